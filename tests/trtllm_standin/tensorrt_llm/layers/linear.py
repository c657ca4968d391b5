"""Stand-in for ``tensorrt_llm/layers/linear.py`` (NVIDIA/TensorRT-LLM @ 2a9abd9536aa62ad3e4b9314be9286b1b1be523b).

Weights ``[out/tp, in]`` (column) / ``[out, in/tp]`` (row), ``y = x @ W^T``. As upstream, only
``LinearBase`` defines ``forward``; the subclasses differ in how they collect the partial
products: the column layer adds its bias and all-gathers on the last dim with
``gather_output``, the row layer all-reduces (``all_reduce_params`` arrives through
``forward``'s ``**kwargs``) and then adds its bias."""

from __future__ import annotations

from ..functional import Tensor, allgather, allreduce, cast, matmul
from ..module import Module
from ..parameter import Parameter


class LinearBase(Module):
    def __init__(self, local_in_features, local_out_features, bias=True, dtype=None, tp_group=None, tp_size=1,
                 share_weight=None, strict_dtype=False, pad_lda=0, pad_ldc=0, prefer_managed_weight=True):
        super().__init__()
        self.in_features, self.out_features = local_in_features, local_out_features
        self.dtype, self.tp_group, self.tp_size = dtype, tp_group, tp_size
        self.weight = share_weight if share_weight is not None else Parameter(
            shape=(self.out_features, self.in_features), dtype=dtype)
        if bias:
            self.bias = Parameter(shape=(self.out_features,), dtype=dtype)
        else:
            self.register_parameter("bias", None)

    def forward(self, x, lora_runtime_params=None, lora_hidden_state: Tensor | None = None, **kwargs) -> Tensor:
        if lora_runtime_params is not None or lora_hidden_state is not None:
            raise NotImplementedError("the stand-in does not emulate LoRA")
        return self._collect_and_bias(matmul(x, self.weight.value, transb=True), **kwargs)

    def _add_bias(self, y: Tensor) -> Tensor:
        if self._parameters.get("bias") is not None:
            y = y + cast(self.bias.value, y.dtype)
        return y


class Linear(LinearBase):
    def __init__(self, in_features, out_features, bias=True, dtype=None, tp_group=None, tp_size=1,
                 gather_output=True, share_weight=None, strict_dtype=False, pad_lda=0, pad_ldc=0,
                 prefer_managed_weight=True, is_qkv=False):
        super().__init__(in_features, out_features // tp_size, bias=bias, dtype=dtype, tp_group=tp_group,
                         tp_size=tp_size, share_weight=share_weight, strict_dtype=strict_dtype, pad_lda=pad_lda,
                         pad_ldc=pad_ldc, prefer_managed_weight=prefer_managed_weight)
        self.gather_output = gather_output
        self.tp_dim = 0

    def _collect_and_bias(self, y: Tensor, **kwargs) -> Tensor:
        y = self._add_bias(y)
        if self.gather_output and self.tp_size > 1 and self.tp_group is not None:
            y = allgather(y, self.tp_group, gather_dim=-1)
        return y


ColumnLinear = Linear


class RowLinear(LinearBase):
    def __init__(self, in_features, out_features, bias=True, dtype=None, tp_group=None, tp_size=1,
                 strict_dtype: bool = False, pad_lda=0, prefer_managed_weight=True, is_expert=False):
        super().__init__(in_features // tp_size, out_features, bias=bias, dtype=dtype, tp_group=tp_group,
                         tp_size=tp_size, strict_dtype=strict_dtype, pad_lda=pad_lda,
                         prefer_managed_weight=prefer_managed_weight)
        self.tp_dim = 1

    def _collect_and_bias(self, y: Tensor, **kwargs) -> Tensor:
        if self.tp_size > 1 and self.tp_group is not None:
            y = allreduce(y, self.tp_group, all_reduce_params=kwargs.get("all_reduce_params"))
        return self._add_bias(y)
