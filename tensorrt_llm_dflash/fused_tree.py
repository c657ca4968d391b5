"""Fused tree kernels: the DDTree build, path values, walk, lookup and graft as one call (one CUDA launch) each.

:func:`device_tree.build_ddtree_device` builds the best-first tree from fixed-shape tensor ops, a
depth loop of sorts and gathers: 397 ops for the cost-aware tree's 63-node pool over 15 drafted
depths, one kernel launch each on a GPU, where even inside a CUDA graph each costs a few
microseconds (the H200's tree-build stage took 1.4 ms a step). The plugin library runs the same
search as one best-first heap per row (``plugins/include/dflash/ddtree_core.h``): the CUDA
library (``libdflash_plugins_cuda.so``) as one kernel, one thread per row, and the CPU library
(``libdflash_plugins_cpu.so``) as the same body row after row. Both produce exactly
:class:`~tensorrt_llm_dflash.device_tree.DeviceTree`'s layout, node for node and bit for bit as the
tensor ops and ``tree.build_ddtree`` do (``tests/test_fused_tree.py``). The cost-aware tree's path
values get the same treatment (:func:`path_sums`: one pass per row for ``device_policy.path_values``'s
depth-by-depth rounds, ~60 ops), and so does the verifier's walk (:func:`walk`: ``device_tree.walk_device``'s
result from one scan per row instead of pointer doubling, ~45 ops), and the prompt-lookup branches and their
grafting (:func:`lookup`, :func:`graft`: ``device_lookup``'s results, ~90 and ~80 ops), the cost-aware tree's
choice of its best nodes (:func:`select`: ``DevicePolicy.select``'s, ~30 ops) and the verifier's
ancestor-or-self mask (:func:`visibility`: ``device_tree.visibility_device``'s, ~17 ops), and the update of
its learned tables after the verify (:func:`learn`: ``DevicePolicy.learn``'s, ~40 ops).

Which build runs is :data:`FUSED_TREE_ENV` (``DFLASH_FUSED_TREE``):

* ``auto`` (the default): the CPU library on CPU tensors when it is built; the tensor ops on CUDA
  (the kernel is opt-in there until a GPU run has measured it: ``examples/gpu_check.py`` compares
  and times both);
* ``on``: the library for the tensors' device, and a clear error when it is not built;
* ``off``: the tensor ops everywhere.

Budgets above :data:`MAX_BUDGET` (255 draft nodes) always take the tensor ops. Build the libraries
with ``cmake -S plugins -B plugins/build && cmake --build plugins/build`` (the CUDA one needs nvcc),
or point ``$DFLASH_PLUGIN_LIB`` at the folder holding them.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

from . import kernels
from .errors import DFlashInputError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .device_tree import DeviceTree

FUSED_TREE_ENV = "DFLASH_FUSED_TREE"
MODES = ("auto", "on", "off")
CUDA_LIBRARY_NAME = "libdflash_plugins_cuda.so"
#: Must equal dflash::kMaxDDTreeBudget (plugins/include/dflash/ddtree_core.h); the tests check it.
MAX_BUDGET = 255

_cuda_library: ctypes.CDLL | None = None
_cuda_searched = False


def mode() -> str:
    """``DFLASH_FUSED_TREE``, checked: one of :data:`MODES` (``1``/``0`` count as on/off)."""
    raw = os.environ.get(FUSED_TREE_ENV, "auto").strip().lower()
    value = {"1": "on", "0": "off", "": "auto"}.get(raw, raw)
    if value not in MODES:
        raise DFlashInputError(f"{FUSED_TREE_ENV}={raw!r} is not one of {', '.join(MODES)} (or 1, 0)")
    return value


def load_cuda_library() -> ctypes.CDLL | None:
    """The CUDA plugin library (looked up as the CPU one is: ``$DFLASH_PLUGIN_LIB``, then ``plugins/build``), or
    None when it is not built. A library built from older sources (one of ``kernels.FUSED_KERNEL_ARGS`` missing) counts as
    not built."""
    global _cuda_library, _cuda_searched
    if _cuda_library is not None or _cuda_searched:
        return _cuda_library
    _cuda_searched = True
    for candidate in kernels.library_candidates(name=CUDA_LIBRARY_NAME):
        if not candidate.is_file():
            continue
        try:
            lib = ctypes.CDLL(str(candidate))
        except OSError:  # no CUDA runtime on this machine
            continue
        functions = {name: getattr(lib, f"dflash_{name}_cuda", None) for name in kernels.FUSED_KERNEL_ARGS}
        if any(fn is None for fn in functions.values()):
            continue
        for name, fn in functions.items():
            fn.restype = ctypes.c_int32
            fn.argtypes = [*kernels.FUSED_KERNEL_ARGS[name], ctypes.c_void_p, ctypes.POINTER(kernels._ErrorDetail)]
        _cuda_library = lib
        break
    return _cuda_library


def backend(device: torch.device) -> str | None:
    """``"cpu-library"`` or ``"cuda-library"`` where the fused build runs on ``device`` under the current mode, None
    where the tensor ops run. ``on`` with no library for the device raises a DFlashInputError."""
    chosen = mode()
    if chosen == "off":
        return None
    if device.type == "cpu":
        if kernels.library_loaded():
            return "cpu-library"
        missing = kernels.LIBRARY_NAME
    elif device.type == "cuda":
        if chosen == "auto":  # opt-in on a GPU until measured there
            return None
        if load_cuda_library() is not None:
            return "cuda-library"
        missing = CUDA_LIBRARY_NAME
    else:
        missing = f"a plugin library for {device.type}"
    if chosen == "on":
        raise DFlashInputError(
            f"{FUSED_TREE_ENV}=on but {missing} is not built: cmake -S plugins -B plugins/build && cmake --build "
            f"plugins/build (or point ${kernels.LIBRARY_ENV_VAR} at its folder), or set {FUSED_TREE_ENV}=auto")
    return None


def ddtree_scratch_row_bytes(budget: int) -> int:
    """dflash::ddtreeScratchRowBytes: a row's heap (budget + 2 entries of 16 bytes) and ranks (budget + 1 int16),
    rounded up to 16 bytes (the tests hold it equal to the library's ``dflash_ddtree_scratch_bytes``)."""
    size = (int(budget) + 2) * 16 + (int(budget) + 1) * 2
    return (size + 15) // 16 * 16


def _where(device: torch.device, where: str | None, what: str) -> str:
    """The library to run ``what`` with: ``where`` if given, else ``backend``'s answer; an error where none runs."""
    where = backend(device) if where is None else where
    if where is None:
        raise DFlashInputError(f"the fused {what} does not run on {device} here ({FUSED_TREE_ENV}={mode()})")
    return where


def _call(where: str, name: str, device: torch.device, *args: object) -> None:
    """Call ``dflash_<name>_cpu``, or ``dflash_<name>_cuda`` on the current stream, and raise on a refused call."""
    import torch

    detail = kernels._ErrorDetail()
    if where == "cuda-library":
        stream = torch.cuda.current_stream(device).cuda_stream
        code = getattr(load_cuda_library(), f"dflash_{name}_cuda")(*args, stream, ctypes.byref(detail))
    else:
        code = getattr(kernels.load_library(), f"dflash_{name}_cpu")(*args, ctypes.byref(detail))
    kernels._raise_for(code, detail, {"max_budget": MAX_BUDGET})


def build_ddtree_fused(root: torch.Tensor, topk_logprobs: torch.Tensor, topk_tokens: torch.Tensor, budget: int,
                       max_depth: torch.Tensor | None = None, *, where: str | None = None) -> DeviceTree:
    """``device_tree.build_ddtree_device``'s tree from the plugin library (same arguments, same result, bit for
    bit). ``where``: the library (``backend``'s answer; default: ask it). On CUDA one asynchronous kernel on the
    current stream, which a CUDA graph captures like any other."""
    import torch

    from .device_tree import DeviceTree

    where = _where(root.device, where, "DDTree build")
    budget = int(budget)
    batch, depth, k = (int(x) for x in topk_logprobs.shape)
    device = root.device
    # The library reads float64 log-probabilities (the tensor ops sum in float64 too: the same additions).
    logprobs = topk_logprobs.to(torch.float64).contiguous()
    tokens_in = topk_tokens.to(torch.long).contiguous()
    roots = root.to(torch.long).contiguous()
    depth_limit = None if max_depth is None else max_depth.to(torch.long).contiguous()
    size = budget + 1
    tokens = torch.empty(batch, size, dtype=torch.long, device=device)
    parents = torch.empty_like(tokens)
    depths = torch.empty_like(tokens)
    valid = torch.empty(batch, size, dtype=torch.bool, device=device)
    num_nodes = torch.empty(batch, dtype=torch.long, device=device)
    scores = torch.empty(batch, size, dtype=torch.float64, device=device)
    pointers = [t.data_ptr() if t is not None and t.numel() else None
                for t in (logprobs, tokens_in, roots, depth_limit)]
    # Each row's heap: caller memory, not a per-thread array (ddtree_core.h, ddtreeScratchRowBytes).
    scratch = torch.empty(max(batch, 1) * ddtree_scratch_row_bytes(budget) // 8, dtype=torch.float64, device=device)
    outputs = [t.data_ptr() for t in (tokens, parents, depths, valid, num_nodes, scores, scratch)]
    _call(where, "ddtree_build", device, *pointers, batch, depth, k, budget, *outputs)
    return DeviceTree(tokens=tokens, parents=parents, depths=depths, valid=valid, num_nodes=num_nodes, scores=scores)


def path_sums(values: torch.Tensor, parents: torch.Tensor, *, where: str | None = None) -> torch.Tensor:
    """Per row of trees in parent-first order (every parent's column before its child's): ``out[i] = values[i]``
    at a root (parent < 0), ``values[i] + out[parent[i]]`` elsewhere, in float64: ``device_policy.path_values``'s
    sums of log-conditionals, one pass instead of one round per depth (the same additions, so the same bits).
    ``where``: the library (``backend``'s answer; default: ask it)."""
    import torch

    where = _where(values.device, where, "path sums")
    batch, n = (int(x) for x in values.shape)
    values = values.to(torch.float64).contiguous()
    parents = parents.to(torch.long).contiguous()
    out = torch.empty_like(values)
    _call(where, "path_sums", values.device, values.data_ptr(), parents.data_ptr(), batch, n, out.data_ptr())
    return out


def walk(tree: DeviceTree, choices: torch.Tensor, max_path: int, *,
         where: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``device_tree.walk_device``'s ``(path, length, bonus)`` from one scan per row: from the root, into the first
    valid child (lowest column) holding the target's choice, at most ``max_path`` nodes. ``where``: the library
    (``backend``'s answer; default: ask it)."""
    import torch

    where = _where(tree.tokens.device, where, "walk")
    batch, n = (int(x) for x in tree.tokens.shape)
    device = tree.tokens.device
    inputs = [t.contiguous() for t in (tree.tokens.to(torch.long), tree.parents.to(torch.long),
                                        tree.valid.to(torch.bool), choices.to(torch.long))]
    path = torch.empty(batch, int(max_path), dtype=torch.long, device=device)
    length = torch.empty(batch, dtype=torch.long, device=device)
    bonus = torch.empty(batch, dtype=torch.long, device=device)
    _call(where, "walk", device, *(t.data_ptr() for t in inputs), batch, n, int(max_path),
          *(t.data_ptr() for t in (path, length, bonus)))
    return path, length, bonus


def lookup(history: torch.Tensor, length: torch.Tensor, max_tokens: int, limit: torch.Tensor | None = None,
           max_ngram: int = 4, min_ngram: int = 1, max_branches: int = 2, *, where: str | None = None):
    """``device_lookup.lookup_device``'s branches from one scan per row (same arguments, the same
    ``DeviceBranches``; ``max_tokens`` and ``max_branches`` at least 1, ``max_ngram >= max(min_ngram, 1)``)."""
    import torch

    from .device_lookup import DeviceBranches

    where = _where(history.device, where, "lookup")
    batch, capacity = (int(x) for x in history.shape)
    device = history.device
    history = history.to(torch.long)
    if history.stride(1) != 1:
        history = history.contiguous()
    lengths = length.to(torch.long).contiguous()
    limits = None if limit is None else limit.to(torch.long).contiguous()
    width, branches = int(max_tokens), int(max_branches)
    tokens = torch.empty(batch, branches, width, dtype=torch.long, device=device)
    branch_lengths = torch.empty(batch, branches, dtype=torch.long, device=device)
    ngram = torch.empty(batch, dtype=torch.long, device=device)
    _call(where, "lookup", device, history.data_ptr(), history.stride(0), capacity, lengths.data_ptr(),
          None if limits is None else limits.data_ptr(), batch, width, int(max_ngram), max(int(min_ngram), 1),
          branches, tokens.data_ptr(), branch_lengths.data_ptr(), ngram.data_ptr())
    return DeviceBranches(tokens=tokens, lengths=branch_lengths, ngram=ngram)


def _grafted_outputs(batch: int, size: int, device: torch.device) -> list[torch.Tensor]:
    """Empty outputs of a ``Grafted`` of ``size`` columns: tokens, parents, depths, valid, num_nodes, scores, cond,
    on_branch (the graft's and the select's kernels fill them)."""
    import torch

    tokens = torch.empty(batch, size, dtype=torch.long, device=device)
    valid = torch.empty(batch, size, dtype=torch.bool, device=device)
    scores = torch.empty(batch, size, dtype=torch.float64, device=device)
    return [tokens, torch.empty_like(tokens), torch.empty_like(tokens), valid,
            torch.empty(batch, dtype=torch.long, device=device), scores, torch.empty_like(scores),
            torch.empty_like(valid)]


def graft(pool: DeviceTree, pool_cond: torch.Tensor, branches, branch_cond: torch.Tensor, *,
          where: str | None = None):
    """``device_lookup.graft_device``'s ``Grafted`` from one pass per row (same arguments and result; ``pool_cond``
    float64, the pool's siblings never repeating a token, as a DDTree's do)."""
    import torch

    from .device_lookup import Grafted
    from .device_tree import DeviceTree

    where = _where(pool.tokens.device, where, "graft")
    batch, pool_size = (int(x) for x in pool.tokens.shape)
    count, width = (int(x) for x in branches.tokens.shape[1:])
    device = pool.tokens.device
    size = pool_size + count * width
    inputs = [pool.tokens.to(torch.long), pool.parents.to(torch.long), pool.depths.to(torch.long),
              pool.valid.to(torch.bool), pool.num_nodes.to(torch.long), pool.scores.to(torch.float64),
              pool_cond.to(torch.float64)]
    inputs = [t.contiguous() for t in inputs]
    want = branches.tokens.to(torch.long).contiguous()
    cond_in = branch_cond.to(torch.float64).contiguous()
    tokens, parents, depths, valid, num_nodes, scores, cond, on_branch = _grafted_outputs(batch, size, device)
    scratch = torch.empty(batch, width, dtype=torch.long, device=device)
    _call(where, "graft", device, *(t.data_ptr() for t in inputs), batch, pool_size, want.data_ptr(),
          cond_in.data_ptr(), count, width,
          *(t.data_ptr() for t in (tokens, parents, depths, valid, num_nodes, scores, cond, on_branch, scratch)))
    tree = DeviceTree(tokens=tokens, parents=parents, depths=depths, valid=valid, num_nodes=num_nodes, scores=scores)
    return Grafted(tree=tree, cond=cond, on_branch=on_branch)



def select(candidates, values: torch.Tensor, size: int, *, where: str | None = None):
    """``device_policy.DevicePolicy.select``'s ``Grafted``: the ``size`` best candidates by value (a stable sort's
    order: ties by column), renumbered in parent-first order, from three passes per row (same arguments, same result
    bit for bit; ``1 <= size <=`` the candidates' columns)."""
    import torch

    from .device_lookup import Grafted
    from .device_tree import DeviceTree

    tree = candidates.tree
    where = _where(tree.tokens.device, where, "select")
    batch, n = (int(x) for x in tree.tokens.shape)
    size = int(size)
    device = tree.tokens.device
    inputs = [values.to(torch.float64), tree.tokens.to(torch.long), tree.parents.to(torch.long),
              tree.depths.to(torch.long), tree.valid.to(torch.bool), tree.scores.to(torch.float64),
              candidates.cond.to(torch.float64), candidates.on_branch.to(torch.bool)]
    inputs = [t.contiguous() for t in inputs]
    tokens, parents, depths, valid, num_nodes, scores, cond, on_branch = _grafted_outputs(batch, size, device)
    scratch = torch.empty(batch, 2 * n, dtype=torch.long, device=device)  # each node's rank, then its new column
    _call(where, "select", device, *(t.data_ptr() for t in inputs), batch, n, size,
          *(t.data_ptr() for t in (tokens, parents, depths, valid, num_nodes, scores, cond, on_branch, scratch)))
    chosen = DeviceTree(tokens=tokens, parents=parents, depths=depths, valid=valid, num_nodes=num_nodes, scores=scores)
    return Grafted(tree=chosen, cond=cond, on_branch=on_branch)


def visibility(tree: DeviceTree, max_hops: int, *, where: str | None = None) -> torch.Tensor:
    """``device_tree.visibility_device``'s bool mask [B, N, N] from one pass per node: itself, and for a valid
    node the first ``max_hops`` nodes up its root path (``visibility_device`` passes ``2**rounds - 1``, what its
    pointer doubling covers)."""
    import torch

    where = _where(tree.parents.device, where, "visibility")
    batch, n = (int(x) for x in tree.parents.shape)
    parents = tree.parents.to(torch.long).contiguous()
    valid = tree.valid.to(torch.bool).contiguous()
    out = torch.empty(batch, n, n, dtype=torch.bool, device=parents.device)
    _call(where, "visibility", parents.device, parents.data_ptr(), valid.data_ptr(), batch, n, int(max_hops),
          out.data_ptr())
    return out


def learn(policy, verified, choices: torch.Tensor, cells: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
          ngram: torch.Tensor | None = None, live: torch.Tensor | None = None, *, where: str | None = None) -> None:
    """``DevicePolicy.learn``'s update of ``policy``'s tables, in place, from one pass (one thread on CUDA: every row
    updates the same tables), bit for bit: ``cells`` are the drafter table's (rows, bins, drafted) per node, which
    the tensor ops compute (``DevicePolicy._draft_bins``: the marginal's bin needs an exp). The same arguments
    otherwise."""
    import torch

    tree = verified.tree
    device = tree.tokens.device
    where = _where(device, where, "learning step")
    batch, n = (int(x) for x in tree.tokens.shape)
    rows, bins, drafted = cells
    inputs = [tree.tokens.to(torch.long), tree.parents.to(torch.long), tree.depths.to(torch.long),
              tree.valid.to(torch.bool), verified.on_branch.to(torch.bool), choices.to(torch.long),
              rows.to(torch.long), bins.to(torch.long), drafted.to(torch.bool)]
    inputs = [t.contiguous() for t in inputs]
    live_in = None if live is None else live.to(torch.bool).contiguous()
    ngram_in = None if ngram is None else ngram.to(torch.long).contiguous()
    tables = [policy.hits, policy.trials, policy.prior, policy.table]
    lookup_tables = [policy.lookup_hits, policy.lookup_trials, policy.lookup_prior, policy.lookup_table]
    for table in (*tables, *lookup_tables, policy.lookup_edges):  # updated in place: the policy's own storage
        if not table.is_contiguous() or table.dtype != torch.float64:
            raise DFlashInputError(f"the fused learning step needs contiguous float64 tables, got {table.dtype}")
    _call(where, "learn", device, *(t.data_ptr() for t in inputs),
          None if live_in is None else live_in.data_ptr(), None if ngram_in is None else ngram_in.data_ptr(),
          batch, n, *(t.data_ptr() for t in tables), *policy.hits.shape,
          *(t.data_ptr() for t in lookup_tables), *policy.lookup_hits.shape, policy.lookup_edges.data_ptr(),
          float(policy.decay), float(policy.strength))
