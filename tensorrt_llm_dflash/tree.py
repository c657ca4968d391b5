"""DDTree: draft trees from DFlash marginals, masks, the verifier walk and compaction indices.

This module is the single implementation of the tree algorithm. It is shared by the
PyTorch runtime, the C++ plugin's tests and the TensorRT-LLM runtime, so it uses
plain numpy arrays and Python, no torch and no transformers.

Conventions (all arrays are numpy):

* A tree has ``N = num_nodes`` entries; index 0 is the root, the bonus token that the
  target already chose; the other entries are draft nodes in best-first pop order.
* ``parents[0] == -1`` and ``parents[i] < i`` for every other node.
* ``depths[0] == 0``; a node at depth ``d`` predicts the token ``d`` positions after the
  root. Depths double as TensorRT-LLM's ``spec_decoding_position_offsets``.

Theory (DDTree, arXiv 2604.12989): with per-depth draft marginals ``p_d``, the
probability of a prefix is the product of its per-depth marginals, and the expected
acceptance of a tree is the sum of its nodes' prefix probabilities. The ``B`` most
probable prefixes are therefore optimal for a node budget ``B``; they are
prefix-closed, and a best-first search over rank tuples finds them in O(B log B).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .errors import DFlashInputError

#: Largest node budget the runtime supports. The verify pass grows with the tree
#: (``budget + 1`` tokens), and the C++ mask plugin is sized for 1,024 tree tokens.
MAX_DDTREE_BUDGET = 1023
#: Largest tree (root included) the packed-mask / plugin code accepts.
MAX_TREE_NODES = MAX_DDTREE_BUDGET + 1


@dataclass
class DraftTree:
    """A flattened draft tree. ``tokens[0]`` is the root (the bonus token)."""

    tokens: np.ndarray  # int64 [N]
    parents: np.ndarray  # int32 [N], -1 at the root
    depths: np.ndarray  # int32 [N]
    children: list[dict[int, int]] = field(repr=False)  # node -> {token: child node}

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.num_nodes else 0


def validate_budget(budget: int, block_size: int | None = None) -> int:
    """Check a DDTree node budget: 0 means the plain DFlash chain."""
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise DFlashInputError(f"ddtree_budget must be an integer, got {budget!r}")
    if budget < 0 or budget > MAX_DDTREE_BUDGET:
        raise DFlashInputError(
            f"ddtree_budget={budget} is out of range: it must be 0 (DFlash chain) or "
            f"1..{MAX_DDTREE_BUDGET} draft nodes"
        )
    if block_size is not None and block_size < 2:
        raise DFlashInputError(f"block_size={block_size} must be at least 2")
    return int(budget)


def _finish(tokens: list[int], parents: list[int], depths: list[int]) -> DraftTree:
    children: list[dict[int, int]] = [dict() for _ in tokens]
    for node in range(1, len(tokens)):
        # setdefault keeps the first (most probable) child should a token repeat;
        # best-first construction never produces duplicate siblings anyway.
        children[parents[node]].setdefault(tokens[node], node)
    return DraftTree(
        tokens=np.asarray(tokens, dtype=np.int64),
        parents=np.asarray(parents, dtype=np.int32),
        depths=np.asarray(depths, dtype=np.int32),
        children=children,
    )


def build_chain(root_token: int, draft_tokens: np.ndarray | list[int]) -> DraftTree:
    """The DFlash chain: the root followed by the drafter's top-1 token at each depth."""
    draft = [int(t) for t in np.asarray(draft_tokens).reshape(-1)]
    n = len(draft) + 1
    return _finish([int(root_token)] + draft, [-1] + list(range(n - 1)), list(range(n)))


def build_ddtree(
    root_token: int,
    topk_logprobs: np.ndarray,
    topk_tokens: np.ndarray,
    budget: int,
) -> DraftTree:
    """Best-first DDTree construction.

    ``topk_logprobs`` / ``topk_tokens`` are ``[D, K]`` arrays: for each depth
    ``1..D`` the K most probable draft tokens, sorted by decreasing log-probability
    (log-softmax of the drafter's float32 logits). Returns a tree with at most
    ``budget`` draft nodes plus the root. Ties are broken by the rank tuple, so the
    result is deterministic; a -inf log-probability (outside a reduced draft
    vocabulary) is never a node.

    A node's score is its path sum added left to right in float64,
    ``score(r1..rd) = score(r1..r_{d-1}) + lp[d-1][rd]``: one addition per node, which
    rounds the same on any device, so ``device_tree.build_ddtree_device`` (tensor ops)
    builds the same tree node for node, ties included. The reference implementation
    (liranringel/ddtree) updates a sibling's score incrementally (``score - lp[r] +
    lp[r + 1]``, two roundings); the two can differ only in the last ulp of a near-tie.
    """
    lp = np.asarray(topk_logprobs, dtype=np.float64)
    tok = np.asarray(topk_tokens)
    if lp.ndim != 2 or lp.shape != tok.shape:
        raise DFlashInputError(
            f"topk_logprobs and topk_tokens must both be [depth, K]; got {lp.shape} and {tok.shape}"
        )
    lp_rows = lp.tolist()
    tok_rows = tok.tolist()
    # DDTree's marginals do not depend on the parent: every node at a depth shares that depth's row.
    return best_first_tree(root_token, budget, lp.shape[0], lambda node, token, depth: (lp_rows[depth - 1],
                                                                                       tok_rows[depth - 1]))


#: ``children(parent node, parent token, depth)`` -> (log-probabilities sorted non-increasing,
#: tokens) of the parent's candidate children at ``depth`` (1-based).
ChildRows = Callable[[int, int, int], tuple[list[float], list[int]]]


def best_first_tree(root_token: int, budget: int, depth_limit: int, children: ChildRows) -> DraftTree:
    """The best-first search shared by DDTree and the DFlash2 tree (``dflash2.tree``).

    Pops prefixes in non-increasing path score (a left-to-right float64 sum of the
    log-probabilities along the path), at most ``budget`` of them, each at most
    ``depth_limit`` deep. A popped node pushes its next sibling and its own best child, so
    the heap never holds more than two entries per node. ``children`` is asked once per
    node that may have children; for DDTree it ignores the parent, for DFlash2 the
    conditional depends on the parent's token. Ties are broken by the rank tuple.
    """
    tokens = [int(root_token)]
    parents = [-1]
    depths = [0]
    if budget <= 0 or depth_limit <= 0:
        return _finish(tokens, parents, depths)
    rows = {0: children(0, int(root_token), 1)}
    if not rows[0][0] or rows[0][0][0] == -np.inf:
        return _finish(tokens, parents, depths)

    node_of_prefix: dict[tuple[int, ...], int] = {(): 0}
    # Heap entries: (-score, rank tuple, score of the prefix). The tuple breaks ties (it is unique).
    heap: list[tuple[float, tuple[int, ...], float]] = [(-(0.0 + rows[0][0][0]), (0,), 0.0)]
    while heap and len(tokens) <= budget:
        neg_score, ranks, prefix_score = heapq.heappop(heap)
        depth = len(ranks)
        rank = ranks[-1]
        parent = node_of_prefix[ranks[:-1]]
        lp_row, tok_row = rows[parent]
        node = len(tokens)
        node_of_prefix[ranks] = node
        tokens.append(int(tok_row[rank]))
        parents.append(parent)
        depths.append(depth)
        score = -neg_score
        if rank + 1 < len(lp_row) and lp_row[rank + 1] != -np.inf:
            sibling_score = prefix_score + lp_row[rank + 1]
            heapq.heappush(heap, (-sibling_score, ranks[:-1] + (rank + 1,), prefix_score))
        if depth < depth_limit:
            rows[node] = children(node, tokens[-1], depth + 1)
            first = rows[node][0]
            if first and first[0] != -np.inf:
                heapq.heappush(heap, (-(score + first[0]), ranks + (0,), score))
    return _finish(tokens, parents, depths)


# ----------------------------------------------------------------------------- masks


def validate_parents(parents: np.ndarray, num_nodes: int | None = None) -> None:
    """Raise DFlashInputError unless ``parents[:num_nodes]`` is a valid flattened tree."""
    parents = np.asarray(parents)
    n = parents.shape[-1] if num_nodes is None else int(num_nodes)
    if n < 1 or n > MAX_TREE_NODES:
        raise DFlashInputError(f"tree size N={n} is out of range 1..{MAX_TREE_NODES}")
    if n > parents.shape[-1]:
        raise DFlashInputError(f"tree size N={n} exceeds the parents row length {parents.shape[-1]}")
    if parents[0] != -1:
        raise DFlashInputError(f"parents[0]={int(parents[0])}: the root's parent must be -1")
    for i in range(1, n):
        p = int(parents[i])
        if p < 0:
            raise DFlashInputError(f"parents[{i}]={p}: only the root may have a negative parent")
        if p >= i:
            raise DFlashInputError(
                f"parents[{i}]={p}: a parent must come before its child (and be < N={n})"
            )


def visibility(parents: np.ndarray) -> np.ndarray:
    """Boolean ancestor-only mask: ``vis[i, j]`` iff j is i or an ancestor of i."""
    parents = np.asarray(parents)
    n = parents.shape[0]
    vis = np.zeros((n, n), dtype=bool)
    vis[0, 0] = True
    for i in range(1, n):
        vis[i, :i] = vis[parents[i], :i]
        vis[i, i] = True
    return vis


def packed_mask(vis: np.ndarray) -> np.ndarray:
    """TensorRT-LLM ``spec_decoding_packed_mask`` rows for one tree: int32 [N, ceil(N/32)].

    Bit ``j % 32`` (LSB first) of word ``j // 32`` in row ``i`` is set iff ``vis[i, j]``.
    """
    vis = np.asarray(vis, dtype=bool)
    n = vis.shape[0]
    words = (n + 31) // 32
    padded = np.zeros((n, words * 32), dtype=bool)
    padded[:, :n] = vis
    packed_bytes = np.packbits(padded, axis=1, bitorder="little")
    return packed_bytes.view("<u4").astype(np.uint32).view(np.int32).reshape(n, words)


def unpack_mask(packed: np.ndarray, num_nodes: int) -> np.ndarray:
    """Inverse of :func:`packed_mask` (for tests and debugging)."""
    packed = np.ascontiguousarray(np.asarray(packed, dtype=np.int32))
    bits = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :num_nodes].astype(bool)


def batched_tree_inputs(
    parents: np.ndarray, generation_lengths: np.ndarray, max_nodes: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gpt attention plugin's ``spec_decoding_*`` tensors from padded parents ``[batch, N]``.

    ``max_nodes`` (M >= N, default N) is the engine's ``spec_decoding_max_generation_length``
    (``max_draft_len + 1``). Returns, all int32, in the layout TensorRT-LLM's XQA kernels read:

    * packed mask ``[batch * N, ceil(M/32)]``: node i of sequence b is row ``cu[b] + i``
      (``cu`` the exclusive prefix sum of the lengths: rows packed tightly, as the tokens
      are); the rows from ``sum(lengths)`` on are zero;
    * position offsets ``[batch, M]``: node depths, zero past each length;
    * generation lengths ``[batch]``.

    This is the contract of the DFlashTreeMask plugin (docs/plugins.md has the kernel sources).
    """
    parents = np.asarray(parents, dtype=np.int32)
    lengths = np.asarray(generation_lengths, dtype=np.int32).reshape(-1)
    batch, n = parents.shape
    if lengths.shape[0] != batch:
        raise DFlashInputError(
            f"generation_lengths has {lengths.shape[0]} entries for a batch of {batch}"
        )
    max_nodes = n if max_nodes is None else int(max_nodes)
    if not n <= max_nodes <= MAX_TREE_NODES:
        raise DFlashInputError(f"max_nodes={max_nodes} must be between N={n} and {MAX_TREE_NODES}")
    words = (max_nodes + 31) // 32
    packed = np.zeros((batch * n, words), dtype=np.int32)
    offsets = np.zeros((batch, max_nodes), dtype=np.int32)
    row = 0
    for b in range(batch):
        length = int(lengths[b])
        validate_parents(parents[b], length)
        rows = packed_mask(visibility(parents[b, :length]))
        packed[row : row + length, : rows.shape[1]] = rows
        offsets[b, :length] = depths_from_parents(parents[b, :length])
        row += length
    return packed, offsets, lengths.copy()


def depths_from_parents(parents: np.ndarray) -> np.ndarray:
    parents = np.asarray(parents)
    depths = np.zeros(parents.shape[0], dtype=np.int32)
    for i in range(1, parents.shape[0]):
        depths[i] = depths[parents[i]] + 1
    return depths


# ------------------------------------------------------------------------ walk/commit


def walk(tree: DraftTree, target_choice: np.ndarray | list[int]) -> tuple[list[int], int]:
    """Follow the target's choices from the root.

    ``target_choice[i]`` is the target's token after node i (argmax at T=0, the
    target's own sample at T>0). Returns the accepted node indices (root first) and
    the bonus token, i.e. the target's choice at the last accepted node.
    """
    choice = [int(t) for t in np.asarray(target_choice).reshape(-1)]
    path = [0]
    node = 0
    while True:
        child = tree.children[node].get(choice[node])
        if child is None:
            return path, choice[node]
        path.append(child)
        node = child


def compaction_indices(accepted_nodes: list[int] | np.ndarray, past_len: int) -> np.ndarray:
    """KV slots to gather so the accepted path becomes contiguous after ``past_len``.

    After verification the tree's K/V sit at slots ``past_len + node``. Slot
    ``past_len + i`` must receive slot ``past_len + accepted_nodes[i]``. Because
    nodes are stored parent-first, ``accepted_nodes`` is strictly increasing and
    ``accepted_nodes[i] >= i``, so an in-place forward copy never overwrites a
    source it still needs.
    """
    nodes = np.asarray(accepted_nodes, dtype=np.int64)
    if nodes.ndim != 1 or nodes.size == 0 or nodes[0] != 0 or np.any(np.diff(nodes) <= 0):
        raise DFlashInputError(
            f"accepted_nodes={nodes.tolist()} must start at the root (0) and be strictly increasing"
        )
    return past_len + nodes


# ------------------------------------------------------------------ scored trees (cost-aware DDTree)


@dataclass
class CandidateTree:
    """A pool of candidate nodes, each with an estimated acceptance probability.

    ``conditional[i]`` estimates P(the target continues node i's parent with node i's token);
    the probability that the whole path root..i is accepted is the product along the path
    (:meth:`path_values`). ``sources[i]`` is a bit set: ``DRAFTER`` and/or ``LOOKUP``.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    conditional: list[float]
    sources: list[int]
    children: list[dict[int, int]]

    @classmethod
    def from_tree(cls, tree: DraftTree, conditional: np.ndarray | list[float], source: int) -> CandidateTree:
        conditional = [float(c) for c in np.asarray(conditional).reshape(-1)]
        if len(conditional) != tree.num_nodes:
            raise DFlashInputError(f"{len(conditional)} conditional probabilities for a tree of {tree.num_nodes} nodes")
        conditional[0] = 1.0
        return cls(tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist(), conditional,
                   [0] + [source] * (tree.num_nodes - 1), [dict(c) for c in tree.children])

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def add_branch(self, tokens: list[int], conditional: list[float], source: int) -> None:
        """Graft a chain of tokens under the root, sharing every node whose tokens agree.

        A shared node keeps the larger of the two estimates: both are estimates of the same
        event, and the larger one comes from the source that predicts it better.
        """
        node = 0
        for token, prob in zip(tokens, conditional):
            token = int(token)
            child = self.children[node].get(token)
            if child is None:
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1)
                self.conditional.append(float(prob))
                self.sources.append(source)
                self.children.append({})
                self.children[node][token] = child
            else:
                self.conditional[child] = max(self.conditional[child], float(prob))
                self.sources[child] |= source
            node = child

    def path_values(self) -> np.ndarray:
        """P(path root..i accepted) per node: the product of the conditionals (parents come first)."""
        values = np.ones(self.num_nodes)
        for i in range(1, self.num_nodes):
            values[i] = values[self.parents[i]] * min(max(self.conditional[i], 0.0), 1.0)
        return values

    def ranked(self) -> tuple[np.ndarray, np.ndarray]:
        """Draft nodes by decreasing path value (ties: parent-first order), and those values.

        Values never increase from parent to child, so every prefix of this order is a
        prefix-closed tree: the best tree of n nodes is the first n, and its expected
        acceptance length is 1 + the sum of their values (the DDTree argument with
        calibrated probabilities)."""
        values = self.path_values()
        order = np.lexsort((np.arange(1, self.num_nodes), -values[1:])) + 1
        return order, values[order]

    def select(self, nodes: np.ndarray | list[int]) -> tuple[DraftTree, np.ndarray]:
        """The subtree of the root and ``nodes`` (prefix-closed), in parent-first order; and
        the pool index of each of its nodes."""
        kept = np.sort(np.asarray(list(nodes), dtype=np.int64))
        kept = np.concatenate([[0], kept[kept > 0]]).astype(np.int64)
        where = {int(old): new for new, old in enumerate(kept)}
        parents = [-1]
        for old in kept[1:]:
            parent = self.parents[int(old)]
            if parent not in where:
                raise DFlashInputError(f"node {int(old)} is selected without its parent {parent}")
            parents.append(where[parent])
        tree = _finish([self.tokens[int(i)] for i in kept], parents, [self.depths[int(i)] for i in kept])
        return tree, kept


DRAFTER = 1
LOOKUP = 2
