"""Drafter directories run.py must refuse by name before the target loads (QA pass): a DFlash checkpoint that does
not match its config, a DFlash2 config that does not declare its architecture, a drafter made for another target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from example_cli import load_example
from safetensors.torch import load_file, save_file
from tiny_dirs import save_tiny_target_dir
from tiny_models import tiny_dflash2_drafter, tiny_drafter, tiny_target

import tensorrt_llm_dflash.target as target_mod
from tensorrt_llm_dflash.dflash2 import check_drafter_dir, load_drafter, save_dflash2_drafter
from tensorrt_llm_dflash.drafter import save_dflash_drafter
from tensorrt_llm_dflash.errors import DFlashConfigError


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    """A 6-layer tiny target directory and a valid DFlash and DFlash2 drafter for it."""
    root = tmp_path_factory.mktemp("qa_pair")
    target_dir = save_tiny_target_dir(root / "target", layers=6)
    model = tiny_target("qwen3", seed=0, vocab=64, layers=6, dtype=torch.float32)  # what the directory holds
    save_dflash_drafter(tiny_drafter(model, block_size=4, layers=2), root / "dflash", dtype=torch.float32)
    save_dflash2_drafter(tiny_dflash2_drafter(model, block_size=4, layers=2), root / "dflash2", dtype=torch.float32)
    return {"target": target_dir, "dflash": root / "dflash", "dflash2": root / "dflash2"}


@pytest.fixture
def no_target_load(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("the target was loaded before the drafter was refused")

    monkeypatch.setattr(target_mod, "load_target", refuse)


def _copy(src: Path, dst: Path, config=None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        state = load_file(str(dst / "model.safetensors"))
        tensors(state)
        save_file(state, str(dst / "model.safetensors"))
    return dst


def _refusal(pair: dict[str, Path], drafter: Path, capsys) -> str:
    argv = ["--target_model_dir", str(pair["target"]), "--draft_model_dir", str(drafter), "--max_output_len", "4",
            "--ddtree_budget", "4", "--input_text", "abc"]
    assert load_example("run").main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize("edit,says", [
    (lambda t: t.pop("fc.weight"), "missing tensors ['fc.weight']"),
    (lambda t: t.__setitem__("fc.weight", torch.zeros(3, 3)), "tensor fc.weight has shape (3, 3), config.json "
                                                               "implies (32, 64)"),
    (lambda t: t.__setitem__("lm_head.weight", torch.zeros(64, 32)), "unexpected tensors ['lm_head.weight']"),
])
def test_run_refuses_a_dflash_checkpoint_that_does_not_match_its_config_before_the_target_loads(
        pair, tmp_path, no_target_load, capsys, edit, says):
    drafter = _copy(pair["dflash"], tmp_path / "d", tensors=edit)
    err = _refusal(pair, drafter, capsys)
    assert says in err and str(drafter) in err


@pytest.mark.parametrize("architectures", [["DFlashDraftModel"], None, "DFlash2DraftModel"])
def test_a_dflash2_config_that_does_not_declare_its_architecture_is_refused_by_that_field(
        pair, tmp_path, no_target_load, capsys, architectures):
    def edit(raw: dict) -> None:
        if architectures is None:
            del raw["architectures"]
        else:
            raw["architectures"] = architectures

    drafter = _copy(pair["dflash2"], tmp_path / "d", config=edit)
    says = f"architectures={architectures!r} is not a list holding 'DFlash2DraftModel'"
    for call in (check_drafter_dir, load_drafter):  # not "missing block_size", the DFlash reading of it
        with pytest.raises(DFlashConfigError, match=r"conv_kernel_size") as info:
            call(drafter)
        assert says in str(info.value)
    assert says in _refusal(pair, drafter, capsys)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("key,value,says", [
    ("target_layer_ids", [1, 9], "dflash_config.target_layer_ids=[1, 9] has [9] outside the target's layers 0..5"),
    ("mask_token_id", 64, "dflash_config.mask_token_id=64 is outside the target's embedding"),
])
def test_a_drafter_made_for_another_target_is_refused_before_the_target_loads(pair, tmp_path, no_target_load,
                                                                             capsys, kind, key, value, says):
    drafter = _copy(pair[kind], tmp_path / "d", config=lambda raw: raw["dflash_config"].__setitem__(key, value))
    err = _refusal(pair, drafter, capsys)
    assert says in err and "--target_model_dir" in err


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_a_drafter_for_a_target_of_another_depth_is_refused_before_the_target_loads(pair, tmp_path, no_target_load,
                                                                                   capsys, kind):
    drafter = _copy(pair[kind], tmp_path / "d", config=lambda raw: raw.__setitem__("num_target_layers", 9))
    err = _refusal(pair, drafter, capsys)
    assert "num_target_layers=9: this drafter was made for a target of 9 layers, but the target has " \
           "num_hidden_layers=6" in err


def test_a_drafter_for_a_target_of_another_hidden_size_is_refused_before_the_target_loads(pair, tmp_path,
                                                                                         no_target_load, capsys):
    wide = tiny_target("qwen3", seed=0, vocab=64, layers=6, hidden=64, dtype=torch.float32)
    save_dflash2_drafter(tiny_dflash2_drafter(wide, block_size=4), tmp_path / "d", dtype=torch.float32)
    err = _refusal(pair, tmp_path / "d", capsys)
    assert "drafter hidden_size=64, target hidden_size=32" in err


def test_runtime_graphed_with_a_dflash2_drafter_is_refused_before_the_target_loads(pair, no_target_load, capsys):
    argv = ["--target_model_dir", str(pair["target"]), "--draft_model_dir", str(pair["dflash2"]), "--runtime",
            "graphed", "--input_text", "abc", "--max_output_len", "4"]
    assert load_example("run").main(argv) == 2
    err = capsys.readouterr().err
    assert "--runtime graphed runs DFlash drafters, not DFlash2" in err and str(pair["dflash2"]) in err


def test_the_graphed_default_falls_back_to_eager_for_a_dflash2_drafter_before_the_target_loads(pair, monkeypatch):
    """On CUDA the runtime defaults to graphed; a DFlash2 drafter runs eagerly, decided before the target loads
    (simulated here: no GPU is needed to choose)."""
    run = load_example("run")
    args = run.parse_args(["--target_model_dir", str(pair["target"]), "--draft_model_dir", str(pair["dflash2"])])
    args.runtime, args.runtime_given = "graphed", False
    seen = []

    def stop(*_args, **_kwargs):
        seen.append(args.runtime)
        raise RuntimeError("stop at the target load")

    monkeypatch.setattr(target_mod, "load_target", stop)
    with pytest.raises(RuntimeError, match="stop at the target load"):
        run.build_pytorch(args)
    assert seen == ["eager"]


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("edit,says", [
    (lambda t: t["norm.weight"].__setitem__(0, float("nan")), "tensor norm.weight in {dir} holds 1 NaN"),
    (lambda t: t.__setitem__("norm.weight", t["norm.weight"].to(torch.int8)),
     "tensor norm.weight in {dir} has dtype int8"),
])
def test_what_only_the_drafter_weights_show_is_refused_before_the_target_loads(pair, tmp_path, no_target_load,
                                                                               capsys, kind, edit, says):
    drafter = _copy(pair[kind], tmp_path / "d", tensors=edit)
    assert says.format(dir=drafter) in _refusal(pair, drafter, capsys)


@pytest.mark.parametrize("case,says", [
    ("dflash2", "is a DFlash2 drafter: the server runs DFlash drafters"),
    ("other_layers", "--draft_model_dir does not fit --target_model_dir"),
    ("nan", "holds 1 NaN"),
])
def test_the_server_refuses_a_drafter_it_cannot_run_before_the_target_loads(pair, tmp_path, no_target_load, case,
                                                                            says):
    """The server's loader checked only the drafter's config.json before the target: a DFlash2 drafter was
    refused as 'missing block_size ... looks like a target model', and a drafter for another target, or with NaN
    weights, only after the target had loaded. It makes run.py's checks now, in run.py's order."""
    import argparse

    from tensorrt_llm_dflash.errors import DFlashError
    from tensorrt_llm_dflash.serve.__main__ import load_models

    if case == "dflash2":
        drafter = pair["dflash2"]
    elif case == "other_layers":
        drafter = _copy(pair["dflash"], tmp_path / "d",
                        config=lambda raw: raw["dflash_config"].__setitem__("target_layer_ids", [1, 9]))
    else:
        drafter = _copy(pair["dflash"], tmp_path / "d", tensors=lambda t: t["norm.weight"].__setitem__(0, float("nan")))
    args = argparse.Namespace(dtype="float32", device="cpu", speculative_decoding_mode="dflash",
                              draft_model_dir=str(drafter), target_model_dir=str(pair["target"]))
    with pytest.raises(DFlashError, match=says):
        load_models(args)
