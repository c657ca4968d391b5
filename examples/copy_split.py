#!/usr/bin/env python
"""How well does each method copy? Split a benchmark run's tau by copyable steps.

A step is *copyable* when the bigram ending at its last committed token occurred earlier in
the context: there prompt lookup has a candidate, and a drafter can win by copying (see
``tensorrt_llm_dflash.bench.copyable_steps``). New benchmark runs report this split in their
``results.md``; this script computes it for any ``results.json``, older runs included:

    python examples/copy_split.py benchmarks/humaneval_t0/results.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorrt_llm_dflash.bench import (  # noqa: E402
    RequestRecord,
    copyable_steps,
    encode_prompt,
    load_prompts,
    read_results,
    summarize_method,
)
from tensorrt_llm_dflash.errors import DFlashInputError  # noqa: E402
from tensorrt_llm_dflash.target import load_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a results.json written by examples/benchmark.py")
    args = ap.parse_args(argv)
    doc = read_results(args.results)
    cfg = doc["config"]
    tokenizer = load_tokenizer(cfg.get("target_model_dir"))
    prompts = [encode_prompt(tokenizer, p, cfg["chat_template"])
               for p in load_prompts(cfg["dataset"], cfg["num_prompts"])]
    lengths = [len(p) for p in prompts]
    if cfg.get("prompt_tokens") not in (None, lengths):
        raise DFlashInputError(f"{args.results}: prompt_tokens={cfg['prompt_tokens']} but the prompts encode to "
                               f"{lengths} tokens now (a different tokenizer or chat template?)")
    print("| method | tau | tau, copyable steps | tau, other steps | copyable steps |")
    print("|---|---:|---:|---:|---:|")
    for label, rows in doc["per_prompt"].items():
        records = [RequestRecord(**row) for row in rows]
        for r in records:
            r.copyable = copyable_steps(prompts[r.prompt_index], r.output_ids, r.acceptance_lengths)
        s = summarize_method(records)
        print(f"| {label} | {s['tau_mean']:.2f} | {s['tau_copyable']:.2f} | {s['tau_elsewhere']:.2f} | "
              f"{100 * s['copyable_step_fraction']:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
