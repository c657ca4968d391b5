"""Stand-in for ``tensorrt_llm/layers/linear.py`` (NVIDIA/TensorRT-LLM @ 2a9abd9536aa62ad3e4b9314be9286b1b1be523b).

Weights ``[out/tp, in]`` (column) / ``[out, in/tp]`` (row), ``y = x @ W^T``; the column
layer all-gathers on the last dim with ``gather_output``, the row layer all-reduces."""

from __future__ import annotations

from ..functional import AllReduceParams, Tensor, allgather, allreduce, cast, matmul
from ..module import Module
from ..parameter import Parameter


class Linear(Module):
    def __init__(self, in_features, out_features, bias=True, dtype=None, tp_group=None, tp_size=1,
                 gather_output=True, share_weight=None, strict_dtype=False, pad_lda=0, pad_ldc=0,
                 prefer_managed_weight=True, is_qkv=False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features // tp_size
        self.dtype, self.tp_group, self.tp_size, self.gather_output = dtype, tp_group, tp_size, gather_output
        self.tp_dim = 0
        self.weight = share_weight if share_weight is not None else Parameter(
            shape=(self.out_features, self.in_features), dtype=dtype)
        if bias:
            self.bias = Parameter(shape=(self.out_features,), dtype=dtype)
        else:
            self.register_parameter("bias", None)

    def forward(self, x, lora_runtime_params=None, lora_hidden_state: Tensor | None = None, **kwargs) -> Tensor:
        y = matmul(x, self.weight.value, transb=True)
        if self._parameters.get("bias") is not None:
            y = y + cast(self.bias.value, y.dtype)
        if self.gather_output and self.tp_size > 1 and self.tp_group is not None:
            y = allgather(y, self.tp_group, gather_dim=-1)
        return y


ColumnLinear = Linear


class RowLinear(Module):
    def __init__(self, in_features, out_features, bias=True, dtype=None, tp_group=None, tp_size=1,
                 strict_dtype: bool = False, pad_lda=0, prefer_managed_weight=True, is_expert=False):
        super().__init__()
        self.in_features, self.out_features = in_features // tp_size, out_features
        self.dtype, self.tp_group, self.tp_size = dtype, tp_group, tp_size
        self.tp_dim = 1
        self.weight = Parameter(shape=(self.out_features, self.in_features), dtype=dtype)
        if bias:
            self.bias = Parameter(shape=(self.out_features,), dtype=dtype)
        else:
            self.register_parameter("bias", None)

    def forward(self, x, lora_runtime_params=None, lora_hidden_state: Tensor | None = None,
                all_reduce_params: AllReduceParams | None = None, **kwargs) -> Tensor:
        y = matmul(x, self.weight.value, transb=True)
        if self.tp_size > 1 and self.tp_group is not None:
            y = allreduce(y, self.tp_group, all_reduce_params=all_reduce_params)
        if self._parameters.get("bias") is not None:
            y = y + cast(self.bias.value, y.dtype)
        return y
