"""The graph-ready decode path (tensorrt_llm_dflash.graphed) on the CPU: the same stage functions a CUDA
graph replays, run eagerly.

* Exact: greedy output equals transformers' own greedy output in float64 and float32, on tiny Qwen3 and
  Llama targets, for AR, the chain, DDTree budgets on both sides of the power-of-two sizes, real random
  drafters and scripted ones that make long accepted paths (so compaction and the device walk are
  exercised), stop tokens inside an accepted run, and prompts that cross the capacity step.
* Sampling: chi-square against the target's exact joint at T > 0.
* No host sync: a whole decode step runs under NoHostSync; its only device-to-host copy is the one
  named copy per step; every step's tensors keep their fixed shapes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampling import PROMPT, VOCAB, chi2_threshold, chi_square, exact_joint
from tiny_models import hf_greedy, scripted_draft_logits, tiny_drafter, tiny_target

from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.device_policy import SizeChooser
from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.graphed import CAPACITY_STEP, CPU_WINDOW_STEP, SIZE_CHOICES, GraphedDecoder, tree_size
from tensorrt_llm_dflash.nosync import NoHostSync
from tensorrt_llm_dflash.proposer import DFlashProposer
from tensorrt_llm_dflash.sampling import SamplingParams
from tensorrt_llm_dflash.target import HFTargetVerifier


class ScriptedStaticProposer:
    """A device-side proposer that knows the target's continuation ``sequence`` (prompt + greedy output).

    Row k of a draft after ``context_len`` committed tokens predicts stream token ``context_len + 1 + k``:
    with probability ``1 - noise`` that token gets the top logit, otherwise a wrong token does and the truth
    is second (a DDTree of two nodes per depth still finds it). Everything is a gather from tables built
    once, so a draft reads nothing on the host.
    """

    def __init__(self, sequence: list[int], block_size: int, vocab: int, noise: float = 0.3, seed: int = 0,
                 length: int = 1024) -> None:
        self.block_size, self.vocab = block_size, vocab
        self.draft_ids = None
        self.target_layer_ids: list[int] = []
        gen = torch.Generator().manual_seed(seed)
        stream = torch.full((length + block_size,), -1, dtype=torch.long)
        stream[: len(sequence)] = torch.tensor(sequence)
        self.stream = stream
        self.base = torch.randn(length, block_size - 1, vocab, generator=gen, dtype=torch.float64)
        self.wrong = torch.rand(length, block_size - 1, generator=gen) < noise
        self.wrong_token = torch.randint(0, vocab, (length, block_size - 1), generator=gen)
        self.offsets = torch.arange(1, block_size)
        self.drafts = 0

    def static_proposer(self, model, capacity: int, batch: int) -> ScriptedStaticProposer:
        return self

    def extend(self, features, start, row=None) -> None:
        pass

    def draft(self, root: torch.Tensor, context_len: torch.Tensor, window: int | None = None) -> torch.Tensor:
        self.drafts += 1
        truth = self.stream[context_len[:, None] + self.offsets]  # [B, D], -1 past the known stream
        return scripted_draft_logits(self.base[context_len], self.wrong[context_len], self.wrong_token[context_len],
                                     truth, self.vocab)


def _targets():
    return [("qwen3", 0), ("llama", 1), ("qwen3", 2)]


@pytest.mark.parametrize("arch,seed", _targets())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ar_graph_path_equals_transformers_greedy(arch, seed, dtype):
    model = tiny_target(arch, seed=seed, dtype=dtype)
    prompt = [int(t) for t in np.random.default_rng(seed).integers(2, 64, 5 + seed)]
    reference = hf_greedy(model, prompt, 30)
    out = GraphedDecoder(model, None).generate(prompt, 30)
    assert out.output_ids == reference
    assert out.stats.acceptance_lengths == [1] * 29


@pytest.mark.parametrize("arch,seed", _targets())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("block_size,budget", [(2, 0), (4, 0), (9, 0), (4, 1), (4, 3), (8, 7), (8, 8),
                                                (16, 15), (16, 16), (16, 33)])
def test_scripted_drafts_equal_transformers_greedy(arch, seed, dtype, block_size, budget):
    """Long accepted paths through compaction and the device walk; wrong top-1s recovered by the tree."""
    model = tiny_target(arch, seed=seed, dtype=dtype)
    prompt = [int(t) for t in np.random.default_rng(seed + 7).integers(2, 64, 3 + 4 * seed)]
    n = 48
    reference = hf_greedy(model, prompt, n)
    proposer = ScriptedStaticProposer(prompt + reference, block_size, 64, noise=0.3, seed=seed)
    decoder = GraphedDecoder(model, proposer, budget=budget)
    out = decoder.generate(prompt, n)
    assert out.output_ids == reference
    lengths = out.stats.acceptance_lengths
    assert sum(lengths) == n - 1 and max(lengths) <= block_size  # no step verifies a node past the token budget
    deepest = block_size if budget == 0 else min(block_size, budget + 1)
    assert max(lengths) >= min(deepest, 4), lengths  # long paths were accepted
    assert decoder.nodes == tree_size(decoder.proposer, budget)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("budget", [0, 2, 5, 16])
def test_real_drafter_equals_transformers_greedy_and_the_eager_runtime(arch, budget):
    model = tiny_target(arch, seed=5)
    drafter = tiny_drafter(model, block_size=6, seed=3, layers=2)
    prompt = [5, 9, 13, 2, 7, 33, 21]
    reference = hf_greedy(model, prompt, 40)
    out = GraphedDecoder(model, drafter, budget=budget).generate(prompt, 40)
    assert out.output_ids == reference
    # The eager runtime with the same drafter accepts what the graph path accepts: same trees, same walk.
    eager = speculative_generate(HFTargetVerifier(model, drafter.config.target_layer_ids),
                                 DFlashProposer.for_target(drafter, model), prompt, 40, ddtree_budget=budget)
    assert eager.output_ids == reference
    assert eager.stats.acceptance_lengths == out.stats.acceptance_lengths


def test_static_drafter_matches_the_reference_drafter():
    """Draft logits of the static context cache equal the reference proposer's (float64, to rounding)."""
    from tensorrt_llm_dflash.static_state import StaticDrafter, StaticTarget

    model = tiny_target("qwen3", seed=1)
    drafter = tiny_drafter(model, block_size=5, seed=2, layers=2)
    prompt = [3, 8, 12, 40, 7, 9]
    static_target = StaticTarget(model, drafter.config.target_layer_ids, 64)
    _, features = static_target.prefill(torch.tensor([prompt]))
    eager_features = HFTargetVerifier(model, drafter.config.target_layer_ids).prefill(prompt)[1]
    torch.testing.assert_close(features[0], eager_features, rtol=0, atol=1e-12)
    static = StaticDrafter(drafter, model.get_input_embeddings(), model.get_output_embeddings(), 64)
    static.extend(features, torch.zeros(1, dtype=torch.long))
    reference = DFlashProposer.for_target(drafter, model)
    with torch.inference_mode():
        got = static.draft(torch.tensor([17]), torch.tensor([len(prompt)]))
    want = reference.propose(17, eager_features)
    torch.testing.assert_close(got[0], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("budget", [0, 6])
def test_a_stop_token_inside_an_accepted_run_ends_the_output_there(budget):
    model = tiny_target("qwen3", seed=3)
    prompt = [4, 9, 30, 2]
    free = hf_greedy(model, prompt, 40)
    stop = free[17]  # committed in the middle of a step (the scripted drafter accepts runs of several tokens)
    reference = hf_greedy(model, prompt, 40, eos_token_id=stop)
    proposer = ScriptedStaticProposer(prompt + free, 8, 64, noise=0.0)
    out = GraphedDecoder(model, proposer, budget=budget).generate(prompt, 40, stop_token_ids=[stop])
    assert out.output_ids == reference and out.finish_reason == "stop"
    assert out.output_ids[-1] == stop and stop not in out.output_ids[:-1]


def test_a_longer_request_grows_the_static_state():
    model = tiny_target("llama", seed=4, max_positions=1024)
    prompt = [int(t) for t in np.random.default_rng(4).integers(2, 64, CAPACITY_STEP - 10)]
    reference = hf_greedy(model, prompt, 24)
    decoder = GraphedDecoder(model, ScriptedStaticProposer(prompt + reference, 4, 64, length=2048), budget=3)
    assert decoder.capacity == CAPACITY_STEP
    assert decoder.generate(prompt, 24).output_ids == reference
    assert decoder.capacity == 2 * CAPACITY_STEP
    short = [7, 8, 9]
    assert decoder.generate(short, 10).output_ids == hf_greedy(model, short, 10)


# --------------------------------------------------------------------------------- host syncs


@pytest.mark.parametrize("budget", [0, 5])
@pytest.mark.parametrize("greedy", [True, False])
def test_a_decode_step_reads_nothing_on_the_host(budget, greedy):
    """A step (draft, tree build, verify, walk, compaction, context update) under NoHostSync: any read of a
    device value on the host, or any data-dependent shape, raises; every step's outputs keep their shapes."""
    model = tiny_target("qwen3", seed=6)
    drafter = tiny_drafter(model, block_size=6, seed=1, layers=1)
    decoder = GraphedDecoder(model, drafter, budget=budget)
    sampling = SamplingParams() if greedy else SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1)
    decoder.generate([3, 4, 5, 6], 8, sampling=sampling)  # sets the state up, and the sampling mode
    shapes = None
    for _ in range(4):
        decoder.max_depth.fill_(decoder.nodes - 1)
        with torch.inference_mode(), NoHostSync():
            live: dict[str, torch.Tensor] = {}
            for _, fn in decoder._stage_fns():
                live.update(fn(live))
        step_shapes = {k: tuple(v.shape) for k, v in live.items()}
        assert shapes is None or step_shapes == shapes
        shapes = step_shapes
        assert tuple(decoder.out.shape) == (1, 2 + decoder.path_width)  # count, tokens, lookup count
    assert shapes["tokens"] == (1, decoder.nodes)


def test_nohostsync_catches_the_decoders_own_copy():
    """The guard is live around the step: the loop's one copy (``.tolist()``) raises inside it, unless named."""
    model = tiny_target("llama", seed=2)
    decoder = GraphedDecoder(model, None)
    decoder.generate([1, 2, 3], 4)
    with torch.inference_mode(), pytest.raises(RuntimeError), NoHostSync():
        decoder.launch()[0].tolist()
    with torch.inference_mode(), NoHostSync() as guard:
        out = decoder.launch()
        with guard.allow("the step's tokens"):
            out[0].tolist()


# --------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("budget,temperature,top_k,top_p,runs", [(0, 1.0, 0, 1.0, 1500), (4, 1.0, 0, 1.0, 1500),
                                                                 (3, 1.3, 4, 0.8, 1500), (None, 1.0, 0, 1.0, 1500)])
def test_sampling_preserves_the_target_distribution(budget, temperature, top_k, top_p, runs):
    target = tiny_target("qwen3", seed=3, vocab=VOCAB, layers=2, hidden=16, init_std=0.3)
    drafter = tiny_drafter(target, block_size=3, seed=5)

    def params(seed):
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

    joint = exact_joint(target, params(0), length=2)
    # The cost-aware tree (budget None) gets a flat cost curve: with costs timed on the machine it may find that no
    # tree pays for this tiny target and decode AR, and the check that drafts were accepted would depend on the CPU.
    decoder = GraphedDecoder(target, drafter, budget=budget,
                             policy_costs=(lambda bucket, size: 1.0 + 0.001 * bucket * size) if budget is None else None)
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    multi = 0
    for r in range(runs):
        # Three tokens, the first two counted: a step's drafts + bonus stay within the budget, so the step after the
        # prefill can accept a draft only with a third token to make (the first two's distribution is the same).
        out = decoder.generate(PROMPT, 3, sampling=params(10_000 * (budget + 1 if budget is not None else 9) + r))
        counts[tuple(out.output_ids[:2])] += 1
        multi += out.stats.acceptance_lengths[0] > 1
    assert not counts[joint == 0].any()
    stat, df = chi_square(counts, joint)
    assert stat < chi2_threshold(df), f"chi2={stat:.1f} (df={df})"
    assert multi > runs // 20, multi  # drafts were accepted
    # The test can fail: the same counts against a distribution with its first token shifted.
    wrong = np.roll(joint, 1, axis=0)
    wrong = 0.999 * wrong + 0.001 / wrong.size
    assert chi_square(counts, wrong / wrong.sum())[0] > 5 * chi2_threshold(df)


# --------------------------------------------------------------------------------- the cost-aware policy


@pytest.mark.parametrize("arch,seed", _targets())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("size_choice", [*SIZE_CHOICES, "in_step+stash"])
def test_the_device_policy_equals_transformers_greedy_and_changes_size(arch, seed, dtype, size_choice):
    model = tiny_target(arch, seed=seed, dtype=dtype)
    prompt = [int(t) for t in np.random.default_rng(seed + 11).integers(2, 64, 4 + 3 * seed)]
    n = 60
    reference = hf_greedy(model, prompt, n)
    proposer = ScriptedStaticProposer(prompt + reference, 8, 64, noise=0.3, seed=seed)
    # A steep cost curve: big trees pay only when the calibrated values say they will be accepted.
    decoder = GraphedDecoder(model, proposer, budget=None, policy_buckets=(2, 4, 8, 16),
                             policy_costs=[1.0, 1.2, 1.6, 2.6], size_choice=size_choice.partition("+")[0])
    decoder.stash_candidates = size_choice.endswith("+stash")  # what CUDA graphs do: candidates in static buffers
    out = decoder.generate(prompt, n)
    assert out.output_ids == reference
    assert len(set(out.stats.tree_sizes)) >= 2, out.stats.tree_sizes  # the size follows the estimates
    assert set(out.stats.tree_sizes) <= {2, 4, 8, 16}
    assert decoder.policy.trials.sum() > 0 and not torch.equal(decoder.policy.table, decoder.policy.prior)


@pytest.mark.parametrize("size_choice", SIZE_CHOICES)
def test_the_size_comes_from_the_right_step_estimates(monkeypatch, size_choice):
    """``ahead`` picks each step's size from the estimates the previous step copied back; ``in_step`` from the
    step's own (the copy after it holds them): the chosen size is the most expected tokens per cost among the
    drafted sizes (delivery shares held at 1 here, so the choice is the estimates' alone)."""
    monkeypatch.setattr(SizeChooser, "share", lambda self, size: 1.0)
    model = tiny_target("qwen3", seed=4, dtype=torch.float64)
    prompt = [int(t) for t in np.random.default_rng(4).integers(2, 64, 12)]
    reference = hf_greedy(model, prompt, 50)
    proposer = ScriptedStaticProposer(prompt + reference, 8, 64, noise=0.7, seed=4)
    costs = [1.0, 1.5, 2.5, 4.5]  # steep: the best size moves from step to step
    decoder = GraphedDecoder(model, proposer, budget=None, policy_buckets=(2, 4, 8, 16), policy_costs=costs,
                             size_choice=size_choice)

    def best(expected):
        return max(zip((2, 4, 8, 16), expected, costs), key=lambda t: t[1] / t[2])[0]

    row = 0
    decoder.admit(row, prompt, 50)
    previous, chosen, want, moved = None, [], [], 0
    while decoder.requests[row].remaining > 0:
        size = decoder.step()[row].tree_size
        now = decoder.requests[row].expected
        if previous is not None and size > 1:
            chosen.append(size)
            want.append(best(now if size_choice == "in_step" else previous))
            moved += best(now) != best(previous)  # steps where the two rules disagree: the test tells them apart
        previous = now
    decoder.release(row)
    assert len(chosen) >= 10 and len(set(chosen)) >= 2 and moved >= 3, (chosen, moved)
    assert chosen == want


def test_size_choice_is_checked():
    model = tiny_target("llama", seed=1)
    with pytest.raises(DFlashInputError, match="size_choice must be one of"):
        GraphedDecoder(model, None, size_choice="later")
    assert GraphedDecoder(model, None).size_choice == "in_step"  # on the CPU


def test_the_device_policy_with_a_real_drafter_and_measured_costs():
    model = tiny_target("qwen3", seed=8)
    drafter = tiny_drafter(model, block_size=6, seed=4, layers=2)
    prompt = [9, 4, 22, 17, 3]
    decoder = GraphedDecoder(model, drafter, budget=None, policy_buckets=(2, 4, 8))
    out = decoder.generate(prompt, 30)
    assert out.output_ids == hf_greedy(model, prompt, 30)
    costs = decoder.policy.costs.tolist()
    assert len(costs) == 3 and all(c > 0 for c in costs)  # measured after start-up, one per size


def test_the_policy_step_reads_nothing_on_the_host():
    model = tiny_target("llama", seed=9)
    drafter = tiny_drafter(model, block_size=5, seed=2, layers=1)
    decoder = GraphedDecoder(model, drafter, budget=None, policy_buckets=(2, 4, 8), policy_costs=[1.0, 1.1, 1.3])
    decoder.generate([5, 6, 7], 6)
    for size in (2, 4, 8):
        decoder.nodes = size
        decoder.max_depth.fill_(4)
        with torch.inference_mode(), NoHostSync():
            live: dict[str, torch.Tensor] = {}
            for _, fn in decoder._stage_fns():
                live.update(fn(live))
        assert live["tokens"].shape == (1, size) and live["expected"].shape == (1, 3)
        assert live["ngram"].shape == (1,) and live["on_branch"].shape == (1, size)  # lookup ran inside the step


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lookup_branches_join_the_device_tree(dtype):
    """A drafter that knows nothing (random logits) and a repetitive context: with lookup branches the device
    policy commits tokens only a branch proposed and needs fewer steps; the output is the target's either way,
    and the history the branches search is the prompt and the output."""
    totals = {True: [0, 0], False: [0, 0]}
    for arch, seed in [("qwen3", 0), ("qwen3", 2), ("llama", 0), ("llama", 1)]:
        model = tiny_target(arch, seed=seed, dtype=dtype)
        prompt = [int(t) for t in np.random.default_rng(seed).integers(2, 64, 6)]
        reference = hf_greedy(model, prompt, 80)
        prompt, reference = prompt + reference[:40], reference[40:]  # tiny random targets repeat themselves
        for lookup in (True, False):
            proposer = ScriptedStaticProposer(prompt, 6, 64, seed=seed)  # knows only the prompt: random drafts
            decoder = GraphedDecoder(model, proposer, budget=None, policy_buckets=(2, 4, 8, 16),
                                     policy_costs=[1.0, 1.05, 1.1, 1.2], lookup=lookup)
            out = decoder.generate(prompt, 40)
            assert out.output_ids == reference
            assert decoder.history[0, : len(prompt) + 40].tolist() == prompt + reference
            totals[lookup][0] += out.stats.lookup_tokens
            totals[lookup][1] += out.stats.steps
    assert totals[False][0] == 0 and totals[True][0] >= 10
    assert totals[True][1] < totals[False][1]


def test_selection_keeps_a_tree_and_ranks_by_value():
    """The policy's verify set is prefix-closed and holds the best nodes by calibrated path value."""
    from tensorrt_llm_dflash.device_lookup import Grafted
    from tensorrt_llm_dflash.device_policy import DevicePolicy
    from tensorrt_llm_dflash.device_tree import build_ddtree_device, to_draft_tree

    rng = np.random.default_rng(0)
    policy = DevicePolicy(6, (2, 4, 8, 16, 32), torch.device("cpu"))
    policy.table.copy_(torch.rand(policy.table.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    for _ in range(30):
        lp = np.log(rng.dirichlet(np.full(12, 0.4), size=6))
        lp = -np.sort(-lp, axis=1)
        pool = build_ddtree_device(torch.tensor([3]), torch.tensor(lp)[None],
                                   torch.tensor(rng.choice(1000, (6, 12)))[None], 31)
        candidates = Grafted(pool, policy.draft_conditional(pool), torch.zeros_like(pool.valid))
        values = policy.path_values(candidates, 6)
        size = int(rng.choice([2, 4, 8, 16]))
        tree = policy.select(candidates, values, size).tree
        host = to_draft_tree(tree)
        assert all(p < i for i, p in enumerate(host.parents.tolist()[1:], start=1))
        chosen = sorted(values[0, 1:].tolist(), reverse=True)[: size - 1]
        kept = values[0].gather(0, torch.tensor([0] + [int(i) for i in torch.sort(
            torch.sort(-values, dim=1, stable=True).indices[:, :size], dim=1).values[0, 1:]]))
        assert sorted(kept[1:].tolist(), reverse=True) == chosen
        vals = values[0].tolist()
        parents = pool.parents[0].tolist()
        assert all(vals[i] <= vals[parents[i]] for i in range(1, len(vals)) if parents[i] >= 0)


# --------------------------------------------------------------------------------- issue 35: capacity, re-capture


def _policy_tables(decoder: GraphedDecoder) -> dict[str, torch.Tensor]:
    policy = decoder.policy
    return {name: getattr(policy, name).clone() for name in
            ("hits", "trials", "table", "lookup_hits", "lookup_trials", "lookup_table")}


def _assert_tables_equal(decoder: GraphedDecoder, tables: dict[str, torch.Tensor]) -> None:
    for name, before in tables.items():
        assert torch.equal(getattr(decoder.policy, name), before), name


@pytest.mark.parametrize("block_size,budget", [(8, 3), (16, 1), (8, None), (12, 2)])
def test_kv_compaction_never_writes_past_the_cache(block_size, budget):
    """Compaction writes ``past + arange(block)``: the cache must hold a block after the last step's ``past``, not
    only a tree (issue 35: block 8, DDTree 3, a 200-token prompt and 51 new tokens wrote slot 256 of 256)."""
    model = tiny_target("qwen3", seed=1, max_positions=1024)
    prompt = [int(t) for t in np.random.default_rng(0).integers(2, 64, 200)]
    reference = hf_greedy(model, prompt, 51)
    proposer = ScriptedStaticProposer(prompt + reference, block_size, 64, noise=0.3, seed=1)
    costs = [1.0, 1.1] if budget is None else None
    decoder = GraphedDecoder(model, proposer, budget=budget, policy_buckets=(2, 4), policy_costs=costs)
    assert max(decoder.sizes()) < block_size  # the tree is smaller than the compacted width
    out = decoder.generate(prompt, 51)
    assert out.output_ids == reference
    assert decoder.capacity >= len(prompt) + 51 + block_size - 2  # the deepest write of the last possible step


def test_warm_up_steps_start_from_an_empty_state_and_teach_nothing():
    """The CUDA capture's eager warm-up (run here eagerly), after a request that ended near the end of the cache:
    its steps start from an empty state, leave one behind, and leave the learned policy as it was (they verify
    trees of stale state: labels from them would be garbage)."""
    model = tiny_target("llama", seed=3, max_positions=1024)
    prompt = [int(t) for t in np.random.default_rng(3).integers(2, 64, 400)]
    n = 104
    reference = hf_greedy(model, prompt, n)
    proposer = ScriptedStaticProposer(prompt + reference, 8, 64, noise=0.2, seed=3)
    # A capture's warm-up is CUDA's path, where the size is chosen ahead (this prompt then ends at the cache's end).
    decoder = GraphedDecoder(model, proposer, budget=None, policy_buckets=(2, 4, 8), policy_costs=[1.0, 1.1, 1.2],
                             size_choice="ahead")
    assert decoder.generate(prompt, n).output_ids == reference
    # The request ended as deep into the cache as one can: its reserve leaves one step's span past its last slot.
    assert decoder.capacity - decoder.last_past == decoder.span + 1
    tables = _policy_tables(decoder)
    assert not torch.equal(tables["table"], decoder.policy.prior)  # it learned something worth keeping
    for size in decoder.sizes():
        decoder.nodes = size
        decoder._warm_up()
        assert int(decoder.past[0]) == 0
    _assert_tables_equal(decoder, tables)
    assert decoder.generate(prompt, n).output_ids == reference


@pytest.mark.parametrize("how", ["temperature", "capacity"])
def test_a_recapture_leaves_the_policy_tables_unchanged(how):
    """Re-preparing for a new sampling setting (new graphs, new cost curve) or a larger capacity (new static state)
    runs throwaway steps: they must not feed their trees to the policy, and a larger state keeps what it learned."""
    model = tiny_target("qwen3", seed=2, max_positions=1024)
    prompt = [int(t) for t in np.random.default_rng(2).integers(2, 64, 12)]
    reference = hf_greedy(model, prompt, 40)
    proposer = ScriptedStaticProposer(prompt + reference, 8, 64, noise=0.3, seed=2, length=2048)
    decoder = GraphedDecoder(model, proposer, budget=None, policy_buckets=(2, 4, 8))
    assert decoder.generate(prompt, 40).output_ids == reference
    tables = _policy_tables(decoder)
    assert not torch.equal(tables["table"], decoder.policy.prior)
    if how == "temperature":
        decoder.sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    else:
        decoder._grow(4 * CAPACITY_STEP)
    decoder.prepare()
    _assert_tables_equal(decoder, tables)


def test_step_costs_are_timed_per_sampling_setting(monkeypatch):
    """A sampled verify sorts the vocabulary at every node: the cost curve of T > 0 is timed under T > 0, once per
    setting (greedy, or sampled with the same top-k/top-p), and each request uses its own setting's curve."""
    model = tiny_target("llama", seed=5)
    drafter = tiny_drafter(model, block_size=6, seed=1, layers=1)
    decoder = GraphedDecoder(model, drafter, budget=None, policy_buckets=(2, 4, 8))
    timed: list[tuple[int, bool]] = []

    def fake_time_step(bucket: int, size: int, repeats: int = 5) -> float:
        timed.append((size, decoder.kind == "greedy"))
        return size * (2e-3 if decoder.kind != "greedy" else 1e-3)

    monkeypatch.setattr(decoder, "_time_step", fake_time_step)
    monkeypatch.setattr(decoder, "_observe_cost", lambda bucket, seconds: None)  # the curves stay as timed
    prompt = [4, 8, 15, 16, 23]
    decoder.generate(prompt, 8)
    assert timed == [(2, True), (4, True), (8, True)]
    assert decoder.policy.costs.tolist() == [2e-3, 4e-3, 8e-3]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    decoder.generate(prompt, 8, sampling=sampled)
    assert timed[3:] == [(2, False), (4, False), (8, False)]
    assert decoder.policy.costs.tolist() == [4e-3, 8e-3, 16e-3]
    decoder.generate(prompt, 8, sampling=SamplingParams(temperature=1.3, top_p=0.9, seed=4))  # same cost class
    decoder.generate(prompt, 8)
    assert len(timed) == 6  # nothing re-timed
    assert decoder.policy.costs.tolist() == [2e-3, 4e-3, 8e-3]


def test_measured_costs_follow_the_steps_and_given_costs_stay(monkeypatch):
    """A start-up curve timed on a busy machine (here: seconds a step, for a tiny model that takes milliseconds) moves
    toward the wall times of the steps that ran, size by size, and only those; a curve that falls with the size is
    kept as timed (a CPU's few-row GEMMs can make a small tree dearer than a bigger one); given costs never change."""
    model = tiny_target("llama", seed=5)
    drafter = tiny_drafter(model, block_size=6, seed=1, layers=1)
    decoder = GraphedDecoder(model, drafter, budget=None, policy_buckets=(1, 2, 4, 8))
    slow = {1: 1.0, 2: 3.0, 4: 1.0, 8: 2.0}
    monkeypatch.setattr(decoder, "_time_step", lambda bucket, size, repeats=5: slow[size])
    prompt = [4, 8, 15, 16, 23]
    decoder.prepare()
    assert decoder.step_costs() == [1.0, 3.0, 1.0, 2.0]
    out = decoder.generate(prompt, 30)
    assert out.output_ids == hf_greedy(model, prompt, 30)
    used = set(out.stats.tree_sizes)
    assert 1 <= len(used) < 4, used  # some sizes ran, some did not: both sides of the rule are seen
    for size, cost, timed in zip(decoder.sizes(), decoder.step_costs(), [1.0, 3.0, 1.0, 2.0]):
        assert (cost < timed) == (size in used) and cost > 0, (size, cost, used)  # only the sizes that ran moved
    given = GraphedDecoder(model, drafter, budget=None, policy_buckets=(1, 2, 4, 8), policy_costs=[1.0, 3.0, 1.0, 2.0])
    given.generate(prompt, 30)
    assert given.step_costs() == [1.0, 3.0, 1.0, 2.0]


def test_timing_keeps_the_fastest_repeat(monkeypatch):
    """Steps of 9 s (the warm-up), then 0.5, 0.2 and 3 s: other work on the machine only adds time, so 0.2 s."""
    import tensorrt_llm_dflash.graphed as graphed

    decoder = GraphedDecoder(tiny_target("llama", seed=5), None)
    clock = [0.0]
    durations = iter([9.0, 0.5, 0.2, 3.0])

    def step(stage_seconds) -> None:
        clock[0] += next(durations)

    monkeypatch.setattr(decoder, "_run_step", step)
    monkeypatch.setattr(graphed.time, "perf_counter", lambda: clock[0])
    assert decoder._time_step(1, 1, repeats=3) == pytest.approx(0.2)


def test_prepare_captures_every_window_a_row_can_reach(monkeypatch):
    """prepare() captures each size at every attention window up to the capacity, so no request pays a capture: on the
    H100 the windows first reached inside a request cost 0.1-0.5 s each there (benchmarks/gpu_h100, issue 35)."""
    model = tiny_target("qwen3", seed=4, max_positions=2048)
    drafter = tiny_drafter(model, block_size=6, seed=2, layers=1)
    decoder = GraphedDecoder(model, drafter, budget=None, policy_buckets=(2, 4), capacity=4 * CAPACITY_STEP)
    captured: list[tuple] = []
    decoder.use_graphs = True  # the capture itself needs CUDA: record the shapes it is asked for instead
    decoder.exact_windows = False
    monkeypatch.setattr(decoder, "_capture", lambda: captured.append(decoder._key()) or object())
    monkeypatch.setattr(decoder, "_time_step", lambda bucket, size, repeats=5: 1e-3)
    decoder.prepare()
    windows = {key[2] for key in captured}
    assert windows == {CAPACITY_STEP, 2 * CAPACITY_STEP, 4 * CAPACITY_STEP}
    assert {key[1] for key in captured} == set(decoder.sizes()) and len(captured) == 3 * len(decoder.sizes())
    for past in range(decoder.capacity - decoder.span + 1):  # every step a row of this capacity can take
        assert decoder.window_for(past + decoder.span) in windows, past


def test_a_request_prepares_every_window_it_passes_through(monkeypatch):
    """generate() captures, before its prefill, each window its row will reach as it grows: a prompt that starts in
    the first window and ends in the second steps only through shapes prepared before the first step."""
    model = tiny_target("llama", seed=5, max_positions=2048)
    drafter = tiny_drafter(model, block_size=6, seed=1, layers=1)
    decoder = GraphedDecoder(model, drafter, budget=3, capacity=2 * CAPACITY_STEP)
    decoder.exact_windows = False  # the windows of graphs (a CPU's own follow each step's need)
    prepared: set[int] = set()
    stepped: list[int] = []
    real_prepare, real_run_step = decoder.prepare, decoder._run_step

    def prepare(*args, **kwargs):
        prepared.update(kwargs.get("windows") or [w for w in [kwargs.get("window")] if w])
        return real_prepare(*args, **kwargs)

    def run_step(stage_seconds):
        if decoder.requests:  # a request's step, not a throwaway timing one
            stepped.append(decoder.window)
        return real_run_step(stage_seconds)

    monkeypatch.setattr(decoder, "prepare", prepare)
    monkeypatch.setattr(decoder, "_run_step", run_step)
    prompt = [int(t) for t in np.random.default_rng(5).integers(2, 64, CAPACITY_STEP - 20)]
    out = decoder.generate(prompt, 40)
    assert out.output_ids == hf_greedy(model, prompt, 40)
    assert set(stepped) == {CAPACITY_STEP, 2 * CAPACITY_STEP}  # the row crossed into the second window
    assert set(stepped) <= prepared


@pytest.mark.parametrize("budget", [None, 3])
def test_prepare_after_a_generate_that_grew_the_capacity(budget):
    """generate() allocates a larger state under inference mode; prepare() (for a new sampling setting) must still
    work outside inference mode, and the next request too."""
    model = tiny_target("qwen3", seed=4, max_positions=1024)
    drafter = tiny_drafter(model, block_size=6, seed=2, layers=1)
    decoder = GraphedDecoder(model, drafter, budget=budget, policy_buckets=(2, 4))
    prompt = [int(t) for t in np.random.default_rng(4).integers(2, 64, CAPACITY_STEP)]
    decoder.generate(prompt, 6)
    assert decoder.capacity > CAPACITY_STEP and torch.is_inference(decoder.history)  # grown under inference mode
    decoder.sampling = SamplingParams(temperature=0.8, seed=1)
    decoder.prepare()
    short = [5, 6, 7]
    assert decoder.generate(short, 10).output_ids == hf_greedy(model, short, 10)


@pytest.mark.parametrize("budget,drafted", [(0, False), (0, True), (4, True), (None, True)])
def test_every_stage_launches_work(budget, drafted):
    """Each stage function is one CUDA graph: a stage that dispatches no op is an empty graph (a warning on every
    capture), so AR has no draft stage."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    model = tiny_target("qwen3", seed=6)
    drafter = tiny_drafter(model, block_size=5, seed=1, layers=1) if drafted else None
    decoder = GraphedDecoder(model, drafter, budget=budget, policy_buckets=(2, 4), policy_costs=[1.0, 1.1])
    decoder.generate([3, 4, 5, 6], 4)
    names = [name for name, _ in decoder._stage_fns()]
    # The cost-aware tree with its size chosen in the step (the CPU's default) splits the tree stage in two.
    split = ["tree_compile"] if budget is None else []
    assert names == ["draft", "tree_build", *split, "verify", "commit"][0 if drafted else 1:]
    live: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for name, fn in decoder._stage_fns():
            Count.ops = 0
            with Count():
                live.update(fn(live))
            assert Count.ops > 0, name


def test_on_a_cpu_each_step_attends_over_what_its_own_size_writes(monkeypatch):
    """Every row reads its K/V over the whole window, so a CPU step's window is its longest row's need rounded to
    ``CPU_WINDOW_STEP`` slots, for the size this step runs: an AR step of the cost-aware tree reads what plain AR's
    does, a drafted one its tree and the drafter's block more (a 16-row AR step of SmolLM2 on the 2-core EPYC cost
    107 ms at 256 slots and 118-135 at 512)."""
    model = tiny_target("llama", seed=2, max_positions=2048)
    drafter = tiny_drafter(model, block_size=6, seed=1, layers=1)
    prompt = [int(t) for t in np.random.default_rng(2).integers(2, 64, 190)]
    plain = GraphedDecoder(model, None, budget=0, capacity=4 * CAPACITY_STEP)
    policy = GraphedDecoder(model, drafter, budget=None, policy_buckets=(1, 2, 4, 8), capacity=4 * CAPACITY_STEP,
                            policy_costs=[1.0, 1.5, 2.0, 3.0], size_choice="ahead")
    for decoder in (plain, policy):
        decoder.admit(0, prompt, 40)
    plain._plan([0])
    assert plain.window == 192 and CPU_WINDOW_STEP == 64  # 190 committed + the root's write
    for size, window in ((1, 192), (4, 256), (8, 256)):  # past 190: + 1, + 6 (the block), + 8 (the tree)
        monkeypatch.setattr(policy.chooser, "choose", lambda *args, size=size: size)
        policy._plan([0])
        assert (policy.nodes, policy.window) == (size, window)
        assert policy.window >= 190 + policy.writes(size)
    out = policy.step()[0]
    assert out.tree_size == 8 and out.tokens == hf_greedy(model, prompt, 40)[1 : 1 + len(out.tokens)]


def test_an_exception_inside_generate_or_generate_many_leaves_no_row_in_flight():
    """A callback that raises on the prefill's token, or Ctrl-C in the middle of generate_many: the rows are released,
    so the next call decodes (they once stayed "in flight" and every later call was refused). Bad prompts are refused
    by name before any row is taken."""
    model = tiny_target("qwen3", seed=5)
    drafter = tiny_drafter(model, block_size=4, seed=3, layers=2)
    decoder = GraphedDecoder(model, drafter, budget=2, batch=2)
    prompt = [5, 9, 13, 2, 7]
    reference = hf_greedy(model, prompt, 12)

    def refuse(tokens):
        raise RuntimeError("the caller's callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        decoder.generate(prompt, 12, on_tokens=refuse)
    assert not decoder.requests
    calls = []
    real_step = decoder.step

    def interrupted_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    decoder.step = interrupted_step
    with pytest.raises(KeyboardInterrupt):
        decoder.generate_many([prompt, prompt[::-1]], 12)
    del decoder.step
    assert not decoder.requests
    assert decoder.generate(prompt, 12).output_ids == reference
    assert [r.output_ids for r in decoder.generate_many([prompt, prompt], 12)] == [reference, reference]
    for bad, says in (("def f(", "got text"), ([1.0, 2.0], "1.0 is not a token id"), (torch.zeros(2, 2, 2).long(),
                                                                                    "3-d array")):
        with pytest.raises(DFlashInputError, match=says):
            decoder.generate(bad, 4)
    with pytest.raises(DFlashInputError, match="give a list of prompts"):
        decoder.generate_many(prompt, 4)
    with pytest.raises(DFlashInputError, match="max_new_tokens=2.5 must be an integer"):
        decoder.generate(prompt, 2.5)
    assert not decoder.requests
