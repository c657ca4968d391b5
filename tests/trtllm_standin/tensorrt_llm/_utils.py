"""Stand-in for ``tensorrt_llm/_utils.py`` (NVIDIA/TensorRT-LLM @ ed53795b33fc139493f762a1c6c53f691cf52d38).

``trt_dtype_to_torch`` answers with the emulated device's storage dtype (``_emu.physical_dtype``):
the declared dtype, or float64 for every floating type in the ``exact`` numerics mode.
"""

from __future__ import annotations

import math
import os

import numpy as np
import tensorrt as trt
import torch
from _emu import physical_dtype

_str_to_trt_dtype_dict = dict(float16=trt.float16, float32=trt.float32, int64=trt.int64, int32=trt.int32,
                              int8=trt.int8, bool=trt.bool, bfloat16=trt.bfloat16, fp8=trt.fp8)
_trt_to_str_dtype_dict = {v: k for k, v in _str_to_trt_dtype_dict.items()}
_str_to_torch_dtype_dict = dict(bfloat16=torch.bfloat16, float16=torch.float16, float32=torch.float32,
                                int64=torch.int64, int32=torch.int32, int8=torch.int8, bool=torch.bool,
                                fp8=torch.float8_e4m3fn)
_torch_to_trt_dtype_dict = {torch.float16: trt.float16, torch.float32: trt.float32, torch.int64: trt.int64,
                            torch.int32: trt.int32, torch.int8: trt.int8, torch.float8_e4m3fn: trt.fp8,
                            torch.qint8: trt.int8, torch.bool: trt.bool, torch.bfloat16: trt.bfloat16}
_np_to_trt = {np.dtype("int8"): trt.int8, np.dtype("int32"): trt.int32, np.dtype("int64"): trt.int64,
              np.dtype("float16"): trt.float16, np.dtype("float32"): trt.float32, np.dtype("bool"): trt.bool}


def str_dtype_to_trt(dtype):
    ret = _str_to_trt_dtype_dict.get(dtype)
    assert ret is not None, f"Unsupported dtype: {dtype}"
    return ret


def trt_dtype_to_str(dtype: trt.DataType) -> str:
    assert isinstance(dtype, trt.DataType)
    return _trt_to_str_dtype_dict[dtype]


def str_dtype_to_torch(dtype):
    ret = _str_to_torch_dtype_dict.get(dtype)
    assert ret is not None, f"Unsupported dtype: {dtype}"
    return ret


def trt_dtype_to_torch(dtype):
    assert isinstance(dtype, trt.DataType), f"{dtype} is not supported"
    return physical_dtype(dtype.value)


def torch_dtype_to_trt(dtype):
    ret = _torch_to_trt_dtype_dict.get(dtype)
    assert ret is not None, f"{dtype} is not supported"
    return ret


def np_dtype_to_trt(dtype):
    ret = _np_to_trt.get(np.dtype(dtype))
    assert ret is not None, f"Unsupported dtype: {dtype}"
    return ret


def pad_vocab_size(vocab_size, tp_size):
    return int(math.ceil(vocab_size / tp_size) * tp_size)


def mpi_rank():
    """The launcher's rank (mpirun sets OMPI_COMM_WORLD_RANK; the stand-in's launcher does too)."""
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))


def mpi_world_size():
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def dim_to_trt_axes(dim):
    if not isinstance(dim, tuple):
        dim = (dim,)
    axes = 0
    for d in dim:
        axes |= 1 << d
    return axes


def dim_resolve_negative(dim, ndim):
    if not isinstance(dim, tuple):
        dim = (dim,)
    return tuple(d + ndim if d < 0 else d for d in dim)
