"""The cost-aware DDTree on the device: which tree to verify, and the next step's tree size, with no host sync.

The eager runtime's policy (:mod:`.policy`) ranks candidate nodes by calibrated acceptance on the host
and picks the tree size that maximises expected tokens per second. Under CUDA graphs the tree size is
the graph, and it must be chosen *before* the launch, without reading the device. So each step:

1. **pool**: the DDTree of the drafter's marginals, ``pool_nodes`` draft nodes (``device_tree``);
2. **calibrate**: each node's conditional acceptance ``c = table[depth - 1, bin(marginal)]``, a device
   table learned online from what the target chose (below); the path value ``v = prod c`` along the
   path, computed depth by depth so that ``v(child) <= v(parent)`` exactly in floating point;
3. **verify set**: the ``n - 1`` best nodes by ``v`` (ties: parent first), where ``n`` is this
   graph's size; values never increase from parent to child, so the set is prefix-closed (a tree);
4. **next size**: for every size ``b`` it could capture, ``(1 + sum of the b - 1 best values) /
   cost(b)`` with ``cost`` the measured seconds of a graphed step of size ``b``; the best ``b`` is
   written into the step's output, which the host copies anyway (the one copy per step), and the
   host launches that size's graph next. The choice lags one step behind the values it is made from;
   consecutive steps' acceptance is strongly correlated, and the lag costs no sync;
5. **learn**: every verified draft node is labelled by the target's choice at its parent (was it
   the token the target picked?); the counts per (depth, marginal bin) decay by ``decay`` per step.
   The table is ``(hits + s * prior) / (trials + s)`` made non-decreasing in the marginal by a running
   maximum (the eager calibrator uses pool-adjacent-violators, which is sequential).

Every committed token is still the target's own choice at an accepted node: the policy changes
which tree is verified, never what is accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .device_tree import DeviceTree
from .policy import DRAFT_EDGES

#: Tree sizes (root included) the policy may choose between: one CUDA graph each.
POLICY_BUCKETS = (2, 4, 8, 16, 32, 64)


class DevicePolicy:
    """State and tensor functions of the on-device cost-aware tree (see the module docstring)."""

    def __init__(self, depth_rows: int, buckets: Sequence[int], device: torch.device, *, strength: float = 4.0,
                 decay: float = 0.995) -> None:
        self.buckets = tuple(sorted(int(b) for b in buckets))
        if not self.buckets or self.buckets[0] < 2:
            raise ValueError(f"policy buckets {buckets} must be sizes >= 2 (root included)")
        self.pool_nodes = self.buckets[-1] - 1
        self.rows = max(int(depth_rows), 1)
        edges = torch.tensor(DRAFT_EDGES, dtype=torch.float64, device=device)
        self.edges = edges[1:-1].contiguous()  # inner edges: bucketize gives the bin index directly
        centres = ((edges[:-1] + edges[1:]) / 2).clamp(0.0, 1.0)
        self.prior = centres[None].expand(self.rows, -1).contiguous()
        self.strength, self.decay = strength, decay
        self.hits = torch.zeros(self.rows, len(DRAFT_EDGES) - 1, dtype=torch.float64, device=device)
        self.trials = torch.zeros_like(self.hits)
        self.table = self.prior.clone()
        #: Seconds of one graphed step per bucket (measured after capture); the policy's denominator.
        self.costs = torch.ones(len(self.buckets), dtype=torch.float64, device=device)
        self._sizes = torch.tensor(self.buckets, dtype=torch.long, device=device)

    def reset(self) -> None:
        self.hits.zero_()
        self.trials.zero_()
        self.table.copy_(self.prior)

    def set_costs(self, seconds: Sequence[float]) -> None:
        self.costs.copy_(torch.tensor([float(s) for s in seconds], dtype=torch.float64))

    def _conditional(self, tree: DeviceTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, bins, conditional acceptance) per node; root and padding get conditional 1 and 0."""
        parent_score = tree.scores.gather(1, tree.parents.clamp(min=0))
        marginal = torch.exp(tree.scores - parent_score).nan_to_num(0.0)  # exp(-inf - x) = 0 for padding
        rows = (tree.depths - 1).clamp(0, self.rows - 1)
        bins = torch.bucketize(marginal, self.edges, right=True)
        cond = self.table[rows, bins].clamp(0.0, 1.0)
        is_root = tree.parents < 0
        cond = torch.where(is_root, torch.ones_like(cond), torch.where(tree.valid, cond, torch.zeros_like(cond)))
        return rows, bins, cond

    def path_values(self, tree: DeviceTree, max_depth: int) -> torch.Tensor:
        """P(path root..i accepted) per node: the product of the conditionals, one depth at a time."""
        _, _, cond = self._conditional(tree)
        log_c = torch.log(cond)  # 0 for the root, -inf for padding
        log_v = log_c.clone()
        parents = tree.parents.clamp(min=0)
        for _ in range(max_depth):  # after d rounds every node of depth <= d holds its path sum
            log_v = torch.where(tree.parents < 0, log_c, log_c + log_v.gather(1, parents))
        return torch.exp(log_v)

    def select(self, tree: DeviceTree, values: torch.Tensor, size: int) -> DeviceTree:
        """The ``size`` best nodes by value (root first, ties parent-first), as a tree in parent-first order."""
        order = torch.sort(-values, dim=1, stable=True).indices[:, :size]  # root has value 1: always first
        kept = torch.sort(order, dim=1).values  # ascending pool index: parents before children
        new_index = torch.full_like(tree.parents, -1).scatter_(
            1, kept, torch.arange(size, device=kept.device).expand_as(kept))
        old_parents = tree.parents.gather(1, kept)
        parents = torch.where(old_parents < 0, old_parents, new_index.gather(1, old_parents.clamp(min=0)))
        valid = tree.valid.gather(1, kept) & (values.gather(1, kept) > 0)
        tokens = torch.where(valid, tree.tokens.gather(1, kept), torch.full_like(kept, -1))
        parents = torch.where(valid | (parents < 0), parents, torch.zeros_like(parents))
        return DeviceTree(tokens=tokens, parents=parents, depths=torch.where(valid, tree.depths.gather(1, kept), 0),
                          valid=valid, num_nodes=valid.sum(1), scores=tree.scores.gather(1, kept))

    def next_bucket(self, values: torch.Tensor) -> torch.Tensor:
        """Index into ``buckets`` of the size that maximises expected tokens per second, per row [B]."""
        ranked = torch.sort(values[:, 1:], dim=1, descending=True).values
        expected = 1.0 + torch.cat([torch.zeros_like(ranked[:, :1]), ranked.cumsum(1)], dim=1)  # [B, pool + 1]
        tokens = expected[:, self._sizes - 1]  # a size b verifies b - 1 draft nodes
        return torch.argmax(tokens / self.costs[None], dim=1)

    def learn(self, tree: DeviceTree, choices: torch.Tensor) -> None:
        """Label every verified draft node by the target's choice at its parent; update the table."""
        rows, bins, _ = self._conditional(tree)
        drafted = tree.valid & (tree.parents >= 0)
        accepted = (tree.tokens == choices.gather(1, tree.parents.clamp(min=0))) & drafted
        flat = (rows * self.hits.shape[1] + bins).reshape(-1)
        self.hits.mul_(self.decay)
        self.trials.mul_(self.decay)
        self.hits.view(-1).scatter_add_(0, flat, accepted.reshape(-1).to(self.hits.dtype))
        self.trials.view(-1).scatter_add_(0, flat, drafted.reshape(-1).to(self.trials.dtype))
        raw = (self.hits + self.strength * self.prior) / (self.trials + self.strength)
        self.table.copy_(torch.cummax(raw, dim=1).values)
