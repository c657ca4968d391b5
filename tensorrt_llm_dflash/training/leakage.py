"""Word n-gram overlap between training prompts and the benchmark prompts.

One definition for the leakage test (``tests/test_leakage.py``, which states the threshold
and what was measured) and for the prompt writer (``training/user_turns.py``), which drops
any prompt of its own that shares a single 8-gram with a benchmark prompt.

Text is lowercased and split into word tokens (``[a-z0-9]+``, so punctuation, indentation
and ``>>>`` markers do not matter); a text shorter than n words is one n-gram.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

NGRAM = 8

_WORD = re.compile(r"[a-z0-9]+")


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """The distinct word n-grams of ``text``; a text shorter than n words is one n-gram (none if empty)."""
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def training_ngrams(turns: Iterable[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    grams: set[tuple[str, ...]] = set()
    for turn in turns:
        grams |= ngrams(turn, n)
    return grams


def leakage(prompt: str, train_grams: set[tuple[str, ...]], n: int = NGRAM) -> float:
    """Fraction of the prompt's distinct word n-grams that occur in some training turn."""
    grams = ngrams(prompt, n)
    return len(grams & train_grams) / len(grams) if grams else 0.0


def leakage_report(benchmark: Sequence[tuple[str, str]], turns: Iterable[str],
                   n: int = NGRAM) -> list[tuple[float, str]]:
    """(leakage, label) of every (label, prompt) of ``benchmark``, worst first."""
    train_grams = training_ngrams(turns, n)
    return sorted(((leakage(text, train_grams, n), label) for label, text in benchmark), key=lambda r: (-r[0], r[1]))


def benchmark_prompts() -> list[tuple[str, str]]:
    """(label, text) of every HumanEval prompt (164) and every prompt of the packaged chat set."""
    from tensorrt_llm_dflash import bench

    humaneval = bench.load_prompts(bench.HUMANEVAL)
    chat = bench.load_prompts(bench.CHAT)
    return ([(f"humaneval[{i}]", p.text) for i, p in enumerate(humaneval)]
            + [(f"chat[{i}] ({p.category}): {p.text[:50]!r}", p.text) for i, p in enumerate(chat)])
