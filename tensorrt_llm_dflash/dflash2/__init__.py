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

from .config import ARCHITECTURE, DFlash2Config, DFlash2Settings, is_dflash2_config, is_dflash2_dir
from .loader import check_dflash2_dir, load_dflash2_drafter, save_dflash2_drafter
from .model import DFlash2DraftModel
from .proposer import DFlash2Proposer
from .selector import SelectorDraft
from .tree import build_dflash2_tree

__all__ = [
    "ARCHITECTURE", "DFlash2Config", "DFlash2DraftModel", "DFlash2Proposer", "DFlash2Settings", "SelectorDraft",
    "build_dflash2_tree", "check_dflash2_dir", "check_drafter_dir", "is_dflash2_config", "is_dflash2_dir",
    "load_drafter", "load_dflash2_drafter", "proposer_for_target", "save_dflash2_drafter",
]


def check_drafter_dir(path: str | Path) -> Any:
    """A drafter directory's config (DFlash or DFlash2, by its architectures), checked before any
    weight loads; a DFlash2 directory's tensor names and shapes are checked from the headers too."""
    if is_dflash2_dir(path):
        return check_dflash2_dir(path)
    from ..config import DFlashDraftConfig

    return DFlashDraftConfig.from_pretrained(path)


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Any:
    """A DFlash or DFlash2 drafter, by its config's architectures (the DFlash loader is unchanged)."""
    if is_dflash2_dir(path):
        return load_dflash2_drafter(path, dtype=dtype, device=device)
    from ..drafter import load_dflash_drafter

    return load_dflash_drafter(path, dtype=dtype, device=device)


def proposer_for_target(drafter: Any, target: Any) -> Any:
    """The proposer that runs ``drafter`` (DFlash or DFlash2) on ``target``."""
    if isinstance(drafter, DFlash2DraftModel):
        return DFlash2Proposer.for_target(drafter, target)
    from ..proposer import DFlashProposer

    return DFlashProposer.for_target(drafter, target)
