"""The device tree (tensorrt_llm_dflash.device_tree) against the numpy reference (tree.py).

* ``build_ddtree_device`` equals ``build_ddtree`` node for node (tokens, parents, depths, in pop
  order) on 1,296 random marginal sets (6 chunks of 216, in batches of 1, 3, 4 and 8 rows with
  different depths, ranks and depth limits): budgets 1..128 (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31,
  32, 33, 48, 63, 64, 65, 100, 127, 128 and random ones), block sizes 2..16, K below and above the
  budget, float32 and float64, exact ties (log-probabilities from a few representable values, so
  equal path sums across siblings and depths are common), -inf entries (the same reduced vocabulary
  in every row, or a different finite count per row), depth limits 0..D.
* ``visibility_device`` and ``walk_device`` equal ``tree.visibility`` and ``tree.walk``; a padding
  row sees only itself, nothing sees a padding node, and no walk accepts one, even when its token
  equals the target's choice.
* Build, visibility and walk run under NoHostSync with fixed output shapes (tests/test_nosync.py
  shows the guard catches each kind of host read).

The build is checked both ways: the tensor ops (``fused=False``) and the plugin library's fused build
(``fused=True``, :mod:`tensorrt_llm_dflash.fused_tree`; the CPU library runs the CUDA kernel's body),
each against the reference, so the two equal each other too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorrt_llm_dflash import fused_tree
from tensorrt_llm_dflash.device_tree import (
    DeviceTree,
    build_chain_device,
    build_ddtree_device,
    pad_tree,
    to_draft_tree,
    visibility_device,
    walk_device,
)
from tensorrt_llm_dflash.nosync import NoHostSync
from tensorrt_llm_dflash.tree import DraftTree, build_chain, build_ddtree, visibility, walk

BUDGETS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100, 127, 128)
TIE_VALUES = np.array([0.0, -0.5, -1.0, -2.0, -4.0])
BATCH_SIZES = (1, 4, 1, 8, 1, 3)  # rows per device call, in turn: 3 per call on average
SETS_PER_CHUNK = 216  # twelve turns of BATCH_SIZES
REQUIRED_BUDGETS = {1, 2, 3, 31, 32, 33, 63, 64, 127, 128}


def random_set(rng: np.random.Generator, case: int, budget: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(logprobs [D, K] sorted per row, distinct tokens per row, max_depth) of one marginal set."""
    depth = int(rng.integers(2, 17)) - 1  # block size 2..16
    k = int(rng.integers(1, 2 * min(budget, 40) + 2))  # below and above the budget
    style = case % 4
    if style == 0:  # exact ties everywhere
        lp = rng.choice(TIE_VALUES, size=(depth, k))
    elif style == 1:  # peaked, like a trained drafter
        lp = np.log(rng.dirichlet(np.full(k, 0.3), size=depth) + 1e-300)
    else:
        lp = np.log(rng.dirichlet(np.full(k, 1.0), size=depth) + 1e-300)
    lp = -np.sort(-lp, axis=1)
    if case % 5 == 0:  # a reduced vocabulary: the same -inf tail in every row
        lp[:, int(rng.integers(1, k + 1)):] = -np.inf
    elif case % 5 == 1:  # fewer finite entries than K, a different count per row (possibly none)
        for row in lp:
            row[int(rng.integers(0, k + 1)):] = -np.inf
    tokens = np.stack([rng.choice(50_000, size=k, replace=False) for _ in range(depth)])
    max_depth = depth if case % 2 else int(rng.integers(0, depth + 1))
    return lp, tokens, max_depth


def pick_budget(rng: np.random.Generator, turn: int) -> int:
    """Every third turn a random budget 1..128; the other turns walk through all of BUDGETS in order."""
    return int(BUDGETS[(turn * 2 // 3) % len(BUDGETS)]) if turn % 3 else int(rng.integers(1, 129))


def random_case(rng: np.random.Generator, case: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """One marginal set with its budget: (logprobs, tokens, budget, max_depth)."""
    budget = pick_budget(rng, case)
    lp, tokens, max_depth = random_set(rng, case, budget)
    return lp, tokens, budget, max_depth


def reference(root: int, lp: np.ndarray, tokens: np.ndarray, budget: int, max_depth: int) -> DraftTree:
    """``build_ddtree`` on what the CPU runtime hands it: the first ``max_depth`` rows and the first ``kf``
    columns, kf the largest finite count of those rows (shorter rows keep their -inf tail, which it skips)."""
    rows = lp[:max_depth]
    finite = int(np.isfinite(rows).sum(1).max()) if rows.size else 0
    return build_ddtree(root, rows[:, :finite], tokens[:max_depth, :finite], budget)


def batch_of(sets: list[tuple[np.ndarray, np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of different depths and ranks in one [B, D, K] batch: -inf past a row's own D and K."""
    depth = max(s[0].shape[0] for s in sets)
    k = max(s[0].shape[1] for s in sets)
    lp = np.full((len(sets), depth, k), -np.inf)
    tokens = np.zeros((len(sets), depth, k), dtype=np.int64)
    for b, (row_lp, row_tokens, _) in enumerate(sets):
        lp[b, : row_lp.shape[0], : row_lp.shape[1]] = row_lp
        tokens[b, : row_tokens.shape[0], : row_tokens.shape[1]] = row_tokens
    return lp, tokens, np.array([s[2] for s in sets])


def assert_same_tree(device_tree: DeviceTree, row: int, expected: DraftTree) -> None:
    got = to_draft_tree(device_tree, row)
    assert got.tokens.tolist() == expected.tokens.tolist()
    assert got.parents.tolist() == expected.parents.tolist()
    assert got.depths.tolist() == expected.depths.tolist()
    n = expected.num_nodes
    assert device_tree.valid[row, :n].all() and not device_tree.valid[row, n:].any()
    assert (device_tree.tokens[row, n:] == -1).all() and (device_tree.parents[row, n:] == 0).all()
    assert (device_tree.depths[row, n:] == 0).all() and (device_tree.scores[row, n:] == -np.inf).all()
    assert int(device_tree.num_nodes[row]) == n and device_tree.scores[row, 0] == 0.0


BUILDS = [pytest.param(False, id="ops"), pytest.param(True, id="fused")]


@pytest.fixture(params=BUILDS)
def fused(request, monkeypatch) -> bool:
    """Each build in turn, ``DFLASH_FUSED_TREE`` unset; the fused one with the CPU plugin library built (cmake;
    skipped without it, as the plugin tests are). ``fused=True`` raises where the fused build cannot run."""
    monkeypatch.delenv(fused_tree.FUSED_TREE_ENV, raising=False)
    if request.param:
        from test_plugin_support import load_cpu_library

        load_cpu_library()
    return request.param


@pytest.mark.parametrize("chunk", range(6))
def test_device_ddtree_equals_the_reference_node_for_node(chunk, fused):
    rng = np.random.default_rng(1000 + chunk)
    case = chunk * 1000
    sets_checked = 0
    call = 0
    budgets_seen: set[int] = set()
    while sets_checked < SETS_PER_CHUNK:
        rows = BATCH_SIZES[call % len(BATCH_SIZES)]
        budget = pick_budget(rng, call)
        budgets_seen.add(budget)
        sets = [random_set(rng, case + i, budget) for i in range(rows)]
        case += rows
        lp, tokens, max_depths = batch_of(sets)
        roots = np.arange(11, 11 + rows)
        # float32 inputs on every fourth call: the reference gets the same values, widened exactly.
        dtype = torch.float32 if call % 4 == 3 else torch.float64
        values = torch.tensor(lp, dtype=dtype)
        exact = values.to(torch.float64).numpy()
        tree = build_ddtree_device(torch.tensor(roots), values, torch.tensor(tokens), budget,
                                   torch.tensor(max_depths), fused=fused)
        assert tree.size == budget + 1 and tree.tokens.shape == (rows, budget + 1)
        for b in range(rows):
            assert_same_tree(tree, b, reference(int(roots[b]), exact[b], tokens[b], budget, int(max_depths[b])))
        sets_checked += rows
        call += 1
    assert sets_checked == SETS_PER_CHUNK  # 6 x 216 = 1,296 sets in all
    assert REQUIRED_BUDGETS <= budgets_seen


def test_exact_ties_across_depths_follow_the_rank_tuple(fused):
    """Every log-probability 0 or -1: whole levels tie, so only the tie rule decides the order."""
    lp = np.array([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    tokens = np.arange(9).reshape(3, 3) + 100
    for budget in range(1, 20):
        expected = build_ddtree(5, lp, tokens, budget)
        tree = build_ddtree_device(torch.tensor([5]), torch.tensor(lp)[None], torch.tensor(tokens)[None], budget,
                                   fused=fused)
        assert_same_tree(tree, 0, expected)
    # (0,) and (0, 0) score 0; then (1,), (0, 1) and (0, 0, r) for every r all score -1, across three depths:
    # the lexicographic rule (a prefix first) takes (0, 0, 0), (0, 0, 1), (0, 0, 2) before (0, 1) and (1,).
    assert build_ddtree(5, lp, tokens, 5).tokens.tolist() == [5, 100, 103, 106, 107, 108]
    assert build_ddtree(5, lp, tokens, 7).tokens.tolist() == [5, 100, 103, 106, 107, 108, 104, 105]


def test_chain_and_padding(fused):
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
    root_only = build_ddtree_device(torch.tensor([3]), torch.zeros(1, 0, 0), torch.zeros(1, 0, 0, dtype=torch.long), 4,
                                    fused=fused)
    assert root_only.tokens.tolist() == [[3, -1, -1, -1, -1]] and root_only.num_nodes.tolist() == [1]
    assert root_only.parents.tolist() == [[-1, 0, 0, 0, 0]] and root_only.valid.tolist() == [[True] + [False] * 4]


def _deep_choices(rng: np.random.Generator, tree: DraftTree, size: int) -> np.ndarray:
    """The target's choices after each node: a random real path is followed (ending early with
    probability 0.15 per step), every other choice random."""
    choices = rng.integers(0, 50_000, size=size)
    node = 0
    while True:
        kids = [c for c in range(1, tree.num_nodes) if tree.parents[c] == node]
        if not kids or rng.random() < 0.15:
            return choices
        node = int(rng.choice(kids))
        choices[tree.parents[node]] = tree.tokens[node]


def _locally_matching_choices(rng: np.random.Generator, tree: DraftTree, size: int) -> np.ndarray:
    """Every node's choice is the token of one of its children, so every node matches locally; then one
    random node's choice breaks. Everything below the break matches its parent but must not be accepted:
    this catches a walk that checks too little of each path."""
    choices = rng.integers(0, 50_000, size=size)
    for node in range(tree.num_nodes):
        kids = [c for c in range(1, tree.num_nodes) if tree.parents[c] == node]
        if kids:
            choices[node] = tree.tokens[int(rng.choice(kids))]
    choices[int(rng.integers(0, tree.num_nodes))] = 50_001  # no token is 50,001
    return choices


def _random_batch(rng: np.random.Generator, turn: int, rows: int) -> tuple[DeviceTree, int]:
    budget = pick_budget(rng, turn)
    lp, tokens, max_depths = batch_of([random_set(rng, turn * 8 + i, budget) for i in range(rows)])
    tree = build_ddtree_device(torch.arange(9, 9 + rows), torch.tensor(lp), torch.tensor(tokens), budget,
                               torch.tensor(max_depths))
    return tree, lp.shape[1]


def test_visibility_and_walk_equal_the_reference(fused):
    rng = np.random.default_rng(3)
    long_paths = 0
    for turn in range(150):
        rows = (1, 3)[turn % 2]
        tree, depth = _random_batch(rng, turn, rows)
        if turn % 5 == 4:  # a bucket larger than the tree: more padding
            tree = pad_tree(tree, tree.size + 7)
        size = tree.size
        eye = np.eye(size, dtype=bool)
        for vis in (visibility_device(tree, fused=fused).numpy(), visibility_device(tree, depth, fused=fused).numpy()):
            for b in range(rows):
                ref = to_draft_tree(tree, b)
                n = ref.num_nodes
                assert np.array_equal(vis[b, :n, :n], visibility(ref.parents))
                assert np.array_equal(vis[b, n:], eye[n:]), "a padding row sees only itself"
                assert np.array_equal(vis[b, :, n:], eye[:, n:]), "nothing else sees a padding node"
        choices = np.zeros((rows, size), dtype=np.int64)
        refs = [to_draft_tree(tree, b) for b in range(rows)]
        for b, ref in enumerate(refs):
            choices[b] = (_deep_choices if turn % 2 else _locally_matching_choices)(rng, ref, size)
            if turn % 3 == 0:  # padding nodes hang off the root: give them the root's choice as their token
                tree.tokens[b, ref.num_nodes:] = int(choices[b, 0])
        for max_path in (depth + 1, size + 1):
            path, length, bonus = walk_device(tree, torch.tensor(choices), max_path, fused=fused)
            assert path.shape == (rows, max_path) and length.shape == bonus.shape == (rows,)
            for b, ref in enumerate(refs):
                want_path, want_bonus = walk(ref, choices[b, : ref.num_nodes])
                assert int(length[b]) == len(want_path) and int(bonus[b]) == want_bonus
                assert path[b].tolist() == want_path + [want_path[-1]] * (max_path - len(want_path))
                long_paths += len(want_path) >= 4
    assert long_paths >= 100  # the choices do follow real paths, deep ones included


def test_path_sum_scores_decide_a_last_ulp_tie(fused):
    """Depth-1 rank 1 scores lp[0][1] = p + b, exactly the path sum of (0, 1) = p + b: a tie, which the rank
    tuple gives to (0, 1). The reference's incremental sibling score ((p + a) - a) + b rounds to one ulp less,
    which would put (1,) first; build_ddtree and the device build both use the path sum."""
    p, a, b = -0.241, -0.031, -0.998
    assert ((p + a) - a) + b < p + b  # the two formulas differ here
    lp = np.array([[p, p + b], [a, b]])
    tokens = np.array([[10, 11], [20, 21]])
    assert build_ddtree(5, lp, tokens, 3).tokens.tolist() == [5, 10, 20, 21]
    assert build_ddtree(5, lp, tokens, 4).tokens.tolist() == [5, 10, 20, 21, 11]
    for budget in (3, 4, 6):
        tree = build_ddtree_device(torch.tensor([5]), torch.tensor(lp)[None], torch.tensor(tokens)[None], budget,
                                   fused=fused)
        assert_same_tree(tree, 0, build_ddtree(5, lp, tokens, budget))


def test_padding_is_never_accepted_even_when_its_token_matches(fused):
    """Padding nodes hang off the root; with token -1, or with the root's own choice as their token, the walk
    accepts none of them (valid is False), in an otherwise empty tree and beside a real child."""
    tree = build_chain_device(torch.tensor([5, 5]), torch.tensor([[7], [7]]), torch.tensor([0, 1]), size=4)
    assert tree.valid.tolist() == [[True, False, False, False], [True, True, False, False]]
    for padding_token in (-1, 8):
        tree.tokens[:, 2:] = padding_token
        tree.tokens[0, 1] = padding_token
        choices = torch.full((2, 4), padding_token)
        path, length, bonus = walk_device(tree, choices, 3, fused=fused)
        assert length.tolist() == [1, 1] and path.tolist() == [[0, 0, 0], [0, 0, 0]]
        assert bonus.tolist() == [padding_token, padding_token]
    choices = torch.tensor([[7, 7, 7, 7], [7, 9, 9, 9]])
    path, length, bonus = walk_device(tree, choices, 3, fused=fused)
    assert length.tolist() == [1, 2] and path.tolist() == [[0, 0, 0], [0, 1, 1]] and bonus.tolist() == [7, 9]


def test_the_walk_checks_the_whole_path_of_a_deep_chain(fused):
    """A chain of D draft tokens (D = 1..16) whose every node matches its parent's choice except at one break:
    the walk stops at the break, however deep the matching nodes below it go."""
    for depth in range(1, 17):
        draft = torch.arange(100, 100 + depth)[None]
        chain = build_chain_device(torch.tensor([1]), draft)
        for broken in range(depth + 1):  # the node whose choice does not match its child
            choices = torch.cat([draft, torch.tensor([[7]])], dim=1)
            choices[0, broken] = 9
            path, length, bonus = walk_device(chain, choices, depth + 1, fused=fused)
            assert int(length[0]) == broken + 1 and int(bonus[0]) == 9
            assert path[0].tolist() == list(range(broken + 1)) + [broken] * (depth - broken)
            want_path, want_bonus = walk(build_chain(1, draft[0].tolist()), choices[0].tolist())
            assert want_path == list(range(broken + 1)) and want_bonus == 9


def test_the_walk_takes_the_first_of_two_matching_siblings(fused):
    tree = build_chain_device(torch.tensor([1]), torch.tensor([[4, 5]]))
    tree.tokens[0, 2], tree.parents[0, 2], tree.depths[0, 2] = 4, 0, 1  # a second child of the root, token 4
    path, length, bonus = walk_device(tree, torch.tensor([[4, 9, 9]]), 3, fused=fused)
    assert path[0, :2].tolist() == [0, 1] and int(length[0]) == 2 and int(bonus[0]) == 9


# ----------------------------------------------------------------------------- host syncs


def test_build_visibility_and_walk_read_nothing_on_the_host(fused):
    """Under NoHostSync (no host read, no data-dependent shape) and with the static output shapes."""
    rng = np.random.default_rng(5)
    for turn in range(40):
        rows = (1, 2, 5)[turn % 3]
        budget = pick_budget(rng, turn)
        lp, tokens, max_depths = batch_of([random_set(rng, turn * 8 + i, budget) for i in range(rows)])
        depth = lp.shape[1]
        roots, values, token_ids, limits = (torch.arange(rows), torch.tensor(lp), torch.tensor(tokens),
                                            torch.tensor(max_depths))
        choices = torch.tensor(rng.integers(0, 50_000, size=(rows, budget + 1)))
        with NoHostSync():
            tree = build_ddtree_device(roots, values.float(), token_ids, budget, limits, fused=fused)
            vis = visibility_device(tree, fused=fused)
            vis_bounded = visibility_device(tree, depth, fused=fused)
            path, length, bonus = walk_device(tree, choices, depth + 1, fused=fused)
            bucket = pad_tree(tree, budget + 9)
            chain = build_chain_device(roots, token_ids[:, :, 0], limits, size=16)
            chain_vis = visibility_device(chain, fused=fused)
            chain_walk = walk_device(chain, choices[:, :1].expand(-1, 16), 16, fused=fused)
        n = budget + 1
        assert tree.tokens.shape == tree.parents.shape == tree.depths.shape == tree.valid.shape == (rows, n)
        assert tree.scores.shape == (rows, n) and tree.num_nodes.shape == (rows,)
        assert vis.shape == vis_bounded.shape == (rows, n, n)
        assert path.shape == (rows, depth + 1) and length.shape == bonus.shape == (rows,)
        assert bucket.tokens.shape == (rows, budget + 9) and chain.tokens.shape == (rows, 16)
        assert chain_vis.shape == (rows, 16, 16) and chain_walk[0].shape == (rows, 16)
