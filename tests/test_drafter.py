"""The DFlash drafter: its math against a from-scratch implementation, the checkpoint format,
and validation messages.

The reference below is written from the DFlash equations (FACTS.md section 1) with
plain torch ops, per head, without reusing anything from the package.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import cached_target, tiny_drafter

from tensorrt_llm_dflash.config import DFlashDraftConfig, build_target_layer_ids
from tensorrt_llm_dflash.drafter import DFlashDraftModel, load_dflash_drafter, save_dflash_drafter
from tensorrt_llm_dflash.errors import DFlashConfigError
from tensorrt_llm_dflash.proposer import DFlashProposer

F64 = torch.float64

# ------------------------------------------------------------------ plain reference


def ref_rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def ref_inv_freq(hd, theta, scaling=None):
    """theta^(-2i/hd), rounded to float32 as transformers computes it for every model
    (targets included), with linear or Llama-3.1 frequency scaling."""
    inv = 1.0 / (theta ** (torch.arange(hd // 2, dtype=torch.float32) * 2.0 / hd))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        return inv.to(F64) / scaling["factor"]
    if kind == "llama3":  # Llama 3.1 bands, in float32 like transformers
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = inv / factor
        smooth = (old / wavelen - lo) / (hi - lo)
        middle = (1 - smooth) * scaled + smooth * inv
        out = torch.where(wavelen < old / hi, inv, torch.where(wavelen > old / lo, scaled, middle))
        return out.to(F64)
    return inv.to(F64)


def ref_rope(x, positions, theta, scaling=None):
    """x [S, heads, hd]; rotate pairs (i, i + hd/2) by angle pos * inv_freq[i] (float64)."""
    hd = x.shape[-1]
    half = hd // 2
    inv = ref_inv_freq(hd, theta, scaling)
    angle = positions.to(F64)[:, None] * inv[None]
    c, s = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def ref_block_logits(sd, cfg: DFlashDraftConfig, feats, root, embed_w, head_w, scaling=None):
    """Logits of block positions 1..B-1, the block [root, MASK...] right after ``feats``."""
    eps, hd = cfg.rms_norm_eps, cfg.head_dim
    nh, nkv, big_b = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.block_size
    s = feats.shape[0]
    ctx = ref_rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    x = embed_w[[root] + [cfg.mask_token_id] * (big_b - 1)]
    pos_blk = torch.arange(s, s + big_b)
    pos_key = torch.arange(s + big_b)  # context positions first, then the block
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."

        def lin(t, name, p=p):
            out = t @ sd[p + name + ".weight"].T
            return out + sd[p + name + ".bias"] if cfg.attention_bias else out

        h = ref_rms(x, sd[p + "input_layernorm.weight"], eps)
        q = ref_rms(lin(h, "self_attn.q_proj").view(big_b, nh, hd), sd[p + "self_attn.q_norm.weight"], eps)
        q = ref_rope(q, pos_blk, cfg.rope_theta, scaling)
        kv_in = torch.cat([ctx, h], 0)  # ctx gets no input_layernorm
        k = ref_rms(lin(kv_in, "self_attn.k_proj").view(s + big_b, nkv, hd), sd[p + "self_attn.k_norm.weight"], eps)
        k = ref_rope(k, pos_key, cfg.rope_theta, scaling)
        v = lin(kv_in, "self_attn.v_proj").view(s + big_b, nkv, hd)
        allowed = torch.ones(big_b, s + big_b, dtype=torch.bool)
        if cfg.layer_types[i] == "sliding_attention":
            allowed = (pos_blk[:, None] - pos_key[None, :]) < cfg.sliding_window
        heads = []
        for head in range(nh):
            g = head // (nh // nkv)
            scores = (q[:, head] @ k[:, g].T) / math.sqrt(hd)
            scores = scores.masked_fill(~allowed, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v[:, g])
        x = x + lin(torch.cat(heads, -1), "self_attn.o_proj")
        y = ref_rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = y @ sd[p + "mlp.gate_proj.weight"].T, y @ sd[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    out = ref_rms(x, sd["norm.weight"], eps)
    return out[1:] @ head_w.T


def random_drafter(seed, vocab=40, hidden=32, **cfg):
    fields = {"hidden_size": hidden, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": vocab, "block_size": 5, "mask_token_id": vocab - 3,
              "target_layer_ids": [0, 2], "rope_theta": 10000.0}
    fields.update(cfg)
    config = DFlashDraftConfig(**fields)
    torch.manual_seed(seed)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.25)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
    model = model.to(F64).eval()
    embed = torch.nn.Embedding(vocab, hidden).to(F64)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(F64)
    with torch.no_grad():
        embed.weight.normal_(0, 1.0)
        head.weight.normal_(0, 0.5)
    return model, embed, head


MATH_CASES = {
    "mha-1layer": ({"num_key_value_heads": 4, "num_hidden_layers": 1, "block_size": 4}, [6]),
    "gqa-2": ({"num_key_value_heads": 2, "block_size": 6}, [9, 1, 4]),
    "mqa-3layers": ({"num_key_value_heads": 1, "num_hidden_layers": 3, "block_size": 3}, [2, 2, 2]),
    "sliding-3": ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 3, "block_size": 6},
                  [10, 3, 1]),
    "sliding-1-all": ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 1, "block_size": 4}, [7, 2]),
    "sliding-big": ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                     "num_key_value_heads": 1, "block_size": 16}, [12, 5, 9]),
    "bias-headdim16-3ids": ({"attention_bias": True, "head_dim": 16, "target_layer_ids": [0, 1, 3], "block_size": 7},
                            [4, 6]),
    "block2-one-context": ({"block_size": 2}, [1, 1, 1, 1]),
    "linear-rope": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "block_size": 5}, [8, 3]),
    # Llama-3.1 drafters carry the target's llama3 rope scaling; the window puts the
    # head_dim 32 frequencies in all three bands (kept, scaled, smoothed).
    "llama3-rope": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                     "head_dim": 32, "block_size": 4, "rope_theta": 500000.0}, [40, 30]),
}


@pytest.mark.parametrize("case", list(MATH_CASES))
def test_block_logits_match_plain_reference_incrementally(case):
    overrides, chunks = MATH_CASES[case]
    model, embed, head = random_drafter(list(MATH_CASES).index(case), **overrides)
    cfg = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(7)
    feats_all = torch.randn(sum(chunks), cfg.num_context_features, generator=gen, dtype=F64)
    proposer = DFlashProposer(model, embed, head)
    seen = 0
    for step, n in enumerate(chunks):
        root = (3 * step + 1) % cfg.vocab_size
        got = proposer.propose(root, feats_all[seen: seen + n])
        seen += n
        expected = ref_block_logits(sd, cfg, feats_all[:seen], root, embed.weight.detach(), head.weight.detach(),
                                    cfg.rope_scaling)
        assert got.shape == (cfg.block_size - 1, cfg.vocab_size)
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
        # Incremental context cache == recomputing everything from scratch.
        fresh = DFlashProposer(model, embed, head)
        torch.testing.assert_close(fresh.propose(root, feats_all[:seen]), got, atol=1e-12, rtol=0)
        assert proposer.context_len == proposer.cache.length == seen
    # propose() never leaves block K/V behind: a repeat call with no new context is identical.
    again = proposer.propose(root, feats_all[:0])
    torch.testing.assert_close(again, got, atol=0, rtol=0)


def test_sliding_window_bites():
    """The sliding-window case above is meaningful: the window changes the logits."""
    kw = {"block_size": 6, "sliding_window": 3}
    slide, embed, head = random_drafter(1, layer_types=["full_attention", "sliding_attention"], **kw)
    full, _, _ = random_drafter(1, layer_types=["full_attention", "full_attention"], **kw)
    full.load_state_dict(slide.state_dict())
    feats = torch.randn(10, slide.config.num_context_features, generator=torch.Generator().manual_seed(0), dtype=F64)
    a = DFlashProposer(slide, embed, head).propose(2, feats)
    b = DFlashProposer(full, embed, head).propose(2, feats)
    assert (a - b).abs().max() > 1e-3


def test_reference_is_sensitive():
    """The plain reference itself distinguishes the details it claims to check."""
    model, embed, head = random_drafter(3, block_size=4)
    cfg = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    feats = torch.randn(5, cfg.num_context_features, generator=torch.Generator().manual_seed(1), dtype=F64)
    got = DFlashProposer(model, embed, head).propose(4, feats)
    base = ref_block_logits(sd, cfg, feats, 4, embed.weight.detach(), head.weight.detach())
    torch.testing.assert_close(got, base, atol=1e-10, rtol=0)
    # Wrong positions (block first), or an input_layernorm applied to the context, change the result.
    shifted = ref_block_logits(sd, cfg, feats, 4, embed.weight.detach(), head.weight.detach(),
                               {"rope_type": "linear", "factor": 1.5})
    assert (shifted - base).abs().max() > 1e-4
    sd2 = dict(sd)
    sd2["hidden_norm.weight"] = sd["hidden_norm.weight"] * 1.1
    assert (ref_block_logits(sd2, cfg, feats, 4, embed.weight.detach(), head.weight.detach()) - got).abs().max() > 1e-4


def test_propose_on_real_target_uses_target_embedding_and_head():
    target = cached_target("qwen3", seed=0, vocab=32)
    drafter = tiny_drafter(target, block_size=5, seed=2, layers=2)
    proposer = DFlashProposer.for_target(drafter, target)
    assert proposer.embed_tokens is target.get_input_embeddings()
    feats = torch.randn(6, drafter.config.num_context_features, generator=torch.Generator().manual_seed(2), dtype=F64)
    got = proposer.propose(7, feats)
    sd = {k: v.detach() for k, v in drafter.state_dict().items()}
    expected = ref_block_logits(sd, drafter.config, feats, 7, target.get_input_embeddings().weight.detach(),
                                target.get_output_embeddings().weight.detach())
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)


# ------------------------------------------------------------------ target layer ids


@pytest.mark.parametrize("lt,n,expected", [
    (36, 5, [1, 9, 17, 25, 33]),
    (28, 5, [1, 7, 13, 19, 25]),
    (30, 5, [1, 8, 14, 20, 27]),  # SmolLM2-135M (FACTS.md section 7)
    (36, 1, [18]),
    (4, 2, [1, 1]),
])
def test_build_target_layer_ids(lt, n, expected):
    assert build_target_layer_ids(lt, n) == expected


def test_from_dict_derives_layer_ids_when_absent():
    raw = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 5, "num_attention_heads": 4,
           "vocab_size": 40, "block_size": 4, "num_target_layers": 36, "dflash_config": {"mask_token_id": 39}}
    assert DFlashDraftConfig.from_dict(raw).target_layer_ids == [1, 9, 17, 25, 33]
    raw["dflash_config"]["target_layer_ids"] = [2, 4]
    assert DFlashDraftConfig.from_dict(raw).target_layer_ids == [2, 4]  # explicit ids win


# ------------------------------------------------------------------ checkpoint format


def test_save_load_round_trip_gives_identical_logits(tmp_path):
    model, embed, head = random_drafter(11, attention_bias=False, layer_types=["full_attention", "sliding_attention"],
                                        sliding_window=4)
    feats = torch.randn(7, model.config.num_context_features, generator=torch.Generator().manual_seed(3), dtype=F64)
    before = DFlashProposer(model, embed, head).propose(5, feats)
    save_dflash_drafter(model, tmp_path, dtype=F64)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"] == {"mask_token_id": 37, "target_layer_ids": [0, 2]}
    assert raw["block_size"] == 5 and raw["layer_types"] == ["full_attention", "sliding_attention"]
    assert raw["use_sliding_window"] is True and raw["sliding_window"] == 4
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert len(tensors) == 11 * 2 + 3 and "fc.weight" in tensors and "layers.1.self_attn.k_norm.weight" in tensors
    assert not any(k.startswith("model.") for k in tensors)
    loaded = load_dflash_drafter(tmp_path, dtype=F64)
    after = DFlashProposer(loaded, embed, head).propose(5, feats)
    assert torch.equal(before, after)
    assert loaded.config.layer_types == model.config.layer_types and loaded.config.sliding_window == 4


def test_bf16_export_and_model_prefix(tmp_path):
    model, embed, head = random_drafter(12)
    save_dflash_drafter(model, tmp_path, dtype=torch.bfloat16)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    save_file({"model." + k: v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    loaded = load_dflash_drafter(tmp_path, dtype=F64)  # an optional "model." prefix is accepted
    for name, value in model.state_dict().items():
        if name in tensors:
            assert torch.equal(loaded.state_dict()[name], value.to(torch.bfloat16).to(F64)), name


def _edit_checkpoint(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_tensor_is_named(tmp_path):
    model, _, _ = random_drafter(13)
    save_dflash_drafter(model, tmp_path, dtype=F64)
    _edit_checkpoint(tmp_path, lambda t: t.pop("layers.1.mlp.up_proj.weight"))
    with pytest.raises(DFlashConfigError, match=r"missing tensors \['layers.1.mlp.up_proj.weight'\]"):
        load_dflash_drafter(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    model, _, _ = random_drafter(14)
    save_dflash_drafter(model, tmp_path, dtype=F64)
    _edit_checkpoint(tmp_path, lambda t: t.update({"lm_head.weight": torch.zeros(40, 32, dtype=F64)}))
    with pytest.raises(DFlashConfigError, match=r"unexpected tensors \['lm_head.weight'\]"):
        load_dflash_drafter(tmp_path)


def test_missing_and_unexpected_together_and_bad_shape(tmp_path):
    model, _, _ = random_drafter(15)
    save_dflash_drafter(model, tmp_path, dtype=F64)

    def edit(t):
        t["layers.0.self_attn.q_proj.weight.extra"] = t.pop("layers.0.self_attn.q_proj.weight")

    _edit_checkpoint(tmp_path, edit)
    with pytest.raises(DFlashConfigError) as err:
        load_dflash_drafter(tmp_path)
    msg = str(err.value)
    assert "missing tensors ['layers.0.self_attn.q_proj.weight']" in msg
    assert "unexpected tensors ['layers.0.self_attn.q_proj.weight.extra']" in msg
    save_dflash_drafter(model, tmp_path, dtype=F64)
    _edit_checkpoint(tmp_path, lambda t: t.update({"fc.weight": torch.zeros(32, 65, dtype=F64)}))
    with pytest.raises(DFlashConfigError, match=r"tensor fc.weight has shape \(32, 65\), config.json implies \(32, 64\)"):
        load_dflash_drafter(tmp_path)


def test_block_size_below_two_in_config_json(tmp_path):
    model, _, _ = random_drafter(16)
    save_dflash_drafter(model, tmp_path, dtype=F64)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["block_size"] = 1
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DFlashConfigError, match="block_size=1 is invalid"):
        load_dflash_drafter(tmp_path)


def test_missing_files_and_keys(tmp_path):
    with pytest.raises(DFlashConfigError, match="has no config.json"):
        load_dflash_drafter(tmp_path)
    model, _, _ = random_drafter(17)
    model.config.save(tmp_path)
    with pytest.raises(DFlashConfigError, match="has no model.safetensors"):
        load_dflash_drafter(tmp_path)
    raw = model.config.to_dict()
    del raw["dflash_config"]["mask_token_id"]
    with pytest.raises(DFlashConfigError, match="dflash_config.mask_token_id"):
        DFlashDraftConfig.from_dict(raw)
    raw = model.config.to_dict()
    del raw["hidden_size"]
    with pytest.raises(DFlashConfigError, match=r"missing \['hidden_size'\]"):
        DFlashDraftConfig.from_dict(raw)


# ------------------------------------------------------------------ validation messages


@pytest.fixture
def config():
    return random_drafter(0, vocab=40, hidden=32)[0].config


def test_hidden_size_mismatch(config):
    with pytest.raises(DFlashConfigError) as err:
        config.validate_for_target(hidden_size=48, vocab_size=40, num_hidden_layers=4)
    assert "hidden_size" in str(err.value) and "drafter hidden_size=32" in str(err.value)
    assert "target hidden_size=48" in str(err.value)


def test_vocab_mismatch(config):
    with pytest.raises(DFlashConfigError) as err:
        config.validate_for_target(hidden_size=32, vocab_size=41, num_hidden_layers=4)
    assert "drafter vocab_size=40" in str(err.value) and "target vocab_size=41" in str(err.value)


@pytest.mark.parametrize("ids,bad", [([0, 4], [4]), ([-1, 2], [-1]), ([9, 1, 7], [9, 7])])
def test_target_layer_ids_out_of_range(config, ids, bad):
    config.target_layer_ids = ids
    with pytest.raises(DFlashConfigError) as err:
        config.validate_for_target(hidden_size=32, vocab_size=40, num_hidden_layers=4)
    msg = str(err.value)
    assert f"target_layer_ids={ids}" in msg and f"has {bad}" in msg and "num_hidden_layers=4" in msg


def test_a_drafter_made_for_a_target_of_another_depth(config):
    """Hidden size and vocabulary can agree across depths (Qwen3-14B and -32B): num_target_layers tells them apart."""
    config.num_target_layers = 6
    with pytest.raises(DFlashConfigError) as err:
        config.validate_for_target(hidden_size=32, vocab_size=40, num_hidden_layers=4)
    msg = str(err.value)
    assert msg.startswith("num_target_layers=6: this drafter was made for a target of 6 layers, but the target has "
                          "num_hidden_layers=4") and "set num_target_layers to 4" in msg
    config.validate_for_target(hidden_size=32, vocab_size=40, num_hidden_layers=6)
    config.num_target_layers = None  # not stated: nothing to compare
    config.validate_for_target(hidden_size=32, vocab_size=40, num_hidden_layers=4)


@pytest.mark.parametrize("mask,rows", [(40, None), (-1, None), (45, 45)])
def test_mask_token_outside_embedding(config, mask, rows):
    config.mask_token_id = mask
    with pytest.raises(DFlashConfigError) as err:
        config.validate_for_target(hidden_size=32, vocab_size=40, num_hidden_layers=4, embedding_rows=rows)
    msg = str(err.value)
    limit = 40 if rows is None else rows
    assert f"mask_token_id={mask}" in msg and f"embedding rows={limit}" in msg and f"0..{limit - 1}" in msg


def test_valid_target_passes(config):
    config.validate_for_target(hidden_size=32, vocab_size=40, num_hidden_layers=3)
    config.mask_token_id = 44  # an unused row beyond the tokenizer but inside the embedding
    config.validate_for_target(hidden_size=32, vocab_size=40, num_hidden_layers=3, embedding_rows=48)


@pytest.mark.parametrize("overrides,match", [
    ({"block_size": 1}, "block_size=1 is invalid"),
    ({"block_size": 0}, "block_size=0 is invalid"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries but num_hidden_layers=2"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types\[1\]='sliding_attention' needs sliding_window"),
    ({"layer_types": ["full_attention", "chunked"]}, r"layer_types\[1\]='chunked' is not supported"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"target_layer_ids": []}, "target_layer_ids is empty"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_config_validation_messages(overrides, match):
    fields = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 40, "block_size": 4, "mask_token_id": 39,
              "target_layer_ids": [1]}
    fields.update(overrides)
    with pytest.raises(DFlashConfigError, match=match):
        DFlashDraftConfig(**fields)


@pytest.mark.parametrize("cast", ["to", "bfloat16", "half", "load"])
def test_low_precision_keeps_exact_rope_frequencies(cast, tmp_path):
    """model.to(bf16) used to cast the rotary frequencies too: the angle at position p became
    p * round_bf16(inv_freq), 0.14 rad off at 100 and 2.8 rad at 2000, so bf16 drafts got worse as
    the context grew. The frequencies stay float64 whatever the weights' dtype."""
    model, _, _ = random_drafter(4, max_position_embeddings=4096, head_dim=64, rope_theta=1_000_000.0)
    exact = model.rotary_emb.inv_freq.clone()
    assert exact.dtype == F64
    dtype = torch.float16 if cast == "half" else torch.bfloat16
    if cast == "to":
        low = copy.deepcopy(model).to(device="cpu", dtype=dtype)
    elif cast == "load":
        save_dflash_drafter(model, tmp_path, dtype=torch.float32)
        low = load_dflash_drafter(tmp_path, dtype=dtype)
    else:
        low = getattr(copy.deepcopy(model), cast)()
    assert next(low.parameters()).dtype == dtype
    assert low.rotary_emb.inv_freq.dtype == F64 and torch.equal(low.rotary_emb.inv_freq, exact)
    positions = torch.tensor([[0, 100, 500, 2000]])
    cos, sin = low.rotary_emb(positions, dtype)
    angles = positions.to(F64)[..., None] * exact
    want_cos, want_sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    # Only the final rounding of cos/sin to the low precision remains (half an ulp of 1: 2^-9 in bf16).
    assert float((cos.to(F64) - want_cos).abs().max()) <= 2.0 ** -8
    assert float((sin.to(F64) - want_sin).abs().max()) <= 2.0 ** -8
