"""The scheduler (tensorrt_llm_dflash.serve.engine) over a scripted runner of several rows (no model): continuous
batching (FIFO admission into free rows at step boundaries, rows admitted while others run, retirement), the
bounded queue, cancellation of waiting and running requests, and that every request gets exactly one final
event whatever goes wrong (a refused admission, a failing step, a runner that commits nothing, a stop)."""

from __future__ import annotations

import random
import threading
import time

import pytest
from tiny_dirs import char_tokenizer

from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.sampling import SamplingParams
from tensorrt_llm_dflash.serve.engine import Engine, EngineStopped, Failed, Finished, QueueFull, TextDelta
from tensorrt_llm_dflash.serve.runner import RowRequest, RowStep
from tensorrt_llm_dflash.serve.sequence import GenerationRequest

TOKENIZER = char_tokenizer()
FIRST_CHAR, LAST_CHAR = 3, 40  # ids of plain characters in the character tokenizer


def continuation(prompt: list[int], n: int) -> list[int]:
    """What the scripted runner generates for ``prompt``: a function of the prompt alone."""
    rng = random.Random(str(prompt))
    return [rng.randint(FIRST_CHAR, LAST_CHAR) for _ in range(n)]


class ScriptedRunner:
    """``max_batch`` rows; each step commits 1-3 tokens per row (drawn per row), the row's own continuation.

    Records admissions, releases and the requests (by admission index) live in each step. ``gate`` (when set) must be open for a step to
    run, and each step sleeps ``step_seconds``; ``fail_next_step`` makes the next step raise; ``refuse`` lists prompts whose admission is refused.
    """

    def __init__(self, max_batch: int) -> None:
        self.max_batch, self.max_model_len, self.vocab_size = max_batch, 512, 64
        self.description = "scripted"
        self.rows: dict[int, tuple[RowRequest, list[int], random.Random]] = {}
        self.admission_of: dict[int, int] = {}  # slot -> index in ``admitted`` (slots are reused)
        self.admitted: list[tuple[int, list[int]]] = []
        self.released: list[int] = []
        self.live_per_step: list[frozenset[int]] = []
        self.gate: threading.Event | None = None
        self.fail_next_step = False
        self.commit_nothing = False
        self.refuse: set[tuple[int, ...]] = set()
        self.step_seconds = 0.0

    def admit(self, slot: int, row: RowRequest) -> None:
        assert slot not in self.rows and 0 <= slot < self.max_batch, f"slot {slot} admitted twice or out of range"
        if tuple(row.prompt_ids) in self.refuse:
            raise DFlashInputError("prompt refused by the runner")
        self.rows[slot] = (row, continuation(row.prompt_ids, row.max_new_tokens), random.Random(slot))
        self.admission_of[slot] = len(self.admitted)
        self.admitted.append((slot, list(row.prompt_ids)))

    def step(self) -> dict[int, RowStep]:
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        time.sleep(self.step_seconds)
        self.live_per_step.append(frozenset(self.admission_of[slot] for slot in self.rows))
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("device lost")
        if self.commit_nothing:
            return {}
        out = {}
        for slot, (_row, tokens, rng) in self.rows.items():
            k = rng.randint(1, 3)
            out[slot] = RowStep(tokens[:k], tree_size=4)
            del tokens[:k]
        return out

    def release(self, slot: int) -> None:
        self.rows.pop(slot, None)
        self.released.append(slot)


class Collector:
    """Events of every request, and a check that each request got exactly one final event."""

    def __init__(self) -> None:
        self.events: dict[str, list] = {}
        self.done = threading.Condition()

    def on(self, request_id: str):
        self.events[request_id] = []

        def receive(event) -> None:
            with self.done:
                self.events[request_id].append(event)
                self.done.notify_all()

        return receive

    def final(self, request_id: str):
        finals = [e for e in self.events[request_id] if isinstance(e, (Finished, Failed))]
        assert len(finals) == 1, f"{request_id}: {len(finals)} final events"
        return finals[0]

    def text(self, request_id: str) -> str:
        events = self.events[request_id]
        return "".join(e.text for e in events if isinstance(e, TextDelta)) + events[-1].text_tail

    def wait(self, request_ids, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self.done:
            while not all(any(isinstance(e, (Finished, Failed)) for e in self.events[r]) for r in request_ids):
                assert self.done.wait(max(0.0, deadline - time.monotonic())), "requests left unanswered"


def request(name: str, max_tokens: int = 12, prompt: list[int] | None = None) -> GenerationRequest:
    prompt = prompt or [FIRST_CHAR + (sum(map(ord, name)) % 30), FIRST_CHAR + len(name)]
    return GenerationRequest(name, prompt, max_tokens, SamplingParams())


@pytest.fixture
def started():
    engines: list[Engine] = []

    def start(runner: ScriptedRunner, max_queue: int = 64) -> Engine:
        engine = Engine(runner, TOKENIZER, max_queue=max_queue)
        engine.start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        if engine.runner.gate is not None:
            engine.runner.gate.set()
        engine.stop()


def test_rows_are_filled_in_order_and_refilled_while_others_run(started):
    runner = ScriptedRunner(max_batch=3)
    runner.gate = threading.Event()  # hold the first step until everything is queued
    engine = started(runner)
    events = Collector()
    names = [f"r{i}" for i in range(10)]
    lengths = {name: 5 + 4 * (i % 4) for i, name in enumerate(names)}
    for name in names:
        engine.submit(request(name, lengths[name]), events.on(name))
    runner.gate.set()
    events.wait(names)
    for name in names:
        final = events.final(name)
        prompt = request(name).prompt_ids
        assert isinstance(final, Finished) and final.finish_reason == "length"
        assert final.completion_tokens == lengths[name]
        assert events.text(name) == TOKENIZER.decode(continuation(prompt, lengths[name]))
    assert [prompt for _, prompt in runner.admitted] == [request(n).prompt_ids for n in names]  # FIFO
    assert max(len(live) for live in runner.live_per_step) == 3
    # Continuous batching: some request joined a step whose other rows had started earlier.
    joined_mid_run = any(len(after - before) and len(after & before)
                         for before, after in zip(runner.live_per_step, runner.live_per_step[1:]))
    assert joined_mid_run
    assert sorted(runner.released) == sorted(slot for slot, _ in runner.admitted)
    assert engine.metrics.value("requests_finished_total", finish_reason="length") == 10


def test_past_rows_plus_queue_requests_are_refused_with_a_reason(started):
    runner = ScriptedRunner(max_batch=1)
    runner.gate = threading.Event()
    engine = started(runner, max_queue=2)
    events = Collector()
    for name in ("a", "b", "c"):
        engine.submit(request(name), events.on(name))
    with pytest.raises(QueueFull, match=r"3 requests in flight \(1 rows \+ a queue of 2\)"):
        engine.submit(request("d"), events.on("d"))
    runner.gate.set()
    events.wait(["a", "b", "c"])
    assert all(isinstance(events.final(n), Finished) for n in ("a", "b", "c"))
    assert events.events["d"] == []
    assert engine.metrics.value("requests_rejected_total", reason="queue_full") == 1
    engine.submit(request("e"), events.on("e"))  # room again
    events.wait(["e"])


def test_cancelled_requests_leave_the_queue_and_free_their_row(started):
    runner = ScriptedRunner(max_batch=1)
    runner.gate = threading.Event()
    runner.step_seconds = 0.01  # "running" needs about a second: it is cancelled long before its end
    engine = started(runner)
    events = Collector()
    engine.submit(request("running", 200), events.on("running"))
    engine.submit(request("waiting"), events.on("waiting"))
    engine.submit(request("next"), events.on("next"))
    runner.gate.set()
    deadline = time.monotonic() + 10
    while not events.events["running"] and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.cancel("waiting")
    engine.cancel("running")
    events.wait(["next"])
    assert isinstance(events.final("next"), Finished)
    admitted = [prompt for _, prompt in runner.admitted]
    assert request("waiting").prompt_ids not in admitted  # never took a row
    assert not any(isinstance(e, (Finished, Failed)) for e in events.events["running"])
    assert engine.metrics.value("requests_cancelled_total") == 2
    assert engine.metrics.value("generation_tokens_total") < 200 + 12  # "running" stopped early


def test_a_failing_step_fails_its_rows_and_later_requests_are_served(started):
    runner = ScriptedRunner(max_batch=2)
    runner.gate = threading.Event()
    engine = started(runner)
    events = Collector()
    runner.fail_next_step = True
    engine.submit(request("x"), events.on("x"))
    engine.submit(request("y"), events.on("y"))
    runner.gate.set()
    events.wait(["x", "y"])
    for name in ("x", "y"):
        final = events.final(name)
        assert isinstance(final, Failed) and final.status == 500 and "RuntimeError: device lost" in final.message
    engine.submit(request("z"), events.on("z"))
    events.wait(["z"])
    assert isinstance(events.final("z"), Finished) and engine.alive


def test_a_refused_admission_fails_that_request_only(started):
    runner = ScriptedRunner(max_batch=2)
    engine = started(runner)
    events = Collector()
    runner.refuse.add((9, 9))
    engine.submit(request("bad", prompt=[9, 9]), events.on("bad"))
    engine.submit(request("good"), events.on("good"))
    events.wait(["bad", "good"])
    bad = events.final("bad")
    assert isinstance(bad, Failed) and bad.status == 400 and "prompt refused by the runner" in bad.message
    assert isinstance(events.final("good"), Finished)
    assert runner.released.count(0) + runner.released.count(1) >= 2  # the refused slot was released too


def test_a_runner_that_commits_nothing_fails_the_rows_instead_of_spinning(started):
    runner = ScriptedRunner(max_batch=1)
    runner.commit_nothing = True
    engine = started(runner)
    events = Collector()
    engine.submit(request("stuck"), events.on("stuck"))
    events.wait(["stuck"])
    final = events.final("stuck")
    assert isinstance(final, Failed) and final.status == 500 and "committed no token" in final.message


def test_stopping_answers_everything_in_flight_with_503(started):
    runner = ScriptedRunner(max_batch=1)
    runner.gate = threading.Event()
    engine = started(runner)
    events = Collector()
    for name in ("p", "q", "r"):
        engine.submit(request(name, 100), events.on(name))
    time.sleep(0.05)  # "p" is in its row (held at the gate), "q" and "r" wait
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    runner.gate.set()
    stopper.join(30)
    events.wait(["p", "q", "r"])
    for name in ("p", "q", "r"):
        final = events.final(name)
        assert isinstance(final, Failed) and final.status == 503 and "shutting down" in final.message
    with pytest.raises(EngineStopped):
        engine.submit(request("late"), events.on("late"))


def test_run_steps_on_the_calling_thread_and_a_second_start_is_refused():
    runner = ScriptedRunner(max_batch=1)
    stepped_on: set[int] = set()
    step = runner.step
    runner.step = lambda: (stepped_on.add(threading.get_ident()), step())[1]
    engine = Engine(runner, TOKENIZER, max_queue=1)
    ready = threading.Event()
    thread = threading.Thread(target=engine.run, kwargs={"ready": ready.set})
    thread.start()
    try:
        assert ready.wait(30) and engine.alive
        with pytest.raises(RuntimeError, match="started already"):
            engine.start()
        events = Collector()
        engine.submit(request("a"), events.on("a"))
        events.wait(["a"])
        assert isinstance(events.final("a"), Finished)
    finally:
        engine.stop()
        thread.join(30)
    assert not thread.is_alive() and stepped_on == {thread.ident}


def test_the_server_builds_the_model_and_steps_it_on_one_thread(monkeypatch):
    """``serve``'s start_model_thread: the thread that built the runner runs the step loop (Engine.run says why)."""
    import argparse

    from tensorrt_llm_dflash.serve import __main__ as serve_main

    seen: dict[str, set[int]] = {"build": set(), "step": set()}

    class Recording(ScriptedRunner):
        def step(self):
            seen["step"].add(threading.get_ident())
            return super().step()

    def build(args, manage_engine=True):
        assert manage_engine is False, "the model thread runs the engine: the app must not start another thread"
        seen["build"].add(threading.get_ident())
        return "app", Engine(Recording(max_batch=2), TOKENIZER, max_queue=4)

    monkeypatch.setattr(serve_main, "build_server", build)
    app, engine = serve_main.start_model_thread(argparse.Namespace())
    try:
        assert app == "app" and engine.alive  # taking requests when it returns
        events = Collector()
        for name in ("a", "b", "c"):
            engine.submit(request(name), events.on(name))
        events.wait(["a", "b", "c"])
        assert all(isinstance(events.final(name), Finished) for name in ("a", "b", "c"))
    finally:
        engine.stop()
    assert len(seen["build"]) == 1 and seen["step"] == seen["build"]
    assert threading.get_ident() not in seen["build"]


def test_a_failing_model_build_is_raised_to_the_caller(monkeypatch):
    import argparse

    from tensorrt_llm_dflash.serve import __main__ as serve_main

    def build(args, manage_engine=True):
        raise DFlashInputError("argument --draft_model_dir: no such drafter")

    monkeypatch.setattr(serve_main, "build_server", build)
    with pytest.raises(DFlashInputError, match="--draft_model_dir"):
        serve_main.start_model_thread(argparse.Namespace())


class HandOverRunner(ScriptedRunner):
    """A scripted runner that prefills in ``admit``: the first token of each new row is handed over by
    ``take_admitted`` (the engine asks for it after admitting), the rest by the steps."""

    def __init__(self, max_batch: int) -> None:
        super().__init__(max_batch)
        self.pending: dict[int, RowStep] = {}
        self.handed_over = 0

    def admit(self, slot: int, row: RowRequest) -> None:
        super().admit(slot, row)
        tokens = self.rows[slot][1]
        self.pending[slot] = RowStep([tokens.pop(0)], tree_size=0)

    def take_admitted(self) -> dict[int, RowStep]:
        taken, self.pending = self.pending, {}
        self.handed_over += len(taken)
        return taken

    def release(self, slot: int) -> None:
        super().release(slot)
        self.pending.pop(slot, None)


def test_a_new_request_takes_its_first_token_before_the_next_step(started):
    """With a runner that hands prefill tokens over (``take_admitted``), a request's first token is the engine's
    before the batch steps again (the steps are held at a gate here; the text waits for the end of its word, as
    ever), and both answers are whole; a one-token request is answered at its admission."""
    runner = HandOverRunner(max_batch=3)
    runner.gate = threading.Event()  # no step runs until the test opens it
    engine = started(runner)
    events = Collector()
    engine.submit(request("first", 8), events.on("first"))
    engine.submit(request("one", 1), events.on("one"))
    events.wait(["one"])  # answered with the gate shut
    assert runner.live_per_step == []  # no step has run: the tokens came from the hand-over
    assert engine.metrics.value("generation_tokens_total") == 2  # "first"'s first token too
    assert isinstance(events.final("one"), Finished) and events.text("one") == TOKENIZER.decode(
        continuation(request("one").prompt_ids, 1))
    runner.gate.set()
    events.wait(["first"])
    assert events.text("first") == TOKENIZER.decode(continuation(request("first").prompt_ids, 8))
    assert runner.handed_over == 2 and sorted(runner.released) == [0, 1]


def test_a_failing_hand_over_fails_the_new_requests_only(started):
    """A runner whose ``take_admitted`` raises may have lost the new rows' first tokens: those requests get a 500
    (never an answer missing its first token), the request already running is answered whole, and later ones are
    served."""
    runner = HandOverRunner(max_batch=3)
    runner.gate = threading.Event()
    engine = started(runner)
    events = Collector()
    engine.submit(request("running", 10), events.on("running"))
    time.sleep(0.05)  # admitted and handed over; its first step waits at the gate
    real_take = runner.take_admitted

    def broken() -> dict:
        runner.take_admitted = real_take
        raise RuntimeError("device lost")

    runner.take_admitted = broken
    engine.submit(request("new", 6), events.on("new"))
    runner.gate.set()
    events.wait(["new"])
    engine.submit(request("later", 5), events.on("later"))
    events.wait(["running", "later"])
    failed = events.final("new")
    assert isinstance(failed, Failed) and failed.status == 500 and "could not be started" in failed.message
    assert not any(isinstance(e, TextDelta) for e in events.events["new"])
    for name, n in (("running", 10), ("later", 5)):
        assert isinstance(events.final(name), Finished)
        assert events.text(name) == TOKENIZER.decode(continuation(request(name).prompt_ids, n))
