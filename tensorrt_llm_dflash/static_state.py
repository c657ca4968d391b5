"""Static (preallocated) state of the graph-ready runtime: the target's KV cache and the drafter's context.

A CUDA graph replays the same kernels on the same addresses, so everything a decode step touches
lives in buffers allocated once: the target's K/V for every layer in one tensor (so that KV
compaction is one gather and one scatter for all layers), the drafter's context K/V likewise, and
every per-step input (write slots, positions, masks) as a fixed-shape tensor. Every buffer has a
batch dimension of ``batch`` rows (one request each). A call covers the first ``b`` rows (a batch
bucket: one CUDA graph per bucket) or one row (a prefill into a free row while the others are
mid-generation), and attends over the first ``window`` slots only: a step costs what its longest row
needs, not what the capacity holds.

* :class:`StaticTarget` runs any transformers causal LM over :class:`RowSlotCache`: the model's own
  forward, with a 4-D additive mask over the whole cache capacity and the K/V of each call written
  at per-row slots (so rows at different lengths need no redesign).
* :class:`StaticDrafter` runs a :class:`~tensorrt_llm_dflash.drafter.DFlashDraftModel` over a
  static context cache; the block's own K/V are written at the slots after the context (scratch:
  the next committed context overwrites them), which is the same as never caching them.

Slots outside the valid range hold stale but finite values from earlier steps; the masks hide
them (an additive ``finfo.min`` gives an exact zero weight).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from .compat import CACHE_KWARG
from .draft_head import DraftHead, DraftLinears
from .drafter import DFlashDraftModel, apply_rope
from .errors import DFlashInputError
from .target import CpuFastPaths, _sliding_window, max_positions


class _RowSlotLayer(CacheLayerMixin):
    """One layer's K/V: views into the shared cache tensor, written at the runtime's per-row slots."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: RowSlotCache) -> None:
        super().__init__()
        self.keys, self.values, self.owner = keys, values, owner
        self.is_initialized = True

    # The signatures below take what both transformers 4.57 and 5.x pass (cache_utils.py: 5.x calls
    # lazy_initialization(key, value) and get_mask_sizes(query_length), and makes get_max_length abstract).
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        return None  # preallocated: nothing to do

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # 4.57: cache_kwargs; 5.2x: kwargs=
        owner = self.owner
        keys, values = self.keys[owner.rows], self.values[owner.rows]  # views: the writes land in the shared tensor
        slots = owner.write_slots  # [b, N]
        index = slots[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[3])
        keys.scatter_(2, index, key_states.to(keys.dtype))
        values.scatter_(2, index, value_states.to(values.dtype))
        return keys[:, :, : owner.window], values[:, :, : owner.window]

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    def get_seq_length(self) -> int:  # never asked: the runtime passes cache_position and a 4-D mask
        raise NotImplementedError("the static runtime passes cache_position; get_seq_length would read the device")

    def get_max_cache_shape(self) -> int:
        return self.keys.shape[2]


class RowSlotCache(Cache):
    """A transformers ``Cache`` over one preallocated tensor ``kv [2, layers, batch, kv_heads, capacity, head_dim]``.

    Before each forward the runtime sets ``rows`` (a slice: the rows this call covers), ``window``
    (attention reads slots ``0 .. window - 1``; the mask has that many columns) and ``write_slots``
    ([rows, N]: where each row's N new K/V go). transformers' own StaticCache writes one
    ``cache_position`` for all rows and turns sliding-window layers into rolling buffers, which tree
    verification and compaction cannot use.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.kv = torch.zeros(2, layers, batch, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.write_slots = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.rows = slice(0, batch)
        self.window = capacity
        super().__init__(layers=[_RowSlotLayer(self.kv[0, i], self.kv[1, i], self) for i in range(layers)])

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[4])

    def copy_from(self, other: RowSlotCache) -> None:
        """Take over ``other``'s K/V (a smaller capacity: growing the state keeps every row's cache)."""
        self.kv[..., : other.capacity, :].copy_(other.kv)

    def compact(self, past: torch.Tensor, path: torch.Tensor) -> None:
        """Move slot ``past[b] + path[b, j]`` to ``past[b] + j`` in every layer, K and V at once.

        ``path`` [B, P] holds accepted tree nodes in depth order (padded by repeating the last one);
        the rows past the accepted length land beyond the new length, where nothing reads them.
        The gather copies before the scatter writes, so overlapping slots are safe. It covers the first
        ``past.shape[0]`` rows.
        """
        kv = self.kv[:, :, : past.shape[0]]
        two, layers, batch, heads, _, dim = kv.shape
        width = path.shape[1]
        source = (past[:, None] + path)[None, None, :, None, :, None].expand(two, layers, batch, heads, width, dim)
        target = (past[:, None] + torch.arange(width, device=path.device))[None, None, :, None, :, None]
        rows = kv.gather(4, source)
        kv.scatter_(4, target.expand_as(source), rows)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean [B, Q, K] -> additive [B, 1, Q, K] (0 where allowed, finfo.min elsewhere)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


class StaticTarget:
    """A transformers causal LM over a :class:`RowSlotCache` of fixed capacity.

    ``verify`` takes a padded tree per row of the first ``b`` rows (ids, depths and ancestor
    visibility, all fixed-shape device tensors) and their committed lengths ``past`` [b]; it writes
    the tree's K/V at slots ``past + i``, attends through a 4-D mask over the first ``window`` slots
    (every committed slot, plus the node's ancestors and itself; sliding-window layers also apply
    their window on positions ``past + depth``), and returns the logits and the target features
    (hidden states of ``layer_ids``, HF's convention: id k is the output of decoder layer k, the
    last one after the final norm). ``prefill`` fills one row (or the first ``b``) from slot 0.
    """

    def __init__(self, model: Any, layer_ids: list[int] | None, capacity: int, batch: int = 1) -> None:
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.model = model
        self.layer_ids = list(layer_ids or [])
        self.vocab_size = int(model.config.vocab_size)
        self.max_positions = max_positions(model)
        self.device = model.device
        self.dtype = model.dtype
        if capacity > self.max_positions + 256:
            raise DFlashInputError(f"capacity={capacity} is far beyond max_position_embeddings={self.max_positions}")
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.cache = RowSlotCache(int(config.num_hidden_layers), batch, kv_heads, capacity, head_dim, self.dtype,
                                  self.device)
        self._window, self._mixed = _sliding_window(config)
        self._slots = torch.arange(capacity, device=self.device)
        # A float32 CPU target takes the eager verifier's fast paths (blocked GEMMs for 1..128 rows, GQA attention
        # without a K/V copy), bit-identical to its own modules: a tree of a few nodes costs what the eager runtime
        # pays for it, not MKL's price for a few rows (CPU only; nothing changes under CUDA graphs).
        self._cpu_paths = CpuFastPaths(model) if CpuFastPaths.applies(model) else None

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def batch(self) -> int:
        return int(self.cache.kv.shape[2])

    def _masks(self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> Any:
        mask = _additive(allowed, self.dtype)
        if self._window is None:
            return mask
        windowed = _additive(allowed & (query_pos[:, :, None] - key_pos[:, None, :] < self._window), self.dtype)
        return {"full_attention": mask, "sliding_attention": windowed} if self._mixed else windowed

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: Any, rows: slice,
             window: int, last_only: bool = False, keep: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward; logits of every position, of the last (``last_only``) or of the positions in ``keep`` (a 1-D
        device tensor: transformers' ``logits_to_keep`` takes one, 4.57 and 5.x alike, with no host read)."""
        cache = self.cache
        cache.write_slots, cache.rows, cache.window = slots, rows, window
        paths = self._cpu_paths.installed() if self._cpu_paths is not None else contextlib.nullcontext()
        with paths:
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, cache_position=slots[0],
                             use_cache=True, **{CACHE_KWARG: cache}, output_hidden_states=bool(self.layer_ids),
                             logits_to_keep=keep if keep is not None else (1 if last_only else 0))
        feats = None
        if self.layer_ids:
            feats = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        return out.logits, feats

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, row: int | None = None, last: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompt ids [b, P] (rows of equal length) at slots 0..P-1 of rows ``0..b-1``, or [1, P] into row ``row``
        alone (the other rows are not touched): last logits [b, V], features [b, P, F]. ``last`` (a device index [1],
        no host read): the position whose logits are returned, for a prompt padded after it (``PaddedPrefill``)."""
        batch, length = prompt.shape
        if length > self.capacity:
            raise DFlashInputError(f"prompt length {length} exceeds the cache capacity {self.capacity}")
        rows = slice(0, batch) if row is None else slice(row, row + 1)
        # Attention reads slots 0..P-1 only: a prefill costs what its prompt needs, whatever the capacity.
        slots = self._slots[:length]
        positions = slots[None].expand(batch, -1)
        allowed = positions[:, :, None] >= slots[None, None, :]  # causal
        mask = self._masks(allowed, positions, positions)
        logits, feats = self._run(prompt, positions, positions, mask, rows, length, last_only=True, keep=last)
        return logits[:, -1], feats

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, depths: torch.Tensor, visible: torch.Tensor, past: torch.Tensor,
               window: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tree tokens/depths [b, N], visibility [b, N, N], lengths [b] of rows ``0..b-1`` -> logits [b, N, V],
        features [b, N, F]. Attention reads the first ``window`` slots (default: the capacity), which must hold
        every row's ``past + N``."""
        n = tokens.shape[1]
        window = self.capacity if window is None else int(window)
        cache_slots = self._slots[:window]
        slots = past[:, None] + torch.arange(n, device=tokens.device)
        positions = past[:, None] + depths
        relative = cache_slots[None, :] - past[:, None]  # [b, W]: slot - past
        in_tree = (relative >= 0) & (relative < n)
        tree_cols = visible.gather(2, relative.clamp(0, n - 1)[:, None, :].expand(-1, n, -1))  # [b, N, W]
        allowed = (relative < 0)[:, None, :] | (in_tree[:, None, :] & tree_cols)
        # A key's position: its slot for committed tokens, past + depth for tree nodes.
        key_pos = torch.where(in_tree, past[:, None] + depths.gather(1, relative.clamp(0, n - 1)), cache_slots[None])
        return self._run(tokens, positions, slots, self._masks(allowed, positions, key_pos),
                         slice(0, tokens.shape[0]), window)


#: The shortest length a padded prefill runs at; longer prompts run at the next power of two (one CUDA graph each).
PREFILL_MIN_LENGTH = 32


def prefill_length(prompt_len: int, limit: int) -> int:
    """The length a prompt of ``prompt_len`` tokens is padded to: the next power of two from
    :data:`PREFILL_MIN_LENGTH`, at most ``limit`` (and never less than the prompt)."""
    length = PREFILL_MIN_LENGTH
    while length < prompt_len:
        length *= 2
    return max(min(length, limit), prompt_len)


class PaddedPrefill:
    """A prompt's prefill at a fixed length, into a one-row staging cache: a few CUDA graphs serve every prompt
    length and every row.

    An eager prefill on a GPU is mostly kernel launches (~25-45 ms a prompt for SmolLM2-135M on an H100 or H200,
    whatever its length), paid by every request and, in a server, by every other row, which waits for it. Here
    the prompt is padded on the right to :func:`prefill_length` and run from static buffers (``ids`` and the index
    of the last real token, per length), so one graph per length replays it; its K/V land in slots ``0 .. L-1`` of
    a one-row cache of its own, and :meth:`copy_to` moves the prompt's ``P`` slots into the decoder's row (one copy:
    the row is a host choice, which a graph could not take). A causal mask keeps every real token from seeing the
    pads after it, so slots ``0 .. P-1``, the features of positions ``0 .. P-1`` and the last token's logits are
    those of the unpadded prefill up to the rounding of other GEMM shapes (tests: float64 equal to 1e-10; the pads'
    own K/V are never copied).
    """

    def __init__(self, model: Any, layer_ids: list[int] | None, length: int) -> None:
        self.target = StaticTarget(model, layer_ids, length, batch=1)
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def capacity(self) -> int:
        return self.target.capacity

    def load(self, prompt: torch.Tensor, length: int) -> None:
        """Put ``prompt`` [P] into the static inputs of ``length`` (pads: token 0)."""
        ids, last = self.inputs(length)
        count = prompt.shape[0]
        ids[0, :count].copy_(prompt)
        ids[0, count:].zero_()
        last.fill_(count - 1)

    def inputs(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The static ``ids`` [1, length] and last-token index [1] of ``length`` (allocated once)."""
        if length not in self._inputs:
            device = self.target.device
            self._inputs[length] = (torch.zeros(1, length, dtype=torch.long, device=device),
                                    torch.zeros(1, dtype=torch.long, device=device))
        return self._inputs[length]

    def run(self, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The padded forward over what :meth:`load` put in (no host read: a CUDA graph's body): the last real
        token's logits [1, V] and the features of every position [1, length, F]."""
        ids, last = self.inputs(length)
        return self.target.prefill(ids, last=last)

    def copy_to(self, cache: RowSlotCache, row: int, count: int) -> None:
        """Slots ``0 .. count-1`` of the staging row into ``row`` of ``cache`` (every layer, K and V at once)."""
        cache.kv[:, :, row, :, :count].copy_(self.target.cache.kv[:, :, 0, :, :count])


class StaticDrafter:
    """A DFlash drafter over a static context cache ``kv [2, layers, batch, kv_heads, capacity + block, head_dim]``.

    Same equations as :class:`~tensorrt_llm_dflash.drafter.DFlashDraftModel` (whose modules it
    runs); only where the K/V live differs. Context slot j holds committed token j (position j).
    """

    def __init__(self, model: DFlashDraftModel, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module,
                 capacity: int, batch: int = 1) -> None:
        config = model.config
        self.model = model
        self.embed_tokens = embed_tokens
        self.block_size = int(config.block_size)
        self.mask_token_id = int(config.mask_token_id)
        self.target_layer_ids = list(config.target_layer_ids)
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.vocab_size = int(lm_head.weight.shape[0])
        #: Target ids of the logits' columns (a reduced draft vocabulary), or None for the full vocabulary.
        self.draft_ids = model.draft_token_ids()
        weight = lm_head.weight if self.draft_ids is None else lm_head.weight.index_select(
            0, self.draft_ids.to(lm_head.weight.device))
        self.head = DraftHead(weight.to(self.device))
        self.linears = DraftLinears(model)  # its own layers through oneDNN on a float32 CPU, during a call only
        attn = model.layers[0].self_attn
        self.kv = torch.zeros(2, len(model.layers), batch, attn.num_kv_heads, capacity + self.block_size,
                              attn.head_dim, dtype=self.dtype, device=self.device)
        self._slots = torch.arange(capacity + self.block_size, device=self.device)
        self._offsets = torch.arange(self.block_size, device=self.device)

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[4]) - self.block_size

    def copy_from(self, other: StaticDrafter) -> None:
        """Take over ``other``'s context K/V (a smaller capacity: growing the state keeps every row's context)."""
        self.kv[..., : other.kv.shape[4], :].copy_(other.kv)

    def move_row(self, src: int, dst: int, used: int) -> None:
        """Row ``dst`` takes row ``src``'s context (its first ``used`` slots: the committed tokens)."""
        self.kv[:, :, dst, :, :used].copy_(self.kv[:, :, src, :, :used])

    def _write(self, layer: int, rows: slice, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        index = slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.kv[0, layer, rows].scatter_(2, index, k)
        self.kv[1, layer, rows].scatter_(2, index, v)

    @torch.inference_mode()
    def extend(self, features: torch.Tensor, start: torch.Tensor, row: int | None = None) -> None:
        """Context K/V of ``features`` [b, P, F] at slots ``start .. start + P - 1`` of rows ``0..b-1``, or of [1, P, F]
        in row ``row`` alone (rows past the accepted count are scratch: the next call overwrites them). Slots past
        the cache's last land on it: only scratch reaches there (a row's stale deferred features,
        ``GraphedDecoder._extend_deferred``), and a draft writes its block there before it reads it."""
        rows = slice(0, features.shape[0]) if row is None else slice(row, row + 1)
        slots = (start[:, None] + torch.arange(features.shape[1], device=self.device)).clamp(max=self.kv.shape[4] - 1)
        with self.linears.installed():
            ctx = self.model.project_context(features.to(self.dtype))
            cos, sin = self.model.rotary_emb(slots, ctx.dtype)
            for i, layer in enumerate(self.model.layers):
                k, v = layer.self_attn.key_values(ctx, cos, sin)
                self._write(i, rows, slots, k, v)

    @torch.inference_mode()
    def draft(self, root: torch.Tensor, context_len: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """Logits [b, block - 1, draft vocabulary] for the positions after ``root`` [b] (rows ``0..b-1``). Attention
        reads the first ``window`` slots (default: all), which must hold every row's ``context_len + block``."""
        with self.linears.installed():
            return self._draft(root, context_len, window)

    def _draft(self, root: torch.Tensor, context_len: torch.Tensor, window: int | None) -> torch.Tensor:
        batch = root.shape[0]
        rows = slice(0, batch)
        window = self.kv.shape[4] if window is None else int(window)
        slots_seen = self._slots[:window]
        ids = torch.full((batch, self.block_size), self.mask_token_id, dtype=torch.long, device=self.device)
        ids[:, 0] = root
        x = self.embed_tokens(ids.to(self.embed_tokens.weight.device)).to(self.device, self.dtype)
        positions = context_len[:, None] + self._offsets  # [b, block]: the block's slots and positions
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        visible = slots_seen[None, :] < (context_len[:, None] + self.block_size)  # [b, W]
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rope(attn.q_norm(attn._heads(h, attn.q_proj, attn.num_heads)), cos, sin)
            k, v = attn.key_values(h, cos, sin)
            self._write(i, rows, positions, k, v)
            allowed = visible[:, None, :].expand(-1, self.block_size, -1)
            if attn.sliding_window is not None:
                allowed = allowed & (positions[:, :, None] - slots_seen[None, None, :] < attn.sliding_window)
            mask = _additive(allowed, q.dtype)
            out = F.scaled_dot_product_attention(q, self.kv[0, i, rows, :, :window], self.kv[1, i, rows, :, :window],
                                                 attn_mask=mask, scale=1.0 / math.sqrt(attn.head_dim),
                                                 enable_gqa=attn.num_heads != attn.num_kv_heads)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, self.block_size, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = self.model.norm(x)[:, 1:]
        return self.head(hidden)
