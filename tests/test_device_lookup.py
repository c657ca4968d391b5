"""Prompt-lookup branches on the device equal the numpy reference, and graft as CandidateTree grafts them.

Each check runs both ways: the tensor ops (``fused=False``) and the plugin library's scan per row (``fused=True``,
:mod:`tensorrt_llm_dflash.fused_tree`; the CPU library runs the CUDA kernels' bodies)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorrt_llm_dflash import fused_tree
from tensorrt_llm_dflash.device_lookup import graft_device, lookup_device
from tensorrt_llm_dflash.device_tree import build_ddtree_device
from tensorrt_llm_dflash.lookup import lookup_branches
from tensorrt_llm_dflash.tree import DRAFTER, LOOKUP, CandidateTree, build_ddtree


@pytest.fixture(params=[pytest.param(False, id="ops"), pytest.param(True, id="fused")])
def fused(request, monkeypatch) -> bool:
    """Each implementation in turn, ``DFLASH_FUSED_TREE`` unset; the fused one with the CPU plugin library built."""
    monkeypatch.delenv(fused_tree.FUSED_TREE_ENV, raising=False)
    if request.param:
        from test_plugin_support import load_cpu_library

        load_cpu_library()
    return request.param


def _device_rows(contexts: list[list[int]], capacity: int, max_tokens: int, limits: list[int],
                 max_ngram: int, min_ngram: int, branches: int, fused: bool) -> list[list[tuple[list[int], int]]]:
    history = torch.full((len(contexts), capacity), -1, dtype=torch.long)
    for b, ctx in enumerate(contexts):
        history[b, : len(ctx)] = torch.tensor(ctx, dtype=torch.long)
        history[b, len(ctx):] = torch.randint(0, 3, (capacity - len(ctx),))  # stale tokens past the length
    length = torch.tensor([len(c) for c in contexts])
    out = lookup_device(history, length, max_tokens, torch.tensor(limits), max_ngram, min_ngram, branches,
                        fused=fused)
    rows = []
    for b in range(len(contexts)):
        rows.append([(out.tokens[b, r, : int(out.lengths[b, r])].tolist(), int(out.ngram[b]))
                     for r in range(branches) if int(out.lengths[b, r]) > 0])
        assert (out.tokens[b, :, :][out.tokens[b] >= 0].numel() == int(out.lengths[b].sum()))
    return rows


@pytest.mark.parametrize("seed", range(12))
def test_device_lookup_equals_lookup_branches(seed: int, fused: bool) -> None:
    """Random histories over tiny vocabularies (many repeats), lengths 0..40, every cap and n-gram range."""
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(20):
        batch = int(rng.integers(1, 6))
        vocab = int(rng.integers(2, 6))
        capacity = 48
        contexts = [rng.integers(0, vocab, int(rng.integers(0, 41))).tolist() for _ in range(batch)]
        max_tokens = int(rng.integers(0, 12))
        limits = [int(rng.integers(0, 14)) for _ in range(batch)]
        max_ngram = int(rng.integers(1, 6))
        min_ngram = int(rng.integers(1, max_ngram + 1))
        branches = int(rng.integers(1, 4))
        got = _device_rows(contexts, capacity, max_tokens, limits, max_ngram, min_ngram, branches, fused)
        for b, ctx in enumerate(contexts):
            want = lookup_branches(ctx, min(max_tokens, limits[b]), max_ngram, min_ngram, branches)
            assert got[b] == [(w.tokens, w.ngram) for w in want], (ctx, max_tokens, limits[b], max_ngram, min_ngram)
            checked += bool(want)
    assert checked > 20  # most cases found branches: the comparison is not between empty lists


def test_two_continuations_and_a_repeated_one(fused: bool) -> None:
    """'a b X ... a b Y ... a b Y ... a b': the newest match gives Y, the repeat of Y is skipped, then X."""
    ctx = [1, 2, 7, 9, 1, 2, 8, 9, 1, 2, 8, 5, 1, 2]
    got = _device_rows([ctx], 20, 3, [3], 4, 1, 3, fused)[0]
    assert got == [([8, 5, 1], 2), ([8, 9, 1], 2), ([7, 9, 1], 2)]
    assert got == [(w.tokens, w.ngram) for w in lookup_branches(ctx, 3, 4, 1, 3)]


def _grafted_paths(tree, cond, on_branch, b: int = 0) -> dict[tuple[int, ...], tuple[float, bool]]:
    """Each valid node as its root path of tokens -> (conditional, on a branch)."""
    paths: dict[int, tuple[int, ...]] = {0: ()}
    out = {}
    for i in range(1, tree.tokens.shape[1]):
        if not bool(tree.valid[b, i]):
            continue
        parent = int(tree.parents[b, i])
        assert parent in paths and parent < i  # parents come first
        paths[i] = paths[parent] + (int(tree.tokens[b, i]),)
        out[paths[i]] = (float(cond[b, i]), bool(on_branch[b, i]))
    return out


@pytest.mark.parametrize("seed", range(10))
def test_grafting_equals_candidate_tree_add_branch(seed: int, fused: bool) -> None:
    """The grafted tree has CandidateTree's nodes, shared nodes keep the larger estimate, branch-only nodes are
    new; and the column order keeps CandidateTree's (pool first, then branches in order)."""
    rng = np.random.default_rng(100 + seed)
    for _ in range(25):
        depth, k, budget, width = int(rng.integers(1, 7)), int(rng.integers(1, 4)), int(rng.integers(1, 20)), 5
        vocab = 4
        logprobs = np.sort(np.log(rng.dirichlet(np.ones(vocab), size=depth)), axis=1)[:, ::-1][:, :k].copy()
        tokens = np.stack([rng.permutation(vocab)[:k] for _ in range(depth)])
        ref_tree = build_ddtree(0, logprobs, tokens, budget)
        pool_cond = rng.uniform(0.05, 0.95, ref_tree.num_nodes)
        ref = CandidateTree.from_tree(ref_tree, pool_cond, DRAFTER)
        branches = [rng.integers(0, vocab, int(rng.integers(1, width + 1))).tolist() for _ in range(2)]
        if rng.random() < 0.5:  # a second branch that shares a prefix with the first
            cut = int(rng.integers(1, len(branches[0]) + 1))
            branches[1] = branches[0][:cut] + rng.integers(0, vocab, int(rng.integers(0, width - cut + 1))).tolist()
        branch_probs = [rng.uniform(0.05, 0.95, len(br)).tolist() for br in branches]
        for br, pr in zip(branches, branch_probs):
            ref.add_branch(br, pr, LOOKUP)

        pool = build_ddtree_device(torch.zeros(1, dtype=torch.long), torch.from_numpy(logprobs)[None],
                                   torch.from_numpy(tokens)[None], budget)
        cond = torch.zeros(1, pool.size, dtype=torch.float64)
        cond[0, : ref_tree.num_nodes] = torch.from_numpy(pool_cond)
        cond[0, 0] = 1.0
        from tensorrt_llm_dflash.device_lookup import DeviceBranches

        toks = torch.full((1, 2, width), -1, dtype=torch.long)
        probs = torch.zeros(1, 2, width, dtype=torch.float64)
        for r, (br, pr) in enumerate(zip(branches, branch_probs)):
            toks[0, r, : len(br)] = torch.tensor(br)
            probs[0, r, : len(pr)] = torch.tensor(pr, dtype=torch.float64)
        grafted = graft_device(pool, cond, DeviceBranches(toks, (toks >= 0).sum(-1), torch.ones(1, dtype=torch.long)),
                               probs, fused=fused)
        got = _grafted_paths(grafted.tree, grafted.cond, grafted.on_branch)
        want = {}
        ref_paths: dict[int, tuple[int, ...]] = {0: ()}
        for i in range(1, ref.num_nodes):
            ref_paths[i] = ref_paths[ref.parents[i]] + (ref.tokens[i],)
            want[ref_paths[i]] = (ref.conditional[i], bool(ref.sources[i] & LOOKUP))
        assert got.keys() == want.keys()
        for path in want:
            assert got[path][0] == pytest.approx(want[path][0], abs=0) and got[path][1] == want[path][1]
        # Column order of valid nodes = CandidateTree's node order.
        order = [path for path in got]
        assert order == [ref_paths[i] for i in range(1, ref.num_nodes)]
        assert int(grafted.tree.num_nodes[0]) == ref.num_nodes


@pytest.mark.parametrize("seed", range(6))
def test_device_selection_equals_the_eager_candidate_ranking(seed: int, fused: bool) -> None:
    """Given the same conditionals, the device policy's verify set of every size is CandidateTree's: the
    ``size - 1`` best nodes by path value, ties parent-first (cases with a near-tie at the cut are skipped
    and counted: the device sums logs where the eager tree multiplies)."""
    from tensorrt_llm_dflash.device_lookup import DeviceBranches
    from tensorrt_llm_dflash.device_policy import DevicePolicy

    rng = np.random.default_rng(300 + seed)
    policy = DevicePolicy(6, (2, 4, 8, 16, 32), torch.device("cpu"), lookup_rows=5)
    compared = 0
    for _ in range(20):
        depth, k, width, vocab = 6, 3, 5, 5
        logprobs = np.sort(np.log(rng.dirichlet(np.ones(vocab), size=depth)), axis=1)[:, ::-1][:, :k].copy()
        tokens = np.stack([rng.permutation(vocab)[:k] for _ in range(depth)])
        pool = build_ddtree_device(torch.zeros(1, dtype=torch.long), torch.from_numpy(logprobs)[None],
                                   torch.from_numpy(tokens)[None], 31)
        n_pool = int(pool.num_nodes[0])
        pool_cond = torch.zeros(1, pool.size, dtype=torch.float64)
        pool_cond[0, :n_pool] = torch.from_numpy(rng.uniform(0.05, 0.95, n_pool))
        pool_cond[0, 0] = 1.0
        ref_tree = build_ddtree(0, logprobs, tokens, 31)
        ref = CandidateTree.from_tree(ref_tree, pool_cond[0, :n_pool].numpy(), DRAFTER)
        branches = [rng.integers(0, vocab, width).tolist(), rng.integers(0, vocab, 3).tolist()]
        toks = torch.full((1, 2, width), -1, dtype=torch.long)
        probs = torch.zeros(1, 2, width, dtype=torch.float64)
        for r, br in enumerate(branches):
            pr = rng.uniform(0.05, 0.95, len(br))
            ref.add_branch(br, pr.tolist(), LOOKUP)
            toks[0, r, : len(br)] = torch.tensor(br)
            probs[0, r, : len(br)] = torch.from_numpy(pr)
        grafted = graft_device(pool, pool_cond, DeviceBranches(toks, (toks >= 0).sum(-1), torch.ones(1, dtype=torch.long)),
                               probs, fused=fused)
        values = policy.path_values(grafted, max(depth, width))
        order, ref_values = ref.ranked()
        for size in (2, 4, 8, 16, 32):
            n = min(size - 1, len(order))
            if 0 < n < len(order) and abs(ref_values[n - 1] - ref_values[n]) < 1e-9:
                continue
            chosen = policy.select(grafted, values, size, fused=fused)
            got = _grafted_paths(chosen.tree, chosen.cond, chosen.on_branch)
            sub, kept = ref.select(order[:n])
            want = {}
            paths: dict[int, tuple[int, ...]] = {0: ()}
            for i in range(1, sub.num_nodes):
                paths[i] = paths[int(sub.parents[i])] + (int(sub.tokens[i]),)
                want[paths[i]] = bool(ref.sources[int(kept[i])] & LOOKUP)
            assert {p: b for p, (_, b) in got.items()} == want
            compared += 1
    assert compared >= 80
