#!/usr/bin/env python
"""Is a change in tau between two benchmark runs more than noise?

For each speculative method in both runs: the mean over prompts of per-prompt tau, its standard error,
the difference and the difference in standard errors (z). At T>0 every run draws its own samples, so
a |z| near 1 is what two runs of the same drafter give. Compare a committed run with the current one:

    git show 714a440:benchmarks/humaneval_t1/results.json > /tmp/before.json
    python examples/compare_runs.py /tmp/before.json benchmarks/humaneval_t1/results.json

Exit code 2, with one line naming the argument: a file that is not a benchmark's results.json, or two
runs that share no speculative method.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorrt_llm_dflash import cli  # noqa: E402
from tensorrt_llm_dflash.bench import METHOD_KINDS, RequestRecord, prompt_tau_spread, read_records  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashError  # noqa: E402


def is_baseline(label: str) -> bool:
    """An autoregressive method (ar, hf, hf-static, ar-graph, as benchmark.py registers them): one token per step,
    tau is 1 by construction, so there is nothing to compare. A label this checkout does not know (a method
    registered by a plugin) is kept."""
    kind = METHOD_KINDS.get(label.partition(":")[0])
    return kind is not None and kind.autoregressive


def read_speculative(ap: argparse.ArgumentParser, argument: str, path: str) -> dict[str, list[RequestRecord]]:
    """The speculative methods' records of one run; a file that is no benchmark's results is refused by argument."""
    try:
        records = read_records(path)
    except (DFlashError, OSError, ValueError) as err:  # read_records wraps these; OSError/ValueError stay defensive
        cli.refuse(ap, argument, str(err))
    speculative = {label: rows for label, rows in records.items() if not is_baseline(label)}
    if not speculative:
        cli.refuse(ap, argument, f"{path} holds no speculative method (only {', '.join(records) or 'no methods'})")
    return speculative


def spread(ap: argparse.ArgumentParser, argument: str, path: str, label: str,
           records: list[RequestRecord]) -> tuple[float, float]:
    try:
        return prompt_tau_spread(records)
    except (DFlashError, TypeError, ValueError) as err:  # too few prompts, or malformed acceptance lengths
        cli.refuse(ap, argument, f"{path}: method {label}: {err}")


def main(argv: list[str] | None = None) -> int:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="results.json of the earlier run")
    ap.add_argument("after", help="results.json of the later run")
    args = ap.parse_args(argv)
    before = read_speculative(ap, "before", args.before)
    after = read_speculative(ap, "after", args.after)
    shared = [m for m in before if m in after]
    if not shared:
        cli.refuse(ap, "after", f"{args.after} shares no speculative method with {args.before} (before: "
                                f"{', '.join(before)}; after: {', '.join(after)})")
    # Every figure is computed before the table starts, so a bad method is refused without half a table.
    rows = [(label, spread(ap, "before", args.before, label, before[label]),
             spread(ap, "after", args.after, label, after[label])) for label in shared]
    print("| method | before (mean +- se) | after (mean +- se) | change | z |")
    print("|---|---:|---:|---:|---:|")
    for label, (m0, se0), (m1, se1) in rows:
        z = (m1 - m0) / math.hypot(se0, se1) if se0 or se1 else math.nan
        print(f"| {label} | {m0:.2f} +- {se0:.2f} | {m1:.2f} +- {se1:.2f} | {m1 - m0:+.2f} | {z:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
