"""OnlineDFlashModel: block-parallel DFlash training on cached target hidden states.

For each sequence, ``num_anchors`` anchors are drawn among the answer positions whose
next token also carries loss. Every anchor opens a block ``[x[a], MASK x (B-1)]`` at
positions ``a .. a+B-1``; the block at offset k predicts ``x[a+k]`` (k >= 1) with loss
weight ``exp(-(k-1)/gamma)``. All blocks of a sequence run in one forward pass under the
DFlash training mask: a block sees the context strictly before its anchor and its own
block (both directions), never another block. That is exactly what the block sees at
inference, where the anchor is the bonus token whose hidden state is not yet known.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..drafter import DFlashDraftModel, DraftContextCache


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors [b, N] (sorted) and keep [b, N]; only positions a with loss_mask[a] and loss_mask[a+1]."""
    b, s = loss_mask.shape
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    valid[:, :-1] = loss_mask[:, :-1].bool() & loss_mask[:, 1:].bool()
    # Drawn where the generator lives (the trainer's is on the CPU, so a GPU run draws the same anchors).
    scores = torch.rand(b, s, generator=generator, device=generator.device if generator is not None
                        else loss_mask.device).to(loss_mask.device)
    scores = scores.masked_fill(~valid, -1.0)
    k = min(num_anchors, s)
    top = scores.topk(k, dim=1)
    keep = top.values >= 0
    anchors = torch.where(keep, top.indices, torch.zeros_like(top.indices))
    order = torch.argsort(anchors + (~keep) * s, dim=1)  # kept anchors first, ascending
    return anchors.gather(1, order), keep.gather(1, order)


def training_mask_bool(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Dense visibility [b, N*B, S + N*B]: context before the anchor, plus the own block."""
    b, n = anchors.shape
    q_block = torch.arange(n * block_size, device=anchors.device) // block_size  # [Q]
    q_anchor = anchors[:, q_block]  # [b, Q]
    ctx = torch.arange(seq_len, device=anchors.device)[None, None, :] < q_anchor[:, :, None]
    ctx = ctx & keep[:, q_block][:, :, None]  # dropped blocks see only themselves
    k_block = torch.arange(n * block_size, device=anchors.device) // block_size
    own = (q_block[:, None] == k_block[None, :]).expand(b, -1, -1)
    return torch.cat([ctx, own], dim=2)


def training_block_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int, num_heads: int):
    """The same rule as a flex-attention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = anchors.shape

    def mask_mod(batch, head, q_idx, kv_idx):
        block = q_idx // block_size
        anchor = anchors[batch, block]
        in_ctx = kv_idx < seq_len
        ctx_ok = (kv_idx < anchor) & keep[batch, block]
        own_ok = (kv_idx - seq_len) // block_size == block
        return torch.where(in_ctx, ctx_ok, own_ok)

    q_len = n * block_size
    return create_block_mask(mask_mod, b, None, q_len, seq_len + q_len, device=str(anchors.device))


class OnlineDFlashModel(nn.Module):
    """Trainable drafter + frozen target embedding / lm_head, with the DFlash loss."""

    def __init__(
        self,
        drafter: DFlashDraftModel,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        num_anchors: int = 32,
        gamma: float = 4.0,
        distill_weight: float = 0.0,
        attention: str = "dense",
    ) -> None:
        super().__init__()
        if attention not in ("dense", "flex"):
            raise ValueError(f"attention={attention!r} must be 'dense' or 'flex'")
        self.drafter = drafter
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        ids = drafter.draft_token_ids()
        head = lm_head_weight.detach() if ids is None else lm_head_weight.detach().index_select(0, ids.to(lm_head_weight.device))
        self.register_buffer("head_weight", head, persistent=False)
        vocab = lm_head_weight.shape[0]
        t2d = torch.full((vocab,), -1, dtype=torch.long)
        t2d[ids.cpu() if ids is not None else torch.arange(vocab)] = torch.arange(head.shape[0])
        self.register_buffer("target_to_draft", t2d, persistent=False)
        self.block_size = drafter.config.block_size
        self.mask_token_id = drafter.config.mask_token_id
        self.num_anchors = num_anchors
        self.gamma = gamma
        self.distill_weight = distill_weight
        self.attention = attention

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        loss_mask: torch.Tensor,
        final_hidden: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
        weight_total: torch.Tensor | None = None,
        scale: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        """The DFlash loss of a batch, and block metrics.

        Data parallel training passes this rank's rows with the ``anchors`` (anchors, keep)
        drawn for them on the global batch, the global batch's ``weight_total``
        (:meth:`label_weight_total`) and ``scale`` = world size: the loss is then this rank's
        share of the global batch's loss, times the world size that DDP's gradient averaging
        divides back out, so N ranks take the step one process takes on the whole batch.
        """
        anchors, keep = sample_anchors(loss_mask, self.num_anchors, generator) if anchors is None else anchors
        hidden = self.draft_hidden(input_ids, features, anchors, keep)
        logits = self.head_logits(hidden)

        label_pos, draft_labels, valid, representable, weight = self._labels(input_ids, loss_mask, anchors, keep)
        total = (weight.sum() if weight_total is None else weight_total).clamp(min=1e-6)
        loss = self.block_loss(logits, draft_labels, weight, label_pos, final_hidden) / total * scale
        with torch.no_grad():
            metrics = block_metrics((logits.argmax(-1) == draft_labels) & valid, valid,
                                    copyable_anchors(input_ids, anchors))
        return {
            "loss": loss,
            **metrics,
            "coverage": representable.sum().float() / valid.sum().clamp(min=1).float(),
        }

    def block_embeds(self, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """[b, N*B, H] embeddings of the blocks ``[x[a], MASK x (B-1)]``."""
        b, n = anchors.shape
        block_ids = torch.full((b, n, self.block_size), self.mask_token_id, dtype=torch.long, device=input_ids.device)
        block_ids[:, :, 0] = input_ids.gather(1, anchors)
        return F.embedding(block_ids.reshape(b, n * self.block_size), self.embed_weight).to(self.head_weight.dtype)

    def run_drafter(self, embeds: torch.Tensor, positions: torch.Tensor, cache: DraftContextCache,
                    mask: Any) -> torch.Tensor:
        return self.drafter(embeds, positions, cache, attention_mask=mask)

    def draft_hidden(self, input_ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor,
                     keep: torch.Tensor) -> torch.Tensor:
        """The drafter's normed output at block offsets 1..B-1, [b, N, B-1, H], every block under
        the DFlash training mask."""
        b, s = input_ids.shape
        bs = self.block_size
        dtype = self.head_weight.dtype
        n = anchors.shape[1]
        offsets = torch.arange(bs, device=input_ids.device)
        block_positions = (anchors[:, :, None] + offsets).reshape(b, n * bs)
        embeds = self.block_embeds(input_ids, anchors)

        cache = DraftContextCache()
        positions = torch.arange(s, device=input_ids.device)[None].expand(b, s)
        self.drafter.extend_context(cache, features.to(dtype), positions)
        if self.attention == "flex":
            mask = training_block_mask(anchors, keep, s, bs, self.drafter.config.num_attention_heads)
        else:
            allowed = training_mask_bool(anchors, keep, s, bs)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=input_ids.device)
            mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
        hidden = self.run_drafter(embeds, block_positions, cache, mask)
        return hidden.view(b, n, bs, -1)[:, :, 1:]  # offset 0 is the known anchor token

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, N, B-1, V'] logits the drafter drafts from (here the (draft-vocabulary) head's)."""
        return self.raw_logits(hidden)

    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [..., H] @ head.T``: the target's own head on ``hidden``."""
        # A 2-D matmul: a 4-D input against the shared head would run as a slow batched matmul.
        return (hidden.reshape(-1, hidden.shape[-1]) @ self.head_weight.T).view(*hidden.shape[:-1], -1)

    def block_loss(self, logits: torch.Tensor, draft_labels: torch.Tensor, weight: torch.Tensor,
                   label_pos: torch.Tensor, final_hidden: torch.Tensor | None) -> torch.Tensor:
        """The decay-weighted CE (mixed with the KL to the target's logits when ``distill_weight``),
        summed, not yet normalised."""
        ce = F.cross_entropy(loss_precision(logits.reshape(-1, logits.shape[-1])), draft_labels.clamp(min=0).view(-1),
                             reduction="none")
        loss = (ce.view_as(weight) * weight).sum()
        if self.distill_weight > 0:
            if final_hidden is None:
                raise ValueError("distill_weight > 0 needs the target's final hidden states")
            b = label_pos.shape[0]
            teacher_pos = (label_pos - 1).view(b, -1)
            teacher_h = final_hidden.gather(1, teacher_pos[..., None].expand(-1, -1, final_hidden.shape[-1]))
            teacher = loss_precision(self.raw_logits(teacher_h.to(self.head_weight.dtype)).view_as(logits)).softmax(-1)
            kl = -(teacher * loss_precision(logits).log_softmax(-1)).sum(-1)
            loss = (1 - self.distill_weight) * loss + self.distill_weight * (kl * weight).sum()
        return loss

    def _labels(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor):
        """(label positions, draft-vocabulary labels, valid, representable, loss weight), [b, N, B-1] each."""
        b, s = input_ids.shape
        offsets = torch.arange(1, self.block_size, device=input_ids.device)
        label_pos = anchors[:, :, None] + offsets  # [b, n, bs-1]
        in_range = label_pos < s
        label_pos = label_pos.clamp(max=s - 1)
        labels = input_ids.gather(1, label_pos.view(b, -1)).view_as(label_pos)
        draft_labels = self.target_to_draft[labels]
        valid = keep[:, :, None] & in_range & loss_mask.gather(1, label_pos.view(b, -1)).view_as(label_pos).bool()
        representable = valid & (draft_labels >= 0)
        decay = torch.exp(-(offsets.to(self.head_weight.dtype) - 1) / self.gamma)
        return label_pos, draft_labels, valid, representable, representable.to(self.head_weight.dtype) * decay

    @torch.no_grad()
    def label_weight_total(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                           keep: torch.Tensor) -> torch.Tensor:
        """The loss normaliser of a whole (global) batch: cheap, labels and masks only."""
        return self._labels(input_ids, loss_mask, anchors, keep)[-1].sum()


def loss_precision(x: torch.Tensor) -> torch.Tensor:
    """Logits as the losses take them: float32 (bf16 autocast, fp32), float64 kept (exact tests)."""
    return x if x.dtype == torch.float64 else x.float()


def copyable_anchors(input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """[b, N] bool: the bigram ending at the anchor, ``(x[a-1], x[a])``, also ends at an earlier
    position. The training-side twin of ``bench.copyable_steps``: the blocks a drafter can win by
    copying from its context, as prompt lookup does."""
    b, s = input_ids.shape
    codes = torch.full((b, s), -1, dtype=torch.long, device=input_ids.device)
    codes[:, 1:] = input_ids[:, :-1].long() * (int(input_ids.max()) + 1) + input_ids[:, 1:].long()
    anchor_codes = codes.gather(1, anchors)  # [b, N]
    earlier = torch.arange(s, device=input_ids.device)[None, None, :] < anchors[:, :, None]
    same = (codes[:, None, :] == anchor_codes[:, :, None]) & earlier & (codes[:, None, :] >= 0)
    return same.any(-1) & (anchor_codes >= 0)


def block_metrics(
    correct: torch.Tensor, valid: torch.Tensor, copyable: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Top-1 counts per block position, and the teacher-forced chain acceptance.

    ``correct`` and ``valid`` are [batch, anchors, B-1]. A block's chain accepts its leading run
    of correct valid positions, exactly what verification would accept from this block given
    the true context; summed over anchors whose first position has a label. Unlike the product
    of per-position accuracies, this keeps the correlation between positions. With
    ``copyable`` ([batch, anchors], see :func:`copyable_anchors`) the copyable blocks' share is
    also returned.
    """
    run = (correct & valid).int().cumprod(-1).sum(-1)
    anchors = valid[..., 0]
    out = {
        "correct": correct.sum((0, 1)).float(),
        "count": valid.sum((0, 1)).float(),
        "chain_accepted": run[anchors].sum().float(),
        "chain_anchors": anchors.sum().float(),
    }
    if copyable is not None:
        out["chain_accepted_copyable"] = run[anchors & copyable].sum().float()
        out["chain_anchors_copyable"] = (anchors & copyable).sum().float()
    return out


def cosine_lr(progress: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Multiplier for the learning rate at ``progress`` in [0, 1]."""
    if progress < warmup:
        return max(progress / warmup, 0.01)
    t = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
