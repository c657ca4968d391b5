"""The model side of the server: the narrow ``BatchRunner`` protocol, and its implementations.

The scheduler (:mod:`.engine`) knows nothing about trees, KV caches or CUDA graphs. It sees a
runner with ``max_batch`` rows (slots), admits a request into a free slot, calls ``step()`` for all
admitted rows at once, and releases a slot when its request is finished or its client has gone.
That is the whole contract, so the scheduler does not change when the runtime gains real batched
rows (issue 37, items 1-3) or when a TensorRT-LLM engine runner serves (item 5, ``--backend trt``).

* :class:`GraphedRunner` runs :class:`~tensorrt_llm_dflash.graphed.GraphedDecoder` at batch 1: one
  row. It reproduces ``GraphedDecoder.generate`` step by step (same prefill, same uniforms drawn in
  the same order), so a request's tokens are exactly what ``generate`` gives for that prompt
  (tested: ``tests/test_serve_runner.py``).
* :class:`RowStack` makes one runner of ``k`` rows out of ``k`` runners, stepping them one after the
  other. With batch-1 decoders that is time slicing, not batching: requests progress together and
  a waiting request starts sooner, but no forward pass is shared, so total tokens/s stay those of
  batch 1. It exists so that the scheduler's continuous batching (admission mid-run, retirement at
  step boundaries) runs, and is tested, before the batched decoder exists.

What a batched ``GraphedDecoder`` needs to offer for a one-decoder ``GraphedRunner`` of B rows is in
the docstring of :class:`GraphedRunner`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import DFlashInputError
from ..sampling import SamplingParams
from ..target import check_prompt_fits

#: The smallest decoder's capacity (prompt + output + one tree); bigger ones double it (GraphedRunner).
INITIAL_CAPACITY = 1024
#: A request starts in a decoder that holds its prompt and this many more tokens (all it asks for, if fewer).
GROWTH_TOKENS = 512


@dataclass(frozen=True)
class RowRequest:
    """What a runner needs to admit one request into a row."""

    prompt_ids: list[int]
    #: The most tokens the row may commit (prompt + this must fit the model's positions). The runner never
    #: drafts past it; the scheduler cuts the output there and at stop tokens and stop strings.
    max_new_tokens: int
    sampling: SamplingParams


@dataclass
class RowStep:
    """What one ``step()`` (or the admission's prefill) committed for one row."""

    tokens: list[int]
    #: Tree nodes verified for this row, root included (1 = a plain AR step); 0 for the prefill.
    tree_size: int = 0
    #: Committed tokens that only a prompt-lookup branch proposed (cost-aware tree with lookup).
    lookup_tokens: int = 0

    @property
    def is_prefill(self) -> bool:
        return self.tree_size == 0


@runtime_checkable
class BatchRunner(Protocol):
    """The model side of the server; every call comes from the engine's one thread.

    * ``admit(slot, row)``: start ``row`` in the free ``slot`` (0 <= slot < max_batch). The runner may
      prefill now or inside the next ``step()``; either way the prefill's token (the row's first) is
      reported by the next ``step()`` as a :class:`RowStep` with ``tree_size`` 0. Raises
      :class:`~tensorrt_llm_dflash.errors.DFlashInputError` for a request it cannot run (that request
      fails, nobody else is touched).
    * ``step()``: one step of every admitted row; ``{slot: RowStep}`` for each row that committed
      tokens. Rows are independent: what one row commits never depends on the others.
    * ``release(slot)``: the row is finished or its client is gone; the slot may be admitted again.
      Releasing a free slot is a no-op.
    """

    #: Rows (slots) the runner decodes together.
    max_batch: int
    #: Prompt + output positions one row may hold.
    max_model_len: int
    vocab_size: int
    #: One line for /v1/models, /metrics and the logs: what decodes ("cost-aware DDTree, graphed runtime").
    description: str

    def admit(self, slot: int, row: RowRequest) -> None: ...

    def step(self) -> dict[int, RowStep]: ...

    def release(self, slot: int) -> None: ...


def check_row(row: RowRequest, max_model_len: int, vocab_size: int) -> None:
    """The checks every runner makes at admission (the HTTP layer makes them first, with field names)."""
    check_prompt_fits(len(row.prompt_ids), row.max_new_tokens, max_model_len)
    bad = [t for t in row.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise DFlashInputError(f"prompt token ids {bad[:5]} are outside the target vocabulary 0..{vocab_size - 1}")


def row_generator(sampling: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The row's own generator (T > 0): a request's draws never depend on other requests."""
    if sampling.greedy:
        return None
    if sampling.seed is None:
        raise DFlashInputError("a sampled request needs a seed: the scheduler draws one when the client sends none")
    generator = torch.Generator(device=device)
    generator.manual_seed(int(sampling.seed))
    return generator


@dataclass
class _Row:
    row: RowRequest
    generator: torch.Generator | None
    #: Tokens committed so far (the prefill's included).
    produced: int = 0
    #: The prompt and every committed token (what a move to a bigger decoder prefills).
    tokens: list[int] = field(default_factory=list)
    #: The prefill's token, reported by the next step().
    pending: RowStep | None = None
    #: Committed tokens in the KV cache (the last committed token, the root, is not in it yet).
    past: int = 0


@dataclass
class DecoderSpec:
    """How to build a :class:`~tensorrt_llm_dflash.graphed.GraphedDecoder` (again, with more capacity)."""

    model: Any
    drafter: Any | None
    #: 0 = chain, B = DDTree of B nodes, None = the cost-aware tree on the device.
    budget: int | None
    lookup: bool = True
    policy_buckets: Sequence[int] | None = None
    #: The cost-aware tree's step seconds per tree size, given instead of measured (tests, or a curve measured
    #: before); None measures it when a decoder is built.
    policy_costs: Sequence[float] | None = None
    #: The cost-aware tree's measured step seconds per tree size, per capacity: measured once per
    #: capacity and shared by every row's decoder (rows of a RowStack would otherwise each measure it).
    costs_by_capacity: dict[int, list[float]] = field(default_factory=dict)

    def largest_tree(self) -> int:
        """Nodes (root included) of the largest tree a step may verify: the slots one step writes past ``past``."""
        from ..device_policy import POLICY_BUCKETS

        if self.drafter is None:
            return 1
        if self.budget is None:
            return max(self.policy_buckets or POLICY_BUCKETS)
        if self.budget == 0:
            config = getattr(self.drafter, "config", None)
            return int(getattr(self.drafter, "block_size", None) or config.block_size)
        return self.budget + 1

    def max_model_len(self) -> int:
        """The longest prompt + output a row can hold: the target's positions, and a capacity the static
        state accepts (it rounds capacity up to ``CAPACITY_STEP`` and refuses more than the target's
        positions + 256, while a step near the end writes one tree past the last position)."""
        from ..graphed import CAPACITY_STEP
        from ..target import max_positions

        positions = max_positions(self.model)
        largest_capacity = (positions + 256) // CAPACITY_STEP * CAPACITY_STEP
        return min(positions, largest_capacity - self.largest_tree() - 1)

    def build(self, capacity: int) -> Any:
        from ..graphed import CAPACITY_STEP, GraphedDecoder

        capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        kwargs: dict[str, Any] = {"budget": self.budget, "capacity": capacity, "lookup": self.lookup,
                                  "policy_costs": self.policy_costs or self.costs_by_capacity.get(capacity)}
        if self.policy_buckets is not None:
            kwargs["policy_buckets"] = tuple(self.policy_buckets)
        decoder = GraphedDecoder(self.model, self.drafter, **kwargs)
        decoder.prepare()  # graphs captured (CUDA) and the cost curve measured now, not in a request
        if decoder.policy is not None:
            self.costs_by_capacity.setdefault(capacity, [float(c) for c in decoder.policy.costs.tolist()])
        return decoder


def describe_decoder(budget: int | None, speculative: bool, lookup: bool) -> str:
    if not speculative:
        return "autoregressive, graphed runtime"
    if budget is None:
        return "cost-aware DDTree" + (" with lookup branches" if lookup else "") + ", graphed runtime"
    return ("DFlash chain" if budget == 0 else f"DDTree budget {budget}") + ", graphed runtime"


class GraphedRunner:
    """:class:`BatchRunner` of one row over :class:`~tensorrt_llm_dflash.graphed.GraphedDecoder` at batch 1.

    Each call reproduces one part of ``GraphedDecoder.generate``: ``admit`` its prefill (the same
    uniform draw before the first token), ``step`` one iteration of its loop (depth limit, uniforms,
    one device step, the one copy, the policy's next tree size). ``GraphedDecoder`` offers the step
    (``step()``, ``out``) but not the prefill on its own, so ``_load`` repeats ``generate``'s
    prefill lines, reading the decoder's ``_choose`` (the only private member used here).

    **Capacity.** The static state's attention runs over its whole capacity at every step (on the
    embedded SmolLM2, one CPU thread: 11.9 tok/s AR at 1,024 slots, 3.8 at 8,192), so a row must not
    sit in a decoder sized for the longest possible request. Decoders are kept per capacity
    (``initial_capacity`` doubled as needed, built on first use, each with its own calibration); a
    request starts in the smallest that holds its prompt and ``growth_tokens`` more tokens (all it
    asks for, if fewer), and a row that reaches the end of its decoder moves to a bigger one: its
    committed tokens are prefilled there (one forward pass), its last token becomes the root, and
    decoding goes on. Requests whose ``max_tokens`` fit their first decoder never move and are
    step for step what ``generate`` gives.

    What a batched decoder needs to offer so that this class becomes one decoder of ``B`` rows (see
    the report in issue 37): ``prefill(row, prompt_ids, sampling, generator) -> first token`` that
    touches only that row's state (and a form that takes a given root, for a row that moves);
    per-row sampling settings as tensors and a per-row generator (the uniforms of row r drawn from
    row r's generator only); ``max_depth`` per row (already [B]); ``release(row)`` that makes the row
    inert padding; and a way to serve rows of very different lengths without every row paying for
    the longest (capacity per batch bucket, or attention bounded by each row's length).
    """

    max_batch = 1

    def __init__(self, spec: DecoderSpec, max_model_len: int | None = None,
                 initial_capacity: int = INITIAL_CAPACITY, growth_tokens: int = GROWTH_TOKENS) -> None:
        from ..graphed import CAPACITY_STEP

        self.spec = spec
        limit = spec.max_model_len()
        if max_model_len is None:
            max_model_len = limit
        if not 1 <= max_model_len <= limit:
            raise DFlashInputError(f"max_model_len={max_model_len} must be in 1..{limit} (the target's positions, "
                                   f"less one tree of {spec.largest_tree()} nodes past the last)")
        if initial_capacity < CAPACITY_STEP or initial_capacity % CAPACITY_STEP:
            raise DFlashInputError(f"initial_capacity={initial_capacity} must be a multiple of {CAPACITY_STEP}")
        if growth_tokens < 1:
            raise DFlashInputError(f"growth_tokens={growth_tokens} must be >= 1")
        self.max_model_len = max_model_len
        self.vocab_size = int(spec.model.config.vocab_size)
        self.description = describe_decoder(spec.budget, spec.drafter is not None, spec.lookup)
        self.initial_capacity, self.growth_tokens = initial_capacity, growth_tokens
        self._largest_capacity = -(-self._slots_for(max_model_len) // CAPACITY_STEP) * CAPACITY_STEP
        self._decoders: dict[int, Any] = {}
        self.decoder = self._decoder_for(1)  # built now: graphs captured and costs measured at start-up
        self._row: _Row | None = None

    def _slots_for(self, positions: int) -> int:
        # One tree past the last position, as GraphedDecoder.generate sizes its state.
        return positions + self.spec.largest_tree() + 1

    def _decoder_for(self, positions: int) -> Any:
        """The smallest kept decoder (``initial_capacity`` doubled) that holds ``positions`` tokens."""
        capacity = self.initial_capacity
        while capacity < self._slots_for(positions) and capacity < self._largest_capacity:
            capacity *= 2
        capacity = min(capacity, self._largest_capacity)
        if capacity not in self._decoders:
            self._decoders[capacity] = self.spec.build(capacity)
        return self._decoders[capacity]

    @property
    def capacities(self) -> list[int]:
        """Capacities of the decoders built so far."""
        return sorted(self._decoders)

    # ------------------------------------------------------------------ BatchRunner

    def admit(self, slot: int, row: RowRequest) -> None:
        if slot != 0:
            raise DFlashInputError(f"slot={slot} does not exist: this runner has one row (slot 0)")
        if self._row is not None:
            raise DFlashInputError("slot 0 is busy: release it before admitting another request")
        check_row(row, self.max_model_len, self.vocab_size)
        self.decoder = self._decoder_for(len(row.prompt_ids) + min(row.max_new_tokens, self.growth_tokens))
        state = _Row(row, row_generator(row.sampling, self.decoder.device))
        first = self._load(state, list(row.prompt_ids), root=None)
        state.tokens = [*row.prompt_ids, first]
        state.produced = 1
        state.pending = RowStep([first], tree_size=0)
        self._row = state

    @torch.inference_mode()
    def _load(self, state: _Row, context: list[int], root: int | None) -> int:
        """Prefill ``context`` into the current decoder; the root is the target's choice (``root`` None, as
        ``generate`` does), or ``root`` for a row that moves with its last committed token."""
        decoder = self.decoder
        decoder.sampling = state.row.sampling
        decoder.prepare()  # a no-op once this sampling setting's graphs exist
        ids = torch.tensor([context], dtype=torch.long, device=decoder.device)
        last_logits, features = decoder.target.prefill(ids)
        decoder.past.fill_(len(context))
        decoder.history[:, : len(context)] = ids
        if decoder.proposer is not None and features is not None:
            decoder.proposer.extend(features, torch.zeros_like(decoder.past))
        if root is None:
            if state.generator is not None:
                decoder.uniforms[:, :1].uniform_(generator=state.generator)
            decoder.root.copy_(decoder._choose(last_logits[:, None])[:, 0])
        else:
            decoder.root.fill_(root)
        decoder.history[:, len(context)] = decoder.root
        state.past = len(context)
        return int(decoder.root[0].item())  # the prefill's one copy

    def _move_to_a_bigger_decoder(self, state: _Row) -> None:
        total = len(state.row.prompt_ids) + state.row.max_new_tokens
        self.decoder = self._decoder_for(min(total, len(state.tokens) + self.growth_tokens))
        self._load(state, state.tokens[:-1], root=state.tokens[-1])

    def step(self) -> dict[int, RowStep]:
        state = self._row
        if state is None:
            return {}
        if state.pending is not None:
            pending, state.pending = state.pending, None
            return {0: pending}
        remaining = state.row.max_new_tokens - state.produced
        if remaining <= 0:  # the scheduler releases a row at its length limit; nothing to decode
            return {}
        if self._slots_for(state.past) > self.decoder.capacity:
            self._move_to_a_bigger_decoder(state)
        decoder = self.decoder
        nodes = decoder.nodes
        decoder.max_depth.fill_(min(remaining, decoder.target.max_positions - 1 - state.past, nodes - 1))
        if state.generator is not None:
            decoder.uniforms.uniform_(generator=state.generator)
        out = decoder.step()[0].tolist()  # the step's one device-to-host copy
        count = out[0]
        lookup = 0
        if decoder.policy is not None:
            decoder.nodes = decoder.policy.buckets[out[1 + decoder.path_width]]
            lookup = out[2 + decoder.path_width]
        committed = out[1 : 1 + count]
        state.past += count
        state.produced += count
        state.tokens += committed
        return {0: RowStep(committed, tree_size=nodes, lookup_tokens=lookup)}

    def release(self, slot: int) -> None:
        if slot == 0:
            self._row = None


class RowStack:
    """One :class:`BatchRunner` of ``sum(part.max_batch)`` rows made of several runners, stepped in turn.

    Slot ``s`` is part ``p``'s local slot ``s - offset[p]``. Every part keeps its own state, so rows are
    independent by construction; a step costs the sum of the parts' steps (no shared forward pass).
    """

    def __init__(self, parts: Sequence[BatchRunner]) -> None:
        if not parts:
            raise DFlashInputError("a RowStack needs at least one runner")
        self.parts = list(parts)
        self._where: list[tuple[BatchRunner, int]] = [(part, local) for part in self.parts
                                                     for local in range(part.max_batch)]
        self._offsets = []
        offset = 0
        for part in self.parts:
            self._offsets.append(offset)
            offset += part.max_batch
        self.max_batch = offset
        self.max_model_len = min(part.max_model_len for part in self.parts)
        self.vocab_size = self.parts[0].vocab_size
        self.description = f"{self.parts[0].description}; {len(self.parts)} rows stepped in turn"
        self._busy: set[int] = set()

    def _locate(self, slot: int) -> tuple[BatchRunner, int]:
        if not 0 <= slot < self.max_batch:
            raise DFlashInputError(f"slot={slot} does not exist: this runner has slots 0..{self.max_batch - 1}")
        return self._where[slot]

    def admit(self, slot: int, row: RowRequest) -> None:
        part, local = self._locate(slot)
        part.admit(local, row)
        self._busy.add(slot)

    def step(self) -> dict[int, RowStep]:
        results: dict[int, RowStep] = {}
        for part, offset in zip(self.parts, self._offsets):
            if not any(offset <= slot < offset + part.max_batch for slot in self._busy):
                continue  # an idle part costs nothing
            for local, out in part.step().items():
                results[offset + local] = out
        return results

    def release(self, slot: int) -> None:
        part, local = self._locate(slot)
        part.release(local)
        self._busy.discard(slot)


def graphed_rows(spec: DecoderSpec, rows: int, max_model_len: int | None = None,
                 initial_capacity: int = INITIAL_CAPACITY, growth_tokens: int = GROWTH_TOKENS) -> BatchRunner:
    """``rows`` rows over the graphed decoder: one :class:`GraphedRunner`, or a :class:`RowStack` of them.

    The decoder runs batch 1 today; when it runs B rows in one step, this returns one runner of B rows.
    """
    if rows == 1:
        return GraphedRunner(spec, max_model_len, initial_capacity, growth_tokens)
    return RowStack([GraphedRunner(spec, max_model_len, initial_capacity, growth_tokens) for _ in range(rows)])
