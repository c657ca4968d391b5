"""AllReduce / AllGather plugins across emulated ranks: one process per rank, torch.distributed (gloo).

The custom all-reduce reads its IPC workspace: every pointer of the bound
``all_reduce_workspace`` tensor must be live device memory of this rank, as the kernel
dereferences them (an unbound or stale workspace is an illegal address on a GPU)."""

from __future__ import annotations

import atexit
import os

import torch
import torch.distributed as dist

from .core import EmulationError, device_memory


def _world() -> int:
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def _ensure_group(group: list[int]) -> None:
    if dist.is_initialized():
        return
    world = _world()
    if world != len(group):
        raise EmulationError(f"collective over ranks {group} in a world of {world} processes")
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # Leave the group before the interpreter tears its threads down (else gloo aborts at exit).
    atexit.register(dist.destroy_process_group)


def _check_workspace(workspace: torch.Tensor | None, tp: int) -> None:
    if workspace is None:
        return
    expected = 7 * tp + 3
    if workspace.numel() != expected:
        raise EmulationError(f"all_reduce_workspace has {workspace.numel()} entries, expected {expected}")
    for address in workspace.reshape(-1).tolist():
        device_memory.find(int(address), 8)


def all_reduce(x: torch.Tensor, group: list[int], workspace: torch.Tensor | None) -> torch.Tensor:
    if len(group) == 1:
        return x
    _check_workspace(workspace, len(group))
    _ensure_group(group)
    # The plugin sums in the model dtype; gloo has no bf16/fp16 sum: float32 then back.
    out = x.to(torch.float32) if x.dtype in (torch.bfloat16, torch.float16) else x.clone()
    dist.all_reduce(out)
    return out.to(x.dtype)


def all_gather(x: torch.Tensor, group: list[int], gather_dim: int) -> torch.Tensor:
    if len(group) == 1:
        return x
    _ensure_group(group)
    parts = [torch.empty_like(x) for _ in group]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=gather_dim)
