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
