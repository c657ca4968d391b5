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

Batch size 1 (as decode.py). Tensor parallelism: launch with ``mpirun -n N``; every
rank runs the same deterministic loop on identical logits (the lm_head gathers its
output), rank r uses GPU ``r % gpus_per_node``.

Everything TensorRT-LLM is imported inside functions: importing this module needs
neither tensorrt nor tensorrt_llm.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

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
    def from_outputs(cls, outputs: dict[str, torch.Tensor], root: int) -> EngineSelectorDraft:
        """Batch row 0 of a pass's ``dflash2_*`` outputs (engine dtype and device, not copied)."""
        return cls(unary=outputs["dflash2_candidate_logits"][0], tokens=outputs["dflash2_candidates"][0].long(),
                   edges=outputs["dflash2_edges"][0], root=root, chain_tokens=outputs["dflash2_draft_tokens"][0])

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


class DFlashEngineTarget:
    """One DFlash engine (one TP rank) as a ``TargetVerifier``."""

    def __init__(self, engine_dir: str | Path, rank: int = 0, device: str | torch.device | None = None) -> None:
        """``device``: where the engine's buffers live (default ``cuda:rank % gpus_per_node``)."""
        import tensorrt as trt
        import tensorrt_llm  # noqa: F401  (its import loads the TensorRT-LLM plugin library)
        from tensorrt_llm.runtime import Session

        from .plugins import load_plugin_library

        load_plugin_library()  # DFlashTreeMask / DFlashKVCompact creators, before deserialising
        config = read_engine_config(engine_dir)
        self.pretrained, self.build = config["pretrained_config"], config["build_config"]
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
        self.max_positions = min(int(self.pretrained["max_position_embeddings"]), self.max_seq_len - self.max_draft_len)
        self.num_layers = int(self.pretrained["num_hidden_layers"])
        self.kv_heads = max(int(self.pretrained["num_key_value_heads"]) // tp, 1)
        self.head_size = int(self.pretrained["head_size"])
        self.draft_layers = int(sub["num_hidden_layers"])
        self.draft_kv_heads = max(int(sub["num_key_value_heads"]) // tp, 1)
        self.draft_head_size = int(sub["head_size"])
        #: The DFlash2 settings of the drafter, None for DFlash (docs/trtllm_engine.md).
        self.dflash2: dict[str, Any] | None = sub.get("dflash2")
        self.mismatched_drafts = 0
        #: Per verify pass: (in-graph accepted count, in-graph bonus, host accepted count, host bonus).
        self.walk_log: list[tuple[int, int, int, int]] = []
        self.ctx_gen_profiles = self._profile_split()
        self._check_kernel(tp)
        self._all_reduce = self._all_reduce_workspace(mapping, rank)
        self._allocate()
        self.reset()

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
            kv_dtype = self._dtype("past_key_value_0")
            self.kv_cache = [
                torch.zeros(1, 2, self.kv_heads, self.max_seq_len, self.head_size, dtype=kv_dtype, device=self.device)
                for _ in range(self.num_layers)
            ]
        self.context_kv = torch.zeros(self.draft_layers, 2, 1, self.max_seq_len, self.draft_kv_heads,
                                      self.draft_head_size, dtype=self._dtype("dflash_context_kv"), device=self.device)

    def _allocate_paged(self) -> None:
        """The paged KV cache as TensorRT-LLM's KV cache manager lays it out for one sequence
        (cpp/tensorrt_llm/kernels/kvCacheUtils.h ``KVBlockArray``; batch_manager/kvCacheManager.cpp
        ``setOffsets``): one pool ``[blocks, layers, 2, kv_heads, tokens_per_block, head_size]``;
        ``host_kv_cache_pool_pointers`` = (pool address, 0), ``host_kv_cache_pool_mapping[l]`` =
        (pool 0, layer l), and block j's K / V entry in ``kv_cache_block_offsets`` =
        ``(j * layers) * 2 + kv`` (the layer is added through the mapping)."""
        tokens_per_block = int(self.build["plugin_config"]["tokens_per_block"])
        blocks = -(-self.max_seq_len // tokens_per_block)
        kv_dtype = self._dtype("dflash_context_kv")  # the engine dtype; the pool has no tensor of its own
        self.kv_pool = torch.zeros(blocks, self.num_layers, 2, self.kv_heads, tokens_per_block, self.head_size,
                                   dtype=kv_dtype, device=self.device)
        entry = (np.arange(blocks, dtype=np.int64) * self.num_layers * 2)[None, :] + np.arange(2)[:, None]
        offsets = torch.as_tensor(entry.astype(np.int32)).reshape(1, 1, 2, blocks)
        self._paged_tensors = {
            "kv_cache_block_offsets": offsets.to(self.device),
            "host_kv_cache_block_offsets": offsets.clone(),
            "host_kv_cache_pool_pointers": torch.tensor([[self.kv_pool.data_ptr(), 0]], dtype=torch.int64),
            "host_kv_cache_pool_mapping": torch.tensor([[0, layer] for layer in range(self.num_layers)],
                                                       dtype=torch.int32),
        }

    def reset(self) -> None:
        self.past_len = 0
        self.prompt_len = 0
        self.context_len = 0
        self._prev = (np.zeros(1, np.int32), 0, 0)  # (accepted nodes, count, past before that tree)
        self._last: dict[str, torch.Tensor] = {}
        self._last_tree: DraftTree | None = None
        self.cached_draft: torch.Tensor | None = None
        self.cached_bonus: int | None = None
        self.in_graph_path: list[int] | None = None
        self._pending_walk: list[int] | None = None

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _stream_handle(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0

    # -------------------------------------------------------------------- passes
    def _i32(self, values: Any, host: bool = False) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(values, dtype=np.int32))
        return t if host else t.to(self.device)

    def _standard_inputs(self, ids: np.ndarray, positions: np.ndarray, is_context: bool,
                         last_token_ids: np.ndarray) -> dict[str, torch.Tensor]:
        """Inputs of TensorRT-LLM's own prepare_inputs (packed tokens, gpt attention plugin,
        continuous or paged KV cache)."""
        n = int(ids.shape[0])
        seq = self.past_len + n
        tensors = {
            "input_ids": self._i32(ids),
            "position_ids": self._i32(positions),
            "last_token_ids": self._i32(last_token_ids),
            "sequence_length": self._i32([seq]),
            "context_lengths": self._i32([self.prompt_len]),
            "host_context_lengths": self._i32([n if is_context else self.prompt_len], host=True),
            "host_request_types": self._i32([0 if is_context else 1], host=True),
            "host_past_key_value_lengths": self._i32([self.past_len], host=True),
            "host_max_attention_window_sizes": self._i32([self.max_seq_len] * self.num_layers, host=True),
            "host_sink_token_length": self._i32([0], host=True),
            "cache_indirection": torch.zeros(1, 1, self.max_seq_len, dtype=torch.int32, device=self.device),
            "host_runtime_perf_knobs": torch.full((16,), -1, dtype=torch.int64),
            "host_context_progress": torch.zeros(1, dtype=torch.int64),
        }
        if self._all_reduce is not None:
            tensors["all_reduce_workspace"] = self._all_reduce[1]
        tensors.update(self._paged_tensors)
        for i, layer in enumerate(self.kv_cache):
            tensors[f"past_key_value_{i}"] = layer
            tensors[f"present_key_value_{i}"] = layer  # in place
        return tensors

    def _dflash_inputs(self, tree: DraftTree | None, n: int) -> dict[str, torch.Tensor]:
        nodes, count, prev_past = self._prev
        path_len = self.block_size
        prev = np.zeros((1, path_len), np.int32)
        prev[0, : len(nodes)] = nodes
        if tree is None:  # context pass: the prompt is accepted whole; a one-node dummy tree
            parents, gen_len = np.array([[-1]], np.int32), np.array([1], np.int32)
            logits_index = np.zeros((1, n), np.int32)
        else:
            parents, gen_len = tree.parents[None].astype(np.int32), np.array([n], np.int32)
            logits_index = np.arange(n, dtype=np.int32)[None]
        packed, offsets, lengths = batched_tree_inputs(parents, gen_len, self.max_draft_len + 1)
        return {
            "dflash_tree_parents": self._i32(parents),
            "dflash_node_index": self._i32(np.arange(n, dtype=np.int32)[None]),
            "dflash_logits_index": self._i32(logits_index),
            "dflash_num_nodes": self._i32([n]),
            "dflash_is_context": self._i32([1 if tree is None else 0]),
            "dflash_context_kv": self.context_kv,
            "dflash_context_lengths": self._i32([self.context_len]),
            "dflash_prev_accepted_nodes": self._i32(prev),
            "dflash_prev_num_accepted": self._i32([count]),
            "dflash_prev_past_lengths": self._i32([prev_past]),
            # Declared by TensorRT-LLM's prepare_inputs for Medusa; the engine builds the
            # tensors the attention reads from dflash_tree_parents with DFlashTreeMask. These
            # host copies follow the same layout (tree.batched_tree_inputs).
            "spec_decoding_generation_lengths": self._i32(lengths),
            "spec_decoding_position_offsets": self._i32(offsets),
            "spec_decoding_packed_mask": self._i32(packed),
            "spec_decoding_use": self._i32([0 if tree is None else 1], host=True),
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

    def _after_pass(self, outputs: dict[str, torch.Tensor]) -> None:
        self._last = outputs
        self.cached_bonus = int(outputs["dflash_bonus"][0])
        if self.dflash2 is not None:  # the selector's tables (model.py, _selector)
            self.cached_draft = EngineSelectorDraft.from_outputs(outputs, self.cached_bonus)
        else:  # medusa_logits [B-1, batch, vocab_padded] -> [B-1, vocab]
            self.cached_draft = outputs["medusa_logits"][:, 0, : self.vocab_size].float()

    # ------------------------------------------------------------ TargetVerifier
    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.reset()
        n = len(prompt_ids)
        if n + self.max_draft_len + 1 > self.max_seq_len:
            raise DFlashInputError(f"prompt length {n} does not fit the engine's max_seq_len={self.max_seq_len}")
        self.prompt_len = n
        inputs = self._standard_inputs(np.asarray(prompt_ids), np.arange(n), True, np.array([n]))
        inputs.update(self._dflash_inputs(None, n))
        outputs = self._run(inputs, is_context=True)
        self.past_len = n
        # The prompt's drafter context K/V go to the buffer right away (all of it is committed).
        self.context_kv[:, :, 0, :n] = outputs["dflash_token_context_kv"][:, :, :n]
        self.context_len = n
        self._after_pass(outputs)
        self.in_graph_path = None
        return outputs["logits"][0, : self.vocab_size].float(), None

    def compile_tree(self, tree: DraftTree) -> DraftTree:
        if tree.num_nodes > self.max_draft_len + 1:
            raise DFlashInputError(
                f"a tree of {tree.num_nodes} nodes exceeds the engine's max_draft_len + 1 = {self.max_draft_len + 1}; "
                "rebuild with a larger --max_draft_len or lower --ddtree_budget"
            )
        return tree

    @torch.inference_mode()
    def verify(self, compiled: DraftTree) -> tuple[torch.Tensor, torch.Tensor | None]:
        tree = compiled
        n = tree.num_nodes
        inputs = self._standard_inputs(tree.tokens, self.past_len + tree.depths, False, np.arange(1, n + 1))
        inputs.update(self._dflash_inputs(tree, n))
        outputs = self._run(inputs, is_context=False)
        # The KV compaction of the previous path ran at the start of this pass.
        self._prev = (np.zeros(1, np.int32), 0, self.past_len)
        self._last_tree = tree
        self._after_pass(outputs)
        return outputs["logits"][:n, : self.vocab_size].float(), None

    @torch.inference_mode()
    def commit(self, accepted_nodes: list[int]) -> None:
        kept = len(accepted_nodes)
        index = torch.as_tensor(accepted_nodes, device=self.device)
        rows = self._last["dflash_token_context_kv"].index_select(2, index)  # [Ld, 2, kept, kv, d]
        self.context_kv[:, :, 0, self.context_len : self.context_len + kept] = rows
        self.context_len += kept
        # Target KV: compacted in-graph by the next pass (dflash_prev_*), from this host path.
        self._prev = (np.asarray(accepted_nodes, np.int32), kept, self.past_len)
        self.in_graph_path = accepted_nodes
        num_in_graph = int(self._last["dflash_num_accepted"][0])
        if num_in_graph != kept:
            self.in_graph_path = None  # the in-graph walk took another path
        # The host's bonus is known at the next propose(); the entry is completed there.
        self._pending_walk = [num_in_graph, int(self._last["dflash_bonus"][0]), kept]
        self.past_len += kept

    def record_host_bonus(self, bonus: int) -> None:
        if self._pending_walk is not None:
            self.walk_log.append((*self._pending_walk, int(bonus)))
            self._pending_walk = None


class EngineProposer:
    """``DraftProposer`` whose drafts come from the engine's previous pass (``medusa_logits``)."""

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
        target = self.target
        if target.cached_draft is None:
            raise DFlashInputError("propose() before prefill(): the engine drafts during target passes")
        target.record_host_bonus(root_token)
        if root_token != target.cached_bonus:
            # Drafted after the in-graph greedy bonus, not the host's token (T > 0 or a tie):
            # still a valid proposal, verification keeps the output exact.
            target.mismatched_drafts += 1
        return target.cached_draft


def build_trt_runtime(args: Any) -> tuple[DFlashEngineTarget, EngineProposer, Any, list[int], int]:
    """(verifier, proposer, tokenizer, stop ids, default DDTree budget) for examples/run.py.

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
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir or args.engine_dir)
    target = DFlashEngineTarget(args.engine_dir, rank=mpi_rank(), device=getattr(args, "device", None))
    stops: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        stops = list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
    default_budget = max_draft_len if max_draft_len > chain_len else 0
    return target, EngineProposer(target), tokenizer, stops, default_budget
