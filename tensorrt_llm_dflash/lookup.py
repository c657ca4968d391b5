"""Prompt lookup: continuations of the recent text that already occurred in the context.

The rule of prompt-lookup decoding (transformers' ``prompt_lookup_num_tokens``): take the
longest n-gram ending at the newest token (n from ``max_ngram`` down to ``min_ngram``) that
also occurs earlier in the prompt or output, and propose the tokens that followed it. Here
several earlier occurrences may give different continuations: the most recent few distinct
ones are all returned, and the cost-aware tree (:mod:`.policy`) grafts them into the DDTree
as extra branches, verified in the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class LookupBranch:
    tokens: list[int]  # the continuation, first token right after the newest context token
    ngram: int  # length of the n-gram match that produced it


def lookup_branches(context: np.ndarray | list[int], max_tokens: int, max_ngram: int = 4, min_ngram: int = 1,
                    max_branches: int = 2) -> list[LookupBranch]:
    """Up to ``max_branches`` distinct continuations of at most ``max_tokens`` tokens.

    The longest matching n-gram wins; among its earlier occurrences the most recent come
    first. Shorter n-grams are only consulted when no longer one matches.
    """
    ids = np.asarray(context, dtype=np.int64)
    length = ids.shape[0]
    if max_tokens <= 0 or length < 2:
        return []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # Windows starting at 0..length-n-1: each is followed by at least one token.
        windows = sliding_window_view(ids[: length - 1], n)
        starts = np.flatnonzero((windows == ids[length - n:]).all(axis=1))
        if starts.size == 0:
            continue
        branches: list[LookupBranch] = []
        seen: set[tuple[int, ...]] = set()
        for start in starts[::-1]:  # most recent first
            follow = ids[start + n : start + n + max_tokens].tolist()
            key = tuple(follow)
            if follow and key not in seen and not any(s[: len(key)] == key for s in seen):
                seen.add(key)
                branches.append(LookupBranch(follow, n))
                if len(branches) == max_branches:
                    break
        return branches
    return []
