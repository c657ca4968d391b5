#!/usr/bin/env python
"""Benchmark the server under load: N concurrent streaming clients, for AR and the default, in one run.

    python examples/bench_serve.py --methods ar default --concurrency 1 2 4 8 16 \\
        --datasets humaneval chat --num_prompts 8 --max_tokens 128 --threads 2 --output_json bench_serve.json

For each method the script starts ``python -m tensorrt_llm_dflash.serve`` on a free loopback port (the
method's flags added: ar = --speculative_decoding_mode none, default = none, dflash = --ddtree_budget 0,
ddtree:B = --ddtree_budget B, auto-ahead / auto-in-step = the default with --size_choice ahead / in_step)
and sends it one untimed warm-up request. Then, level by level, each method's server in turn (the order
reversed at every other level, so that a machine that speeds up or slows down during the run favours no
method) runs the level: at concurrency C, C client tasks take the prompts (HumanEval and chat prompts
interleaved, the same prompts at every concurrency) from one queue, each as a streaming
/v1/chat/completions request. The servers stay loaded, idle while another runs, and stop at the end
(``--one_server_at_a_time``: each server runs all its levels and stops before the next starts, for models
that do not fit twice). ``--repeats R`` runs every level R times per method, the turns alternating, and
reports each level over all its runs, each run's tok/s beside, how far they lie apart (``runs apart``: max / min - 1)
and each repeat's speedup over AR's run of the same repeat (``paired runs vs AR``: how far those spread is how far
the level's speedup can be trusted).
With --url it benchmarks a server that is already running instead (one method, named by --methods).

Per method and concurrency: total tokens/s (all completion tokens over the level's wall time), time to
first token (mean, p50, p90: until the first streamed text, which the server sends once a word is
complete; the server's own first-token time is recorded too), per-request tokens/s (a request's tokens
over its latency, queueing included), tau. At
temperature 0 every answer is compared with AR's answer to the same prompt at the same concurrency, and
each method's answers across concurrencies; in float32/float64 a difference is an error (exit code 1).
Before the servers start, ``examples/benchmark.py --methods ar default`` (``ar-graph default`` on CUDA: graphed AR,
what the server's AR runs there) decodes the same prompts
in-process, alone (what ``examples/run.py`` runs, at the same settings): its speedup is the one the
server's concurrency 1 is held against (``--no_runpy_reference`` skips it; --url skips it too).
Writes one JSON file and prints a table. The clients run on the same machine as the server and take
some of its CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tensorrt_llm_dflash import cli  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashError, DFlashInputError  # noqa: E402

DTYPES = ["float32", "bfloat16", "float16", "float64"]
#: Seconds to wait for a server to load its models and measure its cost curve (the embedded pair on a CPU:
#: well under a minute; a big model on a GPU: minutes).
DEFAULT_SERVER_TIMEOUT = 900
READY = re.compile(r" at (http://\S+)$")


def method_flags(method: str) -> list[str]:
    """The server flags of a method name (ar, default, dflash, ddtree:B)."""
    if method == "ar":
        return ["--speculative_decoding_mode", "none"]
    if method == "default":
        return []
    if method == "dflash":
        return ["--ddtree_budget", "0"]
    if method in ("auto-ahead", "auto-in-step"):
        return ["--size_choice", method.removeprefix("auto-").replace("-", "_")]
    kind, _, budget = method.partition(":")
    if kind == "ddtree" and budget.isdigit() and int(budget) >= 1:
        return ["--ddtree_budget", budget]
    raise DFlashInputError(f"method {method!r} is not one of ar, default, dflash, ddtree:B (B >= 1), auto-ahead, "
                           "auto-in-step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["ar", "default"],
                    help="ar, default, dflash, ddtree:B; with --url, one name for the running server")
    ap.add_argument("--concurrency", type=cli.integer(1, 1024), nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "chat"],
                    help="'humaneval', 'chat' or .jsonl files of {\"prompt\": ...}; their prompts are interleaved")
    ap.add_argument("--num_prompts", type=cli.integer(1), default=8, help="the first N prompts of each dataset")
    ap.add_argument("--max_tokens", type=cli.integer(1, 1 << 20), default=128)
    ap.add_argument("--temperature", type=cli.number(0.0, 2.0), default=0.0)
    ap.add_argument("--seed", type=cli.seed, default=0, help="prompt i is sampled with seed + i (temperature > 0)")
    ap.add_argument("--url", default=None, help="benchmark this running server (http://host:port) instead")
    server = ap.add_argument_group("the servers this script starts (python -m tensorrt_llm_dflash.serve)")
    server.add_argument("--target_model_dir", type=cli.existing_path, default=None)
    server.add_argument("--draft_model_dir", type=cli.existing_dir, default=None)
    server.add_argument("--dtype", choices=DTYPES, default="float32")
    server.add_argument("--device", type=cli.device, default=None)
    server.add_argument("--threads", type=cli.threads, default=None, help="the server's torch CPU threads")
    server.add_argument("--max_batch_size", type=cli.integer(1, 256), default=None,
                        help="rows each server decodes together (default: the largest --concurrency, so that every "
                             "client of every level has a row)")
    server.add_argument("--server_timeout", type=cli.integer(1), default=DEFAULT_SERVER_TIMEOUT,
                        help="seconds to wait for a server to be ready")
    server.add_argument("--one_server_at_a_time", action="store_true",
                        help="run each method's levels with only its server loaded (default: every server loaded, "
                             "the methods taking turns at each level)")
    ap.add_argument("--repeats", type=cli.integer(1, 100), default=1,
                    help="run each level this many times per method (the methods taking turns each time); a level's "
                         "figures are over all its runs (less run-to-run noise)")
    ap.add_argument("--no_warmup", action="store_true", help="no untimed request before the first level")
    ap.add_argument("--no_runpy_reference", action="store_true",
                    help="skip the in-process run of run.py's runtime (AR and default) on the same prompts")
    ap.add_argument("--output_json", type=cli.output_file, default="bench_serve.json")
    args = ap.parse_args(argv)
    for method in args.methods:
        try:
            method_flags(method)
        except DFlashInputError as err:
            if args.url is None:
                cli.refuse(ap, "--methods", str(err))
    if args.url is not None:
        if not re.fullmatch(r"https?://[^/\s]+", args.url):
            cli.refuse(ap, "--url", f"must be http://host:port, got {args.url!r}")
        if len(args.methods) != 1:
            cli.refuse(ap, "--methods", "with --url, give one name for the running server")
    if len(set(args.methods)) != len(args.methods):
        cli.refuse(ap, "--methods", f"names a method twice: {args.methods}")
    if len(set(args.concurrency)) != len(args.concurrency):
        cli.refuse(ap, "--concurrency", f"names a level twice: {args.concurrency}")
    cli.require_module(ap, "--methods", "openai", "pip install -r requirements-dev.txt")
    absolute_paths(args)
    return args


def absolute_paths(args: argparse.Namespace) -> None:
    """The user's paths made absolute: the servers and the run.py reference run in ROOT (``cwd=ROOT``), where a path
    relative to the user's directory would name something else or nothing. The built-in prompt sets keep their
    names."""
    from tensorrt_llm_dflash.bench import CHAT, HUMANEVAL

    for name in ("target_model_dir", "draft_model_dir", "output_json"):
        value = getattr(args, name)
        if value is not None:
            setattr(args, name, os.path.abspath(value))
    args.datasets = [d if d in (HUMANEVAL, CHAT) else os.path.abspath(d) for d in args.datasets]


# ------------------------------------------------------------------------------------- prompts


@dataclass
class BenchPrompt:
    index: int
    dataset: str
    text: str


def load_prompts(datasets: list[str], num_prompts: int) -> list[BenchPrompt]:
    """The first ``num_prompts`` text prompts of each dataset, interleaved (a, b, a, b, ...)."""
    from tensorrt_llm_dflash.bench import load_prompts as load

    per_dataset = []
    for dataset in datasets:
        prompts = load(dataset, num_prompts)
        if any(p.text is None for p in prompts):
            raise DFlashInputError(f"--datasets {dataset!r}: token-id prompts cannot be sent as chat messages")
        per_dataset.append([(dataset, p.text) for p in prompts])
    out: list[BenchPrompt] = []
    for i in range(max(len(p) for p in per_dataset)):
        for prompts in per_dataset:
            if i < len(prompts):
                out.append(BenchPrompt(len(out), *prompts[i]))
    return out


# ------------------------------------------------------------------------------------- the server


class ServerProcess:
    """``python -m tensorrt_llm_dflash.serve`` on a free loopback port; its output goes to ``log``."""

    def __init__(self, flags: list[str], log: Path, timeout: float) -> None:
        command = [sys.executable, "-m", "tensorrt_llm_dflash.serve", "--port", "0", "--log_level", "warning",
                   *flags]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.command, self.log = command, log
        self._log_file = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=self._log_file, text=True)
        self.ready_line: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        deadline = time.monotonic() + timeout
        try:
            while not self._ready.wait(0.1):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    why = "exited" if self.process.poll() is not None else f"was not ready after {timeout:.0f} s"
                    raise DFlashError(f"the server {why}: {' '.join(command)}\n{self.log_tail()}")
        except BaseException:  # a failed start-up, or Ctrl-C during it: no server is left running
            self.stop()
            raise
        match = READY.search(self.ready_line or "")
        assert match is not None
        self.url = match.group(1)

    def _read_stdout(self) -> None:
        # Drained to the end: a full pipe would block the server.
        for line in self.process.stdout:
            self._log_file.write(line)
            self._log_file.flush()
            if self.ready_line is None and READY.search(line.strip()):
                self.ready_line = line.strip()
                self._ready.set()

    def log_tail(self, lines: int = 20) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return "\n".join(self.log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log_file.close()


# ------------------------------------------------------------------------------------- clients


@dataclass
class RequestResult:
    prompt: int
    dataset: str
    seconds: float = 0.0
    #: Until the first streamed text (the server holds back a word until it is complete).
    time_to_first_token: float | None = None
    #: The server's own: from its receiving the request to the first token committed (the response's ``dflash``).
    server_time_to_first_token: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    steps: int = 0
    committed: int = 0
    error: str | None = None


async def one_request(client: Any, model: str, prompt: BenchPrompt, args: argparse.Namespace) -> RequestResult:
    result = RequestResult(prompt.index, prompt.dataset)
    start = time.perf_counter()
    parts: list[str] = []
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt.text}], max_tokens=args.max_tokens,
            temperature=args.temperature, seed=args.seed + prompt.index if args.temperature > 0 else None,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    if result.time_to_first_token is None:
                        result.time_to_first_token = time.perf_counter() - start
                    parts.append(choice.delta.content)
                if choice.finish_reason:
                    result.finish_reason = choice.finish_reason
                    stats = (chunk.model_extra or {}).get("dflash", {})
                    result.steps = int(stats.get("steps", 0))
                    result.server_time_to_first_token = stats.get("time_to_first_token_seconds")
                    result.committed = int(sum(stats.get("acceptance_lengths", [])))
            if chunk.usage is not None:
                result.completion_tokens = chunk.usage.completion_tokens
    except Exception as err:  # noqa: BLE001 - a failed request is a result to report, not a crash
        result.error = f"{type(err).__name__}: {err}"
    result.seconds = time.perf_counter() - start
    result.text = "".join(parts)
    return result


async def run_level(url: str, model: str, prompts: list[BenchPrompt], concurrency: int,
                    args: argparse.Namespace) -> tuple[float, list[RequestResult]]:
    """``concurrency`` clients take the prompts from one queue; (wall seconds, results in prompt order)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    queue: asyncio.Queue[BenchPrompt] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[RequestResult] = []

    async def client_loop() -> None:
        while not queue.empty():
            results.append(await one_request(client, model, queue.get_nowait(), args))

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return wall, sorted(results, key=lambda r: r.prompt)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize_level(wall: float, results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    ttft = [r.time_to_first_token for r in ok if r.time_to_first_token is not None]
    server_ttft = [r.server_time_to_first_token for r in ok if r.server_time_to_first_token is not None]
    tokens = sum(r.completion_tokens for r in ok)
    steps = sum(r.steps for r in ok)
    return {
        "requests": len(results),
        "errors": [f"prompt {r.prompt}: {r.error}" for r in results if r.error is not None],
        "wall_seconds": wall,
        "completion_tokens": tokens,
        "total_tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "ttft_mean_seconds": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_seconds": percentile(ttft, 0.5),
        "ttft_p90_seconds": percentile(ttft, 0.9),
        "server_ttft_mean_seconds": statistics.fmean(server_ttft) if server_ttft else None,
        "request_tokens_per_second_mean": statistics.fmean(
            [r.completion_tokens / r.seconds for r in ok if r.seconds > 0]) if ok else None,
        "tau": sum(r.committed for r in ok) / steps if steps else None,
    }


# ------------------------------------------------------------------------------------- the run


def server_flags(args: argparse.Namespace, method: str) -> list[str]:
    """The server's command-line flags for ``method``; the queue holds every client of the largest level."""
    rows = args.max_batch_size or max(args.concurrency)
    flags = ["--dtype", args.dtype, "--max_batch_size", str(rows),
             "--max_queue", str(max(args.concurrency))]
    names = ["target_model_dir", "device", "threads"] + ([] if method == "ar" else ["draft_model_dir"])
    for name in names:
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name}", str(value)]
    return [*flags, *method_flags(method)]


def reference_ar_method(device: str | None) -> str:
    """run.py's plain decoding on the device the servers run on (``None``: theirs, CUDA when there is one): graphed
    AR on CUDA, what the server's AR runs there and the benchmark's fastest AR (its eager AR is several times
    slower); the eager runtime's AR on a CPU, where it is the faster."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "ar-graph" if str(device).startswith("cuda") else "ar"


def runpy_reference(prompts: list[BenchPrompt], args: argparse.Namespace) -> dict[str, Any]:
    """``examples/benchmark.py --methods ar default`` (``ar-graph`` on CUDA: :func:`reference_ar_method`) on the same
    prompts and settings, in its own process, alone on the machine: run.py's tokens/s and speedup, the figures the
    server at concurrency 1 is compared with."""
    import json

    with tempfile.TemporaryDirectory(prefix="bench_serve_runpy.") as tmp:
        dataset = Path(tmp) / "prompts.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": p.text}) + "\n" for p in prompts), encoding="utf-8")
        out = Path(tmp) / "out"
        ar_method = reference_ar_method(args.device)
        command = [sys.executable, str(ROOT / "examples" / "benchmark.py"), "--dataset", str(dataset),
                   "--methods", ar_method, "default", "--max_output_len", str(args.max_tokens),
                   "--temperature", str(args.temperature), "--seed", str(args.seed), "--dtype", args.dtype,
                   "--no_progress", "--output_dir", str(out)]
        for name in ("target_model_dir", "draft_model_dir", "device", "threads"):
            value = getattr(args, name)
            if value is not None:
                command += [f"--{name}", str(value)]
        print(f"run.py's runtime in-process (examples/benchmark.py --methods {ar_method} default):", flush=True)
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        results_file = out / "results.json"
        if done.returncode not in (0, 1) or not results_file.is_file():  # 1: an output differs from AR (reported)
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise DFlashError(f"the run.py reference run failed (exit {done.returncode}):\n{tail}")
        results = json.loads(results_file.read_text())
    methods = results["methods"]
    ar, default = methods[ar_method]["tokens_per_second"], methods["default"]["tokens_per_second"]
    reference = {
        "command": " ".join(command[1:]).replace(str(dataset), "<the same prompts>").replace(str(out), "<tmp>"),
        "ar_method": ar_method,
        "default_resolves_to": methods["default"].get("resolves_to"),
        "ar_tokens_per_second": ar, "default_tokens_per_second": default,
        "speedup": default / ar if ar else None, "tau": methods["default"].get("tau_mean"),
        "all_outputs_match": results.get("all_outputs_match"),
    }
    print(f"  AR {ar:.1f} tok/s, default {default:.1f} tok/s: {fmt(reference['speedup'], '.2f')}x", flush=True)
    return reference


@contextlib.contextmanager
def started_servers(methods: list[str], args: argparse.Namespace, report: dict[str, Any]) -> Iterator[dict[str, str]]:
    """Each method's server, started one after another (a start-up that measures costs runs alone): method -> url;
    all stopped on the way out, their logs kept only when something failed."""
    running: dict[str, tuple[ServerProcess, Path]] = {}
    try:
        for method in methods:
            log = Path(tempfile.gettempdir()) / f"bench_serve.{os.getpid()}.{method.replace(':', '_')}.log"
            server = ServerProcess(server_flags(args, method), log, args.server_timeout)
            running[method] = (server, log)
            report["servers"][method] = {"command": " ".join(server.command), "ready": server.ready_line}
        yield {method: server.url for method, (server, _) in running.items()}
    finally:
        for server, _ in running.values():
            server.stop()
    for _, log in running.values():
        log.unlink(missing_ok=True)


def served_model(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def warm_up(url: str, model: str, prompts: list[BenchPrompt], args: argparse.Namespace) -> None:
    """One untimed short request: the first request pays for lazy start-up work (allocation, caches)."""
    if not args.no_warmup:
        warm = argparse.Namespace(**{**vars(args), "max_tokens": min(16, args.max_tokens)})
        asyncio.run(run_level(url, model, prompts[:1], 1, warm))


def run_once(url: str, model: str, prompts: list[BenchPrompt], concurrency: int,
             args: argparse.Namespace) -> tuple[float, list[RequestResult]]:
    wall, results = asyncio.run(run_level(url, model, prompts, concurrency, args))
    print(f"  concurrency {concurrency}: {sum(r.completion_tokens for r in results) / wall:.1f} tok/s, "
          f"{sum(r.error is not None for r in results)} errors", flush=True)
    return wall, results


def level_record(runs: list[tuple[float, list[RequestResult]]]) -> dict[str, Any]:
    """A level's figures over its runs (all their tokens over all their wall time), each run's tok/s beside."""
    results = sorted((r for _, rs in runs for r in rs), key=lambda r: r.prompt)  # stable: repeats stay in order
    summary = summarize_level(sum(wall for wall, _ in runs), results)
    if len(runs) > 1:
        summary["runs_tokens_per_second"] = [sum(r.completion_tokens for r in rs if r.error is None) / wall
                                             for wall, rs in runs]
    return {"summary": summary, "requests": [asdict(r) for r in results]}


def bench_method(url: str, prompts: list[BenchPrompt], args: argparse.Namespace) -> dict[str, Any]:
    """Every level on one server."""
    model = served_model(url)
    warm_up(url, model, prompts, args)
    levels = {str(c): level_record([run_once(url, model, prompts, c, args) for _ in range(args.repeats)])
              for c in args.concurrency}
    return {"model": model, "levels": levels}


def level_order(methods: list[str], turn: int) -> list[str]:
    """The methods' order at the ``turn``-th run of a level: as given, reversed at every other turn (ABBA)."""
    return list(methods) if turn % 2 == 0 else list(reversed(methods))


def bench_interleaved(servers: dict[str, str], prompts: list[BenchPrompt], args: argparse.Namespace,
                      results: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every server loaded (``servers``: method -> url): level by level, run by run, each method in turn
    (:func:`level_order`). ``results`` (filled in place, returned): a level enters it once every method has run it,
    so an interrupted run keeps its finished levels, each a fair comparison."""
    models = {method: served_model(url) for method, url in servers.items()}
    for method, url in servers.items():
        warm_up(url, models[method], prompts, args)
    results = {} if results is None else results
    results.update({method: {"model": models[method], "levels": {}} for method in servers})
    turn = 0
    for concurrency in args.concurrency:
        runs: dict[str, list[tuple[float, list[RequestResult]]]] = {method: [] for method in servers}
        for _ in range(args.repeats):
            for method in level_order(list(servers), turn):
                print(f"{method}:", flush=True)
                runs[method].append(run_once(servers[method], models[method], prompts, concurrency, args))
            turn += 1
        for method in servers:
            results[method]["levels"][str(concurrency)] = level_record(runs[method])
    return results


def paired_speedups(summary: dict[str, Any], ar: dict[str, Any]) -> list[float] | None:
    """Each repeat's tok/s over AR's in the same repeat (``runs_tokens_per_second``, in run order), or None without
    the same number of repeats of both. Interleaved, a repeat's two runs are neighbours in time (``level_order``), so
    a machine that drifts during the run moves both alike: how far these ratios spread is how far the level's speedup
    can be trusted, beside how far one server's own runs lie apart (AR's ``runs_spread``)."""
    runs, ar_runs = summary.get("runs_tokens_per_second"), ar.get("runs_tokens_per_second")
    if not runs or not ar_runs or len(runs) != len(ar_runs) or not all(ar_runs):
        return None
    return [mine / theirs for mine, theirs in zip(runs, ar_runs)]


def runs_spread(summary: dict[str, Any]) -> float | None:
    """How far a level's runs lie apart: max / min - 1 of its ``runs_tokens_per_second`` (None without repeats)."""
    runs = summary.get("runs_tokens_per_second")
    if not runs or min(runs) <= 0:
        return None
    return max(runs) / min(runs) - 1.0


def compare(results: dict[str, Any], args: argparse.Namespace, reference: dict[str, Any] | None = None) -> list[str]:
    """Speedups against AR (and the default's at concurrency 1 against run.py's ``reference``), and at temperature 0
    whether answers equal AR's and stay equal across concurrency.

    Returns the differences that fail the run (float32/float64 at temperature 0)."""
    from tensorrt_llm_dflash.precision import is_exact

    problems: list[str] = []
    if reference is not None and reference["all_outputs_match"] is False and args.temperature == 0 \
            and is_exact(args.dtype):
        problems.append("the run.py reference: an output differs from AR")
    greedy = args.temperature == 0
    for method, data in results.items():
        levels = data["levels"]
        texts = {c: [r["text"] for r in level["requests"]] for c, level in levels.items()}
        for c, level in levels.items():
            summary = level["summary"]
            spread = runs_spread(summary)
            if spread is not None:
                summary["runs_spread"] = spread
            if summary["errors"]:
                problems.append(f"{method} at concurrency {c}: {len(summary['errors'])} failed requests")
            if "ar" in results and method != "ar" and c in results["ar"]["levels"]:
                ar = results["ar"]["levels"][c]
                base = ar["summary"]["total_tokens_per_second"]
                summary["speedup_vs_ar"] = summary["total_tokens_per_second"] / base if base else None
                paired = paired_speedups(summary, ar["summary"])
                if paired is not None:
                    summary["paired_speedups_vs_ar"] = paired
                if reference is not None and c == "1" and method == "default" and summary["speedup_vs_ar"] \
                        and reference["speedup"]:
                    summary["speedup_vs_runpy_speedup"] = summary["speedup_vs_ar"] / reference["speedup"]
                if greedy:
                    ar_texts = [r["text"] for r in ar["requests"]]
                    same = sum(a == b for a, b in zip(texts[c], ar_texts))
                    summary["outputs_equal_ar"] = f"{same}/{len(ar_texts)}"
                    if same != len(ar_texts) and is_exact(args.dtype):
                        problems.append(f"{method} at concurrency {c}: {len(ar_texts) - same} answers differ from AR")
            if greedy:
                first = next(iter(texts))
                same = sum(a == b for a, b in zip(texts[c], texts[first]))
                summary["outputs_equal_concurrency_" + first] = f"{same}/{len(texts[first])}"
                if same != len(texts[first]) and is_exact(args.dtype):
                    problems.append(f"{method}: answers at concurrency {c} differ from concurrency {first}")
    return problems


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict[str, Any], reference: dict[str, Any] | None = None) -> str:
    lines = []
    if reference is not None:
        lines += [f"run.py's runtime in-process on the same prompts: AR {reference['ar_tokens_per_second']:.1f} tok/s, "
                  f"default {reference['default_tokens_per_second']:.1f} tok/s ({fmt(reference['speedup'], '.2f')}x, "
                  f"tau {fmt(reference['tau'], '.2f')})", ""]
    lines += ["| method | concurrency | requests | total tok/s | runs apart | vs AR | paired runs vs AR | "
             "TTFT mean (s) | TTFT p90 (s) | per-request tok/s | tau | answers == AR |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for method, data in results.items():
        for c, level in data["levels"].items():
            s = level["summary"]
            paired = s.get("paired_speedups_vs_ar")
            paired_text = "-" if not paired else f"{min(paired):.2f}-{max(paired):.2f}"
            spread = s.get("runs_spread")
            spread_text = "-" if spread is None else f"{100 * spread:.1f}%"
            lines.append(f"| {method} | {c} | {s['requests']} | {s['total_tokens_per_second']:.1f} | {spread_text} | "
                         f"{fmt(s.get('speedup_vs_ar'), '.2f')} | {paired_text} | {fmt(s['ttft_mean_seconds'], '.2f')} | "
                         f"{fmt(s['ttft_p90_seconds'], '.2f')} | {fmt(s['request_tokens_per_second_mean'], '.1f')} | "
                         f"{fmt(s['tau'], '.2f')} | {s.get('outputs_equal_ar', '-')} |")
    one = results.get("default", {}).get("levels", {}).get("1", {}).get("summary", {})
    if reference is not None and one.get("speedup_vs_runpy_speedup") is not None:
        lines += ["", f"concurrency 1: the server's default makes {one['speedup_vs_ar']:.2f}x AR, run.py's runtime "
                      f"{reference['speedup']:.2f}x ({one['speedup_vs_runpy_speedup']:.2f} of it)"]
    return "\n".join(lines)


def interrupted(report: dict[str, Any] | None, output_json: str) -> int:
    """Ctrl-C: the finished levels (every method ran them) are written, marked interrupted; exit status 130."""
    from tensorrt_llm_dflash.files import atomic_write_json

    finished = sorted({level for result in (report or {}).get("results", {}).values()
                       for level in result.get("levels", {})}, key=int)
    if not finished:
        print("\ninterrupted: no concurrency level had finished; nothing written", file=sys.stderr)
        return 130
    report["interrupted"] = True
    atomic_write_json(output_json, report)
    print(f"\ninterrupted: wrote the finished concurrency levels {', '.join(finished)} to {output_json}",
          file=sys.stderr)
    return 130


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tensorrt_llm_dflash.bench import git_commit, machine_info
    from tensorrt_llm_dflash.files import atomic_write_json

    report: dict[str, Any] | None = None
    try:
        prompts = load_prompts(args.datasets, args.num_prompts)
        report = {
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "settings": {k: v for k, v in vars(args).items()},
            "machine": machine_info(args.threads), "git_commit": git_commit(),
            "prompts": [asdict(p) for p in prompts], "servers": {}, "results": {}}
        reference = None
        if args.url is None and not args.no_runpy_reference:
            reference = report["runpy_reference"] = runpy_reference(prompts, args)
        if args.url is not None:
            print(f"{args.methods[0]}:", flush=True)
            report["results"][args.methods[0]] = bench_method(args.url, prompts, args)
        elif args.one_server_at_a_time:
            for method in args.methods:
                print(f"{method}:", flush=True)
                with started_servers([method], args, report) as servers:
                    report["results"][method] = bench_method(servers[method], prompts, args)
        else:
            with started_servers(args.methods, args, report) as servers:
                bench_interleaved(servers, prompts, args, report["results"])
        problems = compare(report["results"], args, reference)
        report["problems"] = problems
        atomic_write_json(args.output_json, report)
    except DFlashError as err:
        cli.print_error(err)
        return 2
    except KeyboardInterrupt:
        return interrupted(report, args.output_json)
    print()
    print(table(report["results"], reference))
    print(f"\nwrote {args.output_json}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
