"""The DFlash2 candidate selector: unary scores, the pairwise term, the chain and its acceptance.

For draft position t (1..B-1 after the root) with draft hidden state h_t:

    unary_t      = softcap(output_multiplier * lm_head(h_t))       over the whole vocabulary
    candidates_t = the selector_top_k tokens with the largest unary_t
    score_t(c | p) = unary_t[c] + < predecessor_codebook[p] * hidden_projection(h_t), successor_codebook[c] >

where p is the token before c (the root at t = 1). Greedy (T = 0) takes the argmax step by step;
at T > 0 each draft token is drawn from q_t(. | p) = softmax(score_t(. | p) / T) over the
candidates, and the target accepts it by rejection sampling against that sparse q
(:meth:`SelectorDraft.accept`), which keeps the target's distribution exactly.

Ordering convention (the reference, z-lab/dflash 07ebd93, uses ``topk(sorted=False)``, whose
order is the kernel's): here the candidates are ordered by unary score, ties by lower token id,
and the K-th place goes to the lower id on a tie; an argmax over scores takes the first maximum
in that order. Scores are computed in float32 for half-precision drafters (float64 for float64
drafters); the reference accumulates in the model dtype. Both choices can change a choice only
at an exact tie or a last-ulp near-tie of the reference's own arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..sampling import SamplingParams, processed_probs
from ..tree import DraftTree, build_chain


def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, tokens) [D, k] of the k largest logits per row, in the order above."""
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    values, tokens = [], []
    for row, bound in zip(logits, kth):
        ids = torch.nonzero(row >= bound).squeeze(-1)  # ascending ids, ties at the bound included
        order = torch.argsort(row[ids], descending=True, stable=True)[:k]
        values.append(row[ids[order]])
        tokens.append(ids[order])
    return torch.stack(values), torch.stack(tokens)


@dataclass
class SelectorDraft:
    """What one DFlash2 draft pass leaves for the tree build: everything the scores need.

    ``unary`` [D, K] and ``tokens`` [D, K] are the candidates of depths 1..D; ``gates`` [D, r]
    is ``hidden_projection(h_t)``; ``successors`` [D, K, r] the successor codebook rows of the
    candidates; all three in the scoring dtype. ``predecessor_codebook`` [V, r] is the drafter's own.
    """

    unary: torch.Tensor
    tokens: torch.Tensor
    gates: torch.Tensor
    successors: torch.Tensor
    predecessor_codebook: torch.Tensor
    #: Set by a sampled chain (T > 0): the q row each draft token was drawn from, for :meth:`accept`.
    sampled_q: list[torch.Tensor] | None = field(default=None, repr=False)
    #: :func:`conditional_rows` already computed, by (depth, predecessor): the tree build and the policy's scores
    #: read the same rows.
    _rows: dict[tuple[int, int], tuple[list[float], list[int]]] = field(default_factory=dict, repr=False)

    #: The decode loop asks such a draft for its tree instead of ranking marginals itself.
    selects_tokens = True

    @property
    def depth(self) -> int:
        return int(self.unary.shape[0])

    def scores(self, depth: int, predecessor: int) -> torch.Tensor:
        """score_{depth+1}(. | predecessor) over the K candidates of that depth (0-based ``depth``)."""
        # One row, converted here: the codebook stays in the drafter's dtype and device ([V, r] is large).
        row = self.predecessor_codebook[predecessor].to(self.gates.device, self.gates.dtype)
        pair = row * self.gates[depth]
        return self.unary[depth] + self.successors[depth] @ pair

    def chain(self, root: int, depth: int, sampling: SamplingParams | None = None,
              generator: torch.Generator | None = None) -> DraftTree:
        """The selector's walk from ``root``: argmax at T = 0, else a draw from q at each step."""
        sampled = sampling is not None and not sampling.greedy
        self.sampled_q = [] if sampled else None
        tokens, predecessor = [], int(root)
        for t in range(min(depth, self.depth)):
            scores = self.scores(t, predecessor)
            if sampled:
                q = torch.softmax(scores.to(torch.float64) / sampling.temperature, -1)
                index = int(torch.multinomial(q.to(_sample_device(generator)), 1, generator=generator))
                self.sampled_q.append(q)
            else:
                index = int(torch.argmax(scores))
            predecessor = int(self.tokens[t, index])
            tokens.append(predecessor)
        return build_chain(root, tokens)

    def build_tree(self, root: int, budget: int, max_depth: int, sampling: SamplingParams | None = None,
                   generator: torch.Generator | None = None) -> DraftTree:
        """The decode loop's hook: the chain (budget 0) or the DFlash2 tree of ``budget`` nodes."""
        if budget == 0:
            return self.chain(root, max_depth, sampling, generator)
        from .tree import build_dflash2_tree

        self.sampled_q = None
        return build_dflash2_tree(root, self, budget, max_depth)

    def node_conditionals(self, tree: DraftTree) -> np.ndarray:
        """q(token | the parent's token) of every node of a tree built from this draft (1 at the root): what the
        cost-aware policy calibrates into acceptance probabilities, as it does DDTree's marginals."""
        out = np.ones(tree.num_nodes)
        for i in range(1, tree.num_nodes):
            logq, tokens = conditional_rows(self, int(tree.depths[i]), int(tree.tokens[tree.parents[i]]))
            out[i] = np.exp(logq[tokens.index(int(tree.tokens[i]))])
        return out

    def accept(self, tree: DraftTree, node_logits: torch.Tensor, sampling: SamplingParams,
               generator: torch.Generator | None) -> tuple[list[int], int] | None:
        """Rejection sampling of a sampled chain against the sparse q (None: use the target's walk).

        Node i (1..n-1) drew token x from q_i; it is accepted with probability
        min(1, p(x) / q_i(x)), p being the target's processed distribution after node i-1; at the
        first rejection the bonus comes from normalise(max(p - q_i, 0)), after a full chain from p
        at the last node. This is standard speculative sampling, so the committed tokens follow p.
        """
        if self.sampled_q is None or sampling.greedy:
            return None
        probs = processed_probs(node_logits, sampling).to(torch.float64)
        device = _sample_device(generator)
        for i in range(1, tree.num_nodes):
            q = self.sampled_q[i - 1].to(probs.device)
            candidates = self.tokens[i - 1].to(probs.device)
            x = int(tree.tokens[i])
            q_x = q[int(torch.nonzero(candidates == x)[0, 0])]
            u = torch.rand((), generator=generator, device=device, dtype=torch.float64).to(probs.device)
            if not bool(u * q_x < probs[i - 1, x]):
                residual = probs[i - 1].clone()
                residual[candidates] -= q
                residual.clamp_(min=0.0)
                total = residual.sum()
                row = residual / total if total > 0 else probs[i - 1]
                return list(range(i)), _draw(row, generator)
        return list(range(tree.num_nodes)), _draw(probs[tree.num_nodes - 1], generator)


def _sample_device(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")


def _draw(row: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(row.to(_sample_device(generator)), 1, generator=generator))


def conditional_rows(draft: SelectorDraft, depth: int, predecessor: int) -> tuple[list[float], list[int]]:
    """log q(. | predecessor) at ``depth`` (1-based) sorted non-increasing (ties: candidate order),
    and the tokens, as ``tree.best_first_tree`` takes them. Float64, so the tree is the same
    whatever device scored it."""
    key = (int(depth), int(predecessor))
    if key not in draft._rows:
        scores = draft.scores(depth - 1, predecessor).to(torch.float64).cpu().numpy()
        logq = scores - np.logaddexp.reduce(scores)
        # Ranked by the scores themselves (the greedy chain's argmax), so the first child is the greedy
        # choice even where subtracting the normaliser rounds two scores to one log-probability.
        order = np.argsort(-scores, kind="stable")
        draft._rows[key] = (logq[order].tolist(), draft.tokens[depth - 1].cpu().numpy()[order].tolist())
    return draft._rows[key]
