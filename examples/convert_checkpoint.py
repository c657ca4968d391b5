#!/usr/bin/env python
"""Convert an HF target (Qwen3 / Qwen2 / Llama safetensors) and a DFlash drafter into a
TensorRT-LLM checkpoint for ``trtllm-build --speculative_decoding_mode dflash``.

    python examples/convert_checkpoint.py --model_dir TARGET --dflash_model_dir DRAFTER \\
        --output_dir CKPT --dtype bfloat16 [--tp_size N] [--pp_size 1]

Runs without TensorRT-LLM (plain torch + safetensors). Exits with status 2 and a
message naming the field when the drafter does not fit the target.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorrt_llm_dflash import cli  # noqa: E402
from tensorrt_llm_dflash.dflash2 import check_drafter_dir  # noqa: E402
from tensorrt_llm_dflash.dflash2.config import DFlash2Config  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashError  # noqa: E402
from tensorrt_llm_dflash.trtllm.constants import MAX_ENGINE_DRAFT_LEN  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_dir", type=cli.existing_dir, required=True,
                    help="HF target directory (config.json + *.safetensors)")
    ap.add_argument("--dflash_model_dir", type=cli.existing_dir, required=True,
                    help="DFlash drafter directory (published format)")
    ap.add_argument("--output_dir", type=cli.result_dir, required=True,
                    help="where config.json and rank{N}.safetensors go (replaced as a whole when complete)")
    ap.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto")
    ap.add_argument("--tp_size", type=cli.integer(1, 1024), default=1)
    ap.add_argument("--pp_size", type=cli.integer(1, 1), default=1,
                    help="must be 1: the drafter reads target layers from every pipeline stage")
    ap.add_argument("--max_draft_len", type=cli.integer(1, MAX_ENGINE_DRAFT_LEN), default=None,
                    help="default draft length stored in config.json (default: block_size - 1; at least that)")
    ap.add_argument("--no_progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    for name in ("model_dir", "dflash_model_dir"):
        if Path(args.output_dir).resolve() == Path(getattr(args, name)).resolve():
            cli.refuse(ap, "--output_dir", f"{args.output_dir!r} is also --{name}")
    if args.max_draft_len is not None:
        # Only the drafter's config.json is read here: the weights load after every argument is settled.
        try:
            config = check_drafter_dir(args.dflash_model_dir)  # DFlash or DFlash2 (either published layout)
            block_size = (config.base if isinstance(config, DFlash2Config) else config).block_size
        except DFlashError as err:
            cli.refuse(ap, "--dflash_model_dir", str(err))
        if args.max_draft_len < block_size - 1:
            cli.refuse(ap, "--max_draft_len", f"{args.max_draft_len} is below the drafter's chain length "
                       f"block_size - 1 = {block_size - 1}; allowed {block_size - 1}..{MAX_ENGINE_DRAFT_LEN}")
    # The configs alone decide whether the mapping can be split: refuse it by name now, not after
    # both models are read. A pair that does not fit is reported by the conversion (its own message).
    from tensorrt_llm_dflash.trtllm.weight import check_parallelism, read_configs

    try:
        target, drafter, _ = read_configs(args.model_dir, args.dflash_model_dir)
    except DFlashError:
        pass
    else:
        try:
            check_parallelism(target, drafter, args.tp_size, args.pp_size)
        except DFlashError as err:
            cli.refuse(ap, "--tp_size", str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tensorrt_llm_dflash.trtllm.weight import convert_checkpoint

    t0 = time.perf_counter()
    try:
        config = convert_checkpoint(
            args.model_dir, args.dflash_model_dir, args.output_dir, dtype=args.dtype,
            tp_size=args.tp_size, pp_size=args.pp_size, max_draft_len=args.max_draft_len,
            progress=not args.no_progress,
        )
    except DFlashError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: {args.output_dir} is unchanged", file=sys.stderr)
        return 130
    print(f"wrote {args.output_dir}: {config['mapping']['world_size']} rank(s), dtype {config['dtype']}, "
          f"{config['num_hidden_layers']} target + {config['dflash']['num_hidden_layers']} draft layers, "
          f"in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
