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
Reported per dtype and method: rows whose output differs from their solo run, and from plain AR alone (null, printed
'-', when ar is not among --methods: the drafter loads only for the other methods). First, per
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

from tensorrt_llm_dflash import cli  # noqa: E402
from tensorrt_llm_dflash.assets import resolve_drafter_dir  # noqa: E402
from tensorrt_llm_dflash.bench import (  # noqa: E402
    CHAT,
    HUMANEVAL,
    check_drafter_fits,
    cpu_model,
    encode_prompt,
    load_prompts,
)
from tensorrt_llm_dflash.config import DFlashDraftConfig  # noqa: E402
from tensorrt_llm_dflash.drafter import load_dflash_drafter  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashError, DFlashInputError  # noqa: E402
from tensorrt_llm_dflash.files import atomic_write_json  # noqa: E402
from tensorrt_llm_dflash.graphed import GraphedDecoder  # noqa: E402
from tensorrt_llm_dflash.target import check_prompt_fits, load_target, max_positions  # noqa: E402
from tensorrt_llm_dflash.tree import MAX_DDTREE_BUDGET  # noqa: E402

#: Longest generation accepted on the command line, as examples/run.py's --max_output_len; the target's own limit is
#: checked against every prompt after loading, before the first decode.
MAX_NEW_TOKENS = 1 << 20
#: The most rows of one batched decoder, the server's --max_batch_size limit.
MAX_BATCH = 256
METHOD_SYNTAX = "ar, chain, ddtree:N or auto (the cost-aware tree)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target_model_dir", type=cli.existing_path, default=None,
                    help="HF dir or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--draft_model_dir", type=cli.existing_dir, default=None,
                    help="DFlash drafter dir (default with the embedded target: the shipped demo drafter); loaded "
                         "only when a method other than ar is measured")
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16", "float64"])
    ap.add_argument("--methods", nargs="*", default=["ar", "ddtree:8", "auto"],
                    help=f"{METHOD_SYNTAX}; none (--methods alone): the logits phase only")
    ap.add_argument("--num_prompts", type=cli.integer(1), default=4)
    ap.add_argument("--max_new_tokens", type=cli.integer(1, MAX_NEW_TOKENS), default=64)
    ap.add_argument("--batch", type=cli.integer(2, MAX_BATCH), default=4)
    ap.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--threads", type=cli.threads, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--output_json", type=cli.output_file, default=None)
    args = ap.parse_args(argv)
    for method in args.methods:
        try:
            budget_of(method)
        except ValueError as err:
            cli.refuse(ap, "--methods", str(err))
    # A repeat would decode (and report) the same method twice; a dtype twice would load the models again.
    for flag, values in (("--methods", args.methods), ("--dtypes", args.dtypes)):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            cli.refuse(ap, flag, f"lists {', '.join(repeated)} more than once")
    if not needs_drafter(args.methods) and args.draft_model_dir is not None:
        cli.refuse(ap, "--draft_model_dir", "applies to the speculative methods (chain, ddtree:N, auto): "
                                            "--methods ar loads no drafter")
    return args


def needs_drafter(methods: list[str]) -> bool:
    return any(method != "ar" for method in methods)


def budget_of(method: str) -> int | None:
    """The method's DDTree budget (0: AR or the chain; None: the cost-aware tree); ValueError for an unknown one."""
    if method in ("ar", "chain"):
        return 0
    if method == "auto":
        return None
    name, _, value = method.partition(":")
    if name != "ddtree" or not value.isdigit() or not 1 <= int(value) <= MAX_DDTREE_BUDGET:
        raise ValueError(f"unknown method {method!r}: {METHOD_SYNTAX}, N in 1..{MAX_DDTREE_BUDGET}")
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
    """(figures, the solo outputs) of one method; ``ar``: AR's solo outputs (None: AR was not measured, or this is
    AR)."""
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
    if method == "ar":
        ar = solo
    # Without ar among the methods there is nothing to compare with: null, not a count against the method itself.
    result["solo_differs_from_ar"] = (None if ar is None else
                                      sum(first_difference(s, a) is not None for s, a in zip(solo, ar)))
    result["batched_differs_from_ar"] = (None if ar is None else
                                         sum(first_difference(b, a) is not None for b, a in zip(batched, ar)))
    return result, solo


def _count(value: int | None, rows: int) -> str:
    return "-" if value is None else f"{value}/{rows}"


def check_prompts_fit(prompts: list[list[int]], max_new_tokens: int, model: Any) -> None:
    """Every prompt and its --max_new_tokens within the target's context, before the first decode (a prompt that
    does not fit would otherwise stop the run after the logits phase and the methods before it)."""
    for index, prompt in enumerate(prompts):
        try:
            check_prompt_fits(len(prompt), max_new_tokens, max_positions(model))
        except DFlashInputError as err:
            raise DFlashInputError(f"prompt {index} does not fit --max_new_tokens: {err}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run_measurements(args)
    except DFlashError as err:  # a model that does not load or fit, a prompt too long for the target
        cli.print_error(err)
        return 2


def run_measurements(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"command": " ".join(sys.argv), "machine": {"cpu": cpu_model(), "python":
                              platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                              "device": args.device}, "batch": args.batch, "max_new_tokens": args.max_new_tokens,
                              "results": {}}
    draft_dir = None
    if needs_drafter(args.methods):
        draft_dir = resolve_drafter_dir(args.draft_model_dir, args.target_model_dir, "measure --methods ar only")
        DFlashDraftConfig.from_pretrained(draft_dir)  # a malformed drafter is refused before the target loads
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        model, tokenizer = load_target(args.target_model_dir, dtype=dtype, device=args.device)
        drafter = None
        if draft_dir is not None:
            drafter = load_dflash_drafter(draft_dir, dtype=dtype, device=args.device)
            check_drafter_fits(drafter, model)
        prompts = prompts_for(tokenizer, args.num_prompts)
        check_prompts_fit(prompts, args.max_new_tokens, model)
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
                  f"  solo != AR: {_count(line['solo_differs_from_ar'], line['rows'])}"
                  f"  batched != AR: {_count(line['batched_differs_from_ar'], line['rows'])}"
                  f"  first differences {line['first_difference']}  ({line['seconds']:.0f} s)", flush=True)
        if args.output_json:
            atomic_write_json(args.output_json, report)
    if args.output_json:
        print(json.dumps({"written": args.output_json}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
