"""Shared test setup: import paths, single-threaded torch, tiny models and oracle proposers."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
for p in (str(ROOT), str(TESTS)):
    if p not in sys.path:
        sys.path.insert(0, p)

# Tiny float64 models: one thread is faster than two on a shared 2-core machine.
torch.set_num_threads(1)
# Cost curves measured by the tests stay in the session, not in the user's cache (subprocesses inherit it).
os.environ["TENSORRT_LLM_DFLASH_CACHE"] = tempfile.mkdtemp(prefix="dflash-test-cache-")


@pytest.fixture(autouse=True)
def _autograd_left_as_found():
    """No test may leave autograd off: a main() that called torch.set_grad_enabled(False) once made every training
    test after it fail (in the whole suite only, never alone). Fails the test that does it, and restores."""
    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("the test left autograd disabled (torch.set_grad_enabled(False) outside a scope)")


@pytest.fixture(scope="session")
def qwen_target():
    from tiny_models import cached_target

    return cached_target("qwen3", seed=0, vocab=32)


@pytest.fixture
def make_proposer():
    """make_proposer(kind, sequence, block_size, vocab, seed=0) -> a scripted proposer."""

    from tiny_models import NoisyOracleProposer, OracleProposer, Top2Proposer

    kinds = {"oracle": OracleProposer, "noisy": NoisyOracleProposer, "top2": Top2Proposer}

    def make(kind: str, sequence, block_size: int, vocab: int, seed: int = 0):
        return kinds[kind](list(sequence), block_size, vocab, seed=seed)

    return make


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001 - pytest's hook signature
    """One line saying whether the CUDA code was compiled in this run (nvcc found or not), so that a CI
    log shows the CUDA compile tests running rather than skipping among a thousand dots."""
    from test_plugin_support import find_nvcc

    counts: dict[str, int] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            if "test_plugins_nvcc.py" not in nodeid or "trt_plugin" in nodeid:  # the TensorRT-header tests aside
                continue
            if outcome == "passed" and report.when != "call":
                continue
            counts[outcome] = counts.get(outcome, 0) + 1
    if not counts:
        return
    nvcc = find_nvcc()
    shown = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    terminalreporter.write_line(f"CUDA compile checks (sm_80 + sm_90, nvcc: {nvcc or 'not found'}): {shown}")
