"""Built libraries the stand-in needs outside the test process (subprocess environments)."""

from __future__ import annotations

import sys
from pathlib import Path

STANDIN = Path(__file__).resolve().parent / "trtllm_standin"


def standin_library(directory: Path) -> Path:
    """The stand-in libdflash_trt_plugins.so (registration entry point only), built into ``directory``."""
    sys.path.insert(0, str(STANDIN))
    try:
        from _emu.dflash_plugins import build_standin_library
    finally:
        sys.path.remove(str(STANDIN))
    return build_standin_library(directory / "lib")


def cpu_library() -> Path:
    """libdflash_plugins_cpu.so, built with cmake when needed."""
    from test_plugin_support import BUILD_DIR, build_cpu_library

    build_cpu_library()
    return BUILD_DIR / "libdflash_plugins_cpu.so"
