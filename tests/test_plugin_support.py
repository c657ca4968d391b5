"""Shared fixture and helpers of the plugin tests (this module holds no tests).

``load_cpu_library()`` (used by each test module's session fixture) builds ``plugins/build/libdflash_plugins_cpu.so`` with cmake when it
is missing or stale, so a fresh clone + ``pytest`` works, unless
``$DFLASH_PLUGIN_LIB`` points at a prebuilt library.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tensorrt_llm_dflash import kernels, plugin_build, tree

REPO = Path(__file__).resolve().parent.parent
PLUGINS = REPO / "plugins"
BUILD_DIR = PLUGINS / "build"


@functools.lru_cache(maxsize=1)
def find_nvcc() -> str | None:
    """plugin_build.find_nvcc, once per test process."""
    return plugin_build.find_nvcc()


stale_configuration = plugin_build.stale_configuration


@functools.cache
def build_cpu_library(plugins_dir: Path = PLUGINS, build_dir: Path = BUILD_DIR) -> Path:
    """plugin_build.build_cpu_library (the build scripts/setup.sh runs too), once per directory; a failed cmake
    step fails the test with its output."""
    try:
        return plugin_build.build_cpu_library(plugins_dir, build_dir, jobs=4)
    except plugin_build.PluginBuildError as err:
        pytest.fail(str(err))


def configure_cuda(plugins_dir: Path = PLUGINS, build_dir: Path = BUILD_DIR) -> bool:
    """plugin_build.configure_cuda; a failed cmake step fails the test with its output."""
    try:
        return plugin_build.configure_cuda(plugins_dir, build_dir)
    except plugin_build.PluginBuildError as err:
        pytest.fail(str(err))


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
