"""The cost-aware DDTree with lookup branches: lossless, sized by the cost curve, calibrated.

* Losslessness: float64 tiny Qwen3 and Llama targets, many seeds, prompts with repeats (so
  lookup branches exist), several synthetic cost curves (so trees of every size are chosen,
  drafting is skipped and resumed), stop tokens; the KV cache and the drafter's context are
  re-derived from scratch after every step (the checked verifier/proposer of
  ``test_lossless.py``).
* The choice of n on synthetic cost curves: CPU-like (linear in n) gives small trees, GPU-like
  (flat up to 64) large ones.
* Calibration converges on a synthetic acceptance process.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_lossless import CheckedProposer, CheckedVerifier, build_proposer, make_prompt, reference_ar
from tiny_models import cached_target, hf_greedy

from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.lookup import lookup_branches
from tensorrt_llm_dflash.policy import (
    DRAFT_EDGES,
    EXPLORE_EVERY,
    Calibrator,
    CostAwarePolicy,
    CostModel,
    PolicyConfig,
    calibrate_costs,
    calibration_path,
    cost_cache_key,
    default_policy,
    load_or_calibrate_costs,
)
from tensorrt_llm_dflash.sampling import SamplingParams
from tensorrt_llm_dflash.target import HFTargetVerifier
from tensorrt_llm_dflash.tree import DRAFTER, LOOKUP, CandidateTree, build_chain, visibility


def cpu_like(per_node: float = 0.12) -> CostModel:
    """Verify cost linear in the tree size: 1 + per_node * (n - 1) AR steps."""
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    return CostModel(sizes=sizes, verify_seconds=[1.0 + per_node * (s - 1) for s in sizes], draft_seconds=0.15)


def gpu_like() -> CostModel:
    """Flat up to 64 nodes, then rising."""
    sizes = [1, 2, 8, 32, 65, 129, 257]
    return CostModel(sizes=sizes, verify_seconds=[1.0, 1.0, 1.0, 1.02, 1.05, 2.0, 4.0], draft_seconds=0.2)


def frozen(model: CostModel) -> CostModel:
    """A cost model the online refinement cannot move (the tests' timings are meaningless)."""
    model.observe_verify = lambda *_: None  # type: ignore[method-assign]
    model.observe_draft = lambda *_: None  # type: ignore[method-assign]
    model.observe_overhead = lambda *_: None  # type: ignore[method-assign]
    return model


def repetitive_prompt(seed: int, length: int, vocab: int) -> list[int]:
    """A prompt that repeats some of its own n-grams, as code and chat prompts do."""
    rng = np.random.default_rng(seed)
    base = make_prompt(seed, max(length // 2, 1), vocab)
    out = list(base)
    while len(out) < length:
        start = int(rng.integers(0, len(base)))
        out += base[start : start + int(rng.integers(2, 6))]
    return out[:length]


# ------------------------------------------------------------------------- lossless

CURVES = {"cpu": lambda: cpu_like(), "gpu": gpu_like, "steep": lambda: cpu_like(0.6),
          "nodraft": lambda: CostModel(sizes=[1, 64], verify_seconds=[1.0, 1.5], draft_seconds=50.0)}
POLICY_CASES = [
    (("qwen3", "llama")[i % 2], i % 4, (16, 24, 32)[i % 3], 3 + (i * 7) % 20, 2 + (i * 5) % 9,
     (5, 12, 24, 33)[i % 4], ("drafter", "noisy", "top2", "oracle")[(i // 2) % 4], list(CURVES)[i % 4],
     (1, 4, 16, 63)[(i // 4) % 4])
    for i in range(32)
]


@pytest.mark.parametrize("arch,seed,vocab,plen,block,n,kind,curve,max_nodes", POLICY_CASES)
def test_cost_aware_lookup_tree_is_lossless(arch, seed, vocab, plen, block, n, kind, curve, max_nodes):
    model = cached_target(arch, seed=seed, vocab=vocab)
    prompt = repetitive_prompt(seed, plen, vocab)
    ar = reference_ar(model, prompt, n)
    stream = prompt + ar
    proposer, layer_ids = build_proposer(kind, model, block, seed, stream, drafter_variant=seed + plen)
    verifier = CheckedVerifier(model, layer_ids, check_cache=kind != "drafter")
    checked = CheckedProposer(proposer, verifier, stream)
    policy = CostAwarePolicy(frozen(CURVES[curve]()), PolicyConfig(max_nodes=max_nodes), block_size=block)
    streamed: list[int] = []
    result = speculative_generate(verifier, checked, prompt, n, on_tokens=streamed.extend, policy=policy)
    assert result.output_ids == ar[:n] and streamed == result.output_ids
    stats = result.stats
    assert len(stats.predicted_tokens) == stats.steps == verifier.commits
    assert all(size <= max_nodes + 1 for size in stats.tree_sizes)
    assert verifier.committed == prompt + result.output_ids[: sum(stats.acceptance_lengths)]
    if curve == "nodraft":
        # A draft that costs 50 AR steps is given up after each try, for twice as long each time.
        assert sum(stats.drafted) <= 2 + np.log2(stats.steps + 1), stats.drafted


def test_lookup_branches_are_accepted_and_counted():
    """A prompt that the target's greedy output copies: lookup branches carry the tokens."""
    model = cached_target("qwen3", seed=1, vocab=16)
    prompt = make_prompt(5, 6, 16)
    cycle = hf_greedy(model, prompt, 60)
    prompt = prompt + cycle  # the continuation repeats what the prompt already holds
    ar = hf_greedy(model, prompt, 40)
    policy = CostAwarePolicy(frozen(gpu_like()), PolicyConfig(max_nodes=16), block_size=4)
    verifier = CheckedVerifier(model, [], check_cache=True)
    result = speculative_generate(verifier, None, prompt, 40, policy=policy)
    assert result.output_ids == ar
    assert result.stats.lookup_tokens > 0, "the copied text comes from lookup branches"
    assert result.stats.mean_acceptance_length > 1.5


@pytest.mark.parametrize("arch,seed", [("qwen3", 0), ("llama", 1), ("qwen3", 2), ("llama", 3)])
def test_stop_tokens_end_where_ar_ends(arch, seed):
    model = cached_target(arch, seed=seed, vocab=24)
    prompt = repetitive_prompt(seed, 14, 24)
    ar = hf_greedy(model, prompt, 30)
    for stop in sorted(set(ar[3:20]))[:3]:
        expected = ar[: ar.index(stop) + 1]
        proposer, layer_ids = build_proposer("noisy", model, 5, seed, prompt + ar)
        policy = CostAwarePolicy(frozen(gpu_like()), PolicyConfig(max_nodes=20), block_size=5)
        result = speculative_generate(HFTargetVerifier(model, layer_ids), proposer, prompt, 30,
                                      stop_token_ids=[stop], policy=policy)
        assert result.output_ids == expected and result.finish_reason == "stop"


def test_sampled_output_follows_the_target_distribution():
    """T=1 on a 4-token vocabulary: the first two sampled tokens' joint frequencies under the
    policy match plain AR sampling (chi-square, 3000 draws each)."""
    model = cached_target("qwen3", seed=4, vocab=4, layers=2)
    prompt = [1, 2, 3, 1, 2]
    counts = {}
    for name, use_policy in (("ar", False), ("policy", True)):
        policy = CostAwarePolicy(frozen(gpu_like()), PolicyConfig(max_nodes=8), block_size=3) if use_policy else None
        seen = np.zeros(16)
        verifier = HFTargetVerifier(model)
        for seed in range(3000):
            out = speculative_generate(verifier, None, prompt, 3, SamplingParams(temperature=1.0, seed=seed),
                                       policy=policy).output_ids
            seen[out[1] * 4 + out[2]] += 1
        counts[name] = seen
    observed = np.stack([counts["ar"], counts["policy"]])
    keep = observed.sum(0) > 0
    expected = observed[:, keep].sum(0) / 2
    chi2 = float((((observed[:, keep] - expected) ** 2) / expected).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 4 * np.sqrt(2 * dof), (chi2, dof)


# ------------------------------------------------------------------------- choosing n


def _geometric_pool(p: float, depth: int = 15, width: int = 4) -> np.ndarray:
    """Draft marginals of a drafter that is right with probability p at every depth."""
    probs = np.array([p] + [(1 - p) / (width - 1)] * (width - 1))
    return np.log(np.tile(probs, (depth, 1)))


def _plan_size(costs: CostModel, p: float, max_nodes: int = 200) -> int:
    policy = CostAwarePolicy(costs, PolicyConfig(max_nodes=max_nodes, lookup=False), block_size=16)
    logits = torch.tensor(_geometric_pool(p))
    logits = torch.cat([logits, torch.full((logits.shape[0], 60), -1e9, dtype=logits.dtype)], dim=1)
    plan = policy.plan(0, logits, np.array([5, 6, 7]), max_depth=15)
    return plan.tree.num_nodes - 1


def test_cpu_like_curve_gives_small_trees_and_gpu_like_large_ones():
    cpu, gpu = _plan_size(cpu_like(), 0.8), _plan_size(gpu_like(), 0.8)
    assert 1 <= cpu <= 16, cpu
    assert gpu >= 48, gpu
    assert _plan_size(cpu_like(0.05), 0.8) > cpu, "cheaper nodes buy more of them"


def test_speculation_that_cannot_pay_is_a_plain_ar_step():
    """A paid-for draft still verifies its best node (for the label), drafting is then paused;
    a lookup branch that cannot pay is verified only on every EXPLORE_EVERY-th step."""
    costs = cpu_like(2.0)
    policy = CostAwarePolicy(costs, PolicyConfig(max_nodes=20), block_size=16)
    logits = torch.tensor(_geometric_pool(0.3))
    plan = policy.plan(0, logits, np.array([5, 6, 7]), max_depth=15)
    assert plan.tree.num_nodes == 2 and policy.skip_left > 0
    sizes = [policy.plan(7, None, np.array([7, 1, 2, 3, 7]), max_depth=15).tree.num_nodes for _ in range(16)]
    assert sizes == ([1] * (EXPLORE_EVERY - 1) + [2]) * (16 // EXPLORE_EVERY)


def test_chosen_size_maximises_predicted_tokens_per_second():
    costs = cpu_like()
    policy = CostAwarePolicy(costs, PolicyConfig(max_nodes=40, lookup=False), block_size=16)
    logits = torch.tensor(_geometric_pool(0.7))
    plan = policy.plan(0, logits, np.array([1, 2]), max_depth=15)
    pool, marginal = policy._drafter_pool(0, logits, 15)
    pool.conditional = [1.0] + policy._calibration()[0].predict(np.asarray(pool.depths[1:]) - 1, marginal[1:]).tolist()
    _, values = pool.ranked()
    rates = [(1 + values[:m].sum()) / (costs.overhead_seconds + costs.draft_seconds + costs.verify(m + 1))
             for m in range(41)]
    assert plan.tree.num_nodes - 1 == int(np.argmax(rates))
    assert plan.predicted_tokens / plan.predicted_seconds == pytest.approx(max(rates))


# ------------------------------------------------------------------------- calibration


def test_calibration_converges_on_a_synthetic_acceptance_process():
    """The drafter says q; the target accepts with probability q**2 (an overconfident drafter)
    at depth 1 and sqrt(q) at depth 2 (underconfident). After enough steps the calibrated
    estimate is within 0.06 of the truth in every well-populated bin."""
    rng = np.random.default_rng(0)
    cal = Calibrator(2, DRAFT_EDGES, prior="identity", decay=0.9995)
    for _ in range(400):
        q = rng.uniform(0, 1, 64)
        rows = rng.integers(0, 2, 64)
        truth = np.where(rows == 0, q**2, np.sqrt(q))
        cal.update(rows, q, rng.uniform(0, 1, 64) < truth)
    centres = (np.asarray(DRAFT_EDGES[:-1]) + np.asarray(DRAFT_EDGES[1:])) / 2
    for row, fn in ((0, np.square), (1, np.sqrt)):
        got = cal.predict(np.full(len(centres), row), centres)
        populated = cal.trials[row] > 200
        assert populated.sum() >= 8
        assert np.all(np.abs(got - fn(centres))[populated] < 0.06), (row, got, fn(centres))
        assert np.all(np.diff(got) >= 0), "calibrated probability never decreases with the score"


def test_calibration_with_no_data_is_the_prior_and_follows_drift():
    cal = Calibrator(1, DRAFT_EDGES, prior="identity", decay=0.98)
    assert cal.predict([0], [0.55])[0] == pytest.approx(0.55)
    for _ in range(300):
        cal.update(np.zeros(10), np.full(10, 0.55), np.ones(10))
    assert cal.predict([0], [0.55])[0] > 0.95
    for _ in range(300):
        cal.update(np.zeros(10), np.full(10, 0.55), np.zeros(10))
    assert cal.predict([0], [0.55])[0] < 0.05, "forgetting lets the estimate follow a change"


def test_policy_learns_acceptance_from_the_target_choices():
    """Every verified node's label is whether the target chose its token at its parent."""
    policy = CostAwarePolicy(frozen(cpu_like()), PolicyConfig(max_nodes=30, lookup=False), block_size=4)
    logits = torch.tensor(_geometric_pool(0.9, depth=3))
    first = policy.plan(0, logits, np.array([3]), max_depth=3).tree.num_nodes
    before = policy._calibration()[0].predict([0], [0.9])[0]
    for _ in range(60):
        plan = policy.plan(0, logits, np.array([3]), max_depth=3)
        choices = np.full(plan.tree.num_nodes, 99)  # the target never picks a drafted token
        policy.observe(plan, choices, {"verify": 1.0, "draft": 0.1, "other": 0.0})
    calibrator = policy._calibration()[0]
    after = calibrator.predict([0], [0.9])[0]
    # Its own bin alone says ~0.06; isotonic pooling with the (prior-only) bins below it lifts that.
    assert before > 0.8 and after < 0.25 and calibrator.trials[0].sum() > 40
    plan = policy.plan(0, logits, np.array([3]), max_depth=3)
    assert first >= 4 and plan.tree.num_nodes <= 2, "a drafter that is never right loses its nodes"


def test_calibration_is_kept_per_temperature():
    policy = CostAwarePolicy(frozen(gpu_like()), block_size=4)
    policy.begin(0.0)
    greedy = policy._calibration()
    policy.begin(1.0)
    assert policy._calibration() is not greedy


# ------------------------------------------------------------------------- drafting skipped


def test_drafting_is_skipped_with_backoff_and_retried():
    costs = CostModel(sizes=[1, 64], verify_seconds=[1.0, 1.2], draft_seconds=20.0)
    policy = CostAwarePolicy(frozen(costs), PolicyConfig(max_nodes=8), block_size=4)
    logits = torch.tensor(_geometric_pool(0.5, depth=3))
    pattern = []
    for _ in range(40):
        drafting = policy.wants_draft()
        pattern.append(drafting)
        plan = policy.plan(0, logits if drafting else None, np.array([4, 5, 4]), max_depth=3)
        policy.observe(plan, np.zeros(plan.tree.num_nodes, dtype=int), {"verify": 1, "draft": 20, "other": 0})
    drafted_at = [i for i, d in enumerate(pattern) if d]
    assert drafted_at[0] == 0 and len(drafted_at) >= 3, "retried later"
    gaps = np.diff(drafted_at)
    assert np.all(np.diff(gaps) >= 0) and gaps[-1] > gaps[0], f"back-off grows: {gaps}"


# ------------------------------------------------------------------------- trees and lookup


def test_lookup_prefers_the_longest_ngram_and_the_most_recent_match():
    ctx = [1, 2, 3, 9, 9, 5, 2, 3, 7, 7, 2, 3]
    branches = lookup_branches(ctx, 3, max_ngram=3, max_branches=2)
    assert [b.tokens for b in branches] == [[7, 7, 2], [9, 9, 5]]
    assert all(b.ngram == 2 for b in branches)
    assert lookup_branches([4, 5, 6], 3) == []
    assert lookup_branches([4, 5, 4], 5)[0].tokens == [5, 4]  # stops at the end of the context
    branches = lookup_branches([1, 2, 3, 1, 2, 3, 1], 2, max_branches=5)
    assert [(b.tokens, b.ngram) for b in branches] == [([2, 3], 4)]


def test_lookup_branches_share_nodes_with_the_draft_and_keep_the_larger_estimate():
    tree = build_chain(0, [5, 6])
    pool = CandidateTree.from_tree(tree, [1.0, 0.5, 0.5], DRAFTER)
    pool.add_branch([5, 7, 8], [0.9, 0.8, 0.8], LOOKUP)
    assert pool.num_nodes == 5
    assert pool.sources[1] == DRAFTER | LOOKUP and pool.conditional[1] == 0.9
    assert pool.parents[3:] == [1, 3] and pool.sources[3:] == [LOOKUP, LOOKUP]
    order, values = pool.ranked()
    assert list(order) == [1, 3, 4, 2]
    np.testing.assert_allclose(values, [0.9, 0.72, 0.576, 0.45])
    for n in range(5):
        sub, kept = pool.select(order[:n])
        vis = visibility(sub.parents)
        assert sub.num_nodes == n + 1 and np.all(sub.parents[1:] < np.arange(1, n + 1))
        assert vis.sum() == sum(d + 1 for d in sub.depths)


def test_cost_calibration_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORRT_LLM_DFLASH_CACHE", str(tmp_path))
    model = cached_target("qwen3", seed=0, vocab=32)
    proposer, layer_ids = build_proposer("drafter", model, 4, 0, [])
    target = HFTargetVerifier(model, layer_ids)
    costs = calibrate_costs(target, proposer, sizes=[1, 3, 9], repeats=1, context_len=20)
    assert costs.sizes == [1, 3, 9] and all(t > 0 for t in costs.verify_seconds) and costs.draft_seconds > 0
    first, how = load_or_calibrate_costs(target, proposer, max_nodes=8)
    assert how == "measured" and first.sizes[-1] == 9
    again, how = load_or_calibrate_costs(target, proposer, max_nodes=8)
    assert how == "cache" and again.verify_seconds == first.verify_seconds
    (next(tmp_path.glob("costs/*.json"))).write_text("{not json")
    _, how = load_or_calibrate_costs(target, proposer, max_nodes=8)
    assert how == "measured", "a damaged cache entry is measured again"


def test_a_cached_cost_curve_is_not_reused_once_the_fast_paths_change(tmp_path, monkeypatch):
    """The cache key holds what decides the costs besides the machine and the models: a curve measured before the
    verifier's blocked GEMMs or the draft's routes changed is measured again, not reused."""
    import tensorrt_llm_dflash.target as target_mod

    monkeypatch.setenv("TENSORRT_LLM_DFLASH_CACHE", str(tmp_path))
    model = cached_target("qwen3", seed=0, vocab=32)
    proposer, layer_ids = build_proposer("drafter", model, 4, 0, [])
    target = HFTargetVerifier(model, layer_ids)
    key = cost_cache_key(target, proposer)
    assert cost_cache_key(target, proposer) == key
    monkeypatch.setattr(target_mod, "BLOCKED_ROWS", range(4, 16))
    assert cost_cache_key(target, proposer) != key
    monkeypatch.setattr(target_mod, "BLOCKED_ROWS", range(1, 129))
    assert cost_cache_key(target, proposer) == key
    keys = set()
    for layers in ([], [model]):  # the drafter's layers on F.linear, then (as on a float32 CPU) on oneDNN
        monkeypatch.setattr(proposer.linears, "layers", layers)
        keys.add(cost_cache_key(target, proposer))
    assert len(keys) == 2


def test_online_refinement_moves_the_curve():
    costs = cpu_like()
    before = costs.verify(9)
    for _ in range(30):
        costs.observe_verify(5, 2 * costs.curve(5))
    assert costs.verify(5) == pytest.approx(2 * costs.curve(5), rel=0.01)
    assert costs.verify(9) > 1.8 * before, "the drift carries to sizes not seen yet"


# ------------------------------------------------------------------------- kept between runs


def _trained_policy(block_size: int = 4) -> CostAwarePolicy:
    policy = CostAwarePolicy(frozen(cpu_like()), PolicyConfig(max_nodes=30), block_size=block_size)
    logits = torch.tensor(_geometric_pool(0.9, depth=block_size - 1))
    rng = np.random.default_rng(0)
    for temperature in (0.0, 1.0):
        policy.begin(temperature)
        for _ in range(40):
            plan = policy.plan(0, logits, np.array([3, 4, 3]), max_depth=block_size - 1)
            choices = np.where(rng.random(plan.tree.num_nodes) < 0.5, 0, 99)
            policy.observe(plan, choices, {"verify": 1.0, "draft": 0.1, "other": 0.0})
    return policy


def test_calibration_state_round_trips_through_json_and_refuses_another_shape():
    policy = _trained_policy()
    state = json.loads(json.dumps(policy.calibration_state()))
    assert sorted(state["temperatures"]) == ["0", "1"]
    fresh = CostAwarePolicy(frozen(cpu_like()), PolicyConfig(max_nodes=30), block_size=4)
    assert fresh.load_calibration(state) == 2
    for temperature in (0.0, 1.0):
        policy.begin(temperature)
        fresh.begin(temperature)
        for mine, theirs in zip(policy._calibration(), fresh._calibration()):
            np.testing.assert_array_equal(mine.table(), theirs.table())
            assert mine.trials.sum() > 0
    other = CostAwarePolicy(frozen(cpu_like()), PolicyConfig(max_nodes=30), block_size=8)
    with pytest.raises(ValueError, match="another drafter shape"):
        other.load_calibration(state)
    damaged = json.loads(json.dumps(state))
    damaged["temperatures"]["1"]["draft"]["hits"][0][0] = 1e9  # more hits than trials
    keeps = CostAwarePolicy(frozen(cpu_like()), PolicyConfig(max_nodes=30), block_size=4)
    with pytest.raises(ValueError, match="out of range"):
        keeps.load_calibration(damaged)
    assert keeps._calibrators == {}, "a damaged state restores nothing, not half of it"


def test_default_policy_keeps_the_calibration_per_target_and_drafter(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORRT_LLM_DFLASH_CACHE", str(tmp_path))
    model = cached_target("qwen3", seed=0, vocab=32)
    proposer, layer_ids = build_proposer("drafter", model, 4, 0, [])
    target = HFTargetVerifier(model, layer_ids)
    other, _ = build_proposer("drafter", model, 4, 1, [])
    policy = default_policy(target, proposer, max_nodes=4, persist=True)
    assert policy.calibration_path == calibration_path(target, proposer) != calibration_path(target, other)
    assert policy.calibration_path.parent == tmp_path / "calibration"
    learned = _trained_policy()
    policy.load_calibration(learned.calibration_state())
    policy.save_calibration()
    lines = []
    again = default_policy(target, proposer, max_nodes=4, persist=True, log=lines.append)
    learned.begin(0.0)
    np.testing.assert_array_equal(again._calibration()[0].table(), learned._calibration()[0].table())
    assert any("continuing from earlier runs" in line for line in lines)
    assert default_policy(target, proposer, max_nodes=4, persist=True, recalibrate=True)._calibrators == {}
    assert default_policy(target, other, max_nodes=4, persist=True)._calibrators == {}, "another drafter"
    assert default_policy(target, proposer, max_nodes=4)._calibrators == {}, "not kept unless asked"
    policy.calibration_path.write_text("{not json")
    assert default_policy(target, proposer, max_nodes=4, persist=True)._calibrators == {}, "damaged: priors"
