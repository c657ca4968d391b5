#!/usr/bin/env python
"""Compare drafters on conversations no training run has seen, chat and code apart.

Held-out numbers in a training log are each run's own split, so two runs' logs cannot be
compared. This script takes the *last* conversations of the built-in set in the order the
data stage answers them (``--chat_share`` as in training): a data stage stops at its time
budget long before them, so no drafter trained on the built-in set has seen them. The
target answers them once (cached in ``--work_dir``, resumable; a work dir made for another target,
--max_new_tokens or drafter layers is refused), then every drafter is scored
with the training evaluation (teacher-forced: each answer position's block against the
target's own continuation), the chain acceptance split into chat and code conversations:

    python examples/heldout_tau.py --work_dir runs/heldout --drafters run1=DIR1 run2=DIR2 \\
        --output_json heldout.json
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from train_dflash import builtin_conversation  # noqa: E402  (examples/, as the data stage builds them)

from tensorrt_llm_dflash import cli  # noqa: E402
from tensorrt_llm_dflash.config import DFlashDraftConfig  # noqa: E402
from tensorrt_llm_dflash.drafter import load_dflash_drafter  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashError  # noqa: E402
from tensorrt_llm_dflash.files import atomic_write_json  # noqa: E402
from tensorrt_llm_dflash.target import load_target, target_dims  # noqa: E402
from tensorrt_llm_dflash.training.data import (  # noqa: E402
    Sequence,
    build_conversation_data,
    readable_shards,
    shard_loss_masks,
)
from tensorrt_llm_dflash.training.datasets import Conversation  # noqa: E402
from tensorrt_llm_dflash.training.model import OnlineDFlashModel  # noqa: E402
from tensorrt_llm_dflash.training.prompts import build_builtin_conversations, build_prompt_set  # noqa: E402
from tensorrt_llm_dflash.training.trainer import TrainConfig, evaluate  # noqa: E402
from tensorrt_llm_dflash.training.workdir import claim_work_dir, hold_work_dir, target_fingerprint  # noqa: E402

#: The data stage's longest sequence (build_conversation_data's default), recorded with the held-out data.
MAX_SEQ_LEN = 2048


def build_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", required=True, metavar="NAME=DIR",
                    help="drafters to compare (exported directories), each named for the table; they must read the "
                         "same target layers (the cached hidden states are those layers')")
    ap.add_argument("--target_model_dir", type=cli.existing_path, default=None,
                    help="HF dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--work_dir", type=cli.output_dir, required=True,
                    help="the held-out answers and hidden states (reused when present, for the same target, "
                         "--max_new_tokens and drafter layers only)")
    ap.add_argument("--chat_share", type=cli.number(0.0, 0.95), default=0.6,
                    help="the built-in set's chat share, as the drafters were trained with")
    ap.add_argument("--num_conversations", type=cli.integer(2, 4096), default=96)
    ap.add_argument("--max_new_tokens", type=cli.integer(1, 4096), default=128)
    ap.add_argument("--output_json", type=cli.output_file, default=None)
    ap.add_argument("--threads", type=cli.threads, default=None)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, with ``args.configs``: NAME -> (DIR, its drafter config), every drafter checked here, before
    the target loads and the data stage runs (a bad last drafter would otherwise lose the others' results)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    args.configs = {}
    for item in args.drafters:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            cli.refuse(ap, "--drafters", f"{item!r} is not NAME=DIR")
        if name in args.configs:
            cli.refuse(ap, "--drafters", f"names {name!r} twice (each drafter needs its own name in the table)")
        try:
            cli.existing_dir(path)
            config = DFlashDraftConfig.from_pretrained(path)
        except (argparse.ArgumentTypeError, DFlashError) as err:
            cli.refuse(ap, "--drafters", f"{name}: {err}")
        args.configs[name] = (path, config)
    (first, (_, reference)), *others = args.configs.items()
    for name, (_, config) in others:
        if list(config.target_layer_ids) != list(reference.target_layer_ids):
            cli.refuse(ap, "--drafters", f"{name} reads target layers {config.target_layer_ids}, {first} reads "
                                         f"{reference.target_layer_ids}: the cached hidden states serve one set")
    return args


def heldout_conversations(chat_share: float, count: int) -> tuple[list[Conversation], list[bool]]:
    """The last ``count`` conversations the data stage would answer, and which are code."""
    turns = build_builtin_conversations(chat_share)
    order = list(range(len(turns)))
    random.Random(0).shuffle(order)  # build_conversation_data's order (its seed 0)
    code = set(build_prompt_set())
    chosen = [turns[i] for i in order[-count:]]
    conversations = [builtin_conversation(user_turns, number) for number, user_turns in enumerate(chosen, start=1)]
    return conversations, [len(t) == 1 and t[0] in code for t in chosen]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    drafters = {name: path for name, (path, _) in args.configs.items()}
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with contextlib.ExitStack() as held:
            model, tokenizer = load_target(args.target_model_dir)
            for name, (_, config) in args.configs.items():  # before the data stage, which reads these layers
                try:
                    config.validate_for_target(**target_dims(model))
                except DFlashError as err:
                    raise DFlashError(f"--drafters {name}: does not fit the target: {err}") from None
            conversations, is_code = heldout_conversations(args.chat_share, args.num_conversations)
            layer_ids = list(next(iter(args.configs.values()))[1].target_layer_ids)
            # One run at a time (the training CLIs' lock): two would write the same data shards.
            held.enter_context(hold_work_dir(args.work_dir))
            # The cached answers and hidden states are those of one target, answer length and set of layers: a reused
            # --work_dir made with others is refused (build_conversation_data would regenerate nothing and score the
            # drafters against the old data).
            claim_work_dir(args.work_dir, {"target": target_fingerprint(model, tokenizer),
                                           "data": {"layer_ids": layer_ids, "max_new_tokens": args.max_new_tokens,
                                                    "max_seq_len": MAX_SEQ_LEN, "answers": "regenerate"}},
                           argument="--work_dir")
            data_dir = Path(args.work_dir) / "data"
            build_conversation_data(data_dir, model, tokenizer, conversations, layer_ids, max_seq_len=MAX_SEQ_LEN,
                                    max_new_tokens=args.max_new_tokens, source="held-out built-in conversations")
            groups: dict[str, list[Sequence]] = {"chat": [], "code": []}
            # By content key, not position: a work dir made when the set was built otherwise also
            # holds conversations that are no longer among the last ones; those are left out.
            code_by_key = {c.key: code for c, code in zip(conversations, is_code)}
            for _, data in readable_shards(data_dir, remove_damaged=False):
                for key, ids, mask, feats in zip(data["conversation_key"], data["input_ids"], shard_loss_masks(data),
                                                 data["features"]):
                    if key in code_by_key:
                        groups["code" if code_by_key[key] else "chat"].append(Sequence(ids.long(), mask, feats, None))
            results = {}
            for name, path in drafters.items():
                drafter = load_dflash_drafter(path)
                online = OnlineDFlashModel(drafter, model.get_input_embeddings().weight,
                                           model.get_output_embeddings().weight, num_anchors=48, gamma=4.0,
                                           distill_weight=0.0, attention="dense")
                results[name] = {}
                for group, seqs in groups.items():
                    if seqs:
                        metrics = evaluate(online, seqs, TrainConfig(batch_size=4), with_final=False)
                        results[name][group] = {"chain_tau": metrics["eval_chain_tau"], "acc": metrics["eval_acc"],
                                                "sequences": len(seqs)}
                print(name, "  ".join(f"{g} chain tau {r['chain_tau']:.3f} ({r['sequences']} conversations)"
                                      for g, r in results[name].items()), flush=True)
    except DFlashError as err:
        cli.print_error(err)
        return 2
    if args.output_json:
        atomic_write_json(args.output_json, {"chat_share": args.chat_share, "conversations": len(conversations),
                                             "drafters": drafters, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
