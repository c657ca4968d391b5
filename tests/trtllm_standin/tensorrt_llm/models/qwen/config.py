"""Stand-in for ``tensorrt_llm/models/qwen/config.py`` (NVIDIA/TensorRT-LLM @ 373970a88b18d893bff89ed1a6be2cb2254afb50).
``qwen_type`` and ``seq_length`` arrive through ``**kwargs`` (QWenDecoderLayer reads them)."""

from __future__ import annotations

from ..modeling_utils import PretrainedConfig


class QWenConfig(PretrainedConfig):
    def __init__(self, *, mlp_bias: bool = False, attn_bias: bool = True, rotary_base: float = 10000.0,
                 rotary_scaling: dict | None = None, disable_weight_only_quant_plugin: bool = False,
                 use_logn_attn: bool = False, moe=None, num_labels: int = 1, mlp_only_layers: list | None = None,
                 decoder_sparse_step: int = 1, **kwargs):
        self.mlp_bias, self.attn_bias = mlp_bias, attn_bias
        self.rotary_base, self.rotary_scaling = rotary_base, rotary_scaling
        self.disable_weight_only_quant_plugin, self.use_logn_attn = disable_weight_only_quant_plugin, use_logn_attn
        if moe is not None:
            raise NotImplementedError("the stand-in does not emulate MoE")
        self.moe = None
        self.num_labels, self.mlp_only_layers, self.decoder_sparse_step = num_labels, mlp_only_layers or [], \
            decoder_sparse_step
        super().__init__(**kwargs)
