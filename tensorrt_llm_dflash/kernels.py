"""Python side of the DFlash plugin library's CPU build (``libdflash_plugins_cpu.so``).

The CPU library implements both plugins with the same per-element code as the CUDA
kernels (``plugins/include/dflash/*_core.h``), so it is the bit-exact reference the
tests compare against :mod:`tensorrt_llm_dflash.tree`, and the PyTorch runtime can use
it to compact its KV cache in place.

The library is looked up, in order, at ``$DFLASH_PLUGIN_LIB`` (a file, or a directory
holding it) and at ``plugins/build/`` in this repository. Build it with::

    cmake -S plugins -B plugins/build && cmake --build plugins/build --target dflash_plugins_cpu

Without the library, :func:`compact_tail_` falls back to torch; the other functions
raise :class:`PluginLibraryNotFound`. Every error code of the library becomes a
:class:`~tensorrt_llm_dflash.errors.DFlashInputError` naming the field and the value.
torch is imported only inside :func:`compact_tail_`.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import DFlashInputError
from .tree import MAX_TREE_NODES

if TYPE_CHECKING:  # pragma: no cover
    import torch

LIBRARY_NAME = "libdflash_plugins_cpu.so"
LIBRARY_ENV_VAR = "DFLASH_PLUGIN_LIB"
#: Must match kAbiVersion in plugins/src/cpu/dflash_cpu.cpp.
ABI_VERSION = 4
REPO_BUILD_DIR = Path(__file__).resolve().parent.parent / "plugins" / "build"

# Status codes of plugins/include/dflash/common.h (part of the ABI).
OK = 0
ERR_NULL_POINTER = 1
ERR_BATCH_OUT_OF_RANGE = 2
ERR_TREE_TOO_LARGE = 3
ERR_LENGTH_OUT_OF_RANGE = 4
ERR_ROOT_PARENT = 5
ERR_NEGATIVE_PARENT = 6
ERR_PARENT_OUT_OF_RANGE = 7
ERR_PARENT_NOT_BEFORE_CHILD = 8
ERR_BAD_GEOMETRY = 9
ERR_PAST_LENGTH_OUT_OF_RANGE = 10
ERR_NUM_ACCEPTED_OUT_OF_RANGE = 11
ERR_ACCEPTED_ROOT = 12
ERR_ACCEPTED_NOT_INCREASING = 13
ERR_SLOT_OUT_OF_RANGE = 14
ERR_TOKENS_PER_BLOCK = 15
ERR_POOL_MAPPING = 16
ERR_BLOCK_OFFSET = 17
ERR_CUDA = 18
ERR_DDTREE_SHAPE = 19
#: The field a DFLASH_ERR_DDTREE_SHAPE detail's index names (common.h).
_SHAPE_FIELDS = ("budget", "depth", "k", "nodes", "max_path", "capacity", "width", "branches", "ngram", "size",
                 "max_hops", "table_rows", "table_bins")


class PluginLibraryNotFound(FileNotFoundError):
    """The CPU plugin library is not built or not where we look for it."""


class _ErrorDetail(ctypes.Structure):
    # Mirrors DFlashErrorDetail; natural alignment gives the same layout as C.
    _fields_ = [
        ("code", ctypes.c_int32),
        ("sequence", ctypes.c_int32),
        ("index", ctypes.c_int32),
        ("value", ctypes.c_int64),
    ]


_I32P = ctypes.POINTER(ctypes.c_int32)
_I64P = ctypes.POINTER(ctypes.c_int64)
_VPP = ctypes.POINTER(ctypes.c_void_p)
_DETAILP = ctypes.POINTER(_ErrorDetail)
_i32 = ctypes.c_int32
_i64 = ctypes.c_int64

_P = ctypes.c_void_p
#: The fused tree kernels (fused_tree.py): their arguments before the error detail, the same in
#: ``dflash_<name>_cpu`` and ``dflash_<name>_cuda`` (which takes the CUDA stream between them).
FUSED_KERNEL_ARGS = {
    "ddtree_build": [_P] * 4 + [_i32] * 4 + [_P] * 7,
    "path_sums": [_P] * 2 + [_i32] * 2 + [_P],
    "walk": [_P] * 4 + [_i32] * 3 + [_P] * 3,
    "lookup": [_P, _i64, _i32] + [_P] * 2 + [_i32] * 5 + [_P] * 3,
    "graft": [_P] * 7 + [_i32] * 2 + [_P] * 2 + [_i32] * 2 + [_P] * 9,
    "select": [_P] * 8 + [_i32] * 3 + [_P] * 9,
    "visibility": [_P] * 2 + [_i32] * 2 + [_i64, _P],
    "learn": [_P] * 11 + [_i32] * 2 + [_P] * 4 + [_i32] * 2 + [_P] * 4 + [_i32] * 2 + [_P] + [ctypes.c_double] * 2,
}

_SIGNATURES = {
    "dflash_abi_version": (_i32, []),
    "dflash_max_tree_nodes": (_i32, []),
    "dflash_error_string": (ctypes.c_char_p, [_i32]),
    "dflash_tree_mask_cpu": (_i32, [_I32P, _I32P, _i32, _i32, _i32, _I32P, _I32P, _I32P, _DETAILP]),
    "dflash_enqueue_skipped_while_building": (_i32, []),
    "dflash_kv_compact_linear_cpu": (
        _i32,
        [_VPP, _i32, _i32, _i32, _i32, _i32, _I32P, _I32P, _i32, _I32P, _DETAILP],
    ),
    "dflash_kv_compact_paged_cpu": (
        _i32,
        [_VPP, _I64P, _i32, _I32P, _i32, _I32P, _i32, _i32, _i32, _i32, _i32]
        + [_I32P, _I32P, _i32, _I32P, _DETAILP],
    ),
    "dflash_compact_tail_cpu": (
        _i32,
        [ctypes.c_void_p, _i64, _i64, _i64, _i32, _I32P, _i32, _DETAILP],
    ),
    "dflash_max_ddtree_budget": (_i32, []),
    "dflash_ddtree_scratch_bytes": (_i32, [_i32]),
    **{f"dflash_{name}_cpu": (_i32, [*args, _DETAILP]) for name, args in FUSED_KERNEL_ARGS.items()},
    "dflash_emulate_tree_mask_kernel": (_i32, [_I32P, _I32P, _i32, _i32, _i32, _I32P, _I32P, _I32P]),
    "dflash_emulate_kv_compact_linear_kernel": (
        _i32,
        [_VPP, _i32, _i32, _i32, _i32, _i32, _I32P, _I32P, _i32, _I32P],
    ),
    "dflash_emulate_kv_compact_paged_kernel": (
        _i32,
        [_VPP, _i32, _I32P, _i32, _I32P, _i32, _i32, _i32, _i32, _i32, _I32P, _I32P, _i32, _I32P],
    ),
}

#: ``implementation=`` values: the validated CPU code, or the CUDA kernels' own
#: per-thread bodies run serially (no validation: bad rows are skipped, as on the GPU).
IMPLEMENTATIONS = ("cpu", "gpu-emulation")

_library: ctypes.CDLL | None = None
_library_searched = False


# --------------------------------------------------------------------------- loading


def library_candidates(env_var: str = LIBRARY_ENV_VAR, name: str = LIBRARY_NAME) -> list[Path]:
    """Where a plugin library is looked for, in order: ``$env_var`` (a file or a directory), then the
    repository's ``plugins/build``. The TensorRT plugin library uses the same search."""
    candidates: list[Path] = []
    env = os.environ.get(env_var)
    if env:
        path = Path(env)
        candidates.append(path / name if path.is_dir() else path)
    candidates.append(REPO_BUILD_DIR / name)
    return candidates


def shared_library_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete ELF shared library, or None when its headers say it is.

    Checked before dlopen because dlopen does not check it: a library cut short by a killed link or copy
    maps segments past the end of the file, and the first touch of those pages kills the process with
    SIGBUS (no exception, no message). The linker writes the section header table last, so a truncated
    file also ends before that table.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
            if len(head) < 52 or head[:4] != b"\x7fELF":
                return f"it is not an ELF file ({size} bytes)"
            if head[4] not in (1, 2) or head[5] not in (1, 2):
                return "its ELF header is damaged (class or byte order)"
            wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
            if wide and len(head) < 64:
                return f"it is truncated ({size} bytes, not even the ELF header)"
            # e_phoff, e_shoff, then e_phentsize, e_phnum, e_shentsize, e_shnum (the ELF header's layout).
            phoff, shoff = struct.unpack_from(order + ("QQ" if wide else "II"), head, 0x20 if wide else 0x1C)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "4H", head, 0x36 if wide else 0x2A)
            if shoff and shoff + shentsize * shnum > size:
                return (f"it is truncated: its section headers end at byte {shoff + shentsize * shnum}, "
                        f"the file holds {size}")
            if phoff + phentsize * phnum > size:
                return f"it is truncated: its program headers end past the file's {size} bytes"
            if phnum and phentsize < (56 if wide else 32):
                return f"its ELF header is damaged (program header size {phentsize})"
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except OSError as err:
        return f"it cannot be read ({err})"
    # p_offset and p_filesz of each program header: where the segment's bytes lie in the file.
    segment = order + ("8xQ16xQ" if wide else "4xI8xI")
    for i in range(phnum):
        offset, filesz = struct.unpack_from(segment, table, i * phentsize)
        if offset + filesz > size:
            return f"it is truncated: segment {i} ends at byte {offset + filesz}, the file holds {size}"
    return None


def load_library(path: str | os.PathLike[str] | None = None) -> ctypes.CDLL:
    """Load (once) and return the CPU library; raise PluginLibraryNotFound if absent."""
    global _library, _library_searched
    if path is None and _library is not None:
        return _library
    candidates = [Path(path)] if path is not None else library_candidates()
    for candidate in candidates:
        if candidate.is_file():
            problem = shared_library_problem(candidate)
            if problem is not None:  # dlopen of a truncated library kills the process (SIGBUS): no fallback then
                raise PluginLibraryNotFound(f"{candidate} is not a loadable shared library: {problem}; rebuild it "
                                            "(cmake --build plugins/build)")
            lib = ctypes.CDLL(str(candidate))
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name, None)
                if fn is None:  # a library built from older sources
                    raise PluginLibraryNotFound(
                        f"{candidate} lacks {name}: it is stale, rebuild it (cmake --build plugins/build)"
                    )
                fn.restype = restype
                fn.argtypes = argtypes
            version = lib.dflash_abi_version()
            if version != ABI_VERSION:
                raise PluginLibraryNotFound(
                    f"{candidate} has ABI version {version}, this package needs {ABI_VERSION}; "
                    "rebuild plugins/ (cmake --build plugins/build)"
                )
            _library = lib
            _library_searched = True
            return lib
    _library_searched = True
    tried = ", ".join(str(c) for c in candidates)
    raise PluginLibraryNotFound(
        f"{LIBRARY_NAME} not found (tried {tried}); build it with "
        "'cmake -S plugins -B plugins/build && cmake --build plugins/build --target dflash_plugins_cpu' "
        f"or point ${LIBRARY_ENV_VAR} at it"
    )


def library_loaded() -> bool:
    """True when the CPU library can be used (loads it on first call)."""
    if _library is not None:
        return True
    if _library_searched:
        return False
    try:
        load_library()
    except (PluginLibraryNotFound, OSError):
        return False
    return True


def compaction_backend(tensor: torch.Tensor | None = None) -> str:
    """Which implementation :func:`compact_tail_` uses: ``"cpu-library"`` or ``"torch"``.

    With a tensor, answers for that tensor (the library only handles contiguous CPU
    tensors); without one, answers for a contiguous CPU tensor.
    """
    if not library_loaded():
        return "torch"
    if tensor is not None and (tensor.device.type != "cpu" or not tensor.is_contiguous()):
        return "torch"
    return "cpu-library"


def error_string(code: int) -> str:
    """The library's description of a status code."""
    return load_library().dflash_error_string(code).decode()


# ----------------------------------------------------------------------- error messages


def _element(field: str, seq: int, index: int, batched: bool) -> str:
    if batched and seq >= 0:
        return f"{field}[{seq}][{index}]" if index >= 0 else f"{field}[{seq}]"
    return f"{field}[{index}]" if index >= 0 else field


def _raise_for(code: int, detail: _ErrorDetail, context: dict[str, object]) -> None:
    """Turn a status code into a DFlashInputError naming the field and its value."""
    if code == OK:
        return
    seq, index, value = detail.sequence, detail.index, detail.value
    batched = bool(context.get("batched", True))
    accepted = _element("accepted_nodes", seq, index, batched)
    seq_suffix = f"[{seq}]" if batched and seq >= 0 else ""
    messages = {
        ERR_BATCH_OUT_OF_RANGE: f"batch={value} must not be negative",
        ERR_TREE_TOO_LARGE: (
            f"tree size N={value} is out of range 1..{MAX_TREE_NODES}"
            if value == context.get("num_nodes", value)
            else f"max_nodes={value} is out of range N={context.get('num_nodes')}..{MAX_TREE_NODES}"
        ),
        ERR_LENGTH_OUT_OF_RANGE: (
            f"generation_lengths[{seq}]={value} is out of range 1..N={context.get('num_nodes')}"
        ),
        ERR_ROOT_PARENT: f"parents[{seq}][0]={value}: the root's parent must be -1",
        ERR_NEGATIVE_PARENT: (
            f"parents[{seq}][{index}]={value}: only the root may have a negative parent"
        ),
        ERR_PARENT_OUT_OF_RANGE: (
            f"parents[{seq}][{index}]={value}: parent index is out of range for a tree of "
            f"length {_length_of(context, seq)}"
        ),
        ERR_PARENT_NOT_BEFORE_CHILD: (
            f"parents[{seq}][{index}]={value}: a parent must come before its child"
        ),
        ERR_BAD_GEOMETRY: f"cache geometry is invalid: {context.get('geometry')}",
        ERR_PAST_LENGTH_OUT_OF_RANGE: (
            f"{context.get('past_field', 'past_lengths')}{seq_suffix}={value} must not be negative"
        ),
        ERR_NUM_ACCEPTED_OUT_OF_RANGE: (
            f"len(accepted_nodes{seq_suffix})={value} is out of range 0.."
            f"{context.get('max_accepted')}"
        ),
        ERR_ACCEPTED_ROOT: f"{accepted}={value}: the first accepted node must be the root 0",
        ERR_ACCEPTED_NOT_INCREASING: f"{accepted}={value}: accepted nodes must be strictly increasing",
        ERR_SLOT_OUT_OF_RANGE: (
            f"{accepted}: its KV slot past_len + node = {value} is beyond the cache capacity "
            f"{context.get('capacity')}"
        ),
        ERR_TOKENS_PER_BLOCK: f"tokens_per_block={value} must be a positive power of two",
        ERR_POOL_MAPPING: f"pool_mapping[{index}] refers to pool/layer {value}, which does not exist",
        ERR_BLOCK_OFFSET: (
            f"block_offsets for sequence {seq}, block {index} = {value} points outside its pool "
            "(or that pool's pointer is null)"
        ),
        ERR_CUDA: f"a CUDA call failed with cudaError_t {value}",
        ERR_DDTREE_SHAPE: (
            f"{_SHAPE_FIELDS[index] if 0 <= index < len(_SHAPE_FIELDS) else 'shape'}={value} is out of range for the "
            f"fused tree kernels (budget 0..{context.get('max_budget', '?')}, depth, k, nodes and capacity >= 0; the "
            "walk's nodes and max_path, the lookup's width and branches >= 1; 1 <= min_ngram <= max_ngram; the select's "
            "1 <= size <= nodes; max_hops >= 0; the learning step's nodes and table rows and bins >= 1)"
        ),
    }
    message = messages.get(code)
    if message is None:
        message = f"plugin library error {code}: {_safe_error_string(code)}"
    raise DFlashInputError(message)


def _length_of(context: dict[str, object], seq: int) -> object:
    lengths = context.get("lengths")
    if isinstance(lengths, np.ndarray) and 0 <= seq < lengths.shape[0]:
        return int(lengths[seq])
    return "?"


def _safe_error_string(code: int) -> str:
    try:
        return error_string(code)
    except PluginLibraryNotFound:
        return "unknown"


# ------------------------------------------------------------------------ conversions


def _check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise DFlashInputError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}")


def _as_int32(name: str, values: object, ndim: int) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != ndim:
        raise DFlashInputError(f"{name} must be {ndim}-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise DFlashInputError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.size and (array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max):
        raise DFlashInputError(f"{name} has values outside int32")
    return np.ascontiguousarray(array, dtype=np.int32)


def _ptr(array: np.ndarray, ctype: type = ctypes.c_int32) -> ctypes._Pointer:
    return array.ctypes.data_as(ctypes.POINTER(ctype))


def _pad_accepted(
    accepted_nodes: Sequence[Sequence[int]], batch: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Ragged per-sequence paths -> (padded [batch, max] int32, counts [batch], max)."""
    if len(accepted_nodes) != batch:
        raise DFlashInputError(f"accepted_nodes has {len(accepted_nodes)} rows for a batch of {batch}")
    rows = [np.asarray(row, dtype=np.int64).reshape(-1) for row in accepted_nodes]
    max_accepted = max([1] + [row.shape[0] for row in rows])
    padded = np.zeros((batch, max_accepted), dtype=np.int32)
    counts = np.zeros(batch, dtype=np.int32)
    for b, row in enumerate(rows):
        padded[b, : row.shape[0]] = _as_int32(f"accepted_nodes[{b}]", row, 1)
        counts[b] = row.shape[0]
    return padded, counts, max_accepted


# ------------------------------------------------------------------------- tree mask


def tree_mask_cpu(
    parents: np.ndarray | Sequence[Sequence[int]],
    generation_lengths: np.ndarray | Sequence[int],
    max_nodes: int | None = None,
    *,
    implementation: str = "cpu",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DFlashTreeMask on the CPU: ``(packed_mask, position_offsets, generation_lengths)``.

    Same contract and result as :func:`tensorrt_llm_dflash.tree.batched_tree_inputs`:
    ``parents`` int32 ``[batch, N]``, ``generation_lengths`` ``[batch]``, ``max_nodes``
    M (default N); returns int32 ``[batch * N, ceil(M/32)]`` (rows packed by length),
    ``[batch, M]`` and ``[batch]``.
    ``implementation="gpu-emulation"`` runs the CUDA kernel's body instead (tests).
    """
    lib = load_library()
    _check_implementation(implementation)
    parents32 = _as_int32("parents", parents, 2)
    lengths32 = _as_int32("generation_lengths", generation_lengths, 1)
    batch, num_nodes = parents32.shape
    if lengths32.shape[0] != batch:
        raise DFlashInputError(
            f"generation_lengths has {lengths32.shape[0]} entries for a batch of {batch}"
        )
    max_nodes = num_nodes if max_nodes is None else int(max_nodes)
    # N and M are checked by the library (DFLASH_ERR_TREE_TOO_LARGE); max(.., 1) only keeps
    # the output allocation valid for out-of-range sizes.
    words = max((max(max_nodes, 1) + 31) // 32, 1)
    packed = np.zeros((batch * max(num_nodes, 0), words), dtype=np.int32)
    offsets = np.zeros((batch, max(max_nodes, 0)), dtype=np.int32)
    lengths_out = np.zeros(batch, dtype=np.int32)
    if implementation == "gpu-emulation":
        code = lib.dflash_emulate_tree_mask_kernel(
            _ptr(parents32), _ptr(lengths32), batch, num_nodes, max_nodes,
            _ptr(packed), _ptr(offsets), _ptr(lengths_out),
        )
        if code != OK:  # the only thing the kernel launcher refuses
            raise DFlashInputError(
                f"tree size N={num_nodes} / max_nodes={max_nodes} is out of range (1 <= N <= max_nodes <= "
                f"{MAX_TREE_NODES})"
            )
        return packed, offsets, lengths_out
    detail = _ErrorDetail()
    code = lib.dflash_tree_mask_cpu(
        _ptr(parents32), _ptr(lengths32), batch, num_nodes, max_nodes,
        _ptr(packed), _ptr(offsets), _ptr(lengths_out), ctypes.byref(detail),
    )
    _raise_for(code, detail, {"num_nodes": num_nodes, "lengths": lengths32})
    return packed, offsets, lengths_out


def enqueue_skipped_while_building() -> bool:
    """What the TensorRT plugins' enqueue() decides (plugins/include/dflash/enqueue_guard.h):
    True while TensorRT builds (``IS_BUILDING=1``), when they must not touch memory."""
    return bool(load_library().dflash_enqueue_skipped_while_building())


# ------------------------------------------------------------------------ compaction


def compact_contiguous_cpu(
    layer_caches: Sequence[np.ndarray],
    past_lengths: Sequence[int] | np.ndarray,
    accepted_nodes: Sequence[Sequence[int]],
    *,
    implementation: str = "cpu",
) -> None:
    """DFlashKVCompact on linear caches, in place.

    ``layer_caches[l]`` is layer l's cache ``[batch, 2 (K, V), kv_heads, max_seq,
    head_dim]`` (TensorRT-LLM's KVLinearBuffer layout), C-contiguous, writable, any
    dtype. For each sequence b, slot ``past_lengths[b] + i`` receives slot
    ``past_lengths[b] + accepted_nodes[b][i]``.
    """
    lib = load_library()
    _check_implementation(implementation)
    if len(layer_caches) == 0:
        raise DFlashInputError("layer_caches is empty: at least one layer is needed")
    first = layer_caches[0]
    if first.ndim != 5 or first.shape[1] != 2:
        raise DFlashInputError(
            f"layer_caches[0] must be [batch, 2, kv_heads, max_seq, head_dim], got shape {first.shape}"
        )
    for layer, cache in enumerate(layer_caches):
        if cache.shape != first.shape or cache.dtype != first.dtype:
            raise DFlashInputError(
                f"layer_caches[{layer}] has shape {cache.shape} / dtype {cache.dtype}, "
                f"expected {first.shape} / {first.dtype} like layer 0"
            )
        if not cache.flags.c_contiguous or not cache.flags.writeable:
            raise DFlashInputError(f"layer_caches[{layer}] must be C-contiguous and writable")
    batch, _, heads, max_seq, head_dim = first.shape
    past = _as_int32("past_lengths", past_lengths, 1)
    if past.shape[0] != batch:
        raise DFlashInputError(f"past_lengths has {past.shape[0]} entries for a batch of {batch}")
    padded, counts, max_accepted = _pad_accepted(accepted_nodes, batch)
    pointers = (ctypes.c_void_p * len(layer_caches))(*[c.ctypes.data for c in layer_caches])
    head_bytes = head_dim * first.itemsize
    detail = _ErrorDetail()
    if implementation == "gpu-emulation":
        code = lib.dflash_emulate_kv_compact_linear_kernel(
            pointers, len(layer_caches), batch, heads, max_seq, head_bytes,
            _ptr(past), _ptr(padded), max_accepted, _ptr(counts),
        )
    else:
        code = lib.dflash_kv_compact_linear_cpu(
            pointers, len(layer_caches), batch, heads, max_seq, head_bytes,
            _ptr(past), _ptr(padded), max_accepted, _ptr(counts), ctypes.byref(detail),
        )
    geometry = f"layers={len(layer_caches)}, heads={heads}, max_seq={max_seq}, head_bytes={head_bytes}"
    _raise_for(
        code, detail,
        {"max_accepted": max_accepted, "capacity": max_seq, "geometry": geometry},
    )


def compact_paged_cpu(
    pools: Sequence[np.ndarray],
    pool_mapping: np.ndarray | Sequence[Sequence[int]],
    block_offsets: np.ndarray,
    tokens_per_block: int,
    num_kv_heads: int,
    head_dim: int,
    past_lengths: Sequence[int] | np.ndarray,
    accepted_nodes: Sequence[Sequence[int]],
    secondary_pools: Sequence[np.ndarray | None] | None = None,
    *,
    implementation: str = "cpu",
) -> None:
    """DFlashKVCompact on TensorRT-LLM's paged KV cache, in place.

    ``pools[p]`` is pool p's primary memory (any shape, C-contiguous, writable; its
    dtype is the cache dtype). ``pool_mapping`` int32 ``[num_layers, 2]`` gives each
    layer's (pool index, layer index inside the pool) and ``block_offsets`` int32
    ``[num_pools, batch, 2, max_blocks_per_seq]`` the KVCacheIndex of every logical
    block, exactly as the gpt attention plugin receives them
    (``host_kv_cache_pool_mapping``, ``kv_cache_block_offsets``). A block of one
    layer holds ``[num_kv_heads, tokens_per_block, head_dim]`` elements.
    """
    lib = load_library()
    _check_implementation(implementation)
    if len(pools) == 0:
        raise DFlashInputError("pools is empty: at least one pool is needed")
    dtype = pools[0].dtype
    for index, pool in enumerate(pools):
        if pool.dtype != dtype or not pool.flags.c_contiguous or not pool.flags.writeable:
            raise DFlashInputError(
                f"pools[{index}] must be C-contiguous, writable and of dtype {dtype}"
            )
    secondary = list(secondary_pools) if secondary_pools is not None else [None] * len(pools)
    if len(secondary) != len(pools):
        raise DFlashInputError(
            f"secondary_pools has {len(secondary)} entries for {len(pools)} pools"
        )
    mapping = _as_int32("pool_mapping", pool_mapping, 2)
    if mapping.shape[1] != 2:
        raise DFlashInputError(f"pool_mapping must be [num_layers, 2], got shape {mapping.shape}")
    offsets = _as_int32("block_offsets", block_offsets, 4)
    if offsets.shape[0] != len(pools) or offsets.shape[2] != 2:
        raise DFlashInputError(
            f"block_offsets must be [num_pools={len(pools)}, batch, 2, max_blocks_per_seq], "
            f"got shape {offsets.shape}"
        )
    _, batch, _, max_blocks = offsets.shape
    past = _as_int32("past_lengths", past_lengths, 1)
    if past.shape[0] != batch:
        raise DFlashInputError(f"past_lengths has {past.shape[0]} entries for a batch of {batch}")
    padded, counts, max_accepted = _pad_accepted(accepted_nodes, batch)

    head_bytes = int(head_dim) * dtype.itemsize
    bytes_per_block = int(tokens_per_block) * int(num_kv_heads) * head_bytes
    pointers = (ctypes.c_void_p * (2 * len(pools)))()
    capacities = np.zeros((len(pools), 2), dtype=np.int64)
    for index, (primary, second) in enumerate(zip(pools, secondary)):
        pointers[2 * index] = primary.ctypes.data
        capacities[index, 0] = primary.nbytes // max(bytes_per_block, 1)
        if second is not None:
            if second.dtype != dtype or not second.flags.c_contiguous or not second.flags.writeable:
                raise DFlashInputError(
                    f"secondary_pools[{index}] must be C-contiguous, writable and of dtype {dtype}"
                )
            pointers[2 * index + 1] = second.ctypes.data
            capacities[index, 1] = second.nbytes // max(bytes_per_block, 1)
    detail = _ErrorDetail()
    if implementation == "gpu-emulation":
        code = lib.dflash_emulate_kv_compact_paged_kernel(
            pointers, len(pools), _ptr(mapping), mapping.shape[0],
            _ptr(offsets), batch, max_blocks, int(tokens_per_block), int(num_kv_heads), head_bytes,
            _ptr(past), _ptr(padded), max_accepted, _ptr(counts),
        )
    else:
        code = lib.dflash_kv_compact_paged_cpu(
            pointers, _ptr(capacities, ctypes.c_int64), len(pools), _ptr(mapping), mapping.shape[0],
            _ptr(offsets), batch, max_blocks, int(tokens_per_block), int(num_kv_heads), head_bytes,
            _ptr(past), _ptr(padded), max_accepted, _ptr(counts), ctypes.byref(detail),
        )
    geometry = (
        f"pools={len(pools)}, layers={mapping.shape[0]}, max_blocks_per_seq={max_blocks}, "
        f"kv_heads={num_kv_heads}, head_bytes={head_bytes}"
    )
    _raise_for(
        code, detail,
        {
            "max_accepted": max_accepted,
            "capacity": max_blocks * int(tokens_per_block),
            "geometry": geometry,
        },
    )


# ------------------------------------------------------------------- torch runtime


def _check_tail(past_len: int, accepted: list[int], seq_len: int) -> None:
    """The compact_tail_ contract, checked identically for both backends."""
    if past_len < 0:
        raise DFlashInputError(f"past_len={past_len} must not be negative")
    if not accepted:
        return
    if accepted[0] != 0:
        raise DFlashInputError(
            f"accepted_nodes[0]={accepted[0]}: the first accepted node must be the root 0"
        )
    for i in range(1, len(accepted)):
        if accepted[i] <= accepted[i - 1]:
            raise DFlashInputError(
                f"accepted_nodes[{i}]={accepted[i]}: accepted nodes must be strictly increasing"
            )
    if past_len + accepted[-1] >= seq_len:
        raise DFlashInputError(
            f"accepted_nodes[{len(accepted) - 1}]: its KV slot past_len + node = "
            f"{past_len + accepted[-1]} is beyond the cache length {seq_len}"
        )


def compact_tail_(tensor: torch.Tensor, past_len: int, accepted_nodes: Sequence[int]) -> None:
    """In place on an HF cache tensor ``[batch, heads, seq, head_dim]`` (seq is dim -2):
    slot ``past_len + accepted_nodes[i]`` moves to ``past_len + i``. The caller crops.

    Uses the CPU library for contiguous CPU tensors when it is built, torch otherwise;
    :func:`compaction_backend` tells which.
    """
    accepted = [int(node) for node in accepted_nodes]
    if tensor.dim() < 2:
        raise DFlashInputError(f"tensor must have a sequence dimension (dim -2), got shape {tuple(tensor.shape)}")
    seq_len = int(tensor.shape[-2])
    _check_tail(int(past_len), accepted, seq_len)
    if not accepted or tensor.numel() == 0:
        return
    if compaction_backend(tensor) == "cpu-library":
        lib = load_library()
        nodes = np.asarray(accepted, dtype=np.int32)
        outer = tensor.numel() // (seq_len * int(tensor.shape[-1]))
        inner_bytes = int(tensor.shape[-1]) * tensor.element_size()
        detail = _ErrorDetail()
        code = lib.dflash_compact_tail_cpu(
            ctypes.c_void_p(tensor.data_ptr()), outer, seq_len, inner_bytes, int(past_len),
            _ptr(nodes), len(accepted), ctypes.byref(detail),
        )
        _raise_for(
            code, detail,
            {"batched": False, "past_field": "past_len", "capacity": seq_len,
             "max_accepted": len(accepted), "geometry": f"shape={tuple(tensor.shape)}"},
        )
        return
    compact_tail_torch_(tensor, int(past_len), accepted)


def compact_tail_torch_(tensor: torch.Tensor, past_len: int, accepted_nodes: Sequence[int]) -> None:
    """The pure-torch fallback of :func:`compact_tail_` (index_select + copy)."""
    import torch

    accepted = [int(node) for node in accepted_nodes]
    _check_tail(past_len, accepted, int(tensor.shape[-2]))
    if not accepted:
        return
    source = torch.as_tensor(accepted, dtype=torch.long, device=tensor.device) + past_len
    dim = tensor.dim() - 2
    # index_select copies first, so overlapping source/destination slots are fine.
    tensor.narrow(dim, past_len, len(accepted)).copy_(tensor.index_select(dim, source))
