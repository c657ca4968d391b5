"""Checkpoint conversion for the TensorRT-LLM engine, verified without TensorRT-LLM.

A plain-PyTorch reference model reads the converted checkpoint by its TensorRT-LLM
names (``transformer.layers.N.attention.qkv`` ...), merges the tensor-parallel shards by
the TP rules, and must reproduce the HF target's logits and the DFlash drafter's block
logits (vs ``DFlashProposer``) to 1e-5 in float32.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tensorrt_llm_dflash.config import DFlashDraftConfig
from tensorrt_llm_dflash.drafter import DFlashDraftModel, save_dflash_drafter
from tensorrt_llm_dflash.proposer import DFlashProposer
from tensorrt_llm_dflash.target import HFTargetVerifier
from tensorrt_llm_dflash.trtllm.weight import DRAFTER_PREFIX, convert_checkpoint, pad_vocab_size

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


# --------------------------------------------------------------------- tiny models


def make_target(arch: str, *, vocab: int, kv_heads: int, seed: int = 0):
    """A tiny random fp32 HF target (same recipe as tests/tiny_models.py, float32)."""
    torch.manual_seed(seed)
    common = {
        "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": kv_heads, "max_position_embeddings": 128,
        "attn_implementation": "sdpa", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
        "rope_theta": 10000.0,
    }
    return random_hf_target(arch, common, head_dim=8).float().eval()


def random_hf_target(arch: str, common: dict, head_dim: int) -> torch.nn.Module:
    """Qwen3 (untied lm_head) or Llama (tied) from ``common`` config fields, weights N(0, 0.3),
    norms U(0.5, 1.5), drawn from torch's current seed."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=head_dim, tie_word_embeddings=False, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(head_dim=head_dim, tie_word_embeddings=True, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def make_drafter(target, *, layers: int = 2, block_size: int = 4, draft_vocab: int | None = None,
                 seed: int = 0, **overrides) -> DFlashDraftModel:
    c = target.config
    fields = {
        "hidden_size": c.hidden_size, "intermediate_size": 48, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": c.vocab_size,
        "block_size": block_size, "mask_token_id": c.vocab_size - 1, "target_layer_ids": [0, 2, 3],
        "num_target_layers": c.num_hidden_layers, "rope_theta": 5000.0,
        "max_position_embeddings": c.max_position_embeddings, "draft_vocab_size": draft_vocab,
    }
    fields.update(overrides)
    torch.manual_seed(1000 + seed)
    model = DFlashDraftModel(DFlashDraftConfig(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
        if draft_vocab is not None:
            # Draft token i -> target id i + d2t[i]: every other id, then the tail.
            ids = torch.cat([torch.arange(0, c.vocab_size, 2), torch.arange(1, c.vocab_size, 2)])[:draft_vocab]
            ids = ids.sort().values
            model.d2t = ids - torch.arange(draft_vocab)
    return model.float().eval()


# ------------------------------------------------------------- reference (TRT names)


def read_checkpoint(ckpt: Path) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    config = json.loads((ckpt / "config.json").read_text())
    world = config["mapping"]["world_size"]
    return config, [load_file(str(ckpt / f"rank{r}.safetensors")) for r in range(world)]


def _heads(config: dict, name: str) -> tuple[int, int, int]:
    sub = config["dflash"] if name.startswith(DRAFTER_PREFIX) else config
    return sub["num_attention_heads"], sub["num_key_value_heads"], sub["head_size"]


def merge_shards(config: dict, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Undo the TP split: qkv per head group (dropping duplicated KV heads), dense/proj on
    dim 1, fc/gate/lm_head on dim 0 (vocab padding removed), everything else replicated."""
    tp = config["mapping"]["tp_size"]
    assert all(set(s) == set(shards[0]) for s in shards), "every rank must hold the same names"
    merged: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        if name.endswith(("attention.qkv.weight", "attention.qkv.bias")):
            heads, kv, d = _heads(config, name)
            q_local, kv_local = heads // tp * d, max(kv // tp, 1) * d
            if (not name.startswith(DRAFTER_PREFIX) and config.get("qk_layernorm")
                    and heads // tp == max(kv // tp, 1) > 1):
                # TensorRT-LLM's Attention reads this case per head: undo weight.interleave_heads.
                h = heads // tp
                parts = [p.reshape(h, 3, d, *p.shape[1:]).transpose(0, 1).reshape(p.shape) for p in parts]
            qs, ks, vs = zip(*(p.split([q_local, kv_local, kv_local], 0) for p in parts))
            owners = range(0, tp, tp // kv) if kv < tp else range(tp)  # one rank per distinct KV head
            for r in range(tp):  # duplicated KV heads must really be copies
                owner = r - r % (tp // kv) if kv < tp else r
                assert torch.equal(ks[r], ks[owner]) and torch.equal(vs[r], vs[owner])
            merged[name] = torch.cat([torch.cat(qs), torch.cat([ks[r] for r in owners]),
                                      torch.cat([vs[r] for r in owners])])
        elif name.endswith(("attention.dense.weight", "mlp.proj.weight")):
            merged[name] = torch.cat(parts, dim=1)
        elif name.endswith(("mlp.fc.weight", "mlp.gate.weight", "lm_head.weight")):
            rows = torch.cat(parts, dim=0)
            if name == "lm_head.weight":
                assert rows.shape[0] == pad_vocab_size(config["vocab_size"], tp)
                assert not rows[config["vocab_size"]:].any(), "vocab padding rows must be zero"
                rows = rows[: config["vocab_size"]]
            elif name == DRAFTER_PREFIX + "lm_head.weight":
                rows = rows[: config["dflash"]["draft_vocab_size"]]
            merged[name] = rows
        else:
            for p in parts[1:]:
                assert torch.equal(p, parts[0]), f"{name} must be replicated on every rank"
            merged[name] = parts[0]
    return merged


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """rope_gpt_neox: rotate halves. x [heads, T, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = positions.double()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def attention_block(W: dict, p: str, sub: dict, q_in, kv_in, q_pos, kv_pos, causal: bool, eps: float,
                    base: float, qk_norm: bool) -> torch.Tensor:
    heads, kv, d = sub["num_attention_heads"], sub["num_key_value_heads"], sub["head_size"]
    w = W[p + "attention.qkv.weight"]
    b = W.get(p + "attention.qkv.bias")
    wq, wk, wv = w.split([heads * d, kv * d, kv * d])
    bq, bk, bv = b.split([heads * d, kv * d, kv * d]) if b is not None else (None, None, None)
    q = F.linear(q_in, wq, bq).view(-1, heads, d).transpose(0, 1)
    k = F.linear(kv_in, wk, bk).view(-1, kv, d).transpose(0, 1)
    v = F.linear(kv_in, wv, bv).view(-1, kv, d).transpose(0, 1)
    if qk_norm:
        q = rms(q, W[p + "attention.q_layernorm.weight"], eps)
        k = rms(k, W[p + "attention.k_layernorm.weight"], eps)
    q, k = rope(q, q_pos, base), rope(k, kv_pos, base)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(kv_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(q_in.shape[0], heads * d)
    return F.linear(out, W[p + "attention.dense.weight"], W.get(p + "attention.dense.bias"))


def gated_mlp(W: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    # tensorrt_llm/layers/mlp.py GatedMLP: proj(silu(fc(x)) * gate(x))
    return F.linear(F.silu(F.linear(x, W[p + "mlp.fc.weight"])) * F.linear(x, W[p + "mlp.gate.weight"]),
                    W[p + "mlp.proj.weight"])


def reference_target(config: dict, W: dict, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits [T, vocab] and each decoder layer's output (the last one after ln_f, as HF reports it)."""
    eps, base = config["norm_epsilon"], config["rotary_base"]
    x = W["transformer.vocab_embedding.weight"][torch.tensor(ids)]
    pos = torch.arange(len(ids))
    outputs = []
    for layer in range(config["num_hidden_layers"]):
        p = f"transformer.layers.{layer}."
        h = rms(x, W[p + "input_layernorm.weight"], eps)
        x = x + attention_block(W, p, config, h, h, pos, pos, True, eps, base, config["qk_layernorm"])
        x = x + gated_mlp(W, p, rms(x, W[p + "post_layernorm.weight"], eps))
        outputs.append(x)
    final = rms(x, W["transformer.ln_f.weight"], eps)
    outputs[-1] = final
    return F.linear(final, W["lm_head.weight"]), outputs


def reference_draft(config: dict, W: dict, features: torch.Tensor, root: int) -> torch.Tensor:
    """DFlash block logits [block_size - 1, draft vocab] for a context of ``features`` [S, F]."""
    sub = config["dflash"]
    eps, base, block = sub["norm_epsilon"], sub["rotary_base"], sub["block_size"]
    ctx = rms(F.linear(features, W[DRAFTER_PREFIX + "fc.weight"]), W[DRAFTER_PREFIX + "hidden_norm.weight"], eps)
    s = features.shape[0]
    ids = torch.full((block,), sub["mask_token_id"])
    ids[0] = root
    x = W["transformer.vocab_embedding.weight"][ids]
    q_pos, kv_pos = torch.arange(s, s + block), torch.arange(s + block)
    for layer in range(sub["num_hidden_layers"]):
        p = f"{DRAFTER_PREFIX}layers.{layer}."
        h = rms(x, W[p + "input_layernorm.weight"], eps)
        x = x + attention_block(W, p, sub, h, torch.cat([ctx, h]), q_pos, kv_pos, False, eps, base, True)
        x = x + gated_mlp(W, p, rms(x, W[p + "post_layernorm.weight"], eps))
    out = rms(x, W[DRAFTER_PREFIX + "norm.weight"], eps)[1:]
    head = W.get(DRAFTER_PREFIX + "lm_head.weight", W["lm_head.weight"])
    return F.linear(out, head)


# ----------------------------------------------------------------------------- tests


CASES = [
    # arch, vocab, kv heads, tp, draft vocab
    ("qwen3", 64, 2, 1, None),
    ("qwen3", 67, 2, 2, None),  # vocab padded to 68
    ("qwen3", 67, 2, 4, None),  # fewer KV heads than ranks: duplicated
    ("llama", 64, 2, 1, None),  # tied embeddings
    ("llama", 63, 1, 2, 40),  # one KV head duplicated, reduced draft vocabulary
]


@pytest.mark.parametrize("arch,vocab,kv,tp,draft_vocab", CASES)
def test_converted_checkpoint_reproduces_target_and_drafter(tmp_path, arch, vocab, kv, tp, draft_vocab):
    target = make_target(arch, vocab=vocab, kv_heads=kv)
    drafter = make_drafter(target, draft_vocab=draft_vocab)
    target.save_pretrained(tmp_path / "target", safe_serialization=True)
    save_dflash_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)

    config = convert_checkpoint(tmp_path / "target", tmp_path / "drafter", tmp_path / "ckpt",
                                dtype="float32", tp_size=tp, progress=False)
    assert config["architecture"] == "DFlashForCausalLM"
    assert config["mapping"] == {"world_size": tp, "tp_size": tp, "pp_size": 1}
    assert config["qk_layernorm"] is (arch == "qwen3")
    assert config["dflash"]["target_layer_ids"] == [0, 2, 3]
    on_disk, shards = read_checkpoint(tmp_path / "ckpt")
    assert on_disk == json.loads(json.dumps(config))
    lm_rows = pad_vocab_size(vocab, tp) // tp
    assert all(s["lm_head.weight"].shape == (lm_rows, 32) for s in shards)
    assert all(s["transformer.layers.0.attention.qkv.weight"].shape[0] == (4 // tp + 2 * max(kv // tp, 1)) * 8
               for s in shards)
    W = merge_shards(config, shards)

    prompt = [3, 17, 5, 9, 30, 2, 11]
    with torch.no_grad():
        ref_logits, ref_layers = reference_target(config, W, prompt)
        hf_logits = target(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ref_logits, hf_logits, atol=TOL, rtol=TOL)

    verifier = HFTargetVerifier(target, drafter.config.target_layer_ids)
    last, features = verifier.prefill(prompt)
    ref_features = torch.cat([ref_layers[i] for i in drafter.config.target_layer_ids], -1)
    torch.testing.assert_close(ref_features, features, atol=TOL, rtol=TOL)
    root = int(last.argmax())
    proposer = DFlashProposer.for_target(drafter, target)
    draft = proposer.propose(root, features)
    with torch.no_grad():
        ref_draft = reference_draft(config, W, ref_features, root)
    if draft_vocab is None:
        torch.testing.assert_close(ref_draft, draft, atol=TOL, rtol=TOL)
    else:
        ids = drafter.draft_token_ids()
        torch.testing.assert_close(ref_draft, draft[:, ids], atol=TOL, rtol=TOL)
        assert torch.equal(shards[0][DRAFTER_PREFIX + "d2t"], drafter.d2t.to(torch.int32))


def test_gate_up_naming_follows_trtllm(tmp_path):
    """mlp.fc is HF gate_proj (the activated branch) and mlp.gate is up_proj, as in
    TensorRT-LLM's qwen/llama converters."""
    target = make_target("qwen3", vocab=64, kv_heads=2)
    target.save_pretrained(tmp_path / "target", safe_serialization=True)
    save_dflash_drafter(make_drafter(target), tmp_path / "drafter", dtype=torch.float32)
    convert_checkpoint(tmp_path / "target", tmp_path / "drafter", tmp_path / "ckpt", dtype="float32",
                       progress=False)
    shard = load_file(str(tmp_path / "ckpt" / "rank0.safetensors"))
    mlp = target.model.layers[1].mlp
    assert torch.equal(shard["transformer.layers.1.mlp.fc.weight"], mlp.gate_proj.weight)
    assert torch.equal(shard["transformer.layers.1.mlp.gate.weight"], mlp.up_proj.weight)
    assert torch.equal(shard["transformer.layers.1.post_layernorm.weight"],
                       target.model.layers[1].post_attention_layernorm.weight)


def test_bfloat16_and_progress_output(tmp_path):
    target = make_target("llama", vocab=64, kv_heads=2)
    target.save_pretrained(tmp_path / "target", safe_serialization=True)
    save_dflash_drafter(make_drafter(target), tmp_path / "drafter", dtype=torch.bfloat16)
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "convert_checkpoint.py"), "--model_dir", str(tmp_path / "target"),
         "--dflash_model_dir", str(tmp_path / "drafter"), "--output_dir", str(tmp_path / "ckpt"),
         "--dtype", "bfloat16", "--tp_size", "2"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "converting ranks" in result.stderr  # the tqdm bar
    shards = [load_file(str(tmp_path / "ckpt" / f"rank{r}.safetensors")) for r in range(2)]
    assert all(t.dtype == torch.bfloat16 for s in shards for t in s.values())
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "bfloat16"


MISMATCHES = [
    ({"hidden_size": 48, "head_dim": 12}, "hidden_size mismatch: drafter hidden_size=48, target hidden_size=32"),
    ({"vocab_size": 80, "mask_token_id": 63}, "vocab_size mismatch: drafter vocab_size=80, target vocab_size=64"),
    ({"target_layer_ids": [1, 4, 7]}, "target_layer_ids=[1, 4, 7] has [4, 7] outside the target's layers 0..3"),
]


@pytest.mark.parametrize("overrides,message", MISMATCHES, ids=["hidden_size", "vocab", "target_layer_ids"])
def test_mismatched_drafter_exits_nonzero(tmp_path, overrides, message):
    target = make_target("qwen3", vocab=64, kv_heads=2)
    target.save_pretrained(tmp_path / "target", safe_serialization=True)
    # A drafter built for another target: same recipe, one size changed.
    fields = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "block_size": 4, "mask_token_id": 63,
              "target_layer_ids": [0, 2, 3], "rope_theta": 5000.0}
    fields.update(overrides)
    save_dflash_drafter(DFlashDraftModel(DFlashDraftConfig(**fields)), tmp_path / "drafter", dtype=torch.float32)
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "convert_checkpoint.py"), "--model_dir", str(tmp_path / "target"),
         "--dflash_model_dir", str(tmp_path / "drafter"), "--output_dir", str(tmp_path / "ckpt"), "--no_progress"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "ckpt").exists(), "nothing is written for a mismatched drafter"


def test_uneven_tensor_parallelism_is_refused(tmp_path):
    target = make_target("qwen3", vocab=64, kv_heads=2)
    target.save_pretrained(tmp_path / "target", safe_serialization=True)
    save_dflash_drafter(make_drafter(target), tmp_path / "drafter", dtype=torch.float32)
    from tensorrt_llm_dflash.errors import DFlashConfigError

    with pytest.raises(DFlashConfigError, match="num_attention_heads=4 is not divisible by tp_size=3"):
        convert_checkpoint(tmp_path / "target", tmp_path / "drafter", tmp_path / "ckpt", tp_size=3, progress=False)
    with pytest.raises(DFlashConfigError, match="pp_size=2 is not supported"):
        convert_checkpoint(tmp_path / "target", tmp_path / "drafter", tmp_path / "ckpt", pp_size=2, progress=False)


@pytest.fixture
def saved_pair(tmp_path):
    target = make_target("llama", vocab=64, kv_heads=2)
    target.save_pretrained(tmp_path / "target", safe_serialization=True)
    save_dflash_drafter(make_drafter(target), tmp_path / "drafter", dtype=torch.float32)
    return tmp_path / "target", tmp_path / "drafter"


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def test_bad_conversions_are_refused_by_name(tmp_path, saved_pair):
    from tensorrt_llm_dflash.errors import DFlashConfigError

    target_dir, drafter_dir = saved_pair
    out = tmp_path / "ckpt"

    def refused(match: str, target=target_dir, **kwargs) -> None:
        with pytest.raises(DFlashConfigError, match=match):
            convert_checkpoint(target, drafter_dir, out, progress=False, **kwargs)

    refused(r"max_draft_len=2 is out of range 3\.\.256", max_draft_len=2)
    refused(r"max_draft_len=257 is out of range 3\.\.256", max_draft_len=257)
    refused(r"dtype='float8' is not one of", dtype="float8")
    refused(r"tp_size=0 and pp_size=1 must be >= 1", tp_size=0)
    refused("has no config.json", target=tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((target_dir / "config.json").read_text())
    refused("has no \\*.safetensors files", target=empty)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    refused("target model_type='gpt2' is not supported", target=gpt2)
    assert not out.exists()


def test_untied_target_without_lm_head_and_missing_tensors(tmp_path, saved_pair):
    from safetensors.torch import load_file, save_file

    from tensorrt_llm_dflash.errors import DFlashConfigError

    target_dir, drafter_dir = saved_pair
    _edit_config(target_dir, tie_word_embeddings=False)
    with pytest.raises(DFlashConfigError, match="target has no lm_head.weight and tie_word_embeddings is false"):
        convert_checkpoint(target_dir, drafter_dir, tmp_path / "ckpt", progress=False)
    _edit_config(target_dir, tie_word_embeddings=True)
    tensors = load_file(str(target_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(target_dir / "model.safetensors"))
    with pytest.raises(DFlashConfigError, match="checkpoint tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
        convert_checkpoint(target_dir, drafter_dir, tmp_path / "ckpt", progress=False)


def test_sharded_target_and_attention_biases(tmp_path):
    """An index-sharded HF checkpoint with q/k/v and o_proj biases (Llama attention_bias): the
    biases are fused like the weights (o_proj's is replicated: RowLinear adds it once)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                          torch_dtype="float32")).eval()
    directory = tmp_path / "target"
    target.config.save_pretrained(directory)
    state = {k: v.contiguous() for k, v in target.state_dict().items()}
    names = sorted(state)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(directory / file))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    save_dflash_drafter(make_drafter(target), tmp_path / "drafter", dtype=torch.float32)
    config = convert_checkpoint(directory, tmp_path / "drafter", tmp_path / "ckpt", tp_size=2, progress=False)
    assert config["dtype"] == "float32"  # "auto": the target's own dtype
    config, shards = read_checkpoint(tmp_path / "ckpt")
    merged = merge_shards(config, shards)
    attn = target.model.layers[0].self_attn
    expected = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    torch.testing.assert_close(merged["transformer.layers.0.attention.qkv.bias"], expected)
    torch.testing.assert_close(merged["transformer.layers.0.attention.dense.bias"], attn.o_proj.bias)


# ------------------------------------------------------- refusals before the weights load


def _convert_cli(argv: list[str], capsys) -> tuple[int, str]:
    """examples/convert_checkpoint.py's main in this process: (exit status, stderr)."""
    from example_cli import load_example

    try:
        code = load_example("convert_checkpoint").main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.fixture
def no_weights_read(monkeypatch):
    """Reading any weight file raises: what is refused here must be refused from the configs alone."""
    import safetensors

    from tensorrt_llm_dflash import drafter
    from tensorrt_llm_dflash.trtllm import weight

    def trap(*_args, **_kwargs):
        raise AssertionError("a weight file was read")

    monkeypatch.setattr(safetensors, "safe_open", trap)
    monkeypatch.setattr(weight, "read_hf_safetensors", trap)
    monkeypatch.setattr(drafter, "read_safetensors_dir", trap)


def test_config_refusals_come_before_any_weight_is_read(tmp_path, saved_pair, no_weights_read, capsys):
    """A tensor-parallel size that does not divide the heads, a drafter made for another target and an
    unsupported "auto" dtype were refused only after every weight of both models was in memory (minutes and
    16 GB for an 8B target); the configs alone decide them."""
    from tensorrt_llm_dflash.errors import DFlashConfigError

    target_dir, drafter_dir = saved_pair
    out = tmp_path / "ckpt"
    with pytest.raises(DFlashConfigError, match="num_attention_heads=4 is not divisible by tp_size=3"):
        convert_checkpoint(target_dir, drafter_dir, out, tp_size=3, progress=False)
    config = json.loads((drafter_dir / "config.json").read_text())
    _edit_config(drafter_dir, hidden_size=48)
    with pytest.raises(DFlashConfigError, match="hidden_size mismatch: drafter hidden_size=48, target hidden_size=32"):
        convert_checkpoint(target_dir, drafter_dir, out, progress=False)
    (drafter_dir / "config.json").write_text(json.dumps(config))
    _edit_config(target_dir, torch_dtype="float64")
    with pytest.raises(DFlashConfigError, match=r"dtype='auto'.*torch_dtype='float64'.*--dtype"):
        convert_checkpoint(target_dir, drafter_dir, out, progress=False)
    _edit_config(target_dir, torch_dtype="float32")
    # The command line names the flag and the value, in one line, before anything loads.
    code, err = _convert_cli(["--model_dir", str(target_dir), "--dflash_model_dir", str(drafter_dir),
                              "--output_dir", str(out), "--tp_size", "3", "--no_progress"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "argument --tp_size: target num_attention_heads=4 is not divisible by tp_size=3" in err, err
    assert not out.exists()


def test_a_damaged_target_is_named_not_a_traceback(tmp_path, saved_pair, capsys):
    """A truncated target shard, an index naming a missing shard, a malformed or incomplete config.json
    ended the conversion in a Python traceback (exit 1); each is now one line naming the file (exit 2)."""
    from tensorrt_llm_dflash.errors import DFlashConfigError

    target_dir, drafter_dir = saved_pair
    out = tmp_path / "ckpt"
    weights = target_dir / "model.safetensors"
    intact = weights.read_bytes()

    def refused(match: str) -> None:
        with pytest.raises(DFlashConfigError, match=match):
            convert_checkpoint(target_dir, drafter_dir, out, progress=False)
        code, err = _convert_cli(["--model_dir", str(target_dir), "--dflash_model_dir", str(drafter_dir),
                                  "--output_dir", str(out), "--no_progress"], capsys)
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith("error: "), err

    weights.write_bytes(intact[: len(intact) // 2])
    refused(f"target weights {weights} ")
    weights.write_bytes(intact)
    index = target_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00002.safetensors"}}))
    refused(r"target index .*model.safetensors.index.json names files that are missing: \['model-00002.safetensors'\]")
    index.write_text("{not json")
    refused(r"target index .*model.safetensors.index.json is damaged")
    index.unlink()
    config_text = (target_dir / "config.json").read_text()
    (target_dir / "config.json").write_text(config_text[:-10])
    refused(r"target .*config.json is not valid JSON")
    config = json.loads(config_text)
    del config["num_attention_heads"]
    (target_dir / "config.json").write_text(json.dumps(config))
    refused(r"target .*config.json has no num_attention_heads")
    assert not out.exists()


def test_a_symlinked_output_dir_is_published_through_its_link(tmp_path, saved_pair):
    """``--output_dir ckpt`` with ckpt -> a directory on another disk: the checkpoint was published in place
    of the link (a real directory beside it), the link itself moved to a hidden ``.ckpt.staging-*`` entry that
    no later run removed, and the directory it pointed at kept the old checkpoint. The result now goes where
    the link points, and the link stays."""
    target_dir, drafter_dir = saved_pair
    real = tmp_path / "disk" / "ckpt"
    real.mkdir(parents=True)
    (real / "README.md").write_text("mine")
    link = tmp_path / "ckpt"
    link.symlink_to(real)
    for dtype in ("float32", "float16"):
        convert_checkpoint(target_dir, drafter_dir, link, dtype=dtype, progress=False)
        assert link.is_symlink() and link.resolve() == real.resolve()
        assert json.loads((real / "config.json").read_text())["dtype"] == dtype
        assert (real / "README.md").read_text() == "mine"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "disk", "drafter", "target"]
        assert sorted(p.name for p in real.parent.iterdir()) == ["ckpt"]


def test_weights_that_float16_cannot_hold_or_that_are_not_finite_are_refused(tmp_path, saved_pair):
    """``--dtype float16`` turned a weight beyond float16's range (65504) into inf without a word, and a target
    weight that was already NaN or inf went into the checkpoint as it was (the drafter's are checked on load):
    an engine of either computes NaNs. Both are refused naming the tensor; bfloat16 holds the large weight."""
    from safetensors.torch import save_file

    from tensorrt_llm_dflash.errors import DFlashConfigError

    target_dir, drafter_dir = saved_pair
    tensors = load_file(str(target_dir / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = 1e5
    save_file(tensors, str(target_dir / "model.safetensors"))
    with pytest.raises(DFlashConfigError, match=r"transformer\.layers\.1\.mlp\.proj\.weight has values beyond "
                                                r"float16's range \(largest magnitude 100000 > 65504\).*bfloat16"):
        convert_checkpoint(target_dir, drafter_dir, tmp_path / "ckpt", dtype="float16", progress=False)
    assert not (tmp_path / "ckpt").exists()
    convert_checkpoint(target_dir, drafter_dir, tmp_path / "ckpt", dtype="bfloat16", progress=False)
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(target_dir / "model.safetensors"))
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(DFlashConfigError, match=r"transformer\.layers\.1\.mlp\.proj\.weight holds NaN or "
                                                    r"infinite values in the source checkpoint"):
            convert_checkpoint(target_dir, drafter_dir, tmp_path / "ckpt", dtype=dtype, progress=False)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "bfloat16"  # the good one stays


def test_the_api_never_writes_over_a_model_it_reads(tmp_path, saved_pair):
    """The command line refused ``--output_dir`` equal to a model directory, convert_checkpoint() did not: it
    published the checkpoint's config.json over the target's own (the HF model was unusable afterwards), also
    through a link to it. Refused by name, before anything is read or written."""
    from tensorrt_llm_dflash.errors import DFlashConfigError

    target_dir, drafter_dir = saved_pair
    (tmp_path / "link").symlink_to(target_dir)
    before = {p.name: p.read_bytes() for d in (target_dir, drafter_dir) for p in d.iterdir()}
    for output, name in ((target_dir, "target"), (drafter_dir, "drafter"), (tmp_path / "link", "target")):
        with pytest.raises(DFlashConfigError, match=f"output_dir={str(output)!r} is the {name} directory"):
            convert_checkpoint(target_dir, drafter_dir, output, progress=False)
    assert {p.name: p.read_bytes() for d in (target_dir, drafter_dir) for p in d.iterdir()} == before
