"""The embedded SmolLM2-135M-Instruct target, end to end through examples/run.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensorrt_llm_dflash.compat import chat_token_ids

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a Python function that adds two numbers."

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from tensorrt_llm_dflash.target import load_target

    try:
        return load_target(None)
    except Exception as err:  # noqa: BLE001 - report the reason, the setup script installs it
        pytest.fail(f"embedded target unavailable: {err}")


def run_cli(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(ROOT / "examples" / "run.py"), "--backend", "pytorch", "--input_text", PROMPT,
           "--max_output_len", "32", "--output_json", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def hf_greedy(smollm2, n: int) -> list[int]:
    model, tok = smollm2
    ids = torch.tensor([chat_token_ids(tok, [{"role": "user", "content": PROMPT}])])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_run_none_matches_hf_generate(smollm2, tmp_path):
    result = run_cli(tmp_path, "--speculative_decoding_mode", "none")
    ours = result["outputs"][0]["output_ids"]
    assert ours == hf_greedy(smollm2, 32)
    stats = result["outputs"][0]["stats"]
    assert set(stats) >= {"steps", "acceptance_lengths", "mean_acceptance_length", "stage_seconds", "tokens_per_second"}
    assert stats["acceptance_lengths"] == [1] * stats["steps"]


def test_run_dflash_demo_drafter_is_lossless(smollm2, tmp_path):
    from tensorrt_llm_dflash.assets import demo_drafter_dir

    if demo_drafter_dir() is None:
        pytest.fail("the demo drafter is missing from tensorrt_llm_dflash/assets")
    reference = hf_greedy(smollm2, 32)
    for budget in ("0", "16"):
        result = run_cli(tmp_path, "--speculative_decoding_mode", "dflash", "--ddtree_budget", budget)
        out = result["outputs"][0]
        assert out["output_ids"] == reference, f"budget {budget}"
        assert out["stats"]["steps"] < 32  # something was accepted


def test_run_rejects_bad_budget_before_loading():
    for budget in ("-3", "5000"):
        cmd = [sys.executable, str(ROOT / "examples" / "run.py"), "--ddtree_budget", budget,
               "--input_text", "hi", "--max_output_len", "2"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        assert f"argument --ddtree_budget: must be an integer in 0..1023, got {budget}" in proc.stderr
