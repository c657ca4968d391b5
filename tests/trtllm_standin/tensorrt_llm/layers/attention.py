"""Stand-in for ``tensorrt_llm/layers/attention.py`` (NVIDIA/TensorRT-LLM, index id 1178835378; parameter
classes also @ 27712aa7720aa3e6a594ad3cc678625490cb479d).

``Attention.forward`` follows the upstream plugin path: ``qkv`` (column-parallel), the
q/k RMS norms of Qwen3 (``qk_layernorm``; eps is the Attention default 1e-05, upstream
does not pass the config's norm_epsilon; with as many KV heads as query heads the fused
qkv is read per head as ``[heads, 3, head_size]``), ``gpt_attention`` with the RoPE tables
of the top model (``rotary_inv_freq``, ``embed_positions_for_gpt_attention``), ``dense``.
"""

from __future__ import annotations

from ..functional import (
    AllReduceParams,
    AttentionMaskType,
    LayerNormType,
    PositionEmbeddingType,
    RopeEmbeddingUtils,
    RotaryScalingType,
    Tensor,
    concat,
    gpt_attention,
    shape,
    split,
    view,
)
from ..module import Module
from ..parameter import Parameter
from ..quantization import QuantMode
from .linear import ColumnLinear, RowLinear
from .normalization import RmsNorm


class SpecDecodingParams:
    def __init__(self, spec_decoding_is_generation_length_variable: bool = False,
                 spec_decoding_max_generation_length: int = 1, spec_decoding_generation_lengths: Tensor = None,
                 spec_decoding_position_offsets: Tensor = None, spec_decoding_packed_mask: Tensor = None,
                 spec_decoding_use: Tensor = None):
        self.spec_decoding_is_generation_length_variable = spec_decoding_is_generation_length_variable
        self.spec_decoding_max_generation_length = spec_decoding_max_generation_length
        self.spec_decoding_generation_lengths = spec_decoding_generation_lengths
        self.spec_decoding_position_offsets = spec_decoding_position_offsets
        self.spec_decoding_packed_mask = spec_decoding_packed_mask
        self.spec_decoding_use = spec_decoding_use


class MropeParams:
    def __init__(self, mrope_rotary_cos_sin: Tensor = None, mrope_position_deltas: Tensor = None):
        self.mrope_rotary_cos_sin = mrope_rotary_cos_sin
        self.mrope_position_deltas = mrope_position_deltas


class AttentionParams:
    def __init__(self, sequence_length: Tensor = None, context_lengths: Tensor = None,
                 host_context_lengths: Tensor = None, max_context_length: int = None,
                 host_request_types: Tensor = None, encoder_input_lengths: Tensor = None,
                 encoder_max_input_length: Tensor = None, host_runtime_perf_knobs: Tensor = None,
                 host_context_progress: Tensor = None):
        self.sequence_length = sequence_length
        self.context_lengths = context_lengths
        self.host_context_lengths = host_context_lengths
        self.max_context_length = max_context_length
        self.host_request_types = host_request_types
        self.encoder_input_lengths = encoder_input_lengths
        self.encoder_max_input_length = encoder_max_input_length
        self.host_runtime_perf_knobs = host_runtime_perf_knobs
        self.host_context_progress = host_context_progress
        self.embed_positions = None
        self.rotary_inv_freq = None
        self.embed_positions_for_gpt_attention = None
        self.short_mscale = 1.0
        self.long_mscale = 1.0

    def is_valid(self, gpt_attention_plugin, remove_input_padding, use_kv_cache):
        if gpt_attention_plugin:
            if use_kv_cache and self.sequence_length is None:
                return False
            if any(x is None for x in (self.context_lengths, self.host_request_types, self.max_context_length,
                                       self.host_runtime_perf_knobs, self.host_context_progress)):
                return False
        if remove_input_padding and (self.host_context_lengths is None or not gpt_attention_plugin):
            return False
        return True


class KeyValueCacheParams:
    def __init__(self, past_key_value: list[Tensor] = None, host_past_key_value_lengths: Tensor = None,
                 host_max_attention_window_sizes: Tensor = None, host_sink_token_length: Tensor = None,
                 kv_cache_block_offsets: Tensor = None, host_kv_cache_block_offsets: Tensor = None,
                 host_kv_cache_pool_pointers: Tensor = None, host_kv_cache_pool_mapping: Tensor = None,
                 cache_indirection: Tensor = None, past_key_value_length: Tensor = None,
                 cross_kv_cache_block_offsets: Tensor = None, host_cross_kv_cache_block_offsets: Tensor = None,
                 host_cross_kv_cache_pool_pointers: Tensor = None, host_cross_kv_cache_pool_mapping: Tensor = None):
        self.past_key_value = past_key_value
        self.host_past_key_value_lengths = host_past_key_value_lengths
        self.host_max_attention_window_sizes = host_max_attention_window_sizes
        self.host_sink_token_length = host_sink_token_length
        self.kv_cache_block_offsets = kv_cache_block_offsets
        self.host_kv_cache_block_offsets = host_kv_cache_block_offsets
        self.host_kv_cache_pool_pointers = host_kv_cache_pool_pointers
        self.host_kv_cache_pool_mapping = host_kv_cache_pool_mapping
        self.cache_indirection = cache_indirection

    def get_first_past_key_value(self):
        return None if self.past_key_value is None else self.past_key_value[0]

    def fill_none_tensor_list(self, list_size):
        if self.past_key_value is None:
            self.past_key_value = tuple([None] * list_size)

    def is_valid(self, gpt_attention_plugin):
        if gpt_attention_plugin:
            return all(x is not None for x in (self.host_past_key_value_lengths, self.host_max_attention_window_sizes,
                                               self.host_sink_token_length, self.cache_indirection))
        return True


class Attention(Module):
    def __init__(self, *, local_layer_idx, hidden_size, num_attention_heads, num_kv_heads=None,
                 max_position_embeddings=1024, num_layers=1, apply_query_key_layer_scaling=False,
                 attention_head_size=None, qk_layernorm=False, layernorm_type=LayerNormType.LayerNorm,
                 layernorm_share=True, inner_layernorm=False, eps=1e-05,
                 attention_mask_type=AttentionMaskType.padding, bias=True, dtype=None,
                 position_embedding_type=PositionEmbeddingType.learned_absolute, rotary_embedding_base=10000.0,
                 rotary_embedding_base_local=1.0, rotary_embedding_scaling=None, rotary_embedding_percentage=1.0,
                 rope_scaling_short_factors=None, rope_scaling_long_factors=None, rope_scaling_short_mscale=None,
                 rope_scaling_long_mscale=None, original_max_position_embeddings=1024, tp_group=None, tp_size=1,
                 tp_rank=0, quant_mode=QuantMode(0), q_scaling=1.0, cross_attention=False, relative_attention=False,
                 max_distance=0, num_buckets=0, dense_bias=None, clip_qkv=None, alibi_bias_max=8,
                 skip_cross_kv=False, max_attn_value=0.0, block_sparse_params=None,
                 use_implicit_relative_attention=False, reorder=False, enable_qkv=True, cp_group=[0],  # noqa: B006
                 cp_size=1, cp_rank=0, max_seqlen_for_logn_scaling=8192, use_logn_scaling=False, is_local=False):
        super().__init__()
        self.local_layer_idx = local_layer_idx
        self.attention_mask_type = attention_mask_type
        self.attention_head_size = attention_head_size or hidden_size // num_attention_heads
        assert num_attention_heads % tp_size == 0
        self.num_attention_heads = num_attention_heads // tp_size
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_attention_heads
        self.num_attention_kv_heads = (self.num_kv_heads + tp_size - 1) // tp_size
        self.tp_group, self.tp_size, self.tp_rank = tp_group, tp_size, tp_rank
        self.max_position_embeddings = max_position_embeddings
        self.original_max_position_embeddings = original_max_position_embeddings
        self.position_embedding_type = position_embedding_type
        self.q_scaling = q_scaling * (num_layers if apply_query_key_layer_scaling else 1)
        self.rotary_embedding_base = rotary_embedding_base
        self.rotary_embedding_scale_type = RotaryScalingType.none
        self.rotary_embedding_scale = 1.0
        if rotary_embedding_scaling is not None:
            kind = rotary_embedding_scaling.get("type", rotary_embedding_scaling.get("rope_type"))
            self.rotary_embedding_scale_type = RotaryScalingType.from_string(kind)
            self.rotary_embedding_scale = rotary_embedding_scaling.get("factor", 1.0)
        self.rotary_embedding_dim = int(self.attention_head_size * rotary_embedding_percentage) \
            if position_embedding_type.is_rope() else 0
        self.max_attn_value = max_attn_value
        self.qk_layernorm = qk_layernorm
        if dense_bias is None:
            dense_bias = bias
        d, h, kv = self.attention_head_size, self.num_attention_heads, self.num_attention_kv_heads
        self.qkv = ColumnLinear(hidden_size, tp_size * (h + 2 * kv) * d, bias=bias, dtype=dtype, tp_group=tp_group,
                                tp_size=tp_size, gather_output=False, is_qkv=True)
        self.dense = RowLinear(tp_size * h * d, hidden_size, bias=dense_bias, dtype=dtype, tp_group=tp_group,
                               tp_size=tp_size)
        if qk_layernorm:
            if layernorm_type != LayerNormType.RmsNorm or not layernorm_share:
                raise NotImplementedError("the stand-in emulates shared RmsNorm q/k norms only")
            self.q_layernorm = RmsNorm(d, eps=eps, dtype=dtype)
            self.k_layernorm = RmsNorm(d, eps=eps, dtype=dtype)

    @staticmethod
    def create_attention_const_params(model_cls, config):
        pe = config.position_embedding_type
        if isinstance(pe, str):
            pe = PositionEmbeddingType.from_string(pe)
        if not pe.is_rope():
            return
        scaling = getattr(config, "rotary_scaling", None) or {}
        scale_type = RotaryScalingType.from_string(scaling.get("type", scaling.get("rope_type", "none")))
        dim = int(config.head_size * getattr(config, "rotary_pct", 1.0))
        inv_freq, cos_sin = RopeEmbeddingUtils.create_sinusoidal_positions_for_attention_plugin(
            config.max_position_embeddings, dim, getattr(config, "rotary_base", 10000.0),
            scaling.get("factor", 1.0), scale_type)
        model_cls.register_parameter("rotary_inv_freq", Parameter(inv_freq, dtype="float32", is_buffer=True))
        model_cls.register_parameter("embed_positions_for_gpt_attention",
                                     Parameter(cos_sin, dtype="float32", is_buffer=True))

    @staticmethod
    def fill_attention_params(model_cls, attention_params):
        if "rotary_inv_freq" not in model_cls._parameters:
            return attention_params
        if attention_params is None:
            attention_params = AttentionParams()
        attention_params.rotary_inv_freq = model_cls.rotary_inv_freq.value
        attention_params.embed_positions_for_gpt_attention = model_cls.embed_positions_for_gpt_attention.value
        return attention_params

    def forward(self, hidden_states: Tensor, attention_mask=None, attention_packed_mask=None, use_cache=False,
                spec_decoding_params=None, mrope_params=None, kv_cache_params=None, attention_params=None,
                encoder_output: Tensor | None = None, position_embedding=None, norm_before_bmm1=False,
                lora_layer_params=None, cross_kv_cache_gen: Tensor | None = None,
                cross_kv_reuse: Tensor | None = None, all_reduce_params: AllReduceParams | None = None,
                skip_attn=None):
        from .._common import default_net
        from ..network import Network  # noqa: F401  (net exists while building)

        spec = spec_decoding_params or SpecDecodingParams()
        qkv = self.qkv(hidden_states)
        plugin_config = default_net().plugin_config
        if plugin_config.remove_input_padding:
            assert qkv.ndim() == 2, "with remove_input_padding the qkv must be [num_tokens, hidden]"
        if self.qk_layernorm:
            d, h, kv = self.attention_head_size, self.num_attention_heads, self.num_attention_kv_heads
            base = [shape(qkv, 0)]
            if h != kv:
                qkv = view(qkv, concat(base + [h + 2 * kv, d]))
                query, key, value = split(qkv, [h, kv, kv], dim=1)
            else:
                qkv = view(qkv, concat(base + [h, 3, d]))
                query, key, value = split(qkv, [1, 1, 1], dim=2)
                query, key, value = (view(t, concat(base + [h, d])) for t in (query, key, value))
            query = self.q_layernorm(query)
            key = self.k_layernorm(key)
            qkv = view(concat([query, key, value], dim=1), concat(base + [(h + 2 * kv) * d]))
        assert attention_params.is_valid(plugin_config.gpt_attention_plugin, plugin_config.remove_input_padding,
                                         use_cache)
        if use_cache:
            assert kv_cache_params.is_valid(plugin_config.gpt_attention_plugin)
        past_key_value = None if kv_cache_params is None else kv_cache_params.get_first_past_key_value()
        kv = kv_cache_params
        context, present = gpt_attention(
            qkv=qkv, past_key_value=past_key_value, attention_mask=attention_mask,
            attention_packed_mask=attention_packed_mask, sequence_length=attention_params.sequence_length,
            host_past_key_value_lengths=kv.host_past_key_value_lengths,
            host_max_attention_window_sizes=kv.host_max_attention_window_sizes,
            host_sink_token_length=kv.host_sink_token_length, context_lengths=attention_params.context_lengths,
            cache_indirection=kv.cache_indirection, host_request_types=attention_params.host_request_types,
            layer_idx=self.local_layer_idx, num_heads=self.num_attention_heads,
            num_kv_heads=self.num_attention_kv_heads, num_kv_heads_origin=self.num_kv_heads,
            hidden_size_per_head=self.attention_head_size, q_scaling=self.q_scaling,
            rotary_embedding_dim=self.rotary_embedding_dim, rotary_embedding_base=self.rotary_embedding_base,
            rotary_embedding_scale_type=self.rotary_embedding_scale_type,
            rotary_embedding_scale=self.rotary_embedding_scale,
            rotary_embedding_max_positions=self.max_position_embeddings,
            rotary_embedding_original_max_positions=self.original_max_position_embeddings,
            position_embedding_type=self.position_embedding_type,
            rotary_inv_freq=attention_params.rotary_inv_freq,
            rotary_cos_sin=attention_params.embed_positions_for_gpt_attention,
            max_context_length=attention_params.max_context_length, mask_type=self.attention_mask_type,
            tp_size=self.tp_size, tp_rank=self.tp_rank, kv_cache_block_offsets=kv.kv_cache_block_offsets,
            host_kv_cache_block_offsets=kv.host_kv_cache_block_offsets,
            host_kv_cache_pool_pointers=kv.host_kv_cache_pool_pointers,
            host_kv_cache_pool_mapping=kv.host_kv_cache_pool_mapping,
            host_context_lengths=attention_params.host_context_lengths, use_cache=use_cache,
            spec_decoding_is_generation_length_variable=spec.spec_decoding_is_generation_length_variable,
            spec_decoding_max_generation_length=spec.spec_decoding_max_generation_length,
            spec_decoding_generation_lengths=spec.spec_decoding_generation_lengths,
            spec_decoding_position_offsets=spec.spec_decoding_position_offsets,
            spec_decoding_packed_mask=spec.spec_decoding_packed_mask, spec_decoding_use=spec.spec_decoding_use,
            attn_logit_softcapping_scale=self.max_attn_value,
            host_runtime_perf_knobs=attention_params.host_runtime_perf_knobs,
            host_context_progress=attention_params.host_context_progress,
        )
        context = self.dense(context, all_reduce_params=all_reduce_params)
        if use_cache:
            return context, present
        return context
