"""The cost-aware tree at batch B (tensorrt_llm_dflash.device_policy): the host's size choice from injected cost
curves (deterministic, no timing), and the device side's per-row estimates and padding-blind learning.

* The choice is the size with the most expected tokens per second for the whole batch (brute force over random
  batches and curves), AR included: where AR wins on the batch's own curve it is chosen, so speculation never
  costs the batch throughput against AR at the same concurrency, except for the back-off's probes, which
  thin out (doubling gaps, longer the more a probe loses, up to 64 AR steps, shorter where a batch size's probes
  have been winning: at most one step in 65); a batch of nothing but new rows probes at once (in a batch
  of more than one, where that batch size's probes have won or have no record).
* A size whose steps deliver fewer tokens than it promised is scaled down until it stops being chosen.
* A row not drafted for yet counts as the mean of the others; a batch with no estimate starts at the start size.
* ``expected_tokens`` is 1 + the sum of the best ``size - 1`` path values; ``learn`` ignores padding rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorrt_llm_dflash.device_lookup import Grafted
from tensorrt_llm_dflash.device_policy import POLICY_BUCKETS, DevicePolicy, SizeChooser
from tensorrt_llm_dflash.device_tree import build_ddtree_device

SIZES = (1, 2, 4, 8, 16, 32, 64)


def random_rows(rng: np.random.Generator, rows: int) -> list[list[float]]:
    """Expected tokens per drafted size: 1 + partial sums of decreasing path values (what the device writes)."""
    out = []
    for _ in range(rows):
        values = np.sort(rng.uniform(0, 1, 63) ** rng.uniform(0.5, 6))[::-1]
        expected = 1 + np.concatenate([[0.0], np.cumsum(values)])
        out.append([float(expected[size - 1]) for size in SIZES[1:]])
    return out


def rate(rows: list[list[float]], costs: list[float], size: int) -> float:
    tokens = len(rows) if size == 1 else sum(row[SIZES[1:].index(size)] for row in rows)
    return tokens / costs[SIZES.index(size)]


def test_the_choice_has_the_most_tokens_per_second_for_the_batch():
    rng = np.random.default_rng(0)
    chose_ar = chose_tree = 0
    for _ in range(500):
        rows = random_rows(rng, int(rng.integers(1, 17)))
        bucket = len(rows)
        # Per step: a fixed overhead, a per-token part (steep on a CPU, nearly flat on a GPU), a draft's cost.
        per_token = rng.choice([1e-4, 1e-3, 1e-2])
        costs = [1e-2 + per_token * bucket * size + (2e-3 * bucket if size > 1 else 0.0) for size in SIZES]
        choice = SizeChooser(SIZES).choose(rows, costs)
        best = max(SIZES, key=lambda size: rate(rows, costs, size))
        assert choice == best
        assert rate(rows, costs, choice) >= rate(rows, costs, 1)  # never below AR at this batch
        chose_ar += choice == 1
        chose_tree += choice > 1
    assert chose_ar > 50 and chose_tree > 50  # both answers occur: the test sees both sides


def test_where_no_tree_pays_ar_runs_and_the_probes_back_off():
    """A batch where AR wins by far: the chooser says AR and drafts once (a probe) to refresh its estimates, stale
    ones cannot tell when trees would pay again. This probe loses 0.8 AR steps (rate 4.8 against AR's 8 over a
    2-AR-step probe), so after it the gap jumps to the longest, 64 AR steps (1% of the AR steps between probes
    would allow 80), instead of doubling from 1: no probe of this batch size has won (``gap_cap``)."""
    chooser = SizeChooser(SIZES)
    rows = [[1.2, 1.3, 1.35, 1.4, 1.4, 1.4]] * 8
    costs = [1.0 * size for size in SIZES]  # every node costs a row's step: 8 / 1.0 for AR beats any tree
    assert chooser.probe_loss(chooser._rates(rows, costs), costs) == pytest.approx(0.8)
    choices = [chooser.choose(rows, costs) for _ in range(400)]
    probes = [i for i, size in enumerate(choices) if size > 1]
    gaps = np.diff([-1, *probes]) - 1  # AR steps before each probe
    assert gaps[0] == 1 and set(gaps[1:]) == {64}
    assert all(choices[i] == 2 for i in probes)  # the probe drafts at the best drafted size
    assert len(probes) == 1 + (400 - 2) // 65
    assert chooser.probes[8] == pytest.approx(sum(0.95 ** k for k in range(len(probes))))  # each judged, all lost
    assert chooser.wins.get(8, 0.0) == 0.0 and chooser.gap_cap(8) == 64


def test_a_probe_that_nearly_pays_is_retried_sooner():
    """A probe that loses little: the gap doubles from what its loss allows. Here a probe at 2 nodes delivers 1.07
    tokens a row at 1.2 s against AR's 1 at 1.1 s: a shortfall of 1.9% over 1.09 AR steps, 0.021 AR steps lost,
    so 3 AR steps (1% of them: 0.03) before the next probe, then 6, 12, ... as AR keeps winning."""
    chooser = SizeChooser(SIZES)
    rows = [[1.07] * 6] * 4
    costs = [1.0 + 0.1 * size for size in SIZES]
    assert chooser.probe_loss(chooser._rates(rows, costs), costs) == pytest.approx(0.0209, abs=1e-4)
    choices = [chooser.choose(rows, costs) for _ in range(300)]
    probes = [i for i, size in enumerate(choices) if size > 1]
    assert list(np.diff([-1, *probes])[:8] - 1) == [1, 3, 6, 12, 24, 48, 64, 64]
    # Rows that accept a little better: the probe's own rate decides, not the count of probes so far.
    better = SizeChooser(SIZES)
    worse = SizeChooser(SIZES)
    for chooser, value in ((better, 1.08), (worse, 1.03)):
        for _ in range(3):
            chooser.choose([[value] * 6] * 4, costs)
    assert better.backoff < worse.backoff


def test_where_probes_win_the_gap_stays_short():
    """A row whose text turns from poor to predictable and back every 40 steps (prose into code and back): a row's
    estimates are refreshed only by the steps that draft. About a quarter of the probes find trees paying, so this
    batch size's gaps stay near ``gap_cap`` (4 over that share), where one lost probe alone (0.18 AR steps lost:
    19) and the doubling would have reached 64, as they do for a row whose probes all lose."""
    poor = [1.05, 1.1, 1.1, 1.1, 1.1, 1.1]
    good = [2.0, 3.9, 7.5, 12.0, 15.0, 16.0]
    costs = [1.0 + 0.3 * size for size in SIZES]

    def ar_runs(chooser: SizeChooser, regime) -> list[int]:
        estimate, runs, run = poor, [], 0
        for step in range(1200):
            size = chooser.choose([estimate], costs)
            if size > 1:
                estimate = regime(step)
                if run and step >= 200:
                    runs.append(run)
                run = 0
            else:
                run += 1
        return runs

    swinging = SizeChooser(SIZES)
    runs = ar_runs(swinging, lambda step: good if (step // 40) % 2 else poor)
    assert max(runs) <= 20 and swinging.gap_cap(1) <= 16
    assert 0.2 < swinging.wins[1] / swinging.probes[1] < 0.4
    losing = SizeChooser(SIZES)
    assert ar_runs(losing, lambda step: poor)[-5:] == [64] * 5 and losing.gap_cap(1) == 64


def test_a_batch_of_only_new_rows_is_probed_at_once():
    """A gap was judged on the rows that stepped then. A new request (no estimate of its own) in a batch of one gets a
    probe at its first step, whatever the last request left, and the gap starts again from that probe's own loss;
    in a larger batch only when every row is new (a few new rows wait for the next probe), and only where that batch
    size's probes have won or have no record: where they all lost, new rows wait for the gap too."""
    chooser = SizeChooser(SIZES)
    poor = [1.05, 1.1, 1.1, 1.1, 1.1, 1.1]
    costs = [1.0 + 0.3 * size for size in SIZES]
    for _ in range(600):
        chooser.choose([poor], costs)
    assert chooser.backoff == 64 and chooser.ar_run > 0
    assert chooser.choose([None], costs) == 2  # the new request: a probe now (it counts as the typical row)
    # The gap starts again from this probe's own loss (0.18 AR steps: 19), where the doubling had reached 64.
    assert chooser.choose([poor], costs) == 1 and chooser.backoff == 19 and chooser.gap_cap(1) == 64
    # Eight rows: seven new ones wait for the next probe, eight get one at once.
    batch = SizeChooser(SIZES)
    for _ in range(600):
        batch.choose([poor] * 8, costs)
    assert batch.backoff == 64
    while batch.ar_run in (0, batch.backoff):  # not next to a probe
        batch.choose([poor] * 8, costs)
    assert batch.choose([poor] + [None] * 7, costs) == 1
    assert batch.wins.get(8, 0.0) == 0.0 and batch.probes[8] > 0  # every probe of 8 rows lost
    while batch.ar_run in (0, batch.backoff):
        batch.choose([poor] * 8, costs)
    assert not batch.probe_new_rows(8) and batch.choose([None] * 8, costs) == 1
    # Where a probe of 8 rows has won, or none was judged yet, eight new rows get one at once.
    batch._judge_probe(8, won=True)
    while batch.ar_run in (0, batch.backoff):
        batch.choose([poor] * 8, costs)
    assert batch.probe_new_rows(8) and batch.choose([None] * 8, costs) == 2
    fresh = SizeChooser(SIZES)
    for _ in range(600):
        fresh.choose([poor], costs)  # probes of one row only: no record for 8 rows
    while fresh.ar_run in (0, fresh.backoff):
        fresh.choose([poor], costs)
    assert fresh.probe_new_rows(8) and fresh.choose([None] * 8, costs) == 2


def test_a_probe_that_finds_speculation_paying_resets_the_back_off():
    chooser = SizeChooser(SIZES)
    poor = [[1.05, 1.1, 1.1, 1.1, 1.1, 1.1]] * 4
    good = [[2.0, 3.9, 7.5, 12.0, 15.0, 16.0]] * 4
    costs = [1.0 + 0.1 * size for size in SIZES]
    for _ in range(20):
        chooser.choose(poor, costs)
    assert chooser.backoff > 4
    assert chooser.choose(good, costs) == 16 and chooser.backoff == 1 and chooser.ar_run == 0
    assert chooser.choose(poor, costs) == 1 and chooser.choose(poor, costs) == 2  # one AR step, then a probe


def test_a_size_that_over_promises_stops_being_chosen():
    """Estimates say 8 nodes pay (4 rows x 4.0 tokens at cost 2.0 vs AR's 4 tokens at 1.0), but its steps deliver a
    quarter of the extra tokens they promise: after a few such steps the batch decodes AR. A size that delivers what
    it promises keeps being chosen; a size not run yet takes the share of the largest smaller size that has run."""
    rows = [[1.1, 1.5, 4.0, 4.0, 4.0, 4.0]] * 4
    costs = [1.0, 1.2, 1.6, 2.0, 4.0, 8.0, 16.0]
    honest, optimist = SizeChooser(SIZES), SizeChooser(SIZES)
    choices = {"honest": [], "optimist": []}
    for _ in range(40):
        choices["honest"].append(honest.choose(rows, costs))
        honest.observe(4 * 4, 4)  # 4 rows x 4 tokens: what 8 nodes promised
        size = optimist.choose(rows, costs)
        choices["optimist"].append(size)
        optimist.observe({1: 4, 4: 6, 8: 4 + 3}.get(size, 4), 4)  # 8 nodes: 3 extra tokens of the 12 promised
    assert set(choices["honest"]) == {8} and honest.share(8) == pytest.approx(1.0)
    assert choices["optimist"][:3] == [8, 8, 8] and choices["optimist"][-20:].count(1) >= 15, choices["optimist"]
    assert optimist.share(8) < 0.35 and optimist.share(16) == optimist.share(8) and optimist.share(2) == 1.0


def test_a_drafting_step_picks_its_size_from_its_own_estimates():
    """``choose_drafted`` (the in-step choice, after the draft is paid): the drafted size with the most expected
    tokens per second, never AR, and the step it picked settles that size's delivery."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        rows = random_rows(rng, int(rng.integers(1, 9)))
        costs = [1e-2 + rng.choice([1e-4, 1e-3, 1e-2]) * len(rows) * size for size in SIZES]
        chooser = SizeChooser(SIZES)
        choice = chooser.choose_drafted(rows, costs)
        assert choice == max(SIZES[1:], key=lambda size: rate(rows, costs, size))
        promised = sum(row[SIZES[1:].index(choice)] for row in rows) - len(rows)
        chooser.observe(len(rows), len(rows))  # nothing beyond the bonus tokens: delivered 0 of ``promised``
        assert chooser.promised == {choice: pytest.approx(promised)} and chooser.delivered == {choice: 0}
    poor = [[1.0 + 1e-3 * size for size in SIZES[1:]]]  # drafting pays nothing: AR would win, but it is drafted
    assert SizeChooser(SIZES).choose_drafted(poor, [1.0 + size for size in SIZES]) == 2


def test_rows_without_estimates():
    chooser = SizeChooser(SIZES, start=16)
    assert chooser.choose([None, None], [1.0] * len(SIZES)) == 16  # nothing drafted yet: the start size
    known = [1.5, 2.0, 2.4, 2.6, 2.7, 2.7]
    assert chooser.totals([known, None]) == chooser.totals([known, known])  # a new row counts as the mean
    assert chooser.totals([None, None, None]) == chooser.totals([known] * 3)  # new rows: the last rows' mean
    assert SizeChooser((2, 4, 8), start=3).start == 4  # a start that is no size: the middle one
    with pytest.raises(ValueError, match="no drafted size"):
        SizeChooser((1,))


def test_expected_tokens_and_learning_that_ignores_padding_rows():
    rng = np.random.default_rng(3)
    policy = DevicePolicy(6, POLICY_BUCKETS, torch.device("cpu"))
    assert policy.buckets == (2, 4, 8, 16, 32, 64)  # size 1 (AR) is the host's: nothing to select or learn
    lp = -np.sort(-np.log(rng.dirichlet(np.full(12, 0.4), size=(2, 6))), axis=2)
    pool = build_ddtree_device(torch.tensor([3, 5]), torch.tensor(lp), torch.tensor(rng.choice(60, (2, 6, 12))), 63)
    candidates = Grafted(pool, policy.draft_conditional(pool), torch.zeros_like(pool.valid))
    values = policy.path_values(candidates, 6)
    expected = policy.expected_tokens(values)
    for row in range(2):
        ranked = sorted(values[row, 1:].tolist(), reverse=True)
        want = [1 + sum(ranked[: size - 1]) for size in policy.buckets]
        torch.testing.assert_close(expected[row], torch.tensor(want, dtype=torch.float64))
    chosen = policy.select(candidates, values, 16)
    choices = torch.where(torch.rand(2, 16, generator=torch.Generator().manual_seed(1)) < 0.5,
                          chosen.tree.tokens.clamp(min=0), 0)
    # Row 1 is padding: learning from both rows with it masked equals learning from row 0 alone.
    masked = DevicePolicy(6, POLICY_BUCKETS, torch.device("cpu"))
    masked.learn(chosen, choices, live=torch.tensor([True, False]))
    alone = DevicePolicy(6, POLICY_BUCKETS, torch.device("cpu"))
    alone.learn(Grafted(*(_row(t, 0) for t in (chosen.tree, chosen.cond, chosen.on_branch))), choices[:1])
    for name in DevicePolicy.LEARNED:
        assert torch.equal(getattr(masked, name), getattr(alone, name)), name
    both = DevicePolicy(6, POLICY_BUCKETS, torch.device("cpu"))
    both.learn(chosen, choices)
    assert not torch.equal(both.trials, masked.trials)  # the mask changed something: the test can fail


def _row(value, row: int):
    from dataclasses import fields, replace

    if isinstance(value, torch.Tensor):
        return value[row : row + 1]
    return replace(value, **{f.name: getattr(value, f.name)[row : row + 1] if f.name != "num_nodes"
                             else value.num_nodes[row : row + 1] for f in fields(value)})


def drain_pace(rows: list[list[float]], remaining: list[int], costs: list[float], size: int) -> float:
    """The pace of the row that would finish last (share 1): min over rows of min(E, R) / R, per second."""
    tokens = [1.0 if size == 1 else row[SIZES[1:].index(size)] for row in rows]
    return min(min(t, r) / r for t, r in zip(tokens, remaining)) / costs[SIZES.index(size)]


def test_a_draining_batch_is_paced_by_its_slowest_row():
    """Nobody waits for a row: the size is the one at which the row that would finish last progresses fastest. Three
    rows that accept well and one that accepts badly: the batch's most tokens per second is 8 nodes, but a step of 8
    costs 3 AR steps and the bad row gains 1.5 tokens from it, so draining runs AR. The same bad row with one token
    left finishes in one step anyway and vetoes nothing."""
    good, bad = [1.9, 3.5, 5.5, 7.0, 7.5, 7.6], [1.2, 1.4, 1.5, 1.6, 1.6, 1.6]
    costs = [1.0, 1.6, 2.2, 3.0, 4.5, 8.0, 16.0]
    rows = [good, good, good, bad]
    assert SizeChooser(SIZES).choose(rows, costs) == 8  # the batch's tokens per second
    assert SizeChooser(SIZES).choose(rows, costs, remaining=[100, 100, 100, 100]) == 1
    assert SizeChooser(SIZES).choose(rows, costs, remaining=[100, 100, 100, 1]) == 8
    assert SizeChooser(SIZES).choose_drafted(rows, costs, remaining=[100, 100, 100, 100]) == 2  # drafted: the least bad
    rng = np.random.default_rng(3)
    seen = set()
    for _ in range(300):
        rows = random_rows(rng, int(rng.integers(1, 17)))
        remaining = [int(r) for r in rng.integers(1, 200, len(rows))]
        costs = [1e-2 + rng.choice([1e-4, 1e-3, 1e-2]) * len(rows) * size + (2e-3 * len(rows) if size > 1 else 0.0)
                 for size in SIZES]
        choice = SizeChooser(SIZES).choose(rows, costs, remaining)
        assert choice == max(SIZES, key=lambda size: drain_pace(rows, remaining, costs, size))
        assert drain_pace(rows, remaining, costs, choice) >= drain_pace(rows, remaining, costs, 1)  # never behind AR
        seen.add(choice > 1)
    assert seen == {False, True}


def test_one_row_drains_as_it_decodes_until_its_last_tokens():
    """For one row the two rules are one (tokens per second), except where a size promises more than is left."""
    rng = np.random.default_rng(4)
    for _ in range(200):
        rows = random_rows(rng, 1)
        costs = [1e-2 + rng.choice([1e-4, 1e-3, 1e-2]) * size for size in SIZES]
        assert SizeChooser(SIZES).choose(rows, costs, remaining=[10**6]) == SizeChooser(SIZES).choose(rows, costs)


def affordable_brute(rows: list[list[float]], costs: list[float], credit: list[float], size: int) -> bool:
    """No row falls behind AR's pace in expectation beyond the tokens it is ahead."""
    if size == 1:
        return True
    steps = costs[SIZES.index(size)] / costs[0]
    return all(row[SIZES[1:].index(size)] - steps >= -max(c, 0.0) for row, c in zip(rows, credit))


def random_credit_case(rng: np.random.Generator) -> tuple[list[list[float]], list[float], list[float]]:
    """A random batch of 1-16 rows, each row's credit, and a cost curve (fixed part, per token, the draft's)."""
    rows = random_rows(rng, int(rng.integers(1, 17)))
    credit = [float(c) for c in rng.choice([0.0, 0.5, 2.0, -1.0], len(rows))]
    costs = [1e-2 + rng.choice([1e-4, 1e-3, 1e-2]) * len(rows) * size + (2e-3 * len(rows) if size > 1 else 0.0)
             for size in SIZES]
    return rows, credit, costs


def test_credit_keeps_every_row_at_ar_pace_unless_it_is_ahead():
    """The batch's most tokens per second can slow one row below AR's pace (the tail a burst of requests waits for,
    SizeChooser's "Credit"). Three rows that accept well and one that accepts badly: 8 nodes wins for the batch, but a
    step of 8 costs 3 AR steps and the bad row gains 1.6 tokens from it, so with no credit the batch runs AR. Once
    the bad row is 1.5 tokens ahead of AR (an earlier step went well for it) it can afford 8 nodes (it would lose 1.4);
    4 nodes (2.2 AR steps for 1.5 tokens) already with 0.75. Negative credit (a step that went badly) is no debt to repay."""
    good, bad = [1.9, 3.5, 5.5, 7.0, 7.5, 7.6], [1.2, 1.5, 1.6, 1.6, 1.6, 1.6]
    costs = [1.0, 1.6, 2.2, 3.0, 4.5, 8.0, 16.0]
    rows = [good, good, good, bad]
    assert SizeChooser(SIZES).choose(rows, costs) == 8  # the batch's tokens per second
    assert SizeChooser(SIZES).choose(rows, costs, credit=[0.0] * 4) == 1
    assert SizeChooser(SIZES).choose(rows, costs, credit=[0.0, 0.0, 0.0, -5.0]) == 1
    assert SizeChooser(SIZES).choose(rows, costs, credit=[0.0, 0.0, 0.0, 0.75]) == 4
    assert SizeChooser(SIZES).choose(rows, costs, credit=[0.0, 0.0, 0.0, 1.5]) == 8
    assert SizeChooser(SIZES).choose_drafted(rows, costs, credit=[0.0, 0.0, 0.0, 0.75]) == 4
    assert SizeChooser(SIZES).choose_drafted(rows, costs, credit=[0.0] * 4) == 8  # none affordable: the best of all
    rng = np.random.default_rng(5)
    seen = set()
    for _ in range(300):
        rows, credit, costs = random_credit_case(rng)
        choice = SizeChooser(SIZES).choose(rows, costs, credit=credit)
        allowed = [size for size in SIZES if affordable_brute(rows, costs, credit, size)]
        assert choice == max(allowed, key=lambda size: rate(rows, costs, size))
        seen.add((choice > 1, choice == SizeChooser(SIZES).choose(rows, costs)))
    assert seen >= {(True, True), (False, False)}  # trees chosen, and trees the batch rule wanted refused


def no_worse_than_the_fallback(rows: list[list[float]], costs: list[float], sunk: float, size: int) -> bool:
    """Every row loses at most what verifying the root alone after the draft costs it (the draft, ``sunk`` AR steps)."""
    steps = costs[SIZES.index(size)] / costs[0]
    return all(row[SIZES[1:].index(size)] - steps >= -sunk for row in rows)


def test_a_drafted_step_no_row_can_afford_verifies_its_root_alone():
    """``choose_drafted`` with ``sunk`` (the AR steps the step's draft cost, where the caller can still verify the root
    alone): where no drafted size is affordable it is AR, unless a size costs no row more than that AR step does
    (the draft is paid either way). The hand case of the credit test: the bad row loses 0.4 AR steps at 2 nodes, 0.7
    at 4, 1.4 at 8. Without ``sunk`` (under CUDA graphs) the step keeps the best of all drafted sizes."""
    good, bad = [1.9, 3.5, 5.5, 7.0, 7.5, 7.6], [1.2, 1.5, 1.6, 1.6, 1.6, 1.6]
    costs = [1.0, 1.6, 2.2, 3.0, 4.5, 8.0, 16.0]
    rows, none = [good, good, good, bad], [0.0] * 4
    chooser = SizeChooser(SIZES)
    assert chooser.choose(rows, costs) == 8 and chooser.backoff == 1  # the batch rule: a win
    assert chooser.choose_drafted(rows, costs, credit=none, sunk=0.3) == 1
    assert chooser._pending is None  # the fallback settles no drafted size's delivery
    # A fallback is a probe AR survived: the next choice (AR, by credit) stretches the back-off to the longest at
    # once (the tree would have cost the bad row 1.4 AR steps), where a win's back-off of 1 would draft again.
    assert chooser.choose(rows, costs, credit=none) == 1 and chooser.backoff == 64
    assert SizeChooser(SIZES).choose_drafted(rows, costs, credit=none, sunk=0.6) == 2  # loses 0.4 < the draft's 0.6
    assert SizeChooser(SIZES).choose_drafted(rows, costs, credit=none, sunk=0.75) == 4  # 2 and 4: 4 is faster
    assert SizeChooser(SIZES).choose_drafted(rows, costs, credit=none) == 8  # no fallback: the best of all
    assert SizeChooser(SIZES).choose_drafted(rows, costs, sunk=0.3) == 8  # no credit: every size affordable
    assert SizeChooser(SIZES).choose_drafted(rows, costs, credit=[0.0, 0.0, 0.0, 0.75], sunk=0.3) == 4  # affordable
    rng = np.random.default_rng(8)
    seen = set()
    for _ in range(300):
        rows, credit, costs = random_credit_case(rng)
        sunk = float(rng.choice([0.1, 0.5, 1.0]))
        choice = SizeChooser(SIZES).choose_drafted(rows, costs, credit=credit, sunk=sunk)
        allowed = [size for size in SIZES[1:] if affordable_brute(rows, costs, credit, size)
                   or no_worse_than_the_fallback(rows, costs, sunk, size)]
        assert choice == (max(allowed, key=lambda size: rate(rows, costs, size)) if allowed else 1)
        seen.add(choice == 1)
    assert seen == {True, False}


def test_one_row_takes_the_same_size_with_any_credit():
    """At batch 1 a size that beats AR's rate keeps the row ahead of AR: credit changes nothing."""
    rng = np.random.default_rng(6)
    for _ in range(300):
        rows = random_rows(rng, 1)
        costs = [1e-2 + rng.choice([1e-4, 1e-3, 1e-2]) * size + rng.choice([0.0, 2e-2]) * (size > 1) for size in SIZES]
        credit = [float(rng.choice([0.0, 3.0, -2.0]))]
        assert SizeChooser(SIZES).choose(rows, costs, credit=credit) == SizeChooser(SIZES).choose(rows, costs)
