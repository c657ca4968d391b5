"""No benchmark prompt leaks into the drafter's training prompts (word 8-gram overlap).

Training side: every user turn the built-in training data can hold, i.e.
``training.prompts.build_prompt_set()`` (the whole set) plus every user turn of
``training.chat_prompts.chat_conversations(8000)`` (more conversations than a training run
draws, so the test covers them), plus the target-written user turns shipped in
``examples/data/*user_turns*.jsonl.xz`` (``examples/write_user_turns.py``; the writer already
drops any turn sharing an 8-gram with a benchmark prompt, this test checks the file as
shipped). Benchmark side: the 164 HumanEval prompts and the packaged chat set
(``--dataset chat``). The n-gram functions are ``tensorrt_llm_dflash.training.leakage``.

Metric: text is lowercased and split into word tokens (``[a-z0-9]+``, so punctuation,
indentation and ``>>>`` markers do not matter); a prompt's leakage is the fraction of its
distinct word 8-grams that occur in ANY training user turn (one set of all training
8-grams, looked up per prompt). A prompt shorter than 8 words counts as one n-gram: it
leaks only if some training turn is exactly that prompt. A benchmark prompt copied
verbatim into a training turn scores 1.0; ``test_metric_flags_a_verbatim_copy`` proves
the check can fail.

Threshold: ``THRESHOLD = 0.10``. Measured when this test was written: 15,297 training user
turns (4,845 from ``build_prompt_set()``, the rest from 8,000 chat conversations), 61,413
distinct 8-grams; the maximum over all 204 benchmark prompts was 0.0, so no HumanEval or
chat prompt shares a single 8-word run with a training turn. With the 3,000 target-written
turns added (18,299 turns, 122,227 distinct 8-grams) the maximum was still 0.0, and with the
6,000 more of run 5 (24,299 turns, 238,000 distinct 8-grams) it is 0.0. HumanEval-shaped boilerplate
that both sides share (``from typing import List``, ``def name(...) -> List[int]:``) is
shorter than 8 words or runs into a function name the training set excludes, so it does
not count. The one overlap seen on the way was benign: a chat prompt opening "How do I
make a simple tomato sauce from scratch?" scored 0.077 (1 of its 13 8-grams) because a
generated how-to asks "How do I make a simple tomato sauce?"; that prompt was replaced.
0.10 tolerates such a stock phrase in all but the shortest prompts (a shared 8-9-word run
is 1-2 8-grams; chat prompts have 2-114, HumanEval prompts 8-252, most HumanEval over 30),
while a copied sentence in a short chat prompt, or a copied docstring passage in a
HumanEval prompt, exceeds it.
``pytest -s tests/test_leakage.py`` prints the distribution (max and the worst 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from tensorrt_llm_dflash.training import leakage as leakage_module
from tensorrt_llm_dflash.training.chat_prompts import chat_conversations
from tensorrt_llm_dflash.training.datasets import read_dataset
from tensorrt_llm_dflash.training.leakage import leakage, leakage_report, training_ngrams
from tensorrt_llm_dflash.training.prompts import build_prompt_set

THRESHOLD = 0.10
#: Conversations drawn from the chat part of the training data (more than a run uses).
CHAT_CONVERSATIONS = 8000
HUMANEVAL_PROMPTS = 164
#: Training data files written by examples/write_user_turns.py and shipped in the repository.
USER_TURN_FILES = sorted((Path(__file__).resolve().parents[1] / "examples" / "data").glob("*user_turns*.jsonl*"))


def over_threshold(report: Sequence[tuple[float, str]], threshold: float = THRESHOLD) -> list[tuple[float, str]]:
    return [(value, label) for value, label in report if value > threshold]


def describe(report: Sequence[tuple[float, str]], worst: int = 5) -> str:
    lines = [f"leakage over {len(report)} benchmark prompts: max {report[0][0]:.4f}, threshold {THRESHOLD}"]
    lines += [f"  {value:.4f}  {label}" for value, label in report[:worst]]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def training_user_turns() -> list[str]:
    """Every user turn of the built-in training data, built once for this module."""
    turns = list(build_prompt_set())
    for conversation in chat_conversations(CHAT_CONVERSATIONS):
        assert isinstance(conversation, tuple) and conversation, conversation
        assert all(isinstance(turn, str) for turn in conversation), conversation
        turns.extend(conversation)
    assert USER_TURN_FILES, "examples/data/*user_turns*.jsonl.xz (the shipped drafter's target-written turns) is missing"
    for path in USER_TURN_FILES:  # the target-written turns the shipped drafter was trained on
        written = read_dataset(path).user_turns()
        assert written, path
        turns.extend(written)
    return turns


@pytest.fixture(scope="module")
def benchmark_prompts() -> list[tuple[str, str]]:
    """(label, text) of every HumanEval prompt and every chat-set prompt."""
    prompts = leakage_module.benchmark_prompts()
    assert sum(label.startswith("humaneval[") for label, _ in prompts) == HUMANEVAL_PROMPTS
    return prompts


def test_no_benchmark_prompt_leaks_into_training_user_turns(training_user_turns, benchmark_prompts):
    report = leakage_report(benchmark_prompts, training_user_turns)
    print("\n" + describe(report))
    leaks = over_threshold(report)
    assert not leaks, f"{len(leaks)} benchmark prompts leak into the training data\n{describe(report, len(leaks))}"


def test_metric_flags_a_verbatim_copy(training_user_turns, benchmark_prompts):
    """The same check as above fails when a benchmark prompt is in the training turns verbatim."""
    for index in (0, HUMANEVAL_PROMPTS, len(benchmark_prompts) - 1):  # HumanEval, first and last chat prompt
        label, text = benchmark_prompts[index]
        # Copied as one user turn of a multi-turn conversation, among the real training turns.
        turns = [*training_user_turns, "Hello! Can you help me with something?", text, "Thanks, one more."]
        leaks = over_threshold(leakage_report(benchmark_prompts, turns))
        assert (1.0, label) in leaks, describe(leaks)


def test_metric_ignores_case_punctuation_and_layout():
    prompt = "Write a haiku about the first snow of winter, please, and keep it calm."
    copy = "WRITE a haiku -- about the first\nsnow of winter! please and keep it calm"
    assert leakage(prompt, training_ngrams([copy])) == 1.0
    assert leakage(prompt, training_ngrams(["Write a haiku about the first rain of spring, please."])) == 0.0
    # Half of the prompt's 8-grams are shared.
    words = [f"w{i}" for i in range(15)]  # 8 distinct 8-grams
    assert leakage(" ".join(words), training_ngrams([" ".join(words[:11])])) == 0.5
    # Shorter than 8 words: leaks only as an exact copy.
    assert leakage("Tell me a joke.", training_ngrams(["tell me a joke"])) == 1.0
    assert leakage("Tell me a joke.", training_ngrams(["Tell me a joke about cats."])) == 0.0
