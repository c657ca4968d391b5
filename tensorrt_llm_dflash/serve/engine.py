"""The scheduler: one thread owns the model and runs the step loop; requests come and go between steps.

    HTTP handlers ──submit()──▶ waiting queue (bounded) ──admit at a step boundary──▶ rows (slots)
          ▲                                                                            │
          └──────── on_event(TextDelta / Finished / Failed), from the engine thread ◀───┘ step()

Continuous batching in nano-vllm's manner: at every step boundary the engine frees the rows of
finished and cancelled requests, admits waiting requests into free slots (FIFO), and runs one
``runner.step()`` for all admitted rows. Nothing here depends on the batch size: a runner of one
row serves many clients through the queue, and the same loop fills B rows when the runner has them.

Every request that reached :meth:`Engine.submit` gets exactly one final event, ``Finished`` or
``Failed`` (a cancelled request's client is gone and gets none): an error in one request's
admission fails that request alone; an error in a step fails the rows of that step (their state
is suspect) and the engine goes on serving; stopping the engine fails everything still in it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import DFlashError, DFlashInputError
from .metrics import Metrics
from .runner import BatchRunner, RowRequest, RowStep
from .sequence import GenerationRequest, RowOutput

log = logging.getLogger("tensorrt_llm_dflash.serve")


# ----------------------------------------------------------------------------------- events


@dataclass
class TextDelta:
    """New text for the client (never empty), and the completion tokens so far."""

    text: str
    completion_tokens: int


@dataclass
class Finished:
    finish_reason: str
    text_tail: str  # the last text, possibly "" (sent before the finish)
    prompt_tokens: int
    completion_tokens: int
    #: The speculative statistics of this request (the response's ``dflash`` extension field).
    stats: dict[str, Any]


@dataclass
class Failed:
    """The request cannot be answered: ``status`` is the HTTP status it maps to (400, 500, 503)."""

    status: int
    message: str


Event = TextDelta | Finished | Failed


class QueueFull(DFlashError):
    """Too many requests in flight: the client should retry later (HTTP 429)."""


class EngineStopped(DFlashError):
    """The engine is not running (starting, stopping, or its thread died): HTTP 503."""


# ----------------------------------------------------------------------------------- state


@dataclass
class _Request:
    request: GenerationRequest
    on_event: Callable[[Event], None]
    cancelled: bool = False


@dataclass
class _Active:
    """A request in a row."""

    entry: _Request
    slot: int
    output: RowOutput
    admitted_at: float
    first_token_at: float | None = None
    acceptance_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    lookup_tokens: int = 0


class Engine:
    """Owns a :class:`~.runner.BatchRunner` and its thread; thread-safe ``submit`` and ``cancel``.

    ``max_queue`` requests may wait for a row; with ``runner.max_batch`` rows busy and ``max_queue``
    waiting, :meth:`submit` raises :class:`QueueFull`. ``tokenizer`` is used by the engine thread only
    (give the HTTP layer its own copy: a fast tokenizer is not safe to share between threads).
    """

    def __init__(self, runner: BatchRunner, tokenizer: Any, *, max_queue: int, metrics: Metrics | None = None) -> None:
        if max_queue < 0:
            raise DFlashInputError(f"max_queue={max_queue} must be >= 0")
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._by_id: dict[str, _Request] = {}
        self._rows: dict[int, _Active] = {}  # slot -> request in it (engine thread only)
        self._running_count = 0  # requests in rows or being admitted into one (other threads read it under the lock)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.metrics.gauge("queue_depth", "Requests waiting for a row.", lambda: self.queue_depth)
        self.metrics.gauge("running_requests", "Requests in a row (being decoded).", lambda: self.running)
        self.metrics.gauge("max_batch_size", "Rows the runner decodes together.", lambda: self.runner.max_batch)
        self.metrics.gauge("max_queue", "Requests that may wait for a row before new ones get 429.",
                           lambda: self.max_queue)
        self.metrics.gauge("mean_acceptance_length", "Tokens committed per row-step since start (tau).",
                           self._mean_acceptance)

    # ------------------------------------------------------------------ other threads

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def running(self) -> int:
        with self._cond:
            return self._running_count

    def _mean_acceptance(self) -> float:
        steps = self.metrics.value("row_steps_total")
        return self.metrics.value("committed_tokens_total") / steps if steps else 0.0

    def start(self) -> None:
        """Run the step loop on a thread of its own (tests, and apps that built the model on their main thread)."""
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("the engine was started already")
            self._thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        self._thread.start()

    def run(self, ready: Callable[[], None] | None = None) -> None:
        """Run the step loop on the calling thread until :meth:`stop`; ``ready()`` is called once the engine takes
        requests (before the first step).

        The server calls this on the thread that loaded the model and built the runner, so that one thread
        does all of the CPU's tensor work. With GNU OpenMP (torch's CPU backend) every thread that runs
        parallel ops keeps a pool of workers; once the pools hold more threads than the machine has CPUs,
        libgomp's workers stop spinning between parallel regions and sleep instead, and every small GEMM pays
        a wake-up: a decode step on a 2-core CPU ran 15-25% slower on a second thread than on the one that
        had built the model (2026-11-27, AMD EPYC, 2 torch threads).
        """
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("the engine was started already")
            self._thread = threading.current_thread()
        if ready is not None:
            ready()
        self._loop()

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop after the current step; every request still queued or running gets ``Failed(503)``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest, on_event: Callable[[Event], None]) -> None:
        """Queue ``request``; ``on_event`` is called from the engine thread (it must not block)."""
        entry = _Request(request, on_event)
        with self._cond:
            if not self.alive:
                self.metrics.inc("requests_rejected_total", reason="unavailable")
                raise EngineStopped("the server is not accepting requests (it is stopping, or its engine stopped)")
            if request.request_id in self._by_id:
                raise DFlashInputError(f"request_id={request.request_id!r} is already in flight")
            in_flight = len(self._waiting) + self._running_count
            limit = self.runner.max_batch + self.max_queue
            if in_flight >= limit:
                self.metrics.inc("requests_rejected_total", reason="queue_full")
                raise QueueFull(f"the server is at capacity: {in_flight} requests in flight ({self.runner.max_batch} "
                                f"rows + a queue of {self.max_queue}); retry later")
            self._waiting.append(entry)
            self._by_id[request.request_id] = entry
            self.metrics.inc("requests_received_total")
            self._cond.notify_all()

    def cancel(self, request_id: str) -> None:
        """The client is gone: drop the request from the queue at once, or free its row at the next step boundary."""
        with self._cond:
            entry = self._by_id.get(request_id)
            if entry is None or entry.cancelled:
                return
            entry.cancelled = True
            # A waiting request leaves the queue now, not at the next step boundary: a step (or an admission's
            # prefill) can take seconds, and until then its slot counted against max_queue (a new request got 429).
            for i, waiting in enumerate(self._waiting):
                if waiting is entry:
                    del self._waiting[i]
                    self._forget(entry)
                    self.metrics.inc("requests_cancelled_total")
                    break
            self._cond.notify_all()

    # ------------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._drop_cancelled_waiting()
                    if self._stopping:
                        break
                    if not self._rows and not self._waiting:
                        self._cond.wait()
                        continue
                    free = [slot for slot in range(self.runner.max_batch) if slot not in self._rows]
                    admitting = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
                    # Counted as running from here, so that submit() never sees them in neither place.
                    self._running_count = len(self._rows) + len(admitting)
                self._release_cancelled_rows()
                for slot, entry in zip(free, admitting):
                    self._admit(slot, entry)
                if admitting:
                    self._hand_over_admitted(free[: len(admitting)])
                with self._cond:
                    self._running_count = len(self._rows)
                if self._rows:
                    self._step()
        except BaseException:  # noqa: BLE001 - the loop must never die silently: say why, fail everyone
            log.error("the engine thread stopped on an unexpected error:\n%s", traceback.format_exc())
            self._fail_everything(500, "the engine stopped on an internal error; see the server log")
            raise
        self._fail_everything(503, "the server is shutting down")

    def _drop_cancelled_waiting(self) -> None:
        """Under the lock: cancelled requests leave the queue without ever taking a row."""
        if any(entry.cancelled for entry in self._waiting):
            kept = collections.deque()
            for entry in self._waiting:
                if entry.cancelled:
                    self._forget(entry)
                    self.metrics.inc("requests_cancelled_total")
                else:
                    kept.append(entry)
            self._waiting = kept

    def _release_cancelled_rows(self) -> None:
        for slot, active in list(self._rows.items()):
            if active.entry.cancelled:
                self._retire(slot)
                self.metrics.inc("requests_cancelled_total")

    def _forget(self, entry: _Request) -> None:
        self._by_id.pop(entry.request.request_id, None)

    def _deliver(self, entry: _Request, event: Event) -> None:
        try:
            entry.on_event(event)
        except Exception:  # noqa: BLE001 - a receiver that cannot take events is a client that has gone
            log.warning("request %s: its receiver failed; treating it as cancelled", entry.request.request_id,
                        exc_info=True)
            entry.cancelled = True

    def _retire(self, slot: int) -> None:
        active = self._rows.pop(slot)
        with self._cond:
            self._running_count -= 1
            self._forget(active.entry)
        try:
            self.runner.release(slot)
        except Exception:  # noqa: BLE001 - the slot's request is over either way; say so and go on
            log.error("runner.release(%d) failed:\n%s", slot, traceback.format_exc())

    def _admit(self, slot: int, entry: _Request) -> None:
        request = entry.request
        if entry.cancelled:
            with self._cond:
                self._forget(entry)
            self.metrics.inc("requests_cancelled_total")
            return
        row = RowRequest(list(request.prompt_ids), request.max_tokens, request.sampling)
        try:
            self.runner.admit(slot, row)
        except DFlashInputError as err:
            self._fail(entry, 400, str(err), slot)
            return
        except Exception as err:  # noqa: BLE001 - one request's failure must not stop the server
            log.error("admitting request %s failed:\n%s", request.request_id, traceback.format_exc())
            self._fail(entry, 500, f"the request could not be started: {type(err).__name__}: {err}", slot)
            return
        self._rows[slot] = _Active(entry, slot, RowOutput(self.tokenizer, request), time.perf_counter())
        self.metrics.inc("prompt_tokens_total", len(request.prompt_ids))

    def _hand_over_admitted(self, slots: list[int]) -> None:
        """The first tokens of the rows just admitted into ``slots``, now, from a runner that has them
        (``take_admitted``), not after the next step of the whole batch (``BatchRunner``)."""
        take = getattr(self.runner, "take_admitted", None)
        if take is None:
            return
        try:
            taken = take()
        except Exception as err:  # noqa: BLE001 - their first tokens may be gone: fail those requests, not the rest
            log.error("runner.take_admitted() failed:\n%s", traceback.format_exc())
            for slot in slots:
                if slot in self._rows:
                    active = self._rows[slot]
                    self._retire(slot)
                    self.metrics.inc("requests_failed_total")
                    self._deliver(active.entry, Failed(500, f"the request could not be started: "
                                                            f"{type(err).__name__}: {err}"))
            return
        for slot, step in taken.items():
            active = self._rows.get(slot)
            if active is not None and step.tokens:
                self._advance_or_fail(active, step)

    def _fail(self, entry: _Request, status: int, message: str, slot: int | None = None) -> None:
        if slot is not None:
            try:
                self.runner.release(slot)
            except Exception:  # noqa: BLE001
                log.error("runner.release(%d) failed:\n%s", slot, traceback.format_exc())
        with self._cond:
            self._forget(entry)
        self.metrics.inc("requests_failed_total")
        self._deliver(entry, Failed(status, message))

    def _step(self) -> None:
        try:
            results = self.runner.step()
        except Exception as err:  # noqa: BLE001 - fail this step's rows, keep serving the others to come
            log.error("runner.step() failed:\n%s", traceback.format_exc())
            for slot in list(self._rows):
                active = self._rows[slot]
                self._retire(slot)
                self.metrics.inc("requests_failed_total")
                self._deliver(active.entry, Failed(500, f"the decode step failed: {type(err).__name__}: {err}"))
            return
        decode_rows = 0
        for slot in list(self._rows):
            active = self._rows[slot]
            step = results.get(slot)
            if step is None or not step.tokens:
                # The protocol: every admitted row commits at least one token per step. Without this check a
                # runner bug would spin the loop forever with the client waiting.
                self._retire(slot)
                self.metrics.inc("requests_failed_total")
                self._deliver(active.entry, Failed(500, f"the runner committed no token for slot {slot} in a step"))
                continue
            if not step.is_prefill:
                decode_rows += 1
            self._advance_or_fail(active, step)
        if decode_rows:
            self.metrics.inc("engine_steps_total")

    def _advance_or_fail(self, active: _Active, step: RowStep) -> None:
        """``_advance``, failing this row alone when its output cannot be made (its tokens do not detokenize, a
        stop-string check raises, ...). Raised out of the loop, such an error stopped the engine: every other row
        failed with it and the server answered 503 from then on."""
        try:
            self._advance(active, step)
        except Exception as err:  # noqa: BLE001 - one request's failure must not stop the server
            log.error("request %s: its output failed:\n%s", active.entry.request.request_id, traceback.format_exc())
            if self._rows.get(active.slot) is active:
                self._retire(active.slot)
            if active.entry.cancelled:  # its client left: nobody to tell, counted as _release_cancelled_rows does
                self.metrics.inc("requests_cancelled_total")
                return
            self.metrics.inc("requests_failed_total")
            self._deliver(active.entry, Failed(500, f"the request's output failed: {type(err).__name__}: {err}"))

    def _advance(self, active: _Active, step: RowStep) -> None:
        now = time.perf_counter()
        request = active.entry.request
        if active.first_token_at is None:
            active.first_token_at = now
            self.metrics.observe("time_to_first_token_seconds", now - request.submitted_at)
        if not step.is_prefill:
            active.acceptance_lengths.append(len(step.tokens))
            active.tree_sizes.append(step.tree_size)
            active.lookup_tokens += step.lookup_tokens
            self.metrics.inc("row_steps_total")
            self.metrics.inc("committed_tokens_total", len(step.tokens))
            self.metrics.observe("tree_size", step.tree_size)
            self.metrics.observe("acceptance_length", len(step.tokens))
        output = active.output
        before = len(output.token_ids)
        text = output.push(step.tokens)
        self.metrics.inc("generation_tokens_total", len(output.token_ids) - before)
        if active.entry.cancelled:
            return  # freed at the next boundary; its client gets nothing more
        if not output.finished:
            if text:
                self._deliver(active.entry, TextDelta(text, len(output.token_ids)))
            return
        self._retire(active.slot)
        self.metrics.inc("requests_finished_total", finish_reason=output.finish_reason)
        self.metrics.observe("request_seconds", now - request.submitted_at)
        self._deliver(active.entry, Finished(output.finish_reason, text, len(request.prompt_ids),
                                             len(output.token_ids), self._stats(active, now)))

    def _stats(self, active: _Active, now: float) -> dict[str, Any]:
        request = active.entry.request
        steps = len(active.acceptance_lengths)
        first = active.first_token_at or now
        decode_seconds = now - first
        return {
            "mode": self.runner.description,
            "steps": steps,
            "mean_acceptance_length": sum(active.acceptance_lengths) / steps if steps else 0.0,
            "acceptance_lengths": list(active.acceptance_lengths),
            "tree_sizes": list(active.tree_sizes),
            "lookup_tokens": active.lookup_tokens,
            "seed": request.sampling.seed,
            "queue_seconds": active.admitted_at - request.submitted_at,
            "time_to_first_token_seconds": first - request.submitted_at,
            "decode_seconds": decode_seconds,
            "decode_tokens_per_second": (len(active.output.token_ids) - 1) / decode_seconds if decode_seconds > 0
            else 0.0,
        }

    def _fail_everything(self, status: int, message: str) -> None:
        for slot in list(self._rows):
            active = self._rows[slot]
            self._retire(slot)
            if not active.entry.cancelled:
                self.metrics.inc("requests_failed_total")
                self._deliver(active.entry, Failed(status, message))
        with self._cond:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            for entry in waiting:
                self._forget(entry)
        for entry in waiting:
            if not entry.cancelled:
                self.metrics.inc("requests_failed_total")
                self._deliver(entry, Failed(status, message))
