"""Stand-in for ``tensorrt_llm/functional.py`` (NVIDIA/TensorRT-LLM @ 0071496dc625910229bf433821453636ef3770eb).

Signatures are the upstream ones (checked against ``manifest.json`` by
``tests/test_trtllm_standin.py``). Each function adds one layer to the current network
whose computation is a module-level kernel below (``_k_*``), applied eagerly by the
emulated device when the engine runs. The TensorRT semantics that matter and differ
from torch are kept: strongly typed element-wise ops (a Python scalar takes the other
operand's dtype; int32 is widened to int64; other mismatches are refused), ``gather`` is
GatherElements and ``index_select`` / ``select`` are Gather, ``concat`` turns Python ints
into int32 ``[1]`` constants (int64 when an int64 tensor is present) and views 0-d inputs
as ``[1]``, ``shape()`` is int64 and 0-d with a ``dim``, ``argmax`` is TopK (int32),
``slice`` takes starts/sizes/strides as lists or shape tensors and refuses out-of-bounds
reads, ``expand`` is a stride-0 slice, ``arange`` takes ``dtype`` as a string.
"""

from __future__ import annotations

import builtins
import enum
import math
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from functools import partial

import numpy as np
import tensorrt as trt
import torch
from _emu import EmulationError, physical_dtype
from _emu.core import compute_dtype

from ._common import default_net, default_trtnet
from ._utils import dim_resolve_negative, np_dtype_to_trt, str_dtype_to_trt
from .quantization import QuantMode


class DimRange:
    """One optimization profile of a network input: per dimension (min, opt, max) and names."""

    def __init__(self, shape: list, names: list) -> None:
        self.min, self.opt, self.max, self.dimension_names = [], [], [], []
        for dim, name in zip(shape, names):
            if isinstance(dim, int):
                lo = mid = hi = dim
            else:
                lo, mid, hi = (int(v) for v in dim)
                assert 0 <= lo <= mid <= hi, f"dim range of {name!r} must satisfy 0 <= min <= opt <= max: {dim}"
            self.min.append(lo)
            self.opt.append(mid)
            self.max.append(hi)
            self.dimension_names.append(name)


class Tensor:
    def __init__(self, name=None, dtype=None, shape=None, dim_range=None, is_network_input=True,
                 location=trt.TensorLocation.DEVICE, network=None, trt_tensor=None):
        if isinstance(dtype, str):
            dtype = str_dtype_to_trt(dtype)
        if trt_tensor is not None:
            assert network is not None and not is_network_input
            self.trt_tensor, self._network = trt_tensor, weakref.ref(network)
            return
        self._network = weakref.ref(default_net())
        self.trt_tensor = None
        self.profiles: list[DimRange] = []
        if is_network_input:
            if dim_range is not None:
                assert isinstance(dim_range, OrderedDict), "dim_range must be an OrderedDict"
                assert len(dim_range) >= 1
                counts = {len(v) for v in dim_range.values()}
                assert len(counts) == 1, f"every dimension needs the same number of profiles: {dim_range}"
                names = list(dim_range.keys())
                for p in range(counts.pop()):
                    self.profiles.append(DimRange([dim_range[n][p] for n in names], names))
            default_net()._add_input(self, name, dtype, shape, dim_range)
            self.name, self.dtype, self.shape = name, dtype, shape
            if location != trt.TensorLocation.DEVICE:
                self.location = location

    @property
    def name(self):
        return self.trt_tensor.name

    @name.setter
    def name(self, name):
        if name is not None:
            self.trt_tensor.name = name

    @property
    def dtype(self):
        return self.trt_tensor.dtype

    @dtype.setter
    def dtype(self, dtype):
        if dtype is not None:
            self.trt_tensor.dtype = dtype

    @property
    def shape(self):
        return self.size()

    @shape.setter
    def shape(self, shape):
        if shape is not None:
            self.trt_tensor.shape = shape

    @property
    def location(self):
        return self.trt_tensor.location

    @location.setter
    def location(self, location):
        if location is not None:
            self.trt_tensor.location = location

    @property
    def network(self):
        return self._network()

    def mark_output(self, name: str | None = None, dtype: str | trt.DataType | None = None):
        if name is None:
            name = self.name
        if isinstance(dtype, str):
            dtype = str_dtype_to_trt(dtype)
        assert dtype is None or isinstance(dtype, trt.DataType)
        default_net()._mark_output(self, name, dtype)

    def __add__(self, b):
        return add(self, b)

    def __radd__(self, b):
        return add(b, self)

    def __sub__(self, b):
        return sub(self, b)

    def __rsub__(self, b):
        return sub(b, self)

    def __mul__(self, b):
        return mul(self, b)

    def __rmul__(self, b):
        return mul(b, self)

    def __truediv__(self, b):
        return div(self, b)

    def __floordiv__(self, b):
        return floordiv(self, b)

    def __mod__(self, b):
        return modulo(self, b)

    def __lt__(self, b):
        return lt(self, b)

    def __gt__(self, b):
        return gt(self, b)

    def __eq__(self, b):
        return eq(self, b)

    def __ge__(self, b):
        return op_or(self > b, self == b)

    def __le__(self, b):
        return op_or(self < b, self == b)

    def __hash__(self):
        return id(self.trt_tensor)

    def view(self, shape, zero_is_placeholder=True):
        return view(self, shape, zero_is_placeholder)

    def flatten(self, start_dim=0, end_dim=-1):
        return flatten(self, start_dim, end_dim)

    def permute(self, dims):
        return permute(self, dims)

    def transpose(self, dim0, dim1):
        return transpose(self, dim0, dim1)

    def mean(self, dim, keepdim=False):
        return mean(self, dim, keepdim)

    def max(self, dim, keepdim=False):
        return max(self, dim, keepdim)

    def abs(self):
        return abs(self)

    def sqrt(self):
        return sqrt(self)

    def log(self):
        return log(self)

    def squeeze(self, dim, zero_is_placeholder):
        return squeeze(self, dim, zero_is_placeholder)

    def unsqueeze(self, dim):
        return unsqueeze(self, dim)

    def cast(self, dtype):
        return cast(self, dtype)

    def size(self, dim=None):
        if dim is None:
            return self.trt_tensor.shape
        return self.trt_tensor.shape[dim]

    def rank(self):
        return len(self.trt_tensor.shape)

    def ndim(self):
        return len(self.trt_tensor.shape)

    def split(self, split_size_or_sections, dim=0):
        return split(self, split_size_or_sections, dim)

    def select(self, dim, index):
        return select(self, dim, index)

    def is_dynamic(self, dim=None):
        if dim is not None:
            return self.trt_tensor.shape[dim] == -1
        return any(d == -1 for i, d in enumerate(self.trt_tensor.shape) if i != 0)


def _create_tensor(trt_tensor: trt.ITensor, producer: trt.ILayer) -> Tensor:
    assert trt_tensor is not None and producer is not None
    tensor = Tensor(name=trt_tensor.name, dtype=trt_tensor.dtype, shape=trt_tensor.shape, is_network_input=False)
    tensor.trt_tensor, tensor.producer = trt_tensor, producer
    return tensor


# ----------------------------------------------------------------------------- enums


class PositionEmbeddingType(enum.IntEnum):
    learned_absolute = 0
    rope_gptj = 1
    rope_gpt_neox = 2
    long_rope = 3
    alibi = 4
    alibi_with_scale = 5
    relative = 6
    chatglm = 7
    yarn = 8
    mrope = 9
    deferred = 10

    def is_rope(self) -> bool:
        return self in (self.rope_gptj, self.rope_gpt_neox, self.long_rope, self.mrope, self.yarn)

    def is_alibi(self) -> bool:
        return self in (self.alibi, self.alibi_with_scale)

    def is_mrope(self) -> bool:
        return self == self.mrope

    @staticmethod
    def from_string(s):
        return PositionEmbeddingType[s]


class RotaryScalingType(enum.IntEnum):
    none = 0
    linear = 1
    dynamic = 2
    longrope = 3
    llama3 = 4
    yarn = 5
    mrope = 6

    @staticmethod
    def from_string(s):
        try:
            return RotaryScalingType[s]
        except KeyError as err:
            raise ValueError(f"Unsupported rotary scaling type: {s}") from err


class AttentionMaskType(enum.IntEnum):
    padding = 0
    causal = 1
    sliding_window_causal = 2
    bidirectional = 3
    bidirectionalglm = 4
    blocksparse = 5
    custom_mask = 6


class LayerNormType(enum.IntEnum):
    LayerNorm = 0
    RmsNorm = 1
    GroupNorm = 2


class AllReduceStrategy(enum.IntEnum):
    NCCL = 0
    MIN_LATENCY = 1
    UB = 2
    AUTO = 3
    ONESHOT = 4
    TWOSHOT = 5
    LOWPRECISION = 6
    MNNVL = 7
    NCCL_SYMMETRIC = 8
    SYMM_MEM = 9
    FLASHINFER = 10


class AllReduceFusionOp(enum.IntEnum):
    NONE = 0
    RESIDUAL_RMS_NORM = 1
    LAST_PROCESS_FOR_UB = 2
    RESIDUAL_RMS_PREPOST_NORM = 3
    RESIDUAL_RMS_NORM_QUANT_FP8 = 4
    RESIDUAL_RMS_NORM_QUANT_NVFP4 = 5
    RESIDUAL_RMS_NORM_OUT_QUANT_FP8 = 6
    RESIDUAL_RMS_NORM_OUT_QUANT_NVFP4 = 7
    MOE_FINALIZE_ALLREDUCE_RESIDUAL_RMS_NORM = 8


class AllReduceParams:
    def __init__(self, strategy: AllReduceStrategy = AllReduceStrategy.AUTO,
                 fusion_op: AllReduceFusionOp = AllReduceFusionOp.NONE, bias: Tensor | None = None,
                 residual: Tensor | None = None, norm_weight: Tensor | None = None,
                 scale: Tensor | None = None, norm_pre_residual_weight: Tensor | None = None,
                 eps: float = 1e-06, enable_allreduce: bool = True, trigger_completion_at_end: bool = True):
        assert fusion_op == AllReduceFusionOp.NONE or residual is not None
        self.strategy, self.fusion_op, self.bias, self.residual = strategy, fusion_op, bias, residual
        self.norm_weight, self.scale, self.norm_pre_residual_weight = norm_weight, scale, norm_pre_residual_weight
        self.eps, self.enable_allreduce, self.trigger_completion_at_end = eps, enable_allreduce, trigger_completion_at_end

    def update_strategy(self):
        if self.strategy == AllReduceStrategy.AUTO and default_net().plugin_config.user_buffer:
            self.strategy = AllReduceStrategy.UB


# ------------------------------------------------------------------- layer plumbing


def _layer(kind: str, fn, inputs: Sequence[Tensor | None], outputs: Sequence[tuple], attrs=None,
           shape_args: Sequence[int] = ()):
    """Add one stand-in layer; ``outputs`` are (trt dtype, static shape) pairs."""
    layer = default_trtnet()._standin_layer(kind, fn, [None if t is None else t.trt_tensor for t in inputs],
                                            outputs, attrs, shape_args)
    tensors = [_create_tensor(layer.get_output(i), layer) for i in range(len(outputs))]
    return tensors[0] if len(tensors) == 1 else tensors


def _np_torch(array: np.ndarray, declared: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(physical_dtype(declared))


def _up(x: torch.Tensor) -> torch.Tensor:
    """Floating inputs in the precision TensorRT's kernels compute in."""
    return x.to(compute_dtype("")) if x.is_floating_point() else x


def _broadcast_static(a: Sequence[int], b: Sequence[int]) -> list[int]:
    out = []
    for x, y in zip(a, b):
        if x == 1:
            out.append(y)
        elif y == 1 or x == y:
            out.append(x)
        elif x == -1 or y == -1:
            out.append(builtins.max(x, y) if builtins.min(x, y) > 1 else -1)
        else:
            raise EmulationError(f"cannot broadcast static shapes {tuple(a)} and {tuple(b)}")
    return out


# ----------------------------------------------------------------------- constants


def _k_constant(args, attrs):
    return [_np_torch(attrs["array"], attrs["dtype"])]


def constant(ndarray: np.ndarray, as_dtype: trt.DataType | None = None, as_shape=None) -> Tensor:
    dtype = as_dtype if as_dtype is not None else np_dtype_to_trt(ndarray.dtype)
    array = np.ascontiguousarray(ndarray)
    if as_shape is not None:
        array = array.reshape(as_shape)
    return _layer("CONSTANT", _k_constant, [], [(dtype, array.shape)], {"array": array, "dtype": dtype.value})


def constant_to_tensor_(input: Tensor | int | float | bool, dtype: trt.DataType | str = None,
                        to_array=True) -> Tensor:
    if isinstance(input, Tensor):
        return input
    if isinstance(dtype, str):
        dtype = str_dtype_to_trt(dtype)
    if dtype is None:
        dtype = trt.bool if isinstance(input, bool) else trt.int32 if isinstance(input, int) else trt.float32
    np_type = {trt.int64: np.int64, trt.int32: np.int32, trt.float32: np.float32, trt.float16: np.float16,
               trt.bool: np.bool_}.get(dtype)
    if dtype == trt.bfloat16:
        tensor = constant(np.array([input] if to_array else input, dtype=np.float32))
        return cast(tensor, trt.bfloat16)
    assert np_type is not None, f"constant_to_tensor_: unsupported dtype {dtype}"
    return constant(np.array([input] if to_array else input, dtype=np_type))


def constants_to_tensors_(*inputs: Tensor | int | float) -> tuple[Tensor, ...]:
    has_int64 = any((isinstance(x, int) and not isinstance(x, bool) and not -2**31 <= x < 2**31)
                    or (isinstance(x, Tensor) and x.dtype == trt.int64) for x in inputs)
    if not has_int64:
        return tuple(constant_to_tensor_(x) for x in inputs)
    return tuple(constant_to_tensor_(x, trt.int64 if isinstance(x, (int, Tensor)) and not isinstance(x, bool)
                                     else None) for x in inputs)


def expand_dims_like(left: Tensor | int | float, right: Tensor) -> Tensor:
    return _lift(constant_to_tensor_(left), right.ndim())


def broadcast_helper(left: Tensor | int | float, right: Tensor | int | float) -> tuple[Tensor, Tensor]:
    if default_net().strongly_typed:
        left = constant_to_tensor_(left, right.dtype if isinstance(right, Tensor) else None)
        right = constant_to_tensor_(right, left.dtype)
    else:
        left, right = constant_to_tensor_(left), constant_to_tensor_(right)
    if left.rank() == right.rank():
        return left, right
    if left.rank() < right.rank():
        return expand_dims_like(left, right), right
    return left, expand_dims_like(right, left)


# ---------------------------------------------------------------------- element-wise

_BOOL_OPS = ("GREATER", "LESS", "EQUAL", "AND", "OR", "XOR")


def _k_elementwise(args, attrs):
    a, b = args
    op = attrs["op"]  # the trt.ElementWiseOperation member's name
    if op in ("AND", "OR", "XOR"):
        return [{"AND": torch.logical_and, "OR": torch.logical_or, "XOR": torch.logical_xor}[op](a, b)]
    if op in ("GREATER", "LESS", "EQUAL"):
        return [{"GREATER": torch.gt, "LESS": torch.lt, "EQUAL": torch.eq}[op](a, b)]
    x, y = _up(a), _up(b)
    if op == "SUM":
        return [x + y]
    if op == "SUB":
        return [x - y]
    if op == "PROD":
        return [x * y]
    if op == "DIV":
        return [x / y if x.is_floating_point() else torch.div(x, y, rounding_mode="trunc")]
    if op == "FLOOR_DIV":
        return [torch.div(x, y, rounding_mode="floor")]
    if op == "MIN":
        return [torch.minimum(x, y)]
    if op == "MAX":
        return [torch.maximum(x, y)]
    if op == "POW":
        return [torch.pow(x, y)]
    raise EmulationError(f"unknown element-wise op {op}")


def elementwise_binary(left: Tensor | int | float, right: Tensor | int | float,
                       op: trt.ElementWiseOperation) -> Tensor:
    op = trt.ElementWiseOperation(op).name
    left, right = broadcast_helper(left, right)
    if left.dtype == trt.int32 and right.dtype == trt.int64:
        left = cast(left, "int64")
    elif left.dtype == trt.int64 and right.dtype == trt.int32:
        right = cast(right, "int64")
    if left.dtype != right.dtype:
        raise EmulationError(f"element-wise {op}: input types differ ({left.dtype.value} vs {right.dtype.value}); "
                             "a strongly typed TensorRT network does not convert them")
    if op in ("AND", "OR", "XOR") and left.dtype != trt.bool:
        raise EmulationError(f"element-wise {op} needs bool inputs, got {left.dtype.value}")
    out_dtype = trt.bool if op in _BOOL_OPS else left.dtype
    shape = _broadcast_static(left.shape, right.shape)
    return _layer("ELEMENTWISE", _k_elementwise, [left, right], [(out_dtype, shape)], {"op": op})


add = partial(elementwise_binary, op=trt.ElementWiseOperation.SUM)
sub = partial(elementwise_binary, op=trt.ElementWiseOperation.SUB)
mul = partial(elementwise_binary, op=trt.ElementWiseOperation.PROD)
div = partial(elementwise_binary, op=trt.ElementWiseOperation.DIV)
floordiv = partial(elementwise_binary, op=trt.ElementWiseOperation.FLOOR_DIV)
gt = partial(elementwise_binary, op=trt.ElementWiseOperation.GREATER)
lt = partial(elementwise_binary, op=trt.ElementWiseOperation.LESS)
eq = partial(elementwise_binary, op=trt.ElementWiseOperation.EQUAL)
op_and = partial(elementwise_binary, op=trt.ElementWiseOperation.AND)
op_or = partial(elementwise_binary, op=trt.ElementWiseOperation.OR)
op_xor = partial(elementwise_binary, op=trt.ElementWiseOperation.XOR)
minimum = partial(elementwise_binary, op=trt.ElementWiseOperation.MIN)
maximum = partial(elementwise_binary, op=trt.ElementWiseOperation.MAX)
pow = partial(elementwise_binary, op=trt.ElementWiseOperation.POW)  # noqa: A001


def modulo(x: Tensor, y: Tensor | int) -> Tensor:
    return x - (x // y) * y


def int_clip(input: Tensor, lower: int, upper: int) -> Tensor:
    assert lower <= upper
    return maximum(minimum(input, upper), lower)


def _k_where(args, attrs):
    cond, a, b = args
    return [torch.where(cond, _up(a), _up(b))]


def _lift(t: Tensor, rank: int) -> Tensor:
    """Prepend size-1 dims up to ``rank`` (what expand_dims_like does)."""
    extra = rank - t.rank()
    return t if extra <= 0 else view(t, [1] * extra + list(t.shape), zero_is_placeholder=False)


def where(condition: Tensor | bool, left: Tensor | int | float, right: Tensor | int | float) -> Tensor:
    condition = constant_to_tensor_(condition)
    left, right = constants_to_tensors_(left, right)
    if left.dtype != right.dtype:
        raise EmulationError(f"where: branch types differ ({left.dtype.value} vs {right.dtype.value})")
    rank = builtins.max(condition.rank(), left.rank(), right.rank())
    condition, left, right = (_lift(t, rank) for t in (condition, left, right))
    shape = _broadcast_static(_broadcast_static(condition.shape, left.shape), right.shape)
    return _layer("SELECT", _k_where, [condition, left, right], [(left.dtype, shape)])


# --------------------------------------------------------------------------- unary


def _k_unary(args, attrs):
    (x,) = args
    op = attrs["op"]
    if op == "NOT":
        return [torch.logical_not(x)]
    fns = {"EXP": torch.exp, "SQRT": torch.sqrt, "SIN": torch.sin, "COS": torch.cos, "ABS": torch.abs,
           "LOG": torch.log, "ROUND": torch.round}
    if op not in fns:
        raise EmulationError(f"unary {op} is not emulated")
    return [fns[op](_up(x))]


def unary(input: Tensor, op: trt.UnaryOperation) -> Tensor:
    return _layer("UNARY", _k_unary, [input], [(input.dtype, input.shape)], {"op": trt.UnaryOperation(op).name})


round = partial(unary, op=trt.UnaryOperation.ROUND)  # noqa: A001
sqrt = partial(unary, op=trt.UnaryOperation.SQRT)
exp = partial(unary, op=trt.UnaryOperation.EXP)
sin = partial(unary, op=trt.UnaryOperation.SIN)
cos = partial(unary, op=trt.UnaryOperation.COS)
abs = partial(unary, op=trt.UnaryOperation.ABS)  # noqa: A001
log = partial(unary, op=trt.UnaryOperation.LOG)
not_op = partial(unary, op=trt.UnaryOperation.NOT)


def _k_activation(args, attrs):
    (x,) = args
    fns = {"SIGMOID": torch.sigmoid, "RELU": torch.relu, "TANH": torch.tanh}
    if attrs["act_type"] not in fns:
        raise EmulationError(f"activation {attrs['act_type']} is not emulated")
    return [fns[attrs["act_type"]](_up(x))]


def activation(input: Tensor, act_type: trt.ActivationType) -> Tensor:
    return _layer("ACTIVATION", _k_activation, [input], [(input.dtype, input.shape)],
                  {"act_type": trt.ActivationType(act_type).name})


relu = partial(activation, act_type=trt.ActivationType.RELU)
tanh = partial(activation, act_type=trt.ActivationType.TANH)
sigmoid = partial(activation, act_type=trt.ActivationType.SIGMOID)


def silu(input: Tensor) -> Tensor:
    return input * sigmoid(input)


def _k_cast(args, attrs):
    return [args[0].to(physical_dtype(attrs["dtype"]))]


def cast(input: Tensor, dtype: str | trt.DataType):
    if isinstance(dtype, str):
        dtype = str_dtype_to_trt(dtype)
    elif not isinstance(dtype, trt.DataType):
        raise TypeError(f"cast: dtype must be str or tensorrt.DataType, got {dtype!r}")
    if input.dtype == dtype:
        return input
    return _layer("CAST", _k_cast, [input], [(dtype, input.shape)], {"dtype": dtype.value})


def identity(input: Tensor) -> Tensor:
    return _layer("IDENTITY", _k_identity, [input], [(input.dtype, input.shape)])


def _k_identity(args, attrs):
    return [args[0]]


# ---------------------------------------------------------------------------- matmul


def _k_matmul(args, attrs):
    a, b = (_up(x) for x in args)
    if attrs["transa"]:
        a = a.transpose(-1, -2)
    if attrs["transb"]:
        b = b.transpose(-1, -2)
    return [torch.matmul(a, b)]


def matmul(input: Tensor, mat2: Tensor, transa: bool = False, transb: bool = False,
           use_fp32_acc: bool = True) -> Tensor:
    if input.dtype != mat2.dtype:
        raise EmulationError(f"matmul: input types differ ({input.dtype.value} vs {mat2.dtype.value})")
    input, mat2 = broadcast_helper(input, mat2)
    a, b = list(input.shape), list(mat2.shape)
    m = a[-1] if transa else a[-2]
    k_a = a[-2] if transa else a[-1]
    k_b = b[-1] if transb else b[-2]
    n = b[-2] if transb else b[-1]
    if k_a != -1 and k_b != -1 and k_a != k_b:
        raise EmulationError(f"matmul: inner dimensions differ ({k_a} vs {k_b}) for {tuple(a)} x {tuple(b)}")
    batch = _broadcast_static(a[:-2], b[:-2])
    return _layer("MATRIX_MULTIPLY", _k_matmul, [input, mat2], [(input.dtype, batch + [m, n])],
                  {"transa": transa, "transb": transb})


# ----------------------------------------------------------------------- shape ops


def _k_shape(args, attrs):
    shape = torch.tensor(list(args[0].shape), dtype=torch.int64)
    if attrs["dim"] is not None:
        return [shape[attrs["dim"]].reshape(())]
    return [shape]


def shape(input: Tensor, dim: int | None = None, cast_to_dtype: str | trt.DataType | None = None,
          clip_before_cast: Sequence[int] = None) -> Tensor:
    if dim is not None:
        dim = dim if dim >= 0 else dim + input.ndim()
    out_shape = [] if dim is not None else [input.ndim()]
    res = _layer("SHAPE", _k_shape, [input], [(trt.int64, out_shape)], {"dim": dim})
    if cast_to_dtype is not None:
        if clip_before_cast is not None and cast_to_dtype in ("int32", trt.int32):
            assert len(clip_before_cast) == 2
            res = int_clip(res, clip_before_cast[0], clip_before_cast[1])
        res = cast(res, cast_to_dtype)
    return res


def _static_len(t: Tensor, what: str) -> int:
    if t.ndim() != 1 or t.shape[0] == -1:
        raise EmulationError(f"{what} must be a 1-D shape tensor of known length, got shape {tuple(t.shape)}")
    return t.shape[0]


def _k_view(args, attrs):
    x = args[0]
    target = attrs["shape"] if attrs["shape"] is not None else [int(v) for v in args[1].tolist()]
    dims = []
    for i, d in enumerate(target):
        if d == 0 and attrs["zero_is_placeholder"]:
            d = x.shape[i]
        dims.append(int(d))
    try:
        return [x.reshape(dims)]
    except RuntimeError as err:
        raise EmulationError(f"view of {tuple(x.shape)} as {dims}: {err}") from None


def view(input: Tensor, shape: Tensor | Sequence[int], zero_is_placeholder: bool = True) -> Tensor:
    if isinstance(shape, Tensor):
        rank = _static_len(shape, "view shape")
        return _layer("SHUFFLE", _k_view, [input, shape], [(input.dtype, [-1] * rank)],
                      {"shape": None, "zero_is_placeholder": zero_is_placeholder}, shape_args=(1,))
    if not isinstance(shape, (list, tuple)):
        raise TypeError(f"view: shape must be a Tensor or a sequence, got {type(shape)}")
    shape = [int(s) for s in shape]
    assert builtins.sum(1 for s in shape if s == -1) <= 1, "view: at most one -1"
    static = [input.shape[i] if (s == 0 and zero_is_placeholder) else s for i, s in enumerate(shape)]
    known = [d for d in input.shape]
    if -1 in static and -1 not in known:
        rest = math.prod(d for d in static if d != -1)
        static = [math.prod(known) // rest if d == -1 else d for d in static] if rest else static
    return _layer("SHUFFLE", _k_view, [input], [(input.dtype, static)],
                  {"shape": shape, "zero_is_placeholder": zero_is_placeholder})


def _k_permute(args, attrs):
    return [args[0].permute(*attrs["dims"])]


def permute(input: Tensor, dims: Sequence[int]) -> Tensor:
    dims = list(dim_resolve_negative(tuple(dims), input.ndim()))
    return _layer("SHUFFLE", _k_permute, [input], [(input.dtype, [input.shape[d] for d in dims])], {"dims": dims})


def transpose(input: Tensor, dim0: int, dim1: int) -> Tensor:
    perm = list(range(input.ndim()))
    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
    return permute(input, perm)


def flatten(input: Tensor, start_dim: int = 0, end_dim: int = -1):
    ndim = input.ndim()
    start_dim, end_dim = dim_resolve_negative((start_dim, end_dim), ndim)
    shape = list(input.shape)
    new = shape[:start_dim] + [math.prod(shape[start_dim:end_dim + 1])] + shape[end_dim + 1:]
    return view(input, new)


def _k_unsqueeze(args, attrs):
    return [args[0].unsqueeze(attrs["axis"])]


def expand_dims(input: Tensor, dim: int | Sequence[int], shape_cast_dtype=None) -> Tensor:
    dims = [dim] if isinstance(dim, int) else sorted(dim)
    out = input
    for d in dims:
        static = list(out.shape)
        static.insert(d, 1)
        out = _layer("SHUFFLE", _k_unsqueeze, [out], [(out.dtype, static)], {"axis": d})
    return out


def unsqueeze(input: Tensor, axis: int):
    if axis < 0:
        axis = axis + input.ndim() + 1
    return expand_dims(input, axis)


def _k_squeeze(args, attrs):
    x = args[0]
    return [x.reshape([d for i, d in enumerate(x.shape) if i not in attrs["dims"]])]


def squeeze(input: Tensor, dim: int | Sequence[int] | None = None, zero_is_placeholder: bool = False):
    ndim = input.ndim()
    dims = list(range(ndim)) if dim is None else list(dim_resolve_negative(dim, ndim))
    dims = [d for d in dims if input.shape[d] == 1]
    return _layer("SHUFFLE", _k_squeeze, [input], [(input.dtype, [s for i, s in enumerate(input.shape)
                                                                  if i not in dims])], {"dims": dims})


# -------------------------------------------------------------------------- slicing


def _vector(value, index: int, args, default=None):
    """A static list attribute, else the shape tensor at ``args[index]``, else ``default``."""
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    if index < len(args) and args[index] is not None:
        return [int(v) for v in args[index].reshape(-1).tolist()]
    return default


def _k_slice(args, attrs):
    x = args[0]
    starts = _vector(attrs["starts"], 1, args)
    sizes = _vector(attrs["sizes"], 2, args)
    strides = _vector(attrs["strides"], 3, args, default=[1] * x.ndim)
    if not (len(starts) == len(sizes) == len(strides) == x.ndim):
        raise EmulationError(f"slice: starts/sizes/strides {starts} {sizes} {strides} do not match rank {x.ndim}")
    out = x
    for d, (start, size, stride) in enumerate(zip(starts, sizes, strides)):
        if size < 0:
            raise EmulationError(f"slice: negative size {size} on dim {d}")
        if size == 0:
            out = out.narrow(d, 0, 0)
            continue
        last = start + (size - 1) * stride
        if not (0 <= start < x.shape[d] and 0 <= last < x.shape[d]):
            raise EmulationError(f"slice out of bounds on dim {d}: start {start}, size {size}, stride {stride}, "
                                 f"input dim {x.shape[d]} (STRICT_BOUNDS)")
        if stride == 1:
            out = out.narrow(d, start, size)
        else:
            index = start + torch.arange(size, device=out.device) * stride
            out = out.index_select(d, index)
    return [out]


def slice(input: Tensor, starts: Tensor | Sequence[int], sizes: Tensor | Sequence[int],
          strides: Tensor | Sequence[int] = None, mode: trt.SampleMode = None,
          fill_value: float | Tensor = None) -> Tensor:
    if mode is not None:
        raise EmulationError("slice: only the default STRICT_BOUNDS mode is emulated")
    inputs, shape_args, attrs = [input], [], {}
    for i, (key, value) in enumerate((("starts", starts), ("sizes", sizes), ("strides", strides)), start=1):
        if isinstance(value, Tensor):
            _static_len(value, f"slice {key}")
            inputs.append(value)
            shape_args.append(i)
            attrs[key] = None
        else:
            inputs.append(None)
            attrs[key] = None if value is None else [int(v) for v in value]
    static = list(attrs["sizes"]) if attrs["sizes"] is not None else [-1] * input.ndim()
    return _layer("SLICE", _k_slice, inputs, [(input.dtype, static)], attrs, shape_args=shape_args)


def _k_expand(args, attrs):
    x = args[0]
    target = [int(v) for v in args[1].tolist()]
    if len(target) != x.ndim:
        raise EmulationError(f"expand: shape {target} does not match rank {x.ndim}")
    out = x
    for d, size in enumerate(target):
        if x.shape[d] == 1:
            out = out.expand(*[size if i == d else s for i, s in enumerate(out.shape)])
        elif size > x.shape[d]:
            raise EmulationError(f"expand: dim {d} of size {x.shape[d]} cannot become {size} (slice out of bounds)")
        elif size < x.shape[d]:
            out = out.narrow(d, 0, size)
    return [out.contiguous() if out.device.type != "meta" else out]


def expand(input: Tensor, expand_shape: Tensor) -> Tensor:
    rank = _static_len(expand_shape, "expand shape")
    if rank != input.ndim():
        raise EmulationError(f"expand: shape tensor of length {rank} for a rank-{input.ndim()} input")
    return _layer("SLICE", _k_expand, [input, expand_shape], [(input.dtype, [-1] * rank)], shape_args=(1,))


def _k_arange(args, attrs):
    if attrs["ints"] is not None:
        start, end = attrs["ints"]
    else:
        start, end = int(args[0].reshape(-1)[0]), int(args[1].reshape(-1)[0])
    return [torch.arange(start, end, dtype=physical_dtype(attrs["dtype"]))]


def arange(start: Tensor | int, end: Tensor | int, dtype: str) -> Tensor:
    assert isinstance(dtype, str), "arange: dtype must be a string"
    trt_dtype = str_dtype_to_trt(dtype)
    if isinstance(start, int):
        assert isinstance(end, int), "arange: start and end must both be int or both be Tensor"
        return _layer("FILL", _k_arange, [], [(trt_dtype, [end - start])], {"ints": (start, end), "dtype": dtype})
    if not isinstance(start, Tensor) or not isinstance(end, Tensor):
        raise TypeError("arange: start and end must both be int or both be Tensor")
    for t in (start, end):
        assert t.dtype in (trt.int32, trt.int64), f"arange bounds must be int32/int64, got {t.dtype}"
    return _layer("FILL", _k_arange, [start, end], [(trt_dtype, [-1])], {"ints": None, "dtype": dtype},
                  shape_args=(0, 1))


# ------------------------------------------------------------------------- gathering


def _check_index(index: torch.Tensor, size: int, what: str) -> None:
    if index.device.type == "meta" or index.numel() == 0:
        return
    lo, hi = int(index.min()), int(index.max())
    if lo < 0 or hi >= size:
        raise EmulationError(f"{what}: index out of range [{lo}, {hi}] for a dimension of {size} "
                             "(undefined in TensorRT: an out-of-bounds read on the GPU)")


def _k_gather_elements(args, attrs):
    x, index = args
    dim = attrs["dim"]
    _check_index(index, x.shape[dim], "gather")
    for d in range(x.ndim):
        if d != dim and index.shape[d] > x.shape[d]:
            raise EmulationError(f"gather: indices {tuple(index.shape)} exceed data {tuple(x.shape)} on dim {d}")
    return [torch.gather(x, dim, index.long())]


def gather(input: Tensor, dim: int, indices: Tensor | int) -> Tensor:
    if isinstance(indices, int):
        indices = constant(np.array([indices], dtype=np.int32))
    assert input.rank() == indices.rank(), "gather: input and indices must have the same rank"
    dim = dim if dim >= 0 else dim + input.ndim()
    return _layer("GATHER_ELEMENTS", _k_gather_elements, [input, indices], [(input.dtype, indices.shape)],
                  {"dim": dim})


def _k_index_select(args, attrs):
    x, index = args
    dim = attrs["dim"]
    _check_index(index, x.shape[dim], "index_select")
    return [torch.index_select(x, dim, index.long().reshape(-1))]


def index_select(input: Tensor, dim: int, index: Tensor) -> Tensor:
    assert isinstance(index, Tensor) and index.rank() == 1, "index_select: index must be a rank-1 Tensor"
    static = list(input.shape)
    static[dim] = index.shape[0]
    return _layer("GATHER", _k_index_select, [input, index], [(input.dtype, static)], {"dim": dim})


def select(input: Tensor, dim: int, index: Tensor | int) -> Tensor:
    if isinstance(index, int):
        index = constant(np.array([index], dtype=np.int32))
    assert index.rank() == 1 and index.size(0) == 1, "select: index must be rank 1 with size 1"
    picked = index_select(input, dim, index)
    return view(picked, [s for i, s in enumerate(picked.shape) if i != dim], zero_is_placeholder=False)


def _k_scatter(args, attrs):
    x, index, updates = args
    _check_index(index, x.shape[attrs["dim"]], "scatter")
    return [torch.scatter(_up(x), attrs["dim"], index.long(), _up(updates))]


def scatter(input: Tensor, dim: int, indices: Tensor, updates: Tensor) -> Tensor:
    if input.dtype != updates.dtype:
        raise EmulationError(f"scatter: data {input.dtype.value} and updates {updates.dtype.value} differ")
    return _layer("SCATTER", _k_scatter, [input, indices, updates], [(input.dtype, input.shape)], {"dim": dim})


def _k_concat(args, attrs):
    return [torch.cat([a.reshape(1) if a.ndim == 0 else a for a in args], dim=attrs["dim"])]


def concat(inputs: Sequence[Tensor | int], dim: int = 0) -> Tensor:
    assert len(inputs) > 0
    tensors = list(constants_to_tensors_(*inputs))
    tensors = [view(t, [1]) if t.rank() == 0 else t for t in tensors]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise EmulationError(f"concat: inputs have different types {sorted(d.value for d in dtypes)}")
    dim = dim_resolve_negative(dim, tensors[0].ndim())[0]
    static = list(tensors[0].shape)
    sizes = [t.shape[dim] for t in tensors]
    static[dim] = -1 if -1 in sizes else builtins.sum(sizes)
    return _layer("CONCATENATION", _k_concat, tensors, [(tensors[0].dtype, static)], {"dim": dim})


def split(tensor: Tensor, split_size_or_sections, dim: int = 0):
    dim = dim if dim >= 0 else dim + tensor.ndim()
    total = tensor.shape[dim]
    if isinstance(split_size_or_sections, int):
        assert total != -1, "split: the split dimension must be static"
        sections = [split_size_or_sections] * (total // split_size_or_sections)
    else:
        sections = list(split_size_or_sections)
    outs, start = [], 0
    for size in sections:
        starts = [0] * tensor.ndim()
        starts[dim] = start
        if -1 in tensor.shape:
            sizes = concat([size if i == dim else shape(tensor, i) for i in range(tensor.ndim())])
        else:
            sizes = [size if i == dim else s for i, s in enumerate(tensor.shape)]
        outs.append(slice(tensor, starts, sizes))
        start += size
    return outs


def chunk(tensor: Tensor, chunks: int, dim: int = 0):
    return split(tensor, tensor.shape[dim] // chunks, dim)


# ------------------------------------------------------------------------ reductions


def _k_softmax(args, attrs):
    return [torch.softmax(_up(args[0]), dim=attrs["dim"])]


def softmax(input: Tensor, dim: int | None = None) -> Tensor:
    dim = input.ndim() - 1 if dim is None else dim_resolve_negative(dim, input.ndim())[0]
    return _layer("SOFTMAX", _k_softmax, [input], [(input.dtype, input.shape)], {"dim": dim})


def _k_reduce(args, attrs):
    x = _up(args[0])
    dims, keep = attrs["dims"], attrs["keepdim"]
    op = attrs["op"]
    if op == "SUM":
        return [x.sum(dim=dims, keepdim=keep)]
    if op == "AVG":
        return [x.mean(dim=dims, keepdim=keep)]
    if op == "MAX":
        return [x.amax(dim=dims, keepdim=keep)]
    if op == "MIN":
        return [x.amin(dim=dims, keepdim=keep)]
    raise EmulationError(f"unknown reduce op {op}")


def reduce(input: Tensor, op: str, dim: int | tuple[int], keepdim: bool = False) -> Tensor:
    dims = list(dim_resolve_negative(dim, input.ndim()))
    static = [1 if i in dims else s for i, s in enumerate(input.shape)] if keepdim else \
        [s for i, s in enumerate(input.shape) if i not in dims]
    return _layer("REDUCE", _k_reduce, [input], [(input.dtype, static)], {"op": op, "dims": dims,
                                                                          "keepdim": keepdim})


def sum(input: Tensor, dim: int, keepdim: bool = False) -> Tensor:  # noqa: A001
    return reduce(input, "SUM", dim, keepdim)


def mean(input: Tensor, dim: int | tuple[int], keepdim: bool = False) -> Tensor:
    return reduce(input, "AVG", dim, keepdim)


def max(input: Tensor, dim: int, keepdim: bool = False) -> Tensor:  # noqa: A001
    return reduce(input, "MAX", dim, keepdim)


def _k_argmax(args, attrs):
    x = _up(args[0])
    return [torch.argmax(x, dim=attrs["dim"], keepdim=attrs["keepdim"]).to(torch.int32)]


def argmax(input: Tensor, dim: int, keepdim: bool = False) -> Tensor:
    dim = dim_resolve_negative(dim, input.ndim())[0]
    if input.dtype not in (trt.float32, trt.float16, trt.bfloat16, trt.int32):
        raise EmulationError(f"argmax (TopK): unsupported input type {input.dtype.value}")
    static = [1 if i == dim else s for i, s in enumerate(input.shape)] if keepdim else \
        [s for i, s in enumerate(input.shape) if i != dim]
    return _layer("TOPK", _k_argmax, [input], [(trt.int32, static)], {"dim": dim, "keepdim": keepdim})


# --------------------------------------------------------------------------- layers


def _k_embedding(args, attrs):
    ids, weight = args
    _check_index(ids, weight.shape[0], "embedding")
    return [weight[ids.long()]]


def embedding(input: Tensor, weight: Tensor, tp_size=1, tp_group=None, sharding_dim=0, tp_rank=None,
              per_token_scale=None, padding=None) -> Tensor:
    if padding is not None:
        weight = concat([weight, padding], dim=0)
    if tp_size > 1 and tp_group is not None:
        raise EmulationError("embedding: the stand-in does not emulate a vocabulary-parallel embedding")
    return _layer("GATHER", _k_embedding, [input, weight],
                  [(weight.dtype, list(input.shape) + list(weight.shape[1:]))])


def _k_rms_norm(args, attrs):
    x = args[0]
    dims = attrs["dims"]
    xf = x.to(compute_dtype(""))
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + attrs["eps"])
    return [y.to(x.dtype)]


def rms_norm(input: Tensor, normalized_shape: int | tuple[int], num_groups: int = 1,
             weight: Tensor | None = None, eps: float = 1e-06) -> Tensor:
    normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if num_groups != 1:
        raise EmulationError("rms_norm: num_groups > 1 is not emulated")
    dims = list(range(input.ndim() - len(normalized_shape), input.ndim()))
    y = _layer("RMS_NORM", _k_rms_norm, [input], [(input.dtype, input.shape)], {"dims": dims, "eps": eps})
    if weight is not None:
        y = y * weight
    return y


def _k_allreduce(args, attrs):
    from _emu.collectives import all_reduce

    x, workspace = args[0], args[1] if len(args) > 1 else None
    return [all_reduce(x, attrs["group"], workspace)]


_k_allreduce.infer = lambda shapes, attrs: [shapes[0]]


def allreduce(tensor: Tensor, group: list[int],
              all_reduce_params: AllReduceParams | None = AllReduceParams()) -> Tensor:  # noqa: B008
    from .plugin.plugin import current_all_reduce_helper

    if all_reduce_params is None:
        all_reduce_params = AllReduceParams()
    all_reduce_params.update_strategy()
    if all_reduce_params.fusion_op != AllReduceFusionOp.NONE:
        raise EmulationError("allreduce: fused all-reduce variants are not emulated")
    workspace = current_all_reduce_helper().workspace
    inputs = [tensor] + ([workspace] if workspace is not None else [])
    return _layer("PLUGIN_AllReduce", _k_allreduce, inputs, [(tensor.dtype, tensor.shape)],
                  {"group": list(group)})


def _k_allgather(args, attrs):
    from _emu.collectives import all_gather

    return [all_gather(args[0], attrs["group"], attrs["gather_dim"])]


def _allgather_shape(shapes, attrs):
    shape = list(shapes[0])
    shape[attrs["gather_dim"]] *= len(attrs["group"])
    return [tuple(shape)]


_k_allgather.infer = _allgather_shape


def allgather(tensor: Tensor, group: list[int], gather_dim: int = 0) -> Tensor:
    gather_dim = dim_resolve_negative(gather_dim, tensor.ndim())[0]
    static = list(tensor.shape)
    static[gather_dim] = -1 if static[gather_dim] == -1 else static[gather_dim] * len(group)
    return _layer("PLUGIN_AllGather", _k_allgather, [tensor], [(tensor.dtype, static)],
                  {"group": list(group), "gather_dim": gather_dim})


def gather_last_token_logits(hidden_states: Tensor, last_token_ids: Tensor, remove_input_padding: bool) -> Tensor:
    if last_token_ids is None:
        return hidden_states
    if not remove_input_padding:
        raise EmulationError("gather_last_token_logits: only remove_input_padding is emulated")
    return index_select(hidden_states, 0, last_token_ids - 1)


ACT2FN = {"silu": silu, "swiglu": None, "sigmoid": sigmoid}


# ---------------------------------------------------------------------- attention


def gpt_attention(
    *,
    qkv: Tensor,
    past_key_value: Tensor,
    attention_mask: Tensor | None = None,
    attention_packed_mask: Tensor | None = None,
    sequence_length: Tensor,
    host_past_key_value_lengths: Tensor | None,
    host_max_attention_window_sizes: Tensor,
    host_sink_token_length: Tensor,
    context_lengths: Tensor | None,
    cache_indirection: Tensor | None,
    host_request_types: Tensor,
    layer_idx: int,
    num_heads: int,
    num_kv_heads: int,
    hidden_size_per_head: int,
    q_scaling: float,
    attn_logit_softcapping_scale: float = 0.0,
    rotary_embedding_dim: int = 0,
    rotary_embedding_base: float = 10000.0,
    rotary_embedding_scale_type: RotaryScalingType = RotaryScalingType.none,
    rotary_embedding_short_m_scale: float = 1.0,
    rotary_embedding_long_m_scale: float = 1.0,
    rotary_embedding_scale: float = 1.0,
    rotary_embedding_max_positions: int = 1024,
    rotary_embedding_original_max_positions: int = 1024,
    position_embedding_type: PositionEmbeddingType = PositionEmbeddingType.learned_absolute,
    rotary_inv_freq: Tensor | None = None,
    rotary_cos_sin: Tensor | None = None,
    kv_orig_quant_scale: Tensor | None = None,
    kv_quant_orig_scale: Tensor | None = None,
    attention_output_orig_quant_scale: Tensor | None = None,
    attention_output_sf_scale: Tensor | None = None,
    kv_cache_quant_mode: QuantMode | int = QuantMode(0),
    max_context_length: int | None = None,
    mask_type: AttentionMaskType = AttentionMaskType.causal,
    block_sparse_block_size: int = 64,
    block_sparse_homo_head_pattern: bool = False,
    block_sparse_num_local_blocks: int = 16,
    block_sparse_vertical_stride: int = 8,
    alibi_slopes: Tensor | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    vision_start: int = -1,
    vision_length: int = -1,
    kv_cache_block_offsets: Tensor | None = None,
    host_kv_cache_block_offsets: Tensor = None,
    host_kv_cache_pool_pointers: Tensor = None,
    host_kv_cache_pool_mapping: Tensor = None,
    do_cross_attention: bool = False,
    cross_kv: Tensor | None = None,
    cross_kv_length: Tensor | None = None,
    encoder_input_lengths: Tensor | None = None,
    relative_attention_bias: Tensor | None = None,
    logn_scaling: Tensor | None = None,
    max_distance: int = 0,
    host_context_lengths: Tensor | None = None,
    qkv_bias: Tensor | None = None,
    use_cache: bool = True,
    spec_decoding_is_generation_length_variable: bool = False,
    spec_decoding_max_generation_length: int = 0,
    spec_decoding_generation_lengths: Tensor = None,
    spec_decoding_position_offsets: Tensor = None,
    spec_decoding_packed_mask: Tensor = None,
    spec_decoding_use: Tensor = None,
    long_rope_rotary_inv_freq: Tensor | None = None,
    long_rope_rotary_cos_sin: Tensor | None = None,
    mrope_rotary_cos_sin: Tensor = None,
    mrope_position_deltas: Tensor = None,
    host_runtime_perf_knobs: Tensor | None = None,
    host_context_progress: Tensor = None,
    is_mla_enabled_flag: bool = False,
    q_lora_rank: int = 0,
    kv_lora_rank: int = 0,
    qk_nope_head_dim: int = 0,
    qk_rope_head_dim: int = 0,
    v_head_dim: int = 0,
    q_b_proj: Tensor | None = None,
    kv_b_proj: Tensor | None = None,
    k_b_proj_trans: Tensor | None = None,
    skip_attn=None,
    cp_group: list[int] = [0],  # noqa: B006  (upstream default)
    cp_size: int = 1,
    cp_rank: int = 0,
    num_kv_heads_origin: int = -1,
) -> tuple[Tensor, Tensor | None]:
    """The GPTAttention plugin (TensorRT-LLM namespace): inputs in the plugin's IdxEntry order,
    build-time settings as plugin fields; the kernels' contract is emulated in _emu/attention.py."""
    assert host_request_types is not None
    assert (alibi_slopes is not None) == position_embedding_type.is_alibi()
    assert (mrope_rotary_cos_sin is not None) == position_embedding_type.is_mrope()
    net = default_net()
    plugin_config = net.plugin_config
    if plugin_config.remove_input_padding:
        assert host_context_lengths is not None
    assert isinstance(max_context_length, int)
    assert host_max_attention_window_sizes is not None and host_sink_token_length is not None
    paged = bool(plugin_config.paged_kv_cache)
    spec = spec_decoding_packed_mask is not None
    if spec:
        assert spec_decoding_generation_lengths is not None and spec_decoding_position_offsets is not None
        assert spec_decoding_use is not None
    from _emu.attention import GPTAttentionFields, create_gpt_attention_plugin

    fields = GPTAttentionFields(
        layer_idx=layer_idx, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=hidden_size_per_head,
        q_scaling=q_scaling, rotary_embedding_dim=rotary_embedding_dim,
        position_embedding_type=int(position_embedding_type), mask_type=int(mask_type),
        tp_size=tp_size, tp_rank=tp_rank, paged_kv_cache=paged, tokens_per_block=plugin_config.tokens_per_block,
        dtype=qkv.dtype.value, kv_dtype=(past_key_value.dtype.value if past_key_value is not None else qkv.dtype.value),
        remove_input_padding=bool(plugin_config.remove_input_padding), use_cache=use_cache,
        is_spec_decoding_enabled=spec,
        spec_decoding_is_generation_length_variable=spec_decoding_is_generation_length_variable,
        spec_decoding_max_generation_length=spec_decoding_max_generation_length,
        max_context_length=max_context_length, do_cross_attention=do_cross_attention,
        attn_logit_softcapping_scale=attn_logit_softcapping_scale,
    )
    plugin = create_gpt_attention_plugin(fields)
    if use_cache:
        ordered = [qkv, sequence_length, host_past_key_value_lengths, host_max_attention_window_sizes,
                   host_sink_token_length, context_lengths, cache_indirection, host_request_types]
        ordered += ([kv_cache_block_offsets, host_kv_cache_block_offsets, host_kv_cache_pool_pointers,
                     host_kv_cache_pool_mapping] if paged else [past_key_value])
    else:
        ordered = [qkv, host_max_attention_window_sizes, host_sink_token_length, context_lengths, host_request_types]
    if position_embedding_type.is_rope():
        assert rotary_inv_freq is not None and rotary_cos_sin is not None
        ordered += [rotary_inv_freq, rotary_cos_sin]
    if plugin_config.remove_input_padding:
        ordered.append(host_context_lengths)
    if spec:
        ordered += [spec_decoding_generation_lengths, spec_decoding_packed_mask, spec_decoding_position_offsets,
                    spec_decoding_use]
    ordered += [host_runtime_perf_knobs, host_context_progress]
    if any(t is None for t in ordered):
        raise EmulationError("gpt_attention: a required plugin input is None")
    layer = default_trtnet().add_plugin_v3([t.trt_tensor for t in ordered], [], plugin)
    output = _create_tensor(layer.get_output(0), layer)
    present = None
    if use_cache and not paged:
        present = _create_tensor(layer.get_output(1), layer)
    return output, present


# ----------------------------------------------------------------------------- rope


class RopeEmbeddingUtils:
    """The RoPE tables the attention plugin reads (upstream ``create_sinusoidal_positions_for_attention_plugin``):
    inv_freq float32 [dim/2] and cos/sin pairs float32 [1, num_pos * dim/2 * 2]."""

    @staticmethod
    def create_sinusoidal_positions_for_attention_plugin(num_pos: int, dim: int, theta: float = 10000.0,
                                                        scale: float = 1.0,
                                                        scale_type: RotaryScalingType = RotaryScalingType.none,
                                                        rope_scaling_config: dict = None, dtype=np.float32):
        if scale_type not in (RotaryScalingType.none, RotaryScalingType.linear):
            raise NotImplementedError(f"the stand-in emulates rotary scaling none/linear, not {scale_type!r}")
        if dtype != np.float32:
            raise NotImplementedError("the attention plugin reads float32 tables")
        if scale_type == RotaryScalingType.linear:
            scale = 1.0 / scale
        inv_freq = (scale / (theta ** (np.arange(0, dim, 2) / dim))).astype(np.float32)
        sinusoid = np.einsum("i,j->ij", np.arange(num_pos, dtype=np.float32), inv_freq).astype(np.float32)
        pairs = np.stack([np.cos(sinusoid), np.sin(sinusoid)], axis=-1)
        return inv_freq, pairs.reshape(1, -1).astype(np.float32)
