"""DFlash drafter configuration in the published z-lab / SpecForge / Model-Optimizer format.

A drafter directory holds ``config.json`` and ``model.safetensors``. The config is a
Qwen3-style decoder config plus ``block_size`` and a ``dflash_config`` block with
``mask_token_id`` and (optionally) ``target_layer_ids``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import DFlashConfigError


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Which target decoder layers feed the drafter (upstream DFlash rule).

    One draft layer reads the middle layer; otherwise the ids are spread evenly over
    ``1 .. num_target_layers - 3``, rounded with Python's round (half to even).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashDraftConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    attention_bias: bool = False
    hidden_act: str = "silu"
    #: Reduced draft vocabulary (vLLM / EAGLE-3 convention): the drafter scores only
    #: ``draft_vocab_size`` tokens; tensor ``d2t`` maps draft index i to target id i + d2t[i].
    draft_vocab_size: int | None = None
    model_type: str = "qwen3"
    dtype: str = "bfloat16"
    #: Everything else found in config.json, kept so export round-trips.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        if self.block_size < 2:
            raise DFlashConfigError(
                f"block_size={self.block_size} is invalid: a DFlash block needs at least 2 "
                "tokens (the bonus token and one MASK)"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise DFlashConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers="
                f"{self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in ("full_attention", "sliding_attention"):
                raise DFlashConfigError(f"layer_types[{i}]={kind!r} is not supported")
            if kind == "sliding_attention" and not self.sliding_window:
                raise DFlashConfigError(
                    f"layer_types[{i}]='sliding_attention' needs sliding_window, got "
                    f"{self.sliding_window!r}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise DFlashConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not self.target_layer_ids:
            raise DFlashConfigError("dflash_config.target_layer_ids is empty")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise DFlashConfigError(
                f"draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size={self.vocab_size}"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise DFlashConfigError(f"hidden_act={self.hidden_act!r} is not supported (silu only)")

    def validate_for_target(
        self,
        *,
        hidden_size: int,
        vocab_size: int,
        num_hidden_layers: int,
        embedding_rows: int | None = None,
    ) -> None:
        """Raise DFlashConfigError if this drafter cannot run on the described target."""
        if self.hidden_size != hidden_size:
            raise DFlashConfigError(
                f"hidden_size mismatch: drafter hidden_size={self.hidden_size}, "
                f"target hidden_size={hidden_size}"
            )
        if self.vocab_size != vocab_size:
            raise DFlashConfigError(
                f"vocab_size mismatch: drafter vocab_size={self.vocab_size}, "
                f"target vocab_size={vocab_size}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < num_hidden_layers]
        if bad:
            raise DFlashConfigError(
                f"dflash_config.target_layer_ids={self.target_layer_ids} has {bad} outside the "
                f"target's layers 0..{num_hidden_layers - 1} (target num_hidden_layers="
                f"{num_hidden_layers})"
            )
        rows = vocab_size if embedding_rows is None else embedding_rows
        if not 0 <= self.mask_token_id < rows:
            raise DFlashConfigError(
                f"dflash_config.mask_token_id={self.mask_token_id} is outside the target's "
                f"embedding: valid ids are 0..{rows - 1} (target embedding rows={rows})"
            )

    @property
    def num_context_features(self) -> int:
        """Width of the concatenated target hidden states the drafter reads."""
        return len(self.target_layer_ids) * self.hidden_size

    # -------------------------------------------------------------- (de)serialize
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlashDraftConfig:
        raw = dict(raw)
        dflash = dict(raw.pop("dflash_config", None) or {})
        required = [
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
        ]
        missing = [k for k in required if k not in raw]
        if missing:
            raise DFlashConfigError(f"drafter config.json is missing {missing}")
        if "block_size" not in raw:
            raise DFlashConfigError("drafter config.json is missing block_size")
        if "mask_token_id" not in dflash:
            raise DFlashConfigError("drafter config.json is missing dflash_config.mask_token_id")
        num_layers = int(raw.pop("num_hidden_layers"))
        num_target_layers = raw.pop("num_target_layers", None)
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise DFlashConfigError(
                    "drafter config.json has neither dflash_config.target_layer_ids nor "
                    "num_target_layers"
                )
            layer_ids = build_target_layer_ids(int(num_target_layers), num_layers)
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in raw.items():
            (kwargs if key in known else extra)[key] = value
        if "torch_dtype" in extra and "dtype" not in kwargs:
            kwargs["dtype"] = extra.pop("torch_dtype")
        kwargs.setdefault("num_key_value_heads", raw.get("num_attention_heads"))
        if kwargs.get("layer_types") is None:
            kwargs.pop("layer_types", None)
        for name in ("mask_token_id", "target_layer_ids"):
            kwargs.pop(name, None)
        extra["dflash_config"] = {
            k: v for k, v in dflash.items() if k not in ("mask_token_id", "target_layer_ids")
        }
        return cls(
            num_hidden_layers=num_layers,
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=[int(i) for i in layer_ids],
            extra=extra,
            **kwargs,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DFlashDraftConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise DFlashConfigError(f"drafter directory {str(path)!r} has no config.json")
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as err:
            raise DFlashConfigError(f"{config_path} is not valid JSON: {err}") from err
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        extra = out.pop("extra")
        dflash = dict(extra.pop("dflash_config", {}) or {})
        dflash["mask_token_id"] = out.pop("mask_token_id")
        dflash["target_layer_ids"] = out.pop("target_layer_ids")
        out = {**extra, **out}
        out["architectures"] = ["DFlashDraftModel"]
        out["dflash_config"] = dflash
        out["use_sliding_window"] = "sliding_attention" in self.layer_types
        out["tie_word_embeddings"] = False
        return out

    def save(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")
