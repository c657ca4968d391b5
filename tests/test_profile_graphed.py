"""examples/profile_graphed.py: the GPU profile of the graph-ready runtime runs on the CPU too (eager stages)."""

from __future__ import annotations

import json

import pytest
from example_cli import load_example


@pytest.mark.parametrize("argv,field", [(["--methods", "ddtree-graph:0"], "--methods"),
                                        (["--methods", "fast"], "--methods"),
                                        (["--max_new_tokens", "0"], "--max_new_tokens")])
def test_bad_arguments_exit_2_naming_the_field(argv, field, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_example("profile_graphed").parse_args(argv)
    assert exit_info.value.code == 2 and field in capsys.readouterr().err


def test_the_profile_runs_on_the_cpu_and_writes_its_report(tmp_path):
    """The embedded target and the shipped drafter, 6 tokens: every method's output equals graphed AR's."""
    module = load_example("profile_graphed")
    assert module.main(["--max_new_tokens", "6", "--methods", "ar-graph", "dflash-graph", "auto-graph",
                        "--output_dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "profile.json").read_text())
    entry = report["dtypes"]["float32"]
    assert [row["method"] for row in entry["methods"]] == ["ar-graph", "dflash-graph", "auto-graph"]
    assert all(row["equals_ar"] for row in entry["methods"])
    assert all(set(row["stage_ms_per_step"]) == {"draft", "tree_build", "tree_compile", "verify", "commit"} for row in entry["methods"])
    assert entry["compaction"]["eager_ms"] > 0 and "graphed_ms" not in entry["compaction"]  # no CUDA graph on a CPU


def test_batch_costs_time_every_size_at_every_batch_in_ar_steps(tmp_path):
    """--batch_costs: per batch size, every tree size's step per stage, its cost in AR steps of that batch (AR itself
    exactly 1), and the tokens per step the fixed-size methods committed at batch 1 (AR exactly 1)."""
    module = load_example("profile_graphed")
    assert module.main(["--max_new_tokens", "4", "--methods", "ar-graph", "ddtree-graph:1", "--batch_costs", "4", "1", "3",
                        "--output_dir", str(tmp_path)]) == 0
    costs = json.loads((tmp_path / "profile.json").read_text())["dtypes"]["float32"]["batch_costs"]
    assert list(costs["batches"]) == ["1", "3", "4"] and costs["batches"]["3"]["bucket"] == 4  # rows round up
    for at in costs["batches"].values():
        assert list(at["sizes"]) == [str(s) for s in costs["sizes"]] and costs["sizes"][0] == 1
        ar = at["sizes"]["1"]
        assert ar["break_even"] == 1.0 and ar["accepted_batch1"] == 1.0 and "draft" not in ar["stage_ms"]
        two = at["sizes"]["2"]
        assert set(two["stage_ms"]) >= {"draft", "verify", "commit"} and two["ms"] > 0
        assert two["break_even"] == two["ms"] / ar["ms"] and 1.0 <= two["accepted_batch1"] <= 2.0
        assert at["sizes"]["4"]["accepted_batch1"] is None  # no fixed 4-node method ran


def test_batch_costs_refuse_a_batch_below_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_example("profile_graphed").parse_args(["--batch_costs", "1", "0"])
    assert exit_info.value.code == 2 and "--batch_costs" in capsys.readouterr().err


def test_tau_excludes_the_prefill_token_as_the_benchmarks_do():
    """tau is tokens committed per decode step, the prefill's token not counted (bench.py's tau_mean, bench_serve's
    tau): AR's is exactly 1, not 8 tokens / 7 steps."""
    import torch
    from tiny_models import tiny_target

    module = load_example("profile_graphed")
    model = tiny_target("qwen3", seed=1, dtype=torch.float32)
    row = module.profile_method(model, None, "ar-graph", [3, 5, 7, 9], 8)
    assert row["steps"] == 7 and len(row["output_ids"]) == 8
    assert row["tau"] == row["accepted_per_step"] == 1.0
