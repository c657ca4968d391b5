#!/usr/bin/env python
"""How well does each method copy? Split a benchmark run's tau by copyable steps.

A step is *copyable* when the bigram ending at its last committed token occurred earlier in
the context: there prompt lookup has a candidate, and a drafter can win by copying (see
``tensorrt_llm_dflash.bench.copyable_steps``). New benchmark runs report this split in their
``results.md``; this script computes it for any ``results.json``, older runs included:

    python examples/copy_split.py benchmarks/humaneval_t0/results.json

Exit code 2, with one line naming the argument: a file that is not a benchmark's results.json, or one
whose tokenizer or prompts cannot be found here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorrt_llm_dflash import cli  # noqa: E402
from tensorrt_llm_dflash.bench import (  # noqa: E402
    CHAT,
    HUMANEVAL,
    RequestRecord,
    copyable_steps,
    encode_prompt,
    load_prompts,
    read_results,
    summarize_method,
)
from tensorrt_llm_dflash.errors import DFlashError, DFlashInputError  # noqa: E402
from tensorrt_llm_dflash.target import load_tokenizer  # noqa: E402

#: What the split needs from a results.json's "config" (examples/benchmark.py writes them all), by type.
CONFIG_FIELDS = {"dataset": str, "num_prompts": int, "chat_template": bool}


def split(path: str) -> list[tuple[str, dict[str, Any]]]:
    """Each method's summary with the copyable split; anything wrong with the run raises DFlashError or OSError."""
    doc = read_results(path)
    cfg = doc.get("config")
    if not isinstance(cfg, dict):
        raise DFlashInputError(f"{path}: has no \"config\" object (not a results.json written by examples/benchmark.py)")
    for key, kind in CONFIG_FIELDS.items():
        if not isinstance(cfg.get(key), kind):
            raise DFlashInputError(f"{path}: config.{key} is {cfg.get(key)!r}, not a {kind.__name__} "
                                   f"(not a results.json written by examples/benchmark.py)")
    try:
        records = {label: [RequestRecord(**row) for row in rows] for label, rows in doc["per_prompt"].items()}
    except (TypeError, AttributeError) as err:
        raise DFlashInputError(f"{path}: per_prompt holds malformed records ({err})") from None
    # examples/benchmark.py stores these absolute; older runs stored them as typed, relative to where they ran.
    for key in ("target_model_dir", "dataset"):
        value = cfg.get(key)
        if isinstance(value, str) and value not in (HUMANEVAL, CHAT) and not Path(value).is_absolute() \
                and not Path(value).exists():
            raise DFlashInputError(f"{path}: config.{key} {value!r} is relative to the directory the benchmark ran "
                                   "in (a run older than absolute paths): run copy_split.py from there")
    tokenizer = load_tokenizer(cfg.get("target_model_dir"))
    prompts = [encode_prompt(tokenizer, p, cfg["chat_template"])
               for p in load_prompts(cfg["dataset"], cfg["num_prompts"])]
    lengths = [len(p) for p in prompts]
    if cfg.get("prompt_tokens") not in (None, lengths):
        raise DFlashInputError(f"{path}: prompt_tokens={cfg['prompt_tokens']} but the prompts encode to "
                               f"{lengths} tokens now (a different tokenizer or chat template?)")
    out = []
    for label, rows in records.items():
        for r in rows:
            if not isinstance(r.prompt_index, int) or not 0 <= r.prompt_index < len(prompts):
                raise DFlashInputError(f"{path}: method {label}: prompt_index={r.prompt_index!r} is not one of the "
                                       f"run's {len(prompts)} prompts")
            try:
                r.copyable = copyable_steps(prompts[r.prompt_index], r.output_ids, r.acceptance_lengths)
            except (TypeError, ValueError) as err:
                raise DFlashInputError(f"{path}: method {label}: malformed record ({err})") from None
        out.append((label, summarize_method(rows)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a results.json written by examples/benchmark.py")
    args = ap.parse_args(argv)
    try:
        methods = split(args.results)  # all of it before the table starts: no half table before an error
    except (DFlashError, OSError) as err:  # the file, its config, or the tokenizer and prompts the config names
        cli.refuse(ap, "results", str(err))
    print("| method | tau | tau, copyable steps | tau, other steps | copyable steps |")
    print("|---|---:|---:|---:|---:|")
    for label, s in methods:
        print(f"| {label} | {s['tau_mean']:.2f} | {s['tau_copyable']:.2f} | {s['tau_elsewhere']:.2f} | "
              f"{100 * s['copyable_step_fraction']:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
