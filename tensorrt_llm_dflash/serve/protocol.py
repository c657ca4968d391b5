"""The OpenAI-compatible request bodies and the checks that turn them into a :class:`GenerationRequest`.

Pydantic checks the JSON types (strict: ``"5"`` is not an integer, ``true`` is not a number) and
ranges; the functions here check what needs the model (a known ``model``, a prompt that fits the
context, token ids in the vocabulary) and refuse what this server does not implement (``n`` > 1,
``logprobs``, penalties, ...) instead of ignoring it. Every refusal is an :class:`InvalidRequest`
naming the field and its value, answered with HTTP 400 in OpenAI's error shape.
Unknown fields are refused too (as OpenAI's API does), so a misspelt ``max_token`` is not silently
dropped.

Extensions (vLLM's names): ``top_k``, ``stop_token_ids``, ``skip_special_tokens``; and in every
response a ``dflash`` object with the request's speculative statistics.
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..cli import MAX_SEED
from ..sampling import MIN_TEMPERATURE, SamplingParams
from .sequence import GenerationRequest

#: OpenAI's default for /v1/completions (vLLM's too); chat completions default to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16


class InvalidRequest(Exception):
    """A request the server refuses: HTTP 400, ``param`` names the field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def show(value: Any, limit: int = 80) -> str:
    """A value for an error message, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=-1)  # -1 and 0: every token (vLLM's values for no top-k)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: StrictBool | None = True
    user: StrictStr | None = None
    # Accepted only at their defaults (a request that asks for more is refused, never silently ignored).
    n: StrictInt | None = None
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None
    # An assistant message sent back as the API returned it carries these, null or empty: accepted as such
    # (tool calls and audio are refused by name, refuse_unsupported).
    refusal: StrictStr | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    annotations: list[Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    top_logprobs: StrictInt | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None


def format_validation_error(errors: list[dict[str, Any]]) -> InvalidRequest:
    """The first of pydantic's (or FastAPI's) errors as one message naming the field and the value."""
    error = errors[0]
    loc = [part for part in error.get("loc", ()) if part != "body"]
    kind = error.get("type", "")
    if kind in ("json_invalid", "json_type"):
        detail = error.get("ctx", {}).get("error", error.get("msg", ""))
        return InvalidRequest(None, f"the request body is not valid JSON: {detail}")
    if not loc or kind == "model_attributes_type":
        where = ".".join(str(p) for p in loc)
        what = f"{where}: " if where else "the request body: "
        got = error.get("input")
        if not where and isinstance(got, (bytes, str)):  # FastAPI reads a body without a JSON content type as bytes
            return InvalidRequest(None, "the request body: send it as JSON with the header Content-Type: "
                                        f"application/json (got {show(got)})")
        return InvalidRequest(where or None, f"{what}must be a JSON object, got {show(got)}")
    # A union's errors carry the member's name in loc (stop.str, stop.list[str].0): keep the path a client wrote,
    # and report the member that got furthest into the value (stop=[3] is a list whose item 0 is not a string).
    deepest = max(len(e.get("loc", ())) for e in errors)
    candidates = [e for e in errors if len(e.get("loc", ())) == deepest]
    error = candidates[0]
    path = _client_path(error.get("loc", ()))
    kind = error.get("type", "")
    messages = [e.get("msg", "invalid") for e in candidates if _client_path(e.get("loc", ())) == path]
    if kind == "extra_forbidden":
        return InvalidRequest(path, f"{path}: unknown field (this server implements the OpenAI API's fields, "
                                    f"and top_k, stop_token_ids, skip_special_tokens)")
    if kind == "missing":
        return InvalidRequest(path, f"{path}: required field is missing")
    return InvalidRequest(path, f"{path}={show(error.get('input'))}: {' or '.join(dict.fromkeys(messages))}")


def _client_path(loc: tuple[Any, ...]) -> str:
    """``("body", "messages", 0, "content", "str")`` -> ``messages[0].content``: pydantic's union member names out."""
    path = ""
    for part in loc:
        if part == "body" or (isinstance(part, str) and ("[" in part or part in _UNION_MEMBERS)):
            continue
        path += f"[{part}]" if isinstance(part, int) else ("." if path else "") + str(part)
    return path


#: Names pydantic puts in an error's loc for a union's members (they are not fields the client wrote).
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "function-after", "function-plain"})


def refuse_unsupported(body: _Sampling) -> None:
    """Fields this server does not implement, refused by name unless at their do-nothing default."""
    checks: list[tuple[str, Any, bool]] = [
        ("n", body.n, body.n in (None, 1)),
        # /v1/completions' logprobs is a count (0 still asks for the chosen tokens'), chat's a flag.
        ("logprobs", body.logprobs, body.logprobs is None or (isinstance(body, ChatCompletionRequest)
                                                             and body.logprobs is False)),
        ("presence_penalty", body.presence_penalty, body.presence_penalty in (None, 0, 0.0)),
        ("frequency_penalty", body.frequency_penalty, body.frequency_penalty in (None, 0, 0.0)),
        ("logit_bias", body.logit_bias, not body.logit_bias),
    ]
    if isinstance(body, CompletionRequest):
        checks += [("echo", body.echo, not body.echo), ("best_of", body.best_of, body.best_of in (None, 1)),
                   ("suffix", body.suffix, not body.suffix)]
    if isinstance(body, ChatCompletionRequest):
        text_format = body.response_format in (None, {"type": "text"})
        checks += [("top_logprobs", body.top_logprobs, not body.top_logprobs),
                   ("response_format", body.response_format, text_format),
                   ("tools", body.tools, not body.tools), ("tool_choice", body.tool_choice,
                                                            body.tool_choice in (None, "none"))]
    if isinstance(body, ChatCompletionRequest):
        for i, message in enumerate(body.messages):
            for field in ("tool_calls", "function_call", "audio"):
                value = getattr(message, field)
                checks.append((f"messages[{i}].{field}", value, not value))
    for name, value, fine in checks:
        if not fine:
            raise InvalidRequest(name, f"{name}={show(value)}: not supported by this server")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options", "stream_options: only allowed with stream=true")


def stop_strings(body: _Sampling) -> tuple[str, ...]:
    if isinstance(body.stop, str):
        if not body.stop:
            raise InvalidRequest("stop", "stop='': a stop string must not be empty")
        return (body.stop,)
    stops = list(body.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest("stop", f"stop: {len(stops)} strings, at most {MAX_STOP_STRINGS} are allowed")
    for i, stop in enumerate(stops):
        if not stop:
            raise InvalidRequest(f"stop[{i}]", f"stop[{i}]={stop!r}: a stop string must not be empty")
    return tuple(stops)


def check_token_ids(param: str, ids: list[int], vocab_size: int) -> None:
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidRequest(param, f"{param}[{i}]={token}: not a token id of this model (0..{vocab_size - 1})")


def build_request(body: _Sampling, prompt_ids: list[int], *, prompt_param: str, max_tokens_param: str,
                  requested_max_tokens: int | None, default_max_tokens: int | None, max_model_len: int,
                  vocab_size: int, eos_token_ids: frozenset[int], prefix: str) -> GenerationRequest:
    """The checks that need the model, then the engine's request."""
    if not prompt_ids:
        raise InvalidRequest(prompt_param, f"{prompt_param}: the prompt is empty (it encodes to no tokens)")
    check_token_ids(prompt_param, prompt_ids, vocab_size)
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise InvalidRequest(prompt_param, f"{prompt_param}: the prompt has {len(prompt_ids)} tokens; this model's "
                                           f"context is {max_model_len} tokens, prompt and output together")
    if requested_max_tokens is not None:
        max_tokens = requested_max_tokens
        if max_tokens > room:
            raise InvalidRequest(max_tokens_param, f"{max_tokens_param}={max_tokens}: the prompt has "
                                                   f"{len(prompt_ids)} tokens, so at most {room} more fit this "
                                                   f"model's context of {max_model_len}")
    else:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    stop_ids = list(body.stop_token_ids or [])
    check_token_ids("stop_token_ids", stop_ids, vocab_size)
    temperature = 1.0 if body.temperature is None else float(body.temperature)  # OpenAI's default
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0  # greedy (SamplingParams's rule, applied first so that no seed is drawn for it)
    seed = body.seed
    if temperature > 0 and seed is None:
        seed = secrets.randbelow(MAX_SEED + 1)  # reported in the response, so the client can reproduce it
    # A k past the vocabulary keeps every token, as the vocabulary does; -1 is vLLM's "every token" (its default for
    # years: clients written for vLLM send it), as 0 is.
    top_k = min(max(body.top_k or 0, 0), vocab_size)
    sampling = SamplingParams(temperature, 1.0 if body.top_p is None else float(body.top_p), top_k, seed)
    return GenerationRequest(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt_ids=list(prompt_ids),
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stop_strings(body),
        stop_token_ids=frozenset(eos_token_ids) | frozenset(stop_ids),
        skip_special_tokens=body.skip_special_tokens is not False,
    )


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as chat templates take them: ``content`` as one string (text parts joined)."""
    out = []
    for message in body.messages:
        content = message.content if isinstance(message.content, str) else "".join(p.text for p in message.content)
        # OpenAI's "developer" role is its "system" (the newer name); chat templates know only "system": Qwen3's
        # renders nothing for another role, SmolLM2's renders it verbatim beside its own default system prompt.
        role = "system" if message.role == "developer" else message.role
        item = {"role": role, "content": content}
        if message.name is not None:
            item["name"] = message.name
        out.append(item)
    return out


def completion_prompt(body: CompletionRequest) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids): one prompt per request."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return prompt, None
    if not prompt:
        raise InvalidRequest("prompt", "prompt=[]: the prompt is empty")
    if all(isinstance(p, (str, list)) for p in prompt):  # a list of prompts (texts or token-id lists)
        if len(prompt) != 1:
            raise InvalidRequest("prompt", f"prompt: a list of {len(prompt)} prompts; send one prompt per request")
        if isinstance(prompt[0], list):
            if not prompt[0]:
                raise InvalidRequest("prompt", "prompt=[[]]: the prompt is empty")
            return None, [int(t) for t in prompt[0]]
        return str(prompt[0]), None
    return None, [int(t) for t in prompt]
