"""The model side of the server: the narrow ``BatchRunner`` protocol, and its implementation over the graphed runtime.

The scheduler (:mod:`.engine`) knows nothing about trees, KV caches or CUDA graphs. It sees a
runner with ``max_batch`` rows (slots), admits a request into a free slot, calls ``step()`` for all
admitted rows at once, and releases a slot when its request is finished or its client has gone.
That is the whole contract, so the scheduler does not change when a TensorRT-LLM engine runner
serves (``--backend trt``).

:class:`GraphedRunner` is one :class:`~tensorrt_llm_dflash.graphed.GraphedDecoder` of ``max_batch``
rows: every step is one forward pass of the target over every row's tree (one CUDA graph per batch
bucket and tree size on CUDA). A request is prefilled into a free decoder row when it is admitted
(the other rows are not touched); its first token is handed over at once (``take_admitted``, which the
engine asks for) or else reported by the next ``step()``, and from the first ``step()`` after that it decodes with
the others; a released row is inert padding until the next admission. At batch 1 it is step for step
``GraphedDecoder.generate`` (tested: ``tests/test_serve_runner.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..errors import DFlashInputError
from ..sampling import SamplingParams, TokenDraws
from ..target import check_prompt_fits

#: Slots per row the decoder starts with; it doubles when a row needs more.
INITIAL_CAPACITY = 1024


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
      tokens. Rows are independent:
      what one row commits never depends on the others (at T = 0 token for token; at T > 0 in
      distribution, and token for token under a fixed tree, whose draws come from the row's own seed
      alone).
    * ``release(slot)``: the row is finished or its client is gone; the slot may be admitted again.
      Releasing a free slot is a no-op.

    Optional: ``take_admitted()`` (a runner that prefills in ``admit``): ``{slot: RowStep}`` of the prefill tokens
    not reported yet, handed over now instead of by the next ``step()``, whose rows then decode in that step
    already. The engine asks for them after each round of admissions, so a new request's first token does not wait
    for a step of the whole batch, nor its second for one more. A runner without it (or a wrapper that does not
    pass it on) reports them with ``step()`` as above: nothing is lost either way.
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


def row_draws(sampling: SamplingParams) -> TokenDraws | None:
    """The row's own draws (T > 0), keyed by its seed and each token's index: a request's sample never depends on
    other requests, the tree sizes or the server's load."""
    if sampling.greedy:
        return None
    if sampling.seed is None:
        raise DFlashInputError("a sampled request needs a seed: the scheduler draws one when the client sends none")
    return TokenDraws(int(sampling.seed))


@dataclass
class DecoderSpec:
    """How to build the :class:`~tensorrt_llm_dflash.graphed.GraphedDecoder` a runner decodes with."""

    model: Any
    drafter: Any | None
    #: 0 = chain, B = DDTree of B nodes, None = the cost-aware tree on the device.
    budget: int | None
    lookup: bool = True
    policy_buckets: Sequence[int] | None = None
    #: The cost-aware tree's step seconds: one per tree size (every batch bucket), or ``(bucket, size) -> seconds``;
    #: given instead of measured (tests, or a curve measured before). None measures them at start-up.
    policy_costs: Sequence[float] | Callable[[int, int], float] | None = None
    #: When the cost-aware tree's size is chosen (``graphed.SIZE_CHOICES``; None: the device's default).
    size_choice: str | None = None

    def build(self, capacity: int, rows: int) -> Any:
        """A decoder of ``rows`` rows and ``capacity`` slots (it grows when a row needs more), its graphs captured
        (CUDA) and its cost curves measured now, for greedy requests at every batch bucket, not in a request."""
        from ..graphed import GraphedDecoder

        kwargs: dict[str, Any] = {"budget": self.budget, "capacity": capacity, "lookup": self.lookup,
                                  "policy_costs": self.policy_costs, "batch": rows, "size_choice": self.size_choice}
        if self.policy_buckets is not None:
            kwargs["policy_buckets"] = tuple(self.policy_buckets)
        decoder = GraphedDecoder(self.model, self.drafter, **kwargs)
        decoder.prepare()
        return decoder


def describe_decoder(budget: int | None, speculative: bool, lookup: bool) -> str:
    if not speculative:
        return "autoregressive, graphed runtime"
    if budget is None:
        return "cost-aware DDTree" + (" with lookup branches" if lookup else "") + ", graphed runtime"
    return ("DFlash chain" if budget == 0 else f"DDTree budget {budget}") + ", graphed runtime"


class GraphedRunner:
    """:class:`BatchRunner` of ``max_batch`` rows over one batched :class:`~tensorrt_llm_dflash.graphed.GraphedDecoder`.

    Engine slots map to decoder rows. A request takes the lowest free decoder row, and before a step rows
    in high rows move down into free low ones when that shrinks the batch bucket the step runs (a step
    covers the first ``b`` rows; a free row below the last busy one is padding that costs a row's compute).

    **Capacity.** The decoder starts with ``initial_capacity`` slots per row and grows (copying every row)
    when a row needs more; a step's attention reads only the window its longest row needs, so a short
    request does not pay for a long one's capacity. ``max_model_len`` is what one row can hold: the target's
    positions, less one step's writes past the last (``GraphedDecoder.max_model_len``).
    """

    def __init__(self, spec: DecoderSpec, max_batch: int = 1, max_model_len: int | None = None,
                 initial_capacity: int = INITIAL_CAPACITY) -> None:
        from ..graphed import CAPACITY_STEP

        if max_batch < 1:
            raise DFlashInputError(f"max_batch={max_batch} must be >= 1")
        if initial_capacity < CAPACITY_STEP or initial_capacity % CAPACITY_STEP:
            raise DFlashInputError(f"initial_capacity={initial_capacity} must be a multiple of {CAPACITY_STEP}")
        self.spec = spec
        self.decoder = spec.build(initial_capacity, max_batch)
        limit = self.decoder.max_model_len
        if max_model_len is None:
            max_model_len = limit
        if not 1 <= max_model_len <= limit:
            raise DFlashInputError(f"max_model_len={max_model_len} must be in 1..{limit} (the target's positions, "
                                   f"less one step's {self.decoder.span} slots past the last)")
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.vocab_size = int(spec.model.config.vocab_size)
        self.description = describe_decoder(spec.budget, spec.drafter is not None, spec.lookup)
        self._row_of: dict[int, int] = {}  # engine slot -> decoder row
        self._pending: dict[int, RowStep] = {}  # slot -> its prefill's token, not reported yet

    def _locate(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch:
            raise DFlashInputError(f"slot={slot} does not exist: this runner has slots 0..{self.max_batch - 1}")

    # ------------------------------------------------------------------ BatchRunner

    def admit(self, slot: int, row: RowRequest) -> None:
        self._locate(slot)
        if slot in self._row_of:
            raise DFlashInputError(f"slot {slot} is busy: release it before admitting another request")
        check_row(row, self.max_model_len, self.vocab_size)
        used = set(self._row_of.values())
        decoder_row = min(r for r in range(self.max_batch) if r not in used)
        first = self.decoder.admit(decoder_row, row.prompt_ids, row.max_new_tokens, row.sampling,
                                   row_draws(row.sampling))
        self._row_of[slot] = decoder_row
        self._pending[slot] = RowStep([first], tree_size=0)

    def take_admitted(self) -> dict[int, RowStep]:
        """The prefill tokens not reported yet, now; their rows decode in the next ``step()`` already."""
        taken, self._pending = self._pending, {}
        return taken

    def step(self) -> dict[int, RowStep]:
        # Never a draining batch (``GraphedDecoder.step``): a server cannot tell the last requests of a burst from
        # clients that send their next request as soon as one is answered, where nobody waits at any step either
        # and pacing by the slowest row costs the batch (16 such clients on the 2-core EPYC: 0.84-0.88x AR).
        results: dict[int, RowStep] = dict(self._pending)
        self._pending.clear()
        stepping = [slot for slot in self._row_of if slot not in results]
        if not stepping:
            return results
        self._pack()
        slot_of = {row: slot for slot, row in self._row_of.items()}
        for row, out in self.decoder.step([self._row_of[slot] for slot in stepping]).items():
            results[slot_of[row]] = RowStep(out.tokens, tree_size=out.tree_size, lookup_tokens=out.lookup_tokens)
        return results

    def release(self, slot: int) -> None:
        self._locate(slot)
        self._pending.pop(slot, None)
        row = self._row_of.pop(slot, None)
        if row is not None:
            self.decoder.release(row)

    def _pack(self) -> None:
        """Move requests from high decoder rows into free low ones while that shrinks the batch bucket."""
        decoder = self.decoder
        while self._row_of:
            rows = sorted(self._row_of.values())
            if decoder.bucket_for(rows[-1] + 1) == decoder.bucket_for(len(rows)):
                return
            free = min(r for r in range(self.max_batch) if r not in rows)
            slot = next(s for s, r in self._row_of.items() if r == rows[-1])
            decoder.move_row(rows[-1], free)
            self._row_of[slot] = free

    @property
    def capacity(self) -> int:
        """Slots per row the decoder holds now."""
        return int(self.decoder.capacity)


def graphed_rows(spec: DecoderSpec, rows: int, max_model_len: int | None = None,
                 initial_capacity: int = INITIAL_CAPACITY) -> GraphedRunner:
    """``rows`` rows over one batched graphed decoder (what ``--max_batch_size`` builds)."""
    return GraphedRunner(spec, rows, max_model_len, initial_capacity)
