"""Data-parallel drafter training under torchrun (gloo, CPU): two ranks take exactly the steps one
process takes on the same global batch.

Tolerance: relative 1e-9 on every logged loss and absolute 1e-9 on every weight after the run
(float64 target and drafter; the only difference is the order in which the two ranks' gradients
are summed)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, script: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(_free_port()), str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("features", ["cached", "online"])
def test_two_ranks_take_the_steps_of_one_process_on_the_same_global_batch(tmp_path, features):
    import ddp_worker

    proc = torchrun(2, TESTS / "ddp_worker.py", str(tmp_path / "ddp"), features)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ddp = json.loads((tmp_path / "ddp" / "result.json").read_text())
    single = ddp_worker.run(str(tmp_path / "single"), features)
    assert ddp["world_size"] == 2
    assert len(single["train_loss"]) == ddp_worker.STEPS // 2
    assert ddp["train_loss"] == pytest.approx(single["train_loss"], rel=1e-9)
    assert ddp["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-9)
    for name, values in single["weights"].items():
        assert ddp["weights"][name] == pytest.approx(values, abs=1e-9), name
    # Not vacuous: training moved the weights.
    assert single["train_loss"][0] != single["train_loss"][-1]
