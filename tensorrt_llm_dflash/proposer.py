"""The DFlash proposer: one drafter pass turns the bonus token into B-1 marginals.

This is the draft half of the runtime's narrow interface
(:class:`tensorrt_llm_dflash.decode.DraftProposer`). It owns the drafter's
context-only KV cache: committed tokens' target features are appended once, and the
block ``[bonus, MASK x (B-1)]`` is never cached, which is the same as cropping the
draft cache back to ``start`` after every draft.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .draft_head import DraftHead, DraftLinears
from .drafter import DFlashDraftModel, DraftContextCache


class DFlashProposer:
    def __init__(self, model: DFlashDraftModel, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        self.model = model
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.block_size = model.config.block_size
        self.mask_token_id = model.config.mask_token_id
        self.target_layer_ids = list(model.config.target_layer_ids)
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.vocab_size = int(lm_head.weight.shape[0])
        self.draft_ids = model.draft_token_ids()
        if self.draft_ids is not None:
            # Score only the draft vocabulary: the lm_head read dominates drafting cost.
            self.draft_ids = self.draft_ids.to(lm_head.weight.device)
        self.head = DraftHead(lm_head.weight if self.draft_ids is None else lm_head.weight.index_select(0, self.draft_ids))
        self.linears = DraftLinears(model)  # its own layers through oneDNN on a float32 CPU, during a draft only
        self.reset()

    @classmethod
    def for_target(cls, model: DFlashDraftModel, target: Any) -> DFlashProposer:
        """Share the target's embedding and lm_head (they are never copied)."""
        return cls(model, target.get_input_embeddings(), target.get_output_embeddings())

    def reset(self) -> None:
        self.cache = DraftContextCache()
        self.context_len = 0

    @torch.inference_mode()
    def propose(self, root_token: int, new_context: torch.Tensor) -> torch.Tensor:
        """Logits [block_size - 1, vocab] for the positions after ``root_token``.

        ``new_context`` [n, F] holds the target features of the tokens committed since
        the last call (the prompt on the first call); the root itself has not been
        through the target yet, so it is never context.
        """
        n = int(new_context.shape[0])
        positions = torch.arange(self.context_len, self.context_len + n, device=self.device)[None]
        with self.linears.installed():
            self.model.extend_context(self.cache, new_context[None].to(self.device, self.dtype), positions)
            self.context_len += n
            block_ids = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=self.device)
            block_ids[0, 0] = root_token
            embeds = self.embed_tokens(block_ids.to(self.embed_tokens.weight.device)).to(self.device, self.dtype)
            block_positions = torch.arange(self.context_len, self.context_len + self.block_size,
                                           device=self.device)[None]
            hidden = self.model(embeds, block_positions, self.cache)
        logits = self.head(hidden[0, 1:])
        if self.draft_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_ids, logits)
