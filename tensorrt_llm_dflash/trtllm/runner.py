"""Python runtime for DFlash engines: the shared decode loop (decode.py) drives the engine.

``DFlashEngineTarget`` implements ``decode.TargetVerifier`` and ``EngineProposer``
``decode.DraftProposer``; ``decode.speculative_generate`` runs unchanged, so tree build,
walk, acceptance and stats are the same code as the PyTorch runtime. Only the model
execution is the engine:

* ``prefill`` runs the context pass; ``verify`` one generation pass over the tree. Each
  pass also drafts the next block in-graph (model.py) from the in-graph greedy walk, so
  ``EngineProposer.propose`` returns the cached ``medusa_logits``. It checks that the
  host's walk (decode.py) took the same path and bonus; when it did not (T > 0 samples,
  or an exact argmax tie) the cached block is still a valid proposal -- verification
  keeps the output exact -- it only drafted from another prefix, and the runner counts
  it (``mismatched_drafts``).
* ``commit`` records the host's path. The next pass compacts the target KV cache with
  it in-graph (DFlashKVCompact, inputs ``dflash_prev_*``), and the accepted tokens' drafter
  context K/V (``dflash_token_context_kv``) are appended to the context buffer here.

Why not ``GenerationSession``: ``tensorrt_llm/runtime/generation.py`` refuses an engine
whose I/O names differ from the set it expects (DFlash adds inputs and outputs), and its
own decode loop (dynamic decoder, Medusa acceptance) is exactly what decode.py replaces.
The engine is driven with ``tensorrt_llm.runtime.Session`` (``runtime/session.py``):
``Session.from_serialized_engine``, ``session.context.set_input_shape`` and
``session.run(inputs, outputs, stream)``. The KV cache is owned here, in either layout
``trtllm-build`` makes: continuous (``--kv_cache_type continuous``), one ``[batch, 2,
kv_heads, max_seq_len, head_size]`` buffer per layer bound as both ``past_key_value_{i}``
and ``present_key_value_{i}`` (in place, as the gpt attention plugin expects); or paged
(TensorRT-LLM's default), one block pool addressed through ``kv_cache_block_offsets`` and
``host_kv_cache_pool_pointers`` as TensorRT-LLM's KV cache manager lays it out.

A DFlash2 engine (``dflash.dflash2`` in its config) drafts with its selector in-graph: the
cached draft is an ``EngineSelectorDraft`` (the engine's candidates, unary scores, pairwise
term and greedy chain), which the shared loop asks for the chain (``--ddtree_budget 0``, the
in-graph chain itself at T = 0), a sampled chain (T > 0, accepted by rejection sampling against
the selector's sparse distribution) or the DFlash2 tree, as it asks the PyTorch runtime's
``SelectorDraft``.

Rows. ``DFlashEngineTarget(..., rows=R)`` holds R sequences (R <= the engine's
``--max_batch_size``): one KV cache row (or block table) and one drafter context buffer row
each, and their host state (:class:`EngineRow`). ``prefill_rows`` / ``verify_rows`` run one
engine pass over a contiguous range of rows, each with its own prompt or tree, packed as
TensorRT-LLM's own runtime packs a batch with ``remove_input_padding``
(``runtime/generation.py``, ``GenerationSession._prepare_context_inputs`` /
``_prepare_generation_inputs`` / ``_get_next_step_shape_buffer`` @ 2340c776: tokens
concatenated, ``last_token_ids`` the cumulative lengths in the context phase and every token
in a Medusa generation step, ``host_request_types`` 0 / 1 per request, ``sequence_length`` and
``host_past_key_value_lengths`` per request); ``commit_row`` and ``move_row`` are per row.
The ``TargetVerifier`` methods (``prefill``, ``verify``, ``commit``) are row 0 of that, so
``decode.speculative_generate`` drives a one-row target as before; ``batch.EngineBatch``
drives R rows in one step loop. Tensor parallelism: launch with ``mpirun -n N``; every
rank runs the same deterministic loop on identical logits (the lm_head gathers its
output), rank r uses GPU ``r % gpus_per_node``.

Everything TensorRT-LLM is imported inside functions: importing this module needs
neither tensorrt nor tensorrt_llm.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..decode import stop_ids
from ..dflash2.selector import SelectorDraft
from ..errors import DFlashConfigError, DFlashInputError
from ..sampling import SamplingParams
from ..tree import DraftTree, batched_tree_inputs, build_chain
from .kernel_support import TargetAttention, device_sm, spec_decoding_kernel

#: trtllm-build flags the runtime needs (docs/trtllm_engine.md).
REQUIRED_BUILD = "--remove_input_padding enable --gpt_attention_plugin auto"


def read_engine_config(engine_dir: str | Path) -> dict[str, Any]:
    """``ENGINE/config.json`` as written by ``tensorrt_llm/builder.py::Engine.save``:
    ``{"version", "pretrained_config", "build_config"}``."""
    path = Path(engine_dir) / "config.json"
    if not path.is_file():
        raise DFlashConfigError(f"engine directory {str(engine_dir)!r} has no config.json")
    config = json.loads(path.read_text())
    arch = config.get("pretrained_config", {}).get("architecture")
    if arch != "DFlashForCausalLM":
        raise DFlashConfigError(
            f"engine {str(engine_dir)!r} has architecture {arch!r}; build a DFlash engine with "
            "examples/convert_checkpoint.py + trtllm-build --speculative_decoding_mode dflash"
        )
    return config


class EngineSelectorDraft(SelectorDraft):
    """A DFlash2 draft as a DFlash2 engine leaves it (model.py, ``_selector``): the decode loop
    uses it exactly as the PyTorch runtime's ``SelectorDraft`` (chain, sampled chain and its
    rejection sampling, DFlash2 tree), but the pairwise term was computed in-graph for every
    predecessor a chain or tree can reach, so ``scores`` reads a table instead of the codebooks
    (``gates``, ``successors`` and ``predecessor_codebook`` stay None).

    ``unary`` [D, K] and ``tokens`` [D, K]: the candidates of depths 1..D and their unary scores;
    ``edges`` [D, K, K]: row i of depth t is the pairwise term after candidate i of depth t - 1 (at
    depth 1 every row is after ``root``, the engine's in-graph bonus); ``chain_tokens`` [D]: the
    selector's greedy chain after ``root``, walked in-graph. Float32 on a GPU engine, as the
    PyTorch runtime scores a half-precision drafter.

    The engine drafted after its own greedy bonus. After another root (T > 0, or a target argmax
    tie) the block is still a valid proposal and its first step is scored after the engine's root:
    the chain is then drawn from that q and accepted against it, which keeps the output exact."""

    def __init__(self, unary: torch.Tensor, tokens: torch.Tensor, edges: torch.Tensor, root: int,
                 chain_tokens: torch.Tensor) -> None:
        super().__init__(unary=unary, tokens=tokens, gates=None, successors=None, predecessor_codebook=None)
        self.edges, self.root, self.chain_tokens = edges, int(root), chain_tokens

    @classmethod
    def from_outputs(cls, outputs: dict[str, torch.Tensor], root: int, row: int = 0) -> EngineSelectorDraft:
        """Batch row ``row`` of a pass's ``dflash2_*`` outputs (engine dtype and device, not copied)."""
        return cls(unary=outputs["dflash2_candidate_logits"][row], tokens=outputs["dflash2_candidates"][row].long(),
                   edges=outputs["dflash2_edges"][row], root=root, chain_tokens=outputs["dflash2_draft_tokens"][row])

    def scores(self, depth: int, predecessor: int) -> torch.Tensor:
        """score_{depth+1}(. | predecessor) over the K candidates of that depth (0-based ``depth``)."""
        if depth == 0:
            row = 0  # every row of depth 1 is the bonus's (see the class docstring for another root)
        else:
            hits = torch.nonzero(self.tokens[depth - 1] == int(predecessor))
            if not len(hits):
                raise DFlashInputError(
                    f"token {predecessor} is not a depth-{depth} candidate of this DFlash2 draft: the engine scored "
                    "the pairwise term after its candidates only")
            row = int(hits[0, 0])
        return self.unary[depth] + self.edges[depth, row]

    def chain(self, root: int, depth: int, sampling: SamplingParams | None = None,
              generator: torch.Generator | None = None) -> DraftTree:
        """The greedy chain after the engine's own root is the one it walked in-graph (the same argmax
        over the same float32 sums as ``SelectorDraft.chain`` over this table); anything else is
        walked here."""
        if (sampling is None or sampling.greedy) and int(root) == self.root:
            self.sampled_q = None
            return build_chain(root, self.chain_tokens[: min(depth, self.depth)].cpu().numpy())
        return super().chain(root, depth, sampling, generator)

    def __repr__(self) -> str:
        return f"EngineSelectorDraft(depth={self.depth}, top_k={int(self.tokens.shape[1])}, root={self.root})"


@dataclass
class EngineRow:
    """The host state of one engine row (one sequence): what a pass over the row reads and leaves."""

    #: Committed tokens in the target KV cache (the compaction of ``prev`` runs at the row's next pass).
    past_len: int = 0
    prompt_len: int = 0
    #: Valid rows of the row's drafter context buffer.
    context_len: int = 0
    #: The previous step's host path: (accepted nodes, count, committed length before that tree).
    prev: tuple[np.ndarray, int, int] = field(default_factory=lambda: (np.zeros(1, np.int32), 0, 0))
    #: What the row's last pass drafted (DFlash: [B-1, V] block logits; DFlash2: an EngineSelectorDraft).
    cached_draft: Any = None
    cached_bonus: int | None = None
    in_graph_path: list[int] | None = None
    pending_walk: list[int] | None = None
    #: Per verify pass: (in-graph accepted count, in-graph bonus, host accepted count, host bonus).
    walk_log: list[tuple[int, int, int, int]] = field(default_factory=list)
    mismatched_drafts: int = 0
    #: The drafter context K/V of the row's tokens in its last pass, [Ld, 2, n, kv, d] (commit appends the path's).
    token_kv: torch.Tensor | None = None
    graph_accepted: int = 0
    graph_bonus: int = 0


def _row_property(name: str, doc: str) -> property:
    """A ``TargetVerifier`` attribute of the one-row API: row 0's."""
    return property(lambda self: getattr(self.row_state[0], name),
                    lambda self, value: setattr(self.row_state[0], name, value), doc=doc)


class DFlashEngineTarget:
    """One DFlash engine (one TP rank) of ``rows`` sequences; row 0 is a ``TargetVerifier``."""

    def __init__(self, engine_dir: str | Path, rank: int = 0, device: str | torch.device | None = None,
                 rows: int = 1) -> None:
        """``device``: where the engine's buffers live (default ``cuda:rank % gpus_per_node``); ``rows``: the
        sequences it holds at once (KV cache and drafter context buffer each), at most its ``--max_batch_size``."""
        import tensorrt as trt
        import tensorrt_llm  # noqa: F401  (its import loads the TensorRT-LLM plugin library)
        from tensorrt_llm.runtime import Session

        from .plugins import load_plugin_library

        config = read_engine_config(engine_dir)
        self.pretrained, self.build = config["pretrained_config"], config["build_config"]
        #: The engine's --max_batch_size: the most sequences one pass takes.
        self.max_batch_size = int(self.build.get("max_batch_size", 1))
        if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= self.max_batch_size:
            raise DFlashInputError(f"rows={rows!r} must be between 1 and the engine's max_batch_size="
                                   f"{self.max_batch_size} (trtllm-build --max_batch_size)")
        self.rows = rows
        load_plugin_library()  # DFlashTreeMask / DFlashKVCompact creators, before deserialising
        mapping = self.pretrained["mapping"]
        gpus = int(mapping.get("gpus_per_node", 8))
        self.device = torch.device(device) if device is not None else torch.device("cuda", rank % gpus)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        engine_file = Path(engine_dir) / f"rank{rank}.engine"
        if not engine_file.is_file():
            raise DFlashConfigError(f"engine directory {str(engine_dir)!r} has no {engine_file.name} (rank {rank})")
        self.session = Session.from_serialized_engine(engine_file.read_bytes())
        self.engine = self.session.engine
        self.context = self.session.context
        # The engine's I/O names: fixed for its lifetime, so read once, not on every pass.
        self.io_names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_names = [n for n in self.io_names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]

        sub = self.pretrained["dflash"]
        tp = int(mapping["tp_size"])
        self.block_size = int(sub["block_size"])
        self.max_draft_len = int(self.pretrained["max_draft_len"])
        self.vocab_size = int(self.pretrained["vocab_size"])
        self.max_seq_len = int(self.build["max_seq_len"])
        #: Longest prompt one context pass takes (the engine's --max_input_len).
        self.max_prompt_len = int(self.build.get("max_input_len", self.max_seq_len))
        #: Most packed tokens one pass takes (the engine's max_num_tokens): several prompts share a context pass
        #: only as far as this allows.
        self.max_num_tokens = int(self.build.get("max_num_tokens") or self.max_batch_size * self.max_seq_len)
        self.max_positions = min(int(self.pretrained["max_position_embeddings"]), self.max_seq_len - self.max_draft_len)
        #: What bounds max_positions, for the messages (a user rebuilds with --max_seq_len for the engine's bound).
        self.max_positions_name = (
            "the target's max_position_embeddings" if self.max_positions == int(self.pretrained["max_position_embeddings"])
            else f"the engine's max_seq_len {self.max_seq_len} - max_draft_len {self.max_draft_len}")
        self.num_layers = int(self.pretrained["num_hidden_layers"])
        self.kv_heads = max(int(self.pretrained["num_key_value_heads"]) // tp, 1)
        self.head_size = int(self.pretrained["head_size"])
        self.draft_layers = int(sub["num_hidden_layers"])
        self.draft_kv_heads = max(int(sub["num_key_value_heads"]) // tp, 1)
        self.draft_head_size = int(sub["head_size"])
        #: The DFlash2 settings of the drafter, None for DFlash (docs/trtllm_engine.md).
        self.dflash2: dict[str, Any] | None = sub.get("dflash2")
        self.row_state = [EngineRow() for _ in range(rows)]
        self.ctx_gen_profiles = self._profile_split()
        self._check_kernel(tp)
        self._all_reduce = self._all_reduce_workspace(mapping, rank)
        self._allocate()
        self.reset()

    # Row 0, for decode.speculative_generate and the policy's calibration (the one-row API).
    past_len = _row_property("past_len", "Committed tokens of row 0.")
    prompt_len = _row_property("prompt_len", "Prompt length of row 0.")
    context_len = _row_property("context_len", "Valid drafter context rows of row 0.")
    cached_draft = _row_property("cached_draft", "What row 0's last pass drafted.")
    cached_bonus = _row_property("cached_bonus", "Row 0's in-graph bonus of its last pass.")
    in_graph_path = _row_property("in_graph_path", "Row 0's last path when the in-graph walk took it, else None.")
    walk_log = _row_property("walk_log", "Row 0's (in-graph count, in-graph bonus, host count, host bonus) per step.")
    mismatched_drafts = _row_property("mismatched_drafts", "Row 0's drafts made after another root than the host's.")

    def _check_kernel(self, tp: int) -> None:
        """On a GPU, refuse before the first pass an engine whose tree verification has no
        attention kernel on this GPU (kernel_support.py): TensorRT-LLM would abort at the first
        verify step. The build already refused what fails on every GPU; the SM is known here."""
        sm = device_sm(self.device)
        if sm is None:
            return
        plugin = self.build["plugin_config"]
        spec_decoding_kernel(
            TargetAttention(int(self.pretrained["num_attention_heads"]), int(self.pretrained["num_key_value_heads"]),
                            int(self.pretrained["head_size"]), str(self.pretrained["dtype"]), tp),
            paged=self._has_paged_inputs(), tokens_per_block=int(plugin.get("tokens_per_block", 32)), sm=sm)

    # ------------------------------------------------------------------ buffers
    def _dtype(self, name: str) -> torch.dtype:
        from tensorrt_llm._utils import trt_dtype_to_torch

        return trt_dtype_to_torch(self.engine.get_tensor_dtype(name))

    def _all_reduce_workspace(self, mapping: dict[str, Any], rank: int) -> Any:
        """tp > 1: TensorRT-LLM's prepare_basic_inputs adds the input ``all_reduce_workspace``;
        allocate and bind it as its own GenerationSession does (runtime/generation.py:
        ``CustomAllReduceHelper.allocate_workspace(mapping, max_workspace_size_auto(tp))``)."""
        if int(mapping["tp_size"]) <= 1:
            return None
        from tensorrt_llm.mapping import Mapping
        from tensorrt_llm.plugin.plugin import CustomAllReduceHelper

        trt_mapping = Mapping(world_size=int(mapping["world_size"]), rank=rank,
                              gpus_per_node=int(mapping.get("gpus_per_node", 8)), tp_size=int(mapping["tp_size"]),
                              pp_size=int(mapping.get("pp_size", 1)))
        size = CustomAllReduceHelper.max_workspace_size_auto(trt_mapping.tp_size)
        return CustomAllReduceHelper.allocate_workspace(trt_mapping, size)  # (IPC buffers, CPU int64 tensor)

    def _allocate(self) -> None:
        self.paged = self._has_paged_inputs()
        self.kv_cache: list[torch.Tensor] = []
        self.kv_pool: torch.Tensor | None = None
        self._paged_tensors: dict[str, torch.Tensor] = {}
        if self.paged:
            self._allocate_paged()
        else:
            # runtime/generation.py allocates present_key_value_{i} as [batch, 2, kv_heads, max_seq_len, head_size].
            kv_dtype = self._dtype("past_key_value_0")
            self.kv_cache = [
                torch.zeros(self.rows, 2, self.kv_heads, self.max_seq_len, self.head_size, dtype=kv_dtype,
                            device=self.device)
                for _ in range(self.num_layers)
            ]
        self.context_kv = torch.zeros(self.draft_layers, 2, self.rows, self.max_seq_len, self.draft_kv_heads,
                                      self.draft_head_size, dtype=self._dtype("dflash_context_kv"), device=self.device)

    def _allocate_paged(self) -> None:
        """The paged KV cache as TensorRT-LLM's KV cache manager lays it out
        (cpp/tensorrt_llm/kernels/kvCacheUtils.h ``KVBlockArray``; batch_manager/kvCacheManager.cpp
        ``setOffsets``): one pool ``[blocks, layers, 2, kv_heads, tokens_per_block, head_size]``;
        ``host_kv_cache_pool_pointers`` = (pool address, 0), ``host_kv_cache_pool_mapping[l]`` =
        (pool 0, layer l), and block j's K / V entry in ``kv_cache_block_offsets`` =
        ``(j * layers) * 2 + kv`` (the layer is added through the mapping). Row r owns blocks
        ``r * per_row .. (r + 1) * per_row - 1``; its table is row r of ``kv_cache_block_offsets``
        ``[1, rows, 2, per_row]`` (a move between rows swaps tables, no KV is copied)."""
        tokens_per_block = int(self.build["plugin_config"]["tokens_per_block"])
        per_row = -(-self.max_seq_len // tokens_per_block)
        blocks = self.rows * per_row
        kv_dtype = self._dtype("dflash_context_kv")  # the engine dtype; the pool has no tensor of its own
        self.kv_pool = torch.zeros(blocks, self.num_layers, 2, self.kv_heads, tokens_per_block, self.head_size,
                                   dtype=kv_dtype, device=self.device)
        entry = (np.arange(blocks, dtype=np.int64) * self.num_layers * 2)[None, :] + np.arange(2)[:, None]  # [2, blocks]
        entry = entry.reshape(2, self.rows, per_row).transpose(1, 0, 2)  # [rows, 2, per_row]
        offsets = torch.as_tensor(np.ascontiguousarray(entry).astype(np.int32)).reshape(1, self.rows, 2, per_row)
        self._block_offsets = offsets.to(self.device)
        self._host_block_offsets = offsets.clone()
        self._paged_tensors = {
            "host_kv_cache_pool_pointers": torch.tensor([[self.kv_pool.data_ptr(), 0]], dtype=torch.int64),
            "host_kv_cache_pool_mapping": torch.tensor([[0, layer] for layer in range(self.num_layers)],
                                                       dtype=torch.int32),
        }

    def reset(self) -> None:
        """Forget every row's sequence."""
        for row in range(self.rows):
            self.reset_row(row)

    def reset_row(self, row: int) -> None:
        self.row_state[row] = EngineRow()

    def move_row(self, src: int, dst: int) -> None:
        """Row ``src``'s sequence continues in row ``dst`` (whatever ``dst`` held is dropped; ``src`` is free
        after). Continuous KV: the cache row is copied whole (a compaction may still be pending past the
        committed length); paged: the two rows' block tables are swapped. The drafter context row is copied."""
        if src == dst:
            return
        if self.paged:
            for table in (self._block_offsets, self._host_block_offsets):
                table[:, [src, dst]] = table[:, [dst, src]]
        else:
            for layer in self.kv_cache:
                layer[dst].copy_(layer[src])
        self.context_kv[:, :, dst].copy_(self.context_kv[:, :, src])
        self.row_state[dst], self.row_state[src] = self.row_state[src], EngineRow()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _stream_handle(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0

    # -------------------------------------------------------------------- passes
    def _i32(self, values: Any, host: bool = False) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(values, dtype=np.int32))
        return t if host else t.to(self.device)

    def _rows(self, rows: Sequence[int], count: int) -> range:
        """``rows`` as a range: one pass covers consecutive rows (a continuous KV cache is bound as the slice
        of its batch dimension, and TensorRT reads a binding as one contiguous buffer)."""
        rows = list(rows)
        if not rows or rows != list(range(rows[0], rows[0] + len(rows))) or rows[0] < 0 or rows[-1] >= self.rows:
            raise DFlashInputError(f"a pass runs on consecutive rows of 0..{self.rows - 1}, got {rows}")
        if len(rows) != count:
            raise DFlashInputError(f"{len(rows)} rows but {count} prompts or trees")
        return range(rows[0], rows[-1] + 1)

    def _standard_inputs(self, rows: range, ids: np.ndarray, positions: np.ndarray, is_context: bool,
                         last_token_ids: np.ndarray, new_tokens: list[int]) -> dict[str, torch.Tensor]:
        """Inputs of TensorRT-LLM's own prepare_inputs (packed tokens, gpt attention plugin,
        continuous or paged KV cache) for the consecutive ``rows``, ``new_tokens[j]`` packed tokens each."""
        states = [self.row_state[r] for r in rows]
        b = len(states)
        past = [s.past_len for s in states]
        tensors = {
            "input_ids": self._i32(ids),
            "position_ids": self._i32(positions),
            "last_token_ids": self._i32(last_token_ids),
            "sequence_length": self._i32([p + n for p, n in zip(past, new_tokens)]),
            "context_lengths": self._i32([s.prompt_len for s in states]),
            "host_context_lengths": self._i32(new_tokens if is_context else [s.prompt_len for s in states], host=True),
            "host_request_types": self._i32([0 if is_context else 1] * b, host=True),
            "host_past_key_value_lengths": self._i32(past, host=True),
            "host_max_attention_window_sizes": self._i32([self.max_seq_len] * self.num_layers, host=True),
            "host_sink_token_length": self._i32([0], host=True),
            "cache_indirection": torch.zeros(b, 1, self.max_seq_len, dtype=torch.int32, device=self.device),
            "host_runtime_perf_knobs": torch.full((16,), -1, dtype=torch.int64),
            "host_context_progress": torch.zeros(1, dtype=torch.int64),
        }
        if self._all_reduce is not None:
            tensors["all_reduce_workspace"] = self._all_reduce[1]
        if self.paged:
            tensors.update(self._paged_tensors)
            tensors["kv_cache_block_offsets"] = self._block_offsets[:, rows.start : rows.stop]
            tensors["host_kv_cache_block_offsets"] = self._host_block_offsets[:, rows.start : rows.stop]
        for i, layer in enumerate(self.kv_cache):
            rows_of_layer = layer[rows.start : rows.stop]  # a contiguous slice of the batch dimension
            tensors[f"past_key_value_{i}"] = rows_of_layer
            tensors[f"present_key_value_{i}"] = rows_of_layer  # in place
        return tensors

    def _dflash_inputs(self, rows: range, trees: Sequence[DraftTree] | None,
                       new_tokens: list[int]) -> dict[str, torch.Tensor]:
        states = [self.row_state[r] for r in rows]
        b, width = len(states), max(new_tokens)
        starts = np.concatenate([[0], np.cumsum(new_tokens)[:-1]]).astype(np.int32)  # each row's first packed token
        # Node i of row j is packed token starts[j] + i; the columns past a row's length repeat its last token
        # (valid rows of every packed tensor, masked by dflash_num_nodes in the graph).
        columns = np.minimum(np.arange(width)[None, :], np.asarray(new_tokens)[:, None] - 1)
        node_index = (starts[:, None] + columns).astype(np.int32)
        prev = np.zeros((b, self.block_size), np.int32)
        for j, state in enumerate(states):
            nodes = state.prev[0]
            prev[j, : len(nodes)] = nodes
        if trees is None:  # context pass: each prompt is accepted whole; a one-node dummy tree
            parents, gen_len = np.full((b, 1), -1, np.int32), np.ones(b, np.int32)
            logits_index = np.repeat(np.arange(b, dtype=np.int32)[:, None], width, axis=1)  # the row's last token
        else:
            parents = np.zeros((b, width), np.int32)
            for j, tree in enumerate(trees):
                parents[j, : tree.num_nodes] = tree.parents
            gen_len = np.asarray(new_tokens, np.int32)
            logits_index = node_index  # a verify pass returns every token's logits
        packed, offsets, lengths = batched_tree_inputs(parents, gen_len, self.max_draft_len + 1)
        # The drafter context rows the pass can read: the longest valid prefix among its rows (a copy unless the
        # pass covers every row and every column; the drafter's attention reads as much).
        used = max(1, max(s.context_len for s in states))
        context = self.context_kv[:, :, rows.start : rows.stop, :used]
        return {
            "dflash_tree_parents": self._i32(parents),
            "dflash_node_index": self._i32(node_index),
            "dflash_logits_index": self._i32(logits_index),
            "dflash_num_nodes": self._i32(new_tokens),
            "dflash_is_context": self._i32([1 if trees is None else 0] * b),
            "dflash_context_kv": context if context.is_contiguous() else context.contiguous(),
            "dflash_context_lengths": self._i32([s.context_len for s in states]),
            "dflash_prev_accepted_nodes": self._i32(prev),
            "dflash_prev_num_accepted": self._i32([s.prev[1] for s in states]),
            "dflash_prev_past_lengths": self._i32([s.prev[2] for s in states]),
            # Declared by TensorRT-LLM's prepare_inputs for Medusa; the engine builds the
            # tensors the attention reads from dflash_tree_parents with DFlashTreeMask. These
            # host copies follow the same layout (tree.batched_tree_inputs).
            "spec_decoding_generation_lengths": self._i32(lengths),
            "spec_decoding_position_offsets": self._i32(offsets),
            "spec_decoding_packed_mask": self._i32(packed),
            "spec_decoding_use": self._i32([0 if trees is None else 1], host=True),
        }

    def _profile_split(self) -> bool:
        """True when the engine's optimization profiles are a context and a generation profile.

        TensorRT-LLM lays profiles out one of two ways (models/generation_mixin.py @ 03ec464e,
        ``get_profiles_ranges``): when ``has_ctx_gen_opt_profiles`` (a continuous KV cache without
        the gemm plugin), profile 0 for context and 1 for generation steps; otherwise one
        profile, or with ``--multiple_profiles enable`` one per range of token counts split at
        64, 128, 256, 512 and 1024 (``split_num_tokens_range``: [1, 64], [64, 128], ...)."""
        from tensorrt_llm.models.generation_mixin import GenerationMixin
        from tensorrt_llm.models.modeling_utils import get_kv_cache_type_from_legacy

        plugin = self.build["plugin_config"]
        return GenerationMixin.has_ctx_gen_opt_profiles(
            use_gpt_attention_plugin=bool(plugin.get("gpt_attention_plugin")),
            use_gemm_plugin=bool(plugin.get("gemm_plugin")),
            remove_input_padding=bool(plugin.get("remove_input_padding")),
            kv_cache_type=get_kv_cache_type_from_legacy(True, self._has_paged_inputs()))

    def _has_paged_inputs(self) -> bool:
        """The engine's KV layout, read from its inputs (paged engines take the block tables)."""
        return "kv_cache_block_offsets" in self.input_names

    def _select_profile(self, is_context: bool, num_tokens: int) -> int:
        """The profile a pass of ``num_tokens`` packed tokens runs on: by phase for context /
        generation profiles, else the first profile whose ``input_ids`` range holds the count,
        as TensorRT-LLM's runtime picks it (cpp/include/tensorrt_llm/runtime/tllmRuntime.h,
        ``getOptProfileId``: ``lower_bound`` of the token count in the split points)."""
        profiles = self.engine.num_optimization_profiles
        if profiles < 2:
            profile = 0
        elif self.ctx_gen_profiles:
            profile = 0 if is_context else 1
        else:
            ranges = [self.engine.get_tensor_profile_shape("input_ids", p) for p in range(profiles)]
            fits = [p for p, (lo, _, hi) in enumerate(ranges) if lo[0] <= num_tokens <= hi[0]]
            if not fits:
                raise DFlashInputError(
                    f"a pass of {num_tokens} tokens fits none of the engine's {profiles} optimization profiles "
                    f"(input_ids {[(lo[0], hi[0]) for lo, _, hi in ranges]}): rebuild with a larger --max_num_tokens "
                    "or send a shorter prompt")
            profile = fits[0]
        if self.context.active_optimization_profile != profile:
            if not self.context.set_optimization_profile_async(profile, self._stream_handle()):
                raise RuntimeError(f"TensorRT refused optimization profile {profile}")
        return profile

    def _run(self, inputs: dict[str, torch.Tensor], is_context: bool) -> dict[str, torch.Tensor]:
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise DFlashConfigError(
                f"the engine has inputs this runtime does not provide: {missing}; build it with {REQUIRED_BUILD}"
            )
        profile = self._select_profile(is_context, int(inputs["input_ids"].shape[0]))
        bound = {n: inputs[n] for n in self.input_names}
        for name, tensor in bound.items():
            if not tensor.is_contiguous():  # TensorRT reads a binding as one dense buffer from its address
                raise RuntimeError(f"engine input {name!r} is not contiguous")
            if not self.context.set_input_shape(name, tuple(tensor.shape)):
                lo, _, hi = self.engine.get_tensor_profile_shape(name, profile)
                raise DFlashInputError(
                    f"engine input {name!r} of shape {tuple(tensor.shape)} is outside optimization profile {profile} "
                    f"[{tuple(lo)} .. {tuple(hi)}]: rebuild with larger limits (--max_input_len, --max_seq_len, "
                    "--max_draft_len) or send a shorter prompt"
                )
        outputs: dict[str, torch.Tensor] = {}
        for name in self.io_names:
            if name in bound:
                continue
            if name in inputs:  # present_key_value_{i}: the same buffer as past_key_value_{i}
                outputs[name] = inputs[name]
                continue
            shape = tuple(self.context.get_tensor_shape(name))
            outputs[name] = torch.empty(shape, dtype=self._dtype(name), device=self.device)
        if not self.session.run(bound, outputs, self._stream_handle()):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        self.synchronize()
        return outputs

    def _after_pass(self, rows: range, outputs: dict[str, torch.Tensor], new_tokens: list[int]) -> None:
        start = 0
        for j, row in enumerate(rows):
            state = self.row_state[row]
            n = new_tokens[j]
            state.cached_bonus = int(outputs["dflash_bonus"][j])
            state.graph_bonus, state.graph_accepted = state.cached_bonus, int(outputs["dflash_num_accepted"][j])
            state.token_kv = outputs["dflash_token_context_kv"][:, :, start : start + n]
            if self.dflash2 is not None:  # the selector's tables (model.py, _selector)
                state.cached_draft = EngineSelectorDraft.from_outputs(outputs, state.cached_bonus, j)
            else:  # medusa_logits [B-1, batch, vocab_padded] -> [B-1, vocab]
                state.cached_draft = outputs["medusa_logits"][:, j, : self.vocab_size].float()
            start += n

    def check_prompt_len(self, n: int) -> None:
        """A prompt one context pass takes: past the engine's --max_input_len the pass would fail TensorRT's
        optimization-profile check with the name of an engine input instead."""
        limit = min(self.max_prompt_len, self.max_num_tokens)
        if n > limit:
            raise DFlashInputError(f"prompt length {n} exceeds the engine's max_input_len={self.max_prompt_len} "
                                   f"(one context pass takes at most {limit} tokens); rebuild with a larger "
                                   "--max_input_len or send a shorter prompt")

    @torch.inference_mode()
    def prefill_rows(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """One context pass: row ``rows[j]`` (consecutive rows) starts over with ``prompts[j]``. Returns each
        row's last-position logits [V]; each row's first draft is cached (``take_draft``)."""
        rows = self._rows(rows, len(prompts))
        lengths = [len(p) for p in prompts]
        for n in lengths:
            if n + self.max_draft_len + 1 > self.max_seq_len:
                raise DFlashInputError(f"prompt length {n} does not fit the engine's max_seq_len={self.max_seq_len}")
            self.check_prompt_len(n)
        for row, n in zip(rows, lengths):
            self.reset_row(row)
            self.row_state[row].prompt_len = n
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
        positions = np.concatenate([np.arange(n) for n in lengths])
        inputs = self._standard_inputs(rows, ids, positions, True, np.cumsum(lengths), lengths)
        inputs.update(self._dflash_inputs(rows, None, lengths))
        outputs = self._run(inputs, is_context=True)
        self._after_pass(rows, outputs, lengths)
        for row, n in zip(rows, lengths):
            state = self.row_state[row]
            state.past_len = n
            # The prompt's drafter context K/V go to the buffer right away (all of it is committed).
            self.context_kv[:, :, row, :n] = state.token_kv
            state.context_len = n
        return [outputs["logits"][j, : self.vocab_size].float() for j in range(len(rows))]

    def check_tree(self, tree: DraftTree) -> DraftTree:
        if tree.num_nodes > self.max_draft_len + 1:
            raise DFlashInputError(
                f"a tree of {tree.num_nodes} nodes exceeds the engine's max_draft_len + 1 = {self.max_draft_len + 1}; "
                "rebuild with a larger --max_draft_len or lower --ddtree_budget"
            )
        return tree

    @torch.inference_mode()
    def verify_rows(self, rows: Sequence[int], trees: Sequence[DraftTree]) -> list[torch.Tensor]:
        """One generation pass: row ``rows[j]`` verifies ``trees[j]`` (consecutive rows, trees of any sizes).
        Returns each row's node logits [N_j, V]; each row's next draft is cached (``take_draft``)."""
        rows = self._rows(rows, len(trees))
        for tree in trees:
            self.check_tree(tree)
        sizes = [tree.num_nodes for tree in trees]
        ids = np.concatenate([tree.tokens for tree in trees])
        positions = np.concatenate([self.row_state[row].past_len + tree.depths for row, tree in zip(rows, trees)])
        inputs = self._standard_inputs(rows, ids, positions, False, np.arange(1, sum(sizes) + 1), sizes)
        inputs.update(self._dflash_inputs(rows, trees, sizes))
        outputs = self._run(inputs, is_context=False)
        for row in rows:  # the KV compaction of the previous path ran at the start of this pass
            state = self.row_state[row]
            state.prev = (np.zeros(1, np.int32), 0, state.past_len)
        self._after_pass(rows, outputs, sizes)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        return [outputs["logits"][starts[j] : starts[j + 1], : self.vocab_size].float() for j in range(len(rows))]

    @torch.inference_mode()
    def commit_row(self, row: int, accepted_nodes: list[int]) -> None:
        """Row ``row`` keeps ``accepted_nodes`` (root first) of the tree it verified last."""
        state = self.row_state[row]
        kept = len(accepted_nodes)
        index = torch.as_tensor(accepted_nodes, device=self.device)
        path_kv = state.token_kv.index_select(2, index)  # [Ld, 2, kept, kv, d]
        self.context_kv[:, :, row, state.context_len : state.context_len + kept] = path_kv
        state.context_len += kept
        # Target KV: compacted in-graph by the row's next pass (dflash_prev_*), from this host path.
        state.prev = (np.asarray(accepted_nodes, np.int32), kept, state.past_len)
        # The in-graph walk took this path when it accepted as many nodes (both walks follow the same parents).
        state.in_graph_path = accepted_nodes if state.graph_accepted == kept else None
        # The host's bonus is known at the next take_draft(); the entry is completed there.
        state.pending_walk = [state.graph_accepted, state.graph_bonus, kept]
        state.past_len += kept

    def take_draft(self, row: int, root_token: int) -> torch.Tensor | EngineSelectorDraft:
        """The draft row ``row``'s last pass made, for the step after ``root_token`` (the host's bonus)."""
        state = self.row_state[row]
        if state.cached_draft is None:
            raise DFlashInputError("propose() before prefill(): the engine drafts during target passes")
        if state.pending_walk is not None:
            state.walk_log.append((*state.pending_walk, int(root_token)))
            state.pending_walk = None
        if root_token != state.cached_bonus:
            # Drafted after the in-graph greedy bonus, not the host's token (T > 0 or a tie):
            # still a valid proposal, verification keeps the output exact.
            state.mismatched_drafts += 1
        return state.cached_draft

    # ------------------------------------------------------- TargetVerifier (row 0)
    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.prefill_rows([0], [prompt_ids])[0], None

    def compile_tree(self, tree: DraftTree) -> DraftTree:
        return self.check_tree(tree)

    def verify(self, compiled: DraftTree) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.verify_rows([0], [compiled])[0], None

    def commit(self, accepted_nodes: list[int]) -> None:
        self.commit_row(0, accepted_nodes)


class EngineProposer:
    """``DraftProposer`` whose drafts come from the engine's previous pass (``medusa_logits``), row 0."""

    def __init__(self, target: DFlashEngineTarget) -> None:
        self.target = target
        self.block_size = target.block_size

    @property
    def selects_tokens(self) -> bool:
        """A DFlash2 engine's drafts choose their own tokens: the cost-aware policy, which ranks
        marginals, cannot run them (decode.speculative_generate and run.py check this)."""
        return self.target.dflash2 is not None

    def reset(self) -> None:
        self.target.mismatched_drafts = 0
        self.target.walk_log = []

    def propose(self, root_token: int, new_context: torch.Tensor | None) -> torch.Tensor | EngineSelectorDraft:
        return self.target.take_draft(0, root_token)


def batch_rows(args: Any) -> int:
    """Rows examples/run.py decodes together on the engine: one per ``--input_text`` prompt, up to the engine's
    ``--max_batch_size``; 1 (one prompt at a time, as before) for the cost-aware tree (no ``--ddtree_budget``, a
    DFlash or a DFlash2 engine: it prices a one-row step; a batch ran fixed full trees under its name) and with
    ``--streaming`` (one prompt's text at a time)."""
    config = read_engine_config(args.engine_dir)
    if args.ddtree_budget is None or getattr(args, "streaming", False):
        return 1
    prompts = len(getattr(args, "input_text", None) or [])
    return max(1, min(int(config["build_config"].get("max_batch_size", 1)), prompts))


def build_trt_runtime(args: Any, rows: int = 1) -> tuple[DFlashEngineTarget, EngineProposer, Any, list[int], int]:
    """(verifier, proposer, tokenizer, stop ids, default DDTree budget) for examples/run.py; the verifier holds
    ``rows`` sequences (``batch_rows``), the proposer drafts for row 0.

    The arguments are checked against the engine's config.json before the engine is loaded."""
    if not args.engine_dir:
        raise DFlashConfigError("--engine_dir is required with --backend trt")
    if args.speculative_decoding_mode != "dflash":
        raise DFlashInputError("a DFlash engine always drafts: use --speculative_decoding_mode dflash "
                               "(--ddtree_budget 0 for the chain)")
    pretrained = read_engine_config(args.engine_dir)["pretrained_config"]
    max_draft_len, chain_len = int(pretrained["max_draft_len"]), int(pretrained["dflash"]["block_size"]) - 1
    if args.ddtree_budget is not None and args.ddtree_budget > max_draft_len:
        raise DFlashInputError(
            f"--ddtree_budget={args.ddtree_budget} exceeds the engine's max_draft_len={max_draft_len}"
        )
    from tensorrt_llm._utils import mpi_rank

    check_engine_world(args.engine_dir)
    tokenizer, stops = load_engine_tokenizer(args.engine_dir, args.tokenizer_dir)
    target = DFlashEngineTarget(args.engine_dir, rank=mpi_rank(), device=getattr(args, "device", None), rows=rows)
    default_budget = max_draft_len if max_draft_len > chain_len else 0
    return target, EngineProposer(target), tokenizer, stops, default_budget


#: A tokenizer directory holds one of these (what AutoTokenizer reads).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def missing_tokenizer(engine_dir: str, tokenizer_dir: str | None) -> str | None:
    """Why an engine run has no tokenizer to load (for ``--tokenizer_dir``'s refusal at parse time), or None:
    the tokenizer defaults to the engine dir, which trtllm-build never writes one into."""
    if tokenizer_dir is not None or any((Path(engine_dir) / name).is_file() for name in TOKENIZER_FILES):
        return None
    return (f"is required: the engine dir {engine_dir!r} holds no tokenizer (pass the directory of the target the "
            "engine was converted from)")


def load_engine_tokenizer(engine_dir: str, tokenizer_dir: str | None) -> tuple[Any, list[int]]:
    """(tokenizer, stop ids) of an engine run: the ids the PyTorch runtime stops on for the same model dir
    (``model.generation_config.eos_token_id``: its generation_config.json, else its config.json, as transformers
    builds it), the tokenizer's EOS only for a directory that holds a tokenizer and no model config. The
    tokenizer's EOS alone missed Qwen3's second stop id (generation_config lists 151645 and 151643)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    source = tokenizer_dir or engine_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as err:
        flag = "--tokenizer_dir" if tokenizer_dir else "--engine_dir"
        reason = " ".join(str(err).split())[:200]
        raise DFlashConfigError(f"{flag} {source!r}: no tokenizer loads from it ({reason})") from None
    path = Path(source)
    eos = getattr(tokenizer, "eos_token_id", None)
    try:
        if (path / "generation_config.json").is_file():
            eos = GenerationConfig.from_pretrained(source).eos_token_id
        elif (path / "config.json").is_file() and source != engine_dir:  # an engine's config.json is TensorRT-LLM's
            eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(source)).eos_token_id
    except (OSError, ValueError, TypeError, KeyError):
        pass  # not a model's config: the tokenizer's EOS
    return tokenizer, stop_ids(eos)


def check_engine_world(engine_dir: str) -> None:
    """A tensor-parallel engine runs one process per rank (``mpirun -n N``): started alone, its first all-reduce
    waits for ranks that never come. Refused by name before the engine loads."""
    from tensorrt_llm._utils import mpi_world_size

    mapping = read_engine_config(engine_dir)["pretrained_config"].get("mapping") or {}
    world = int(mapping.get("world_size", 1))
    if world != mpi_world_size():
        raise DFlashConfigError(f"--engine_dir {engine_dir!r} was built for {world} ranks (tp_size "
                                f"{mapping.get('tp_size', 1)}) and this run has {mpi_world_size()}: launch it with "
                                f"mpirun -n {world} (docs/trtllm_engine.md)")
