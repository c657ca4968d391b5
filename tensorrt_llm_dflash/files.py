"""Crash-safe writes: every file goes to a temporary name and is renamed into place, and a
directory result is built aside and swapped in only when complete.

A kill at any moment therefore leaves either the previous good file (directory) or the new
complete one, plus at worst a hidden temporary (``.NAME.tmp-*`` / ``.NAME.staging-*``) that
no loader reads and the next write of the same result removes.

Why fsync before the rename: without it a power cut can publish the new name before its
data reach the disk, which is the half-written file this module exists to prevent.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import ctypes.util
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import IO, Any

from .errors import DFlashInputError

_TMP_TAG = ".tmp-"
_STAGING_TAG = ".staging-"
_OLD_TAG = ".old-"


def _temp_sibling(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}{tag}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _usual_mode(path: Path) -> None:
    """safetensors creates its files 0600; a published file gets the mode ``open`` would give."""
    os.chmod(path, 0o666 & ~_current_umask())


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_stream(f: IO[Any], write: Callable[[IO[Any]], None]) -> None:
    """The one place bytes reach a temporary file (the kill tests slow it down)."""
    write(f)


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write; renamed onto ``path`` if the block succeeds,
    deleted if it fails (the caller fsyncs it: it alone knows how the file was written)."""
    tmp = _temp_sibling(path, _TMP_TAG)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def atomic_write(path: str | Path, write: Callable[[IO[Any]], None], binary: bool = True) -> Path:
    """Call ``write(f)`` on a temporary sibling of ``path``, then rename it onto ``path``."""
    path = Path(path)
    with _replacing(path) as tmp, open(tmp, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
        _write_stream(f, write)
        f.flush()
        os.fsync(f.fileno())
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text), binary=False)


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 2, **dumps_kwargs: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, **dumps_kwargs) + "\n")


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    import torch

    return atomic_write(path, lambda f: torch.save(obj, f))


def atomic_save_safetensors(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """safetensors ``save_file`` into a temporary sibling, then rename (no in-memory copy of
    the whole file, which matters for the multi-GB ranks of a converted checkpoint)."""
    from safetensors.torch import save_file

    path = Path(path)
    with _replacing(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
        _usual_mode(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    return path


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete the hidden temporaries a killed writer left in ``directory``; returns them."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in directory.iterdir():
        name = entry.name
        if name.startswith(".") and any(tag in name for tag in (_TMP_TAG, _STAGING_TAG, _OLD_TAG)):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()
            removed.append(entry)
    return removed


# ------------------------------------------------------------------ directory results

_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def _link_or_copy(source: str, target: str) -> None:
    """A carried-over file as a hard link (the same data, nothing copied), or a copy where links fail."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _is_owned(name: str, owned: Iterable[str]) -> bool:
    return any(fnmatch(name, pattern) for pattern in owned)


def holds_current_directory(path: str | Path) -> Path | None:
    """The current directory when ``path`` is it or holds it, else None: a directory result is published by
    replacing its directory as a whole, which would pull that directory out from under the running process (and
    a relative ``.`` cannot be renamed at all). The one check behind every such refusal (``publish_dir``,
    ``trtllm/build.py``), each caller wording it for its own flag."""
    here = Path.cwd().resolve()
    resolved = Path(path).resolve()
    return here if resolved == here or resolved in here.parents else None


@contextlib.contextmanager
def publish_dir(final: str | Path, owned: Iterable[str]) -> Iterator[Path]:
    """Build a directory result in a staging directory; publish it only if the block succeeds.

    ``owned`` are glob patterns of the files this kind of result consists of. Files of an
    earlier result that match them and are not rewritten disappear (stale shards of a
    conversion with more ranks, an old ``model.safetensors.index.json``); anything else
    the user keeps in the directory (a model card, notes, whole subdirectories: the models
    a conversion read, a training run's work directory) is carried over, subdirectories as
    hard-linked copies (no data copied; a plain copy where links cannot be made), so the
    old directory holds them until the new one does. On Linux the old and new directories
    are exchanged in one atomic rename; elsewhere the window is two renames, and the loser
    of a kill inside it is a hidden ``.NAME.old-*`` sibling.

    The current directory, or one holding it, is refused before the block runs: it would be
    replaced under the running process (and a relative ``.`` cannot be renamed at all).

    A symbolic link to a directory is published through: the directory it points at is replaced and
    the link kept (replacing the link itself left a real directory in its place, the pointed-at one
    with the old result, and the link under a hidden staging name).
    """
    final = Path(final).absolute()
    here = holds_current_directory(final)
    if here is not None:
        raise DFlashInputError(f"{final}: a directory result replaces its directory as a whole, and this one is (or "
                               f"holds) the current directory {here}; write it to a directory of its own")
    if final.is_symlink():
        final = final.resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}{_STAGING_TAG}*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in final.parent.glob(f".{final.name}{_OLD_TAG}*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = _temp_sibling(final, _STAGING_TAG)
    staging.mkdir()
    try:
        yield staging
        owned = list(owned)
        for entry in staging.iterdir():
            if entry.is_file() and not entry.stat().st_mode & 0o044:
                _usual_mode(entry)
        if final.is_dir():
            for entry in final.iterdir():
                target = staging / entry.name
                if _is_owned(entry.name, owned) or target.exists() or target.is_symlink():
                    continue
                if entry.is_symlink() or not entry.is_dir():
                    shutil.copy2(entry, target, follow_symlinks=False)
                else:
                    shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
        for entry in staging.iterdir():
            if entry.is_file() and not entry.is_symlink():
                with open(entry, "rb") as f:
                    os.fsync(f.fileno())
        _fsync_dir(staging)
        if final.is_dir():
            if _exchange(staging, final):
                shutil.rmtree(staging, ignore_errors=True)  # now holds the previous result
            else:
                old = _temp_sibling(final, _OLD_TAG)
                os.rename(final, old)
                os.rename(staging, final)
                shutil.rmtree(old, ignore_errors=True)
        elif final.exists():
            raise FileExistsError(f"{final} exists and is not a directory")
        else:
            os.rename(staging, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ------------------------------------------------------------------ reading text files

# Longest first: the UTF-32 LE mark starts with the UTF-16 LE one.
_FOREIGN_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32 (little-endian)"), (codecs.BOM_UTF32_BE, "UTF-32 (big-endian)"),
                 (codecs.BOM_UTF16_LE, "UTF-16 (little-endian)"), (codecs.BOM_UTF16_BE, "UTF-16 (big-endian)"))


def utf8_text(data: bytes, path: Path, kind: str) -> str:
    """A file's bytes as text; anything but UTF-8 is a DFlashInputError naming the file, the
    line and the problem (``kind``: "prompt", "dataset": whose files must be UTF-8)."""
    for bom, name in _FOREIGN_BOMS:
        if data.startswith(bom):
            raise DFlashInputError(f"{path}: the file is {name} encoded (it starts with a {name} byte-order mark); "
                                   f"{kind} files must be UTF-8: convert it, e.g. with iconv -t UTF-8")
    data = data.removeprefix(codecs.BOM_UTF8)  # a UTF-8 byte-order mark is harmless
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line, column = _line_column(data, err.start)
        raise DFlashInputError(f"{path}:{line}: not valid UTF-8 (byte 0x{data[err.start]:02x} at column {column}: "
                               f"{err.reason}); {kind} files must be UTF-8") from None
    if "\0" in text:  # never in JSON text; ASCII in UTF-16/32 without a byte-order mark
        line, column = _line_column(data, data.index(b"\0"))
        raise DFlashInputError(f"{path}:{line}: a NUL byte at column {column}: the file looks UTF-16 or UTF-32 "
                               f"encoded without a byte-order mark; {kind} files must be UTF-8")
    return text


def _line_column(data: bytes, offset: int) -> tuple[int, int]:
    """1-based line and byte column of ``offset``."""
    return data.count(b"\n", 0, offset) + 1, offset - (data.rfind(b"\n", 0, offset) + 1) + 1


# ------------------------------------------------------------------ packed weights

#: Weights this package ships xz-compressed (``model.safetensors.xz``): bf16 weights lose ~30% to xz,
#: which keeps the checkout and the wheel small. Loaders see a plain directory through unpacked().
PACKED_SUFFIX = ".xz"


def cache_root() -> Path:
    """``$TENSORRT_LLM_DFLASH_CACHE`` or ``~/.cache/tensorrt_llm_dflash``: what this package derives once and keeps."""
    return Path(os.environ.get("TENSORRT_LLM_DFLASH_CACHE") or Path.home() / ".cache" / "tensorrt_llm_dflash")


def _packed(directory: Path) -> list[Path]:
    """The ``*.safetensors.xz`` files of a directory that have no unpacked sibling."""
    return sorted(p for p in directory.glob(f"*.safetensors{PACKED_SUFFIX}")
                  if not (directory / p.name[: -len(PACKED_SUFFIX)]).exists())


def unpacked(directory: str | Path) -> Path:
    """``directory`` itself, or, where it holds packed weights, a plain copy of it in the cache.

    The copy (``<cache_root>/unpacked/<name>-<digest of the packed files>``) is made once: built aside
    and renamed into place complete, so a kill leaves no half directory, and two processes unpacking
    at once both end with the same complete one. A damaged archive is a DFlashInputError naming it.
    """
    import hashlib
    import lzma

    directory = Path(directory)
    packed = _packed(directory) if directory.is_dir() else []
    if not packed:
        return directory
    digest = hashlib.sha256()
    for file in packed:
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    final = cache_root() / "unpacked" / f"{directory.name}-{digest.hexdigest()[:16]}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = _temp_sibling(final, _STAGING_TAG)
    staging.mkdir()
    try:
        for entry in directory.iterdir():
            if entry in packed:
                try:
                    with lzma.open(entry) as src, open(staging / entry.name[: -len(PACKED_SUFFIX)], "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                        dst.flush()
                        os.fsync(dst.fileno())
                except (lzma.LZMAError, EOFError) as err:
                    raise DFlashInputError(f"packed weights {entry} are damaged ({err}): reinstall the package or "
                                           "restore the file") from err
            elif entry.is_file() and not entry.name.startswith("."):
                shutil.copy2(entry, staging / entry.name)
        _fsync_dir(staging)
        try:
            os.rename(staging, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(staging, ignore_errors=True)  # another process published the same copy first
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final
