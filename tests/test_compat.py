"""transformers 4.57.3 and 5.x through one code base (tensorrt_llm_dflash/compat.py).

The suite runs on both ends (scripts/test.sh); these tests pin what differs between them. The two
silent breaks of 5.x (no test failed, the numbers were wrong) have a test each: the RoPE a training
run writes into the drafter's config, and the RoPE base a converted engine checkpoint reads.
"""

from __future__ import annotations

import json

import pytest
import torch

from tensorrt_llm_dflash import compat
from tensorrt_llm_dflash.config import DFlashDraftConfig
from tensorrt_llm_dflash.drafter import RotaryEmbedding
from tensorrt_llm_dflash.training.trainer import make_drafter_config

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _target_config(arch: str, rope_theta: float, rope_scaling: dict | None):
    from transformers import LlamaConfig, Qwen3Config

    common = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 8,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
              "rope_theta": rope_theta}
    if rope_scaling is not None:
        common["rope_scaling"] = dict(rope_scaling)
    return Qwen3Config(head_dim=8, **common) if arch == "qwen3" else LlamaConfig(head_dim=8, **common)


def test_default_rope_is_transformers_own_formula() -> None:
    """"default" left ROPE_INIT_FUNCTIONS in 5.x; compat computes it as 4.57 did (float32, bit for bit)."""
    inv_freq, scale = compat.rope_inv_freq(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=10000.0,
                                           rope_scaling=None, max_position_embeddings=128)
    expected = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert inv_freq.dtype == torch.float32 and scale == 1.0
    assert torch.equal(inv_freq, expected)
    assert "default" in compat.rope_types() and "llama3" in compat.rope_types()


def test_rope_inv_freq_leaves_the_callers_dict_alone() -> None:
    """Qwen3Config(rope_scaling=d) fills d in (5.x aliases it as rope_parameters): compat passes a copy."""
    scaling = dict(LLAMA3)
    before = json.dumps(scaling, sort_keys=True)
    compat.rope_inv_freq(hidden_size=32, num_attention_heads=4, head_dim=8, rope_theta=5e5, rope_scaling=scaling,
                         max_position_embeddings=256)
    assert json.dumps(scaling, sort_keys=True) == before
    config = DFlashDraftConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, vocab_size=64, block_size=4, mask_token_id=63,
                               target_layer_ids=[1], rope_scaling=scaling, max_position_embeddings=256)
    RotaryEmbedding(config)
    assert json.dumps(config.rope_scaling, sort_keys=True) == before


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("theta,scaling", [(1_000_000.0, None), (10_000.0, None), (500_000.0, LLAMA3),
                                           (20_000.0, {"rope_type": "linear", "factor": 2.0})])
def test_training_writes_the_targets_rope_into_the_drafter_config(arch: str, theta: float, scaling: dict | None,
                                                                   tmp_path) -> None:
    """Break 6: on 5.x a config has no rope_theta attribute and rope_scaling aliases rope_parameters, so
    getattr(c, "rope_theta", 1e6) gave 1e6 for every target and rope_scaling a dict even for plain RoPE."""
    config = make_drafter_config(_target_config(arch, theta, scaling), num_layers=1, block_size=4,
                                 mask_token_id=63, num_feature_layers=2)
    assert config.rope_theta == theta
    assert config.rope_scaling == (None if scaling is None else scaling)
    # The same numbers survive the round trip through the drafter's config.json.
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    again = DFlashDraftConfig.from_pretrained(tmp_path)
    assert again.rope_theta == theta and again.rope_scaling == config.rope_scaling


@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_engine_conversion_reads_the_targets_rope_base(tmp_path, scaling: dict | None) -> None:
    """Break 7: 5.x's save_pretrained writes RoPE only under rope_parameters; the conversion read
    rope_theta with a 10000 fallback, so a 1e6 target's engine rotated with base 10000."""
    from test_trtllm_convert import make_drafter, random_hf_target

    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.trtllm.weight import convert_checkpoint

    common = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "attn_implementation": "sdpa", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
              "rope_theta": 1_000_000.0}
    if scaling is not None:
        common["rope_scaling"] = dict(scaling)
    torch.manual_seed(0)
    target = random_hf_target("llama", common, head_dim=8).float().eval()
    target.save_pretrained(tmp_path / "target", safe_serialization=True)
    save_dflash_drafter(make_drafter(target), tmp_path / "drafter", dtype=torch.float32)
    config = convert_checkpoint(tmp_path / "target", tmp_path / "drafter", tmp_path / "ckpt", dtype="float32",
                                progress=False)
    assert config["rotary_base"] == 1_000_000.0
    assert config["rotary_scaling"] == scaling


def test_raw_config_rope_reads_both_layouts() -> None:
    assert compat.raw_config_rope({"rope_theta": 5e5, "rope_scaling": None}) == (5e5, None)
    assert compat.raw_config_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == (1e6, None)
    theta, scaling = compat.raw_config_rope({"rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
    assert theta == 5e5 and scaling == LLAMA3
    assert compat.raw_config_rope({}) == (None, None)


def test_drafter_config_written_by_5x_layout_loads(tmp_path) -> None:
    """A drafter config.json with RoPE only under rope_parameters (as 5.x writes, and DFlash2 checkpoints)
    reads as the flat pair."""
    raw = {"architectures": ["DFlashDraftModel"], "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "vocab_size": 64, "block_size": 4, "num_target_layers": 8,
           "dflash_config": {"mask_token_id": 63, "target_layer_ids": [1, 5]},
           "rope_parameters": {**LLAMA3, "rope_theta": 250000.0}, "max_position_embeddings": 256}
    config = DFlashDraftConfig.from_dict(raw)
    assert config.rope_theta == 250000.0 and config.rope_scaling == LLAMA3


class _ListTemplate:
    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [1, 2, 3]


class _DictTemplate:
    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        from transformers import BatchEncoding

        return BatchEncoding({"input_ids": [4, 5], "attention_mask": [1, 1]})


def test_chat_token_ids_takes_either_return_shape() -> None:
    """5.x's apply_chat_template(tokenize=True) returns a BatchEncoding: iterating it gave the key names."""
    messages = [{"role": "user", "content": "hi"}]
    assert compat.chat_token_ids(_ListTemplate(), messages) == [1, 2, 3]
    assert compat.chat_token_ids(_DictTemplate(), messages) == [4, 5]


def test_crop_cache_keeps_the_prefix_on_any_release() -> None:
    """DynamicCache.crop(positive) is refused from 5.18; compat crops with a negative count."""
    from tiny_models import cached_target
    from transformers import DynamicCache

    model = cached_target("qwen3", seed=0, vocab=32)
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5, 6, 7]]), use_cache=True, **{compat.CACHE_KWARG: cache})
    keys = [layer_keys.clone() for layer_keys in _keys(cache)]
    compat.crop_cache(cache, 5)  # nothing to drop: must not empty the cache (crop(0) would)
    assert cache.get_seq_length() == 5
    compat.crop_cache(cache, 3)
    assert cache.get_seq_length() == 3
    for before, after in zip(keys, _keys(cache)):
        assert torch.equal(before[:, :, :3], after)


def _keys(cache) -> list[torch.Tensor]:
    if hasattr(cache, "layers"):
        return [layer.keys for layer in cache.layers]
    return list(cache.key_cache)


def test_generate_kwargs_are_accepted_by_generate() -> None:
    from tiny_models import cached_target

    model = cached_target("llama", seed=0, vocab=32)
    out = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, do_sample=False, pad_token_id=0,
                         **compat.generate_kwargs())
    assert out.shape == (1, 5)


def test_supported_versions_are_the_ones_running() -> None:
    """The suite runs only on releases compat knows: 4.57.x or 5.x."""
    import numpy
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    assert (major, minor) >= (4, 57) and major <= 5, transformers.__version__
    assert int(numpy.__version__.split(".")[0]) in (1, 2)
    assert compat.TRANSFORMERS_MAJOR == major
