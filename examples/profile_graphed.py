#!/usr/bin/env python
"""Profile the graph-ready runtime (``GraphedDecoder``) per stage, per tree size and per dtype.

For each dtype and each method it builds a decoder, captures its graphs (CUDA) and reports the
capture time and memory, decodes a HumanEval-like prompt and reports tok/s, tau and the per-stage
milliseconds per step (CUDA events between graph replays on CUDA, wall time on the CPU). Then, per
dtype, it times the graphed step's pieces in isolation:

* ``compact``: the static cache's KV compaction (one gather + one scatter over all layers) for a
  16-token path, eager and, on CUDA, replayed from a CUDA graph;
* with ``--kernels``: one eager verify of the largest size and one eager draft under
  ``torch.profiler``, the top kernels by device time (where bf16 and fp32 differ);
* with ``--batch_costs B ...``: the cost-aware tree's step at every batch size B and tree size, per stage, and
  what it costs in AR steps of that batch: the tokens per row a step of that size must commit to keep AR's pace
  (its break-even), beside the tokens per step a DDTree of that size committed on the prompt at batch 1
  (``--methods ddtree-graph:B`` gives size B + 1). Where every size's break-even exceeds what the drafter
  delivers, speculation cannot pay at that concurrency on this machine, and the cost-aware tree decodes AR there.

    python examples/profile_graphed.py --device cuda --dtypes float32 bfloat16 --kernels --output_dir prof
    python examples/profile_graphed.py --max_new_tokens 32 --methods ar-graph auto-graph   # CPU, eager stages
    python examples/profile_graphed.py --methods ar-graph ddtree-graph:1 ddtree-graph:3 ddtree-graph:7 \
        --batch_costs 1 4 8 16 --output_dir prof   # where speculation can pay, per concurrency

Results print as one line per figure and, with ``--output_dir``, as ``profile.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tensorrt_llm_dflash import cli  # noqa: E402
from tensorrt_llm_dflash.assets import resolve_drafter_dir  # noqa: E402
from tensorrt_llm_dflash.bench import encode_prompt, load_prompts  # noqa: E402
from tensorrt_llm_dflash.drafter import load_dflash_drafter  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashError  # noqa: E402
from tensorrt_llm_dflash.files import atomic_write_json  # noqa: E402
from tensorrt_llm_dflash.graphed import STEP_STAGES, GraphedDecoder  # noqa: E402
from tensorrt_llm_dflash.target import load_target, load_tokenizer  # noqa: E402
from tensorrt_llm_dflash.tree import MAX_DDTREE_BUDGET  # noqa: E402

METHODS = {"ar-graph": "AR", "dflash-graph": "chain", "auto-graph": "cost-aware tree + lookup"}
METHOD_SYNTAX = "ar-graph, dflash-graph, auto-graph, ddtree-graph:B"
DTYPES = ["float32", "bfloat16", "float16", "float64"]
#: Longest generation accepted, as examples/run.py's --max_output_len; the target's own limit applies after loading.
MAX_NEW_TOKENS = 1 << 20
#: The most rows --batch_costs times, the server's --max_batch_size limit (serve/__main__.py MAX_BATCH_SIZE): the
#: concurrencies a deployment of this runtime can have.
MAX_BATCH_ROWS = 256


def needs_drafter(args: argparse.Namespace) -> bool:
    """Every method but ar-graph drafts, and --batch_costs and --kernels time the drafter's stages."""
    return any(m != "ar-graph" for m in args.methods) or bool(args.batch_costs) or args.kernels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target_model_dir", type=cli.existing_path, default=None,
                    help="HF dir or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--draft_model_dir", type=cli.existing_dir, default=None,
                    help="DFlash drafter dir (default with the embedded target: the shipped demo drafter); loaded "
                         "only for the speculative methods, --batch_costs and --kernels")
    ap.add_argument("--no_chat_template", action="store_true", help="send the prompt text as-is")
    ap.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=DTYPES)
    ap.add_argument("--methods", nargs="+", default=["ar-graph", "dflash-graph", "auto-graph", "ddtree-graph:32"],
                    help=METHOD_SYNTAX)
    ap.add_argument("--max_new_tokens", type=cli.integer(1, MAX_NEW_TOKENS), default=128)
    ap.add_argument("--kernels", action="store_true", help="torch.profiler kernel tables of one verify and one draft")
    ap.add_argument("--batch_costs", type=cli.integer(1, MAX_BATCH_ROWS), nargs="+", default=None, metavar="B",
                    help="time the cost-aware tree's step per stage at these batch sizes (rows), every tree size")
    ap.add_argument("--output_dir", type=cli.output_dir, default=None, help="writes DIR/profile.json")
    args = ap.parse_args(argv)
    for method in args.methods:
        name, sep, param = method.partition(":")
        if name == "ddtree-graph":
            if not sep:
                cli.refuse(ap, "--methods", f"{method!r} needs a node budget: write ddtree-graph:B, e.g. ddtree-graph:16")
            try:
                cli.integer(1, MAX_DDTREE_BUDGET)(param)
            except argparse.ArgumentTypeError as err:
                cli.refuse(ap, "--methods", f"{method!r}: the budget B {err}")
        elif name not in METHODS or sep:
            cli.refuse(ap, "--methods", f"unknown method {method!r} ({METHOD_SYNTAX})")
    # A repeat would profile (and load, for a dtype) the same thing again and overwrite its report entry.
    for flag, values in (("--methods", args.methods), ("--dtypes", args.dtypes)):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            cli.refuse(ap, flag, f"lists {', '.join(repeated)} more than once")
    if needs_drafter(args):
        if args.target_model_dir is not None and args.draft_model_dir is None:
            cli.refuse(ap, "--draft_model_dir", "is required with --target_model_dir (the demo drafter only fits the "
                                                "embedded SmolLM2 target), or profile only --methods ar-graph "
                                                "(without --batch_costs and --kernels)")
    elif args.draft_model_dir is not None:
        cli.refuse(ap, "--draft_model_dir", "applies to the speculative methods (dflash-graph, auto-graph, "
                                            "ddtree-graph:B), --batch_costs and --kernels: --methods ar-graph "
                                            "loads no drafter")
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, reps: int = 20) -> float:
    fn()
    samples = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(1000 * (time.perf_counter() - start))
    return statistics.median(samples)


def profile_method(model, drafter, method: str, prompt: list[int], new_tokens: int) -> dict:
    name, _, param = method.partition(":")
    budget = {"ar-graph": 0, "dflash-graph": 0, "auto-graph": None}.get(name, int(param or 0))
    decoder = GraphedDecoder(model, None if name == "ar-graph" else drafter, budget=budget)
    decoder.reserve(len(prompt), new_tokens)
    start = time.perf_counter()
    decoder.prepare()
    prepare_s = time.perf_counter() - start
    decoder.generate(prompt, min(new_tokens, 16))  # warm-up
    result = decoder.generate(prompt, new_tokens)
    stats = result.stats
    steps = max(stats.steps, 1)
    # Tokens committed per decode step, the prefill's token not counted: tau as examples/benchmark.py (bench.py's
    # tau_mean) and examples/bench_serve.py define it, so AR's is exactly 1. Also what a step of a fixed-size tree
    # delivers (accepted_per_step, which --batch_costs reads).
    tau = sum(stats.acceptance_lengths) / steps
    return {
        "method": method, "tok_per_s": stats.new_tokens / stats.total_seconds, "steps": stats.steps,
        "tau": tau, "accepted_per_step": tau, "tree_sizes": sorted(set(stats.tree_sizes)),
        "stage_ms_per_step": {k: 1000 * stats.stage_seconds.get(k, 0.0) / steps for k in STEP_STAGES},
        "prefill_ms": 1000 * stats.stage_seconds.get("prefill", 0.0),
        "capture_s": decoder.capture_seconds, "capture_mib": decoder.capture_bytes / 2**20, "prepare_s": prepare_s,
        "policy_costs_ms": ([1000 * c for c in decoder.policy.costs.tolist()] if decoder.policy is not None else None),
        "lookup_tokens": stats.lookup_tokens, "output_ids": result.output_ids,
    }


def profile_compaction(model, device: torch.device) -> dict:
    """KV compaction alone: a 16-node path over the whole static cache, eager and graphed."""
    decoder = GraphedDecoder(model, None, budget=0, capacity=1024)
    cache = decoder.target.cache
    past = torch.full((1,), 400, dtype=torch.long, device=device)
    path = torch.arange(0, 32, 2, device=device)[None]
    out = {"eager_ms": _median_ms(lambda: cache.compact(past, path), device)}
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            cache.compact(past, path)
        torch.cuda.current_stream(device).wait_stream(stream)
        with torch.cuda.graph(graph):
            cache.compact(past, path)
        out["graphed_ms"] = _median_ms(graph.replay, device)
    out["kv_mib"] = cache.kv.numel() * cache.kv.element_size() / 2**20
    return out


def batch_costs(model, drafter, prompt: list[int], new_tokens: int, batches: list[int],
                accepted: dict[int, float]) -> dict:
    """The cost-aware tree's step per stage at each batch size (every row holding ``prompt``) and tree size, in ms and
    in AR steps of that batch; ``accepted``: tokens per decode step a tree of that many nodes committed at batch 1."""
    decoder = GraphedDecoder(model, drafter, budget=None, batch=max(batches))
    decoder.reserve(len(prompt), new_tokens)
    for row in range(max(batches)):
        decoder.admit(row, prompt, new_tokens)
    out: dict = {"sizes": list(decoder.sizes()), "batches": {}}
    for rows in batches:
        bucket = decoder.bucket_for(rows)
        stages = {size: decoder.time_stages(size, bucket=bucket) for size in decoder.sizes()}
        totals = {size: sum(ms.values()) for size, ms in stages.items()}
        out["batches"][str(rows)] = {
            "bucket": bucket,
            "sizes": {str(size): {"stage_ms": ms, "ms": totals[size], "break_even": totals[size] / totals[1],
                                  "accepted_batch1": accepted.get(size)} for size, ms in stages.items()}}
    return out


def kernel_tables(model, drafter, device: torch.device, prompt: list[int], rows: int = 15) -> dict:
    """One eager verify (64 nodes) and one eager draft under torch.profiler: top kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    decoder = GraphedDecoder(model, drafter, budget=63, use_graphs=False)
    decoder.generate(prompt, 8)
    tables = {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    for stage, fn in decoder._stage_fns():
        if stage not in ("draft", "verify"):
            continue
        live: dict = {}
        with torch.inference_mode():
            for name, f in decoder._stage_fns():  # run the stages before this one to build its inputs
                if name == stage:
                    break
                live.update(f(live))
            _sync(device)
            with profile(activities=activities) as prof:
                fn(live)
                _sync(device)
        tables[stage] = prof.key_averages().table(sort_by=sort_by, row_limit=rows)
    return tables


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    try:
        draft_dir = (resolve_drafter_dir(args.draft_model_dir, args.target_model_dir,
                                         "pass --draft_model_dir, or profile only --methods ar-graph")
                     if needs_drafter(args) else None)
        # Encoded once, before any model loads: a tokenizer without a chat template is refused in a second, not
        # after the first dtype's model has loaded.
        prompt = encode_prompt(load_tokenizer(args.target_model_dir), load_prompts("humaneval", 1)[0],
                               not args.no_chat_template)
        report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        "torch": torch.__version__, "command": " ".join(sys.argv),
                        "chat_template": not args.no_chat_template, "dtypes": {}}
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            model, _ = load_target(args.target_model_dir, dtype=dtype, device=args.device)
            drafter = None if draft_dir is None else load_dflash_drafter(draft_dir, dtype=dtype, device=args.device)
            entry: dict = {"methods": [], "compaction": profile_compaction(model, device)}
            print(f"[{dtype_name}] compaction {entry['compaction']}", flush=True)
            for method in args.methods:
                row = profile_method(model, drafter, method, prompt, args.max_new_tokens)
                entry["methods"].append(row)
                stages = " ".join(f"{k} {v:.2f}" for k, v in row["stage_ms_per_step"].items())
                print(f"[{dtype_name}] {method}: {row['tok_per_s']:.1f} tok/s, tau {row['tau']:.2f}, "
                      f"ms/step: {stages}; capture {row['capture_s']:.2f} s {row['capture_mib']:.0f} MiB; "
                      f"sizes {row['tree_sizes']}", flush=True)
            ar = next((r["output_ids"] for r in entry["methods"] if r["method"] == "ar-graph"), None)
            for row in entry["methods"]:
                row["equals_ar"] = None if ar is None else row["output_ids"] == ar
            if args.batch_costs:
                fixed = [r for r in entry["methods"]  # one tree size per step: AR and the DDTrees
                         if r["method"] == "ar-graph" or r["method"].startswith("ddtree-graph")]
                accepted = {r["tree_sizes"][0]: r["accepted_per_step"] for r in fixed}
                entry["batch_costs"] = batch_costs(model, drafter, prompt, args.max_new_tokens,
                                                   sorted(set(args.batch_costs)), accepted)
                for rows, at in entry["batch_costs"]["batches"].items():
                    sizes = " ".join(f"{size}: {v['ms']:.1f} ms = {v['break_even']:.2f} AR"
                                     + (f" (accepts {v['accepted_batch1']:.2f})" if v["accepted_batch1"] else "")
                                     for size, v in at["sizes"].items())
                    print(f"[{dtype_name}] batch {rows}: {sizes}", flush=True)
            if args.kernels:
                entry["kernels"] = kernel_tables(model, drafter, device, prompt)
                for stage, table in entry["kernels"].items():
                    print(f"[{dtype_name}] top kernels, one eager {stage}:\n{table}", flush=True)
            report["dtypes"][dtype_name] = entry
            del model, drafter
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if args.output_dir:
            out = Path(args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(out / "profile.json", report)
            print(f"wrote {out / 'profile.json'}")
    except (DFlashError, OSError) as err:  # a model that does not load, a report that cannot be written
        cli.print_error(err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
