"""The graph-ready decode path: every step a fixed-shape function of static buffers, CUDA graphs on CUDA.

One step, for a tree of ``n`` nodes (``n`` fixed per graph: the chain's block, a DDTree budget + 1,
or 1 for plain AR), in four stages, each captured as its own CUDA graph per size (on CPU the
same functions run eagerly: one implementation):

    draft       the drafter's block after the root                  -> logits [B, D, Vd]
    tree_build  chain (top-1 per depth) or DDTree (best-first, on the device, device_tree.py); the
                cost-aware tree also grafts prompt-lookup branches found in a static token
                history (device_lookup.py)                           -> tokens, depths, parents, visibility
    verify      the target over the tree, ancestor-only mask         -> the target's choice at every node
    commit      walk from the root (on the device), KV compaction, drafter context, next root

Nothing inside a step reads a device value on the host. The host learns what a step committed
from **one** device-to-host copy of ``[count, tokens...]`` per step, which it needs anyway for
streaming and stop tokens; what the next step needs (its depth limit) it writes to the device
before the launch, which does not wait for the device.

The committed tokens are the target's own choices at accepted nodes, exactly as in
:mod:`tensorrt_llm_dflash.decode`: greedy output equals the target's greedy output, sampled
output follows its distribution (inverse-CDF sampling from one uniform per node, drawn outside
the graph so that replays stay deterministic under a seed).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .decode import STAGES, GenerationResult, GenerationStats, OutputStream, _single_prompt
from .device_lookup import Grafted, graft_device, lookup_device
from .device_policy import POLICY_BUCKETS, DevicePolicy
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
from .policy import PolicyConfig
from .sampling import SamplingParams, processed_probs
from .static_state import StaticDrafter, StaticTarget
from .target import check_prompt_fits
from .tree import validate_budget

STEP_STAGES = ("draft", "tree_build", "verify", "commit")
#: Capacity granularity: a longer request re-allocates (and re-captures) in steps of this many slots.
CAPACITY_STEP = 256


def tree_size(proposer: StaticDrafter | None, budget: int | None) -> int:
    """Nodes (root included) of the first graph a run needs: 1 for AR, the block for the chain, budget + 1,
    and for the cost-aware policy (budget None) the size it starts from."""
    if proposer is None:
        return 1
    if budget is None:
        return POLICY_START
    return proposer.block_size if budget == 0 else budget + 1


#: The cost-aware policy's first tree size, before any step has told it better.
POLICY_START = 16


@dataclass
class _Graphs:
    """Per tree size: the captured stage graphs and the tensors they read and write."""

    graphs: dict[str, Any] = field(default_factory=dict)
    live: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


class GraphedDecoder:
    """Speculative (or AR) decoding with static state; on CUDA each stage replays a CUDA graph.

    ``budget`` 0 is the DFlash chain, B >= 1 a DDTree of B nodes, None the cost-aware tree on the
    device (:mod:`.device_policy`: one graph per size in ``policy_buckets``, its step costs measured
    after capture unless ``policy_costs`` gives them; with ``lookup``, prompt-lookup branches as the
    eager default grafts them, :class:`~.policy.PolicyConfig`'s lengths); without a drafter every step is one token
    (the graphed AR baseline). ``drafter`` is a :class:`DFlashDraftModel` (run by
    :class:`StaticDrafter`), or any object whose ``static_proposer(model, capacity, batch)``
    returns one of the same interface (``block_size``, ``draft_ids``, ``target_layer_ids``,
    ``extend``, ``draft``). ``use_graphs`` defaults to True on CUDA and is always
    False on the CPU, where the same stage functions run eagerly.

    What the policy learned survives a re-capture (a new sampling setting, a larger capacity): the
    throwaway steps of warm-up and timing never teach it, and a larger static state takes over its
    tables. Its step costs are timed per sampling cost class (:meth:`_cost_key`) and per capacity.
    """

    def __init__(self, target_model: Any, drafter: Any | None = None, *, budget: int | None = 0,
                 use_graphs: bool | None = None, batch: int = 1, capacity: int = CAPACITY_STEP,
                 policy_buckets: Sequence[int] = POLICY_BUCKETS, policy_costs: Sequence[float] | None = None,
                 lookup: bool = True) -> None:
        self.model = target_model
        self.lookup_config = PolicyConfig(lookup=bool(lookup))
        self.drafter_model = drafter
        self.budget = None if budget is None else validate_budget(budget)
        self.policy_buckets = tuple(policy_buckets)
        self.policy_costs = None if policy_costs is None else [float(c) for c in policy_costs]
        self.batch = batch
        self.device = target_model.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise DFlashInputError(f"use_graphs=True needs a CUDA device, the target is on {self.device}")
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.policy: DevicePolicy | None = None
        self._allocate(capacity)

    # ------------------------------------------------------------------ state

    def _allocate(self, capacity: int) -> None:
        """(Re)build the static state for ``capacity`` slots (rounded up to ``CAPACITY_STEP``, and at least one
        step's writes from an empty state, which warm-up and timing steps make). Graphs and step costs are
        per state (attention spans the capacity); the policy's learned tables carry over."""
        capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        learned = self.policy.state() if self.policy is not None else None
        self.proposer: Any = None
        if isinstance(self.drafter_model, DFlashDraftModel):
            self.proposer = StaticDrafter(self.drafter_model, self.model.get_input_embeddings(),
                                          self.model.get_output_embeddings(), capacity, self.batch)
        elif self.drafter_model is not None:  # a proposer of the same interface (tests script one)
            self.proposer = self.drafter_model.static_proposer(self.model, capacity, self.batch)
        layer_ids = list(self.proposer.target_layer_ids) if self.proposer is not None else []
        self.target = StaticTarget(self.model, layer_ids, capacity, self.batch)
        self.nodes = tree_size(self.proposer, self.budget)
        self.path_width = self.proposer.block_size if self.proposer is not None else 1
        b, dev = self.batch, self.device
        self.policy = None
        if self.budget is None and self.proposer is not None:
            self.policy = DevicePolicy(self.proposer.block_size - 1, self.policy_buckets, dev,
                                       lookup_rows=self.lookup_config.lookup_tokens)
            if learned is not None:  # same drafter, same buckets: same table shapes
                self.policy.load_state(learned)
            if self.nodes not in self.policy.buckets:
                self.nodes = self.policy.buckets[len(self.policy.buckets) // 2]
        self.lookup = self.policy is not None and self.lookup_config.lookup
        #: Prompt and committed tokens (the root last, at ``past``), what lookup searches; one spare column
        #: takes the writes of a step's unused slots.
        self.history = torch.zeros(b, capacity + 1, dtype=torch.long, device=dev)
        self.past = torch.zeros(b, dtype=torch.long, device=dev)
        self.root = torch.zeros(b, dtype=torch.long, device=dev)
        self.max_depth = torch.zeros(b, dtype=torch.long, device=dev)
        largest = self.policy.buckets[-1] if self.policy is not None else self.nodes
        self.uniforms = torch.zeros(b, largest, dtype=torch.float64, device=dev)
        #: What the host copies once per step: [count, committed tokens (padded), next tree size's index,
        #: committed tokens that only a lookup branch proposed].
        self.out = torch.zeros(b, 3 + self.path_width, dtype=torch.long, device=dev)
        #: Measured step costs per sampling cost class (``_cost_key``), for this state's capacity.
        self._costs: dict[tuple, list[float]] = {}
        self._events: list[Any] = []
        self._pending_timing: tuple[list[str], dict[str, float]] | None = None
        self.sampling = SamplingParams()
        self._graphs: dict[tuple, _Graphs] = {}
        self._pool: Any = None
        if self.span > capacity:  # a tree or block larger than the rounded capacity: one more round
            self._allocate(self.span)

    @property
    def capacity(self) -> int:
        return self.target.capacity

    @property
    def span(self) -> int:
        """Slots after ``past`` that one step writes: the verified tree (``past + i`` for its largest size) and
        the compaction, which writes ``past + arange(path_width)`` (the block) whatever the tree's size."""
        return max(max(self.sizes()), self.path_width)

    def capacity_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Slots a request needs: a step starts at ``past <= prompt_len + max_new_tokens - 2`` (the prefill's
        token and at least one more are out before the last step) and writes ``span`` slots from there."""
        return prompt_len + max_new_tokens + self.span

    def reserve(self, prompt_len: int, max_new_tokens: int) -> None:
        """Grow the static state (and so re-capture) if a request of this size would not fit."""
        needed = self.capacity_needed(prompt_len, max_new_tokens)
        if needed > self.capacity:
            self._allocate(needed)

    # ------------------------------------------------------------------ stages

    def _draft(self, _: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.proposer is None:
            return {}
        return {"logits": self.proposer.draft(self.root, self.past)}

    def _tree_build(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        extra: dict[str, torch.Tensor] = {}
        if self.proposer is None:
            tree = build_chain_device(self.root, self.root[:, None][:, :0], self.max_depth, size=1)
        else:
            logits = live["logits"]
            ids = self.proposer.draft_ids
            if self.policy is not None:
                pool_nodes = self.policy.pool_nodes
                k = min(pool_nodes, logits.shape[-1])
                values, index = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
                tokens = index if ids is None else ids[index]
                pool = build_ddtree_device(self.root, values, tokens, pool_nodes, self.max_depth)
                candidates = Grafted(pool, self.policy.draft_conditional(pool), torch.zeros_like(pool.valid))
                depth = logits.shape[1]
                if self.lookup:
                    config = self.lookup_config
                    branches = lookup_device(self.history, self.past + 1, config.lookup_tokens, self.max_depth,
                                             config.max_ngram, max_branches=config.lookup_branches)
                    candidates = graft_device(pool, candidates.cond, branches, self.policy.lookup_conditional(branches))
                    extra["ngram"] = branches.ngram
                    depth = max(depth, config.lookup_tokens)
                path_values = self.policy.path_values(candidates, depth)
                chosen = self.policy.select(candidates, path_values, self.nodes)
                tree = chosen.tree
                extra.update(next_bucket=self.policy.next_bucket(path_values), cond=chosen.cond,
                             on_branch=chosen.on_branch)
            elif self.budget == 0:
                top1 = logits.argmax(-1)
                tokens = top1 if ids is None else ids[top1]
                tree = build_chain_device(self.root, tokens, self.max_depth, size=self.nodes)
            else:
                k = min(self.budget, logits.shape[-1])
                values, index = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
                tokens = index if ids is None else ids[index]
                tree = build_ddtree_device(self.root, values, tokens, self.budget, self.max_depth)
                tree = pad_tree(tree, self.nodes)
        return {"tokens": tree.tokens, "parents": tree.parents, "depths": tree.depths, "valid": tree.valid,
                "num_nodes": tree.num_nodes, "scores": tree.scores, "visible": visibility_device(tree), **extra}

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        if self.sampling.greedy:
            return logits.argmax(-1)
        probs = processed_probs(logits, self.sampling).to(torch.float64)
        cdf = probs.cumsum(-1)
        draw = self.uniforms[:, : logits.shape[1], None] * cdf[..., -1:]
        return torch.searchsorted(cdf, draw, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)

    def _verify(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = live["tokens"].clamp(min=0)  # padding nodes (token -1) read a real row; nothing accepts them
        logits, features = self.target.verify(ids, live["depths"], live["visible"], self.past)
        out = {"choices": self._choose(logits)}
        if features is not None:
            out["features"] = features
        return out

    def _commit(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tree = DeviceTree(tokens=live["tokens"], parents=live["parents"], depths=live["depths"],
                          valid=live["valid"], num_nodes=live["num_nodes"], scores=live["scores"])
        path, length, bonus = walk_device(tree, live["choices"], self.path_width)
        self.target.cache.compact(self.past, path)
        if self.proposer is not None and "features" in live:
            features = live["features"].gather(1, path[:, :, None].expand(-1, -1, live["features"].shape[-1]))
            self.proposer.extend(features, self.past)
        # Committed this step: the accepted draft tokens, then the bonus (the target's choice after the last).
        accepted = tree.tokens.gather(1, path)[:, 1:]
        slot = torch.arange(self.path_width, device=self.device)[None]
        shifted = torch.cat([accepted, bonus[:, None]], dim=1)  # [B, P]
        committed = torch.where(slot == (length - 1)[:, None], bonus[:, None], shifted)
        next_bucket = live.get("next_bucket", torch.zeros_like(length))
        in_path = (slot > 0) & (slot < length[:, None])  # the accepted draft nodes
        if "on_branch" in live:
            lookup_only = live["on_branch"] & ~torch.isfinite(tree.scores)  # no drafter score: a lookup node only
            lookup_count = (lookup_only.gather(1, path) & in_path).sum(1)
        else:
            lookup_count = torch.zeros_like(length)
        self.out.copy_(torch.cat([length[:, None], committed, next_bucket[:, None], lookup_count[:, None]], dim=1))
        if self.policy is not None:
            self.policy.learn(Grafted(tree, live["cond"], live["on_branch"]), live["choices"], live.get("ngram"))
        # The history gains the committed tokens after the root (at past): slots past the count go to the spare column.
        spare = self.history.shape[1] - 1
        where = torch.where(slot < length[:, None], self.past[:, None] + 1 + slot, spare).clamp(max=spare)
        self.history.scatter_(1, where, committed)
        self.past.add_(length)
        self.root.copy_(bonus)
        return {}

    def _stage_fns(self) -> list[tuple[str, Callable[[dict], dict]]]:
        # AR drafts nothing: a draft stage would capture an empty CUDA graph (a warning on every capture).
        draft = [("draft", self._draft)] if self.proposer is not None else []
        return [*draft, ("tree_build", self._tree_build), ("verify", self._verify), ("commit", self._commit)]

    @contextlib.contextmanager
    def _scratch(self) -> Iterator[Callable[[], None]]:
        """Throwaway steps (capture warm-up, cost timing): yields ``reset``, which puts the step state back to an
        empty cache (``past`` 0, the current size's full depth) so that no step writes past the capacity,
        whatever the last request left. The policy's learned tables are restored afterwards: these steps verify
        trees of stale or arbitrary state, and would otherwise feed them to ``policy.learn``.
        Everything else they touch (cache, history, drafter context) the next prefill makes valid again."""
        saved = self.policy.state() if self.policy is not None else None

        def reset() -> None:
            self.past.zero_()
            self.max_depth.fill_(self.nodes - 1)

        reset()
        try:
            yield reset
        finally:
            self.past.zero_()
            if saved is not None:
                self.policy.load_state(saved)

    def _warm_up(self, steps: int = 2) -> None:
        """Eager steps of the current size from an empty state (what a capture runs first, on its side stream)."""
        with torch.inference_mode(), self._scratch() as reset:
            for _ in range(steps):
                reset()
                live: dict[str, torch.Tensor] = {}
                for _, fn in self._stage_fns():
                    live.update(fn(live))

    # ------------------------------------------------------------------ graphs

    def _key(self) -> tuple:
        return (self.nodes, self.sampling.greedy, self.sampling.top_k, self.sampling.top_p,
                self.sampling.temperature if not self.sampling.greedy else 0.0)

    def _cost_key(self) -> tuple:
        """What a step's cost depends on in the sampling settings: greedy takes an argmax per node, sampled
        verify a full-vocabulary softmax (top-k: a topk, top-p: a sort) per node. Temperature and seed cost
        nothing extra, so they share a curve (their graphs still differ: the temperature is baked in)."""
        if self.sampling.greedy:
            return ("greedy",)
        return ("sampled", self.sampling.top_k, self.sampling.top_p)

    def _capture(self) -> _Graphs:
        """Warm up (2 eager steps on a side stream, from an empty state), then capture each stage; state is reset
        by the next prefill."""
        captured = _Graphs()
        start = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._warm_up()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # One memory pool for every size's graphs: only one size replays at a time, and the tensors a later
        # stage reads stay referenced in ``captured.live``, so no capture can reuse their memory.
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        pool = self._pool
        live = {}
        with torch.inference_mode():
            for name, fn in self._stage_fns():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    produced = fn(live)
                live.update(produced)
                captured.graphs[name] = graph
                captured.live[name] = produced
        torch.cuda.synchronize(self.device)
        self.past.zero_()
        self.capture_seconds += time.perf_counter() - start
        self.capture_bytes += torch.cuda.memory_allocated(self.device) - before
        return captured

    def sizes(self) -> tuple[int, ...]:
        """Every tree size this decoder runs (one graph each)."""
        return self.policy.buckets if self.policy is not None else (self.nodes,)

    # Inference mode: a generate() that grew the capacity allocated the state under it, and inference tensors
    # take in-place updates (warm-up, timing, the policy's costs) only inside it.
    @torch.inference_mode()
    def prepare(self, sampling: SamplingParams | None = None) -> None:
        """Capture every size's graphs for ``sampling`` (default: the current setting) now, instead of at the first
        step; with the policy, also measure each size's step time (its cost curve) for this sampling cost class,
        unless ``policy_costs`` gave it. The policy's learned tables are left as they were."""
        if sampling is not None:
            self.sampling = sampling
        current = self.nodes
        try:
            for size in self.sizes():
                self.nodes = size
                if self.use_graphs and self._key() not in self._graphs:
                    self._graphs[self._key()] = self._capture()
            if self.policy is not None:
                key = self._cost_key()
                if key not in self._costs:
                    self._costs[key] = self.policy_costs or [self._time_step(size) for size in self.sizes()]
                self.policy.set_costs(self._costs[key])
        finally:
            self.nodes = current

    @torch.inference_mode()
    def _time_step(self, size: int, repeats: int = 5) -> float:
        """Median seconds of one step of ``size`` nodes (graph replay on CUDA) on throwaway state."""
        self.nodes = size
        samples = []
        with self._scratch() as reset:
            for rep in range(repeats + 1):
                reset()
                self.synchronize()
                start = time.perf_counter()
                self._run_step(None)
                self.synchronize()
                if rep:
                    samples.append(time.perf_counter() - start)
        return sorted(samples)[len(samples) // 2]

    @torch.inference_mode()
    def time_stages(self, size: int, repeats: int = 5) -> dict[str, float]:
        """Median milliseconds per stage of one step of ``size`` nodes (CUDA events between graph replays on CUDA,
        wall time on the CPU) on throwaway state, as :meth:`generate` times them; a profiling aid."""
        current, self.nodes = self.nodes, size
        samples: dict[str, list[float]] = {}
        try:
            with self._scratch() as reset:
                for rep in range(repeats + 1):
                    reset()
                    seconds = dict.fromkeys((name for name, _ in self._stage_fns()), 0.0)
                    self._run_step(seconds)
                    self.synchronize()
                    self._collect_stage_times()
                    if rep:
                        for name, value in seconds.items():
                            samples.setdefault(name, []).append(1000.0 * value)
        finally:
            self.nodes = current
        return {name: sorted(values)[len(values) // 2] for name, values in samples.items()}

    def _run_step(self, stage_seconds: dict[str, float] | None) -> None:
        if self.use_graphs:
            if self._key() not in self._graphs:
                self._graphs[self._key()] = self._capture()
            captured = self._graphs[self._key()]
            names = [name for name, _ in self._stage_fns()]
            if stage_seconds is None:
                for name in names:
                    captured.graphs[name].replay()
                return
            # Events between the replays time each stage on the device; read after the step's copy.
            events = self._events or [torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)]
            self._events = events
            events[0].record()
            for i, name in enumerate(names):
                captured.graphs[name].replay()
                events[i + 1].record()
            self._pending_timing = (names, stage_seconds)
            return
        live: dict[str, torch.Tensor] = {}
        for name, fn in self._stage_fns():
            start = time.perf_counter()
            live.update(fn(live))
            if stage_seconds is not None:
                stage_seconds[name] += time.perf_counter() - start

    # ------------------------------------------------------------------ the loop

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """One step on the device (no host read); returns the device buffer ``[B, 1 + P]`` it wrote."""
        self._run_step(None)
        return self.out

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                 stop_token_ids: Sequence[int] = (), on_tokens: Callable[[list[int]], None] | None = None,
                 generator: torch.Generator | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` for one prompt; same contract as ``decode.speculative_generate``."""
        sampling = sampling or SamplingParams()
        prompt = _single_prompt(prompt_ids)
        check_prompt_fits(len(prompt), max_new_tokens, self.target.max_positions)
        bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
        if bad:
            raise DFlashInputError(
                f"prompt token ids {bad[:5]} are outside the target vocabulary 0..{self.target.vocab_size - 1}")
        self.reserve(len(prompt), max_new_tokens)
        if generator is None and not sampling.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        self.prepare(sampling)
        stops = {int(t) for t in stop_token_ids}
        stats = GenerationStats()
        stats.stage_seconds = dict.fromkeys(STAGES, 0.0)
        output = OutputStream(max_new_tokens, stops, on_tokens)
        emit = output.emit

        t0 = time.perf_counter()
        ids = torch.tensor([prompt] * self.batch, dtype=torch.long, device=self.device)
        last_logits, features = self.target.prefill(ids)
        self.past.fill_(len(prompt))
        self.history[:, : len(prompt)] = ids
        if self.proposer is not None and features is not None:
            self.proposer.extend(features, torch.zeros_like(self.past))
        if not sampling.greedy:
            self.uniforms[:, :1].uniform_(generator=generator)
        self.root.copy_(self._choose(last_logits[:, None])[:, 0])
        self.history[:, len(prompt)] = self.root
        done = emit([int(self.root[0].item())])  # the prefill's one copy
        stats.stage_seconds["prefill"] = time.perf_counter() - t0
        past = len(prompt)
        while not done:
            depth = min(max_new_tokens - len(output), self.target.max_positions - 1 - past, self.nodes - 1)
            self.max_depth.fill_(depth)
            if not sampling.greedy:
                self.uniforms.uniform_(generator=generator)
            self._run_step(stats.stage_seconds)
            result = self.out[0].tolist()  # the step's one device-to-host copy
            self._collect_stage_times()
            count = result[0]
            stats.steps += 1
            stats.acceptance_lengths.append(count)
            stats.tree_sizes.append(self.nodes)
            if self.policy is not None:
                self.nodes = self.policy.buckets[result[1 + self.path_width]]
                stats.lookup_tokens += result[2 + self.path_width]
            past += count
            done = emit(result[1 : 1 + count])
        self.synchronize()
        stats.total_seconds = time.perf_counter() - t0
        stats.new_tokens = len(output)
        return GenerationResult(output_ids=output.tokens, stats=stats, finish_reason=output.finish_reason())

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
