"""Shared fixture and helpers of the plugin tests (this module holds no tests).

``load_cpu_library()`` (used by each test module's session fixture) builds ``plugins/build/libdflash_plugins_cpu.so`` with cmake when it
is missing or stale, so a fresh clone + ``pytest`` works, unless
``$DFLASH_PLUGIN_LIB`` points at a prebuilt library.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tensorrt_llm_dflash import kernels, tree

REPO = Path(__file__).resolve().parent.parent
PLUGINS = REPO / "plugins"
BUILD_DIR = PLUGINS / "build"


@functools.lru_cache(maxsize=1)
def find_nvcc() -> str | None:
    """nvcc on PATH, else where CUDA installs it ($CUDACXX, $CUDA_HOME/bin, /usr/local/cuda*/bin, newest first).

    A CI or login shell may not have CUDA's bin directory on PATH although the toolkit is there; the
    CUDA compile tests must run wherever the compiler exists, not only where PATH happens to name it.
    """
    found = shutil.which("nvcc")
    if found:
        return found
    candidates = [os.environ.get("CUDACXX")]
    candidates += [str(Path(os.environ[v]) / "bin" / "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    candidates.append("/usr/local/cuda/bin/nvcc")
    candidates += [str(p / "bin" / "nvcc") for p in sorted(Path("/usr/local").glob("cuda-*"), reverse=True)]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@functools.lru_cache(maxsize=1)
def build_cpu_library() -> Path:
    """Configure (first time) and build the CPU library target; return its path."""
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    # Several test runs may share the work tree: build under a lock.
    with open(BUILD_DIR / ".pytest-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (BUILD_DIR / "CMakeCache.txt").is_file():
            nvcc = find_nvcc()
            # Name the compiler: CMake looks for nvcc on PATH only, and the CUDA library test needs it built.
            cuda = [f"-DCMAKE_CUDA_COMPILER={nvcc}"] if nvcc else []
            _run(["cmake", "-S", str(PLUGINS), "-B", str(BUILD_DIR), *cuda])
        # Incremental: a no-op when the library is up to date with its sources.
        _run(["cmake", "--build", str(BUILD_DIR), "--target", "dflash_plugins_cpu", "-j", "4"])
    return BUILD_DIR / kernels.LIBRARY_NAME


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")


def load_cpu_library() -> ctypes.CDLL:
    """The loaded CPU plugin library, built on demand (skips the test without cmake)."""
    if os.environ.get(kernels.LIBRARY_ENV_VAR):
        return kernels.load_library(kernels.library_candidates()[0])
    if shutil.which("cmake") is None:
        if (BUILD_DIR / kernels.LIBRARY_NAME).is_file():
            return kernels.load_library(BUILD_DIR / kernels.LIBRARY_NAME)
        pytest.skip("cmake is not installed and plugins/build holds no prebuilt CPU library")
    return kernels.load_library(build_cpu_library())


# ------------------------------------------------------------------------ trees


def random_parents(rng: np.random.Generator, num_nodes: int) -> np.ndarray:
    """parent[i] uniform in [0, i): every node's parent precedes it."""
    parents = np.empty(num_nodes, dtype=np.int32)
    parents[0] = -1
    if num_nodes > 1:
        parents[1:] = np.floor(rng.random(num_nodes - 1) * np.arange(1, num_nodes)).astype(np.int32)
    return parents


def random_batch(rng: np.random.Generator, batch: int, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Padded parents [batch, N] and lengths: even rows full, odd rows shorter; padding is junk."""
    parents = rng.integers(-50, 5000, size=(batch, num_nodes), dtype=np.int32)
    lengths = np.empty(batch, dtype=np.int32)
    for b in range(batch):
        length = num_nodes if b % 2 == 0 else int(rng.integers(1, num_nodes + 1))
        lengths[b] = length
        parents[b, :length] = random_parents(rng, length)
    return parents, lengths


def path_to(parents: np.ndarray, node: int) -> list[int]:
    """Root-first node list from the root to ``node``."""
    path = [int(node)]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def deepest_path(parents: np.ndarray) -> list[int]:
    """The accepted path when the target accepts the full depth of the tree."""
    return path_to(parents, int(np.argmax(tree.depths_from_parents(parents))))


def random_path(rng: np.random.Generator, parents: np.ndarray) -> list[int]:
    return path_to(parents, int(rng.integers(0, parents.shape[0])))
