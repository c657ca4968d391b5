"""The model side of the server (tensorrt_llm_dflash.serve.runner) and one request's output (serve.sequence).

* GraphedRunner replays GraphedDecoder.generate step by step: the same tokens, the same tree sizes and
  acceptance per step, greedy and seeded sampling, AR / chain / DDTree / the cost-aware tree.
* A RowStack's rows are independent: rows admitted mid-run, released early, of different lengths and
  temperatures, each give what that request gives alone.
* RowOutput cuts at stop tokens, the length limit and the first stop string (never sending a stop string,
  whatever the chunking), and its chunks concatenate to the decoded text.
"""

from __future__ import annotations

import random

import pytest
import torch
from serve_support import POLICY_BUCKETS, POLICY_COSTS, TinyModels
from tiny_dirs import char_tokenizer

from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.graphed import GraphedDecoder
from tensorrt_llm_dflash.sampling import SamplingParams
from tensorrt_llm_dflash.serve.runner import BatchRunner, GraphedRunner, RowRequest, RowStack, graphed_rows
from tensorrt_llm_dflash.serve.sequence import GenerationRequest, RowOutput


@pytest.fixture(scope="module")
def models() -> TinyModels:
    torch.set_num_threads(1)
    return TinyModels()


def run_alone(runner: BatchRunner, slot: int, row: RowRequest) -> tuple[list[int], list[int], list[int]]:
    """Admit one row, step until max_new_tokens: (tokens, tree sizes, tokens per step)."""
    runner.admit(slot, row)
    tokens: list[int] = []
    sizes: list[int] = []
    counts: list[int] = []
    while len(tokens) < row.max_new_tokens:
        out = runner.step()[slot]
        tokens += out.tokens
        if not out.is_prefill:
            sizes.append(out.tree_size)
            counts.append(len(out.tokens))
    runner.release(slot)
    return tokens[: row.max_new_tokens], sizes, counts


@pytest.mark.parametrize("speculative, budget", [(False, 0), (True, 0), (True, 4), (True, None)])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_graphed_runner_equals_generate_step_for_step(models, speculative, budget, temperature):
    prompt = models.encode("def add(a, b):")  # on this target every mode accepts draft tokens somewhere
    n = 40
    sampling = SamplingParams(temperature, top_p=0.95 if temperature else 1.0, seed=11 if temperature else None)
    runner = GraphedRunner(models.spec(budget, speculative))
    tokens, sizes, counts = run_alone(runner, 0, RowRequest(prompt, n, sampling))
    reference = GraphedDecoder(models.model, models.drafter if speculative else None, budget=budget,
                               policy_buckets=POLICY_BUCKETS, policy_costs=POLICY_COSTS)
    expected = reference.generate(prompt, n, sampling)
    assert tokens == expected.output_ids
    assert sizes == expected.stats.tree_sizes and counts == expected.stats.acceptance_lengths
    if temperature == 0.0:
        assert tokens == models.solo_ids(prompt, n)
    if speculative:
        assert max(counts) > 1, "no step accepted a draft token: the test would not see a speculative step"


def test_rows_of_a_stack_are_independent(models):
    """Four rows: admitted at different steps, different lengths, greedy and sampled, one released early; each
    row's tokens equal what it gives alone on a fresh runner."""
    stack = graphed_rows(models.spec(None), 4)
    assert isinstance(stack, RowStack) and stack.max_batch == 4
    rows = {
        0: RowRequest(models.encode("def add(a, b):"), 30, SamplingParams()),
        1: RowRequest(models.encode("hello"), 12, SamplingParams(0.8, seed=3)),
        2: RowRequest(models.encode("a much longer prompt, with punctuation: (1, 2)"), 25, SamplingParams()),
        3: RowRequest(models.encode("x"), 40, SamplingParams(1.2, top_k=5, seed=9)),
    }
    admit_at = {0: 0, 1: 0, 2: 3, 3: 7}  # rows 2 and 3 join while 0 and 1 run
    release_at = {3: 15}  # row 3's client goes away after 15 steps
    got: dict[int, list[int]] = {slot: [] for slot in rows}
    live: set[int] = set()
    for step in range(200):
        for slot, at in admit_at.items():
            if at == step:
                stack.admit(slot, rows[slot])
                live.add(slot)
        for slot in [s for s in live if release_at.get(s) == step]:
            stack.release(slot)
            live.discard(slot)
        if not live:
            break
        out = stack.step()
        assert set(out) == live, "every admitted row commits in every step"
        for slot, result in out.items():
            got[slot] += result.tokens
            if len(got[slot]) >= rows[slot].max_new_tokens:
                stack.release(slot)
                live.discard(slot)
    for slot, row in rows.items():
        alone, _, _ = run_alone(GraphedRunner(models.spec(None)), 0, row)
        if slot in release_at:
            assert got[slot] == alone[: len(got[slot])] and len(got[slot]) < row.max_new_tokens
        else:
            assert got[slot][: row.max_new_tokens] == alone
        if row.sampling.greedy:
            assert alone == models.solo_ids(row.prompt_ids, row.max_new_tokens)


@pytest.mark.parametrize("budget", [4, None])
def test_a_row_that_outgrows_its_decoder_moves_to_a_bigger_one(models, budget):
    """Decoders from 256 slots, rows starting with room for 32 more tokens: a 300-token answer to a 100-token prompt
    starts in the 256-slot decoder (admission picks it) and moves to a 512-slot one near slot 256, prefilling what it
    has committed; its tokens are still the target's own greedy output. A short request afterwards runs in the small
    decoder again."""
    runner = GraphedRunner(models.spec(budget), initial_capacity=256, growth_tokens=32)
    assert runner.capacities == [256]
    prompt = models.encode("def add(a, b):\n    return a + b\n" * 3)[:100]
    tokens, sizes, counts = run_alone(runner, 0, RowRequest(prompt, 300, SamplingParams()))
    assert runner.capacities == [256, 512] and runner.decoder.capacity == 512
    assert tokens == models.solo_ids(prompt, 300)
    assert sum(counts) + 1 >= 300 and max(counts) > 1
    short = models.encode("x")
    tokens, _, _ = run_alone(runner, 0, RowRequest(short, 10, SamplingParams()))
    assert runner.decoder.capacity == 256 and tokens == models.solo_ids(short, 10)


def test_a_request_that_fits_never_moves(models):
    runner = GraphedRunner(models.spec(4), initial_capacity=256, growth_tokens=32)
    prompt = models.encode("a" * 150)
    run_alone(runner, 0, RowRequest(prompt, 30, SamplingParams()))
    assert runner.capacities == [256]


def test_the_runner_refuses_what_cannot_run(models):
    runner = GraphedRunner(models.spec(0))
    with pytest.raises(DFlashInputError, match="outside the target vocabulary"):
        runner.admit(0, RowRequest([3, 64, 5], 4, SamplingParams()))
    with pytest.raises(DFlashInputError, match="exceeds the target's max_position_embeddings=512"):
        runner.admit(0, RowRequest([3] * 500, 20, SamplingParams()))
    with pytest.raises(DFlashInputError, match="slot=1 does not exist"):
        runner.admit(1, RowRequest([3], 4, SamplingParams()))
    runner.admit(0, RowRequest([3, 4], 4, SamplingParams()))
    with pytest.raises(DFlashInputError, match="slot 0 is busy"):
        runner.admit(0, RowRequest([3], 4, SamplingParams()))
    with pytest.raises(DFlashInputError, match="max_model_len=9999 must be in 1.."):
        GraphedRunner(models.spec(0), max_model_len=9999)


# ------------------------------------------------------------------------------------ RowOutput


def _request(max_tokens: int = 100, stop: tuple[str, ...] = (), stop_ids: frozenset[int] = frozenset()):
    return GenerationRequest("test", [2], max_tokens, SamplingParams(), stop=stop, stop_token_ids=stop_ids)


def _chunks(tokenizer, request, ids: list[int], rng: random.Random) -> tuple[list[str], RowOutput]:
    output = RowOutput(tokenizer, request)
    chunks, i = [], 0
    while i < len(ids) and not output.finished:
        n = rng.randint(1, 4)
        chunks.append(output.push(ids[i : i + n]))
        i += n
    return chunks, output


def test_stop_strings_end_the_text_before_them_whatever_the_chunking():
    tokenizer = char_tokenizer()
    text = "the answer is 42. done. the end"
    ids = list(tokenizer(text)["input_ids"])
    rng = random.Random(0)
    cases = [((". d",), "the answer is 42"), (("end", "42"), "the answer is "), (("zzz",), text),
             (("answer", "the a"), ""), ((" the end",), "the answer is 42. done.")]
    for stops, expected in cases:
        for _ in range(20):
            chunks, output = _chunks(tokenizer, _request(max_tokens=len(ids), stop=stops), ids, rng)
            assert "".join(chunks) == expected, (stops, chunks)
            for chunk in chunks:  # no chunk ever shows a stop string, not even one cut later
                assert not any(stop in chunk for stop in stops)
            assert output.finish_reason == ("length" if expected == text else "stop")


def test_stop_tokens_and_the_length_limit_cut_the_tokens():
    tokenizer = char_tokenizer()
    ids = list(tokenizer("abcdefghij")["input_ids"])
    stop_id = ids[4]  # "e"
    output = RowOutput(tokenizer, _request(stop_ids=frozenset({stop_id})))
    assert output.push(ids[:3]) + output.push(ids[3:8]) == "abcde" and output.finish_reason == "stop"
    assert output.token_ids == ids[:5]
    assert output.push(ids[8:]) == ""  # nothing after the end
    output = RowOutput(tokenizer, _request(max_tokens=6))
    assert output.push(ids[:4]) + output.push(ids[4:]) == "abcdef" and output.finish_reason == "length"
    assert output.token_ids == ids[:6]


def test_chunks_concatenate_to_the_decoded_text():
    """Multi-byte characters split over byte tokens (a Llama-style byte-fallback tokenizer), random chunkings: the
    streamed chunks are the final decode exactly, and a held-back stop-string prefix is released when it does not
    become one."""
    from test_streaming import byte_fallback_tokenizer

    tokenizer = byte_fallback_tokenizer(clean_up=True)
    text = "Party 🎉🎉 and 你好，世界！ Café crème — done?\n def f(x): return x"
    ids = list(tokenizer(text)["input_ids"])
    rng = random.Random(1)
    for _ in range(30):
        chunks, output = _chunks(tokenizer, _request(max_tokens=len(ids), stop=("dx", "Caf!")), ids, rng)
        assert output.finish_reason == "length"
        assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=True)
