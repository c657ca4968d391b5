#!/usr/bin/env python
"""Benchmark decoding methods on one machine, one prompt set, one run: tau, tokens/s, speedup, stages.

    python examples/benchmark.py --dataset humaneval --num_prompts 20 --max_output_len 128 \\
        --temperature 0 --methods ar hf pld dflash ddtree:8 ddtree:16 ddtree:32 ddtree:64 --output_dir bench/t0

Methods: ar (this runtime's AR loop), hf (transformers generate), pld[:N] (transformers
prompt-lookup decoding, N lookup tokens, default 10), dflash (chain), ddtree:B (DDTree,
B draft nodes), auto[:N] (the cost-aware DDTree with lookup branches, at most N nodes),
default (exactly what examples/run.py does with no decoding flags; results.json records
what it resolved to), and the graph-ready runtime: ar-graph, dflash-graph, ddtree-graph:B
(static state; CUDA graphs on CUDA), hf-static (transformers generate over its static cache).

On a GPU:

    python examples/benchmark.py --device cuda --methods ar ar-graph hf-static default \\
        dflash-graph ddtree-graph:16 ddtree-graph:32 --output_dir bench/gpu

LoRA-inject (docs/lora_inject.md): --lora_inject_dir DIR adds lora_inject and lora_inject_ddtree:B, which draft
with that adapter alone (no --draft_model_dir).

Writes DIR/results.json, DIR/results.md and PNG plots. At T=0 every
output is compared with the AR output; a mismatch is printed and the exit code is 1.
Exit code 2: bad input or a missing model.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorrt_llm_dflash import cli  # noqa: E402
from tensorrt_llm_dflash.assets import resolve_drafter_dir  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashError  # noqa: E402
from tensorrt_llm_dflash.precision import low_precision_warning  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="humaneval",
                    help="'humaneval', 'chat' (the packaged chat prompt set: explanations, how-tos, advice, "
                         "comparisons, stories, poems, summaries, rewrites) or a .jsonl file of {\"prompt\": ...} lines")
    ap.add_argument("--num_prompts", type=cli.integer(1), default=20, help="the first N prompts, in file order")
    ap.add_argument("--max_output_len", type=cli.integer(1, 1 << 20), default=128,
                    help="new tokens per prompt (fewer on EOS)")
    ap.add_argument("--methods", nargs="+", default=["ar", "hf", "pld", "dflash", "ddtree:16"])
    ap.add_argument("--temperature", type=cli.number(0.0), default=0.0)
    ap.add_argument("--top_p", type=cli.number(0.0, 1.0, low_open=True), default=1.0)
    ap.add_argument("--top_k", type=cli.integer(0), default=0)
    ap.add_argument("--seed", type=cli.seed, default=0, help="prompt i is sampled with seed + i by every method")
    ap.add_argument("--target_model_dir", type=cli.existing_path, default=None,
                    help="HF causal-LM dir or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--draft_model_dir", type=cli.existing_dir, default=None,
                    help="DFlash drafter dir (default: the shipped demo drafter)")
    ap.add_argument("--no_chat_template", action="store_true", help="send prompt text as-is (recorded in results)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"], default="float32",
                    help="float32/float64: outputs are checked against AR (a mismatch exits 1); "
                         "float16/bfloat16: the match rate is reported instead")
    ap.add_argument("--device", type=cli.device, default="cpu",
                    help="cpu or cuda: where the target and drafter run (timing synchronises the device)")
    ap.add_argument("--threads", type=cli.threads, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--no_warmup", action="store_true", help="skip the untimed warm-up prompt")
    ap.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    ap.add_argument("--lora_inject_dir", type=cli.existing_dir, default=None,
                    help="LoRA-inject adapter dir: adds the methods lora_inject and lora_inject_ddtree:B")
    ap.add_argument("--output_dir", type=cli.output_dir, default="bench_results")
    args = ap.parse_args(argv)
    from tensorrt_llm_dflash import bench
    from tensorrt_llm_dflash.errors import DFlashInputError

    if args.lora_inject_dir:
        bench.register_lora_inject(args.lora_inject_dir)
    try:
        args.parsed_methods = bench.parse_methods(args.methods)
    except DFlashInputError as err:
        cli.refuse(ap, "--methods", str(err))
    if args.draft_model_dir is not None and not bench.needs_dflash_drafter(args.parsed_methods):
        cli.refuse(ap, "--draft_model_dir", "no method given drafts with it (ar, hf, pld, ar-graph and hf-static use "
                                            "no drafter; the lora_inject methods draft with --lora_inject_dir)")
    if args.dataset not in (bench.HUMANEVAL, bench.CHAT):
        try:
            cli.existing_file(args.dataset)
        except argparse.ArgumentTypeError as err:
            cli.refuse(ap, "--dataset", f"is neither 'humaneval', 'chat' nor a JSONL file: {err}")
    return args


def absolute(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)


def absolute_paths(args: argparse.Namespace) -> dict[str, str | None]:
    """The path arguments, absolute; a built-in prompt set keeps its name."""
    from tensorrt_llm_dflash import bench

    paths = {name: absolute(getattr(args, name))
             for name in ("target_model_dir", "draft_model_dir", "lora_inject_dir", "output_dir")}
    paths["dataset"] = args.dataset if args.dataset in (bench.HUMANEVAL, bench.CHAT) else absolute(args.dataset)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "examples/benchmark.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        import torch

        from tensorrt_llm_dflash import bench
        from tensorrt_llm_dflash.sampling import SamplingParams
        from tensorrt_llm_dflash.target import check_prompt_fits, load_target, max_positions

        # Everything cheap is checked before the models load.
        methods = args.parsed_methods
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, seed=args.seed)
        prompts = bench.load_prompts(args.dataset, args.num_prompts)
        # Checked before anything heavy is loaded.
        draft_dir = (resolve_drafter_dir(args.draft_model_dir, args.target_model_dir,
                                         "pass --draft_model_dir, or benchmark only --methods ar hf pld")
                     if bench.needs_dflash_drafter(methods) else None)
        if args.threads:
            torch.set_num_threads(args.threads)
        warning = low_precision_warning(args.dtype, any(not bench.METHOD_KINDS[m.kind].autoregressive
                                                         for m in methods))
        if warning:
            print(warning + " The report gives each method's match rate against AR.", file=sys.stderr)

        dtype = getattr(torch, args.dtype)
        model, tokenizer = load_target(args.target_model_dir, dtype=dtype, device=args.device)
        drafter = None
        if draft_dir is not None:
            from tensorrt_llm_dflash.dflash2 import load_drafter  # DFlash or DFlash2, by its config

            drafter = load_drafter(draft_dir, dtype=dtype, device=args.device)
            bench.check_drafter_fits(drafter, model)
        prompt_ids = [bench.encode_prompt(tokenizer, p, not args.no_chat_template) for p in prompts]
        for ids in prompt_ids:
            check_prompt_fits(len(ids), args.max_output_len, max_positions(model))

        ctx = bench.BenchContext(model, args.max_output_len, sampling, bench.stop_token_ids(model),
                                 drafter=drafter, tokenizer=tokenizer)
        records = bench.run_benchmark(ctx, methods, prompt_ids, seed=args.seed, warmup=not args.no_warmup,
                                      progress=not args.no_progress)
        summary = bench.summarize(records, methods, sampling.greedy, dtype=args.dtype,
                                  categories=[p.category for p in prompts])
        run_info = {
            "command": command,
            "git_commit": bench.git_commit(),
            "machine": bench.machine_info(args.threads),
            # Paths absolute (the command keeps them as typed): copy_split.py and others read them from anywhere.
            "config": {**{k: v for k, v in vars(args).items() if k != "parsed_methods"}, **absolute_paths(args),
                       "num_prompts": len(prompt_ids), "chat_template": not args.no_chat_template,
                       "target": absolute(args.target_model_dir) or "embedded SmolLM2-135M-Instruct",
                       "drafter": absolute(draft_dir), "stop_token_ids": ctx.stop_token_ids,
                       "prompt_tokens": [len(p) for p in prompt_ids]},
        }
        written = bench.write_results(args.output_dir, summary, records, run_info)
    except DFlashError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: nothing written to {args.output_dir} (a partial benchmark compares methods on "
              "different prompts)", file=sys.stderr)
        return 130

    print(bench.results_markdown(summary, run_info, []))
    print("wrote " + ", ".join(str(p) for p in written))
    loud = bench.mismatch_lines(summary)
    for line in loud:
        print(line, file=sys.stderr)
    return 1 if loud else 0


if __name__ == "__main__":
    sys.exit(main())
