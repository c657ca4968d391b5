"""DFlashTreeMask on the CPU library against tree.batched_tree_inputs, bit for bit.

The ``cpu_library`` fixture (via tests/test_plugin_support.py) builds the library with
cmake when needed, so a fresh clone + ``pytest`` works.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_plugin_support import PLUGINS, load_cpu_library, random_batch, random_parents

from tensorrt_llm_dflash import kernels, tree
from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.trtllm import plugins


@pytest.fixture(scope="session")
def cpu_library() -> ctypes.CDLL:
    return load_cpu_library()


# ---------------------------------------------------------------------- tree mask


def test_library_limits_match_tree_module(cpu_library: ctypes.CDLL) -> None:
    assert cpu_library.dflash_max_tree_nodes() == tree.MAX_TREE_NODES == 1024
    assert cpu_library.dflash_abi_version() == kernels.ABI_VERSION


IMPLEMENTATIONS = pytest.mark.parametrize("implementation", kernels.IMPLEMENTATIONS)


@IMPLEMENTATIONS
@pytest.mark.parametrize("num_nodes", [1, 2, 31, 32, 33, 64, 65, 257, 1000, 1023, 1024])
@pytest.mark.parametrize("extra", [0, 1, 40])
def test_tree_mask_matches_reference_bit_for_bit(
    cpu_library: ctypes.CDLL, num_nodes: int, extra: int, implementation: str
) -> None:
    """max_nodes = N + extra: the engine's max generation length above this step's tree."""
    rng = np.random.default_rng(num_nodes)
    batch = 3
    parents, lengths = random_batch(rng, batch, num_nodes)
    max_nodes = min(num_nodes + extra, tree.MAX_TREE_NODES)
    expected = tree.batched_tree_inputs(parents, lengths, max_nodes)
    got = kernels.tree_mask_cpu(parents, lengths, max_nodes, implementation=implementation)
    for name, e, g in zip(("packed_mask", "position_offsets", "generation_lengths"), expected, got):
        assert g.dtype == np.int32 and g.shape == e.shape, name
        np.testing.assert_array_equal(g, e, err_msg=name)


@IMPLEMENTATIONS
def test_tree_mask_chain_star_and_root_only(cpu_library: ctypes.CDLL, implementation: str) -> None:
    n = 70
    chain = np.arange(-1, n - 1, dtype=np.int32)
    star = np.zeros(n, dtype=np.int32)
    star[0] = -1
    root_only = np.full(n, 9, dtype=np.int32)
    root_only[0] = -1
    parents = np.stack([chain, star, root_only])
    lengths = np.array([n, n, 1], dtype=np.int32)
    expected = tree.batched_tree_inputs(parents, lengths)
    got = kernels.tree_mask_cpu(parents, lengths, implementation=implementation)
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(g, e)
    # A chain sees everything before it; its depth is its index.
    np.testing.assert_array_equal(got[1][0], np.arange(n))
    assert tree.unpack_mask(got[0][:n], n)[n - 1].all()  # the chain's rows come first


@IMPLEMENTATIONS
def test_tree_mask_many_random_batches(cpu_library: ctypes.CDLL, implementation: str) -> None:
    rng = np.random.default_rng(7)
    for _ in range(30):
        num_nodes = int(rng.integers(1, 300))
        batch = int(rng.integers(1, 6))
        parents, lengths = random_batch(rng, batch, num_nodes)
        max_nodes = int(rng.integers(num_nodes, 301))
        expected = tree.batched_tree_inputs(parents, lengths, max_nodes)
        got = kernels.tree_mask_cpu(parents, lengths, max_nodes, implementation=implementation)
        for e, g in zip(expected, got):
            np.testing.assert_array_equal(g, e)


def test_gpu_kernel_stays_in_bounds_on_bad_trees(cpu_library: ctypes.CDLL) -> None:
    """The kernel cannot report errors; on garbage it must still only touch its rows.

    Guard bands around the outputs catch any write outside them (the emulation runs
    the kernel's own per-thread body).
    """
    rng = np.random.default_rng(13)
    batch, n, m = 4, 100, 130
    parents = rng.integers(-5, 3 * n, size=(batch, n), dtype=np.int32)  # cycles, forward edges, junk
    parents[1, 5] = 5  # self loop
    lengths = np.array([n, -3, n + 50, 40], dtype=np.int32)
    words = (m + 31) // 32
    guard = 7
    packed = np.full(batch * n * words + 2 * guard, 0x5A5A5A5A, dtype=np.int32)
    offsets = np.full(batch * m + 2 * guard, 0x5A5A5A5A, dtype=np.int32)
    out = np.full(batch + 2 * guard, 0x5A5A5A5A, dtype=np.int32)
    p = ctypes.POINTER(ctypes.c_int32)
    code = cpu_library.dflash_emulate_tree_mask_kernel(
        parents.ctypes.data_as(p), lengths.ctypes.data_as(p), batch, n, m,
        packed[guard:].ctypes.data_as(p), offsets[guard:].ctypes.data_as(p), out[guard:].ctypes.data_as(p),
    )
    assert code == kernels.OK
    for array in (packed, offsets, out):
        assert (array[:guard] == 0x5A5A5A5A).all() and (array[-guard:] == 0x5A5A5A5A).all()
    assert not (packed[guard:-guard] == 0x5A5A5A5A).any(), "every output word is written"
    assert not (offsets[guard:-guard] == 0x5A5A5A5A).any()
    np.testing.assert_array_equal(out[guard:-guard], lengths)  # passed through untouched
    rows = packed[guard:-guard].reshape(batch * n, words)
    # Lengths clamp to 0..N: sequence 0 owns rows 0..99, sequence 1 none, sequence 2 rows 100..199.
    assert rows[5, 0] & (1 << 5)  # a row always contains its own node
    assert rows[100, 0] & 1 and rows[100 + 7, 0] & (1 << 7)
    assert not rows[2 * n + 40:].any()  # past the clamped lengths: zero rows
    assert not offsets[guard:-guard].reshape(batch, m)[1].any()  # negative length: no depths


def _bad_tree(parents_row: list[int], length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    parents = np.array([parents_row], dtype=np.int32)
    lengths = np.array([len(parents_row) if length is None else length], dtype=np.int32)
    return parents, lengths


@pytest.mark.parametrize(
    ("parents_row", "length", "code", "fragment"),
    [
        ([-1, 0, 2, 1], None, kernels.ERR_PARENT_NOT_BEFORE_CHILD, "parents[0][2]=2: a parent must come before its child"),
        ([-1, 0, 3, 1], None, kernels.ERR_PARENT_NOT_BEFORE_CHILD, "parents[0][2]=3"),
        ([-1, 0, 7, 1], None, kernels.ERR_PARENT_OUT_OF_RANGE, "parents[0][2]=7: parent index is out of range"),
        ([-1, 0, 1, 3, 0], 3, kernels.OK, ""),
        ([-1, 0, -1, 1], None, kernels.ERR_NEGATIVE_PARENT, "parents[0][2]=-1: only the root may have a negative parent"),
        ([-1, -4, 0], None, kernels.ERR_NEGATIVE_PARENT, "parents[0][1]=-4"),
        ([0, 0, 1], None, kernels.ERR_ROOT_PARENT, "parents[0][0]=0: the root's parent must be -1"),
        ([-1, 0, 1], 0, kernels.ERR_LENGTH_OUT_OF_RANGE, "generation_lengths[0]=0 is out of range 1..N=3"),
        ([-1, 0, 1], 4, kernels.ERR_LENGTH_OUT_OF_RANGE, "generation_lengths[0]=4 is out of range 1..N=3"),
        ([-1, 0, 1], -2, kernels.ERR_LENGTH_OUT_OF_RANGE, "generation_lengths[0]=-2"),
    ],
)
def test_tree_mask_bad_input_raises(
    cpu_library: ctypes.CDLL, parents_row: list[int], length: int | None, code: int, fragment: str
) -> None:
    parents, lengths = _bad_tree(parents_row, length)
    assert _raw_tree_mask_code(cpu_library, parents, lengths) == code
    if code == kernels.OK:  # padding past the length is ignored, even if it is junk
        for e, g in zip(tree.batched_tree_inputs(parents, lengths), kernels.tree_mask_cpu(parents, lengths)):
            np.testing.assert_array_equal(g, e)
        return
    with pytest.raises(DFlashInputError) as excinfo:
        kernels.tree_mask_cpu(parents, lengths)
    assert fragment in str(excinfo.value)
    with pytest.raises(DFlashInputError):  # the Python reference refuses the same input
        tree.batched_tree_inputs(parents, lengths)


def test_tree_mask_too_many_nodes_raises(cpu_library: ctypes.CDLL) -> None:
    n = tree.MAX_TREE_NODES + 1
    parents = random_parents(np.random.default_rng(0), n)[None, :]
    lengths = np.array([10], dtype=np.int32)
    assert _raw_tree_mask_code(cpu_library, parents, lengths) == kernels.ERR_TREE_TOO_LARGE
    with pytest.raises(DFlashInputError, match=r"tree size N=1025 is out of range 1\.\.1024"):
        kernels.tree_mask_cpu(parents, lengths)
    small = random_parents(np.random.default_rng(0), 8)[None, :]
    for bad in (7, 1025):
        with pytest.raises(DFlashInputError, match=rf"max_nodes={bad} is out of range N=8\.\.1024"):
            kernels.tree_mask_cpu(small, [8], bad)
        with pytest.raises(DFlashInputError, match="out of range"):
            kernels.tree_mask_cpu(small, [8], bad, implementation="gpu-emulation")


def test_enqueue_guard_follows_is_building(cpu_library: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugins' enqueue guard (enqueue_guard.h), as the CPU library exports it."""
    monkeypatch.delenv("IS_BUILDING", raising=False)
    assert kernels.enqueue_skipped_while_building() is False
    monkeypatch.setenv("IS_BUILDING", "1")
    assert kernels.enqueue_skipped_while_building() is True
    monkeypatch.setenv("IS_BUILDING", "0")
    assert kernels.enqueue_skipped_while_building() is False


def test_tree_mask_error_in_second_sequence_names_it(cpu_library: ctypes.CDLL) -> None:
    parents = np.array([[-1, 0, 1], [-1, 0, 2]], dtype=np.int32)
    with pytest.raises(DFlashInputError, match=r"parents\[1\]\[2\]=2"):
        kernels.tree_mask_cpu(parents, [3, 3])


def test_tree_mask_shape_errors(cpu_library: ctypes.CDLL) -> None:
    with pytest.raises(DFlashInputError, match="generation_lengths has 1 entries for a batch of 2"):
        kernels.tree_mask_cpu(np.array([[-1, 0], [-1, 0]]), [2])
    with pytest.raises(DFlashInputError, match="parents must be 2-D"):
        kernels.tree_mask_cpu(np.array([-1, 0]), [2])


def test_error_strings_cover_every_code(cpu_library: ctypes.CDLL) -> None:
    for code in range(kernels.ERR_DDTREE_SHAPE + 1):
        text = kernels.error_string(code)
        assert text and text != "unknown error"
    assert kernels.error_string(kernels.ERR_DDTREE_SHAPE + 1) == "unknown error"
    assert kernels.error_string(999) == "unknown error"
    assert kernels.error_string(-1) == "unknown error"


def _raw_tree_mask_code(lib: ctypes.CDLL, parents: np.ndarray, lengths: np.ndarray) -> int:
    parents = np.ascontiguousarray(parents, dtype=np.int32)
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    batch, n = parents.shape
    words = max((n + 31) // 32, 1)
    packed = np.zeros((batch * n, words), dtype=np.int32)
    offsets = np.zeros((batch, n), dtype=np.int32)
    out = np.zeros(batch, dtype=np.int32)
    p = ctypes.POINTER(ctypes.c_int32)
    return lib.dflash_tree_mask_cpu(
        parents.ctypes.data_as(p), lengths.ctypes.data_as(p), batch, n, n,
        packed.ctypes.data_as(p), offsets.ctypes.data_as(p), out.ctypes.data_as(p), None,
    )


def test_every_error_code_becomes_input_error_with_value(cpu_library: ctypes.CDLL) -> None:
    for code in range(1, kernels.ERR_DDTREE_SHAPE + 1):
        detail = kernels._ErrorDetail(code, 1, 2, 77)
        with pytest.raises(DFlashInputError) as excinfo:
            kernels._raise_for(code, detail, {"geometry": "heads=77", "capacity": 9, "max_accepted": 3})
        message = str(excinfo.value)
        assert message and ("77" in message or code == kernels.ERR_NULL_POINTER), (code, message)


# ------------------------------------------------------------------- the build directory


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_a_stale_or_half_written_build_dir_is_rebuilt(tmp_path: Path) -> None:
    """What the test build (test_plugin_support.build_cpu_library) recovers from, each seen failing before:
    a configure killed before it generated the Makefile ("No rule to make target 'Makefile'" on every later
    run); a build directory copied with its checkout (cmake --build rebuilt the *original* checkout's library,
    the copy's stayed stale); a library a killed link left truncated (newer than its objects, so never
    relinked, and dlopen of it died of SIGBUS)."""
    from test_plugin_support import build_cpu_library, stale_configuration

    build = build_cpu_library.__wrapped__  # uncached: each call below must really build
    first = tmp_path / "first" / "plugins"
    first.mkdir(parents=True)
    for part in ("CMakeLists.txt", "include", "src", "tests"):
        source = PLUGINS / part
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, first / part)
    library = build(first, first / "build")
    assert stale_configuration(first, first / "build") is None

    (first / "build" / "Makefile").unlink()  # a configure killed between "Configuring done" and "Generating done"
    assert "no build system" in stale_configuration(first, first / "build")
    assert build(first, first / "build") == library and (first / "build" / "Makefile").is_file()

    moved = tmp_path / "moved" / "plugins"
    shutil.copytree(first, moved, symlinks=True)
    assert "another checkout" in stale_configuration(moved, moved / "build")
    source = moved / "src" / "cpu" / "dflash_cpu.cpp"
    exported = '__attribute__((visibility("default")))'  # the library hides what is not its C ABI
    source.write_text(source.read_text() + f'\nextern "C" {exported} int dflash_moved_checkout(void) {{ return 7; }}\n')
    copied = build(moved, moved / "build")
    assert ctypes.CDLL(str(copied)).dflash_moved_checkout() == 7  # the copy's own sources, in the copy's library
    assert not hasattr(ctypes.CDLL(str(library)), "dflash_moved_checkout")

    # A link killed midway (a new file, as ld makes: this process has the old one mapped, and truncating a
    # mapped file in place would kill it with SIGBUS); its mtime is now the newest.
    partial = copied.with_name("partial.so")
    partial.write_bytes(copied.read_bytes()[:4096])
    partial.replace(copied)
    assert plugins.shared_library_problem(copied) is not None
    assert build(moved, moved / "build") == copied and plugins.shared_library_problem(copied) is None


def test_a_truncated_cpu_library_falls_back_to_torch_not_a_crash(tmp_path: Path) -> None:
    """``$DFLASH_PLUGIN_LIB`` at a library a killed link left half-written: dlopen mapped segments past the end of
    the file and the first touch killed Python with SIGBUS, so the runtimes' torch fallback never ran. It is
    checked before dlopen now: load_library names it, compaction_backend answers torch."""
    import _ctypes

    whole = Path(_ctypes.__file__).read_bytes()  # any real shared library
    half = tmp_path / "libdflash_plugins_cpu.so"
    half.write_bytes(whole[: len(whole) // 2])
    code = ("from tensorrt_llm_dflash import kernels\n"
            "try:\n    kernels.load_library()\nexcept kernels.PluginLibraryNotFound as err:\n    print(err)\n"
            "kernels._library_searched = False\n"
            "print(kernels.compaction_backend())\n")
    env = {**os.environ, kernels.LIBRARY_ENV_VAR: str(half)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, (result.returncode, result.stderr)
    named, backend = result.stdout.strip().splitlines()
    assert f"{half} is not a loadable shared library: it is truncated" in named, named
    assert backend == "torch"


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_setup_builds_the_library_as_the_tests_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/setup.sh runs ``python -m tensorrt_llm_dflash.plugin_build`` (it configured only where no
    CMakeCache.txt was, so an interrupted configure broke every later setup): the tests' build, the same checks."""
    from test_plugin_support import build_cpu_library

    from tensorrt_llm_dflash import plugin_build

    assert "-m tensorrt_llm_dflash.plugin_build" in (PLUGINS.parent / "scripts" / "setup.sh").read_text()
    library = build_cpu_library()
    assert plugin_build.main([]) == 0 and capsys.readouterr().out.strip() == str(library)
    assert plugin_build.main(["--plugins_dir", str(tmp_path)]) == 2
    assert f"--plugins_dir {str(tmp_path)!r} holds no CMakeLists.txt" in capsys.readouterr().err
