"""The DFlash2 proposer: one drafter pass and the selector's inputs for the block after the root.

Same context handling as :class:`~tensorrt_llm_dflash.proposer.DFlashProposer` (context-only
K/V cache; the block is never cached). Instead of marginals it returns a
:class:`~.selector.SelectorDraft`, from which the decode loop asks for the chain or the tree
(``SelectorDraft.build_tree``), because DFlash2's draft tokens depend on each other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..draft_head import DraftHead
from ..drafter import DraftContextCache
from .model import DFlash2DraftModel
from .selector import SelectorDraft, top_candidates


def _scoring_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class DFlash2Proposer:
    #: The drafts choose their own tokens: the decode loop and the cost-aware policy ask them for their tree.
    selects_tokens = True

    def __init__(self, model: DFlash2DraftModel, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        self.model = model
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.block_size = model.config.block_size
        self.mask_token_id = model.config.mask_token_id
        self.target_layer_ids = list(model.config.target_layer_ids)
        self.settings = model.dflash2
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.vocab_size = int(lm_head.weight.shape[0])
        self.head = DraftHead(lm_head.weight)
        self.reset()

    @classmethod
    def for_target(cls, model: DFlash2DraftModel, target: Any) -> DFlash2Proposer:
        """Share the target's embedding and lm_head (never copied)."""
        return cls(model, target.get_input_embeddings(), target.get_output_embeddings())

    def reset(self) -> None:
        self.cache = DraftContextCache()
        self.context_len = 0

    def unary_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """softcap(output_multiplier * lm_head(hidden)) in the scoring dtype."""
        work = _scoring_dtype(self.dtype)
        logits = self.head(hidden).to(work) * self.settings.output_multiplier
        cap = self.settings.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def block_hidden(self, root_token: int, new_context: torch.Tensor) -> torch.Tensor:
        """The drafter's normed output at block slots 1..B-1, [B-1, H]."""
        n = int(new_context.shape[0])
        positions = torch.arange(self.context_len, self.context_len + n, device=self.device)[None]
        self.model.extend_context(self.cache, new_context[None].to(self.device, self.dtype), positions)
        self.context_len += n
        ids = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long)
        ids[0, 0] = root_token
        # The raw embedding rows times input_embedding_scale, as the reference does (a target whose
        # embedding module scales its output would otherwise be scaled twice).
        weight = self.embed_tokens.weight
        embeds = F.embedding(ids.to(weight.device), weight).to(self.device, self.dtype)
        embeds = embeds * self.settings.input_embedding_scale
        positions = torch.arange(self.context_len, self.context_len + self.block_size, device=self.device)[None]
        return self.model(embeds, positions, self.cache)[0, 1:]

    @torch.inference_mode()
    def propose(self, root_token: int, new_context: torch.Tensor) -> SelectorDraft:
        """The selector's inputs for depths 1..B-1 after ``root_token`` (see ``DFlashProposer.propose``
        for ``new_context``)."""
        hidden = self.block_hidden(root_token, new_context)
        unary, tokens = top_candidates(self.unary_logits(hidden), self.settings.selector_top_k)
        work = unary.dtype
        selector = self.model.candidate_selector
        gates = selector.hidden_projection(hidden).to(work)
        successors = selector.successor_codebook[tokens.to(selector.successor_codebook.device)].to(work)
        return SelectorDraft(unary=unary, tokens=tokens, gates=gates.to(unary.device),
                             successors=successors.to(unary.device),
                             predecessor_codebook=selector.predecessor_codebook.detach())
