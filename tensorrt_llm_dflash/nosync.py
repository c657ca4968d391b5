"""A guard that fails on anything that makes the host wait for the device, for CPU tests of GPU code.

A CUDA graph cannot contain a host read, and outside a graph every host read of a device value
stalls the CPU until the GPU has caught up (the per-step stall that makes trees lose to chains
under CUDA graphs elsewhere). On the CPU those reads cost nothing and go unnoticed, so tests run
decode steps under :class:`NoHostSync`, which raises :class:`HostSyncError` on:

* ``aten._local_scalar_dense`` / ``aten.item``: ``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``,
  ``if t:``, ``t.any()`` in a condition: the host needs the value, so it waits for the device;
* every aten op tagged ``dynamic_output_shape`` or ``data_dependent_output`` (the output's size, or a
  Python result, is computed from the data, so the host must read it back): ``nonzero`` (also behind
  ``argwhere`` and one-argument ``torch.where``), ``masked_select``, ``unique`` and friends, ``bincount``,
  ``one_hot``; two tagged ops are refused only in their data-dependent form: ``aten.index`` with a
  boolean index (``t[mask]``; integer indexing has a static shape) and ``repeat_interleave`` with tensor
  repeats and no ``output_size``;
* ``index_put`` with a boolean index (``t[mask] = v``): on CUDA it turns the mask into indices with
  ``nonzero``, a sync, although the CPU shows no such op;
* ``equal``, ``is_nonzero``, ``allclose``: Python results computed from device data;
* device-to-host copies: ``aten._to_copy`` / ``copy_`` from a non-CPU tensor to the CPU (``.to("cpu")``,
  ``.cpu()`` on the GPU);
* the tensor methods that read data into Python, numpy or text without dispatching any aten op on the
  CPU (so the mode alone would miss them there): ``tolist``, ``numpy``, ``cpu``, ``__array__``,
  ``__repr__``, ``__format__``. They are wrapped while the guard is active. On the CPU the guard cannot
  tell a device tensor from a host one, so these refuse on any tensor.

torch 2.13 on the CPU: ``.item()``, ``int()``, ``float()`` and ``bool()`` dispatch
``aten._local_scalar_dense``; ``.tolist()``, ``.cpu()`` and ``repr()`` dispatch nothing (hence the
wrappers); ``t[mask]`` dispatches ``aten.index.Tensor`` and ``t[mask] = v`` ``aten.index_put_``, each
with the bool mask among the indices.

Not covered: ``one_hot`` with an explicit ``num_classes`` reads bounds on the CPU (refused here) but not
on CUDA; stream and event synchronisation calls (``torch.cuda.synchronize``) dispatch no aten op.

The one copy a step is allowed (its tokens, for streaming and stop checks) is made inside
``guard.allow("what")``, which names it; ``guard.allowed_copies`` records each use.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: Overload packets refused outright, with the reason given in the error.
FORBIDDEN = {
    aten._local_scalar_dense: "reads a device value on the host (.item(), int(), float(), bool(), if)",
    aten.item: "reads a device value on the host (.item())",
    aten.nonzero: "has a data-dependent output shape (nonzero, argwhere, one-argument where)",
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
#: Tagged data-dependent, but with a static shape in the form the code below lets through.
_CHECKED_BY_ARGUMENTS = (aten.index, aten.repeat_interleave)
_DATA_DEPENDENT_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
_INDEX_PUT = (aten.index_put, aten.index_put_, aten._index_put_impl_)
#: Tensor methods that read data into Python/numpy/text without dispatching an aten op on the CPU.
WRAPPED_METHODS = ("tolist", "numpy", "cpu", "__array__", "__repr__", "__format__")


class HostSyncError(RuntimeError):
    """An op inside a NoHostSync region would make the host wait for the device."""


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or []))


class NoHostSync(TorchDispatchMode):
    """Raise HostSyncError on any host read of device data (see the module docstring).

    Use ``with NoHostSync() as guard:`` around the code under test and ``with guard.allow("name"):`` around
    the one read the code is meant to make.
    """

    def __init__(self) -> None:
        super().__init__()
        self._allowed: list[str] = []
        self._saved: list[dict[str, Any]] = []  # one entry per active __enter__ (re-entry restores in order)
        #: What ``allow`` let through, in order (tests check the count of copies per step).
        self.allowed_copies: list[str] = []

    @contextmanager
    def allow(self, what: str) -> Iterator[None]:
        """Let the host reads inside this block through, recording ``what`` once in ``allowed_copies``."""
        self._allowed.append(what)
        self.allowed_copies.append(what)
        try:
            yield
        finally:
            self._allowed.pop()

    def _refuse(self, what: str) -> None:
        if not self._allowed:
            raise HostSyncError(f"host sync inside a NoHostSync region: {what}")

    def _check(self, func: Any, args: tuple, kwargs: dict) -> None:
        packet = func.overloadpacket
        if packet in FORBIDDEN:
            self._refuse(f"aten.{packet.__name__} {FORBIDDEN[packet]}")
        elif packet is aten.index:
            if _has_bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
                self._refuse("indexing with a boolean mask (t[mask]) has a data-dependent output shape")
        elif packet is aten.repeat_interleave:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            tensor_repeats = func is aten.repeat_interleave.Tensor or isinstance(repeats, torch.Tensor)
            if tensor_repeats and kwargs.get("output_size") is None:
                self._refuse("repeat_interleave with tensor repeats and no output_size has a data-dependent shape")
        elif packet in _INDEX_PUT:
            if _has_bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
                self._refuse("index_put with a boolean mask (t[mask] = v) runs nonzero on the device")
        elif any(tag in func.tags for tag in _DATA_DEPENDENT_TAGS):
            self._refuse(f"{func} is tagged data-dependent (its output shape or value needs a host read)")
        elif packet in (aten._to_copy, aten.copy_):
            source = args[1] if packet is aten.copy_ else args[0]
            target = args[0].device if packet is aten.copy_ else kwargs.get("device")
            if (isinstance(source, torch.Tensor) and source.device.type != "cpu" and target is not None
                    and torch.device(target).type == "cpu"):
                self._refuse(f"a device-to-host copy ({func})")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def __enter__(self) -> NoHostSync:
        saved: dict[str, Any] = {}
        for name in WRAPPED_METHODS:
            original = getattr(torch.Tensor, name)
            saved[name] = original

            def wrapped(tensor: torch.Tensor, *args: Any, _name: str = name, _original: Any = original,
                        **kwargs: Any) -> Any:
                self._refuse(f"Tensor.{_name}() reads tensor data on the host")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, wrapped)
        self._saved.append(saved)
        try:
            return super().__enter__()
        except BaseException:
            self._restore()
            raise

    def _restore(self) -> None:
        for name, original in self._saved.pop().items():
            setattr(torch.Tensor, name, original)

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001 - the context manager protocol
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._restore()
