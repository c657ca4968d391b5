"""Training a DFlash2 drafter: the DFlash objective plus the candidate selector's.

The backbone trains exactly as DFlash does (:class:`~.model.OnlineDFlashModel`: random anchors,
the block mask, the exponential position decay ``exp(-(k-1)/gamma)``), the convolutions restarting
at every block of the training row (``DFlash2DraftModel.forward(block_len=B)``). On top of the
block's per-position cross-entropy on the unary logits (``softcap(output_multiplier * lm_head(h))``,
over the whole vocabulary) comes the selector's loss, a K-way cross-entropy over the candidates
the runtime would score:

    candidates_k = top-K of unary_k                            (K = selector_top_k)
    if the gold token x[a+k] is not among them, it replaces the K-th (the weakest) candidate
    score_k(c)  = unary_k[c] + < predecessor_codebook[p_k] * hidden_projection(h_k), successor_codebook[c] >
    p_k         = x[a+k-1]: the anchor at k = 1, the gold token before after (teacher forcing)
    L_selector  = sum_k w_k * CE(score_k, index of the gold token) / sum_k w_k

with the DFlash position weights ``w_k`` (the same normaliser as the block loss), so
``loss = L_block + selector_weight * L_selector``. Inserting the gold token when the top-K
misses it (SpecForge PR #772, vllm-project/speculators PR #1006) gives every position a label
without scoring the whole vocabulary with the pairwise term; the metrics use the strict
top-K, as decoding does. Teacher forcing is exact for the chain's acceptance: the chain keeps
a drafted token only while every one before it was the target's, so the predecessor of every
position that can still be accepted is the gold token.

Initialisation: every convolution starts as the identity (base tap 0 = 1, the other taps and
``kernel_projection`` zero, so the dynamic term is zero; vllm-project/speculators PR #1006), the
successor codebook at zero (the pairwise term is exactly zero at step 0, so the selector picks
the unary argmax), the predecessor codebook N(0, 1) and ``hidden_projection`` with nn.Linear's
default init, so the first steps' gradients reach the successor codebook at a useful scale.
A DFlash2 drafter initialised from a DFlash drafter (``init_dflash2_from_drafter``) therefore
computes that drafter's block hidden states and drafts its full-vocabulary greedy chain at step 0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..config import DFlashDraftConfig
from ..dflash2 import ARCHITECTURE, DFlash2Config, DFlash2DraftModel, DFlash2Settings
from ..drafter import DFlashDraftModel, DraftContextCache
from ..errors import DFlashConfigError
from .model import OnlineDFlashModel, block_metrics, copyable_anchors, loss_precision, sample_anchors
from .trainer import check_init_fields

#: What the DFlash2 training CLI takes (and the published drafters use): 2 taps, groups of 16
#: channels, top-16 candidates. The selector rank follows the hidden size (``suggest_selector_rank``).
DEFAULT_CONV_KERNEL_SIZE = 2
DEFAULT_CONV_GROUP_SIZE = 16
DEFAULT_SELECTOR_TOP_K = 16
#: The selector loss weight of both community recipes (SpecForge ``dflash2_selector_loss_alpha``,
#: speculators ``selector_loss_alpha``); docs/dflash2.md, "Training", says why it is kept.
DEFAULT_SELECTOR_WEIGHT = 1.0


def suggest_selector_rank(hidden_size: int) -> int:
    """256 (the published drafters', hidden 2560-5120) for hidden >= 2048, else 64: the codebooks
    are 2 x vocab x rank parameters, and at rank 256 a 49k-vocabulary target's would be 25M,
    three times a 2-layer drafter for a 135M target."""
    return 256 if hidden_size >= 2048 else 64


def make_dflash2_config(base: DFlashDraftConfig, settings: DFlash2Settings) -> DFlash2Config:
    """The DFlash2 config.json (z-lab's flat layout: block_size and RoPE at the top level, the
    DFlash2 keys in dflash_config) for the DFlash drafter shape ``base``."""
    if base.draft_vocab_size is not None:
        raise DFlashConfigError(f"draft_vocab_size={base.draft_vocab_size}: a DFlash2 drafter scores the whole "
                                "vocabulary (its selector codebooks cover every token); use --draft_vocab full")
    raw = base.to_dict()
    raw.pop("draft_vocab_size", None)
    raw["architectures"] = [ARCHITECTURE]
    raw["is_causal"] = False  # draft layers attend bidirectionally within the block (the published contract)
    raw["dflash_config"] = {**raw["dflash_config"],
                            "conv_kernel_size": settings.conv_kernel_size, "conv_group_size": settings.conv_group_size,
                            "selector_rank": settings.selector_rank, "selector_top_k": settings.selector_top_k}
    if settings.output_multiplier != 1.0:
        raw["dflash_config"]["output_multiplier"] = settings.output_multiplier
    if settings.input_embedding_scale != 1.0:
        raw["dflash_config"]["input_embedding_scale"] = settings.input_embedding_scale
    if settings.final_logit_softcapping is not None:
        raw["dflash_config"]["final_logit_softcapping"] = settings.final_logit_softcapping
    return DFlash2Config.from_dict(raw)


@torch.no_grad()
def init_dflash2_for_training(drafter: DFlash2DraftModel) -> None:
    """Identity convolutions and a selector whose pairwise term is zero (see the module doc)."""
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel.zero_()
            conv.base_kernel[:, 0] = 1.0
            conv.kernel_projection.weight.zero_()
    selector = drafter.candidate_selector
    selector.hidden_projection.reset_parameters()
    selector.predecessor_codebook.normal_(0.0, 1.0)
    selector.successor_codebook.zero_()


#: Config fields a drafter to start from must share with the DFlash2 drafter being trained.
SHARED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "block_size", "mask_token_id", "target_layer_ids", "vocab_size")


def _shared_part(name: str) -> bool:
    """Whether a DFlash2 tensor is one a DFlash drafter has too (layers, fc, norms)."""
    return "_conv." not in name and not name.startswith("candidate_selector.")


@torch.no_grad()
def init_dflash2_from_drafter(drafter: DFlash2DraftModel, source: DFlashDraftModel, path: Any) -> list[str]:
    """Start from an exported drafter (``--init_drafter``): a DFlash drafter gives the shared parts
    (draft layers, fc, hidden_norm, norm; its reduced draft vocabulary is not used), the
    convolutions and the selector keep :func:`init_dflash2_for_training`'s values; a DFlash2
    drafter gives everything (its DFlash2 settings must match). Returns the tensor names copied."""
    check_init_fields(drafter, source, path, SHARED_FIELDS)
    if isinstance(source, DFlash2DraftModel) and source.dflash2 != drafter.dflash2:
        raise DFlashConfigError(f"--init_drafter {path}: its DFlash2 settings {source.dflash2} differ from those of "
                                f"the drafter being trained, {drafter.dflash2}")
    own = drafter.state_dict()
    state = {k: v for k, v in source.state_dict().items() if k in own and "rotary" not in k}
    if not isinstance(source, DFlash2DraftModel):
        state = {k: v for k, v in state.items() if _shared_part(k)}
    wanted = {k for k in own if "rotary" not in k and (isinstance(source, DFlash2DraftModel) or _shared_part(k))}
    missing = sorted(wanted - set(state))
    if missing:
        raise DFlashConfigError(f"--init_drafter {path}: tensors missing {missing[:5]}")
    for name, tensor in state.items():
        own[name].copy_(tensor)
    return sorted(state)


def selector_training_candidates(candidates: torch.Tensor, gold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                         torch.Tensor]:
    """(training candidates [..., K], the gold token's index among them [...], whether the strict
    top-K held it [...]). A gold token missing from ``candidates`` replaces the last (K-th) one."""
    match = candidates == gold[..., None]
    hit = match.any(-1)
    last = candidates.shape[-1] - 1
    index = torch.where(hit, match.int().argmax(-1), torch.full_like(gold, last))
    training = candidates.clone()
    training[..., last] = torch.where(hit, candidates[..., last], gold)
    return training, index, hit


class OnlineDFlash2Model(OnlineDFlashModel):
    """Trainable DFlash2 drafter + the target's frozen embedding and head, with the block loss
    and the selector loss (module doc). ``selector_weight`` is the selector loss's weight."""

    def __init__(self, drafter: DFlash2DraftModel, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 num_anchors: int = 32, gamma: float = 4.0, distill_weight: float = 0.0, attention: str = "dense",
                 selector_weight: float = DEFAULT_SELECTOR_WEIGHT) -> None:
        if not isinstance(drafter, DFlash2DraftModel):
            raise TypeError(f"OnlineDFlash2Model trains a DFlash2DraftModel, not {type(drafter).__name__}")
        super().__init__(drafter, embed_weight, lm_head_weight, num_anchors=num_anchors, gamma=gamma,
                         distill_weight=distill_weight, attention=attention)
        self.settings = drafter.dflash2
        self.selector_weight = float(selector_weight)

    def block_embeds(self, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        # The raw embedding rows times input_embedding_scale, as the runtime drafts them.
        return super().block_embeds(input_ids, anchors) * self.settings.input_embedding_scale

    def run_drafter(self, embeds: torch.Tensor, positions: torch.Tensor, cache: DraftContextCache,
                    mask: Any) -> torch.Tensor:
        return self.drafter(embeds, positions, cache, attention_mask=mask, block_len=self.block_size)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The unary logits, ``softcap(output_multiplier * lm_head(h))``, as the selector scores them."""
        logits = self.raw_logits(hidden) * self.settings.output_multiplier
        cap = self.settings.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def pair_scores(self, hidden: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """The pairwise term [..., K] of ``candidates`` [..., K] after ``predecessors`` [...]."""
        selector = self.drafter.candidate_selector
        gate = selector.predecessor_codebook[predecessors] * selector.hidden_projection(hidden)
        return torch.einsum("...r,...kr->...k", gate, selector.successor_codebook[candidates].to(gate.dtype))

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
    ) -> dict[str, Any]:
        """The DFlash2 loss of a batch and its metrics (arguments as ``OnlineDFlashModel.forward``).

        ``correct`` (and so the chain metrics) is the selector's teacher-forced choice among the
        strict top-K; ``extras`` carries (sum, count) pairs: the selector loss, the top-K recall
        of the gold token and the chain the unary argmax alone would draft (DFlash's rule).
        """
        anchors, keep = sample_anchors(loss_mask, self.num_anchors, generator) if anchors is None else anchors
        hidden = self.draft_hidden(input_ids, features, anchors, keep)
        unary = self.head_logits(hidden)  # [b, n, B-1, V]
        label_pos, labels, valid, _, weight = self._labels(input_ids, loss_mask, anchors, keep)
        total = (weight.sum() if weight_total is None else weight_total).clamp(min=1e-6)
        block = self.block_loss(unary, labels, weight, label_pos, final_hidden)

        gold = labels.clamp(min=0)
        # The predecessor of offset k is x[a+k-1]: the anchor, then the gold tokens (teacher forcing).
        predecessors = torch.cat([input_ids.gather(1, anchors)[:, :, None], gold[:, :, :-1]], dim=2)
        candidates = torch.topk(unary.detach(), self.settings.selector_top_k, dim=-1).indices
        training, index, hit = selector_training_candidates(candidates, gold)
        strict_pair = self.pair_scores(hidden, predecessors, candidates)
        gold_pair = self.pair_scores(hidden, predecessors, gold[..., None])[..., 0]
        last = candidates.shape[-1] - 1
        pair = torch.cat([strict_pair[..., :last],
                          torch.where(hit, strict_pair[..., last], gold_pair)[..., None]], dim=-1)
        scores = loss_precision(unary.gather(-1, training) + pair)
        selector_ce = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), index.reshape(-1), reduction="none")
        selector = (selector_ce.view_as(weight) * weight).sum()
        loss = (block + self.selector_weight * selector) / total * scale

        with torch.no_grad():
            strict = unary.gather(-1, candidates) + strict_pair
            chosen = candidates.gather(-1, strict.argmax(-1, keepdim=True))[..., 0]
            copyable = copyable_anchors(input_ids, anchors)
            metrics = block_metrics((chosen == labels) & valid, valid, copyable)
            unary_correct = (candidates[..., 0] == labels) & valid
            unary_chain = block_metrics(unary_correct, valid)
            w_sum, n_valid = weight.sum(), valid.sum().float()
        return {
            "loss": loss,
            **metrics,
            "coverage": torch.ones(()),
            "extras": {
                "selector_loss": (selector.detach(), w_sum),
                "block_loss": (block.detach(), w_sum),
                "candidate_recall": ((hit & valid).sum().float(), n_valid),
                # Teacher-forced top-1 accuracy over all offsets: the selector's choice, and the unary argmax's.
                "selector_accuracy": (metrics["correct"].sum(), n_valid),
                "unary_accuracy": (unary_correct.sum().float(), n_valid),
                # (1 + accepted) per anchor: the chain tau of the unary argmax, DFlash's drafting rule.
                "unary_chain_tau": (unary_chain["chain_accepted"] + unary_chain["chain_anchors"],
                                    unary_chain["chain_anchors"]),
            },
        }
