"""Stand-in for ``tensorrt_llm/parameter.py`` (NVIDIA/TensorRT-LLM, index id 728909344).

``value`` reads as a constant layer of the network being built; assignment takes a numpy
array or a torch tensor of the declared shape (a dtype change is logged and adopted, as upstream).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import tensorrt as trt
import torch

from ._utils import str_dtype_to_trt


def _to_numpy(value):
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            return value.float().numpy(), trt.bfloat16
        return value.numpy(), None
    return np.asarray(value), None


class Parameter:
    _DEFAULT_DTYPE = trt.DataType.FLOAT

    def __init__(self, value: np.ndarray | torch.Tensor | None = None, shape: Sequence[int] = None,
                 dtype: str | trt.DataType = None, is_buffer: bool = False, prefer_managed=False):
        if dtype is None:
            dtype = self._DEFAULT_DTYPE if value is None else _to_numpy(value)[1] or trt.DataType(
                _to_numpy(value)[0].dtype.name)
        elif isinstance(dtype, str):
            dtype = str_dtype_to_trt(dtype)
        self._dtype = dtype
        self.is_buffer = is_buffer
        self._value = None
        if value is None:
            assert isinstance(shape, (list, tuple)), "Parameter: shape must be a list or tuple"
            self._shape = tuple(int(s) for s in shape)
        else:
            self._shape = tuple(int(s) for s in value.shape)
            self.value = value

    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        return self._dtype

    def is_inited(self):
        return self._value is not None

    @property
    def value(self):
        from .functional import cast, constant

        if self._value is None:
            raise RuntimeError("Parameter.value read before a value was assigned (load the checkpoint first)")
        array = self._value
        if self._dtype == trt.bfloat16:
            return cast(constant(array.astype(np.float32)), "bfloat16")
        return constant(array, as_dtype=None)

    @value.setter
    def value(self, v):
        array, source_dtype = _to_numpy(v)
        if array.ndim == 0 and all(s == 1 for s in self._shape):
            array = array.reshape(self._shape)
        assert tuple(array.shape) == tuple(self._shape), \
            f"The value updated is not the same shape as the original. Updated: {array.shape}, original: {self._shape}"
        new_dtype = source_dtype or trt.DataType({"float32": "float32", "float16": "float16", "int32": "int32",
                                                  "int64": "int64", "int8": "int8", "bool": "bool"}[array.dtype.name])
        if new_dtype != self._dtype:
            warnings.warn(f"Parameter dtype is {self._dtype}, the value assigned is {new_dtype}; using {new_dtype}",
                          stacklevel=2)
            self._dtype = new_dtype
        self._value = np.ascontiguousarray(array)

    @property
    def raw_value(self):
        return self._value
