"""A training work directory belongs to one target and one data recipe.

Data shards and checkpoints are only meaningful for the target that produced them: a second
target of the same shape would happily resume the first one's data and checkpoint and
export a drafter trained on the wrong model. ``fingerprint.json`` in the work dir records
what the work was made with (the target's config, tokenizer and a hash of some weights; the
data settings; the drafter's shape) and :func:`claim_work_dir` refuses any mismatch by name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import DFlashConfigError
from ..files import atomic_write_json

FINGERPRINT_FILE = "fingerprint.json"
#: Held (flock) by the run working in a directory; it holds that run's pid, for the refusal's message.
LOCK_FILE = ".lock"
_HELD: set[str] = set()  # the work dirs this process holds
#: Config keys that describe how a model was loaded or saved, not which model it is.
_VOLATILE_CONFIG_KEYS = {"torch_dtype", "dtype", "_name_or_path", "transformers_version", "_attn_implementation",
                         "_attn_implementation_autoset", "attn_implementation", "_commit_hash", "use_cache"}
_ROWS = 16  # rows hashed from each sampled weight: enough to tell models apart, cheap for 70B targets


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def target_fingerprint(model: Any, tokenizer: Any) -> dict[str, Any]:
    """What identifies a target: config, tokenizer and a sample of its weights.

    Weights are sampled (a few rows of the embedding, the first and last layer and the
    output head), hashed in float32, so the same model loaded in another dtype from another
    file format still matches.
    """
    config = {k: v for k, v in sorted(model.config.to_dict().items()) if k not in _VOLATILE_CONFIG_KEYS}
    vocab = sorted(tokenizer.get_vocab().items())
    template = getattr(tokenizer, "chat_template", None) or ""
    digest = hashlib.sha256()
    layers = model.get_decoder().layers
    samples = [model.get_input_embeddings().weight, model.get_output_embeddings().weight,
               *[p for _, p in sorted(layers[0].named_parameters())][:2],
               *[p for _, p in sorted(layers[-1].named_parameters())][:2]]
    with torch.no_grad():
        for weight in samples:
            rows = torch.cat([weight[:_ROWS], weight[-_ROWS:]]).detach().to("cpu", torch.float32).contiguous()
            digest.update(rows.numpy().tobytes())
    return {
        "model_type": config.get("model_type"),
        "config_sha256": _sha256(json.dumps(config, sort_keys=True, default=str).encode()),
        "tokenizer_sha256": _sha256(json.dumps([vocab, template], ensure_ascii=False).encode()),
        "weights_sha256": digest.hexdigest(),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:20] + "...'"


def _differences(recorded: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(recorded) | set(current)):
        a, b = recorded.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {_short(a)} (recorded) != {_short(b)} (now)")
    return out


def claim_work_dir(work_dir: str | Path, fingerprint: dict[str, Any], renew: tuple[str, ...] = (),
                   argument: str = "--work_dir", adopt: bool = False, optional: tuple[str, ...] = ()) -> None:
    """Record ``fingerprint`` in a new work dir, or refuse one made for something else.

    ``fingerprint`` maps section names ("target", "data", "drafter") to plain dicts; the
    sections in ``renew`` are recorded anew instead of compared (the drafter's shape may
    change when training starts over with ``--no_resume``). A work dir that already holds
    data or a checkpoint but no fingerprint is refused too: what it was made with cannot be
    known, unless ``adopt`` (a data dir made by hand): it is then recorded for this target,
    with a warning. ``argument`` is the command-line flag the directory came from, for the messages.
    A section in ``optional`` that the recorded fingerprint lacks is recorded, not refused: a DFlash
    and a DFlash2 drafter train on one work dir's data, each with its own section ("drafter",
    "drafter_dflash2") and checkpoint, whichever ran first.
    """
    work = Path(work_dir)
    path = work / FINGERPRINT_FILE
    if path.is_file():
        try:
            recorded = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DFlashConfigError(f"{path} is damaged ({err}); delete the directory or use another {argument}") from None
        if not isinstance(recorded, dict):
            raise DFlashConfigError(f"{path} is damaged (not a JSON object); delete the directory or use another {argument}")
        added = [k for k in fingerprint if k in optional and k not in recorded]
        renew = (*renew, *added)
        compared = [k for k in fingerprint if k not in renew]
        diffs = _differences({k: recorded.get(k) for k in compared}, {k: fingerprint[k] for k in compared})
        if diffs:
            raise DFlashConfigError(
                f"{argument} {str(work)!r} was made for another target or recipe: " + "; ".join(diffs[:4])
                + ("; ..." if len(diffs) > 4 else "") + f". Use another {argument} (or delete this one)"
            )
        if any(recorded.get(k) != fingerprint[k] for k in renew if k in fingerprint):
            atomic_write_json(path, {**recorded, **{k: fingerprint[k] for k in renew if k in fingerprint}})
        return
    leftovers = [p.name for p in (work / "checkpoint.pt", work / "data") if p.exists()]
    leftovers += sorted(p.name for p in work.glob("shard_*.pt"))[:1]  # a bare data dir
    if leftovers and adopt:
        print(f"warning: {argument} {str(work)!r} has no {FINGERPRINT_FILE}: where its {leftovers} came from is "
              "unknown; it is recorded as made for this target from now on")
    elif leftovers:
        raise DFlashConfigError(
            f"{argument} {str(work)!r} holds {leftovers} but no {FINGERPRINT_FILE}, so what they were made "
            f"from is unknown: use another {argument} (or delete this one)"
        )
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, fingerprint)


@contextlib.contextmanager
def hold_work_dir(work_dir: str | Path, argument: str = "--work_dir") -> Iterator[None]:
    """One run at a time in a work directory: two would write the same shards, checkpoint and log, each
    resuming from whatever the other saved last. An advisory lock (``flock``) on ``LOCK_FILE``, released by
    the kernel when the process ends however it ends, so a killed run never leaves the directory locked.
    Creates the directory."""
    import fcntl

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    key = str(work.resolve())
    if key in _HELD:  # this process holds it already (a LoRA run whose --data_dir lies in its --work_dir)
        yield
        return
    fd = os.open(work / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    _HELD.add(key)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise DFlashConfigError(f"{argument} {str(work)!r} is in use by another run (pid {holder}): wait for it "
                                    f"to end, or give another {argument}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        _HELD.discard(key)
        os.close(fd)
