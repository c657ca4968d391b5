"""DFlash2: DFlash with grouped dynamic convolutions and a candidate selector (z-lab/dflash).

``config`` reads z-lab's published config.json layouts, ``loader`` their safetensors,
``model`` is the drafter, ``selector`` the candidate selector (chain, sparse draft
distribution, rejection sampling), ``tree`` the DFlash2 draft tree, ``proposer`` the drafter's
side of the decode loop. docs/dflash2.md has the whole picture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import DFlashConfigError
from .config import ARCHITECTURE, DFlash2Config, DFlash2Settings, is_dflash2_config, is_dflash2_dir
from .loader import check_dflash2_dir, load_dflash2_drafter, save_dflash2_drafter
from .model import DFlash2DraftModel
from .proposer import DFlash2Proposer
from .selector import SelectorDraft
from .tree import build_dflash2_tree

__all__ = [
    "ARCHITECTURE", "DFlash2Config", "DFlash2DraftModel", "DFlash2Proposer", "DFlash2Settings", "SelectorDraft",
    "build_dflash2_tree", "check_dflash2_dir", "check_drafter_checkpoint", "check_drafter_dir", "is_dflash2_config",
    "is_dflash2_dir", "load_drafter", "load_dflash2_drafter", "proposer_for_target", "save_dflash2_drafter",
]


def check_drafter_dir(path: str | Path) -> Any:
    """A drafter directory's config (DFlash or DFlash2, by its architectures), checked before any
    weight loads; a DFlash2 directory's tensor names and shapes are checked from the headers too."""
    if is_dflash2_dir(path):
        return check_dflash2_dir(path)
    _refuse_undeclared_dflash2(path)
    from ..config import DFlashDraftConfig

    return DFlashDraftConfig.from_pretrained(path)


def check_drafter_checkpoint(path: str | Path) -> Any:
    """:func:`check_drafter_dir` plus a DFlash directory's tensor names and shapes from its safetensors headers (no
    weight read), so a checkpoint that does not match its config is refused before the target, whose load can take
    minutes, not after it."""
    config = check_drafter_dir(path)
    if not isinstance(config, DFlash2Config):  # a DFlash2 directory's headers were checked already
        from ..drafter import check_tensor_shapes
        from .loader import read_header_shapes

        check_tensor_shapes(config, read_header_shapes(Path(path)), path)
    return config


def _refuse_undeclared_dflash2(path: str | Path) -> None:
    """A config with DFlash2 settings whose ``architectures`` does not declare DFlash2 would be read as a DFlash
    drafter and refused for a field it does not need (``block_size`` nested in ``dflash_config``) or for its
    convolution and selector tensors; name the field that decides instead."""
    from ..config import read_json
    from .config import INT_KEYS

    config_path = Path(path) / "config.json"
    try:
        raw = read_json(config_path, str(config_path)) if config_path.is_file() else None
    except DFlashConfigError:  # the DFlash loader reports an unreadable config.json by name
        return
    if not isinstance(raw, dict):
        return
    nested = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    keys = [k for k in INT_KEYS if k in nested or k in raw]
    if keys:
        raise DFlashConfigError(
            f"{config_path}: architectures={raw.get('architectures')!r} is not a list holding {ARCHITECTURE!r}, but "
            f"the config gives the DFlash2 settings {keys}: a DFlash2 drafter needs architectures=[{ARCHITECTURE!r}]"
        )


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Any:
    """A DFlash or DFlash2 drafter, by its config's architectures (the DFlash loader is unchanged)."""
    if is_dflash2_dir(path):
        return load_dflash2_drafter(path, dtype=dtype, device=device)
    _refuse_undeclared_dflash2(path)
    from ..drafter import load_dflash_drafter

    return load_dflash_drafter(path, dtype=dtype, device=device)


def proposer_for_target(drafter: Any, target: Any) -> Any:
    """The proposer that runs ``drafter`` (DFlash or DFlash2) on ``target``."""
    if isinstance(drafter, DFlash2DraftModel):
        return DFlash2Proposer.for_target(drafter, target)
    from ..proposer import DFlashProposer

    return DFlashProposer.for_target(drafter, target)
