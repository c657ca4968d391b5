"""Argument checking shared by the example CLIs: every value is checked at parse time.

A bad value exits with status 2 and one line, ``PROG: error: argument --NAME: ...``, that
names the argument, the value and what is allowed, before any model is loaded. The checks
that touch the file system (an output directory that cannot be written, a model directory
that does not exist) run here too, so hours of work are never lost to a typo at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

#: Seeds go to torch generators, Python's random and numpy, whose common range is 32 bits.
MAX_SEED = 2**32 - 1
MAX_THREADS = 4096


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error: no usage block between the user and the reason."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _fail(message: str) -> NoReturn:
    raise argparse.ArgumentTypeError(message)


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An integer written as one (``8.5``, ``1e21``, ``inf`` are refused) within [low, high]."""
    where = "" if low is None and high is None else (
        f" >= {low}" if high is None else f" <= {high}" if low is None else f" in {low}..{high}")

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            _fail(f"must be an integer{where}, got {text!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            _fail(f"must be an integer{where}, got {value}")
        return value

    return parse


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Callable[[str], float]:
    """A finite float within the given bounds (``nan`` and ``inf`` are always refused)."""
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high:g}")
    where = " " + " and ".join(parts) if parts else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            _fail(f"must be a finite number{where}, got {text!r}")
        if not math.isfinite(value):
            _fail(f"must be a finite number{where}, got {text!r}")
        if low is not None and (value < low or (low_open and value == low)):
            _fail(f"must be a finite number{where}, got {value:g}")
        if high is not None and (value > high or (high_open and value == high)):
            _fail(f"must be a finite number{where}, got {value:g}")
        return value

    return parse


def seed(text: str) -> int:
    return integer(0, MAX_SEED)(text)


def threads(text: str) -> int:
    return integer(1, MAX_THREADS)(text)


def utf8_text(text: str) -> str:
    """Text that is valid UTF-8 and not empty. Undecodable bytes on the command line reach
    Python as lone surrogates, which the tokenizer would reject with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = os.fsencode(text)[err.start:err.end + 3]
        _fail(f"is not valid UTF-8 (bytes {bad!r} at character {err.start})")
    if not text.strip():
        _fail("is empty")
    return text


def existing_path(text: str) -> str:
    if not Path(text).exists():
        _fail(f"{text!r} does not exist")
    return text


def existing_dir(text: str) -> str:
    path = Path(text)
    if not path.exists():
        _fail(f"{text!r} does not exist")
    if not path.is_dir():
        _fail(f"{text!r} is not a directory")
    return text


def existing_file(text: str) -> str:
    path = Path(text)
    if not path.exists():
        _fail(f"{text!r} does not exist")
    if not path.is_file():
        _fail(f"{text!r} is not a file")
    return text


def _writable_ancestor(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path``, if the process can create entries in it."""
    for parent in [path, *path.parents]:
        if parent.exists():
            return parent if parent.is_dir() and os.access(parent, os.W_OK | os.X_OK) else None
    return None


def output_dir(text: str) -> str:
    """A directory that exists and is writable, or can be created."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        _fail(f"{text!r} exists and is not a directory")
    if _writable_ancestor(path.absolute()) is None:
        _fail(f"{text!r} cannot be written (no permission, or a parent is not a directory)")
    return text


def result_dir(text: str) -> str:
    """``output_dir`` for a directory result, which is published by replacing the directory as a whole
    (``files.publish_dir``): not the current directory nor one holding it (that replacement would fail, or pull the
    directory out from under the running process, at the very end of the work)."""
    from .files import holds_current_directory  # the one check publish_dir makes too

    output_dir(text)
    if holds_current_directory(text) is not None:
        _fail(f"{text!r} is (or holds) the current directory; the result replaces its directory as a whole, so give "
              f"it a directory of its own")
    return text


def output_file(text: str) -> str:
    """A file path whose directory exists and is writable."""
    path = Path(text)
    if path.is_dir():
        _fail(f"{text!r} is a directory")
    parent = path.absolute().parent
    if not parent.is_dir():
        _fail(f"the directory of {text!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        _fail(f"{text!r} cannot be written (no permission)")
    return text


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``; CUDA only where torch sees a GPU."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        _fail(f"must be cpu, cuda or cuda:N, got {text!r}")
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            _fail(f"{text!r} was asked for but torch sees no CUDA device (torch {torch.__version__})")
        if index and int(index) >= torch.cuda.device_count():
            _fail(f"{text!r} does not exist: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return text


def require_module(parser: argparse.ArgumentParser, argument: str, module: str, install: str) -> None:
    """Refuse ``argument`` by name when the package it needs is not installed."""
    if importlib.util.find_spec(module) is None:
        parser.error(f"argument {argument}: needs the {module} package, which is not installed ({install})")


def refuse(parser: argparse.ArgumentParser, argument: str, message: str) -> NoReturn:
    """A check that needs several arguments, reported like a single argument's."""
    parser.error(f"argument {argument}: {message}")


def print_error(message: object) -> None:
    """Errors found after parsing (a model that does not fit): one line on stderr."""
    print(f"error: {message}", file=sys.stderr)
