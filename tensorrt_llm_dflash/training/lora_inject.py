"""OnlineDFlashLoRAInjectModel: DFlash-style block training of the LoRA-inject drafter.

Same recipe as :class:`~tensorrt_llm_dflash.training.model.OnlineDFlashModel`: random
anchors among answer positions (``sample_anchors``), blocks ``[x[a], MASK x (B-1)]`` at
positions ``a .. a+B-1``, the DFlash training mask (a block sees the context strictly
before its anchor plus its own block, never another block: ``training_mask_bool``), label
``x[a+k]`` at offset k >= 1 with weight ``exp(-(k-1)/gamma)``, per-position accuracy.

Why the target's states are recomputed per batch instead of read from the data shards:
the shards (``training/data.py``) hold the outputs of the 5 layers a DFlash drafter reads,
while injection needs every layer's input; for SmolLM2 that is 30 x 576 values per token,
about 6x the shards' size, i.e. several GB for the DFlash data set. A frozen target forward
over the batch costs less than the drafter's own forward + backward through all its layers,
and it yields the context K/V directly (its KV cache), which is all the drafter reads of the
context when no adapter is on k_proj/v_proj. Only the shards' token ids and answer starts
are used (:func:`load_token_sequences`), so the DFlash and LoRA-inject drafters share one
data set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..compat import CACHE_KWARG
from ..errors import DFlashConfigError
from ..lora_inject import ContextKV, DFlashLoRAInjectDraftModel
from .data import Sequence, readable_shards, shard_loss_masks
from .model import block_metrics, copyable_anchors, sample_anchors, training_mask_bool


def load_token_sequences(data_dir: str | Path) -> list[Sequence]:
    """The DFlash shards' sequences without their hidden states (features are [S, 0]).

    The shards are memory-mapped, so the large feature tensors are never read from disk.
    """
    shards = readable_shards(Path(data_dir), remove_damaged=False, mmap=True)
    if not shards:
        raise DFlashConfigError(f"no readable shard_*.pt files in {str(data_dir)!r}")
    sequences = []
    for _, data in shards:
        for ids, mask in zip(data["input_ids"], shard_loss_masks(data)):
            ids = ids.long().clone()
            sequences.append(Sequence(ids, mask.clone(), torch.zeros(len(ids), 0), None))
    return sequences


class OnlineDFlashLoRAInjectModel(nn.Module):
    """Trainable LoRA-inject drafter + frozen target (context K/V, embedding, final norm, lm_head).

    ``forward`` has the interface ``training.trainer.train`` expects; ``features`` and
    ``final_hidden`` are accepted and ignored (context comes from the target forward).
    """

    def __init__(self, drafter: DFlashLoRAInjectDraftModel, target: Any, num_anchors: int = 16,
                 gamma: float = 4.0) -> None:
        super().__init__()
        self.drafter = drafter
        object.__setattr__(self, "_decoder", target.get_decoder())  # frozen, not a submodule
        self.block_size = drafter.config.block_size
        self.num_anchors = num_anchors
        self.gamma = gamma

    @torch.no_grad()
    def target_context(self, input_ids: torch.Tensor) -> ContextKV:
        """Per-layer K/V of the whole (right-padded) sequences from one frozen, causal target forward.

        Padding sits after every real token, so causal attention keeps it out of real tokens'
        states, and the training mask never shows a block anything at or after its anchor.
        """
        from transformers import DynamicCache

        cache = DynamicCache()
        self._decoder(input_ids=input_ids, use_cache=True, **{CACHE_KWARG: cache})
        return ContextKV.from_cache(cache)

    def forward(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        features: torch.Tensor | None = None,
        final_hidden: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        b, s = input_ids.shape
        bs = self.block_size
        context = self.target_context(input_ids)
        anchors, keep = sample_anchors(loss_mask, self.num_anchors, generator)
        n = anchors.shape[1]
        offsets = torch.arange(bs, device=input_ids.device)
        embeds = self.drafter.embed_blocks(input_ids.gather(1, anchors))
        block_positions = (anchors[:, :, None] + offsets).reshape(b, n * bs)
        allowed = training_mask_bool(anchors, keep, s, bs)
        hidden = self.drafter(embeds, block_positions, context, block_allowed=allowed)
        logits = self.drafter.draft_logits(hidden.view(b, n, bs, -1)[:, :, 1:])  # offset 0 is the known anchor

        label_pos = anchors[:, :, None] + offsets[1:]
        in_range = label_pos < s
        label_pos = label_pos.clamp(max=s - 1)
        labels = input_ids.gather(1, label_pos.view(b, -1)).view_as(label_pos)
        valid = keep[:, :, None] & in_range & loss_mask.gather(1, label_pos.view(b, -1)).view_as(label_pos).bool()
        decay = torch.exp(-(offsets[1:].to(torch.float32) - 1) / self.gamma)
        weight = valid.float() * decay
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.view(-1), reduction="none")
        loss = (ce.view_as(weight) * weight).sum() / weight.sum().clamp(min=1e-6)
        with torch.no_grad():
            metrics = block_metrics((logits.argmax(-1) == labels) & valid, valid, copyable_anchors(input_ids, anchors))
        return {
            "loss": loss,
            **metrics,
            "coverage": torch.ones(()),  # full vocabulary: every label is representable
        }
