"""Load an example CLI (examples/<script>.py) as a module, to call its ``main(argv)`` in-process."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_fresh = itertools.count()


def load_example(script: str) -> ModuleType:
    """A fresh module of ``examples/<script>.py`` each call, so tests never share its state."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # train_dflash_lora_inject imports train_dflash
    spec = importlib.util.spec_from_file_location(f"example_{script}_{next(_fresh)}", EXAMPLES / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
