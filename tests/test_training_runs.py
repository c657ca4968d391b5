"""Training runs across invocations: the held-out set, repeated sequences, one run per work dir, and the checks
that refuse a run before its data stage (examples/train_dflash.py, examples/train_dflash_lora_inject.py)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from example_cli import load_example
from tiny_dirs import save_tiny_target_dir
from tiny_models import tiny_target

from tensorrt_llm_dflash.errors import DFlashConfigError
from tensorrt_llm_dflash.training.data import Sequence, build_distillation_data, data_stage_state, readable_shards
from tensorrt_llm_dflash.training.trainer import TrainConfig, distinct_sequences, held_out_split, sequence_key

TINY = ["--max_new_tokens", "4", "--train_minutes", "0", "--log_every", "1", "--num_feature_layers", "2",
        "--threads", "1", "--data_minutes", "0"]


@pytest.fixture(scope="module")
def train_dflash():
    return load_example("train_dflash")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target_dir(tmp_path_factory.mktemp("runs") / "target")


def _run(train_dflash, target_dir, work: Path, out: Path, *extra: str) -> int:
    builtin = [] if "--dataset" in extra else ["--chat_share", "0"]  # the code prompts only: quicker
    return train_dflash.main(["--target_model_dir", str(target_dir), "--work_dir", str(work), "--output_dir", str(out),
                              *TINY, *builtin, *extra])


def _hold_in_another_process(work: Path) -> subprocess.Popen:
    """Another process holding ``work``'s lock, as a running training does (the caller kills it)."""
    return subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, sys.argv[2]); "
        "from tensorrt_llm_dflash.training.workdir import hold_work_dir\n"
        "with hold_work_dir(sys.argv[1]):\n    print('held', flush=True); time.sleep(120)"),
        str(work), str(Path(__file__).resolve().parents[1])], stdout=subprocess.PIPE, text=True)


def test_a_resumed_run_keeps_its_held_out_set_and_records_changed_settings(tmp_path, target_dir, train_dflash,
                                                                            capsys):
    """The reported leak: the split was drawn afresh on every resume, so a grown data set or another --seed held
    out sequences the drafter had already trained on. The checkpoint records the held-out set by token-id hash
    and a resume keeps it; a changed lr or seed is noted and recorded in the model card."""
    work, out = tmp_path / "work", tmp_path / "out"
    assert _run(train_dflash, target_dir, work, out, "--num_prompts", "8", "--max_steps", "2", "--lr", "3e-5") == 0
    captured = capsys.readouterr()
    first = captured.out
    logged = [json.loads(line) for line in first.splitlines() if line.startswith('{"step"')]
    assert logged and all(0 < record["lr"] <= 3e-5 for record in logged), first  # printed as 0.0 before
    held = torch.load(work / "checkpoint.pt", weights_only=False)["eval_keys"]
    assert len(held) == 1 and "held out for evaluation: 1 sequences; training on 7" in first
    assert _run(train_dflash, target_dir, work, out, "--num_prompts", "40", "--max_steps", "4", "--seed", "7",
                "--lr", "1e-3") == 0
    second = capsys.readouterr().out
    assert "resumed from" in second and "note: resumed with other settings" in second
    assert "lr 3e-05 -> 0.001" in second and "seed 0 -> 7" in second
    state = torch.load(work / "checkpoint.pt", weights_only=False)
    assert state["eval_keys"] == held  # drawn afresh from 40 sequences and seed 7, it would be others
    # ...and they would be: the fresh rule on this run's data and seed holds out another sequence.
    keys = [sequence_key(Sequence(ids, None, None, None)) for _, data in readable_shards(work / "data", False)
            for ids in data["input_ids"]]
    fresh, _ = held_out_split(distinct_sequences(keys, quiet=True), keys, TrainConfig(seed=7), None)
    assert fresh and {keys[i] for i in fresh} != set(held)
    card = json.loads((out / "training_metrics.json").read_text())["train"]
    assert card["settings_changes"] == [{"step": 2, "changes": {"lr": [3e-05, 0.001], "seed": [0, 7]}}]


def test_repeated_sequences_are_used_once_and_never_on_both_sides(tmp_path, target_dir, train_dflash, capsys):
    path = tmp_path / "dup.jsonl"
    lines = [json.dumps({"prompt": f"question {i}", "response": f"answer {i} " * 3}) for i in range(6)]
    path.write_text("\n".join(lines * 4) + "\n")
    work = tmp_path / "work"
    assert _run(train_dflash, target_dir, work, tmp_path / "out", "--dataset", str(path), "--answers", "dataset",
                "--max_steps", "1", "--max_seq_len", "256") == 0 or pytest.fail(capsys.readouterr().err)
    captured = capsys.readouterr().out
    assert "warning: 18 of 24 sequences repeat an earlier one token for token; each is used once" in captured
    assert "held out for evaluation: 1 sequences; training on 5" in captured


def test_unit_held_out_split_exact_count_and_resume():
    keys = [f"k{i}" for i in range(10)]
    eval_ids, train_ids = held_out_split(list(range(10)), keys, TrainConfig(eval_sequences=4), None)
    assert len(eval_ids) == 4 and sorted(eval_ids + train_ids) == list(range(10))
    # Too many asked: all but one held out, never the whole data.
    eval_ids, train_ids = held_out_split(list(range(10)), keys, TrainConfig(eval_sequences=50), None)
    assert len(eval_ids) == 9 and len(train_ids) == 1
    # A recorded set wins over the seed and the count, and new sequences train.
    state = {"eval_keys": ["k3", "k5"]}
    eval_ids, train_ids = held_out_split(list(range(10)), keys, TrainConfig(seed=99, eval_sequences=7), state)
    assert eval_ids == [3, 5] and train_ids == [0, 1, 2, 4, 6, 7, 8, 9]
    ids = torch.tensor([1, 2, 3])
    assert sequence_key(Sequence(ids, ids > 1, None, None)) == sequence_key(Sequence(ids.int(), ids > 0, None, None))


def test_a_mix_of_cached_and_online_shards_is_refused_by_count(tmp_path, target_dir, train_dflash, capsys):
    """The reported traceback: a work dir whose later shards came from a --features online run crashed a cached
    run in the batch assembly; every sequence is checked now."""
    work, out = tmp_path / "work", tmp_path / "out"
    assert _run(train_dflash, target_dir, work, out, "--num_prompts", "3", "--max_steps", "1") == 0
    assert _run(train_dflash, target_dir, work, out, "--num_prompts", "5", "--max_steps", "2",
                "--features", "online") == 0
    capsys.readouterr()
    assert _run(train_dflash, target_dir, work, out, "--num_prompts", "5", "--max_steps", "3") == 2
    err = capsys.readouterr().err
    assert "error: 2 of the 5 sequences in" in err and "hold no hidden states" in err and "Traceback" not in err


def test_a_second_run_on_a_work_dir_in_use_is_refused_by_name(tmp_path, target_dir, train_dflash, capsys):
    """Two runs on one --work_dir overwrote each other's checkpoint and log; the second is refused (the first
    here is another process holding the lock, as a running training does)."""
    work = tmp_path / "work"
    holder = _hold_in_another_process(work)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert _run(train_dflash, target_dir, work, tmp_path / "out", "--num_prompts", "3", "--max_steps", "1") == 2
        err = capsys.readouterr().err
        assert f"error: --work_dir {str(work)!r} is in use by another run (pid {holder.pid})" in err
        assert not (work / "data").exists()
    finally:
        holder.kill()
        holder.wait()
    # The lock dies with its process: the same command runs now.
    deadline = time.monotonic() + 10
    while _run(train_dflash, target_dir, work, tmp_path / "out", "--num_prompts", "3", "--max_steps", "1") != 0:
        assert time.monotonic() < deadline, capsys.readouterr().err
        time.sleep(0.2)


def test_checks_that_used_to_come_after_the_data_stage(tmp_path, target_dir, train_dflash, capsys):
    """--attention flex on a CPU (no backward there), an --init_drafter of another shape, an unfinished
    --extra_data work dir: each refused by name before any data is made."""
    with pytest.raises(SystemExit) as exit_info:
        _run(train_dflash, target_dir, tmp_path / "w0", tmp_path / "o0", "--attention", "flex", "--device", "cpu")
    assert exit_info.value.code == 2 and "--attention" in capsys.readouterr().err
    first = tmp_path / "first"
    assert _run(train_dflash, target_dir, tmp_path / "w1", first, "--num_prompts", "3", "--max_steps", "1") == 0
    capsys.readouterr()
    assert _run(train_dflash, target_dir, tmp_path / "w2", tmp_path / "o2", "--num_prompts", "3", "--max_steps", "1",
                "--num_layers", "3", "--init_drafter", str(first)) == 2
    err = capsys.readouterr().err
    assert "--init_drafter" in err and "num_hidden_layers is 2" in err and not (tmp_path / "w2" / "data").exists()
    meta = tmp_path / "w1" / "data" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "complete": False}))
    assert data_stage_state(meta.parent) == "partial"
    with pytest.raises(SystemExit) as exit_info:
        _run(train_dflash, target_dir, tmp_path / "w3", tmp_path / "o3", "--extra_data", str(tmp_path / "w1"))
    assert exit_info.value.code == 2 and "its data stage did not finish" in capsys.readouterr().err


def test_interrupt_hint_follows_no_resume(tmp_path, target_dir, train_dflash, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_dflash, "train_drafter", interrupted)
    for flags, hint in (([], "the same command resumes"), (["--no_resume"], "the same command without --no_resume")):
        assert _run(train_dflash, target_dir, tmp_path / "w", tmp_path / "o", *flags) == 130
        assert hint in capsys.readouterr().err


def test_a_data_budget_that_ends_before_the_first_shard_names_the_flag(tmp_path):
    model = tiny_target("llama", vocab=64).float()

    class Tokenizer:
        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
            return [3 + len(m["content"]) % 50 for m in messages] * 3

    with pytest.raises(DFlashConfigError, match="ran out before its first batch.*raise --data_minutes"):
        build_distillation_data(tmp_path / "data", model, Tokenizer(), ["a", "bb"], [1], max_new_tokens=2,
                                time_budget_s=1e-9)
    assert data_stage_state(tmp_path / "data") == "empty"


def test_lora_inject_data_stage_resumes_its_own_data_and_refuses_an_unfinished_work_dirs(tmp_path, monkeypatch):
    lora = load_example("train_dflash_lora_inject")
    from tensorrt_llm_dflash.training import data

    built = []
    monkeypatch.setattr(data, "build_distillation_data", lambda out, *a, **k: built.append(out))
    own = tmp_path / "own"
    own.mkdir()
    torch.save({"input_ids": []}, own / "shard_00000.pt")
    (own / "meta.json").write_text(json.dumps({"seconds": 3.0, "complete": False}))
    args = argparse.Namespace(data_dir=str(own), data_minutes=0.0)
    lora.ensure_data(args, tiny_target("llama", vocab=64), None, False)
    assert built == [str(own)]  # a stopped run's shards: the stage goes on (it skips the prompts done)
    (own / "meta.json").write_text(json.dumps({"seconds": 3.0, "complete": True}))
    lora.ensure_data(args, tiny_target("llama", vocab=64), None, False)
    assert built == [str(own)]  # finished: read as it is
    (own / "meta.json").write_text(json.dumps({"seconds": 3.0, "complete": False}))
    with pytest.raises(DFlashConfigError, match="its data stage did not finish"):
        lora.ensure_data(args, tiny_target("llama", vocab=64), None, True)


def test_heldout_tau_refuses_a_work_dir_another_run_holds(tmp_path, capsys):
    """examples/heldout_tau.py writes data shards into its --work_dir as the trainers do, and took no lock: two runs
    on one dir wrote the same shards. It takes the trainers' lock now, before its data stage."""
    from tiny_dirs import save_long_context_pair

    target, drafter = save_long_context_pair(tmp_path / "pair")
    heldout = load_example("heldout_tau")
    work = tmp_path / "work"
    holder = _hold_in_another_process(work)
    argv = ["--drafters", f"d={drafter}", "--target_model_dir", str(target), "--work_dir", str(work),
            "--num_conversations", "2", "--max_new_tokens", "2", "--threads", "1"]
    try:
        assert holder.stdout.readline().strip() == "held"
        assert heldout.main(argv) == 2
        assert f"error: --work_dir {str(work)!r} is in use by another run (pid {holder.pid})" in capsys.readouterr().err
        assert not (work / "data").exists()
    finally:
        holder.kill()
        holder.wait()
