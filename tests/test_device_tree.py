"""The device tree (tensorrt_llm_dflash.device_tree) against the numpy reference (tree.py), and the NoHostSync guard.

* ``build_ddtree_device`` equals ``build_ddtree`` node for node (tokens, parents, depths, in pop
  order) on 1,200 random marginal sets: budgets 1..128, block sizes 2..16, K below and above the
  budget, float32 and float64, exact ties (log-probabilities from a few representable values, so
  equal path sums across siblings and depths are common), -inf entries, depth limits, batches of
  different rows.
* ``visibility_device`` and ``walk_device`` equal ``tree.visibility`` and ``tree.walk``; padding is
  invisible and never accepted.
* Build, visibility and walk run under NoHostSync, with fixed output shapes; NoHostSync itself
  catches every kind of host read it claims to.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorrt_llm_dflash.device_tree import (
    build_chain_device,
    build_ddtree_device,
    pad_tree,
    to_draft_tree,
    visibility_device,
    walk_device,
)
from tensorrt_llm_dflash.nosync import HostSyncError, NoHostSync
from tensorrt_llm_dflash.tree import build_chain, build_ddtree, visibility, walk

BUDGETS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100, 127, 128)
TIE_VALUES = np.array([0.0, -0.5, -1.0, -2.0, -4.0])


def random_case(rng: np.random.Generator, case: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(logprobs [D, K] sorted per row, distinct tokens per row, budget, max_depth) of one marginal set."""
    block = int(rng.integers(2, 17))
    depth = block - 1
    budget = int(BUDGETS[case % len(BUDGETS)]) if case % 3 else int(rng.integers(1, 129))
    k = int(rng.integers(1, 2 * min(budget, 40) + 2))
    style = case % 4
    if style == 0:  # exact ties everywhere
        lp = rng.choice(TIE_VALUES, size=(depth, k))
    elif style == 1:  # peaked, like a trained drafter
        lp = np.log(rng.dirichlet(np.full(k, 0.3), size=depth) + 1e-300)
    else:
        lp = np.log(rng.dirichlet(np.full(k, 1.0), size=depth) + 1e-300)
    lp = -np.sort(-lp, axis=1)
    if case % 5 == 0:  # a reduced vocabulary: the tail of every row is -inf
        lp[:, int(rng.integers(1, k + 1)):] = -np.inf
    tokens = np.stack([rng.choice(50_000, size=k, replace=False) for _ in range(depth)])
    max_depth = depth if case % 2 else int(rng.integers(0, depth + 1))
    return lp, tokens, budget, max_depth


def reference(root: int, lp: np.ndarray, tokens: np.ndarray, budget: int, max_depth: int):
    return build_ddtree(root, lp[:max_depth], tokens[:max_depth], budget)


def assert_same_tree(device_tree, row: int, expected) -> None:
    got = to_draft_tree(device_tree, row)
    assert got.tokens.tolist() == expected.tokens.tolist()
    assert got.parents.tolist() == expected.parents.tolist()
    assert got.depths.tolist() == expected.depths.tolist()
    n = expected.num_nodes
    assert not device_tree.valid[row, n:].any() and (device_tree.tokens[row, n:] == -1).all()


@pytest.mark.parametrize("chunk", range(6))
def test_device_ddtree_equals_the_reference_node_for_node(chunk):
    rng = np.random.default_rng(1000 + chunk)
    for case in range(chunk * 200, (chunk + 1) * 200):
        lp, tokens, budget, max_depth = random_case(rng, case)
        expected = reference(11, lp, tokens, budget, max_depth)
        for dtype in ((torch.float64, torch.float32) if case % 7 == 0 else (torch.float64,)):
            values = torch.tensor(lp, dtype=dtype)
            exact = values.to(torch.float64).numpy()  # what a float32 drafter hands the reference
            expected = reference(11, exact, tokens, budget, max_depth)
            tree = build_ddtree_device(torch.tensor([11]), values[None], torch.tensor(tokens)[None], budget,
                                       torch.tensor([max_depth]))
            assert tree.size == budget + 1
            assert_same_tree(tree, 0, expected)


def test_exact_ties_across_depths_follow_the_rank_tuple():
    """Every log-probability 0 or -1: whole levels tie, so only the tie rule decides the order."""
    lp = np.array([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    tokens = np.arange(9).reshape(3, 3) + 100
    for budget in range(1, 20):
        expected = build_ddtree(5, lp, tokens, budget)
        tree = build_ddtree_device(torch.tensor([5]), torch.tensor(lp)[None], torch.tensor(tokens)[None], budget)
        assert_same_tree(tree, 0, expected)
    # (0,) and (0, 0) score 0; then (1,), (0, 1) and (0, 0, r) for every r all score -1, across three depths:
    # the lexicographic rule (a prefix first) takes (0, 0, 0), (0, 0, 1), (0, 0, 2) before (0, 1) and (1,).
    assert build_ddtree(5, lp, tokens, 5).tokens.tolist() == [5, 100, 103, 106, 107, 108]
    assert build_ddtree(5, lp, tokens, 7).tokens.tolist() == [5, 100, 103, 106, 107, 108, 104, 105]


def test_batches_of_different_rows():
    rng = np.random.default_rng(7)
    for budget in (1, 6, 32, 128):
        cases = [random_case(rng, 4 * budget + i) for i in range(4)]
        depth = max(c[0].shape[0] for c in cases)
        k = max(c[0].shape[1] for c in cases)
        lp = np.full((4, depth, k), -np.inf)
        tokens = np.zeros((4, depth, k), dtype=np.int64)
        max_depths = []
        for b, (row_lp, row_tok, _, md) in enumerate(cases):
            lp[b, : row_lp.shape[0], : row_lp.shape[1]] = row_lp
            tokens[b, : row_tok.shape[0], : row_tok.shape[1]] = row_tok
            max_depths.append(min(md, row_lp.shape[0]))
        roots = torch.tensor([1, 2, 3, 4])
        tree = build_ddtree_device(roots, torch.tensor(lp), torch.tensor(tokens), budget, torch.tensor(max_depths))
        for b in range(4):
            assert_same_tree(tree, b, reference(b + 1, lp[b], tokens[b], budget, max_depths[b]))


def test_chain_and_padding():
    draft = torch.tensor([[7, 8, 9, 10], [1, 2, 3, 4]])
    chain = build_chain_device(torch.tensor([5, 6]), draft, torch.tensor([4, 2]), size=8)
    assert chain.tokens.tolist() == [[5, 7, 8, 9, 10, -1, -1, -1], [6, 1, 2, -1, -1, -1, -1, -1]]
    assert chain.parents[0].tolist() == [-1, 0, 1, 2, 3, 0, 0, 0]
    assert chain.num_nodes.tolist() == [5, 3]
    assert_same_tree(chain, 0, build_chain(5, [7, 8, 9, 10]))
    assert_same_tree(chain, 1, build_chain(6, [1, 2]))
    padded = pad_tree(chain, 16)
    assert padded.size == 16 and padded.num_nodes.tolist() == [5, 3]
    assert_same_tree(padded, 1, build_chain(6, [1, 2]))
    with pytest.raises(ValueError):
        pad_tree(chain, 4)
    root_only = build_ddtree_device(torch.tensor([3]), torch.zeros(1, 0, 0), torch.zeros(1, 0, 0, dtype=torch.long), 4)
    assert root_only.tokens.tolist() == [[3, -1, -1, -1, -1]] and root_only.num_nodes.tolist() == [1]


def _deep_choices(rng: np.random.Generator, tree, size: int) -> np.ndarray:
    """The target's choices after each node: a random real path is followed, the rest random."""
    choices = rng.integers(0, 50_000, size=size)
    node = 0
    while True:
        kids = [c for c in range(1, tree.num_nodes) if tree.parents[c] == node]
        if not kids or rng.random() < 0.15:
            return choices
        node = int(rng.choice(kids))
        choices[tree.parents[node]] = tree.tokens[node]


def test_visibility_and_walk_equal_the_reference():
    rng = np.random.default_rng(3)
    for case in range(400):
        lp, tokens, budget, max_depth = random_case(rng, case)
        tree = build_ddtree_device(torch.tensor([9]), torch.tensor(lp)[None], torch.tensor(tokens)[None], budget,
                                   torch.tensor([max_depth]))
        ref = to_draft_tree(tree)
        n = ref.num_nodes
        vis = visibility_device(tree, lp.shape[0])[0].numpy()
        assert np.array_equal(vis[:n, :n], visibility(ref.parents))
        assert not vis[:, n:][~np.eye(tree.size, dtype=bool)[:, n:]].any()  # nobody sees a padding node
        choices = _deep_choices(rng, ref, tree.size)
        choices[n:] = -1  # padding tokens are -1: even a choice of -1 must not accept them
        path, length, bonus = walk_device(tree, torch.tensor(choices)[None], lp.shape[0] + 1)
        want_path, want_bonus = walk(ref, choices[:n])
        assert int(length[0]) == len(want_path) and int(bonus[0]) == want_bonus
        assert path[0].tolist() == want_path + [want_path[-1]] * (lp.shape[0] + 1 - len(want_path))


def test_the_walk_takes_the_first_of_two_matching_siblings():
    tree = build_chain_device(torch.tensor([1]), torch.tensor([[4, 5]]))
    tree.tokens[0, 2], tree.parents[0, 2], tree.depths[0, 2] = 4, 0, 1  # a second child of the root, token 4
    path, length, bonus = walk_device(tree, torch.tensor([[4, 9, 9]]), 3)
    assert path[0, :2].tolist() == [0, 1] and int(length[0]) == 2 and int(bonus[0]) == 9


# ----------------------------------------------------------------------------- host syncs


def test_build_visibility_and_walk_read_nothing_on_the_host():
    rng = np.random.default_rng(5)
    for case in range(40):
        lp, tokens, budget, max_depth = random_case(rng, case)
        args = (torch.tensor([9]), torch.tensor(lp)[None], torch.tensor(tokens)[None], budget, torch.tensor([max_depth]))
        choices = torch.tensor(rng.integers(0, 50_000, size=budget + 1))[None]
        with NoHostSync():
            tree = build_ddtree_device(*args)
            vis = visibility_device(tree, lp.shape[0])
            path, length, bonus = walk_device(tree, choices, lp.shape[0] + 1)
            chain = build_chain_device(args[0], args[2][:, :, 0], args[4], size=16)
            walk_device(chain, choices[:, :1].expand(-1, 16), 16)
        assert tree.tokens.shape == (1, budget + 1) and vis.shape == (1, budget + 1, budget + 1)
        assert path.shape == (1, lp.shape[0] + 1) and length.shape == bonus.shape == (1,)


@pytest.mark.parametrize("read", ["item", "int", "float", "bool", "if", "tolist", "numpy", "cpu", "array",
                                  "nonzero", "mask", "masked_select", "unique", "repeat_interleave", "equal"])
def test_nohostsync_catches_every_host_read(read):
    t = torch.arange(6)
    reads = {
        "item": lambda: t[1].item(), "int": lambda: int(t[1]), "float": lambda: float(t[1]),
        "bool": lambda: bool(t[1] > 0), "if": lambda: 1 if (t > 2).any() else 0, "tolist": lambda: t.tolist(),
        "numpy": lambda: t.numpy(), "cpu": lambda: t.cpu(), "array": lambda: np.asarray(t),
        "nonzero": lambda: t.nonzero(), "mask": lambda: t[t > 2], "masked_select": lambda: t.masked_select(t > 2),
        "unique": lambda: torch.unique(t), "repeat_interleave": lambda: torch.repeat_interleave(t, t),
        "equal": lambda: torch.equal(t, t),
    }
    reads[read]()  # outside the guard it works
    with pytest.raises(HostSyncError), NoHostSync():
        reads[read]()
    with NoHostSync() as guard:
        with guard.allow("the step's tokens"):
            reads[read]()
        assert guard.allowed_copies == ["the step's tokens"]
    assert torch.Tensor.tolist(t) == list(range(6))  # the wrapped methods are restored


def test_nohostsync_lets_fixed_shape_work_through():
    t = torch.arange(6)
    with NoHostSync():
        out = torch.where(t > 2, t, 0).gather(0, torch.tensor([1, 5])) + t.sum()
        torch.sort(t.flip(0), stable=True)
        torch.repeat_interleave(t, 2)  # an integer repeat: the shape is known
    assert out.tolist() == [15, 20]
