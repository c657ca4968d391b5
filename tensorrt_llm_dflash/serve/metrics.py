"""Server metrics in the Prometheus text exposition format (``GET /metrics``).

A few counters, gauges and histograms written by the engine thread and the HTTP layer and read by
scrapes, under one lock. The format is small enough to write here (``# HELP``, ``# TYPE``, one line
per sample, cumulative ``_bucket{le=...}`` lines for histograms); it needs no client library.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

PREFIX = "dflash_"


def _escape(value: str) -> str:
    """A label value as the exposition format quotes it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(float(value))


class Metrics:
    """The server's metrics. Counter names end in ``_total``; every name starts with ``dflash_``."""

    TREE_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
    ACCEPTANCE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)
    SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
    #: (counter, label, every value it takes).
    LABELLED = (("requests_rejected_total", "reason", ("invalid_request", "queue_full", "unavailable")),
                ("requests_finished_total", "finish_reason", ("stop", "length")))

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._help: dict[str, tuple[str, str]] = {}  # name -> (type, help)
        self._counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        self._histograms: dict[str, tuple[Sequence[float], list[int], list[float]]] = {}  # buckets, counts, [sum]
        self._gauges: dict[str, Callable[[], float]] = {}
        counters = {
            "requests_received_total": "Requests accepted into the engine's queue.",
            "requests_rejected_total": "Requests refused before the engine, by reason (invalid_request, "
                                       "queue_full, unavailable).",
            "requests_finished_total": "Requests answered in full, by finish_reason (stop, length).",
            "requests_cancelled_total": "Requests whose client went away; their row was freed at the next step.",
            "requests_failed_total": "Requests the engine could not finish (an error in the model step).",
            "prompt_tokens_total": "Prompt tokens of admitted requests.",
            "generation_tokens_total": "Tokens returned to clients (completion_tokens).",
            "engine_steps_total": "Decode steps of the runner (all rows at once).",
            "row_steps_total": "Decode steps summed over rows (tau = committed_tokens_total / row_steps_total).",
            "committed_tokens_total": "Tokens committed by decode steps, bonus tokens included, before stop cuts.",
        }
        for name, text in counters.items():
            self._help[name] = ("counter", text)
            self._counters[name] = {}
        # Every label value a counter can take starts at 0: a series that appears only with its first event (or an
        # unlabelled 0 that vanishes then) reads to Prometheus as a series ending and another starting.
        for name, label, values in self.LABELLED:
            for value in values:
                self._counters[name][((label, value),)] = 0.0
        histograms = {
            "tree_size": ("Tree nodes verified per row-step, root included (1 = a plain AR step).",
                          self.TREE_SIZE_BUCKETS),
            "acceptance_length": ("Tokens committed per row-step (tau), bonus token included.",
                                  self.ACCEPTANCE_BUCKETS),
            "time_to_first_token_seconds": ("From submission to the first generated token.", self.SECONDS_BUCKETS),
            "request_seconds": ("From submission to the last token, finished requests.", self.SECONDS_BUCKETS),
        }
        for name, (text, buckets) in histograms.items():
            self._help[name] = ("histogram", text)
            self._histograms[name] = (tuple(buckets), [0] * (len(buckets) + 1), [0.0])

    def gauge(self, name: str, text: str, read: Callable[[], float]) -> None:
        """A value read at every scrape (queue depth, running rows, ...)."""
        with self._lock:
            self._help[name] = ("gauge", text)
            self._gauges[name] = read

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._counters[name]
            series[key] = series.get(key, 0.0) + amount

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            buckets, counts, total = self._histograms[name]
            index = next((i for i, bound in enumerate(buckets) if value <= bound), len(buckets))
            counts[index] += 1
            total[0] += value

    def value(self, name: str, **labels: str) -> float:
        """One counter's current value (tests and the summary line)."""
        with self._lock:
            return self._counters[name].get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            gauges = dict(self._gauges)
            for name, (kind, text) in self._help.items():
                if kind == "gauge":
                    continue
                full = PREFIX + name
                lines += [f"# HELP {full} {text}", f"# TYPE {full} {kind}"]
                if kind == "counter":
                    series = self._counters[name] or {(): 0.0}
                    lines += [f"{full}{_labels(key)} {_number(v)}" for key, v in sorted(series.items())]
                elif kind == "histogram":
                    buckets, counts, total = self._histograms[name]
                    running = 0
                    for bound, count in zip([*buckets, math.inf], counts):
                        running += count
                        lines.append(f'{full}_bucket{{le="{_number(float(bound))}"}} {running}')
                    lines += [f"{full}_sum {_number(total[0])}", f"{full}_count {running}"]
        # Gauges are read outside the lock: their callbacks may take the engine's lock.
        for name, read in gauges.items():
            kind, text = self._help[name]
            full = PREFIX + name
            lines += [f"# HELP {full} {text}", f"# TYPE {full} gauge", f"{full} {_number(float(read()))}"]
        return "\n".join(lines) + "\n"
