"""Activating the TensorRT / TensorRT-LLM stand-in (tests/trtllm_standin) for a test.

``activate()`` puts the stand-in first on ``sys.path`` (and ``PYTHONPATH``, for subprocesses
such as ``trtllm-build --workers 2`` or a two-rank run), points ``$DFLASH_TRT_PLUGIN_LIB`` at
the stand-in plugin library, and forgets every module that imported ``tensorrt`` /
``tensorrt_llm`` before, so the project's engine code binds to the stand-in. ``deactivate()``
undoes all of it. Users never see the stand-in: it lives under tests/ and is only on the
path inside these tests.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
STANDIN = TESTS / "trtllm_standin"
ROOT = TESTS.parent
#: Modules that bind tensorrt / tensorrt_llm names at import time.
_BOUND = ("tensorrt_llm_dflash.trtllm.config", "tensorrt_llm_dflash.trtllm.model")
_PREFIXES = ("tensorrt", "tensorrt_llm", "_emu")


def _purge() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in _PREFIXES or name in _BOUND:
            del sys.modules[name]
    package = sys.modules.get("tensorrt_llm_dflash.trtllm")
    for name in _BOUND:  # `from . import model` would otherwise find the stale submodule attribute
        if package is not None and hasattr(package, name.rsplit(".", 1)[1]):
            delattr(package, name.rsplit(".", 1)[1])


@contextlib.contextmanager
def active(library_dir: Path, numerics: str = "exact", schedule_seed: int = 1) -> Iterator[dict[str, str]]:
    """The stand-in active for the duration; yields the environment subprocesses need."""
    saved_env = dict(os.environ)
    saved_path = list(sys.path)
    _purge()
    sys.path.insert(0, str(STANDIN))
    from _emu.dflash_plugins import build_standin_library

    library = build_standin_library(library_dir)
    env_updates = {
        "DFLASH_TRT_PLUGIN_LIB": str(library),
        "TRTLLM_STANDIN_NUMERICS": numerics,
        "TRTLLM_STANDIN_SCHEDULE_SEED": str(schedule_seed),
        "PYTHONPATH": os.pathsep.join([str(STANDIN), str(ROOT), str(TESTS)]
                                      + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
    }
    os.environ.update(env_updates)
    try:
        yield {**os.environ}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        _purge()
