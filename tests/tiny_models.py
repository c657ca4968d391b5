"""Tiny random targets and drafters for exact CPU tests."""

from __future__ import annotations

import torch

from tensorrt_llm_dflash.config import DFlashDraftConfig, build_target_layer_ids
from tensorrt_llm_dflash.drafter import DFlashDraftModel


def tiny_target(arch: str = "qwen3", seed: int = 0, vocab: int = 64, layers: int = 4, hidden: int = 32,
                dtype: torch.dtype = torch.float64, max_positions: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  attn_implementation="sdpa", bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if arch == "qwen3":
        config = Qwen3Config(head_dim=hidden // 4, tie_word_embeddings=False, **common)
        model = Qwen3ForCausalLM(config)
    elif arch == "llama":
        config = LlamaConfig(tie_word_embeddings=True, **common)
        model = LlamaForCausalLM(config)
    else:
        raise ValueError(arch)
    # Larger-than-default init gives peaked, seed-dependent distributions, so greedy
    # paths are varied and ties are practically impossible.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model.to(dtype).eval()


def tiny_drafter_config(target, block_size: int = 4, layers: int = 1, **overrides) -> DFlashDraftConfig:
    c = target.config
    fields = dict(hidden_size=c.hidden_size, intermediate_size=2 * c.hidden_size, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=c.hidden_size // 4,
                  vocab_size=c.vocab_size, block_size=block_size, mask_token_id=c.vocab_size - 1,
                  target_layer_ids=build_target_layer_ids(c.num_hidden_layers, min(layers, 3) if c.num_hidden_layers > 4 else 1),
                  num_target_layers=c.num_hidden_layers, rope_theta=10000.0, max_position_embeddings=c.max_position_embeddings)
    fields.update(overrides)
    return DFlashDraftConfig(**fields)


def tiny_drafter(target, block_size: int = 4, seed: int = 0, layers: int = 1, **overrides) -> DFlashDraftModel:
    torch.manual_seed(1000 + seed)
    model = DFlashDraftModel(tiny_drafter_config(target, block_size, layers, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.to(target.dtype).eval()
