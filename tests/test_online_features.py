"""--features online (the target runs inside the training step) gives the loss --features cached
(hidden states stored by the data stage) gives, on the same batch and over whole training runs.

Tolerance: exact. Both modes hand the drafter the target's hidden states rounded to bf16; the
target here is float64, so the two forward passes (one batch of all sequences for the cache,
one per training batch online) agree to ~1e-16, far inside one bf16 step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import tiny_drafter, tiny_target

from tensorrt_llm_dflash.training.data import Sequence, capture_hidden_states
from tensorrt_llm_dflash.training.model import OnlineDFlashModel
from tensorrt_llm_dflash.training.trainer import TargetFeatures, TrainConfig, _batch, train


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("qwen3", seed=4, vocab=64, layers=6)
    drafter = tiny_drafter(target, block_size=4, layers=1)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(2, 64, (int(n),), generator=gen).tolist() for n in torch.randint(12, 30, (10,), generator=gen)]
    layer_ids = drafter.config.target_layer_ids
    captured = capture_hidden_states(target, seqs, layer_ids, pad_id=0)
    cached, bare = [], []
    for ids, (feats, final) in zip(seqs, captured):
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(ids) // 3:] = True  # the "answer"
        cached.append(Sequence(torch.tensor(ids), mask, feats, final))
        bare.append(Sequence(torch.tensor(ids), mask, None, None))
    return target, drafter, cached, bare, TargetFeatures(target, layer_ids)


def _online(target, drafter, distill_weight=0.0):
    return OnlineDFlashModel(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                             num_anchors=6, gamma=4.0, distill_weight=distill_weight)


@pytest.mark.parametrize("distill_weight", [0.0, 0.5])
def test_online_and_cached_features_give_the_same_batch_and_loss(setup, distill_weight):
    target, drafter, cached, bare, features = setup
    with_final = distill_weight > 0
    a = _batch(cached[:4], with_final)
    b = _batch(bare[:4], with_final, features)
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    model = _online(target, drafter, distill_weight)
    loss_a = model(**a, generator=torch.Generator().manual_seed(3))["loss"]
    loss_b = model(**b, generator=torch.Generator().manual_seed(3))["loss"]
    assert torch.isfinite(loss_a) and loss_a.item() == loss_b.item()


def test_online_and_cached_training_runs_are_identical(setup, tmp_path):
    target, drafter, cached, bare, features = setup
    config = TrainConfig(lr=1e-3, batch_size=3, num_anchors=6, max_steps=6, log_every=2, save_every=100,
                         eval_fraction=0.2)
    runs = []
    for sequences, feats, name in ((cached, None, "cached"), (bare, features, "online")):
        model = _online(target, copy.deepcopy(drafter))
        result = train(model, sequences, config, tmp_path / name, resume=False, features=feats)
        runs.append(([h["train_loss"] for h in result["history"]], result["final"]["eval_loss"],
                     [p.detach().clone() for p in model.drafter.parameters()]))
    (hist_a, eval_a, params_a), (hist_b, eval_b, params_b) = runs
    assert len(hist_a) == 3 and hist_a == hist_b and eval_a == eval_b
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))


def test_logged_records_are_appended_to_a_jsonl_file(setup, tmp_path):
    import json

    target, drafter, cached, _, _ = setup
    log = tmp_path / "train_log.jsonl"
    config = TrainConfig(lr=1e-3, batch_size=3, num_anchors=6, max_steps=4, log_every=2, save_every=100,
                         eval_fraction=0.2, log_path=str(log))
    result = train(_online(target, copy.deepcopy(drafter)), cached, config, tmp_path / "run", resume=False)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4] and lines == json.loads(json.dumps(result["history"]))
    assert {"train_loss", "eval_loss", "eval_acc", "lr", "minutes"} <= set(lines[0])
