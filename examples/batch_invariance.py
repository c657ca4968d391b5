#!/usr/bin/env python
"""How often a batched row's greedy (T = 0) output differs from the same prompt decoded alone, per dtype and method.

    python examples/batch_invariance.py --dtypes float32 bfloat16 --methods ar ddtree:8 auto --num_prompts 4 \\
        --max_new_tokens 64 --batch 4 --threads 2 --output_json benchmarks/batch_invariance/cpu.json

A batched step runs every row through one forward pass: other GEMM and attention shapes than a one-row step
(``b * n`` rows of a linear instead of ``n``), so other rounding, and in low precision the logits move enough to
flip near-ties. The cost-aware tree (``auto``) also verifies the batch's tree size, not the one a lone row gets.
Each prompt is decoded alone (a one-row decoder) and among ``--batch`` rows of one decoder, with the rows admitted
one step apart (so each one shares its steps with rows at other lengths), on the embedded SmolLM2-135M target
with the shipped drafter (or ``--target_model_dir/--draft_model_dir``); HumanEval and chat prompts alternate.
Reported per dtype and method: rows whose output differs from their solo run, and from plain AR alone. First, per
dtype, the size of the effect at the logits: one 9-node verify of each prompt's row alone and inside a batch of
``--batch`` rows (the others other prompts), the largest logit difference and the argmax flips.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorrt_llm_dflash.assets import resolve_drafter_dir  # noqa: E402
from tensorrt_llm_dflash.bench import CHAT, HUMANEVAL, cpu_model, encode_prompt, load_prompts  # noqa: E402
from tensorrt_llm_dflash.drafter import load_dflash_drafter  # noqa: E402
from tensorrt_llm_dflash.files import atomic_write_json  # noqa: E402
from tensorrt_llm_dflash.graphed import GraphedDecoder  # noqa: E402
from tensorrt_llm_dflash.target import load_target  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target_model_dir", default=None)
    ap.add_argument("--draft_model_dir", default=None)
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16", "float64"])
    ap.add_argument("--methods", nargs="*", default=["ar", "ddtree:8", "auto"],
                    help="ar, chain, ddtree:N or auto (the cost-aware tree)")
    ap.add_argument("--num_prompts", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--output_json", default=None)
    args = ap.parse_args(argv)
    for method in args.methods:
        budget_of(method)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.batch < 2:
        ap.error("--num_prompts and --max_new_tokens must be >= 1, --batch >= 2")
    return args


def budget_of(method: str) -> int | None:
    if method in ("ar", "chain"):
        return 0
    if method == "auto":
        return None
    name, _, value = method.partition(":")
    if name != "ddtree" or not value.isdigit() or int(value) < 1:
        raise SystemExit(f"unknown method {method!r}: ar, chain, ddtree:N or auto")
    return int(value)


def prompts_for(tokenizer: Any, count: int) -> list[list[int]]:
    """HumanEval and chat prompts, alternating, through the chat template."""
    code, chat = load_prompts(HUMANEVAL, count), load_prompts(CHAT, count)
    mixed = [p for pair in zip(code, chat) for p in pair][:count]
    return [encode_prompt(tokenizer, prompt, chat_template=True) for prompt in mixed]


@torch.inference_mode()
def logit_difference(model: Any, prompts: list[list[int]], batch: int, nodes: int = 9) -> dict[str, Any]:
    """Each prompt's 9-node chain verified in a one-row state and in row r of a ``batch``-row state whose other rows
    hold the other prompts (their own chains): the largest |logit difference| and the argmax flips of that row."""
    from tensorrt_llm_dflash.static_state import StaticTarget

    vocab = int(model.config.vocab_size)
    chains = [torch.randint(0, vocab, (nodes,), generator=torch.Generator().manual_seed(i)) for i in range(batch)]
    depths = torch.arange(nodes, device=model.device)
    visible = torch.ones(nodes, nodes, dtype=torch.bool, device=model.device).tril()
    worst, flips = 0.0, 0
    capacity = -(-(max(len(p) for p in prompts) + nodes) // 256) * 256

    def run(rows: list[int]) -> torch.Tensor:
        state = StaticTarget(model, [], capacity, len(rows))
        for r, i in enumerate(rows):
            state.prefill(torch.tensor([prompts[i]], device=model.device), row=r)
        past = torch.tensor([len(prompts[i]) for i in rows], device=model.device)
        tokens = torch.stack([chains[i % batch] for i in rows]).to(model.device)
        logits, _ = state.verify(tokens, depths.expand(len(rows), -1), visible.expand(len(rows), -1, -1), past)
        return logits.float()

    for i in range(min(batch, len(prompts))):
        together = run(list(range(min(batch, len(prompts)))))[i]
        alone = run([i])[0]
        worst = max(worst, float((together - alone).abs().max()))
        flips += int((together.argmax(-1) != alone.argmax(-1)).sum())
    return {"nodes": nodes * min(batch, len(prompts)), "max_abs_logit_difference": worst, "argmax_flips": flips}


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def measure(model: Any, drafter: Any, method: str, prompts: list[list[int]], new: int, batch: int,
            ar: list[list[int]] | None) -> tuple[dict[str, Any], list[list[int]]]:
    """(figures, the solo outputs) of one method; ``ar``: AR's solo outputs (None: this is AR)."""
    speculative = method != "ar"
    budget = budget_of(method)
    start = time.perf_counter()
    solo_decoder = GraphedDecoder(model, drafter if speculative else None, budget=budget, capacity=1024)
    solo = [solo_decoder.generate(prompt, new).output_ids for prompt in prompts]
    batched_decoder = GraphedDecoder(model, drafter if speculative else None, budget=budget, batch=batch,
                                     capacity=1024)
    batched = [r.output_ids for r in batched_decoder.generate_many(prompts, new)]
    differs = [first_difference(s, b) for s, b in zip(solo, batched)]
    result = {"rows": len(prompts), "batched_differs_from_solo": sum(d is not None for d in differs),
              "first_difference": differs, "seconds": time.perf_counter() - start}
    reference = ar if ar is not None else solo
    result["solo_differs_from_ar"] = sum(first_difference(s, a) is not None for s, a in zip(solo, reference))
    result["batched_differs_from_ar"] = sum(first_difference(b, a) is not None for b, a in zip(batched, reference))
    return result, solo


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"command": " ".join(sys.argv), "machine": {"cpu": cpu_model(), "python":
                              platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                              "device": args.device}, "batch": args.batch, "max_new_tokens": args.max_new_tokens,
                              "results": {}}
    draft_dir = resolve_drafter_dir(args.draft_model_dir, args.target_model_dir, "measure --methods ar only")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        model, tokenizer = load_target(args.target_model_dir, dtype=dtype, device=args.device)
        drafter = load_dflash_drafter(draft_dir, dtype=dtype, device=args.device)
        prompts = prompts_for(tokenizer, args.num_prompts)
        ar_solo = None
        results = report["results"].setdefault(dtype_name, {})
        results["logits"] = logit_difference(model, prompts, args.batch)
        print(f"{dtype_name:9s} logits     alone vs in a batch of {args.batch}: max |difference| "
              f"{results['logits']['max_abs_logit_difference']:.3g}, argmax flips {results['logits']['argmax_flips']}/"
              f"{results['logits']['nodes']} nodes", flush=True)
        for method in sorted(args.methods, key=lambda m: m != "ar"):  # AR first: the others compare with it
            results[method], solo = measure(model, drafter, method, prompts, args.max_new_tokens, args.batch, ar_solo)
            if method == "ar":
                ar_solo = solo
            line = results[method]
            print(f"{dtype_name:9s} {method:10s} batched != solo: {line['batched_differs_from_solo']}/{line['rows']}"
                  f"  solo != AR: {line['solo_differs_from_ar']}/{line['rows']}"
                  f"  batched != AR: {line['batched_differs_from_ar']}/{line['rows']}"
                  f"  first differences {line['first_difference']}  ({line['seconds']:.0f} s)", flush=True)
        if args.output_json:
            atomic_write_json(args.output_json, report)
    if args.output_json:
        print(json.dumps({"written": args.output_json}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
