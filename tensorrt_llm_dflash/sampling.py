"""The target's own token choice: argmax at T=0, else a draw from the processed softmax."""

from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass

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


def choose_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits`` [N, V]: the target's own choice at each position."""
    if params.greedy:
        return logits.argmax(-1)
    probs = processed_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else fresh_seed())
    return gen


def fresh_seed() -> int:
    """A seed for a request that gave none, from the OS: ``torch.seed()`` would reseed torch's global generator,
    and a user's seeded ``torch.rand`` after a call would no longer repeat."""
    return secrets.randbits(63)
