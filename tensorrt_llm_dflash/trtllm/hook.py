"""Make TensorRT-LLM's own ``trtllm-build`` accept ``--speculative_decoding_mode dflash``.

This package does not install a ``trtllm-build`` script: that file belongs to TensorRT-LLM
(its setup.py: ``trtllm-build=tensorrt_llm.commands.build:main``), and two distributions
writing one script means the last install wins and either uninstall deletes it. Instead the
wheel ships ``tensorrt_llm_dflash-trtllm-build.pth``, which Python's ``site`` runs at start-up
(one ``import`` line, https://docs.python.org/3/library/site.html); it calls :func:`install`,
which only adds a finder to ``sys.meta_path``. When ``tensorrt_llm.commands.build`` is
imported (TensorRT-LLM's script does ``from tensorrt_llm.commands.build import main``), the
finder wraps that module's ``main``: a DFlash build (``--speculative_decoding_mode dflash``, or
a checkpoint whose architecture is ``DFlashForCausalLM``) goes through
:func:`tensorrt_llm_dflash.trtllm.build.main`, every other invocation reaches TensorRT-LLM's
``main`` untouched. Uninstalling this package removes the ``.pth`` and TensorRT-LLM's command
is as it was. Nothing here imports tensorrt_llm, torch or anything heavy at start-up.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import sys
from pathlib import Path
from typing import Any

from .constants import ARCHITECTURE, DFLASH_MODE, MODE_FLAG

TARGET = "tensorrt_llm.commands.build"


def wants_dflash(argv: list[str]) -> bool:
    """A DFlash build: the dflash mode, or a DFlash checkpoint (so a missing mode is refused by name). Flags are read
    as trtllm-build's argparse reads them (``build._options``: ``--flag=value`` and unique prefixes too), so an
    abbreviated ``--speculative_decoding dflash`` is not handed to TensorRT-LLM, which would refuse the mode without
    saying why; an ambiguous prefix goes to our entry point too, which names it in one line."""
    from ..errors import DFlashConfigError
    from .build import _options

    try:
        options = _options(argv)
    except DFlashConfigError:
        return True
    if any(option.flag == MODE_FLAG and option.value == DFLASH_MODE for option in options):
        return True
    checkpoints = [option.value for option in options if option.flag == "--checkpoint_dir" and option.value]
    if not checkpoints:
        return False
    try:  # argparse keeps the last value
        return json.loads((Path(checkpoints[-1]) / "config.json").read_text()).get("architecture") == ARCHITECTURE
    except (OSError, ValueError, AttributeError):
        return False


def wrap_main(original: Any) -> Any:
    if getattr(original, "_dflash_hooked", False):
        return original

    @functools.wraps(original)  # keeps TensorRT-LLM's main reachable as __wrapped__
    def main(*args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not wants_dflash(sys.argv[1:]):
            return original(*args, **kwargs)
        from .build import main as dflash_main

        return dflash_main(sys.argv[1:])

    main._dflash_hooked = True
    return main


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        if callable(getattr(module, "main", None)):
            module.main = wrap_main(module.main)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Add the finder (once); wrap the module right away if it is already imported."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    module = sys.modules.get(TARGET)
    if module is not None and callable(getattr(module, "main", None)):
        module.main = wrap_main(module.main)
