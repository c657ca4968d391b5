"""Stand-in for ``tensorrt_llm/layers/mlp.py`` (NVIDIA/TensorRT-LLM, index id 601018076):
``GatedMLP``: ``proj(act(fc(x)) * gate(x))``."""

from __future__ import annotations

from ..functional import ACT2FN, AllReduceParams
from ..module import Module
from ..quantization import QuantMode
from .linear import ColumnLinear, RowLinear


class MLP(Module):
    def __init__(self, hidden_size, ffn_hidden_size, hidden_act, bias=True, dtype=None, tp_group=None, tp_size=1,
                 quant_mode=QuantMode(0), inner_layernorm=False, eps=1e-05, is_expert=False):
        super().__init__()
        if hidden_act not in ACT2FN or ACT2FN[hidden_act] is None:
            raise ValueError(f"unsupported activation function: {hidden_act}")
        self.hidden_act = hidden_act
        fc_output_size = 2 * ffn_hidden_size if hidden_act in ("swiglu", "gegelu") else ffn_hidden_size
        self.fc = ColumnLinear(hidden_size, fc_output_size, bias=bias, dtype=dtype, tp_group=tp_group,
                               tp_size=tp_size, gather_output=False)
        self.proj = RowLinear(ffn_hidden_size, hidden_size, bias=bias, dtype=dtype, tp_group=tp_group,
                              tp_size=tp_size, is_expert=is_expert)

    def forward(self, hidden_states, lora_layer_params=None, gegelu_limit=None):
        if lora_layer_params is not None or gegelu_limit is not None:
            raise NotImplementedError("the stand-in does not emulate LoRA or gegelu")
        return self.proj(ACT2FN[self.hidden_act](self.fc(hidden_states)))


class GatedMLP(MLP):
    def __init__(self, hidden_size, ffn_hidden_size, hidden_act, bias=True, dtype=None, tp_group=None, tp_size=1,
                 quant_mode=QuantMode(0), inner_layernorm=False, eps=1e-05, is_expert=False):
        super().__init__(hidden_size, ffn_hidden_size, hidden_act, bias=bias, dtype=dtype, tp_group=tp_group,
                         tp_size=tp_size, quant_mode=quant_mode, inner_layernorm=inner_layernorm, eps=eps,
                         is_expert=is_expert)
        # GatedMLP's fc is ffn wide whatever the activation (its product with gate is)
        self.fc = ColumnLinear(hidden_size, ffn_hidden_size, bias=bias, dtype=dtype, tp_group=tp_group,
                               tp_size=tp_size, gather_output=False)
        self.gate = ColumnLinear(hidden_size, ffn_hidden_size, bias=bias, dtype=dtype, tp_group=tp_group,
                                 tp_size=tp_size, gather_output=False)

    def forward(self, hidden_states, lora_layer_params=None, all_reduce_params: AllReduceParams | None = None):
        inter = ACT2FN[self.hidden_act](self.fc(hidden_states))
        gate = self.gate(hidden_states)
        return self.proj(inter * gate, all_reduce_params=all_reduce_params)
