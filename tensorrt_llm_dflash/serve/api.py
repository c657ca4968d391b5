"""The HTTP layer: an OpenAI-compatible FastAPI app over an :class:`~.engine.Engine`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as
server-sent events with ``"stream": true``), ``GET /health``, ``GET /metrics`` (Prometheus text).

Everything a request can get wrong is checked here, before it reaches the engine, and answered with
400 in OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``, the message naming
the field and the value. A full queue is 429 (with ``Retry-After``), a stopped engine 503. Once a
stream has started (status 200 sent), an engine failure arrives as a last SSE event holding an
``error`` object, then ``[DONE]``: no request in flight ends without an answer.

The engine thread hands events to a request's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``; a client that disconnects cancels its request, which frees its row at
the next step boundary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..compat import chat_token_ids
from ..errors import DFlashError
from .engine import Engine, EngineStopped, Event, Failed, Finished, QueueFull, TextDelta
from .protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    build_request,
    chat_messages,
    completion_prompt,
    format_validation_error,
    refuse_unsupported,
    show,
)
from .sequence import GenerationRequest

#: How often a non-streamed request checks whether its client is still there (while text arrives too).
DISCONNECT_POLL_SECONDS = 0.25
#: The largest request body accepted (a prompt filling a 128k-token context is well under 1 MiB of text).
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
OWNER = "tensorrt-llm-dflash"


@dataclass
class ServerSettings:
    served_model_name: str
    #: EOS ids of the model (its generation config): every request stops there, as run.py does.
    eos_token_ids: frozenset[int]
    #: The tokenizer that encodes prompts, on a thread of its own (the engine thread has another).
    tokenizer: Any
    #: Bodies larger than this are refused with 413 before they are read (or as soon as they pass it).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 in OpenAI's error shape, decided from its
    Content-Length before anything is read, or, for a body sent without one, as soon as the bytes read pass it (the
    body is read here, at most ``limit`` bytes of it, and handed to the app as one message)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send, int(declared))
            return
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body ended
                await self.app(scope, _replay([message], receive), send)
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                await self._refuse(send, size)
                return
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(parts), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, send: Any, size: int) -> None:
        body = json.dumps(error_body(f"the request body has {size} bytes or more; this server accepts at most "
                                     f"{self.limit}")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None,
                   ) -> JSONResponse:
    kinds = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}
    kind = kinds.get(status, "server_error")
    return JSONResponse(error_body(message, kind, param), status_code=status, headers=headers)


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    """An ASGI receive that returns ``messages`` first, then what ``receive`` gets (a disconnect, later on)."""
    queued = list(messages)

    async def replaying() -> dict[str, Any]:
        return queued.pop(0) if queued else await receive()

    return replaying


def create_app(engine: Engine, settings: ServerSettings, *, manage_engine: bool = True) -> FastAPI:
    """The app. With ``manage_engine`` the app's lifespan starts the engine and stops it on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            encoder.shutdown(wait=False, cancel_futures=True)
            if manage_engine:
                await asyncio.to_thread(engine.stop)

    app = FastAPI(title="tensorrt-llm-dflash", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    tokenizer = settings.tokenizer
    # Prompts are encoded off the event loop (a long one takes seconds; /health and the streams must not wait), on
    # one thread: a fast tokenizer is not safe to use from two threads at once.
    encoder = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-tokenize")

    async def encode(param: str, what: str, work: Any) -> list[int]:
        try:
            return await asyncio.get_running_loop().run_in_executor(encoder, work)
        except Exception as err:  # noqa: BLE001 - a tokenizer or template refusing the text is the request's fault
            raise InvalidRequest(param, f"{param}: {what}: {type(err).__name__}: {err}") from None
    runner = engine.runner
    metrics = engine.metrics
    created = int(time.time())

    def rejected(status: int, message: str, param: str | None = None, reason: str = "invalid_request",
                 headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.inc("requests_rejected_total", reason=reason)
        return error_response(status, message, param, headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = format_validation_error(list(exc.errors()))
        return rejected(400, error.message, error.param)

    @app.exception_handler(InvalidRequest)
    async def invalid_request(_: Request, exc: InvalidRequest) -> JSONResponse:
        return rejected(400, exc.message, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths (404), methods (405) and bodies FastAPI cannot parse (400) in OpenAI's error shape, not
        FastAPI's ``{"detail": ...}``."""
        if exc.status_code == 400 and exc.__cause__ is not None and not isinstance(exc.__cause__, ClientDisconnect):
            # FastAPI's "There was an error parsing the body" said nothing of why: bytes that are not UTF-8 (a latin-1
            # charset, a compressed body), JSON nested too deep. Say it, and count the request as the invalid one it is.
            cause = exc.__cause__
            return rejected(400, f"the request body is not valid JSON: {type(cause).__name__}: {cause} (send it as "
                                 "UTF-8 JSON, uncompressed)")
        message = {404: f"{request.method} {request.url.path}: no such endpoint (GET /v1/models, POST "
                        f"/v1/completions, POST /v1/chat/completions, GET /health, GET /metrics)",
                   405: f"{request.method} {request.url.path}: method not allowed"}.get(exc.status_code,
                                                                                       str(exc.detail))
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health() -> Response:
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": "the engine is not running"}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        return {"id": settings.served_model_name, "object": "model", "created": created, "owned_by": OWNER,
                "max_model_len": runner.max_model_len, "dflash": {"mode": runner.description,
                                                                  "max_batch_size": runner.max_batch}}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        """OpenAI's model retrieve (``client.models.retrieve``): what clients ask before they use a name."""
        if model_id != settings.served_model_name:
            return error_response(404, f"model={show(model_id)}: unknown model; this server serves "
                                       f"{settings.served_model_name!r}", "model")
        return JSONResponse(model_card())

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.served_model_name:
            raise InvalidRequest("model", f"model={show(name)}: unknown model; this server serves "
                                          f"{settings.served_model_name!r} (GET /v1/models)")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        refuse_unsupported(body)
        text, ids = completion_prompt(body)
        if ids is None:
            ids = await encode("prompt", "the tokenizer cannot encode it",
                               lambda: list(tokenizer(text)["input_ids"]))
        generation = build_request(
            body, ids, prompt_param="prompt", max_tokens_param="max_tokens", requested_max_tokens=body.max_tokens,
            default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS, max_model_len=runner.max_model_len,
            vocab_size=runner.vocab_size, eos_token_ids=settings.eos_token_ids, prefix="cmpl")
        return await serve(request, generation, body.stream, body.stream_options is not None
                           and body.stream_options.include_usage, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        refuse_unsupported(body)
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise InvalidRequest("max_completion_tokens", f"max_completion_tokens={body.max_completion_tokens} "
                                                          f"and max_tokens={body.max_tokens} disagree; send one")
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest("messages", "messages: this model's tokenizer has no chat template; use "
                                             "/v1/completions with the prompt text")
        messages = chat_messages(body)
        # A template may refuse a conversation (roles out of order, ...), a tokenizer some text (a lone surrogate).
        ids = await encode("messages", "the chat template refused them", lambda: chat_token_ids(tokenizer, messages))
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        generation = build_request(
            body, ids, prompt_param="messages", max_tokens_param=param, requested_max_tokens=requested,
            default_max_tokens=None, max_model_len=runner.max_model_len, vocab_size=runner.vocab_size,
            eos_token_ids=settings.eos_token_ids, prefix="chatcmpl")
        return await serve(request, generation, body.stream, body.stream_options is not None
                           and body.stream_options.include_usage, chat=True)

    async def serve(request: Request, generation: GenerationRequest, stream: bool, include_usage: bool,
                    chat: bool) -> Response:
        if await request.is_disconnected():
            # Gone while its prompt was encoded (a long prompt takes seconds, the likeliest moment to give up): never
            # submitted, or its prefill, and decoding until the first disconnect check, ran for nobody.
            return Response(status_code=499)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def on_event(event: Event) -> None:  # the engine thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            engine.submit(generation, on_event)
        except QueueFull as err:
            return error_response(429, str(err), headers={"Retry-After": "1"})
        except EngineStopped as err:
            return error_response(503, str(err))
        except DFlashError as err:
            return rejected(400, str(err))
        shape = ResponseShape(generation.request_id, settings.served_model_name, chat)
        if stream:
            return StreamingResponse(sse(request, generation, events, shape, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await collect(request, generation, events, shape)

    async def collect(request: Request, generation: GenerationRequest, events: asyncio.Queue[Event],
                      shape: ResponseShape) -> Response:
        parts: list[str] = []
        loop = asyncio.get_running_loop()
        check_at = loop.time() + DISCONNECT_POLL_SECONDS
        try:
            while True:
                event = None
                try:
                    event = await asyncio.wait_for(events.get(), max(check_at - loop.time(), 0.0))
                except asyncio.TimeoutError:  # TimeoutError only from Python 3.11 on
                    pass
                if loop.time() >= check_at:  # on the clock, not only when no text came: a decoding row sends often
                    if await request.is_disconnected():
                        engine.cancel(generation.request_id)
                        return Response(status_code=499)  # nobody reads it; the row is freed
                    check_at = loop.time() + DISCONNECT_POLL_SECONDS
                if event is None:
                    continue
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                elif isinstance(event, Failed):
                    return error_response(event.status, event.message)
                else:
                    parts.append(event.text_tail)
                    return JSONResponse(shape.full("".join(parts), event))
        except asyncio.CancelledError:
            engine.cancel(generation.request_id)
            raise

    async def sse(request: Request, generation: GenerationRequest, events: asyncio.Queue[Event],
                  shape: ResponseShape, include_usage: bool) -> AsyncIterator[str]:
        finished = False
        try:
            if shape.chat:
                yield data(shape.chunk({"role": "assistant", "content": ""}, None))
            while True:
                event = await events.get()
                if isinstance(event, TextDelta):
                    yield data(shape.chunk(event.text, None))
                elif isinstance(event, Failed):
                    finished = True
                    yield data(error_body(event.message, "server_error" if event.status >= 500
                                          else "invalid_request_error"))
                    break
                else:
                    finished = True
                    final = shape.chunk(event.text_tail, event.finish_reason)
                    final["dflash"] = event.stats
                    yield data(final)
                    if include_usage:
                        usage = shape.chunk(None, None)
                        usage["choices"] = []
                        usage["usage"] = shape.usage(event)
                        yield data(usage)
                    break
            yield "data: [DONE]\n\n"
        finally:
            # Reached on a disconnect too (the response task is cancelled, or the next send fails).
            if not finished:
                engine.cancel(generation.request_id)

    return app


def data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class ResponseShape:
    """OpenAI's response objects for one request (text_completion or chat.completion)."""

    request_id: str
    model: str
    chat: bool

    def __post_init__(self) -> None:
        self.created = int(time.time())

    @staticmethod
    def usage(event: Finished) -> dict[str, int]:
        return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
                "total_tokens": event.prompt_tokens + event.completion_tokens}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, event: Finished) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": event.finish_reason}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": event.finish_reason}
            body = self._head("text_completion")
        body.update(choices=[choice], usage=self.usage(event), system_fingerprint=None, dflash=event.stats)
        return body

    def chunk(self, content: str | dict[str, str] | None, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            delta = content if isinstance(content, dict) else ({} if content is None else {"content": content})
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        return body

