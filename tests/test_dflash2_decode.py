"""DFlash2 decoding is lossless: chain and tree greedy output == the target's greedy output (float64),
and sampled output follows the target's distribution (chi-square), the chain's through rejection
sampling against the selector's sparse draft distribution."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from test_lossless import CheckedVerifier, make_prompt, reference_ar
from test_sampling import PROMPT, VOCAB, PathRecorder, chi2_threshold, chi_square, exact_joint
from tiny_models import cached_target, tiny_dflash2_drafter, tiny_target

from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.dflash2 import DFlash2Proposer, SelectorDraft, build_dflash2_tree, save_dflash2_drafter
from tensorrt_llm_dflash.dflash2.selector import conditional_rows
from tensorrt_llm_dflash.policy import CostAwarePolicy, CostModel, PolicyConfig
from tensorrt_llm_dflash.sampling import SamplingParams
from tensorrt_llm_dflash.target import HFTargetVerifier

# ----------------------------------------------------------------------------- scripted drafts


class OracleSelectorProposer:
    """A DFlash2-style proposer that knows the target's greedy stream: at each depth the truth is
    a candidate; with probability ``noise`` the selector's unary term ranks a wrong token first, so
    chains break and the tree has to branch. The pairwise term is random but small."""

    selects_tokens = True

    def __init__(self, stream: list[int], block_size: int, vocab: int, seed: int, noise: float, k: int = 4) -> None:
        self.stream, self.block_size, self.vocab, self.noise, self.k = stream, block_size, vocab, noise, k
        self.rng = np.random.default_rng(seed)
        self.codebook = torch.from_numpy(self.rng.standard_normal((vocab, 3)) * 0.3)
        self.reset()

    def reset(self) -> None:
        self.context_len = 0

    def propose(self, root: int, new_context: torch.Tensor) -> SelectorDraft:
        self.context_len += int(new_context.shape[0])
        unary, tokens = [], []
        for depth in range(1, self.block_size):
            index = self.context_len + depth
            truth = self.stream[index] if index < len(self.stream) else 0
            others = [t for t in self.rng.permutation(self.vocab).tolist() if t != truth][: self.k - 1]
            row = sorted(self.rng.normal(0.0, 0.5, self.k - 1).tolist(), reverse=True)
            if self.rng.random() < self.noise:
                tokens.append(others[:1] + [truth] + others[1:])
                unary.append([4.0, 3.5] + row[1:])
            else:
                tokens.append([truth] + others)
                unary.append([4.0] + row)
        tokens_t = torch.tensor(tokens)
        return SelectorDraft(unary=torch.tensor(unary, dtype=torch.float64), tokens=tokens_t,
                             gates=torch.from_numpy(self.rng.standard_normal((self.block_size - 1, 3)) * 0.3),
                             successors=self.codebook[tokens_t], predecessor_codebook=self.codebook)


# ----------------------------------------------------------------------------- greedy


GREEDY_CASES = [
    # (arch, seed, vocab, prompt length, block, new tokens, budget, proposer)
    (("qwen3", "llama")[i % 2], i % 3, (24, 32)[i % 2], 1 + (i * 5) % 9, (4, 8, 16)[i % 3], (9, 17, 24)[i % 3],
     (0, 0, 3, 8, 20)[i % 5], ("drafter", "oracle")[(i // 2) % 2])
    for i in range(20)
]


def greedy_case(arch: str, seed: int, vocab: int, plen: int, block: int, n: int, kind: str):
    """(target, prompt, its greedy AR continuation, proposer, target layer ids) of one float64 case."""
    model = cached_target(arch, seed=seed, vocab=vocab)
    prompt = make_prompt(seed, plen, vocab)
    ar = reference_ar(model, prompt, n)
    if kind == "drafter":
        drafter = tiny_dflash2_drafter(model, block_size=block, seed=seed, layers=1 + seed % 2,
                                       layout=("nested", "flat")[seed % 2])
        return model, prompt, ar, DFlash2Proposer.for_target(drafter, model), list(drafter.config.target_layer_ids)
    return model, prompt, ar, OracleSelectorProposer(prompt + ar, block, vocab, seed, noise=0.3), [1, 3]


@pytest.mark.parametrize("arch,seed,vocab,plen,block,n,budget,kind", GREEDY_CASES)
def test_greedy_equals_target_greedy(arch, seed, vocab, plen, block, n, budget, kind):
    model, prompt, ar, proposer, layer_ids = greedy_case(arch, seed, vocab, plen, block, n, kind)
    verifier = CheckedVerifier(model, layer_ids, check_cache=seed == 0)
    result = speculative_generate(verifier, proposer, prompt, n, ddtree_budget=budget)
    assert result.output_ids == ar[:n]
    assert verifier.committed == prompt + result.output_ids[: sum(result.stats.acceptance_lengths)]
    if kind == "oracle" and n > 9:  # the drafts were used: chains accepted, trees branched off the top-1
        assert max(result.stats.acceptance_lengths) >= 3
        if budget:
            assert any(size > block for size in result.stats.tree_sizes) or budget < block


def test_tree_recovers_what_the_chain_loses():
    """Same scripted drafts (the truth second whenever the unary term is wrong): a tree of a few
    nodes per depth accepts more per step than the chain, and both equal AR."""
    model = cached_target("qwen3", seed=1, vocab=32)
    prompt = make_prompt(1, 5, 32)
    ar = reference_ar(model, prompt, 40)
    taus = {}
    for budget in (0, 24):
        proposer = OracleSelectorProposer(prompt + ar, 8, 32, seed=4, noise=0.4)
        result = speculative_generate(HFTargetVerifier(model, [1, 3]), proposer, prompt, 40, ddtree_budget=budget)
        assert result.output_ids == ar[:40]
        taus[budget] = result.stats.mean_acceptance_length
    assert taus[24] > taus[0] + 0.5, taus


# ----------------------------------------------------------------------------- the tree itself


def _random_draft(seed: int, depth: int = 3, k: int = 3, vocab: int = 7, rank: int = 4) -> SelectorDraft:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(depth)])
    codebook = torch.randn(vocab, rank, generator=gen, dtype=torch.float64)
    unary = torch.randn(depth, k, generator=gen, dtype=torch.float64).sort(-1, descending=True).values
    return SelectorDraft(unary=unary, tokens=tokens, gates=torch.randn(depth, rank, generator=gen, dtype=torch.float64),
                         successors=torch.randn(depth, k, rank, generator=gen, dtype=torch.float64),
                         predecessor_codebook=codebook)


@pytest.mark.parametrize("seed", range(12))
def test_tree_is_the_most_probable_prefixes(seed):
    """Brute force: every prefix's probability is the product of q_t(c_t | c_{t-1}); the tree of
    B nodes is the B most probable prefixes, and its first path is the greedy chain."""
    draft, root = _random_draft(seed), 5
    probs: dict[tuple[int, ...], float] = {}
    for d in range(1, draft.depth + 1):
        for path in itertools.product(range(3), repeat=d):
            p, prev, tokens = 1.0, root, []
            for t, i in enumerate(path):
                lp, toks = conditional_rows(draft, t + 1, prev)
                p *= float(np.exp(lp[toks.index(int(draft.tokens[t, i]))]))
                prev = int(draft.tokens[t, i])
                tokens.append(prev)
            probs[tuple(tokens)] = p
    ranked = sorted(probs, key=probs.get, reverse=True)
    for budget in (1, 4, 9, 20, 39):
        tree = build_dflash2_tree(root, draft, budget, 3)
        paths = set()
        for node in range(1, tree.num_nodes):
            path, n = [], node
            while n > 0:
                path.append(int(tree.tokens[n]))
                n = int(tree.parents[n])
            paths.add(tuple(reversed(path)))
        assert paths == set(ranked[:budget])
    chain = draft.chain(root, 3).tokens[1:].tolist()
    tree = build_dflash2_tree(root, draft, 39, 3)
    first, node = [], 0
    while tree.children[node]:
        node = min(tree.children[node].values())
        first.append(int(tree.tokens[node]))
    assert first == chain


# ----------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def small_target():
    return tiny_target("qwen3", seed=3, vocab=VOCAB, layers=2, hidden=16, init_std=0.3)


@pytest.fixture(scope="module")
def small_drafter(small_target):
    return tiny_dflash2_drafter(small_target, block_size=3, seed=5, selector_top_k=3, conv_group_size=8,
                                selector_rank=4)


def _counts(target, drafter, params, budget, runs, seed0, policy=None):
    verifier = PathRecorder(target, list(drafter.config.target_layer_ids))
    proposer = DFlash2Proposer.for_target(drafter, target)
    counts = np.zeros([VOCAB] * 3, dtype=np.int64)
    for r in range(runs):
        out = speculative_generate(verifier, proposer, PROMPT, 3, sampling=params(seed0 + r), ddtree_budget=budget,
                                   policy=policy)
        counts[tuple(out.output_ids)] += 1
    return counts, verifier


SAMPLING_CASES = [("chain-T1", 0, 1.0, 0, 2000), ("chain-T0.7-topk3", 0, 0.7, 3, 1500), ("tree-T1", 4, 1.0, 0, 1500)]


@pytest.mark.parametrize("name,budget,temperature,top_k,runs", SAMPLING_CASES)
def test_sampling_preserves_target_distribution(small_target, small_drafter, name, budget, temperature, top_k, runs):
    def params(seed):
        return SamplingParams(temperature=temperature, top_k=top_k, seed=seed)

    joint3 = exact_joint(small_target, params(0), length=3)
    counts3, verifier = _counts(small_target, small_drafter, params, budget, runs, seed0=31 + budget)
    assert counts3.sum() == runs and not counts3[joint3 == 0].any()
    for counts, joint in ((counts3.sum(-1), joint3.sum(-1)), (counts3, joint3)):
        stat, df = chi_square(counts, joint)
        assert stat < chi2_threshold(df), f"{name}: chi2={stat:.1f} (df={df})"
    assert verifier.multi > runs // 20, verifier.multi  # drafts were accepted
    if budget:
        assert verifier.off_chain > runs // 20, verifier.off_chain  # off the selector's chain


def test_broken_rejection_sampling_is_detected(small_target, small_drafter, monkeypatch):
    """Rejection sampling that draws the bonus from p instead of the residual max(p - q, 0) favours
    the drafted tokens; the same test rejects it overwhelmingly."""
    real = SelectorDraft.accept

    def no_residual(self, tree, node_logits, sampling, generator):
        out = real(self, tree, node_logits, sampling, generator)
        if out is None or len(out[0]) == tree.num_nodes:
            return out
        path = out[0]
        return path, int(tree.tokens[len(path)])  # "resample" = keep the rejected draft token

    monkeypatch.setattr(SelectorDraft, "accept", no_residual)

    def params(seed):
        return SamplingParams(temperature=1.0, seed=seed)

    joint = exact_joint(small_target, params(0), length=3).sum(-1)
    counts, _ = _counts(small_target, small_drafter, params, 0, 800, seed0=5)
    stat, df = chi_square(counts.sum(-1), joint)
    assert stat > 5 * chi2_threshold(df), stat


# ----------------------------------------------------------------------------- policy and CLI


def _policy(costs: str) -> CostAwarePolicy:
    """A cost-aware policy with a fixed cost curve (the tests' timings mean nothing): ``flat`` verifies big trees,
    ``steep`` small ones, ``nodraft`` prices the draft so high that AR and lookup steps win."""
    curves = {"flat": ([1, 2, 8, 32, 65], [1.0, 1.0, 1.0, 1.02, 1.05], 0.1),
              "steep": ([1, 2, 4, 8, 16, 32], [1.0, 1.3, 1.9, 3.1, 5.5, 10.3], 0.1),
              "nodraft": ([1, 65], [1.0, 1.5], 50.0)}
    sizes, seconds, draft = curves[costs]
    model = CostModel(sizes=sizes, verify_seconds=seconds, draft_seconds=draft)
    model.observe_verify = model.observe_draft = model.observe_overhead = lambda *_: None
    return CostAwarePolicy(model, PolicyConfig(max_nodes=24))


POLICY_CASES = [
    # (arch, seed, vocab, prompt length, block, new tokens, costs, proposer)
    (("qwen3", "llama")[i % 2], i % 3, (24, 32)[i % 2], 1 + (i * 5) % 9, (4, 8, 16)[i % 3], (9, 17, 24)[i % 3],
     ("flat", "steep", "nodraft")[i % 3], ("drafter", "oracle")[(i // 3) % 2])
    for i in range(12)
]


@pytest.mark.parametrize("arch,seed,vocab,plen,block,n,costs,kind", POLICY_CASES)
def test_cost_aware_policy_over_dflash2_equals_target_greedy(arch, seed, vocab, plen, block, n, costs, kind):
    """The cost-aware tree sizes DFlash2's own tree (and grafts lookup branches onto it): still AR's output."""
    model, prompt, ar, proposer, layer_ids = greedy_case(arch, seed, vocab, plen, block, n, kind)
    verifier = CheckedVerifier(model, layer_ids, check_cache=seed == 0)
    result = speculative_generate(verifier, proposer, prompt, n, policy=_policy(costs))
    assert result.output_ids == ar[:n]
    assert verifier.committed == prompt + result.output_ids[: sum(result.stats.acceptance_lengths)]
    if kind == "oracle" and costs == "flat":  # the selector's tree was verified and paid
        assert max(result.stats.tree_sizes) > 2 and max(result.stats.acceptance_lengths) >= 3


def test_the_policy_ranks_the_selector_tree_by_its_conditionals():
    """Over a DFlash2 draft the policy's drafter pool is build_dflash2_tree's tree, each node scored by q(token |
    its parent's token), and a verified tree of n nodes is its n most probable prefixes (the selector's chain
    first)."""
    model = cached_target("qwen3", seed=1, vocab=32)
    prompt = make_prompt(1, 5, 32)
    ar = reference_ar(model, prompt, 20)
    proposer = OracleSelectorProposer(prompt + ar, 6, 32, seed=4, noise=0.5)
    draft = proposer.propose(prompt[-1], torch.zeros(len(prompt), 2))
    policy = _policy("flat")
    pool, scores = policy._drafter_pool(prompt[-1], draft, 5)
    tree = build_dflash2_tree(prompt[-1], draft, policy.config.max_nodes, 5)
    assert pool.tokens == tree.tokens.tolist() and pool.parents == tree.parents.tolist()
    for i in range(1, tree.num_nodes):
        logq, tokens = conditional_rows(draft, int(tree.depths[i]), int(tree.tokens[tree.parents[i]]))
        assert scores[i] == pytest.approx(np.exp(logq[tokens.index(int(tree.tokens[i]))]), rel=1e-12)
    plan = policy.plan(prompt[-1], draft, np.asarray(prompt), 5)
    assert plan.drafted and plan.tree.num_nodes > 2
    chain = draft.chain(prompt[-1], 5).tokens[1:].tolist()
    node, first = 0, []
    while plan.tree.children[node] and len(first) < len(chain):
        node = min(plan.tree.children[node].values())
        first.append(int(plan.tree.tokens[node]))
    assert first == chain[: len(first)] and len(first) >= 2


def test_sampling_with_the_cost_aware_policy_preserves_target_distribution(small_target, small_drafter):
    """At T = 1 the policy's tree over DFlash2 is verified by the target's own draws (no sparse-q rejection):
    the committed tokens still follow the target's distribution."""
    params = lambda seed: SamplingParams(temperature=1.0, seed=seed)  # noqa: E731
    joint3 = exact_joint(small_target, params(0), length=3)
    runs = 1500
    counts3, verifier = _counts(small_target, small_drafter, params, 0, runs, seed0=71, policy=_policy("flat"))
    assert counts3.sum() == runs and not counts3[joint3 == 0].any()
    for counts, joint in ((counts3.sum(-1), joint3.sum(-1)), (counts3, joint3)):
        stat, df = chi_square(counts, joint)
        assert stat < chi2_threshold(df), f"chi2={stat:.1f} (df={df})"
    assert verifier.multi > runs // 20, verifier.multi
    assert verifier.off_chain > runs // 20, verifier.off_chain


def test_runpy_loads_and_decodes_a_zlab_layout_dflash2_dir(tmp_path, capsys):
    from example_cli import load_example
    from tiny_dirs import save_tiny_target_dir

    from tensorrt_llm_dflash.target import load_target

    target_dir = save_tiny_target_dir(tmp_path / "target", arch="qwen3", seed=4, layers=4, dtype=torch.float64)
    model, _ = load_target(target_dir, dtype=torch.float64)
    save_dflash2_drafter(tiny_dflash2_drafter(model, block_size=6, layers=2), tmp_path / "drafter",
                         dtype=torch.float32)
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    run = load_example("run")
    outputs = {}
    for name, extra in (("default", []), ("chain", ["--ddtree_budget", "0"]), ("tree", ["--ddtree_budget", "12"]),
                        ("ar", ["--speculative_decoding_mode", "none"])):
        out = tmp_path / f"{name}.json"
        argv = ["--target_model_dir", str(target_dir), "--dtype", "float64", "--max_output_len", "24",
                "--output_json", str(out), "--input_text", "abc abc ab", "hello there"]
        if name != "ar":
            argv += ["--draft_model_dir", str(tmp_path / "drafter")]
        assert run.main(argv + extra) == 0
        outputs[name] = json.loads(out.read_text())
    capsys.readouterr()
    ids = {name: [o["output_ids"] for o in doc["outputs"]] for name, doc in outputs.items()}
    assert ids["default"] == ids["chain"] == ids["tree"] == ids["ar"]
    assert outputs["default"]["mode"].startswith("cost-aware DFlash2 tree")  # the policy sizes the selector's tree
    assert run.main(["--target_model_dir", str(target_dir), "--draft_model_dir", str(tmp_path / "drafter"),
                     "--runtime", "graphed", "--max_output_len", "4"]) != 0
    assert "not DFlash2" in capsys.readouterr().err
