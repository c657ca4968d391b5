"""A draft tree over DFlash2's selector (no other system builds one).

DDTree ranks prefixes by the product of per-depth marginals. DFlash2's draft distribution at
depth t depends on the token chosen at t-1 (the pairwise codebook term), so the probability of
a prefix c_1..c_d after the root c_0 is

    P(c_1..c_d) = prod_t q_t(c_t | c_{t-1}),   q_t(. | p) = softmax_K(unary_t + edge_t(p, .)),

and the path score is the left-to-right sum of log q_t: the unary and the edge term of every
step inside the softmax of that step. Each factor is <= 1, so scores never increase from parent
to child, the B best prefixes are prefix-closed, and the same best-first search as DDTree
(``tree.best_first_tree``) finds them; only the child rows differ: a node's children are
ranked by q given that node's own token, computed when the node is popped. The first child of
every node is the selector's greedy choice, so the tree's top path is the greedy chain.
"""

from __future__ import annotations

from ..tree import DraftTree, best_first_tree
from .selector import SelectorDraft, conditional_rows


def build_dflash2_tree(root: int, draft: SelectorDraft, budget: int, max_depth: int) -> DraftTree:
    """The ``budget`` most probable prefixes under the selector's conditionals, at most
    ``max_depth`` (and at most the block's) deep."""
    depth_limit = min(max_depth, draft.depth)
    return best_first_tree(root, budget, depth_limit, lambda node, token, depth: conditional_rows(draft, depth, token))
