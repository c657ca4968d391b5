"""Loading DFlash2 checkpoints in z-lab's layouts, and refusing what is malformed or unsupported by
name (field and value) before any weight is read.

The published Muse-Glimmer-30B-DFlash2 config.json and its safetensors header (names and shapes)
are in tests/fixtures/dflash2 (z-lab/dflash tests/fixtures, see README.md there).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import cached_target, tiny_dflash2_config, tiny_dflash2_drafter, tiny_drafter

import tensorrt_llm_dflash.dflash2.loader as loader_mod
from tensorrt_llm_dflash.dflash2 import (
    DFlash2Config,
    DFlash2DraftModel,
    check_drafter_dir,
    load_dflash2_drafter,
    load_drafter,
    save_dflash2_drafter,
)
from tensorrt_llm_dflash.dflash2.loader import expected_dflash2_shapes
from tensorrt_llm_dflash.drafter import DFlashDraftModel, DraftContextCache, save_dflash_drafter
from tensorrt_llm_dflash.errors import DFlashConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "dflash2"


def published_config() -> dict:
    return json.loads((FIXTURES / "zlab-dflash2-config.json").read_text())


def test_published_config_is_read_as_published():
    config = DFlash2Config.from_dict(published_config())
    base, s = config.base, config.dflash2
    assert (base.block_size, base.mask_token_id, base.target_layer_ids) == (16, 201818, [1, 13, 25, 37, 49])
    assert (base.hidden_size, base.vocab_size, base.num_hidden_layers, base.head_dim) == (6656, 202048, 5, 128)
    assert base.rope_theta == 500000.0 and base.rope_scaling is None and base.rms_norm_eps == 1e-05
    assert base.layer_types == ["sliding_attention"] * 5 and base.sliding_window == 2048
    assert (s.conv_kernel_size, s.conv_group_size, s.selector_rank, s.selector_top_k) == (2, 16, 256, 16)
    assert s.output_multiplier == 0.19611613513818404 and s.final_logit_softcapping == 20.0
    assert s.input_embedding_scale == 1.0


def test_published_header_is_exactly_the_expected_tensors():
    published = json.loads((FIXTURES / "zlab-dflash2-safetensors-shapes.json").read_text())["shapes"]
    expected = expected_dflash2_shapes(DFlash2Config.from_dict(published_config()))
    assert {k: list(v) for k, v in expected.items()} == published
    assert len(published) == 15 * 5 + 6


@pytest.fixture(scope="module")
def target():
    return cached_target("qwen3", seed=2, vocab=32, layers=4)


def _block_output(model, target, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(1, 5, len(model.config.target_layer_ids) * model.config.hidden_size, generator=gen,
                           dtype=torch.float64)
    cache = DraftContextCache()
    model.extend_context(cache, features, torch.arange(5)[None])
    ids = torch.full((1, model.config.block_size), model.config.mask_token_id)
    ids[0, 0] = 3
    with torch.inference_mode():
        return model(target.get_input_embeddings()(ids), torch.arange(5, 5 + model.config.block_size)[None], cache)


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_save_and_load_round_trip_in_both_layouts(target, tmp_path, layout):
    model = tiny_dflash2_drafter(target, block_size=5, layers=2, layout=layout)
    save_dflash2_drafter(model, tmp_path, dtype=torch.float64)
    raw = json.loads((tmp_path / "config.json").read_text())
    if layout == "nested":
        assert raw["dflash_config"]["block_size"] == 5 and "rope_parameters" in raw and "block_size" not in raw
    else:
        assert raw["block_size"] == 5 and raw["rope_theta"] == 10000.0 and "rope_parameters" not in raw
    loaded = load_drafter(tmp_path, dtype=torch.float64)
    assert isinstance(loaded, DFlash2DraftModel)
    assert torch.equal(_block_output(loaded, target), _block_output(model, target))
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "candidate_selector.predecessor_codebook" in names  # raw tensors, as published


def test_codebooks_saved_with_weight_suffix_and_model_prefix_load(target, tmp_path):
    """A checkpoint saved from the reference's nn.Embedding codebooks names them ``...codebook.weight``."""
    model = tiny_dflash2_drafter(target, block_size=4)
    save_dflash2_drafter(model, tmp_path, dtype=torch.float64)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    renamed = {"model." + (k + ".weight" if k.endswith("codebook") else k): v for k, v in tensors.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    loaded = load_dflash2_drafter(tmp_path, dtype=torch.float64)
    assert torch.equal(loaded.candidate_selector.successor_codebook, model.candidate_selector.successor_codebook)


def test_the_dflash_loader_is_unchanged_and_dispatch_keeps_it(target, tmp_path):
    save_dflash_drafter(tiny_drafter(target, block_size=4), tmp_path, dtype=torch.float64)
    model = load_drafter(tmp_path, dtype=torch.float64)
    assert type(model) is DFlashDraftModel


# ------------------------------------------------------------------------------- refusals


def _edit(raw: dict, path: str, value) -> dict:
    """Set (or delete, value ...) a dotted key of a config dict."""
    node = raw
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return raw


CONFIG_REFUSALS = [
    # (layout, dotted key, value, the message must contain)
    ("nested", "dflash_config.selector_rank", ..., "dflash_config.selector_rank is missing"),
    ("nested", "dflash_config.conv_kernel_size", 0, "dflash_config.conv_kernel_size=0 is invalid"),
    ("nested", "dflash_config.selector_top_k", 2.5, "dflash_config.selector_top_k=2.5 is invalid"),
    ("nested", "dflash_config.selector_top_k", 33, "dflash_config.selector_top_k=33 exceeds vocab_size=32"),
    ("nested", "dflash_config.conv_group_size", 5, "dflash_config.conv_group_size=5 does not divide hidden_size=32"),
    ("nested", "dflash_config.output_multiplier", -1.0, "dflash_config.output_multiplier=-1.0 is not supported"),
    ("nested", "dflash_config.final_logit_softcapping", -3.0, "final_logit_softcapping=-3.0 is not supported"),
    ("nested", "dflash_config.final_logit_softcapping", "big", "final_logit_softcapping='big' is invalid"),
    ("nested", "is_causal", True, "is_causal=True is not supported"),
    ("nested", "is_causal", ..., "is_causal is missing and layer_types[0]='sliding_attention'"),
    ("nested", "sliding_window", 3, "sliding_window=3 is not supported with block_size=4"),
    ("nested", "block_size", 6, "dflash_config.block_size=4 and block_size=6 disagree"),
    ("nested", "rope_theta", 7.0, "rope_parameters.rope_theta=10000.0 and rope_theta=7.0 disagree"),
    ("nested", "rope_parameters", {"rope_type": "default"}, "rope_parameters={'rope_type': 'default'} is invalid"),
    ("nested", "draft_vocab_size", 16, "draft_vocab_size=16 is not supported for DFlash2"),
    ("nested", "dflash_config.mask_token_id", ..., "dflash_config.mask_token_id"),
    ("flat", "rope_theta", ..., "rope_theta is missing"),
    ("flat", "selector_rank", 4, "dflash_config.selector_rank=8 and selector_rank=4 disagree"),
    ("flat", "architectures", ["DFlashDraftModel"], "is not a DFlash2 drafter"),
]


@pytest.mark.parametrize("layout,key,value,message", CONFIG_REFUSALS)
def test_unsupported_or_malformed_configs_are_refused_by_name(target, layout, key, value, message):
    raw = _edit(tiny_dflash2_config(target, block_size=4, layout=layout), key, value)
    with pytest.raises(DFlashConfigError, match=_literal(message)):
        DFlash2Config.from_dict(raw)


def _literal(text: str) -> str:
    import re

    return re.escape(text)


@pytest.fixture
def saved(target, tmp_path):
    """A valid DFlash2 directory; reading any weight data from it fails the test."""
    save_dflash2_drafter(tiny_dflash2_drafter(target, block_size=4, layers=2), tmp_path, dtype=torch.float32)
    return tmp_path


@pytest.fixture
def no_weight_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were read before the checkpoint was refused")

    monkeypatch.setattr(loader_mod, "read_safetensors_dir", refuse)


def test_missing_codebook_is_refused_by_name_before_loading(saved, no_weight_reads):
    tensors = load_file(str(saved / "model.safetensors"))
    del tensors["candidate_selector.successor_codebook"]
    save_file(tensors, str(saved / "model.safetensors"))
    for check in (check_drafter_dir, load_dflash2_drafter):
        with pytest.raises(DFlashConfigError, match=r"missing tensors \['candidate_selector.successor_codebook'\]"):
            check(saved)


def test_wrong_selector_rank_is_refused_by_name_before_loading(saved, no_weight_reads):
    raw = json.loads((saved / "config.json").read_text())
    raw["dflash_config"]["selector_rank"] = 16
    (saved / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DFlashConfigError, match=r"candidate_selector\.hidden_projection\.weight has shape \(8, 32\), "
                                                r"but dflash_config\.selector_rank.*imply \(16, 32\).*selector_rank=16"):
        load_dflash2_drafter(saved)


def test_wrong_conv_shape_and_extra_tensor_are_refused(saved, no_weight_reads):
    tensors = load_file(str(saved / "model.safetensors"))
    tensors["layers.1.mlp_conv.base_kernel"] = torch.zeros(2, 3, 32)
    save_file(tensors, str(saved / "model.safetensors"))
    with pytest.raises(DFlashConfigError, match=r"layers\.1\.mlp_conv\.base_kernel has shape \(2, 3, 32\).*conv_kernel_size"):
        load_dflash2_drafter(saved)
    tensors["layers.1.mlp_conv.base_kernel"] = torch.zeros(2, 2, 32)
    tensors["lm_head.weight"] = torch.zeros(32, 32)
    save_file(tensors, str(saved / "model.safetensors"))
    with pytest.raises(DFlashConfigError, match=r"unexpected tensors \['lm_head.weight'\]"):
        load_dflash2_drafter(saved)


def test_non_finite_weights_are_refused(saved):
    tensors = load_file(str(saved / "model.safetensors"))
    tensors["candidate_selector.predecessor_codebook"][3, 1] = math.nan
    save_file(tensors, str(saved / "model.safetensors"))
    with pytest.raises(DFlashConfigError, match=r"candidate_selector\.predecessor_codebook.*1 NaN"):
        load_dflash2_drafter(saved)


def test_runpy_refuses_a_malformed_dflash2_dir_before_loading_the_target(saved, monkeypatch, capsys):
    from example_cli import load_example

    import tensorrt_llm_dflash.target as target_mod

    raw = json.loads((saved / "config.json").read_text())
    raw["dflash_config"]["selector_rank"] = 4
    (saved / "config.json").write_text(json.dumps(raw))

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the drafter was checked")

    monkeypatch.setattr(target_mod, "load_target", no_target)
    assert load_example("run").main(["--draft_model_dir", str(saved), "--max_output_len", "4"]) != 0
    assert "selector_rank=4" in capsys.readouterr().err
