"""The fused DDTree build (tensorrt_llm_dflash.fused_tree; plugins/include/dflash/ddtree_core.h).

Node-for-node equality with ``tree.build_ddtree`` (ties, -inf, depth limits, float32 and float64) is in
tests/test_device_tree.py, which runs every build check both ways. Here: the largest budget and batch bit for
bit against the tensor ops, which build runs where (``DFLASH_FUSED_TREE``, the libraries, the budget), the
errors, and the graphed runtime decoding the same tokens with it as without it.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from test_graphed import ScriptedStaticProposer
from test_plugin_support import load_cpu_library
from tiny_models import hf_greedy, tiny_target

from tensorrt_llm_dflash import fused_tree, kernels
from tensorrt_llm_dflash.device_tree import DeviceTree, build_ddtree_device
from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.graphed import GraphedDecoder

FIELDS = ("tokens", "parents", "depths", "valid", "num_nodes", "scores")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def cpu_library(monkeypatch):
    monkeypatch.delenv(fused_tree.FUSED_TREE_ENV, raising=False)
    return load_cpu_library()


def marginals(rng: np.random.Generator, batch: int, depth: int, k: int, ties: bool = False):
    if ties:
        lp = rng.choice(np.array([0.0, -0.5, -1.0, -2.0]), size=(batch, depth, k))
    else:
        lp = np.log(rng.dirichlet(np.full(k, 0.3), size=(batch, depth)) + 1e-300)
    lp = -np.sort(-lp, axis=-1)
    tokens = rng.integers(0, 50_000, size=(batch, depth, k))
    return torch.tensor(lp), torch.tensor(tokens), torch.arange(7, 7 + batch)


def assert_identical(a: DeviceTree, b: DeviceTree) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), name


def test_the_budget_limit_and_scratch_size_are_the_librarys(cpu_library):
    assert cpu_library.dflash_max_ddtree_budget() == fused_tree.MAX_BUDGET
    for budget in (0, 1, 7, 63, 100, 255):
        assert cpu_library.dflash_ddtree_scratch_bytes(budget) == fused_tree.ddtree_scratch_row_bytes(budget)


@pytest.mark.parametrize("ties", [False, True])
def test_the_largest_budget_and_a_batch_of_16_equal_the_tensor_ops_bit_for_bit(ties):
    rng = np.random.default_rng(4 + ties)
    for depth, k, budget in ((15, 255, 255), (15, 63, 63), (16, 300, 200), (3, 2, 255)):
        lp, tokens, roots = marginals(rng, 16, depth, k, ties)
        max_depth = torch.tensor(rng.integers(-1, depth + 2, size=16))
        for limit in (None, max_depth):
            fused = build_ddtree_device(roots, lp.float(), tokens, budget, limit, fused=True)
            ops = build_ddtree_device(roots, lp.float(), tokens, budget, limit, fused=False)
            assert_identical(fused, ops)
            assert int(fused.num_nodes.max()) > min(budget, 8)  # real trees, not root-only rows


def test_which_build_runs_where(monkeypatch):
    assert fused_tree.mode() == "auto" and fused_tree.backend(CPU) == "cpu-library"
    # CUDA: opt-in, the kernel has not been measured on a GPU yet.
    assert fused_tree.backend(CUDA) is None
    for value, mode in (("1", "on"), ("ON", "on"), ("0", "off"), (" off ", "off"), ("", "auto")):
        monkeypatch.setenv(fused_tree.FUSED_TREE_ENV, value)
        assert fused_tree.mode() == mode
    monkeypatch.setenv(fused_tree.FUSED_TREE_ENV, "off")
    assert fused_tree.backend(CPU) is None
    calls = []
    monkeypatch.setattr(fused_tree, "build_ddtree_fused", lambda *a, **k: calls.append(1))
    lp, tokens, roots = marginals(np.random.default_rng(0), 2, 4, 5)
    build_ddtree_device(roots, lp, tokens, 6)
    assert calls == []  # off: the tensor ops
    monkeypatch.delenv(fused_tree.FUSED_TREE_ENV)
    build_ddtree_device(roots, lp, tokens, 6)
    assert calls == [1]  # auto with the CPU library built
    build_ddtree_device(roots, lp, tokens, fused_tree.MAX_BUDGET + 1)
    assert calls == [1]  # past the fused build's budget: the tensor ops


def test_a_bad_mode_names_the_variable_and_the_value(monkeypatch):
    monkeypatch.setenv(fused_tree.FUSED_TREE_ENV, "maybe")
    with pytest.raises(DFlashInputError, match=r"DFLASH_FUSED_TREE='maybe' is not one of auto, on, off"):
        fused_tree.backend(CPU)


def test_on_without_a_library_is_a_clear_error_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(fused_tree, "_cuda_library", None)
    monkeypatch.setattr(fused_tree, "_cuda_searched", True)  # searched, nothing built
    monkeypatch.setenv(fused_tree.FUSED_TREE_ENV, "on")
    with pytest.raises(DFlashInputError, match=r"DFLASH_FUSED_TREE=on but libdflash_plugins_cuda.so is not built"):
        fused_tree.backend(CUDA)
    monkeypatch.setattr(kernels, "_library", None)
    monkeypatch.setattr(kernels, "_library_searched", True)
    with pytest.raises(DFlashInputError, match=r"libdflash_plugins_cpu.so is not built"):
        fused_tree.backend(CPU)
    lp, tokens, roots = marginals(np.random.default_rng(1), 3, 5, 6)
    with pytest.raises(DFlashInputError, match="not built"):
        build_ddtree_device(roots, lp, tokens, 9)
    monkeypatch.delenv(fused_tree.FUSED_TREE_ENV)
    assert fused_tree.backend(CPU) is None
    with pytest.raises(DFlashInputError, match=r"does not run on cpu with budget 9 here \(DFLASH_FUSED_TREE=auto"):
        build_ddtree_device(roots, lp, tokens, 9, fused=True)
    tree = build_ddtree_device(roots, lp, tokens, 9)  # auto: the tensor ops
    assert tree.tokens.shape == (3, 10) and int(tree.num_nodes.min()) == 10


def test_the_library_refuses_a_bad_shape_naming_the_field(cpu_library):
    lp, tokens, roots = marginals(np.random.default_rng(2), 1, 4, 5)
    with pytest.raises(DFlashInputError, match=r"budget=256 is out of range for the fused tree kernels \(budget 0..255"):
        fused_tree.build_ddtree_fused(roots, lp, tokens, 256, where="cpu-library")
    with pytest.raises(DFlashInputError, match=r"with budget 256 here"):
        build_ddtree_device(roots, lp, tokens, 256, fused=True)
    detail = kernels._ErrorDetail()
    # (batch, depth, k, budget); the detail's index: 0 budget, 1 depth, 2 k.
    for field, args, value in ((1, (1, -1, 5, 8), -1), (2, (1, 4, -3, 8), -3), (0, (1, 4, 5, -1), -1)):
        code = cpu_library.dflash_ddtree_build_cpu(None, None, None, None, *args, *[None] * 7, ctypes.byref(detail))
        assert (code, detail.index, detail.value) == (kernels.ERR_DDTREE_SHAPE, field, value)
    code = cpu_library.dflash_ddtree_build_cpu(None, None, None, None, 2, 4, 5, 8, *[None] * 7, ctypes.byref(detail))
    assert code == kernels.ERR_NULL_POINTER
    code = cpu_library.dflash_ddtree_build_cpu(None, None, None, None, 0, 4, 5, 8, *[None] * 7, ctypes.byref(detail))
    assert code == kernels.OK  # an empty batch touches nothing


@pytest.mark.parametrize("budget", [None, 5])
def test_the_graphed_decoder_decodes_the_same_with_the_fused_build(monkeypatch, budget):
    """The cost-aware tree (its pool is a DDTree of the largest bucket's size) and a fixed DDTree budget: the same
    tokens, acceptance lengths and tree sizes with the fused build as with the tensor ops, both = transformers."""
    model = tiny_target("qwen3", seed=6)
    prompt = [4, 19, 33, 8, 2, 51]
    reference = hf_greedy(model, prompt, 36)
    fused_calls = []
    real = fused_tree.build_ddtree_fused
    monkeypatch.setattr(fused_tree, "build_ddtree_fused", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
    runs = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(fused_tree.FUSED_TREE_ENV, mode)
        # Scripted drafts (the truth with noise): long accepted paths and wrong top-1s the tree recovers.
        drafter = ScriptedStaticProposer(prompt + reference, 8, 64, noise=0.3, seed=3)
        decoder = GraphedDecoder(model, drafter, budget=budget, policy_buckets=(2, 4, 8, 16),
                                 policy_costs=[1.0, 1.1, 1.3, 1.8], seed_calibration=False)
        runs[mode] = decoder.generate(prompt, 36)
        assert (len(fused_calls) > 0) == (mode == "on")
    for out in runs.values():
        assert out.output_ids == reference
    assert runs["on"].stats.acceptance_lengths == runs["off"].stats.acceptance_lengths
    assert runs["on"].stats.tree_sizes == runs["off"].stats.tree_sizes
    assert max(runs["on"].stats.acceptance_lengths) >= 4  # trees were verified and accepted


def test_path_values_in_one_pass_equal_the_rounds_bit_for_bit():
    """``DevicePolicy.path_values`` on candidate trees (a DDTree pool with lookup branches grafted, batches of 1-8,
    rows with fewer nodes and padding): the library's one pass per row gives the rounds' bits, and
    ``expected_tokens`` and ``select`` see the same values."""
    from tensorrt_llm_dflash.device_lookup import DeviceBranches, Grafted, graft_device
    from tensorrt_llm_dflash.device_policy import DevicePolicy

    rng = np.random.default_rng(9)
    policy = DevicePolicy(16, (2, 4, 8, 16, 32, 64), CPU, lookup_rows=6)
    for turn in range(40):
        batch, depth, k, width = (1, 3, 8)[turn % 3], int(rng.integers(1, 16)), int(rng.integers(1, 40)), 6
        lp, tokens, roots = marginals(rng, batch, depth, k, ties=turn % 4 == 0)
        tokens = tokens % 50  # small vocabulary: branches share pool nodes
        pool = build_ddtree_device(roots, lp, tokens, 63, torch.tensor(rng.integers(0, depth + 1, size=batch)))
        branch_tokens = torch.tensor(rng.integers(-1, 50, size=(batch, 2, width)))
        branch_tokens = torch.where(branch_tokens.cummin(-1).values < 0, -1, branch_tokens)  # -1 only at the end
        branches = DeviceBranches(branch_tokens, (branch_tokens >= 0).sum(-1), torch.ones(batch, dtype=torch.long))
        grafted = graft_device(pool, policy.draft_conditional(pool), branches,
                               torch.tensor(rng.uniform(0.05, 0.95, size=(batch, 2, width))))
        assert isinstance(grafted, Grafted)
        rounds = max(depth, width)
        fused = policy.path_values(grafted, rounds, fused=True)
        ops = policy.path_values(grafted, rounds, fused=False)
        assert fused.dtype == ops.dtype == torch.float64 and torch.equal(fused, ops)
        assert torch.equal(policy.expected_tokens(fused), policy.expected_tokens(ops))


def test_path_sums_mark_a_parent_after_its_child():
    values = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    sums = fused_tree.path_sums(values, torch.tensor([[-1, 0, 1, 1]]))
    assert sums.tolist() == [[0.0, -1.0, -3.0, -1.5]]
    broken = fused_tree.path_sums(values, torch.tensor([[-1, 2, 0, 3]]))  # node 1 under node 2, node 3 under itself
    assert broken[0, 0] == 0.0 and broken[0, 2] == -2.0 and torch.isnan(broken[0, 1]) and torch.isnan(broken[0, 3])


def test_path_sums_refuse_a_negative_node_count(cpu_library):
    detail = kernels._ErrorDetail()
    assert cpu_library.dflash_path_sums_cpu(None, None, 1, -2, None, ctypes.byref(detail)) == kernels.ERR_DDTREE_SHAPE
    assert (detail.index, detail.value) == (3, -2)
    with pytest.raises(DFlashInputError, match=r"nodes=-2 is out of range"):
        kernels._raise_for(kernels.ERR_DDTREE_SHAPE, detail, {"max_budget": fused_tree.MAX_BUDGET})
    assert cpu_library.dflash_path_sums_cpu(None, None, 0, 5, None, ctypes.byref(detail)) == kernels.OK


def test_the_walk_refuses_an_empty_tree_or_path(cpu_library):
    detail = kernels._ErrorDetail()
    for args, field, value in (((1, 0, 4), 3, 0), ((1, 8, 0), 4, 0)):
        code = cpu_library.dflash_walk_cpu(*[None] * 4, *args, *[None] * 3, ctypes.byref(detail))
        assert (code, detail.index, detail.value) == (kernels.ERR_DDTREE_SHAPE, field, value)
    with pytest.raises(DFlashInputError, match=r"max_path=0 is out of range"):
        kernels._raise_for(kernels.ERR_DDTREE_SHAPE, detail, {"max_budget": fused_tree.MAX_BUDGET})


def _lookup_inputs(rng: np.random.Generator, batch: int, capacity: int, vocab: int):
    """Histories in a wider buffer (the decoder's ``history[:b, :window]`` is a view), stale tokens past each length."""
    buffer = torch.tensor(rng.integers(0, vocab, size=(batch, capacity + 9)))
    lengths = torch.tensor(rng.integers(0, capacity + 1, size=batch))
    return buffer[:, :capacity], lengths


def test_lookup_and_graft_equal_the_tensor_ops_bit_for_bit():
    """Every output of ``lookup_device`` and ``graft_device`` (batches of 1-8, long histories over small vocabularies,
    per-row limits, branch counts 1-3, widths 1-12) and the graft of a real DDTree pool with those branches."""
    from tensorrt_llm_dflash.device_lookup import graft_device, lookup_device
    from tensorrt_llm_dflash.device_policy import DevicePolicy

    rng = np.random.default_rng(21)
    policy = DevicePolicy(16, (2, 4, 8, 16, 32, 64), CPU, lookup_rows=12)
    found = shared = 0
    for turn in range(60):
        batch, vocab = (1, 3, 8)[turn % 3], int(rng.integers(2, 12))
        history, lengths = _lookup_inputs(rng, batch, int(rng.integers(1, 300)), vocab)
        width, branches = int(rng.integers(1, 13)), int(rng.integers(1, 4))
        max_ngram = int(rng.integers(1, 6))
        min_ngram = int(rng.integers(0, max_ngram + 1))
        limit = torch.tensor(rng.integers(-1, 14, size=batch)) if turn % 2 else None
        args = (history, lengths, width, limit, max_ngram, min_ngram, branches)
        fused, ops = lookup_device(*args, fused=True), lookup_device(*args, fused=False)
        for name in ("tokens", "lengths", "ngram"):
            assert torch.equal(getattr(fused, name), getattr(ops, name)), (turn, name)
        found += int((ops.lengths > 0).sum())
        # Graft them into a pool over the same small vocabulary, so branches and pool share prefixes.
        depth = int(rng.integers(1, 12))
        lp, tokens, roots = marginals(rng, batch, depth, vocab, ties=turn % 4 == 0)
        tokens = torch.stack([torch.stack([torch.tensor(rng.permutation(vocab)) for _ in range(depth)])
                              for _ in range(batch)])
        pool = build_ddtree_device(roots, lp, tokens, int(rng.choice([3, 15, 63])))
        pool_cond = policy.draft_conditional(pool)
        branch_cond = policy.lookup_conditional(ops)
        one, other = graft_device(pool, pool_cond, ops, branch_cond, fused=True), \
            graft_device(pool, pool_cond, ops, branch_cond, fused=False)
        for name in FIELDS:
            assert torch.equal(getattr(one.tree, name), getattr(other.tree, name)), (turn, name)
        assert torch.equal(one.cond, other.cond) and torch.equal(one.on_branch, other.on_branch), turn
        shared += int((other.on_branch[:, : pool.size] & pool.valid).sum())  # branch nodes the pool already had
    assert found > 60 and shared > 20  # branches were found and grafted onto pool nodes, not only beside them


def _random_candidates(rng: np.random.Generator, batch: int, n: int, ties: bool):
    """Parent-first trees of 1..n real nodes (then padding), random tokens, scores, conditionals and branch flags, and
    path values: in [0, 1] (with ``ties``: a few values repeated, -0.0, 0 and NaN among them)."""
    from tensorrt_llm_dflash.device_lookup import Grafted

    parents = np.zeros((batch, n), np.int64)
    depths = np.zeros((batch, n), np.int64)
    valid = np.zeros((batch, n), bool)
    for b in range(batch):
        real = int(rng.integers(1, n + 1))
        parents[b, 0], valid[b, :real] = -1, True
        for i in range(1, real):
            parents[b, i] = rng.integers(0, i)
            depths[b, i] = depths[b, parents[b, i]] + 1
    if ties:
        values = rng.choice(np.array([0.0, -0.0, 0.125, 0.25, 0.5, np.nan]), size=(batch, n))
    else:
        values = rng.uniform(0.0, 1.0, size=(batch, n))
    values[:, 0] = 1.0
    tree = DeviceTree(tokens=torch.tensor(rng.integers(-1, 60, size=(batch, n))), parents=torch.tensor(parents),
                      depths=torch.tensor(depths), valid=torch.tensor(valid), num_nodes=torch.tensor(valid.sum(1)),
                      scores=torch.tensor(rng.normal(size=(batch, n))))
    candidates = Grafted(tree, torch.tensor(rng.uniform(0.0, 1.0, size=(batch, n))),
                         torch.tensor(rng.uniform(size=(batch, n)) < 0.3))
    return candidates, torch.tensor(values)


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: object) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.dtype == torch.float64:  # -0.0 against 0.0 and NaN payloads count too
        a, b = a.view(torch.int64), b.view(torch.int64)
    assert torch.equal(a, b), what


def test_select_and_visibility_equal_the_tensor_ops_bit_for_bit():
    """``DevicePolicy.select`` and ``visibility_device`` in the library against their tensor ops: random trees with
    padding (values with ties, zeros, -0.0 and NaN; sizes 1, all and between) and real cost-aware candidates (a DDTree
    pool with lookup branches grafted in, its path values), every output field, every visibility bound."""
    from tensorrt_llm_dflash.device_lookup import graft_device, lookup_device
    from tensorrt_llm_dflash.device_policy import DevicePolicy
    from tensorrt_llm_dflash.device_tree import visibility_device

    rng = np.random.default_rng(33)
    policy = DevicePolicy(16, (2, 4, 8, 16, 32, 64), CPU, lookup_rows=12)
    dropped = 0
    for turn in range(120):
        batch = (1, 3, 16)[turn % 3]
        if turn % 2:
            candidates, values = _random_candidates(rng, batch, int(rng.integers(1, 130)), ties=turn % 4 == 1)
        else:  # a real pool and its grafted branches, valued by the policy
            vocab, depth = int(rng.integers(2, 12)), int(rng.integers(1, 12))
            lp, _, roots = marginals(rng, batch, depth, vocab, ties=turn % 4 == 0)
            tokens = torch.stack([torch.stack([torch.tensor(rng.permutation(vocab)) for _ in range(depth)])
                                  for _ in range(batch)])
            pool = build_ddtree_device(roots, lp, tokens, int(rng.choice([3, 15, 63])), fused=False)
            history, lengths = _lookup_inputs(rng, batch, int(rng.integers(1, 200)), vocab)
            branches = lookup_device(history, lengths, 8, None, 4, 1, 2, fused=False)
            candidates = graft_device(pool, policy.draft_conditional(pool), branches,
                                      policy.lookup_conditional(branches), fused=False)
            values = policy.path_values(candidates, max(depth, 8), fused=False)
        tree = candidates.tree
        n = tree.tokens.shape[1]
        for size in sorted({1, n, int(rng.integers(1, n + 1))}):
            fused = policy.select(candidates, values, size, fused=True)
            ops = policy.select(candidates, values, size, fused=False)
            for name in FIELDS:
                _assert_same_bits(getattr(fused.tree, name), getattr(ops.tree, name), (turn, size, name))
            _assert_same_bits(fused.cond, ops.cond, (turn, size, "cond"))
            _assert_same_bits(fused.on_branch, ops.on_branch, (turn, size, "on_branch"))
            dropped += int((ops.tree.num_nodes < size).sum())  # padding and value-0 nodes among the kept
            for chosen in (tree, ops.tree):
                depth = int(chosen.depths.max())
                for bound in (None, depth, max(depth - 1, 0)):
                    assert torch.equal(visibility_device(chosen, bound, fused=True),
                                       visibility_device(chosen, bound, fused=False)), (turn, size, bound)
    assert dropped > 50  # kept columns that became padding were compared too


def test_select_and_visibility_refuse_bad_shapes_naming_the_field(cpu_library):
    detail = kernels._ErrorDetail()
    # (batch, n, size); the detail's index: 3 nodes, 9 size.
    for args, field, value in (((1, 0, 1), 3, 0), ((1, 8, 0), 9, 0), ((1, 8, 9), 9, 9)):
        code = cpu_library.dflash_select_cpu(*[None] * 8, *args, *[None] * 9, ctypes.byref(detail))
        assert (code, detail.index, detail.value) == (kernels.ERR_DDTREE_SHAPE, field, value)
    with pytest.raises(DFlashInputError, match=r"size=9 is out of range .* 1 <= size <= nodes"):
        kernels._raise_for(kernels.ERR_DDTREE_SHAPE, detail, {"max_budget": fused_tree.MAX_BUDGET})
    assert cpu_library.dflash_select_cpu(*[None] * 8, 2, 8, 4, *[None] * 9, ctypes.byref(detail)) \
        == kernels.ERR_NULL_POINTER
    assert cpu_library.dflash_select_cpu(*[None] * 8, 0, 8, 4, *[None] * 9, ctypes.byref(detail)) == kernels.OK
    for args, field, value in (((1, 0, 3), 3, 0), ((1, 4, -1), 10, -1)):
        code = cpu_library.dflash_visibility_cpu(None, None, *args, None, ctypes.byref(detail))
        assert (code, detail.index, detail.value) == (kernels.ERR_DDTREE_SHAPE, field, value)
    with pytest.raises(DFlashInputError, match=r"max_hops=-1 is out of range"):
        kernels._raise_for(kernels.ERR_DDTREE_SHAPE, detail, {"max_budget": fused_tree.MAX_BUDGET})
    candidates, values = _random_candidates(np.random.default_rng(0), 2, 6, ties=False)
    with pytest.raises(DFlashInputError, match=r"size=7 is out of range"):
        fused_tree.select(candidates, values, 7, where="cpu-library")


def test_the_learning_step_equals_the_tensor_ops_bit_for_bit():
    """``DevicePolicy.learn`` in the library against its tensor ops over 150 steps of one policy each (the tables
    accumulate, so a difference in any step's rounding stays): real DDTree pools (a reduced vocabulary's -inf among
    them), choices that follow 60% of the edges, lookup nodes, with and without an n-gram length and idle rows."""
    from tensorrt_llm_dflash.device_lookup import Grafted
    from tensorrt_llm_dflash.device_policy import DevicePolicy

    rng = np.random.default_rng(8)
    ops, fused = (DevicePolicy(15, (2, 4, 8, 16, 32, 64), CPU, lookup_rows=12) for _ in range(2))
    for turn in range(150):
        batch, depth, k = int(rng.integers(1, 17)), int(rng.integers(1, 16)), int(rng.integers(2, 30))
        lp, tokens, roots = marginals(rng, batch, depth, k, ties=turn % 5 == 0)
        tokens = tokens % 40
        if turn % 4 == 0:
            lp[:, :, k // 2:] = float("-inf")
        tree = build_ddtree_device(roots, lp, tokens, int(rng.choice([3, 15, 63])), fused=False)
        n = tree.tokens.shape[1]
        verified = Grafted(tree, torch.rand(batch, n, dtype=torch.float64),
                           torch.tensor(rng.uniform(size=(batch, n)) < 0.4))
        follow = torch.where(torch.rand(batch, n - 1) < 0.6, tree.tokens[:, 1:].clamp(min=0), 0)
        choices = torch.tensor(rng.integers(0, 40, size=(batch, n))).scatter_(1, tree.parents.clamp(min=0)[:, 1:],
                                                                               follow)
        ngram = torch.tensor(rng.integers(0, 7, size=batch)) if turn % 3 else None
        live = torch.tensor(rng.uniform(size=batch) < 0.8) if turn % 2 else None
        ops.learn(verified, choices, ngram, live, fused=False)
        fused.learn(verified, choices, ngram, live, fused=True)
        for name in DevicePolicy.LEARNED:
            _assert_same_bits(getattr(fused, name), getattr(ops, name), (turn, name))
    assert float(ops.hits.sum()) > 100 and float(ops.lookup_hits.sum()) > 100  # both tables learned


def test_the_learning_step_refuses_bad_shapes_naming_the_field(cpu_library):
    detail = kernels._ErrorDetail()
    table = torch.zeros(4, 3, dtype=torch.float64)
    tables = [table.data_ptr()] * 4
    # (batch, n); then (rows, bins) of each table; the detail's index: 3 nodes, 11 rows, 12 bins.
    for shape, draft, lookup, ngram, field, value in (
            ((1, 0), (4, 3), (4, 3), None, 3, 0), ((1, 5), (0, 3), (4, 3), None, 11, 0),
            ((1, 5), (4, -1), (4, 3), None, 12, -1), ((1, 5), (4, 3), (4, 0), 1, 12, 0)):
        code = cpu_library.dflash_learn_cpu(*[None] * 10, ngram, *shape, *tables, *draft, *tables, *lookup, None,
                                            0.5, 4.0, ctypes.byref(detail))
        assert (code, detail.index, detail.value) == (kernels.ERR_DDTREE_SHAPE, field, value)
    with pytest.raises(DFlashInputError, match=r"table_bins=0 is out of range"):
        kernels._raise_for(kernels.ERR_DDTREE_SHAPE, detail, {"max_budget": fused_tree.MAX_BUDGET})
    # No n-gram: the lookup table's shape is not read. Rows to learn from but no trees: a null pointer, refused.
    assert cpu_library.dflash_learn_cpu(*[None] * 11, 0, 5, *tables, 4, 3, *[None] * 4, 0, 0, None, 0.5, 4.0,
                                        ctypes.byref(detail)) == kernels.OK
    assert cpu_library.dflash_learn_cpu(*[None] * 11, 2, 5, *tables, 4, 3, *[None] * 4, 0, 0, None, 0.5, 4.0,
                                        ctypes.byref(detail)) == kernels.ERR_NULL_POINTER
