"""Stand-in for ``tensorrt_llm/models/llama/config.py`` (NVIDIA/TensorRT-LLM @ 89fd9b74ab7ae753b4c6b3db25a400dca7ea54a0)."""

from __future__ import annotations

from ..modeling_utils import PretrainedConfig


class LLaMAConfig(PretrainedConfig):
    def __init__(self, *, mlp_bias: bool = False, attn_bias: bool = False, rotary_base: float = 10000.0,
                 rotary_scaling: dict | None = None, residual_mlp: bool = False,
                 disable_weight_only_quant_plugin: bool = False, moe=None, remove_duplicated_kv_heads: bool = False,
                 embedding_multiplier: float = 1.0, attention_multiplier: float = 1.0,
                 residual_multiplier: float = 1.0, output_multiplier_scale: float = 1.0, **kwargs):
        self.mlp_bias, self.attn_bias = mlp_bias, attn_bias
        self.rotary_base, self.rotary_scaling = rotary_base, rotary_scaling
        self.residual_mlp, self.disable_weight_only_quant_plugin = residual_mlp, disable_weight_only_quant_plugin
        if moe is not None:
            raise NotImplementedError("the stand-in does not emulate MoE")
        self.moe = None
        self.remove_duplicated_kv_heads = remove_duplicated_kv_heads
        self.embedding_multiplier, self.attention_multiplier = embedding_multiplier, attention_multiplier
        self.residual_multiplier, self.output_multiplier_scale = residual_multiplier, output_multiplier_scale
        self.fc_after_embed, self.use_input_layernorm_in_first_layer = False, True
        self.use_last_layernorm, self.layer_idx_offset, self.has_partial_lora_mask = True, 0, False
        super().__init__(**kwargs)
