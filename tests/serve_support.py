"""Shared setup of the server tests: a real uvicorn server on a loopback port, in a thread of the test process,
over tiny random models (float64: greedy output is exactly transformers' greedy output)."""

from __future__ import annotations

import contextlib
import copy
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tiny_dirs import char_tokenizer
from tiny_models import hf_greedy, tiny_drafter, tiny_target

from tensorrt_llm_dflash.compat import chat_token_ids
from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.sampling import SamplingParams
from tensorrt_llm_dflash.serve.api import ServerSettings, create_app
from tensorrt_llm_dflash.serve.engine import Engine
from tensorrt_llm_dflash.serve.runner import BatchRunner, DecoderSpec, RowRequest, RowStep, graphed_rows
from tensorrt_llm_dflash.target import HFTargetVerifier

#: The tiny target's context: prompts are characters, so a 600-character prompt does not fit.
MAX_POSITIONS = 512
MODEL_NAME = "tiny-dflash"
#: Step costs of the cost-aware tree per tree size (2, 4, 8, 16), given instead of measured: deterministic trees
#: whatever the machine's load, and mid-sized trees get chosen.
POLICY_BUCKETS = (2, 4, 8, 16)
POLICY_COSTS = (1.0, 1.1, 1.3, 1.8)


class TinyModels:
    """A tiny Qwen3 target (float64), a tiny DFlash drafter and a character tokenizer with a chat template."""

    def __init__(self, seed: int = 2) -> None:
        self.model = tiny_target("qwen3", seed=seed, max_positions=MAX_POSITIONS)
        self.drafter = tiny_drafter(self.model, block_size=4, seed=2)
        self.tokenizer = char_tokenizer()
        self._solo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_token_ids(self.tokenizer, messages)

    def solo_ids(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """The prompt's own greedy continuation from transformers' generate (cached)."""
        key = (tuple(prompt_ids), max_tokens)
        if key not in self._solo:
            self._solo[key] = hf_greedy(self.model, list(prompt_ids), max_tokens)
        return self._solo[key]

    def solo_text(self, prompt_ids: list[int], max_tokens: int) -> str:
        return self.tokenizer.decode(self.solo_ids(prompt_ids, max_tokens), skip_special_tokens=True)

    def solo_sample_text(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams) -> str:
        """Plain AR sampling of the prompt with the request's seed (the eager runtime, no drafter): what a seeded
        request must get whatever the server's load, its draws being keyed by the seed and each token's index."""
        verifier = HFTargetVerifier(self.model)
        try:
            ids = speculative_generate(verifier, None, list(prompt_ids), max_tokens, params).output_ids
        finally:
            verifier.close()
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def spec(self, budget: int | None = None, speculative: bool = True) -> DecoderSpec:
        return DecoderSpec(self.model, self.drafter if speculative else None, budget=budget,
                           policy_buckets=POLICY_BUCKETS, policy_costs=POLICY_COSTS)


class SlowRunner:
    """A runner that sleeps before every step: long requests take seconds, so a test can act while they run."""

    def __init__(self, inner: BatchRunner, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds
        self.max_batch, self.max_model_len = inner.max_batch, inner.max_model_len
        self.vocab_size, self.description = inner.vocab_size, inner.description

    def admit(self, slot: int, row: RowRequest) -> None:
        self.inner.admit(slot, row)

    def step(self) -> dict[int, RowStep]:
        time.sleep(self.seconds)
        return self.inner.step()

    def release(self, slot: int) -> None:
        self.inner.release(slot)


class SlowTokenizer:
    """The tiny tokenizer, taking ``seconds`` to encode a prompt that starts with "slow"."""

    def __init__(self, inner, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def __call__(self, text, *args, **kwargs):
        if isinstance(text, str) and text.startswith("slow"):
            time.sleep(self.seconds)
        return self.inner(text, *args, **kwargs)

    def __getattr__(self, name):
        if "inner" not in self.__dict__:  # a copy being made: no attributes yet
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)


@contextlib.contextmanager
def slowed(live: LiveServer, seconds: float) -> Iterator[None]:
    """Every step of ``live``'s :class:`SlowRunner` sleeps ``seconds`` for the duration."""
    assert isinstance(live.runner, SlowRunner)
    before, live.runner.seconds = live.runner.seconds, seconds
    try:
        yield
    finally:
        live.runner.seconds = before


class LiveServer:
    """The app served by uvicorn on 127.0.0.1, a free port, in a daemon thread; ``close()`` shuts it down."""

    def __init__(self, runner: BatchRunner, tokenizer: Any, *, max_queue: int = 64,
                 eos_token_ids: frozenset[int] = frozenset(), max_body_bytes: int | None = None,
                 shutdown_timeout: int | None = None) -> None:
        """``shutdown_timeout``: serve through the command's ``graceful_server`` with that graceful timeout."""
        import uvicorn

        from tensorrt_llm_dflash.serve.__main__ import graceful_server

        self.runner = runner
        self.engine = Engine(runner, copy.deepcopy(tokenizer), max_queue=max_queue)
        settings = ServerSettings(MODEL_NAME, eos_token_ids, tokenizer)
        if max_body_bytes is not None:
            settings.max_body_bytes = max_body_bytes
        self.app = create_app(self.engine, settings)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        if shutdown_timeout is None:
            self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        else:
            self.server = graceful_server(uvicorn.Config(self.app, log_level="warning",
                                                         timeout_graceful_shutdown=shutdown_timeout), self.engine)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def client(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` parsed: ``name{labels}`` -> value."""
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        return parse_prometheus(text)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the test server did not stop"


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (-?[0-9.e+-]+|\+Inf|-Inf|NaN)$")


def parse_prometheus(text: str) -> dict[str, float]:
    """Every sample line of the text format; fails on a line that is neither a sample nor HELP/TYPE."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def tiny_server(models: TinyModels, *, rows: int, budget: int | None = None, speculative: bool = True,
                max_queue: int = 64, slow: float | None = None) -> LiveServer:
    """``slow``: wrap the runner in a :class:`SlowRunner` (its ``seconds`` can be changed while serving)."""
    torch.set_num_threads(1)
    runner: BatchRunner = graphed_rows(models.spec(budget, speculative), rows)
    if slow is not None:
        runner = SlowRunner(runner, slow)
    return LiveServer(runner, models.tokenizer, max_queue=max_queue)


@contextlib.contextmanager
def server_process(command: list[str], env: dict[str, str], cwd: Path,
                   timeout: float = 120) -> Iterator[tuple[subprocess.Popen, str]]:
    """``python -m tensorrt_llm_dflash.serve ...`` as a real process: yields (process, its start-up line) once it
    says where it listens (the URL follows the line's last " at "); killed on the way out if still running."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + timeout
        while not any(" at http://" in line for line in lines):
            assert process.poll() is None, f"the server exited: {process.stderr.read()}"
            assert time.monotonic() < deadline, "the server did not say where it listens"
            time.sleep(0.05)
        yield process, next(line for line in lines if " at http://" in line)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def long_requests_in_flight(live: Any) -> dict[str, Any]:
    """A long stream and a long non-streamed greedy request, both running on ``live`` (two rows) when this returns;
    the caller stops the server, then calls ``answers["join"]()``: ``answers["stream"]`` holds the stream's data
    lines, ``answers["plain"]`` the other's response."""
    import httpx

    answers: dict[str, Any] = {}
    body = {"prompt": "the answer is", "max_tokens": 400, "temperature": 0}

    def streamed() -> None:
        with httpx.stream("POST", live.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            answers["stream"] = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]

    def plain() -> None:
        answers["plain"] = httpx.post(live.url + "/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=streamed), threading.Thread(target=plain)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while live.metrics()["dflash_running_requests"] < 2:
        assert time.monotonic() < deadline, "the two requests never ran"
        time.sleep(0.02)

    def join() -> None:
        for thread in threads:
            thread.join(30)

    answers["join"] = join
    return answers
