"""Several prompts through one DFlash engine in one step loop.

``EngineBatch`` drives a :class:`~.runner.DFlashEngineTarget` of R rows (R <= the engine's
``--max_batch_size``). Each row runs exactly what ``decode.speculative_generate`` runs for one
prompt, in the same order and with its own draws: prefill, first token, then per step its
own draft (the engine's previous pass), its own tree (chain, DDTree of the budget, or a DFlash2
tree), the target's choices, the walk or the DFlash2 rejection sampling, commit, its own stop
condition. What rows share is the engine pass: one context pass for the prompts admitted together
(as many as the engine's ``max_num_tokens`` takes), and one generation pass per step that verifies
every active row's tree at once (the trees packed by their sizes, ``tree.batched_tree_inputs``).
So a row's tokens are the ones ``speculative_generate`` gives for its prompt on the same engine,
whatever the other rows do (tested: ``tests/test_trtllm_batch.py``).

Rows are engine rows ``0 .. n-1`` in admission order; a pass covers consecutive rows, so when a
row leaves (``release``, at a step boundary) the last row moves into its place
(``DFlashEngineTarget.move_row``) and a waiting prompt is prefilled into row ``n`` at the next
admission. ``generate`` runs a list of prompts that way (continuous batching); the server's
``BatchRunner`` (``serve_runner.py``) uses ``admit`` / ``step`` / ``release`` directly.

The cost-aware tree is not run here: it prices a one-row step (``policy.py``); a batch takes a
fixed ``ddtree_budget`` (0 = the chain).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..decode import GenerationResult, GenerationStats, OutputStream, draft_tree
from ..errors import DFlashInputError
from ..sampling import SamplingParams, TokenDraws, choose_tokens, make_draws
from ..target import check_prompt_fits
from ..tree import DraftTree, build_chain, validate_budget, walk
from .runner import DFlashEngineTarget


@dataclass
class BatchRequest:
    """One prompt for an :class:`EngineBatch` (the arguments of ``speculative_generate`` that are per prompt)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: Sequence[int] = ()
    #: The row's own draws at T > 0; None: ``sampling.make_draws`` (keyed by ``sampling.seed``), as
    #: ``speculative_generate`` makes them.
    draws: TokenDraws | None = None


@dataclass(eq=False)
class BatchRow:
    """The host side of one admitted prompt: what ``speculative_generate`` keeps in its locals."""

    request: BatchRequest
    draws: TokenDraws | None
    #: A DFlash2 chain's own draws at T > 0 (a generator of the row's seed, as ``speculative_generate`` makes it).
    generator: torch.Generator | None
    output: OutputStream
    stats: GenerationStats
    started: float
    root: int = 0
    #: Committed tokens (prompt included) in the row's KV cache.
    past: int = 0
    done: bool = False

    def result(self) -> GenerationResult:
        return GenerationResult(output_ids=list(self.output.tokens), stats=self.stats,
                                finish_reason=self.output.finish_reason())


class EngineBatch:
    """The step loop of up to ``target.rows`` prompts on one engine (module docstring)."""

    def __init__(self, target: DFlashEngineTarget, ddtree_budget: int = 0) -> None:
        self.target = target
        self.budget = validate_budget(ddtree_budget)
        if self.budget > target.max_draft_len:
            raise DFlashInputError(f"ddtree_budget={self.budget} exceeds the engine's max_draft_len="
                                   f"{target.max_draft_len}")
        #: Engine row i runs ``active[i]``.
        self.active: list[BatchRow] = []

    @property
    def rows(self) -> int:
        return self.target.rows

    @property
    def free_rows(self) -> int:
        return self.target.rows - len(self.active)

    def check(self, request: BatchRequest) -> None:
        """What ``speculative_generate`` checks before it starts, and what one context pass takes."""
        target = self.target
        n = len(request.prompt_ids)
        check_prompt_fits(n, request.max_new_tokens, target.max_positions, target.max_positions_name)
        target.check_prompt_len(n)
        bad = [t for t in request.prompt_ids if not 0 <= t < target.vocab_size]
        if bad:
            raise DFlashInputError(f"prompt token ids {bad[:5]} are outside the target vocabulary "
                                   f"0..{target.vocab_size - 1}")

    # ------------------------------------------------------------------ admission
    def admit(self, requests: Sequence[BatchRequest]) -> list[BatchRow]:
        """Prefill ``requests`` into the next free rows (context passes of at most ``max_num_tokens`` tokens)
        and choose each one's first token. A request that cannot run is refused before any pass."""
        if len(requests) > self.free_rows:
            raise DFlashInputError(f"{len(requests)} prompts for {self.free_rows} free rows of {self.rows}")
        for request in requests:
            self.check(request)
        admitted: list[BatchRow] = []
        group: list[BatchRequest] = []
        for request in requests:
            if group and sum(len(r.prompt_ids) for r in group) + len(request.prompt_ids) > self.target.max_num_tokens:
                admitted += self._prefill(group)
                group = []
            group.append(request)
        if group:
            admitted += self._prefill(group)
        return admitted

    def _prefill(self, requests: list[BatchRequest]) -> list[BatchRow]:
        start = time.perf_counter()
        rows = []
        for request in requests:
            sampling = request.sampling
            draws = request.draws if request.draws is not None else make_draws(sampling)
            generator = draws.generator(self.target.device) if draws is not None else None
            rows.append(BatchRow(request, draws, generator, OutputStream(request.max_new_tokens,
                                                                  {int(t) for t in request.stop_token_ids}, None),
                                 GenerationStats(), start))
        first = len(self.active)
        logits = self.target.prefill_rows(range(first, first + len(rows)), [r.prompt_ids for r in requests])
        self.active += rows
        for row, last_logits in zip(rows, logits):
            row.root = int(choose_tokens(last_logits[None], row.request.sampling, row.draws,
                                         [len(row.request.prompt_ids)])[0])
            row.past = len(row.request.prompt_ids)
            row.done = row.output.emit([row.root])
        spent = time.perf_counter() - start
        for row in rows:
            row.stats.stage_seconds["prefill"] += spent
            self._finish_if_done(row)
        return rows

    # ----------------------------------------------------------------------- step
    def step(self) -> dict[BatchRow, list[int]]:
        """One engine pass verifying every active row's tree; the tokens each unfinished row committed (cut at
        its stop condition). A finished row that was not released yet rides along with its root alone and
        commits nothing (a pass covers consecutive rows)."""
        target = self.target
        if all(row.done for row in self.active):  # nothing to verify (no rows, or only finished ones)
            return {}
        trees: list[DraftTree] = []
        drafts: list[object] = []
        for i, row in enumerate(self.active):
            if row.done:
                trees.append(build_chain(row.root, []))
                drafts.append(None)
                continue
            request, stats = row.request, row.stats
            max_depth = min(request.max_new_tokens - len(row.output) - 1, target.max_positions - 1 - row.past)
            t0 = time.perf_counter()
            draft = target.take_draft(i, row.root)
            t1 = time.perf_counter()
            tree = draft_tree(row.root, draft, self.budget, min(max_depth, target.block_size - 1), request.sampling,
                              row.generator)
            t2 = time.perf_counter()
            trees.append(target.check_tree(tree))
            stats.stage_seconds["draft"] += t1 - t0
            stats.stage_seconds["tree_build"] += t2 - t1
            stats.stage_seconds["tree_compile"] += time.perf_counter() - t2
            drafts.append(draft)
        t0 = time.perf_counter()
        node_logits = target.verify_rows(range(len(self.active)), trees)
        shared = time.perf_counter() - t0
        committed: dict[BatchRow, list[int]] = {}
        for i, (row, tree, draft, logits) in enumerate(zip(self.active, trees, drafts, node_logits)):
            if draft is None:
                continue
            committed[row] = self._accept(i, row, tree, draft, logits, shared)
        return committed

    def _accept(self, i: int, row: BatchRow, tree: DraftTree, draft: object, logits: torch.Tensor,
                shared: float) -> list[int]:
        """The rest of ``speculative_generate``'s step for row ``i``: acceptance, commit, stats, stop."""
        request, stats = row.request, row.stats
        t0 = time.perf_counter()
        # A sampled DFlash2 chain is accepted by rejection sampling against its sparse draft distribution.
        accept = getattr(draft, "accept", None)
        accepted = accept(tree, logits, request.sampling, row.generator) if accept is not None else None
        if accepted is None:
            choices = choose_tokens(logits, request.sampling, row.draws, row.past + 1 + tree.depths).cpu().numpy()
            path, bonus = walk(tree, choices)
        else:
            path, bonus = accepted
        t1 = time.perf_counter()
        self.target.commit_row(i, path)
        stats.stage_seconds["verify"] += shared + t1 - t0
        stats.stage_seconds["commit"] += time.perf_counter() - t1
        stats.steps += 1
        stats.acceptance_lengths.append(len(path))
        stats.tree_sizes.append(tree.num_nodes)
        row.past += len(path)
        row.root = bonus
        before = len(row.output)
        row.done = row.output.emit([int(t) for t in np.asarray(tree.tokens)[path[1:]]] + [bonus])
        self._finish_if_done(row)
        return row.output.tokens[before:]

    def _finish_if_done(self, row: BatchRow) -> None:
        if row.done:
            row.stats.total_seconds = time.perf_counter() - row.started
            row.stats.new_tokens = len(row.output)

    # -------------------------------------------------------------------- release
    def release(self, row: BatchRow) -> None:
        """``row`` leaves the batch (at a step boundary): the last row takes its engine row."""
        index = next((i for i, r in enumerate(self.active) if r is row), None)
        if index is None:
            return
        last = len(self.active) - 1
        if index != last:
            self.target.move_row(last, index)
            self.active[index] = self.active[last]
        else:
            self.target.reset_row(last)
        self.active.pop()

    # ------------------------------------------------------------------ generate
    def finished(self, requests: Sequence[BatchRequest]) -> Iterator[tuple[int, GenerationResult]]:
        """Every request to its end, ``rows`` at a time: a finished row leaves at the step boundary and the
        next waiting request is prefilled into the freed row. Yields ``(index, result)`` as each request
        finishes. Every request is checked before the first pass."""
        for request in requests:
            self.check(request)
        waiting = deque(enumerate(requests))
        index_of: dict[BatchRow, int] = {}
        while waiting or self.active:
            taken = [waiting.popleft() for _ in range(min(self.free_rows, len(waiting)))]
            if taken:
                for (i, _), row in zip(taken, self.admit([request for _, request in taken])):
                    index_of[row] = i
            if any(not row.done for row in self.active):
                self.step()
            for row in [r for r in self.active if r.done]:
                self.release(row)
                yield index_of.pop(row), row.result()

    def generate(self, requests: Sequence[BatchRequest]) -> list[GenerationResult]:
        """``finished``, collected in request order."""
        results: list[GenerationResult | None] = [None] * len(requests)
        for i, result in self.finished(requests):
            results[i] = result
        return results  # type: ignore[return-value]


def in_request_order(finished: Iterable[tuple[int, GenerationResult]]) -> Iterator[GenerationResult]:
    """Results of ``EngineBatch.finished`` in request order, each as soon as it and every earlier one are done."""
    ready: dict[int, GenerationResult] = {}
    upcoming = 0
    for index, result in finished:
        ready[index] = result
        while upcoming in ready:
            yield ready.pop(upcoming)
            upcoming += 1


def run_prompts(target: DFlashEngineTarget, budget: int, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                sampling: SamplingParams, stop_token_ids: Sequence[int]) -> Iterator[GenerationResult]:
    """examples/run.py's prompts through one ``EngineBatch``: each prompt's result in prompt order, as it and
    every earlier prompt are done (each row with its own draws, keyed as ``speculative_generate`` keys them for
    that prompt alone)."""
    batch = EngineBatch(target, budget)
    requests = [BatchRequest(list(p), max_new_tokens, sampling, tuple(stop_token_ids)) for p in prompts]
    return in_request_order(batch.finished(requests))
