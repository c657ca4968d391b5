"""A guard that fails on anything that makes the host wait for the device, for CPU tests of GPU code.

A CUDA graph cannot contain a host read, and outside a graph every host read of a device value
stalls the CPU until the GPU has caught up (the per-step stall that makes trees lose to chains
under CUDA graphs elsewhere). On the CPU those reads cost nothing and go unnoticed, so tests run
decode steps under :class:`NoHostSync`, which raises :class:`HostSyncError` on:

* ``aten._local_scalar_dense``: ``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``, ``if t:``;
* ops whose output shape depends on the data (the shape must be read back): ``nonzero``,
  ``masked_select``, ``unique`` and friends, ``repeat_interleave`` with tensor repeats,
  ``bincount``, and indexing with a boolean mask (``aten.index`` with a bool index);
* ops that return a Python value computed from the data: ``equal``, ``is_nonzero``, ``allclose``;
* device-to-host copies: ``aten._to_copy`` / ``copy_`` from a non-CPU tensor to the CPU, and the
  tensor methods that read data into Python or numpy without dispatching (``tolist``, ``numpy``,
  ``cpu``, ``__array__``), which it wraps while active.

The one copy a step is allowed (its tokens, for streaming and stop checks) is made inside
``guard.allow("what")``, which names it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: Overload packets that read device data on the host or give a data-dependent shape.
FORBIDDEN = {
    aten._local_scalar_dense: "reads a device value on the host (.item(), int(), float(), bool(), if)",
    aten.nonzero: "has a data-dependent output shape (nonzero)",
    aten.masked_select: "has a data-dependent output shape (masked_select)",
    aten.unique_consecutive: "has a data-dependent output shape (unique_consecutive)",
    aten._unique: "has a data-dependent output shape (unique)",
    aten._unique2: "has a data-dependent output shape (unique)",
    aten.unique_dim: "has a data-dependent output shape (unique)",
    aten.bincount: "has a data-dependent output shape (bincount)",
    aten.equal: "returns a Python bool computed from device data (torch.equal)",
    aten.is_nonzero: "returns a Python bool computed from device data",
    aten.allclose: "returns a Python bool computed from device data (allclose)",
}
#: Tensor methods that read data into Python/numpy without dispatching an aten op on the CPU.
WRAPPED_METHODS = ("tolist", "numpy", "cpu", "__array__")


class HostSyncError(RuntimeError):
    """An op inside a NoHostSync region would make the host wait for the device."""


class NoHostSync(TorchDispatchMode):
    """Raise HostSyncError on any host read of device data (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._allowed: list[str] = []
        self._saved: dict[str, Any] = {}
        #: What ``allow`` let through, in order (tests check the count of copies per step).
        self.allowed_copies: list[str] = []

    @contextmanager
    def allow(self, what: str) -> Iterator[None]:
        """Let one named host read through (e.g. the step's tokens)."""
        self._allowed.append(what)
        self.allowed_copies.append(what)
        try:
            yield
        finally:
            self._allowed.pop()

    def _refuse(self, what: str) -> None:
        if not self._allowed:
            raise HostSyncError(f"host sync inside a NoHostSync region: {what}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in FORBIDDEN:
            self._refuse(f"aten.{packet.__name__} {FORBIDDEN[packet]}")
        elif packet is aten.repeat_interleave and isinstance(args[0] if args else None, torch.Tensor) and (
                func is aten.repeat_interleave.Tensor or isinstance(args[1] if len(args) > 1 else None, torch.Tensor)):
            self._refuse("aten.repeat_interleave with tensor repeats has a data-dependent output shape")
        elif packet is aten.index and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])):
            self._refuse("indexing with a boolean mask has a data-dependent output shape")
        elif packet in (aten._to_copy, aten.copy_):
            source = args[1] if packet is aten.copy_ else args[0]
            target = args[0].device if packet is aten.copy_ else kwargs.get("device")
            if (isinstance(source, torch.Tensor) and source.device.type != "cpu" and target is not None
                    and torch.device(target).type == "cpu"):
                self._refuse(f"a device-to-host copy ({func})")
        return func(*args, **kwargs)

    def __enter__(self) -> NoHostSync:
        for name in WRAPPED_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapped(tensor: torch.Tensor, *args: Any, _name: str = name, _original: Any = original,
                        **kwargs: Any) -> Any:
                self._refuse(f"Tensor.{_name}() reads device data on the host")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, wrapped)
        try:
            return super().__enter__()
        except BaseException:
            self._restore()
            raise

    def _restore(self) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001 - the context manager protocol
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._restore()
