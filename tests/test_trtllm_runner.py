"""DFlashEngineTarget / build_trt_runtime / examples/run.py --engine_dir, through the stand-in:
refusals by name before anything heavy, the reduced draft vocabulary in the engine, T > 0
bookkeeping, and the documented run command end to end."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import standin
from engine_case import MAX_DRAFT_LEN, PROMPTS, build_argv, pytorch_run, word, word_tokenizer, write_checkpoint

from tensorrt_llm_dflash.errors import DFlashConfigError, DFlashInputError


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("runner")
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.trtllm import build

        target, drafter, ckpt = write_checkpoint(root, "qwen3")
        assert build.main(build_argv(ckpt, root / "engine")) == 0
    return root, target, drafter, root / "engine"


def _run_example():
    """examples/run.py as a module, loaded under the active stand-in."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_example", standin.ROOT / "examples" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    return run


def load(engine_dir):
    from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget

    return DFlashEngineTarget(engine_dir, device="cpu")


def test_reduced_draft_vocabulary_engine_equals_pytorch_runtime(tmp_path):
    """A drafter with a 20-token draft vocabulary (d2t): the engine scores the draft rows and
    scatters them into the target vocabulary (model.py, _draft_logits)."""
    with standin.active(tmp_path / "lib"):
        from tensorrt_llm_dflash.decode import speculative_generate
        from tensorrt_llm_dflash.trtllm import build
        from tensorrt_llm_dflash.trtllm.runner import EngineProposer

        target, drafter, ckpt = write_checkpoint(tmp_path, "llama", draft_vocab=20)
        assert build.main(build_argv(ckpt, tmp_path / "engine")) == 0
        engine = load(tmp_path / "engine")
        for budget in (0, 8, MAX_DRAFT_LEN):
            got = speculative_generate(engine, EngineProposer(engine), PROMPTS[0], 16, ddtree_budget=budget)
            expected = pytorch_run(target, drafter, PROMPTS[0], budget, max_new=16)
            assert got.output_ids == expected.output_ids
            assert got.stats.acceptance_lengths == expected.stats.acceptance_lengths


def test_engine_directory_problems_are_named(tmp_path, engine):
    root, _, _, engine_dir = engine
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.trtllm.runner import read_engine_config

        with pytest.raises(DFlashConfigError, match="has no config.json"):
            read_engine_config(tmp_path)
        (tmp_path / "config.json").write_text(json.dumps({"pretrained_config": {"architecture": "LlamaForCausalLM"}}))
        with pytest.raises(DFlashConfigError, match="has architecture 'LlamaForCausalLM'; build a DFlash engine"):
            read_engine_config(tmp_path)
        copy = tmp_path / "copy"
        shutil.copytree(engine_dir, copy)
        (copy / "rank0.engine").unlink()
        with pytest.raises(DFlashConfigError, match="has no rank0.engine"):
            load(copy)


def test_inputs_the_engine_cannot_take_are_refused_by_name(engine):
    root, _, _, engine_dir = engine
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.tree import build_chain
        from tensorrt_llm_dflash.trtllm.runner import EngineProposer

        target = load(engine_dir)
        with pytest.raises(DFlashInputError, match="propose\\(\\) before prefill"):
            EngineProposer(target).propose(3, None)
        too_long = list(range(2, 30)) * 4  # 112 tokens: more than max_seq_len allows with the tree
        with pytest.raises(DFlashInputError, match=r"prompt length 112 does not fit the engine's max_seq_len=136"):
            target.prefill(too_long)
        # 40 tokens fit max_seq_len but not the context profile (max_input_len 32): refused by the flag to change,
        # before the pass; past that check, by the profile's own message.
        with pytest.raises(DFlashInputError, match=r"prompt length 40 exceeds the engine's max_input_len=32"):
            target.prefill(list(range(2, 30)) + list(range(2, 14)))
        target.max_prompt_len = target.max_num_tokens = 1 << 20
        with pytest.raises(DFlashInputError, match=r"engine input 'input_ids' of shape \(40,\) is outside optimization "
                                                   r"profile 0"):
            target.prefill(list(range(2, 30)) + list(range(2, 14)))
        target.max_prompt_len, target.max_num_tokens = load(engine_dir).max_prompt_len, load(engine_dir).max_num_tokens
        target.prefill(PROMPTS[0])
        big = build_chain(3, list(range(MAX_DRAFT_LEN + 1)))
        with pytest.raises(DFlashInputError, match="a tree of 42 nodes exceeds the engine's max_draft_len \\+ 1 = 41"):
            target.compile_tree(big)


def test_sampling_bookkeeping(engine):
    """T > 0: the engine drafts after its greedy bonus while the host samples; every step's host
    and in-graph results are logged, and mismatched drafts are counted exactly where they differ."""
    root, _, _, engine_dir = engine
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.decode import speculative_generate
        from tensorrt_llm_dflash.sampling import SamplingParams
        from tensorrt_llm_dflash.trtllm.runner import EngineProposer

        target = load(engine_dir)
        result = speculative_generate(target, EngineProposer(target), PROMPTS[0], 20,
                                      SamplingParams(temperature=1.0, seed=3), ddtree_budget=8)
        assert len(result.output_ids) == 20 and all(0 <= t < 32 for t in result.output_ids)
        steps = target.walk_log
        assert len(steps) == result.stats.steps - 1  # the last step's bonus is never proposed from
        assert target.mismatched_drafts == sum(graph_bonus != host_bonus for _, graph_bonus, _, host_bonus in steps)
        assert target.mismatched_drafts > 0  # sampling does leave the greedy path on this target


def _args(**kwargs):
    defaults = {"engine_dir": None, "tokenizer_dir": None, "speculative_decoding_mode": "dflash",
                "ddtree_budget": None, "device": "cpu"}
    defaults.update(kwargs)
    return argparse.Namespace(**defaults)


def test_build_trt_runtime_checks_arguments_before_loading(engine, monkeypatch):
    root, _, _, engine_dir = engine
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.trtllm import runner

        loaded = []
        monkeypatch.setattr(runner.DFlashEngineTarget, "__init__", lambda self, *a, **k: loaded.append(a))
        with pytest.raises(DFlashConfigError, match="--engine_dir is required"):
            runner.build_trt_runtime(_args())
        with pytest.raises(DFlashInputError, match="a DFlash engine always drafts"):
            runner.build_trt_runtime(_args(engine_dir=str(engine_dir), speculative_decoding_mode="none"))
        with pytest.raises(DFlashInputError, match="--ddtree_budget=41 exceeds the engine's max_draft_len=40"):
            runner.build_trt_runtime(_args(engine_dir=str(engine_dir), ddtree_budget=41))
        assert not loaded


def test_run_py_generates_with_the_engine(engine, tmp_path, capsys):
    """The documented command: examples/run.py --engine_dir ENGINE --tokenizer_dir TOKENIZER
    --speculative_decoding_mode dflash --use_py_session ... gives the PyTorch runtime's output."""
    root, target, drafter, engine_dir = engine
    word_tokenizer(tmp_path / "tokenizer")
    with standin.active(root / "lib"):
        run = _run_example()
        out = tmp_path / "out.json"
        code = run.main(["--engine_dir", str(engine_dir), "--tokenizer_dir", str(tmp_path / "tokenizer"),
                         "--speculative_decoding_mode", "dflash", "--use_py_session", "--no_chat_template",
                         "--input_text", " ".join(word(t) for t in PROMPTS[0]), "--max_output_len", "12",
                         "--ddtree_budget", "8", "--device", "cpu", "--output_json", str(out)])
    assert code == 0, capsys.readouterr().err
    record = json.loads(out.read_text())["outputs"][0]
    expected = pytorch_run(target, drafter, PROMPTS[0], 8, max_new=12)
    # Token 1 is the tokenizer's EOS: generation ends right after it, as with the PyTorch runtime.
    stop = expected.output_ids.index(1) + 1 if 1 in expected.output_ids else len(expected.output_ids)
    assert record["output_ids"] == expected.output_ids[:stop]
    assert record["output_text"] == " ".join(word(t) for t in record["output_ids"] if t != 1)


def test_run_py_default_is_the_cost_aware_tree_on_the_engine(engine, tmp_path, capsys):
    """No --ddtree_budget: the engine runs the same cost-aware policy through the shared loop;
    its cost curve is measured on the engine (passes up to max_draft_len + 1 nodes), trees never
    exceed the engine's size, and the output is the PyTorch runtime's (AR's) output."""
    root, target, drafter, engine_dir = engine
    word_tokenizer(tmp_path / "tokenizer")
    with standin.active(root / "lib"):
        run = _run_example()
        out = tmp_path / "out.json"
        prompt = PROMPTS[0] + PROMPTS[0][:6]  # repeats: lookup branches have candidates
        code = run.main(["--engine_dir", str(engine_dir), "--tokenizer_dir", str(tmp_path / "tokenizer"),
                         "--no_chat_template", "--input_text", " ".join(word(t) for t in prompt),
                         "--max_output_len", "12", "--device", "cpu", "--output_json", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "measuring this machine's verify cost curve" in err
    doc = json.loads(out.read_text())
    assert doc["mode"] == f"cost-aware DDTree (<= {MAX_DRAFT_LEN} nodes, lookup branches)"
    record = doc["outputs"][0]
    expected = pytorch_run(target, drafter, prompt, 0, max_new=12)
    stop = expected.output_ids.index(1) + 1 if 1 in expected.output_ids else len(expected.output_ids)
    assert record["output_ids"] == expected.output_ids[:stop]
    assert max(record["stats"]["tree_sizes"]) <= MAX_DRAFT_LEN + 1
