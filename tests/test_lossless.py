"""Greedy speculative decoding is lossless: chain and DDTree output == the target's AR output.

The reference is transformers' own ``generate(do_sample=False)``; the runtime's AR path
(``speculative_generate(HFTargetVerifier(model), None, ...)``) must agree with it too.
A spying verifier checks, after every commit, that the compacted KV cache equals a
fresh prefill of the committed tokens, and a spying proposer checks that the drafter
receives exactly the committed tokens' target features, once each, in order.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from tiny_models import (
    NoisyOracleProposer,
    OracleProposer,
    Top2Proposer,
    cached_target,
    full_forward,
    hf_greedy,
    tiny_drafter,
    tiny_target,
)

from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.proposer import DFlashProposer
from tensorrt_llm_dflash.target import HFTargetVerifier

ATOL = 1e-10


class CheckedVerifier(HFTargetVerifier):
    """HFTargetVerifier that re-derives its state from scratch after every commit."""

    def __init__(self, model, layer_ids=None, check_cache: bool = True, atol: float = ATOL) -> None:
        super().__init__(model, layer_ids)
        self.check_cache = check_cache
        self.atol = atol
        self.committed: list[int] = []
        self.commits = 0
        self.prefills = 0
        self.fresh_hidden = None

    def prefill(self, prompt_ids):
        out = super().prefill(prompt_ids)
        self.prefills += 1
        self.committed = list(prompt_ids)
        self._check()
        return out

    def compile_tree(self, tree):
        self.last_tree = tree
        return super().compile_tree(tree)

    def commit(self, accepted_nodes):
        path = list(accepted_nodes)
        assert path[0] == 0 and all(b > a for a, b in itertools.pairwise(path))
        super().commit(accepted_nodes)
        self.committed += [int(t) for t in self.last_tree.tokens[path]]
        self.commits += 1
        self._check()

    def _check(self) -> None:
        assert self.past_len == len(self.committed)
        if not self.check_cache:
            return
        cache, hidden, _ = full_forward(self.model, self.committed)
        self.fresh_hidden = hidden
        mine = self.cache_tensors()
        ref = [(layer.keys, layer.values) for layer in cache.layers]
        assert len(mine) == len(ref)
        for (k, v), (rk, rv) in zip(mine, ref, strict=True):
            assert k.shape == rk.shape and v.shape == rv.shape, (k.shape, rk.shape)
            torch.testing.assert_close(k, rk, atol=self.atol, rtol=0)
            torch.testing.assert_close(v, rv, atol=self.atol, rtol=0)


class CheckedProposer:
    """Wraps a proposer; checks the context it is fed against the verifier's committed state."""

    def __init__(self, inner, verifier: CheckedVerifier, stream: list[int]) -> None:
        self.inner = inner
        self.verifier = verifier
        self.stream = stream
        self.block_size = inner.block_size
        self.received = 0
        self.resets = 0
        self.calls = 0

    def reset(self) -> None:
        self.inner.reset()
        self.received = 0
        self.resets += 1

    def propose(self, root_token, new_context):
        n = int(new_context.shape[0])
        assert n >= 1, "every step commits at least one token"
        self.received += n
        self.calls += 1
        v = self.verifier
        # Drafter context length == target's committed length, at every draft.
        assert self.received == v.past_len == len(v.committed)
        if self.received < len(self.stream):
            assert root_token == self.stream[self.received], "root must be the target's greedy next token"
        if v.check_cache and v.layer_ids:
            hs = v.fresh_hidden
            expected = torch.cat([hs[k + 1][0, self.received - n: self.received] for k in v.layer_ids], -1)
            torch.testing.assert_close(new_context, expected, atol=v.atol, rtol=0)
        out = self.inner.propose(root_token, new_context)
        if isinstance(self.inner, DFlashProposer):
            assert self.inner.context_len == self.received
            assert self.inner.cache.length == self.received
            for k, val in zip(self.inner.cache.keys, self.inner.cache.values, strict=True):
                assert k.shape[2] == val.shape[2] == self.received
        assert out.shape == (self.block_size - 1, v.vocab_size)
        return out


def make_prompt(seed: int, length: int, vocab: int) -> list[int]:
    rng = np.random.default_rng(10_000 + seed * 31 + length)
    return rng.integers(0, vocab - 1, length).tolist()


def reference_ar(model, prompt: list[int], n: int, extra: int = 16) -> list[int]:
    """Greedy AR from HF generate, cross-checked with the runtime's own AR path."""
    ar_long = hf_greedy(model, prompt, n + extra)
    runtime_ar = speculative_generate(HFTargetVerifier(model), None, prompt, n)
    assert runtime_ar.output_ids == ar_long[:n], "runtime AR path disagrees with transformers generate"
    assert runtime_ar.stats.acceptance_lengths == [1] * (n - 1)
    return ar_long


def build_proposer(kind, model, block, seed, stream, drafter_variant=0):
    """(proposer, verifier layer ids)."""
    vocab = model.config.vocab_size
    if kind == "drafter":
        ids_options = [None, [0, 3], [1, 2, 3]]
        overrides = {}
        if ids_options[drafter_variant % 3] is not None:
            overrides["target_layer_ids"] = ids_options[drafter_variant % 3]
        drafter = tiny_drafter(model, block_size=block, seed=seed, layers=1 + drafter_variant % 2, **overrides)
        return DFlashProposer.for_target(drafter, model), list(drafter.config.target_layer_ids)
    cls = {"oracle": OracleProposer, "noisy": NoisyOracleProposer, "top2": Top2Proposer}[kind]
    return cls(stream, block, vocab, seed=seed), [1, 3]


def run_case(arch, seed, vocab, plen, block, n, kind, budget, check_cache):
    model = cached_target(arch, seed=seed, vocab=vocab)
    prompt = make_prompt(seed, plen, vocab)
    ar = reference_ar(model, prompt, n)
    stream = prompt + ar
    proposer, layer_ids = build_proposer(kind, model, block, seed, stream, drafter_variant=seed + plen)
    verifier = CheckedVerifier(model, layer_ids, check_cache=check_cache)
    checked = CheckedProposer(proposer, verifier, stream)
    streamed: list[int] = []
    result = speculative_generate(verifier, checked, prompt, n, ddtree_budget=budget, on_tokens=streamed.extend)
    assert result.output_ids == ar[:n]
    assert streamed == result.output_ids
    assert result.finish_reason == "length" and len(result.output_ids) == n
    acc = result.stats.acceptance_lengths
    assert result.stats.steps == len(acc) == verifier.commits == checked.calls
    assert checked.resets == 1 and verifier.prefills == 1
    assert all(1 <= a <= block for a in acc)
    # Every step was needed and none verified past the budget: the prefill's token and the steps' are the output.
    assert 1 + sum(acc) == n
    # Every committed token went through the target, and they are the output's prefix.
    assert verifier.committed == prompt + result.output_ids[: sum(acc)]
    # Each step drafted as deep as allowed (block - 1, and its drafts + the bonus never past max_new_tokens) and,
    # for DDTree, spent exactly its node budget (or the whole prefix space when smaller).
    for i, size in enumerate(result.stats.tree_sizes):
        depth = min(block - 1, n - 2 - sum(acc[:i]))
        if budget == 0:
            assert size == 1 + depth
        else:
            assert size == 1 + min(budget, sum(vocab**d for d in range(1, depth + 1)))
    return result


# ---------------------------------------------------------------------- chain cases

_NEWS = [1, 2, 5, 9, 17, 24, 33, 12]
_CHAIN_KINDS = ["drafter", "noisy", "drafter", "oracle", "noisy"]
CHAIN_CASES = [
    (
        ("qwen3", "llama")[i % 2],  # arch
        (i // 2) % 3,  # target seed
        (16, 24, 32)[(i // 3) % 3],  # vocab
        1 + (i * 5) % 12,  # prompt length
        2 + (i * 7) % 15,  # block size 2..16
        _NEWS[i % 8],  # max_new_tokens
        _CHAIN_KINDS[i % 5],
    )
    for i in range(60)
]


@pytest.mark.parametrize("arch,seed,vocab,plen,block,n,kind", CHAIN_CASES)
def test_chain_is_lossless(arch, seed, vocab, plen, block, n, kind):
    result = run_case(arch, seed, vocab, plen, block, n, kind, budget=0, check_cache=(kind != "drafter"))
    acc = result.stats.acceptance_lengths
    if kind in ("oracle", "noisy") and len(acc) >= 3:
        assert max(acc) > 1, "a mostly-right proposer must get multi-token acceptance"


def test_random_drafters_get_accepted_sometimes():
    """Tiny vocab: random drafters' drafts are accepted now and then (commit path exercised)."""
    multi = 0
    for seed in range(4):
        for budget in (0, 8):
            model = cached_target(("qwen3", "llama")[seed % 2], seed=seed, vocab=16)
            prompt = make_prompt(seed, 5, 16)
            ar = hf_greedy(model, prompt, 30)
            drafter = tiny_drafter(model, block_size=6, seed=seed)
            verifier = HFTargetVerifier(model, drafter.config.target_layer_ids)
            res = speculative_generate(verifier, DFlashProposer.for_target(drafter, model), prompt, 30,
                                       ddtree_budget=budget)
            assert res.output_ids == ar
            multi += sum(a > 1 for a in res.stats.acceptance_lengths)
    assert multi > 0


# ---------------------------------------------------------------------- DDTree cases

_BUDGETS = [1, 2, 3, 4, 5, 8, 12, 16, 31, 64, 100, 128, 200, 256]
_TREE_KINDS = ["drafter", "noisy", "top2", "drafter", "oracle", "noisy", "drafter"]
TREE_CASES = [
    (
        ("qwen3", "llama")[i % 2],
        (i // 2) % 3,
        (16, 24, 32)[(i // 6) % 3],
        1 + (i * 7) % 11,
        2 + (i * 4) % 15,
        (3, 8, 13, 21, 30)[i % 5],
        _TREE_KINDS[i % 7],
        _BUDGETS[i % 14],
    )
    for i in range(56)
]


@pytest.mark.parametrize("arch,seed,vocab,plen,block,n,kind,budget", TREE_CASES)
def test_ddtree_is_lossless_and_cache_is_compacted(arch, seed, vocab, plen, block, n, kind, budget):
    result = run_case(arch, seed, vocab, plen, block, n, kind, budget=budget, check_cache=True)
    acc = result.stats.acceptance_lengths
    if kind in ("oracle", "noisy") and len(acc) >= 3 and block > 2:
        assert max(acc) > 1


def test_ddtree_compaction_actually_moves_kv():
    """The cache check above must cover non-trivial compaction (accepted path != 0..k-1)."""
    model = cached_target("qwen3", seed=1, vocab=16)
    prompt = make_prompt(1, 6, 16)
    ar = reference_ar(model, prompt, 30)
    verifier = CheckedVerifier(model, [1, 3])
    moved = []
    original = verifier.commit

    def spy(nodes):
        moved.append(list(nodes) != list(range(len(nodes))))
        original(nodes)

    verifier.commit = spy
    proposer = CheckedProposer(Top2Proposer(prompt + ar, 5, 16, seed=3), verifier, prompt + ar)
    res = speculative_generate(verifier, proposer, prompt, 30, ddtree_budget=16)
    assert res.output_ids == ar[:30]
    assert sum(moved) >= 3, "top-2 drafts must be accepted off the first-child chain"


# ------------------------------------------------------------ oracle / top-2 drafters

ORACLE_CASES = [
    # (arch, block, n, budget)
    ("qwen3", 2, 9, 0), ("qwen3", 4, 21, 0), ("llama", 8, 30, 0), ("llama", 16, 40, 0), ("qwen3", 5, 23, 0),
    ("qwen3", 2, 9, 1), ("qwen3", 4, 21, 3), ("llama", 8, 30, 7), ("llama", 16, 40, 15), ("qwen3", 5, 23, 64),
    ("llama", 6, 25, 256), ("qwen3", 16, 33, 100),
]


@pytest.mark.parametrize("arch,block,n,budget", ORACLE_CASES)
def test_oracle_drafter_accepts_whole_blocks(make_proposer, arch, block, n, budget):
    model = cached_target(arch, seed=2, vocab=32)
    prompt = make_prompt(2, 4, 32)
    ar = hf_greedy(model, prompt, n + 16)
    proposer = make_proposer("oracle", prompt + ar, block, 32, seed=block)
    verifier = HFTargetVerifier(model, [2])
    res = speculative_generate(verifier, proposer, prompt, n, ddtree_budget=budget)
    assert res.output_ids == ar[:n]
    acc = res.stats.acceptance_lengths
    assert acc[:-1] == [block] * (len(acc) - 1), acc
    assert 1 <= acc[-1] <= block
    assert len(acc) == -(-(n - 1) // block)  # ceil((n - 1) / block) steps


TOP2_CASES = [("qwen3", 2, 15), ("llama", 3, 20), ("qwen3", 4, 25), ("llama", 6, 30), ("qwen3", 8, 30)]


@pytest.mark.parametrize("arch,block,n", TOP2_CASES)
def test_top2_drafter_tree_beats_chain(make_proposer, arch, block, n):
    model = cached_target(arch, seed=0, vocab=24)
    prompt = make_prompt(0, 3, 24)
    ar = hf_greedy(model, prompt, n + 16)
    stream = prompt + ar
    chain = speculative_generate(HFTargetVerifier(model, [1]), make_proposer("top2", stream, block, 24), prompt, n)
    tree = speculative_generate(HFTargetVerifier(model, [1]), make_proposer("top2", stream, block, 24), prompt, n,
                                ddtree_budget=2 * (block - 1))
    assert chain.output_ids == tree.output_ids == ar[:n]
    assert chain.stats.acceptance_lengths == [1] * (n - 1)
    # (the last step may have one token left to make: a root-only step, nothing to draft)
    assert all(a >= 2 for a in tree.stats.acceptance_lengths[:-1]), tree.stats.acceptance_lengths
    assert tree.stats.mean_acceptance_length > 1.5
    # A large enough tree holds the all-second-choice path: whole blocks again.
    full = speculative_generate(HFTargetVerifier(model, [1]), Top2Proposer(stream, block, 24), prompt, n,
                                ddtree_budget=min(2 ** block, 256))
    if block <= 6:
        assert full.stats.acceptance_lengths[:-1] == [block] * (len(full.stats.acceptance_lengths) - 1)
    assert full.output_ids == ar[:n]


# ------------------------------------------------------------- stop tokens and lengths


def _stop_positions(ar: list[int], block: int) -> list[int]:
    """Output indices i where ar[i] is a first occurrence and i is a drafted (non-bonus) slot."""
    seen, out = set(), []
    for i, t in enumerate(ar):
        if t not in seen and i % block != 0:
            out.append(i)
        seen.add(t)
    return out


@pytest.mark.parametrize("arch,block,budget,pick", [("qwen3", 6, 0, 0), ("qwen3", 6, 0, 2), ("llama", 5, 0, 1),
                                                    ("llama", 5, 12, 0), ("qwen3", 8, 30, 3), ("llama", 4, 3, 2)])
def test_stop_token_inside_accepted_block(arch, block, budget, pick):
    model = cached_target(arch, seed=1, vocab=32)
    prompt = make_prompt(1, 5, 32)
    ar = hf_greedy(model, prompt, 60)
    i = _stop_positions(ar[:40], block)[pick]
    stop = ar[i]
    expected = ar[: i + 1]
    assert hf_greedy(model, prompt, 40, eos_token_id=stop) == expected  # HF's own stop semantics
    proposer = OracleProposer(prompt + ar, block, 32)
    streamed: list[int] = []
    res = speculative_generate(HFTargetVerifier(model, [1]), proposer, prompt, 40, stop_token_ids=[stop],
                               ddtree_budget=budget, on_tokens=streamed.extend)
    assert res.output_ids == expected and res.finish_reason == "stop"
    assert streamed == expected
    # The stop was a drafted token inside an accepted block: tokens after it were accepted
    # by the target but dropped.
    assert 1 + sum(res.stats.acceptance_lengths) > len(expected)
    # Same with the AR path and with a random drafter.
    ar_res = speculative_generate(HFTargetVerifier(model), None, prompt, 40, stop_token_ids=[stop])
    assert ar_res.output_ids == expected and ar_res.finish_reason == "stop"
    drafter = tiny_drafter(model, block_size=block, seed=1)
    rnd = speculative_generate(HFTargetVerifier(model, drafter.config.target_layer_ids),
                               DFlashProposer.for_target(drafter, model), prompt, 40,
                               stop_token_ids=[stop, 10_000], ddtree_budget=budget)
    assert rnd.output_ids == expected and rnd.finish_reason == "stop"


def test_stop_token_first_and_several_stops():
    model = cached_target("qwen3", seed=1, vocab=32)
    prompt = make_prompt(1, 5, 32)
    ar = hf_greedy(model, prompt, 40)
    res = speculative_generate(HFTargetVerifier(model, [1]), OracleProposer(prompt + ar, 4, 32), prompt, 40,
                               stop_token_ids=[ar[0]])
    assert res.output_ids == [ar[0]] and res.finish_reason == "stop" and res.stats.steps == 0
    later = [t for t in ar[5:] if t not in ar[:5]]
    stops = [later[0], later[1]] if len(later) > 1 else [later[0]]
    first = min(ar.index(s) for s in stops)
    res = speculative_generate(HFTargetVerifier(model, [1]), OracleProposer(prompt + ar, 4, 32), prompt, 40,
                               stop_token_ids=stops, ddtree_budget=6)
    assert res.output_ids == ar[: first + 1] and res.finish_reason == "stop"


@pytest.mark.parametrize("n,budget,kind", [(1, 0, "oracle"), (2, 0, "oracle"), (3, 4, "oracle"), (7, 0, None),
                                           (16, 0, "oracle"), (17, 8, "oracle"), (13, 0, "drafter")])
def test_max_new_tokens_is_exact(n, budget, kind):
    model = cached_target("llama", seed=2, vocab=32)
    prompt = make_prompt(2, 3, 32)
    ar = hf_greedy(model, prompt, n + 16)
    if kind is None:
        proposer, ids = None, []
    else:
        proposer, ids = build_proposer(kind, model, 8, 0, prompt + ar)
    res = speculative_generate(HFTargetVerifier(model, ids), proposer, prompt, n, ddtree_budget=budget)
    assert res.output_ids == ar[:n] and len(res.output_ids) == n and res.finish_reason == "length"
    assert res.stats.new_tokens == n
    # No step verifies past the budget: every committed token is output (tau counts only those), the prefill's + steps'.
    assert 1 + sum(res.stats.acceptance_lengths) == n


class CountingVerifier(HFTargetVerifier):
    def __init__(self, model, layer_ids=None):
        super().__init__(model, layer_ids)
        self.calls = 0

    def prefill(self, prompt_ids):
        self.calls += 1
        return super().prefill(prompt_ids)


class CountingProposer:
    block_size = 4

    def __init__(self):
        self.calls = 0

    def reset(self):
        self.calls += 1

    def propose(self, root, ctx):
        self.calls += 1
        raise AssertionError("must not be reached")


@pytest.fixture(scope="module")
def short_target():
    return tiny_target("qwen3", seed=3, vocab=32, max_positions=32)


def test_position_limit_boundary_runs_and_is_lossless(short_target):
    prompt = make_prompt(3, 10, 32)
    ar = hf_greedy(short_target, prompt, 22)
    for budget in (0, 40):
        stream = prompt + ar
        res = speculative_generate(HFTargetVerifier(short_target, [1]), OracleProposer(stream, 16, 32), prompt, 22,
                                   ddtree_budget=budget)
        assert res.output_ids == ar


@pytest.mark.parametrize("plen,n", [(10, 23), (30, 5), (32, 1), (1, 40)])
def test_prompt_plus_max_new_beyond_positions_raises_first(short_target, plen, n):
    verifier, proposer = CountingVerifier(short_target, [1]), CountingProposer()
    with pytest.raises(DFlashInputError) as err:
        speculative_generate(verifier, proposer, make_prompt(0, plen, 32), n)
    msg = str(err.value)
    assert f"prompt length {plen}" in msg and f"max_new_tokens {n}" in msg
    assert str(plen + n) in msg and "max_position_embeddings=32" in msg
    assert verifier.calls == 0 and proposer.calls == 0


@pytest.mark.parametrize("prompts", [
    [[1, 2, 3], [4, 5, 6]],
    [[1, 2, 3], [4, 5]],
    "tensor",
    "array",
])
def test_batch_of_two_prompts_is_refused(qwen_target, prompts):
    if prompts == "tensor":
        prompts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    elif prompts == "array":
        prompts = np.array([[1, 2, 3], [4, 5, 6]])
    verifier, proposer = CountingVerifier(qwen_target, [1]), CountingProposer()
    with pytest.raises(DFlashInputError, match="batch size 2 is not supported"):
        speculative_generate(verifier, proposer, prompts, 4)
    assert verifier.calls == 0 and proposer.calls == 0


def test_batch_of_one_equals_flat_prompt(qwen_target):
    flat = speculative_generate(HFTargetVerifier(qwen_target), None, [3, 4, 5], 6).output_ids
    for batched in ([[3, 4, 5]], torch.tensor([[3, 4, 5]]), np.array([[3, 4, 5]]), torch.tensor([3, 4, 5])):
        assert speculative_generate(HFTargetVerifier(qwen_target), None, batched, 6).output_ids == flat


@pytest.mark.parametrize("budget", [-1, -100, 1024, 5000])
def test_bad_ddtree_budget_raises_first(qwen_target, budget):
    verifier, proposer = CountingVerifier(qwen_target, [1]), CountingProposer()
    with pytest.raises(DFlashInputError, match=f"ddtree_budget={budget} is out of range"):
        speculative_generate(verifier, proposer, [1, 2, 3], 4, ddtree_budget=budget)
    assert verifier.calls == 0 and proposer.calls == 0


@pytest.mark.parametrize("prompt,n,match", [
    ([], 4, "prompt is empty"),
    ([1, 2], 0, "max_new_tokens=0"),
    ([1, 32, 2], 3, r"prompt token ids \[32\] are outside the target vocabulary 0..31"),
    ([-1, 2], 3, r"prompt token ids \[-1\]"),
])
def test_other_bad_inputs_raise_first(qwen_target, prompt, n, match):
    verifier, proposer = CountingVerifier(qwen_target, [1]), CountingProposer()
    with pytest.raises(DFlashInputError, match=match):
        speculative_generate(verifier, proposer, prompt, n)
    assert verifier.calls == 0 and proposer.calls == 0


@pytest.mark.parametrize("arch,budget", [("qwen3", 10), ("llama", 10), ("llama", 0)])
def test_eager_attention_target_is_lossless(arch, budget):
    """The verifier's additive tree mask works with eager attention as well as sdpa.

    transformers' eager attention takes its softmax in float32 even for float64 models,
    so caches agree to float32 precision only (1e-5 here instead of 1e-10).
    """
    model = tiny_target(arch, seed=4, vocab=24, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    prompt = make_prompt(4, 5, 24)
    ar = reference_ar(model, prompt, 24)
    verifier = CheckedVerifier(model, [1, 3], atol=1e-5)
    proposer = CheckedProposer(NoisyOracleProposer(prompt + ar, 6, 24, seed=4), verifier, prompt + ar)
    res = speculative_generate(verifier, proposer, prompt, 24, ddtree_budget=budget)
    assert res.output_ids == ar[:24] and max(res.stats.acceptance_lengths) > 1


# ------------------------------------------------------------- sliding-window targets

@pytest.mark.parametrize("budget,kind", [
    (0, "oracle"),
    (0, "noisy"),
    (8, "oracle"),
    (8, "noisy"),
    (16, "noisy"),
])
def test_sliding_window_target_is_lossless(budget, kind):
    """A target with sliding_attention layers (window 4 < context): output == greedy AR."""
    model = tiny_target("qwen3", seed=0, vocab=32, sliding_window=4)
    assert "sliding_attention" in model.config.layer_types
    prompt = [3, 5, 7, 9, 11, 2, 4]
    ar = reference_ar(model, prompt, 24)
    proposer, layer_ids = build_proposer(kind, model, 6, 1, prompt + ar)
    verifier = CheckedVerifier(model, layer_ids, check_cache=False)
    result = speculative_generate(verifier, proposer, prompt, 24, ddtree_budget=budget)
    assert result.output_ids == ar[:24]


@pytest.mark.parametrize("budget", [0, 8])
def test_mistral_style_sliding_window_target_is_lossless(budget):
    """A target that windows every layer without layer_types (Mistral): one windowed mask."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(3)
    config = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           sliding_window=4, attn_implementation="sdpa", bos_token_id=0, eos_token_id=1,
                           pad_token_id=1)
    model = MistralForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model = model.to(torch.float64).eval()
    prompt = [3, 5, 7, 9, 11, 2, 4]
    ar = reference_ar(model, prompt, 20)
    proposer, layer_ids = build_proposer("noisy", model, 6, 2, prompt + ar)
    result = speculative_generate(CheckedVerifier(model, layer_ids, check_cache=False), proposer, prompt, 20,
                                  ddtree_budget=budget)
    assert result.output_ids == ar[:20]
    assert max(result.stats.acceptance_lengths) > 1


# ----------------------------------------------------------- reduced draft vocabulary


@pytest.mark.parametrize("budget,draft_ids", [
    (0, [2, 5, 7, 8, 11, 3]),
    (4, [2, 5, 7, 8, 11, 3]),
    (12, list(range(0, 16, 2))),
    (64, [2, 5, 8, 11]),  # more nodes than finite-probability prefixes
])
def test_reduced_draft_vocabulary_is_lossless(budget, draft_ids):
    model = cached_target("llama", seed=1, vocab=16)
    prompt = make_prompt(1, 4, 16)
    ar = reference_ar(model, prompt, 25)
    drafter = tiny_drafter(model, block_size=4, seed=3, draft_vocab_size=len(draft_ids))
    drafter.d2t = torch.tensor(draft_ids) - torch.arange(len(draft_ids))  # target id = i + d2t[i]
    proposer = DFlashProposer.for_target(drafter, model)
    verifier = CheckedVerifier(model, drafter.config.target_layer_ids)
    checked = CheckedProposer(proposer, verifier, prompt + ar)
    logits = []
    original = proposer.propose

    def spy(root, ctx):
        out = original(root, ctx)
        logits.append(out)
        return out

    proposer.propose = spy
    res = speculative_generate(verifier, checked, prompt, 25, ddtree_budget=budget)
    assert res.output_ids == ar[:25]
    outside = torch.ones(16, dtype=torch.bool)
    outside[draft_ids] = False
    assert all(torch.isneginf(lg[:, outside]).all() and torch.isfinite(lg[:, ~outside]).all() for lg in logits)
