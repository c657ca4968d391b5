"""Example CLIs refuse what they would ignore or crash on: exit status 2 and one line naming the argument.

examples/run.py (engine flags without the trt backend, a budget without a drafter, an output too long for the
target), examples/profile_graphed.py (every flag checked at parse time, a drafter only when one is profiled, targets
without a chat template), examples/compare_runs.py and examples/copy_split.py (files that are not a benchmark's
results, runs with nothing to compare), examples/batch_invariance.py (every flag, a drafter only for the speculative
methods, prompts that do not fit), examples/heldout_tau.py (drafters checked before the data stage, a work dir made
for another target or length) and examples/profile_verify.py (every flag, layers the target does not have).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from example_cli import load_example
from tiny_dirs import save_tiny_target_dir

from tensorrt_llm_dflash import bench, cli

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_DRAFTER_CONFIG = ROOT / "tensorrt_llm_dflash/assets/smollm2-135m-instruct-dflash/config.json"


def _trap(*_args, **_kwargs):
    raise AssertionError("a model load was reached")


@pytest.fixture
def no_model_loads(monkeypatch):
    """Anything that would open a model or tokenizer raises instead."""
    import transformers

    from tensorrt_llm_dflash import drafter, target

    for auto in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer, transformers.AutoConfig):
        monkeypatch.setattr(auto, "from_pretrained", _trap)
    for module, name in ((target, "load_target"), (target, "load_tokenizer"), (drafter, "load_dflash_drafter")):
        monkeypatch.setattr(module, name, _trap)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Existing directories the command lines point at (never loaded by a refused one)."""
    root = tmp_path_factory.mktemp("cli_errors")
    for name in ("engine", "tokenizer", "target"):
        (root / name).mkdir()
    (root / "drafter").mkdir()
    (root / "drafter" / "config.json").write_text(SHIPPED_DRAFTER_CONFIG.read_text())
    (root / "a_file").write_text("x")
    return root


def _one_line_refusal(call, capsys) -> str:
    """Run ``call``; it must exit 2 with exactly one line on stderr, ``PROG: error: ...``, and no traceback.
    Returns the line after ``PROG: error: `` (PROG is the test runner's name in-process)."""
    with pytest.raises(SystemExit) as exit_info:
        call()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert ": error: " in err, err
    return err.strip().split(": error: ", 1)[1]


def _stub_module_loaders(module, monkeypatch) -> None:
    """The names an example imported at its top: trapped too, so a refusal provably comes before them."""
    for name in ("load_target", "load_tokenizer", "load_dflash_drafter"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, _trap)


# ---------------------------------------------------------------------------- examples/run.py


@pytest.mark.parametrize("argv, message", [
    (["--backend", "pytorch", "--engine_dir", "{engine}", "--tokenizer_dir", "{tokenizer}"],
     "argument --engine_dir: applies to --backend trt (a TensorRT-LLM engine)"),
    (["--tokenizer_dir", "{tokenizer}"], "argument --tokenizer_dir: applies to --backend trt (a TensorRT-LLM engine)"),
    (["--speculative_decoding_mode", "none", "--ddtree_budget", "8"],
     "argument --ddtree_budget: needs --speculative_decoding_mode dflash (there is no drafter in 'none')"),
    (["--speculative_decoding_mode", "none", "--draft_model_dir", "{tokenizer}"],
     "argument --draft_model_dir: needs --speculative_decoding_mode dflash (there is no drafter in 'none')"),
])
def test_run_flags_it_would_ignore_are_refused_before_any_load(argv, message, dirs, no_model_loads, capsys,
                                                                monkeypatch):
    run = load_example("run")
    _stub_module_loaders(run, monkeypatch)
    argv = [a.format(engine=dirs / "engine", tokenizer=dirs / "tokenizer") for a in argv]
    line = _one_line_refusal(lambda: run.main(argv), capsys)
    assert line == f"{message} (see --help)"


def test_run_engine_flags_pass_with_the_trt_backend_it_infers(dirs, no_model_loads, monkeypatch, capsys):
    """--engine_dir alone implies --backend trt, where --tokenizer_dir belongs; no --engine_dir means pytorch, where
    --tokenizer_dir is refused (the tensorrt_llm check is stubbed: it is not installed on a CPU machine)."""
    run = load_example("run")
    monkeypatch.setattr(cli, "require_module", lambda *args: None)
    args = run.parse_args(["--engine_dir", str(dirs / "engine"), "--tokenizer_dir", str(dirs / "tokenizer")])
    assert args.backend == "trt" and args.runtime == "eager"
    assert run.parse_args(["--speculative_decoding_mode", "none"]).backend == "pytorch"
    line = _one_line_refusal(lambda: run.parse_args(["--tokenizer_dir", str(dirs / "tokenizer")]), capsys)
    assert "argument --tokenizer_dir" in line


@pytest.mark.parametrize("extra, flag", [(["--target_model_dir", "{tokenizer}"], "--target_model_dir"),
                                         (["--draft_model_dir", "{tokenizer}"], "--draft_model_dir"),
                                         (["--dtype", "bfloat16"], "--dtype")])
def test_run_with_an_engine_refuses_the_pytorch_models_flags(extra, flag, dirs, no_model_loads, monkeypatch, capsys):
    """An engine holds its own target, drafter and dtype: run.py refuses those flags with it, as the server does."""
    run = load_example("run")
    monkeypatch.setattr(cli, "require_module", lambda *args: None)
    argv = ["--engine_dir", str(dirs / "engine"), *[a.format(tokenizer=dirs / "tokenizer") for a in extra]]
    line = _one_line_refusal(lambda: run.parse_args(argv), capsys)
    assert f"argument {flag}: applies to --backend pytorch: an engine holds its own" in line, line


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    return save_tiny_target_dir(tmp_path_factory.mktemp("tiny") / "target", arch="llama", seed=5, layers=2)


def test_run_output_too_long_for_the_target_names_max_output_len(tiny_target_dir, capsys):
    """The 512-position tiny target cannot hold 'hi' + 1000 tokens (nor any prompt: refused from its config.json
    before it loads) or 'hi' + 510: the message names the flag the user typed and how many tokens fit, not the
    library's max_new_tokens."""
    run = load_example("run")
    for max_output_len, says in (("1000", "leaves no room for a prompt"), ("510", "'hi'")):
        rc = run.main(["--target_model_dir", str(tiny_target_dir), "--speculative_decoding_mode", "none",
                       "--max_output_len", max_output_len, "--threads", "1", "--input_text", "hi"])
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading progress bar
        assert rc == 2, err
        assert err.startswith(f"error: --max_output_len={max_output_len}") and "max_new_tokens" not in err, err
        assert says in err and "max_position_embeddings=512" in err and "new tokens fit after" in err, err


# ---------------------------------------------------------------------------- examples/profile_graphed.py


@pytest.mark.parametrize("argv, flag", [
    (["--output_dir", "{file}"], "--output_dir"),
    (["--output_dir", "{file}/sub"], "--output_dir"),
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:x"], "--device"),
    (["--target_model_dir", "{missing}"], "--target_model_dir"),
    (["--draft_model_dir", "{missing}"], "--draft_model_dir"),
    (["--draft_model_dir", "{file}"], "--draft_model_dir"),
    (["--max_new_tokens", "1e21"], "--max_new_tokens"),
    (["--max_new_tokens", "2.5"], "--max_new_tokens"),
    (["--batch_costs", "4", "x"], "--batch_costs"),
    (["--batch_costs", "100000"], "--batch_costs"),
    (["--methods", "ddtree-graph:99999"], "--methods"),
    (["--methods", "ddtree-graph"], "--methods"),
    (["--methods", "ar-graph:3"], "--methods"),
    (["--methods", "ar-graph", "ar-graph"], "--methods"),
    (["--dtypes", "float32", "float32"], "--dtypes"),
    # A speculative method (the default list has three) with a target of one's own needs its drafter ...
    (["--target_model_dir", "{target}"], "--draft_model_dir"),
    (["--target_model_dir", "{target}", "--methods", "ar-graph", "--kernels"], "--draft_model_dir"),
    # ... and AR alone loads none, so a drafter given for it would be ignored.
    (["--draft_model_dir", "{drafter}", "--methods", "ar-graph"], "--draft_model_dir"),
])
def test_profile_graphed_refuses_every_bad_flag_before_any_load(argv, flag, dirs, no_model_loads, capsys,
                                                                monkeypatch):
    profile = load_example("profile_graphed")
    _stub_module_loaders(profile, monkeypatch)
    argv = [a.format(file=dirs / "a_file", missing=dirs / "missing", target=dirs / "target",
                     drafter=dirs / "drafter") for a in argv]
    line = _one_line_refusal(lambda: profile.main(argv), capsys)
    assert line.startswith(f"argument {flag}: "), line


@pytest.fixture(scope="module")
def templateless_target_dir(tiny_target_dir, tmp_path_factory):
    """The tiny target with its chat template removed, as a base model ships."""
    path = tmp_path_factory.mktemp("templateless") / "target"
    shutil.copytree(tiny_target_dir, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_profile_graphed_ar_alone_needs_no_drafter_and_has_no_chat_template(templateless_target_dir, tmp_path,
                                                                           monkeypatch, capsys):
    """--methods ar-graph with a target of one's own: no drafter is asked for or loaded. A target without a chat
    template is refused, before its model loads, with the flag this script has; with that flag it profiles."""
    profile = load_example("profile_graphed")
    monkeypatch.setattr(profile, "load_dflash_drafter", _trap)
    real_load_target = profile.load_target
    monkeypatch.setattr(profile, "load_target", _trap)
    argv = ["--target_model_dir", str(templateless_target_dir), "--methods", "ar-graph", "--max_new_tokens", "2",
            "--output_dir", str(tmp_path)]
    assert profile.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: the target's tokenizer has no chat template: pass --no_chat_template", err
    monkeypatch.setattr(profile, "load_target", real_load_target)
    assert profile.main([*argv, "--no_chat_template"]) == 0
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["chat_template"] is False
    assert [row["method"] for row in report["dtypes"]["float32"]["methods"]] == ["ar-graph"]


# ---------------------------------------------------------------------------- compare_runs.py, copy_split.py


def _results(path: Path, labels: list[str], taus: tuple[list[int], ...] = ([1, 2], [2, 3], [3, 3])) -> str:
    stages = dict.fromkeys(bench.STAGES, 0.0)
    rows = [dataclasses.asdict(bench.RequestRecord(i, list(range(4)), 1.0, list(t), stages))
            for i, t in enumerate(taus)]
    path.write_text(json.dumps({"per_prompt": dict.fromkeys(labels, rows)}))
    return str(path)


@pytest.fixture
def bad_inputs(tmp_path) -> dict[str, str]:
    (tmp_path / "broken.json").write_text('{"per_prompt": ')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "a_dir").mkdir()
    return {"missing": str(tmp_path / "nope.json"), "broken JSON": str(tmp_path / "broken.json"),
            "a JSON list": str(tmp_path / "list.json"), "no per_prompt": str(tmp_path / "empty.json"),
            "a directory": str(tmp_path / "a_dir")}


@pytest.mark.parametrize("kind", ["missing", "broken JSON", "a JSON list", "no per_prompt", "a directory"])
def test_compare_runs_refuses_a_file_that_is_no_results_by_argument(kind, bad_inputs, tmp_path, capsys):
    compare = load_example("compare_runs")
    good = _results(tmp_path / "good.json", ["dflash"])
    bad = bad_inputs[kind]
    line = _one_line_refusal(lambda: compare.main([bad, good]), capsys)
    assert line.startswith(f"argument before: {bad}: not a results.json"), line
    line = _one_line_refusal(lambda: compare.main([good, bad]), capsys)
    assert line.startswith(f"argument after: {bad}: not a results.json"), line


def test_compare_runs_compares_only_speculative_methods(tmp_path, capsys):
    """ar-graph (like ar, hf and hf-static) is an autoregressive baseline: tau is 1 by construction, its z NaN."""
    compare = load_example("compare_runs")
    before = _results(tmp_path / "before.json", ["ar", "ar-graph", "hf-static", "dflash"])
    after = _results(tmp_path / "after.json", ["ar", "ar-graph", "hf-static", "dflash"])
    assert compare.main([before, after]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in out[2:]] == ["| dflash"], out


@pytest.mark.parametrize("before_labels, after_labels, argument, reason", [
    (["ar", "ar-graph"], ["dflash"], "before", "holds no speculative method (only ar, ar-graph)"),
    (["dflash"], ["hf", "ar-graph"], "after", "holds no speculative method (only hf, ar-graph)"),
    (["dflash"], ["ddtree:8"], "after", "shares no speculative method with"),
])
def test_compare_runs_with_nothing_to_compare_is_refused(before_labels, after_labels, argument, reason, tmp_path,
                                                         capsys):
    compare = load_example("compare_runs")
    before = _results(tmp_path / "before.json", before_labels)
    after = _results(tmp_path / "after.json", after_labels)
    line = _one_line_refusal(lambda: compare.main([before, after]), capsys)
    assert line.startswith(f"argument {argument}: ") and reason in line, line


def test_compare_runs_refuses_a_method_with_too_few_prompts_before_printing(tmp_path, capsys):
    compare = load_example("compare_runs")
    before = _results(tmp_path / "before.json", ["dflash"], taus=([1, 2],))
    after = _results(tmp_path / "after.json", ["dflash"])
    with pytest.raises(SystemExit) as exit_info:
        compare.main([before, after])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == ""
    assert "argument before: " in captured.err and "method dflash" in captured.err and "at least 2" in captured.err


@pytest.mark.parametrize("kind", ["missing", "broken JSON", "a JSON list", "no per_prompt", "a directory"])
def test_copy_split_refuses_a_file_that_is_no_results_by_argument(kind, bad_inputs, no_model_loads, capsys,
                                                                  monkeypatch):
    split = load_example("copy_split")
    _stub_module_loaders(split, monkeypatch)
    bad = bad_inputs[kind]
    line = _one_line_refusal(lambda: split.main([bad]), capsys)
    assert line.startswith(f"argument results: {bad}: not a results.json"), line


def test_copy_split_refuses_results_without_their_config_before_the_tokenizer(tmp_path, no_model_loads, capsys,
                                                                             monkeypatch):
    split = load_example("copy_split")
    _stub_module_loaders(split, monkeypatch)
    results = _results(tmp_path / "results.json", ["dflash"])  # per_prompt alone: no "config"
    line = _one_line_refusal(lambda: split.main([results]), capsys)
    assert line.startswith(f"argument results: {results}: has no \"config\""), line


# ---------------------------------------------------------------------------- examples/batch_invariance.py


@pytest.mark.parametrize("argv, flag", [
    (["--device", "tpu"], "--device"),
    (["--target_model_dir", "{missing}"], "--target_model_dir"),
    (["--draft_model_dir", "{missing}"], "--draft_model_dir"),
    (["--output_json", "{missing}/x.json"], "--output_json"),
    (["--output_json", "{target}"], "--output_json"),
    (["--methods", "ddtree:x"], "--methods"),
    (["--methods", "ddtree:0"], "--methods"),
    (["--methods", "ar", "ar"], "--methods"),
    (["--dtypes", "float32", "float32"], "--dtypes"),
    (["--threads", "0"], "--threads"),
    (["--threads", "-2"], "--threads"),
    (["--num_prompts", "0"], "--num_prompts"),
    (["--batch", "1"], "--batch"),
    # AR alone loads no drafter, so a drafter given for it would be ignored.
    (["--methods", "ar", "--draft_model_dir", "{drafter}"], "--draft_model_dir"),
])
def test_batch_invariance_refuses_every_bad_flag_before_any_load(argv, flag, dirs, no_model_loads, capsys,
                                                                 monkeypatch):
    module = load_example("batch_invariance")
    _stub_module_loaders(module, monkeypatch)
    argv = [a.format(missing=dirs / "missing", target=dirs / "target", drafter=dirs / "drafter") for a in argv]
    line = _one_line_refusal(lambda: module.main(argv), capsys)
    assert line.startswith(f"argument {flag}: "), line


@pytest.fixture(scope="module")
def long_context_dirs(tmp_path_factory):
    """A tiny target with room for HumanEval prompts (one token per character) and a drafter made for it."""
    from tiny_dirs import save_long_context_pair

    return save_long_context_pair(tmp_path_factory.mktemp("long_context"))


def test_batch_invariance_ar_alone_loads_no_drafter(long_context_dirs, tmp_path, monkeypatch):
    """--methods ar with a target of one's own: no --draft_model_dir is asked for and no drafter loads."""
    module = load_example("batch_invariance")
    monkeypatch.setattr(module, "load_dflash_drafter", _trap)
    out = tmp_path / "report.json"
    assert module.main(["--target_model_dir", str(long_context_dirs[0]), "--methods", "ar", "--num_prompts", "2",
                        "--max_new_tokens", "3", "--batch", "2", "--threads", "1", "--output_json", str(out)]) == 0
    ar = json.loads(out.read_text())["results"]["float32"]["ar"]
    assert ar["solo_differs_from_ar"] == 0 and ar["batched_differs_from_ar"] == ar["batched_differs_from_solo"]


def test_batch_invariance_without_ar_reports_no_comparison_with_it(long_context_dirs, tmp_path, capsys):
    """AR not among the methods: the AR columns are null in the JSON and '-' on stdout, not the method compared with
    its own solo output (always 0)."""
    module = load_example("batch_invariance")
    target_dir, drafter_dir = long_context_dirs
    out = tmp_path / "report.json"
    assert module.main(["--target_model_dir", str(target_dir), "--draft_model_dir", str(drafter_dir),
                        "--methods", "chain", "--num_prompts", "2", "--max_new_tokens", "3", "--batch", "2",
                        "--threads", "1", "--output_json", str(out)]) == 0
    chain = json.loads(out.read_text())["results"]["float32"]["chain"]
    assert chain["solo_differs_from_ar"] is None and chain["batched_differs_from_ar"] is None
    assert chain["rows"] == 2 and chain["batched_differs_from_solo"] is not None
    assert "solo != AR: -  batched != AR: -" in capsys.readouterr().out


def test_batch_invariance_refuses_a_prompt_too_long_before_decoding(tiny_target_dir, monkeypatch, capsys):
    """The 512-position tiny target cannot hold a HumanEval prompt and 400 tokens: one line, exit 2, before the
    logits phase (not a traceback after it)."""
    module = load_example("batch_invariance")
    monkeypatch.setattr(module, "logit_difference", _trap)
    assert module.main(["--target_model_dir", str(tiny_target_dir), "--methods", "ar", "--num_prompts", "2",
                        "--max_new_tokens", "400", "--batch", "2", "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: prompt 0 does not fit --max_new_tokens: ") and "max_position_embeddings=512" in err


# ---------------------------------------------------------------------------- examples/heldout_tau.py


@pytest.fixture(scope="module")
def other_layers_drafter(dirs):
    """The shipped drafter's config, reading other target layers."""
    path = dirs / "other_layers_drafter"
    if not path.exists():
        path.mkdir()
        config = json.loads(SHIPPED_DRAFTER_CONFIG.read_text())
        config["dflash_config"]["target_layer_ids"] = [2, 9, 15, 21, 28]
        (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("argv, says", [
    (["--drafters", "a={drafter}", "b={missing}"], "argument --drafters: b: "),
    (["--drafters", "a={drafter}", "b={a_file}"], "argument --drafters: b: "),
    (["--drafters", "a={drafter}", "b={target}"], "argument --drafters: b: "),  # a directory without config.json
    (["--drafters", "a={drafter}", "a={drafter}"], "argument --drafters: names 'a' twice"),
    (["--drafters", "{drafter}"], "argument --drafters: "),
    (["--drafters", "a={drafter}", "b={other}"], "argument --drafters: b reads target layers [2, 9, 15, 21, 28]"),
    (["--drafters", "a={drafter}", "--work_dir", "{a_file}"], "argument --work_dir: "),
    (["--drafters", "a={drafter}", "--target_model_dir", "{missing}"], "argument --target_model_dir: "),
])
def test_heldout_tau_refuses_bad_drafters_and_dirs_before_any_load(argv, says, dirs, other_layers_drafter,
                                                                   no_model_loads, capsys, monkeypatch, tmp_path):
    module = load_example("heldout_tau")
    _stub_module_loaders(module, monkeypatch)
    argv = [a.format(drafter=dirs / "drafter", missing=dirs / "missing", a_file=dirs / "a_file",
                     target=dirs / "target", other=other_layers_drafter) for a in argv]
    if "--work_dir" not in argv:
        argv += ["--work_dir", str(tmp_path / "work")]
    line = _one_line_refusal(lambda: module.main(argv), capsys)
    assert line.startswith(says), line


def test_heldout_tau_refuses_a_drafter_that_does_not_fit_the_target_before_the_data_stage(
        long_context_dirs, dirs, tmp_path, monkeypatch, capsys):
    """The shipped drafter (SmolLM2's sizes and layers) on the 2-layer tiny target: refused by name after the target
    loads, before any answer is generated."""
    module = load_example("heldout_tau")
    monkeypatch.setattr(module, "build_conversation_data", _trap)
    assert module.main(["--drafters", f"demo={dirs / 'drafter'}", "--target_model_dir", str(long_context_dirs[0]),
                        "--work_dir", str(tmp_path / "work"), "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --drafters demo: does not fit the target: "), err


def test_heldout_tau_refuses_a_work_dir_made_for_another_target_or_length(long_context_dirs, tmp_path, monkeypatch,
                                                                          capsys):
    """A reused --work_dir holds one target's answers at one --max_new_tokens: a second run with another length or
    another target is refused by name, before the data stage (which would regenerate nothing and score the drafters
    against the first run's answers)."""
    target_dir, drafter_dir = long_context_dirs
    module = load_example("heldout_tau")
    work = tmp_path / "work"
    argv = ["--drafters", f"d={drafter_dir}", "--work_dir", str(work), "--num_conversations", "2",
            "--max_new_tokens", "2", "--threads", "1"]
    assert module.main([*argv, "--target_model_dir", str(target_dir), "--output_json", str(tmp_path / "a.json")]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["results"]["d"]
    capsys.readouterr()
    monkeypatch.setattr(module, "build_conversation_data", _trap)
    longer = [*argv[:-4], "--max_new_tokens", "3", "--threads", "1", "--target_model_dir", str(target_dir)]
    assert module.main(longer) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: --work_dir {str(work)!r} was made for another target or recipe: "), err
    assert "data.max_new_tokens 2 (recorded) != 3 (now)" in err, err
    other = save_tiny_target_dir(tmp_path / "other", arch="qwen3", seed=7, layers=2, max_positions=2048)
    assert module.main([*argv, "--target_model_dir", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "was made for another target or recipe: target.weights_sha256" in err, err


# ---------------------------------------------------------------------------- examples/profile_verify.py


@pytest.mark.parametrize("argv, flag", [
    (["--nodes", "1,x"], "--nodes"),
    (["--nodes", "0"], "--nodes"),
    (["--nodes", "5000"], "--nodes"),
    (["--nodes", ""], "--nodes"),
    (["--nodes", "9,9"], "--nodes"),
    (["--reps", "0"], "--reps"),
    (["--warmup", "-1"], "--warmup"),
    (["--context_tokens", "-5"], "--context_tokens"),
    (["--layer_ids", "1,-2"], "--layer_ids"),
    (["--layer_ids", "a"], "--layer_ids"),
    (["--threads", "0"], "--threads"),
    (["--target_model_dir", "{missing}"], "--target_model_dir"),
])
def test_profile_verify_refuses_every_bad_flag_before_any_load(argv, flag, dirs, no_model_loads, capsys):
    module = load_example("profile_verify")
    argv = [a.format(missing=dirs / "missing") for a in argv]
    line = _one_line_refusal(lambda: module.main(argv), capsys)
    assert line.startswith(f"argument {flag}: "), line


def test_profile_verify_refuses_the_default_layers_on_a_smaller_target(tiny_target_dir, capsys):
    """The default --layer_ids are the shipped drafter's (SmolLM2's 30 layers): on the 2-layer tiny target one line
    names the flag, right after the load (not an IndexError in the verifier)."""
    module = load_example("profile_verify")
    assert module.main(["--target_model_dir", str(tiny_target_dir), "--context_tokens", "40", "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --layer_ids 1,8,14,20,27: [8, 14, 20, 27] outside the target's layers 0..1"), err


def test_profile_verify_compares_with_no_warmup(tiny_target_dir, capsys):
    """--warmup 0 --compare: the logits compared are kept on the first (timed) pass."""
    module = load_example("profile_verify")
    assert module.main(["--target_model_dir", str(tiny_target_dir), "--context_tokens", "40", "--threads", "1",
                        "--layer_ids", "0,1", "--nodes", "1,3", "--reps", "1", "--warmup", "0", "--compare",
                        "--no_breakdown"]) == 0
    assert "max|dlogit|" in capsys.readouterr().out
