"""Stand-in for ``tensorrt_llm/models/qwen/model.py`` (NVIDIA/TensorRT-LLM, index id 66032162657, the qwen2/qwen3
part): ``QWenDecoderLayer``, ``QWenModel``, ``QWenForCausalLM``."""

from __future__ import annotations

from ..._utils import pad_vocab_size
from ...functional import AttentionMaskType, LayerNormType, Tensor
from ...layers import Attention, ColumnLinear, Embedding, GatedMLP, RmsNorm
from ...module import Module
from ..modeling_utils import DecoderLayerList, DecoderModelForCausalLM
from .config import QWenConfig


class QWenDecoderLayer(Module):
    def __init__(self, config: QWenConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.config = layer_idx, config
        dtype, mapping = config.dtype, config.mapping
        self.input_layernorm = RmsNorm(normalized_shape=config.hidden_size, eps=config.norm_epsilon, dtype=dtype)
        qk_layernorm = config.qwen_type in ("qwen3", "qwen3_moe")
        self.attention = Attention(
            local_layer_idx=layer_idx - config.mapping.pp_layers(config.num_hidden_layers)[0],
            hidden_size=config.hidden_size, attention_head_size=config.head_size,
            num_attention_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings, dtype=dtype,
            attention_mask_type=AttentionMaskType.causal, bias=config.attn_bias,
            position_embedding_type=config.position_embedding_type, rotary_embedding_base=config.rotary_base,
            rotary_embedding_scaling=config.rotary_scaling, tp_group=mapping.tp_group, tp_size=mapping.tp_size,
            tp_rank=mapping.tp_rank, max_seqlen_for_logn_scaling=config.seq_length,
            use_logn_scaling=config.use_logn_attn, dense_bias=False, qk_layernorm=qk_layernorm,
            layernorm_type=LayerNormType.RmsNorm if qk_layernorm else LayerNormType.LayerNorm)
        self.mlp = GatedMLP(hidden_size=config.hidden_size, ffn_hidden_size=config.intermediate_size,
                            hidden_act=config.hidden_act, dtype=dtype, bias=config.mlp_bias,
                            tp_group=mapping.tp_group, tp_size=mapping.tp_size)
        self.post_layernorm = RmsNorm(normalized_shape=config.hidden_size, eps=config.norm_epsilon, dtype=dtype)

    def forward(self, hidden_states: Tensor, attention_mask=None, use_cache=False, spec_decoding_params=None,
                kv_cache_params=None, attention_params=None, lora_layer_params=None, mrope_params=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        attention_output = self.attention(hidden_states, attention_mask=attention_mask, use_cache=use_cache,
                                          spec_decoding_params=spec_decoding_params,
                                          kv_cache_params=kv_cache_params, attention_params=attention_params)
        if use_cache:
            attention_output, presents = attention_output
        hidden_states = residual + attention_output
        residual = hidden_states
        hidden_states = self.post_layernorm(hidden_states)
        hidden_states = residual + self.mlp(hidden_states)
        if use_cache:
            return hidden_states, presents
        return hidden_states


class QWenModel(Module):
    def __init__(self, config: QWenConfig) -> None:
        super().__init__()
        self.vocab_embedding = Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
        self.layers = DecoderLayerList(QWenDecoderLayer, config)
        self.ln_f = RmsNorm(normalized_shape=config.hidden_size, eps=config.norm_epsilon, dtype=config.dtype)

    def forward(self, input_ids: Tensor, position_ids=None, use_cache=False, spec_decoding_params=None,
                attention_mask=None, kv_cache_params=None, attention_params=None, mrope_params=None,
                hidden_states=None, prompt_embedding_table: Tensor | None = None,
                prompt_tasks: Tensor | None = None, prompt_vocab_size: Tensor | None = None, lora_params=None):
        hidden_states = self.vocab_embedding(input_ids)
        hidden_states = self.layers.forward(hidden_states, use_cache=use_cache, attention_mask=attention_mask,
                                            kv_cache_params=kv_cache_params, attention_params=attention_params,
                                            spec_decoding_params=spec_decoding_params)
        if use_cache:
            hidden_states, presents = hidden_states
        hidden_states = self.ln_f(hidden_states)
        if use_cache:
            return hidden_states, tuple(presents)
        return hidden_states


class QWenForCausalLM(DecoderModelForCausalLM):
    config_class = QWenConfig

    def __init__(self, config: QWenConfig):
        transformer = QWenModel(config)
        vocab_size_padded = pad_vocab_size(config.vocab_size, config.mapping.tp_size)
        lm_head = ColumnLinear(config.hidden_size, vocab_size_padded, bias=False, dtype=config.dtype,
                               tp_group=config.mapping.tp_group, tp_size=config.mapping.tp_size, gather_output=True)
        self.mapping = config.mapping
        super().__init__(config, transformer, lm_head)
