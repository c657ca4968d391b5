"""HF target + DFlash drafter -> TensorRT-LLM checkpoint (``config.json`` + ``rank{N}.safetensors``).

Plain torch + safetensors: this module never imports tensorrt or tensorrt_llm, so a
checkpoint can be converted (and tested) on a machine without them.

Target tensor names and TP rules follow TensorRT-LLM 1.2.1's own converters
(NVIDIA/TensorRT-LLM):

* ``tensorrt_llm/models/qwen/convert.py::convert_hf_qwen`` and
  ``tensorrt_llm/models/qwen/utils.py::get_qwen_key_list``:
  ``mlp.gate`` <- ``mlp.up_proj``, ``mlp.fc`` <- ``mlp.gate_proj``, ``mlp.proj`` <-
  ``mlp.down_proj``, ``attention.dense`` <- ``self_attn.o_proj``, ``attention.qkv`` =
  ``cat(split(q), split(k), split(v))`` per rank, KV heads duplicated with
  ``dup_kv_weight`` when ``num_key_value_heads < tp_size``, Qwen3 ``q_norm``/``k_norm``
  -> ``attention.q_layernorm``/``attention.k_layernorm``, ``post_attention_layernorm`` ->
  ``post_layernorm``, ``model.norm`` -> ``transformer.ln_f``, ``lm_head`` padded with zero
  rows to ``pad_vocab_size(vocab, tp)`` and split on dim 0 (tied embeddings copy the
  embedding), ``transformer.vocab_embedding`` unsplit (``use_parallel_embedding=False``).
* ``tensorrt_llm/models/convert_utils.py``: ``split`` (equal chunks, ``torch.split``),
  ``dup_kv_weight`` (each KV head repeated ``tp // kv_heads`` times, head by head).
* ``tensorrt_llm/models/llama/convert.py`` uses the same names and rules for Llama.
* Config fields: ``tensorrt_llm/models/modeling_utils.py::PretrainedConfig.__init__``,
  ``tensorrt_llm/models/qwen/config.py::QWenConfig`` (``qwen_type``, ``attn_bias``,
  ``rotary_base``, ``rotary_scaling``, ...), ``tensorrt_llm/models/llama/config.py::LLaMAConfig``.

Drafter tensors live under ``dflash.`` with the same per-layer names as the target
(``dflash.layers.{i}.attention.qkv.weight`` ...) and the same TP rules, so the engine
builds the draft layers from TensorRT-LLM's own ``Attention``/``GatedMLP`` modules.
The feature projection ``dflash.fc`` and the norms are replicated on every rank: the
captured target hidden states are full (replicated after the row-parallel all-reduce),
so a replicated ``fc`` needs no communication. A reduced draft vocabulary adds
``dflash.lm_head.weight`` (the draft rows of the target lm_head, padded and split like
``lm_head``) and ``dflash.d2t`` (int32, replicated).

A DFlash2 drafter (``tensorrt_llm_dflash/dflash2``, z-lab's layout, read by its own loader)
converts into the same checkpoint plus ``dflash.dflash2`` in config.json (its convolution and
selector settings, ``dflash2_support.py``) and, replicated on every rank, its published tensors
under ``dflash.``: ``layers.{i}.{attention,mlp}_conv.base_kernel`` [2, taps, H] and
``...kernel_projection.weight`` [2 * taps * H / group, H] (the convolutions act on the full
hidden state, after the row-parallel all-reduce), ``candidate_selector.hidden_projection.weight``
[rank, H] and ``candidate_selector.{predecessor,successor}_codebook`` [vocab, rank] (raw tensors,
as published; ``...codebook.weight`` is read too and written without the suffix).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..compat import raw_config_rope
from ..config import DFlashDraftConfig
from ..errors import DFlashConfigError
from .constants import ARCHITECTURE, MAX_ENGINE_DRAFT_LEN
from .dflash2_support import check_section, engine_section

DRAFTER_PREFIX = "dflash."
SUPPORTED_TARGETS = {"qwen3": "qwen", "qwen2": "qwen", "llama": "llama", "mistral": "llama"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Same rule as ``tensorrt_llm/_utils.py::pad_vocab_size``: round up to a multiple of tp."""
    return (vocab_size + tp_size - 1) // tp_size * tp_size


# ------------------------------------------------------------------------ TP rules


def split(tensor: torch.Tensor, tp_size: int, rank: int, dim: int = 0) -> torch.Tensor:
    """``convert_utils.split``: equal chunks along ``dim``; refuses uneven shapes."""
    if tp_size == 1:
        return tensor
    if tensor.shape[dim] % tp_size:
        raise DFlashConfigError(
            f"cannot split a tensor of shape {tuple(tensor.shape)} on dim {dim} into tp_size={tp_size} parts"
        )
    return tensor.split(tensor.shape[dim] // tp_size, dim=dim)[rank].clone()


def dup_kv_heads(weight: torch.Tensor, num_kv_heads: int, tp_size: int) -> torch.Tensor:
    """``convert_utils.dup_kv_weight``: repeat each KV head so every rank holds one.

    Works for weights ``[kv * d, in]`` and biases ``[kv * d]``.
    """
    if tp_size % num_kv_heads:
        raise DFlashConfigError(
            f"tp_size={tp_size} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    reps = tp_size // num_kv_heads
    head = weight.shape[0] // num_kv_heads
    rest = weight.shape[1:]
    out = weight.reshape(num_kv_heads, 1, head, *rest).expand(num_kv_heads, reps, head, *rest)
    return out.reshape(num_kv_heads * reps * head, *rest).clone()


def fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int, tp_size: int,
              rank: int) -> torch.Tensor:
    """Rank-local ``attention.qkv``: ``cat(split(q), split(k), split(v))``, KV heads
    duplicated first when there are fewer than ranks (head groups stay together)."""
    if num_kv_heads < tp_size:
        k, v = dup_kv_heads(k, num_kv_heads, tp_size), dup_kv_heads(v, num_kv_heads, tp_size)
    elif num_kv_heads % tp_size:
        raise DFlashConfigError(f"num_key_value_heads={num_kv_heads} is not divisible by tp_size={tp_size}")
    return torch.cat([split(q, tp_size, rank), split(k, tp_size, rank), split(v, tp_size, rank)], dim=0)


# ------------------------------------------------------------------------- HF input


def read_hf_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory (single file or index-sharded). A truncated or
    damaged file is a DFlashConfigError naming it (safetensors' own error was a traceback)."""
    from ..drafter import checkpoint_files, read_safetensors_file

    tensors: dict[str, torch.Tensor] = {}
    for name in checkpoint_files(model_dir, "target", any_name=True):
        file_tensors, _ = read_safetensors_file(model_dir / name, "target weights")
        tensors.update(file_tensors)
    return tensors


@dataclass
class TargetSpec:
    """The target's sizes, read from its HF config.json."""

    model_type: str
    family: str  # "qwen" or "llama": which TensorRT-LLM config class the engine wraps
    hf_config: dict[str, Any]
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attn_bias: bool
    qk_layernorm: bool

    @classmethod
    def from_dir(cls, model_dir: Path) -> TargetSpec:
        path = model_dir / "config.json"
        if not path.is_file():
            raise DFlashConfigError(f"target directory {str(model_dir)!r} has no config.json")
        try:
            hf = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as err:
            raise DFlashConfigError(f"target {path} cannot be read ({err})") from None
        except json.JSONDecodeError as err:
            raise DFlashConfigError(f"target {path} is not valid JSON ({err})") from None
        if not isinstance(hf, dict):
            raise DFlashConfigError(f"target {path} holds a JSON {type(hf).__name__}, a JSON object is required")
        model_type = str(hf.get("model_type", ""))
        if model_type not in SUPPORTED_TARGETS:
            raise DFlashConfigError(
                f"target model_type={model_type!r} is not supported; supported: {sorted(SUPPORTED_TARGETS)}"
            )

        def size(key: str, fallback: int | None = None) -> int:
            """A positive integer field; a missing or malformed one is named (it was a KeyError traceback)."""
            value = hf.get(key)
            if value is None or (fallback is not None and not value):  # HF writes null for "derive it"
                value = fallback
            if value is None:
                raise DFlashConfigError(f"target {path} has no {key}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DFlashConfigError(f"target {path} {key}={value!r}: a positive integer is required")
            return value

        heads = size("num_attention_heads")
        hidden = size("hidden_size")
        return cls(
            model_type=model_type,
            family=SUPPORTED_TARGETS[model_type],
            hf_config=hf,
            hidden_size=hidden,
            num_layers=size("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=size("num_key_value_heads", heads),
            head_size=size("head_dim", hidden // heads),
            intermediate_size=size("intermediate_size"),
            vocab_size=size("vocab_size"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases; Qwen3 and Llama only with attention_bias (qwen/config.py).
            attn_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_layernorm=model_type == "qwen3",
        )


# ------------------------------------------------------------------------- config


def trtllm_config(
    target: TargetSpec,
    drafter: DFlashDraftConfig,
    *,
    dtype: str,
    tp_size: int,
    pp_size: int,
    max_draft_len: int | None = None,
    dflash2: Any = None,
) -> dict[str, Any]:
    """The checkpoint's config.json: PretrainedConfig + QWenConfig/LLaMAConfig fields
    (as their ``from_hugging_face`` would set them) + a ``dflash`` section (with ``dflash2``,
    the DFlash2 settings, when ``dflash2`` is a drafter's ``DFlash2Settings``)."""
    hf = target.hf_config
    if max_draft_len is not None and (isinstance(max_draft_len, bool) or not isinstance(max_draft_len, int)
                                      or not drafter.block_size - 1 <= max_draft_len <= MAX_ENGINE_DRAFT_LEN):
        raise DFlashConfigError(
            f"max_draft_len={max_draft_len!r} is out of range {drafter.block_size - 1}..{MAX_ENGINE_DRAFT_LEN} "
            f"(block_size - 1 for the chain, at most {MAX_ENGINE_DRAFT_LEN} in a TensorRT-LLM engine)"
        )
    _hf_rope = raw_config_rope(hf)
    config: dict[str, Any] = {
        "architecture": ARCHITECTURE,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "num_hidden_layers": target.num_layers,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_size": target.head_size,
        "intermediate_size": target.intermediate_size,
        "hidden_act": hf.get("hidden_act", "silu"),
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
        # transformers 5.x writes RoPE only under rope_parameters; raw_config_rope reads either layout.
        "rotary_base": float(_hf_rope[0] if _hf_rope[0] is not None else 10000.0),
        "rotary_scaling": _hf_rope[1],
        "attn_bias": target.attn_bias,
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        "qk_layernorm": target.qk_layernorm,
        "tie_word_embeddings": target.tie_word_embeddings,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mapping": {"world_size": tp_size * pp_size, "tp_size": tp_size, "pp_size": pp_size},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        # Medusa-compatible fields (models/medusa/config.py): the runtime reads the
        # number of draft heads and the draft length like Medusa's.
        "num_medusa_heads": drafter.block_size - 1,
        "max_draft_len": max_draft_len if max_draft_len is not None else drafter.block_size - 1,
        # Which TensorRT-LLM target family the DFlash model wraps.
        "base_architecture": hf.get("architectures", ["?"])[0],
        "base_family": target.family,
    }
    if target.family == "qwen":
        # QWenDecoderLayer reads both (models/qwen/model.py); from_hugging_face sets them so.
        config["qwen_type"] = target.model_type
        config["seq_length"] = int(hf.get("seq_length", 8192))
    config["dflash"] = {
        "num_hidden_layers": drafter.num_hidden_layers,
        "hidden_size": drafter.hidden_size,
        "intermediate_size": drafter.intermediate_size,
        "num_attention_heads": drafter.num_attention_heads,
        "num_key_value_heads": drafter.num_key_value_heads,
        "head_size": drafter.head_dim,
        "block_size": drafter.block_size,
        "mask_token_id": drafter.mask_token_id,
        "target_layer_ids": list(drafter.target_layer_ids),
        "norm_epsilon": drafter.rms_norm_eps,
        "rotary_base": drafter.rope_theta,
        "rotary_scaling": drafter.rope_scaling,
        "max_position_embeddings": drafter.max_position_embeddings,
        "layer_types": list(drafter.layer_types),
        "sliding_window": drafter.sliding_window,
        "attn_bias": drafter.attention_bias,
        "hidden_act": drafter.hidden_act,
        "draft_vocab_size": drafter.draft_vocab_size,
    }
    if dflash2 is not None:
        config["dflash"]["dflash2"] = check_section(engine_section(dflash2), hidden_size=drafter.hidden_size,
                                                    vocab_size=drafter.vocab_size, where="dflash_config")
    return config


# ---------------------------------------------------------------------- converters


def _get(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise DFlashConfigError(f"checkpoint tensor {name!r} is missing")
    return tensors[name]


def interleave_heads(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """``[Q | K | V]`` blocks (``3 * heads * d`` rows) -> per head ``[q_h, k_h, v_h]``."""
    rows = qkv.shape[0] // (3 * heads)
    return qkv.reshape(3, heads, rows, *qkv.shape[1:]).transpose(0, 1).reshape(qkv.shape).contiguous()


def _layer_tensors(
    get: Callable[..., torch.Tensor | None],
    *,
    out_prefix: str,
    num_heads: int,
    num_kv_heads: int,
    qk_layernorm: bool,
    tp_size: int,
    rank: int,
    trtllm_attention: bool = True,
) -> dict[str, torch.Tensor]:
    """One decoder layer (target or drafter), HF names -> TensorRT-LLM names, rank-local.

    ``trtllm_attention``: the layer runs in TensorRT-LLM's ``Attention``. With q/k norms and
    as many KV heads as query heads on a rank, that layer reads the fused qkv per head as
    ``[heads, 3, head_size]`` (layers/attention.py, ``Attention.forward``, the
    ``num_attention_heads == num_attention_kv_heads`` branch), so the rows are interleaved
    per head there; the drafter's layers (model.py) read ``[Q | K | V]`` blocks.
    """
    out: dict[str, torch.Tensor] = {}
    q, k, v = get("self_attn.q_proj.weight"), get("self_attn.k_proj.weight"), get("self_attn.v_proj.weight")
    local_heads, local_kv = num_heads // tp_size, max(num_kv_heads // tp_size, 1)
    per_head = trtllm_attention and qk_layernorm and local_heads == local_kv > 1
    out["attention.qkv.weight"] = fused_qkv(q, k, v, num_kv_heads, tp_size, rank)
    if per_head:
        out["attention.qkv.weight"] = interleave_heads(out["attention.qkv.weight"], local_heads)
    qb = get("self_attn.q_proj.bias", optional=True)
    if qb is not None:
        kb, vb = get("self_attn.k_proj.bias"), get("self_attn.v_proj.bias")
        out["attention.qkv.bias"] = fused_qkv(qb, kb, vb, num_kv_heads, tp_size, rank)
        if per_head:
            out["attention.qkv.bias"] = interleave_heads(out["attention.qkv.bias"], local_heads)
    out["attention.dense.weight"] = split(get("self_attn.o_proj.weight"), tp_size, rank, dim=1)
    ob = get("self_attn.o_proj.bias", optional=True)
    if ob is not None:  # RowLinear adds its bias once, after the all-reduce: replicated
        out["attention.dense.bias"] = ob.clone()
    if qk_layernorm:
        out["attention.q_layernorm.weight"] = get("self_attn.q_norm.weight").clone()
        out["attention.k_layernorm.weight"] = get("self_attn.k_norm.weight").clone()
    # GatedMLP (tensorrt_llm/layers/mlp.py): act(fc(x)) * gate(x) -> proj, so fc is the
    # activated branch (HF gate_proj) and gate the linear one (HF up_proj).
    out["mlp.fc.weight"] = split(get("mlp.gate_proj.weight"), tp_size, rank, dim=0)
    out["mlp.gate.weight"] = split(get("mlp.up_proj.weight"), tp_size, rank, dim=0)
    out["mlp.proj.weight"] = split(get("mlp.down_proj.weight"), tp_size, rank, dim=1)
    out["input_layernorm.weight"] = get("input_layernorm.weight").clone()
    out["post_layernorm.weight"] = get("post_attention_layernorm.weight").clone()
    return {out_prefix + name: t for name, t in out.items()}


def _getter(tensors: dict[str, torch.Tensor], prefix: str) -> Callable[..., torch.Tensor | None]:
    def get(name: str, optional: bool = False) -> torch.Tensor | None:
        full = prefix + name
        if full not in tensors:
            if optional:
                return None
            raise DFlashConfigError(f"checkpoint tensor {full!r} is missing")
        return tensors[full]

    return get


def _padded_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if weight.shape[0] == rows:
        return weight
    pad = weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])
    return torch.cat([weight, pad], dim=0)


def convert_rank(
    target: TargetSpec,
    target_tensors: dict[str, torch.Tensor],
    drafter: DFlashDraftConfig,
    drafter_tensors: dict[str, torch.Tensor],
    *,
    tp_size: int,
    rank: int,
    dtype: torch.dtype,
    dflash2: Any = None,
) -> dict[str, torch.Tensor]:
    """All TensorRT-LLM tensors of one tensor-parallel rank (pp_size 1); ``dflash2`` (the
    drafter's ``DFlash2Settings``) adds its convolution and selector tensors."""
    out: dict[str, torch.Tensor] = {}
    embed = _get(target_tensors, "model.embed_tokens.weight")
    out["transformer.vocab_embedding.weight"] = embed.clone()
    for layer in range(target.num_layers):
        out.update(_layer_tensors(
            _getter(target_tensors, f"model.layers.{layer}."),
            out_prefix=f"transformer.layers.{layer}.", num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads, qk_layernorm=target.qk_layernorm, tp_size=tp_size, rank=rank,
        ))
    out["transformer.ln_f.weight"] = _get(target_tensors, "model.norm.weight").clone()
    if "lm_head.weight" in target_tensors:
        lm_head = target_tensors["lm_head.weight"]
    elif target.tie_word_embeddings:
        lm_head = embed
    else:
        raise DFlashConfigError("target has no lm_head.weight and tie_word_embeddings is false")
    padded = pad_vocab_size(target.vocab_size, tp_size)
    out["lm_head.weight"] = split(_padded_rows(lm_head, padded), tp_size, rank, dim=0)

    # Drafter: same layer names and rules under "dflash."; Qwen3-style layers always
    # carry q/k norms (drafter.py), whatever the target family.
    for layer in range(drafter.num_hidden_layers):
        out.update(_layer_tensors(
            _getter(drafter_tensors, f"layers.{layer}."),
            out_prefix=f"{DRAFTER_PREFIX}layers.{layer}.", num_heads=drafter.num_attention_heads,
            num_kv_heads=drafter.num_key_value_heads, qk_layernorm=True, tp_size=tp_size, rank=rank,
            trtllm_attention=False,
        ))
    for name in ("fc.weight", "hidden_norm.weight", "norm.weight"):
        out[DRAFTER_PREFIX + name] = _get(drafter_tensors, name).clone()
    if drafter.draft_vocab_size is not None:
        d2t = _get(drafter_tensors, "d2t").to(torch.int64)
        draft_ids = torch.arange(d2t.shape[0]) + d2t
        draft_rows = lm_head.index_select(0, draft_ids)
        draft_padded = pad_vocab_size(drafter.draft_vocab_size, tp_size)
        out[DRAFTER_PREFIX + "lm_head.weight"] = split(_padded_rows(draft_rows, draft_padded), tp_size, rank, dim=0)
    if dflash2 is not None:
        # Replicated: the convolutions mix the full hidden state (after the all-reduce), and the
        # selector scores the gathered logits of every rank alike.
        for name in sorted(dflash2_tensor_names(drafter)):
            out[DRAFTER_PREFIX + name] = _get(drafter_tensors, name).clone()
    converted = {name: _finite_as(name, t, dtype) for name, t in out.items()}
    if drafter.draft_vocab_size is not None:
        converted[DRAFTER_PREFIX + "d2t"] = _get(drafter_tensors, "d2t").to(torch.int32).contiguous()
    return converted


def _all_finite(tensor: torch.Tensor) -> bool:
    """A finite sum proves every element finite (one pass, no mask); an overflowing sum falls back to the test."""
    if tensor.numel() == 0:
        return True
    total = tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32)
    return math.isfinite(float(total)) or bool(torch.isfinite(tensor).all())


def _finite_as(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``, refused by name where a value is not finite: float16 stores anything past 65504
    as inf (silently), and a NaN or inf already in the source would reach the engine as it is (the drafter's
    weights are checked on load, the target's nowhere else). Either way the engine would compute NaNs."""
    converted = tensor.to(dtype).contiguous()
    if _all_finite(converted):
        return converted
    if not _all_finite(tensor):
        raise DFlashConfigError(f"{name} holds NaN or infinite values in the source checkpoint: it is damaged")
    largest = float(tensor.abs().max())
    raise DFlashConfigError(f"{name} has values beyond {str(dtype).removeprefix('torch.')}'s range (largest "
                            f"magnitude {largest:g} > {torch.finfo(dtype).max:g}): it would store them as inf; "
                            "convert with --dtype bfloat16 (or float32)")


def dflash2_tensor_names(drafter: DFlashDraftConfig) -> list[str]:
    """The DFlash2 tensors a converted checkpoint carries (published names, under ``dflash.``)."""
    names = [f"layers.{i}.{conv}.{part}" for i in range(drafter.num_hidden_layers)
             for conv in ("attention_conv", "mlp_conv") for part in ("base_kernel", "kernel_projection.weight")]
    return names + ["candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
                    "candidate_selector.successor_codebook"]


def _read_drafter_config(drafter_dir: Path) -> tuple[DFlashDraftConfig, Any]:
    """(DFlash part of the drafter's config, its whole DFlash2Config or None), from config.json alone.

    A DFlash2 directory (its ``architectures``) is checked against the engine's own limits here,
    named by the drafter's field."""
    from ..dflash2 import is_dflash2_dir

    if not is_dflash2_dir(drafter_dir):
        return DFlashDraftConfig.from_pretrained(drafter_dir), None
    from ..dflash2.config import DFlash2Config

    config = DFlash2Config.from_pretrained(drafter_dir)
    check_section(engine_section(config.dflash2), hidden_size=config.base.hidden_size,
                  vocab_size=config.base.vocab_size, where="dflash_config")
    return config.base, config


def _read_drafter_tensors(drafter_dir: Path, drafter: DFlashDraftConfig, dflash2_config: Any) -> dict[str, torch.Tensor]:
    """The drafter's tensors by published name; a DFlash2 drafter's names and shapes are checked from the
    headers before any weight is read (the DFlash2 loader's checks)."""
    from ..drafter import check_state_dict, check_tensor_values, read_safetensors_dir

    if dflash2_config is None:
        return check_state_dict(drafter, read_safetensors_dir(drafter_dir), source=drafter_dir)
    from ..dflash2.loader import check_dflash2_names, read_header_shapes

    renamed = check_dflash2_names(dflash2_config, read_header_shapes(drafter_dir), drafter_dir)
    tensors = {renamed[name]: t for name, t in read_safetensors_dir(drafter_dir).items()}
    check_tensor_values(tensors, drafter_dir)
    return tensors


def read_configs(target_dir: str | Path, drafter_dir: str | Path) -> tuple[TargetSpec, DFlashDraftConfig, Any]:
    """Both config.json files, the drafter checked against the target's sizes, without reading a weight:
    ``(target, DFlash part of the drafter's config, its DFlash2Config or None)``. A pair that cannot
    convert is refused here in seconds, not after both models are in memory."""
    target = TargetSpec.from_dir(Path(target_dir))
    drafter, dflash2_config = _read_drafter_config(Path(drafter_dir))
    drafter.validate_for_target(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                                num_hidden_layers=target.num_layers)
    return target, drafter, dflash2_config


def _read_tensors(
    target_dir: Path, drafter_dir: Path, target: TargetSpec, drafter: DFlashDraftConfig, dflash2_config: Any
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(target tensors, drafter tensors), with the checks that need them: the target's embedding
    rows (for the mask token) and the draft vocabulary's ``d2t``."""
    drafter_tensors = _read_drafter_tensors(drafter_dir, drafter, dflash2_config)
    target_tensors = read_hf_safetensors(target_dir)
    embed = _get(target_tensors, "model.embed_tokens.weight")
    drafter.validate_for_target(
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_hidden_layers=target.num_layers,
        embedding_rows=int(embed.shape[0]),
    )
    if drafter.draft_vocab_size is not None:
        ids = torch.arange(drafter.draft_vocab_size) + drafter_tensors["d2t"].to(torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size:
            raise DFlashConfigError(
                f"d2t maps draft tokens outside the target vocabulary 0..{target.vocab_size - 1}"
            )
    return target_tensors, drafter_tensors


def load_and_check(
    target_dir: str | Path, drafter_dir: str | Path
) -> tuple[TargetSpec, dict[str, torch.Tensor], DFlashDraftConfig, dict[str, torch.Tensor], Any]:
    """Read both checkpoints and refuse a drafter that does not fit the target. The last item is
    the drafter's ``DFlash2Settings`` (None for a DFlash drafter)."""
    target, drafter, dflash2_config = read_configs(target_dir, drafter_dir)
    target_tensors, drafter_tensors = _read_tensors(Path(target_dir), Path(drafter_dir), target, drafter,
                                                    dflash2_config)
    dflash2 = None if dflash2_config is None else dflash2_config.dflash2
    return target, target_tensors, drafter, drafter_tensors, dflash2


def check_parallelism(target: TargetSpec, drafter: DFlashDraftConfig, tp_size: int, pp_size: int) -> None:
    """Refuse mappings the TP rules cannot express, naming the size that does not divide."""
    if tp_size < 1 or pp_size < 1:
        raise DFlashConfigError(f"tp_size={tp_size} and pp_size={pp_size} must be >= 1")
    if pp_size != 1:
        raise DFlashConfigError(
            f"pp_size={pp_size} is not supported: the drafter reads target layers from every stage, "
            "so DFlash engines use tensor parallelism only (pp_size 1)"
        )
    for who, heads, kv, inter in (
        ("target", target.num_heads, target.num_kv_heads, target.intermediate_size),
        ("drafter", drafter.num_attention_heads, drafter.num_key_value_heads, drafter.intermediate_size),
    ):
        if heads % tp_size:
            raise DFlashConfigError(f"{who} num_attention_heads={heads} is not divisible by tp_size={tp_size}")
        if (kv < tp_size and tp_size % kv) or (kv >= tp_size and kv % tp_size):
            raise DFlashConfigError(f"{who} num_key_value_heads={kv} does not fit tp_size={tp_size}")
        if inter % tp_size:
            raise DFlashConfigError(f"{who} intermediate_size={inter} is not divisible by tp_size={tp_size}")


def resolve_dtype(dtype: str, target: TargetSpec) -> str:
    """The checkpoint dtype: ``dtype`` itself, or for "auto" the target's own (``torch_dtype``, or
    ``dtype`` in transformers 5), float32 when it names none."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise DFlashConfigError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
        return dtype
    key = "torch_dtype" if target.hf_config.get("torch_dtype") else "dtype"
    found = target.hf_config.get(key)
    if not found:
        return "float32"
    if str(found) not in DTYPES:
        raise DFlashConfigError(f"dtype='auto' reads the target's {key}={found!r}, which is not one of "
                                f"{sorted(DTYPES)}; pass --dtype")
    return str(found)


def iter_ranks(
    target_dir: str | Path,
    drafter_dir: str | Path,
    *,
    dtype: str = "auto",
    tp_size: int = 1,
    pp_size: int = 1,
    max_draft_len: int | None = None,
) -> Iterator[tuple[dict[str, Any], int, dict[str, torch.Tensor]]]:
    """Yield ``(config, rank, tensors)`` for every rank; the config is the same each time.

    Everything the configs decide (the pair, the mapping, the dtype, the draft length) is checked
    before a weight is read."""
    target, drafter, dflash2_config = read_configs(target_dir, drafter_dir)
    check_parallelism(target, drafter, tp_size, pp_size)
    dtype = resolve_dtype(dtype, target)
    dflash2 = None if dflash2_config is None else dflash2_config.dflash2
    config = trtllm_config(target, drafter, dtype=dtype, tp_size=tp_size, pp_size=pp_size,
                           max_draft_len=max_draft_len, dflash2=dflash2)
    target_tensors, drafter_tensors = _read_tensors(Path(target_dir), Path(drafter_dir), target, drafter,
                                                    dflash2_config)
    for rank in range(tp_size * pp_size):
        yield config, rank, convert_rank(target, target_tensors, drafter, drafter_tensors,
                                         tp_size=tp_size, rank=rank, dtype=DTYPES[dtype], dflash2=dflash2)


def convert_checkpoint(
    target_dir: str | Path,
    drafter_dir: str | Path,
    output_dir: str | Path,
    *,
    dtype: str = "auto",
    tp_size: int = 1,
    pp_size: int = 1,
    max_draft_len: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Write ``config.json`` and ``rank{N}.safetensors`` to ``output_dir``; returns the config.

    The checkpoint is built in a hidden staging directory and swapped in only when every rank
    and the config are written, so a failed or killed conversion leaves the previous
    checkpoint (or nothing), never a mix; rank files of an earlier conversion with more
    ranks do not survive a new one.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    from ..files import publish_dir

    for name, source in (("target", target_dir), ("drafter", drafter_dir)):
        # The checkpoint's config.json would replace the model's own (the command line refuses it too).
        if Path(output_dir).resolve() == Path(source).resolve():
            raise DFlashConfigError(f"output_dir={str(output_dir)!r} is the {name} directory; the checkpoint's "
                                    "config.json would replace the model's: give it a directory of its own")
    ranks = iter_ranks(target_dir, drafter_dir, dtype=dtype, tp_size=tp_size, pp_size=pp_size,
                       max_draft_len=max_draft_len)
    config: dict[str, Any] = {}
    with publish_dir(output_dir, CHECKPOINT_FILES) as staging:
        bar = tqdm(ranks, total=tp_size * pp_size, desc="converting ranks", unit="rank", disable=not progress)
        for rank_config, rank, tensors in bar:
            config = rank_config
            save_file(tensors, str(staging / f"rank{rank}.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    return config


#: The files of a converted checkpoint (what trtllm-build reads).
CHECKPOINT_FILES = ("config.json", "rank*.safetensors")
