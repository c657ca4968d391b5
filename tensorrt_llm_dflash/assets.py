"""Assets shipped inside the package: the demo drafter for the embedded SmolLM2 target."""

from __future__ import annotations

from pathlib import Path

from .errors import DFlashError
from .files import PACKED_SUFFIX, unpacked

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEMO_DRAFTER_DIR = ASSETS_DIR / "smollm2-135m-instruct-dflash"
#: A drafter for the embedded target from scratch (the first run of the chain that made the
#: shipped one; the model card lists them all), offered when no demo drafter ships.
DEMO_DRAFTER_COMMAND = (
    "python examples/train_dflash.py --output_dir tensorrt_llm_dflash/assets/smollm2-135m-instruct-dflash "
    "--work_dir runs/smollm2 --chat_share 0 --data_minutes 44 --train_minutes 41 --precision bf16 --lr 2e-3"
)
#: DDTree budget for the demo drafter on a CPU (see README: "Choosing a budget").
DEMO_DDTREE_BUDGET = 8


def demo_drafter_dir() -> Path | None:
    """The shipped demo drafter as a plain drafter directory, or None if this checkout has none yet.

    Its weights ship xz-compressed (files.unpacked): the first call unpacks them into the cache."""
    weights = DEMO_DRAFTER_DIR / "model.safetensors"
    packed = weights.with_name(weights.name + PACKED_SUFFIX)
    if (DEMO_DRAFTER_DIR / "config.json").is_file() and (weights.is_file() or packed.is_file()):
        return unpacked(DEMO_DRAFTER_DIR)
    return None


def resolve_drafter_dir(draft_model_dir: str | None, target_model_dir: str | None, alternative: str) -> str:
    """The drafter to load: the given one, else the demo drafter (only for the embedded target).

    ``alternative`` tells the user what else to run when no demo drafter ships.
    """
    if draft_model_dir is not None:
        return draft_model_dir
    if target_model_dir is not None:
        raise DFlashError("--draft_model_dir is required with --target_model_dir (the demo drafter only fits "
                          "the embedded SmolLM2 target)")
    found = demo_drafter_dir()
    if found is None:
        raise DFlashError(f"no demo drafter ships in this checkout; train one with:\n  {DEMO_DRAFTER_COMMAND}\n"
                          f"or {alternative}")
    return str(found)
