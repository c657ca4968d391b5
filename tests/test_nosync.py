"""NoHostSync (tensorrt_llm_dflash.nosync) catches every kind of host read it claims to, and lets fixed-shape work
through.

Each refused read is first run outside the guard (where it works, or fails for its own reason), then
inside it, where it must raise HostSyncError; a guard that let one through would fail here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorrt_llm_dflash.nosync import HostSyncError, NoHostSync

t = torch.arange(6)

HOST_READS = {
    "item": lambda: t[1].item(),
    "int": lambda: int(t[1]),
    "float": lambda: float(t[1]),
    "bool": lambda: bool(t[1] > 0),
    "if": lambda: 1 if (t > 2).any() else 0,
    "index_scalar": lambda: [0, 1, 2][t[1]],  # __index__
    "tolist": lambda: t.tolist(),
    "tolist_0d": lambda: t[1].tolist(),
    "numpy": lambda: t.numpy(),
    "cpu": lambda: t.cpu(),
    "array": lambda: np.asarray(t),
    "repr": lambda: repr(t),
    "str": lambda: str(t),
    "format": lambda: f"{t}",
    "nonzero": lambda: t.nonzero(),
    "argwhere": lambda: torch.argwhere(t),
    "where_one_arg": lambda: torch.where(t > 2),
    "mask_index": lambda: t[t > 2],
    "mask_assign": lambda: t.clone().__setitem__(t > 2, 0),
    "masked_select": lambda: t.masked_select(t > 2),
    "unique": lambda: torch.unique(t),
    "unique_consecutive": lambda: torch.unique_consecutive(t),
    "bincount": lambda: torch.bincount(t),
    "repeat_interleave": lambda: torch.repeat_interleave(t, t),
    "one_hot": lambda: torch.nn.functional.one_hot(t),
    "equal": lambda: torch.equal(t, t),
    "allclose": lambda: torch.allclose(t.double(), t.double()),
}


@pytest.mark.parametrize("read", sorted(HOST_READS))
def test_nohostsync_catches_each_host_read(read):
    HOST_READS[read]()  # outside the guard it works
    with pytest.raises(HostSyncError), NoHostSync():
        HOST_READS[read]()
    with NoHostSync() as guard:
        with guard.allow("the step's tokens"):
            HOST_READS[read]()
        assert guard.allowed_copies == ["the step's tokens"]
        with pytest.raises(HostSyncError):  # the permission ends with its block
            HOST_READS[read]()
    assert torch.Tensor.tolist(t) == list(range(6)) and "tensor(" in repr(t)  # the wrapped methods are restored


@pytest.mark.parametrize("copy", ["to", "copy_"])
def test_nohostsync_catches_device_to_host_copies(copy):
    """A non-CPU tensor copied to the CPU. The meta device stands in for CUDA on a machine without one: the
    copy itself fails outside the guard (a meta tensor has no data), so only the guard's error type is checked."""
    on_device = torch.empty(3, device="meta")

    def read() -> torch.Tensor:
        return on_device.to("cpu") if copy == "to" else torch.empty(3).copy_(on_device)

    with pytest.raises(NotImplementedError):
        read()
    with pytest.raises(HostSyncError, match="device-to-host copy"), NoHostSync():
        read()
    with NoHostSync():
        torch.empty(3).to("meta")  # host to device is fine
        torch.empty(3).copy_(torch.ones(3))  # host to host as well


def test_nohostsync_lets_fixed_shape_work_through():
    with NoHostSync():
        out = torch.where(t > 2, t, 0).gather(0, torch.tensor([1, 5])) + t.sum()
        torch.sort(t.flip(0), stable=True)
        torch.topk(t.double(), 2)
        t[torch.tensor([0, 2])]  # integer indexing: static shape
        t.clone().index_put_((torch.tensor([1]),), torch.tensor(7))
        t.masked_fill(t > 2, 0)
        torch.repeat_interleave(t, 2)  # an integer repeat: the shape is known
        torch.repeat_interleave(t, t, output_size=15)  # tensor repeats with a declared size
        (t > 2).any()  # a device bool is fine; only reading it on the host is not
    assert out.tolist() == [15, 20]


def test_nested_guards_restore_the_tensor_methods():
    original = torch.Tensor.tolist
    with NoHostSync() as outer:
        with NoHostSync():
            with pytest.raises(HostSyncError):
                t.tolist()
        with pytest.raises(HostSyncError):  # the outer guard is still in force
            t.tolist()
        with outer.allow("one read"):
            assert t.tolist() == list(range(6))
    assert torch.Tensor.tolist is original


def test_the_tag_rule_alone_catches_data_dependent_ops(monkeypatch):
    """With the explicit list emptied, ops torch tags dynamic_output_shape / data_dependent_output are still
    refused: the tag rule covers ops the list does not name."""
    from tensorrt_llm_dflash import nosync

    monkeypatch.setattr(nosync, "FORBIDDEN", {})
    for read in ("item", "nonzero", "masked_select", "unique", "unique_consecutive", "bincount"):
        with pytest.raises(HostSyncError, match="tagged data-dependent"), NoHostSync():
            HOST_READS[read]()
