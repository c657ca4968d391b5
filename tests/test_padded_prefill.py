"""The padded prefill (static_state.PaddedPrefill, GraphedDecoder.padded_prefill): a prompt prefilled at the next
power-of-two length into a staging row, then copied into its decoder row, so that one CUDA graph per length serves
every prompt and row. CUDA's default; on the CPU these tests switch it on and run its stage eagerly.

* The row it fills equals the plain prefill's (K/V of the prompt's slots, first token, the drafter's context) in
  float64, at lengths on both sides of the padding steps, in a row of a batch whose other rows are busy.
* Greedy output equals transformers' own greedy output (float64; tiny Qwen3 with sliding-window layers and Llama;
  AR, DDTree, the cost-aware tree), alone and for rows admitted mid-run.
* Its graph body reads nothing on the host; prepare() captures one graph per padded length a fitting prompt can
  take, and a replay's static outputs are copied out before the next prompt overwrites them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import hf_greedy, tiny_drafter, tiny_target

from tensorrt_llm_dflash.graphed import CAPACITY_STEP, GraphedDecoder
from tensorrt_llm_dflash.nosync import NoHostSync
from tensorrt_llm_dflash.static_state import PREFILL_MIN_LENGTH, PaddedPrefill, prefill_length


def _prompt(length: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, 64, length)]


def _decoder(model, drafter, budget, padded: bool, **kwargs) -> GraphedDecoder:
    decoder = GraphedDecoder(model, drafter, budget=budget, **kwargs)
    decoder.padded_prefill = padded
    return decoder


def test_prefill_lengths_are_powers_of_two_from_the_minimum_up_to_the_limit():
    assert [prefill_length(n, 4096) for n in (1, 31, 32, 33, 64, 65, 1000)] == [32, 32, 32, 64, 64, 128, 1024]
    assert prefill_length(300, 256) == 300  # never shorter than the prompt
    assert prefill_length(200, 256) == 256  # the limit caps the power of two
    assert PREFILL_MIN_LENGTH == 32


def test_on_a_cpu_the_plain_prefill_is_the_default():
    model = tiny_target("llama", seed=1)
    assert GraphedDecoder(model, None).padded_prefill is False  # CUDA's default only (compute-bound CPU: no pads)


@pytest.mark.parametrize("arch,window", [("qwen3", 8), ("llama", None)])
@pytest.mark.parametrize("length", [1, 7, 31, 32, 33, 100])
def test_the_padded_prefill_fills_its_row_as_the_plain_prefill(arch, window, length):
    """Row 2 of a 3-row decoder, rows 0 and 1 busy: its K/V slots 0..P-1, its first token, its drafter context and
    the other rows' caches are those of the plain prefill (float64, to 1e-10); the pads' K/V never reach the row."""
    model = tiny_target(arch, seed=3, sliding_window=window)
    drafter = tiny_drafter(model, block_size=4, seed=2)
    decoders = [_decoder(model, drafter, 3, padded, batch=3) for padded in (False, True)]
    prompt = _prompt(length, seed=length)
    for decoder in decoders:
        decoder.admit(0, _prompt(9, seed=40), 6)
        decoder.admit(1, _prompt(40, seed=41), 6)
    firsts = [decoder.admit(2, prompt, 6) for decoder in decoders]
    assert firsts[0] == firsts[1]
    for decoder in decoders:
        decoder._extend_deferred()  # a CPU keeps a prompt's drafter context until its row's first draft
    plain, padded = (d.target.cache.kv for d in decoders)
    torch.testing.assert_close(padded[:, :, :, :, :length], plain[:, :, :, :, :length], rtol=0, atol=1e-10)
    assert torch.count_nonzero(padded[:, :, 2, :, length:]) == torch.count_nonzero(plain[:, :, 2, :, length:])
    plain_ctx, padded_ctx = (d.proposer.kv for d in decoders)
    torch.testing.assert_close(padded_ctx[..., :length, :], plain_ctx[..., :length, :], rtol=0, atol=1e-10)
    for name in ("past", "root", "history"):
        assert torch.equal(getattr(decoders[0], name), getattr(decoders[1], name)), name


@pytest.mark.parametrize("arch,window", [("qwen3", 6), ("llama", None)])
@pytest.mark.parametrize("budget", ["ar", 3, None])
def test_padded_prefill_output_equals_transformers_greedy(arch, window, budget):
    model = tiny_target(arch, seed=7, sliding_window=window)
    drafter = None if budget == "ar" else tiny_drafter(model, block_size=6, seed=1, layers=2)
    decoder = _decoder(model, drafter, None if budget == "ar" else budget, padded=True,
                       policy_buckets=(2, 4, 8), policy_costs=(1.0, 1.1, 1.3))
    for seed, length in enumerate((3, 32, 45)):
        prompt = _prompt(length, seed)
        out = decoder.generate(prompt, 30)
        assert out.output_ids == hf_greedy(model, prompt, 30), (seed, length)


def test_rows_admitted_mid_run_with_padded_prefill_each_get_their_greedy_output():
    model = tiny_target("qwen3", seed=8, sliding_window=8)
    drafter = tiny_drafter(model, block_size=4, seed=3)
    decoder = _decoder(model, drafter, None, padded=True, batch=4, policy_buckets=(2, 4), policy_costs=(1.0, 1.2))
    prompts = [_prompt(length, seed) for seed, length in enumerate((5, 33, 17, 64, 2, 90))]
    results = decoder.generate_many(prompts, 20, admit_every=2)
    for prompt, result in zip(prompts, results):
        assert result.output_ids == hf_greedy(model, prompt, 20)


def test_the_padded_prefill_reads_nothing_on_the_host():
    """``PaddedPrefill.run`` is the body of a prefill graph: no host read, fixed output shapes."""
    model = tiny_target("qwen3", seed=9, sliding_window=8)
    prefill = PaddedPrefill(model, [1, 3], 64)
    shapes = set()
    for count in (5, 40):
        prefill.load(torch.tensor(_prompt(count, count)), 64)
        with torch.inference_mode(), NoHostSync():
            logits, feats = prefill.run(64)
        shapes.add((tuple(logits.shape), tuple(feats.shape)))
    assert shapes == {((1, 64), (1, 64, 2 * 32))}


class _FakeGraph:
    """What a CUDA graph does to a prefill, on the CPU: its outputs are fixed tensors written by every replay."""

    def __init__(self, prefill: PaddedPrefill, length: int) -> None:
        self.prefill, self.length = prefill, length
        self.outputs = prefill.run(length)
        self.replays = 0

    def replay(self) -> None:
        logits, feats = self.prefill.run(self.length)
        self.outputs[0].copy_(logits)
        self.outputs[1].copy_(feats)
        self.replays += 1


def test_prepare_captures_a_prefill_graph_per_length_and_admissions_replay_them(monkeypatch):
    """Under graphs, prepare() captures one prefill graph per padded length a fitting prompt can take; admissions
    (two prompts of one length in two rows, then a longer one) replay them and copy their static outputs out before
    the next replay overwrites them: every row then decodes its own greedy output."""
    model = tiny_target("llama", seed=10, max_positions=1024)
    drafter = tiny_drafter(model, block_size=4, seed=4)
    decoder = _decoder(model, drafter, 3, padded=True, batch=3, capacity=2 * CAPACITY_STEP)
    graphs: dict[int, _FakeGraph] = {}

    def fake_graph(length: int):
        if length not in graphs:
            graphs[length] = _FakeGraph(decoder._prefill_for(length), length)
        return graphs[length], graphs[length].outputs

    decoder.use_graphs = True  # the captures themselves need CUDA: record and emulate them
    monkeypatch.setattr(decoder, "_capture", lambda: object())
    monkeypatch.setattr(decoder, "_time_step", lambda bucket, size, repeats=5: 1e-3)
    monkeypatch.setattr(decoder, "_prefill_graph", fake_graph)
    decoder.prepare()
    lengths = decoder.prefill_lengths()
    assert sorted(graphs) == lengths == [32, 64, 128, 256, 512]
    assert all(prefill_length(n, decoder.max_capacity) in lengths
               for n in range(1, decoder.capacity - decoder.span + 1))
    prompts = [_prompt(20, 1), _prompt(30, 2), _prompt(70, 3)]
    firsts = [decoder.admit(row, prompt, 12) for row, prompt in enumerate(prompts)]
    assert [graphs[n].replays for n in (32, 128)] == [2, 1]
    plain = _decoder(model, drafter, 3, padded=False, batch=3, capacity=2 * CAPACITY_STEP)
    assert firsts == [plain.admit(row, prompt, 12) for row, prompt in enumerate(prompts)]
    for d in (decoder, plain):
        d._extend_deferred()  # every row's prompt context, as each row got it from its own replay
    for row, prompt in enumerate(prompts):  # not the next replay's: the outputs were copied out in time
        torch.testing.assert_close(decoder.proposer.kv[:, :, row, ..., : len(prompt), :],
                                   plain.proposer.kv[:, :, row, ..., : len(prompt), :], rtol=0, atol=1e-10)
    decoder.use_graphs = False  # the steps run their stages eagerly from here
    tokens = {row: [first] for row, first in enumerate(firsts)}
    while decoder.requests:
        for row, result in decoder.step().items():
            tokens[row] += result.tokens
            if len(tokens[row]) >= 12:
                decoder.release(row)
    for row, prompt in enumerate(prompts):
        assert tokens[row][:12] == hf_greedy(model, prompt, 12), row


@pytest.mark.parametrize("length", [129, 240])
def test_a_long_prompt_grows_the_state_and_the_staging_row(length):
    """A prompt past the capacity grows the decoder (its rows kept) and the staging prefill (rebuilt at the larger
    padded length); a prompt near the target's positions pads up to them at most."""
    model = tiny_target("qwen3", seed=11, max_positions=256)
    drafter = tiny_drafter(model, block_size=4, seed=5)
    decoder = _decoder(model, drafter, 3, padded=True, capacity=CAPACITY_STEP // 2)
    short = _prompt(10, 1)
    assert decoder.generate(short, 8).output_ids == hf_greedy(model, short, 8)
    assert decoder._prefill.capacity == 32
    prompt = _prompt(length, 2)
    new = min(12, decoder.max_model_len - length)
    assert decoder.generate(prompt, new).output_ids == hf_greedy(model, prompt, new)
    assert decoder._prefill.capacity == prefill_length(length, decoder.max_capacity) >= length
