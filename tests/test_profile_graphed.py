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
