"""Insert the DFlash TensorRT plugins into a TensorRT-LLM network.

The plugins live in ``libdflash_trt_plugins.so`` (built from ``plugins/`` when
TensorRT 10.x is found). :func:`load_plugin_library` loads it with ``RTLD_GLOBAL`` and
calls its ``initDFlashPlugins(logger, "dflash")``, which registers both creators in
TensorRT's plugin registry under namespace ``"dflash"``, version ``"1"``: the namespace
the creators and their plugins report, so a deserialized engine finds them again
(TensorRT-LLM registers its own library the same way, ``initTrtLlmPlugins``).

The insertion follows TensorRT-LLM's own V3 plugins, e.g.
``eagle_prepare_drafter_inputs_plugin`` in ``tensorrt_llm/models/eagle/model.py``
(NVIDIA/TensorRT-LLM): ``trt.get_plugin_registry().get_creator(name, "1", namespace)``,
``creator.create_plugin(name, PluginFieldCollection, trt.TensorRTPhase.BUILD)``,
``default_trtnet().add_plugin_v3(inputs, [], plugin)`` (``default_trtnet`` from
``tensorrt_llm/_common.py``) and ``_create_tensor(layer.get_output(i), layer)`` (from
``tensorrt_llm/functional.py``) to wrap the outputs.

tensorrt and tensorrt_llm are imported inside the functions only, so importing this
module needs neither.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import DFlashError, DFlashInputError
from ..kernels import shared_library_problem
from ..tree import MAX_TREE_NODES

if TYPE_CHECKING:  # pragma: no cover
    from tensorrt_llm.functional import Tensor

PLUGIN_NAMESPACE = "dflash"
PLUGIN_VERSION = "1"
TREE_MASK_PLUGIN = "DFlashTreeMask"
KV_COMPACT_PLUGIN = "DFlashKVCompact"
PLUGIN_LIBRARY_NAME = "libdflash_trt_plugins.so"
PLUGIN_LIBRARY_ENV_VAR = "DFLASH_TRT_PLUGIN_LIB"
REPO_BUILD_DIR = Path(__file__).resolve().parents[2] / "plugins" / "build"

#: KV-cache element sizes by dtype name (the plugin copies bytes, so only the size matters).
KV_CACHE_ELEM_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1, "int8": 1,
}

LAYOUT_LINEAR = 0
LAYOUT_PAGED = 1

_loaded: dict[str, ctypes.CDLL] = {}


class PluginLibraryError(DFlashError, RuntimeError):
    """A plugin library file that cannot be loaded: not a shared library, truncated, or refused by dlopen."""


class PluginLibraryNotFound(DFlashError, FileNotFoundError):
    """No plugin library where one is looked for. A DFlashError, so the command-line tools report it in one line
    (a bare FileNotFoundError was a traceback); a FileNotFoundError, as it always was."""


def _open_library(candidate: Path) -> ctypes.CDLL:
    """dlopen ``candidate`` globally, after checking that it is a whole shared library."""
    advice = (f"rebuild it (cmake --build plugins/build) or point ${PLUGIN_LIBRARY_ENV_VAR} at a complete "
              f"{PLUGIN_LIBRARY_NAME}")
    problem = shared_library_problem(candidate)
    if problem is not None:
        raise PluginLibraryError(f"{candidate} is not a loadable shared library: {problem}; {advice}")
    try:
        return ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:  # e.g. built for another machine, or a dependency (libnvinfer) missing
        raise PluginLibraryError(f"{candidate} cannot be loaded: {err}; {advice}") from None


def plugin_library_candidates() -> list[Path]:
    """Where :func:`load_plugin_library` looks when no path is given, in order."""
    from ..kernels import library_candidates

    return library_candidates(PLUGIN_LIBRARY_ENV_VAR, PLUGIN_LIBRARY_NAME)


def load_plugin_library(path: str | os.PathLike[str] | None = None) -> ctypes.CDLL:
    """Load the TensorRT plugin library globally so TensorRT can find its creators.

    RTLD_GLOBAL matters: the registrars run at load time and the engine must be able
    to resolve the creators when it is deserialised.
    """
    candidates = [Path(path)] if path is not None else plugin_library_candidates()
    for candidate in candidates:
        key = str(candidate.resolve()) if candidate.exists() else str(candidate)
        if key in _loaded:
            return _loaded[key]
        if candidate.is_file():
            library = _open_library(candidate)
            _register_creators(library, candidate)
            _loaded[key] = library
            return library
    tried = ", ".join(str(c) for c in candidates)
    raise PluginLibraryNotFound(
        f"{PLUGIN_LIBRARY_NAME} not found (tried {tried}). Build it on a machine with TensorRT 10.x: "
        "'cmake -S plugins -B plugins/build -DTensorRT_ROOT=<prefix> && cmake --build plugins/build', "
        f"or point ${PLUGIN_LIBRARY_ENV_VAR} at it"
    )


def _register_creators(library: ctypes.CDLL, path: Path) -> None:
    try:
        init = library.initDFlashPlugins
    except AttributeError as err:
        raise RuntimeError(f"{path} has no initDFlashPlugins: rebuild plugins/ (an old or foreign library)") from err
    init.restype = ctypes.c_bool
    init.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    if not init(None, PLUGIN_NAMESPACE.encode()):
        raise RuntimeError(
            f"initDFlashPlugins could not register the DFlash plugin creators from {path} under namespace "
            f"{PLUGIN_NAMESPACE!r} (already registered under another namespace, or by another library)"
        )


# ---------------------------------------------------------------------- attributes


def _check_range(name: str, value: int, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DFlashInputError(f"{name} must be an integer, got {value!r}")
    if not low <= int(value) <= high:
        raise DFlashInputError(f"{name}={value} is out of range {low}..{high}")
    return int(value)


def tree_mask_fields(max_nodes: int = MAX_TREE_NODES) -> dict[str, int]:
    """DFlashTreeMask attributes (see docs/plugins.md), checked like the C++ creator does."""
    return {"max_nodes": _check_range("max_nodes", max_nodes, 1, MAX_TREE_NODES)}


def elem_bytes_of(kv_cache_dtype: str | int) -> int:
    """Bytes per KV-cache element from a dtype name (or an explicit byte count)."""
    if isinstance(kv_cache_dtype, (int, np.integer)) and not isinstance(kv_cache_dtype, bool):
        return _check_range("elem_bytes", kv_cache_dtype, 1, 8)
    name = str(kv_cache_dtype).removeprefix("torch.")
    if name not in KV_CACHE_ELEM_BYTES:
        raise DFlashInputError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not one of {sorted(KV_CACHE_ELEM_BYTES)}"
        )
    return KV_CACHE_ELEM_BYTES[name]


def kv_compact_fields(
    *,
    paged: bool,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    kv_cache_dtype: str | int,
    tokens_per_block: int = 64,
) -> dict[str, int]:
    """DFlashKVCompact attributes, in the creator's order, checked like the C++ creator."""
    fields = {
        "layout": LAYOUT_PAGED if paged else LAYOUT_LINEAR,
        "num_layers": _check_range("num_layers", num_layers, 1, 1 << 16),
        "num_kv_heads": _check_range("num_kv_heads", num_kv_heads, 1, 1 << 16),
        "head_size": _check_range("head_size", head_size, 1, 1 << 16),
        "elem_bytes": elem_bytes_of(kv_cache_dtype),
        "tokens_per_block": _check_range("tokens_per_block", tokens_per_block, 1, 1 << 16),
    }
    if paged and fields["tokens_per_block"] & (fields["tokens_per_block"] - 1):
        raise DFlashInputError(f"tokens_per_block={tokens_per_block} must be a power of two")
    return fields


# -------------------------------------------------------------------- insertion


def _create_plugin(plugin_name: str, layer_name: str, fields: dict[str, int]) -> Any:
    import tensorrt as trt

    registry = trt.get_plugin_registry()
    creator = registry.get_creator(plugin_name, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    if creator is None:
        # parallel_build's spawn workers (trtllm-build --workers N) start without the library
        # the parent process loaded: load it here, where the network first needs it.
        try:
            load_plugin_library()
        except FileNotFoundError as err:
            raise RuntimeError(
                f"TensorRT has no creator {PLUGIN_NAMESPACE}::{plugin_name} v{PLUGIN_VERSION}, and "
                f"load_plugin_library() could not load one: {err}"
            ) from err
        creator = registry.get_creator(plugin_name, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    if creator is None:
        raise RuntimeError(
            f"TensorRT has no creator {PLUGIN_NAMESPACE}::{plugin_name} v{PLUGIN_VERSION} even after "
            "load_plugin_library(): the loaded library does not register it; rebuild plugins/ against "
            "this TensorRT"
        )
    collection = trt.PluginFieldCollection([
        trt.PluginField(name, np.array([value], dtype=np.int32), trt.PluginFieldType.INT32)
        for name, value in fields.items()
    ])
    plugin = creator.create_plugin(layer_name, collection, trt.TensorRTPhase.BUILD)
    if plugin is None:
        raise RuntimeError(f"{plugin_name} refused its attributes {fields} (see stderr)")
    return plugin


def _add_plugin(plugin: Any, inputs: list[Tensor], nb_outputs: int) -> tuple[Tensor, ...]:
    from tensorrt_llm._common import default_trtnet
    from tensorrt_llm.functional import _create_tensor

    layer = default_trtnet().add_plugin_v3([t.trt_tensor for t in inputs], [], plugin)
    return tuple(_create_tensor(layer.get_output(i), layer) for i in range(nb_outputs))


def tree_mask(
    parents: Tensor, generation_lengths: Tensor, *, max_nodes: int = MAX_TREE_NODES
) -> tuple[Tensor, Tensor, Tensor]:
    """Add DFlashTreeMask: ``parents`` int32 ``[batch, N]`` (-1 at the root),
    ``generation_lengths`` int32 ``[batch]`` -> ``(spec_decoding_packed_mask
    [batch * N, ceil(max_nodes/32)], spec_decoding_position_offsets [batch, max_nodes],
    spec_decoding_generation_lengths [batch])``, all int32, in the layout the gpt attention
    plugin reads when ``spec_decoding_max_generation_length == max_nodes``: mask rows
    packed by generation length, ``ceil(max_nodes/32)`` words each (docs/plugins.md).
    """
    plugin = _create_plugin(TREE_MASK_PLUGIN, "dflash_tree_mask", tree_mask_fields(max_nodes))
    packed, offsets, lengths = _add_plugin(plugin, [parents, generation_lengths], 3)
    return packed, offsets, lengths


def kv_compact_paged(
    accepted_nodes: Tensor,
    num_accepted: Tensor,
    past_key_value_lengths: Tensor,
    kv_cache_block_offsets: Tensor,
    host_kv_cache_pool_pointers: Tensor,
    host_kv_cache_pool_mapping: Tensor,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    kv_cache_dtype: str | int,
    tokens_per_block: int,
) -> Tensor:
    """Add DFlashKVCompact for TensorRT-LLM's paged cache; returns the committed lengths
    ``past_key_value_lengths + num_accepted`` (int32 ``[batch]``).

    The last three inputs are the gpt attention plugin's own tensors. Make what must
    run after the compaction depend on the returned tensor: the cache is written
    through raw pointers, invisible to TensorRT's dependency analysis.
    """
    fields = kv_compact_fields(
        paged=True, num_layers=num_layers, num_kv_heads=num_kv_heads, head_size=head_size,
        kv_cache_dtype=kv_cache_dtype, tokens_per_block=tokens_per_block,
    )
    plugin = _create_plugin(KV_COMPACT_PLUGIN, "dflash_kv_compact", fields)
    inputs = [
        accepted_nodes, num_accepted, past_key_value_lengths,
        kv_cache_block_offsets, host_kv_cache_pool_pointers, host_kv_cache_pool_mapping,
    ]
    (committed,) = _add_plugin(plugin, inputs, 1)
    return committed


def kv_compact_linear(
    accepted_nodes: Tensor,
    num_accepted: Tensor,
    past_key_value_lengths: Tensor,
    layer_caches: list[Tensor],
    *,
    num_kv_heads: int,
    head_size: int,
    kv_cache_dtype: str | int,
) -> Tensor:
    """Add DFlashKVCompact for linear caches: ``layer_caches`` are the engine's
    ``past_key_value_{i}`` inputs (``[batch, 2, heads, max_seq_len, head_size]``), updated in
    place. Returns the committed lengths; order what reads the caches after the compaction
    by that tensor (the caches are written behind TensorRT's back, as the attention does).
    """
    fields = kv_compact_fields(
        paged=False, num_layers=len(layer_caches), num_kv_heads=num_kv_heads, head_size=head_size,
        kv_cache_dtype=kv_cache_dtype,
    )
    plugin = _create_plugin(KV_COMPACT_PLUGIN, "dflash_kv_compact", fields)
    inputs = [accepted_nodes, num_accepted, past_key_value_lengths, *layer_caches]
    (committed,) = _add_plugin(plugin, inputs, 1)
    return committed
