"""DFlash / DDTree through a real TensorRT-LLM 1.2.1 engine == the PyTorch runtime.

Needs TensorRT-LLM 1.2.1, a CUDA GPU and the plugin library (``scripts/verify_trtllm_gpu.sh``
does all of it); skipped otherwise, with the reason shown (``pytest -rs``). For tiny fp32
Qwen3 and Llama targets with a tiny drafter it converts, builds with the project's
``trtllm-build`` entry point, and checks that the chain and DDTree give exactly the
PyTorch runtime's tokens and the same acceptance length at every step (T = 0).
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

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_VERSION = "1.2.1"


def _skip_reason() -> str | None:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return f"tensorrt_llm {REQUIRED_VERSION} and a CUDA GPU are required (tensorrt_llm is not installed)"
    if not torch.cuda.is_available():
        return f"tensorrt_llm {REQUIRED_VERSION} and a CUDA GPU are required (no CUDA GPU)"
    from importlib.metadata import version

    found = version("tensorrt_llm")
    if found != REQUIRED_VERSION:
        return f"tensorrt_llm {REQUIRED_VERSION} is required, found {found}"
    from tensorrt_llm_dflash.trtllm.plugins import plugin_library_candidates

    if not any(p.is_file() for p in plugin_library_candidates()):
        return "libdflash_trt_plugins.so is not built (cmake -S plugins -B plugins/build && cmake --build plugins/build)"
    return None


pytestmark = [pytest.mark.trtllm, pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")]

PROMPTS = [[3, 17, 5, 9, 30, 2, 11], [40, 41, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
MAX_NEW = 24
MAX_DRAFT_LEN = 8
BUDGETS = [0, 4, MAX_DRAFT_LEN]  # 0 = the DFlash chain


def _models(arch: str):
    sys.path.insert(0, str(ROOT / "tests"))
    from test_trtllm_convert import make_drafter, make_target

    target = make_target(arch, vocab=64, kv_heads=2)
    drafter = make_drafter(target, layers=2, block_size=4)
    return target, drafter


def _build_engine(tmp: Path, arch: str, tp: int = 1) -> tuple[Path, object, object]:
    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.trtllm.weight import convert_checkpoint

    target, drafter = _models(arch)
    target.save_pretrained(tmp / "target", safe_serialization=True)
    save_dflash_drafter(drafter, tmp / "drafter", dtype=torch.float32)
    convert_checkpoint(tmp / "target", tmp / "drafter", tmp / "ckpt", dtype="float32", tp_size=tp, progress=False)
    cmd = [sys.executable, "-m", "tensorrt_llm_dflash.trtllm.build", "--checkpoint_dir", str(tmp / "ckpt"),
           "--output_dir", str(tmp / "engine"), "--speculative_decoding_mode", "dflash",
           "--max_draft_len", str(MAX_DRAFT_LEN), "--max_batch_size", "1", "--max_input_len", "32",
           "--max_seq_len", "96", "--kv_cache_type", "continuous", "--remove_input_padding", "enable",
           "--gpt_attention_plugin", "float32", "--gemm_plugin", "disable", "--workers", str(tp)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return tmp / "engine", target, drafter


def _pytorch_run(target, drafter, prompt, budget):
    from tensorrt_llm_dflash.decode import speculative_generate
    from tensorrt_llm_dflash.proposer import DFlashProposer
    from tensorrt_llm_dflash.target import HFTargetVerifier

    verifier = HFTargetVerifier(target, drafter.config.target_layer_ids)
    proposer = DFlashProposer.for_target(drafter, target)
    return speculative_generate(verifier, proposer, prompt, MAX_NEW, ddtree_budget=budget)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_matches_pytorch_runtime(tmp_path, arch):
    from tensorrt_llm_dflash.decode import speculative_generate
    from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget, EngineProposer

    engine_dir, target, drafter = _build_engine(tmp_path, arch)
    engine = DFlashEngineTarget(engine_dir)
    proposer = EngineProposer(engine)
    for prompt in PROMPTS:
        for budget in BUDGETS:
            expected = _pytorch_run(target, drafter, prompt, budget)
            got = speculative_generate(engine, proposer, prompt, MAX_NEW, ddtree_budget=budget)
            assert got.output_ids == expected.output_ids, (arch, prompt, budget)
            assert got.stats.acceptance_lengths == expected.stats.acceptance_lengths, (arch, prompt, budget)
            assert engine.mismatched_drafts == 0  # the in-graph walk agreed with the host's every step


@pytest.mark.skipif(_skip_reason() is not None or torch.cuda.device_count() < 2 or shutil.which("mpirun") is None,
                    reason=_skip_reason() or "tensor parallelism needs 2 CUDA GPUs and mpirun")
def test_engine_tp2_matches_pytorch_runtime(tmp_path):
    engine_dir, target, drafter = _build_engine(tmp_path, "qwen3", tp=2)
    out = tmp_path / "tp2.json"
    driver = "\n".join([
        f"import json, sys; sys.path.insert(0, {str(ROOT)!r})",
        "from tensorrt_llm._utils import mpi_rank",
        "from tensorrt_llm_dflash.decode import speculative_generate",
        "from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget, EngineProposer",
        f"engine = DFlashEngineTarget({str(engine_dir)!r}, rank=mpi_rank())",
        f"runs = [speculative_generate(engine, EngineProposer(engine), p, {MAX_NEW}, ddtree_budget=b)"
        f" for p in {PROMPTS!r} for b in {BUDGETS!r}]",
        "if mpi_rank() == 0:",
        f"    json.dump([[r.output_ids, r.stats.acceptance_lengths] for r in runs], open({str(out)!r}, 'w'))",
    ]) + "\n"
    result = subprocess.run(["mpirun", "-n", "2", "--allow-run-as-root", sys.executable, "-c", driver],
                            capture_output=True, text=True, timeout=1800, env={**os.environ})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    got = json.loads(out.read_text())
    expected = [_pytorch_run(target, drafter, p, b) for p in PROMPTS for b in BUDGETS]
    assert got == [[r.output_ids, r.stats.acceptance_lengths] for r in expected]
