"""examples/gpu_check.py, the one-command GPU check of the graph-ready runtime, runs on the CPU at tiny sizes.

The same functions the GPU run calls (random-weight targets built from configs, drafters through the project's
loader, the oracle drafter, every comparison, the re-capture paths, the compaction boundary) run here eagerly, so
the command cannot rot between the rare GPU runs. A failing sub-check is recorded and the run goes on (exit 1).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from test_plugin_support import load_cpu_library

from tensorrt_llm_dflash import fused_tree
from tensorrt_llm_dflash.decode import GenerationResult, GenerationStats

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "gpu_check.py"


def load_gpu_check() -> ModuleType:
    """A fresh module of examples/gpu_check.py, registered in sys.modules (its dataclasses need their module there)."""
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _checks(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def test_the_tiny_check_passes_on_the_cpu_and_records_every_figure(tmp_path, capsys):
    """The default run at tiny sizes: both targets (Llama-shaped; Qwen3 with sliding-window layers) in float32 and
    bfloat16. In float32 every method's graphed output equals the eager twin's, the eager runtime's and the eager AR
    output; every check passes in both dtypes (bf16 equalities are reported, not required)."""
    load_cpu_library()  # the fused tree build's checks run on the CPU library
    module = load_gpu_check()
    assert module.main(["--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] and report["complete"] and report["failed"] == [] and report["tiny"]
    assert report["dtypes"] == ["float32", "bfloat16"]
    checks = _checks(report)
    assert all(c["status"] == "ok" for name, c in checks.items() if not name.startswith("plugins/"))
    for target in ("smollm2-135m-tiny", "qwen3-swa-tiny"):
        for dtype in ("float32", "bfloat16"):
            tag = f"{target}/{dtype}"
            assert checks[f"{tag}/setup"]["figures"]["mixed_layers"] == (target == "qwen3-swa-tiny")
            for method in module.DEFAULT_METHODS:
                assert set(checks[f"{tag}/{method}/graphed"]["figures"]["stage_ms_per_step"]) == {
                    "draft", "tree_build", "tree_compile", "verify", "commit"}
                sizes = checks[f"{tag}/{method}/capture"]["figures"]["sizes"]
                assert all(f"{tag}/{method}/stage-ms@{n}" in checks for n in sizes)
            assert checks[f"{tag}/auto/capture"]["figures"]["sizes"] == list(module.TINY_BUCKETS)
            grown = checks[f"{tag}/recapture-longer-prompt"]["figures"]["capacity"]
            assert grown[1] > grown[0]
            for kind in ("drafter", "oracle"):
                boundary = checks[f"{tag}/compaction-boundary-{kind}"]["figures"]
                assert boundary["prompt"] + boundary["new"] + module.BOUNDARY_BUDGET + 2 == 256
        tag = f"{target}/float32"
        for method in module.DEFAULT_METHODS:
            assert checks[f"{tag}/{method}/graphed"]["figures"]["equal_eager_ar"] is True
            twin = checks[f"{tag}/{method}/vs-eager-stages"]["figures"]
            assert twin["equal_eager_stages_0"] is True and twin["equal_eager_stages_1"] is True
        for method in ("ar", "chain", "ddtree:32"):
            assert checks[f"{tag}/{method}/vs-eager-runtime"]["figures"]["equal_eager_runtime"] is True
        assert checks[f"{tag}/oracle-ddtree:32/graphed"]["figures"]["tau"] > 2  # long accepted paths were compacted
        assert checks[f"{tag}/recapture-longer-prompt"]["figures"]["equal_eager_ar"] is True
        assert checks[f"{tag}/sampled-vs-eager-stages"]["figures"]["equal_eager_stages_T0.8"] is True
        assert checks[f"{tag}/recapture-temperature"]["figures"]["equal_ar_T0.8"] is True  # AR's own sample
        assert all(checks[f"{tag}/compaction-boundary-{kind}"]["figures"]["equal_eager_ar"] is True
                   and checks[f"{tag}/compaction-boundary-{kind}"]["figures"]["equal_eager_stages"] is True
                   for kind in ("drafter", "oracle"))
        for method in ("ar", "ddtree:32", "auto"):  # four rows of one decoder, each equal to its solo run
            batch = checks[f"{tag}/batch{module.BATCH_ROWS}-{method}"]["figures"]
            assert batch["equal_solo"] == batch["rows"] == 4 and batch["equal_eager_stages"] is True
            assert batch["tokens"] == 4 * report["max_new_tokens"]
    assert checks["shipped-drafter"]["figures"]["target_layer_ids"] == [1, 8, 14, 20, 27]
    assert checks["plugins/cmake"]["status"] == "skip" and "CUDA device" in checks["plugins/cmake"]["error"]
    fused = checks["fused-tree/equal"]["figures"]
    assert fused["backend"] == "cpu-library" and fused["trees"] == 16 * (1 + 4 + 16) and fused["nodes"] > fused["trees"]
    assert fused["accepted_paths"] > 100 and fused["lookup_branches"] > 50  # real paths walked, branches grafted
    assert set(checks["fused-tree/ms"]["figures"]) == {"fused_ms@1", "ops_ms@1", "fused_ms@16", "ops_ms@16"}
    decoder = checks["fused-tree/decoder"]["figures"]
    assert decoder["equal_tensor_ops_0"] is True and decoder["equal_tensor_ops_1"] is True
    assert decoder["tree_build_ms_on"] > 0 and decoder["tree_build_ms_off"] > 0
    assert decoder["commit_ms_on"] > 0 and decoder["commit_ms_off"] > 0
    out = capsys.readouterr().out
    assert "ok   smollm2-135m-tiny/float32/ar/graphed tok_per_s: " in out  # one summary line per figure
    assert out.rstrip().splitlines()[-1].startswith("gpu_check: ") and " 0 failed" in out


def test_the_fused_checks_run_where_the_kernels_are_opt_in(tmp_path, monkeypatch):
    """On a GPU the fused kernels are opt-in (``auto`` runs the tensor ops there), so every ``fused=True`` call of the
    fused-tree checks must run under their own ``on``. The CPU's ``auto`` would hide a call that does not: here the
    checks run with ``DFLASH_FUSED_TREE=off`` around them, as a GPU's ``auto``, and must pass all the same."""
    load_cpu_library()
    module = load_gpu_check()
    monkeypatch.setenv(fused_tree.FUSED_TREE_ENV, "off")
    args = module.parse_args(["--tiny", "--device", "cpu", "--out", str(tmp_path)])
    report = module.Report(tmp_path / "fused.json", {})
    module.check_fused_tree(report, torch.device("cpu"), args, None, tmp_path)
    checks = _checks(json.loads((tmp_path / "fused.json").read_text()))
    assert [checks[name]["status"] for name in ("fused-tree/equal", "fused-tree/ms", "fused-tree/decoder")] == \
        ["ok"] * 3, {name: c.get("error") for name, c in checks.items()}
    equal = checks["fused-tree/equal"]["figures"]
    assert equal["selected_nodes"] > 200 and equal["learned_trials"] > 50  # selects and learning compared
    assert fused_tree.mode() == "off"  # the checks' own modes were undone


def test_a_failing_check_is_recorded_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """bfloat16, AR only: an exception in one sub-check fails it (JSON and summary), the later checks still run,
    and the exit code is 1."""
    module = load_gpu_check()

    def broken(self, size: int, repeats: int = 5) -> dict[str, float]:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(module.GraphedDecoder, "time_stages", broken)
    json_path = tmp_path / "elsewhere" / "check.json"
    argv = ["--tiny", "--device", "cpu", "--targets", "smollm2-135m-tiny", "--dtypes", "bfloat16", "--methods", "ar",
            "--plugins", "off", "--out", str(tmp_path / "out"), "--json", str(json_path)]
    assert module.main(argv) == 1
    report = json.loads(json_path.read_text())
    assert report["failed"] == ["smollm2-135m-tiny/bfloat16/ar/stage-ms@1"] and not report["ok"]
    checks = _checks(report)
    failed = checks["smollm2-135m-tiny/bfloat16/ar/stage-ms@1"]
    assert failed["status"] == "FAIL" and failed["error"] == "RuntimeError: injected failure"
    assert "injected failure" in failed["figures"]["traceback"]
    for later in ("ar-graphed-vs-eager", "compaction-boundary-drafter", "compaction-boundary-oracle"):
        assert checks[f"smollm2-135m-tiny/bfloat16/{later}"]["status"] == "ok", later
    assert checks["plugins/cmake"]["error"] == "--plugins off"
    assert checks["fused-tree/decoder"]["status"] == checks["fused-tree/equal"]["status"] == "skip"
    out = capsys.readouterr().out
    assert "FAIL smollm2-135m-tiny/bfloat16/ar/stage-ms@1: RuntimeError: injected failure" in out
    assert "FAILED smollm2-135m-tiny/bfloat16/ar/stage-ms@1" in out


def _result(ids: list[int], lengths: list[int]) -> GenerationResult:
    stats = GenerationStats()
    stats.acceptance_lengths = lengths
    return GenerationResult(output_ids=ids, stats=stats, finish_reason="length")


def test_compare_requires_equality_only_where_exact():
    module = load_gpu_check()
    figures: dict = {}
    module.compare(_result([1, 2, 3], [1, 2]), _result([1, 2, 3], [1, 2]), "x", True, figures)
    assert figures == {"equal_x": True}
    with pytest.raises(module.Mismatch, match="acceptance lengths False"):
        module.compare(_result([1, 2, 3], [1, 2]), _result([1, 2, 3], [2, 1]), "x", True, figures)
    module.compare(_result([1, 2, 4], [1, 2]), _result([1, 2, 3], [1, 2]), "y", False, figures)  # reported only
    assert figures["equal_y"] is False and figures["first_difference_y"] == 2


def test_a_float32_difference_from_ar_passes_only_at_a_near_tie():
    """Against AR the check asks the reference's top-2 logit gap at the first differing token: at most NEAR_TIE_GAP
    (kernels of other shapes rounding differently) is recorded as a near-tie flip; a wider gap is a bug and fails."""
    module = load_gpu_check()
    got, want = _result([1, 2, 4], [1, 1, 1]), _result([1, 2, 3], [1, 1, 1])
    asked: list[int] = []
    figures: dict = {}
    module.compare(got, want, "eager_ar", True, figures, lengths=False,
                   tie_gap=lambda i: asked.append(i) or module.NEAR_TIE_GAP / 10)
    assert asked == [2] and figures["near_tie_eager_ar"] is True and figures["equal_eager_ar"] is False
    assert figures["top2_gap_eager_ar"] == pytest.approx(module.NEAR_TIE_GAP / 10)
    with pytest.raises(module.Mismatch, match="differs from eager_ar"):
        module.compare(got, want, "eager_ar", True, {}, lengths=False, tie_gap=lambda i: 0.5)
    with pytest.raises(module.Mismatch):  # no tie test asked for (graphed against the same stages eagerly): strict
        module.compare(got, want, "eager_stages", True, {})


def test_top2_gap_reads_the_targets_logits_at_the_position():
    from tiny_models import tiny_target

    module = load_gpu_check()
    model = tiny_target("llama", seed=3, dtype=torch.float64)
    prompt, reference = [3, 5, 7], [9, 11, 13]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + reference[:2]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert module.top2_gap(model, prompt, reference, 2) == pytest.approx(float(top[0] - top[1]))


def test_the_oracle_drafts_the_known_continuation_on_the_device():
    """Top-1 at each depth is the stream's next token unless the noise table says a decoy; then the truth is second."""
    module = load_gpu_check()
    stream = list(range(3, 40))
    state = module.OracleDrafter(stream, 5, 64, noise=0.5, seed=1).static_proposer(
        type("M", (), {"device": torch.device("cpu")})(), capacity=32, batch=1)
    logits = state.draft(torch.tensor([stream[10]]), torch.tensor([10]))
    top2 = logits[0].topk(2, dim=-1).indices
    truth = torch.tensor(stream[11:15])
    wrong = state.wrong[10]
    assert torch.equal(torch.where(wrong, top2[:, 1], top2[:, 0]), truth)
    assert wrong.any() and not wrong.all()


@pytest.mark.parametrize("argv,field", [(["--max_new_tokens", "1"], "--max_new_tokens"),
                                        (["--targets", "gpt2"], "--targets"),
                                        (["--methods", "ddtree:7"], "--methods")])
def test_bad_arguments_exit_2_naming_the_field(argv, field, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_gpu_check().parse_args(["--tiny", "--device", "cpu", *argv])
    assert exit_info.value.code == 2 and field in capsys.readouterr().err


@pytest.mark.parametrize("argv,field", [(["--max_new_tokens", "0"], "--max_new_tokens"),
                                        (["--prompt_len", "0"], "--prompt_len"),
                                        (["--repeats", "0"], "--repeats"),
                                        (["--repeats", "-3"], "--repeats"),
                                        (["--threads", "-2"], "--threads"),
                                        (["--device", "tpu"], "--device"),
                                        (["--json", "{dir}"], "--json"),
                                        (["--json", "{file}/x.json"], "--json"),
                                        (["--out", "{file}"], "--out")])
def test_zero_negative_and_misplaced_values_are_refused_not_defaulted(argv, field, tmp_path, capsys):
    """A 0 is refused by its range, never turned into the default; paths that cannot be written are refused before
    any check runs. One line, exit 2."""
    (tmp_path / "a_file").write_text("x")
    argv = [a.format(dir=tmp_path, file=tmp_path / "a_file") for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        load_gpu_check().parse_args(["--tiny", "--device", "cpu", *argv])  # a later --device wins
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"argument {field}: " in err and len(err.strip().splitlines()) == 1, err


def test_the_defaults_apply_only_to_values_not_given():
    args = load_gpu_check().parse_args(["--tiny", "--device", "cpu", "--repeats", "2"])
    assert (args.max_new_tokens, args.prompt_len, args.repeats) == (8, 24, 2)


def _no_target_runs(module, monkeypatch) -> None:
    """The run without its per-target checks (the slow part): the report's framing is what is tested."""
    monkeypatch.setattr(module, "run_target", lambda *args, **kwargs: None)
    monkeypatch.setattr(module, "check_fused_tree", lambda *args, **kwargs: None)


def test_a_run_cut_short_does_not_read_as_a_pass(tmp_path, monkeypatch):
    """The JSON is rewritten after every check; until the last write it says complete false and ok false, so the file
    a run killed mid-way (a GPU run's time limit) leaves behind is no pass, though no check failed."""
    module = load_gpu_check()
    _no_target_runs(module, monkeypatch)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as a time limit's signal ends the run after the checks before it

    monkeypatch.setattr(module, "check_plugins", killed)
    with pytest.raises(KeyboardInterrupt):
        module.main(["--tiny", "--device", "cpu", "--plugins", "off", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [c["name"] for c in report["checks"]] == ["shipped-drafter"] and report["failed"] == []
    assert report["complete"] is False and report["ok"] is False


def test_a_finished_run_is_complete(tmp_path, monkeypatch):
    module = load_gpu_check()
    _no_target_runs(module, monkeypatch)
    assert module.main(["--tiny", "--device", "cpu", "--plugins", "off", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["complete"] is True and report["ok"] is True and report["failed"] == []
