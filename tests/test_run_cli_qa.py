"""examples/run.py as a demanding user runs it (QA pass): prompts checked before the cost-aware tree measures this
machine, a target without a chat template, a repeated --input_text, and seeded sampling with a DFlash2 drafter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from example_cli import load_example
from tiny_dirs import save_tiny_target_dir
from tiny_models import tiny_dflash2_drafter, tiny_target

from tensorrt_llm_dflash.dflash2 import save_dflash2_drafter


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    """A tiny 64-position target directory and a DFlash2 drafter for it."""
    root = tmp_path_factory.mktemp("run_qa")
    target_dir = save_tiny_target_dir(root / "target", layers=4, max_positions=64)
    model = tiny_target("qwen3", seed=0, vocab=64, layers=4, dtype=torch.float32, max_positions=64)
    save_dflash2_drafter(tiny_dflash2_drafter(model, block_size=4, layers=2), root / "dflash2", dtype=torch.float32)
    return {"target": target_dir, "dflash2": root / "dflash2"}


def _argv(pair: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["--target_model_dir", str(pair["target"]), "--draft_model_dir", str(pair["dflash2"]),
            "--output_json", str(out), "--dtype", "float64", *extra]


@pytest.mark.parametrize("text,max_output_len,says", [
    ("x" * 80, "4", "--input_text 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx': the 80-token prompt leaves no room for a "
                    "new token within the target's max_position_embeddings=64; at most 63 prompt tokens fit"),
    ("x" * 40, "30", "--max_output_len=30: the 40-token prompt"),
])
def test_a_prompt_that_cannot_run_is_refused_before_the_cost_aware_tree_measures_the_machine(
        pair, tmp_path, monkeypatch, capsys, text, max_output_len, says):
    run = load_example("run")

    def no_policy(*_args, **_kwargs):
        raise AssertionError("the cost-aware tree was built (its verify costs measured) before the prompt was checked")

    monkeypatch.setattr(run, "make_policy", no_policy)
    out = tmp_path / "out.json"
    assert run.main(_argv(pair, out, "--no_chat_template", "--input_text", "ok", text, "--max_output_len",
                          max_output_len)) == 2
    err = capsys.readouterr().err
    assert says in err and "max_new_tokens" not in err, err  # the flag run.py has, not the library's name
    doc = json.loads(out.read_text())
    assert (doc["status"], doc["outputs"], doc["mode"]) == ("error", [], "cost-aware tree")


@pytest.fixture(scope="module")
def templateless_target(pair, tmp_path_factory) -> Path:
    """The tiny target with its chat template removed, as a base model ships."""
    path = tmp_path_factory.mktemp("templateless") / "target"
    shutil.copytree(pair["target"], path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_a_target_without_a_chat_template_says_its_text_is_sent_as_is(templateless_target, tmp_path, capsys):
    """The README: "The chat template of the target is applied unless --no_chat_template"; a target without one
    got the text as-is, silently (kept: the engine demo pair's documented commands rely on it; now it is said)."""
    argv = ["--target_model_dir", str(templateless_target), "--speculative_decoding_mode", "none", "--input_text",
            "hello", "--max_output_len", "2", "--output_json", str(tmp_path / "out.json")]
    note = "note: the target's tokenizer has no chat template: the text is sent as-is"
    assert load_example("run").main(argv) == 0
    assert note in capsys.readouterr().err
    assert load_example("run").main([*argv, "--no_chat_template"]) == 0
    assert note not in capsys.readouterr().err


def test_a_repeated_input_text_adds_its_prompts():
    run = load_example("run")
    assert run.parse_args(["--input_text", "a", "b", "--input_text", "c"]).input_text == ["a", "b", "c"]
    assert run.parse_args([]).input_text == [run.DEFAULT_PROMPT]


def _sample(pair: dict[str, Path], tmp_path: Path, seed: int, *extra: str) -> list[int]:
    out = tmp_path / f"seed{seed}.json"
    argv = _argv(pair, out, "--input_text", "hello", "--max_output_len", "12", "--temperature", "1.0",
                 "--random_seed", str(seed), *extra)
    if "none" in extra:  # plain sampling: no drafter
        at = argv.index("--draft_model_dir")
        del argv[at: at + 2]
    assert load_example("run").main(argv) == 0
    return json.loads(out.read_text())["outputs"][0]["output_ids"]


@pytest.mark.parametrize("budget", ["0", "6"])
def test_a_dflash2_run_with_a_fixed_budget_repeats_its_sample_for_the_same_seed(pair, tmp_path, capsys, budget):
    first = _sample(pair, tmp_path, 7, "--ddtree_budget", budget)
    assert _sample(pair, tmp_path, 7, "--ddtree_budget", budget) == first
    assert _sample(pair, tmp_path, 8, "--ddtree_budget", budget) != first
    assert "does not repeat a sample" not in capsys.readouterr().err


def test_a_seeded_sample_is_plain_samplings_own_in_every_mode(pair, tmp_path, capsys):
    """Token t is drawn from a uniform keyed by the seed and t: the cost-aware tree (twice: its sizes follow
    measured costs and what it learned), a DFlash2 DDTree and plain sampling give one sample for one seed; --help
    says so."""
    first = _sample(pair, tmp_path, 7)
    assert _sample(pair, tmp_path, 7) == first
    assert _sample(pair, tmp_path, 7, "--ddtree_budget", "6") == first
    assert _sample(pair, tmp_path, 7, "--speculative_decoding_mode", "none") == first
    assert _sample(pair, tmp_path, 8) != first
    assert "note:" not in capsys.readouterr().err
    assert "same output in every mode and runtime" in " ".join(load_example("run").build_parser().format_help().split())


def test_a_drafter_of_the_other_kind_is_refused_by_draft_type_before_the_target_loads(pair, tmp_path, monkeypatch,
                                                                                      capsys):
    import tensorrt_llm_dflash.lora_inject as lora_inject
    import tensorrt_llm_dflash.target as target_mod

    def no_target(*_args, **_kwargs):
        raise AssertionError("the target was loaded before the drafter's kind was checked")

    monkeypatch.setattr(target_mod, "load_target", no_target)
    run = load_example("run")
    assert run.LORA_INJECT_CONFIG == lora_inject.CONFIG_NAME
    common = ["--target_model_dir", str(pair["target"]), "--input_text", "hi", "--max_output_len", "2"]
    # A DFlash2 drafter given as a LoRA-inject adapter: refused at parse time, by the flag.
    with pytest.raises(SystemExit) as exit_info:
        run.main([*common, "--draft_type", "lora_inject", "--draft_model_dir", str(pair["dflash2"])])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "argument --draft_type: 'lora_inject' needs a LoRA-inject adapter dir" in err
    assert "drop --draft_type lora_inject" in err
    # A LoRA-inject adapter given as a DFlash drafter: named as what it is, not "has no config.json".
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / lora_inject.CONFIG_NAME).write_text("{}")
    assert run.main([*common, "--draft_model_dir", str(adapter)]) == 2
    assert "is a LoRA-inject adapter (it has dflash_lora_inject.json): pass --draft_type lora_inject" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("budget,mode", [("0", "DFlash2 chain"), ("6", "DFlash2 tree budget 6")])
def test_a_fixed_dflash2_run_is_named_as_what_it_runs(pair, tmp_path, capsys, budget, mode):
    """The selector's chain and the DFlash2 tree, not "DFlash chain" / "DDTree" (what a DFlash drafter runs)."""
    out = tmp_path / "out.json"
    assert load_example("run").main(_argv(pair, out, "--input_text", "hi", "--max_output_len", "3", "--ddtree_budget",
                                          budget)) == 0
    assert json.loads(out.read_text())["mode"] == mode
    assert f"[{mode}] 'hi'" in capsys.readouterr().out


def test_an_output_longer_than_the_targets_context_is_refused_before_anything_loads(pair, tmp_path, monkeypatch,
                                                                                   capsys):
    import tensorrt_llm_dflash.dflash2 as dflash2_mod
    import tensorrt_llm_dflash.target as target_mod

    def no_load(*_args, **_kwargs):
        raise AssertionError("a model was loaded before --max_output_len was checked")

    monkeypatch.setattr(target_mod, "load_target", no_load)
    monkeypatch.setattr(dflash2_mod, "load_drafter", no_load)
    for extra in ([], ["--speculative_decoding_mode", "none"]):
        argv = ["--target_model_dir", str(pair["target"]), "--input_text", "hi", "--max_output_len", "64", *extra]
        if not extra:
            argv += ["--draft_model_dir", str(pair["dflash2"])]
        assert load_example("run").main(argv) == 2
        assert ("--max_output_len=64 leaves no room for a prompt: the target's max_position_embeddings=64" in
                capsys.readouterr().err)
