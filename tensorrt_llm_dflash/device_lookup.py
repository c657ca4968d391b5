"""Prompt-lookup branches on the device: found in a static token history and grafted into the candidate tree.

The same rule as :func:`tensorrt_llm_dflash.lookup.lookup_branches` (the numpy reference the tests compare
with, row by row) and the same grafting as :meth:`tensorrt_llm_dflash.tree.CandidateTree.add_branch`,
written as fixed-shape tensor ops so that a CUDA graph holds them: no loop over history positions or
nodes (loops run over the n-gram length, the branch count and the pointer-doubling rounds, all static),
no host reads.

**Finding.** An n-gram "ends" at position ``e`` of the history; it matches the newest ``n`` tokens when
``history[e - i] == history[last - i]`` for ``i < n``, and it counts only if a token follows it
(``e <= last - 1``). The longest ``n`` with a match wins. Its matches are taken most recent first; a
match is skipped when its continuation (``history[e + 1 : e + 1 + cap]``, cut at the newest token) is a
prefix of a branch already taken. An older match's continuation is never shorter than a newer one's,
so "a prefix of" is "equal to" here, and the branches are: the match with the largest ``e`` whose
continuation differs from those of the branches before it.

**Grafting.** A branch shares every node whose root path spells its prefix, in the drafter's pool
(found for all nodes at once by pointer doubling, as the walk finds accepted paths) or in an earlier
branch; past the shared prefix it owns fixed columns ``pool + r * T + t``. A shared node keeps the
larger of the two acceptance estimates (:meth:`CandidateTree.add_branch`'s rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import fused_tree
from .device_tree import DeviceTree, _jump_rounds


@dataclass
class DeviceBranches:
    """Up to R lookup branches per row, each at most T tokens."""

    tokens: torch.Tensor  # int64 [B, R, T]; -1 past the branch's length
    lengths: torch.Tensor  # int64 [B, R]; 0: no branch
    ngram: torch.Tensor  # int64 [B]; the n-gram length of the match (0: no branch)


def lookup_device(history: torch.Tensor, length: torch.Tensor, max_tokens: int, limit: torch.Tensor | None = None,
                  max_ngram: int = 4, min_ngram: int = 1, max_branches: int = 2, *,
                  fused: bool | None = None) -> DeviceBranches:
    """Branches of ``lookup_branches(history[b, :length[b]], min(max_tokens, limit[b]), max_ngram, min_ngram,
    max_branches)`` for every row ``b``.

    ``history`` int64 [B, C] (tokens >= 0 up to ``length`` <= C, anything after); ``length`` int64 [B];
    ``max_tokens`` (static) the longest branch, T; ``limit`` int64 [B] a per-row cap on top (None: T).
    ``fused``: the plugin library's scan per row (:func:`fused_tree.lookup`, the same branches) where
    ``DFLASH_FUSED_TREE`` allows (None), required (True), or the tensor ops below (False); a shape that holds no
    branch (no tokens, no branches, no n-gram length) takes the tensor ops either way.
    """
    if int(max_tokens) > 0 and int(max_branches) > 0 and int(max_ngram) >= max(int(min_ngram), 1):
        where = fused_tree.backend(history.device) if fused is not False else None
        if where is not None or fused:
            return fused_tree.lookup(history, length, max_tokens, limit, max_ngram, min_ngram, max_branches,
                                     where=where)
    batch, capacity = history.shape
    device = history.device
    width, branches = int(max_tokens), int(max_branches)
    empty = DeviceBranches(tokens=torch.full((batch, branches, max(width, 0)), -1, dtype=torch.long, device=device),
                           lengths=torch.zeros(batch, branches, dtype=torch.long, device=device),
                           ngram=torch.zeros(batch, dtype=torch.long, device=device))
    if width <= 0 or branches <= 0 or max_ngram < min_ngram or max_ngram <= 0:
        return empty
    last = length - 1  # the newest token's index
    ends = torch.arange(capacity, device=device)[None]  # [1, C]: where an n-gram ends
    followed = ends <= (last - 1)[:, None]  # at least one token after it
    matches = followed
    chosen_n = torch.zeros(batch, dtype=torch.long, device=device)
    chosen = torch.zeros_like(followed)
    for i in range(int(max_ngram)):
        n = i + 1
        earlier = torch.cat([history.new_full((batch, i), -1), history[:, : capacity - i]], dim=1)  # history[e - i]
        newest = history.gather(1, (last - i).clamp(min=0)[:, None])  # history[last - i]
        # An n-gram longer than the tokens before the newest one cannot match: its start e - i < 0 reads the
        # -1 padding, never a token.
        matches = matches & (earlier == newest)
        if n < min_ngram:
            continue
        usable = matches.any(1)
        chosen_n = torch.where(usable, n, chosen_n)
        chosen = torch.where(usable[:, None], matches, chosen)
    cap = torch.full_like(length, width) if limit is None else limit.clamp(max=width)
    offsets = torch.arange(width, device=device)
    where = ends[:, :, None] + 1 + offsets  # [1, C, T]: the continuation's positions
    inside = (where <= last[:, None, None]) & (offsets < cap[:, None, None])
    follows = torch.where(inside, history.gather(1, where.clamp(max=capacity - 1).reshape(1, -1).expand(batch, -1))
                          .view(batch, capacity, width), -1)  # [B, C, T]
    available = chosen & (cap > 0)[:, None]
    tokens, lengths = [], []
    for _ in range(branches):
        end = torch.where(available, ends, -1).max(1).values  # the most recent match left
        found = end >= 0
        branch = follows.gather(1, end.clamp(min=0)[:, None, None].expand(-1, 1, width))[:, 0]
        branch = torch.where(found[:, None], branch, -1)
        tokens.append(branch)
        lengths.append((branch >= 0).sum(1))
        available = available & ~(follows == branch[:, None, :]).all(-1)  # its own and equal continuations
    lengths_t = torch.stack(lengths, dim=1)
    return DeviceBranches(tokens=torch.stack(tokens, dim=1), lengths=lengths_t,
                          ngram=torch.where(lengths_t[:, 0] > 0, chosen_n, 0))


@dataclass
class Grafted:
    """The pool with the branches grafted: ``pool + R * T`` columns, parents before children. Unlike a
    built tree, ``valid`` is not a prefix of the row (pool padding sits before branch columns); the
    policy's ``select`` and the walk read ``valid`` per column, never a count."""

    tree: DeviceTree  # scores -inf on branch-only nodes (they have no drafter marginal)
    cond: torch.Tensor  # float64 [B, N']: conditional acceptance, shared nodes the larger estimate
    on_branch: torch.Tensor  # bool [B, N']: the node lies on a lookup branch


def graft_device(pool: DeviceTree, pool_cond: torch.Tensor, branches: DeviceBranches,
                 branch_cond: torch.Tensor, *, fused: bool | None = None) -> Grafted:
    """Graft ``branches`` (conditional acceptance ``branch_cond`` [B, R, T] per branch token) under the root.

    ``fused``: the plugin library's pass per row (:func:`fused_tree.graft`, the same result for a float64
    ``pool_cond`` and a pool whose siblings never repeat a token) where ``DFLASH_FUSED_TREE`` allows (None),
    required (True), or the tensor ops below (False)."""
    if branches.tokens.shape[1] > 0 and branches.tokens.shape[2] > 0 and pool_cond.dtype == torch.float64:
        where = fused_tree.backend(pool.tokens.device) if fused is not False else None
        if where is not None or fused:
            return fused_tree.graft(pool, pool_cond, branches, branch_cond, where=where)
    batch, pool_size = pool.tokens.shape
    _, count, width = branches.tokens.shape
    device = pool.tokens.device
    want = branches.tokens
    # Pool nodes on branch r's path: its token at every depth of the node's root path (pointer doubling).
    at_depth = want.gather(2, (pool.depths - 1).clamp(0, max(width - 1, 0))[:, None, :].expand(-1, count, -1))
    real = pool.valid & (pool.parents >= 0)
    on = (real & (pool.depths <= width))[:, None] & (pool.tokens[:, None] == at_depth) & (at_depth >= 0)
    is_root = (pool.parents < 0)[:, None].expand(-1, count, -1)
    path_ok = on | is_root
    jump = pool.parents.clamp(min=0)[:, None].expand(-1, count, -1)
    for _ in range(_jump_rounds(width)):
        path_ok = path_ok & path_ok.gather(2, jump)
        jump = jump.gather(2, jump)
    shared_pool = path_ok & on  # [B, R, N]; siblings never repeat a token, so one node per depth at most
    slot = torch.where(shared_pool, pool.depths[:, None] - 1, width)  # spare slot T for the rest
    nodes = torch.arange(pool_size, device=device)[None, None].expand(batch, count, -1)
    pool_node = torch.full((batch, count, width + 1), -1, dtype=torch.long, device=device).scatter_reduce(
        2, slot, nodes, reduce="amax")[:, :, :width]  # [B, R, T]: the pool node at offset t, or -1

    # The earliest branch q <= r that spells the same prefix through t owns the node at (r, t).
    in_branch = want >= 0
    same = (want[:, :, None] == want[:, None, :]) & in_branch[:, :, None] & in_branch[:, None, :]
    prefix = same.long().cumprod(-1).bool()  # [B, Q, R, T]
    q_le_r = torch.ones(count, count, dtype=torch.bool, device=device).triu()[None, :, :, None]
    owner = (prefix & q_le_r).long().argmax(1)  # first q (r itself at least, where the branch has offset t)
    offsets = torch.arange(width, device=device)
    node = torch.where(pool_node >= 0, pool_node, pool_size + owner * width + offsets)
    node = torch.where(in_branch, node, -1)  # [B, R, T]
    owns = in_branch & (pool_node < 0) & (owner == torch.arange(count, device=device)[None, :, None])

    parent = torch.cat([torch.zeros_like(node[:, :, :1]), node[:, :, :-1]], dim=2)  # offset 0 hangs off the root
    extra = count * width
    flat_owns = owns.reshape(batch, extra)
    tree = DeviceTree(
        tokens=torch.cat([pool.tokens, torch.where(flat_owns, want.reshape(batch, extra), -1)], dim=1),
        parents=torch.cat([pool.parents, torch.where(flat_owns, parent.reshape(batch, extra), 0)], dim=1),
        depths=torch.cat([pool.depths, torch.where(flat_owns, (offsets + 1).expand(batch, count, -1)
                                                   .reshape(batch, extra), 0)], dim=1),
        valid=torch.cat([pool.valid, flat_owns], dim=1),
        num_nodes=pool.num_nodes + flat_owns.sum(1),
        scores=torch.cat([pool.scores, pool.scores.new_full((batch, extra), float("-inf"))], dim=1),
    )
    target = node.clamp(min=0).reshape(batch, extra)
    estimate = torch.where(in_branch, branch_cond.to(pool_cond.dtype), 0.0).reshape(batch, extra)
    cond = torch.cat([pool_cond, torch.zeros_like(estimate)], dim=1).scatter_reduce(1, target, estimate,
                                                                                     reduce="amax")
    on_branch = torch.zeros(batch, pool_size + extra, dtype=torch.long, device=device).scatter_reduce(
        1, target, in_branch.reshape(batch, extra).long(), reduce="amax").bool()
    on_branch[:, 0] = False  # a missing branch token points at column 0 (the root) only through clamp
    return Grafted(tree=tree, cond=cond, on_branch=on_branch)
