"""DDTree core: optimal best-first build, ancestor masks, packed masks, walk, compaction.

Every check here is against an independent brute-force computation (enumerate all
prefixes, walk parent pointers, test bits one by one), never against the module's
own helpers.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

from tensorrt_llm_dflash.decode import draft_tree
from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.kernels import compact_tail_torch_
from tensorrt_llm_dflash.target import (
    HFTargetVerifier,
    compaction_reference,
)
from tensorrt_llm_dflash.tree import (
    MAX_DDTREE_BUDGET,
    MAX_TREE_NODES,
    DraftTree,
    _finish,
    batched_tree_inputs,
    build_chain,
    build_ddtree,
    compaction_indices,
    depths_from_parents,
    packed_mask,
    unpack_mask,
    validate_budget,
    validate_parents,
    visibility,
    walk,
)

# ------------------------------------------------------------------ brute-force helpers


def random_logprobs(rng: np.random.Generator, depth: int, vocab: int, sharpness: float) -> np.ndarray:
    logits = rng.normal(0.0, sharpness, (depth, vocab))
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def all_prefixes(logprobs: np.ndarray) -> dict[tuple[int, ...], float]:
    """Every token prefix of length 1..D with its log-probability (sum of marginals)."""
    depth, vocab = logprobs.shape
    out = {}
    for d in range(1, depth + 1):
        for prefix in itertools.product(range(vocab), repeat=d):
            out[prefix] = float(sum(logprobs[i, t] for i, t in enumerate(prefix)))
    return out


def node_prefix(tree: DraftTree, node: int) -> tuple[int, ...]:
    toks = []
    while node != 0:
        toks.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return tuple(reversed(toks))


def brute_ancestors(parents: np.ndarray) -> np.ndarray:
    n = len(parents)
    vis = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j != -1:
            vis[i, j] = True
            j = int(parents[j])
    return vis


def random_parents(rng: np.random.Generator, n: int, style: str) -> np.ndarray:
    parents = np.full(n, -1, dtype=np.int32)
    for i in range(1, n):
        if style == "uniform":
            parents[i] = rng.integers(0, i)
        elif style == "deep":  # mostly the previous node: long chains
            parents[i] = i - 1 if rng.random() < 0.9 else rng.integers(0, i)
        elif style == "star":
            parents[i] = 0 if rng.random() < 0.8 else rng.integers(0, i)
        else:  # recent: parents near the child, bushy and deep
            parents[i] = rng.integers(max(0, i - 8), i)
    return parents


def topk_rows(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(logprobs, order, -1), order


# ---------------------------------------------------------------------- optimality

OPT_CASES = [
    # (seed, vocab, depth, budget, sharpness)
    (s, v, d, b, sh)
    for s, (v, d) in enumerate([(4, 3), (5, 3), (6, 3), (4, 4), (5, 4), (6, 4), (4, 5), (5, 5), (6, 5)])
    for b, sh in [(1, 1.0), (3, 0.3), (7, 2.0), (20, 1.0), (64, 3.0), (300, 0.7)]
]


@pytest.mark.parametrize("seed,vocab,depth,budget,sharpness", OPT_CASES)
def test_ddtree_is_the_top_budget_prefixes(seed, vocab, depth, budget, sharpness):
    rng = np.random.default_rng(seed * 7919 + budget)
    lp = random_logprobs(rng, depth, vocab, sharpness)
    everything = all_prefixes(lp)
    # The runtime passes K = min(budget, V) columns; the full V columns must give the same tree.
    for k in sorted({min(budget, vocab), vocab}):
        vals, toks = topk_rows(lp, k)
        tree = build_ddtree(99, vals, toks, budget)
        n = tree.num_nodes
        assert tree.tokens[0] == 99 and tree.parents[0] == -1 and tree.depths[0] == 0
        assert n - 1 == min(budget, len(everything))
        prefixes = [node_prefix(tree, i) for i in range(1, n)]
        assert len(set(prefixes)) == n - 1, "duplicate prefixes"
        chosen = set(prefixes)
        # Parents before children; depth == prefix length <= D.
        for i in range(1, n):
            assert 0 <= tree.parents[i] < i
            assert tree.depths[i] == len(prefixes[i - 1]) == tree.depths[tree.parents[i]] + 1
            assert tree.depths[i] <= depth
        # Prefix-closed.
        for p in chosen:
            assert len(p) == 1 or p[:-1] in chosen
        # Optimal: nothing outside is more probable than anything inside (ties allowed).
        inside = min(everything[p] for p in chosen)
        outside = max((v for p, v in everything.items() if p not in chosen), default=-np.inf)
        assert inside >= outside - 1e-12
        # Best-first pop order: non-increasing path probability.
        scores = [everything[p] for p in prefixes]
        assert all(a >= b - 1e-12 for a, b in itertools.pairwise(scores))
        # Child maps agree with parents/tokens.
        for i in range(1, n):
            assert tree.children[tree.parents[i]][int(tree.tokens[i])] == i
        assert sum(len(c) for c in tree.children) == n - 1


@pytest.mark.parametrize("seed,budget,max_depth", [(0, 5, 3), (1, 40, 4), (2, 200, 5), (3, 1, 2), (4, 12, 1)])
def test_runtime_draft_tree_glue_is_optimal(seed, budget, max_depth):
    """decode.draft_tree (log_softmax + topk of raw logits, depth cut) gives the brute-force tree."""
    rng = np.random.default_rng(seed)
    vocab, depth = 5, 6
    logits = torch.tensor(rng.normal(0, 1.5, (depth, vocab)))
    tree = draft_tree(7, logits, budget, max_depth)
    lp = torch.log_softmax(logits[:max_depth].float(), -1).double().numpy()
    everything = all_prefixes(lp)
    chosen = {node_prefix(tree, i) for i in range(1, tree.num_nodes)}
    assert len(chosen) == min(budget, len(everything))
    inside = min(everything[p] for p in chosen)
    outside = max((v for p, v in everything.items() if p not in chosen), default=-np.inf)
    assert inside >= outside - 1e-6
    assert tree.max_depth <= max_depth
    # budget 0 is the chain of per-depth argmaxes
    chain = draft_tree(7, logits, 0, max_depth)
    assert chain.tokens.tolist() == [7] + logits[:max_depth].argmax(-1).tolist()
    assert chain.parents.tolist() == list(range(-1, max_depth))


def test_ddtree_edge_cases():
    lp = np.log(np.array([[0.6, 0.4], [0.5, 0.5]]))
    toks = np.array([[3, 4], [5, 6]])
    assert build_ddtree(1, lp, toks, 0).num_nodes == 1
    assert build_ddtree(1, lp[:0], toks[:0], 5).num_nodes == 1
    # Exhausts the whole space (2 + 4 prefixes) even with a larger budget.
    full = build_ddtree(1, lp, toks, 100)
    assert full.num_nodes == 7
    with pytest.raises(DFlashInputError, match="topk_logprobs"):
        build_ddtree(1, lp, toks[:, :1], 3)
    # Exact ties resolved by rank tuple: deterministic across calls.
    a = build_ddtree(0, np.zeros((3, 3)), np.arange(9).reshape(3, 3), 5)
    b = build_ddtree(0, np.zeros((3, 3)), np.arange(9).reshape(3, 3), 5)
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


def test_chain():
    t = build_chain(5, np.array([1, 2, 3]))
    assert t.tokens.tolist() == [5, 1, 2, 3]
    assert t.parents.tolist() == [-1, 0, 1, 2]
    assert t.depths.tolist() == [0, 1, 2, 3]
    assert t.children == [{1: 1}, {2: 2}, {3: 3}, {}]
    assert build_chain(5, []).num_nodes == 1


# --------------------------------------------------------------------------- masks

MASK_CASES = [(s, n, style) for s, (n, style) in enumerate([
    (1, "uniform"), (2, "uniform"), (31, "uniform"), (32, "star"), (33, "deep"), (64, "recent"),
    (65, "uniform"), (100, "star"), (257, "deep"), (500, "recent"), (1000, "uniform"), (1024, "uniform"),
    (1024, "deep"), (1024, "star"), (1024, "recent"),
])]


@pytest.mark.parametrize("seed,n,style", MASK_CASES)
def test_visibility_and_packed_mask_match_brute_force(seed, n, style):
    rng = np.random.default_rng(seed)
    parents = random_parents(rng, n, style)
    validate_parents(parents)
    brute = brute_ancestors(parents)
    vis = visibility(parents)
    assert vis.dtype == bool and vis.shape == (n, n)
    np.testing.assert_array_equal(vis, brute)
    # depths = number of strict ancestors
    np.testing.assert_array_equal(depths_from_parents(parents), brute.sum(1) - 1)

    packed = packed_mask(vis)
    words = (n + 31) // 32
    assert packed.dtype == np.int32 and packed.shape == (n, words)
    as_u32 = packed.view(np.uint32).astype(np.int64)
    cols = np.arange(words * 32)
    bits = (as_u32[:, cols // 32] >> (cols % 32)) & 1  # bit j%32 of word j//32, LSB first
    np.testing.assert_array_equal(bits[:, :n].astype(bool), brute)
    assert not bits[:, n:].any(), "padding bits beyond N must be zero"
    np.testing.assert_array_equal(unpack_mask(packed, n), brute)


def test_packed_mask_sign_bit_hand_case():
    # 33 nodes in a chain: row 31 sets bit 31 of word 0, which is the int32 sign bit.
    parents = np.arange(-1, 32)
    packed = packed_mask(visibility(parents))
    assert packed[31, 0] == -1  # all 32 bits set
    assert packed[32].tolist() == [-1, 1]
    assert packed[0].tolist() == [1, 0]
    assert packed[5].tolist() == [0b111111, 0]


@pytest.fixture(scope="module")
def mask_verifier():
    from tiny_models import cached_target

    v = HFTargetVerifier(cached_target("qwen3", seed=0, vocab=32))
    return v


@pytest.mark.parametrize("seed,n,style,past", [(0, 2, "uniform", 0), (1, 9, "star", 3), (2, 64, "recent", 17),
                                               (3, 300, "uniform", 5), (4, 1024, "uniform", 40),
                                               (5, 1024, "deep", 1)])
def test_dense_verify_mask_is_ancestor_only(mask_verifier, seed, n, style, past):
    rng = np.random.default_rng(100 + seed)
    parents = random_parents(rng, n, style)
    if n == 2:
        parents = np.array([-1, 0], dtype=np.int32)
    tree = _finish(rng.integers(0, 32, n).tolist(), parents.tolist(), depths_from_parents(parents).tolist())
    mask_verifier.past_len = past
    compiled = mask_verifier.compile_tree(tree)
    brute = brute_ancestors(parents)
    assert compiled["input_ids"].tolist() == [tree.tokens.tolist()]
    assert compiled["position_ids"].tolist() == [[past + int(d) for d in brute.sum(1) - 1]]
    mask = compiled["attention_mask"]
    if mask is None:
        # Only allowed when the tree is a chain: then causal == ancestor-only.
        np.testing.assert_array_equal(brute, np.tril(np.ones((n, n), dtype=bool)))
        return
    assert mask.shape == (1, 1, n, past + n) and mask.dtype == torch.float64
    m = mask[0, 0].numpy()
    assert (m[:, :past] == 0).all(), "every committed column must be visible"
    tree_part = m[:, past:]
    np.testing.assert_array_equal(tree_part == 0, brute)
    assert (tree_part[~brute] == torch.finfo(torch.float64).min).all()


def test_dense_mask_for_a_chain_is_causal(mask_verifier):
    mask_verifier.past_len = 4
    tree = build_chain(3, [4, 5, 6])
    compiled = mask_verifier.compile_tree(tree)
    assert compiled["attention_mask"] is None  # HF's causal mask == ancestor mask for a chain
    assert compiled["position_ids"].tolist() == [[4, 5, 6, 7]]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_nodes", [None, 70, 71, 200])
def test_batched_tree_inputs_pack_rows_and_pad_with_zeros(seed, max_nodes):
    """The layout TensorRT-LLM's XQA kernels read: mask rows packed by length, ceil(M/32)
    words per row for M = max_nodes (the engine's max generation length), offsets M wide."""
    rng = np.random.default_rng(seed)
    n = 70
    m = n if max_nodes is None else max_nodes
    words = (m + 31) // 32
    lengths = np.array([70, 33, 1, 40])
    parents = np.full((4, n), 12345, dtype=np.int32)  # garbage beyond each length
    trees = []
    for b, length in enumerate(lengths):
        p = random_parents(rng, int(length), ["uniform", "deep", "star", "recent"][b])
        parents[b, :length] = p
        trees.append(p)
    packed, offsets, lens = batched_tree_inputs(parents, lengths, max_nodes)
    assert packed.shape == (4 * n, words) and packed.dtype == np.int32
    assert offsets.shape == (4, m) and offsets.dtype == np.int32
    assert lens.tolist() == lengths.tolist() and lens.dtype == np.int32
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for b, length in enumerate(lengths):
        brute = brute_ancestors(trees[b])
        rows = packed[starts[b]: starts[b] + length]
        as_u32 = rows.view(np.uint32).astype(np.int64)
        cols = np.arange(words * 32)
        bits = ((as_u32[:, cols // 32] >> (cols % 32)) & 1).astype(bool)
        np.testing.assert_array_equal(bits[:, :length], brute)
        assert not bits[:, length:].any()
        np.testing.assert_array_equal(offsets[b, :length], brute.sum(1) - 1)
        assert not offsets[b, length:].any()
    assert not packed[lengths.sum():].any(), "rows past the last sequence's nodes must be zero"
    with pytest.raises(DFlashInputError, match="generation_lengths has 3 entries for a batch of 4"):
        batched_tree_inputs(parents, lengths[:3])
    with pytest.raises(DFlashInputError, match="max_nodes=69 must be between N=70 and 1024"):
        batched_tree_inputs(parents, lengths, 69)
    bad = parents.copy()
    bad[1, 5] = 7  # parent after child inside the valid length
    with pytest.raises(DFlashInputError, match=r"parents\[5\]=7"):
        batched_tree_inputs(bad, lengths)


# ---------------------------------------------------------------------------- walk


def hand_tree() -> DraftTree:
    #        0:A
    #     /   |   \
    #  1:B   2:C   3:D
    #   |     |
    #  4:E   5:B
    #   |
    #  6:F
    A, B, C, D, E, F = 10, 11, 12, 13, 14, 15
    return _finish([A, B, C, D, E, B, F], [-1, 0, 0, 0, 1, 2, 4], [0, 1, 1, 1, 2, 2, 3])


@pytest.mark.parametrize("choices,path,bonus", [
    # target's choice after each node:  0   1   2   3   4   5   6
    ([20, 20, 20, 20, 20, 20, 20], [0], 20),            # nothing accepted: bonus = choice at root
    ([11, 14, 20, 20, 15, 20, 21], [0, 1, 4, 6], 21),   # full depth-3 path, bonus after the leaf
    ([11, 14, 20, 20, 30, 20, 21], [0, 1, 4], 30),
    ([12, 14, 11, 20, 15, 22, 21], [0, 2, 5], 22),      # token B again, under C: node 5 not node 1
    ([13, 11, 11, 11, 11, 11, 11], [0, 3], 11),         # leaf at depth 1
    ([11, 12, 20, 20, 20, 20, 20], [0, 1], 12),         # C is a child of root, not of B
])
def test_walk_hand_cases(choices, path, bonus):
    got_path, got_bonus = walk(hand_tree(), np.array(choices))
    assert got_path == path and got_bonus == bonus


def test_walk_chain_and_single_node():
    chain = build_chain(1, [2, 3, 4])
    assert walk(chain, [2, 3, 4, 9]) == ([0, 1, 2, 3], 9)
    assert walk(chain, [2, 7, 4, 9]) == ([0, 1], 7)
    assert walk(build_chain(1, []), [5]) == ([0], 5)


# --------------------------------------------------------------------- compaction


def test_compaction_indices_hand_cases():
    assert compaction_indices([0], 10).tolist() == [10]
    assert compaction_indices([0, 1, 4, 6], 10).tolist() == [10, 11, 14, 16]
    assert compaction_indices(np.array([0, 3]), 0).tolist() == [0, 3]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_inplace_compaction_matches_out_of_place(seed):
    rng = np.random.default_rng(seed)
    n = 40
    parents = random_parents(rng, n, "recent")
    node = int(rng.integers(0, n))
    path = []
    while node != -1:
        path.append(node)
        node = int(parents[node])
    path = path[::-1]
    idx = compaction_indices(path, 7)
    assert (np.diff(idx) > 0).all() and all(idx[i] >= 7 + i for i in range(len(idx)))
    cache = torch.randn(1, 2, 7 + n, 3, dtype=torch.float64)
    expected = torch.cat([cache[:, :, :7], cache[:, :, 7 + torch.tensor(path)]], 2)
    np.testing.assert_array_equal(compaction_reference(cache, 7, path).numpy(), expected.numpy())
    work = cache.clone()
    compact_tail_torch_(work, 7, path)
    np.testing.assert_array_equal(work[:, :, : 7 + len(path)].numpy(), expected.numpy())
    # The in-place kernel HFTargetVerifier.commit actually uses (C library when built, else torch).
    from tensorrt_llm_dflash import kernels

    for fn in (kernels.compact_tail_, kernels.compact_tail_torch_):
        work = cache.clone()
        fn(work, 7, path)
        np.testing.assert_array_equal(work[:, :, : 7 + len(path)].numpy(), expected.numpy())
        np.testing.assert_array_equal(work[:, :, :7].numpy(), cache[:, :, :7].numpy())


# --------------------------------------------------------------------- validation


def test_validate_parents_errors():
    with pytest.raises(DFlashInputError, match=f"N={MAX_TREE_NODES + 1}"):
        validate_parents(np.arange(-1, MAX_TREE_NODES))
    validate_parents(np.arange(-1, MAX_TREE_NODES - 1))  # exactly the maximum is fine
    with pytest.raises(DFlashInputError, match=r"parents\[2\]=2.*before its child"):
        validate_parents(np.array([-1, 0, 2]))
    with pytest.raises(DFlashInputError, match=r"parents\[3\]=4"):
        validate_parents(np.array([-1, 0, 1, 4, 0]))
    with pytest.raises(DFlashInputError, match=r"parents\[1\]=9"):  # out of range (>= N)
        validate_parents(np.array([-1, 9]))
    with pytest.raises(DFlashInputError, match=r"parents\[2\]=-1: only the root"):
        validate_parents(np.array([-1, 0, -1]))
    with pytest.raises(DFlashInputError, match=r"parents\[0\]=0"):
        validate_parents(np.array([0, 0]))
    with pytest.raises(DFlashInputError, match="N=5 exceeds the parents row length 3"):
        validate_parents(np.array([-1, 0, 0]), 5)
    with pytest.raises(DFlashInputError, match="N=0"):
        validate_parents(np.array([-1, 0]), 0)
    # Entries past num_nodes are not looked at.
    validate_parents(np.array([-1, 0, 77]), 2)


@pytest.mark.parametrize("bad", [-1, -7, MAX_DDTREE_BUDGET + 1, 10**6])
def test_validate_budget_names_the_value(bad):
    with pytest.raises(DFlashInputError, match=f"ddtree_budget={bad} "):
        validate_budget(bad)


def test_validate_budget_types_and_block():
    assert validate_budget(0) == 0 and validate_budget(MAX_DDTREE_BUDGET) == MAX_DDTREE_BUDGET
    assert validate_budget(np.int64(8)) == 8
    for bad in (True, 2.5, "8", None):
        with pytest.raises(DFlashInputError, match="ddtree_budget must be an integer"):
            validate_budget(bad)
    with pytest.raises(DFlashInputError, match="block_size=1"):
        validate_budget(4, block_size=1)


def test_build_time_budget_256_is_reported(capsys):
    """Times the B=256 build (printed, not asserted: the machine is shared)."""
    rng = np.random.default_rng(0)
    logits = torch.tensor(rng.normal(0, 2.0, (15, 49152)), dtype=torch.float32)
    start = time.perf_counter()
    reps = 20
    for _ in range(reps):
        tree = draft_tree(1, logits, 256, 15)
    per_call = (time.perf_counter() - start) / reps
    lp = torch.log_softmax(logits, -1)
    vals, toks = torch.topk(lp, 256, -1)
    vals, toks = vals.numpy(), toks.numpy()
    start = time.perf_counter()
    for _ in range(reps):
        build_ddtree(1, vals, toks, 256)
    heap_only = (time.perf_counter() - start) / reps
    start = time.perf_counter()
    for _ in range(reps):
        visibility(tree.parents)
    vis_time = (time.perf_counter() - start) / reps
    assert tree.num_nodes == 257
    with capsys.disabled():
        print(f"\n[timing] B=256, D=15, V=49152: draft_tree {per_call * 1e3:.2f} ms "
              f"(heap build only {heap_only * 1e3:.2f} ms, visibility {vis_time * 1e3:.2f} ms)")
