"""The target's own token choice: argmax at T=0, else a draw from the processed softmax."""

from __future__ import annotations

import math
import numbers
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import DFlashInputError

#: Temperatures below this decode greedily (vLLM's rule): dividing float32 logits by a temperature near float32's
#: smallest numbers overflows to inf and the softmax to NaN, and long before that the distribution is the argmax.
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """Temperature (0, or below :data:`MIN_TEMPERATURE`: greedy), top-p in (0, 1], top-k (0: off), seed."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        # numbers.Real / Integral: numpy scalars pass too, as they did before these checks.
        for name, kind in (("temperature", numbers.Real), ("top_p", numbers.Real), ("top_k", numbers.Integral)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise DFlashInputError(f"{name}={value!r} must be "
                                       f"{'an integer' if kind is numbers.Integral else 'a number'}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)
                                      or not 0 <= self.seed < 2 ** 63):
            raise DFlashInputError(f"seed={self.seed!r} must be an integer in 0..2**63 - 1 (or None)")
        if not 0.0 <= self.temperature < math.inf:
            raise DFlashInputError(f"temperature={self.temperature} must be >= 0 and finite")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if not 0.0 < self.top_p <= 1.0:
            raise DFlashInputError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise DFlashInputError(f"top_k={self.top_k} must be >= 0 (0 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Row-wise sampling distribution after temperature, top-k and top-p (float32+)."""
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = logits.to(work) / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(-1)
        # Drop a token once the mass strictly before it already reaches top_p; the most
        # probable token always stays.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False  # a top_p below float32's smallest number reads 0 there: keep the first anyway
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def choose_tokens(logits: torch.Tensor, params: SamplingParams, draws: TokenDraws | None,
                  positions: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [N, V]: the target's own choice at each position (row n's token is the
    sequence's token at index ``positions[n]``: the argmax at T = 0, else the keyed draw of ``draws`` there)."""
    if params.greedy:
        return logits.argmax(-1)
    if draws is None:
        raise DFlashInputError("a sampled request needs its draws (sampling.make_draws)")
    where = torch.as_tensor(np.asarray(positions, dtype=np.int64) if not isinstance(positions, torch.Tensor)
                            else positions, device=logits.device)
    key_a, key_b = draws.key
    return keyed_draw(processed_probs(logits, params), key_a, key_b, where)


# ------------------------------------------------------------------ draws keyed by seed and position
#
# A sampled token is a function of the distribution and of uniforms keyed by the request's seed, the token's index
# in the sequence and a lane: U(seed, t, lane). The speculative runtimes choose the target's token at every tree
# node with the uniforms of the index that node's choice would take, and AR uses the same uniforms at the same
# index, so a sampled output is the same token for token whatever the tree's size, the policy's choices, the runtime
# or the other requests of a batch: in float64 the same seed gives the same answer. Each token is an exact draw from
# the target's distribution given the tokens before it (the uniforms are independent and never read before index t
# is reached).
#
# The draw is an exponential race (Gumbel-max) in two levels: the vocabulary in blocks of RACE_BLOCK tokens, a race
# between the blocks (block b finishes at -log U / p(b), p(b) its mass), then one between the winning block's tokens.
# A block wins with probability p(b) and, the second race being independent, a token inside it with p(i) / p(b): a
# draw from p. Unlike an inverse CDF it is robust to rounding: a verify's logits differ from an AR step's in the last
# bits, and a race changes its winner only where two finishing times nearly tie, while an inverse-CDF draw landing
# on a token of tiny probability moves with any shift of the boundaries before it (in float32 that changed 4 of 20
# HumanEval T=1 answers). Two levels keep the hashing to ~2 x (V / RACE_BLOCK + RACE_BLOCK) words per position
# (448 for a 49,152-token vocabulary) instead of one per token.
#
# The hash is integer arithmetic every device does alike: 32-bit words kept in int64 tensors, where no product
# passes 2**49 (no overflow, which torch leaves to the platform), and the same function on Python ints.

#: Tokens per block of the two-level race.
RACE_BLOCK = 256
_MASK32 = 0xFFFFFFFF


def _mul32(x: Any, constant: int) -> Any:
    """(x * constant) mod 2**32 for x in [0, 2**32), without a product past 2**49."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: Any) -> Any:
    """MurmurHash3's 32-bit finalizer: a bijection of [0, 2**32) whose every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def draw_key(seed: int) -> tuple[int, int]:
    """Two 32-bit words from a seed in 0..2**63 - 1 (SplitMix64's output function: neighbouring seeds get unrelated
    keys)."""
    z = (int(seed) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return z & _MASK32, z >> 32


def keyed_uniforms(key_a: Any, key_b: Any, positions: Any, lanes: Any = 0) -> Any:
    """U(seed, t, lane) in (0, 1) for the key of a seed (:func:`draw_key`), indices ``positions`` (0 .. 2**31 - 1)
    and ``lanes`` (0 .. 2**32 - 1): int64 tensors (broadcast together; the result float64, on their device) or Python
    ints (the result a float). 53 random bits, from two keyed hashes."""
    lane_word = _mix32((lanes + 0x9E3779B9) & _MASK32)
    words = []
    for half in (0, 1):
        x = _mix32((positions * 2 + half) ^ key_a)
        words.append(_mix32(_mix32(x ^ key_b) ^ lane_word))
    bits = (words[0] >> 5) * (1 << 26) + (words[1] >> 6)  # 27 + 26 bits: exact in float64
    if isinstance(bits, torch.Tensor):
        return (bits.to(torch.float64) + 0.5) / float(1 << 53)
    return (bits + 0.5) / float(1 << 53)


def keyed_draw(probs: torch.Tensor, key_a: Any, key_b: Any, positions: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [..., V] (any non-negative weights) at the sequence index ``positions`` [...]:
    the two-level race above with the uniforms of the key (ints, or int64 tensors broadcast against ``positions``).
    Never a token of probability 0. Fixed shapes and no host read: a CUDA graph can hold it."""
    work = probs.to(torch.float64)
    vocab = work.shape[-1]
    blocks = -(-vocab // RACE_BLOCK)
    if blocks * RACE_BLOCK != vocab:
        work = torch.nn.functional.pad(work, (0, blocks * RACE_BLOCK - vocab))
    work = work.unflatten(-1, (blocks, RACE_BLOCK))  # [..., blocks, RACE_BLOCK]
    if isinstance(key_a, torch.Tensor):
        key_a, key_b = key_a[..., None], key_b[..., None]
    where = positions.to(torch.long)[..., None]
    lane = torch.arange(blocks, device=work.device)
    block_time = -torch.log(keyed_uniforms(key_a, key_b, where, lane)) / work.sum(-1)  # a mass of 0 never finishes
    block = block_time.argmin(-1)  # [...]
    inside = work.gather(-2, block[..., None, None].expand(*block.shape, 1, RACE_BLOCK)).squeeze(-2)
    token = block[..., None] * RACE_BLOCK + torch.arange(RACE_BLOCK, device=work.device)  # [..., RACE_BLOCK]
    token_time = -torch.log(keyed_uniforms(key_a, key_b, where, blocks + token)) / inside
    return block * RACE_BLOCK + token_time.argmin(-1)


@dataclass(frozen=True)
class TokenDraws:
    """A sampled request's randomness: the keyed uniforms of the token at index t (:func:`keyed_draw`), and, for
    drafts that sample their own tokens (DFlash2's sampled chain and its rejection test), a torch generator
    seeded from the same seed."""

    seed: int

    @property
    def key(self) -> tuple[int, int]:
        return draw_key(self.seed)

    def generator(self, device: torch.device | str) -> torch.Generator:
        """A generator of the seed's own for a draft's draws (a new one per call: callers keep theirs)."""
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return gen


def make_draws(params: SamplingParams) -> TokenDraws | None:
    """A request's draws: None at T = 0; its seed, or a fresh one from the OS when it gave none."""
    if params.greedy:
        return None
    return TokenDraws(params.seed if params.seed is not None else fresh_seed())


def fresh_seed() -> int:
    """A seed for a request that gave none, from the OS: ``torch.seed()`` would reseed torch's global generator,
    and a user's seeded ``torch.rand`` after a call would no longer repeat."""
    return secrets.randbits(63)
