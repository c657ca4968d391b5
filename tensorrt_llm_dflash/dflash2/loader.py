"""Load and save DFlash2 drafters in z-lab's published layout (config.json + safetensors).

Tensors: everything a DFlash drafter has (``drafter.expected_tensor_shapes``), plus per layer
``layers.{i}.{attention,mlp}_conv.base_kernel`` [2, T, H] and ``...kernel_projection.weight``
[2*T*(H/group), H], and ``candidate_selector.hidden_projection.weight`` [r, H],
``candidate_selector.{predecessor,successor}_codebook`` [V, r]. The codebooks are raw tensors in
the published files; a checkpoint saved from the reference's modules names them ``...codebook.weight``,
and that is read too.

Names and shapes are checked from the safetensors headers alone, so a malformed checkpoint (a
missing codebook, a ``selector_rank`` its tensors do not have) is refused by name before any
weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..drafter import (
    check_safetensors_file,
    check_tensor_values,
    checkpoint_files,
    checksum_metadata,
    expected_tensor_shapes,
    read_safetensors_dir,
)
from ..errors import DFlashConfigError
from ..files import atomic_save_safetensors, atomic_write_json, unpacked
from .config import DFlash2Config
from .model import DFlash2DraftModel

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def expected_dflash2_shapes(config: DFlash2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DFlash2 checkpoint, with the config field its shape follows (for messages)."""
    base, s = config.base, config.dflash2
    h, groups = base.hidden_size, base.hidden_size // s.conv_group_size
    shapes = dict(expected_tensor_shapes(base))
    for i in range(base.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, s.conv_kernel_size, h)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * s.conv_kernel_size * groups, h)
    shapes["candidate_selector.hidden_projection.weight"] = (s.selector_rank, h)
    for name in CODEBOOKS:
        shapes[name] = (base.vocab_size, s.selector_rank)
    return shapes


def _implied_by(name: str) -> str:
    if name.startswith("candidate_selector."):
        return "dflash_config.selector_rank, vocab_size and hidden_size"
    if "_conv." in name:
        return "dflash_config.conv_kernel_size, dflash_config.conv_group_size and hidden_size"
    return "config.json"


def _canonical(name: str) -> str:
    """The published name of a tensor (``...codebook.weight`` -> ``...codebook``)."""
    for codebook in CODEBOOKS:
        if name == codebook + ".weight":
            return codebook
    return name


def read_header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every file of a checkpoint directory, from the headers only."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    path = unpacked(path)  # xz-packed weights (files.unpacked) read like plain ones
    for file_name in checkpoint_files(path):
        file = path / file_name
        check_safetensors_file(file, "drafter weights")
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in shapes:
                        raise DFlashConfigError(f"drafter tensor {name} appears in {file} and in another shard")
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as err:
            if isinstance(err, DFlashConfigError):
                raise
            raise DFlashConfigError(f"drafter weights {file} cannot be read: {type(err).__name__}: {err}") from err
    return shapes


def check_dflash2_names(config: DFlash2Config, shapes: dict[str, tuple[int, ...]], source: object) -> dict[str, str]:
    """Check names and shapes against the config; returns stored name -> published name."""
    where = f"DFlash2 drafter checkpoint {source}"
    prefix = "model." if shapes and all(k.startswith("model.") for k in shapes) else ""
    renamed = {stored: _canonical(stored[len(prefix):]) for stored in shapes}
    expected = expected_dflash2_shapes(config)
    got: dict[str, tuple[int, ...]] = {}
    for stored, name in renamed.items():
        if name in got:
            raise DFlashConfigError(f"{where} holds {name} twice (with and without the .weight suffix)")
        got[name] = shapes[stored]
    missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or unexpected:
        parts = ([f"missing tensors {missing}"] if missing else []) + (
            [f"unexpected tensors {unexpected}"] if unexpected else [])
        raise DFlashConfigError(f"{where} does not match its config.json: " + "; ".join(parts))
    for name, shape in expected.items():
        if got[name] != shape:
            raise DFlashConfigError(
                f"tensor {name} has shape {got[name]}, but {_implied_by(name)} in config.json imply {shape} "
                f"({where}: selector_rank={config.dflash2.selector_rank}, conv_kernel_size="
                f"{config.dflash2.conv_kernel_size}, conv_group_size={config.dflash2.conv_group_size})"
            )
    return renamed


def check_dflash2_dir(path: str | Path) -> DFlash2Config:
    """Config and tensor names/shapes of a DFlash2 drafter directory, without reading any weight."""
    path = Path(path)
    config = DFlash2Config.from_pretrained(path)
    check_dflash2_names(config, read_header_shapes(path), path)
    return config


def load_dflash2_drafter(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DFlash2DraftModel:
    """Load a DFlash2 drafter directory (z-lab layout); every fault is a DFlashConfigError naming it."""
    path = Path(path)
    config = DFlash2Config.from_pretrained(path)
    renamed = check_dflash2_names(config, read_header_shapes(path), path)
    tensors = {renamed[name]: t for name, t in read_safetensors_dir(path).items()}
    check_tensor_values(tensors, path)
    model = DFlash2DraftModel(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # Only the rotary buffers are not in a checkpoint; the names were checked above.
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model.to(device=device, dtype=dtype).eval()


def save_dflash2_drafter(model: DFlash2DraftModel, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json (as read, dtype updated) and model.safetensors with the published names."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = expected_dflash2_shapes(model.full_config)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items() if k in names}
    check_tensor_values(state, source=f"the drafter being exported to {path}")
    atomic_save_safetensors(state, path / "model.safetensors", metadata=checksum_metadata(state))
    raw = dict(model.full_config.raw, dtype=str(dtype).replace("torch.", ""))
    atomic_write_json(path / "config.json", json.loads(json.dumps(raw)), indent=2)
