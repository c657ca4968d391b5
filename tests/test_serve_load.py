"""The server under load and abuse, as an operator finds it: a real uvicorn server on loopback, the official ``openai``
client and raw httpx, tiny float64 models. Each test here reproduces a defect a QA pass found:

* a failure in one row's output (its tokens' text, stop strings) stopped the engine: every other row failed with it
  and the server answered 503 from then on;
* a second Ctrl-C (uvicorn's force quit) cut the requests in flight off: a plain-text 500, a stream without its error
  event or [DONE];
* a client that left the queue kept its queue slot until the step running then had ended (seconds, for a long
  prefill or a big model on a CPU): a new request got 429 from a server with room;
* a body that is not UTF-8 JSON (a latin-1 charset, a gzip body, nesting too deep) got FastAPI's "There was an error
  parsing the body", which says nothing of why, and was not counted as an invalid request;
* ``top_k=-1``, vLLM's "every token" (clients written for vLLM send it), was refused;
* a client that left while its prompt was being encoded was still submitted: its prompt prefilled, and (not
  streamed) decoded until the first disconnect check, for nobody.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from serve_support import (
    MODEL_NAME,
    LiveServer,
    SlowRunner,
    SlowTokenizer,
    TinyModels,
    long_requests_in_flight,
    tiny_server,
)

from tensorrt_llm_dflash.serve import sequence
from tensorrt_llm_dflash.serve.runner import BatchRunner, RowStep, graphed_rows


@pytest.fixture(scope="module")
def models() -> TinyModels:
    return TinyModels()


def test_a_row_whose_output_fails_fails_alone_and_the_server_goes_on(models, monkeypatch):
    """Two rows decode together; one request's output raises after a few tokens (a tokenizer that cannot decode what
    the model committed, say). That request gets a 500 naming the error; the other row's answer is the prompt's own
    greedy output, /health stays ok and the next request is served."""
    push = sequence.RowOutput.push

    def failing_push(self: sequence.RowOutput, tokens: list[int]) -> str:
        if self.request.stop == ("#victim#",) and len(self.token_ids) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return push(self, tokens)

    monkeypatch.setattr(sequence.RowOutput, "push", failing_push)
    live = tiny_server(models, rows=2, budget=4, slow=0.01)
    try:
        client = live.client()
        answers: dict = {}

        def ask(name: str, **extra) -> None:
            try:
                answers[name] = client.completions.create(model=MODEL_NAME, prompt="def f(", max_tokens=40,
                                                          temperature=0, **extra).choices[0].text
            except openai.APIError as err:
                answers[name] = err

        threads = [threading.Thread(target=ask, args=("victim",), kwargs={"stop": "#victim#"}),
                   threading.Thread(target=ask, args=("bystander",))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        victim = answers["victim"]
        assert isinstance(victim, openai.InternalServerError), victim
        assert "the request's output failed: UnicodeDecodeError" in victim.message
        assert answers["bystander"] == models.solo_text(models.encode("def f("), 40)
        assert httpx.get(live.url + "/health", timeout=10).status_code == 200
        assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, temperature=0).usage \
            .completion_tokens == 3
        metrics = live.metrics()
        assert metrics["dflash_requests_failed_total"] == 1 and metrics["dflash_running_requests"] == 0
    finally:
        live.close()


def test_a_second_ctrl_c_still_answers_what_is_in_flight(models):
    """Ctrl-C with a long stream and a long non-streamed request in flight, then Ctrl-C again before the graceful
    timeout (30 s) is up: uvicorn stops waiting at once; both requests are still answered, within seconds: the stream
    with an error event and [DONE], the other with a 503 in OpenAI's shape."""
    runner = SlowRunner(graphed_rows(models.spec(speculative=False), 2), 0.05)
    live = LiveServer(runner, models.tokenizer, shutdown_timeout=30)
    answers = long_requests_in_flight(live)
    start = time.monotonic()
    live.server.should_exit = True  # what uvicorn's signal handler does at the first Ctrl-C
    time.sleep(0.5)
    live.server.force_exit = True  # and at the second
    answers["join"]()
    live.thread.join(30)
    assert not live.thread.is_alive()
    assert time.monotonic() - start < 20  # uvicorn alone would have waited out the 30 s graceful timeout
    assert answers["stream"][-1] == "[DONE]", answers["stream"][-3:]
    assert "error" in json.loads(answers["stream"][-2]), answers["stream"][-2]
    assert answers["plain"].status_code == 503, answers["plain"].text
    assert "shutting down" in answers["plain"].json()["error"]["message"]
    assert not live.engine.alive


class GatedRunner(SlowRunner):
    """A runner whose steps wait for ``gate``: a test holds the engine inside a step for as long as it likes."""

    def __init__(self, inner: BatchRunner) -> None:
        super().__init__(inner, 0.0)
        self.gate = threading.Event()

    def step(self) -> dict[int, RowStep]:
        assert self.gate.wait(60), "the test never opened the gate"
        return self.inner.step()


def test_a_client_that_leaves_the_queue_frees_its_slot_at_once(models):
    """One row, a queue of one; the engine is inside a long step. A queued client gives up: at once the queue is empty
    (/metrics) and a new request is queued, not refused with 429, and it is served once the step ends."""
    runner = GatedRunner(graphed_rows(models.spec(speculative=False), 1))
    live = LiveServer(runner, models.tokenizer, max_queue=1)
    try:
        answers: dict = {}
        body = {"prompt": "x", "max_tokens": 3, "temperature": 0}
        first = threading.Thread(target=lambda: answers.update(first=httpx.post(
            live.url + "/v1/completions", json=body, timeout=60)))
        first.start()
        deadline = time.monotonic() + 10
        while live.metrics()["dflash_running_requests"] < 1:  # in its row, the engine held in the step
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", json=body, timeout=0.5)  # queued, then gone
        deadline = time.monotonic() + 1.0
        while (metrics := live.metrics())["dflash_queue_depth"] > 0:
            assert time.monotonic() < deadline, "the queue slot of a client that left stayed taken"
            time.sleep(0.02)
        assert metrics["dflash_requests_cancelled_total"] == 1
        third = threading.Thread(target=lambda: answers.update(third=httpx.post(
            live.url + "/v1/completions", json=body, timeout=60)))
        third.start()
        deadline = time.monotonic() + 10
        while "third" not in answers and live.metrics()["dflash_queue_depth"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        runner.gate.set()
        first.join(60)
        third.join(60)
        for name in ("first", "third"):
            assert answers[name].status_code == 200, answers[name].text
            assert answers[name].json()["choices"][0]["text"] == models.solo_text(models.encode("x"), 3)
    finally:
        runner.gate.set()
        live.close()


@pytest.fixture(scope="module")
def server(models):
    live = tiny_server(models, rows=2, budget=4)
    yield live
    live.close()


def test_a_body_that_is_not_utf8_json_is_told_why(server):
    before = server.metrics()['dflash_requests_rejected_total{reason="invalid_request"}']
    bodies = [("latin-1", '{"prompt": "café", "max_tokens": 2}'.encode("latin-1"), "UnicodeDecodeError"),
              ("gzip", gzip.compress(b'{"prompt": "x", "max_tokens": 2}'), "UnicodeDecodeError"),
              ("nested", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "RecursionError")]
    for name, body, says in bodies:
        response = httpx.post(server.url + "/v1/completions", content=body, timeout=30,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400, (name, response.text)
        message = response.json()["error"]["message"]
        assert message.startswith("the request body is not valid JSON: " + says), (name, message)
    # A client that leaves halfway through its body is gone, not invalid: not counted.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"x")
        time.sleep(0.3)
    time.sleep(0.3)
    after = server.metrics()['dflash_requests_rejected_total{reason="invalid_request"}']
    assert after - before == len(bodies)
    assert server.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, temperature=0).usage


def test_top_k_minus_one_keeps_every_token_as_in_vllm(server, models):
    client = server.client()
    ids = models.encode("def f(")
    for endpoint in ("completions", "chat/completions"):
        body = {"max_tokens": 6, "temperature": 0, "top_k": -1}
        body.update({"prompt": "def f("} if endpoint == "completions" else {"messages": [{"role": "user",
                                                                                        "content": "def f("}]})
        response = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=30)
        assert response.status_code == 200, (endpoint, response.text)
    seeded = {"prompt": "def f(", "max_tokens": 12, "temperature": 1.0, "seed": 7}
    texts = [client.completions.create(model=MODEL_NAME, **seeded, extra_body={"top_k": k}).choices[0].text
             for k in (-1, 0)]
    assert texts[0] == texts[1]  # the same sample: -1 is no top-k, as 0 is
    assert client.completions.create(model=MODEL_NAME, prompt="def f(", max_tokens=6, temperature=0,
                                     extra_body={"top_k": -1}).choices[0].text == models.solo_text(ids, 6)
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "top_k": -2}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_k", response.text


def test_a_client_that_leaves_while_its_prompt_is_encoded_is_never_submitted(models):
    """Encoding takes 1.5 s; the client gives up after 0.5 s (streamed or not): the request never reaches the engine:
    no prompt token prefilled, no token generated; the next request is served."""
    live = LiveServer(graphed_rows(models.spec(speculative=False), 1), SlowTokenizer(models.tokenizer, 1.5))
    try:
        body = {"prompt": "slow " + "x" * 300, "max_tokens": 100, "temperature": 0}
        for stream in (False, True):
            before = live.metrics()
            with pytest.raises(httpx.ReadTimeout):
                with httpx.stream("POST", live.url + "/v1/completions", json={**body, "stream": stream},
                                  timeout=0.5) as response:
                    response.read()
            time.sleep(1.5)  # the encoding ends, the request would be submitted
            after = live.metrics()
            for name in ("dflash_requests_received_total", "dflash_prompt_tokens_total",
                         "dflash_generation_tokens_total"):
                assert after[name] == before[name], (stream, name)
        assert live.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, temperature=0) \
            .choices[0].text == models.solo_text(models.encode("x"), 3)
    finally:
        live.close()
