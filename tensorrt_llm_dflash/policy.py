"""The cost-aware DDTree: how many nodes to verify this step, and whether to draft at all.

DDTree pops nodes in non-increasing path probability, and the expected acceptance length
of the top-n tree is 1 + the sum of their path probabilities. Those probabilities have to
be *acceptance* probabilities, and verifying n nodes has a price, so each step:

1. **candidates**: the DDTree of the drafter's marginals (a pool of ``max_nodes``; a DFlash2
   drafter's own tree over its selector's conditionals, :mod:`.dflash2.tree`) plus
   prompt-lookup branches (:mod:`.lookup`) grafted under the root, sharing nodes where the
   tokens agree (:class:`.tree.CandidateTree`);
2. **calibrate**: every candidate's draft probability (DDTree: its marginal; DFlash2: q of its
   token given its parent's) is mapped to an acceptance probability learned online from what
   the target actually chose (:class:`Calibrator`);
3. **choose n**: the n that maximises expected committed tokens per second,
   ``(1 + sum of the top-n values) / (step overhead + draft + verify(n + 1))``, with the
   verify cost from a measured curve (:class:`CostModel`); n = 0 is a plain AR step;
4. **learn**: the target's choice at every verified node labels every verified child (was
   it the token the target picked?), the step's timings refine the cost curve, and when
   drafting has not paid for itself recently it is skipped for a while (lookup branches
   and AR steps only) and retried later, with a doubling back-off.

Every committed token is still the target's own choice at an accepted node, verified with
the ancestor-only mask in one pass: the policy changes which tree is verified, never what
is accepted, so output stays exactly AR's (greedy) or AR's distribution (sampling).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import DFlashInputError
from .files import atomic_write_json
from .lookup import lookup_branches
from .tree import DRAFTER, LOOKUP, CandidateTree, DraftTree, build_ddtree

# ----------------------------------------------------------------------------- costs

#: Tree sizes (root included) the start-up calibration times: every size to 17, then sparser. A CPU's verify cost
#: is not smooth in the size (on the 2-core AMD EPYC, with the blocked GEMM bit-identical at 8 and 12..128 rows and
#: not at 9..11: 8 rows 41 ms, 9 rows 57, 16 rows 52), so a curve interpolated from 1, 2, 3, 5, 9, 17, ... priced
#: the sizes between its points wrongly until a step had measured them, and which size a run settled on (7 or 15
#: draft nodes) moved HumanEval between 1.81x and 1.93x AR (BENCHMARKS.md).
CALIBRATION_SIZES = (*range(1, 18), 24, 32, 33, 48, 64, 65)
#: Bumped whenever what a cached curve measured would change: a new calibration or new fast paths.
COST_CACHE_FORMAT = 2


@dataclass
class CostModel:
    """Seconds per verify pass as a function of the tree size (root included), per draft, and
    per step besides both (tree build, commit, sampling).

    The start-up curve is interpolated linearly (and extrapolated from its last two
    points); online, each step's measured verify time updates an exponential average per
    tree size, and a machine-wide scale factor (measured / curve) carries the drift to sizes
    not seen yet.
    """

    sizes: list[int]
    verify_seconds: list[float]
    draft_seconds: float = 0.0
    overhead_seconds: float = 0.0
    device: str = ""
    observed: dict[int, list[float]] = field(default_factory=dict)  # size -> [ema, count]
    scale: float = 1.0
    ema: float = 0.2

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.verify_seconds) or not self.sizes:
            raise DFlashInputError("a cost curve needs as many times as sizes, and at least one")
        order = np.argsort(self.sizes)
        self.sizes = [int(self.sizes[i]) for i in order]
        # A bigger tree never verifies faster: timing noise (a busy machine) is pooled away.
        seconds = np.asarray([float(self.verify_seconds[i]) for i in order])
        self.verify_seconds = _pool_adjacent_violators(seconds, np.ones(len(seconds))).tolist()

    def curve(self, nodes: int) -> float:
        x, y = self.sizes, self.verify_seconds
        if len(x) == 1:
            return y[0] * max(nodes, 1) / x[0]
        if nodes <= x[-1]:
            return float(np.interp(nodes, x, y))
        slope = (y[-1] - y[-2]) / max(x[-1] - x[-2], 1)
        return y[-1] + slope * (nodes - x[-1])

    def verify(self, nodes: int) -> float:
        seen = self.observed.get(int(nodes))
        if seen is not None and seen[1] >= 2:
            return seen[0]
        return self.curve(nodes) * self.scale

    def verify_many(self, max_nodes: int) -> np.ndarray:
        """verify(n) for n = 1..max_nodes."""
        n = np.arange(1, max_nodes + 1)
        x, y = np.asarray(self.sizes, dtype=np.float64), np.asarray(self.verify_seconds)
        if len(x) == 1:
            out = y[0] * n / x[0]
        else:
            slope = (y[-1] - y[-2]) / max(x[-1] - x[-2], 1)
            out = np.where(n <= x[-1], np.interp(n, x, y), y[-1] + slope * (n - x[-1]))
        out = out * self.scale
        for size, (ema, count) in self.observed.items():
            if count >= 2 and size <= max_nodes:
                out[size - 1] = ema
        return out

    def observe_verify(self, nodes: int, seconds: float) -> None:
        seen = self.observed.setdefault(int(nodes), [seconds, 0])
        seen[0] = seconds if seen[1] == 0 else (1 - self.ema) * seen[0] + self.ema * seconds
        seen[1] += 1
        self.scale = (1 - self.ema) * self.scale + self.ema * seconds / max(self.curve(nodes), 1e-9)

    def observe_draft(self, seconds: float) -> None:
        self.draft_seconds = (1 - self.ema) * self.draft_seconds + self.ema * seconds

    def observe_overhead(self, seconds: float) -> None:
        self.overhead_seconds = (1 - self.ema) * self.overhead_seconds + self.ema * seconds

    def to_json(self) -> dict[str, Any]:
        return {"sizes": self.sizes, "verify_seconds": self.verify_seconds, "draft_seconds": self.draft_seconds,
                "overhead_seconds": self.overhead_seconds, "device": self.device}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        return cls(sizes=list(data["sizes"]), verify_seconds=list(data["verify_seconds"]),
                   draft_seconds=float(data["draft_seconds"]), overhead_seconds=float(data["overhead_seconds"]),
                   device=str(data.get("device", "")))


def _calibration_tree(nodes: int, vocab_size: int) -> DraftTree:
    """A bushy tree of ``nodes`` nodes (root included): what a DDTree looks like."""
    depth, width = 8, 4
    logprobs = np.log(np.tile(np.array([0.6, 0.2, 0.1, 0.05]), (depth, 1)))
    tokens = np.tile(np.arange(1, 1 + width) % vocab_size, (depth, 1))
    return build_ddtree(0, logprobs, tokens, nodes - 1)


@torch.inference_mode()
def calibrate_costs(target: Any, proposer: Any | None, sizes: Sequence[int] = CALIBRATION_SIZES,
                    repeats: int = 5, context_len: int = 160) -> CostModel:
    """Time verify passes of the given tree sizes (and one draft) on a synthetic prompt.

    The median of ``repeats`` timed passes after one warm-up, each size after a fresh
    prefill of the same prompt; only the root is committed, so every pass sees about the
    same context.
    """
    sizes = [s for s in sizes if s >= 1]
    # Each size starts from a fresh prefill, so the context never outgrows the model (or an engine).
    limit = int(getattr(target, "max_positions", 1 << 30)) - (repeats + 1) - max(sizes) - 1
    context_len = max(1, min(context_len, limit, int(getattr(target, "max_prompt_len", context_len))))
    prompt = [(i * 7919) % min(target.vocab_size, 32000) for i in range(1, context_len + 1)]
    times: list[float] = []
    for size in sizes:
        _, features = target.prefill(prompt)
        samples = []
        for rep in range(repeats + 1):
            tree = _calibration_tree(size, target.vocab_size)
            start = time.perf_counter()
            target.verify(target.compile_tree(tree))
            target.synchronize()
            elapsed = time.perf_counter() - start
            target.commit([0])
            if rep:
                samples.append(elapsed)
        times.append(statistics.median(samples))
    draft = 0.0
    if proposer is not None:
        proposer.reset()
        samples = []
        context = features if features is not None else torch.zeros(len(prompt), 0)
        for rep in range(repeats + 1):
            start = time.perf_counter()
            proposer.propose(0, context)
            target.synchronize()
            if rep:
                samples.append(time.perf_counter() - start)
            context = context[:0]
        draft = statistics.median(samples)
        proposer.reset()
    return CostModel(sizes=list(sizes), verify_seconds=times, draft_seconds=draft, device=_device_name(target))


def _device_name(target: Any) -> str:
    device = getattr(target, "device", torch.device("cpu"))
    if getattr(device, "type", "cpu") == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def cost_cache_dir() -> Path:
    """``$TENSORRT_LLM_DFLASH_CACHE`` or ``~/.cache/tensorrt_llm_dflash``, then ``costs/``."""
    root = os.environ.get("TENSORRT_LLM_DFLASH_CACHE") or Path.home() / ".cache" / "tensorrt_llm_dflash"
    return Path(root) / "costs"


def cost_cache_key(target: Any, proposer: Any | None, extra: str = "") -> str:
    """Machine (CPU model and threads, or GPU), target and drafter identity, and what decides the costs besides them:
    the calibration's sizes, the verifier's blocked-GEMM rows and the draft's routes (a curve measured before the
    blocked GEMMs served one-token steps priced AR 30% too high on the 2-core EPYC)."""
    from .target import BLOCKED_ROWS

    parts = [_device_name(target), platform.node(), str(torch.__version__), type(target).__name__,
             str(getattr(target, "vocab_size", "")), str(getattr(target, "dtype", "")), extra,
             f"format {COST_CACHE_FORMAT}", f"sizes {CALIBRATION_SIZES}",
             f"blocked rows {BLOCKED_ROWS.start}..{BLOCKED_ROWS.stop - 1}"]
    model = getattr(target, "model", None)
    if model is not None:
        parts.append(str(sum(p.numel() for p in model.parameters())))
        parts.append(json.dumps(getattr(model.config, "to_diff_dict", dict)(), sort_keys=True, default=str))
    if proposer is not None:
        parts += [type(proposer).__name__, str(getattr(proposer, "block_size", "")),
                  str(getattr(proposer, "dtype", "")),
                  str(getattr(getattr(proposer, "head", None), "backend", "")),
                  str(getattr(getattr(proposer, "linears", None), "backend", ""))]
        drafter = getattr(proposer, "model", None)
        if drafter is not None:
            parts.append(str(sum(p.numel() for p in drafter.parameters())))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def load_or_calibrate_costs(target: Any, proposer: Any | None, max_nodes: int, extra: str = "",
                            refresh: bool = False, log: Any = None) -> tuple[CostModel, str]:
    """The cached curve for this machine, target and drafter, or a fresh calibration (then
    cached). Returns the model and where it came from (``cache`` or ``measured``)."""
    sizes = [s for s in CALIBRATION_SIZES if s <= max_nodes + 1] or [1]
    if sizes[-1] < max_nodes + 1:
        sizes.append(max_nodes + 1)
    path = cost_cache_dir() / f"{cost_cache_key(target, proposer, extra)}.json"
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            model = CostModel.from_json(data)
            if model.sizes[-1] >= sizes[-1] and (proposer is None or model.draft_seconds > 0):
                return model, "cache"
        except (OSError, ValueError, KeyError, TypeError, DFlashInputError):
            pass  # a damaged cache entry is measured again and replaced
    if log is not None:
        log(f"measuring this machine's verify cost curve (trees of {sizes[0]}..{sizes[-1]} nodes; once, then "
            f"cached in {path.parent})")
    model = calibrate_costs(target, proposer, sizes)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, model.to_json())
    except OSError:
        pass  # a read-only home: the curve is measured again next time
    return model, "measured"


#: Largest tree the default policy considers (draft nodes): flat-cost GPUs go this far, CPUs stop early.
DEFAULT_MAX_NODES = 64


def default_policy(target: Any, proposer: Any | None, max_nodes: int = DEFAULT_MAX_NODES, lookup: bool = True,
                   recalibrate: bool = False, log: Any = None, persist: bool = False) -> CostAwarePolicy:
    """What ``examples/run.py`` uses with no decoding flags: the cost curve of this machine,
    target and drafter (measured once, then cached), and lookup branches.

    ``persist``: start from the acceptance calibration an earlier run learned with this target
    and drafter (``calibration_path``), and let ``save_calibration`` keep it for the next one,
    so a one-prompt run starts where the last run ended instead of from the priors.
    ``recalibrate`` starts both the cost curve and the calibration afresh."""
    costs, _ = load_or_calibrate_costs(target, proposer, max_nodes, refresh=recalibrate, log=log)
    block = int(getattr(proposer, "block_size", 2)) if proposer is not None else 2
    policy = CostAwarePolicy(costs, PolicyConfig(max_nodes=max_nodes, lookup=lookup), block_size=block)
    if persist:
        policy.calibration_path = calibration_path(target, proposer)
        if policy.calibration_path is not None and not recalibrate and policy.calibration_path.is_file():
            try:
                restored = policy.load_calibration(json.loads(policy.calibration_path.read_text()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                restored = 0  # damaged or made for another shape: start from the priors, replace it later
            if log is not None and restored:
                log(f"acceptance calibration: continuing from earlier runs ({policy.calibration_path})")
    return policy


def _weights_digest(module: Any) -> str:
    """A cheap identity of a module's weights: every tensor's shape and its first and last 256 values."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        for part in (flat[:256], flat[-256:]):
            digest.update(part.to(torch.float64).cpu().numpy().tobytes())
    return digest.hexdigest()


def calibration_path(target: Any, proposer: Any | None) -> Path | None:
    """Where the acceptance calibration of this target and drafter is kept (beside the cost
    curves): keyed by the models' weights and dtypes, not the machine, since acceptance does
    not depend on it; a retrained drafter of the same shape starts afresh. None when the
    models' weights cannot be read here (an engine): nothing is kept."""
    parts = []
    for owner in (target, proposer):
        model = getattr(owner, "model", None)
        if isinstance(model, torch.nn.Module):
            parts += [type(owner).__name__, str(getattr(owner, "dtype", "")),
                      str(getattr(owner, "block_size", "")), _weights_digest(model)]
    return _calibration_file(parts) if parts else None


def models_calibration_path(target_model: torch.nn.Module, drafter_model: torch.nn.Module) -> Path:
    """:func:`calibration_path` of the eager runtime's verifier and DFlash proposer for these two models, without
    building them: the graphed runtime starts from the same file (tested equal to the eager runtime's path)."""
    drafter_dtype = next(drafter_model.parameters()).dtype
    return _calibration_file(["HFTargetVerifier", str(target_model.dtype), "", _weights_digest(target_model),
                              "DFlashProposer", str(drafter_dtype), str(drafter_model.config.block_size),
                              _weights_digest(drafter_model)])


def _calibration_file(parts: list[str]) -> Path:
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]
    return cost_cache_dir().parent / "calibration" / f"{key}.json"


# ----------------------------------------------------------------------------- calibration


def _pool_adjacent_violators(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted isotonic (non-decreasing) regression of ``values``."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return np.concatenate([np.full(int(c), m) for m, _, c in blocks])


class Calibrator:
    """P(accepted) from a score, per row (a depth, or a lookup offset), learned online.

    Histogram binning with a Beta prior and isotonic smoothing: the score axis is cut into
    bins; each bin keeps exponentially forgotten counts of accepted / offered candidates;
    its estimate is ``(hits + s * prior) / (trials + s)``, made non-decreasing in the score
    by pool-adjacent-violators (a more confident candidate is never rated less likely).
    With no data the estimate is the prior, so a fresh calibrator trusts the drafter's own
    probability (``prior="identity"``) or a constant.
    """

    def __init__(self, rows: int, edges: Sequence[float], prior: str | float = "identity",
                 strength: float = 4.0, decay: float = 0.995) -> None:
        self.edges = np.asarray(edges, dtype=np.float64)
        bins = len(self.edges) - 1
        centres = (self.edges[:-1] + self.edges[1:]) / 2
        centres[-1] = self.edges[-2] if not np.isfinite(self.edges[-1]) else centres[-1]
        self.prior = np.clip(centres, 0.0, 1.0) if prior == "identity" else np.full(bins, float(prior))
        self.rows, self.strength, self.decay = rows, strength, decay
        self.hits = np.zeros((rows, bins))
        self.trials = np.zeros((rows, bins))
        self._table: np.ndarray | None = None

    def _bins(self, scores: np.ndarray) -> np.ndarray:
        return np.clip(np.searchsorted(self.edges, scores, side="right") - 1, 0, len(self.edges) - 2)

    def table(self) -> np.ndarray:
        if self._table is None:
            raw = (self.hits + self.strength * self.prior) / (self.trials + self.strength)
            weight = self.trials + self.strength
            self._table = np.stack([_pool_adjacent_violators(raw[r], weight[r]) for r in range(self.rows)])
        return self._table

    def predict(self, rows: np.ndarray, scores: np.ndarray) -> np.ndarray:
        rows = np.clip(np.asarray(rows, dtype=np.int64), 0, self.rows - 1)
        return self.table()[rows, self._bins(np.asarray(scores, dtype=np.float64))]

    def state(self) -> dict[str, Any]:
        return {"edges": [float(e) for e in self.edges], "hits": self.hits.tolist(), "trials": self.trials.tolist()}

    def load_state(self, state: dict[str, Any]) -> None:
        """Counts saved by :meth:`state`; a ValueError if they were made for other rows or bins."""
        edges = np.asarray(state["edges"], dtype=np.float64)
        hits, trials = np.asarray(state["hits"], dtype=np.float64), np.asarray(state["trials"], dtype=np.float64)
        if edges.shape != self.edges.shape or not np.array_equal(edges, self.edges):
            raise ValueError("calibration bins differ")
        if hits.shape != self.hits.shape or trials.shape != self.trials.shape:
            raise ValueError(f"calibration rows differ: {hits.shape} != {self.hits.shape}")
        if not (np.all(np.isfinite(hits)) and np.all(np.isfinite(trials)) and np.all(hits >= 0)
                and np.all(hits <= trials + 1e-9)):
            raise ValueError("calibration counts out of range")
        self.hits, self.trials, self._table = hits, trials, None

    def update(self, rows: np.ndarray, scores: np.ndarray, accepted: np.ndarray) -> None:
        self.hits *= self.decay
        self.trials *= self.decay
        rows = np.clip(np.asarray(rows, dtype=np.int64), 0, self.rows - 1)
        bins = self._bins(np.asarray(scores, dtype=np.float64))
        np.add.at(self.trials, (rows, bins), 1.0)
        np.add.at(self.hits, (rows, bins), np.asarray(accepted, dtype=np.float64))
        self._table = None


#: Bins of the drafter's marginal probability (finer near 0 and 1, where most candidates are).
DRAFT_EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0 + 1e-9)
#: Bins of a lookup branch's n-gram match length (1, 2, 3, 4+ tokens).
LOOKUP_EDGES = (0.5, 1.5, 2.5, 3.5, float("inf"))


# ----------------------------------------------------------------------------- the policy


def top_marginals(draft_logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most probable draft tokens per depth and their log-probabilities, ``[D, k]``
    numpy arrays as ``tree.build_ddtree`` takes them. A reduced draft vocabulary leaves -inf
    logits; those are never offered as tree nodes."""
    logprobs = torch.log_softmax(draft_logits.float(), dim=-1)
    k = min(k, int(torch.isfinite(logprobs[0]).sum()))
    values, tokens = torch.topk(logprobs, k, dim=-1)
    return values.cpu().numpy(), tokens.cpu().numpy()


#: Format of a saved calibration (``CostAwarePolicy.calibration_state``).
CALIBRATION_VERSION = 1
#: Smallest DDTree candidate pool, and the number of recent steps whose largest choice sizes it.
POOL_MIN, POOL_WINDOW = 16, 32
#: A lookup-only step whose best choice is n = 0 verifies its best candidate anyway once in this many.
EXPLORE_EVERY = 8


@dataclass
class StepPlan:
    """What one step verifies, and what the policy needs to learn from its outcome."""

    tree: DraftTree
    drafted: bool
    predicted_tokens: float
    predicted_seconds: float
    sources: np.ndarray  # per node of ``tree``
    draft_rows: np.ndarray  # per node: depth - 1 (drafter calibration row), -1 if not a drafter candidate
    draft_scores: np.ndarray  # per node: the drafter's marginal probability of the token
    lookup_rows: np.ndarray  # per node: branch offset - 1, -1 if not a lookup candidate
    lookup_scores: np.ndarray  # per node: n-gram length of the branch


@dataclass
class PolicyConfig:
    max_nodes: int = 64  # largest tree verified (draft nodes), and the DDTree candidate pool
    lookup: bool = True  # graft prompt-lookup branches into the tree
    lookup_tokens: int = 10  # longest lookup branch (transformers' default for prompt lookup)
    lookup_branches: int = 2
    max_ngram: int = 4
    max_backoff: int = 64  # longest run of steps without drafting before it is tried again
    min_draft_advantage: float = 1.0  # drafting must beat lookup/AR by this factor on average


class CostAwarePolicy:
    """Chooses each step's tree (see the module docstring); one instance serves many prompts
    and keeps what it learned. Calibration is kept per sampling temperature."""

    def __init__(self, costs: CostModel, config: PolicyConfig | None = None, block_size: int = 16) -> None:
        self.costs = costs
        self.config = config or PolicyConfig()
        if not 0 <= self.config.max_nodes <= 1023:
            raise DFlashInputError(f"max_nodes={self.config.max_nodes} must be in 0..1023")
        self.block_size = block_size
        self._calibrators: dict[float, tuple[Calibrator, Calibrator]] = {}
        self.temperature = 0.0
        self.advantage = 1.0  # running ratio: best rate with the draft / best rate without
        self.skip_left = 0
        self.backoff = 2
        self._undrafted_zero = 0  # lookup-only steps that chose n = 0 (every EXPLORE_EVERY-th explores)
        # DDTree pool size: twice the largest tree chosen lately (at least POOL_MIN), so a CPU that
        # verifies a few nodes does not rank 64 each step, and a growing choice can double per step.
        self._pool = self.config.max_nodes
        self._recent_sizes: list[int] = []
        #: Where ``save_calibration`` keeps what was learned for the next run (None: not kept).
        self.calibration_path: Path | None = None

    def describe(self) -> dict[str, Any]:
        return {"policy": "cost-aware DDTree + lookup branches", **asdict(self.config),
                "costs": self.costs.to_json()}

    def begin(self, temperature: float) -> None:
        self.temperature = float(temperature)

    def _calibration(self) -> tuple[Calibrator, Calibrator]:
        key = round(self.temperature, 3)
        if key not in self._calibrators:
            self._calibrators[key] = self._new_calibrators()
        return self._calibrators[key]

    def _new_calibrators(self) -> tuple[Calibrator, Calibrator]:
        return (Calibrator(max(self.block_size - 1, 1), DRAFT_EDGES, prior="identity"),
                Calibrator(self.config.lookup_tokens, LOOKUP_EDGES, prior=0.5))

    def calibration_state(self) -> dict[str, Any]:
        """What the calibrators learned, per temperature (JSON-ready)."""
        return {"version": CALIBRATION_VERSION, "block_size": self.block_size,
                "lookup_tokens": self.config.lookup_tokens,
                "temperatures": {f"{t:g}": {"draft": d.state(), "lookup": lk.state()}
                                 for t, (d, lk) in sorted(self._calibrators.items())}}

    def load_calibration(self, state: dict[str, Any]) -> int:
        """Restore :meth:`calibration_state`; returns how many temperatures were restored. A
        state made for another block size or lookup length, or damaged, restores nothing
        (ValueError): the calibration starts from the priors, as it would with no state."""
        if (state.get("version") != CALIBRATION_VERSION or state.get("block_size") != self.block_size
                or state.get("lookup_tokens") != self.config.lookup_tokens):
            raise ValueError("calibration made for another drafter shape or policy version")
        restored: dict[float, tuple[Calibrator, Calibrator]] = {}
        for key, parts in state["temperatures"].items():
            draft, lookup = self._new_calibrators()
            draft.load_state(parts["draft"])
            lookup.load_state(parts["lookup"])
            restored[round(float(key), 3)] = (draft, lookup)
        self._calibrators.update(restored)
        return len(restored)

    def save_calibration(self) -> None:
        """Write the calibration to ``calibration_path`` (set by ``default_policy(persist=True)``),
        atomically; a read-only cache directory is not an error (the next run starts afresh)."""
        if self.calibration_path is None or not self._calibrators:
            return
        try:
            self.calibration_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.calibration_path, self.calibration_state())
        except OSError:
            pass

    def wants_draft(self) -> bool:
        if self.skip_left > 0:
            self.skip_left -= 1
            return False
        return True

    def plan(self, root: int, draft_logits: Any | None, context: np.ndarray, max_depth: int) -> StepPlan:
        """The tree to verify after ``root`` (the newest token, last in ``context``); ``draft_logits``: the drafter's
        [block - 1, V] logits, or a draft that builds its own tree (DFlash2's ``SelectorDraft``)."""
        draft_cal, lookup_cal = self._calibration()
        pool, draft_marginal = self._drafter_pool(root, draft_logits, max_depth)
        draft_rows = np.full(pool.num_nodes, -1)
        draft_rows[1:] = np.asarray(pool.depths[1:]) - 1
        pool.conditional = [1.0] + draft_cal.predict(draft_rows[1:], draft_marginal[1:]).tolist()
        n_draft_pool = pool.num_nodes
        lookup_rows: dict[int, int] = {}
        lookup_scores: dict[int, int] = {}
        lookup_values: dict[int, float] = {}  # P(path accepted) by the lookup estimates alone
        if self.config.lookup and max_depth > 0:
            for branch in lookup_branches(context, min(max_depth, self.config.lookup_tokens), self.config.max_ngram,
                                          max_branches=self.config.lookup_branches):
                offsets = np.arange(len(branch.tokens))
                probs = lookup_cal.predict(offsets, np.full(len(offsets), branch.ngram))
                pool.add_branch(branch.tokens, probs.tolist(), LOOKUP)
                node = 0
                for k, (token, value) in enumerate(zip(branch.tokens, np.cumprod(probs).tolist())):
                    node = pool.children[node][int(token)]
                    lookup_rows.setdefault(node, k)
                    lookup_scores[node] = max(lookup_scores.get(node, 0), branch.ngram)
                    lookup_values[node] = max(lookup_values.get(node, 0.0), value)
        order, values = pool.ranked()
        drafted = draft_logits is not None
        n, tokens, seconds = self._best_size(values, drafted)
        if drafted:
            self._judge_drafting(np.sort(np.fromiter(lookup_values.values(), float))[::-1], tokens / seconds)
        if n == 0 and len(values) and (drafted or self._explore()):
            # Verify the best candidate anyway: a paid-for draft (or, now and then, a lookup
            # branch) that is never verified never gets a label, and a calibration that has
            # given up on a source could then never see it improve.
            n, tokens, seconds = 1, 1.0 + float(values[0]), self._step_seconds(1, drafted)
        self._recent_sizes = (self._recent_sizes + [n])[-POOL_WINDOW:]
        self._pool = max(POOL_MIN, 2 * max(self._recent_sizes))
        tree, kept = pool.select(order[:n])
        sources = np.asarray([pool.sources[i] for i in kept])
        return StepPlan(
            tree=tree, drafted=drafted, predicted_tokens=tokens, predicted_seconds=seconds, sources=sources,
            draft_rows=np.where(kept < n_draft_pool, draft_rows[np.minimum(kept, n_draft_pool - 1)], -1),
            draft_scores=np.where(kept < n_draft_pool, draft_marginal[np.minimum(kept, n_draft_pool - 1)], 0.0),
            lookup_rows=np.asarray([lookup_rows.get(int(i), -1) for i in kept]),
            lookup_scores=np.asarray([lookup_scores.get(int(i), 0) for i in kept]),
        )

    def _drafter_pool(self, root: int, draft_logits: Any | None,
                      max_depth: int) -> tuple[CandidateTree, np.ndarray]:
        """The drafter's candidate pool and each node's draft probability (the calibrator's score)."""
        budget = min(self.config.max_nodes, self._pool)
        if draft_logits is None or max_depth <= 0 or budget == 0:
            tree = build_ddtree(root, np.zeros((0, 0)), np.zeros((0, 0), dtype=np.int64), 0)
            return CandidateTree.from_tree(tree, [1.0], DRAFTER), np.ones(1)
        if getattr(draft_logits, "selects_tokens", False):
            # DFlash2: its own best-first tree (a child's probability depends on its parent's token), scored by
            # q(token | parent). Its path probabilities are products of those, as DDTree's are of marginals, so
            # the ranking below keeps every prefix of a chosen node, and the top path is the selector's chain.
            tree = draft_logits.build_tree(root, budget, max_depth)
            conditional = draft_logits.node_conditionals(tree)
            return CandidateTree.from_tree(tree, conditional, DRAFTER), conditional
        values, tokens = top_marginals(draft_logits[:max_depth], budget)
        tree = build_ddtree(root, values, tokens, budget)
        marginal = np.ones(tree.num_nodes)
        lookup = [dict(zip(row_t.tolist(), row_v.tolist())) for row_t, row_v in zip(tokens, values)]
        for i in range(1, tree.num_nodes):
            marginal[i] = np.exp(lookup[tree.depths[i] - 1][int(tree.tokens[i])])
        return CandidateTree.from_tree(tree, marginal, DRAFTER), marginal

    def _step_seconds(self, nodes: int | np.ndarray, drafted: bool) -> Any:
        verify = self.costs.verify_many(int(nodes) + 1) if np.ndim(nodes) == 0 else None
        base = self.costs.overhead_seconds + (self.costs.draft_seconds if drafted else 0.0)
        return float(base + verify[-1]) if verify is not None else base

    def _best_size(self, values: np.ndarray, drafted: bool) -> tuple[int, float, float]:
        """n maximising (1 + sum of the n best values) / predicted step time."""
        cap = min(len(values), self.config.max_nodes)
        tokens = 1.0 + np.concatenate([[0.0], np.cumsum(values[:cap])])
        seconds = self._step_seconds(np.zeros(0), drafted) + self.costs.verify_many(cap + 1)
        n = int(np.argmax(tokens / seconds))
        return n, float(tokens[n]), float(seconds[n])

    def _explore(self) -> bool:
        self._undrafted_zero += 1
        return self._undrafted_zero % EXPLORE_EVERY == 0

    def _judge_drafting(self, lookup_values: np.ndarray, rate: float) -> None:
        """Compare this step's best rate with what lookup branches alone (or AR) would give
        without the draft; after a run of losses, stop drafting for a while."""
        _, tokens, seconds = self._best_size(lookup_values, drafted=False)
        self.advantage = 0.7 * self.advantage + 0.3 * rate / (tokens / seconds)
        if self.advantage < self.config.min_draft_advantage:
            self.skip_left = self.backoff
            self.backoff = min(self.backoff * 2, self.config.max_backoff)
            self.advantage = 1.0  # judged afresh when drafting resumes
        else:
            self.backoff = 2

    def observe(self, plan: StepPlan, choices: np.ndarray, seconds: dict[str, float]) -> None:
        """Learn from a verified step: ``choices[i]`` is the target's token after node i."""
        tree = plan.tree
        if tree.num_nodes > 1:
            nodes = np.arange(1, tree.num_nodes)
            accepted = np.asarray(choices)[tree.parents[1:]] == tree.tokens[1:]
            draft_cal, lookup_cal = self._calibration()
            d = nodes[plan.draft_rows[1:] >= 0]
            if d.size:
                draft_cal.update(plan.draft_rows[d], plan.draft_scores[d], accepted[d - 1])
            lk = nodes[plan.lookup_rows[1:] >= 0]
            if lk.size:
                lookup_cal.update(plan.lookup_rows[lk], plan.lookup_scores[lk], accepted[lk - 1])
        self.costs.observe_verify(tree.num_nodes, seconds["verify"])
        if plan.drafted:
            self.costs.observe_draft(seconds["draft"])
        self.costs.observe_overhead(seconds["other"])
