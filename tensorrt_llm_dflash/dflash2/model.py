"""The DFlash2 drafter: DFlash layers, each sublayer wrapped by a grouped dynamic causal
convolution over the block, and a candidate selector on top.

Equations (names match the published checkpoint tensors; ``G = H / conv_group_size`` groups,
``T = conv_kernel_size`` taps, ``o`` the tap offset):

    per sublayer f (attention, MLP), with y = its norm's output on the block only:
        c        = kernel_projection(y)        viewed [L, 2, T, G]: side 0 before f, side 1 after
        mix_s(z)[t] = sum_o (base_kernel[s, o] + c[t, s, o, group]) * z[t - o]   (z[t < 0] = 0)
        x = x + mix_1(f(mix_0(y)))

Context rows never pass through a convolution: the context K/V of a layer are those of DFlash
(``k_proj``/``v_proj`` of the projected target features), so the context cache is DFlash's.
The coefficient at output position t multiplies x[t - o] (it is indexed by the output, not by
the input), and the convolution starts afresh at slot 0 of every block.
"""

from __future__ import annotations

import torch
from torch import nn

from ..drafter import DFlashDraftModel, DraftContextCache
from .config import DFlash2Config


class GroupedDynamicConv(nn.Module):
    """The convolution pair around one sublayer (``layers.{i}.{attention,mlp}_conv``)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.taps, self.group_size = taps, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def coefficients(self, normed: torch.Tensor) -> torch.Tensor:
        """Per-position dynamic taps [batch, L, 2, T, G] from the sublayer's normed input."""
        return self.kernel_projection(normed).unflatten(-1, (2, self.taps, self.groups))

    def mix(self, x: torch.Tensor, coefficients: torch.Tensor, side: int, block_len: int | None = None) -> torch.Tensor:
        """``mix_side(x)`` for x [batch, L, H]: one block per row, or (``block_len``) L / block_len
        consecutive blocks per row, the convolution starting afresh at each (the training layout)."""
        if block_len is not None and block_len != x.shape[1]:
            rows, length = x.shape[0], x.shape[1]
            if length % block_len:
                raise ValueError(f"a row of {length} positions is not a whole number of blocks of {block_len}")
            blocks = self.mix(x.reshape(-1, block_len, x.shape[-1]),
                              coefficients.reshape(-1, block_len, *coefficients.shape[2:]), side)
            return blocks.reshape(rows, length, -1)
        length = x.shape[1]
        dynamic = coefficients[:, :, side].repeat_interleave(self.group_size, dim=-1)  # [b, L, T, H]
        taps = self.base_kernel[side].to(x.dtype) + dynamic
        out = taps[:, :, 0] * x
        for offset in range(1, min(self.taps, length)):
            out[:, offset:] += taps[:, offset:, offset] * x[:, :-offset]
        return out


class CandidateSelector(nn.Module):
    """``candidate_selector.*``: a rank-r pairwise term between a token and its predecessor.

    The published checkpoint stores the codebooks as raw tensors (no ``.weight``), as here.
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))


class DFlash2DraftModel(DFlashDraftModel):
    """``config`` stays the DFlash part (so code that reads a drafter's block size, MASK or
    target layers reads it as for DFlash); ``dflash2`` holds the DFlash2 settings."""

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__(config.base)
        self.dflash2 = config.dflash2
        self.full_config = config
        s = config.dflash2
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicConv(config.base.hidden_size, s.conv_kernel_size, s.conv_group_size)
            layer.mlp_conv = GroupedDynamicConv(config.base.hidden_size, s.conv_kernel_size, s.conv_group_size)
        self.candidate_selector = CandidateSelector(config.base.hidden_size, config.base.vocab_size, s.selector_rank)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        cache: DraftContextCache,
        attention_mask: torch.Tensor | None = None,
        block_len: int | None = None,
    ) -> torch.Tensor:
        """norm(out) for one block per row, [batch, B, H], against the cached context.

        Training layout (``block_len``): each row holds Q / block_len consecutive blocks, the
        convolutions restart at every block, and ``attention_mask`` (DFlash's training mask, dense
        or a flex-attention BlockMask) keeps the blocks apart. Without ``block_len`` the row is one
        block and ``attention_mask`` must be None (the inference rule: the block sees everything).
        """
        if attention_mask is not None and block_len is None:
            raise NotImplementedError("DFlash2 drafter: an attention_mask needs block_len (the training layout)")
        x = block_embeds
        cos, sin = self.rotary_emb(block_positions, x.dtype)
        key_positions = block_positions if cache.positions is None else torch.cat([cache.positions, block_positions], 1)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if cache.length:
                context_kv = (cache.keys[i], cache.values[i])
            else:
                empty = x.new_zeros(x.shape[0], attn.num_kv_heads, 0, attn.head_dim)
                context_kv = (empty, empty)
            y = layer.input_layernorm(x)
            conv = layer.attention_conv
            c = conv.coefficients(y)
            out = attn(conv.mix(y, c, 0, block_len), (cos, sin), context_kv, block_positions, key_positions,
                       attention_mask)
            x = x + conv.mix(out, c, 1, block_len)
            y = layer.post_attention_layernorm(x)
            conv = layer.mlp_conv
            c = conv.coefficients(y)
            x = x + conv.mix(layer.mlp(conv.mix(y, c, 0, block_len)), c, 1, block_len)
        return self.norm(x)
