"""The OpenAI-compatible server end to end: the official ``openai`` client against a real uvicorn server on
loopback (tensorrt_llm_dflash.serve), tiny float64 models, the graphed runtime.

* completions and chat, streamed and not: the streamed text equals the non-streamed text, and both equal the
  prompt's own greedy output from transformers (the runtime's guarantee in float64), with usage counts and the
  ``dflash`` statistics; stop strings and stop tokens; seeded sampling reproduces;
* a burst of 64 requests from 16 concurrent clients over 4 rows: every answer arrives, each equals its own solo
  output (none garbled or mixed);
* a client that disconnects (streamed or not) frees its row: the next request is served at once;
* past rows + queue, 429 with a reason; malformed requests get 400 naming the field and the value while a
  request in flight is undisturbed; a failing step is answered (500, or an SSE error event), and the server
  goes on serving.
"""

from __future__ import annotations

import asyncio
import json
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
    parse_prometheus,
    slowed,
    tiny_server,
)

from tensorrt_llm_dflash.sampling import SamplingParams
from tensorrt_llm_dflash.serve.runner import GraphedRunner, RowStep, graphed_rows

CHAT = [{"role": "system", "content": "You answer in code."}, {"role": "user", "content": "Add two numbers."}]


@pytest.fixture(scope="module")
def models() -> TinyModels:
    return TinyModels()


@pytest.fixture(scope="module")
def server(models):
    """Four rows of one batched graphed decoder, the cost-aware tree with lookup branches."""
    live = tiny_server(models, rows=4)
    yield live
    live.close()


@pytest.fixture(scope="module")
def one_row(models):
    """One row, a queue of one, DDTree budget 4 (a seed reproduces a sample); ``slowed`` makes a 400-token answer
    take seconds, so that a test can act while it runs."""
    live = tiny_server(models, rows=1, budget=4, max_queue=1, slow=0.0)
    yield live
    live.close()


def stream_text(chunks, chat: bool) -> tuple[str, list]:
    chunks = list(chunks)
    parts = []
    for chunk in chunks:
        for choice in chunk.choices:
            parts.append((choice.delta.content or "") if chat else choice.text)
    return "".join(parts), chunks


def check_stats(stats: dict, completion_tokens: int) -> None:
    assert stats["steps"] == len(stats["tree_sizes"]) == len(stats["acceptance_lengths"]) >= 1
    assert stats["mean_acceptance_length"] == pytest.approx(sum(stats["acceptance_lengths"]) / stats["steps"])
    assert sum(stats["acceptance_lengths"]) + 1 >= completion_tokens  # + the prefill's token
    assert all(size >= 1 for size in stats["tree_sizes"])
    assert "cost-aware DDTree" in stats["mode"] and stats["time_to_first_token_seconds"] >= 0


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_and_non_streamed_answers_equal_the_solo_greedy_output(server, models, chat):
    client = server.client()
    prompts = [CHAT, [{"role": "user", "content": "Write a loop (0, 1, 2)."}]] if chat else \
        ["def add(a, b):", "the answer is"]
    for prompt, n in zip(prompts, (37, 21)):
        ids = models.chat_ids(prompt) if chat else models.encode(prompt)
        expected = models.solo_text(ids, n)
        if chat:
            whole = client.chat.completions.create(model=MODEL_NAME, messages=prompt, max_tokens=n, temperature=0)
            text = whole.choices[0].message.content
            assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
            stream = client.chat.completions.create(model=MODEL_NAME, messages=prompt, max_tokens=n, temperature=0,
                                                    stream=True, stream_options={"include_usage": True})
        else:
            whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=n, temperature=0)
            text = whole.choices[0].text
            stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=n, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
        streamed, chunks = stream_text(stream, chat)
        assert text == streamed == expected
        assert whole.choices[0].finish_reason == "length"
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), n)
        check_stats(whole.model_extra["dflash"], n)
        final, usage = chunks[-2], chunks[-1]
        assert final.choices[0].finish_reason == "length" and usage.choices == []
        assert (usage.usage.prompt_tokens, usage.usage.completion_tokens, usage.usage.total_tokens) == \
            (len(ids), n, len(ids) + n)
        check_stats(final.model_extra["dflash"], n)
        if chat:
            assert chunks[0].choices[0].delta.role == "assistant"
        assert len({chunk.id for chunk in chunks}) == 1


def test_a_reply_sent_back_as_the_client_returned_it_continues_the_conversation(server, models):
    """The usual multi-turn pattern: the assistant message object, dumped with its null fields (refusal, tool_calls,
    audio, ...), goes back in ``messages``; the second answer is the greedy output for the whole conversation."""
    client = server.client()
    first = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0)
    sent_back = first.choices[0].message.model_dump()
    assert "tool_calls" in sent_back and sent_back["tool_calls"] is None
    conversation = [*CHAT, sent_back, {"role": "user", "content": "Now subtract them."}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=conversation, max_tokens=12, temperature=0)
    ids = models.chat_ids([*CHAT, {"role": "assistant", "content": first.choices[0].message.content},
                           {"role": "user", "content": "Now subtract them."}])
    assert second.choices[0].message.content == models.solo_text(ids, 12)


def test_stop_strings_and_stop_tokens_end_the_answer(server, models):
    client = server.client()
    prompt, n = "def add(a, b):", 37
    ids = models.encode(prompt)
    solo_ids = models.solo_ids(ids, n)
    solo = models.solo_text(ids, n)
    stop = solo[12:15]
    cut = solo[: solo.index(stop)]
    for stream in (False, True):
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=n, temperature=0,
                                             stop=[stop, "never-there"], stream=stream)
        if stream:
            text, chunks = stream_text(response, chat=False)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = response.choices[0].text, response.choices[0].finish_reason
        assert (text, reason) == (cut, "stop")
    k = 9
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=n, temperature=0,
                                         extra_body={"stop_token_ids": [solo_ids[k]]})
    first = solo_ids.index(solo_ids[k])  # the first occurrence of that token ends the answer
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == first + 1
    assert response.choices[0].text == models.tokenizer.decode(solo_ids[: first + 1], skip_special_tokens=True)


def test_a_seed_reproduces_a_sample_streamed_or_not(one_row, models):
    client = one_row.client()
    kwargs = {"model": MODEL_NAME, "prompt": "the answer is", "max_tokens": 30, "temperature": 0.9, "top_p": 0.95}
    texts = {}
    for seed in (1, 2, 3):
        first = client.completions.create(seed=seed, **kwargs)
        again = client.completions.create(seed=seed, **kwargs)
        streamed, _ = stream_text(client.completions.create(seed=seed, stream=True, **kwargs), chat=False)
        assert first.choices[0].text == again.choices[0].text == streamed
        assert first.model_extra["dflash"]["seed"] == seed
        texts[seed] = first.choices[0].text
    assert len(set(texts.values())) > 1, "three seeds gave one sample: the test cannot see the seed"
    unseeded = client.completions.create(**kwargs)
    drawn = unseeded.model_extra["dflash"]["seed"]  # the server draws one and says which
    assert client.completions.create(seed=drawn, **kwargs).choices[0].text == unseeded.choices[0].text


def test_a_burst_of_64_requests_from_16_clients(server, models):
    """Every answer arrives whole and equals its solo output: greedy requests transformers' greedy continuation,
    seeded sampled ones (every fifth) plain AR sampling's with that seed, whatever the other rows and the tree
    sizes the load makes the cost-aware tree choose."""
    before = server.metrics()
    jobs = []
    for i in range(64):
        chat, stream, n = i % 2 == 1, i % 3 == 0, 6 + (i * 7) % 17
        sampling = SamplingParams(0.8, top_p=0.95, seed=7000 + i) if i % 5 == 2 else SamplingParams()
        if chat:
            prompt = [{"role": "user", "content": f"request {i}: sum ({i}, {i * 3})"}]
            ids = models.chat_ids(prompt)
        else:
            prompt = f"request {i}: def f{i}(x):"
            ids = models.encode(prompt)
        solo = models.solo_text(ids, n) if sampling.greedy else models.solo_sample_text(ids, n, sampling)
        jobs.append((i, chat, stream, n, prompt, solo, sampling))

    async def one(client, job) -> tuple[int, str, int]:
        i, chat, stream, n, prompt, _, sampling = job
        common = {"model": MODEL_NAME, "max_tokens": n, "temperature": sampling.temperature, "top_p": sampling.top_p}
        if not sampling.greedy:
            common["seed"] = sampling.seed
        if chat:
            response = await client.chat.completions.create(messages=prompt, stream=stream, **common)
        else:
            response = await client.completions.create(prompt=prompt, stream=stream, **common)
        if not stream:
            choice = response.choices[0]
            return i, choice.message.content if chat else choice.text, response.usage.completion_tokens
        parts = []
        async for chunk in response:
            for choice in chunk.choices:
                parts.append((choice.delta.content or "") if chat else choice.text)
        return i, "".join(parts), n

    async def burst() -> list[tuple[int, str, int]]:
        client = server.async_client(timeout=120)
        queue: asyncio.Queue = asyncio.Queue()
        for job in jobs:
            queue.put_nowait(job)
        results = []

        async def client_loop() -> None:
            while not queue.empty():
                results.append(await one(client, queue.get_nowait()))

        await asyncio.gather(*(client_loop() for _ in range(16)))
        await client.close()
        return results

    results = asyncio.run(burst())
    assert sorted(i for i, _, _ in results) == list(range(64))
    for i, text, tokens in results:
        assert text == jobs[i][5], f"request {i} differs from its solo output"
        assert tokens == jobs[i][3]
    after = server.metrics()
    assert after['dflash_requests_finished_total{finish_reason="length"}'] - \
        before.get('dflash_requests_finished_total{finish_reason="length"}', 0) == 64
    assert after["dflash_running_requests"] == after["dflash_queue_depth"] == 0
    # The four rows were used together (one batched step covers every live row).
    assert after["dflash_row_steps_total"] - before["dflash_row_steps_total"] > \
        1.5 * (after["dflash_engine_steps_total"] - before["dflash_engine_steps_total"])


def _first_chunk_then_gone(live: LiveServer, max_tokens: int) -> None:
    stream = live.client().completions.create(model=MODEL_NAME, prompt="the answer is", max_tokens=max_tokens,
                                              temperature=0, stream=True)
    next(iter(stream))
    stream.close()


def test_a_client_that_disconnects_frees_its_row(one_row):
    """One row. A 400-token request needs seconds; its client leaves after the first chunk (streamed) or after
    0.3 s (not streamed). Each time the next request is served at once, and the first stopped early."""
    client = one_row.client()
    for streamed in (True, False):
        with slowed(one_row, 0.01):
            check_the_row_is_freed(one_row, client, streamed)


def check_the_row_is_freed(one_row: LiveServer, client, streamed: bool) -> None:
    before = one_row.metrics()
    if streamed:
        _first_chunk_then_gone(one_row, 400)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(one_row.url + "/v1/completions", timeout=0.3,
                       json={"prompt": "the answer is", "max_tokens": 400, "temperature": 0})
    start = time.monotonic()
    response = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5, temperature=0)
    waited = time.monotonic() - start
    assert response.usage.completion_tokens == 5
    assert response.model_extra["dflash"]["queue_seconds"] < 1.0 and waited < 2.0
    after = one_row.metrics()
    assert after["dflash_requests_cancelled_total"] - before["dflash_requests_cancelled_total"] == 1
    generated = after["dflash_generation_tokens_total"] - before["dflash_generation_tokens_total"]
    assert generated < 400, "the abandoned request ran to its end"
    assert after["dflash_running_requests"] == 0


def test_past_the_queue_requests_get_429_with_a_reason(one_row):
    with slowed(one_row, 0.01):
        check_429(one_row, one_row.client())


def check_429(one_row: LiveServer, client) -> None:
    stream = client.completions.create(model=MODEL_NAME, prompt="the answer is", max_tokens=400, temperature=0,
                                       stream=True)
    next(iter(stream))  # the one row is busy
    waiting: dict = {}
    thread = threading.Thread(target=lambda: waiting.update(
        r=client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, temperature=0)))
    thread.start()
    deadline = time.monotonic() + 10
    while one_row.metrics()["dflash_queue_depth"] < 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, temperature=0)
    assert refused.value.status_code == 429
    assert "at capacity: 2 requests in flight (1 rows + a queue of 1)" in refused.value.message
    assert refused.value.response.headers["retry-after"] == "1"
    stream.close()
    thread.join(30)
    assert waiting["r"].usage.completion_tokens == 3  # the queued request was served, not dropped
    assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, temperature=0).usage  # room again


#: (endpoint, body, the field the 400 names, text the message holds)
MALFORMED = [
    ("completions", {"model": "gpt-4", "prompt": "x"}, "model", "model='gpt-4': unknown model"),
    ("completions", {"prompt": "x", "max_tokens": -1}, "max_tokens", "max_tokens=-1"),
    ("completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens", "max_tokens='5'"),
    ("completions", {"prompt": "x", "max_tokens": 2.5}, "max_tokens", "max_tokens=2.5"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature", "temperature='hot'"),
    ("completions", {"prompt": "x", "temperature": 3}, "temperature", "temperature=3"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p", "top_p=0"),
    ("completions", {"prompt": "x", "seed": -4}, "seed", "seed=-4"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream", "stream='yes'"),
    ("completions", {"prompt": "x", "stop": [3]}, "stop[0]", "stop[0]=3"),
    ("completions", {"prompt": "x", "stop": ""}, "stop", "stop='': a stop string must not be empty"),
    ("completions", {"prompt": "x", "stop": 5}, "stop", "stop=5: Input should be a valid string or Input should be a valid list"),
    ("completions", {"prompt": "y" * 600}, "prompt", "the prompt has 600 tokens; this model's context is 512"),
    ("completions", {"prompt": "x" * 10, "max_tokens": 510}, "max_tokens", "max_tokens=510: the prompt has 10"),
    ("completions", {"prompt": [5, 64]}, "prompt", "prompt[1]=64: not a token id"),
    ("completions", {"prompt": ["a", "b"]}, "prompt", "a list of 2 prompts"),
    ("completions", {"prompt": "x", "stop_token_ids": [99]}, "stop_token_ids", "stop_token_ids[0]=99"),
    ("completions", {"prompt": "x", "n": 2}, "n", "n=2: not supported"),
    ("completions", {"prompt": "x", "logprobs": 3}, "logprobs", "logprobs=3: not supported"),
    ("completions", {"prompt": "x", "max_token": 5}, "max_token", "max_token: unknown field"),
    ("completions", {"max_tokens": 5}, "prompt", "prompt: required field is missing"),
    ("chat/completions", {"messages": []}, "messages", "messages=[]"),
    ("chat/completions", {"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role",
     "messages[0].role='bot'"),
    ("chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages[0].content",
     "messages[0].content=7"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens=0"),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools", "not supported"),
    ("chat/completions", {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "call_1"}]}]},
     "messages[0].tool_calls", "messages[0].tool_calls=[{'id': 'call_1'}]: not supported"),
]


def test_malformed_requests_get_400_naming_the_field_and_the_rest_is_undisturbed(server, models):
    ids = models.encode("def add(a, b):")
    expected = models.solo_text(ids, 150)
    good: dict = {}
    thread = threading.Thread(target=lambda: good.update(text=stream_text(server.client().completions.create(
        model=MODEL_NAME, prompt="def add(a, b):", max_tokens=150, temperature=0, stream=True), chat=False)[0]))
    thread.start()
    before = server.metrics()
    for endpoint, body, param, text in MALFORMED:
        response = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=30)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and text in error["message"], (body, error)
        assert error["type"] == "invalid_request_error"
    for raw, text in ((b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object")):
        response = httpx.post(f"{server.url}/v1/completions", content=raw, timeout=30,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and text in response.json()["error"]["message"], response.text
    with pytest.raises(openai.BadRequestError, match="unknown model"):
        server.client().completions.create(model="davinci", prompt="x")
    thread.join(60)
    assert good["text"] == expected  # the request in flight was not disturbed
    after = server.metrics()
    rejected = 'dflash_requests_rejected_total{reason="invalid_request"}'
    assert after[rejected] - before.get(rejected, 0) == len(MALFORMED) + 3
    assert server.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, temperature=0).usage


def test_models_health_and_metrics(server):
    listing = server.client().models.list()
    assert [m.id for m in listing.data] == [MODEL_NAME]
    assert listing.data[0].model_extra["max_model_len"] == 512
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    response = httpx.get(server.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    metrics = server.metrics()  # every line parses (serve_support.parse_prometheus)
    for name in ("dflash_requests_received_total", "dflash_generation_tokens_total", "dflash_queue_depth",
                 "dflash_running_requests", "dflash_mean_acceptance_length", "dflash_max_batch_size",
                 'dflash_tree_size_bucket{le="+Inf"}', "dflash_acceptance_length_sum",
                 "dflash_time_to_first_token_seconds_count"):
        assert name in metrics, name
    assert metrics["dflash_max_batch_size"] == 4
    assert metrics['dflash_tree_size_bucket{le="+Inf"}'] == metrics["dflash_row_steps_total"]
    assert metrics["dflash_mean_acceptance_length"] == pytest.approx(
        metrics["dflash_committed_tokens_total"] / metrics["dflash_row_steps_total"])


class FailingRunner(SlowRunner):
    """Raises in ``step`` while ``failing`` is set."""

    failing = False

    def step(self) -> dict[int, RowStep]:
        if self.failing:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.inner.step()


def test_a_failing_step_is_answered_and_the_server_goes_on(models):
    runner = FailingRunner(GraphedRunner(models.spec(speculative=False)), 0.0)
    live = LiveServer(runner, models.tokenizer)
    try:
        client = live.client()
        runner.failing = True
        with pytest.raises(openai.InternalServerError, match="the decode step failed: RuntimeError: CUDA error"):
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5, temperature=0)
        with httpx.stream("POST", live.url + "/v1/completions", timeout=30,
                          json={"prompt": "x", "max_tokens": 5, "temperature": 0, "stream": True}) as response:
            assert response.status_code == 200
            events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "the decode step failed" in json.loads(events[-2])["error"]["message"]
        runner.failing = False
        ids = models.encode("x")
        assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5,
                                         temperature=0).choices[0].text == models.solo_text(ids, 5)
        assert live.metrics()["dflash_requests_failed_total"] == 2
    finally:
        live.close()


class ChattyRunner:
    """One row whose every step commits " a" (a space, then a letter: the detokenizer releases text each step) after
    sleeping ``seconds``: a long request sends text continuously for as long as it runs."""

    def __init__(self, tokenizer, seconds: float = 0.02) -> None:
        self.max_batch, self.max_model_len, self.vocab_size = 1, 100_000, len(tokenizer)
        self.description, self.seconds = "chatty", seconds
        self.tokens = list(tokenizer(" a", add_special_tokens=False)["input_ids"])
        self.slots: set[int] = set()

    def admit(self, slot: int, row) -> None:
        self.slots.add(slot)

    def step(self) -> dict[int, RowStep]:
        time.sleep(self.seconds)
        return {slot: RowStep(list(self.tokens), tree_size=2) for slot in self.slots}

    def release(self, slot: int) -> None:
        self.slots.discard(slot)


def test_a_non_streamed_client_that_leaves_while_text_flows_frees_its_row_at_once(models):
    """The row sends text every 20 ms; its non-streamed client gives up after 0.3 s: the request is cancelled within
    a few disconnect polls, not only once the text pauses (it never does here)."""
    live = LiveServer(ChattyRunner(models.tokenizer), models.tokenizer)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", timeout=0.3,
                       json={"prompt": "x", "max_tokens": 50_000, "temperature": 0})
        gone = time.monotonic()
        while live.metrics().get("dflash_requests_cancelled_total", 0) < 1:
            assert time.monotonic() - gone < 2.0, "the abandoned request kept its row"
            time.sleep(0.05)
        assert live.metrics()["dflash_running_requests"] == 0
    finally:
        live.close()


def test_a_prompt_being_encoded_blocks_nobody_and_a_huge_body_gets_413(models):
    """Encoding runs off the event loop: while one prompt takes 2 s to encode, /health and another request are answered
    at once. A body over the limit gets 413 in OpenAI's error shape, from its Content-Length or, sent without one,
    as soon as it passes the limit; the server goes on."""
    runner = graphed_rows(models.spec(speculative=False), 1)
    live = LiveServer(runner, SlowTokenizer(models.tokenizer, 2.0), max_body_bytes=4096)
    try:
        slow: dict = {}
        thread = threading.Thread(target=lambda: slow.update(r=httpx.post(
            live.url + "/v1/completions", timeout=30, json={"prompt": "slow one", "max_tokens": 2, "temperature": 0})))
        thread.start()
        time.sleep(0.3)
        start = time.monotonic()
        assert httpx.get(live.url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - start < 1.0, "the event loop waited for the tokenizer"
        thread.join(30)
        assert slow["r"].status_code == 200
        big = {"prompt": "x" * 5000, "max_tokens": 2}
        response = httpx.post(live.url + "/v1/completions", json=big, timeout=30)
        assert response.status_code == 413 and "accepts at most 4096" in response.json()["error"]["message"]

        def chunks():
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}'

        response = httpx.post(live.url + "/v1/completions", content=chunks(), timeout=30,
                              headers={"content-type": "application/json"})
        assert response.status_code == 413, response.text
        ids = models.encode("x")
        assert live.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, temperature=0) \
            .choices[0].text == models.solo_text(ids, 3)
    finally:
        live.close()


def test_odd_but_valid_values_are_served_and_unknown_paths_answer_in_openai_shape(server, models):
    """A temperature below float32's range decodes greedily (it once gave NaN probabilities and garbage), a top_k past
    the vocabulary keeps every token (it once overflowed into a 500), null for stream/echo/skip_special_tokens is their
    default; a prompt the tokenizer cannot encode (a lone surrogate) is a 400 naming the prompt, logprobs=0 on
    completions (a request for the chosen tokens' log-probabilities) is refused; unknown paths and methods are 404 and
    405 in OpenAI's error shape, and a body sent without a JSON content type is told so."""
    ids = models.encode("def f(")
    greedy = models.solo_text(ids, 8)
    for extra in ({"temperature": 1e-300}, {"temperature": 1e-45}, {"top_k": 2 ** 63, "temperature": 0},
                  {"top_k": 10 ** 30, "temperature": 0}, {"stream": None, "echo": None, "skip_special_tokens": None,
                                                          "temperature": 0}):
        response = httpx.post(server.url + "/v1/completions", timeout=30,
                              json={"prompt": "def f(", "max_tokens": 8, **extra})
        assert response.status_code == 200, (extra, response.text)
        assert response.json()["choices"][0]["text"] == greedy, extra
    response = httpx.post(server.url + "/v1/completions", timeout=30,
                          content=b'{"prompt": "\\ud800abc", "max_tokens": 2}', headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "logprobs": 0}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"
    for method, path, status, says in (("GET", "/v1/nothing", 404, "no such endpoint"),
                                       ("GET", "/v1/completions", 405, "method not allowed")):
        response = httpx.request(method, server.url + path, timeout=30)
        assert response.status_code == status and says in response.json()["error"]["message"], response.text
    response = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x"}', timeout=30)
    assert response.status_code == 400 and "Content-Type: application/json" in response.json()["error"]["message"]
    assert server.client().completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, temperature=0).usage


def test_shutting_down_answers_what_cannot_finish(models):
    """Ctrl-C with a long stream and a long non-streamed request in flight: the server stops taking connections, and
    before its graceful timeout (3 s) cancels them, the engine stops so that both are answered: the stream with an
    error event and [DONE], the other with 503."""
    runner = SlowRunner(graphed_rows(models.spec(speculative=False), 2), 0.05)
    live = LiveServer(runner, models.tokenizer, shutdown_timeout=3)
    answers = long_requests_in_flight(live)
    start = time.monotonic()
    live.close()
    answers["join"]()
    assert time.monotonic() - start < 3.5
    assert answers["stream"][-1] == "[DONE]", answers["stream"][-3:]
    assert "error" in json.loads(answers["stream"][-2]), answers["stream"][-2]
    assert answers["plain"].status_code == 503 and "error" in answers["plain"].json()


def test_openai_conformance_model_retrieve_nested_token_prompt_developer_role_and_zero_counters(server, models):
    """Found by a QA pass: ``client.models.retrieve`` was a 404 (no GET /v1/models/{id}); a prompt as a list of one
    token-id list (the OpenAI API's array of token arrays) was a 400; a "developer" message went to the chat
    template under a role templates do not know (Qwen3's renders nothing for it) instead of as the system message it
    is; a labelled counter was an unlabelled 0 until its first event, a series Prometheus then saw vanish."""
    from tensorrt_llm_dflash.serve.protocol import ChatCompletionRequest, chat_messages

    client = server.client()
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    response = httpx.get(server.url + "/v1/models/other", timeout=30)
    assert response.status_code == 404 and response.json()["error"]["param"] == "model", response.text
    ids = models.encode("def f(")
    flat = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    nested = client.completions.create(model=MODEL_NAME, prompt=[ids], max_tokens=6, temperature=0)
    assert nested.choices[0].text == flat.choices[0].text == models.solo_text(ids, 6)
    for prompt in ([ids, ids], [[]]):
        response = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    body = ChatCompletionRequest(messages=[{"role": "developer", "content": "Be brief."},
                                           {"role": "user", "content": "hi"}])
    assert chat_messages(body) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    samples = parse_prometheus(httpx.get(server.url + "/metrics", timeout=30).text)
    for series in ('dflash_requests_rejected_total{reason="queue_full"}',
                   'dflash_requests_rejected_total{reason="unavailable"}',
                   'dflash_requests_finished_total{finish_reason="stop"}',
                   'dflash_requests_finished_total{finish_reason="length"}'):
        assert series in samples, series
    assert "dflash_requests_rejected_total" not in samples and "dflash_requests_finished_total" not in samples
