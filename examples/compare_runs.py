#!/usr/bin/env python
"""Is a change in tau between two benchmark runs more than noise?

For each method in both runs: the mean over prompts of per-prompt tau, its standard error, the
difference and the difference in standard errors (z). At T>0 every run draws its own samples, so
a |z| near 1 is what two runs of the same drafter give. Compare a committed run with the current one:

    git show 714a440:benchmarks/humaneval_t1/results.json > /tmp/before.json
    python examples/compare_runs.py /tmp/before.json benchmarks/humaneval_t1/results.json
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorrt_llm_dflash.bench import prompt_tau_spread, read_records  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashInputError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="results.json of the earlier run")
    ap.add_argument("after", help="results.json of the later run")
    args = ap.parse_args(argv)
    before, after = read_records(args.before), read_records(args.after)
    shared = [m for m in before if m in after and m not in ("ar", "hf")]
    if not shared:
        raise DFlashInputError(f"{args.before} and {args.after} share no speculative method")
    print("| method | before (mean +- se) | after (mean +- se) | change | z |")
    print("|---|---:|---:|---:|---:|")
    for label in shared:
        (m0, se0), (m1, se1) = prompt_tau_spread(before[label]), prompt_tau_spread(after[label])
        z = (m1 - m0) / math.hypot(se0, se1) if se0 or se1 else math.nan
        print(f"| {label} | {m0:.2f} +- {se0:.2f} | {m1:.2f} +- {se1:.2f} | {m1 - m0:+.2f} | {z:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
