"""The graph-ready decode path: every step a fixed-shape function of static buffers, CUDA graphs on CUDA.

**Rows.** The static state holds ``batch`` rows, one request each, with its own prompt length, tree,
acceptance count, stop condition and sampling settings (temperature, top-p, top-k as per-row
tensors; row r's draws keyed by row r's own seed and each token's index, ``sampling.keyed_draw``, so its
randomness comes from its seed alone, whatever the tree sizes and the other rows).
:meth:`GraphedDecoder.admit` prefills a prompt into a free row while the other rows are mid-generation (a one-row
forward that touches nothing else; on CUDA at the prompt's padded length in a staging row, one graph per
power-of-two length, ``static_state.PaddedPrefill``, then copied into the row: an eager prefill there is ~25-45 ms
of launches, paid by every row waiting for it); :meth:`GraphedDecoder.step` runs one
step of the admitted rows together; :meth:`GraphedDecoder.release` frees a row at the step boundary,
and the next request takes it (continuous batching). A step covers the first ``b`` rows, ``b`` the
smallest batch bucket (1, 2, 4, 8, ..., as nano-vllm and vLLM bucket) that holds every row stepping;
rows inside it that are free, or admitted but not stepping, are inert padding: their depth limit is
-1, so they commit nothing, teach the policy nothing, and write only slots past their own committed
length. Attention reads the first ``window`` slots, the smallest power-of-two multiple of
``CAPACITY_STEP`` that holds every row's next writes: a step costs what its longest row needs, not
what the capacity holds. The capacity grows (copying every row's state) when a row needs more.

**One step**, for a tree of ``n`` nodes (``n`` fixed per graph: the chain's block, a DDTree budget + 1,
a size the cost-aware policy chose for the batch, or 1 for plain AR), in four stages, each captured as
its own CUDA graph per (batch bucket, tree size, window, sampling class) (on CPU the same functions run
eagerly: one implementation):

    draft       the drafter's block after each row's root              -> logits [b, D, Vd]
    tree_build  chain (top-1 per depth) or DDTree (best-first, on the device, device_tree.py); the
                cost-aware tree also grafts prompt-lookup branches found in a static token
                history (device_lookup.py)                              -> tokens, depths, parents, visibility
    verify      the target over every row's tree, ancestor-only mask    -> the target's choice at every node
    commit      walk from the root (on the device), KV compaction, drafter context, next root

Nothing inside a step reads a device value on the host. The host learns what a step committed for
every row from **one** device-to-host copy of ``[count, tokens..., lookup count, expected tokens per
size]`` per row, which it needs anyway for streaming and stop tokens; what the next step needs (each
row's depth limit, the tree size) it writes to the device before the launch. One
exception: with ``size_choice="in_step"`` (the CPU's default; CUDA's is ``ahead``) the cost-aware
tree's size is chosen inside the step from that step's own candidates, one more read per step
(see :data:`SIZE_CHOICES`); that choice may be the root alone, where no drafted size is affordable for
every row (``SizeChooser.choose_drafted``). Also on a CPU, an AR step's drafter context waits for the
next draft (:data:`CPU_DEFERRED_CONTEXT`). The
sampling class (greedy / sampled / sampled with top-k or top-p) picks which graph runs, never the
values: those are tensors the graph reads.

The committed tokens are the target's own choices at accepted nodes, exactly as in
:mod:`tensorrt_llm_dflash.decode`: greedy output equals the target's greedy output, sampled output
follows its distribution (``sampling.keyed_draw``, each node with the uniforms of the index its choice takes,
computed in the graph from the row's seed key and ``past``: the same draws as the eager runtime and AR).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .decode import STAGES, GenerationResult, GenerationStats, OutputStream, _single_prompt
from .device_lookup import Grafted, graft_device, lookup_device
from .device_policy import POLICY_START, DevicePolicy, SizeChooser, default_policy_buckets
from .device_tree import (
    DeviceTree,
    build_chain_device,
    build_ddtree_device,
    pad_tree,
    visibility_device,
    walk_device,
)
from .drafter import DFlashDraftModel
from .errors import DFlashInputError
from .policy import PolicyConfig, models_calibration_path
from .sampling import SamplingParams, TokenDraws, keyed_draw, make_draws
from .static_state import PaddedPrefill, StaticDrafter, StaticTarget, prefill_length
from .target import check_prompt_fits, max_positions
from .tree import validate_budget

__all__ = ["CAPACITY_STEP", "POLICY_START", "SIZE_CHOICES", "STEP_STAGES", "GraphedDecoder", "RowResult", "batch_buckets",
           "row_probs", "sampling_kind", "tree_size"]

#: A step's stages; ``tree_compile`` (selecting the chosen size from the candidates) only with the in-step choice.
STEP_STAGES = ("draft", "tree_build", "tree_compile", "verify", "commit")
#: Capacity granularity: a longer request re-allocates (and re-captures) in steps of this many slots; attention
#: windows are this times a power of two.
CAPACITY_STEP = 256
#: On a CPU (no graph to capture per window) the attention window grows by this many slots, not by doubling: every
#: row reads its K/V over the whole window, and a 16-row AR step of the embedded SmolLM2 cost 107 ms at 256 slots,
#: 118-135 at 512 and 145-170 at 1024 (2-core EPYC, fp32, 2 threads).
CPU_WINDOW_STEP = 64
#: On a CPU the drafter's context for an AR step's token (one slot per row: the context projection and every drafter
#: layer's K/V) waits in a buffer of up to this many AR steps, extended in one call when a step drafts again (or
#: the buffer is full). A batch where no tree pays (16 rows on the 2-core EPYC) then pays for it in one call per
#: 64 steps (7-23 ms for 16 rows in two in-process measurements, 0.1-0.2 ms a step) instead of on every step
#: (2.2 ms of ~120 against plain AR's).
CPU_DEFERRED_CONTEXT = 64
#: On a CPU a prompt's drafter context (its features from the prefill) waits for the row's first draft when it holds
#: at most this many bytes: a row that never drafts (16 rows on the 2-core EPYC decode AR) never pays for it, ~3%
#: of an admission (the serving benchmark's prompts, 41-163 tokens); a longer prompt is extended at admission, as
#: under graphs.
CPU_DEFERRED_PROMPT_BYTES = 64 << 20
#: Sampling classes, cheapest first: one graph each where a batch needs it (the values are tensors, not graphs).
SAMPLING_KINDS = ("greedy", "sampled", "filtered")
#: Seconds of timed steps after which a cost measurement stops repeating (one warm-up step, then at least one).
TIMING_SECONDS = 1.0
#: Weight of each observed step time in the running estimate of its shape's cost.
COST_EMA = 0.2
#: Fixed-point scale of the expected-token estimates in the step's integer output.
EXPECTED_SCALE = 1 << 20
#: When the cost-aware tree's size is chosen. ``ahead``: on the host before the step, from the estimates the
#: previous step copied back (a step old), so nothing inside a step reads the device: what CUDA graphs need.
#: ``in_step``: whether to draft is decided ahead, the size after ``tree_build`` has built this step's candidates,
#: from their own estimates (one host read of ``[rows, sizes]`` values), as the eager runtime's policy decides;
#: ``tree_compile`` then selects that many nodes (under CUDA graphs: the candidate stages of one size's graphs, the
#: read, the rest of the chosen size's graphs). On a CPU that read costs nothing and the step's own estimates choose
#: better: 10 HumanEval prompts, fp32, 2 threads, tau 3.60 -> 4.18, 31.6 -> 36.5 tok/s (the eager runtime: tau
#: 4.05). On a GPU the read stalls the host once per step; not measured there yet, so CUDA defaults to ``ahead``.
SIZE_CHOICES = ("ahead", "in_step")


def tree_size(proposer: Any | None, budget: int | None) -> int:
    """Nodes (root included) of the first graph a run needs: 1 for AR, the block for the chain, budget + 1,
    and for the cost-aware policy (budget None) the size it starts from."""
    if proposer is None:
        return 1
    if budget is None:
        return POLICY_START
    return proposer.block_size if budget == 0 else budget + 1


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a step may run (one CUDA graph set each): powers of two below ``max_batch``, then it."""
    if max_batch < 1:
        raise DFlashInputError(f"batch={max_batch} must be >= 1")
    buckets = []
    size = 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return (*buckets, max_batch)


def sampling_kind(settings: Iterable[SamplingParams]) -> str:
    """The cheapest sampling class that serves every setting: greedy (argmax only), sampled (a softmax per node),
    filtered (top-k or top-p: vocabulary sorts per node)."""
    kind = 0
    for params in settings:
        if not params.greedy:
            kind = max(kind, 2 if params.top_k > 0 or params.top_p < 1.0 else 1)
    return SAMPLING_KINDS[kind]


def row_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              filtered: bool) -> torch.Tensor:
    """``sampling.processed_probs`` with per-row settings: logits [b, N, V]; temperature, top_p float64 [b],
    top_k int64 [b] (0: off). Rows at temperature 0 are computed at 1 (their caller takes the argmax instead).
    The same operations as ``processed_probs`` row by row: a fixed k per row is the k-th largest score of a
    full sort; a row whose top_p is 1 drops nothing (``processed_probs`` skips it; rounding must not cut a
    tail whose mass before it reads 1.0)."""
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    t = torch.where(temperature > 0, temperature, 1.0).to(work)
    scores = logits.to(work) / t[:, None, None]
    if filtered:
        vocab, nodes = scores.shape[-1], scores.shape[1]
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        ranked = torch.sort(scores, dim=-1, descending=True).values
        kth = ranked.gather(-1, (k - 1)[:, None, None].expand(-1, nodes, 1))
        scores = scores.masked_fill(scores < kth, float("-inf"))
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(-1)
        cut = top_p.to(work)[:, None, None]
        drop_sorted = ((sorted_probs.cumsum(-1) - sorted_probs) >= cut) & (top_p < 1.0)[:, None, None]
        drop_sorted[..., 0] = False  # the most probable token stays, even where top_p underflows float32 to 0
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


@dataclass
class RowState:
    """The host's view of an admitted row (what it needs to plan the next step without reading the device)."""

    #: Committed tokens in the KV cache (the last committed token, the root, is not in it yet).
    past: int
    #: Tokens committed so far, the prefill's included; the row never drafts past ``max_new_tokens``.
    produced: int
    max_new_tokens: int
    sampling: SamplingParams
    draws: TokenDraws | None
    #: Expected committed tokens at each drafted policy size, from the row's last drafted step (None: none yet).
    expected: list[float] | None = None
    #: Tokens the row is ahead of plain AR steps of the same batches (``SizeChooser``'s "Credit"): each step of
    #: ``k`` AR steps' measured cost that commits ``c`` tokens adds ``c - k`` (an AR step adds nothing).
    credit: float = 0.0

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.produced


@dataclass
class RowResult:
    """What one step committed for one row."""

    tokens: list[int]
    #: Tree nodes verified for the row, root included (1 = a plain AR step).
    tree_size: int
    #: Committed tokens that only a prompt-lookup branch proposed.
    lookup_tokens: int = 0


@dataclass
class _Graphs:
    """The captured stage graphs of one step shape."""

    graphs: dict[str, Any] = field(default_factory=dict)


class GraphedDecoder:
    """Speculative (or AR) decoding of up to ``batch`` rows with static state; on CUDA each stage replays a graph.

    ``budget`` 0 is the DFlash chain, B >= 1 a DDTree of B nodes, None the cost-aware tree (:mod:`.device_policy`:
    one graph per size in ``policy_buckets`` and batch bucket, 1 meaning a plain AR step; each bucket's step
    costs measured when first needed unless ``policy_costs`` gives them, either one list per size for every
    bucket or a function ``(bucket, size) -> seconds``; with ``lookup``, prompt-lookup branches as the eager
    default grafts them, :class:`~.policy.PolicyConfig`'s lengths); without a drafter every step is one token
    (the graphed AR baseline); measured costs are refined from the steps that run unless ``refine_costs`` is False.
    ``drafter`` is a :class:`DFlashDraftModel` (run by :class:`StaticDrafter`), or any
    object whose ``static_proposer(model, capacity, batch)`` returns one of the same interface (``block_size``,
    ``draft_ids``, ``target_layer_ids``, ``extend(features, start, row=None)``, ``draft(root, context_len,
    window)``, optionally ``copy_from(old)`` and ``move_row(src, dst)``). ``use_graphs`` defaults to True on
    CUDA and is always False on the CPU, where the same stage functions run eagerly.

    What the policy learned survives a re-capture and a larger capacity; the throwaway steps of warm-up and
    timing never teach it. Step costs are timed per sampling class and batch bucket. With ``seed_calibration``
    the policy starts from the acceptance calibration the eager runtime saved for this target and drafter, if any
    (``policy_buckets`` default: :func:`~.device_policy.default_policy_buckets` of the target's device).
    """

    def __init__(self, target_model: Any, drafter: Any | None = None, *, budget: int | None = 0,
                 use_graphs: bool | None = None, batch: int = 1, capacity: int = CAPACITY_STEP,
                 policy_buckets: Sequence[int] | None = None,
                 policy_costs: Sequence[float] | Callable[[int, int], float] | None = None,
                 lookup: bool = True, refine_costs: bool = True, seed_calibration: bool = True,
                 size_choice: str | None = None) -> None:
        self.model = target_model
        self.lookup_config = PolicyConfig(lookup=bool(lookup))
        self.drafter_model = drafter
        self.budget = None if budget is None else validate_budget(budget)
        self.device = target_model.device
        if policy_buckets is None:
            policy_buckets = default_policy_buckets(self.device)
        self.policy_buckets = tuple(sorted({int(b) for b in policy_buckets}))
        self.policy_costs = policy_costs if callable(policy_costs) or policy_costs is None else \
            [float(c) for c in policy_costs]
        #: Refine measured step costs from the steps that run (off: decisions depend only on the start-up timing,
        #: so that two decoders given the same requests choose the same sizes).
        self.refine_costs = bool(refine_costs)
        self.batch = int(batch)
        self.batch_buckets = batch_buckets(self.batch)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise DFlashInputError(f"use_graphs=True needs a CUDA device, the target is on {self.device}")
        #: When the cost-aware tree's size is chosen (see :data:`SIZE_CHOICES`).
        self.size_choice = (("ahead" if self.device.type == "cuda" else "in_step") if size_choice is None
                            else str(size_choice))
        if self.size_choice not in SIZE_CHOICES:
            raise DFlashInputError(f"size_choice must be one of {sorted(SIZE_CHOICES)}, got {size_choice!r}")
        #: In-step choice: the rows stepping, their costs and (draining) remaining tokens while a step runs (None
        #: outside a step).
        self._in_step: tuple[list[int], list[float], list[int] | None, list[float]] | None = None
        #: In-step choice, eagerly: a step whose own estimates found no drafted size affordable verifies its root
        #: alone (plain AR, the draft paid); the AR steps its draft cost, until ``step`` books it (None otherwise).
        #: Not under CUDA graphs, where the size-1 graphs have no ``tree_compile`` to replay after the candidates.
        self._fell_back: float | None = None
        #: In-step choice under CUDA graphs: the candidates go through these static buffers, which every size's
        #: ``tree_compile`` graph reads (each capture's own outputs live in its graph's memory). Tests set it on a CPU.
        self.stash_candidates = self.use_graphs
        #: Each step attends over the window its own rows and size need (``CPU_WINDOW_STEP``); off under graphs,
        #: whose windows are the few shapes captured before any request.
        self.exact_windows = not self.use_graphs
        #: AR steps' drafter context waits for the next draft (``CPU_DEFERRED_CONTEXT``); off under graphs, whose
        #: commit extends it in the step (no host decision in a replay).
        self.defer_context = drafter is not None and not self.use_graphs
        self._deferred: torch.Tensor | None = None  # [batch, CPU_DEFERRED_CONTEXT, F]: each AR step's features
        self._deferred_count = torch.zeros(self.batch, dtype=torch.long, device=self.device)  # per row, waiting
        self._deferred_steps = 0  # AR steps since the last extension: at least every row's count
        self._deferred_prompts: dict[int, torch.Tensor] = {}  # row -> its prompt's features [1, P, F], not extended
        self._stash: dict[str, torch.Tensor] = {}
        #: Prompts are prefilled at a padded length from static buffers (``PaddedPrefill``): one CUDA graph per
        #: length serves every prompt and row. On by default on CUDA (graphed or not, so that the eager twin of a
        #: graphed decoder runs the same arithmetic); a CPU, compute-bound, prefills the prompt as it is.
        self.padded_prefill = self.device.type == "cuda"
        self._prefill: PaddedPrefill | None = None
        self._prefill_graphs: dict[int, tuple[Any, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._prefill_pool: Any = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.requests: dict[int, RowState] = {}
        #: The final ``past`` of the last ``generate`` (its row is released, so the device's is 0 again).
        self.last_past = 0
        self._graphs: dict[tuple, _Graphs] = {}
        self._pool: Any = None
        self._costs: dict[tuple[str, int], list[float]] = {}
        self._events: list[Any] = []
        self._pending_timing: tuple[list[str], dict[str, float]] | None = None
        self._build(capacity)
        self.seeded_from: str | None = None
        if seed_calibration:
            self._seed_calibration()

    def _seed_calibration(self) -> None:
        """Start the cost-aware tree from the acceptance calibration the eager runtime keeps for this target and
        drafter (``policy.calibration_path``; the same bins), when there is one. From the priors alone, lookup nodes
        sit at a flat 0.5 per node, rarely win a place in the tree and so are rarely learned: on copy-heavy prompts
        the graphed tree's tau was half the eager one's (BENCHMARKS.md, "Serving"). A file made for another drafter
        shape, or damaged, is ignored (the priors, as with no file)."""
        if self.policy is None or not isinstance(self.drafter_model, DFlashDraftModel):
            return
        try:
            path = models_calibration_path(self.model, self.drafter_model)
            state = json.loads(path.read_text())
            if (state.get("block_size") != self.proposer.block_size
                    or state.get("lookup_tokens") != self.lookup_config.lookup_tokens):
                return
            greedy = next(parts for key, parts in state["temperatures"].items() if float(key) == 0.0)
            self.policy.seed_counts(greedy["draft"], greedy["lookup"])
        except (OSError, ValueError, KeyError, TypeError, StopIteration):
            return
        self.seeded_from = str(path)

    # ------------------------------------------------------------------ state

    def _static_parts(self, capacity: int) -> tuple[StaticTarget, Any]:
        proposer: Any = None
        if isinstance(self.drafter_model, DFlashDraftModel):
            proposer = StaticDrafter(self.drafter_model, self.model.get_input_embeddings(),
                                     self.model.get_output_embeddings(), capacity, self.batch)
        elif self.drafter_model is not None:  # a proposer of the same interface (tests script one)
            proposer = self.drafter_model.static_proposer(self.model, capacity, self.batch)
        layer_ids = list(proposer.target_layer_ids) if proposer is not None else []
        return StaticTarget(self.model, layer_ids, capacity, self.batch), proposer

    def _build(self, capacity: int) -> None:
        """The static state for ``capacity`` slots (rounded up to ``CAPACITY_STEP``, and at least one step's writes
        from an empty row, which warm-up and timing steps make) and the per-row tensors."""
        capacity = min(_round_up(capacity), self.max_capacity)
        self.target, self.proposer = self._static_parts(capacity)
        self._stash = {}
        b, dev = self.batch, self.device
        self.nodes = tree_size(self.proposer, self.budget)
        self.path_width = self.proposer.block_size if self.proposer is not None else 1
        self.policy: DevicePolicy | None = None
        self.chooser: SizeChooser | None = None
        if self.budget is None and self.proposer is not None:
            self.policy = DevicePolicy(self.proposer.block_size - 1, self.policy_buckets, dev,
                                       lookup_rows=self.lookup_config.lookup_tokens)
            self.chooser = SizeChooser(self.sizes(), start=POLICY_START)
            self.nodes = self.chooser.start
        self.lookup = self.policy is not None and self.lookup_config.lookup
        #: Prompt and committed tokens per row (the root last, at ``past``), what lookup searches; one spare
        #: column takes the writes of a step's unused slots.
        self.history = torch.zeros(b, capacity + 1, dtype=torch.long, device=dev)
        self.past = torch.zeros(b, dtype=torch.long, device=dev)
        self.root = torch.zeros(b, dtype=torch.long, device=dev)
        #: Per row: the deepest node the next step may build; -1 marks a row that does not step (inert padding).
        self.max_depth = torch.full((b,), -1, dtype=torch.long, device=dev)
        self.temperature = torch.zeros(b, dtype=torch.float64, device=dev)
        self.top_p = torch.ones(b, dtype=torch.float64, device=dev)
        self.top_k = torch.zeros(b, dtype=torch.long, device=dev)
        #: Per row: the two 32-bit words of its seed's key (``sampling.draw_key``), from which the graph computes
        #: each node's uniform (zeros for greedy and free rows, whose draws nothing reads).
        self.draw_key = torch.zeros(b, 2, dtype=torch.long, device=dev)
        expected = len(self.policy.buckets) if self.policy is not None else 0
        #: What the host copies once per step, per row: [count, committed tokens (padded), tokens only a lookup
        #: branch proposed, expected committed tokens at each drafted policy size (fixed point)].
        self.out = torch.zeros(b, 2 + self.path_width + expected, dtype=torch.long, device=dev)
        #: The step shape the stage functions run (one graph set each): rows (a batch bucket), window, class.
        self.bucket = 1
        self.window = self.window_for(self.span)
        self.kind = "greedy"
        self.sampling = SamplingParams()  # the setting ``prepare()`` prepares by default
        if self.span > self.capacity:  # a tree or block larger than the rounded capacity: one more round
            self._build(self.span)

    def _grow(self, capacity: int) -> None:
        """A larger static state that keeps every row: the caches, drafter context and history are copied in.
        Graphs read the old buffers, so they are dropped (captured again when next needed)."""
        capacity = min(_round_up(capacity), self.max_capacity)
        old_target, old_proposer, old_history = self.target, self.proposer, self.history
        self.target, self.proposer = self._static_parts(capacity)
        self.target.cache.copy_from(old_target.cache)
        if self.proposer is not old_proposer and hasattr(self.proposer, "copy_from"):
            self.proposer.copy_from(old_proposer)
        self.history = torch.zeros(self.batch, capacity + 1, dtype=torch.long, device=self.device)
        self.history[:, : old_history.shape[1] - 1].copy_(old_history[:, :-1])
        self._graphs.clear()

    @property
    def capacity(self) -> int:
        return self.target.capacity

    @property
    def max_capacity(self) -> int:
        """The largest capacity the static state accepts (the target's positions + 256, in whole steps)."""
        return (max_positions(self.model) + 256) // CAPACITY_STEP * CAPACITY_STEP

    @property
    def span(self) -> int:
        """Slots after ``past`` that one step writes: the verified tree (``past + i`` for its largest size) and
        the compaction, which writes ``past + arange(path_width)`` (the block) whatever the tree's size."""
        return max(max(self.sizes()), self.path_width)

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output one row may hold: the target's positions, and the largest capacity less
        one step's writes past the last position (a compaction once wrote past a state sized by the tree)."""
        return min(self.target.max_positions, self.max_capacity - self.span)

    def capacity_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Slots a request needs: a step starts at ``past <= prompt_len + max_new_tokens - 2`` (the prefill's
        token and at least one more are out before the last step) and writes ``span`` slots from there."""
        return prompt_len + max_new_tokens + self.span

    def reserve(self, prompt_len: int, max_new_tokens: int) -> None:
        """Grow the static state (and so re-capture) if a request of this size would not fit."""
        needed = self.capacity_needed(prompt_len, max_new_tokens)
        if needed > self.capacity:
            self._grow(needed)

    def window_for(self, need: int) -> int:
        """The attention window that holds ``need`` slots: ``CAPACITY_STEP`` times a power of two (one graph set
        each), with ``exact_windows`` (a CPU) the next multiple of ``CPU_WINDOW_STEP``; at most the capacity."""
        if self.exact_windows:
            return min(max(-(-int(need) // CPU_WINDOW_STEP), 1) * CPU_WINDOW_STEP, self.capacity)
        window = CAPACITY_STEP
        while window < need:
            window *= 2
        return min(window, self.capacity)

    def windows_from(self, first: int, last: int | None = None) -> list[int]:
        """Every attention window from ``window_for(first)`` to ``window_for(last)`` (default: the capacity), in
        the order a growing row passes through them: the shapes to capture before a request, not during it."""
        window, end = self.window_for(first), self.window_for(self.capacity if last is None else last)
        windows = [window]
        while window < end:
            window = min(2 * window, self.capacity)
            windows.append(window)
        return windows

    def bucket_for(self, rows: int) -> int:
        """The smallest batch bucket of at least ``rows`` rows."""
        return next(b for b in self.batch_buckets if b >= rows)

    def sizes(self) -> tuple[int, ...]:
        """Every tree size this decoder runs (one graph each per batch bucket)."""
        if self.budget is None and self.proposer is not None:
            return self.policy_buckets
        return (self.nodes,)

    # ------------------------------------------------------------------ rows

    def check_request(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        """What any row refuses: an empty or too long request, token ids outside the vocabulary."""
        check_prompt_fits(len(prompt), max_new_tokens, self.target.max_positions)
        if len(prompt) + max_new_tokens > self.max_model_len:
            raise DFlashInputError(
                f"prompt length {len(prompt)} + max_new_tokens {max_new_tokens} exceeds {self.max_model_len}, the "
                f"most one row holds (the target's positions less one step's {self.span} slots past the last)")
        bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
        if bad:
            raise DFlashInputError(
                f"prompt token ids {bad[:5]} are outside the target vocabulary 0..{self.target.vocab_size - 1}")

    @torch.inference_mode()
    def admit(self, row: int, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None,
              draws: TokenDraws | None = None) -> int:
        """Prefill ``prompt_ids`` into the free ``row`` (no other row is touched) and choose its first token, the
        target's own choice after the prompt (drawn with ``draws``, the row's own, at T > 0); returns it (the
        prefill's one copy). The row steps from the next :meth:`step` on."""
        sampling = sampling or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        if not 0 <= row < self.batch:
            raise DFlashInputError(f"row={row} does not exist: this decoder has rows 0..{self.batch - 1}")
        if row in self.requests:
            raise DFlashInputError(f"row {row} is busy: release it before admitting another request")
        self.check_request(prompt, max_new_tokens)
        if not sampling.greedy and draws is None:
            raise DFlashInputError("a sampled row needs its own draws (sampling.make_draws, keyed by the request's seed)")
        # The prefill writes slots 0..P-1 and the first step span more: nothing past the capacity.
        if len(prompt) + self.span > self.capacity:
            self._grow(max(len(prompt) + self.span, 2 * self.capacity))
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        if self.padded_prefill:
            last_logits, features = self._padded_prefill(ids[0], row)
        else:
            last_logits, features = self.target.prefill(ids, row=row)
        self.past[row] = len(prompt)
        self.history[row, : len(prompt)] = ids[0]
        if self.proposer is not None and features is not None:
            if self.defer_context and features.numel() * features.element_size() <= CPU_DEFERRED_PROMPT_BYTES:
                self._deferred_prompts[row] = features  # extended before the row's first draft, if it drafts
            else:
                self._extend_prompt(row, features)
        self._deferred_count[row] = 0
        self.temperature[row] = float(sampling.temperature)
        self.top_p[row] = float(sampling.top_p)
        self.top_k[row] = int(sampling.top_k)
        self.draw_key[row] = torch.tensor(draws.key if draws is not None else (0, 0), dtype=torch.long)
        kind = sampling_kind([sampling])
        rows = slice(row, row + 1)
        # The first token is the one at index len(prompt) = past: the prompt's last token stands at depth -1.
        before_root = torch.full((1, 1), -1, dtype=torch.long, device=self.device)
        self.root[rows] = self._choose(last_logits[:, None], rows, kind, before_root)[:, 0]
        self.history[row, len(prompt)] = self.root[row]
        first = int(self.root[row].item())  # the prefill's one copy
        self.requests[row] = RowState(len(prompt), 1, int(max_new_tokens), sampling, draws)
        return first

    def _padded_prefill(self, prompt: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``prompt`` [P] prefilled at its padded length (a graph replay under graphs) and its K/V copied into
        ``row``: the last token's logits [1, V] and the prompt's features [1, P, F] (copies: the static outputs are
        the next prefill's)."""
        count = prompt.shape[0]
        length = prefill_length(count, self.max_capacity)
        prefill = self._prefill_for(length)
        prefill.load(prompt, length)
        if self.use_graphs:
            graph, (logits, feats) = self._prefill_graph(length)
            graph.replay()
        else:
            logits, feats = prefill.run(length)
        prefill.copy_to(self.target.cache, row, count)
        return logits.clone(), None if feats is None else feats[:, :count].clone()

    def _prefill_for(self, length: int) -> PaddedPrefill:
        """The staging prefill, rebuilt larger (its graphs dropped) when ``length`` does not fit it."""
        if self._prefill is None or self._prefill.capacity < length:
            layer_ids = list(self.proposer.target_layer_ids) if self.proposer is not None else []
            self._prefill = PaddedPrefill(self.model, layer_ids, length)
            self._prefill_graphs.clear()
        return self._prefill

    def _prefill_graph(self, length: int) -> tuple[Any, tuple[torch.Tensor, torch.Tensor | None]]:
        """The CUDA graph of a prefill at ``length`` and its static outputs, captured on first use (``prepare``
        captures every length a prompt that fits the capacity can take). Its own memory pool: the outputs are read
        after the replay, and no step graph may have reused their memory in between."""
        if length not in self._prefill_graphs:
            prefill = self._prefill_for(length)
            start = time.perf_counter()
            before = torch.cuda.memory_allocated(self.device)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.inference_mode(), torch.cuda.stream(stream):
                prefill.run(length)  # warm-up (the staging row is scratch until a prompt is copied out of it)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self._prefill_pool is None:
                self._prefill_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self._prefill_pool):
                outputs = prefill.run(length)
            torch.cuda.synchronize(self.device)
            self.capture_seconds += time.perf_counter() - start
            self.capture_bytes += torch.cuda.memory_allocated(self.device) - before
            self._prefill_graphs[length] = (graph, outputs)
        return self._prefill_graphs[length]

    def prefill_lengths(self) -> list[int]:
        """The padded lengths of every prompt that fits the current capacity (one prefill graph each)."""
        longest = prefill_length(max(self.capacity - self.span, 1), self.max_capacity)
        lengths = [prefill_length(1, self.max_capacity)]
        while lengths[-1] < longest:
            lengths.append(prefill_length(lengths[-1] + 1, self.max_capacity))
        return lengths

    def release(self, row: int) -> None:
        """The row's request is over (finished, stopped or abandoned): from now on it is inert padding, free for the
        next admission. Releasing a free row is a no-op."""
        if self.requests.pop(row, None) is not None:
            self.past[row] = 0  # an idle row's writes stay in its first slots, inside any window
            self._deferred_count[row] = 0
            self._deferred_prompts.pop(row, None)  # never drafted: its prompt's context was never needed

    @torch.inference_mode()
    def move_row(self, src: int, dst: int) -> None:
        """Move the request in row ``src`` to the free row ``dst`` (its committed cache, drafter context, history,
        settings and host state), so that the rows in use stay in a small batch bucket."""
        if src not in self.requests or dst in self.requests or not 0 <= dst < self.batch:
            raise DFlashInputError(f"cannot move row {src} to row {dst}: the source must be busy, the target free")
        self._extend_deferred(prompts=False)  # the source's AR context is in the drafter's cache before it moves
        if src in self._deferred_prompts:  # its prompt's context still waits: it moves with the row
            self._deferred_prompts[dst] = self._deferred_prompts.pop(src)
        state = self.requests.pop(src)
        used = state.past  # slots 0..past-1 hold committed K/V; the rest is scratch
        kv = self.target.cache.kv
        kv[:, :, dst, :, :used].copy_(kv[:, :, src, :, :used])
        if hasattr(self.proposer, "move_row"):
            self.proposer.move_row(src, dst, used)
        for tensor in (self.past, self.root, self.temperature, self.top_p, self.top_k, self.draw_key):
            tensor[dst] = tensor[src]
        self.history[dst, : used + 1].copy_(self.history[src, : used + 1])
        self.past[src] = 0
        self.requests[dst] = state

    # ------------------------------------------------------------------ stages

    def _draft(self, _: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        b = self.bucket
        self._extend_deferred()
        return {"logits": self.proposer.draft(self.root[:b], self.past[:b], self.window)}

    def _defer_context(self, features: torch.Tensor, stepping: torch.Tensor) -> None:
        """Keep an AR step's features ``[b, F]`` (its root's, per row) for the drafter's context; rows not
        ``stepping`` write past their count (nothing reads it)."""
        b = features.shape[0]
        if self._deferred is None or self._deferred.shape[2] != features.shape[1]:
            self._extend_deferred(prompts=False)
            self._deferred = features.new_zeros(self.batch, CPU_DEFERRED_CONTEXT, features.shape[1])
        if self._deferred_steps == CPU_DEFERRED_CONTEXT:
            self._extend_deferred(prompts=False)
        count = self._deferred_count[:b]
        self._deferred[torch.arange(b, device=self.device), count] = features
        count.add_(stepping.long())
        self._deferred_steps += 1

    def _extend_deferred(self, prompts: bool = True) -> None:
        """The drafter's context for every waiting AR step, in one call: row r's ``count`` features sit at slots
        ``past - count .. past - 1``. A row with fewer than the longest count writes stale features past its ``past``
        (scratch, which the next draft overwrites before reading; ``StaticDrafter.extend`` keeps them in its
        cache). With ``prompts``, first every waiting prompt's context (slots ``0 .. P - 1`` of its row; each slot's
        K/V depends on its own features and position alone, so the order does not matter)."""
        if not self.defer_context:
            return
        if prompts:
            self._extend_prompts()
        steps, self._deferred_steps = self._deferred_steps, 0
        rows = max(self.requests, default=-1) + 1
        if steps == 0 or rows == 0 or self._deferred is None:
            self._deferred_count.zero_()
            return
        count = self._deferred_count[:rows]
        self.proposer.extend(self._deferred[:rows, :steps], self.past[:rows] - count)
        self._deferred_count.zero_()

    def _extend_prompts(self) -> None:
        """The drafter's context of every prompt still waiting for its row's first draft."""
        while self._deferred_prompts:
            self._extend_prompt(*self._deferred_prompts.popitem())

    def _extend_prompt(self, row: int, features: torch.Tensor) -> None:
        """The drafter's context of ``row``'s prompt (its prefill's ``features`` [1, P, F]) at slots 0..P-1."""
        self.proposer.extend(features, torch.zeros(1, dtype=torch.long, device=self.device), row=row)

    def _tree_build(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        b = self.bucket
        root, depth = self.root[:b], self.max_depth[:b].clamp(min=0)
        extra: dict[str, torch.Tensor] = {}
        if self.nodes == 1:  # AR (no drafter, or the policy's fallback): the root alone
            tree = build_chain_device(root, root[:, None][:, :0], depth, size=1)
        else:
            logits = live["logits"]
            ids = self.proposer.draft_ids
            if self.policy is not None:
                tree, extra = self._policy_tree(root, depth, logits)
            elif self.budget == 0:
                top1 = logits.argmax(-1)
                tokens = top1 if ids is None else ids[top1]
                tree = build_chain_device(root, tokens, depth, size=self.nodes)
            else:
                k = min(self.budget, logits.shape[-1])
                values, index = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
                tokens = index if ids is None else ids[index]
                tree = build_ddtree_device(root, values, tokens, self.budget, depth)
                tree = pad_tree(tree, self.nodes)
        return {"tokens": tree.tokens, "parents": tree.parents, "depths": tree.depths, "valid": tree.valid,
                "num_nodes": tree.num_nodes, "scores": tree.scores, "visible": visibility_device(tree), **extra}

    def _policy_tree(self, root: torch.Tensor, depth: torch.Tensor,
                     logits: torch.Tensor) -> tuple[DeviceTree, dict[str, torch.Tensor]]:
        """The cost-aware tree: the pool (+ lookup branches), calibrated values, the best ``nodes`` of them, and
        each row's expected tokens at every drafted size (for the host's next choice)."""
        return self._policy_select(self._policy_candidates(root, depth, logits))

    def _policy_candidates(self, root: torch.Tensor, depth: torch.Tensor, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """The pool (+ lookup branches) with its calibrated path values and each row's expected tokens at every drafted
        size: everything the tree needs before its size is known, as flat tensors."""
        policy, ids = self.policy, self.proposer.draft_ids
        pool_nodes = policy.pool_nodes
        k = min(pool_nodes, logits.shape[-1])
        values, index = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
        tokens = index if ids is None else ids[index]
        pool = build_ddtree_device(root, values, tokens, pool_nodes, depth)
        candidates = Grafted(pool, policy.draft_conditional(pool), torch.zeros_like(pool.valid))
        rounds = logits.shape[1]
        out: dict[str, torch.Tensor] = {}
        if self.lookup:
            config = self.lookup_config
            b = self.bucket
            branches = lookup_device(self.history[:b, : self.window], self.past[:b] + 1, config.lookup_tokens,
                                     depth, config.max_ngram, max_branches=config.lookup_branches)
            candidates = graft_device(pool, candidates.cond, branches, policy.lookup_conditional(branches))
            out["ngram"] = branches.ngram
            rounds = max(rounds, config.lookup_tokens)
        path_values = policy.path_values(candidates, rounds)
        tree = candidates.tree
        out.update(tokens=tree.tokens, parents=tree.parents, depths=tree.depths, valid=tree.valid,
                   num_nodes=tree.num_nodes, scores=tree.scores, cond=candidates.cond, on_branch=candidates.on_branch,
                   path_values=path_values, expected=self.policy.expected_tokens(path_values))
        return out

    def _policy_select(self, found: dict[str, torch.Tensor]) -> tuple[DeviceTree, dict[str, torch.Tensor]]:
        """The best ``nodes`` of the candidates (``_policy_candidates``'s tensors)."""
        tree = DeviceTree(tokens=found["tokens"], parents=found["parents"], depths=found["depths"],
                          valid=found["valid"], num_nodes=found["num_nodes"], scores=found["scores"])
        chosen = self.policy.select(Grafted(tree, found["cond"], found["on_branch"]), found["path_values"], self.nodes)
        extra = {"expected": found["expected"], "cond": chosen.cond, "on_branch": chosen.on_branch}
        if "ngram" in found:
            extra["ngram"] = found["ngram"]
        return chosen.tree, extra

    def _candidates(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tree_build`` when the size is chosen in the step: the candidates, kept for ``tree_compile``."""
        b = self.bucket
        found = self._policy_candidates(self.root[:b], self.max_depth[:b].clamp(min=0), live["logits"])
        if self.stash_candidates:
            for name, value in found.items():
                stash = self._stash.get(name)
                if stash is None or stash.shape[1:] != value.shape[1:] or stash.dtype != value.dtype:
                    # Allocated by the first (eager) warm-up of a capture, never inside one; rebuilt with the state.
                    stash = self._stash[name] = torch.empty((self.batch, *value.shape[1:]), dtype=value.dtype,
                                                            device=value.device)
                stash[:b].copy_(value)
            found = {name: self._stash[name][:b] for name in found}
        return {f"candidate_{name}": value for name, value in found.items()}

    def _select(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tree_compile`` when the size is chosen in the step: the chosen size's tree from the candidates."""
        prefix = "candidate_"
        tree, extra = self._policy_select({k[len(prefix):]: v for k, v in live.items() if k.startswith(prefix)})
        return {"tokens": tree.tokens, "parents": tree.parents, "depths": tree.depths, "valid": tree.valid,
                "num_nodes": tree.num_nodes, "scores": tree.scores, "visible": visibility_device(tree), **extra}

    def _choose(self, logits: torch.Tensor, rows: slice, kind: str, depths: torch.Tensor) -> torch.Tensor:
        """The target's token after every node [b, N]: argmax at T = 0, else the keyed draw with each row's
        settings and the uniforms of the index the node's choice takes, ``past + depth + 1`` (what AR draws there;
        greedy rows of a sampled batch still take the argmax)."""
        greedy = logits.argmax(-1)
        if kind == "greedy":
            return greedy
        temperature = self.temperature[rows]
        probs = row_probs(logits, temperature, self.top_k[rows], self.top_p[rows], kind == "filtered")
        key = self.draw_key[rows]
        positions = (self.past[rows, None] + 1 + depths).clamp(min=0)  # padding nodes: any index will do
        return torch.where(temperature[:, None] > 0, keyed_draw(probs, key[:, :1], key[:, 1:], positions), greedy)

    def _verify(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        b = self.bucket
        ids = live["tokens"].clamp(min=0)  # padding nodes (token -1) read a real row; nothing accepts them
        logits, features = self.target.verify(ids, live["depths"], live["visible"], self.past[:b], self.window)
        out = {"choices": self._choose(logits, slice(0, b), self.kind, live["depths"])}
        if features is not None:
            out["features"] = features
        return out

    def _commit(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        b, full = self.bucket, self.path_width
        # A path through an N-node tree holds at most N nodes: the compaction, the drafter's context and the history
        # cover only those (an AR step extends the drafter's context by one slot, not by a block; at batch 8 on a
        # CPU the block-wide extension cost an AR step 5%).
        width = min(full, self.nodes)
        past = self.past[:b]
        stepping = self.max_depth[:b] >= 0  # padding rows commit nothing and teach nothing
        tree = DeviceTree(tokens=live["tokens"], parents=live["parents"], depths=live["depths"],
                          valid=live["valid"], num_nodes=live["num_nodes"], scores=live["scores"])
        path, length, bonus = walk_device(tree, live["choices"], width)
        if width > 1:  # a one-node path is the root, already at its slot: compaction would copy it onto itself
            self.target.cache.compact(past, path)
        if self.proposer is not None and "features" in live:
            features = live["features"].gather(1, path[:, :, None].expand(-1, -1, live["features"].shape[-1]))
            if self.defer_context and width == 1:
                self._defer_context(features[:, 0], stepping)
            else:
                self.proposer.extend(features, past)
        # Committed this step: the accepted draft tokens, then the bonus (the target's choice after the last).
        accepted = tree.tokens.gather(1, path)[:, 1:]
        slot = torch.arange(width, device=self.device)[None]
        shifted = torch.cat([accepted, bonus[:, None]], dim=1)  # [b, P]
        committed = torch.where(slot == (length - 1)[:, None], bonus[:, None], shifted)
        in_path = (slot > 0) & (slot < length[:, None])  # the accepted draft nodes
        if "on_branch" in live:
            lookup_only = live["on_branch"] & ~torch.isfinite(tree.scores)  # no drafter score: a lookup node only
            lookup_count = (lookup_only.gather(1, path) & in_path).sum(1)
        else:
            lookup_count = torch.zeros_like(length)
        columns = [length[:, None], torch.nn.functional.pad(committed, (0, full - width)), lookup_count[:, None]]
        if self.policy is not None:
            expected = live.get("expected")
            columns.append(torch.zeros_like(self.out[:b, 2 + full:]) if expected is None
                           else (expected * EXPECTED_SCALE).round().long())
        self.out[:b].copy_(torch.cat(columns, dim=1))
        if self.policy is not None and "cond" in live and self.nodes > 1:  # a fallback verified no draft node
            self.policy.learn(Grafted(tree, live["cond"], live["on_branch"]), live["choices"], live.get("ngram"),
                              live=stepping)
        # The history gains the committed tokens after the root (at past): slots past the count go to the spare column.
        history = self.history[:b]
        spare = history.shape[1] - 1
        where = torch.where(slot < length[:, None], past[:, None] + 1 + slot, spare).clamp(max=spare)
        history.scatter_(1, where, committed)
        past.add_(torch.where(stepping, length, 0))
        self.root[:b].copy_(torch.where(stepping, bonus, self.root[:b]))
        return {}

    def _stage_fns(self) -> list[tuple[str, Callable[[dict], dict]]]:
        # An AR step drafts nothing: a draft stage would capture an empty CUDA graph (a warning on every capture).
        draft = [("draft", self._draft)] if self.proposer is not None and self.nodes > 1 else []
        if self._split():  # the size is chosen between the candidates and the selection
            tree = [("tree_build", self._candidates), ("tree_compile", self._select)]
        else:
            tree = [("tree_build", self._tree_build)]
        return [*draft, *tree, ("verify", self._verify), ("commit", self._commit)]

    def _split(self) -> bool:
        return self.size_choice == "in_step" and self.policy is not None and self.nodes > 1

    @contextlib.contextmanager
    def _shape(self, bucket: int, nodes: int, window: int, kind: str) -> Iterator[None]:
        """Run stages of another step shape for a while (capture, timing), then put the current one back."""
        saved = (self.bucket, self.nodes, self.window, self.kind)
        self.bucket, self.nodes, self.window, self.kind = bucket, nodes, window, kind
        try:
            yield
        finally:
            self.bucket, self.nodes, self.window, self.kind = saved

    @contextlib.contextmanager
    def _scratch(self) -> Iterator[Callable[[], None]]:
        """Throwaway steps (capture warm-up, cost timing) on the live state, which rows may be using: yields ``reset``,
        which puts every row back where it was (``past``, root) with a full-depth tree, and restores the depth limits
        and the policy's learned tables afterwards (these steps verify trees of stale or arbitrary state: their labels
        would be noise). Everything else they write lies past each row's committed length (tree K/V, compaction,
        drafter context, history after the root), which no later step reads before writing it again."""
        self._extend_deferred()  # the rows' context is whole before throwaway steps defer or extend their own
        saved = self.past.clone(), self.root.clone(), self.max_depth.clone()
        tables = self.policy.state() if self.policy is not None else None

        def reset() -> None:
            self.past.copy_(saved[0])
            self.root.copy_(saved[1])
            self.max_depth.fill_(self.nodes - 1)
            self._deferred_count.zero_()
            self._deferred_steps = 0

        reset()
        try:
            yield reset
        finally:
            for tensor, value in zip((self.past, self.root, self.max_depth), saved):
                tensor.copy_(value)
            self._deferred_count.zero_()
            self._deferred_steps = 0
            if tables is not None:
                self.policy.load_state(tables)

    def _warm_up(self, steps: int = 2) -> None:
        """Eager steps of the current shape on throwaway state (what a capture runs first, on its side stream)."""
        with torch.inference_mode(), self._scratch() as reset:
            for _ in range(steps):
                reset()
                live: dict[str, torch.Tensor] = {}
                for _, fn in self._stage_fns():
                    live.update(fn(live))

    # ------------------------------------------------------------------ graphs

    def _key(self) -> tuple:
        return (self.bucket, self.nodes, self.window, self.kind)

    def _capture(self) -> _Graphs:
        """Warm up (2 eager steps on a side stream, on throwaway state), then capture each stage. A capture only
        records kernels, so the rows' state is untouched."""
        captured = _Graphs()
        start = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._warm_up()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # One memory pool for every shape's graphs (nano-vllm's pattern). A stage's outputs stay referenced in
        # ``live`` while the later stages of the same step are captured, so no capture inside the step reuses them;
        # once the step is captured they are released, and another shape's capture may reuse that memory: only one
        # shape replays at a time, and every step writes a stage's outputs before the next stage reads them.
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        live: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            for name, fn in self._stage_fns():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    live.update(fn(live))
                captured.graphs[name] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - start
        self.capture_bytes += torch.cuda.memory_allocated(self.device) - before
        return captured

    def step_costs(self, kind: str = "greedy", bucket: int = 1) -> list[float]:
        """Seconds per step of every size at this batch bucket and sampling class: given, or measured once."""
        key = (kind, bucket)
        if key not in self._costs:
            if callable(self.policy_costs):
                self._costs[key] = [float(self.policy_costs(bucket, size)) for size in self.sizes()]
            elif self.policy_costs is not None:
                if len(self.policy_costs) != len(self.sizes()):
                    raise DFlashInputError(f"policy_costs has {len(self.policy_costs)} entries for the sizes "
                                           f"{self.sizes()}")
                self._costs[key] = list(self.policy_costs)
            else:
                # Not pooled to rise with the size (CostModel's rule): on the embedded SmolLM2 (AMD EPYC, 2 threads) a
                # 2-node verify costs 89 ms, a 4-node one 54 ms (MKL's few-row GEMM path). Noise is kept out by timing
                # the fastest repeat, and the steps that run refine their own cost.
                self._costs[key] = [self._time_step(bucket, size) for size in self.sizes()]
        return self._costs[key]

    def _observe_cost(self, bucket: int, seconds: float) -> None:
        """Refine the measured cost of the step shape that just ran from its wall time (launch to copy), an
        exponential average as the eager policy's CostModel keeps: the start-up curve was timed on throwaway state
        at one window, on a machine that may have been busy then. Given costs stay as given."""
        costs = self._costs.get((self.kind, bucket))
        if self.policy is None or self.policy_costs is not None or not self.refine_costs or costs is None:
            return
        i = self.sizes().index(self.nodes)
        costs[i] = (1.0 - COST_EMA) * costs[i] + COST_EMA * seconds

    # Inference mode: a step that grew the capacity allocated the state under it, and inference tensors take
    # in-place updates (warm-up, timing) only inside it.
    @torch.inference_mode()
    def prepare(self, sampling: SamplingParams | None = None, buckets: Sequence[int] | None = None,
                windows: Sequence[int] | None = None) -> None:
        """Capture every size's graphs for the sampling class of ``sampling`` (default: the current setting) at each
        batch bucket (default: all) and each of ``windows`` (default: every window from what the rows in flight need
        up to the capacity) now, instead of at the first step that needs them; with the policy, also measure each
        bucket's step costs for that class, unless ``policy_costs`` gave them. Rows in flight and the policy's
        learned tables are left as they were.

        Every window by default: on the H100 a request that reached a window not captured yet paid its capture
        inside the request (0.1-0.5 s for the cost-aware tree's sizes; benchmarks/gpu_h100). Under graphs
        with ``padded_prefill``, also the prefill graph of every padded length a prompt that fits can take."""
        if sampling is not None:
            self.sampling = sampling
        if self.use_graphs and self.padded_prefill:
            lengths = self.prefill_lengths()
            with torch.inference_mode():
                self._prefill_for(lengths[-1])  # the staging row at its largest first: one build, no re-captures
                for length in lengths:
                    self._prefill_graph(length)
        kind = sampling_kind([self.sampling])
        for bucket in buckets or self.batch_buckets:
            shape_windows = list(windows) if windows else self.windows_from(self._window_needed(bucket))
            for shape_window in shape_windows:
                for size in self.sizes():
                    with self._shape(bucket, size, shape_window, kind):
                        if self.use_graphs and self._key() not in self._graphs:
                            self._graphs[self._key()] = self._capture()
            if self.policy is not None:
                # Timed at a typical window (a CPU's first window, 64 slots, would price attention at almost nothing).
                with self._shape(bucket, self.nodes, max(shape_windows[0], self.window_for(CAPACITY_STEP)), kind):
                    costs = self.step_costs(kind, bucket)
                if bucket == 1:
                    self.policy.set_costs([c for size, c in zip(self.sizes(), costs) if size >= 2])

    @torch.inference_mode()
    def _time_step(self, bucket: int, size: int, repeats: int = 5) -> float:
        """Fastest of a few steps of ``bucket`` rows and ``size`` nodes (graph replay on CUDA), on throwaway state;
        fewer repeats (at least two) once they add up to ``TIMING_SECONDS`` (a big batch on a CPU: start-up stays
        short)."""
        samples: list[float] = []
        with self._shape(bucket, size, self.window, self.kind), self._scratch() as reset:
            for rep in range(repeats + 1):
                reset()
                self.synchronize()
                start = time.perf_counter()
                self._run_step(None)
                self.synchronize()
                if rep:
                    samples.append(time.perf_counter() - start)
                    if len(samples) >= 2 and sum(samples) >= TIMING_SECONDS:
                        break
        return min(samples)  # other work on the machine only ever adds time

    @torch.inference_mode()
    def time_stages(self, size: int, repeats: int = 5, bucket: int = 1) -> dict[str, float]:
        """Median milliseconds per stage of one step of ``bucket`` rows and ``size`` nodes (CUDA events between graph
        replays on CUDA, wall time on the CPU) on throwaway state, as :meth:`generate` times them; a profiling aid."""
        samples: dict[str, list[float]] = {}
        with self._shape(bucket, size, self._window_needed(bucket), self.kind), self._scratch() as reset:
            for rep in range(repeats + 1):
                reset()
                seconds = dict.fromkeys((name for name, _ in self._stage_fns()), 0.0)
                self._run_step(seconds)
                self.synchronize()
                self._collect_stage_times()
                if rep:
                    for name, value in seconds.items():
                        samples.setdefault(name, []).append(1000.0 * value)
        return {name: sorted(values)[len(values) // 2] for name, values in samples.items()}

    def _run_step(self, stage_seconds: dict[str, float] | None) -> None:
        """One step of the planned shape: every stage in order, with ``in_step`` the size chosen after
        ``tree_build`` (the stages up to it run under the planned size's graphs, the rest under the chosen one's)."""
        stages = self._stage_fns()
        names = [name for name, _ in stages]
        cut = names.index("tree_build") + 1 if self._in_step is not None and self._split() else len(names)
        began = time.perf_counter()
        if self.use_graphs:
            if cut < len(names):  # every size this step may pick, captured before its candidates are written
                for size in self.chooser.drafted:
                    with self._shape(self.bucket, size, self.window, self.kind):
                        if self._key() not in self._graphs:
                            self._graphs[self._key()] = self._capture()
            elif self._key() not in self._graphs:
                self._graphs[self._key()] = self._capture()
            timed = stage_seconds is not None
            if timed:  # events between the replays time each stage on the device; read after the step's copy
                while len(self._events) < len(names) + 1:
                    self._events.append(torch.cuda.Event(enable_timing=True))
                self._events[0].record()
            for i, name in enumerate(names):
                if i == cut:
                    self._choose_in_step(self._stash["expected"][: self.bucket])
                self._graphs[self._key()].graphs[name].replay()
                if timed:
                    self._events[i + 1].record()
            if timed:
                self._pending_timing = (names, stage_seconds)
            return
        live: dict[str, torch.Tensor] = {}
        for i, (name, fn) in enumerate(stages):
            if i == cut:
                self._choose_in_step(live["candidate_expected"], time.perf_counter() - began)
            start = time.perf_counter()
            live.update(fn(live))
            if stage_seconds is not None:
                stage_seconds[name] += time.perf_counter() - start

    def _choose_in_step(self, expected: torch.Tensor, drafted_seconds: float | None = None) -> None:
        """``in_step``: the size from this step's own estimates (``[bucket, drafted sizes]``); the step goes on at it
        (the stages after ``tree_build`` read ``self.nodes``, or replay that size's graphs). Eagerly
        (``drafted_seconds``: the time the step has spent so far) it may be 1: the root alone, where no drafted
        size is affordable for every row (``SizeChooser.choose_drafted``'s ``sunk``)."""
        stepping, costs, remaining, credit = self._in_step
        sunk = None
        if drafted_seconds is not None and 1 in self.sizes():
            # In AR steps of measured costs; given costs (tests, a caller's curve) need not be seconds: the draft
            # then counts as free, and the fallback is taken where no drafted size is affordable.
            sunk = drafted_seconds / costs[self.sizes().index(1)] if self.policy_costs is None else 0.0
        self.nodes = self.chooser.choose_drafted(self._copy_estimates(expected, stepping), costs, remaining, credit,
                                                 sunk)
        if self.nodes == 1:
            self._fell_back = sunk

    # ------------------------------------------------------------------ the loop

    def _window_needed(self, bucket: int, nodes: int | None = None) -> int:
        """The window a step of the first ``bucket`` rows needs: every row's next writes end before ``past + span``
        (free rows sit at 0), or with ``nodes`` before ``past + writes(nodes)``: a step of that size alone."""
        pasts = [state.past for row, state in self.requests.items() if row < bucket]
        return self.window_for(max(pasts, default=0) + (self.span if nodes is None else self.writes(nodes)))

    def writes(self, nodes: int) -> int:
        """Slots after ``past`` that a step of ``nodes`` nodes writes (and so attends over): an AR step its root
        alone; a drafted one its tree, the compaction of a path (``min(path_width, nodes)``) and the drafter's block
        (its K/V sit at ``past .. past + block - 1`` while it drafts)."""
        if nodes <= 1:
            return 1
        block = self.proposer.block_size if self.proposer is not None else 1
        return max(nodes, block)

    def _plan(self, stepping: list[int], draining: bool = False) -> None:
        """Everything the next step needs, decided on the host from what it knows: the batch bucket, the capacity
        (grown if a row needs more), the window, the sampling class, the tree size (for a batch that is
        ``draining``, the pace of its slowest row: ``SizeChooser``), and on the device each row's depth limit (-1
        for padding rows)."""
        bucket = self.bucket_for(stepping[-1] + 1)
        need = max(state.past for row, state in self.requests.items() if row < bucket) + self.span
        if need > self.capacity:
            self._grow(max(need, 2 * self.capacity))
        kind = sampling_kind(self.requests[row].sampling for row in stepping)
        self.bucket, self.window, self.kind = bucket, self._window_needed(bucket), kind
        self._in_step = None
        deepest = self.nodes
        if self.chooser is not None:
            costs = self.step_costs(kind, bucket)
            # A lone row keeps the batch rule (the two agree but at its last tokens): what run.py's decoder runs.
            remaining = [self.requests[row].remaining for row in stepping] if draining and len(stepping) > 1 \
                else None
            credit = [self.requests[row].credit for row in stepping]
            self.nodes = deepest = self.chooser.choose([self.requests[row].expected for row in stepping], costs,
                                                       remaining, credit)
            if self.size_choice == "in_step" and self.nodes > 1:
                # The candidates are built for the largest size; the tree stage picks the size from them.
                self._in_step, deepest = (stepping, costs, remaining, credit), max(self.sizes())
        if self.exact_windows:
            # On a CPU a step attends over what its own size writes: an AR step of the cost-aware tree reads no more
            # of the cache than plain AR's (under graphs every size runs each window's graphs, captured before).
            self.window = self._window_needed(bucket, deepest)
        positions = self.target.max_positions
        depths = [-1] * bucket
        for row in stepping:
            state = self.requests[row]
            # Accepted drafts + the bonus after them fit the row's budget: a deeper node's bonus would be cut.
            depths[row] = min(state.remaining - 1, positions - 1 - state.past, deepest - 1)
        self.max_depth[:bucket].copy_(torch.tensor(depths, dtype=torch.long))

    def launch(self) -> torch.Tensor:
        """One step of the planned shape on the device (no host read); returns the device buffer ``[b, columns]``."""
        with torch.inference_mode():
            self._run_step(None)
        return self.out[: self.bucket]

    @torch.inference_mode()
    def step(self, rows: Collection[int] | None = None, stage_seconds: dict[str, float] | None = None, *,
             draining: bool = False) -> dict[int, RowResult]:
        """One step of the admitted rows (``rows``: only those; the others in the bucket are padding this time):
        ``{row: RowResult}`` for each row that stepped. A row that has committed its ``max_new_tokens`` does not
        step (its caller releases it). ``draining``: no more requests will come, so the batch is done when its
        slowest row is (the cost-aware tree paces it by that row: ``SizeChooser``, "Draining"); only a caller
        that knows its queue is empty says so (:meth:`generate_many`, not a server)."""
        chosen = self.requests if rows is None else rows
        stepping = sorted(row for row in chosen if row in self.requests and self.requests[row].remaining > 0)
        if not stepping:
            return {}
        self._plan(stepping, draining)
        bucket, captured, drafted = self.bucket, self.capture_seconds, self.nodes > 1
        if drafted:  # a new prompt's drafter context, once, outside the step's time (its cost is the admission's)
            self._extend_prompts()
        start = time.perf_counter()
        try:
            self._run_step(stage_seconds)
        finally:
            self._in_step, fell_back, self._fell_back = None, self._fell_back, None
        nodes = self.nodes  # with ``in_step``, the size the tree stage chose
        out = self._copy_out()
        # A step that captured its graphs first says nothing about its cost, nor one that drafted and verified its
        # root alone (neither an AR step nor a drafted one).
        if self.capture_seconds == captured and fell_back is None:
            self._observe_cost(bucket, time.perf_counter() - start)
        self._collect_stage_times()
        results = {}
        width = self.path_width
        ar_steps = self._ar_steps(bucket, nodes) + (fell_back or 0.0)  # a fallback paid its draft too
        for row in stepping:
            values = out[row]
            count = values[0]
            state = self.requests[row]
            state.past += count
            state.produced += count
            state.credit += count - ar_steps
            if self.policy is not None and drafted:  # a fallback's estimates are as fresh
                state.expected = [v / EXPECTED_SCALE for v in values[2 + width:]]
            results[row] = RowResult(values[1 : 1 + count], nodes, values[1 + width])
        if self.chooser is not None:
            self.chooser.observe(sum(len(r.tokens) for r in results.values()), len(results))
        return results

    def _ar_steps(self, bucket: int, nodes: int) -> float:
        """What a step of ``nodes`` nodes at ``bucket`` costs in plain AR steps of that bucket, by the step costs (1
        where there is no AR size to compare with): one token per row is AR's pace."""
        sizes = self.sizes()
        costs = self._costs.get((self.kind, bucket))
        if self.chooser is None or costs is None or 1 not in sizes:
            return 1.0
        return costs[sizes.index(nodes)] / costs[sizes.index(1)]

    def _copy_estimates(self, expected: torch.Tensor, stepping: list[int]) -> list[list[float]]:
        """``in_step``'s one extra read: the stepping rows' expected tokens at every drafted size."""
        return expected[stepping].tolist()

    def _copy_out(self) -> list[list[int]]:
        """The step's one device-to-host copy: every row's count, tokens and estimates at once."""
        return self.out[: self.bucket].tolist()

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                 stop_token_ids: Sequence[int] = (), on_tokens: Callable[[list[int]], None] | None = None,
                 draws: TokenDraws | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` for one prompt in row 0 (no other row may be in flight); same contract
        as ``decode.speculative_generate``."""
        sampling = sampling or SamplingParams()
        prompt = _single_prompt(prompt_ids)
        if self.requests:
            raise DFlashInputError(f"generate() decodes one prompt alone; rows {sorted(self.requests)} are in flight")
        self.check_request(prompt, max_new_tokens)
        self.reserve(len(prompt), max_new_tokens)
        if draws is None:
            draws = make_draws(sampling)
        # Every window this request passes through is captured before its prefill, none in the step loop.
        self.prepare(sampling, buckets=(1,), windows=self.windows_from(len(prompt) + self.span,
                                                                      len(prompt) + max_new_tokens + self.span))
        stops = {int(t) for t in stop_token_ids}
        stats = GenerationStats()
        stats.stage_seconds = dict.fromkeys(STAGES, 0.0)
        output = OutputStream(max_new_tokens, stops, on_tokens)

        t0 = time.perf_counter()
        try:  # the row is released whatever happens, the admission and the first token's callback included
            done = output.emit([self.admit(0, prompt, max_new_tokens, sampling, draws)])
            stats.stage_seconds["prefill"] = time.perf_counter() - t0
            while not done:
                result = self.step([0], stats.stage_seconds)[0]
                stats.steps += 1
                stats.acceptance_lengths.append(len(result.tokens))
                stats.tree_sizes.append(result.tree_size)
                stats.drafted.append(result.tree_size > 1)
                stats.lookup_tokens += result.lookup_tokens
                done = output.emit(result.tokens)
        finally:
            if 0 in self.requests:
                self.last_past = self.requests[0].past
                self.release(0)
        self.synchronize()
        stats.total_seconds = time.perf_counter() - t0
        stats.new_tokens = len(output)
        return GenerationResult(output_ids=output.tokens, stats=stats, finish_reason=output.finish_reason())

    @torch.inference_mode()
    def generate_many(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, admit_every: int = 1,
                      stop_token_ids: Sequence[int] = ()) -> list[GenerationResult]:
        """Greedy outputs of several prompts through the rows (none may be in flight): prompt i is admitted into the
        lowest free row once ``i * admit_every`` steps have run (and a row is free), and released when it is done,
        so rows of different lengths share steps and join mid-run, as on a server."""
        if self.requests:
            raise DFlashInputError(f"generate_many() needs free rows; rows {sorted(self.requests)} are in flight")
        if isinstance(prompts, (str, bytes)) or any(not hasattr(p, "__len__") for p in prompts):
            raise DFlashInputError("prompts: give a list of prompts, each a list of token ids (one prompt: generate)")
        prompts = [_single_prompt(p) for p in prompts]
        for prompt in prompts:
            self.check_request(prompt, max_new_tokens)
        self.prepare(SamplingParams())
        stops = {int(t) for t in stop_token_ids}
        outputs = [OutputStream(max_new_tokens, stops, None) for _ in prompts]
        stats = [GenerationStats() for _ in prompts]
        row_of: dict[int, int] = {}
        waiting, steps, t0 = list(range(len(prompts))), 0, time.perf_counter()
        try:
            while waiting or row_of:
                free = [r for r in range(self.batch) if r not in self.requests]
                while waiting and free and waiting[0] * admit_every <= steps:
                    i, row = waiting.pop(0), free.pop(0)
                    row_of[row] = i
                    if outputs[i].emit([self.admit(row, prompts[i], max_new_tokens)]):
                        self.release(row)
                        del row_of[row]
                for row, result in self.step(list(row_of), draining=not waiting).items():
                    i = row_of[row]
                    stats[i].steps += 1
                    stats[i].acceptance_lengths.append(len(result.tokens))
                    stats[i].tree_sizes.append(result.tree_size)
                    stats[i].lookup_tokens += result.lookup_tokens
                    if outputs[i].emit(result.tokens):
                        self.release(row)
                        del row_of[row]
                steps += 1
        finally:  # an exception (Ctrl-C) leaves no row in flight: the decoder stays usable
            for row in [r for r in row_of if r in self.requests]:
                self.release(row)
        seconds = time.perf_counter() - t0
        for output, stat in zip(outputs, stats):
            stat.total_seconds, stat.new_tokens = seconds, len(output)
        return [GenerationResult(output_ids=o.tokens, stats=st, finish_reason=o.finish_reason())
                for o, st in zip(outputs, stats)]

    def _collect_stage_times(self) -> None:
        """Add the last graphed step's per-stage device times (its events are complete after the copy)."""
        if self._pending_timing is None:
            return
        names, stage_seconds = self._pending_timing
        for i, name in enumerate(names):
            stage_seconds[name] += self._events[i].elapsed_time(self._events[i + 1]) / 1000.0
        self._pending_timing = None

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _round_up(capacity: int) -> int:
    return -(-int(capacity) // CAPACITY_STEP) * CAPACITY_STEP
