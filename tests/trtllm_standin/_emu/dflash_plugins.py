"""The project's TensorRT plugin library (``libdflash_trt_plugins.so``), emulated.

What runs is the project's own C++: the kernels' per-thread bodies through the CPU
library's GPU emulation (``kernels.tree_mask_cpu`` / ``compact_*_cpu`` with
``implementation="gpu-emulation"``), the enqueue guard (``dflash_enqueue_skipped_while_building``),
and the attribute tables, parsed from ``plugins/src/trt/*.cpp`` (``kFieldSpecs``). The
TensorRT-facing rules the plugin classes implement (input types and ranks, output shapes,
``onShapeChange``) are restated here from ``tree_mask_plugin.cpp`` / ``kv_compact_plugin.cpp``;
``plugins/tests/trt_plugin_host_test.cpp`` checks the C++ side of the same rules.

Registration: TensorRT finds a creator only after the library is loaded *and* registered
under the namespace asked for. The stand-in library (``standin_plugin_library.c``) exports
``initDFlashPlugins(logger, namespace)`` and records the namespace it was given; the
registry sees the two creators under exactly that namespace, and only once the project
has loaded the library (``ctypes.CDLL(..., RTLD_GLOBAL)``) and called the init function.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import torch

from .core import EmulatedMemoryFault, EmulationError, device_memory, numerics_mode

#: The project checkout whose plugin sources hold the attribute tables (the stand-in may be
#: installed elsewhere as a distribution, tests/test_trtllm_build_entry_point.py).
REPO = Path(os.environ.get("DFLASH_REPO_ROOT", Path(__file__).resolve().parents[3]))
TRT_SOURCES = REPO / "plugins" / "src" / "trt"
STUB_SOURCE = Path(__file__).resolve().parent / "standin_plugin_library.c"
LIBRARY_ENV = "DFLASH_TRT_PLUGIN_LIB"
VERSION = "1"
_CONSTANTS = {"kMaxTreeNodes": 1024, "kPaged": 1, "kLinear": 0, "INT32_MAX": 2**31 - 1, "kRequired": None}


def field_specs(source: str) -> list[tuple[str, int | None, int, int]]:
    """(name, default or None if required, min, max) of a plugin's kFieldSpecs table in the C++ source."""
    text = (TRT_SOURCES / source).read_text()
    table = text[text.index("kFieldSpecs["): text.index("};", text.index("kFieldSpecs["))]
    specs = []
    for name, default, lo, hi in re.findall(r'\{"(\w+)",\s*([^,]+),\s*([^,]+),\s*([^}]+?)\s*\}', table):
        specs.append((name, *(_value(v) for v in (default, lo, hi))))
    return specs


def _value(expr: str) -> int | None:
    expr = expr.strip()
    if expr in _CONSTANTS:
        return _CONSTANTS[expr]
    shift = re.fullmatch(r"(\d+)\s*<<\s*(\d+)", expr)
    if shift:
        return int(shift.group(1)) << int(shift.group(2))
    return int(expr)


def _parse_fields(collection, specs, plugin: str) -> dict[str, int] | None:
    """parseInt32Fields (plugin_fields.cpp): INT32, one value, in range; required ones present."""
    given = {f.name: f for f in collection or []}
    values = {}
    for name, default, lo, hi in specs:
        field = given.get(name)
        if field is None:
            if default is None:
                return None  # "missing required field"
            values[name] = default
            continue
        data = np.asarray(field.data).reshape(-1)
        if data.dtype != np.int32 or data.size != 1 or not lo <= int(data[0]) <= hi:
            return None
        values[name] = int(data[0])
    return values


def _fields_collection(values: dict[str, int]):
    import tensorrt as trt

    return trt.PluginFieldCollection([trt.PluginField(k, np.array([v], np.int32), trt.PluginFieldType.INT32)
                                      for k, v in values.items()])


def _skip_while_building() -> bool:
    from tensorrt_llm_dflash import kernels

    return kernels.enqueue_skipped_while_building()


# ------------------------------------------------------------------- DFlashTreeMask


class TreeMaskPlugin:
    plugin_name, plugin_version = "DFlashTreeMask", VERSION

    def __init__(self, values: dict[str, int], namespace: str) -> None:
        self.values, self.plugin_namespace = values, namespace
        self.max_nodes = values["max_nodes"]

    def get_fields_to_serialize(self):
        return _fields_collection(self.values)

    def get_output_data_types(self, input_types):
        if [t.value for t in input_types] != ["int32", "int32"]:
            raise EmulationError("DFlashTreeMask: expects two INT32 inputs (parents, generation_lengths)")
        return [input_types[0]] * 3

    def get_output_shapes(self, shapes):
        (batch, nodes), _ = shapes
        words = (self.max_nodes + 31) // 32
        rows = -1 if -1 in (batch, nodes) else batch * nodes
        return [(rows, words), (batch, self.max_nodes), (batch,)]

    def infer_output_shapes(self, inputs):
        parents, lengths = inputs
        if parents.ndim != 2 or lengths.ndim != 1 or parents.shape[0] != lengths.shape[0]:
            raise EmulationError("DFlashTreeMask onShapeChange: parents must be [batch, N] and generation_lengths "
                                 "[batch]")
        if not 1 <= parents.shape[1] <= self.max_nodes:
            raise EmulationError(f"DFlashTreeMask onShapeChange: N={parents.shape[1]} is out of range "
                                 f"1..max_nodes={self.max_nodes}")
        return self.get_output_shapes([tuple(parents.shape), tuple(lengths.shape)])

    def enqueue(self, inputs, outputs) -> int:
        if _skip_while_building():
            return 0
        from tensorrt_llm_dflash import kernels

        parents, lengths = (t.cpu().numpy() for t in inputs)
        packed, offsets, lengths_out = kernels.tree_mask_cpu(parents, lengths, self.max_nodes,
                                                             implementation="gpu-emulation")
        for out, value in zip(outputs, (packed, offsets, lengths_out)):
            out.copy_(torch.from_numpy(value).reshape(out.shape))
        return 0


# ------------------------------------------------------------------ DFlashKVCompact

_CACHE_TYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8": 1}


class KVCompactPlugin:
    plugin_name, plugin_version = "DFlashKVCompact", VERSION

    def __init__(self, values: dict[str, int], namespace: str) -> None:
        self.values, self.plugin_namespace = values, namespace
        self.paged = values["layout"] == 1

    def get_fields_to_serialize(self):
        return _fields_collection(self.values)

    @property
    def num_inputs(self) -> int:
        return 6 if self.paged else 3 + self.values["num_layers"]

    def get_output_data_types(self, input_types):
        if len(input_types) != self.num_inputs:
            raise EmulationError(f"DFlashKVCompact: the {'paged' if self.paged else 'linear'} layout takes "
                                 f"{self.num_inputs} inputs, got {len(input_types)}")
        for i, t in enumerate(input_types):
            if not self.paged and i >= 3:
                ok = _CACHE_TYPES.get(t.value) == self.values["elem_bytes"]
            elif self.paged and i == 4:
                ok = t.value == "int64"
            else:
                ok = t.value == "int32"
            if not ok:
                raise EmulationError(f"DFlashKVCompact getOutputDataTypes: input {i} may not be {t.value}")
        return [input_types[0]]

    def get_output_shapes(self, shapes):
        return [(shapes[1][0],)]

    def infer_output_shapes(self, inputs):
        shapes = [tuple(t.shape) for t in inputs]
        batch = shapes[0][0]
        ok = len(shapes[0]) == 2 and shapes[1] == (batch,) and shapes[2] == (batch,) and shapes[0][1] >= 1
        v = self.values
        if self.paged:
            offsets, pools, mapping = shapes[3], shapes[4], shapes[5]
            ok = ok and len(offsets) == 4 and offsets[1] == batch and offsets[2] == 2 and pools == (offsets[0], 2) \
                and mapping == (v["num_layers"], 2)
        else:
            caches = shapes[3:]
            ok = ok and all(len(c) == 5 and c[0] == batch and c[1] == 2 and c[2] == v["num_kv_heads"]
                            and c[3] == caches[0][3] >= 1 and c[4] == v["head_size"] for c in caches)
        if not ok:
            raise EmulationError(f"DFlashKVCompact onShapeChange: inconsistent input shapes {shapes}")
        return [(batch,)]

    def enqueue(self, inputs, outputs) -> int:
        if _skip_while_building():
            return 0  # builder-owned buffers: no valid cache addresses in them
        from tensorrt_llm_dflash import kernels

        accepted, num, past = (t.cpu().numpy().astype(np.int32) for t in inputs[:3])
        rows = [accepted[b, : max(int(num[b]), 0)].tolist() or [0] for b in range(accepted.shape[0])]
        if self.paged:
            self._paged(inputs, past, rows)
        else:
            caches = [_bytes_view(t, self.values["elem_bytes"]) for t in inputs[3:]]
            kernels.compact_contiguous_cpu(caches, past, rows, implementation="gpu-emulation")
        outputs[0].copy_(torch.from_numpy(past + np.maximum(num, 0)))
        return 0

    def _paged(self, inputs, past, rows) -> None:
        from tensorrt_llm_dflash import kernels

        v = self.values
        offsets, pool_pointers, mapping = inputs[3].cpu().numpy(), inputs[4].cpu().numpy(), inputs[5].cpu().numpy()
        pools, secondaries = [], []
        for primary, secondary in pool_pointers.tolist():
            pools.append(_pool_view(int(primary), v["elem_bytes"]))
            secondaries.append(_pool_view(int(secondary), v["elem_bytes"]) if secondary else None)
        kernels.compact_paged_cpu(pools, mapping, offsets, v["tokens_per_block"], v["num_kv_heads"], v["head_size"],
                                  past, rows, secondaries, implementation="gpu-emulation")


_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _stored_width(elem_bytes: int) -> int:
    """Bytes of one cache element on the emulated device: the declared size, except that the
    exact numerics hold every floating cache in float64 (the byte copy scales uniformly)."""
    return 8 if numerics_mode() == "exact" and elem_bytes in (2, 4) else elem_bytes


def _bytes_view(tensor: torch.Tensor, elem_bytes: int) -> np.ndarray:
    """A writable numpy view of a cache tensor, one integer per stored element."""
    if not tensor.is_contiguous():
        raise EmulationError("DFlashKVCompact: a KV cache input is not contiguous")
    width = tensor.element_size()
    if width != _stored_width(elem_bytes):
        raise EmulationError(f"DFlashKVCompact: elem_bytes={elem_bytes} but the bound cache has {width}-byte "
                             "elements (the engine's kv dtype differs from the runtime's buffers)")
    return tensor.view(_AS_INT[width]).numpy()


def _pool_view(address: int, elem_bytes: int) -> np.ndarray:
    width = _stored_width(elem_bytes)
    owner = device_memory.find(address, width)
    storage = owner.untyped_storage()
    offset = address - storage.data_ptr()
    if offset % width:
        raise EmulatedMemoryFault(f"pool pointer {address:#x} is not aligned to {width} bytes")
    count = (storage.nbytes() - offset) // width
    return torch.empty(0, dtype=_AS_INT[width]).set_(storage, offset // width, (count,), (1,)).numpy()


# --------------------------------------------------------------------- the creators


class _Creator:
    plugin_version = VERSION

    def __init__(self, name: str, source: str, cls, namespace: str) -> None:
        self.name, self._cls, self.plugin_namespace = name, cls, namespace
        self._specs = field_specs(source)
        self._kv = name == "DFlashKVCompact"

    @property
    def field_names(self):
        return [s[0] for s in self._specs]

    def create_plugin(self, name, field_collection, phase):
        values = _parse_fields(field_collection, self._specs, self.name)
        if values is None:
            return None
        if self._kv and values["layout"] == 1 and values["tokens_per_block"] & (values["tokens_per_block"] - 1):
            return None  # validAttributes: tokens_per_block must be a power of two
        return self._cls(values, self.plugin_namespace)


def registered_creators() -> list[tuple[object, str]]:
    """The creators TensorRT's registry holds right now: none until the library at
    ``$DFLASH_TRT_PLUGIN_LIB`` is loaded in this process and initDFlashPlugins ran."""
    path = os.environ.get(LIBRARY_ENV)
    if not path or not Path(path).is_file() or not hasattr(os, "RTLD_NOLOAD"):
        return []
    try:
        library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
    except OSError:
        return []  # not loaded: its registrar never ran
    get = getattr(library, "standin_registered_namespace", None)
    if get is None:
        return []
    get.restype = ctypes.c_char_p
    namespace = get()
    if namespace is None:
        return []
    namespace = namespace.decode()
    return [(_Creator("DFlashTreeMask", "tree_mask_plugin.cpp", TreeMaskPlugin, namespace), namespace),
            (_Creator("DFlashKVCompact", "kv_compact_plugin.cpp", KVCompactPlugin, namespace), namespace)]


def build_standin_library(directory: Path) -> Path:
    """Compile the stand-in ``libdflash_trt_plugins.so`` (its init function only) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "libdflash_trt_plugins.so"
    if not target.is_file() or target.stat().st_mtime < STUB_SOURCE.stat().st_mtime:
        tmp = directory / f".libdflash_trt_plugins.{os.getpid()}.so"
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(tmp), str(STUB_SOURCE)], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, target)
    return target
