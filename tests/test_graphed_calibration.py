"""The graphed cost-aware tree starts from the acceptance calibration the eager runtime keeps for its target and
drafter (policy.calibration_path), and its sizes follow the device (15 for 16 on a CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import hf_greedy, tiny_drafter, tiny_target

from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.device_policy import CPU_POLICY_BUCKETS, POLICY_BUCKETS, default_policy_buckets
from tensorrt_llm_dflash.graphed import GraphedDecoder
from tensorrt_llm_dflash.policy import calibration_path, default_policy, models_calibration_path
from tensorrt_llm_dflash.proposer import DFlashProposer
from tensorrt_llm_dflash.target import HFTargetVerifier


@pytest.fixture()
def pair(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORRT_LLM_DFLASH_CACHE", str(tmp_path / "cache"))
    model = tiny_target("llama", seed=5)
    return model, tiny_drafter(model, block_size=6, seed=1, layers=1)


def _eager_run(model, drafter, prompt, new):
    """run.py's eager default with a persisted calibration: it learns, then saves it."""
    verifier = HFTargetVerifier(model, list(drafter.config.target_layer_ids))
    proposer = DFlashProposer.for_target(drafter, model)
    try:
        policy = default_policy(verifier, proposer, max_nodes=16, persist=True)
        out = speculative_generate(verifier, proposer, prompt, new, policy=policy)
        policy.save_calibration()
    finally:
        verifier.close()
    return out, policy


def test_the_graphed_runtime_finds_the_eager_runtimes_calibration_file(pair):
    model, drafter = pair
    verifier = HFTargetVerifier(model, list(drafter.config.target_layer_ids))
    try:
        assert models_calibration_path(model, drafter) == calibration_path(verifier,
                                                                           DFlashProposer.for_target(drafter, model))
    finally:
        verifier.close()


def test_a_saved_calibration_seeds_the_device_tables_and_output_stays_exact(pair):
    model, drafter = pair
    prompt = [4, 8, 15, 16, 23, 4, 8, 15, 16, 23, 4, 8]
    _, policy = _eager_run(model, drafter, prompt, 24)
    saved = json.loads(policy.calibration_path.read_text())["temperatures"]["0"]
    decoder = GraphedDecoder(model, drafter, budget=None)
    assert decoder.seeded_from == str(policy.calibration_path)
    assert torch.equal(decoder.policy.trials.cpu(), torch.tensor(saved["draft"]["trials"], dtype=torch.float64))
    assert torch.equal(decoder.policy.lookup_hits.cpu(), torch.tensor(saved["lookup"]["hits"], dtype=torch.float64))
    assert float(decoder.policy.lookup_trials.sum()) > 0  # the eager run verified lookup nodes
    assert not torch.equal(decoder.policy.lookup_table, decoder.policy.lookup_prior)
    assert decoder.generate(prompt, 24).output_ids == hf_greedy(model, prompt, 24)
    unseeded = GraphedDecoder(model, drafter, budget=None, seed_calibration=False)  # the benchmark's: from the priors
    assert unseeded.seeded_from is None and torch.equal(unseeded.policy.lookup_table, unseeded.policy.lookup_prior)


def test_no_file_or_a_damaged_one_leaves_the_priors(pair):
    model, drafter = pair
    fresh = GraphedDecoder(model, drafter, budget=None)
    assert fresh.seeded_from is None and torch.equal(fresh.policy.table, fresh.policy.prior)
    path = models_calibration_path(model, drafter)
    path.parent.mkdir(parents=True, exist_ok=True)
    for damaged in ("{not json", json.dumps({"block_size": 6, "lookup_tokens": 10, "temperatures": {
            "0": {"draft": {"edges": [0.0, 1.0], "hits": [[1.0]], "trials": [[1.0]]}, "lookup": {}}}})):
        path.write_text(damaged)
        decoder = GraphedDecoder(model, drafter, budget=None)
        assert decoder.seeded_from is None and torch.equal(decoder.policy.table, decoder.policy.prior)
        assert torch.equal(decoder.policy.lookup_table, decoder.policy.lookup_prior)


def test_the_default_sizes_follow_the_device(pair):
    model, drafter = pair
    assert default_policy_buckets("cuda") == POLICY_BUCKETS and 16 in POLICY_BUCKETS
    assert default_policy_buckets("cpu") == CPU_POLICY_BUCKETS and 15 in CPU_POLICY_BUCKETS
    decoder = GraphedDecoder(model, drafter, budget=None)
    assert decoder.sizes() == CPU_POLICY_BUCKETS and decoder.chooser.start == 15
