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
    sequence's token at index ``positions[n]``: the argmax at T = 0, else the inverse-CDF draw of ``draws`` there)."""
    if params.greedy:
        return logits.argmax(-1)
    if draws is None:
        raise DFlashInputError("a sampled request needs its draws (sampling.make_draws)")
    where = torch.as_tensor(np.asarray(positions, dtype=np.int64) if not isinstance(positions, torch.Tensor)
                            else positions, device=logits.device)
    return inverse_cdf(processed_probs(logits, params), draws.uniforms(where))


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative-probability interval holds ``uniforms`` (one per row of ``probs`` [..., V]):
    a draw from each row. Float64 sums, and never a token of probability 0 (a draw that rounds up to the total
    is moved below it)."""
    cdf = probs.to(torch.float64).cumsum(-1)
    total = cdf[..., -1:]
    draw = torch.minimum(uniforms.to(torch.float64)[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, draw, right=True).squeeze(-1)


# ------------------------------------------------------------------ draws keyed by seed and position
#
# A sampled token is the inverse-CDF draw of one uniform, and that uniform is a function of the request's seed and
# the token's index in the sequence alone: U(seed, t). The speculative runtimes choose the target's token at every
# tree node from the uniform of the index that node's choice would take, and AR takes the same uniform at the same
# index, so a sampled output is the same token for token whatever the tree's size, the policy's choices, the
# runtime or the other requests of a batch: in float64 the same seed gives the same answer. (In float32 a verify's
# rounding moves a draw across a token's boundary now and then, more often than it flips a greedy near-tie: a draw
# on a token of tiny probability changes with any shift of the boundaries before it.) Each token is still an exact
# draw from the target's distribution given the tokens before it (U(seed, t) is uniform and never read before index
# t is reached).
#
# The hash is integer arithmetic every device does alike: 32-bit words kept in int64 tensors, where no product
# passes 2**49 (no overflow, which torch leaves to the platform), and the same function on Python ints.

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


def keyed_uniforms(key_a: Any, key_b: Any, positions: Any) -> Any:
    """U(seed, t) in (0, 1) for the key of a seed (:func:`draw_key`) and indices ``positions`` (0 .. 2**31 - 1):
    int64 tensors (keys broadcast against the positions; the result float64, on their device) or Python ints (the
    result a float). 53 random bits, from two keyed hashes of the index."""
    words = []
    for lane in (0, 1):
        x = _mix32((positions * 2 + lane) ^ key_a)
        words.append(_mix32(x ^ key_b))
    bits = (words[0] >> 5) * (1 << 26) + (words[1] >> 6)  # 27 + 26 bits: exact in float64
    if isinstance(bits, torch.Tensor):
        return (bits.to(torch.float64) + 0.5) / float(1 << 53)
    return (bits + 0.5) / float(1 << 53)


@dataclass(frozen=True)
class TokenDraws:
    """A sampled request's randomness: U(seed, t) for the token at index t (:func:`keyed_uniforms`), and, for
    drafts that sample their own tokens (DFlash2's sampled chain and its rejection test), a torch generator
    seeded from the same seed."""

    seed: int

    @property
    def key(self) -> tuple[int, int]:
        return draw_key(self.seed)

    def uniforms(self, positions: torch.Tensor) -> torch.Tensor:
        key_a, key_b = self.key
        return keyed_uniforms(key_a, key_b, positions.to(torch.long))

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
