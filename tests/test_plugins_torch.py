"""kernels.compact_tail_ (the PyTorch runtime's KV compaction) against its torch fallback."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_plugin_support import (
    deepest_path,
    load_cpu_library,
    random_parents,
    random_path,
)

from tensorrt_llm_dflash import kernels, tree
from tensorrt_llm_dflash.errors import DFlashInputError


@pytest.fixture(scope="session")
def cpu_library() -> ctypes.CDLL:
    return load_cpu_library()


def reference(tensor: torch.Tensor, past_len: int, accepted: list[int]) -> torch.Tensor:
    """Out of place, straight from tree.compaction_indices."""
    expected = tensor.clone()
    source = torch.as_tensor(tree.compaction_indices(accepted, past_len))
    expected[..., past_len : past_len + len(accepted), :] = tensor.index_select(-2, source)
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compact_tail_library_equals_torch_fallback(cpu_library: ctypes.CDLL, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(5)
    torch.manual_seed(5)
    for trial in range(12):
        parents = random_parents(rng, int(rng.integers(1, 60)))
        accepted = [[0], deepest_path(parents)][trial % 2] if trial < 2 else random_path(rng, parents)
        past_len = int(rng.integers(0, 40))
        cache = torch.randn(1, 4, past_len + parents.shape[0] + 3, 16).to(dtype)
        via_library, via_torch = cache.clone(), cache.clone()
        assert kernels.compaction_backend(via_library) == "cpu-library"
        kernels.compact_tail_(via_library, past_len, accepted)
        kernels.compact_tail_torch_(via_torch, past_len, accepted)
        assert torch.equal(via_library, via_torch)
        assert torch.equal(via_library, reference(cache, past_len, accepted))


def test_compact_tail_non_contiguous_tensor_uses_torch(cpu_library: ctypes.CDLL) -> None:
    base = torch.randn(1, 24, 4, 8)  # [batch, seq, heads, dim] viewed as [batch, heads, seq, dim]
    view = base.transpose(1, 2)
    assert kernels.compaction_backend(view) == "torch"
    expected = reference(view, 3, [0, 2, 7])
    kernels.compact_tail_(view, 3, [0, 2, 7])
    assert torch.equal(view, expected)


def test_compact_tail_without_library_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_library", None)
    monkeypatch.setattr(kernels, "_library_searched", True)
    assert kernels.compaction_backend() == "torch"
    cache = torch.randn(1, 2, 12, 4)
    expected = reference(cache, 2, [0, 1, 4])
    kernels.compact_tail_(cache, 2, [0, 1, 4])
    assert torch.equal(cache, expected)


def test_compaction_backend_reports_library(cpu_library: ctypes.CDLL) -> None:
    assert kernels.compaction_backend() == "cpu-library"
    assert kernels.compaction_backend(torch.zeros(1, 1, 4, 2)) == "cpu-library"


@pytest.mark.parametrize("use_library", [True, False])
@pytest.mark.parametrize(
    ("past_len", "accepted", "fragment"),
    [
        (0, [1, 2], r"accepted_nodes\[0\]=1: the first accepted node must be the root 0"),
        (0, [0, 2, 2], r"accepted_nodes\[2\]=2: accepted nodes must be strictly increasing"),
        (4, [0, 3, 8], r"accepted_nodes\[2\]: its KV slot past_len \+ node = 12 is beyond the cache length 10"),
        (-1, [0], r"past_len=-1 must not be negative"),
    ],
)
def test_compact_tail_bad_input_raises(
    cpu_library: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch, use_library: bool,
    past_len: int, accepted: list[int], fragment: str,
) -> None:
    if not use_library:
        monkeypatch.setattr(kernels, "_library", None)
        monkeypatch.setattr(kernels, "_library_searched", True)
    cache = torch.zeros(1, 2, 10, 4)
    with pytest.raises(DFlashInputError, match=fragment):
        kernels.compact_tail_(cache, past_len, accepted)


def test_library_reports_tail_errors_itself(cpu_library: ctypes.CDLL) -> None:
    """The C entry point refuses a bad path on its own (not only the Python pre-check)."""
    tensor = torch.zeros(2, 10, 4)
    nodes = np.array([0, 5, 3], dtype=np.int32)
    detail = kernels._ErrorDetail()
    code = cpu_library.dflash_compact_tail_cpu(
        ctypes.c_void_p(tensor.data_ptr()), 2, 10, 16, 0,
        nodes.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), 3, ctypes.byref(detail),
    )
    assert code == kernels.ERR_ACCEPTED_NOT_INCREASING
    assert (detail.index, detail.value) == (2, 3)


def test_stale_library_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A library without the expected entry points is refused, and compact_tail_ still works."""
    stale = tmp_path / "libstale.so"
    source = tmp_path / "stale.c"
    source.write_text("int dflash_abi_version(void) { return 1; }\n")
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    subprocess.run(["gcc", "-shared", "-fPIC", str(source), "-o", str(stale)], check=True, timeout=120)
    with pytest.raises(kernels.PluginLibraryNotFound, match="stale"):
        kernels.load_library(stale)
    monkeypatch.setattr(kernels, "_library", None)
    monkeypatch.setattr(kernels, "_library_searched", False)
    monkeypatch.setenv(kernels.LIBRARY_ENV_VAR, str(stale))
    monkeypatch.setattr(kernels, "REPO_BUILD_DIR", tmp_path / "nowhere")
    assert kernels.compaction_backend() == "torch"
    cache = torch.randn(1, 2, 8, 4)
    expected = reference(cache, 1, [0, 3])
    kernels.compact_tail_(cache, 1, [0, 3])
    assert torch.equal(cache, expected)
