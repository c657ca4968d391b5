"""examples/bench_serve.py in tiny mode, so that it cannot rot: it starts a server per method on loopback, runs
each concurrency level with streaming clients over HumanEval and chat prompts (the methods taking turns, or one
server at a time), and writes the JSON and the table;
at temperature 0 in float32 the default's answers equal AR's at every concurrency. Also against a running
server (--url), and its flag checks."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from example_cli import EXAMPLES
from serve_support import TinyModels, tiny_server

from tensorrt_llm_dflash.errors import DFlashInputError


@pytest.fixture(scope="module")
def bench():
    # Registered in sys.modules: its dataclasses look their module up there (example_cli's loader does not).
    spec = importlib.util.spec_from_file_location("bench_serve_example", EXAMPLES / "bench_serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from tiny_dirs import save_long_context_pair

    return save_long_context_pair(tmp_path_factory.mktemp("bench_serve"))


def test_the_benchmark_runs_ar_and_the_default_at_two_concurrencies(bench, model_dirs, tmp_path, capsys):
    target_dir, drafter_dir = model_dirs
    out = tmp_path / "serve.json"
    rc = bench.main(["--target_model_dir", str(target_dir), "--draft_model_dir", str(drafter_dir),
                     "--methods", "ar", "default", "--concurrency", "1", "3", "--num_prompts", "2",
                     "--max_tokens", "12", "--threads", "1", "--max_batch_size", "2", "--output_json", str(out)])
    captured = capsys.readouterr()
    printed = captured.out
    assert rc == 0, captured.out + captured.err
    report = json.loads(out.read_text())
    assert [p["dataset"] for p in report["prompts"]] == ["humaneval", "chat", "humaneval", "chat"]
    assert report["problems"] == []
    for method in ("ar", "default"):
        assert set(report["results"][method]["levels"]) == {"1", "3"}
        assert "max_batch_size 2" in report["servers"][method]["ready"]
        for level in report["results"][method]["levels"].values():
            summary = level["summary"]
            assert summary["requests"] == 4 and summary["errors"] == []
            assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in level["requests"]) > 0
            assert summary["total_tokens_per_second"] > 0 and summary["ttft_mean_seconds"] > 0
            assert 0 < summary["server_ttft_mean_seconds"] <= summary["ttft_mean_seconds"]
            assert all(r["text"] and r["finish_reason"] in ("stop", "length") for r in level["requests"])
    for c in ("1", "3"):
        summary = report["results"]["default"]["levels"][c]["summary"]
        assert summary["outputs_equal_ar"] == "4/4" and summary["speedup_vs_ar"] > 0 and summary["tau"] >= 1
    assert "| default | 3 | 4 |" in printed and "| ar | 1 | 4 |" in printed
    # Both servers loaded, the methods taking turns: ar then default at the first level, the other way at the next.
    turns = [line.rstrip(":") for line in printed.splitlines() if line in ("ar:", "default:")]
    assert turns == ["ar", "default", "default", "ar"], printed
    # run.py's runtime on the same prompts, in-process: the speedup concurrency 1 is held against.
    reference = report["runpy_reference"]
    assert reference["ar_method"] == "ar" and "--methods ar default" in reference["command"]  # a CPU's AR
    assert reference["all_outputs_match"] is True and reference["default_resolves_to"]
    assert reference["ar_tokens_per_second"] > 0 and reference["default_tokens_per_second"] > 0
    one = report["results"]["default"]["levels"]["1"]["summary"]
    assert one["speedup_vs_runpy_speedup"] == pytest.approx(one["speedup_vs_ar"] / reference["speedup"])
    assert "run.py's runtime in-process on the same prompts" in printed and "concurrency 1: the server's" in printed


def test_ctrl_c_keeps_the_finished_levels_and_exits_130(bench, model_dirs, tmp_path, capsys, monkeypatch):
    """Ctrl-C during the second level: the first level (both methods ran it) is written, marked interrupted, exit 130,
    and both servers are stopped (it once died with a traceback and wrote nothing)."""
    target_dir, drafter_dir = model_dirs
    out = tmp_path / "serve.json"
    real_run_once, calls, started = bench.run_once, [], []
    real_init = bench.ServerProcess.__init__

    def counting_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        started.append(self)

    def run_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the first run of the second level
            raise KeyboardInterrupt
        return real_run_once(*args, **kwargs)

    monkeypatch.setattr(bench, "run_once", run_once)
    monkeypatch.setattr(bench.ServerProcess, "__init__", counting_init)
    rc = bench.main(["--target_model_dir", str(target_dir), "--draft_model_dir", str(drafter_dir),
                     "--methods", "ar", "default", "--concurrency", "1", "2", "--num_prompts", "1",
                     "--max_tokens", "8", "--threads", "1", "--max_batch_size", "2", "--no_runpy_reference",
                     "--output_json", str(out)])
    assert rc == 130
    report = json.loads(out.read_text())
    assert report["interrupted"] is True
    assert {method: set(r["levels"]) for method, r in report["results"].items()} == {"ar": {"1"}, "default": {"1"}}
    assert "wrote the finished concurrency levels 1" in capsys.readouterr().err
    assert len(started) == 2 and all(server.process.poll() is not None for server in started)


def test_one_server_at_a_time_and_repeats(bench, model_dirs, tmp_path, capsys):
    """``--one_server_at_a_time`` (models that do not fit twice): each server runs all its levels, then stops.
    ``--repeats 2``: each level runs twice per method; its figures are over both runs (all tokens over all wall time),
    each run's tok/s beside. (Interleaved, the turns of every run follow ``level_order``.)"""
    target_dir, drafter_dir = model_dirs
    out = tmp_path / "serve.json"
    rc = bench.main(["--target_model_dir", str(target_dir), "--draft_model_dir", str(drafter_dir),
                     "--methods", "ar", "default", "--concurrency", "1", "2", "--num_prompts", "1", "--repeats", "2",
                     "--max_tokens", "6", "--threads", "1", "--no_runpy_reference", "--one_server_at_a_time",
                     "--output_json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads(out.read_text())
    assert report["problems"] == [] and set(report["results"]) == {"ar", "default"}
    turns = [line.rstrip(":") for line in printed.splitlines() if line in ("ar:", "default:")]
    assert turns == ["ar", "default"], printed
    for method in ("ar", "default"):
        assert set(report["results"][method]["levels"]) == {"1", "2"}
        level = report["results"][method]["levels"]["2"]
        summary = level["summary"]
        assert summary["requests"] == 4 and [r["prompt"] for r in level["requests"]] == [0, 0, 1, 1]
        runs = summary["runs_tokens_per_second"]
        assert len(runs) == 2 and min(runs) <= summary["total_tokens_per_second"] <= max(runs)
    default = report["results"]["default"]["levels"]["2"]["summary"]
    assert default["outputs_equal_ar"] == "4/4"
    # Each repeat's speedup over AR's run of the same repeat, and how far each method's runs lie apart.
    ar = report["results"]["ar"]["levels"]["2"]["summary"]
    assert default["paired_speedups_vs_ar"] == pytest.approx(
        [mine / theirs for mine, theirs in zip(default["runs_tokens_per_second"], ar["runs_tokens_per_second"])])
    assert "paired_speedups_vs_ar" not in ar
    for summary in (ar, default):
        runs = summary["runs_tokens_per_second"]
        assert summary["runs_spread"] == pytest.approx(max(runs) / min(runs) - 1.0)
    paired = default["paired_speedups_vs_ar"]
    assert f"| {100 * default['runs_spread']:.1f}% | {default['speedup_vs_ar']:.2f} | " \
           f"{min(paired):.2f}-{max(paired):.2f} |" in printed, printed


def test_paired_speedups_need_the_same_repeats_of_both(bench):
    """A repeat's speedup is over AR's run of the same repeat: none without repeats of both, or with a different
    count (a level cut short), or an AR run that made nothing; a level's runs lie ``max / min - 1`` apart."""
    assert bench.paired_speedups({"runs_tokens_per_second": [12.0, 9.0]},
                                 {"runs_tokens_per_second": [10.0, 10.0]}) == pytest.approx([1.2, 0.9])
    assert bench.paired_speedups({"runs_tokens_per_second": [12.0]}, {"runs_tokens_per_second": [10.0, 10.0]}) is None
    assert bench.paired_speedups({"total_tokens_per_second": 12.0}, {"runs_tokens_per_second": [10.0]}) is None
    assert bench.paired_speedups({"runs_tokens_per_second": [1.0]}, {"runs_tokens_per_second": [0.0]}) is None
    assert bench.runs_spread({"runs_tokens_per_second": [8.0, 10.0, 9.0]}) == pytest.approx(0.25)
    assert bench.runs_spread({"total_tokens_per_second": 9.0}) is None


def test_level_order_alternates(bench):
    assert [bench.level_order(["a", "b", "c"], i) for i in range(3)] == [["a", "b", "c"], ["c", "b", "a"],
                                                                        ["a", "b", "c"]]


def test_the_benchmark_measures_a_running_server(bench, tmp_path, capsys):
    live = tiny_server(TinyModels(), rows=2)
    try:
        out = tmp_path / "url.json"
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(3)))
        rc = bench.main(["--url", live.url, "--methods", "tiny", "--datasets", str(prompts), "--concurrency", "2",
                         "--max_tokens", "6", "--no_warmup", "--output_json", str(out)])
        assert rc == 0, capsys.readouterr()
        report = json.loads(out.read_text())
        assert "runpy_reference" not in report  # a server started elsewhere: its settings are not known here
        level = report["results"]["tiny"]["levels"]["2"]
        assert level["summary"]["requests"] == 3 and level["summary"]["completion_tokens"] == 18
    finally:
        live.close()


@pytest.mark.parametrize("argv, says", [
    (["--methods", "ddtree:0"], "argument --methods: method 'ddtree:0' is not one of"),
    (["--concurrency", "0"], "argument --concurrency: must be an integer in 1..1024, got 0"),
    (["--methods", "ar", "ar"], "argument --methods: names a method twice"),
    (["--url", "localhost:8000", "--methods", "x"], "argument --url: must be http://host:port"),
    (["--url", "http://127.0.0.1:1", "--methods", "a", "b"], "argument --methods: with --url, give one name"),
])
def test_bad_flags_are_refused(bench, argv, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_method_flags(bench):
    """Each method name starts the server with its flags (the size-choice A/B included); an unknown one is refused."""
    assert bench.method_flags("ar") == ["--speculative_decoding_mode", "none"]
    assert bench.method_flags("default") == []
    assert bench.method_flags("ddtree:5") == ["--ddtree_budget", "5"]
    assert bench.method_flags("auto-ahead") == ["--size_choice", "ahead"]
    assert bench.method_flags("auto-in-step") == ["--size_choice", "in_step"]
    with pytest.raises(DFlashInputError, match="auto-in-step"):
        bench.method_flags("auto-later")


def test_the_runpy_reference_decodes_plain_ar_as_the_servers_device_runs_it(bench, monkeypatch):
    """On CUDA the server's AR is the graphed runtime's, and so is the AR run.py's speedup is measured against there
    (the eager runtime's AR is several times slower on a GPU); on a CPU, the eager runtime's AR (the faster there)."""
    assert bench.reference_ar_method("cuda") == "ar-graph" and bench.reference_ar_method("cuda:1") == "ar-graph"
    assert bench.reference_ar_method("cpu") == "ar"
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert bench.reference_ar_method(None) == "ar-graph"  # the servers' own default device
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert bench.reference_ar_method(None) == "ar"


def test_relative_paths_are_made_absolute_for_the_servers_started_in_the_checkout(bench, tmp_path, monkeypatch):
    """The servers and the run.py reference run with the checkout as their directory: every path the user typed
    relative to theirs reaches them absolute; the built-in prompt sets keep their names."""
    for name in ("target", "drafter"):
        (tmp_path / name).mkdir()
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    monkeypatch.chdir(tmp_path)
    args = bench.parse_args(["--target_model_dir", "target", "--draft_model_dir", "drafter",
                             "--datasets", "humaneval", "prompts.jsonl", "chat", "--output_json", "out.json"])
    assert args.target_model_dir == str(tmp_path / "target") and args.draft_model_dir == str(tmp_path / "drafter")
    assert args.datasets == ["humaneval", str(tmp_path / "prompts.jsonl"), "chat"]
    assert args.output_json == str(tmp_path / "out.json")
    flags = bench.server_flags(args, "default")
    assert flags[flags.index("--target_model_dir") + 1] == str(tmp_path / "target")
    assert flags[flags.index("--draft_model_dir") + 1] == str(tmp_path / "drafter")
