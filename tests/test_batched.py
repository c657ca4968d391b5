"""Batch > 1 in the graph-ready runtime (tensorrt_llm_dflash.graphed): rows of one decoder, on the CPU.

* Exact per request (float64, tiny Qwen3 and Llama targets): every row's greedy output equals that prompt's own
  greedy output from transformers, whatever the other rows do: rows of different lengths, admitted mid-run,
  released early, beside sampled rows, in AR, the chain, DDTree budgets and the cost-aware tree, with real random
  drafters and scripted ones that make long accepted paths (compaction of several rows at once).
* Undisturbed: under a fixed tree a row's steps (tokens, acceptance per step) are those of its solo run, at T = 0
  and at T > 0 (its draws are keyed by its own seed), whatever its companions; throwaway steps (capture
  warm-up, cost timing) and a capacity growth in the middle of a batch change no row.
* Sampling: chi-square per row against that row's own exact joint, four rows with four sampling settings in
  one batch, two of them admitted mid-run.
* No host sync: a whole batched step (planning, the keyed draws, the stages) under NoHostSync, one named copy per step.
* The cost-aware tree at batch B, from injected cost curves (no timing): it verifies trees where the batch's own
  curve makes them pay and falls back to AR where it does not; step costs are measured per batch bucket.
* The drafter's context deferred on a CPU (AR steps' and prompts'): every draft reads what extending it at once
  gives; a row released before it drafts never pays for its prompt's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampling import VOCAB, chi2_threshold, chi_square
from tiny_models import full_forward, hf_greedy, scripted_draft_logits, tiny_drafter, tiny_target

from tensorrt_llm_dflash import graphed
from tensorrt_llm_dflash.device_policy import SizeChooser
from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.graphed import GraphedDecoder, batch_buckets, row_probs, sampling_kind
from tensorrt_llm_dflash.nosync import NoHostSync
from tensorrt_llm_dflash.sampling import SamplingParams, TokenDraws, make_draws, processed_probs


class ScriptedRows:
    """A device-side proposer that knows each row's continuation: row r of a draft after ``context_len`` committed
    tokens predicts that row's stream token ``context_len + 1 + k``, right with probability ``1 - noise`` (else a
    decoy takes the top logit and the truth is second). ``streams[r]`` is set by the test when it admits a prompt
    into row r; ``move_row`` follows the decoder's row moves."""

    def __init__(self, rows: int, block_size: int, vocab: int, noise: float = 0.3, seed: int = 0,
                 length: int = 512) -> None:
        self.block_size, self.vocab = block_size, vocab
        self.draft_ids = None
        self.target_layer_ids: list[int] = []
        gen = torch.Generator().manual_seed(seed)
        self.streams = torch.full((rows, length + block_size), -1, dtype=torch.long)
        self.base = torch.randn(length, block_size - 1, vocab, generator=gen, dtype=torch.float64)
        self.wrong = torch.rand(length, block_size - 1, generator=gen) < noise
        self.decoys = torch.randint(0, vocab, (length, block_size - 1), generator=gen)
        self.offsets = torch.arange(1, block_size)

    def static_proposer(self, model, capacity: int, batch: int) -> ScriptedRows:
        return self

    def set_stream(self, row: int, tokens: list[int]) -> None:
        self.streams[row] = -1
        self.streams[row, : len(tokens)] = torch.tensor(tokens)

    def move_row(self, src: int, dst: int, used: int) -> None:
        self.streams[dst] = self.streams[src]

    def extend(self, features, start, row=None) -> None:
        pass

    def draft(self, root: torch.Tensor, context_len: torch.Tensor, window: int | None = None) -> torch.Tensor:
        b = root.shape[0]
        truth = self.streams[:b].gather(1, context_len[:, None] + self.offsets)  # [b, D], -1 past the known stream
        return scripted_draft_logits(self.base[context_len], self.wrong[context_len], self.decoys[context_len], truth,
                                     self.vocab)


def prompts_of(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(2, 64, n)] for n in lengths]


class Schedule:
    """Requests driven through a decoder as a server would: request i is admitted at step ``admit_at[i]`` into the
    lowest free row (when one is free; else it waits), released when it has its tokens (or at ``cut_at[i]``)."""

    def __init__(self, decoder: GraphedDecoder, prompts: list[list[int]], lengths: list[int],
                 sampling: list[SamplingParams] | None = None, admit_at: list[int] | None = None,
                 cut_at: dict[int, int] | None = None, on_admit=None) -> None:
        self.decoder, self.prompts, self.lengths = decoder, prompts, lengths
        self.sampling = sampling or [SamplingParams()] * len(prompts)
        self.admit_at = admit_at or [0] * len(prompts)
        self.cut_at = cut_at or {}
        self.on_admit = on_admit
        self.tokens: dict[int, list[int]] = {}
        self.steps: dict[int, list[tuple[int, int]]] = {}  # request -> (tree size, count) per step
        self.buckets: list[int] = []

    def run(self, max_steps: int = 400) -> Schedule:
        decoder, row_of = self.decoder, {}
        waiting = list(range(len(self.prompts)))
        for step in range(max_steps):
            for i in list(waiting):
                free = [r for r in range(decoder.batch) if r not in decoder.requests]
                if self.admit_at[i] <= step and free:
                    waiting.remove(i)
                    row_of[free[0]] = i
                    if self.on_admit is not None:
                        self.on_admit(free[0], i)
                    params = self.sampling[i]
                    self.tokens[i] = [decoder.admit(free[0], self.prompts[i], self.lengths[i], params,
                                                    make_draws(params))]
                    self.steps[i] = []
            for row, i in list(row_of.items()):
                if self.cut_at.get(i) == step:
                    decoder.release(row)
                    del row_of[row]
            if not row_of and not waiting:
                return self
            results = decoder.step()  # a server never drains (serve/runner.py says why)
            if results:
                self.buckets.append(decoder.bucket)
            for row, result in results.items():
                i = row_of[row]
                self.tokens[i] += result.tokens
                self.steps[i].append((result.tree_size, len(result.tokens)))
            for row, i in list(row_of.items()):
                if len(self.tokens[i]) >= self.lengths[i]:
                    decoder.release(row)
                    del row_of[row]
        raise AssertionError("the schedule did not finish")

    def output(self, i: int) -> list[int]:
        return self.tokens[i][: self.lengths[i]]


def record_choices(monkeypatch) -> list[tuple[int, list[int] | None]]:
    """Every ``SizeChooser.choose`` call from now on, as (rows, remaining tokens handed over or None)."""
    calls: list[tuple[int, list[int] | None]] = []
    choose = SizeChooser.choose

    def recording(self, expected, costs, remaining=None, credit=None):
        calls.append((len(expected), None if remaining is None else list(remaining)))
        return choose(self, expected, costs, remaining, credit)

    monkeypatch.setattr(SizeChooser, "choose", recording)
    return calls


def cpu_like_costs(bucket: int, size: int) -> float:
    """A curve where a step of one or two rows is almost all fixed overhead but more rows pay for every token, and
    for the draft (as on a CPU): trees pay at batch 1 and 2 (even a random drafter's: a tree costs about what its
    root does), no tree pays at batch 4 or more."""
    if bucket <= 2:
        return 0.3 + 0.001 * bucket * size
    return bucket * (size + (1.0 if size > 1 else 0.0))


def flat_costs(bucket: int, size: int) -> float:
    """A curve that is flat to 64 nodes (as on a GPU): big trees pay at every batch."""
    return 1.0 + 0.001 * bucket * size


# --------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("arch,seed", [("qwen3", 0), ("llama", 1)])
@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree:5", "auto", "auto-ahead", "auto-stash"])
def test_every_row_equals_its_own_greedy_output(arch, seed, mode):
    """Six requests of different lengths through four rows of one decoder (a real random drafter): two start
    together, the rest join mid-run as rows free up, one is abandoned early, two sample beside the greedy ones;
    every greedy row equals transformers' greedy output for its prompt. The cost-aware tree three ways: its size
    chosen in the step (the CPU's default), ahead (CUDA's), in the step through the static candidate buffers that
    CUDA graphs of two sizes share."""
    model = tiny_target(arch, seed=seed)
    drafter = None if mode == "ar" else tiny_drafter(model, block_size=6, seed=seed + 3, layers=2)
    budget = {"ar": 0, "chain": 0, "ddtree:5": 5}.get(mode)
    decoder = GraphedDecoder(model, drafter, budget=budget, batch=4, policy_buckets=(1, 2, 4, 8, 16),
                             policy_costs=cpu_like_costs, size_choice="ahead" if mode == "auto-ahead" else None)
    decoder.stash_candidates = mode == "auto-stash"
    prompts = prompts_of(seed, (5, 17, 3, 30, 9, 12))
    lengths = [40, 25, 33, 20, 45, 30]
    sampling = [SamplingParams()] * 6
    sampling[1] = SamplingParams(0.9, seed=7)
    sampling[4] = SamplingParams(1.1, top_k=8, top_p=0.9, seed=8)
    run = Schedule(decoder, prompts, lengths, sampling, admit_at=[0, 0, 3, 4, 6, 9], cut_at={3: 12}).run()
    for i, params in enumerate(sampling):
        if i == 3:  # abandoned: what it had is a prefix of its own output
            assert run.tokens[3] == hf_greedy(model, prompts[3], lengths[3])[: len(run.tokens[3])]
        elif params.greedy:
            assert run.output(i) == hf_greedy(model, prompts[i], lengths[i]), i
    assert max(run.buckets) == 4 and decoder.requests == {}
    if mode.startswith("auto"):
        sizes = {size for steps in run.steps.values() for size, _ in steps}
        assert 1 in sizes and len(sizes) >= 2, sizes  # AR at the full batch, trees when fewer rows remain
        assert (decoder._stash != {}) == (mode == "auto-stash")  # the candidates went through the buffers


@pytest.mark.parametrize("arch,seed", [("qwen3", 2), ("llama", 0)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("block_size,budget", [(4, 0), (8, 3), (8, None), (16, 15)])
def test_long_accepted_paths_in_every_row(arch, seed, dtype, block_size, budget):
    """Scripted drafts that know each row's continuation: long accepted runs in several rows at once (the batched
    walk and compaction), rows at different lengths, one request longer than the others joins last."""
    model = tiny_target(arch, seed=seed, dtype=dtype)
    prompts = prompts_of(seed + 10, (3, 11, 7, 20, 2))
    lengths = [48, 30, 40, 26, 60]
    references = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    proposer = ScriptedRows(4, block_size, 64, noise=0.3, seed=seed)
    decoder = GraphedDecoder(model, proposer, budget=budget, batch=4, policy_buckets=(2, 4, 8),
                             policy_costs=flat_costs)
    run = Schedule(decoder, prompts, lengths, admit_at=[0, 1, 1, 2, 5],
                   on_admit=lambda row, i: proposer.set_stream(row, prompts[i] + references[i])).run()
    for i, reference in enumerate(references):
        assert run.output(i) == reference, i
        assert max(count for _, count in run.steps[i]) >= min(4, block_size), run.steps[i]  # long paths accepted


@pytest.mark.parametrize("budget", [0, 4])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_row_steps_as_it_would_alone(budget, temperature):
    """Under a fixed tree a row's tree and draws are its own: the same request gives the same steps (tokens and
    acceptance per step) alone and in a batch, whoever its companions are and whenever they come and go."""
    model = tiny_target("qwen3", seed=4)
    drafter = tiny_drafter(model, block_size=5, seed=2, layers=2)
    target_prompt = [5, 9, 13, 2, 7, 33, 21]
    params = SamplingParams(temperature, top_p=0.9 if temperature else 1.0, seed=21 if temperature else None)
    alone = Schedule(GraphedDecoder(model, drafter, budget=budget), [target_prompt], [40], [params]).run()
    others = prompts_of(3, (4, 12, 9, 6))
    companions = [SamplingParams(), SamplingParams(1.2, seed=5), SamplingParams(0.7, top_k=3, seed=6),
                  SamplingParams()]
    batched = GraphedDecoder(model, drafter, budget=budget, batch=4)
    run = Schedule(batched, [others[0], others[1], target_prompt, others[2], others[3]], [12, 30, 40, 9, 50],
                   [companions[0], companions[1], params, companions[2], companions[3]],
                   admit_at=[0, 0, 2, 3, 4], cut_at={1: 6}).run()
    assert run.tokens[2] == alone.tokens[0]
    assert run.steps[2] == alone.steps[0]
    assert max(run.buckets) == 4


def test_throwaway_steps_and_growth_in_the_middle_of_a_batch_change_no_row():
    """Rows in flight while the decoder captures-and-times a new sampling class (throwaway steps on the live
    state), warms up every shape, and grows its capacity: every row still ends with its own greedy output, and the
    policy's learned tables are as the real steps left them."""
    model = tiny_target("llama", seed=3, max_positions=1024)
    drafter = tiny_drafter(model, block_size=6, seed=1, layers=1)
    prompts = prompts_of(5, (200, 6, 40))
    lengths = [80, 30, 60]
    decoder = GraphedDecoder(model, drafter, budget=None, batch=4, policy_buckets=(1, 2, 4, 8))  # costs timed
    got = {row: [decoder.admit(row, prompt, n)] for row, (prompt, n) in enumerate(zip(prompts, lengths))}
    for step in range(200):
        if step == 4:
            tables = decoder.policy.state()
            capacity = decoder.capacity
            decoder.prepare(SamplingParams(0.7, top_p=0.8, seed=1))  # a new class: every bucket, every size
            for size in decoder.sizes():
                with decoder._shape(4, size, decoder.window, "sampled"):
                    decoder._warm_up()
            decoder._grow(2 * capacity)
            assert decoder.capacity == 2 * capacity
            for name, before in tables.items():
                assert torch.equal(getattr(decoder.policy, name), before), name
        results = decoder.step()
        if not results:
            break
        for row, result in results.items():
            got[row] += result.tokens
    for row, (prompt, n) in enumerate(zip(prompts, lengths)):
        assert got[row][:n] == hf_greedy(model, prompt, n), row


def test_generate_many_gives_each_prompt_its_own_greedy_output():
    """Five prompts through two rows, admitted two steps apart as rows free up; a stop token ends one early."""
    model = tiny_target("llama", seed=7)
    drafter = tiny_drafter(model, block_size=5, seed=2)
    prompts = prompts_of(7, (4, 9, 2, 15, 6))
    decoder = GraphedDecoder(model, drafter, budget=3, batch=2)
    results = decoder.generate_many(prompts, 20, admit_every=2)
    assert [r.output_ids for r in results] == [hf_greedy(model, p, 20) for p in prompts]
    assert all(r.finish_reason == "length" and sum(r.stats.acceptance_lengths) + 1 >= 20 for r in results)
    stop = hf_greedy(model, prompts[1], 20)[6]
    stopped = decoder.generate_many([prompts[1], prompts[2]], 20, stop_token_ids=[stop])
    assert stopped[0].output_ids == hf_greedy(model, prompts[1], 20, eos_token_id=stop)
    assert stopped[0].finish_reason == "stop" and decoder.requests == {}


def test_rows_refuse_what_cannot_run():
    model = tiny_target("qwen3", seed=1)
    decoder = GraphedDecoder(model, None, batch=2)
    decoder.admit(0, [3, 4], 5)
    with pytest.raises(DFlashInputError, match="row 0 is busy"):
        decoder.admit(0, [3], 5)
    with pytest.raises(DFlashInputError, match="row=2 does not exist"):
        decoder.admit(2, [3], 5)
    with pytest.raises(DFlashInputError, match="needs its own draws"):
        decoder.admit(1, [3], 5, SamplingParams(0.5, seed=1))
    with pytest.raises(DFlashInputError, match="generate\\(\\) decodes one prompt alone"):
        decoder.generate([3], 4)
    with pytest.raises(DFlashInputError, match="cannot move row 1 to row 0"):
        decoder.move_row(1, 0)
    decoder.release(0)
    decoder.release(0)  # a free row: nothing to do
    assert decoder.generate([3, 4], 5).output_ids == hf_greedy(model, [3, 4], 5)


# --------------------------------------------------------------------------------- sampling


def test_row_probs_equal_processed_probs_row_by_row():
    """The per-row sampling distribution is ``processed_probs`` of each row's own settings, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 50, generator=gen, dtype=torch.float64) * 3
    settings = [SamplingParams(0.7), SamplingParams(1.3, top_k=5), SamplingParams(0.9, top_p=0.6),
                SamplingParams(1.0, top_k=7, top_p=0.8)]
    for dtype in (torch.float64, torch.float32):
        x = logits.to(dtype)
        probs = row_probs(x, torch.tensor([s.temperature for s in settings], dtype=torch.float64),
                          torch.tensor([s.top_k for s in settings]),
                          torch.tensor([s.top_p for s in settings], dtype=torch.float64), filtered=True)
        for r, params in enumerate(settings):
            assert torch.equal(probs[r], processed_probs(x[r], params)), (dtype, params)
    assert [sampling_kind(s) for s in ([], [SamplingParams()], settings[:1], settings)] == \
        ["greedy", "greedy", "sampled", "filtered"]
    assert batch_buckets(1) == (1,) and batch_buckets(6) == (1, 2, 4, 6) and batch_buckets(8) == (1, 2, 4, 8)


ROW_SETTINGS = [  # (prompt, sampling) per row; rows 2 and 3 join after the first step
    ([2, 3], SamplingParams(1.0)),
    ([3, 2, 4], SamplingParams(1.3, top_k=4, top_p=0.8)),
    ([4], SamplingParams(0.7, top_p=0.9)),
    ([1, 0], SamplingParams(1.0, top_k=3)),
]


@pytest.mark.parametrize("budget", [3, None])
def test_every_row_follows_its_own_distribution(budget):
    """Four rows with four sampling settings share every step; rows 0 and 1 generate four tokens (their first two
    counted) so that rows 2 and 3 join them mid-run. Each row's first two tokens follow its own exact joint."""
    target = tiny_target("qwen3", seed=3, vocab=VOCAB, layers=2, hidden=16, init_std=0.3)
    drafter = tiny_drafter(target, block_size=3, seed=5)
    decoder = GraphedDecoder(target, drafter, budget=budget, batch=4, policy_buckets=(1, 2, 4),
                             policy_costs=flat_costs)
    runs = 1500
    counts = [np.zeros((VOCAB, VOCAB), dtype=np.int64) for _ in ROW_SETTINGS]
    joints = []
    for prompt, params in ROW_SETTINGS:
        joints.append(exact_with_prompt(target, prompt, params))
    multi = 0
    for run in range(runs):
        seeds = [SamplingParams(p.temperature, p.top_p, p.top_k, seed=100_000 * (r + 1) + run)
                 for r, (_, p) in enumerate(ROW_SETTINGS)]
        schedule = Schedule(decoder, [p for p, _ in ROW_SETTINGS], [4, 4, 2, 2], seeds, admit_at=[0, 0, 1, 1]).run()
        for r in range(4):
            counts[r][tuple(schedule.tokens[r][:2])] += 1
            multi += any(count > 1 for _, count in schedule.steps[r])
    assert multi > runs // 10, multi  # drafts were accepted
    for r, (count, joint) in enumerate(zip(counts, joints)):
        assert not count[joint == 0].any(), r
        stat, df = chi_square(count, joint)
        assert stat < chi2_threshold(df), f"row {r}: chi2={stat:.1f} (df={df})"
        # The test can fail: the same counts against another row's distribution.
        other = joints[(r + 1) % 4]
        other = 0.999 * other + 0.001 / other.size
        assert chi_square(count, other / other.sum())[0] > 3 * chi2_threshold(df), r


def exact_with_prompt(model, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """The exact joint of the first two tokens after ``prompt`` (test_sampling.exact_joint for any prompt)."""
    first = processed_probs(full_forward(model, prompt)[2][-1], params).numpy()
    second = np.stack([processed_probs(full_forward(model, [*prompt, t])[2][-1], params).numpy()
                       for t in range(VOCAB)])
    return first[:, None] * second


# --------------------------------------------------------------------------------- host syncs


@pytest.mark.parametrize("budget,size_choice", [(0, "ahead"), (4, "ahead"), (None, "ahead"), (None, "in_step")])
def test_a_batched_step_reads_nothing_on_the_host_but_its_one_copy(budget, size_choice, monkeypatch):
    """Whole steps of three rows (greedy, sampled, filtered; one of them admitted mid-run) under NoHostSync: the
    planning (depth limits, tree size), the keyed draws, every stage and the bookkeeping read nothing on the host except
    the one named copy per step (what CUDA graphs need); choosing the size in the step (the CPU's way) adds one
    named read of the estimates per drafted step."""
    model = tiny_target("qwen3", seed=6)
    drafter = tiny_drafter(model, block_size=6, seed=1, layers=1)
    decoder = GraphedDecoder(model, drafter, budget=budget, batch=4, policy_buckets=(1, 2, 4, 8),
                             policy_costs=flat_costs, size_choice=size_choice)
    decoder.prepare(SamplingParams(0.8, top_k=5, seed=1))  # the costs of the filtered class, outside the guard
    decoder.admit(0, [3, 4, 5, 6], 30)
    decoder.admit(1, [7, 8], 30, SamplingParams(0.9, seed=2), TokenDraws(2))
    guard = NoHostSync()
    original = decoder._copy_out

    def copy_out() -> list[list[int]]:
        with guard.allow("the step's tokens"):
            return original()

    estimates = decoder._copy_estimates

    def copy_estimates(*args: object) -> list[list[float]]:
        with guard.allow("the step's estimates"):
            return estimates(*args)

    monkeypatch.setattr(decoder, "_copy_out", copy_out)
    monkeypatch.setattr(decoder, "_copy_estimates", copy_estimates)
    want = []
    for step in range(6):
        if step == 2:
            decoder.admit(2, [9, 10, 11], 30, SamplingParams(1.1, top_p=0.8, seed=3), TokenDraws(3))
        with guard:
            results = decoder.step()
        assert set(results) == ({0, 1} if step < 2 else {0, 1, 2})
        assert tuple(decoder.out[: decoder.bucket].shape) == (decoder.bucket, decoder.out.shape[1])
        drafted = size_choice == "in_step" and results[0].tree_size > 1
        want += ["the step's estimates"] * drafted + ["the step's tokens"]
    assert guard.allowed_copies == want
    assert size_choice == "ahead" or "the step's estimates" in want  # the in-step case drafted


# --------------------------------------------------------------------------------- the policy at batch B


def test_the_cost_aware_tree_follows_the_batchs_own_cost_curve():
    """The same requests under two injected curves: where every extra token of a step costs (a CPU), the batch of
    four falls back to AR and the lone row verifies trees; where the curve is flat (a GPU), every step verifies
    big trees. The outputs are the target's own either way, and the choice at each step used its bucket's curve."""
    model = tiny_target("qwen3", seed=5)
    prompts = prompts_of(8, (8, 10, 4, 6))
    lengths = [60, 20, 20, 20]
    references = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    sizes_by_curve = {}
    for name, curve in (("cpu", cpu_like_costs), ("gpu", flat_costs)):
        proposer = ScriptedRows(4, 8, 64, noise=0.2, seed=1)
        decoder = GraphedDecoder(model, proposer, budget=None, batch=4, policy_buckets=(1, 2, 4, 8),
                                 policy_costs=curve)
        run = Schedule(decoder, prompts, lengths,
                       on_admit=lambda row, i, p=proposer: p.set_stream(row, prompts[i] + references[i])).run()
        assert [run.output(i) for i in range(4)] == references
        full = [size for size, _ in run.steps[1][1:]]  # the four rows together (after the first guess)
        # The long row, alone in row 0 (bucket 1) at the end, but for its last step: with one or two tokens left to
        # make, a tree deeper than one draft cannot pay whatever the curve.
        alone = [size for size, _ in run.steps[0][-10:-1]]
        sizes_by_curve[name] = (full, alone)
    cpu_full, cpu_alone = sizes_by_curve["cpu"]
    gpu_full, gpu_alone = sizes_by_curve["gpu"]
    assert cpu_full.count(1) >= len(cpu_full) - 3, cpu_full  # AR, but for the probes of the back-off
    assert max(cpu_alone) > 1  # one row: trees pay on the same curve's batch-1 row
    assert min(gpu_full) >= 4 and min(gpu_alone) >= 4, (gpu_full, gpu_alone)


class UnsureRow(ScriptedRows):
    """Scripted rows, but row ``unsure``'s drafts are near-uniform (its marginals fall in the lowest bins, as a
    drafter's do on text it cannot predict): the policy's estimates for that row are low."""

    def __init__(self, *args, unsure: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.unsure = unsure

    def draft(self, root: torch.Tensor, context_len: torch.Tensor, window: int | None = None) -> torch.Tensor:
        logits = super().draft(root, context_len, window)
        if self.unsure < logits.shape[0]:
            logits[self.unsure] *= 0.01
        return logits


def two_row_costs(bucket: int, size: int) -> float:
    """A step of 8 nodes costs 2.7 AR steps at batch 2: worth it for a row that accepts well, not for one that
    accepts nothing."""
    return 1.0 + 0.1 * bucket * (size - 1) + (0.3 if size > 1 else 0.0)


@pytest.mark.parametrize("credit", [True, False])
def test_a_row_that_accepts_badly_keeps_ars_pace(credit, monkeypatch):
    """Two rows: one whose drafts the target always accepts, one whose near-uniform drafts it never does. The batch's
    most tokens per second verifies 8-node trees (2.7 AR steps for ~8 tokens and 1), and the bad row falls behind
    where AR would have brought it; with each row's credit (``SizeChooser``'s "Credit") the batch runs AR but for
    the first step and a probe, after which the probe's loss to the bad row stretches the back-off to its longest. The decoder keeps each row's credit as
    its tokens less each step's cost in AR steps; both rows are their own greedy output (float64) either way."""
    if not credit:  # the batch rule alone: every size affordable
        monkeypatch.setattr(SizeChooser, "affordable", lambda self, rows, costs, credit: set(self.sizes))
    model = tiny_target("qwen3", seed=6, dtype=torch.float64)
    prompts = prompts_of(9, (7, 5))
    lengths = [48, 48]
    references = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    proposer = UnsureRow(2, 8, 64, noise=0.0, seed=3)
    decoder = GraphedDecoder(model, proposer, budget=None, batch=2, policy_buckets=(1, 2, 4, 8),
                             policy_costs=two_row_costs, lookup=False)  # the drafter's marginals alone
    outputs, credits, sizes = {}, {0: 0.0, 1: 0.0}, []
    for row, prompt in enumerate(prompts):
        proposer.set_stream(row, prompt + (references[row] if row == 0 else [1] * 64))  # row 1: a wrong script
        outputs[row] = [decoder.admit(row, prompt, lengths[row])]
    while decoder.requests:
        results = decoder.step()
        for row, result in results.items():
            outputs[row] += result.tokens
            steps = two_row_costs(decoder.bucket, result.tree_size) / two_row_costs(decoder.bucket, 1)
            credits[row] += len(result.tokens) - steps
            assert decoder.requests[row].credit == pytest.approx(credits[row])
            if len(results) == 2:
                sizes.append(result.tree_size)
            if len(outputs[row]) >= lengths[row]:
                decoder.release(row)
    assert [outputs[row][: lengths[row]] for row in (0, 1)] == references
    drafted = [size for size in sizes[::2] if size > 1]  # one entry per row and step: per step
    if credit:
        # The first step (at the start size) and one probe, after which the probe's loss to the bad row (1.7 tokens
        # of AR's pace) sets the back-off to its longest: 3.4 tokens lost, no more.
        assert len(drafted) <= 2 and credits[1] > -4.0, (sizes, credits)
    else:
        assert len(drafted) == len(sizes) // 2 and credits[1] < -8.0, (sizes, credits)  # every step, 10.7 lost


def test_a_drafted_step_no_row_can_afford_verifies_its_root_alone(monkeypatch):
    """The in-step choice (the CPU's) after a draft that no row can afford: the step verifies its root alone (an AR
    step that paid the draft) rather than the best tree, which would put the bad row behind AR's pace. Every step is
    made to draft (the host's choice forced to 8 nodes): while the row that accepts nothing steps, each step drafts and
    verifies one node, the bad row's credit stays at 0 (given costs: the draft counts as free) and every row keeps
    the fallback's own estimates; alone, the good row verifies trees. Both rows are their own greedy output (float64)."""
    monkeypatch.setattr(SizeChooser, "choose", lambda self, *args, **kwargs: 8)
    model = tiny_target("qwen3", seed=6, dtype=torch.float64)
    prompts = prompts_of(9, (7, 5))
    lengths = [40, 16]
    references = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    proposer = UnsureRow(2, 8, 64, noise=0.0, seed=3)
    drafts = []
    draft = proposer.draft
    monkeypatch.setattr(proposer, "draft", lambda *args: drafts.append(1) or draft(*args))
    decoder = GraphedDecoder(model, proposer, budget=None, batch=2, policy_buckets=(1, 2, 4, 8),
                             policy_costs=two_row_costs, lookup=False)
    assert decoder.size_choice == "in_step"
    seen = []  # what each in-step choice read: every stepping row's estimates
    copy_estimates = decoder._copy_estimates
    monkeypatch.setattr(decoder, "_copy_estimates", lambda *args: seen.append(copy_estimates(*args)) or seen[-1])
    outputs, together, alone = {}, [], []
    for row, prompt in enumerate(prompts):
        proposer.set_stream(row, prompt + (references[row] if row == 0 else [1] * 64))  # row 1: a wrong script
        outputs[row] = [decoder.admit(row, prompt, lengths[row])]
    steps = 0
    while decoder.requests:
        results = decoder.step()
        steps += 1
        if len(results) == 2:
            together.append(results[0].tree_size)
            for row in (0, 1):  # the fallback's own estimates, as the next choice reads them
                assert decoder.requests[row].expected == pytest.approx(seen[-1][row], abs=1e-3)
            assert decoder.requests[1].credit == pytest.approx(0.0)  # one token per AR-priced step
        else:
            alone.append(results[0].tree_size)
        for row, result in results.items():
            outputs[row] += result.tokens
            if len(outputs[row]) >= lengths[row]:
                decoder.release(row)
    assert [outputs[row][: lengths[row]] for row in (0, 1)] == references
    assert len(drafts) == steps  # every step drafted
    assert set(together) == {1} and len(together) >= 10, together
    assert max(alone) > 1, alone


def step_and_release(decoder: GraphedDecoder, outputs: dict[int, list[int]], request_of: dict[int, int],
                     lengths: list[int]) -> None:
    """One step of every admitted row: each row's tokens go to its request's output (``request_of``: row ->
    request), and a request with ``lengths`` of its tokens releases its row."""
    for row, result in decoder.step().items():
        outputs[request_of[row]] += result.tokens
        if len(outputs[request_of[row]]) >= lengths[request_of[row]]:
            decoder.release(row)
            del request_of[row]


def test_deferred_drafter_context_is_what_every_draft_would_have_read(monkeypatch):
    """On a CPU an AR step's drafter context waits for the next draft (``CPU_DEFERRED_CONTEXT``) and is extended then
    in one call. Every draft must read the context a per-step extension gives: the same requests through two
    decoders (a real random drafter, float64), one deferring and one not, draft the same logits at every step
    (within float64 rounding of a wider GEMM), including a stretch of 70 AR steps (the buffer fills and is emptied
    once), a row admitted mid-run with fewer waiting steps than the others, and a row moved down with features
    waiting (``move_row``). Both runs are every row's own greedy output."""
    model = tiny_target("qwen3", seed=7, dtype=torch.float64)
    drafter = tiny_drafter(model, block_size=6, seed=2, layers=2)
    prompts = prompts_of(12, (6, 9, 4))
    lengths = [120, 30, 90]
    references = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    plan = [1] * 70 + [1, 1, 4] * 40  # the host's size per step: AR, then a draft every third step
    monkeypatch.setattr(SizeChooser, "choose_drafted", lambda self, *args, **kwargs: 4)

    def run(defer: bool) -> tuple[list[torch.Tensor], dict[int, list[int]]]:
        decoder = GraphedDecoder(model, drafter, budget=None, batch=3, policy_buckets=(1, 2, 4, 8),
                                 policy_costs=flat_costs, lookup=False)
        decoder.defer_context = defer
        step = iter(range(10**6))
        monkeypatch.setattr(decoder.chooser, "choose", lambda *args, **kwargs: plan[min(next(step), len(plan) - 1)])
        drafts: list[torch.Tensor] = []
        draft = decoder.proposer.draft
        monkeypatch.setattr(decoder.proposer, "draft", lambda *args: drafts.append(draft(*args)) or drafts[-1])
        outputs, request_of = {}, {0: 0, 1: 1}
        for row in (0, 1):
            outputs[row] = [decoder.admit(row, prompts[row], lengths[row])]
        for i in range(400):
            if i == 40:  # fewer waiting AR steps than rows 0 and 1
                request_of[2] = 2
                outputs[2] = [decoder.admit(2, prompts[2], lengths[2])]
            if 1 not in request_of and 2 in request_of and i == 75:  # features of row 2 wait as it moves
                assert decoder._deferred_steps > 0 or not defer
                decoder.move_row(2, 1)
                request_of[1] = request_of.pop(2)
            if not request_of:
                break
            step_and_release(decoder, outputs, request_of, lengths)
        assert not request_of
        return drafts, outputs

    deferred, outputs = run(True)
    per_step, outputs_per_step = run(False)
    for want, got in ((references, outputs), (references, outputs_per_step)):
        assert [got[i][: lengths[i]] for i in range(3)] == want
    assert len(deferred) == len(per_step) >= 15
    for a, b in zip(deferred, per_step):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_a_prompts_drafter_context_waits_for_its_rows_first_draft(monkeypatch):
    """On a CPU a prompt's drafter context waits for its row's first draft (``CPU_DEFERRED_PROMPT_BYTES``): an
    admission extends nothing, a row released before it drafts never pays for it, a row moved while its prompt
    waits takes it along, and every draft reads what an extension at admission gives (float64, a real random
    drafter, against a decoder that extends at admission). A prompt over the byte limit is extended at once."""
    model = tiny_target("llama", seed=5, dtype=torch.float64)
    drafter = tiny_drafter(model, block_size=4, seed=3, layers=2)
    prompts = prompts_of(21, (7, 11, 5))
    lengths = [40, 6, 30]
    references = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    plan = [1] * 8 + [4] * 100  # AR steps first: request 1 (6 tokens) is done before anything drafts
    monkeypatch.setattr(SizeChooser, "choose_drafted", lambda self, *args, **kwargs: 4)

    def decoder_of(defer: bool) -> tuple[GraphedDecoder, list[tuple[int, int]]]:
        decoder = GraphedDecoder(model, drafter, budget=None, batch=3, policy_buckets=(1, 2, 4),
                                 policy_costs=flat_costs, lookup=False)
        decoder.defer_context = defer
        prompt_extensions: list[tuple[int, int]] = []  # (row, positions) of each one-row (prompt) extension
        extend = decoder.proposer.extend

        def spy(features: torch.Tensor, start: torch.Tensor, row: int | None = None) -> None:
            if row is not None:
                prompt_extensions.append((row, features.shape[1]))
            extend(features, start, row=row)

        monkeypatch.setattr(decoder.proposer, "extend", spy)
        return decoder, prompt_extensions

    def run(defer: bool) -> tuple[list[torch.Tensor], dict[int, list[int]], list[tuple[int, int]]]:
        decoder, prompt_extensions = decoder_of(defer)
        step = iter(range(10**6))
        monkeypatch.setattr(decoder.chooser, "choose", lambda *args, **kwargs: plan[min(next(step), len(plan) - 1)])
        drafts: list[torch.Tensor] = []
        draft = decoder.proposer.draft
        monkeypatch.setattr(decoder.proposer, "draft", lambda *args: drafts.append(draft(*args)) or drafts[-1])
        outputs = {row: [decoder.admit(row, prompts[row], lengths[row])] for row in (0, 1, 2)}
        request_of = {0: 0, 1: 1, 2: 2}
        assert prompt_extensions == ([] if defer else [(0, 7), (1, 11), (2, 5)])
        for _ in range(200):
            if not request_of:
                break
            step_and_release(decoder, outputs, request_of, lengths)
            if 1 not in request_of and 2 in request_of and not drafts:  # request 2 moves down, its prompt waiting
                assert decoder._deferred_prompts.keys() == ({0, 2} if defer else set())
                decoder.move_row(2, 1)
                request_of[1] = request_of.pop(2)
        assert not request_of and not decoder._deferred_prompts
        return drafts, outputs, prompt_extensions

    deferred, outputs, extended = run(True)
    at_admission, outputs_at_admission, _ = run(False)
    for got in (outputs, outputs_at_admission):
        assert [got[i][: lengths[i]] for i in range(3)] == references
    # Request 1's prompt (11 positions) was never extended; request 2's went to the row it moved to.
    assert sorted(extended) == [(0, 7), (1, 5)]
    assert len(deferred) == len(at_admission) >= 10
    for a, b in zip(deferred, at_admission):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    width = len(drafter.config.target_layer_ids) * model.config.hidden_size  # a position's features (float64)
    monkeypatch.setattr(graphed, "CPU_DEFERRED_PROMPT_BYTES", 6 * width * 8)  # 7 positions over it, 5 within
    decoder, prompt_extensions = decoder_of(True)
    decoder.admit(0, prompts[0], 4)
    decoder.admit(1, prompts[2], 4)
    assert prompt_extensions == [(0, 7)] and set(decoder._deferred_prompts) == {1}


def test_a_draining_decoder_hands_the_chooser_each_rows_remaining_tokens(monkeypatch):
    """``step(draining=True)`` with several rows hands the chooser every row's remaining tokens (``SizeChooser``
    paces the batch by the row that would finish last); not draining, or with one row, it does not. Every row is
    still its own greedy output (float64), and drained steps verify trees where they pay."""
    calls = record_choices(monkeypatch)
    model = tiny_target("llama", seed=3, dtype=torch.float64)
    prompts = prompts_of(4, (6, 9, 5))
    lengths = [40, 12, 24]
    references = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    proposer = ScriptedRows(4, 8, 64, noise=0.2, seed=2)
    decoder = GraphedDecoder(model, proposer, budget=None, batch=4, policy_buckets=(1, 2, 4, 8), policy_costs=flat_costs)
    outputs: dict[int, list[int]] = {}
    for row, prompt in enumerate(prompts):
        proposer.set_stream(row, prompt + references[row])
        outputs[row] = [decoder.admit(row, prompt, lengths[row])]
    sizes: dict[bool, list[int]] = {True: [], False: []}
    for step in range(200):
        live = sorted(decoder.requests)
        if not live:
            break
        draining = step % 3 != 0
        left = [decoder.requests[row].remaining for row in live]
        calls.clear()
        results = decoder.step(draining=draining)
        drained = draining and len(live) > 1
        assert calls == [(len(live), left if drained else None)], (step, calls)
        for row, result in results.items():
            outputs[row] += result.tokens
            sizes[drained].append(result.tree_size)
            if len(outputs[row]) >= lengths[row]:
                decoder.release(row)
    assert [outputs[row][: lengths[row]] for row in range(3)] == references
    assert max(sizes[True]) > 1 and sizes[False], sizes  # flat costs: trees pay even for the slowest row


def test_generate_many_drains_only_once_its_queue_is_empty(monkeypatch):
    """``generate_many`` knows its queue: while prompts wait for a row the chooser gets the batch rule, and once the
    last prompt is in, every step of several rows is a draining one (remaining tokens handed over). Outputs are
    still each prompt's own greedy output."""
    calls = record_choices(monkeypatch)
    model = tiny_target("llama", seed=4, dtype=torch.float64)
    prompts = prompts_of(9, (5, 8, 3, 7, 6))
    decoder = GraphedDecoder(model, ScriptedRows(2, 8, 64, noise=0.2, seed=3), budget=None, batch=2,
                             policy_buckets=(1, 2, 4, 8), policy_costs=flat_costs)
    results = decoder.generate_many(prompts, 12, admit_every=0)
    assert [r.output_ids for r in results] == [hf_greedy(model, p, 12) for p in prompts]
    drained = [left is not None for _, left in calls]
    first = drained.index(True)  # the first step after the last prompt took its row
    assert first > 0 and not any(drained[:first])
    assert all(d for (rows, _), d in zip(calls[first:], drained[first:]) if rows > 1)  # one row: the batch rule


def test_step_costs_are_measured_per_batch_bucket(monkeypatch):
    """Without injected costs, each batch bucket's curve is timed once per sampling class, when first needed."""
    model = tiny_target("llama", seed=2)
    drafter = tiny_drafter(model, block_size=5, seed=1, layers=1)
    decoder = GraphedDecoder(model, drafter, budget=None, batch=4, policy_buckets=(1, 2, 4))
    timed: list[tuple[int, int, str]] = []

    def fake_time_step(bucket: int, size: int, repeats: int = 5) -> float:
        timed.append((bucket, size, decoder.kind))
        return bucket * size * 1e-3

    monkeypatch.setattr(decoder, "_time_step", fake_time_step)
    monkeypatch.setattr(decoder, "_observe_cost", lambda bucket, seconds: None)  # the curves stay as timed
    decoder.prepare(buckets=(1, 2))
    assert timed == [(b, s, "greedy") for b in (1, 2) for s in (1, 2, 4)]
    for row, prompt in enumerate(prompts_of(1, (4, 5, 6))):
        decoder.admit(row, prompt, 6)
    while decoder.step():  # three rows: bucket 4, timed now; then fewer rows, buckets already timed
        pass
    assert timed[6:] == [(4, s, "greedy") for s in (1, 2, 4)]
    assert decoder.step_costs("greedy", 4) == [4e-3, 8e-3, 16e-3]
