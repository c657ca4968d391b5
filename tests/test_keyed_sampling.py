"""Sampled tokens keyed by the seed and the token's index: speculation at T > 0 gives AR's own sampled tokens.

Every runtime draws the token at sequence index t with uniforms keyed by the seed, t and a lane
(``sampling.keyed_draw``: a two-level exponential race), so a sampled speculative run must equal, token for token,
a plain AR sampler that draws each token the same way. The reference here is independent of every runtime: a fresh
full forward of the whole sequence per token (no KV cache, no tree, no walk). Checked in float64 on tiny Qwen3 and
Llama targets for the eager runtime (chain, DDTree budgets, the cost-aware tree), the graphed runtime alone and in a
batch with rows admitted mid-run, with drafts that know the sampled continuation (long accepted paths at T > 0) and
with real random drafters. The draws themselves: the same hash on Python ints and on tensors, uniform and unrelated
across neighbouring indices, lanes and seeds; the race follows its distribution (chi-square), never draws a token of
probability 0, and moves far less under a rounding of the logits than an inverse-CDF draw does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_batched import Schedule, ScriptedRows, flat_costs, prompts_of
from test_graphed import ScriptedStaticProposer
from test_policy import frozen, gpu_like
from test_sampling import chi2_threshold, chi_square
from tiny_models import NoisyOracleProposer, full_forward, tiny_drafter, tiny_target

from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.graphed import GraphedDecoder
from tensorrt_llm_dflash.policy import CostAwarePolicy, PolicyConfig
from tensorrt_llm_dflash.proposer import DFlashProposer
from tensorrt_llm_dflash.sampling import (
    RACE_BLOCK,
    SamplingParams,
    draw_key,
    keyed_draw,
    keyed_uniforms,
    processed_probs,
)
from tensorrt_llm_dflash.target import HFTargetVerifier

SETTINGS = [SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.9)]


def reference_sample(model, prompt: list[int], n: int, params: SamplingParams, seed: int) -> list[int]:
    """Plain AR sampling, one full forward per token: token t is the keyed draw at index t."""
    key = draw_key(seed)
    tokens = list(prompt)
    for _ in range(n):
        logits = full_forward(model, tokens)[2][-1]
        if params.greedy:
            tokens.append(int(logits.argmax()))
            continue
        where = torch.tensor([len(tokens)])
        tokens.append(int(keyed_draw(processed_probs(logits[None], params), *key, where)[0]))
    return tokens[len(prompt):]


def seeded(params: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed)


def keys_of(seeds) -> tuple[torch.Tensor, torch.Tensor]:
    keys = [draw_key(s) for s in seeds]
    return torch.tensor([k[0] for k in keys]), torch.tensor([k[1] for k in keys])


# ------------------------------------------------------------------------------------------ the draws


def test_the_hash_is_one_function_on_python_ints_and_on_tensors():
    positions = [0, 1, 2, 7, 1000, 65535, 65536, 2 ** 31 - 1]
    lanes = [0, 1, 191, 192, 49_343, 2 ** 32 - 1, 5, 6]
    for seed in (0, 1, 5, 2 ** 32, 2 ** 63 - 1):
        key_a, key_b = draw_key(seed)
        assert 0 <= key_a < 2 ** 32 and 0 <= key_b < 2 ** 32
        on_tensors = keyed_uniforms(key_a, key_b, torch.tensor(positions), torch.tensor(lanes))
        assert on_tensors.dtype == torch.float64
        assert on_tensors.tolist() == [keyed_uniforms(key_a, key_b, p, lane) for p, lane in zip(positions, lanes)]
        assert all(0.0 < u < 1.0 for u in on_tensors.tolist())
        # Keys as tensors broadcast against the positions, as the graphed runtime passes them (one row per request).
        keys = torch.tensor([[key_a, key_b]] * 2)
        rows = keyed_uniforms(keys[:, :1], keys[:, 1:], torch.tensor([positions[:4], positions[4:]]),
                              torch.tensor([lanes[:4], lanes[4:]]))
        assert rows.reshape(-1).tolist() == on_tensors.tolist()
    assert draw_key(0) != draw_key(1)


def test_the_uniforms_are_uniform_and_unrelated_across_indices_lanes_and_seeds():
    """Chi-square of 40 equal bins along one seed's indices, along one index's lanes and along consecutive seeds;
    the joint of neighbours (10 x 10 bins) for each; correlations near 0. A constant, a uniform shared by
    neighbouring indices, lanes or seeds, or a coarse hash fails one of them."""
    key_a, key_b = draw_key(11)
    along_indices = keyed_uniforms(key_a, key_b, torch.arange(40_000), 3).numpy()
    along_lanes = keyed_uniforms(key_a, key_b, torch.tensor(17), torch.arange(40_000)).numpy()
    seeds_a, seeds_b = keys_of(range(40_000))
    along_seeds = keyed_uniforms(seeds_a, seeds_b, torch.full((40_000,), 17), 3).numpy()
    for draws in (along_indices, along_lanes, along_seeds):
        counts = np.histogram(draws, bins=40, range=(0, 1))[0]
        stat, df = chi_square(counts, np.full(40, 1 / 40))
        assert stat < chi2_threshold(df), stat
        pairs = np.histogram2d(draws[:-1], draws[1:], bins=10, range=[[0, 1], [0, 1]])[0]
        stat, df = chi_square(pairs, np.full(100, 1 / 100))
        assert stat < chi2_threshold(df), stat
        assert abs(np.corrcoef(draws[:-1], draws[1:])[0, 1]) < 0.03
    # The same seeds at the next index, and at the next lane, are unrelated too.
    for position, lane in ((18, 3), (17, 4)):
        other = keyed_uniforms(seeds_a, seeds_b, torch.full((40_000,), position), lane).numpy()
        assert abs(np.corrcoef(along_seeds, other)[0, 1]) < 0.03


def spread_distribution(vocab: int = 700, seed: int = 0) -> torch.Tensor:
    """Mass over three race blocks (700 is not a multiple of RACE_BLOCK: the last block is padded), zeros between."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 4
    probs[torch.rand(vocab, generator=gen) < 0.5] = 0.0
    probs[[3, 300, 699]] = torch.tensor([0.2, 0.1, 0.05], dtype=torch.float64) * probs.sum()
    return probs / probs.sum()


def test_the_race_draws_from_its_distribution_and_never_a_token_of_probability_zero():
    assert 700 % RACE_BLOCK
    probs = spread_distribution()
    runs = 60_000
    seeds_a, seeds_b = keys_of(range(runs))
    drawn = keyed_draw(probs.expand(runs, -1), seeds_a, seeds_b, torch.full((runs,), 9)).numpy()
    assert (probs[drawn] > 0).all() and drawn.max() < 700
    counts = np.bincount(drawn, minlength=700)
    stat, df = chi_square(counts, probs.numpy())
    assert stat < chi2_threshold(df), (stat, df)
    # The test can fail: a race that ignored the blocks' masses (a uniform choice of block) is far off.
    flat = probs.clone().reshape(-1)
    wrong = torch.zeros(3 * RACE_BLOCK, dtype=torch.float64)
    wrong[:700] = flat
    wrong = wrong.reshape(3, RACE_BLOCK)
    wrong = (wrong / wrong.sum(-1, keepdim=True) / 3).reshape(-1)[:700]
    assert chi_square(counts, (0.999 * wrong + 0.001 / 700).numpy())[0] > 5 * chi2_threshold(df)
    # Unnormalized weights draw in proportion, in any float dtype; a single token of mass draws it.
    one = torch.zeros(300)
    one[271] = 2.0
    assert int(keyed_draw(one[None], 1, 2, torch.tensor([0]))[0]) == 271


def test_a_rounding_of_the_logits_moves_the_race_far_less_than_an_inverse_cdf():
    """A verify's logits differ from an AR step's in the last bits. With a long tail of tiny probabilities an
    inverse-CDF draw that lands in the tail changes with the boundaries' shift; the race changes only at near-ties."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.cat([torch.randn(20, generator=gen, dtype=torch.float64) + 4,  # a tail of 10% of the mass
                        torch.randn(8000, generator=gen, dtype=torch.float64) - 4])
    moved = logits + 1e-4 * torch.randn(logits.shape, generator=gen, dtype=torch.float64)
    runs = 20_000
    seeds_a, seeds_b = keys_of(range(runs))
    where = torch.full((runs,), 40)
    race = [keyed_draw(x.softmax(-1).expand(runs, -1), seeds_a, seeds_b, where) for x in (logits, moved)]
    u = keyed_uniforms(seeds_a, seeds_b, where, 0)
    cdf = [x.softmax(-1).cumsum(-1) for x in (logits, moved)]
    inverse = [torch.searchsorted(c, (u * c[-1])[:, None]).squeeze(-1) for c in cdf]
    race_moves = int((race[0] != race[1]).sum())
    inverse_moves = int((inverse[0] != inverse[1]).sum())
    assert inverse_moves >= 200, inverse_moves  # about 2%: the test's tail is long enough to show it
    assert race_moves <= inverse_moves // 50, (race_moves, inverse_moves)


# -------------------------------------------------------------------------- the eager runtime


@pytest.mark.parametrize("arch,seed", [("qwen3", 0), ("llama", 1)])
@pytest.mark.parametrize("method", ["ar", "chain", "ddtree:3", "ddtree:8", "auto"])
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_eager_speculation_samples_ars_own_tokens(arch, seed, method, setting):
    """Drafts that know the sampled continuation (right 70% of the time, else second): long accepted paths at
    T > 0, and every token equal to the reference sampler's for the same seed."""
    model = tiny_target(arch, seed=seed)
    block, n = 6, 36
    deep = 0
    for request_seed in (seed, 1000 + seed, 2 ** 62 + seed):
        params = seeded(SETTINGS[setting], request_seed)
        prompt = prompts_of(seed + request_seed % 7, (4 + request_seed % 11,))[0]
        reference = reference_sample(model, prompt, n, params, request_seed)
        proposer = None if method == "ar" else NoisyOracleProposer(prompt + reference, block, 64, seed=seed)
        budget = int(method.split(":")[1]) if method.startswith("ddtree") else 0
        policy = CostAwarePolicy(frozen(gpu_like()), PolicyConfig(max_nodes=20), block_size=block) \
            if method == "auto" else None
        out = speculative_generate(HFTargetVerifier(model, [1, 3]), proposer, prompt, n, params,
                                   ddtree_budget=budget, policy=policy)
        assert out.output_ids == reference, (method, request_seed)
        deep += max(out.stats.acceptance_lengths) >= 4
    if method != "ar":
        assert deep >= 2  # drafts were accepted deep into the block, at T > 0


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("budget", [0, 5])
def test_a_real_drafter_samples_ars_own_tokens(arch, budget):
    model = tiny_target(arch, seed=4, vocab=24)
    drafter = tiny_drafter(model, block_size=5, seed=2, layers=2)
    proposer = DFlashProposer.for_target(drafter, model)
    verifier = HFTargetVerifier(model, drafter.config.target_layer_ids)
    accepted = 0
    for request_seed in range(4):
        params = SamplingParams(0.8, seed=request_seed)
        prompt = prompts_of(request_seed, (9,))[0]
        prompt = [t % 24 for t in prompt]
        out = speculative_generate(verifier, proposer, prompt, 30, params, ddtree_budget=budget)
        assert out.output_ids == reference_sample(model, prompt, 30, params, request_seed), request_seed
        accepted += sum(length - 1 for length in out.stats.acceptance_lengths)
    assert accepted > 0


# ------------------------------------------------------------------------ the graphed runtime


@pytest.mark.parametrize("arch,seed", [("qwen3", 2), ("llama", 0)])
@pytest.mark.parametrize("budget", [0, 4, None])
def test_the_graphed_runtime_samples_ars_own_tokens(arch, seed, budget):
    model = tiny_target(arch, seed=seed)
    n = 40
    for setting, params in enumerate(SETTINGS):
        request_seed = 31 * setting + seed
        params = seeded(params, request_seed)
        prompt = prompts_of(request_seed, (5 + setting * 6,))[0]
        reference = reference_sample(model, prompt, n, params, request_seed)
        proposer = ScriptedStaticProposer(prompt + reference, 8, 64, noise=0.3, seed=seed)
        decoder = GraphedDecoder(model, proposer, budget=budget, policy_buckets=(1, 2), policy_costs=flat_costs)
        out = decoder.generate(prompt, n, params)
        assert out.output_ids == reference, (budget, setting)
        # Long paths under fixed trees; the cost-aware tree sizes itself from what it learns (drafts accepted).
        assert max(out.stats.acceptance_lengths) >= (2 if budget is None else 4), out.stats.acceptance_lengths


@pytest.mark.parametrize("budget", [0, 4, None])
def test_batched_rows_sample_their_own_ar_tokens_whoever_shares_the_step(budget):
    """Five requests through three rows: different prompt lengths, lengths, temperatures, top-k/top-p, one
    greedy; rows admitted mid-run as others finish. Each row's tokens equal its own reference sample."""
    model = tiny_target("qwen3", seed=3)
    prompts = prompts_of(5, (4, 13, 7, 22, 9))
    lengths = [30, 18, 36, 24, 28]
    sampling = [SamplingParams(1.0, seed=1), SamplingParams(), SamplingParams(0.7, top_k=6, seed=2),
                SamplingParams(1.2, top_p=0.85, seed=3), SamplingParams(0.9, seed=2 ** 40)]
    references = [reference_sample(model, p, n, s, s.seed or 0) for p, n, s in zip(prompts, lengths, sampling)]
    proposer = ScriptedRows(3, block_size=6, vocab=64, noise=0.3, seed=1)
    decoder = GraphedDecoder(model, proposer, budget=budget, batch=3, policy_buckets=(1, 2, 4),
                             policy_costs=flat_costs)
    run = Schedule(decoder, prompts, lengths, sampling, admit_at=[0, 0, 1, 2, 3],
                   on_admit=lambda row, i: proposer.set_stream(row, prompts[i] + references[i])).run()
    for i, reference in enumerate(references):
        assert run.output(i) == reference, i
    assert max(count for steps in run.steps.values() for _, count in steps) >= 4  # long paths at T > 0
