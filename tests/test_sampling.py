"""Sampling: speculative decoding at T > 0 preserves the target's distribution exactly.

The target's exact joint distribution of the first two generated tokens is enumerated
with ``processed_probs`` (temperature, top-k, top-p), and a chi-square test compares
it with thousands of seeded speculative runs (chain and DDTree). The same statistic
against a wrong distribution, and for a deliberately broken walk, must be huge: the
test can fail.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from tiny_models import full_forward, tiny_drafter, tiny_target

import tensorrt_llm_dflash.decode as decode_mod
from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.proposer import DFlashProposer
from tensorrt_llm_dflash.sampling import (
    SamplingParams,
    choose_tokens,
    make_draws,
    processed_probs,
)
from tensorrt_llm_dflash.target import HFTargetVerifier

P_VALUE = 1e-4
VOCAB = 5
PROMPT = [2, 3]

# ------------------------------------------------------------------- chi-square (no scipy)


def _gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) (series / continued fraction)."""
    if x <= 0:
        return 1.0
    log_prefix = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_prefix) * h


def chi2_sf(stat: float, df: int) -> float:
    return _gamma_q(df / 2.0, stat / 2.0)


def chi2_threshold(df: int, p: float = P_VALUE) -> float:
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > p else (lo, mid)
    return hi


def chi_square(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; cells with small expectation are pooled."""
    counts = counts.reshape(-1).astype(np.float64)
    probs = probs.reshape(-1).astype(np.float64)
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big).any():
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    obs, exp = np.array(obs), np.array(exp)
    keep = exp > 0
    assert (obs[~keep] == 0).all(), "counts in cells of probability zero"
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


@pytest.mark.parametrize("x,df,expected", [
    (0.5, 2, math.exp(-0.25)), (7.3, 2, math.exp(-3.65)), (30.0, 2, math.exp(-15.0)),
    (3.0, 4, math.exp(-1.5) * 2.5), (25.0, 4, math.exp(-12.5) * 13.5),
    (1.0, 1, math.erfc(math.sqrt(0.5))), (12.0, 1, math.erfc(math.sqrt(6.0))),
])
def test_chi2_sf_closed_forms(x, df, expected):
    assert chi2_sf(x, df) == pytest.approx(expected, rel=1e-9)


def test_chi2_threshold_known_value():
    # Values of scipy.stats.chi2.isf(1e-4, df) (scipy 1.17.1) and chi2.sf(40, 24).
    assert chi2_threshold(24) == pytest.approx(58.6129697, abs=1e-4)
    assert chi2_threshold(10) == pytest.approx(35.5640139, abs=1e-4)
    assert chi2_threshold(1) == pytest.approx(15.1367052, abs=1e-4)
    assert chi2_sf(40.0, 24) == pytest.approx(0.0213868216, rel=1e-7)


# ------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=3, vocab=VOCAB, layers=2, hidden=16, init_std=0.3)


@pytest.fixture(scope="module")
def drafter(target):
    return tiny_drafter(target, block_size=3, seed=5)


def exact_joint(model, params: SamplingParams, length: int = 2) -> np.ndarray:
    """Exact joint of the first ``length`` generated tokens, [V] * length, by enumeration:
    p(t1 | prompt) * p(t2 | prompt, t1) * ... under the processed distribution."""
    joint = np.ones(())
    for depth in range(length):
        rows = []
        for prefix in np.ndindex(*([VOCAB] * depth)):
            logits = full_forward(model, [*PROMPT, *prefix])[2][-1]
            rows.append(processed_probs(logits, params).numpy())
        cond = np.stack(rows).reshape([VOCAB] * depth + [VOCAB])
        joint = joint[..., None] * cond
    assert abs(joint.sum() - 1) < 1e-12
    return joint


class PathRecorder(HFTargetVerifier):
    def __init__(self, model, layer_ids):
        super().__init__(model, layer_ids)
        self.off_chain = 0
        self.multi = 0
        self.deep = 0

    def commit(self, accepted_nodes):
        nodes = list(accepted_nodes)
        self.off_chain += nodes != list(range(len(nodes)))
        self.multi += len(nodes) > 1
        self.deep += len(nodes) > 2
        super().commit(accepted_nodes)


def sample_counts(target, drafter, params_fn, budget: int, runs: int, seed0: int, new_tokens: int = 3):
    verifier = PathRecorder(target, drafter.config.target_layer_ids)
    proposer = DFlashProposer.for_target(drafter, target)
    counts = np.zeros([VOCAB] * new_tokens, dtype=np.int64)
    for r in range(runs):
        # One token more than counted: a step's drafts + bonus stay within the budget, so only then can the first step
        # accept new_tokens - 1 drafts (deep paths); the first new_tokens' distribution is the same.
        out = speculative_generate(verifier, proposer, PROMPT, new_tokens + 1, sampling=params_fn(seed0 + r),
                                   ddtree_budget=budget).output_ids
        assert len(out) == new_tokens + 1
        counts[tuple(out[:new_tokens])] += 1
    return counts, verifier


SAMPLING_CASES = [
    # (name, budget, temperature, top_k, top_p, runs)
    ("chain-T1", 0, 1.0, 0, 1.0, 2000),
    ("tree-T1", 4, 1.0, 0, 1.0, 2500),
    ("chain-T0.7-topk3", 0, 0.7, 3, 1.0, 1500),
    ("tree-T1.3-topk4-topp0.8", 6, 1.3, 4, 0.8, 2000),
]


@pytest.mark.parametrize("name,budget,temperature,top_k,top_p,runs", SAMPLING_CASES)
def test_sampling_preserves_target_distribution(target, drafter, name, budget, temperature, top_k, top_p, runs):
    def params(seed):
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

    joint3 = exact_joint(target, params(0), length=3)
    joint = joint3.sum(-1)
    counts3, verifier = sample_counts(target, drafter, params, budget, runs, seed0=1_000_000 * (budget + 1))
    counts = counts3.sum(-1)
    assert counts.sum() == runs
    assert not counts[joint == 0].any(), "sampled a token pair the target's processed distribution forbids"
    if top_k or top_p < 1:
        assert (joint == 0).any(), "top-k / top-p must remove something in this setting"
    stat, df = chi_square(counts, joint)
    threshold = chi2_threshold(df)
    assert stat < threshold, f"{name}: chi2={stat:.1f} >= {threshold:.1f} (df={df}, p<{P_VALUE})"
    # The third token too (it can come from a depth-2 draft node): the full 3-token joint,
    # with cells of small expectation pooled.
    stat3, df3 = chi_square(counts3, joint3)
    assert not counts3[joint3 == 0].any()
    assert stat3 < chi2_threshold(df3), f"{name}: 3-token chi2={stat3:.1f} (df={df3})"
    # The speculative paths were exercised: drafts were accepted, and for trees off the first-child chain.
    assert verifier.multi > runs // 20, verifier.multi
    if budget:
        assert verifier.off_chain > runs // 10, verifier.off_chain  # branches off the top-1 chain
        assert verifier.deep > runs // 100, verifier.deep  # depth-2 draft nodes were accepted too

    # The test can fail: the same counts against the drafter-proposed distribution
    # (target's t1, drafter's marginal for t2) are rejected overwhelmingly.
    proposer = DFlashProposer.for_target(drafter, target)
    ctx = HFTargetVerifier(target, drafter.config.target_layer_ids).prefill(PROMPT)[1]
    rows = []
    for t1 in range(VOCAB):
        proposer.reset()
        q = processed_probs(proposer.propose(t1, ctx)[0], SamplingParams(temperature=temperature)).numpy()
        rows.append(0.999 * q + 0.001 / VOCAB)  # keep every cell possible
    wrong = joint.sum(1)[:, None] * np.stack(rows)
    wrong_stat, wrong_df = chi_square(counts, wrong / wrong.sum())
    assert wrong_stat > 5 * chi2_threshold(wrong_df), wrong_stat


def test_broken_walk_is_detected(target, drafter, monkeypatch):
    """A walk that trusts the drafter (accepts the first child whatever the target sampled)."""

    def trusting_walk(tree, choice):
        choice = [int(t) for t in np.asarray(choice).reshape(-1)]
        path, node = [0], 0
        while tree.children[node]:
            node = min(tree.children[node].values())
            path.append(node)
        return path, choice[node]

    monkeypatch.setattr(decode_mod, "walk", trusting_walk)

    def params(seed):
        return SamplingParams(temperature=1.0, seed=seed)

    joint = exact_joint(target, params(0))
    counts, _ = sample_counts(target, drafter, params, 4, 600, seed0=77)
    stat, df = chi_square(counts.sum(-1), joint)
    assert stat > 5 * chi2_threshold(df), stat


def test_seeded_sampling_is_reproducible(target, drafter):
    proposer = DFlashProposer.for_target(drafter, target)
    verifier = HFTargetVerifier(target, drafter.config.target_layer_ids)

    def run(seed, budget):
        return speculative_generate(verifier, proposer, PROMPT, 12, sampling=SamplingParams(1.0, seed=seed),
                                    ddtree_budget=budget).output_ids

    assert run(5, 0) == run(5, 0) and run(6, 4) == run(6, 4)
    assert len({tuple(run(s, 4)) for s in range(8)}) > 1


# ------------------------------------------------------------- processed_probs unit tests


def test_temperature_is_softmax_of_scaled_logits():
    logits = torch.tensor([[1.0, 2.0, -0.5, 0.3]], dtype=torch.float64)
    for t in (0.3, 1.0, 2.5):
        torch.testing.assert_close(processed_probs(logits, SamplingParams(t)), torch.softmax(logits / t, -1))


def test_top_k_and_top_p_hand_cases():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3], dtype=torch.float64)
    logits = probs.log()
    got = processed_probs(logits, SamplingParams(1.0, top_k=2))
    torch.testing.assert_close(got, torch.tensor([0, 0.625, 0, 0.375], dtype=torch.float64))
    # top_p = 0.75: 0.5 + 0.3 reaches it, so the smallest such set is kept.
    got = processed_probs(logits, SamplingParams(1.0, top_p=0.75))
    torch.testing.assert_close(got, torch.tensor([0, 0.625, 0, 0.375], dtype=torch.float64))
    got = processed_probs(logits, SamplingParams(1.0, top_p=0.85))
    torch.testing.assert_close(got, torch.tensor([0, 0.5, 0.15, 0.3], dtype=torch.float64) / 0.95)
    # the most probable token always survives
    got = processed_probs(logits, SamplingParams(1.0, top_p=0.01))
    torch.testing.assert_close(got, torch.tensor([0, 1.0, 0, 0], dtype=torch.float64))
    # top_k >= V is a no-op
    torch.testing.assert_close(processed_probs(logits, SamplingParams(1.0, top_k=9)), probs)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 5, 1.0), (0.7, 0, 0.9), (1.5, 8, 0.6), (0.9, 3, 0.95)])
def test_processed_probs_match_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    gen = torch.Generator().manual_seed(int(temperature * 100) + top_k)
    logits = torch.randn(6, 20, generator=gen, dtype=torch.float64) * 2
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.softmax(-1)
    got = processed_probs(logits, SamplingParams(temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_choose_tokens_greedy_and_sampled():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert choose_tokens(logits, SamplingParams(), None, [4, 5]).tolist() == [1, 0]
    params = SamplingParams(1.0, top_k=1, seed=3)
    assert choose_tokens(logits, params, make_draws(params), [4, 5]).tolist() == [1, 0]
    assert make_draws(SamplingParams()) is None
    with pytest.raises(DFlashInputError, match="needs its draws"):
        choose_tokens(logits, params, None, [4, 5])


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.5}, "temperature=-0.5"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"temperature": 1.0, "top_p": 0.0}, "top_p=0.0"),
    ({"temperature": 1.0, "top_p": 1.5}, "top_p=1.5"),
    ({"temperature": 1.0, "top_k": -1}, "top_k=-1"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(DFlashInputError, match=match):
        SamplingParams(**kwargs)


def test_a_temperature_below_the_minimum_decodes_greedily():
    """A temperature near float32's smallest numbers would overflow the scaled logits to inf and the softmax to NaN:
    below MIN_TEMPERATURE a request is greedy (vLLM's rule)."""
    from tensorrt_llm_dflash.sampling import MIN_TEMPERATURE, SamplingParams

    for tiny in (1e-45, 1e-38, 1e-20, MIN_TEMPERATURE / 2):
        assert SamplingParams(temperature=tiny).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_top_p_that_underflows_keeps_the_most_probable_token(dtype):
    """top_p = 1e-46 reads 0 in float32: every token would be dropped, the softmax NaN. The most probable token stays,
    in the eager processed_probs and in the graphed runtime's per-row row_probs alike."""
    from tensorrt_llm_dflash.graphed import row_probs
    from tensorrt_llm_dflash.sampling import SamplingParams, processed_probs

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    top = logits.argmax(-1)
    for top_p in (1e-46, 5e-324, 1e-3):
        eager = processed_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        rows = row_probs(logits[None], torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.long),
                         torch.full((1,), top_p, dtype=torch.float64), True)[0]
        for probs in (eager, rows):
            assert not probs.isnan().any(), top_p
            assert torch.equal(probs.argmax(-1), top) and torch.all(probs.max(-1).values == 1.0), top_p


def test_sampling_without_a_seed_leaves_torchs_global_generator_alone():
    """A request without a seed draws one from the OS: torch.seed() reseeded the global generator, so a user's seeded
    torch.rand after the call no longer repeated."""
    from tensorrt_llm_dflash.sampling import SamplingParams, make_draws

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    first = make_draws(SamplingParams(temperature=1.0)).seed
    assert torch.equal(torch.rand(3), expected)
    assert make_draws(SamplingParams(temperature=1.0)).seed != first  # fresh each time
    assert make_draws(SamplingParams(temperature=1.0, seed=5)).seed == 5
    assert make_draws(SamplingParams(temperature=1.0, seed=5)).generator("cpu").initial_seed() == 5


@pytest.mark.parametrize("field, value, says", [("top_k", 2.5, "top_k=2.5 must be an integer"),
                                                ("seed", 2 ** 64, "seed=18446744073709551616 must be an integer"),
                                                ("temperature", float("inf"), "temperature=inf must be >= 0 and finite"),
                                                ("temperature", "0.7", "temperature='0.7' must be a number")])
def test_sampling_params_refuse_what_the_samplers_cannot_take(field, value, says):
    from tensorrt_llm_dflash.errors import DFlashInputError
    from tensorrt_llm_dflash.sampling import SamplingParams

    with pytest.raises(DFlashInputError, match=re.escape(says)):
        SamplingParams(**{field: value})
