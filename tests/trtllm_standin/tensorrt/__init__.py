"""Test-only stand-in for the ``tensorrt`` 10.14 Python API (NVIDIA/TensorRT 10.14, commit 3b4ddc1d).

Only what TensorRT-LLM's Python layer and this project call exists here, with the names
of the real bindings: ``DataType`` and its module aliases, ``TensorLocation``,
``TensorIOMode``, ``TensorRTPhase``, the plugin registry and ``PluginField(Collection)``,
``INetworkDefinition`` (inputs, outputs, ``add_plugin_v3``), ``Builder`` /
``IBuilderConfig`` / ``IOptimizationProfile``, ``Runtime`` / ``ICudaEngine`` /
``IExecutionContext``.

A network records its layers as calls into the emulated device (``_emu``); a
"serialized engine" is that record, pickled; executing it evaluates the record on the
bound tensors. Every other TensorRT layer kind is created by the stand-in
``tensorrt_llm.functional`` through ``INetworkDefinition._standin_layer`` (private: the
project never calls it).
"""

from __future__ import annotations

import builtins
import enum
import os
import pickle
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from _emu import EmulationError, device_memory, physical_dtype
from _emu.graph import Graph, LayerRecord, TensorRecord, evaluate

__version__ = "10.14.1.48"


# ------------------------------------------------------------------------------- enums


class DataType(enum.Enum):
    FLOAT = "float32"
    HALF = "float16"
    BF16 = "bfloat16"
    INT8 = "int8"
    INT32 = "int32"
    INT64 = "int64"
    BOOL = "bool"
    UINT8 = "uint8"
    FP8 = "fp8"
    INT4 = "int4"
    FP4 = "fp4"
    E8M0 = "e8m0"

    @property
    def itemsize(self) -> int | float | None:
        # python/packaging/bindings_wheel/tensorrt/__init__.py, _itemsize: sub-byte types are
        # fractions, E8M0 has no entry (None).
        return {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int32": 4, "int64": 8, "bool": 1,
                "uint8": 1, "fp8": 1, "int4": 0.5, "fp4": 0.5}.get(self.value)


float32 = DataType.FLOAT
float16 = DataType.HALF
bfloat16 = DataType.BF16
int8 = DataType.INT8
int32 = DataType.INT32
int64 = DataType.INT64
bool = DataType.BOOL  # noqa: A001  (tensorrt exports `bool`)
uint8 = DataType.UINT8
fp8 = DataType.FP8
int4 = DataType.INT4
fp4 = DataType.FP4
e8m0 = DataType.E8M0


class TensorLocation(enum.Enum):
    DEVICE = 0
    HOST = 1


class TensorIOMode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class TensorRTPhase(enum.Enum):
    BUILD = 0
    RUNTIME = 1


class PluginFieldType(enum.Enum):
    FLOAT16 = 0
    FLOAT32 = 1
    FLOAT64 = 2
    INT8 = 3
    INT16 = 4
    INT32 = 5
    CHAR = 6
    DIMS = 7
    UNKNOWN = 8
    BF16 = 9
    INT64 = 10
    FP8 = 11
    INT4 = 12
    FP4 = 13


class NetworkDefinitionCreationFlag(enum.IntEnum):
    EXPLICIT_BATCH = 0
    STRONGLY_TYPED = 1
    PREFER_JIT_PYTHON_PLUGINS = 2
    PREFER_AOT_PYTHON_PLUGINS = 3


class UnaryOperation(enum.IntEnum):
    EXP = 0
    LOG = 1
    SQRT = 2
    RECIP = 3
    ABS = 4
    NEG = 5
    SIN = 6
    COS = 7
    TAN = 8
    SINH = 9
    COSH = 10
    ASIN = 11
    ACOS = 12
    ATAN = 13
    ASINH = 14
    ACOSH = 15
    ATANH = 16
    CEIL = 17
    FLOOR = 18
    ERF = 19
    NOT = 20
    SIGN = 21
    ROUND = 22
    ISINF = 23
    ISNAN = 24


class ElementWiseOperation(enum.IntEnum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    SUB = 4
    DIV = 5
    POW = 6
    FLOOR_DIV = 7
    AND = 8
    OR = 9
    XOR = 10
    EQUAL = 11
    GREATER = 12
    LESS = 13


class ActivationType(enum.IntEnum):
    RELU = 0
    SIGMOID = 1
    TANH = 2
    LEAKY_RELU = 3
    ELU = 4
    SELU = 5
    SOFTSIGN = 6
    SOFTPLUS = 7
    CLIP = 8
    HARD_SIGMOID = 9
    SCALED_TANH = 10
    THRESHOLDED_RELU = 11
    GELU_ERF = 12
    GELU_TANH = 13


class ExecutionContextAllocationStrategy(enum.IntEnum):
    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


class ILogger:
    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    def log(self, severity: ILogger.Severity, msg: str) -> None:
        raise NotImplementedError("a Python ILogger subclass must override log()")


class Logger(ILogger):
    # The package __init__ sets Logger.Severity = ILogger.Severity and copies the members.
    Severity = ILogger.Severity
    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = tuple(ILogger.Severity)

    def __init__(self, min_severity: ILogger.Severity = ILogger.Severity.WARNING) -> None:
        self.min_severity = min_severity

    def log(self, severity: ILogger.Severity, msg: str) -> None:
        if severity <= self.min_severity:
            print(f"[TRT] {severity.name}: {msg}")


# ------------------------------------------------------------------------------ plugins


class PluginField:
    # The (name, data, type) constructor; the other overload, PluginField(name=""), is not used.
    def __init__(self, name: str, data: Any, type: PluginFieldType = PluginFieldType.UNKNOWN) -> None:  # noqa: A002
        self.name, self.data, self.type = name, np.asarray(data) if data is not None else None, type


class PluginFieldCollection(list):
    """``trt.PluginFieldCollection(fields)``: ``py::bind_vector`` of PluginField, list-like."""

    def __init__(self, arg0: Sequence[PluginField], /) -> None:
        super().__init__(arg0)


class IPluginRegistry:
    """The process-wide registry: creators keyed exactly by (name, version, namespace),
    as ``getCreator`` matches them (include/NvInferRuntimeCommon.h, IPluginRegistry)."""

    def __init__(self) -> None:
        self._creators: dict[tuple[str, str, str], Any] = {}
        self._sources: list[Callable[[], list[tuple[Any, str]]]] = []

    def register_creator(self, creator: Any, plugin_namespace: str = "") -> builtins.bool:
        key = (creator.name, creator.plugin_version, plugin_namespace)
        if key in self._creators:
            return False
        self._creators[key] = creator
        return True

    def _add_dynamic_source(self, source: Callable[[], list[tuple[Any, str]]]) -> None:
        """Creators that appear when a shared library is loaded (the stand-in's way to see a
        library's static registrars run: ``source`` reports (creator, namespace) pairs)."""
        self._sources.append(source)

    def _all(self) -> dict[tuple[str, str, str], Any]:
        found = dict(self._creators)
        for source in self._sources:
            for creator, namespace in source():
                found.setdefault((creator.name, creator.plugin_version, namespace), creator)
        return found

    def get_creator(self, type: str, version: str, plugin_namespace: str = "") -> Any:  # noqa: A002
        return self._all().get((type, version, plugin_namespace))

    @property
    def all_creators(self) -> list[Any]:
        return list(self._all().values())


_registry = IPluginRegistry()
# Plugin libraries the emulated device knows how to run, once the project loads them.
from _emu.dflash_plugins import registered_creators as _dflash_creators  # noqa: E402

_registry._add_dynamic_source(_dflash_creators)


def get_plugin_registry() -> IPluginRegistry:
    return _registry


# ------------------------------------------------------------------------------ network


class ITensor:
    def __init__(self, network: INetworkDefinition, record: TensorRecord) -> None:
        self._network, self._record = network, record

    @property
    def name(self) -> str:
        return self._record.name

    @name.setter
    def name(self, value: str) -> None:
        self._network._rename(self._record, value)

    @property
    def dtype(self) -> DataType:
        return DataType(self._record.dtype)

    @dtype.setter
    def dtype(self, value: DataType) -> None:
        if not isinstance(value, DataType):
            raise TypeError(f"dtype must be a tensorrt.DataType, got {value!r}")
        if self._record.producer is not None and value.value != self._record.dtype:
            # Weakly typed networks may force an output type; the producer then converts.
            self._record.forced_dtype = value.value
        self._record.dtype = value.value

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._record.shape)

    @shape.setter
    def shape(self, value: Sequence[int]) -> None:
        self._record.shape = tuple(int(v) for v in value)

    @property
    def location(self) -> TensorLocation:
        return TensorLocation(self._record.location)

    @location.setter
    def location(self, value: TensorLocation) -> None:
        # NvInfer.h (10.14), ITensor::setLocation: deprecated since 10.0, "the location must
        # always be TensorLocation::kDEVICE"; a host location is refused when the engine is built.
        warnings.warn("ITensor.location is deprecated since TensorRT 10.0 (location must be DEVICE)",
                      DeprecationWarning, stacklevel=2)
        self._record.location = value.value

    @property
    def is_network_input(self) -> builtins.bool:
        return self._record.is_input

    @property
    def is_network_output(self) -> builtins.bool:
        return self._record.is_output

    @property
    def is_shape_tensor(self) -> builtins.bool:
        return False

    def set_dimension_name(self, index: int, name: str) -> None:
        self._record.dim_names[int(index)] = str(name)

    def get_dimension_name(self, index: int) -> str | None:
        return self._record.dim_names.get(int(index))

    def __repr__(self) -> str:
        return f"ITensor({self.name!r}, {self.dtype.value}, {self.shape})"


class ILayer:
    def __init__(self, network: INetworkDefinition, record: LayerRecord) -> None:
        self._network, self._record = network, record

    @property
    def name(self) -> str:
        return self._record.name

    @name.setter
    def name(self, value: str) -> None:
        self._record.name = str(value)

    @property
    def type(self) -> str:
        return self._record.kind

    @property
    def num_inputs(self) -> int:
        return len(self._record.inputs)

    @property
    def num_outputs(self) -> int:
        return len(self._record.outputs)

    def get_input(self, index: int) -> ITensor | None:
        tid = self._record.inputs[index]
        return None if tid is None else self._network._tensor(tid)

    def get_output(self, index: int) -> ITensor:
        return self._network._tensor(self._record.outputs[index])

    @property
    def precision(self) -> DataType:
        return DataType(self._record.precision or self._network._graph.tensors[self._record.outputs[0]].dtype)

    @precision.setter
    def precision(self, value: DataType) -> None:
        self._record.precision = value.value

    def set_output_type(self, index: int, dtype: DataType) -> None:
        self.get_output(index).dtype = dtype


class INetworkDefinition:
    def __init__(self, flags: int = 0) -> None:
        self._graph = Graph()
        self._flags = int(flags)
        self._views: dict[int, ITensor] = {}

    def get_flag(self, flag: NetworkDefinitionCreationFlag) -> builtins.bool:
        return builtins.bool(self._flags & (1 << int(flag)))

    def _tensor(self, tid: int) -> ITensor:
        view = self._views.get(tid)
        if view is None:
            view = self._views[tid] = ITensor(self, self._graph.tensors[tid])
        return view

    def _rename(self, record: TensorRecord, name: str) -> None:
        self._graph.rename(record, name)

    # -- public TensorRT API ---------------------------------------------------------
    def add_input(self, name: str, dtype: DataType, shape: Sequence[int]) -> ITensor:
        if not isinstance(dtype, DataType):
            raise TypeError(f"add_input({name!r}): dtype must be a tensorrt.DataType, got {dtype!r}")
        record = self._graph.add_input(name, dtype.value, tuple(int(d) for d in shape))
        return self._tensor(record.tid)

    def mark_output(self, tensor: ITensor) -> None:
        self._graph.mark_output(tensor._record)

    def unmark_output(self, tensor: ITensor) -> None:
        self._graph.unmark_output(tensor._record)

    @property
    def num_inputs(self) -> int:
        return len(self._graph.inputs)

    def get_input(self, index: int) -> ITensor:
        return self._tensor(self._graph.inputs[index])

    @property
    def num_outputs(self) -> int:
        return len(self._graph.outputs)

    def get_output(self, index: int) -> ITensor:
        return self._tensor(self._graph.outputs[index])

    @property
    def num_layers(self) -> int:
        return len(self._graph.layers)

    def get_layer(self, index: int) -> ILayer:
        return ILayer(self, self._graph.layers[index])

    def add_plugin_v3(self, inputs: Sequence[ITensor], shape_inputs: Sequence[ITensor], plugin: Any) -> ILayer:
        """``INetworkDefinition::addPluginV3`` (NvInfer.h, 10.14)."""
        if plugin is None:
            raise TypeError("add_plugin_v3: plugin is None")
        if list(shape_inputs):
            raise EmulationError("the stand-in has no shape-input plugins")
        records = [t._record for t in inputs]
        in_types = [DataType(r.dtype) for r in records]
        out_types = plugin.get_output_data_types(in_types)
        out_shapes = plugin.get_output_shapes([tuple(r.shape) for r in records])
        layer = self._graph.add_layer(
            kind="PLUGIN_V3", fn=None, inputs=[r.tid for r in records],
            outputs=[(t.value, s) for t, s in zip(out_types, out_shapes)], attrs={}, plugin=plugin,
        )
        return ILayer(self, layer)

    # -- the stand-in's own layer factory (used by tensorrt_llm.functional only) ---------
    def _standin_layer(self, kind: str, fn: Callable, inputs: Sequence[ITensor | None],
                       outputs: Sequence[tuple[DataType, Sequence[int]]], attrs: dict | None = None,
                       shape_args: Sequence[int] = ()) -> ILayer:
        layer = self._graph.add_layer(
            kind=kind, fn=fn, inputs=[None if t is None else t._record.tid for t in inputs],
            outputs=[(d.value, tuple(int(x) for x in s)) for d, s in outputs], attrs=dict(attrs or {}),
            shape_args=tuple(shape_args),
        )
        return ILayer(self, layer)


# ------------------------------------------------------------------------------ builder


class IOptimizationProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}

    def set_shape(self, input: str, min: Sequence[int], opt: Sequence[int], max: Sequence[int]) -> None:  # noqa: A002
        lo, mid, hi = (tuple(int(v) for v in s) for s in (min, opt, max))
        if not (len(lo) == len(mid) == len(hi)) or any(not a <= b <= c for a, b, c in zip(lo, mid, hi)):
            raise EmulationError(f"profile for {input!r}: need min <= opt <= max, got {lo} {mid} {hi}")
        self.shapes[input] = (lo, mid, hi)

    def get_shape(self, input: str) -> list[tuple[int, ...]]:  # noqa: A002
        return list(self.shapes[input])


class IBuilderConfig:
    def __init__(self) -> None:
        self.profiles: list[IOptimizationProfile] = []
        self.flags = 0

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)


class Builder:
    def __init__(self, logger: ILogger) -> None:
        self.logger = logger

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        return INetworkDefinition(flags)

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig()

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> bytes:
        """Validate, 'time' every plugin layer on builder-owned buffers (as TensorRT's
        auto-tuner runs enqueue), and return the pickled record."""
        graph = network._graph
        problems = graph.validate(config.profiles)
        if problems:
            raise EmulationError("TensorRT refused the network:\n  " + "\n  ".join(problems))
        graph.time_plugins(config.profiles)
        return pickle.dumps({"graph": graph.freeze(), "profiles": [p.shapes for p in config.profiles]},
                            protocol=pickle.HIGHEST_PROTOCOL)


# ------------------------------------------------------------------------------ runtime


class Runtime:
    def __init__(self, logger: ILogger) -> None:
        self.logger = logger

    def deserialize_cuda_engine(self, serialized_engine: bytes) -> ICudaEngine:
        payload = pickle.loads(bytes(serialized_engine))
        graph: Graph = payload["graph"]
        graph.recreate_plugins(_registry, TensorRTPhase.RUNTIME)  # creators must be registered now
        return ICudaEngine(graph, payload["profiles"])


class ICudaEngine:
    def __init__(self, graph: Graph, profiles: list[dict]) -> None:
        self._graph, self._profiles = graph, profiles
        self._io = [graph.tensors[t].name for t in graph.inputs] + [graph.tensors[t].name for t in graph.outputs]

    @property
    def num_io_tensors(self) -> int:
        return len(self._io)

    def get_tensor_name(self, index: int) -> str:
        return self._io[index]

    def _record(self, name: str) -> TensorRecord:
        record = self._graph.io_record(name)
        if record is None:
            raise KeyError(f"engine has no I/O tensor {name!r}")
        return record

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        record = self._graph.io_record(name)
        if record is None:
            return TensorIOMode.NONE
        return TensorIOMode.INPUT if record.is_input else TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType(self._record(name).dtype)

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._record(name).shape)

    def get_tensor_location(self, name: str) -> TensorLocation:
        return TensorLocation(self._record(name).location)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self._profiles)

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[tuple[int, ...]]:
        return list(self._profiles[profile_index][name])

    def create_execution_context(
        self, strategy: ExecutionContextAllocationStrategy = ExecutionContextAllocationStrategy.STATIC
    ) -> IExecutionContext:
        return IExecutionContext(self)


class IExecutionContext:
    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine
        self._profile = 0
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._addresses: dict[str, int] = {}
        self._inferred: dict[tuple, dict[int, tuple[int, ...]]] = {}

    @property
    def active_optimization_profile(self) -> int:
        return self._profile

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> builtins.bool:
        if not 0 <= profile_index < self.engine.num_optimization_profiles:
            # pyCore.cpp wraps the C++ call in PY_ASSERT_RUNTIME_ERROR: a refusal raises.
            raise RuntimeError("Error in set optimization profile async.")
        self._profile = int(profile_index)
        return True

    def set_input_shape(self, name: str, shape: Sequence[int]) -> builtins.bool:
        """False (TensorRT logs an error) for an unknown input or a shape outside the active profile."""
        record = self.engine._graph.io_record(name)
        if record is None or not record.is_input:
            return False
        shape = tuple(int(d) for d in shape)
        lo, _, hi = self.engine._profiles[self._profile][name]
        if len(shape) != len(lo) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False
        self._shapes[name] = shape
        return True

    def _check_named_dimensions(self) -> None:
        """NvInfer.h (v10.14, 3b4ddc1d), ``ITensor::setDimensionName``: "Dimensions with the same
        non-empty name must be equal at runtime." TensorRT-LLM names the dimensions of every
        input (``Tensor(dim_range=OrderedDict(...))``, network.py ``_add_input``), so e.g. every
        ``batch_size_beam_width`` must agree; a runner that sizes one input differently is refused."""
        seen: dict[str, tuple[int, str]] = {}
        for tid in self.engine._graph.inputs:
            record = self.engine._graph.tensors[tid]
            shape = self._shapes.get(record.name)
            if shape is None:
                continue
            for index, dim_name in sorted(record.dim_names.items()):
                if not dim_name or index >= len(shape):
                    continue
                value = shape[index]
                if dim_name in seen and seen[dim_name][0] != value:
                    raise EmulationError(
                        f"IExecutionContext: dimension {dim_name!r} is {seen[dim_name][0]} in input "
                        f"{seen[dim_name][1]!r} but {value} in input {record.name!r}; dimensions with the same "
                        "name must be equal at runtime (NvInfer.h, ITensor::setDimensionName)")
                seen.setdefault(dim_name, (value, record.name))

    def _infer(self) -> dict[int, tuple[int, ...]]:
        """Output shapes for the current input shapes (a pure function of them: cached)."""
        key = tuple(sorted(self._shapes.items()))
        if key not in self._inferred:
            missing = [self.engine._graph.tensors[t].name for t in self.engine._graph.inputs
                       if self.engine._graph.tensors[t].name not in self._shapes]
            if missing:
                raise EmulationError(f"input shapes not set: {missing}")
            self._check_named_dimensions()
            if len(self._inferred) > 256:
                self._inferred.clear()
            self._inferred[key] = self.engine._graph.infer_shapes(self._shapes)
        return self._inferred[key]

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        record = self.engine._record(name)
        if record.is_input:
            return self._shapes.get(name, tuple(record.shape))
        return tuple(self._infer()[record.tid])

    def set_tensor_address(self, name: str, memory: int) -> builtins.bool:
        if self.engine._graph.io_record(name) is None:
            # TensorRT logs "Given invalid tensor name" and returns false, and TensorRT-LLM's
            # Session.run does not look at the result: the stand-in raises, so a runner binding
            # a name the engine lacks cannot pass unnoticed.
            raise EmulationError(f"setTensorAddress: given invalid tensor name {name!r}: the engine has no such I/O")
        self._addresses[name] = int(memory)
        return True

    def get_tensor_address(self, name: str) -> int:
        return self._addresses.get(name, 0)

    def execute_async_v3(self, stream_handle: int) -> builtins.bool:
        graph = self.engine._graph
        shapes = self._infer()
        bound: dict[int, torch.Tensor] = {}
        for tid in list(graph.inputs) + list(graph.outputs):
            record = graph.tensors[tid]
            if record.name not in self._addresses:
                raise EmulationError(f"no address set for {'input' if record.is_input else 'output'} {record.name!r}")
            shape = self._shapes[record.name] if record.is_input else shapes[tid]
            bound[tid] = device_memory.view(self._addresses[record.name], tuple(shape), physical_dtype(record.dtype))
        _check_placement({graph.tensors[tid].name: t for tid, t in bound.items()})
        evaluate(graph, bound, shapes, seed=int(os.environ.get("TRTLLM_STANDIN_SCHEDULE_SEED", "0")))
        return True


#: Inputs TensorRT-LLM's plugins read on the host (their ``host_*`` naming; the gpt attention
#: plugin also reads ``spec_decoding_use`` there). TensorRT-LLM's runtime allocates them on the
#: CPU (runtime/generation.py, e.g. ``host_past_key_value_lengths = torch.tensor(..., device='cpu')``).
#: ``all_reduce_workspace`` (a table of IPC addresses) is neither and is checked by the all-reduce.
_HOST_READ_EXTRA = ("spec_decoding_use",)
_UNPLACED = ("all_reduce_workspace",)


def _is_host_read(name: str) -> builtins.bool:
    return name.startswith("host_") or name in _HOST_READ_EXTRA


def _check_placement(views: dict[str, torch.Tensor]) -> None:
    """Host/device placement of the bound memory. NvInferRuntime.h (v10.14), ``setTensorAddress``:
    a kDEVICE tensor's pointer "must point to a device buffer"; TensorRT-LLM's plugins dereference
    the ``host_*`` inputs on the CPU. One allocation cannot be both, and the KV pools the
    attention kernels address through ``host_kv_cache_pool_pointers`` are device memory. On this
    CPU-only emulated device both spaces are CPU memory, so what is checked is what can be told
    apart: one allocation bound as host memory and as device memory in the same execution, a
    pool pointer into host memory, a host input that is not a CPU tensor, and device I/O on more
    than one device."""
    roles: dict[int, tuple[str, str]] = {}
    devices: dict[str, str] = {}
    for name, view in views.items():
        if name in _UNPLACED:
            continue
        owner = device_memory.find(view.data_ptr(), max(view.numel() * view.element_size(), 1))
        start = owner.untyped_storage().data_ptr()
        role = "host" if _is_host_read(name) else "device"
        if role == "host" and owner.device.type != "cpu":
            raise EmulationError(f"{name!r} is read on the host by TensorRT-LLM's plugins but is bound to "
                                 f"{owner.device} memory")
        if role == "device":
            devices.setdefault(str(owner.device), name)
        other = roles.setdefault(start, (role, name))
        if other[0] != role:
            raise EmulationError(
                f"{name!r} ({role} memory) and {other[1]!r} ({other[0]} memory) are bound to the same allocation "
                f"{start:#x}: a buffer is host or device memory, never both (NvInferRuntime.h, setTensorAddress)")
    if len(devices) > 1:
        raise EmulationError(f"device I/O bound on more than one device: {devices}")
    pools = views.get("host_kv_cache_pool_pointers")
    if pools is not None:
        for address in (int(a) for a in pools.reshape(-1).tolist() if int(a)):
            owner = device_memory.find(address, 1)
            role = roles.get(owner.untyped_storage().data_ptr())
            if role is not None and role[0] == "host":
                raise EmulationError(f"host_kv_cache_pool_pointers holds {address:#x}, inside {role[1]!r} (host "
                                     "memory): the attention kernels read the KV pool on the device")
