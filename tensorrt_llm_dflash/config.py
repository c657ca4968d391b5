"""DFlash drafter configuration in the published z-lab / SpecForge / Model-Optimizer format.

A drafter directory holds ``config.json`` and ``model.safetensors``. The config is a
Qwen3-style decoder config plus ``block_size`` and a ``dflash_config`` block with
``mask_token_id`` and (optionally) ``target_layer_ids``.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import DFlashConfigError
from .files import atomic_write_json

#: Smallest DFlash block: the bonus token and one MASK.
MIN_BLOCK_SIZE = 2
#: Largest accepted block. Published drafters use 16 (z-lab ``*-b16``); 128 leaves 8x headroom
#: while keeping the per-step work bounded: the drafter runs ``block_size`` queries and scores
#: ``block_size - 1`` rows over the vocabulary (127 x 152k fp32 logits = 77 MB for Qwen3), and
#: ``block_size - 1`` stays inside the TensorRT-LLM engine's draft limit (MAX_ENGINE_DRAFT_LEN = 256).
#: A config with ``block_size`` 100000 used to run for minutes and take gigabytes before dying.
MAX_BLOCK_SIZE = 128


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


# Field schema: name -> (kind, nullable, minimum, maximum). Integers must be integers (not
# booleans, not floats such as 576.0 or 16.7, not strings such as "576"); numbers must be
# finite. head_dim may be null: __post_init__ derives it from hidden_size.
_INT, _NUM, _BOOL, _STR = "integer", "number", "boolean", "string"
_SCHEMA: dict[str, tuple[str, bool, int | None, int | None]] = {
    "hidden_size": (_INT, False, 1, None),
    "intermediate_size": (_INT, False, 1, None),
    "num_hidden_layers": (_INT, False, 1, None),
    "num_attention_heads": (_INT, False, 1, None),
    "num_key_value_heads": (_INT, False, 1, None),
    "vocab_size": (_INT, False, 1, None),
    "block_size": (_INT, False, MIN_BLOCK_SIZE, MAX_BLOCK_SIZE),
    "mask_token_id": (_INT, False, 0, None),
    "num_target_layers": (_INT, True, 1, None),
    "head_dim": (_INT, True, 1, None),
    "rms_norm_eps": (_NUM, False, None, None),  # > 0
    "rope_theta": (_NUM, False, None, None),  # > 0
    "max_position_embeddings": (_INT, False, 1, None),
    "sliding_window": (_INT, True, 1, None),
    "attention_bias": (_BOOL, False, None, None),
    "hidden_act": (_STR, False, None, None),
    "draft_vocab_size": (_INT, True, 1, None),
    "model_type": (_STR, False, None, None),
    "dtype": (_STR, True, None, None),  # informational: the loader's dtype argument decides
}
# Where a field lives in config.json, for messages.
_JSON_NAME = {"mask_token_id": "dflash_config.mask_token_id", "target_layer_ids": "dflash_config.target_layer_ids"}


def read_json(path: Path, label: str) -> Any:
    """A JSON file's content; an unreadable or malformed file is a DFlashConfigError led by ``label``."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DFlashConfigError(f"{label} is not valid JSON: {err}") from err
    except (OSError, UnicodeDecodeError) as err:
        raise DFlashConfigError(f"{label} cannot be read: {type(err).__name__}: {err}") from err


def is_integer(value: Any) -> bool:
    """A true integer: int (numpy ints too), never bool, never a float such as 576.0."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def json_kind(value: Any) -> str:
    """The JSON name of a value's type with its article ("a string", "an array"), for messages."""
    kind = _json_kind(value)
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        return "string"
    if isinstance(value, numbers.Integral):
        return "integer"
    if isinstance(value, numbers.Real):
        return "number"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _check_field(name: str, value: Any) -> None:
    """Raise DFlashConfigError naming the field and its value unless it fits _SCHEMA."""
    kind, nullable, low, high = _SCHEMA[name]
    where = _JSON_NAME.get(name, name)
    if value is None:
        if nullable:
            return
        raise DFlashConfigError(f"{where}=null is invalid: it must be {_describe(name)}")
    if kind == _INT:
        typed = is_integer(value)
        ok = typed and (low is None or value >= low) and (high is None or value <= high)
    elif kind == _NUM:
        typed = isinstance(value, numbers.Real) and not isinstance(value, bool)
        ok = typed and math.isfinite(value) and value > 0
    else:
        typed = ok = isinstance(value, bool if kind == _BOOL else str)
    if not ok:
        found = "" if typed else f", not {json_kind(value)}"
        raise DFlashConfigError(f"{where}={value!r} is invalid: it must be {_describe(name)}{found}")


def _describe(name: str) -> str:
    kind, nullable, low, high = _SCHEMA[name]
    if name == "block_size":
        text = (f"an integer in {low}..{high} (a block is the bonus token plus at least one MASK; "
                "published drafters use 16)")
    elif kind == _INT:
        text = "a non-negative integer" if low == 0 else f"an integer >= {low}"
    elif kind == _NUM:
        text = "a finite number > 0"
    else:
        text = f"a {kind}"
    return text + (" or null" if nullable else "")


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
        self._check_schema()  # before anything is derived from the fields
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
            if self.head_dim < 1:
                raise DFlashConfigError(
                    f"head_dim is not set and hidden_size={self.hidden_size} // num_attention_heads="
                    f"{self.num_attention_heads} is 0"
                )
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.target_layer_ids = list(self.target_layer_ids)
        self.validate()

    # ------------------------------------------------------------------ checks
    def _check_schema(self) -> None:
        """Types and ranges of every field (the table _SCHEMA, plus the structured fields)."""
        for name in _SCHEMA:
            _check_field(name, getattr(self, name))
        ids = self.target_layer_ids
        if not isinstance(ids, (list, tuple)):
            raise DFlashConfigError(
                f"dflash_config.target_layer_ids={ids!r} is invalid: it must be an array of non-negative "
                f"integers, not {json_kind(ids)}"
            )
        for i, layer in enumerate(ids):
            if not is_integer(layer) or layer < 0:
                raise DFlashConfigError(
                    f"dflash_config.target_layer_ids={list(ids)!r} is invalid: entry {i} is {layer!r}, "
                    "not a non-negative integer"
                )
        if self.layer_types is not None and (
            not isinstance(self.layer_types, (list, tuple)) or not all(isinstance(k, str) for k in self.layer_types)
        ):
            raise DFlashConfigError(
                f"layer_types={self.layer_types!r} is invalid: it must be an array of strings or null"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise DFlashConfigError(
                f"rope_scaling={self.rope_scaling!r} is invalid: it must be an object or null, not "
                f"{json_kind(self.rope_scaling)}"
            )
        if not isinstance(self.extra, dict):
            raise DFlashConfigError(f"extra={self.extra!r} must be a dict")

    def _check_rope_scaling(self) -> None:
        """rope_scaling must name a RoPE type transformers knows and carry what that type needs."""
        if self.rope_scaling is None:
            return
        from .compat import rope_inv_freq, rope_type_of, rope_types

        scaling = self.rope_scaling
        rope_type = rope_type_of(scaling)
        if not isinstance(rope_type, str) or rope_type not in rope_types():
            raise DFlashConfigError(
                f"rope_scaling={scaling!r} is invalid: its type {rope_type!r} is not one of {rope_types()}"
            )
        if rope_type == "default":
            return
        # Compute the frequencies once, exactly as the drafter will: a missing or mistyped
        # parameter (factor, original_max_position_embeddings, ...) is caught here, by name.
        import logging

        # transformers' own advisory warnings are logged once, when the drafter is built.
        rope_logger = logging.getLogger("transformers.modeling_rope_utils")
        level = rope_logger.level
        rope_logger.setLevel(logging.ERROR)
        try:
            rope_inv_freq(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                          head_dim=self.head_dim, rope_theta=self.rope_theta, rope_scaling=scaling,
                          max_position_embeddings=self.max_position_embeddings)
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as err:
            raise DFlashConfigError(
                f"rope_scaling={scaling!r} is invalid for rope type {rope_type!r}: {type(err).__name__}: {err}"
            ) from err
        finally:
            rope_logger.setLevel(level)

    def validate(self) -> None:
        self._check_schema()
        if self.head_dim % 2:
            raise DFlashConfigError(
                f"head_dim={self.head_dim} is invalid: RoPE rotates pairs of dimensions, so it must be even"
            )
        if self.block_size > self.max_position_embeddings:
            raise DFlashConfigError(
                f"block_size={self.block_size} is invalid: it exceeds max_position_embeddings="
                f"{self.max_position_embeddings}"
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
        self._check_rope_scaling()

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
        if self.num_target_layers is not None and self.num_target_layers != num_hidden_layers:
            # Its hidden size and vocabulary may still agree (Qwen3-14B and -32B do): the drafter would run, exact
            # but reading features of layers it was never trained on, and accept next to nothing.
            raise DFlashConfigError(
                f"num_target_layers={self.num_target_layers}: this drafter was made for a target of "
                f"{self.num_target_layers} layers, but the target has num_hidden_layers={num_hidden_layers}; "
                f"pair it with its own target (or, to run this pairing anyway, set num_target_layers to "
                f"{num_hidden_layers} in the drafter's config.json)"
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
        """Build from a parsed config.json; every field is type- and range-checked by name."""
        if not isinstance(raw, dict):
            raise DFlashConfigError(
                f"drafter config.json must hold a JSON object, not {json_kind(raw)}: {_short(raw)}"
            )
        raw = dict(raw)
        dflash = raw.pop("dflash_config", None)
        if dflash is None:
            dflash = {}
        if not isinstance(dflash, dict):
            raise DFlashConfigError(
                f"dflash_config={_short(dflash)} is invalid: it must be an object, not {json_kind(dflash)}"
            )
        dflash = dict(dflash)
        required = [
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
        ]
        archs = raw.get("architectures")
        hint = ""
        if "block_size" not in raw and isinstance(archs, list) and "DFlashDraftModel" not in archs:
            hint = f" (architectures={archs!r}: this looks like a target model, not a DFlash drafter)"
        missing = [k for k in required if k not in raw]
        if missing:
            raise DFlashConfigError(f"drafter config.json is missing {missing}{hint}")
        if "block_size" not in raw:
            raise DFlashConfigError(f"drafter config.json is missing block_size{hint}")
        if "mask_token_id" not in dflash:
            raise DFlashConfigError("drafter config.json is missing dflash_config.mask_token_id")
        # Checked before they are used to derive target_layer_ids (int() would truncate 2.9).
        num_layers = raw.pop("num_hidden_layers")
        _check_field("num_hidden_layers", num_layers)
        num_target_layers = raw.pop("num_target_layers", None)
        _check_field("num_target_layers", num_target_layers)
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise DFlashConfigError(
                    "drafter config.json has neither dflash_config.target_layer_ids nor "
                    "num_target_layers"
                )
            layer_ids = build_target_layer_ids(num_target_layers, num_layers)
        params = raw.get("rope_parameters")
        if isinstance(params, dict) and ("rope_theta" in params or "rope_type" in params):
            # A config written by transformers 5.x keeps RoPE only under rope_parameters; read it as the
            # flat rope_theta / rope_scaling pair this config (and z-lab's format) uses.
            from .compat import raw_config_rope

            theta, scaling = raw_config_rope(raw)
            raw.pop("rope_parameters")
            if theta is not None:
                raw["rope_theta"] = theta
            raw["rope_scaling"] = scaling
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in raw.items():
            (kwargs if key in known else extra)[key] = value
        if "torch_dtype" in extra and "dtype" not in kwargs:
            kwargs["dtype"] = extra.pop("torch_dtype")
        if kwargs.get("num_key_value_heads") is None:  # absent or null: multi-head attention (HF rule)
            kwargs["num_key_value_heads"] = raw.get("num_attention_heads")
        if kwargs.get("layer_types") is None:
            kwargs.pop("layer_types", None)
        for name in ("mask_token_id", "target_layer_ids"):
            kwargs.pop(name, None)
        extra["dflash_config"] = {
            k: v for k, v in dflash.items() if k not in ("mask_token_id", "target_layer_ids")
        }
        return cls(
            num_hidden_layers=num_layers,
            num_target_layers=num_target_layers,
            mask_token_id=dflash["mask_token_id"],
            target_layer_ids=layer_ids,
            extra=extra,
            **kwargs,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DFlashDraftConfig:
        return config_from_dir(path, cls.from_dict)

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
        """Write ``config.json`` atomically (a temporary file renamed into place)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(path) / "config.json", self.to_dict(), indent=2)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def config_from_dir(path: str | Path, parse: Any) -> Any:
    """``parse(config.json)`` of a drafter directory (DFlash or DFlash2); a fault names the file."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise DFlashConfigError(f"drafter directory {str(path)!r} has no config.json")
    raw = read_json(config_path, str(config_path))
    try:
        return parse(raw)
    except DFlashConfigError as err:
        raise DFlashConfigError(f"{config_path}: {err}") from err
