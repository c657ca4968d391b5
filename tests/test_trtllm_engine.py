"""DFlash / DDTree through a real TensorRT-LLM 1.2.1 engine on a CUDA GPU.

Needs TensorRT-LLM 1.2.1, a CUDA GPU and the plugin library (``scripts/verify_trtllm_gpu.sh``
does all of it); skipped otherwise, with the reason shown (``pytest -rs``). The same engines
as the CPU stand-in tests (tests/engine_case.py: a bf16 Qwen3 and an fp16 Llama target,
head size 64, ``max_draft_len`` 40) are converted, built with the project's build entry
point and decoded with ``decode.speculative_generate``.

What a real engine is held to (docs/trtllm_engine.md, "Exactness"): in bf16/fp16 an N-token
verify rounds differently from a 1-token step, so the contract is the bf16 rule, not bit
equality with the float64 PyTorch runtime:

* the speculative output equals the same engine's one-token-per-step greedy output, except
  that the first difference, if any, is at a near-tie of that greedy step;
* the engine's greedy output equals the float64 target's greedy output under the same rule
  (the engine computes the right model, not merely a self-consistent one);
* at every step, the in-graph greedy walk takes the host walk's path and bonus token.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_case import (
    BF16_TIE_GAP,
    MAX_DRAFT_LEN,
    MAX_NEW,
    PROMPTS,
    assert_bf16_rule,
    build_argv,
    check_engine_bf16,
    target_greedy_with_gaps,
    write_checkpoint,
)

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_VERSION = "1.2.1"
BUDGETS = [0, 1, 8, MAX_DRAFT_LEN]  # 0 = the DFlash chain


def _skip_reason() -> str | None:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return f"tensorrt_llm {REQUIRED_VERSION} and a CUDA GPU are required (tensorrt_llm is not installed)"
    if not torch.cuda.is_available():
        return f"tensorrt_llm {REQUIRED_VERSION} and a CUDA GPU are required (no CUDA GPU)"
    from importlib.metadata import version

    found = version("tensorrt_llm")
    if found != REQUIRED_VERSION:
        return f"tensorrt_llm {REQUIRED_VERSION} is required, found {found}"
    if (ROOT / "tests" / "trtllm_standin").as_posix() in (importlib.util.find_spec("tensorrt_llm").origin or ""):
        return "tensorrt_llm resolves to the test stand-in, not the real package"
    from tensorrt_llm_dflash.trtllm.plugins import plugin_library_candidates

    if not any(p.is_file() for p in plugin_library_candidates()):
        return "libdflash_trt_plugins.so is not built (cmake -S plugins -B plugins/build && cmake --build plugins/build)"
    return None


pytestmark = [pytest.mark.trtllm, pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")]


def _build(tmp: Path, arch: str, tp: int = 1):
    target, drafter, ckpt = write_checkpoint(tmp, arch, tp=tp)
    engine = tmp / "engine"
    cmd = [sys.executable, "-m", "tensorrt_llm_dflash.trtllm.build", *build_argv(ckpt, engine, workers=tp)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return engine, target


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_obeys_the_bf16_rule_and_the_host_walk(tmp_path, arch):
    from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget

    engine_dir, target = _build(tmp_path, arch)
    check_engine_bf16(DFlashEngineTarget(engine_dir), target, BUDGETS)


def test_engine_prefill_logits_are_the_targets(tmp_path):
    """The last prompt position's logits, engine vs the float64 target, within bf16 rounding
    of logits of size O(10) through 4 layers (the tie gap is the same scale)."""
    from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget

    engine_dir, target = _build(tmp_path, "qwen3")
    engine = DFlashEngineTarget(engine_dir)
    for prompt in PROMPTS:
        got = engine.prefill(prompt)[0].double().cpu()
        with torch.no_grad():
            expected = target(torch.tensor([prompt])).logits[0, -1]
        assert torch.allclose(got, expected, atol=4 * BF16_TIE_GAP, rtol=0.02), (prompt, got, expected)


@pytest.mark.skipif(_skip_reason() is not None or torch.cuda.device_count() < 2 or shutil.which("mpirun") is None,
                    reason=_skip_reason() or "tensor parallelism needs 2 CUDA GPUs and mpirun")
def test_engine_tp2_obeys_the_bf16_rule_and_the_host_walk(tmp_path):
    engine_dir, target = _build(tmp_path, "qwen3", tp=2)
    out = tmp_path / "tp2.json"
    driver = "\n".join([
        f"import json, sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]",
        "from tensorrt_llm._utils import mpi_rank",
        "from tensorrt_llm_dflash.decode import speculative_generate",
        "from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget, EngineProposer",
        "from engine_case import greedy_with_gaps",
        f"engine = DFlashEngineTarget({str(engine_dir)!r}, rank=mpi_rank())",
        "runs = []",
        f"for p in {PROMPTS!r}:",
        "    ar = greedy_with_gaps(engine, p)",
        f"    for b in {BUDGETS!r}:",
        f"        r = speculative_generate(engine, EngineProposer(engine), p, {MAX_NEW}, ddtree_budget=b)",
        "        runs.append([ar, r.output_ids, [list(s) for s in engine.walk_log], engine.mismatched_drafts])",
        "if mpi_rank() == 0:",
        f"    json.dump(runs, open({str(out)!r}, 'w'))",
    ]) + "\n"
    result = subprocess.run(["mpirun", "-n", "2", "--allow-run-as-root", sys.executable, "-c", driver],
                            capture_output=True, text=True, timeout=1800, env={**os.environ})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    runs = json.loads(out.read_text())
    assert len(runs) == len(PROMPTS) * len(BUDGETS)
    for i, (ar, spec, walk_log, mismatched) in enumerate(runs):
        prompt = PROMPTS[i // len(BUDGETS)]
        assert_bf16_rule(ar[0], target_greedy_with_gaps(target, prompt))
        assert_bf16_rule(spec, (ar[0], ar[1]))
        assert walk_log and all(s[:2] == s[2:] for s in walk_log), (prompt, walk_log)
        assert mismatched == 0
