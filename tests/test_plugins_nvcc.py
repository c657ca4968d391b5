"""Compile-only checks of the GPU side (this machine has nvcc but no GPU or TensorRT).

* every ``plugins/src/cuda/*.cu`` compiles for sm_80 and sm_90 with warnings as errors
  (both architectures in one nvcc call per file, to keep the run short);
* the TensorRT plugin classes compile against real TensorRT 10.x headers with
  ``-Wall -Wextra -Werror`` when ``$DFLASH_TRT_INCLUDE_DIR`` (or a system / pip
  TensorRT) provides them; the headers are never part of this repository.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from test_plugin_support import find_nvcc

REPO = Path(__file__).resolve().parent.parent
PLUGINS = REPO / "plugins"
CUDA_SOURCES = sorted((PLUGINS / "src" / "cuda").glob("*.cu"))
TRT_SOURCES = sorted((PLUGINS / "src" / "trt").glob("*.cpp"))
NVCC = find_nvcc()


def test_sources_exist() -> None:
    assert CUDA_SOURCES, "no .cu files found under plugins/src/cuda"
    assert TRT_SOURCES, "no .cpp files found under plugins/src/trt"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the CUDA kernels cannot be compiled here")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles_for_sm80_and_sm90(source: Path, tmp_path: Path) -> None:
    command = [
        NVCC, "-std=c++17", f"-I{PLUGINS / 'include'}",
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_90,code=sm_90",
        "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror",
        "--resource-usage",  # ptxas reports each kernel per architecture: proof both were built
        "-c", str(source), "-o", str(tmp_path / (source.stem + ".o")),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command)}\n{output}"
    assert "warning" not in output.lower(), output
    assert "sm_80" in output and "sm_90" in output, output
    if source.name == "ddtree_kernels.cu":
        # Per-thread arrays would give these kernels a stack frame past the 1 KiB default, and the driver would have to
        # grow every thread's local memory at launch (not inside a CUDA graph capture): their scratch is the caller's.
        frames = re.findall(r"(\d+) bytes stack frame", output)
        assert frames and all(frame == "0" for frame in frames), output


def _trt_include_dir() -> Path | None:
    candidates = [os.environ.get("DFLASH_TRT_INCLUDE_DIR"), "/usr/include", "/usr/include/x86_64-linux-gnu"]
    purelib = sysconfig.get_paths().get("purelib")
    if purelib:
        candidates += [f"{purelib}/tensorrt_include", f"{purelib}/tensorrt/include"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "NvInferRuntime.h").is_file():
            return Path(candidate)
    return None


def _cuda_include_dir() -> Path | None:
    roots = [Path(NVCC).resolve().parent.parent] if NVCC else []
    roots += [Path("/usr/local/cuda")]
    for root in roots:
        for include in (root / "include", root / "targets" / "x86_64-linux" / "include"):
            if (include / "cuda_runtime_api.h").is_file():
                return include
    return None


TRT_INCLUDE = _trt_include_dir()
CUDA_INCLUDE = _cuda_include_dir()


@pytest.mark.skipif(
    TRT_INCLUDE is None,
    reason="no TensorRT headers: set DFLASH_TRT_INCLUDE_DIR to a TensorRT 10.x include/ directory",
)
@pytest.mark.skipif(CUDA_INCLUDE is None, reason="no CUDA headers (cuda_runtime_api.h) found")
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
@pytest.mark.parametrize("source", TRT_SOURCES, ids=lambda p: p.name)
def test_trt_plugin_compiles_against_headers(source: Path, tmp_path: Path) -> None:
    command = [
        "g++", "-std=c++17", "-fPIC", "-Wall", "-Wextra", "-Werror",
        f"-I{PLUGINS / 'include'}", f"-I{PLUGINS / 'src' / 'trt'}",
        # SYSTEM includes: only our own code's warnings count.
        "-isystem", str(TRT_INCLUDE), "-isystem", str(CUDA_INCLUDE),
        "-c", str(source), "-o", str(tmp_path / (source.stem + ".o")),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}{result.stderr}"
    assert not result.stderr.strip(), result.stderr


@pytest.mark.skipif(
    TRT_INCLUDE is None,
    reason="no TensorRT headers: set DFLASH_TRT_INCLUDE_DIR to a TensorRT 10.x include/ directory",
)
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_trt_plugin_classes_host_test(tmp_path: Path) -> None:
    """Build and run plugins/tests/trt_plugin_host_test.cpp: creators, fields, serialisation,
    clone, capability interfaces, types, formats and shape checks, enqueue doing nothing while
    TensorRT builds, and registration under one namespace (initDFlashPlugins against a
    recording registry), on the host (links cudart statically, not libnvinfer; launches no kernel)."""
    executable = tmp_path / "trt_plugin_host_test"
    sources = [PLUGINS / "tests" / "trt_plugin_host_test.cpp"] + [
        PLUGINS / "src" / "trt" / name
        for name in ("plugin_fields.cpp", "tree_mask_plugin.cpp", "kv_compact_plugin.cpp", "plugin_registration.cpp")
    ] + CUDA_SOURCES
    command = [
        NVCC, "-std=c++17", "-gencode", "arch=compute_80,code=sm_80",
        f"-I{PLUGINS / 'include'}", f"-I{PLUGINS / 'src' / 'trt'}", "-isystem", str(TRT_INCLUDE),
        "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror",
        *[str(s) for s in sources], "-o", str(executable),
    ]
    build = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert build.returncode == 0, f"{' '.join(command)}\n{build.stdout}{build.stderr}"
    run = subprocess.run([str(executable)], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASSED: 0 failure(s)" in run.stdout


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: libdflash_plugins_cuda.so cannot be built")
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_cuda_c_api_library_builds_and_fails_gracefully_without_gpu() -> None:
    """libdflash_plugins_cuda.so: builds with the CMake project, exports the C ABI,
    refuses bad geometry without touching CUDA, and (on a machine without a GPU)
    turns the failed launch into DFLASH_ERR_CUDA instead of crashing."""
    import ctypes

    from test_plugin_support import BUILD_DIR, configure_cuda

    from tensorrt_llm_dflash import kernels

    if not configure_cuda():  # configures plugins/build if needed, with nvcc where it was configured without
        pytest.skip("plugins/build was configured with DFLASH_ENABLE_CUDA=OFF")
    result = subprocess.run(
        ["cmake", "--build", str(BUILD_DIR), "--target", "dflash_plugins_cuda", "-j", "4"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    library = ctypes.CDLL(str(BUILD_DIR / "libdflash_plugins_cuda.so"))
    for name in ("dflash_tree_mask_cuda", "dflash_kv_compact_linear_cuda", "dflash_kv_compact_paged_cuda",
                 "dflash_ddtree_build_cuda", "dflash_path_sums_cuda", "dflash_walk_cuda"):
        assert hasattr(library, name), name
    detail = kernels._ErrorDetail()
    fn = library.dflash_tree_mask_cuda
    fn.restype = ctypes.c_int32
    # N = 0, or max_nodes < N, is refused by the launcher before any CUDA call.
    assert fn(None, None, 1, 0, 4, None, None, None, None, ctypes.byref(detail)) == kernels.ERR_BAD_GEOMETRY
    assert fn(None, None, 1, 8, 4, None, None, None, None, ctypes.byref(detail)) == kernels.ERR_BAD_GEOMETRY
    # batch = 0 launches nothing.
    assert fn(None, None, 0, 4, 4, None, None, None, None, ctypes.byref(detail)) == kernels.OK
    # The fused DDTree build: a budget past the static scratch, or a negative depth, is refused by name
    # (detail index 0 budget, 1 depth) before any CUDA call; an empty batch launches nothing.
    ddtree = library.dflash_ddtree_build_cuda
    ddtree.restype = ctypes.c_int32

    def build(batch: int, depth: int, k: int, budget: int) -> int:
        return ddtree(*[None] * 4, batch, depth, k, budget, *[None] * 8, ctypes.byref(detail))

    assert build(1, 4, 5, 256) == kernels.ERR_DDTREE_SHAPE and (detail.index, detail.value) == (0, 256)
    assert build(1, -1, 5, 8) == kernels.ERR_DDTREE_SHAPE and (detail.index, detail.value) == (1, -1)
    assert build(0, 4, 5, 8) == kernels.OK
    sums = library.dflash_path_sums_cuda
    sums.restype = ctypes.c_int32
    assert sums(None, None, 1, -2, None, None, ctypes.byref(detail)) == kernels.ERR_DDTREE_SHAPE
    assert (detail.index, detail.value) == (3, -2)
    assert sums(None, None, 0, 5, None, None, ctypes.byref(detail)) == kernels.OK
    walk = library.dflash_walk_cuda
    walk.restype = ctypes.c_int32
    assert walk(*[None] * 4, 1, 8, 0, *[None] * 4, ctypes.byref(detail)) == kernels.ERR_DDTREE_SHAPE
    assert (detail.index, detail.value) == (4, 0)
    if Path("/dev/nvidia0").exists():
        return  # a real launch on null pointers would fault the device: stop here
    code = fn(None, None, 1, 4, 4, None, None, None, None, ctypes.byref(detail))
    assert code == kernels.ERR_CUDA and detail.value != 0
    assert build(1, 4, 5, 8) == kernels.ERR_CUDA and detail.value != 0


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_a_build_dir_configured_without_nvcc_gets_the_cuda_targets(tmp_path: Path) -> None:
    """A build directory configured while nvcc was not on PATH caches CMAKE_CUDA_COMPILER=NOTFOUND, so the CUDA
    library test answered "No rule to make target 'dflash_plugins_cuda'" and skipped on every run, nvcc or not.
    configure_cuda() configures the CUDA targets with the nvcc find_nvcc() finds."""
    from test_plugin_support import configure_cuda

    plugins = tmp_path / "plugins"
    plugins.mkdir()
    for part in ("CMakeLists.txt", "include", "src", "tests"):
        (shutil.copytree if (PLUGINS / part).is_dir() else shutil.copy2)(PLUGINS / part, plugins / part)
    build = plugins / "build"
    env = {**os.environ, "PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                                  if not (Path(p) / "nvcc").exists())}
    subprocess.run([shutil.which("cmake"), "-S", str(plugins), "-B", str(build)], env=env, check=True,
                   capture_output=True)
    assert "CMAKE_CUDA_COMPILER:FILEPATH=NOTFOUND" in (build / "CMakeCache.txt").read_text()
    assert configure_cuda(plugins, build)
    result = subprocess.run(["cmake", "--build", str(build), "--target", "dflash_plugins_cuda", "-j", "2"],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (build / "libdflash_plugins_cuda.so").is_file()
