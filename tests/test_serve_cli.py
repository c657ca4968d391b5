"""``python -m tensorrt_llm_dflash.serve``: bad flags (and a port in use) are refused with one line naming the flag
before any model loads; the real command serves tiny model directories on a free port, answers through the
openai client exactly as the target's own greedy decoding, and shuts down cleanly on SIGINT."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch
from serve_support import server_process
from tiny_dirs import save_tiny_target_dir
from tiny_models import hf_greedy, tiny_drafter

from tensorrt_llm_dflash.compat import chat_token_ids
from tensorrt_llm_dflash.serve import __main__ as serve_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.target import load_target

    root = tmp_path_factory.mktemp("serve_cli")
    target_dir = save_tiny_target_dir(root / "target", arch="qwen3", seed=2, layers=4)
    model, _ = load_target(target_dir, dtype=torch.float32)
    save_dflash_drafter(tiny_drafter(model, block_size=4, seed=2), root / "drafter", dtype=torch.float32)
    return target_dir, root / "drafter"


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a model was loaded although the flags are bad")

    monkeypatch.setattr(serve_main, "load_models", refuse)


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        serve_main.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, f"more than one line: {err!r}"
    return err


@pytest.mark.parametrize("argv, says", [
    (["--port", "70000"], "argument --port: must be an integer in 0..65535, got 70000"),
    (["--max_batch_size", "0"], "argument --max_batch_size: must be an integer in 1..256, got 0"),
    (["--max_queue", "-1"], "argument --max_queue: must be an integer"),
    (["--max_model_len", "ten"], "argument --max_model_len: must be an integer >= 1, got 'ten'"),
    (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["--backend", "trt"], "argument --backend: 'trt' needs --engine_dir"),
    (["--speculative_decoding_mode", "none", "--ddtree_budget", "4"], "argument --ddtree_budget: needs "
                                                                      "--speculative_decoding_mode dflash"),
    (["--no_lookup", "--ddtree_budget", "4"], "argument --no_lookup: applies to the cost-aware tree"),
    (["--size_choice", "ahead", "--ddtree_budget", "4"], "argument --size_choice: applies to the cost-aware tree"),
    (["--size_choice", "later"], "argument --size_choice: invalid choice: 'later'"),
    (["--speculative_decoding_mode", "none", "--size_choice", "in_step"], "argument --size_choice: needs "
                                                                           "--speculative_decoding_mode dflash"),
    (["--target_model_dir", "/no/such/model"], "argument --target_model_dir: '/no/such/model' does not exist"),
    (["--served_model_name", " "], "argument --served_model_name: must be a non-empty name"),
])
def test_bad_flags_are_refused_before_any_model_loads(argv, says, capsys, no_model_loads):
    assert says in _refused(argv, capsys)


@pytest.fixture
def engine_config(tmp_path):
    """An engine directory's config.json only (max_draft_len 8, max_batch_size 4): what the checks read."""
    import json

    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({
        "pretrained_config": {"architecture": "DFlashForCausalLM", "max_draft_len": 8, "dflash": {"block_size": 4}},
        "build_config": {"max_batch_size": 4}}))
    return engine


@pytest.mark.parametrize("extra, says", [
    (["--ddtree_budget", "9"], "argument --ddtree_budget: 9 exceeds the engine's max_draft_len=8"),
    (["--max_batch_size", "5"], "argument --max_batch_size: 5 exceeds the engine's max_batch_size=4"),
    (["--speculative_decoding_mode", "none"], "argument --speculative_decoding_mode: a DFlash engine always drafts"),
    (["--dtype", "bfloat16"], "argument --dtype: applies to --backend pytorch"),
    (["--no_lookup"], "argument --no_lookup: applies to --backend pytorch"),
    (["--size_choice", "ahead"], "argument --size_choice: applies to --backend pytorch"),
    (["--backend", "pytorch"], "argument --engine_dir: applies to --backend trt"),
])
def test_engine_flags_are_refused_before_the_engine_loads(engine_config, extra, says, capsys, no_model_loads):
    assert says in _refused(["--engine_dir", str(engine_config), *extra], capsys)


def test_a_directory_that_is_no_dflash_engine_is_refused_by_name(tmp_path, capsys, no_model_loads):
    (tmp_path / "config.json").write_text('{"pretrained_config": {"architecture": "LlamaForCausalLM"}}')
    err = _refused(["--engine_dir", str(tmp_path)], capsys)
    assert f"argument --engine_dir: {tmp_path} is not a DFlash engine" in err and "'LlamaForCausalLM'" in err


def test_without_tensorrt_llm_an_engine_is_refused_by_name(engine_config, capsys, no_model_loads, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorrt_llm" else real(name, *a))
    assert "argument --engine_dir: needs the tensorrt_llm package" in _refused(["--engine_dir", str(engine_config)],
                                                                              capsys)


def test_a_target_without_a_drafter_is_refused_by_name(model_dirs, capsys, no_model_loads):
    target_dir, _ = model_dirs
    assert "argument --draft_model_dir: is required with --target_model_dir" in _refused(
        ["--target_model_dir", str(target_dir)], capsys)


def test_a_port_in_use_is_refused_before_any_model_loads(capsys, no_model_loads):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        err = _refused(["--port", str(port)], capsys)
        assert f"argument --port: cannot listen on 127.0.0.1:{port}" in err
    finally:
        taken.close()


def test_the_command_serves_model_directories_and_stops_on_sigint(model_dirs):
    import openai

    from tensorrt_llm_dflash.target import load_target

    target_dir, drafter_dir = model_dirs
    command = [sys.executable, "-m", "tensorrt_llm_dflash.serve", "--target_model_dir", str(target_dir),
               "--draft_model_dir", str(drafter_dir), "--port", "0", "--max_batch_size", "2", "--threads", "1",
               "--log_level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with server_process(command, env, ROOT) as (process, ready):
        assert "'target'" in ready and "cost-aware DDTree" in ready and "max_batch_size 2" in ready
        url = ready.rsplit(" at ", 1)[1].strip()
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Add two numbers."}]
        response = client.chat.completions.create(model="target", messages=messages, max_tokens=24, temperature=0)
        model, tokenizer = load_target(target_dir, dtype=torch.float32)
        ids = chat_token_ids(tokenizer, messages)
        eos = model.generation_config.eos_token_id
        expected = hf_greedy(model, ids, 24, eos_token_id=eos)
        assert response.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
        assert response.usage.completion_tokens == len(expected)
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
