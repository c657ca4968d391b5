"""One request as the engine sees it: what to generate, and the text its committed tokens make.

:class:`RowOutput` turns a row's committed tokens into the text a client receives, chunk by chunk:
it cuts the tokens where AR decoding would stop (a stop token, the length limit), detokenizes them
incrementally (:class:`~tensorrt_llm_dflash.streaming.IncrementalDetokenizer`: multi-byte characters
are never split), and cuts the text before the first stop string, holding back a tail that could
still become one. A non-streamed response is the concatenation of the same chunks, so streamed
and non-streamed text are equal by construction.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..sampling import SamplingParams
from ..streaming import IncrementalDetokenizer

#: finish_reason values, as the OpenAI API names them.
STOP, LENGTH = "stop", "length"


@dataclass
class GenerationRequest:
    """A validated request: token ids and settings (the HTTP layer did the checking and the tokenizing)."""

    request_id: str
    prompt_ids: list[int]
    #: The most tokens to generate (prompt + this fits the runner's max_model_len).
    max_tokens: int
    #: ``seed`` is set whenever the temperature is > 0 (the HTTP layer draws one if the client sent none).
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    #: Token ids that end the output (included in the tokens, not in the text): the model's EOS ids and
    #: the request's ``stop_token_ids``.
    stop_token_ids: frozenset[int] = frozenset()
    skip_special_tokens: bool = True
    submitted_at: float = field(default_factory=time.perf_counter)


class RowOutput:
    """The text of one row's committed tokens, with stop tokens, the length limit and stop strings applied."""

    def __init__(self, tokenizer: Any, request: GenerationRequest) -> None:
        self.request = request
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=request.skip_special_tokens)
        self._stops = tuple(s for s in request.stop if s)
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        #: Text decoded but not yet returned: it may be (the start of) a stop string.
        self._unsent = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, tokens: Iterable[int]) -> str:
        """Add a step's committed tokens; returns the text that may be sent now (maybe "").

        Tokens after a stop token or past ``max_tokens`` are dropped, as AR decoding would never have
        made them. After the call, :attr:`finished` says whether the request is done.
        """
        if self.finished:
            return ""
        accepted: list[int] = []
        reason = None
        for token in tokens:
            accepted.append(int(token))
            if token in self.request.stop_token_ids:
                reason = STOP
                break
            if len(self.token_ids) + len(accepted) >= self.request.max_tokens:
                reason = LENGTH
                break
        if self._stops:
            return self._push_watching_stops(accepted, reason)
        self.token_ids.extend(accepted)
        text = self._detokenizer.push(accepted)
        if reason is not None:
            text += self._detokenizer.flush()
        return self._emit(text, reason)

    def _push_watching_stops(self, accepted: list[int], reason: str | None) -> str:
        """``push`` with stop strings: one token at a time, each checked against all the text decoded so far (the
        detokenizer's held-back last word included), so the output ends at the token that completes a stop string,
        as decoding token by token would: no later token is counted (usage) or decoded."""
        out = []
        for i, token in enumerate(accepted):
            self.token_ids.append(token)
            last = i == len(accepted) - 1
            text = self._detokenizer.push([token])
            seen = self._unsent + text + self._detokenizer.held
            if (last and reason is not None) or any(stop in seen for stop in self._stops):
                text += self._detokenizer.flush()  # the final text of these tokens, to cut at the stop
            out.append(self._emit(text, reason if last else None))
            if self.finished:
                break
        return "".join(out)

    def _emit(self, text: str, reason: str | None) -> str:
        self._unsent += text
        if self._stops:
            found = [i for i in (self._unsent.find(s) for s in self._stops) if i >= 0]
            if found:
                # OpenAI's rule: the text ends before the first stop string, which is not returned.
                out = self._unsent[: min(found)]
                self._unsent = ""
                self.finish_reason = STOP
                return out
        if reason is not None:
            out, self._unsent = self._unsent, ""
            self.finish_reason = reason
            return out
        hold = self._stop_prefix_length(self._unsent)
        out = self._unsent[: len(self._unsent) - hold]
        self._unsent = self._unsent[len(self._unsent) - hold:]
        return out

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest end of ``text`` that is the start of a stop string (held back until known)."""
        for length in range(min(len(text), self._longest_stop - 1), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
