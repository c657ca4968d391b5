"""The server's ``BatchRunner`` over a DFlash TensorRT-LLM engine (``--backend trt``).

:class:`EngineServeRunner` implements ``serve.runner.BatchRunner`` (``admit`` / ``step`` / ``release``)
with one :class:`~.batch.EngineBatch`: scheduler slots map to engine rows. ``admit`` checks the request
(prompt and output within the engine's positions, the prompt within one context pass, token ids within
the vocabulary, a seed at T > 0) and queues it; the next ``step()`` runs one generation pass verifying
every running row's tree, then one context pass (or more, as ``max_num_tokens`` allows) prefilling the
rows admitted since, and reports each new row's first token as a prefill ``RowStep`` (``tree_size`` 0).
A released row leaves at once; the last engine row moves into its place, so every pass covers
consecutive rows. Each row's tokens are the ones ``decode.speculative_generate`` gives for that request
on the same engine (T = 0; at T > 0 with the request's seed), whatever the other rows do.

It decodes with a fixed tree: ``ddtree_budget`` nodes (0 = the chain; default the engine's
``max_draft_len`` when that is more than the chain, as ``examples/run.py`` does); the cost-aware tree
prices one row's step and is not on this path. The runner cuts a row at its ``max_new_tokens``; the
scheduler applies stop tokens and stop strings.

Importing this module needs neither tensorrt nor tensorrt_llm (the engine is loaded by the constructor).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import DFlashInputError
from ..sampling import SamplingParams
from ..serve.runner import RowRequest, RowStep, check_row, row_draws
from .batch import BatchRequest, BatchRow, EngineBatch
from .runner import DFlashEngineTarget, read_engine_config


def default_budget(engine_dir: str | Path) -> int:
    """The engine's largest tree when it holds more than the chain, else 0 (the chain): ``run.py``'s default."""
    pretrained = read_engine_config(engine_dir)["pretrained_config"]
    max_draft_len, chain_len = int(pretrained["max_draft_len"]), int(pretrained["dflash"]["block_size"]) - 1
    return max_draft_len if max_draft_len > chain_len else 0


class EngineServeRunner:
    """``BatchRunner`` of ``max_batch`` rows over one DFlash engine (module docstring)."""

    def __init__(self, engine_dir: str | Path, *, ddtree_budget: int | None = None, max_batch: int | None = None,
                 max_model_len: int | None = None, device: str | torch.device | None = None, rank: int = 0) -> None:
        """``engine_dir``: a ``trtllm-build --speculative_decoding_mode dflash`` output; ``ddtree_budget``: nodes
        per tree (0 = the chain; None: ``default_budget``); ``max_batch``: rows (default and at most the engine's
        ``--max_batch_size``); ``max_model_len``: prompt + output one row may hold (default and at most the
        engine's positions); ``device`` (default ``cuda:rank``) and ``rank`` as ``DFlashEngineTarget``'s."""
        config = read_engine_config(engine_dir)
        engine_rows = int(config["build_config"].get("max_batch_size", 1))
        rows = engine_rows if max_batch is None else max_batch
        budget = default_budget(engine_dir) if ddtree_budget is None else ddtree_budget
        self.target = DFlashEngineTarget(engine_dir, rank=rank, device=device, rows=rows)
        self.batch = EngineBatch(self.target, budget)
        limit = self.target.max_positions
        if max_model_len is None:
            max_model_len = limit
        if not 1 <= max_model_len <= limit:
            raise DFlashInputError(f"max_model_len={max_model_len} must be in 1..{limit} (the engine's positions: "
                                   "max_position_embeddings, and max_seq_len less max_draft_len)")
        self.max_batch = rows
        self.max_model_len = max_model_len
        self.vocab_size = self.target.vocab_size
        kind = "DFlash2" if self.target.dflash2 is not None else "DFlash"
        tree = f"{kind} chain" if self.batch.budget == 0 else f"{kind} DDTree budget {self.batch.budget}"
        self.description = f"{tree}, TensorRT-LLM engine"
        self._rows: dict[int, BatchRow] = {}
        self._waiting: dict[int, BatchRequest] = {}

    def _locate(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch:
            raise DFlashInputError(f"slot={slot} does not exist: this runner has slots 0..{self.max_batch - 1}")

    # ------------------------------------------------------------------ BatchRunner
    def admit(self, slot: int, row: RowRequest) -> None:
        self._locate(slot)
        if slot in self._rows or slot in self._waiting:
            raise DFlashInputError(f"slot {slot} is busy: release it before admitting another request")
        check_row(row, self.max_model_len, self.vocab_size)
        sampling: SamplingParams = row.sampling
        request = BatchRequest(list(row.prompt_ids), row.max_new_tokens, sampling,
                               draws=row_draws(sampling))
        self.batch.check(request)
        self._waiting[slot] = request

    def step(self) -> dict[int, RowStep]:
        results: dict[int, RowStep] = {}
        committed = self.batch.step()
        for slot, row in self._rows.items():
            tokens = committed.get(row)
            if tokens:
                results[slot] = RowStep(list(tokens), tree_size=row.stats.tree_sizes[-1])
        if self._waiting:
            slots = list(self._waiting)
            rows = self.batch.admit([self._waiting.pop(slot) for slot in slots])
            for slot, row in zip(slots, rows):
                self._rows[slot] = row
                results[slot] = RowStep(list(row.output.tokens), tree_size=0)
        return results

    def release(self, slot: int) -> None:
        self._locate(slot)
        self._waiting.pop(slot, None)
        row = self._rows.pop(slot, None)
        if row is not None:
            self.batch.release(row)
