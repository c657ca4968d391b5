"""The user's own training conversations: JSONL in the common shapes, and where a chat
template puts each assistant answer.

Each non-blank line of the file is one conversation, in one of three shapes:

* OpenAI: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
* ShareGPT: ``{"conversations": [{"from": "system"|"human"|"user"|"gpt"|"assistant", "value": str}, ...]}``
  (an optional top-level ``"system": str`` becomes the first message)
* plain: ``{"prompt": str}``, optionally with ``"response": str`` (or ``"completion": str``)

All three become the same list of ``{"role", "content"}`` messages (:class:`Conversation`).
The whole file is parsed before any model is loaded, so a bad file costs nothing: every
malformed line is reported by number and reason (:class:`BadLine`), and skipped, or with
``strict`` refused at once (:class:`DFlashInputError` naming the file and the line).

Rules a conversation must meet (each broken one is a bad line): roles are system, user and
assistant only; every content is a non-empty string; system messages come first; there is
a user turn, and it comes before any assistant turn; with ``answers="dataset"`` there is an
assistant turn to learn from. Blank lines are not conversations and are ignored.

**Where the assistant tokens are** (:func:`assistant_spans`): for the assistant message
``i``, its tokens run from the end of the conversation rendered up to message ``i`` with
``add_generation_prompt=True`` to the end of the conversation rendered up to and including
message ``i``, and stop after the first stop token (end of turn) in that range: what
follows it (a newline, say) is template glue the target never generates. Both renders must
be token prefixes of the sequence being trained on; a turn for which they are not (a
template that renders earlier turns differently in context) cannot be located and gets no
loss.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import lzma
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..compat import chat_token_ids
from ..errors import DFlashInputError
from ..files import utf8_text

ANSWER_MODES = ("regenerate", "dataset")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
SHAPE_KEYS = ("messages", "conversations", "prompt")
_SHOWN = 60  # characters of an offending value quoted in a reason



@dataclass(frozen=True)
class Conversation:
    """One line of the file as messages ``{"role": "system"|"user"|"assistant", "content": str}``."""

    messages: tuple[dict[str, str], ...]
    line: int  # 1-based line number in the source file
    shape: str = "messages"  # "messages" (OpenAI), "conversations" (ShareGPT) or "prompt" (plain)

    @property
    def key(self) -> str:
        """What identifies the conversation for resuming: a hash of its messages."""
        text = json.dumps([[m["role"], m["content"]] for m in self.messages], ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    def for_dataset_answers(self) -> list[dict[str, str]]:
        """The messages up to the last assistant turn (later turns have nothing to learn from)."""
        last = max(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        return [dict(m) for m in self.messages[: last + 1]]

    def regeneration_segments(self) -> list[list[dict[str, str]]]:
        """The system/user messages, cut where the target answers: after each run of them that
        an assistant turn followed, and after the last one. The dataset's assistant turns are
        dropped (several in a row become one answer)."""
        segments: list[list[dict[str, str]]] = []
        current: list[dict[str, str]] = []
        for m in self.messages:
            if m["role"] == "assistant":
                if current:
                    segments.append(current)
                    current = []
            else:
                current.append(dict(m))
        if current:
            segments.append(current)
        return segments


@dataclass(frozen=True)
class BadLine:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


@dataclass
class Dataset:
    path: Path
    sha256: str  # of the file's bytes
    conversations: list[Conversation]
    lines: int  # non-blank lines
    bad: list[BadLine] = field(default_factory=list)

    def summary(self) -> str | None:
        """``skipped N of M lines (first: line 3: ...)``, or None when every line is used."""
        if not self.bad:
            return None
        return f"{self.path}: skipped {len(self.bad)} of {self.lines} lines (first: {self.bad[0]})"

    def user_turns(self) -> list[str]:
        """Every user message of every conversation, in file order."""
        return [m["content"] for c in self.conversations for m in c.messages if m["role"] == "user"]


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_dataset(path: str | Path, answers: str = "regenerate", strict: bool = False,
                 flag: str = "--dataset") -> Dataset:
    """Parse a JSONL conversation file (shapes and rules: the module docstring).

    Malformed lines are collected in ``Dataset.bad`` (``strict``: the first one raises).
    Raises DFlashInputError naming ``flag`` and the file for a file that cannot be read, is
    not UTF-8, is empty, or holds no valid conversation.
    """
    if answers not in ANSWER_MODES:
        raise DFlashInputError(f"answers={answers!r} must be one of {', '.join(ANSWER_MODES)}")
    path = Path(path)
    if path.is_dir():
        raise DFlashInputError(f"{flag} {str(path)!r} is a directory, not a .jsonl file")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DFlashInputError(f"{flag} {str(path)!r} cannot be read: {err.strerror or err}") from None
    if path.suffix == ".xz":  # shipped data files are xz-compressed (a quarter of the size); same content hash
        try:
            data = lzma.decompress(data)
        except (lzma.LZMAError, EOFError) as err:
            raise DFlashInputError(f"{flag} {str(path)!r} is not a complete .xz file: {err}") from None
    text = utf8_text(data, path, "dataset")
    conversations: list[Conversation] = []
    bad: list[BadLine] = []
    lines = 0
    # Universal newlines, as reading the file in text mode would split it.
    for lineno, line in enumerate(io.StringIO(text, newline=None), start=1):
        if not line.strip():
            continue
        lines += 1
        try:
            conversations.append(parse_line(line, lineno, answers))
        except DFlashInputError as err:
            if strict:
                raise DFlashInputError(f"{path}:{lineno}: {err} (--strict refuses the file at its first bad line)") \
                    from None
            bad.append(BadLine(lineno, str(err)))
    if lines == 0:
        raise DFlashInputError(f"{flag} {str(path)!r} is empty: no conversations")
    dataset = Dataset(path, hashlib.sha256(data).hexdigest(), conversations, lines, bad)
    if not conversations:
        raise DFlashInputError(f"{flag} {str(path)!r} holds no valid conversation: all {lines} lines are bad "
                               f"(first: {bad[0]})")
    return dataset


def parse_line(line: str, lineno: int, answers: str = "regenerate") -> Conversation:
    """One JSONL line as a Conversation; DFlashInputError(reason) when it is malformed."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DFlashInputError(f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(row, dict):
        raise DFlashInputError(f"expected a JSON object, got {_type(row)}")
    shapes = [k for k in SHAPE_KEYS if k in row]
    if not shapes:
        raise DFlashInputError(f"unknown shape: expected a 'messages', 'conversations' or 'prompt' field "
                               f"(keys: {sorted(row)[:8]})")
    if len(shapes) > 1:
        raise DFlashInputError(f"ambiguous shape: both {shapes[0]!r} and {shapes[1]!r} fields")
    shape = shapes[0]
    if shape == "messages":
        messages = _openai(row["messages"])
    elif shape == "conversations":
        messages = _sharegpt(row["conversations"], row.get("system"))
    else:
        messages = _plain(row)
    _check_order(messages, answers)
    return Conversation(tuple(messages), lineno, shape)


def _type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _content(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise DFlashInputError(f"{where} must be a string, got {_type(value)}")
    if not value.strip():
        raise DFlashInputError(f"{where} is empty")
    return value


def _turn_list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise DFlashInputError(f"{name!r} must be a list of messages, got {_type(value)}")
    if not value:
        raise DFlashInputError(f"{name!r} is an empty list")
    return value


def _openai(value: Any) -> list[dict[str, str]]:
    messages = []
    for n, item in enumerate(_turn_list(value, "messages"), start=1):
        if not isinstance(item, dict):
            raise DFlashInputError(f"message {n} must be an object with 'role' and 'content', got {_type(item)}")
        for key in ("role", "content"):
            if key not in item:
                raise DFlashInputError(f"message {n} has no {key!r} field (keys: {sorted(item)[:8]})")
        role = item["role"]
        if not isinstance(role, str) or role not in ROLES:
            raise DFlashInputError(f"message {n}: unknown role {str(role)[:_SHOWN]!r} (expected system, user or "
                                   "assistant)")
        messages.append({"role": role, "content": _content(item["content"], f"message {n}'s content")})
    return messages


def _sharegpt(value: Any, system: Any) -> list[dict[str, str]]:
    messages = []
    if system is not None:
        messages.append({"role": "system", "content": _content(system, "'system'")})
    for n, item in enumerate(_turn_list(value, "conversations"), start=1):
        if not isinstance(item, dict):
            raise DFlashInputError(f"turn {n} must be an object with 'from' and 'value', got {_type(item)}")
        for key in ("from", "value"):
            if key not in item:
                raise DFlashInputError(f"turn {n} has no {key!r} field (keys: {sorted(item)[:8]})")
        source = item["from"]
        if not isinstance(source, str) or source not in SHAREGPT_ROLES:
            raise DFlashInputError(f"turn {n}: unknown 'from' {str(source)[:_SHOWN]!r} (expected system, human, "
                                   "user, gpt or assistant)")
        messages.append({"role": SHAREGPT_ROLES[source], "content": _content(item["value"], f"turn {n}'s value")})
    return messages


def _plain(row: dict[str, Any]) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": _content(row["prompt"], "'prompt'")}]
    answers = [k for k in ("response", "completion") if k in row]
    if len(answers) > 1:
        raise DFlashInputError("both 'response' and 'completion' fields: give one answer")
    if answers:
        messages.append({"role": "assistant", "content": _content(row[answers[0]], f"{answers[0]!r}")})
    return messages


def _check_order(messages: list[dict[str, str]], answers: str) -> None:
    roles = [m["role"] for m in messages]
    if "user" not in roles:
        raise DFlashInputError("no user turn")
    first_user = roles.index("user")
    if "assistant" in roles[:first_user]:
        raise DFlashInputError(f"message {roles.index('assistant') + 1}: an assistant turn before the first user turn")
    late_system = [i for i, r in enumerate(roles) if r == "system" and i > first_user]
    if late_system:
        raise DFlashInputError(f"message {late_system[0] + 1}: a system message after the conversation started "
                               "(system messages must come first)")
    if answers == "dataset" and "assistant" not in roles:
        raise DFlashInputError("no assistant turn to learn from (--answers dataset keeps the dataset's answers)")


# ------------------------------------------------------------------ chat template


@contextlib.contextmanager
def template_errors() -> Iterator[None]:
    """A chat template's own error (jinja, "roles must alternate") as a DFlashInputError reason."""
    try:
        yield
    except DFlashInputError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever the template raises, it is this conversation's fault
        raise DFlashInputError(f"the chat template refused it ({type(err).__name__}: {str(err)[:120]})") from None


def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` through the target's chat template."""
    return chat_token_ids(tokenizer, messages, add_generation_prompt=add_generation_prompt)


@dataclass(frozen=True)
class Span:
    """The assistant message ``message``'s tokens are ``ids[start:end]``; ``cut`` is where the
    turn ends in the template (after its end-of-turn glue): the place a conversation may be
    cut at this turn's boundary."""

    message: int
    start: int
    end: int
    cut: int


def assistant_spans(tokenizer: Any, messages: list[dict[str, str]], ids: list[int],
                    stop_ids: set[int] | frozenset[int] = frozenset()) -> list[Span | None]:
    """Where each assistant message of ``messages`` lies in ``ids`` (rule: the module docstring).

    One entry per assistant message, in order; None for a turn whose renders are not token
    prefixes of ``ids`` (it cannot be located, so it carries no loss).
    """
    spans: list[Span | None] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (len(before) < len(upto) <= len(ids) and upto[: len(before)] == before and ids[: len(upto)] == upto):
            spans.append(None)
            continue
        end = len(upto)
        for pos in range(len(before), len(upto)):
            if upto[pos] in stop_ids:
                end = pos + 1
                break
        spans.append(Span(i, len(before), end, len(upto)))
    return spans


def loss_mask_of(length: int, spans: list[Span]) -> list[bool]:
    mask = [False] * length
    for span in spans:
        for pos in range(span.start, min(span.end, length)):
            mask[pos] = True
    return mask


@dataclass
class Tokenized:
    """A conversation ready for the data stage (``answers="dataset"``)."""

    conversation: Conversation
    input_ids: list[int]
    loss_mask: list[bool]
    answer_start: int  # the first assistant token: everything before is prompt
    truncated: bool  # turns were dropped or the first answer cut to fit max_seq_len
    turns_without_loss: int = 0  # assistant turns kept whose tokens could not be located


def tokenize_for_dataset_answers(tokenizer: Any, conversation: Conversation, max_seq_len: int,
                                 stop_ids: set[int] | frozenset[int] = frozenset()) -> Tokenized:
    """The conversation with its own answers, truncated to ``max_seq_len`` tokens.

    Truncation rule: whole turns are dropped from the end (the sequence ends at the turn
    boundary after an assistant answer), keeping at least the first user turn and the first
    answer; if even that is longer than ``max_seq_len``, the first answer's tokens are cut
    at ``max_seq_len``; if the prompt part alone (everything before the first answer) leaves
    no room for an answer token, DFlashInputError (the conversation is skipped).
    """
    messages = conversation.for_dataset_answers()
    with template_errors():
        ids = render(tokenizer, messages, add_generation_prompt=False)
        spans = assistant_spans(tokenizer, messages, ids, stop_ids)
    if spans[0] is None:
        raise DFlashInputError("the chat template does not render the first assistant turn as a token prefix of "
                               "the conversation, so its answer tokens cannot be located")
    located = [s for s in spans if s is not None]
    first = located[0]
    if first.start >= max_seq_len:
        raise DFlashInputError(f"its prompt ({first.start} tokens before the first answer) leaves no room for an "
                               f"answer within --max_seq_len {max_seq_len}")
    truncated = len(ids) > max_seq_len
    if truncated:
        fitting = [s for s in located if s.cut <= max_seq_len]
        if fitting:
            ids, located = ids[: fitting[-1].cut], fitting
        else:
            ids, located = ids[:max_seq_len], [first]
    # Turns that could not be located and are still in the (possibly cut) sequence.
    kept_up_to = located[-1].message
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    unlocated = sum(span is None and (not truncated or i < kept_up_to) for i, span in zip(turns, spans))
    return Tokenized(conversation, ids, loss_mask_of(len(ids), located), first.start, truncated, unlocated)
