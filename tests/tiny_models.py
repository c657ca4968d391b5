"""Tiny random targets, tiny drafters and scripted proposers for exact CPU tests.

Everything here is deterministic given its seed. Targets are float64 so that the
lossless tests can compare KV caches to 1e-10 and never hit argmax ties by rounding.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from tensorrt_llm_dflash.compat import CACHE_KWARG
from tensorrt_llm_dflash.config import DFlashDraftConfig, build_target_layer_ids
from tensorrt_llm_dflash.drafter import DFlashDraftModel


def tiny_target(arch: str = "qwen3", seed: int = 0, vocab: int = 64, layers: int = 4, hidden: int = 32,
                dtype: torch.dtype = torch.float64, max_positions: int = 256, init_std: float = 0.3,
                sliding_window: int | None = None, attn_implementation: str = "sdpa"):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": max_positions, "attn_implementation": attn_implementation,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
    }
    if arch == "qwen3":
        sliding = {}
        if sliding_window is not None:  # layers >= layers // 2 use a sliding window
            sliding = {"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": layers // 2}
        config = Qwen3Config(head_dim=hidden // 4, tie_word_embeddings=False, **sliding, **common)
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
                p.normal_(0, init_std)
    # No implicit EOS: HF generate would otherwise stop (or, with min_new_tokens,
    # suppress token 1), and the runtime has no stop tokens unless asked.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


@functools.lru_cache(maxsize=64)
def cached_target(arch: str = "qwen3", seed: int = 0, vocab: int = 64, layers: int = 4, hidden: int = 32,
                  max_positions: int = 256):
    """Shared float64 targets (never mutated by the tests)."""
    return tiny_target(arch, seed=seed, vocab=vocab, layers=layers, hidden=hidden, max_positions=max_positions)


def tiny_drafter_config(target, block_size: int = 4, layers: int = 1, **overrides) -> DFlashDraftConfig:
    c = target.config
    fields = {
        "hidden_size": c.hidden_size, "intermediate_size": 2 * c.hidden_size, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": c.hidden_size // 4,
        "vocab_size": c.vocab_size, "block_size": block_size, "mask_token_id": c.vocab_size - 1,
        "target_layer_ids": build_target_layer_ids(
            c.num_hidden_layers, min(layers, 3) if c.num_hidden_layers > 4 else 1
        ),
        "num_target_layers": c.num_hidden_layers, "rope_theta": 10000.0,
        "max_position_embeddings": c.max_position_embeddings,
    }
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
            else:  # biases
                p.normal_(0, 0.1)
    return model.to(target.dtype).eval()


# ------------------------------------------------------------------------- AR oracles


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Greedy AR continuation from transformers' own ``generate`` (the reference)."""
    ids = torch.tensor([prompt], dtype=torch.long)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def full_forward(model, tokens: list[int]):
    """A fresh prefill of ``tokens``: (DynamicCache, hidden_states tuple, logits)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=torch.tensor([tokens]), use_cache=True, output_hidden_states=True, **{CACHE_KWARG: cache})
    return cache, out.hidden_states, out.logits[0]


# ------------------------------------------------------------------- scripted proposers


class ScriptedProposer:
    """A proposer that knows the target's true continuation ``sequence``.

    ``sequence`` is the full token stream the target commits (prompt followed by its
    greedy output). The proposer counts the context rows the decode loop hands it,
    so it knows how many tokens are committed; it asserts that the root it is given
    is the committed stream's next token (so the loop's bookkeeping is checked too),
    and returns ``[block_size - 1, vocab]`` logits built by :meth:`row`.
    """

    def __init__(self, sequence: list[int], block_size: int, vocab: int, seed: int = 0) -> None:
        self.sequence = list(sequence)
        self.block_size = block_size
        self.vocab = vocab
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        self.context_len = 0
        self.calls = 0
        self.rng = np.random.default_rng(self.seed)

    def true_token(self, index: int) -> int | None:
        return self.sequence[index] if index < len(self.sequence) else None

    def row(self, truth: int | None) -> np.ndarray:  # pragma: no cover - overridden
        raise NotImplementedError

    def propose(self, root_token: int, new_context: torch.Tensor) -> torch.Tensor:
        assert new_context is not None and new_context.dim() == 2, "the loop must pass [n, F] features"
        self.context_len += int(new_context.shape[0])
        self.calls += 1
        expected_root = self.true_token(self.context_len)
        if expected_root is not None:
            assert root_token == expected_root, (
                f"root {root_token} != committed stream token {expected_root} at {self.context_len}"
            )
        rows = [self.row(self.true_token(self.context_len + k)) for k in range(1, self.block_size)]
        return torch.tensor(np.stack(rows), dtype=torch.float64)


class OracleProposer(ScriptedProposer):
    """Always proposes the target's own greedy continuation (peaked logits)."""

    def row(self, truth):
        logits = self.rng.normal(0.0, 1.0, self.vocab)
        if truth is not None:
            logits[truth] = 12.0
        return logits


class NoisyOracleProposer(ScriptedProposer):
    """Right with probability ``1 - noise``; when wrong, the truth is ranked second.

    The chain then accepts a random number of tokens per step, and a DDTree with a
    budget of at least two nodes per depth can still recover the truth.
    """

    def __init__(self, sequence, block_size, vocab, seed=0, noise=0.3):
        self.noise = noise
        super().__init__(sequence, block_size, vocab, seed)

    def row(self, truth):
        logits = self.rng.normal(0.0, 1.0, self.vocab)
        if truth is None:
            return logits
        if self.rng.random() < self.noise:
            wrong = (truth + 1 + int(self.rng.integers(self.vocab - 1))) % self.vocab
            logits[wrong] = 12.0
            logits[truth] = 11.0
        else:
            logits[truth] = 12.0
        return logits


class Top2Proposer(ScriptedProposer):
    """Top-1 is always wrong, top-2 is always the target's true next token."""

    def row(self, truth):
        logits = self.rng.normal(0.0, 0.5, self.vocab) - 5.0
        if truth is not None:
            logits[(truth + 1) % self.vocab] = 10.0
            logits[truth] = 9.5
        return logits


# ------------------------------------------------------------------------- DFlash2 drafters


def tiny_dflash2_config(target, block_size: int = 4, layers: int = 1, layout: str = "nested", **dflash2):
    """A DFlash2 config.json dict for ``target`` in one of z-lab's layouts: ``nested`` (block size
    and RoPE as in Muse-Glimmer-30B-DFlash2: dflash_config.block_size, rope_parameters, sliding
    layers) or ``flat`` (top-level rope_theta, full-attention layers)."""
    c = target.config
    settings = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 8,
                "mask_token_id": c.vocab_size - 1,
                "target_layer_ids": build_target_layer_ids(c.num_hidden_layers, min(layers, 3))}
    settings.update(dflash2)
    raw = {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
           "hidden_size": c.hidden_size, "intermediate_size": 2 * c.hidden_size, "num_hidden_layers": layers,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": c.hidden_size // 4,
           "vocab_size": c.vocab_size, "num_target_layers": c.num_hidden_layers, "rms_norm_eps": 1e-6,
           "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu", "dtype": "float32"}
    if layout == "nested":
        settings["block_size"] = block_size
        raw.update(rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, sliding_window=2048,
                   layer_types=["sliding_attention"] * layers, use_sliding_window=True)
    else:
        raw.update(block_size=block_size, rope_theta=10000.0, layer_types=["full_attention"] * layers)
    raw["dflash_config"] = settings
    return raw


def tiny_dflash2_drafter(target, block_size: int = 4, seed: int = 0, layers: int = 1, layout: str = "nested",
                         **dflash2):
    """A random DFlash2 drafter in the target's dtype; convolutions near identity (base tap 0 = 1) so
    the block still carries the embeddings, and codebooks large enough that the pairwise term
    changes the selector's choices."""
    from tensorrt_llm_dflash.dflash2 import DFlash2Config, DFlash2DraftModel

    torch.manual_seed(2000 + seed)
    model = DFlash2DraftModel(DFlash2Config.from_dict(tiny_dflash2_config(target, block_size, layers, layout,
                                                                          **dflash2)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("base_kernel"):
                p.normal_(0, 0.2)
                p[:, 0] += 1.0
            elif "codebook" in name:
                p.normal_(0, 1.0)
            elif p.dim() > 1:
                p.normal_(0, 0.2)
            else:
                p.uniform_(0.5, 1.5)
    return model.to(target.dtype).eval()


def scripted_draft_logits(base: torch.Tensor, wrong: torch.Tensor, decoys: torch.Tensor, truth: torch.Tensor,
                          vocab: int) -> torch.Tensor:
    """Draft logits [B, D, V] of the scripted proposers (tests/test_graphed.py, test_batched.py): ``base`` random
    logits with the known continuation ``truth`` [B, D] (-1: not known) on top, or second behind a decoy where
    ``wrong`` (a DDTree of two nodes per depth still finds it). Gathers only: nothing is read on the host."""
    logits = base.clone()
    known = truth >= 0
    wrong = wrong & known
    truth = truth.clamp(min=0)
    decoy = torch.where(decoys == truth, (truth + 1) % vocab, decoys)
    high, second = torch.tensor(12.0, dtype=logits.dtype), torch.tensor(11.0, dtype=logits.dtype)
    at_truth = logits.gather(2, truth[..., None])[..., 0]
    logits.scatter_(2, truth[..., None], torch.where(known, torch.where(wrong, second, high), at_truth)[..., None])
    at_decoy = logits.gather(2, decoy[..., None])[..., 0]
    logits.scatter_(2, decoy[..., None], torch.where(wrong, high, at_decoy)[..., None])
    return logits
