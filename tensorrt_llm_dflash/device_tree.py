"""DDTree on the device: the best-first tree, its visibility and the verifier's walk as fixed-shape tensor ops.

The same algorithm as :func:`tensorrt_llm_dflash.tree.build_ddtree` (the numpy reference every part is
checked against), written so that a CUDA graph can hold it: batched (a leading batch dimension), no
Python loop over nodes (loops run over depths, a static count), no data-dependent shapes and no host
reads. The tests compare it with ``build_ddtree`` node for node, ties included.

**Why per-depth selection gives the same tree.** Every node is a rank tuple ``(r1..rd)`` with score
``lp[0][r1] + ... + lp[d-1][rd]``, summed left to right in float64 (``build_ddtree`` does the same:
one addition per node, so both devices round alike). Every tuple but ``(0,)`` has one generator in
the heap: its previous sibling if ``rd > 0``, else its prefix. Rows of ``lp`` are sorted non-increasing
and ``lp <= 0``, so the score never increases along a generator edge (float addition is monotone),
while the rank tuple strictly increases (a prefix sorts before its extensions). The heap key
``(-score, rank tuple)`` therefore strictly increases along generator edges, the heap pops tuples in
sorted key order, and the tree of budget ``n`` is the ``n`` smallest keys. That set is prefix-closed,
and a node's rank under its parent is below ``n``. Let ``kept_1`` be the ``n`` best depth-1 tuples and
``kept_d`` the ``n`` best among ``kept_{d-1} x ranks``: by induction each depth's share of the top-n
lies in ``kept_d`` (a top-n node has fewer than ``n`` smaller keys, so fewer than ``n`` candidates of
its depth beat it), so the ``n`` best of all kept nodes are exactly the tree. The code uses the
sharper static bounds the same counting gives: a top-n node at depth ``t`` follows its ``t - 1``
ancestors, so its rank is below ``n - t + 1``, its depth holds at most ``n - t + 1`` top-n nodes, and
depths beyond ``n`` hold none.

**Tie rule** (the same as the heap's): score descending, then rank tuple ascending,
lexicographically, a prefix before its extensions. Inside a depth, kept nodes are stored in
lexicographic order, so the flattened ``(parent, rank)`` index is itself lexicographic and a stable
sort by score keeps ties in that order. Across depths the comparison needs each node's position in
the lexicographic (pre-order) walk of the kept nodes: subtree sizes bottom-up, then
``pre(child) = pre(parent) + 1 + sizes of its earlier siblings``, top-down.

**Fixed shapes.** A tree of budget ``n`` always has ``n + 1`` columns. Columns past ``num_nodes`` are
padding: token -1, parent 0 (the root), depth 0, score -inf, ``valid`` False; a padding row sees
only itself, nothing sees a padding node and no walk accepts it. Depth limits (``max_depth``) and a
reduced draft vocabulary (-inf log-probabilities) only make nodes invalid (score -inf, sorted last),
never change a shape.

**Cost** (budget ``n``, ``K' = min(K, n)`` ranks, ``min(D, n)`` depths, per row): per depth one stable
sort of at most ``n * K'`` float64 keys and one sort of ``n`` int64 indices; then one stable sort of the at most
``D * n`` kept nodes (their pre-order listing is a scatter). Visibility and the walk use pointer
doubling: ``bit_length(D)`` rounds, not ``D``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import fused_tree
from .errors import DFlashInputError
from .tree import DraftTree, _finish


@dataclass
class DeviceTree:
    """A batch of padded draft trees; column 0 is the root (the bonus token)."""

    tokens: torch.Tensor  # int64 [B, N]; -1 on padding
    parents: torch.Tensor  # int64 [B, N]; -1 at the root, 0 on padding
    depths: torch.Tensor  # int64 [B, N]; 0 on padding
    valid: torch.Tensor  # bool [B, N]; the root and real nodes, a prefix of each row
    num_nodes: torch.Tensor  # int64 [B], root included
    scores: torch.Tensor  # float64 [B, N]; path log-probability, 0 at the root, -inf on padding

    @property
    def size(self) -> int:
        return int(self.tokens.shape[1])


def _root_only(root: torch.Tensor, size: int) -> DeviceTree:
    batch, device = root.shape[0], root.device
    cols = torch.arange(size, device=device)[None].expand(batch, -1)
    is_root = cols == 0
    return DeviceTree(
        tokens=torch.where(is_root, root[:, None], -1),
        parents=torch.where(is_root, -1, 0),
        depths=torch.zeros(batch, size, dtype=torch.long, device=device),
        valid=is_root.clone(),
        num_nodes=torch.ones(batch, dtype=torch.long, device=device),
        scores=torch.where(is_root, 0.0, float("-inf")).to(torch.float64),
    )


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(-1) - x


def build_ddtree_device(root: torch.Tensor, topk_logprobs: torch.Tensor, topk_tokens: torch.Tensor, budget: int,
                        max_depth: torch.Tensor | None = None, *, fused: bool | None = None) -> DeviceTree:
    """Best-first DDTree of ``budget`` draft nodes per row, as ``tree.build_ddtree`` builds it.

    ``root`` int64 [B]; ``topk_logprobs`` [B, D, K] (float32 or float64, rows sorted non-increasing;
    -inf entries are never nodes); ``topk_tokens`` int64 [B, D, K]; ``budget`` a static int;
    ``max_depth`` int64 [B] (nodes deeper than it are not built) or None. Returns ``budget + 1`` columns.

    ``fused``: the plugin library's one-call build (:mod:`.fused_tree`, the same tree bit for bit) where
    ``DFLASH_FUSED_TREE`` and the built libraries allow it (None), required (True), or the tensor ops below (False).
    """
    if fused is not False and int(budget) <= fused_tree.MAX_BUDGET:
        where = fused_tree.backend(root.device)
        if where is not None:
            return fused_tree.build_ddtree_fused(root, topk_logprobs, topk_tokens, budget, max_depth, where=where)
    if fused:
        raise DFlashInputError(f"the fused DDTree build does not run on {root.device} with budget {budget} here "
                               f"({fused_tree.FUSED_TREE_ENV}={fused_tree.mode()}, at most {fused_tree.MAX_BUDGET})")
    size = int(budget) + 1
    batch, depth_limit, k = topk_logprobs.shape
    if budget <= 0 or depth_limit == 0 or k == 0:
        return _root_only(root, size)
    device = root.device
    # Static bounds from the top-n's prefix closure. A node at depth t = d + 1 comes after its t - 1 ancestors
    # and its earlier siblings, so its rank is below n - d, and at most n - d nodes of the top-n lie at depth t;
    # depths beyond n hold none. They trim the ranks, the kept nodes and the depth loop, never the result.
    budget = int(budget)
    k = min(k, budget)
    depths_used = min(depth_limit, budget)
    lp = topk_logprobs[:, :depths_used, :k].to(torch.float64)
    tok = topk_tokens[:, :depths_used, :k]
    usable = torch.isfinite(lp)
    if max_depth is not None:
        usable = usable & (torch.arange(1, depths_used + 1, device=device)[None, :, None] <= max_depth[:, None, None])
    lp = torch.where(usable, lp, float("-inf"))

    # Per depth, the best children of the previous depth's kept nodes, stored in lexicographic order.
    parent_scores = torch.zeros(batch, 1, dtype=torch.float64, device=device)  # depth 0: the root
    levels = []  # per depth: (parent position in the previous level, token, score)
    for d in range(depths_used):
        width = parent_scores.shape[1]
        ranks = min(k, budget - d)
        candidates = (parent_scores[:, :, None] + lp[:, d, None, :ranks]).reshape(batch, width * ranks)
        keep = min(budget - d, width * ranks)
        # Keys are -score. No score is -0.0 (path sums start from the root's +0.0, and +0.0 + -0.0 == +0.0),
        # so a radix sort that orders -0.0 before +0.0 cannot split a tie of zero scores.
        order = torch.sort(-candidates, dim=1, stable=True).indices[:, :keep]  # ties keep lexicographic order
        chosen = torch.sort(order, dim=1).values  # back to lexicographic order (flat index = parent * ranks + rank)
        parent_pos, rank = chosen // ranks, chosen % ranks
        scores = candidates.gather(1, chosen)
        tokens = tok[:, d].gather(1, rank)
        levels.append((parent_pos, tokens, scores))
        parent_scores = scores

    # Subtree sizes (bottom-up), then pre-order positions (top-down): the cross-depth tie-break.
    sizes = [torch.ones_like(level[0]) for level in levels]
    for d in range(len(levels) - 1, 0, -1):
        sizes[d - 1] = sizes[d - 1].scatter_add(1, levels[d][0], sizes[d])
    preorder = []
    parent_pre = torch.zeros(batch, 1, dtype=torch.long, device=device)
    for d, (parent_pos, _, _) in enumerate(levels):
        per_parent = torch.zeros_like(parent_pre).scatter_add(1, parent_pos, sizes[d])
        before = _exclusive_cumsum(sizes[d]) - _exclusive_cumsum(per_parent).gather(1, parent_pos)
        pre = parent_pre.gather(1, parent_pos) + 1 + before
        preorder.append(pre)
        parent_pre = pre

    # All kept nodes, in pop order: score descending, then pre-order. The kept nodes of all depths form one
    # prefix-closed tree under the root, so their pre-order numbers are exactly 1..total: listing them in
    # pre-order is a scatter (the inverse permutation), and one stable sort by score finishes the order.
    offsets = [0]
    for parent_pos, _, _ in levels:
        offsets.append(offsets[-1] + parent_pos.shape[1])
    all_scores = torch.cat([level[2] for level in levels], dim=1)
    all_tokens = torch.cat([level[1] for level in levels], dim=1)
    all_depths = torch.cat([torch.full_like(level[0], d + 1) for d, level in enumerate(levels)], dim=1)
    # A kept node's parent as an index into the concatenation; -1 for children of the root.
    all_parents = torch.cat([level[0] + offsets[d - 1] if d else torch.full_like(level[0], -1)
                             for d, level in enumerate(levels)], dim=1)
    total = all_scores.shape[1]
    kept_index = torch.arange(total, device=device).expand(batch, -1)
    by_pre = torch.empty_like(kept_index).scatter_(1, torch.cat(preorder, dim=1) - 1, kept_index)
    by_score = torch.sort(-all_scores.gather(1, by_pre), dim=1, stable=True).indices
    pop = by_pre.gather(1, by_score)[:, : size - 1]  # the budget best kept nodes, in pop order

    new_index = torch.zeros(batch, total, dtype=torch.long, device=device).scatter_(
        1, pop, torch.arange(1, size, device=device).expand(batch, -1))  # node index in the tree (root = 0)
    scores = all_scores.gather(1, pop)
    valid = torch.isfinite(scores)
    old_parent = all_parents.gather(1, pop)
    parents = torch.where(old_parent < 0, 0, new_index.gather(1, old_parent.clamp(min=0)))
    root_col = _root_only(root, 1)
    tree = DeviceTree(
        tokens=torch.cat([root_col.tokens, torch.where(valid, all_tokens.gather(1, pop), -1)], dim=1),
        parents=torch.cat([root_col.parents, torch.where(valid, parents, 0)], dim=1),
        depths=torch.cat([root_col.depths, torch.where(valid, all_depths.gather(1, pop), 0)], dim=1),
        valid=torch.cat([root_col.valid, valid], dim=1),
        num_nodes=1 + valid.sum(1),
        scores=torch.cat([root_col.scores, torch.where(valid, scores, float("-inf"))], dim=1),
    )
    return pad_tree(tree, size)  # fewer tuples exist than the budget (few ranks, shallow): still budget + 1 columns


def build_chain_device(root: torch.Tensor, draft_tokens: torch.Tensor, max_depth: torch.Tensor | None = None,
                       size: int | None = None) -> DeviceTree:
    """The DFlash chain: the root and the drafter's top-1 token per depth (``draft_tokens`` [B, D]), padded to
    ``size`` columns (default D + 1); nodes deeper than ``max_depth`` [B] are padding. Real nodes score 0.0:
    the chain carries no log-probabilities."""
    batch, depth_limit = draft_tokens.shape
    size = depth_limit + 1 if size is None else int(size)
    device = root.device
    cols = torch.arange(size, device=device)[None].expand(batch, -1)
    valid = cols <= depth_limit
    if max_depth is not None:
        valid = valid & (cols <= max_depth[:, None])
    padded = torch.cat([root[:, None], draft_tokens, root.new_full((batch, max(size - 1 - depth_limit, 0)), -1)],
                       dim=1)[:, :size]
    return DeviceTree(
        tokens=torch.where(valid, padded, -1),
        parents=torch.where(cols == 0, -1, torch.where(valid, cols - 1, 0)),
        depths=torch.where(valid, cols, 0),
        valid=valid,
        num_nodes=valid.sum(1),
        scores=torch.where(valid, 0.0, float("-inf")).to(torch.float64),
    )


def pad_tree(tree: DeviceTree, size: int) -> DeviceTree:
    """The same trees with ``size`` columns (padding appended as the module docstring describes)."""
    extra = int(size) - tree.size
    if extra < 0:
        raise ValueError(f"pad_tree: size {size} is smaller than the tree's {tree.size} columns")
    if extra == 0:
        return tree
    batch = tree.tokens.shape[0]

    def more(value: float | int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((batch, extra), value, dtype=dtype, device=tree.tokens.device)

    return DeviceTree(
        tokens=torch.cat([tree.tokens, more(-1, tree.tokens.dtype)], dim=1),
        parents=torch.cat([tree.parents, more(0, tree.parents.dtype)], dim=1),
        depths=torch.cat([tree.depths, more(0, tree.depths.dtype)], dim=1),
        valid=torch.cat([tree.valid, more(False, torch.bool)], dim=1),
        num_nodes=tree.num_nodes,
        scores=torch.cat([tree.scores, more(float("-inf"), tree.scores.dtype)], dim=1),
    )


def _jump_rounds(longest_path: int) -> int:
    """Pointer-doubling rounds after which every jump table covers ``longest_path`` steps up (2^r > it)."""
    return max(int(longest_path), 0).bit_length()


def visibility_device(tree: DeviceTree, max_depth: int | None = None, *, fused: bool | None = None) -> torch.Tensor:
    """Ancestor-or-self mask, bool [B, N, N]: ``vis[b, i, j]`` iff j is i or an ancestor of i.

    Padding rows see only themselves (a non-empty attention row) and no row sees a padding column.
    ``max_depth`` (static; default N - 1) bounds the depth of real nodes; the mask is built by pointer
    doubling in ``bit_length(max_depth)`` rounds of one row gather each (4 rounds for a 16-token block),
    not one round per depth: after round r a row holds the 2^r nearest nodes of its root path.

    ``fused``: the plugin library's walk up each node's path (:func:`fused_tree.visibility`, the same mask bit for
    bit, the same ``2^rounds - 1`` steps up) where ``DFLASH_FUSED_TREE`` allows (None), required (True), or the
    tensor ops below (False).
    """
    batch, n = tree.parents.shape
    longest = n - 1 if max_depth is None else min(int(max_depth), n - 1)
    where = fused_tree.backend(tree.parents.device) if fused is not False and n > 0 else None
    if where is not None or fused:
        return fused_tree.visibility(tree, (1 << _jump_rounds(longest)) - 1, where=where)
    jump = tree.parents.clamp(min=0)  # the root jumps to itself, so a saturated jump adds nothing new
    vis = torch.eye(n, dtype=torch.bool, device=tree.parents.device)[None].expand(batch, -1, -1)
    for _ in range(_jump_rounds(longest)):
        vis = vis | vis.gather(1, jump[:, :, None].expand(-1, -1, n))
        jump = jump.gather(1, jump)
    eye = torch.eye(n, dtype=torch.bool, device=tree.parents.device)[None]
    return eye | (vis & tree.valid[:, :, None])


def walk_device(tree: DeviceTree, choices: torch.Tensor, max_path: int, *,
                fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow the target's choices (``choices[b, i]``: its token after node i) from the root.

    Returns ``path`` int64 [B, max_path] (accepted nodes in depth order, padded by repeating the last
    one), ``length`` int64 [B] (root included) and ``bonus`` int64 [B] (the target's choice at the last
    accepted node). ``max_path`` (static) must exceed the deepest node a tree can hold (D + 1 for a
    block of D draft tokens); a deeper accepted path would be cut at ``max_path`` nodes.

    A node is accepted iff every node on its path below the root matches the target's choice at its
    parent; that AND over the path is taken by pointer doubling in ``bit_length(max_path - 1)`` rounds.

    ``fused``: the plugin library's scan per row (:func:`fused_tree.walk`, the same result on trees whose
    ``depths`` count their ancestors) where ``DFLASH_FUSED_TREE`` allows (None), required (True), or the tensor
    ops below (False).
    """
    where = fused_tree.backend(tree.tokens.device) if fused is not False else None
    if where is not None or fused:
        return fused_tree.walk(tree, choices, max_path, where=where)
    batch, n = tree.tokens.shape
    device = tree.tokens.device
    parents = tree.parents.clamp(min=0)
    is_root = tree.parents < 0
    matched = tree.valid & ~is_root & (tree.tokens == choices.gather(1, parents))
    # Best-first trees never repeat a token among siblings; should one, the first child wins (tree.walk's rule).
    earlier = torch.ones(n, n, dtype=torch.bool, device=device).tril(-1)[None]
    same = (tree.parents[:, :, None] == tree.parents[:, None, :]) & (tree.tokens[:, :, None] == tree.tokens[:, None, :])
    matched = matched & ~(same & earlier & tree.valid[:, None, :]).any(-1)
    accepted = matched | is_root  # after round r: the 2^r nearest nodes of the path all match
    jump = parents
    for _ in range(_jump_rounds(min(max_path - 1, n - 1))):
        accepted = accepted & accepted.gather(1, jump)
        jump = jump.gather(1, jump)
    accepted = accepted & (tree.depths < max_path)  # a path never outgrows its static width
    length = accepted.sum(1)
    slot = torch.where(accepted, tree.depths, max_path).clamp(max=max_path)  # rejected nodes go to a spare column
    nodes = torch.arange(n, device=device)[None].expand(batch, -1)
    path = torch.zeros(batch, max_path + 1, dtype=torch.long, device=device)
    path = path.scatter(1, slot, nodes)[:, :max_path]
    last = path.gather(1, (length - 1)[:, None])
    path = torch.where(torch.arange(max_path, device=device)[None] < length[:, None], path, last)
    return path, length, choices.gather(1, last)[:, 0]


def to_draft_tree(tree: DeviceTree, b: int = 0) -> DraftTree:
    """Row ``b`` as a host ``tree.DraftTree`` (tests and debugging only: it reads the device)."""
    count = int(tree.num_nodes[b])
    return _finish(tree.tokens[b, :count].tolist(), tree.parents[b, :count].tolist(),
                   tree.depths[b, :count].tolist())
