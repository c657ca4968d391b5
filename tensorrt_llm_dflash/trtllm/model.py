"""``DFlashForCausalLM``: one TensorRT-LLM engine that verifies a draft tree with the target
and drafts the next block with the DFlash drafter, in the same pass.

Layout and conventions follow Medusa (``tensorrt_llm/models/medusa/model.py``):
``DFlashForCausalLM`` wraps a generic subclass of the target's own model class
(``QWenForCausalLM``, ``models/qwen/model.py``, or ``LLaMAForCausalLM``,
``models/llama/model.py``) and adds the drafter's block logits as the output
``medusa_logits`` ``[block_size - 1, batch, vocab_padded]`` (``logits_dtype``) next to
``logits``. Extra inputs are declared like EAGLE's (``models/eagle/model.py``,
``EagleForCausalLM.prepare_inputs``: ``GenerationMixin.get_profiles_ranges`` and
``Tensor(name, dtype, shape, dim_range)``).

One pass (generation phase, one request per batch row; see docs/trtllm_engine.md):

1. ``dflash_prev_*`` (the host's accepted path of the previous step) -> DFlashKVCompact
   compacts the target KV cache (the ``past_key_value_{i}`` buffers are its inputs, updated
   in place); the compacted lengths feed the attention's ``sequence_length`` so TensorRT
   orders every attention layer after the copy.
2. ``dflash_tree_parents`` -> DFlashTreeMask -> ``spec_decoding_packed_mask /
   position_offsets / generation_lengths`` in the layout the attention kernels read (mask
   rows of ``ceil((max_draft_len + 1) / 32)`` words, offsets ``max_draft_len + 1`` wide) ->
   the target runs the tree (gpt attention plugin). Hidden states of ``target_layer_ids``
   are captured on the way.
3. ``ctx = hidden_norm(fc(cat(features)))`` for every token of the pass; the drafter's
   context K/V of each token (k_norm, RoPE at the token's position) are an output,
   ``dflash_token_context_kv``; the runner appends the accepted rows to its context
   buffer (input ``dflash_context_kv``) at commit.
4. In-graph greedy walk over the tree (argmax per node; a node is accepted iff its
   token is its parent's argmax and its parent is accepted) -> accepted mask and bonus
   (``dflash_bonus``); a context request accepts all its tokens.
5. The drafter block ``[bonus, MASK x (B-1)]`` at positions ``committed .. committed+B-1``
   attends to the buffer, to the accepted tokens of this pass (masked, no copy) and to
   itself (no mask; a sliding-window layer also masks keys ``sliding_window`` or more
   positions behind the query) -> ``norm`` -> lm_head -> ``medusa_logits``.

A DFlash2 drafter (``dflash.dflash2`` in the config, docs/dflash2.md) adds, in the same pass:
each sublayer of the block wrapped by its grouped dynamic causal convolution (step 5), and the
candidate selector on the block's hidden states: unary scores ``softcap(output_multiplier *
lm_head(h))`` (``medusa_logits``), their top-K candidates per position (ties to the lower token
id), the pairwise term of every candidate after every predecessor it can follow (the bonus at
depth 1, the previous depth's candidates after), and the selector's greedy chain. They leave the
engine as ``dflash2_candidates``, ``dflash2_candidate_logits``, ``dflash2_edges`` and
``dflash2_draft_tokens`` (docs/trtllm_engine.md); the runner drafts the chain from the last and
builds the DFlash2 tree (or samples the chain at T > 0) from the tables.

Imports tensorrt_llm at module level (import only where TensorRT-LLM 1.2.1 is installed).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import numpy as np
import tensorrt as trt
from tensorrt_llm._common import default_net
from tensorrt_llm._utils import pad_vocab_size, str_dtype_to_trt
from tensorrt_llm.functional import (
    Tensor,
    arange,
    argmax,
    cast,
    concat,
    constant,
    cos,
    eq,
    expand,
    gather,
    gt,
    index_select,
    lt,
    matmul,
    scatter,
    shape,
    sin,
    slice,
    softmax,
    tanh,
    unsqueeze,
    view,
)
from tensorrt_llm.functional import max as reduce_max
from tensorrt_llm.functional import sum as reduce_sum
from tensorrt_llm.layers import ColumnLinear, GatedMLP, RmsNorm, RowLinear
from tensorrt_llm.layers.attention import SpecDecodingParams
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.models import MODEL_MAP
from tensorrt_llm.models.generation_mixin import GenerationMixin
from tensorrt_llm.models.llama.model import LLaMAForCausalLM
from tensorrt_llm.models.modeling_utils import PretrainedModel, get_kv_cache_type_from_legacy
from tensorrt_llm.models.qwen.model import QWenForCausalLM
from tensorrt_llm.module import Module, ModuleList
from tensorrt_llm.parameter import Parameter

from ..errors import DFlashConfigError
from . import plugins
from .config import DFlashConfig
from .constants import ARCHITECTURE, MAX_ENGINE_DRAFT_LEN
from .dflash2_support import check_section
from .kernel_support import TargetAttention, spec_decoding_kernel

#: Engine I/O added by DFlash (docs/trtllm_engine.md lists shapes and dtypes).
INPUT_NAMES = (
    "dflash_tree_parents", "dflash_node_index", "dflash_logits_index", "dflash_num_nodes", "dflash_is_context",
    "dflash_context_kv", "dflash_context_lengths",
    "dflash_prev_accepted_nodes", "dflash_prev_num_accepted", "dflash_prev_past_lengths",
)
OUTPUT_NAMES = ("medusa_logits", "dflash_token_context_kv", "dflash_bonus", "dflash_num_accepted",
                "dflash_committed_lengths")
#: Engine outputs added for a DFlash2 drafter (batch first; docs/trtllm_engine.md).
DFLASH2_OUTPUT_DTYPES = {"dflash2_candidates": "int32", "dflash2_candidate_logits": "float32",
                         "dflash2_edges": "float32", "dflash2_draft_tokens": "int32"}
DFLASH2_OUTPUT_NAMES = tuple(DFLASH2_OUTPUT_DTYPES)
#: Additive mask value of a hidden key (exp underflows to exactly 0 in float32, as -inf would,
#: without the NaN of -inf * 0); also what takes a chosen candidate out of the next max pass.
_HIDDEN = 1e30


# ----------------------------------------------------------------------------- helpers


def _int(x: Tensor) -> Tensor:
    return cast(x, "int32")


def _arange(n: Tensor) -> Tensor:
    """0 .. n-1 (int32) for a scalar shape tensor; functional.arange wants both ends as Tensors."""
    return arange(n - n, n, "int32")


def _or(a: Tensor, b: Tensor) -> Tensor:
    """Logical or of 0/1 int32 tensors."""
    return a + b - a * b


def _rotate_half(x: Tensor, head_size: int) -> Tensor:
    """[.., d] -> [-x2, x1] (rope_gpt_neox), with static last-dim slices."""
    half = head_size // 2
    starts = [0] * (x.ndim() - 1)
    sizes = concat([shape(x, i) for i in range(x.ndim() - 1)] + [half])
    x1 = slice(x, starts + [0], sizes)
    x2 = slice(x, starts + [half], sizes)
    return concat([x2 * -1.0, x1], dim=x.ndim() - 1)


def _first_argmax(x: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """(index int32 [n, 1], value [n, 1]) of the first maximum along the last dim of x [n, width],
    as ``torch.argmax`` takes it: the maxima are marked exactly (eq to the row max), and an argmax
    over ``marked * (width - index)`` has a unique winner, so the result does not depend on how
    TensorRT's TopK orders ties."""
    top = reduce_max(x, dim=1, keepdim=True)
    first = constant((width - np.arange(width)).astype(np.float32)[None])  # exact below 2**24
    return _int(argmax(cast(eq(x, top), "float32") * first, dim=1, keepdim=True)), top


def _top_k(x: Tensor, k: int, width: int) -> tuple[Tensor, Tensor]:
    """(values [n, k], indices int32 [n, k]) of the k largest entries of x [n, width] (float32), in
    the PyTorch runtime's order (dflash2/selector.py, ``top_candidates``): descending, ties to the
    lower index. One max pass per candidate (k is at most dflash2_support.MAX_ENGINE_TOP_K)."""
    columns = constant(np.arange(width, dtype=np.int32)[None])
    values, indices = [], []
    for _ in range(k):
        index, value = _first_argmax(x, width)
        values.append(value)
        indices.append(index)
        x = x - cast(eq(columns, index), "float32") * _HIDDEN  # out of the next passes
    return concat(values, dim=1), concat(indices, dim=1)


def sliding_window(sub: dict[str, Any], layer: int) -> int | None:
    """The sliding window of draft layer ``layer`` (None: full attention), as drafter.py reads it
    from ``layer_types`` and ``sliding_window``."""
    kinds = sub.get("layer_types") or []
    sliding = layer < len(kinds) and kinds[layer] == "sliding_attention"
    return int(sub["sliding_window"]) if sliding else None


def rotary_tables(sub: dict[str, Any]) -> tuple[np.ndarray, float]:
    """inv_freq [d/2] and attention scaling, computed like drafter.RotaryEmbedding (transformers'
    ROPE_INIT_FUNCTIONS, through compat.rope_inv_freq), so every rope_scaling type the PyTorch runtime knows is the same here."""
    from ..compat import rope_inv_freq

    inv_freq, attention_scaling = rope_inv_freq(
        hidden_size=sub["hidden_size"], num_attention_heads=sub["num_attention_heads"], head_dim=sub["head_size"],
        rope_theta=sub["rotary_base"], rope_scaling=sub["rotary_scaling"],
        max_position_embeddings=sub["max_position_embeddings"])
    return inv_freq.double().numpy(), float(attention_scaling)


def apply_rope(x: Tensor, positions: Tensor, inv_freq: np.ndarray, scaling: float, head_size: int) -> Tensor:
    """x [.., L, heads, d] rotated at integer ``positions`` [.., L] (float32 math)."""
    freqs = unsqueeze(cast(positions, "float32"), -1) * constant(inv_freq.astype(np.float32))
    emb = concat([freqs, freqs], dim=freqs.ndim() - 1)  # [.., L, d]
    c, s = unsqueeze(cos(emb) * scaling, -2), unsqueeze(sin(emb) * scaling, -2)  # [.., L, 1, d]
    xf = cast(x, "float32")
    return cast(xf * c + _rotate_half(xf, head_size) * s, x.dtype)


# ----------------------------------------------------------------------------- drafter


class DFlashDraftAttention(Module):
    """Queries from the block; keys/values from [context buffer, this pass's accepted tokens, block]."""

    def __init__(self, sub: dict[str, Any], dtype: str, mapping: Mapping) -> None:
        super().__init__()
        tp = mapping.tp_size
        self.head_size = sub["head_size"]
        self.num_heads = sub["num_attention_heads"] // tp
        self.num_kv_heads = max(sub["num_key_value_heads"] // tp, 1)
        d = self.head_size
        self.qkv = ColumnLinear(sub["hidden_size"], tp * (self.num_heads + 2 * self.num_kv_heads) * d,
                                bias=sub["attn_bias"], dtype=dtype, tp_group=mapping.tp_group, tp_size=tp,
                                gather_output=False)
        self.dense = RowLinear(tp * self.num_heads * d, sub["hidden_size"], bias=sub["attn_bias"], dtype=dtype,
                               tp_group=mapping.tp_group, tp_size=tp)
        self.q_layernorm = RmsNorm(normalized_shape=d, eps=sub["norm_epsilon"], dtype=dtype)
        self.k_layernorm = RmsNorm(normalized_shape=d, eps=sub["norm_epsilon"], dtype=dtype)

    def split_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [.., H] -> q [.., heads, d], k and v [.., kv_heads, d] (k/q normalised)."""
        d, q_w, kv_w = self.head_size, self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        qkv = self.qkv(x)
        lead = [shape(qkv, i) for i in range(qkv.ndim() - 1)]
        zeros = [0] * (qkv.ndim() - 1)
        q = slice(qkv, zeros + [0], concat(lead + [q_w]))
        k = slice(qkv, zeros + [q_w], concat(lead + [kv_w]))
        v = slice(qkv, zeros + [q_w + kv_w], concat(lead + [kv_w]))
        q = self.q_layernorm(view(q, concat(lead + [self.num_heads, d])))
        k = self.k_layernorm(view(k, concat(lead + [self.num_kv_heads, d])))
        v = view(v, concat(lead + [self.num_kv_heads, d]))
        return q, k, v

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, additive_mask: Tensor) -> Tensor:
        """q [b, B, heads, d]; keys/values [b, S, kv, d]; mask [b, 1, 1, S] -> [b, B, H]."""
        groups = self.num_heads // self.num_kv_heads
        qh = q.permute([0, 2, 1, 3])  # [b, heads, B, d]
        kh, vh = keys.permute([0, 2, 1, 3]), values.permute([0, 2, 1, 3])  # [b, kv, S, d]
        if groups > 1:  # GQA: every query head of a group reads its KV head
            b, s = shape(kh, 0), shape(kh, 2)
            grouped = concat([b, self.num_kv_heads, groups, s, self.head_size])
            kh = view(expand(unsqueeze(kh, 2), grouped), concat([b, self.num_heads, s, self.head_size]))
            vh = view(expand(unsqueeze(vh, 2), grouped), concat([b, self.num_heads, s, self.head_size]))
        scores = matmul(cast(qh, "float32"), cast(kh, "float32"), transb=True) * (1.0 / math.sqrt(self.head_size))
        probs = softmax(scores + additive_mask, dim=3)
        out = matmul(probs, cast(vh, "float32"))  # [b, heads, B, d]
        out = cast(out, q.dtype).permute([0, 2, 1, 3])
        return self.dense(view(out, concat([shape(out, 0), shape(out, 1), self.num_heads * self.head_size])))


class GroupedDynamicConv(Module):
    """DFlash2's convolution pair around one sublayer (``layers.{i}.{attention,mlp}_conv``), as
    ``dflash2/model.py::GroupedDynamicConv``: ``c = kernel_projection(y)`` viewed [b, B, 2, T, G],
    ``mix_s(z)[t] = sum_o (base_kernel[s, o] + c[t, s, o, group]) * z[t - o]``, z zero before the
    block. Replicated on every rank (it mixes the full hidden state)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int, dtype: str) -> None:
        super().__init__()
        self.hidden_size, self.taps, self.group_size = hidden_size, taps, group_size
        self.groups, self.block_size = hidden_size // group_size, block_size
        self.base_kernel = Parameter(shape=(2, taps, hidden_size), dtype=dtype)
        self.kernel_projection = ColumnLinear(hidden_size, 2 * taps * self.groups, bias=False, dtype=dtype,
                                              tp_size=1, gather_output=True)

    def coefficients(self, normed: Tensor) -> Tensor:
        """The dynamic taps of every block position, [b, B, 2 * T * G], from the sublayer's normed input."""
        return self.kernel_projection(normed)

    def mix(self, z: Tensor, coefficients: Tensor, side: int) -> Tensor:
        """``mix_side(z)`` for z [b, B, H] (one block per row)."""
        b, blk, h, taps, groups = shape(z, 0), self.block_size, self.hidden_size, self.taps, self.groups
        c = view(coefficients, concat([b, blk, 2, taps, groups, 1]))
        c = slice(c, [0, 0, side, 0, 0, 0], concat([b, blk, 1, taps, groups, 1]))
        # repeat_interleave over the channels of a group: expand the trailing 1, fold into H.
        dynamic = view(expand(c, concat([b, blk, 1, taps, groups, self.group_size])), concat([b, blk, taps, h]))
        base = view(slice(self.base_kernel.value, [side, 0, 0], [1, taps, h]), [taps, h])
        kernel = dynamic + base  # [b, B, T, H], the sum the PyTorch runtime forms in the model dtype

        def tap(offset: int) -> Tensor:
            return view(slice(kernel, [0, 0, offset, 0], concat([b, blk, 1, h])), concat([b, blk, h]))

        out = tap(0) * z
        for offset in range(1, min(taps, blk)):  # a tap reaching before the block start reads zeros
            zeros = expand(cast(constant(np.zeros((1, offset, h), np.float32)), z.dtype), concat([b, offset, h]))
            shifted = concat([zeros, slice(z, [0, 0, 0], concat([b, blk - offset, h]))], dim=1)  # z[t - offset]
            out = out + tap(offset) * shifted
        return out


class CandidateSelector(Module):
    """``candidate_selector.*`` (replicated): the rank-r pairwise term between a token and the one
    before it. The codebooks are raw [vocab, r] tensors, as published."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, dtype: str) -> None:
        super().__init__()
        self.rank = rank
        self.hidden_projection = ColumnLinear(hidden_size, rank, bias=False, dtype=dtype, tp_size=1,
                                              gather_output=True)
        self.predecessor_codebook = Parameter(shape=(vocab_size, rank), dtype=dtype)
        self.successor_codebook = Parameter(shape=(vocab_size, rank), dtype=dtype)


class DFlashDraftLayer(Module):
    def __init__(self, sub: dict[str, Any], dtype: str, mapping: Mapping) -> None:
        super().__init__()
        eps = sub["norm_epsilon"]
        self.input_layernorm = RmsNorm(normalized_shape=sub["hidden_size"], eps=eps, dtype=dtype)
        self.attention = DFlashDraftAttention(sub, dtype, mapping)
        self.post_layernorm = RmsNorm(normalized_shape=sub["hidden_size"], eps=eps, dtype=dtype)
        self.mlp = GatedMLP(hidden_size=sub["hidden_size"], ffn_hidden_size=sub["intermediate_size"],
                            hidden_act=sub["hidden_act"], dtype=dtype, bias=False, tp_group=mapping.tp_group,
                            tp_size=mapping.tp_size)
        settings = sub.get("dflash2")
        if settings is not None:
            args = (sub["hidden_size"], settings["conv_kernel_size"], settings["conv_group_size"],
                    int(sub["block_size"]), dtype)
            self.attention_conv = GroupedDynamicConv(*args)
            self.mlp_conv = GroupedDynamicConv(*args)


class DFlashDrafter(Module):
    """Parameters under ``dflash.`` (weight.py writes the same names)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        sub, dtype, mapping = config.dflash, config.dtype, config.mapping
        hidden = sub["hidden_size"]
        n_features = len(sub["target_layer_ids"]) * hidden
        # Replicated on every rank: the captured target states are full after the all-reduce.
        self.fc = ColumnLinear(n_features, hidden, bias=False, dtype=dtype, tp_size=1, gather_output=True)
        self.hidden_norm = RmsNorm(normalized_shape=hidden, eps=sub["norm_epsilon"], dtype=dtype)
        self.norm = RmsNorm(normalized_shape=hidden, eps=sub["norm_epsilon"], dtype=dtype)
        self.layers = ModuleList([DFlashDraftLayer(sub, dtype, mapping) for _ in range(sub["num_hidden_layers"])])
        self.draft_vocab_size = sub.get("draft_vocab_size")
        if self.draft_vocab_size is not None:
            self.lm_head = ColumnLinear(hidden, pad_vocab_size(self.draft_vocab_size, mapping.tp_size), bias=False,
                                        dtype=dtype, tp_group=mapping.tp_group, tp_size=mapping.tp_size,
                                        gather_output=True)
            self.d2t = Parameter(shape=(self.draft_vocab_size,), dtype="int32")
        self.dflash2 = sub.get("dflash2")
        if self.dflash2 is not None:
            self.candidate_selector = CandidateSelector(hidden, config.vocab_size, self.dflash2["selector_rank"],
                                                        dtype)


# ------------------------------------------------------------------------------- model


class DFlashForCausalLM(PretrainedModel):
    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        base_lm = QWenForCausalLM if config.base_family == "qwen" else LLaMAForCausalLM

        class GenericDFlashForCausalLM(base_lm):
            def __init__(self, config: DFlashConfig) -> None:
                super().__init__(config)
                self.sub = config.dflash
                self.block_size = int(self.sub["block_size"])
                self.max_draft_len = int(config.max_draft_len)
                if not self.block_size - 1 <= self.max_draft_len <= MAX_ENGINE_DRAFT_LEN:
                    raise DFlashConfigError(
                        f"max_draft_len={self.max_draft_len} is out of range {self.block_size - 1}.."
                        f"{MAX_ENGINE_DRAFT_LEN} (TensorRT-LLM builds tree speculative decoding with at most "
                        f"{MAX_ENGINE_DRAFT_LEN} draft tokens)")
                self.layer_ids = [int(i) for i in self.sub["target_layer_ids"]]
                if self.sub.get("dflash2") is not None:  # also when the network is built without build.py
                    check_section(self.sub["dflash2"], hidden_size=int(self.sub["hidden_size"]),
                                  vocab_size=int(config.vocab_size), where="dflash.dflash2")
                self.dflash = DFlashDrafter(config)
                self.inv_freq, self.rope_scaling = rotary_tables(self.sub)
                self._captured: dict[int, Tensor] = {}
                for layer_id in sorted(set(self.layer_ids)):
                    self._install_capture(layer_id)

            # -- target feature capture -------------------------------------------------
            def _install_capture(self, layer_id: int) -> None:
                """Record the output of decoder layer ``layer_id`` (HF ``hidden_states[id + 1]``)."""
                layer = self.transformer.layers[layer_id]
                original = layer.forward
                captured = self._captured

                def forward(*args: Any, **kwargs: Any) -> Any:
                    out = original(*args, **kwargs)
                    captured[layer_id] = out[0] if isinstance(out, tuple) else out
                    return out

                object.__setattr__(layer, "forward", forward)

            def _features(self) -> Tensor:
                last = self.config.num_hidden_layers - 1
                parts = []
                for i in self.layer_ids:
                    if i not in self._captured:
                        raise RuntimeError(
                            f"decoder layer {i} did not run through its forward(): the DFlash feature capture "
                            "needs the layers called one by one (DecoderLayerList.forward)")
                    h = self._captured[i]
                    # HF reports the last layer after the final norm (target.py does the same).
                    parts.append(self.transformer.ln_f(h) if i == last else h)
                return concat(parts, dim=parts[0].ndim() - 1)

            # -- one pass -----------------------------------------------------------------
            def forward(self, *args: Any, **kwargs: Any) -> Any:
                self._check_attention_kernel()
                dflash = {name: kwargs.pop(name) for name in INPUT_NAMES}
                committed = self._compact_previous_path(dflash, kwargs)
                kwargs["spec_decoding_params"] = self._tree_mask(dflash, kwargs["spec_decoding_params"])
                outputs = super().forward(*args, **kwargs)
                lm_logits = outputs[0]
                token_kv = self._context_kv(kwargs["position_ids"])
                acc, num_accepted, bonus = self._greedy_walk(dflash, kwargs, lm_logits)
                hidden = self._draft_block(dflash, kwargs["position_ids"], token_kv, acc, num_accepted, bonus)
                if self.dflash.dflash2 is None:
                    medusa_logits = self._draft_logits(hidden)
                else:
                    medusa_logits, selected = self._selector(hidden, bonus)
                    for name in DFLASH2_OUTPUT_NAMES:
                        selected[name].mark_output(name, DFLASH2_OUTPUT_DTYPES[name])
                medusa_logits = cast(medusa_logits, self.config.logits_dtype).permute([1, 0, 2])  # [B-1, b, V]
                medusa_logits.mark_output("medusa_logits", self.config.logits_dtype)
                token_kv.mark_output("dflash_token_context_kv", self.config.dtype)
                bonus.mark_output("dflash_bonus", "int32")
                num_accepted.mark_output("dflash_num_accepted", "int32")
                committed.mark_output("dflash_committed_lengths", "int32")
                return (medusa_logits, *outputs)

            def _check_attention_kernel(self) -> None:
                """The network is only worth building if TensorRT-LLM has an attention kernel that
                verifies its trees (kernel_support.py): also when it is built without build.py."""
                config, plugin_config = self.config, default_net().plugin_config
                spec_decoding_kernel(
                    TargetAttention(config.num_attention_heads, config.num_key_value_heads, config.head_size,
                                    config.dtype, config.mapping.tp_size),
                    paged=bool(plugin_config.paged_kv_cache), tokens_per_block=plugin_config.tokens_per_block)

            def _compact_previous_path(self, dflash: dict[str, Tensor], kwargs: dict[str, Any]) -> Tensor:
                """Compact the previous step's accepted path (host walk) before any attention reads
                the cache; the attention's sequence_length then depends on the plugin output."""
                kv = kwargs["kv_cache_params"]
                common = {"num_kv_heads": max(self.config.num_key_value_heads // self.config.mapping.tp_size, 1),
                          "head_size": self.config.head_size, "kv_cache_dtype": self.config.kv_dtype}
                if default_net().plugin_config.paged_kv_cache:
                    committed = plugins.kv_compact_paged(
                        dflash["dflash_prev_accepted_nodes"], dflash["dflash_prev_num_accepted"],
                        dflash["dflash_prev_past_lengths"], kv.kv_cache_block_offsets,
                        kv.host_kv_cache_pool_pointers, kv.host_kv_cache_pool_mapping,
                        num_layers=self.config.num_hidden_layers,
                        tokens_per_block=default_net().plugin_config.tokens_per_block, **common)
                else:
                    committed = plugins.kv_compact_linear(
                        dflash["dflash_prev_accepted_nodes"], dflash["dflash_prev_num_accepted"],
                        dflash["dflash_prev_past_lengths"], list(kv.past_key_value), **common)
                attention = kwargs["attention_params"]
                # sequence_length = committed + tokens of this pass: the same value the host
                # passes, now ordered after the compaction.
                extra = attention.sequence_length - dflash["dflash_prev_past_lengths"] - dflash["dflash_prev_num_accepted"]
                attention.sequence_length = committed + extra
                return committed

            def _tree_mask(self, dflash: dict[str, Tensor], spec: SpecDecodingParams) -> SpecDecodingParams:
                # Already in the plugin's layout: [b * N, ceil((D + 1) / 32)] rows packed by length,
                # offsets [b, D + 1] (docs/plugins.md), matching the max generation length D + 1.
                packed, offsets, lengths = plugins.tree_mask(
                    dflash["dflash_tree_parents"], spec.spec_decoding_generation_lengths,
                    max_nodes=self.max_draft_len + 1)
                return SpecDecodingParams(
                    spec_decoding_is_generation_length_variable=True,
                    spec_decoding_max_generation_length=self.max_draft_len + 1,
                    spec_decoding_generation_lengths=lengths, spec_decoding_position_offsets=offsets,
                    spec_decoding_packed_mask=packed, spec_decoding_use=spec.spec_decoding_use)

            def _context_kv(self, position_ids: Tensor) -> Tensor:
                """Drafter context K/V of every token of the pass: [Ld, 2, T, kv, d]."""
                ctx = self.dflash.hidden_norm(self.dflash.fc(self._features()))  # [T, H]
                rows = []
                for layer in self.dflash.layers:
                    _, k, v = layer.attention.split_qkv(ctx)
                    k = apply_rope(k, position_ids, self.inv_freq, self.rope_scaling, layer.attention.head_size)
                    rows.append(unsqueeze(concat([unsqueeze(k, 0), unsqueeze(v, 0)], dim=0), 0))
                return concat(rows, dim=0)

            def _greedy_walk(self, dflash: dict[str, Tensor], kwargs: dict[str, Any],
                             lm_logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
                """Accepted mask [b, N], accepted count [b] and bonus token [b]."""
                node_index = dflash["dflash_node_index"]  # [b, N] rows of the packed tokens
                b, n = shape(node_index, 0), shape(node_index, 1)
                flat = view(node_index, concat([b * n]))
                logits_rows = view(dflash["dflash_logits_index"], concat([b * n]))  # rows of lm_logits
                choice = view(_int(argmax(index_select(lm_logits, 0, logits_rows), dim=1)), concat([b, n]))
                tokens = view(index_select(kwargs["input_ids"], 0, flat), concat([b, n]))
                positions = unsqueeze(_arange(n), 0)  # [1, N]
                valid = _int(lt(positions, unsqueeze(dflash["dflash_num_nodes"], 1)))
                is_root = _int(eq(positions, 0))
                is_ctx = unsqueeze(dflash["dflash_is_context"], 1)
                # Tree parents cover the generation tree only; a context pass passes [[-1]].
                parents = dflash["dflash_tree_parents"]
                parent_index = parents * _int(gt(parents, -1))  # the root points at itself
                match = _int(eq(tokens, gather(choice, 1, parent_index)))
                acc = _or(match, is_root) * valid
                for _ in range(self.block_size - 1):  # a path is at most block_size - 1 deep
                    acc = acc * _or(gather(acc, 1, parent_index), is_root)
                acc = is_ctx * valid + (1 - is_ctx) * acc  # a prompt is accepted whole
                num_accepted = _int(reduce_sum(acc, dim=1))
                # Deepest accepted node. argmax is a TopK layer: fed float32 (exact for these small
                # integers), as not every TensorRT 10.x release takes int32 TopK input.
                last = _int(argmax(cast(acc * (positions + 1), "float32"), dim=1, keepdim=True))
                bonus = view(gather(choice, 1, last), concat([b]))
                return acc, num_accepted, bonus

            def _draft_block(self, dflash: dict[str, Tensor], position_ids: Tensor, token_kv: Tensor, acc: Tensor,
                             num_accepted: Tensor, bonus: Tensor) -> Tensor:
                """The drafter's normed hidden states at block slots 1..B-1, [b, B-1, H]."""
                sub, bsz = self.sub, self.block_size
                b = shape(bonus, 0)
                mask_ids = constant(np.full((1, bsz - 1), sub["mask_token_id"], dtype=np.int32))
                block_ids = concat([unsqueeze(bonus, 1), expand(mask_ids, concat([b, bsz - 1]))], dim=1)
                x = self.transformer.vocab_embedding(block_ids)  # [b, B, H]
                scale = 1.0 if self.dflash.dflash2 is None else float(self.dflash.dflash2["input_embedding_scale"])
                if scale != 1.0:  # the raw rows times the scale, in float32 as torch scales a half tensor
                    x = cast(cast(x, "float32") * scale, x.dtype)
                committed = dflash["dflash_context_lengths"] + num_accepted
                block_pos = unsqueeze(committed, 1) + constant(np.arange(bsz, dtype=np.int32)[None])
                context_kv = dflash["dflash_context_kv"]  # [Ld, 2, b, C, kv, d]
                ctx_cols = unsqueeze(_arange(shape(context_kv, 3)), 0)
                ctx_ok = _int(lt(ctx_cols, unsqueeze(dflash["dflash_context_lengths"], 1)))
                keep = concat([ctx_ok, acc, expand(constant(np.ones((1, bsz), np.int32)), concat([b, bsz]))], dim=1)
                additive = view(cast(1 - keep, "float32") * -_HIDDEN, concat([b, 1, 1, shape(keep, 1)]))
                flat = view(dflash["dflash_node_index"], concat([shape(acc, 0) * shape(acc, 1)]))
                masks: dict[int | None, Tensor] = {None: additive}
                for window in sorted({sliding_window(self.sub, i) for i in range(len(self.dflash.layers))} - {None}):
                    # Key positions: buffer row r holds position r (the committed tokens in order), a
                    # node of this pass sits at its position_ids entry, the block at block_pos.
                    node_pos = view(index_select(position_ids, 0, flat), concat([shape(acc, 0), shape(acc, 1)]))
                    key_pos = concat([expand(ctx_cols, concat([b, shape(ctx_cols, 1)])), node_pos, block_pos], dim=1)
                    masks[window] = self._window_mask(keep, block_pos, key_pos, window)
                for i, layer in enumerate(self.dflash.layers):
                    att = layer.attention
                    mask = masks[sliding_window(self.sub, i)]
                    h = layer.input_layernorm(x)
                    if self.dflash.dflash2 is not None:  # DFlash2: the convolution pair around the attention
                        taps = layer.attention_conv.coefficients(h)
                        h = layer.attention_conv.mix(h, taps, 0)
                    q, k, v = att.split_qkv(h)
                    q = apply_rope(q, block_pos, self.inv_freq, self.rope_scaling, att.head_size)
                    k = apply_rope(k, block_pos, self.inv_freq, self.rope_scaling, att.head_size)
                    node_kv = index_select(self._layer_kv(token_kv, i), 1, flat)  # [2, b*N, kv, d]
                    node_kv = view(node_kv, concat([2, b, shape(acc, 1), att.num_kv_heads, att.head_size]))
                    layer_ctx = self._layer_kv(context_kv, i)  # [2, b, C, kv, d]
                    keys = concat([self._kv_part(layer_ctx, 0), self._kv_part(node_kv, 0), k], dim=1)
                    values = concat([self._kv_part(layer_ctx, 1), self._kv_part(node_kv, 1), v], dim=1)
                    attended = att.attend(q, keys, values, mask)
                    if self.dflash.dflash2 is not None:
                        attended = layer.attention_conv.mix(attended, taps, 1)
                    x = x + attended
                    h = layer.post_layernorm(x)
                    if self.dflash.dflash2 is None:
                        x = x + layer.mlp(h)
                    else:  # and around the MLP
                        taps = layer.mlp_conv.coefficients(h)
                        x = x + layer.mlp_conv.mix(layer.mlp(layer.mlp_conv.mix(h, taps, 0)), taps, 1)
                out = self.dflash.norm(x)
                return slice(out, [0, 1, 0], concat([b, bsz - 1, shape(out, 2)]))  # positions 1..B-1

            @staticmethod
            def _window_mask(keep: Tensor, block_pos: Tensor, key_pos: Tensor, window: int) -> Tensor:
                """[b, 1, B, S] additive mask of a sliding-window layer: a key is visible while it is kept
                and fewer than ``window`` positions behind the query (drafter.py, DFlashAttention)."""
                near = _int(lt(unsqueeze(block_pos, 2) - unsqueeze(key_pos, 1), window))  # [b, B, S]
                hidden = cast(1 - unsqueeze(keep, 1) * near, "float32") * -_HIDDEN
                return unsqueeze(hidden, 1)

            def _selector(self, hidden: Tensor, bonus: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
                """DFlash2's candidate selector on the block's hidden states [b, D, H] (D = B - 1), in
                float32 as the PyTorch runtime scores a half-precision drafter (dflash2/proposer.py).

                Returns the unary logits [b, D, V_padded] and the tables the runner drafts from: the
                top-K candidates [b, D, K] and their unary scores, the pairwise term ``edges`` [b, D, K, K]
                (row i of depth t: after candidate i of depth t - 1; at depth 1 every row is after the
                bonus), and the greedy chain [b, D]."""
                settings, depth, vocab = self.dflash.dflash2, self.block_size - 1, self.config.vocab_size
                k, rank = int(settings["selector_top_k"]), int(settings["selector_rank"])
                b = shape(hidden, 0)
                unary = cast(self.lm_head(hidden), "float32")  # the target's head, shared (as DFlash)
                if settings["output_multiplier"] != 1.0:
                    unary = unary * float(settings["output_multiplier"])
                cap = settings.get("final_logit_softcapping")
                if cap:
                    unary = tanh(unary / float(cap)) * float(cap)
                # Padded vocabulary columns (tp > 1) are never candidates.
                flat = view(slice(unary, [0, 0, 0], concat([b, depth, vocab])), concat([b * depth, vocab]))
                values, tokens = _top_k(flat, k, vocab)
                values, tokens = view(values, concat([b, depth, k])), view(tokens, concat([b, depth, k]))
                selector = self.dflash.candidate_selector
                gates = cast(selector.hidden_projection(hidden), "float32")  # [b, D, r]
                root = expand(view(bonus, concat([b, 1, 1])), concat([b, 1, k]))
                predecessors = root if depth == 1 else concat(
                    [root, slice(tokens, [0, 0, 0], concat([b, depth - 1, k]))], dim=1)  # [b, D, K]

                def rows(codebook: Parameter, ids: Tensor) -> Tensor:  # codebook rows, [b, D, K, r] float32
                    picked = index_select(codebook.value, 0, view(ids, concat([b * depth * k])))
                    return cast(view(picked, concat([b, depth, k, rank])), "float32")

                pair = rows(selector.predecessor_codebook, predecessors) * unsqueeze(gates, 2)
                edges = matmul(pair, rows(selector.successor_codebook, tokens), transb=True)  # [b, D, K, K]
                selected = {"dflash2_candidates": tokens, "dflash2_candidate_logits": values, "dflash2_edges": edges,
                            "dflash2_draft_tokens": self._selector_chain(values, tokens, edges)}
                return unary, selected

            def _selector_chain(self, values: Tensor, tokens: Tensor, edges: Tensor) -> Tensor:
                """The selector's greedy walk [b, D]: at depth t the argmax (first maximum) of
                ``unary_t + edges_t[row]``, row being the index of the previous choice (0 after the bonus)."""
                depth, k = self.block_size - 1, int(self.dflash.dflash2["selector_top_k"])
                b = shape(values, 0)
                chosen, index = [], None
                for t in range(depth):
                    unary_t = view(slice(values, [0, t, 0], concat([b, 1, k])), concat([b, k]))
                    edges_t = view(slice(edges, [0, t, 0, 0], concat([b, 1, k, k])), concat([b, k, k]))
                    if index is None:
                        edge = slice(edges_t, [0, 0, 0], concat([b, 1, k]))
                    else:
                        edge = gather(edges_t, 1, expand(unsqueeze(index, 2), concat([b, 1, k])))
                    index, _ = _first_argmax(unary_t + view(edge, concat([b, k])), k)  # [b, 1]
                    tokens_t = view(slice(tokens, [0, t, 0], concat([b, 1, k])), concat([b, k]))
                    chosen.append(gather(tokens_t, 1, index))
                return concat(chosen, dim=1)

            @staticmethod
            def _layer_kv(kv: Tensor, layer: int) -> Tensor:
                """kv[layer] (static index on dim 0)."""
                dims = [shape(kv, j) for j in range(1, kv.ndim())]
                part = slice(kv, [layer] + [0] * (kv.ndim() - 1), concat([1] + dims))
                return view(part, concat(dims))

            _kv_part = _layer_kv  # kv[0] is K, kv[1] is V

            def _draft_logits(self, hidden: Tensor) -> Tensor:
                if self.dflash.draft_vocab_size is None:
                    return self.lm_head(hidden)  # the target's lm_head, shared
                # Reduced draft vocabulary: score the draft rows, scatter into the target vocab.
                draft = self.dflash.lm_head(hidden)
                draft = slice(draft, [0, 0, 0], concat([shape(draft, 0), shape(draft, 1),
                                                        self.dflash.draft_vocab_size]))
                ids = self.dflash.d2t.value + constant(np.arange(self.dflash.draft_vocab_size, dtype=np.int32))
                vocab = pad_vocab_size(self.config.vocab_size, self.config.mapping.tp_size)
                base = expand(constant(np.full((1, 1, vocab), -1e30, dtype=np.float32)),
                              concat([shape(draft, 0), shape(draft, 1), vocab]))
                index = expand(unsqueeze(unsqueeze(ids, 0), 0),
                               concat([shape(draft, 0), shape(draft, 1), self.dflash.draft_vocab_size]))
                return scatter(base, 2, index, cast(draft, "float32"))

            # -- inputs ---------------------------------------------------------------------
            def prepare_inputs(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
                kwargs["speculative_decoding_draft_tokens_external"] = False
                kwargs["max_draft_len"] = self.max_draft_len
                kwargs["spec_decoding_is_generation_length_variable"] = True
                inputs = super().prepare_inputs(*args, **kwargs)
                inputs.update(self._dflash_inputs(kwargs))
                return inputs

            def _dflash_inputs(self, kwargs: dict[str, Any]) -> dict[str, Tensor]:
                net = default_net().plugin_config
                # TensorRT-LLM's own helper, so kv_type is the enum GenerationMixin compares against:
                # the C++ binding's KVCacheType up to 1.0, tensorrt_llm.llmapi.kv_cache_type's
                # (a plain Python enum that never equals the binding's) in 1.2.
                kv_type = get_kv_cache_type_from_legacy(True, bool(net.paged_kv_cache))
                enable_ctx_gen = GenerationMixin.has_ctx_gen_opt_profiles(
                    use_gpt_attention_plugin=net.gpt_attention_plugin, use_gemm_plugin=net.gemm_plugin,
                    remove_input_padding=net.remove_input_padding, kv_cache_type=kv_type)
                _, ranges = GenerationMixin.get_profiles_ranges(
                    max_batch_size=kwargs["max_batch_size"], max_beam_width=kwargs["max_beam_width"],
                    max_input_len=kwargs["max_input_len"], max_num_tokens=kwargs["max_num_tokens"],
                    max_draft_len=self.max_draft_len, opt_batch_size=kwargs.get("opt_batch_size"),
                    opt_num_tokens=kwargs.get("opt_num_tokens"), enable_ctx_gen_opt_profiles=enable_ctx_gen,
                    multiple_profiles=net.multiple_profiles, kv_cache_type=kv_type)
                bb = ranges["bb_range"]
                profiles = len(bb)
                tree_max = self.max_draft_len + 1
                node_max = max(kwargs["max_input_len"], tree_max)  # a prompt, or a tree
                tree = [[1, tree_max, tree_max]] * profiles
                nodes = [[1, tree_max, node_max]] * profiles
                seq = [[1, kwargs["max_seq_len"], kwargs["max_seq_len"]]] * profiles
                path = [[1, self.block_size, self.block_size]] * profiles
                sub, tp = self.sub, self.config.mapping.tp_size
                kv_heads, d, ld = max(sub["num_key_value_heads"] // tp, 1), sub["head_size"], sub["num_hidden_layers"]

                def tensor(name: str, dtype: Any, dims: list[tuple[str, Any]]) -> Tensor:
                    # As EagleForCausalLM.prepare_inputs: a dynamic dim is -1 with one [min, opt, max]
                    # per profile; a static dim is its size, repeated once per profile in dim_range.
                    shape_ = [-1 if isinstance(r, list) else r for _, r in dims]
                    ranges_ = OrderedDict((n, r if isinstance(r, list) else [r] * profiles) for n, r in dims)
                    return Tensor(name=name, dtype=dtype, shape=shape_, dim_range=ranges_)

                return {
                    "dflash_tree_parents": tensor("dflash_tree_parents", trt.int32,
                                                  [("batch_size", bb), ("dflash_tree_len", tree)]),
                    "dflash_node_index": tensor("dflash_node_index", trt.int32,
                                                [("batch_size", bb), ("dflash_nodes", nodes)]),
                    "dflash_logits_index": tensor("dflash_logits_index", trt.int32,
                                                  [("batch_size", bb), ("dflash_nodes", nodes)]),
                    "dflash_num_nodes": tensor("dflash_num_nodes", trt.int32, [("batch_size", bb)]),
                    "dflash_is_context": tensor("dflash_is_context", trt.int32, [("batch_size", bb)]),
                    "dflash_context_kv": tensor("dflash_context_kv", str_dtype_to_trt(self.config.dtype),
                                                [("dflash_layers", ld), ("kv", 2), ("batch_size", bb),
                                                 ("dflash_context_len", seq), ("kv_heads", kv_heads),
                                                 ("dflash_head_size", d)]),
                    "dflash_context_lengths": tensor("dflash_context_lengths", trt.int32, [("batch_size", bb)]),
                    "dflash_prev_accepted_nodes": tensor("dflash_prev_accepted_nodes", trt.int32,
                                                         [("batch_size", bb), ("dflash_path_len", path)]),
                    "dflash_prev_num_accepted": tensor("dflash_prev_num_accepted", trt.int32,
                                                       [("batch_size", bb)]),
                    "dflash_prev_past_lengths": tensor("dflash_prev_past_lengths", trt.int32,
                                                       [("batch_size", bb)]),
                }

        self.model = GenericDFlashForCausalLM(config)

    # Same delegation as MedusaForCausalLm.
    def __getattribute__(self, name: str) -> Any:
        if name == "model" or "__" in name:
            return object.__getattribute__(self, name)
        model = object.__getattribute__(self, "model")
        return model.__getattribute__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)


# PretrainedConfig.from_dict and commands/build.py::build_model resolve the architecture here.
MODEL_MAP[ARCHITECTURE] = DFlashForCausalLM

__all__ = ["DFlashForCausalLM"]
