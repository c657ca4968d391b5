"""The model side of the server (tensorrt_llm_dflash.serve.runner) and one request's output (serve.sequence).

* GraphedRunner at one row replays GraphedDecoder.generate step by step: the same tokens, the same tree sizes
  and acceptance per step, greedy and seeded sampling, AR / chain / DDTree / the cost-aware tree.
* GraphedRunner at four rows is one batched decoder: every step is one forward over the rows (the batch bucket
  grows with the rows in flight); rows admitted mid-run, released early, of different lengths and
  temperatures each give what that request gives alone (a fixed tree: token for token at every temperature;
  the cost-aware tree, whose size is the batch's: greedy rows token for token); free rows below busy ones are
  packed so that the bucket shrinks; a long request grows the state without disturbing the others.
* max_model_len leaves room for one step's writes (block or tree, whichever is larger) past the last position
  (issue 35's compaction write past the cache, which the old sizing by tree repeated).
* RowOutput cuts at stop tokens, the length limit and the first stop string (never sending a stop string,
  whatever the chunking), and its chunks concatenate to the decoded text.
"""

from __future__ import annotations

import random

import pytest
import torch
from serve_support import POLICY_BUCKETS, POLICY_COSTS, TinyModels
from test_batched import record_choices
from tiny_dirs import char_tokenizer
from tiny_models import hf_greedy, tiny_drafter, tiny_target

from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.graphed import GraphedDecoder
from tensorrt_llm_dflash.sampling import SamplingParams
from tensorrt_llm_dflash.serve.runner import BatchRunner, DecoderSpec, GraphedRunner, RowRequest, graphed_rows
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


ROWS = {
    0: RowRequest([], 30, SamplingParams()),
    1: RowRequest([], 12, SamplingParams(0.8, seed=3)),
    2: RowRequest([], 25, SamplingParams()),
    3: RowRequest([], 40, SamplingParams(1.2, top_k=5, seed=9)),
}
PROMPTS = {0: "def add(a, b):", 1: "hello", 2: "a much longer prompt, with punctuation: (1, 2)", 3: "x"}


def run_together(runner: GraphedRunner, rows: dict[int, RowRequest], admit_at: dict[int, int],
                 release_at: dict[int, int]) -> tuple[dict[int, list[int]], list[int]]:
    """Drive the runner as the engine does; (tokens per slot, the batch bucket of each decode step)."""
    got: dict[int, list[int]] = {slot: [] for slot in rows}
    buckets: list[int] = []
    live: set[int] = set()
    for step in range(300):
        for slot, at in admit_at.items():
            if at == step:
                runner.admit(slot, rows[slot])
                live.add(slot)
        for slot in [s for s in live if release_at.get(s) == step]:
            runner.release(slot)
            live.discard(slot)
        if not live:
            break
        out = runner.step()
        assert set(out) == live, "every admitted row commits in every step"
        if any(not result.is_prefill for result in out.values()):
            buckets.append(runner.decoder.bucket)
        for slot, result in out.items():
            got[slot] += result.tokens
            if len(got[slot]) >= rows[slot].max_new_tokens:
                runner.release(slot)
                live.discard(slot)
    return got, buckets


@pytest.mark.parametrize("budget", [4, None])
def test_rows_of_a_batch_are_independent(models, budget):
    """Four rows in one decoder: admitted at different steps, different lengths, greedy and sampled, one released
    early; each row's tokens equal what it gives alone on a fresh one-row runner (under the cost-aware tree, whose
    size is the batch's, the greedy rows), and the steps really ran several rows at once."""
    rows = {slot: RowRequest(models.encode(PROMPTS[slot]), row.max_new_tokens, row.sampling)
            for slot, row in ROWS.items()}
    runner = graphed_rows(models.spec(budget), 4)
    assert isinstance(runner, GraphedRunner) and runner.max_batch == 4 and runner.decoder.batch == 4
    admit_at = {0: 0, 1: 0, 2: 3, 3: 7}  # rows 2 and 3 join while 0 and 1 run
    release_at = {3: 15}  # row 3's client goes away after 15 steps
    got, buckets = run_together(runner, rows, admit_at, release_at)
    assert max(buckets) == 4 and min(buckets) <= 2, buckets  # batched, and the bucket followed the rows
    for slot, row in rows.items():
        alone, _, _ = run_alone(GraphedRunner(models.spec(budget)), 0, row)
        if slot in release_at:
            assert len(got[slot]) < row.max_new_tokens
        if budget is None and not row.sampling.greedy:
            assert len(got[slot]) >= min(row.max_new_tokens, 1) and all(0 <= t < 64 for t in got[slot])
            continue
        assert got[slot][: row.max_new_tokens] == alone[: len(got[slot])], slot
        if row.sampling.greedy:
            assert alone == models.solo_ids(row.prompt_ids, row.max_new_tokens)


def test_the_server_never_paces_a_batch_by_its_slowest_row(models, monkeypatch):
    """A server cannot tell the last requests of a burst from clients that send the next request as soon as one is
    answered (nobody waits at any step either way), so its steps use the batch rule: the chooser never gets the
    rows' remaining tokens, even with several rows and an empty queue."""
    calls = record_choices(monkeypatch)
    runner = GraphedRunner(models.spec(None), max_batch=4)
    for slot, text in enumerate(("ab", "def add(a, b):", "hello")):
        runner.admit(slot, RowRequest(models.encode(text), 10, SamplingParams()))
    for _ in range(6):
        runner.step()
    assert calls and all(left is None for _, left in calls) and max(rows for rows, _ in calls) == 3


def test_free_rows_below_busy_ones_are_packed(models):
    """Three requests in rows 0-2; rows 0 and 1 finish: the third moves to row 0 and steps in bucket 1. Its tokens and
    its acceptance per step are those of its solo run (its cache and its drafter context moved with it)."""
    runner = GraphedRunner(models.spec(4), max_batch=4)
    prompts = [models.encode(text) for text in ("ab", "cd", "def add(a, b):")]
    lengths = [6, 6, 60]
    for slot, prompt in enumerate(prompts):
        runner.admit(slot, RowRequest(prompt, lengths[slot], SamplingParams()))
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    counts: list[int] = []
    buckets = []
    while runner._row_of:
        for slot, result in runner.step().items():
            got[slot] += result.tokens
            if slot == 2 and not result.is_prefill:
                counts.append(len(result.tokens))
            if len(got[slot]) >= lengths[slot]:
                runner.release(slot)
        buckets.append(runner.decoder.bucket)
    assert runner.decoder.requests == {} and buckets[-1] == 1 and 4 in buckets, buckets
    for slot, prompt in enumerate(prompts):
        assert got[slot][: lengths[slot]] == models.solo_ids(prompt, lengths[slot])
    _, _, alone = run_alone(GraphedRunner(models.spec(4)), 0, RowRequest(prompts[2], 60, SamplingParams()))
    assert counts == alone and max(counts) > 1


@pytest.mark.parametrize("budget", [4, None])
def test_a_long_request_grows_the_state_and_the_other_rows_keep_their_tokens(models, budget):
    """A 300-token answer to a 100-token prompt in a runner of 256 slots per row, beside short requests that come
    and go: the state grows (every row copied), and every answer is its own greedy output."""
    runner = GraphedRunner(models.spec(budget), max_batch=2, initial_capacity=256)
    assert runner.capacity == 256
    long_prompt = models.encode("def add(a, b):\n    return a + b\n" * 3)[:100]
    shorts = [models.encode(text) for text in ("x", "hello", "(1, 2)", "abc", "zz")]
    rows = {0: RowRequest(long_prompt, 300, SamplingParams())}
    rows.update({1 + i: RowRequest(p, 50, SamplingParams()) for i, p in enumerate(shorts)})
    got: dict[int, list[int]] = {slot: [] for slot in rows}
    runner.admit(0, rows[0])
    live = {0: 0}  # runner slot -> request
    queue = list(range(1, len(rows)))
    while live:
        if 1 not in live and queue:
            live[1] = queue.pop(0)
            runner.admit(1, rows[live[1]])
        for slot, result in runner.step().items():
            request = live[slot]
            got[request] += result.tokens
            if len(got[request]) >= rows[request].max_new_tokens:
                runner.release(slot)
                del live[slot]
    assert runner.capacity >= 100 + 300 and not queue
    for request, row in rows.items():
        assert got[request][: row.max_new_tokens] == models.solo_ids(row.prompt_ids, row.max_new_tokens), request


def test_max_model_len_leaves_one_steps_writes_past_the_last_position():
    """Block 16, DDTree 3 (a 4-node tree): a step writes 16 slots past ``past`` (the compaction), not 4. A target of
    500 positions holds at most 512 slots per row (positions + 256, in steps of 256), so a row holds 496 tokens; the
    old sizing (positions, less one tree + 1) said 500 and a 500-token request compacted past the cache."""
    model = tiny_target("qwen3", seed=1, max_positions=500)
    drafter = tiny_drafter(model, block_size=16, seed=1)
    runner = GraphedRunner(DecoderSpec(model, drafter, budget=3), initial_capacity=256)
    assert runner.decoder.span == 16 and runner.max_model_len == 512 - 16
    with pytest.raises(DFlashInputError, match="max_model_len=497 must be in 1..496"):
        GraphedRunner(DecoderSpec(model, drafter, budget=3), max_model_len=497)
    with pytest.raises(DFlashInputError, match="exceeds the target's max_position_embeddings=496"):
        runner.admit(0, RowRequest([5] * 400, 97, SamplingParams()))
    prompt = [int(t) for t in torch.randint(2, 64, (400,), generator=torch.Generator().manual_seed(0))]
    tokens, _, _ = run_alone(runner, 0, RowRequest(prompt, 96, SamplingParams()))
    assert tokens == hf_greedy(model, prompt, 96) and runner.capacity == 512


def test_the_runner_refuses_what_cannot_run(models):
    runner = GraphedRunner(models.spec(0))
    with pytest.raises(DFlashInputError, match="outside the target vocabulary"):
        runner.admit(0, RowRequest([3, 64, 5], 4, SamplingParams()))
    with pytest.raises(DFlashInputError, match="exceeds the target's max_position_embeddings=512"):
        runner.admit(0, RowRequest([3] * 500, 20, SamplingParams()))
    with pytest.raises(DFlashInputError, match="slot=1 does not exist"):
        runner.admit(1, RowRequest([3], 4, SamplingParams()))
    with pytest.raises(DFlashInputError, match="needs a seed"):
        runner.admit(0, RowRequest([3], 4, SamplingParams(0.7)))
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


def test_a_stop_string_ends_the_tokens_at_the_one_that_completes_it():
    """With a real BPE tokenizer a stop string is often completed inside a word that the detokenizer still holds back
    (" Paris" for "Par"): the output must end at that token whatever the chunking (usage counts it, decoding stops
    there), not at the later token that releases the word."""
    from tensorrt_llm_dflash.target import load_tokenizer

    tokenizer = load_tokenizer()
    rng = random.Random(3)
    cases = [("The capital of France is Paris, a city of light and", "Par"),
             ("x = 1\ndef fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)", "fib"),
             ("one two three four five six", "thr")]
    held = 0
    for text, stop in cases:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        # The fewest tokens whose text holds the stop string (the one completing it is the last of them).
        need = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
        assert need < len(ids) - 2  # tokens follow: stopping late would show
        probe = RowOutput(tokenizer, _request(max_tokens=len(ids)))
        held += probe.push(ids[:need]) != tokenizer.decode(ids[:need])  # the detokenizer holds the word back
        for _ in range(20):
            chunks, output = _chunks(tokenizer, _request(max_tokens=len(ids), stop=(stop,)), ids, rng)
            assert output.finish_reason == "stop" and output.token_ids == ids[:need], (text, len(output.token_ids))
            assert "".join(chunks) == tokenizer.decode(ids[:need]).split(stop)[0]
    assert held == len(cases)  # each stop string was completed inside held-back text


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


def test_admitted_rows_hand_their_first_token_over_at_once_and_decode_in_the_next_step(models):
    """``take_admitted``: a row admitted while another runs hands its prefill token over at once, and the very next
    step decodes it (it does not sit one step out); its tokens are still its solo greedy output, the running row's
    too, and a row released right after its hand-over never steps."""
    runner = graphed_rows(models.spec(4), 3)
    prompts = [models.encode(text) for text in ("def add(a, b):", "the answer is", "ab")]
    runner.admit(0, RowRequest(prompts[0], 30, SamplingParams()))
    first = runner.take_admitted()
    assert set(first) == {0} and runner.take_admitted() == {}  # handed over once
    got = {0: list(first[0].tokens), 1: []}
    for _ in range(3):
        got[0] += runner.step()[0].tokens
    runner.admit(1, RowRequest(prompts[1], 20, SamplingParams()))
    runner.admit(2, RowRequest(prompts[2], 5, SamplingParams()))
    taken = runner.take_admitted()
    assert set(taken) == {1, 2} and all(step.is_prefill and len(step.tokens) == 1 for step in taken.values())
    got[1] += taken[1].tokens
    runner.release(2)
    out = runner.step()
    assert set(out) == {0, 1} and not out[1].is_prefill and out[1].tree_size >= 1  # slot 1 decodes at once
    while True:
        for slot, result in out.items():
            got[slot] += result.tokens
        for slot, n in ((0, 30), (1, 20)):
            if slot in runner._row_of and len(got[slot]) >= n:
                runner.release(slot)
        if not runner._row_of:
            break
        out = runner.step()
    assert got[0][:30] == models.solo_ids(prompts[0], 30)
    assert got[1][:20] == models.solo_ids(prompts[1], 20)
