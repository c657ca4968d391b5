#!/usr/bin/env python
"""Have the target write user turns (Magpie-style sampling), as a --dataset for train_dflash.py.

The chat template is rendered up to where a user's message begins and the target samples
from there until it ends the turn; turns that did not end, hold a template token, are too
short, repeat, or share a word 8-gram with a benchmark prompt (HumanEval, the chat set) are
dropped (tensorrt_llm_dflash/training/user_turns.py). The kept turns are written as OpenAI
lines, {"messages": [{"role": "user", "content": ...}]}, for the target to answer greedily in
the data stage:

    python examples/write_user_turns.py --output runs/user_turns.jsonl --num_turns 2000
    python examples/write_user_turns.py --output runs/more_turns.jsonl --seed 1 --avoid runs/user_turns.jsonl
    python examples/train_dflash.py --dataset runs/user_turns.jsonl --work_dir runs/self ...

The file is written whole, through a temporary name, once every turn is kept.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tensorrt_llm_dflash import cli  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashError  # noqa: E402
from tensorrt_llm_dflash.files import atomic_write_text  # noqa: E402
from tensorrt_llm_dflash.target import load_target  # noqa: E402
from tensorrt_llm_dflash.training.datasets import read_dataset  # noqa: E402
from tensorrt_llm_dflash.training.leakage import benchmark_prompts  # noqa: E402
from tensorrt_llm_dflash.training.user_turns import WrittenTurns, write_user_turns  # noqa: E402


def build_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", type=cli.output_file, required=True, help="the JSONL file to write")
    ap.add_argument("--num_turns", type=cli.integer(1, 1_000_000), default=2000, help="user turns to keep")
    ap.add_argument("--target_model_dir", type=cli.existing_path, default=None,
                    help="HF dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--seed", type=cli.seed, default=0)
    ap.add_argument("--avoid", type=cli.existing_path, nargs="+", default=[], metavar="JSONL",
                    help="conversation files (earlier runs' output, or any --dataset file) whose user turns the "
                         "new turns must not repeat")
    ap.add_argument("--temperature", type=cli.number(0.0, 2.0, low_open=True), default=1.0)
    ap.add_argument("--top_p", type=cli.number(0.0, 1.0, low_open=True), default=0.95)
    ap.add_argument("--max_new_tokens", type=cli.integer(8, 4096), default=96,
                    help="longest user turn in tokens (a longer one is dropped, not cut)")
    ap.add_argument("--min_words", type=cli.integer(1, 1000), default=4)
    ap.add_argument("--batch_size", type=cli.integer(1, 4096), default=64)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="dtype of the target while it writes (bf16: about 2x faster on CPUs with AMX-BF16)")
    ap.add_argument("--device", type=cli.device, default=None, help="cpu or cuda[:N] (default: cuda if available)")
    ap.add_argument("--threads", type=cli.threads, default=None)
    return ap


def avoided_turns(paths: list[str]) -> list[str]:
    """Every user turn of the --avoid files (read before the model loads: a bad file exits 2)."""
    turns = []
    for path in paths:
        dataset = read_dataset(path, flag="--avoid")
        if dataset.summary():
            print(f"warning: --avoid {dataset.summary()}; their turns are not avoided", file=sys.stderr)
        turns += dataset.user_turns()
    return turns


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        exclude = [text for _, text in benchmark_prompts()]
        avoid = avoided_turns(args.avoid)
        model, tokenizer = load_target(args.target_model_dir, dtype=torch.float32, device=device)
        if args.precision == "bf16":
            model = model.to(torch.bfloat16)
        bar = tqdm(total=args.num_turns, desc="user turns", unit="turn")

        def progress(written: WrittenTurns) -> None:
            bar.update(len(written.turns) - bar.n)
            bar.set_postfix(dropped=sum(written.dropped.values()))

        t0 = time.time()
        written = write_user_turns(model, tokenizer, args.num_turns, seed=args.seed, temperature=args.temperature,
                                   top_p=args.top_p, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                   min_words=args.min_words, exclude=exclude, avoid=avoid,
                                   progress=progress)
        bar.close()
    except DFlashError as err:
        cli.print_error(err)
        return 2
    if not written.turns:
        cli.print_error(f"no user turn was kept ({written.summary()}); nothing written to {args.output}")
        return 2
    atomic_write_text(args.output, "".join(
        json.dumps({"messages": [{"role": "user", "content": turn}]}, ensure_ascii=False) + "\n"
        for turn in written.turns))
    short = len(written.turns) < args.num_turns
    print(f"{written.summary()} in {written.batches} batches, {time.time() - t0:.0f}s; wrote {args.output}"
          + (f" (fewer than --num_turns {args.num_turns}: the batch limit was reached)" if short else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
