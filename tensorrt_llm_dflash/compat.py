"""Every difference between the transformers (and numpy) releases this project runs on, in one place.

Supported: transformers 4.57.3 (what TensorRT-LLM 1.2.1 pins) through the newest 5.x, numpy 1.26
through 2.x. Code elsewhere in the package calls these helpers instead of the version-specific
API, so a new transformers release that moves something again is fixed here, once.

Each helper names the transformers file whose change it absorbs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import transformers

#: The major version decides; 4.57 is the last 4.x and the oldest release supported.
TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])

# --------------------------------------------------------------------------------------------- RoPE
# transformers/modeling_rope_utils.py: 5.x dropped "default" from ROPE_INIT_FUNCTIONS (each model's
# rotary module computes it itself now) and moved `rope_theta` / `rope_scaling` into one
# `rope_parameters` dict ({"rope_type", "rope_theta", ...}); a 5.x config object has no `rope_theta`
# attribute and its `rope_scaling` is an alias of `rope_parameters`, so it is never None.


def rope_types() -> list[str]:
    """Every RoPE type transformers can compute, "default" included (sorted)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return sorted({"default", *ROPE_INIT_FUNCTIONS})


def rope_type_of(scaling: Mapping[str, Any] | None) -> Any:
    """The type a rope_scaling / rope_parameters object names ("type" is the pre-4.45 key)."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def _default_inv_freq(theta: float, head_dim: int, partial_rotary_factor: float = 1.0) -> torch.Tensor:
    # The formula of transformers 4.57's _compute_default_rope_parameters, float32 as there, so that
    # both releases give bit-identical frequencies.
    dim = int(head_dim * partial_rotary_factor)
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def rope_inv_freq(*, hidden_size: int, num_attention_heads: int, head_dim: int, rope_theta: float,
                  rope_scaling: Mapping[str, Any] | None, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention scaling) exactly as transformers computes them.

    ``rope_scaling`` is a 4.x-style object (``{"rope_type": "llama3", "factor": ...}``) or None; it
    is never modified. Raises what transformers raises for a missing or mistyped parameter.
    """
    rope_type = rope_type_of(rope_scaling)
    if rope_type == "default":
        return _default_inv_freq(float(rope_theta), int(head_dim)), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise KeyError(f"unknown rope type {rope_type!r}")
    # Qwen3Config stores (4.x) or aliases and fills in (5.x, as rope_parameters) the dict it is given:
    # a deep copy keeps the caller's config untouched.
    hf_config = Qwen3Config(hidden_size=hidden_size, num_attention_heads=num_attention_heads, head_dim=head_dim,
                            rope_theta=rope_theta, rope_scaling=copy.deepcopy(dict(rope_scaling or {})),
                            max_position_embeddings=max_position_embeddings)
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv_freq, float(attention_scaling)


def config_rope(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) of a transformers config object, on 4.x and 5.x alike.

    rope_scaling comes back 4.x-style: None for plain RoPE, else a dict without ``rope_theta``.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, Mapping) and params:
        layer_types = set(getattr(config, "layer_types", None) or ())
        if layer_types and set(params) <= layer_types:
            # 5.x nests parameters per layer type when they differ; the text decoders this project
            # drafts for use one set: take the full-attention one.
            params = params.get("full_attention") or next(iter(params.values()))
        theta = params.get("rope_theta", getattr(config, "rope_theta", None))
        return _theta(theta), _scaling_without_theta(params)
    theta = getattr(config, "rope_theta", None)
    scaling = getattr(config, "rope_scaling", None)
    return _theta(theta), _scaling_without_theta(scaling)


def raw_config_rope(raw: Mapping[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta or None when absent, rope_scaling or None) of a config.json object.

    5.x's ``save_pretrained`` writes only ``rope_parameters`` (theta inside it); 4.x writes a flat
    ``rope_theta`` and ``rope_scaling``. Both are read; a flat key wins where both exist.
    """
    params = raw.get("rope_parameters")
    params = params if isinstance(params, Mapping) else {}
    theta = raw.get("rope_theta", params.get("rope_theta"))
    scaling = raw.get("rope_scaling")
    if scaling is None and params:
        scaling = _scaling_without_theta(params)
    return theta, scaling


def _theta(theta: Any) -> float:
    return 10000.0 if theta is None else float(theta)


def _scaling_without_theta(scaling: Any) -> dict[str, Any] | None:
    if not isinstance(scaling, Mapping) or not scaling:
        return None
    out = {k: copy.deepcopy(v) for k, v in scaling.items() if k != "rope_theta"}
    if rope_type_of(out) == "default" and set(out) <= {"rope_type", "type"}:
        return None
    return out


# ----------------------------------------------------------------------------------- tokenizers
def chat_token_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *,
                   add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat through the tokenizer's template.

    transformers/tokenization_utils_base.py: 5.x's ``apply_chat_template(tokenize=True)`` returns a
    BatchEncoding (``return_dict=True`` by default) where 4.x returned the id list; iterating it
    yields the key names. Both shapes are accepted here (and any tokenizer-like object).
    """
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if isinstance(out, torch.Tensor):
        out = out.reshape(-1).tolist()
    if out and isinstance(out[0], list | tuple):  # a batch of one
        out = out[0]
    return [int(t) for t in out]


# ------------------------------------------------------------------------------------- caches
def crop_cache(cache: Any, length: int) -> None:
    """Crop a DynamicCache to its first ``length`` positions.

    transformers/cache_utils.py: ``DynamicCache.crop(positive)`` is deprecated in 5.17 and refused
    from 5.18; a negative argument (drop that many from the end) means the same on 4.57 and 5.x.
    ``crop(0)`` would empty the cache, so an already short enough cache is left alone.
    """
    drop = int(cache.get_seq_length()) - int(length)
    if drop > 0:
        cache.crop(-drop)


# ----------------------------------------------------------------------------------- generate
def generate_kwargs() -> dict[str, Any]:
    """Keyword arguments that make ``model.generate`` honour only the arguments it is given.

    transformers/generation/utils.py: 4.57 merges the model's generation_config defaults unless
    ``use_model_defaults=False``; 5.x dropped that argument (and refuses it).
    """
    return {"use_model_defaults": False} if TRANSFORMERS_MAJOR < 5 else {}


# -------------------------------------------------------------------------------------- saving
def drop_gguf_quantizer(model: Any) -> None:
    """Make a GGUF-loaded model saveable: its weights are already dequantized, the quantizer object is not
    serializable.

    transformers/modeling_utils.py (5.x): ``from_pretrained(gguf_file=...)`` keeps an ``hf_quantizer``
    and a ``quantization_config`` on the model and config, which ``save_pretrained`` then tries to
    write; 4.57 kept neither.
    """
    if getattr(model, "hf_quantizer", None) is not None and "gguf" in type(model.hf_quantizer).__name__.lower():
        model.hf_quantizer = None
        if hasattr(model, "is_quantized"):
            try:
                model.is_quantized = False
            except AttributeError:  # a read-only property in some releases: nothing to clear then
                pass
    config = getattr(model, "config", None)
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, Mapping) else getattr(qc, "quant_method", None)
    if qc is not None and "gguf" in str(method).lower():
        try:
            delattr(config, "quantization_config")
        except AttributeError:
            config.quantization_config = None


# ------------------------------------------------------------------------------- forward kwargs
def _cache_kwarg() -> str:
    # transformers/utils/generic.py, modeling_outputs.py (5.2x): forward's `past_key_values` became `cache`
    # (the old name is deprecated, removed in 5.40) and outputs carry `.cache`; 4.57 through 5.1x know only
    # `past_key_values`.
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


#: The keyword a transformers forward (model or decoder layer) takes its KV cache by.
CACHE_KWARG = _cache_kwarg()


def output_cache(output: Any) -> Any:
    """The KV cache a transformers forward returned (``.cache`` on new releases, ``.past_key_values`` before)."""
    return getattr(output, CACHE_KWARG)
