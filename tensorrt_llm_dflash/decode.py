"""The speculative decoding loop, shared by the PyTorch and TensorRT-LLM runtimes.

One step (stages as timed in the stats):

    draft         proposer.propose(root, new context)          -> B-1 marginals
    tree_build    chain (top-1 per depth) or DDTree (best-first)  -> DraftTree
    tree_compile  target.compile_tree(tree)                     -> ids, positions, mask
    verify        target.verify(compiled)                       -> logits, features per node
                  target's own choice at every node, walk from the root
    commit        target.commit(path); the path's features become draft context

With no proposer every step is a one-node tree: plain autoregressive decoding through
the same code. Every committed token is the target's own choice (argmax, or a sample
from the target's processed distribution), so greedy output equals greedy AR output
and sampled output follows the target's distribution.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from .errors import DFlashInputError
from .policy import CostAwarePolicy, top_marginals
from .sampling import SamplingParams, choose_tokens, make_draws
from .tree import DRAFTER, DraftTree, build_chain, build_ddtree, validate_budget, walk

STAGES = ("prefill", "draft", "tree_build", "tree_compile", "verify", "commit")


class TargetVerifier(Protocol):
    """Model execution of the target. Implemented with transformers and with TRT-LLM."""

    vocab_size: int
    max_positions: int
    device: torch.device

    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [V] at the last prompt position, features [P, F] (or None)."""

    def compile_tree(self, tree: DraftTree) -> Any:
        """Device inputs for verifying ``tree`` (ids, positions, mask)."""

    def verify(self, compiled: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [N, V] and features [N, F] for every tree node."""

    def commit(self, accepted_nodes: list[int]) -> None:
        """Keep only the accepted path in the KV cache, contiguous after the prefix."""

    def synchronize(self) -> None: ...


class DraftProposer(Protocol):
    block_size: int

    def reset(self) -> None: ...

    def propose(self, root_token: int, new_context: torch.Tensor) -> torch.Tensor:
        """Draft logits [block_size - 1, V] for the positions after ``root_token``."""


@dataclass
class GenerationStats:
    steps: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    new_tokens: int = 0
    total_seconds: float = 0.0
    # Cost-aware policy only (empty otherwise): per step, the expected tokens and seconds it
    # predicted, whether it drafted; and committed tokens that only a lookup branch proposed.
    predicted_tokens: list[float] = field(default_factory=list)
    predicted_seconds: list[float] = field(default_factory=list)
    drafted: list[bool] = field(default_factory=list)
    lookup_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "acceptance_lengths": list(self.acceptance_lengths),
            "mean_acceptance_length": self.mean_acceptance_length,
            "tree_sizes": list(self.tree_sizes),
            "stage_seconds": dict(self.stage_seconds),
            "new_tokens": self.new_tokens,
            "total_seconds": self.total_seconds,
            "tokens_per_second": self.tokens_per_second,
            "predicted_tokens": list(self.predicted_tokens),
            "predicted_seconds": list(self.predicted_seconds),
            "drafted": list(self.drafted),
            "lookup_tokens": self.lookup_tokens,
        }


@dataclass
class GenerationResult:
    output_ids: list[int]
    stats: GenerationStats
    finish_reason: str  # "stop" or "length"


class OutputStream:
    """The tokens a generation committed, cut where AR decoding would stop (both runtimes' loops use it)."""

    def __init__(self, max_new_tokens: int, stops: set[int], on_tokens: Callable[[list[int]], None] | None) -> None:
        self.tokens: list[int] = []
        self.max_new_tokens, self.stops, self.on_tokens = max_new_tokens, stops, on_tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def emit(self, tokens: list[int]) -> bool:
        """Append tokens up to a stop token or the length limit (streamed to ``on_tokens``); True when finished."""
        for i, token in enumerate(tokens):
            self.tokens.append(token)
            if token in self.stops or len(self.tokens) >= self.max_new_tokens:
                if self.on_tokens:
                    self.on_tokens(tokens[: i + 1])
                return True
        if self.on_tokens:
            self.on_tokens(tokens)
        return False

    def finish_reason(self) -> str:
        return "stop" if self.tokens and self.tokens[-1] in self.stops else "length"


class _Timer:
    def __init__(self, stats: GenerationStats, sync: Callable[[], None]) -> None:
        self.stats, self.sync = stats, sync

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.stats.stage_seconds[name] += time.perf_counter() - start


def draft_tree(root: int, draft_logits: torch.Tensor, budget: int, max_depth: int,
               sampling: SamplingParams | None = None, generator: torch.Generator | None = None) -> DraftTree:
    """Chain (budget 0) or DDTree from the drafter's marginals, at most ``max_depth`` deep.

    A draft that chooses its own tokens (DFlash2's selector, ``selects_tokens``) builds its own
    chain or tree; at T > 0 its chain draws from its sparse distribution (hence ``sampling``)."""
    if getattr(draft_logits, "selects_tokens", False):
        return draft_logits.build_tree(root, budget, max(max_depth, 0), sampling, generator)
    logits = draft_logits[:max_depth]
    if max_depth <= 0:
        return build_chain(root, [])
    if budget == 0:
        return build_chain(root, logits.argmax(-1).cpu().numpy())
    return build_ddtree(root, *top_marginals(logits, budget), budget)


def stop_ids(eos_token_id: Any) -> list[int]:
    """A model's or tokenizer's ``eos_token_id`` (None, one id, or a list of them) as the stop ids every runtime takes."""
    if eos_token_id is None:
        return []
    return [int(t) for t in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])]


def _single_prompt(prompt_ids: Any) -> list[int]:
    """A flat token list ([N], or one row of [1, N]: a list, numpy array or tensor of integers); a batch of more
    than one prompt, text, floats (which int() would truncate) and other shapes are refused by name."""
    if isinstance(prompt_ids, (str, bytes)):
        raise DFlashInputError("prompt_ids: got text; give token ids (encode it with the tokenizer first)")
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.cpu().numpy()
    if isinstance(prompt_ids, np.ndarray):
        if prompt_ids.ndim not in (1, 2) or (prompt_ids.size and not np.issubdtype(prompt_ids.dtype, np.integer)):
            raise DFlashInputError(f"prompt_ids: a {prompt_ids.ndim}-d array of {prompt_ids.dtype}; give token ids "
                                   f"as integers, shaped [N] or [1, N]")
    elif not hasattr(prompt_ids, "__len__"):
        raise DFlashInputError(f"prompt_ids: {type(prompt_ids).__name__}; give a list (or array) of token ids")
    rows = np.asarray(prompt_ids, dtype=object) if not isinstance(prompt_ids, np.ndarray) else prompt_ids
    if rows.ndim == 2 or (len(prompt_ids) and isinstance(prompt_ids[0], (list, tuple))):
        if len(prompt_ids) != 1:
            raise DFlashInputError(
                f"batch size {len(prompt_ids)} is not supported: the runtime decodes one prompt at a time"
            )
        prompt_ids = prompt_ids[0]
    ids = []
    for token in prompt_ids:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise DFlashInputError(f"prompt_ids: {token!r} is not a token id (an integer)")
        ids.append(int(token))
    return ids


def speculative_generate(
    target: TargetVerifier,
    proposer: DraftProposer | None,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    stop_token_ids: Sequence[int] = (),
    ddtree_budget: int = 0,
    on_tokens: Callable[[list[int]], None] | None = None,
    policy: CostAwarePolicy | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens for one prompt (batch size 1).

    ``ddtree_budget`` 0 is the DFlash chain; B >= 1 verifies a DDTree of B draft nodes.
    With a ``policy`` (:mod:`.policy`) the budget is ignored: each step verifies the tree
    the policy chooses (cost-aware size, lookup branches, drafting skipped when it does not
    pay). Generation ends right after a stop token, exactly where AR decoding would.
    """
    from .target import MAX_POSITIONS_NAME, check_prompt_fits

    sampling = sampling or SamplingParams()
    prompt = _single_prompt(prompt_ids)
    check_prompt_fits(len(prompt), max_new_tokens, target.max_positions,
                      getattr(target, "max_positions_name", MAX_POSITIONS_NAME))
    budget = validate_budget(ddtree_budget)
    bad = [t for t in prompt if not 0 <= t < target.vocab_size]
    if bad:
        raise DFlashInputError(f"prompt token ids {bad[:5]} are outside the target vocabulary 0..{target.vocab_size - 1}")
    stops = {int(t) for t in stop_token_ids}
    draws = make_draws(sampling)
    # A DFlash2 chain at T > 0 samples its own drafts (and tests them by rejection) from a generator of the seed's.
    generator = draws.generator(target.device) if draws is not None else None
    stats = GenerationStats()
    timer = _Timer(stats, target.synchronize)
    output = OutputStream(max_new_tokens, stops, on_tokens)
    emit = output.emit

    t0 = time.perf_counter()
    if proposer is not None:
        proposer.reset()
    with timer.stage("prefill"):
        last_logits, context = target.prefill(prompt)
        root = int(choose_tokens(last_logits[None], sampling, draws, [len(prompt)])[0])
    done = emit([root])
    past = len(prompt)
    history = np.asarray(prompt + [root], dtype=np.int64)  # what prompt lookup searches
    if policy is not None:
        policy.begin(sampling.temperature)
    while not done:
        # Never draft past the token budget (the accepted drafts and the bonus after them: one less) or the positions.
        max_depth = min(max_new_tokens - len(output) - 1, target.max_positions - 1 - past)
        step_start, before = time.perf_counter(), dict(stats.stage_seconds)
        plan = None
        if policy is not None:
            logits = None
            if proposer is not None and policy.wants_draft():
                with timer.stage("draft"):
                    logits = proposer.propose(root, context)
                context = context[:0] if context is not None else None
            with timer.stage("tree_build"):
                plan = policy.plan(root, logits, history, max_depth)
                tree = plan.tree
        elif proposer is not None:
            with timer.stage("draft"):
                logits = proposer.propose(root, context)
            with timer.stage("tree_build"):
                tree = draft_tree(root, logits, budget, min(max_depth, proposer.block_size - 1), sampling, generator)
        else:
            tree = build_chain(root, [])
        with timer.stage("tree_compile"):
            compiled = target.compile_tree(tree)
        with timer.stage("verify"):
            node_logits, features = target.verify(compiled)
            # A sampled DFlash2 chain is accepted by rejection sampling against its sparse draft
            # distribution (None otherwise: every node's own target choice, and the walk).
            accept = getattr(logits, "accept", None) if proposer is not None and policy is None else None
            accepted = accept(tree, node_logits, sampling, generator) if accept is not None else None
            if accepted is None:
                # Node n's choice is the token at index past + depth + 1: AR draws it from the same uniform.
                choices = choose_tokens(node_logits, sampling, draws, past + 1 + tree.depths).cpu().numpy()
                path, bonus = walk(tree, choices)
            else:
                path, bonus = accepted
        with timer.stage("commit"):
            target.commit(path)
            if features is not None:
                accepted = features[torch.as_tensor(path, device=features.device)]
                # A step without a draft leaves its features for the next draft to read.
                context = accepted if plan is None or context is None else torch.cat([context, accepted])
        if plan is not None:
            spent = {k: stats.stage_seconds[k] - before[k] for k in STAGES}
            spent["other"] = time.perf_counter() - step_start - spent["verify"] - spent["draft"]
            policy.observe(plan, choices, spent)
            stats.predicted_tokens.append(plan.predicted_tokens)
            stats.predicted_seconds.append(plan.predicted_seconds)
            stats.drafted.append(plan.drafted)
            stats.lookup_tokens += int(sum(plan.sources[i] & DRAFTER == 0 for i in path[1:]))
        stats.steps += 1
        stats.acceptance_lengths.append(len(path))
        stats.tree_sizes.append(tree.num_nodes)
        past += len(path)
        root = bonus
        new = [int(t) for t in tree.tokens[path[1:]]] + [bonus]
        history = np.concatenate([history, np.asarray(new, dtype=np.int64)])
        done = emit(new)
    stats.total_seconds = time.perf_counter() - t0
    stats.new_tokens = len(output)
    return GenerationResult(output_ids=output.tokens, stats=stats, finish_reason=output.finish_reason())
