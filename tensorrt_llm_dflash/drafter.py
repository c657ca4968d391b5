"""The DFlash drafter: a few Qwen3-style layers whose K/V also see the target's context.

Equations (upstream DFlash; names match the published checkpoint tensors):

    ctx   = hidden_norm(fc(cat(target hidden states at target_layer_ids)))
    per layer, with h = input_layernorm(x) for the block only:
        q = q_norm(q_proj(h))                       # queries: block positions only
        k = k_norm(cat(k_proj(ctx), k_proj(h)))     # keys: context, then block
        v = cat(v_proj(ctx), v_proj(h))
        x = x + o_proj(attn(rope(q), rope(k), v))   # non-causal inside the block
        x = x + down_proj(silu(gate_proj(y)) * up_proj(y)),  y = post_attention_layernorm(x)
    out = norm(x)

``ctx`` is the same for every layer. The embedding and the lm_head are the target's.
Context K/V depend only on target features and frozen weights, so at inference they
are computed once per committed token and cached (:class:`DraftContextCache`); the
block's own K/V are never cached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .compat import rope_inv_freq
from .config import DFlashDraftConfig
from .errors import DFlashConfigError
from .files import atomic_save_safetensors, unpacked


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half precisions are normalised in float32; float32/float64 stay as they are so the
    # float64 tests are exact.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(_compute_dtype(dtype))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE with every rope_scaling type transformers knows (default, llama3, yarn, ...)."""

    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(
            hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
            head_dim=config.head_dim, rope_theta=config.rope_theta, rope_scaling=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )
        self.register_buffer("inv_freq", inv_freq.to(torch.float64), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        # model.to(dtype) / .bfloat16() cast every floating buffer, and bf16 frequencies turn the angle at
        # position p into p * round(inv_freq): 0.14 rad off at position 100, 2.8 rad at 2000. Follow the
        # move to another device, never the cast: the frequencies stay float64.
        exact = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = exact.to(device=self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [..., positions, head_dim] for integer ``positions``."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        freqs = positions.to(work)[..., None] * self.inv_freq.to(work)
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [batch, seq, head_dim]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashDraftConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None

    def _heads(self, x: torch.Tensor, proj: nn.Linear, heads: int) -> torch.Tensor:
        b, s, _ = x.shape
        return proj(x).view(b, s, heads, self.head_dim).transpose(1, 2)

    def key_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated, normalised keys and values for ``x`` [batch, seq, hidden]."""
        k = apply_rope(self.k_norm(self._heads(x, self.k_proj, self.num_kv_heads)), cos, sin)
        v = self._heads(x, self.v_proj, self.num_kv_heads)
        return k, v

    def forward(
        self,
        h_block: torch.Tensor,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_kv: tuple[torch.Tensor, torch.Tensor],
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        cos, sin = block_rope
        q = apply_rope(self.q_norm(self._heads(h_block, self.q_proj, self.num_heads)), cos, sin)
        k_block, v_block = self.key_values(h_block, cos, sin)
        k = torch.cat([context_kv[0], k_block], dim=2)
        v = torch.cat([context_kv[1], v_block], dim=2)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        mask = attention_mask
        if self.sliding_window is not None and (mask is None or isinstance(mask, torch.Tensor)):
            # Same rule as a causal sliding window: a key is visible while it is fewer
            # than `sliding_window` positions behind the query.
            too_far = (query_positions[:, :, None] - key_positions[:, None, :]) >= self.sliding_window
            if mask is None:
                mask = torch.zeros(too_far.shape, dtype=q.dtype, device=q.device)[:, None]
            mask = mask.masked_fill(too_far[:, None], torch.finfo(q.dtype).min)
        if mask is not None and not isinstance(mask, torch.Tensor):  # a flex-attention BlockMask (training)
            if self.sliding_window is not None:
                raise NotImplementedError("flex-attention training of sliding-window draft layers; use attention='dense'")
            from torch.nn.attention.flex_attention import flex_attention

            out = flex_attention(q, k, v, block_mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashDraftConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)


class DraftContextCache:
    """Per-layer context K/V of the drafter. Append-only: context never needs rollback."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions: torch.Tensor | None = None  # [batch, S]

    @property
    def length(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[1])

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)


class DFlashDraftModel(nn.Module):
    """DFlash draft layers (no embedding, no lm_head: both belong to the target)."""

    def __init__(self, config: DFlashDraftConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.fc = nn.Linear(config.num_context_features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        if config.draft_vocab_size is not None:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None

    def draft_token_ids(self) -> torch.Tensor | None:
        """Target ids of the reduced draft vocabulary, or None for the full vocabulary."""
        if self.d2t is None:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """[batch, S, len(target_layer_ids) * H] target hidden states -> [batch, S, H]."""
        return self.hidden_norm(self.fc(target_features))

    def extend_context(
        self, cache: DraftContextCache, target_features: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Append context K/V for newly committed tokens (features [batch, n, F])."""
        if target_features.shape[1] == 0:
            return
        ctx = self.project_context(target_features)
        cos, sin = self.rotary_emb(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_values(ctx, cos, sin)
            cache.append(i, k, v)
        cache.positions = positions if cache.positions is None else torch.cat([cache.positions, positions], 1)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        cache: DraftContextCache,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the block [batch, Q, H] against the cached context; returns norm(out).

        ``attention_mask`` is an additive [batch, 1, Q, S + Q] mask (training uses it to
        keep blocks apart); ``None`` means every query sees all context and all of the
        block, which is the inference rule.
        """
        x = block_embeds
        cos, sin = self.rotary_emb(block_positions, x.dtype)
        key_positions = block_positions if cache.positions is None else torch.cat([cache.positions, block_positions], 1)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            if cache.length:
                context_kv = (cache.keys[i], cache.values[i])
            else:
                empty = x.new_zeros(x.shape[0], layer.self_attn.num_kv_heads, 0, layer.self_attn.head_dim)
                context_kv = (empty, empty)
            x = x + layer.self_attn(h, (cos, sin), context_kv, block_positions, key_positions, attention_mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


# --------------------------------------------------------------------------- loading


def expected_tensor_shapes(config: DFlashDraftConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every tensor in a published DFlash checkpoint."""
    h, hd = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, config.num_context_features),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
        if config.draft_vocab_size is not None:
            shapes["d2t"] = (config.draft_vocab_size,)
        if config.attention_bias:
            for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", h)):
                shapes[p + f"self_attn.{name}.bias"] = (size,)
    return shapes


#: safetensors metadata key holding ``{tensor name: SHA-256 hex of its bytes as stored}`` (JSON).
CHECKSUM_KEY = "dflash_sha256"
#: Dtypes a drafter weight may have (a quantized checkpoint is not a DFlash drafter this runtime runs).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in safetensors layout (row-major, little-endian)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def check_safetensors_file(file: Path, what: str = "safetensors file") -> None:
    """Refuse a file that is truncated or whose header is damaged, naming it and the fault.

    Reads only the header (cheap for any size): the 8-byte header length, the JSON header,
    and whether the tensor data it describes exactly fills the rest of the file.
    """
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else None
            header_bytes = f.read(length) if length is not None and 8 + length <= size else b""
    except OSError as err:
        raise DFlashConfigError(f"{what} {file} cannot be read: {err}") from err
    if length is None:
        raise DFlashConfigError(f"{what} {file} is truncated or empty: it holds {size} bytes, not even the header")
    if 8 + length > size:
        raise DFlashConfigError(
            f"{what} {file} is truncated or corrupted: its header length field says {length} bytes, "
            f"the whole file holds {size}"
        )
    try:
        header = json.loads(header_bytes.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
        end = max(
            (int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"), default=0
        )
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError) as err:
        raise DFlashConfigError(f"{what} {file} is corrupted: its header cannot be parsed ({err})") from err
    data = size - 8 - length
    if data < end:
        raise DFlashConfigError(
            f"{what} {file} is truncated: its header describes {end} bytes of tensor data, the file holds "
            f"{data} ({size} bytes in all); download or export it again"
        )
    if data > end:
        raise DFlashConfigError(
            f"{what} {file} is corrupted: it holds {data - end} bytes after the {end} bytes of tensor data "
            "its header describes"
        )


def read_safetensors_file(file: Path, what: str = "safetensors file") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of one safetensors file; any fault is a DFlashConfigError naming it."""
    from safetensors import SafetensorError, safe_open

    check_safetensors_file(file, what)
    try:
        with safe_open(str(file), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as err:
        raise DFlashConfigError(f"{what} {file} cannot be read: {type(err).__name__}: {err}") from err
    return tensors, metadata


def verify_checksums(file: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bool:
    """Check every tensor against the SHA-256 saved with it; False when the file carries none."""
    raw = metadata.get(CHECKSUM_KEY)
    if raw is None:
        return False
    try:
        sums = json.loads(raw)
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise ValueError("not an object of tensor name -> hex digest")
    except ValueError as err:
        raise DFlashConfigError(
            f"{file}: metadata {CHECKSUM_KEY}={raw[:80]!r} is damaged ({err}); the file is corrupted"
        ) from err
    missing, unlisted = sorted(set(sums) - set(tensors)), sorted(set(tensors) - set(sums))
    if missing or unlisted:
        raise DFlashConfigError(
            f"{file} does not match the checksums saved with it (metadata {CHECKSUM_KEY}): tensors listed but "
            f"absent {missing}, present but unlisted {unlisted}; the file was edited or corrupted"
        )
    for name, tensor in tensors.items():
        digest = tensor_sha256(tensor)
        if digest != sums[name]:
            raise DFlashConfigError(
                f"tensor {name} in {file} is corrupted: its bytes have SHA-256 {digest}, the checksum saved "
                f"with it (metadata {CHECKSUM_KEY}) is {sums[name]}; download or export the drafter again"
            )
    return True


def checkpoint_files(path: Path, what: str = "drafter", any_name: bool = False) -> list[str]:
    """The safetensors files of a checkpoint directory: its index's (a damaged index, or one naming an absent
    file, is a DFlashConfigError naming it), else ``model.safetensors`` (``any_name``: every ``*.safetensors``,
    as an HF target may be saved). ``what`` names the checkpoint in the messages."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
            if not files or not all(isinstance(f, str) for f in files):
                raise ValueError(f"weight_map names no files: {weight_map!r}"[:200])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise DFlashConfigError(
                f"{what} index {index} is damaged: {type(err).__name__}: {err} (expected a JSON object with a "
                "weight_map of tensor name -> file)"
            ) from err
        absent = [f for f in files if not (path / f).is_file()]
        if absent:
            raise DFlashConfigError(f"{what} index {index} names files that are missing: {absent}")
        return files
    if any_name:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise DFlashConfigError(f"{what} directory {str(path)!r} has no *.safetensors files")
        return files
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise DFlashConfigError(f"{what} directory {str(path)!r} has no model.safetensors")


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded with an index).

    Each file is checked for truncation and a damaged header, and where it carries
    checksums (metadata ``dflash_sha256``, written by :func:`save_dflash_drafter`) every
    tensor's bytes are verified; a fault is a DFlashConfigError naming the file (and tensor).
    """
    path = unpacked(path)  # the shipped drafters' weights are xz-packed
    tensors: dict[str, torch.Tensor] = {}
    for name in checkpoint_files(path):
        file = path / name
        file_tensors, metadata = read_safetensors_file(file, "drafter weights")
        verify_checksums(file, file_tensors, metadata)
        twice = sorted(set(file_tensors) & set(tensors))
        if twice:
            raise DFlashConfigError(f"drafter tensors {twice} appear in {file} and in another shard")
        tensors.update(file_tensors)
    return tensors


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite. A NaN or an infinity anywhere makes the sum NaN or
    infinite, so a finite sum proves it (about 10x cheaper than isfinite on bf16); an infinite
    sum of finite values (overflow) falls back to the exact test."""
    if tensor.numel() == 0:
        return True
    total = tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32)
    return math.isfinite(float(total)) or bool(torch.isfinite(tensor).all())


def check_tensor_values(tensors: dict[str, torch.Tensor], source: Any = None) -> None:
    """Weights must be float (fp32/fp16/bf16/fp64) and finite; ``d2t`` must be integer."""
    where = "" if source is None else f" in {source}"
    for name, tensor in tensors.items():
        if name == "d2t":
            if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
                raise DFlashConfigError(
                    f"tensor d2t{where} has dtype {str(tensor.dtype).replace('torch.', '')}: it maps draft ids "
                    "to target ids and must have an integer dtype"
                )
            continue
        if tensor.dtype not in FLOAT_DTYPES:
            raise DFlashConfigError(
                f"tensor {name}{where} has dtype {str(tensor.dtype).replace('torch.', '')}: drafter weights must "
                "be float32, float16, bfloat16 or float64 (quantized drafters are not supported)"
            )
        if not _all_finite(tensor):
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            raise DFlashConfigError(
                f"tensor {name}{where} holds {nan} NaN and {inf} infinite values (of {tensor.numel()}): the "
                "checkpoint is corrupted or its training diverged"
            )


def check_state_dict(
    config: DFlashDraftConfig, tensors: dict[str, torch.Tensor], source: Any = None
) -> dict[str, torch.Tensor]:
    """Strip an optional ``model.`` prefix; check names and shapes exactly, dtypes and finiteness.

    ``source`` (the checkpoint directory) is named in the messages when given.
    """
    if tensors and all(k.startswith("model.") for k in tensors):
        tensors = {k[len("model."):]: v for k, v in tensors.items()}
    check_tensor_shapes(config, {k: tuple(v.shape) for k, v in tensors.items()}, source)
    check_tensor_values(tensors, source)
    return tensors


def check_tensor_shapes(config: DFlashDraftConfig, shapes: dict[str, tuple[int, ...]], source: Any = None) -> None:
    """Names and shapes of a DFlash checkpoint (tensor name -> shape; an optional ``model.`` prefix is stripped)
    against its config. Takes shapes alone so a directory can be checked from its safetensors headers before
    anything (the target included) is loaded."""
    where = "drafter checkpoint" if source is None else f"drafter checkpoint {source}"
    if shapes and all(k.startswith("model.") for k in shapes):
        shapes = {k[len("model."):]: v for k, v in shapes.items()}
    expected = expected_tensor_shapes(config)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if unexpected:
            parts.append(f"unexpected tensors {unexpected}")
        raise DFlashConfigError(f"{where} does not match its config.json: " + "; ".join(parts))
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise DFlashConfigError(
                f"tensor {name} has shape {tuple(shapes[name])}, config.json implies {shape}"
                + ("" if source is None else f" ({where})")
            )


def load_dflash_drafter(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DFlashDraftModel:
    """Load a drafter directory in the published z-lab / SpecForge format."""
    path = Path(path)
    config = DFlashDraftConfig.from_pretrained(path)
    tensors = check_state_dict(config, read_safetensors_dir(path), source=path)
    model = DFlashDraftModel(config)
    model.load_state_dict(tensors, strict=False)  # rotary buffers are not in checkpoints
    model = model.to(device=device, dtype=dtype).eval()
    if model.d2t is not None:
        model.d2t = tensors["d2t"].to(device=device, dtype=torch.long)
        ids = model.draft_token_ids()
        if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
            raise DFlashConfigError(
                f"tensor d2t in {path} maps draft tokens outside the vocabulary 0..{config.vocab_size - 1}"
            )
    return model


def save_dflash_drafter(model: DFlashDraftModel, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Export in the published format: config.json + model.safetensors, no name prefix.

    Each file is written atomically (temporary file, then rename). The safetensors metadata
    carries ``format: pt`` and ``dflash_sha256``, a SHA-256 per tensor that loading verifies.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dataclasses.replace(model.config, dtype=str(dtype).replace("torch.", ""))
    names = expected_tensor_shapes(config)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items() if k in names and k != "d2t"}
    if model.d2t is not None:
        state["d2t"] = model.d2t.detach().to("cpu", torch.long).contiguous()
    # A drafter that loading would refuse (a diverged run's NaN weights) is refused here, before
    # it replaces anything.
    check_tensor_values(state, source=f"the drafter being exported to {path}")
    # Weights first: a failure there (a full disk) leaves the previous pair untouched; the
    # config.json that follows is a few hundred bytes.
    atomic_save_safetensors(state, path / "model.safetensors", metadata=checksum_metadata(state))
    config.save(path)


def checksum_metadata(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """safetensors metadata for ``tensors``: ``format: pt`` and their SHA-256 (see CHECKSUM_KEY)."""
    sums = {name: tensor_sha256(t) for name, t in sorted(tensors.items())}
    return {"format": "pt", CHECKSUM_KEY: json.dumps(sums, separators=(",", ":"))}
