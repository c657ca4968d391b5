"""DFlash2 drafter configuration, read from z-lab's published ``config.json`` layouts.

A DFlash2 config is a DFlash config (:class:`~tensorrt_llm_dflash.config.DFlashDraftConfig`) plus
the convolution and candidate-selector settings. Two layouts are published and both are read:

* **nested** (z-lab ``Muse-Glimmer-30B-DFlash2``; transformers 5 style): ``block_size`` and the
  DFlash2 keys inside ``dflash_config``; RoPE under ``rope_parameters``;
* **flat RoPE** (transformers 4 style): ``rope_theta`` / ``rope_scaling`` at the top level; the
  DFlash2 keys may also sit at the top level (the reference reads ``dflash_config`` first, then
  the top level), and so may ``block_size``.

A key given in two places with two values is refused, naming both. Everything this runtime
does not run the way the reference does is refused by name and value before any weight loads:
causal draft attention, a reduced draft vocabulary, a sliding window shorter than the block.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import DFlashDraftConfig, config_from_dir, is_integer, json_kind, read_json
from ..errors import DFlashConfigError

#: The ``architectures`` entry of a DFlash2 drafter.
ARCHITECTURE = "DFlash2DraftModel"
#: Required integer settings (all >= 1); where they live: ``dflash_config`` or the top level.
INT_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
#: Optional numeric settings and their defaults (the reference's).
FLOAT_KEYS = {"output_multiplier": 1.0, "input_embedding_scale": 1.0, "final_logit_softcapping": None}


@dataclass(frozen=True)
class DFlash2Settings:
    """What DFlash2 adds to DFlash (names as in ``dflash_config``)."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    output_multiplier: float = 1.0
    input_embedding_scale: float = 1.0
    #: tanh soft cap of the unary logits; None (or 0 in a config) means none, as in the reference.
    final_logit_softcapping: float | None = None


@dataclass
class DFlash2Config:
    """``base``: the DFlash part (layers, context features, block, MASK); ``dflash2``: the rest."""

    base: DFlashDraftConfig
    dflash2: DFlash2Settings
    #: config.json as read (saved back unchanged by ``save_dflash2_drafter``).
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlash2Config:
        if not isinstance(raw, dict):
            raise DFlashConfigError(f"drafter config.json must hold a JSON object, not {json_kind(raw)}")
        archs = raw.get("architectures")
        if not isinstance(archs, list) or ARCHITECTURE not in archs:
            raise DFlashConfigError(f"architectures={archs!r} is not a DFlash2 drafter (expected [{ARCHITECTURE!r}])")
        dflash = raw.get("dflash_config")
        if not isinstance(dflash, dict):
            raise DFlashConfigError(
                f"dflash_config={dflash!r} is invalid: a DFlash2 config needs it as an object "
                "(mask_token_id, target_layer_ids, conv_*, selector_*)"
            )
        settings = _settings(raw, dflash)
        base = DFlashDraftConfig.from_dict(_base_dict(raw, dflash))
        _check_supported(raw, base, settings)
        return cls(base=base, dflash2=settings, raw=dict(raw))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DFlash2Config:
        return config_from_dir(path, cls.from_dict)


def is_dflash2_config(raw: Any) -> bool:
    """Whether a parsed config.json declares a DFlash2 drafter (its ``architectures``)."""
    return isinstance(raw, dict) and isinstance(raw.get("architectures"), list) and ARCHITECTURE in raw["architectures"]


def is_dflash2_dir(path: str | Path) -> bool:
    """Whether ``path/config.json`` declares a DFlash2 drafter; False when it cannot be read (the
    DFlash loader then reports what is wrong with it)."""
    config_path = Path(path) / "config.json"
    try:
        return config_path.is_file() and is_dflash2_config(read_json(config_path, str(config_path)))
    except DFlashConfigError:
        return False


# ----------------------------------------------------------------------------- parsing


def _one_value(raw: dict[str, Any], dflash: dict[str, Any], key: str, default: Any = None) -> Any:
    """``dflash_config.key`` or top-level ``key`` (the reference's lookup order); both with two
    different values is refused."""
    inner, outer = dflash.get(key), raw.get(key)
    if inner is not None and outer is not None and inner != outer:
        raise DFlashConfigError(
            f"dflash_config.{key}={inner!r} and {key}={outer!r} disagree: give it once, or the same in both places"
        )
    return inner if inner is not None else (outer if outer is not None else default)


def _settings(raw: dict[str, Any], dflash: dict[str, Any]) -> DFlash2Settings:
    values: dict[str, Any] = {}
    for key in INT_KEYS:
        value = _one_value(raw, dflash, key)
        if value is None:
            raise DFlashConfigError(f"dflash_config.{key} is missing: a DFlash2 config must give it")
        if not is_integer(value) or value < 1:
            raise DFlashConfigError(f"dflash_config.{key}={value!r} is invalid: it must be an integer >= 1")
        values[key] = int(value)
    for key, default in FLOAT_KEYS.items():
        value = _one_value(raw, dflash, key, default)
        if value is None:
            values[key] = None
            continue
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
            raise DFlashConfigError(f"dflash_config.{key}={value!r} is invalid: it must be a finite number")
        values[key] = float(value)
    if values["output_multiplier"] <= 0:
        raise DFlashConfigError(
            f"dflash_config.output_multiplier={values['output_multiplier']!r} is not supported: it must be > 0 "
            "(a multiplier <= 0 reverses or erases the ranking of the candidates)"
        )
    cap = values["final_logit_softcapping"]
    if cap is not None and cap < 0:
        raise DFlashConfigError(
            f"dflash_config.final_logit_softcapping={cap!r} is not supported: it must be > 0, or 0 / null for none"
        )
    values["final_logit_softcapping"] = cap or None
    return DFlash2Settings(**values)


def _base_dict(raw: dict[str, Any], dflash: dict[str, Any]) -> dict[str, Any]:
    """The config as the DFlash loader reads it: ``block_size`` at the top level, RoPE flat, and
    the DFlash2-only keys out of the way (they are parsed by :func:`_settings`)."""
    out = {k: v for k, v in raw.items() if k not in INT_KEYS and k not in FLOAT_KEYS}
    out["dflash_config"] = {k: v for k, v in dflash.items() if k not in INT_KEYS and k not in FLOAT_KEYS}
    block = _one_value(raw, dflash, "block_size")
    out["dflash_config"].pop("block_size", None)
    if block is not None:
        out["block_size"] = block
    rope = raw.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, dict) or "rope_theta" not in rope:
            raise DFlashConfigError(f"rope_parameters={rope!r} is invalid: it must be an object with rope_theta")
        theta = rope["rope_theta"]
        if "rope_theta" in raw and raw["rope_theta"] != theta:
            raise DFlashConfigError(
                f"rope_parameters.rope_theta={theta!r} and rope_theta={raw['rope_theta']!r} disagree"
            )
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
        if raw.get("rope_scaling") is not None and raw["rope_scaling"] != scaling:
            raise DFlashConfigError(
                f"rope_parameters={rope!r} and rope_scaling={raw['rope_scaling']!r} disagree"
            )
        out.pop("rope_parameters")
        out["rope_theta"], out["rope_scaling"] = theta, scaling
    elif "rope_theta" not in raw:
        # The DFlash loader would assume 1e6; the reference's Qwen3 config another default. Neither is a guess
        # worth making for a drafter whose RoPE must match the one it was trained with.
        raise DFlashConfigError("rope_theta is missing: give rope_parameters.rope_theta or rope_theta")
    return out


def _check_supported(raw: dict[str, Any], base: DFlashDraftConfig, settings: DFlash2Settings) -> None:
    """What this runtime would not run as the reference does, refused by field and value."""
    causal = raw.get("is_causal")
    sliding = [i for i, kind in enumerate(base.layer_types) if kind == "sliding_attention"]
    if causal is not None and causal is not False:
        raise DFlashConfigError(
            f"is_causal={causal!r} is not supported: DFlash2 draft layers attend bidirectionally (is_causal=false)"
        )
    if causal is None and sliding:
        raise DFlashConfigError(
            f"is_causal is missing and layer_types[{sliding[0]}]='sliding_attention': the reference then runs that "
            "layer causally, which this runtime does not; set is_causal=false if the drafter was trained bidirectional"
        )
    if sliding and base.sliding_window < base.block_size:
        raise DFlashConfigError(
            f"sliding_window={base.sliding_window} is not supported with block_size={base.block_size}: the "
            "window must cover the block (published DFlash2 drafters use 2048)"
        )
    if base.draft_vocab_size is not None:
        raise DFlashConfigError(
            f"draft_vocab_size={base.draft_vocab_size} is not supported for DFlash2: its selector codebooks cover "
            "the whole vocabulary"
        )
    if base.hidden_size % settings.conv_group_size:
        raise DFlashConfigError(
            f"dflash_config.conv_group_size={settings.conv_group_size} does not divide hidden_size={base.hidden_size}"
        )
    if settings.selector_top_k > base.vocab_size:
        raise DFlashConfigError(
            f"dflash_config.selector_top_k={settings.selector_top_k} exceeds vocab_size={base.vocab_size}"
        )
