"""User turns written by the target itself, for self-distillation data that sounds like its users.

The built-in chat set (``chat_prompts.py``) crosses templates with topic lists: its prompts
are many but alike, and a drafter trained on the target's answers to them accepts far less
on hand-written prompts than on more of the same. A chat model has seen countless user turns
in its own training, so it can write them: render the chat template up to where the user's
text begins and *sample* from there (temperature 1, nucleus), stopping at the end of the
turn. What comes out is the target's own idea of a user (a plan, a worry, a pasted table and
a request about it), and its greedy answers to those turns are then distilled as usual
(``examples/train_dflash.py --dataset``). The technique is Magpie's (Xu et al., 2024,
"Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing").

A written turn is kept only if it ended by itself (not cut by ``max_new_tokens``), holds no
template token, has at least ``min_words`` words, is not a duplicate (of a turn kept before
or of one in ``avoid``, say an earlier file of written turns), and shares no word
8-gram with any benchmark prompt (``leakage.py``): the benchmark sets stay out by
construction, not by luck.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import DFlashConfigError
from .data import stop_and_pad_ids
from .leakage import ngrams, training_ngrams

#: Stand-in user text, located in the rendered template to find where the user's text begins.
_SLOT = "USER-TURN-SLOT-7f3a"
#: Why a written turn was dropped, in the order the checks run.
DROP_REASONS = ("unfinished", "template token", "too short", "duplicate", "benchmark overlap")


@dataclass
class WrittenTurns:
    """The kept turns, in the order written, and how many were dropped for each reason."""

    turns: list[str] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    batches: int = 0

    def summary(self) -> str:
        dropped = ", ".join(f"{reason} {self.dropped[reason]}" for reason in DROP_REASONS if self.dropped[reason])
        return f"{len(self.turns)} user turns kept of {len(self.turns) + sum(self.dropped.values())} written" + (
            f" (dropped: {dropped})" if dropped else "")


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """Token ids of the chat template up to where a user's first message begins (the
    template's default system prompt included, as the target sees it in every chat)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SLOT}], tokenize=False)
    if not isinstance(text, str) or text.count(_SLOT) != 1:
        raise DFlashConfigError("the target's chat template does not place a user's message verbatim; "
                                "it cannot write user turns")
    ids = tokenizer(text[: text.index(_SLOT)], add_special_tokens=False)["input_ids"]
    if not ids:
        raise DFlashConfigError("the target's chat template renders nothing before a user's message")
    return [int(t) for t in ids]


def _normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()


def write_user_turns(
    model: Any,
    tokenizer: Any,
    count: int,
    *,
    seed: int = 0,
    temperature: float = 1.0,
    top_p: float = 0.95,
    max_new_tokens: int = 96,
    batch_size: int = 64,
    min_words: int = 4,
    exclude: list[str] | None = None,
    avoid: Iterable[str] = (),
    max_batches: int | None = None,
    progress: Callable[[WrittenTurns], None] | None = None,
) -> WrittenTurns:
    """Sample user turns from ``model`` until ``count`` are kept (module docstring for what is
    kept), at most ``max_batches`` batches (default: enough for a 4x drop rate).

    Batch ``b`` samples under the seed ``seed * 1_000_003 + b`` and the global RNG is left as
    it was, so the same arguments on the same machine give the same turns. ``exclude``: texts
    (the benchmark prompts) no kept turn may share a word 8-gram with. ``avoid``: turns kept
    already (an earlier run's); one written again, up to case and spacing, is a duplicate.
    """
    if count < 1:
        raise DFlashConfigError(f"count={count} must be at least 1")
    if model.generation_config.eos_token_id in (None, []):
        raise DFlashConfigError("the target's generation config names no end-of-turn token (eos_token_id)")
    stop_ids, pad_id = stop_and_pad_ids(model)
    special = {int(t) for t in getattr(tokenizer, "all_special_ids", [])} - stop_ids
    prefix = torch.tensor([user_turn_prefix(tokenizer)], dtype=torch.long)
    banned = training_ngrams(exclude or [])
    seen = {_normalized(text) for text in avoid}
    result = WrittenTurns()
    max_batches = max_batches or 4 * -(-count // batch_size)
    device = next(model.parameters()).device
    prompts = prefix.to(device).repeat(batch_size, 1)
    while len(result.turns) < count and result.batches < max_batches:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed * 1_000_003 + result.batches)
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                 temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=max_new_tokens,
                                 eos_token_id=sorted(stop_ids), pad_token_id=pad_id)
        result.batches += 1
        for row in out[:, prompts.shape[1]:].tolist():
            ends = [i for i, t in enumerate(row) if t in stop_ids]
            if not ends:
                result.dropped["unfinished"] += 1
                continue
            ids = row[: ends[0]]
            if special.intersection(ids):
                result.dropped["template token"] += 1
                continue
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            if len(re.findall(r"\w+", text)) < min_words:
                result.dropped["too short"] += 1
                continue
            key = _normalized(text)
            if key in seen:
                result.dropped["duplicate"] += 1
                continue
            if ngrams(text) & banned:
                result.dropped["benchmark overlap"] += 1
                continue
            seen.add(key)
            result.turns.append(text)
            if len(result.turns) == count:
                break
        if progress is not None:
            progress(result)
    return result

