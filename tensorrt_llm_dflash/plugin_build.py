"""Build the plugin library's CPU target from ``plugins/`` with cmake, recovering from a build directory that
``cmake --build`` alone cannot: one configure of the tests and of ``scripts/setup.sh``
(``python -m tensorrt_llm_dflash.plugin_build``), so a stale ``plugins/build`` breaks neither.

Incremental: a no-op when the library is up to date with its sources. The runtimes use the library where it is
built and torch where it is not (``kernels.py``).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .kernels import LIBRARY_NAME, REPO_BUILD_DIR, shared_library_problem

PLUGINS_DIR = REPO_BUILD_DIR.parent
LOCK_NAME = ".build.lock"


class PluginBuildError(RuntimeError):
    """A cmake step failed; the message holds its command and output."""


def find_nvcc() -> str | None:
    """nvcc on PATH, else where CUDA installs it ($CUDACXX, $CUDA_HOME/bin, /usr/local/cuda*/bin, newest first).

    A CI or login shell may not have CUDA's bin directory on PATH although the toolkit is there; the CUDA
    targets must be configured wherever the compiler exists, not only where PATH happens to name it.
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


def stale_configuration(plugins_dir: Path, build_dir: Path) -> str | None:
    """Why ``build_dir`` must be configured afresh before ``cmake --build``, or None.

    ``cmake --build`` alone cannot recover from either: a configure killed before it generated the build
    system leaves CMakeCache.txt without a Makefile ("No rule to make target 'Makefile'", forever), and a
    build directory copied or moved with its checkout keeps the cache of the old one, so the build
    silently rebuilds the *old* checkout's library while this one's stays stale.
    """
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return "not configured"
    if not any((build_dir / name).is_file() for name in ("Makefile", "build.ninja")):
        return "configured, but no build system was generated (an interrupted configure)"
    text = cache.read_text(errors="replace")
    for key, expected in (("CMAKE_HOME_DIRECTORY", plugins_dir), ("CMAKE_CACHEFILE_DIR", build_dir)):
        match = re.search(rf"^{key}:INTERNAL=(.*)$", text, re.MULTILINE)
        if match is None or Path(match.group(1)).resolve() != expected.resolve():
            return f"its cache belongs to another checkout ({key}={match.group(1) if match else None})"
    return None


def build_cpu_library(plugins_dir: Path = PLUGINS_DIR, build_dir: Path | None = None, jobs: int = 2) -> Path:
    """Configure (the first time, or afresh when the configuration is stale) and build the CPU library target;
    return its path. Several builds may share a work tree (test runs, a setup): they take turns (a lock)."""
    plugins_dir = Path(plugins_dir)
    build_dir = plugins_dir / "build" if build_dir is None else Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / LIBRARY_NAME
    with open(build_dir / LOCK_NAME, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stale_configuration(plugins_dir, build_dir) is not None:
            # A foreign cache makes cmake refuse the directory: start from nothing (the objects are rebuilt).
            (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
            shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)
            nvcc = find_nvcc()
            # Name the compiler: CMake looks for nvcc on PATH only, and the CUDA targets need it.
            cuda = [f"-DCMAKE_CUDA_COMPILER={nvcc}"] if nvcc else []
            run_cmake(["-S", str(plugins_dir), "-B", str(build_dir), *cuda])
        # A link killed midway leaves a library newer than its objects, so make never relinks it, and dlopen
        # of it can die of SIGBUS: remove it so the build below links it again.
        if library.exists() and shared_library_problem(library) is not None:
            library.unlink()
        run_cmake(["--build", str(build_dir), "--target", "dflash_plugins_cpu", "-j", str(jobs)])
    return library


def configure_cuda(plugins_dir: Path = PLUGINS_DIR, build_dir: Path | None = None) -> bool:
    """Whether ``build_dir`` (configured by :func:`build_cpu_library`) builds the CUDA targets; configures them
    with :func:`find_nvcc`'s compiler where the directory was configured while CMake could not find nvcc.

    CMake caches ``CMAKE_CUDA_COMPILER=NOTFOUND`` from a configure run without nvcc on PATH (``cmake -S plugins
    -B plugins/build`` by hand, as docs/plugins.md shows) and never looks again. Only ``DFLASH_ENABLE_CUDA=OFF``
    means no CUDA.
    """
    plugins_dir = Path(plugins_dir)
    build_dir = plugins_dir / "build" if build_dir is None else Path(build_dir)
    build_cpu_library(plugins_dir, build_dir)
    nvcc = find_nvcc()
    with open(build_dir / LOCK_NAME, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cache = (build_dir / "CMakeCache.txt").read_text(errors="replace")
        if re.search(r"^DFLASH_ENABLE_CUDA:BOOL=(OFF|FALSE|0|NO)$", cache, re.MULTILINE | re.IGNORECASE):
            return False
        compiler = re.search(r"^CMAKE_CUDA_COMPILER:\w+=(.*)$", cache, re.MULTILINE)
        if compiler is not None and compiler.group(1) and not compiler.group(1).endswith("NOTFOUND"):
            return True
        if nvcc is None:
            return False
        run_cmake(["-S", str(plugins_dir), "-B", str(build_dir), f"-DCMAKE_CUDA_COMPILER={nvcc}"])
    return True


def run_cmake(arguments: list[str]) -> None:
    command = ["cmake", *arguments]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if result.returncode != 0:
        raise PluginBuildError(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plugins_dir", type=Path, default=PLUGINS_DIR, help="the plugins/ source tree")
    ap.add_argument("--build_dir", type=Path, default=None, help="default: PLUGINS_DIR/build")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    args = ap.parse_args(argv)
    if shutil.which("cmake") is None:
        print("cmake not found: the plugin library is not built (the runtimes use torch instead)", file=sys.stderr)
        return 1
    if not (args.plugins_dir / "CMakeLists.txt").is_file():
        print(f"error: --plugins_dir {str(args.plugins_dir)!r} holds no CMakeLists.txt", file=sys.stderr)
        return 2
    try:
        library = build_cpu_library(args.plugins_dir, args.build_dir, args.jobs)
    except PluginBuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(library)
    return 0


if __name__ == "__main__":
    sys.exit(main())
