"""examples/run.py's runtime choice: graphed on CUDA by default (it ran the cost-aware tree 3.1x faster than the eager
runtime on an H100, BENCHMARKS.md "On a GPU"), eager on the CPU; with no --ddtree_budget the graphed runtime runs the
cost-aware tree on the device, and its output is the target's own greedy output."""

from __future__ import annotations

import json

import pytest
import torch
from example_cli import load_example
from tiny_dirs import save_tiny_target_dir
from tiny_models import tiny_drafter

from tensorrt_llm_dflash.device_policy import CPU_POLICY_BUCKETS, POLICY_BUCKETS


@pytest.fixture(scope="module")
def run():
    return load_example("run")


def test_the_runtime_default_follows_the_device(run, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert run.parse_args([]).runtime == "graphed"  # no --device: CUDA when torch sees it
    assert run.parse_args(["--device", "cuda"]).runtime == "graphed"
    assert run.parse_args(["--device", "cpu"]).runtime == "eager"
    assert run.parse_args(["--device", "cuda", "--runtime", "eager"]).runtime == "eager"
    assert run.parse_args(["--device", "cuda", "--recalibrate"]).runtime == "eager"  # only the eager runtime keeps one
    assert run.parse_args(["--device", "cuda", "--draft_type", "lora_inject"]).runtime == "eager"
    assert run.parse_args(["--device", "cuda"]).runtime_given is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.parse_args([]).runtime == "eager"


def test_graphed_refuses_recalibrate_by_name(run, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run.parse_args(["--runtime", "graphed", "--recalibrate"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--recalibrate" in err and "graphed" in err


def test_max_tree_nodes_bounds_the_graphed_sizes(run):
    assert run.graphed_policy_buckets(None, "cuda") == POLICY_BUCKETS
    assert run.graphed_policy_buckets(None, "cpu") == CPU_POLICY_BUCKETS
    assert run.graphed_policy_buckets(16, "cuda") == tuple(b for b in POLICY_BUCKETS if b <= 16)
    assert run.graphed_policy_buckets(16, "cpu") == (1, 2, 4, 8, 15)
    assert run.graphed_policy_buckets(1, "cpu") == (1, 2)  # at least one drafted size
    assert run.parse_args(["--runtime", "graphed", "--max_tree_nodes", "16"]).max_tree_nodes == 16


def test_graphed_cost_aware_run_equals_the_targets_greedy_output(run, tmp_path, capsys):
    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.target import load_target

    target_dir = save_tiny_target_dir(tmp_path / "target", arch="llama", seed=5, layers=2, dtype=torch.float64)
    model, _ = load_target(target_dir, dtype=torch.float64)
    save_dflash_drafter(tiny_drafter(model, block_size=6, seed=1, layers=1), tmp_path / "drafter",
                        dtype=torch.float64)
    docs = {}
    for name, extra in (("graphed", ["--runtime", "graphed", "--draft_model_dir", str(tmp_path / "drafter")]),
                        ("graphed4", ["--runtime", "graphed", "--max_tree_nodes", "4", "--no_lookup",
                                       "--draft_model_dir", str(tmp_path / "drafter")]),
                        ("ar", ["--speculative_decoding_mode", "none"])):
        out = tmp_path / f"{name}.json"
        argv = ["--target_model_dir", str(target_dir), "--dtype", "float64", "--max_output_len", "20", "--threads",
                "1", "--output_json", str(out), "--input_text", "abc abc abc ab", "hello there", *extra]
        assert run.main(argv) == 0, capsys.readouterr().err
        docs[name] = json.loads(out.read_text())
    printed = capsys.readouterr().out
    ids = {name: [o["output_ids"] for o in doc["outputs"]] for name, doc in docs.items()}
    assert ids["graphed"] == ids["graphed4"] == ids["ar"]
    assert docs["graphed"]["mode"] == "cost-aware DDTree (<= 63 nodes, lookup branches), graphed runtime"
    assert docs["graphed4"]["mode"] == "cost-aware DDTree (<= 3 nodes), graphed runtime"
    sizes = [s for o in docs["graphed4"]["outputs"] for s in o["stats"]["tree_sizes"]]
    assert max(sizes) <= 4
    assert "drafted on" in printed
