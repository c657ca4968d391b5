"""Numerics and memory of the emulated device."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from dataclasses import dataclass

import torch

NUMERICS_ENV = "TRTLLM_STANDIN_NUMERICS"
NUMERICS_MODES = ("faithful", "exact")

#: Declared (TensorRT) dtype name -> torch dtype, as tensorrt_llm._utils.trt_dtype_to_torch maps them.
DECLARED_TORCH = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int8": torch.int8, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
    "fp8": torch.float8_e4m3fn, "uint8": torch.uint8,
}
FLOATING = ("float32", "float16", "bfloat16", "fp8")


class EmulationError(RuntimeError):
    """Something TensorRT or the GPU would refuse (a build error, a failed enqueue)."""


class EmulatedMemoryFault(EmulationError):
    """A kernel dereferenced an address outside every live allocation (an illegal address on a GPU)."""


class DataDependentShape(EmulationError):
    """A shape tensor was computed from execution data: TensorRT cannot build that."""


def numerics_mode() -> str:
    mode = os.environ.get(NUMERICS_ENV, "faithful")
    if mode not in NUMERICS_MODES:
        raise EmulationError(f"${NUMERICS_ENV}={mode!r} is not one of {NUMERICS_MODES}")
    return mode


def set_numerics(mode: str) -> None:
    if mode not in NUMERICS_MODES:
        raise EmulationError(f"numerics mode {mode!r} is not one of {NUMERICS_MODES}")
    os.environ[NUMERICS_ENV] = mode


def physical_dtype(declared: str) -> torch.dtype:
    """The torch dtype that holds a tensor declared as ``declared`` on this emulated device."""
    if declared in FLOATING and numerics_mode() == "exact":
        return torch.float64
    return DECLARED_TORCH[declared]


def compute_dtype(declared: str) -> torch.dtype:
    """Arithmetic precision for a floating op whose output is ``declared`` (TensorRT accumulates
    half types in float32)."""
    return torch.float64 if numerics_mode() == "exact" else torch.float32


# ------------------------------------------------------------------------------ memory


@dataclass
class _Allocation:
    start: int
    nbytes: int
    ref: weakref.ref


class DeviceMemory:
    """Live allocations by address. Everything an engine dereferences must be in here:
    tensors bound to an execution context are registered when they are bound; a buffer
    the runtime allocated and passes by address only (a paged KV pool) is adopted on first
    access if a live tensor owns it, as any ``cudaMalloc`` allocation is addressable."""

    def __init__(self) -> None:
        self._allocations: dict[int, _Allocation] = {}
        self._lock = threading.Lock()

    def register(self, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            self._allocations[start] = _Allocation(start, nbytes, weakref.ref(tensor))
        return tensor.data_ptr()

    def _live(self) -> list[_Allocation]:
        with self._lock:
            dead = [k for k, a in self._allocations.items() if a.ref() is None]
            for k in dead:
                del self._allocations[k]
            return list(self._allocations.values())

    def find(self, address: int, nbytes: int) -> torch.Tensor:
        """The live tensor whose storage holds ``[address, address + nbytes)``."""
        for attempt in range(2):
            for alloc in self._live():
                if alloc.start <= address and address + nbytes <= alloc.start + alloc.nbytes:
                    tensor = alloc.ref()
                    if tensor is not None:
                        return tensor
            if attempt == 0 and not self._adopt(address, nbytes):
                break
        raise EmulatedMemoryFault(
            f"illegal memory access: [{address:#x}, +{nbytes}) is not inside any live allocation"
        )

    def _adopt(self, address: int, nbytes: int) -> bool:
        """A buffer allocated without going through a binding (a paged KV pool the runtime
        allocated itself, as it would with cudaMalloc): any live torch tensor owns memory
        the device can address. Found once by a scan, then registered."""
        for obj in gc.get_objects():
            # type(): no __getattr__ proxies; plain tensors and parameters only (a FakeTensor
            # left behind by torch.compile elsewhere in the process has no memory to address)
            if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.is_meta:
                continue
            try:
                storage = obj.untyped_storage()
                start = storage.data_ptr()
            except RuntimeError:  # no addressable storage (sparse, a wrapper subclass)
                continue
            if start <= address and address + nbytes <= start + storage.nbytes():
                self.register(obj)
                return True
        return False

    def view(self, address: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape``/``dtype`` over the memory at ``address`` (no copy)."""
        numel = 1
        for d in shape:
            numel *= int(d)
        itemsize = torch.empty((), dtype=dtype).element_size()
        owner = self.find(address, numel * itemsize)
        storage = owner.untyped_storage()
        offset = address - storage.data_ptr()
        if offset % itemsize:
            raise EmulatedMemoryFault(f"misaligned access: {address:#x} for a {dtype} tensor")
        flat = torch.empty(0, dtype=dtype, device=owner.device)
        flat.set_(storage, offset // itemsize, (numel,), (1,))
        return flat.view(*shape) if shape else flat.view(())


device_memory = DeviceMemory()


def emulated_device_count() -> int:
    """GPUs the emulated node has (``torch.cuda.device_count()`` where the real one asks CUDA)."""
    return int(os.environ.get("TRTLLM_STANDIN_GPUS", "8"))
