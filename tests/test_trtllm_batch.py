"""The engine runner at batch > 1 (issue 37, item 5), through the stand-in.

Engines built with ``--max_batch_size 4`` (tiny Qwen3 bf16 / Llama fp16 targets, DFlash and DFlash2
drafters, continuous and paged KV) run several prompts in one step loop (``trtllm/batch.py``): one
context pass per admission, one generation pass per step verifying every active row's tree, rows
with their own prompt length, tree, acceptance and stop condition, a finished row leaving at the
step boundary and a waiting prompt taking its row. In the stand-in's exact numerics every row's
tokens, per-step acceptance and tree sizes equal the PyTorch runtime's for that prompt alone (T = 0);
at T > 0 every row equals the same engine's one-prompt run with that row's seed, whatever the other
rows are. The server's ``BatchRunner`` over it (``trtllm/serve_runner.py``) and
``examples/run.py --input_text a b c d`` are held to the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import standin
from engine_case import MAX_DRAFT_LEN, PROMPTS, build_argv, word, word_tokenizer, write_checkpoint

from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.errors import DFlashInputError
from tensorrt_llm_dflash.sampling import SamplingParams

ROWS = 4
MAX_NEW = 16
#: Six prompts of different lengths for four rows: two wait for a row to free.
BATCH_PROMPTS = [*PROMPTS, [5, 6, 7, 8, 9], [30, 2, 2, 17, 4, 4, 9, 28, 13], [11, 25, 3, 19]]
#: Per prompt: max_new_tokens (row 0 ends first, so the last row moves into its place) and the position of the
#: expected output whose token becomes that prompt's stop token (None: no stop token).
LIMITS = [3, MAX_NEW, 11, MAX_NEW, 7, MAX_NEW]
STOP_AT = [None, 9, None, None, None, 5]


def build(root: Path, ckpt: Path, **kwargs) -> Path:
    from tensorrt_llm_dflash.trtllm import build as trtllm_build

    engine = root / "engine"
    assert trtllm_build.main(build_argv(ckpt, engine, max_batch_size=ROWS, **kwargs)) == 0
    return engine


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """max_batch_size 4: a Qwen3 DFlash engine (continuous KV), a Llama DFlash engine (paged KV, 16-token blocks)
    and a Qwen3 DFlash2 engine (the nested layout, sliding window)."""
    from test_trtllm_dflash2_engine import write_checkpoint as dflash2_checkpoint

    root = tmp_path_factory.mktemp("batch_engines")
    built = {}
    with standin.active(root / "lib"):
        target, drafter, ckpt = write_checkpoint(root / "qwen3", "qwen3")
        built["qwen3"] = (target, drafter, build(root / "qwen3", ckpt))
        target, drafter, ckpt = write_checkpoint(root / "llama", "llama")
        built["llama-paged"] = (target, drafter, build(root / "llama", ckpt, kv_cache="paged",
                                                          extra=("--tokens_per_block", "16")))
        target, drafter, ckpt = dflash2_checkpoint(root / "dflash2", "qwen3")
        built["dflash2"] = (target, drafter, build(root / "dflash2", ckpt))
    return root, built


def reference(target, drafter, prompt, budget, max_new, stops=(), sampling=None):
    """The PyTorch runtime on one prompt (float64 target, the drafter the engine was converted from)."""
    from tensorrt_llm_dflash.dflash2 import proposer_for_target
    from tensorrt_llm_dflash.target import HFTargetVerifier

    verifier = HFTargetVerifier(target, drafter.config.target_layer_ids)
    return speculative_generate(verifier, proposer_for_target(drafter, target), prompt, max_new, sampling=sampling,
                                stop_token_ids=stops, ddtree_budget=budget)


class Spy:
    """Records every pass and row move of a DFlashEngineTarget: (kind, first row, rows)."""

    def __init__(self, target) -> None:
        self.calls: list[tuple[str, int, int]] = []
        for name in ("prefill_rows", "verify_rows", "move_row"):
            original = getattr(target, name)

            def wrapped(*args, _name=name, _original=original):
                if _name == "move_row":
                    self.calls.append((_name, args[0], args[1]))
                else:
                    rows = list(args[0])
                    self.calls.append((_name, rows[0], len(rows)))
                return _original(*args)

            setattr(target, name, wrapped)

    def of(self, kind: str) -> list[tuple[int, int]]:
        return [(a, b) for k, a, b in self.calls if k == kind]


def requests_and_references(target, drafter, budget):
    """The six requests (stop tokens taken from each prompt's own PyTorch output) and their PyTorch results."""
    from tensorrt_llm_dflash.trtllm.batch import BatchRequest

    requests, expected = [], []
    for prompt, limit, stop_at in zip(BATCH_PROMPTS, LIMITS, STOP_AT):
        stops = ()
        if stop_at is not None:
            stops = (reference(target, drafter, prompt, budget, limit).output_ids[stop_at],)
        requests.append(BatchRequest(prompt, limit, stop_token_ids=stops))
        expected.append(reference(target, drafter, prompt, budget, limit, stops))
    return requests, expected


# ------------------------------------------------------------------------- T = 0


@pytest.mark.parametrize(("name", "budgets"), [("qwen3", (0, MAX_DRAFT_LEN)), ("llama-paged", (8, MAX_DRAFT_LEN)),
                                               ("dflash2", (0, 8))])
def test_each_row_of_a_batch_equals_the_pytorch_runtime(engines, name, budgets):
    """Six prompts through four rows: every row's tokens, acceptance per step, tree sizes and finish reason are
    the PyTorch runtime's for that prompt alone; every step verifies all active rows in one generation pass; the
    row that ends first is not the last, so the last row moves into its place (a KV copy for the continuous
    cache, a swap of block tables for the paged one) and the waiting prompts are prefilled mid-run into the
    freed rows."""
    root, built = engines
    target, drafter, engine_dir = built[name]
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.trtllm.batch import EngineBatch
        from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget

        engine = DFlashEngineTarget(engine_dir, device="cpu", rows=ROWS)
        assert engine.paged == (name == "llama-paged") and (engine.dflash2 is not None) == (name == "dflash2")
        longest = 0
        for budget in budgets:
            requests, expected = requests_and_references(target, drafter, budget)
            spy = Spy(engine)
            results = EngineBatch(engine, budget).generate(requests)
            for i, (got, want) in enumerate(zip(results, expected)):
                assert got.output_ids == want.output_ids, (name, budget, i)
                assert got.stats.acceptance_lengths == want.stats.acceptance_lengths, (name, budget, i)
                assert got.stats.tree_sizes == want.stats.tree_sizes, (name, budget, i)
                assert got.finish_reason == want.finish_reason, (name, budget, i)
                longest = max(longest, max(got.stats.acceptance_lengths, default=0))
            assert [r.finish_reason for r in results].count("stop") == 2
            verifies = spy.of("verify_rows")
            assert all(first == 0 for first, _ in verifies) and max(n for _, n in verifies) == ROWS
            assert len(verifies) < sum(r.stats.steps for r in results) / 2  # rows share their passes
            prefills = spy.of("prefill_rows")
            assert prefills[0] == (0, ROWS) and any(first > 0 for first, _ in prefills[1:])  # admitted mid-run
            assert ("move_row", ROWS - 1, 0) in spy.calls  # row 0 (3 tokens) ended first
        # Draft tokens accepted in some step, or the comparison proves little (the random drafters accept one draft
        # token at most on these prompts once no step verifies past the token budget).
        assert longest >= 2


def test_a_finished_row_that_stays_rides_along_and_commits_nothing(engines):
    """A row whose request has ended but was not released yet (a scheduler's choice) verifies its root alone
    in the shared pass and commits nothing; the other rows are unaffected and it leaves cleanly later."""
    root, built = engines
    target, drafter, engine_dir = built["qwen3"]
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.trtllm.batch import BatchRequest, EngineBatch
        from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget

        batch = EngineBatch(DFlashEngineTarget(engine_dir, device="cpu", rows=2), 8)
        assert batch.step() == {}
        short, long = batch.admit([BatchRequest(PROMPTS[1], 2), BatchRequest(PROMPTS[0], 12)])
        while not long.done:
            committed = batch.step()
            assert short not in committed or not short.done or committed[short]
        assert short.done and len(short.output) == 2 and short.stats.new_tokens == 2
        assert long.result().output_ids == reference(target, drafter, PROMPTS[0], 8, 12).output_ids
        assert short.result().output_ids == reference(target, drafter, PROMPTS[1], 8, 2).output_ids
        batch.release(short)
        batch.release(short)  # no longer in the batch: nothing happens
        batch.release(long)
        assert batch.free_rows == 2 and batch.step() == {}


# ------------------------------------------------------------------------- T > 0


def _solo(engine_dir, request, budget):
    from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget, EngineProposer

    engine = DFlashEngineTarget(engine_dir, device="cpu")
    return speculative_generate(engine, EngineProposer(engine), request.prompt_ids, request.max_new_tokens,
                                request.sampling, request.stop_token_ids, ddtree_budget=budget)


@pytest.mark.parametrize(("name", "budget"), [("qwen3", 8), ("dflash2", 0)])
def test_rows_at_t_above_zero_reproduce_their_one_prompt_runs(engines, name, budget):
    """Per-row seeds and sampling settings (T 1.0, 0.7 with top_p, 1.2 with top_k, and a greedy row): each row's
    tokens and acceptance equal the same engine's one-prompt run with that seed (DFlash DDTree; the DFlash2
    sampled chain with its rejection sampling), and a batch of the same requests in another order gives every
    request the same output: a row's draws come from its own generator and its logits from its own tokens."""
    root, built = engines
    _, _, engine_dir = built[name]
    settings = [SamplingParams(1.0, seed=3), SamplingParams(0.7, top_p=0.9, seed=11), SamplingParams(),
                SamplingParams(1.2, top_k=5, seed=5)]
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.trtllm.batch import BatchRequest, EngineBatch
        from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget

        requests = [BatchRequest(p, MAX_NEW, s) for p, s in zip(BATCH_PROMPTS, settings)]
        engine = DFlashEngineTarget(engine_dir, device="cpu", rows=ROWS)
        batched = EngineBatch(engine, budget).generate(requests)
        reordered = EngineBatch(engine, budget).generate(requests[::-1])[::-1]
        for request, got, again in zip(requests, batched, reordered):
            solo = _solo(engine_dir, request, budget)
            assert got.output_ids == solo.output_ids == again.output_ids, request.sampling
            assert got.stats.acceptance_lengths == solo.stats.acceptance_lengths, request.sampling
        # The first row sampled: it left its prompt's greedy output.
        assert batched[0].output_ids != _solo(engine_dir, BatchRequest(BATCH_PROMPTS[0], MAX_NEW), budget).output_ids


# ------------------------------------------------------------------------- server


def test_serve_runner_rows_equal_the_pytorch_runtime(engines):
    """``EngineServeRunner`` driven as the server's scheduler drives a ``BatchRunner``: prefills reported by the
    next step with tree size 0, every running row committing at least one token per step, a client leaving
    mid-run (its slot released, a new request admitted into it), rows released as they reach max_new_tokens.
    Every request's tokens are the PyTorch runtime's for that prompt (the released one: a prefix of them)."""
    root, built = engines
    target, drafter, engine_dir = built["qwen3"]
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.serve.runner import BatchRunner, RowRequest
        from tensorrt_llm_dflash.trtllm.serve_runner import EngineServeRunner

        runner = EngineServeRunner(engine_dir, ddtree_budget=8, device="cpu")
        assert isinstance(runner, BatchRunner)
        assert (runner.max_batch, runner.vocab_size) == (ROWS, 32)
        assert runner.max_model_len == runner.target.max_positions and runner.description == (
            "DFlash DDTree budget 8, TensorRT-LLM engine")
        greedy = SamplingParams()
        plan = {0: (PROMPTS[0], 14), 1: (PROMPTS[1], MAX_NEW), 3: (BATCH_PROMPTS[3], 9)}
        got: dict[int, list[int]] = {}
        for slot, (prompt, limit) in plan.items():
            runner.admit(slot, RowRequest(prompt, limit, greedy))
            got[slot] = []
        late = (BATCH_PROMPTS[5], 10)
        left, steps, trees = None, 0, []
        while got:
            results = runner.step()
            steps += 1
            assert set(results) == set(got), (steps, results)
            for slot, step in results.items():
                assert step.tokens and (step.tree_size == 0) == (got[slot] == [])
                trees.append(step.tree_size)
                got[slot] += step.tokens
            if steps == 3:  # the client of slot 1 goes away; a new request takes the slot
                runner.release(1)
                left = got.pop(1)
                plan[1] = late
                runner.admit(1, RowRequest(late[0], late[1], greedy))
                got[1] = []
            for slot in [s for s in got if len(got[s]) >= plan[s][1]]:
                prompt, limit = plan[slot]
                assert got.pop(slot) == reference(target, drafter, prompt, 8, limit).output_ids, slot
                runner.release(slot)
        assert left and left == reference(target, drafter, PROMPTS[1], 8, MAX_NEW).output_ids[: len(left)]
        assert max(trees) > 1 and runner.batch.free_rows == ROWS


def test_serve_runner_refuses_what_it_cannot_run_by_name(engines):
    root, built = engines
    _, _, engine_dir = built["dflash2"]
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.serve.runner import RowRequest
        from tensorrt_llm_dflash.trtllm.serve_runner import EngineServeRunner, default_budget

        with pytest.raises(DFlashInputError, match=r"rows=5 must be between 1 and the engine's max_batch_size=4"):
            EngineServeRunner(engine_dir, max_batch=5, device="cpu")
        with pytest.raises(DFlashInputError, match=r"max_model_len=500 must be in 1\.\.96"):
            EngineServeRunner(engine_dir, max_model_len=500, device="cpu")
        runner = EngineServeRunner(engine_dir, max_batch=2, max_model_len=60, device="cpu")
        assert default_budget(engine_dir) == MAX_DRAFT_LEN == runner.batch.budget
        assert (runner.max_batch, runner.max_model_len) == (2, 60)
        assert runner.description == f"DFlash2 DDTree budget {MAX_DRAFT_LEN}, TensorRT-LLM engine"
        greedy = SamplingParams()
        with pytest.raises(DFlashInputError, match="slot=2 does not exist: this runner has slots 0..1"):
            runner.admit(2, RowRequest(PROMPTS[0], 4, greedy))
        with pytest.raises(DFlashInputError, match="prompt length 40 exceeds the engine's max_input_len=32"):
            runner.admit(0, RowRequest(list(range(2, 30)) + list(range(2, 14)), 4, greedy))
        with pytest.raises(DFlashInputError, match="exceeds the target's max_position_embeddings=60"):
            runner.admit(0, RowRequest(PROMPTS[0], 60, greedy))
        with pytest.raises(DFlashInputError, match=r"prompt token ids \[32\] are outside the target vocabulary"):
            runner.admit(0, RowRequest([3, 32], 4, greedy))
        with pytest.raises(DFlashInputError, match="a sampled request needs a seed"):
            runner.admit(0, RowRequest(PROMPTS[0], 4, SamplingParams(1.0)))
        runner.admit(0, RowRequest(PROMPTS[0], 4, greedy))
        with pytest.raises(DFlashInputError, match="slot 0 is busy"):
            runner.admit(0, RowRequest(PROMPTS[1], 4, greedy))
        runner.release(0)  # before its prefill: it never takes an engine row
        runner.release(1)  # a free slot: nothing happens
        assert runner.step() == {} and runner.batch.free_rows == 2


def test_the_server_serves_an_engine_with_backend_trt(engines, tmp_path):
    """``python -m tensorrt_llm_dflash.serve --engine_dir E --tokenizer_dir T`` (``--backend trt`` implied) on a
    max_batch_size 4 engine, with the official ``openai`` client: four concurrent completions (rows of one step
    loop) and a streamed one, each answer the PyTorch runtime's tokens for its prompt; the engine's name and rows
    in /v1/models and the start-up line."""
    import signal
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from serve_support import server_process

    root, built = engines
    target, drafter, engine_dir = built["qwen3"]
    tokenizer = word_tokenizer(tmp_path / "tokenizer")
    with standin.active(root / "lib") as env:
        command = [sys.executable, "-m", "tensorrt_llm_dflash.serve", "--engine_dir", str(engine_dir),
                   "--tokenizer_dir", str(tmp_path / "tokenizer"), "--ddtree_budget", "8", "--device", "cpu",
                   "--port", "0", "--log_level", "warning"]
    with server_process(command, env, standin.ROOT) as (process, ready):
        assert "'engine'" in ready and "DFlash DDTree budget 8, TensorRT-LLM engine" in ready
        assert f"max_batch_size {ROWS}" in ready
        client = openai.OpenAI(base_url=ready.rsplit(" at ", 1)[1].strip() + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["engine"]
        prompts = BATCH_PROMPTS[:4]

        def complete(prompt: list[int]):
            return client.completions.create(model="engine", prompt=" ".join(word(t) for t in prompt),
                                             max_tokens=10, temperature=0)

        with ThreadPoolExecutor(len(prompts)) as pool:
            responses = list(pool.map(complete, prompts))
        for prompt, response in zip(prompts, responses):
            expected = reference(target, drafter, prompt, 8, 10, stops=(1,)).output_ids  # w01: the EOS
            assert response.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True), prompt
            assert response.usage.completion_tokens == len(expected)
        streamed = client.completions.create(model="engine", prompt=" ".join(word(t) for t in prompts[1]),
                                             max_tokens=10, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == responses[1].choices[0].text
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0


# ------------------------------------------------------------------------ run.py


def _run_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_example", standin.ROOT / "examples" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    return run


def test_run_py_runs_the_prompts_as_one_batch(engines, tmp_path, capsys):
    """``examples/run.py --engine_dir E --input_text a b c d e --ddtree_budget 8`` on a max_batch_size 4 engine:
    one step loop, four rows at a time (the fifth prompt takes a freed row); outputs in prompt order and per-prompt
    stats in the usual format, each prompt's tokens the PyTorch runtime's."""
    root, built = engines
    target, drafter, engine_dir = built["qwen3"]
    word_tokenizer(tmp_path / "tokenizer")
    prompts = BATCH_PROMPTS[:5]
    with standin.active(root / "lib"):
        run = _run_example()
        out = tmp_path / "out.json"
        code = run.main(["--engine_dir", str(engine_dir), "--tokenizer_dir", str(tmp_path / "tokenizer"),
                         "--no_chat_template", "--input_text", *(" ".join(word(t) for t in p) for p in prompts),
                         "--max_output_len", "10", "--ddtree_budget", "8", "--device", "cpu",
                         "--output_json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "running 5 prompts 4 at a time in one step loop (the engine's max_batch_size is 4)" in captured.err
    doc = json.loads(out.read_text())
    assert doc["mode"] == "DDTree budget 8" and doc["status"] == "complete"
    assert [o["prompt"] for o in doc["outputs"]] == [" ".join(word(t) for t in p) for p in prompts]
    headers = [line for line in captured.out.splitlines() if line.startswith("[DDTree budget 8] ")]
    assert headers == [f"[DDTree budget 8] {' '.join(word(t) for t in p)!r}" for p in prompts]
    assert captured.out.count(" target steps, mean tau ") == 5
    for prompt, record in zip(prompts, doc["outputs"]):
        expected = reference(target, drafter, prompt, 8, 10, stops=(1,))  # w01, the tokenizer's EOS
        assert record["output_ids"] == expected.output_ids
        assert record["stats"]["acceptance_lengths"] == expected.stats.acceptance_lengths


def test_batch_rows_follow_the_engine_and_the_mode(engines, tmp_path):
    """One row per prompt up to max_batch_size; one at a time for the cost-aware tree (no --ddtree_budget), with
    --streaming, and on a max_batch_size 1 engine."""
    import argparse

    root, built = engines
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.trtllm.runner import batch_rows

        def rows(name, **kwargs):
            defaults = {"engine_dir": str(built[name][2]), "ddtree_budget": 8, "streaming": False,
                        "input_text": ["a", "b", "c"]}
            return batch_rows(argparse.Namespace(**{**defaults, **kwargs}))

        assert rows("qwen3") == 3 and rows("qwen3", input_text=list("abcdef")) == ROWS
        assert rows("qwen3", ddtree_budget=0) == 3
        assert rows("qwen3", ddtree_budget=None) == 1  # the cost-aware tree
        assert rows("qwen3", streaming=True) == 1
        # DFlash2 too: run.py sizes its selector's tree with the cost-aware policy, a one-row step (a batch of
        # three ran fixed full trees under the policy's name)
        assert rows("dflash2", ddtree_budget=None) == 1
        assert rows("dflash2", ddtree_budget=8) == 3
        config = json.loads((built["qwen3"][2] / "config.json").read_text())
        config["build_config"]["max_batch_size"] = 1  # what --max_batch_size 1 writes
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert batch_rows(argparse.Namespace(engine_dir=str(tmp_path), ddtree_budget=8, streaming=False,
                                             input_text=["a", "b"])) == 1


# ---------------------------------------------------------------------- refusals


def test_batch_inputs_the_engine_cannot_take_are_refused_by_name(engines):
    root, built = engines
    _, _, engine_dir = built["qwen3"]
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.tree import build_chain
        from tensorrt_llm_dflash.trtllm.batch import BatchRequest, EngineBatch
        from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget

        for rows in (0, 5, True, 2.0):
            with pytest.raises(DFlashInputError, match=r"must be between 1 and the engine's max_batch_size=4"):
                DFlashEngineTarget(engine_dir, device="cpu", rows=rows)
        engine = DFlashEngineTarget(engine_dir, device="cpu", rows=3)
        engine.prefill_rows([1], [PROMPTS[1]])
        engine.move_row(1, 1)  # onto itself: nothing changes
        assert engine.row_state[1].prompt_len == 3 and engine.row_state[1].cached_draft is not None
        with pytest.raises(DFlashInputError, match=r"a pass runs on consecutive rows of 0\.\.2, got \[0, 2\]"):
            engine.prefill_rows([0, 2], [PROMPTS[0], PROMPTS[1]])
        with pytest.raises(DFlashInputError, match=r"consecutive rows of 0\.\.2, got \[2, 3\]"):
            engine.prefill_rows([2, 3], [PROMPTS[0], PROMPTS[1]])
        with pytest.raises(DFlashInputError, match="2 rows but 1 prompts or trees"):
            engine.verify_rows([0, 1], [build_chain(3, [])])
        with pytest.raises(DFlashInputError, match=f"ddtree_budget=41 exceeds the engine's max_draft_len={MAX_DRAFT_LEN}"):
            EngineBatch(engine, 41)
        batch = EngineBatch(engine, 8)
        with pytest.raises(DFlashInputError, match="4 prompts for 3 free rows of 3"):
            batch.admit([BatchRequest(PROMPTS[0], 4)] * 4)
        with pytest.raises(DFlashInputError, match=r"prompt token ids \[-1\] are outside the target vocabulary"):
            batch.generate([BatchRequest(PROMPTS[0], 4), BatchRequest([-1], 4)])
        with pytest.raises(DFlashInputError, match="the prompt is empty"):
            batch.admit([BatchRequest([], 4)])
        assert batch.free_rows == 3  # nothing was prefilled


def test_admission_splits_context_passes_at_max_num_tokens(engines):
    """Prompts admitted together share a context pass only as far as the engine's max_num_tokens allows."""
    root, built = engines
    target, drafter, engine_dir = built["qwen3"]
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.trtllm.batch import BatchRequest, EngineBatch
        from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget

        engine = DFlashEngineTarget(engine_dir, device="cpu", rows=3)
        engine.max_num_tokens = 20  # as if built with --max_num_tokens 20
        spy = Spy(engine)
        rows = EngineBatch(engine, 0).admit([BatchRequest(p, 1) for p in PROMPTS])  # 7 + 3 + 12 tokens
        assert spy.of("prefill_rows") == [(0, 2), (2, 1)]
        for prompt, row in zip(PROMPTS, rows):
            assert row.done and row.result().output_ids == reference(target, drafter, prompt, 0, 1).output_ids


def test_run_py_on_an_engine_stops_and_refuses_as_the_pytorch_runtime_does(engines, tmp_path, capsys, monkeypatch):
    """Found by a QA pass: the engine stopped on the tokenizer's EOS only, where the PyTorch runtime stops on the
    model's generation_config (Qwen3 lists two ids); no --tokenizer_dir was a transformers traceback; a prompt past
    --max_input_len failed TensorRT's profile check on the one-row path; a tensor-parallel engine started without
    mpirun failed in its first all-reduce; the output limit was blamed on max_position_embeddings."""
    root, built = engines
    target, drafter, engine_dir = built["qwen3"]
    tokenizer_dir = tmp_path / "tokenizer"
    word_tokenizer(tokenizer_dir)
    prompt = BATCH_PROMPTS[1]
    free = reference(target, drafter, prompt, 8, 10).output_ids
    stop = next(t for t in free[1:] if t != 1)  # a token the run reaches: the model's second stop id
    (tokenizer_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop, 1]}))
    expected = reference(target, drafter, prompt, 8, 10, stops=(stop, 1))
    assert len(expected.output_ids) < len(free)
    text = " ".join(word(t) for t in prompt)
    common = ["--engine_dir", str(engine_dir), "--no_chat_template", "--ddtree_budget", "8", "--device", "cpu"]
    with standin.active(root / "lib"):
        run = _run_example()
        out = tmp_path / "out.json"
        assert run.main([*common, "--tokenizer_dir", str(tokenizer_dir), "--input_text", text, "--max_output_len",
                         "10", "--output_json", str(out)]) == 0, capsys.readouterr().err
        assert json.loads(out.read_text())["outputs"][0]["output_ids"] == expected.output_ids
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            run.main([*common, "--input_text", text])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "--tokenizer_dir: is required: the engine dir" in err
        long_text = " ".join(word(2 + i % 20) for i in range(33))  # max_input_len 32 (engine_case.build_argv)
        assert run.main([*common, "--tokenizer_dir", str(tokenizer_dir), "--input_text", long_text,
                         "--max_output_len", "4"]) == 2
        assert "prompt length 33 exceeds the engine's max_input_len=32" in capsys.readouterr().err
        from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget

        engine = DFlashEngineTarget(engine_dir, device="cpu")
        assert run.main([*common, "--tokenizer_dir", str(tokenizer_dir), "--input_text", text,
                         "--max_output_len", str(engine.max_positions)]) == 2
        assert f"exceeds {engine.max_positions_name}={engine.max_positions}" in capsys.readouterr().err
        assert f"max_seq_len {engine.max_seq_len} - max_draft_len" in engine.max_positions_name  # not the model's
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
        assert run.main([*common, "--tokenizer_dir", str(tokenizer_dir), "--input_text", text]) == 2
        assert "was built for 1 ranks (tp_size 1) and this run has 2" in capsys.readouterr().err
