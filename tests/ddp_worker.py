"""One rank of the data-parallel training test, launched by torchrun (or called in-process for the
single-process reference): a seeded tiny float64 target and drafter, cached or online features,
``training.trainer.train`` for a few steps; rank 0 writes the loss history and the weights."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from tiny_models import tiny_drafter, tiny_target  # noqa: E402

from tensorrt_llm_dflash.training.data import Sequence, capture_hidden_states  # noqa: E402
from tensorrt_llm_dflash.training.model import OnlineDFlashModel  # noqa: E402
from tensorrt_llm_dflash.training.trainer import TargetFeatures, TrainConfig, train  # noqa: E402

STEPS = 6
GLOBAL_BATCH = 4


def run(out_dir: str, features_mode: str) -> dict:
    torch.set_num_threads(1)
    target = tiny_target("qwen3", seed=4, vocab=64, layers=6)
    drafter = tiny_drafter(target, block_size=4, layers=1)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(12, 30, (12,), generator=gen)
    seqs = [torch.randint(2, 64, (int(n),), generator=gen).tolist() for n in lengths]
    layer_ids = drafter.config.target_layer_ids
    captured = capture_hidden_states(target, seqs, layer_ids, pad_id=0) if features_mode == "cached" else None
    sequences = []
    for i, ids in enumerate(seqs):
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(ids) // 3:] = True
        feats, final = captured[i] if captured else (None, None)
        sequences.append(Sequence(torch.tensor(ids), mask, feats, final))
    online = OnlineDFlashModel(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                               num_anchors=6, gamma=4.0)
    config = TrainConfig(lr=1e-3, batch_size=GLOBAL_BATCH, num_anchors=6, max_steps=STEPS, log_every=2,
                         save_every=100, eval_fraction=0.2)
    features = TargetFeatures(target, layer_ids) if features_mode == "online" else None
    result = train(online, sequences, config, out_dir, resume=False, features=features)
    return {"train_loss": [h["train_loss"] for h in result["history"]],
            "eval_loss": result["final"].get("eval_loss"),
            "weights": {k: v.flatten().tolist() for k, v in online.drafter.state_dict().items()}}


def main() -> None:
    import torch.distributed as dist

    out_dir, features_mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    result = run(out_dir, features_mode)
    if dist.get_rank() == 0:
        result["world_size"] = dist.get_world_size()
        Path(out_dir, "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
