"""examples/train_dflash.py under ``torchrun --nproc_per_node 2`` (gloo, CPU) on a JSONL dataset in
all three shapes: the same losses as one process with the same global batch, and a 2-rank run
killed with SIGKILL resumes with 1 rank to a drafter that decodes losslessly.

Tolerance for 2 ranks vs 1 process: relative 1e-5 on every logged loss (float32 drafter; the
ranks sum their gradients in another order than one process does)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from example_cli import load_example
from test_distributed_training import _free_port
from tiny_dirs import save_tiny_target_dir

ROOT = Path(__file__).resolve().parents[1]
LINES = [
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a color"},
                  {"role": "assistant", "content": "blue, like the sky"}]},
    {"conversations": [{"from": "human", "value": "count to five"}, {"from": "gpt", "value": "1 2 3 4 5"},
                       {"from": "human", "value": "and back"}, {"from": "gpt", "value": "5 4 3 2 1"}]},
    {"prompt": "say hello", "response": "hello there, friend"},
]


def _train_module():
    return load_example("train_dflash")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp_cli")
    target = save_tiny_target_dir(root / "target", seed=6)
    dataset = root / "chats.jsonl"
    dataset.write_text("".join(json.dumps(LINES[i % 3]).replace("five", f"{5 + i}") + "\n" for i in range(24)))
    return root, target, dataset


def _argv(target, dataset, work, out, steps, *extra):
    return ["--target_model_dir", str(target), "--dataset", str(dataset), "--answers", "dataset", "--work_dir",
            str(work), "--output_dir", str(out), "--data_minutes", "0", "--train_minutes", "0", "--max_steps",
            str(steps), "--batch_size", "4", "--num_anchors", "8", "--log_every", "2", "--num_feature_layers", "2",
            "--threads", "1", *extra]


def _torchrun(argv, **kwargs):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(ROOT / "examples" / "train_dflash.py"), *argv]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **kwargs)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _log(work):
    return [json.loads(line) for line in (Path(work) / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("features", ["cached", "online"])
def test_two_ranks_under_torchrun_match_one_process(setup, features):
    root, target, dataset = setup
    proc = _torchrun(_argv(target, dataset, root / f"w2-{features}", root / f"d2-{features}", 6,
                           "--features", features))
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    assert _train_module().main(_argv(target, dataset, root / f"w1-{features}", root / f"d1-{features}", 6,
                                      "--features", features)) == 0
    two, one = _log(root / f"w2-{features}"), _log(root / f"w1-{features}")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [2, 4, 6]
    for a, b in zip(two, one):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
    assert one[0]["train_loss"] != one[-1]["train_loss"]


def test_a_killed_two_rank_run_resumes_with_one_rank_to_a_lossless_drafter(setup):
    from tensorrt_llm_dflash.decode import speculative_generate
    from tensorrt_llm_dflash.drafter import load_dflash_drafter
    from tensorrt_llm_dflash.proposer import DFlashProposer
    from tensorrt_llm_dflash.sampling import SamplingParams
    from tensorrt_llm_dflash.target import HFTargetVerifier, load_target

    root, target, dataset = setup
    work, out = root / "wk", root / "dk"
    argv = _argv(target, dataset, work, out, 400, "--save_every", "10", "--log_every", "50")
    proc = _torchrun(argv)
    ckpt, step = work / "checkpoint.pt", 0
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if ckpt.exists():
            step = torch.load(ckpt, weights_only=False)["step"]
            if step >= 60:
                break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    # torchrun starts each rank in a session of its own, so killing torchrun's group would leave
    # the ranks running: every process of the job gets SIGKILL, at once.
    job = [proc.pid, *_descendants(proc.pid)]
    assert len(job) >= 3, job  # torchrun and two ranks
    for pid in job:
        os.kill(pid, signal.SIGKILL)
    proc.wait(60)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in job[1:]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in job[1:])
    killed_at = torch.load(ckpt, weights_only=False)["step"]
    assert 60 <= killed_at < 400 and not out.exists()

    assert _train_module().main(argv) == 0  # one rank, same command
    log = _log(work)
    assert [r["step"] for r in log] == list(range(50, 401, 50))  # one record per logged step, resumed or not
    state = torch.load(ckpt, weights_only=False)
    assert state["step"] == 400 and state["history"][0]["step"] == 50  # the history of the 2-rank part survives
    model, _ = load_target(target, dtype=torch.float64)
    drafter = load_dflash_drafter(out, dtype=torch.float64)
    for budget in (0, 4):
        prompt = [5, 9, 12, 3, 17]
        ar = speculative_generate(HFTargetVerifier(model, []), None, prompt, 20, SamplingParams(), [], 0)
        spec = speculative_generate(HFTargetVerifier(model, drafter.config.target_layer_ids),
                                    DFlashProposer.for_target(drafter, model), prompt, 20, SamplingParams(), [], budget)
        assert spec.output_ids == ar.output_ids
