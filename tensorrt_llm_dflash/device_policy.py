"""The cost-aware DDTree on the device: which tree to verify, and the next step's tree size, with no host sync.

The eager runtime's policy (:mod:`.policy`) ranks candidate nodes by calibrated acceptance on the host
and picks the tree size that maximises expected tokens per second. Under CUDA graphs the tree size is
the graph, and it must be chosen *before* the launch, without reading the device. So each step:

1. **pool**: the DDTree of the drafter's marginals, ``pool_nodes`` draft nodes (``device_tree``), with
   prompt-lookup branches grafted under the root (``device_lookup``), as the eager policy grafts them;
2. **calibrate**: each drafter node's conditional acceptance ``c = table[depth - 1, bin(marginal)]``,
   each lookup node's ``lookup_table[offset, bin(n-gram length)]`` (a node both propose keeps the
   larger), device tables learned online from what the target chose (below); the path value
   ``v = prod c`` along the path, computed depth by depth so that ``v(child) <= v(parent)`` exactly
   in floating point;
3. **verify set**: the ``n - 1`` best nodes by ``v`` (ties: parent first), where ``n`` is this
   graph's size; values never increase from parent to child, so the set is prefix-closed (a tree);
4. **next size** (:class:`SizeChooser`, on the host): per row, the expected committed tokens of a step of
   every drafted size ``b``, ``1 + the sum of the b - 1 best values``, go into the step's output, which
   the host copies anyway (the one copy per step). The host sums them over the rows that step next
   (a batch runs one tree size: one CUDA graph per batch bucket and size) and divides by the measured
   seconds of a step of that many rows and nodes; a plain AR step (size 1, one token per row) competes
   too, so speculation is chosen only where it beats AR at the same batch, and only at a size that puts no row
   behind plain AR's pace beyond what speculation gained it before ("Credit" in :class:`SizeChooser`; when no more
   requests will come, where the batch's slowest row moves fastest: "Draining"). The choice lags one step
   behind the values it is made from; consecutive steps' acceptance is strongly correlated, and the
   lag costs no sync;
5. **learn**: every verified node is labelled by the target's choice at its parent (was it the token
   the target picked?); the counts per (depth, marginal bin), and per (offset, n-gram bin) for lookup
   nodes, decay by ``decay`` per step.
   The table is ``(hits + s * prior) / (trials + s)`` made non-decreasing in the marginal by a running
   maximum (the eager calibrator uses pool-adjacent-violators, which is sequential).

Every committed token is still the target's own choice at an accepted node: the policy changes
which tree is verified, never what is accepted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import fused_tree
from .device_lookup import DeviceBranches, Grafted
from .device_tree import DeviceTree
from .policy import DRAFT_EDGES, LOOKUP_EDGES, Calibrator

#: Tree sizes (root included) the policy may choose between: one CUDA graph each (per batch bucket); 1 is a plain
#: AR step (no draft), chosen where no tree pays for itself at the batch's own cost.
POLICY_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: The same on a CPU, with 15 for 16: chosen when only the verify's 4..15-row GEMMs ran blocked
#: (``target.BlockedLinear``) and a 16-row verify cost 127 ms against 114 ms for 15 rows on the 2-core EPYC, which
#: steered the policy to 4 and 8 nodes where the eager runtime's picks 15 (BENCHMARKS.md, "Serving"). Since 1..128
#: rows run blocked, 16 rows do too (not timed against 15 since); 15 is kept because the serving figures used it.
CPU_POLICY_BUCKETS = (1, 2, 4, 8, 15, 32, 64)
#: The policy's first tree size, before any step has told it better (the middle drafted size where it is not one).
POLICY_START = 16


def default_policy_buckets(device: torch.device | str) -> tuple[int, ...]:
    """The tree sizes the cost-aware tree chooses between on ``device`` (one CUDA graph set each on a GPU)."""
    return POLICY_BUCKETS if torch.device(device).type == "cuda" else CPU_POLICY_BUCKETS


class DevicePolicy:
    """State and tensor functions of the on-device cost-aware tree (see the module docstring)."""

    def __init__(self, depth_rows: int, buckets: Sequence[int], device: torch.device, *, lookup_rows: int = 0,
                 strength: float = 4.0, decay: float = 0.995) -> None:
        # Drafted sizes only: a size-1 step (plain AR) drafts nothing, so it has no tree to select or learn from.
        self.buckets = tuple(sorted({int(b) for b in buckets if int(b) >= 2}))
        if not self.buckets or min(int(b) for b in buckets) < 1:
            raise ValueError(f"policy buckets {buckets} must be sizes >= 1 (root included), one of them >= 2")
        self.pool_nodes = self.buckets[-1] - 1
        self.rows = max(int(depth_rows), 1)
        edges = torch.tensor(DRAFT_EDGES, dtype=torch.float64, device=device)
        self.edges = edges[1:-1].contiguous()  # inner edges: bucketize gives the bin index directly
        centres = ((edges[:-1] + edges[1:]) / 2).clamp(0.0, 1.0)
        self.prior = centres[None].expand(self.rows, -1).contiguous()
        self.strength, self.decay = strength, decay
        self.hits = torch.zeros(self.rows, len(DRAFT_EDGES) - 1, dtype=torch.float64, device=device)
        self.trials = torch.zeros_like(self.hits)
        self.table = self.prior.clone()
        # Lookup branches: one row per offset along the branch, one bin per n-gram length (1, 2, 3, 4+),
        # a flat prior of 0.5 (the eager lookup calibrator's).
        self.lookup_rows = max(int(lookup_rows), 1)
        self.lookup_edges = torch.tensor(LOOKUP_EDGES[1:-1], dtype=torch.float64, device=device)
        self.lookup_prior = torch.full((self.lookup_rows, len(LOOKUP_EDGES) - 1), 0.5, dtype=torch.float64,
                                       device=device)
        self.lookup_hits = torch.zeros_like(self.lookup_prior)
        self.lookup_trials = torch.zeros_like(self.lookup_prior)
        self.lookup_table = self.lookup_prior.clone()
        #: Seconds of one graphed step per drafted size at batch 1 for the current sampling class (a record for
        #: profiles; the decision is :class:`SizeChooser`'s, on the host, from the decoder's per-batch costs).
        self.costs = torch.ones(len(self.buckets), dtype=torch.float64, device=device)
        self._sizes = torch.tensor(self.buckets, dtype=torch.long, device=device)

    def reset(self) -> None:
        self.hits.zero_()
        self.trials.zero_()
        self.table.copy_(self.prior)
        self.lookup_hits.zero_()
        self.lookup_trials.zero_()
        self.lookup_table.copy_(self.lookup_prior)

    #: What ``learn`` changes: the whole learned state.
    LEARNED = ("hits", "trials", "table", "lookup_hits", "lookup_trials", "lookup_table")

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of the learned tables (device tensors; no host sync)."""
        return {name: getattr(self, name).clone() for name in self.LEARNED}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy learned tables back in place (same addresses: captured graphs keep reading them)."""
        for name in self.LEARNED:
            getattr(self, name).copy_(state[name])

    def seed_counts(self, draft: dict, lookup: dict) -> None:
        """Start from acceptance counts learned before (``policy.Calibrator.state()`` of the eager runtime's saved
        calibration: the same bins) instead of the priors alone. A ValueError, and nothing changed, if they were made
        for other bins or rows (``Calibrator.load_state`` checks them)."""
        parts = ((self.hits, self.trials, self.prior, self.table, DRAFT_EDGES, draft),
                 (self.lookup_hits, self.lookup_trials, self.lookup_prior, self.lookup_table, LOOKUP_EDGES, lookup))
        loaded = []
        for hits, _, _, _, edges, state in parts:
            calibrator = Calibrator(hits.shape[0], edges)
            calibrator.load_state(state)
            loaded.append(calibrator)
        for (hits, trials, prior, table, _, _), calibrator in zip(parts, loaded):
            hits.copy_(torch.as_tensor(calibrator.hits, dtype=torch.float64))
            trials.copy_(torch.as_tensor(calibrator.trials, dtype=torch.float64))
            self._refresh(hits, trials, prior, table)

    def set_costs(self, seconds: Sequence[float]) -> None:
        self.costs.copy_(torch.tensor([float(s) for s in seconds], dtype=torch.float64))

    def _draft_bins(self, tree: DeviceTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, bins, is a drafter node) per node; the marginal is exp(score - parent's score)."""
        parent_score = tree.scores.gather(1, tree.parents.clamp(min=0))
        marginal = torch.exp(tree.scores - parent_score).nan_to_num(0.0)  # exp(-inf - x) = 0 for padding
        rows = (tree.depths - 1).clamp(0, self.rows - 1)
        bins = torch.bucketize(marginal, self.edges, right=True)
        drafted = tree.valid & (tree.parents >= 0) & torch.isfinite(tree.scores)  # lookup-only nodes score -inf
        return rows, bins, drafted

    def draft_conditional(self, tree: DeviceTree) -> torch.Tensor:
        """Conditional acceptance per node of a drafter pool: the root 1, padding 0."""
        rows, bins, drafted = self._draft_bins(tree)
        cond = self.table[rows, bins].clamp(0.0, 1.0)
        return torch.where(tree.parents < 0, torch.ones_like(cond), torch.where(drafted, cond, torch.zeros_like(cond)))

    def _lookup_bins(self, depths: torch.Tensor, ngram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = (depths - 1).clamp(0, self.lookup_rows - 1)
        bins = torch.bucketize(ngram.to(torch.float64), self.lookup_edges, right=True)
        return rows, bins.expand_as(rows)

    def lookup_conditional(self, branches: DeviceBranches) -> torch.Tensor:
        """Conditional acceptance [B, R, T] of every branch token, from its offset and the match's n-gram length."""
        width = branches.tokens.shape[2]
        offsets = torch.arange(1, width + 1, device=branches.tokens.device).expand_as(branches.tokens)
        rows, bins = self._lookup_bins(offsets, branches.ngram[:, None, None])
        return torch.where(branches.tokens >= 0, self.lookup_table[rows, bins].clamp(0.0, 1.0), 0.0)

    def path_values(self, candidates: Grafted, max_depth: int, fused: bool | None = None) -> torch.Tensor:
        """P(path root..i accepted) per node: the product of the conditionals, one depth at a time (every node at
        most ``max_depth`` deep; the candidates are in parent-first order). ``fused``: one pass per row in the
        plugin library (``fused_tree.path_sums``, the same additions) where ``DFLASH_FUSED_TREE`` allows (None),
        required (True), or the rounds of tensor ops (False)."""
        tree = candidates.tree
        log_c = torch.log(torch.where(tree.valid, candidates.cond, 0.0))  # 0 for the root, -inf for padding
        where = fused_tree.backend(log_c.device) if fused is not False else None
        if where is not None or fused:
            return torch.exp(fused_tree.path_sums(log_c, tree.parents, where=where))
        log_v = log_c.clone()
        parents = tree.parents.clamp(min=0)
        for _ in range(max_depth):  # after d rounds every node of depth <= d holds its path sum
            log_v = torch.where(tree.parents < 0, log_c, log_c + log_v.gather(1, parents))
        return torch.exp(log_v)

    def select(self, candidates: Grafted, values: torch.Tensor, size: int, fused: bool | None = None) -> Grafted:
        """The ``size`` best nodes by value (root first, ties parent-first), as a tree in parent-first order.
        ``fused``: three passes per row in the plugin library (``fused_tree.select``, the same tree bit for bit)
        where ``DFLASH_FUSED_TREE`` allows (None), required (True), or the tensor ops below (False)."""
        tree = candidates.tree
        where = fused_tree.backend(tree.tokens.device) if fused is not False else None
        if where is not None or fused:
            return fused_tree.select(candidates, values, size, where=where)
        order = torch.sort(-values, dim=1, stable=True).indices[:, :size]  # root has value 1: always first
        kept = torch.sort(order, dim=1).values  # ascending pool index: parents before children
        new_index = torch.full_like(tree.parents, -1).scatter_(
            1, kept, torch.arange(size, device=kept.device).expand_as(kept))
        old_parents = tree.parents.gather(1, kept)
        parents = torch.where(old_parents < 0, old_parents, new_index.gather(1, old_parents.clamp(min=0)))
        valid = tree.valid.gather(1, kept) & (values.gather(1, kept) > 0)
        tokens = torch.where(valid, tree.tokens.gather(1, kept), torch.full_like(kept, -1))
        parents = torch.where(valid | (parents < 0), parents, torch.zeros_like(parents))
        chosen = DeviceTree(tokens=tokens, parents=parents, depths=torch.where(valid, tree.depths.gather(1, kept), 0),
                            valid=valid, num_nodes=valid.sum(1), scores=tree.scores.gather(1, kept))
        return Grafted(tree=chosen, cond=candidates.cond.gather(1, kept),
                       on_branch=candidates.on_branch.gather(1, kept) & valid)

    def expected_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """Expected committed tokens [B, len(buckets)] of a step of each drafted size: 1 (the bonus) + the sum of the
        size - 1 best path values (a size verifies that many draft nodes, the best by value, as ``select`` keeps)."""
        ranked = torch.sort(values[:, 1:], dim=1, descending=True).values
        expected = 1.0 + torch.cat([torch.zeros_like(ranked[:, :1]), ranked.cumsum(1)], dim=1)  # [B, pool + 1]
        return expected[:, self._sizes - 1]

    def learn(self, verified: Grafted, choices: torch.Tensor, ngram: torch.Tensor | None = None,
              live: torch.Tensor | None = None, fused: bool | None = None) -> None:
        """Label every verified node by the target's choice at its parent; update the tables (drafter nodes
        by depth and marginal, lookup nodes by offset and the step's n-gram length ``ngram`` [B]). ``live`` [B]
        (default: all) marks the rows whose labels count: an idle row's tree is padding, its labels noise.
        ``fused``: the counting and the refresh in one plugin-library call (``fused_tree.learn``, the same tables bit
        for bit) where ``DFLASH_FUSED_TREE`` allows (None), required (True), or the tensor ops below (False)."""
        tree = verified.tree
        where = fused_tree.backend(tree.tokens.device) if fused is not False else None
        if where is not None or fused:
            fused_tree.learn(self, verified, choices, self._draft_bins(tree), ngram, live, where=where)
            return
        accepted = tree.tokens == choices.gather(1, tree.parents.clamp(min=0))
        rows, bins, drafted = self._draft_bins(tree)
        if live is not None:
            drafted = drafted & live[:, None]
        self._update(self.hits, self.trials, self.prior, self.table, rows, bins, accepted & drafted, drafted)
        if ngram is not None:
            looked = verified.on_branch & tree.valid & (tree.parents >= 0)
            if live is not None:
                looked = looked & live[:, None]
            rows, bins = self._lookup_bins(tree.depths, ngram[:, None])
            self._update(self.lookup_hits, self.lookup_trials, self.lookup_prior, self.lookup_table, rows, bins,
                         accepted & looked, looked)

    def _update(self, hits: torch.Tensor, trials: torch.Tensor, prior: torch.Tensor, table: torch.Tensor,
                rows: torch.Tensor, bins: torch.Tensor, accepted: torch.Tensor, offered: torch.Tensor) -> None:
        flat = (rows * hits.shape[1] + bins).reshape(-1)
        hits.mul_(self.decay)
        trials.mul_(self.decay)
        hits.view(-1).scatter_add_(0, flat, accepted.reshape(-1).to(hits.dtype))
        trials.view(-1).scatter_add_(0, flat, offered.reshape(-1).to(trials.dtype))
        self._refresh(hits, trials, prior, table)

    def _refresh(self, hits: torch.Tensor, trials: torch.Tensor, prior: torch.Tensor, table: torch.Tensor) -> None:
        raw = (hits + self.strength * prior) / (trials + self.strength)
        table.copy_(torch.cummax(raw, dim=1).values)  # a better score (marginal, longer match) never rates lower


#: Pseudo-tokens of the prior that a size delivers all the extra tokens it predicts (before its steps say otherwise).
DELIVERY_PRIOR = 4.0


@dataclass
class SizeChooser:
    """The next step's tree size for the rows that step together (the host side of the cost-aware tree).

    ``choose`` takes each row's expected committed tokens at every drafted size (from the last drafted step's
    copy; None for a row not drafted for yet, which counts as the mean of the others, or, in a batch of new rows,
    as the mean of the last rows that had one: ``start`` only before any estimate at all) and the measured seconds
    of a step of this batch bucket at every size in ``sizes``, and returns the size with the most expected
    tokens per second for the batch: ``sum over rows of E_r(n) / cost(n)``, ties to the smaller size. A plain
    AR step (size 1, in ``sizes`` when the decoder may fall back to it) commits exactly one token per row.

    **Delivery.** The estimates are a step old and come from calibrated path values whose product assumes
    independent acceptances along a path; choosing the size whose estimate happens to be high also selects
    optimistic estimates. So :meth:`observe` compares what each drafted step committed with what was expected of
    it, per size: the extra tokens (beyond one per row) it delivered over the extra it promised, exponentially
    forgotten (``decay`` per step), with a prior of full delivery. ``choose`` scales each size's promised extra
    by that share (a size not run yet takes the share of the largest smaller size that has run), so a size that
    over-promises stops being chosen where its real rate is below AR's.

    **Draining.** Given ``remaining`` (each row's tokens still to come), the batch is draining: no more requests
    will come, so a row that finishes early frees nothing, and the batch is done when its slowest row is (only a
    caller that knows its queue is empty says so: ``GraphedDecoder.generate_many``, never a server). Then the
    size is the one at which the row that would finish last progresses fastest, ``min over rows of
    min(E_r(n), R_r) / R_r / cost(n)``, rather than the most tokens for the batch: a tree that pays for the rows
    that accept well but slows the one that accepts badly lengthens the whole batch. (At batch 16 on the 2-core
    EPYC a 4-node step costs 2.3 AR steps; its best rows commit 3-4 tokens and its worst 1.5, so the most
    tokens per second still left every burst of 16 requests 5-20% behind AR.) For one row the two rules differ only
    where a size's estimate passes the row's remaining tokens (its last step or two).

    **Credit.** The most tokens per second for the batch can still slow one row: at batch 16 on the 2-core EPYC a
    4-node step costs ~2.4 AR steps, the rows that accept well commit 3-4 tokens in it and one that accepts badly
    1.5, so that row falls behind where plain AR would have brought it. In a server that row's client waits longer
    than without speculation, and in a burst of requests (16 clients, one request each) it is the tail the whole
    burst waits for: the rows that accept well finish early and the batch ends with a few slow rows in a small
    bucket (0.87x AR at 16 clients, ``docs/serving.md``). Given ``credit`` (each row's tokens ahead of AR so far,
    kept by the decoder: a step of ``k`` AR steps' cost that commits ``c`` tokens adds ``c - k``), ``choose`` keeps
    to the sizes :meth:`affordable` for every row: none may fall behind AR's pace beyond what it is ahead, in
    expectation. At batch 1 this is the same choice (a size that beats AR's rate is affordable). A step that has
    drafted already and can still verify its root alone (the in-step choice, eagerly) does so where no drafted size
    is affordable (:meth:`choose_drafted`'s ``sunk``).

    An AR step drafts nothing, so the estimates it decides from go stale. After ``backoff`` AR steps in a row it
    drafts once (a probe, at the best drafted size) to refresh them, and a step where speculation wins resets
    ``backoff`` to 1. Each probe that AR survives doubles ``backoff``, and more when the probe's own estimates
    say the next one would lose much: a probe at size ``p`` whose rate falls short of AR's by a share ``d``
    costs ``d * cost(p) / cost(1)`` AR steps (with ``credit``, or what it puts the row it slows most behind AR's
    pace beyond that row's credit, if more), so the gap grows to at least that over ``probe_share``.

    **How long a gap may grow** depends on how often probes find speculation paying again, which depends on the
    batch: at batch 16 on the 2-core EPYC a tree costs 2.3 AR steps and probes almost never win, so a probe every
    ``max_backoff`` AR steps is right (each lost ~0.7 AR steps; doubling from 1 spent 6-7 of them on every
    128-token request, 3-5% of AR's pace); at batch 1 a step drafts for ~0.4 AR steps and a response turns
    predictable again within a few steps (prose into code, a list, a repeat), so a gap of 64 (reached after one
    bad probe) left half of a 128-token chat answer on AR while trees would have paid: 43-48 tok/s at one client
    against 53 with gaps of at most 8 and a probe per new request (2026-11-28). So each batch size class (rows
    rounded up to a power of two, the batch buckets) keeps its own record of the probes judged and of those that
    won (forgotten by ``probe_decay`` per probe), and the gap stays below :meth:`gap_cap`: ``probe_gap`` over the
    share of probes that won,
    ``wins / (probes + 1)``, and ``max_backoff`` until one has won: the gap shortens only on evidence that probes
    win at this batch size, so where they never do (16 rows on that CPU) the probes are as rare as before.

    **New rows.** A gap was judged on the rows that stepped then. Where no row stepping now has an estimate of its
    own (new requests, never drafted for), the chooser probes at once and the gap restarts from that probe's own
    loss: at batch 1 every new request gets its own look (before, a request that followed a chat answer decoded its
    first 64 tokens on AR whatever it was). In a larger batch only where its class has no probe record or its probes
    have won (:meth:`probe_new_rows`): at 16 rows on the 2-core EPYC, where none ever did, it was one of the three
    probes of each 16-request burst (in-process: 12 probes in 4 bursts, AR survived all; after, 2 a burst).
    """

    sizes: tuple[int, ...]
    start: int = POLICY_START
    max_backoff: int = 64
    #: The share of the AR steps between probes that a losing probe may cost (it sets the gap after it).
    probe_share: float = 0.01
    #: The gap's floor for the probe record (:meth:`gap_cap`), and how fast that record forgets, per probe.
    probe_gap: int = 4
    probe_decay: float = 0.95
    decay: float = 0.98
    #: AR steps to run before the next probe, and AR steps run since the last drafted step.
    backoff: int = 1
    ar_run: int = 0
    #: The sizes that draft (>= 2), ascending.
    drafted: tuple[int, ...] = field(init=False, default=())
    #: Per drafted size that has run: forgotten sums of the extra tokens its steps promised and delivered.
    promised: dict[int, float] = field(init=False, default_factory=dict)
    delivered: dict[int, float] = field(init=False, default_factory=dict)
    #: (size, promised extra tokens) of the last choice, until :meth:`observe` settles it.
    _pending: tuple[int, float] | None = field(init=False, default=None)
    #: The mean estimate of the rows at the last choice that had one: what a batch of new rows counts as.
    typical: list[float] | None = field(init=False, default=None)
    #: Per batch size class (rows rounded up to a power of two): forgotten counts of the probes judged and of those
    #: that found speculation paying (:meth:`gap_cap`).
    probes: dict[int, float] = field(init=False, default_factory=dict)
    wins: dict[int, float] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.sizes = tuple(sorted(int(s) for s in self.sizes))
        self.drafted = tuple(s for s in self.sizes if s >= 2)
        if not self.drafted:
            raise ValueError(f"sizes {self.sizes} hold no drafted size (>= 2)")
        if self.start not in self.drafted:
            self.start = self.drafted[len(self.drafted) // 2]

    def rows(self, expected: Sequence[Sequence[float] | None]) -> list[list[float]] | None:
        """Each row's expected committed tokens at every drafted size, a row not drafted for yet counting as the
        typical row (None: no row, now or before, has an estimate)."""
        known = [list(e) for e in expected if e is not None]
        if known:
            self.typical = [sum(column) / len(known) for column in zip(*known)]
        if self.typical is None:
            return None
        return [list(e) if e is not None else self.typical for e in expected]

    def totals(self, expected: Sequence[Sequence[float] | None]) -> dict[int, float] | None:
        """Expected committed tokens of the batch per size, as estimated (None: no row, now or before, has one)."""
        rows = self.rows(expected)
        return None if rows is None else self._totals(rows)

    def _totals(self, rows: list[list[float]]) -> dict[int, float]:
        totals = {size: sum(row[j] for row in rows) for j, size in enumerate(self.drafted)}
        if 1 in self.sizes:
            totals[1] = float(len(rows))
        return totals

    def share(self, size: int) -> float:
        """The share of its promised extra tokens that ``size`` delivers (see the class docstring)."""
        run = [s for s in self.drafted if s <= size and s in self.promised]
        if size < 2 or not run:
            return 1.0
        last = run[-1]
        return (self.delivered[last] + DELIVERY_PRIOR) / (self.promised[last] + DELIVERY_PRIOR)

    def row_tokens(self, row: Sequence[float], size: int) -> float:
        """A row's expected committed tokens at ``size``: one for AR, else one plus its promised extra scaled by the
        size's delivery share (``row``: its estimates at every drafted size)."""
        if size < 2:
            return 1.0
        return 1.0 + self.share(size) * (row[self.drafted.index(size)] - 1.0)

    def _seconds(self, costs: Sequence[float]) -> dict[int, float]:
        return dict(zip(self.sizes, (float(c) for c in costs)))

    def choose(self, expected: Sequence[Sequence[float] | None], costs: Sequence[float],
               remaining: Sequence[int] | None = None, credit: Sequence[float] | None = None) -> int:
        """The next size; ``costs`` holds seconds per size of ``sizes`` (ascending) at this batch bucket;
        ``remaining`` (each row's tokens still to come) when the batch is draining; ``credit`` (each row's tokens
        ahead of plain AR) to keep every row at least at AR's pace (see the class docstring)."""
        rows = self.rows(expected)
        self._pending = None
        if rows is None:
            return self.start
        rate = self._rates(rows, costs, remaining)
        allowed = self.affordable(rows, costs, credit)
        best = max((s for s in self.sizes if s in allowed), key=rate.get)  # the first maximum: the smaller size
        n = 1 << (len(rows) - 1).bit_length()  # the batch size class the probe record is kept for
        judged = self.ar_run == 0 and self.backoff > 1  # the last step was a probe, or a drafted step fell back
        if best == 1:
            if judged:  # AR survived it: wait longer the more the next one would lose, by the probe's fresh estimates
                self._judge_probe(n, won=False)
                loss = self.probe_loss(rate, costs, rows, credit)
                self.backoff = min(max(self.backoff, math.ceil(loss / self.probe_share)), self.gap_cap(n))
            if all(e is None for e in expected) and self.probe_new_rows(n):
                self.ar_run = self.backoff = 1  # only new rows: the gap was judged on other requests
            if self.ar_run < self.backoff:
                self.ar_run += 1
                return 1
            self.ar_run, self.backoff = 0, min(2 * self.backoff, self.gap_cap(n))
            best = max(self.drafted, key=rate.get)  # a probe
        else:
            if judged:
                self._judge_probe(n, won=True)
            self.ar_run, self.backoff = 0, 1
        self._pending = (best, self._totals(rows)[best] - len(rows))
        return best

    def gap_cap(self, size_class: int) -> int:
        """The most AR steps between probes for the batch size class ``size_class`` (rows rounded up to a power of
        two): ``probe_gap`` over the share of its probes that won lately, ``wins / (probes + 1)``, at most
        ``max_backoff`` (all of it until a probe has won)."""
        share = self.wins.get(size_class, 0.0) / (self.probes.get(size_class, 0.0) + 1.0)
        if share <= 0.0:
            return self.max_backoff
        return min(math.ceil(self.probe_gap / share - 1e-9), self.max_backoff)  # share < 1: at least probe_gap

    def probe_new_rows(self, size_class: int) -> bool:
        """Whether a batch of nothing but new rows of ``size_class`` is probed at once: always for one row (the
        request is the whole batch, and its look costs a draft, ~0.2 AR steps on a CPU), else where this class has
        no probe record yet or its probes have won lately; where they all lost (16 rows on the 2-core EPYC), the
        batch's cost decides, not its rows, and new rows wait for the gap like any other."""
        return size_class == 1 or not self.probes.get(size_class) or self.wins.get(size_class, 0.0) > 0.0

    def _judge_probe(self, size_class: int, won: bool) -> None:
        self.probes[size_class] = self.probe_decay * self.probes.get(size_class, 0.0) + 1.0
        self.wins[size_class] = self.probe_decay * self.wins.get(size_class, 0.0) + float(won)

    def affordable(self, rows: list[list[float]], costs: Sequence[float],
                   credit: Sequence[float] | None) -> set[int]:
        """The sizes that slow no row below plain AR's pace beyond what it is ahead (``credit``: each row's tokens
        ahead of AR): a size ``n`` whose step costs ``k = cost(n) / cost(1)`` AR steps is affordable when every row's
        expected tokens ``t_r(n)`` (delivery share applied) satisfy ``t_r(n) - k >= -max(credit_r, 0)``. Every size
        without ``credit`` or without an AR size to compare with; AR (``k = 1``, one token) always."""
        if credit is None or 1 not in self.sizes:
            return set(self.sizes)
        return {1, *(size for size in self.drafted
                     if self._no_row_behind(rows, costs, size, [max(float(c), 0.0) for c in credit]))}

    def _no_row_behind(self, rows: list[list[float]], costs: Sequence[float], size: int,
                       allowance: Sequence[float]) -> bool:
        """Whether a step of ``size`` (``k = cost(size) / cost(1)`` AR steps) puts no row further behind AR's pace than
        its ``allowance`` (in tokens): ``t_r(size) - k >= -allowance_r`` for every row."""
        seconds = self._seconds(costs)
        steps = seconds[size] / seconds[1]
        return all(self.row_tokens(row, size) - steps >= -a for row, a in zip(rows, allowance))

    def probe_loss(self, rate: dict[int, float], costs: Sequence[float], rows: list[list[float]] | None = None,
                   credit: Sequence[float] | None = None) -> float:
        """What a probe at the best drafted size would cost, in AR steps: its time in AR steps times its shortfall
        from AR's rate (``rate``: each size's worth per second, as :meth:`_rates` gives it), or with ``rows`` and
        ``credit`` what it would put the row it slows most behind AR's pace, beyond that row's credit, if more."""
        probe = max(self.drafted, key=rate.get)
        seconds = self._seconds(costs)
        steps = seconds[probe] / seconds[1]
        loss = max(0.0, 1.0 - rate[probe] / rate[1]) * steps
        if rows is not None and credit is not None:
            behind = max(steps - self.row_tokens(row, probe) - max(float(c), 0.0) for row, c in zip(rows, credit))
            loss = max(loss, behind)
        return loss

    def _rates(self, rows: list[list[float]], costs: Sequence[float],
               remaining: Sequence[int] | None = None) -> dict[int, float]:
        """Each size's worth per second: the batch's expected tokens, or when draining (``remaining``) the pace of
        the row that would finish last; a size's promised extra tokens scaled by its delivery share."""
        seconds = self._seconds(costs)
        if remaining is None:
            n = len(rows)
            return {size: (n + self.share(size) * (total - n)) / seconds[size]
                    for size, total in self._totals(rows).items()}
        left = [max(int(r), 1) for r in remaining]
        rates = {}
        for size in self.sizes:
            tokens = [self.row_tokens(row, size) for row in rows]
            rates[size] = min(min(t, r) / r for t, r in zip(tokens, left)) / seconds[size]
        return rates

    def choose_drafted(self, expected: Sequence[Sequence[float]], costs: Sequence[float],
                       remaining: Sequence[int] | None = None, credit: Sequence[float] | None = None,
                       sunk: float | None = None) -> int:
        """The size for a step that has drafted already, from that step's own estimates (``expected``: each
        stepping row's expected committed tokens at every drafted size): the best drafted size as :meth:`choose`
        weighs them (delivery share, draining and ``credit`` included).

        Where no drafted size is affordable: without ``sunk``, the best of all drafted sizes (the caller cannot
        step otherwise); with ``sunk`` (the AR steps this step has spent drafting, when the caller can still verify
        the root alone) plain AR, unless a drafted size puts no row further behind AR's pace than that AR step
        does (``t_r(n) - k(n) >= -sunk`` for every row: the draft is paid either way). At batch 16 on the 2-core
        EPYC a probe's 8-node tree cost 3.5 AR steps and the rows that accept badly gained 1.5 tokens from it; the
        fallback costs them the draft alone (~0.6 AR steps)."""
        rows = [[float(v) for v in row] for row in expected]
        rate = self._rates(rows, costs, remaining)
        affordable = self.affordable(rows, costs, credit)
        allowed = [s for s in self.drafted if s in affordable]
        if sunk is not None and credit is not None and 1 in self.sizes:
            allowed += [s for s in self.drafted
                        if s not in affordable and self._no_row_behind(rows, costs, s, [float(sunk)] * len(rows))]
            if not allowed:
                # What a probe that AR survived tells: the next choice prices the gap by what a tree would lose (a
                # win had reset the back-off to 1, and each burst of new rows paid a second fallback at once).
                self._pending, self.ar_run, self.backoff = None, 0, max(self.backoff, 2)
                return 1
        best = max(sorted(allowed) or self.drafted, key=rate.get)  # first maximum: the smaller size
        self._pending = (best, self._totals(rows)[best] - len(rows))
        return best

    def observe(self, committed: int, rows: int) -> None:
        """What the step of the last choice committed, over ``rows`` rows: it settles that size's delivery."""
        if self._pending is None:
            return
        size, promised = self._pending
        self._pending = None
        self.promised[size] = self.decay * self.promised.get(size, 0.0) + max(promised, 0.0)
        self.delivered[size] = self.decay * self.delivered.get(size, 0.0) + max(committed - rows, 0)
