"""examples/batch_invariance.py on tiny float64 model directories: every batched row equals its solo run and AR (the
runtime's float64 guarantee), the logits of a row alone and in a batch agree to rounding, and the counting is right."""

from __future__ import annotations

import json

import torch
from example_cli import load_example
from tiny_dirs import save_tiny_target_dir
from tiny_models import tiny_drafter


def test_the_measurement_runs_and_finds_no_difference_in_float64(tmp_path):
    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.target import load_target

    target_dir = save_tiny_target_dir(tmp_path / "target", arch="qwen3", seed=2, layers=4)
    model, _ = load_target(target_dir, dtype=torch.float32)
    save_dflash_drafter(tiny_drafter(model, block_size=4, seed=2), tmp_path / "drafter", dtype=torch.float32)
    module = load_example("batch_invariance")
    out = tmp_path / "report.json"
    assert module.main(["--target_model_dir", str(target_dir), "--draft_model_dir", str(tmp_path / "drafter"),
                        "--dtypes", "float64", "--methods", "ar", "ddtree:3", "auto", "--num_prompts", "2",
                        "--max_new_tokens", "8", "--batch", "2", "--threads", "1", "--output_json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]["float64"]
    assert results["logits"]["max_abs_logit_difference"] < 1e-9 and results["logits"]["argmax_flips"] == 0
    for method in ("ar", "ddtree:3", "auto"):
        assert results[method]["rows"] == 2
        assert results[method]["batched_differs_from_solo"] == results[method]["batched_differs_from_ar"] == 0


def test_first_difference():
    first_difference = load_example("batch_invariance").first_difference
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
