"""Training loop: batches of cached sequences, AdamW, cosine LR on step or time, resume, export."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..compat import config_rope
from ..config import DFlashDraftConfig, build_target_layer_ids
from ..drafter import DFlashDraftModel, save_dflash_drafter
from ..errors import DFlashConfigError
from ..files import atomic_torch_save, atomic_write_json, atomic_write_text, publish_dir, remove_stale_temporaries
from .data import Sequence
from .model import OnlineDFlashModel, cosine_lr, sample_anchors

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
CHECKPOINT = "checkpoint.pt"


def _autocast(online: OnlineDFlashModel, precision: str):
    dtype = PRECISIONS[precision]
    device_type = next(online.parameters()).device.type
    # A disabled autocast still validates its dtype (float32 would warn on CPU), hence bf16 either way.
    return torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


@dataclass
class TrainConfig:
    lr: float = 6e-4
    weight_decay: float = 0.0
    batch_size: int = 4
    num_anchors: int = 48
    gamma: float = 4.0
    distill_weight: float = 0.0
    max_steps: int = 100_000
    time_budget_s: float | None = None
    log_every: int = 100
    save_every: int = 200
    eval_fraction: float = 0.04
    max_eval_sequences: int = 64
    #: Held-out sequences, exactly (instead of ``eval_fraction`` capped at ``max_eval_sequences``).
    eval_sequences: int | None = None
    seed: int = 0
    attention: str = "dense"
    #: Rank 0 appends every logged record (the periodic evaluation) to this JSONL file, and
    #: to TensorBoard event files in ``tensorboard_dir`` when given (needs ``tensorboard``).
    log_path: str | None = None
    tensorboard_dir: str | None = None
    #: "bf16" runs forward and backward under bf16 autocast (weights and optimizer stay fp32):
    #: 1.3x the steps per minute on a 2-core AVX512-BF16 CPU (the demo drafter's run records).
    precision: str = "fp32"
    #: The training state's file in the work dir: a DFlash2 drafter trained on a DFlash run's data
    #: keeps its own (``checkpoint_dflash2.pt``), so the two runs share the data and not the weights.
    checkpoint_name: str = CHECKPOINT

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise DFlashConfigError(f"precision={self.precision!r} must be one of {sorted(PRECISIONS)}")


def suggest_drafter_shape(num_target_params: int, device_type: str = "cpu") -> tuple[int, int]:
    """(draft layers, block size) for a target. Small targets on a CPU: 2 layers, block 8;
    billion-scale targets follow the published drafters (5 layers, block 16)."""
    if num_target_params >= 3e9:
        return 5, 16
    if num_target_params >= 1e9:
        return 3, 16 if device_type == "cuda" else 8
    return 2, 8


def make_drafter_config(
    target_config: Any,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    num_feature_layers: int = 5,
    draft_vocab_size: int | None = None,
) -> DFlashDraftConfig:
    """A drafter shaped like the target's own layers; refuses targets it cannot fit."""
    c = target_config
    lt = int(c.num_hidden_layers)
    if num_feature_layers > 1 and lt < 4 + num_feature_layers - 1:
        raise DFlashConfigError(
            f"target num_hidden_layers={lt} is too shallow for {num_feature_layers} feature layers "
            f"(need at least {num_feature_layers + 3}); use --num_feature_layers 1"
        )
    if not 0 <= mask_token_id < int(c.vocab_size):
        raise DFlashConfigError(f"mask_token_id={mask_token_id} is outside the target vocabulary 0..{c.vocab_size - 1}")
    heads = int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    # The target's own RoPE: transformers 5.x configs keep it only in rope_parameters (no rope_theta
    # attribute, rope_scaling an alias that is never None), so read it through compat.
    rope_theta, rope_scaling = config_rope(c)
    return DFlashDraftConfig(
        hidden_size=int(c.hidden_size), intermediate_size=int(c.intermediate_size), num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=int(getattr(c, "num_key_value_heads", heads)),
        head_dim=head_dim, vocab_size=int(c.vocab_size), block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=build_target_layer_ids(lt, num_feature_layers), num_target_layers=lt,
        rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_theta=rope_theta,
        rope_scaling=rope_scaling, max_position_embeddings=int(c.max_position_embeddings),
        draft_vocab_size=draft_vocab_size,
    )


def init_from_target(drafter: DFlashDraftModel, target: Any) -> None:
    """Start the draft layers from the target's last layers (same shapes), the rest random."""
    layers = target.get_decoder().layers
    offset = len(layers) - len(drafter.layers)
    with torch.no_grad():
        for i, layer in enumerate(drafter.layers):
            src = dict(layers[offset + i].named_parameters())
            for name, param in layer.named_parameters():
                if name in src and src[name].shape == param.shape:
                    param.copy_(src[name])
        drafter.norm.weight.copy_(target.get_decoder().norm.weight)
        torch.nn.init.normal_(drafter.fc.weight, std=0.02)


#: Config fields a drafter to start from must share with the one being trained.
INIT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "block_size", "mask_token_id", "target_layer_ids", "vocab_size")


def check_init_fields(drafter: Any, source: Any, path: Any, fields: tuple[str, ...]) -> None:
    """``--init_drafter``: refuse a drafter whose config differs from the one being trained in any of ``fields``."""
    for name in fields:
        ours, theirs = getattr(drafter.config, name), getattr(source.config, name)
        if isinstance(ours, (list, tuple)):
            ours, theirs = list(ours), list(theirs)
        if ours != theirs:
            raise DFlashConfigError(f"--init_drafter {path}: its {name} is {theirs!r}, the drafter being trained "
                                    f"has {ours!r}")


def init_from_drafter(drafter: DFlashDraftModel, source: DFlashDraftModel, path: Any) -> None:
    """Start from an exported drafter's layers (``--init_drafter``): continued training on new
    data keeps what it learned. The draft vocabulary is the new model's own (a superset)."""
    check_init_fields(drafter, source, path, INIT_FIELDS)
    state = {k: v for k, v in source.state_dict().items() if k != "d2t"}
    with torch.no_grad():
        missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "d2t"]
    if missing or unexpected:
        raise DFlashConfigError(f"--init_drafter {path}: tensors missing {missing[:5]}, unexpected {unexpected[:5]}")


class TargetFeatures:
    """``--features online``: the frozen target computes the drafter's inputs inside each step.

    Nothing touches the disk, which is what makes large targets trainable: cached features
    of an 8B target reading 5 layers take 40 KB per token. Both modes hand the drafter the
    same values, the target's hidden states rounded to bf16 (what the cache stores: SmolLM2's
    reach |h| ~ 25k, beyond fp16), so ``online`` and ``cached`` train the same model.
    """

    def __init__(self, target: Any, layer_ids: list[int]) -> None:
        self.target = target.eval()
        self.layer_ids = list(layer_ids)
        for param in self.target.parameters():
            param.requires_grad_(False)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [b, s, K*H], final normed hidden [b, s, H]) for a right-padded batch, float32,
        on the target's device."""
        from .data import _layer_features

        device = self.target.device
        attention = (torch.arange(input_ids.shape[1])[None] < lengths[:, None]).long()
        out = self.target(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                          output_hidden_states=True, use_cache=False, logits_to_keep=1)
        feats, final = _layer_features(out.hidden_states, self.layer_ids, to_cpu=False)
        return feats.float(), final.float()


def _to(tensors: Any, device: torch.device) -> Any:
    """A batch (dict or tuple of tensors) on ``device``; a no-op on the CPU."""
    if isinstance(tensors, dict):
        return {k: v.to(device) for k, v in tensors.items()}
    return tuple(t.to(device) for t in tensors)


class MetricsLog:
    """The logged training records as JSONL and, optionally, TensorBoard scalars.

    The file is first rewritten (atomically) with the records the checkpoint holds, so after
    a resume it tells the history of the weights being trained, without the records a killed
    run logged past its last checkpoint; then each new record is appended in one ``write``.
    """

    def __init__(self, path: str | None, tensorboard_dir: str | None = None,
                 history: list[dict[str, Any]] | None = None) -> None:
        self.path = path
        if path:
            atomic_write_text(path, "".join(self._line(r) for r in history or []))
        self.writer = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise DFlashConfigError(f"tensorboard_dir={tensorboard_dir!r} needs the tensorboard package "
                                        f"(pip install tensorboard): {err}") from None
            self.writer = SummaryWriter(tensorboard_dir)

    def write(self, record: dict[str, Any]) -> None:
        if self.path:
            line = self._line(record).encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.writer.add_scalar(key, value, record["step"])
                elif isinstance(value, list):
                    for i, item in enumerate(value):
                        self.writer.add_scalar(f"{key}/{i + 1}", item, record["step"])

    @staticmethod
    def _line(record: dict[str, Any]) -> str:
        return json.dumps(record, default=float) + "\n"

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _token_batch(seqs: list[Sequence], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, loss mask, lengths), right padded to the longest sequence (or ``width``)."""
    s = width or max(len(x.input_ids) for x in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    mask = torch.zeros(len(seqs), s, dtype=torch.bool)
    for row, x in enumerate(seqs):
        ids[row, : len(x.input_ids)], mask[row, : len(x.input_ids)] = x.input_ids, x.loss_mask
    return ids, mask, torch.tensor([len(x.input_ids) for x in seqs])


def _batch(seqs: list[Sequence], with_final: bool, features: TargetFeatures | None = None,
           width: int | None = None) -> dict[str, torch.Tensor]:
    """A right-padded batch; features from the cache, or from the target when ``features`` is given."""
    ids, mask, lengths = _token_batch(seqs, width)
    b, s = ids.shape
    out = {"input_ids": ids, "loss_mask": mask}
    if features is not None:
        feats, final = features(ids, lengths)
        # Padding rows are zero, as in the cached batch (no block reads them; equal batches either way).
        pad = (torch.arange(s)[None] >= lengths[:, None])[:, :, None].to(feats.device)
        out["features"] = feats.masked_fill(pad, 0.0)
        if with_final:
            out["final_hidden"] = final.masked_fill(pad, 0.0)
        return out
    feats = torch.zeros(b, s, seqs[0].features.shape[-1], dtype=torch.bfloat16)
    final = torch.zeros(b, s, seqs[0].final_hidden.shape[-1], dtype=torch.bfloat16) if with_final else None
    for row, x in enumerate(seqs):
        n = len(x.input_ids)
        feats[row, :n] = x.features
        if with_final:
            final[row, :n] = x.final_hidden
    out["features"] = feats.float()
    if with_final:
        out["final_hidden"] = final.float()
    return out


def distributed_world() -> tuple[int, int]:
    """(rank, world size) of an initialised torch.distributed job of two or more ranks, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def train(
    online: OnlineDFlashModel,
    sequences: list[Sequence],
    config: TrainConfig,
    output_dir: str | Path,
    resume: bool = True,
    features: TargetFeatures | None = None,
) -> dict[str, Any]:
    """Train in place; checkpoints to ``output_dir/checkpoint.pt``; returns final metrics.

    ``features``: compute the drafter's inputs with the target in every step (``--features
    online``) instead of reading them from ``sequences`` (cached).

    Under ``torchrun`` (an initialised process group of N > 1 ranks) this is data parallel:
    every rank draws the same global batch of ``config.batch_size`` sequences and the same
    anchors (shared seeds), runs the forward and backward of its own rows only, and
    DistributedDataParallel averages the gradients; the loss is normalised over the global
    batch (see ``OnlineDFlashModel.forward``), so N ranks take the step one process would.
    Rank 0 evaluates, logs and writes the checkpoint, which holds nothing rank-specific:
    a run resumes with any number of ranks.
    """
    import torch.distributed as dist

    rank, world = distributed_world()
    if world > 1:
        if not hasattr(online, "label_weight_total"):
            raise DFlashConfigError(f"{type(online).__name__} does not support data parallel training; run one process")
        if config.batch_size < world:
            raise DFlashConfigError(f"batch_size={config.batch_size} is the global batch and must be at least the "
                                    f"number of ranks ({world})")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = [sequence_key(s) for s in sequences]
    unique = distinct_sequences(keys, quiet=rank != 0)
    if len(unique) < 2:
        raise DFlashConfigError(f"the data holds {len(unique)} distinct sequence(s): training needs at least 2 (one "
                                "is held out for evaluation); give more prompts or a larger --data_minutes")
    rng = random.Random(config.seed)
    params = [p for p in online.drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    step, elapsed, history, changes = 0, 0.0, [], []
    ckpt = out / config.checkpoint_name
    if rank == 0:
        remove_stale_temporaries(out)
    state = load_checkpoint(ckpt, online.drafter, quiet=rank != 0) if resume else None
    if state is not None:
        online.drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        changes = list(state.get("settings_changes", []))
        changed = changed_settings(state.get("config", {}), asdict(config))
        if changed:
            changes.append({"step": step, "changes": changed})
        if rank == 0:
            print(f"resumed from {ckpt} at step {step} ({elapsed / 60:.1f} min trained)")
            if changed:
                print("note: resumed with other settings than the checkpoint's last run: " + ", ".join(
                    f"{name} {old!r} -> {new!r}" for name, (old, new) in changed.items())
                    + " (recorded in the checkpoint and the exported drafter's training_metrics.json)")
    eval_ids, train_ids = held_out_split(unique, keys, config, state, quiet=rank != 0)
    if state is not None:
        rng.setstate(state["rng"])
    if rank == 0:
        print(f"held out for evaluation: {len(eval_ids)} sequences; training on {len(train_ids)}")
    gen = torch.Generator().manual_seed(config.seed + step)
    with_final = config.distill_weight > 0
    device = next(online.drafter.parameters()).device
    model = online
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        # The frozen embedding / lm_head are buffers, equal on every rank: not re-broadcast each step.
        model = DistributedDataParallel(online, broadcast_buffers=False,
                                        device_ids=[device.index] if device.type == "cuda" else None)

    def progress() -> float:
        p = step / config.max_steps
        if config.time_budget_s:
            p = max(p, elapsed / config.time_budget_s)
        return p

    def save() -> None:
        if rank == 0:
            atomic_torch_save({"drafter": online.drafter.state_dict(), "optimizer": opt.state_dict(), "step": step,
                               "elapsed": elapsed, "history": history, "rng": rng.getstate(),
                               "config": asdict(config), "eval_keys": sorted(keys[i] for i in eval_ids),
                               "settings_changes": changes}, ckpt)

    bar = tqdm(total=config.max_steps if not config.time_budget_s else None, initial=step, desc="train", unit="step",
               mininterval=5.0, disable=rank != 0)
    logger = MetricsLog(config.log_path if rank == 0 else None, config.tensorboard_dir if rank == 0 else None, history)
    window: dict[str, Any] = {"loss": 0.0, "n": 0, "correct": None, "count": None, "extras": {}}
    online.train()
    while progress() < 1.0:
        t0 = time.perf_counter()
        chosen = [sequences[i] for i in rng.sample(train_ids, min(config.batch_size, len(train_ids)))]
        lr = config.lr * cosine_lr(progress())
        for group in opt.param_groups:
            group["lr"] = lr
        with _autocast(online, config.precision):
            if world > 1:
                ids, mask, _ = _to(_token_batch(chosen), device)
                anchors, keep = sample_anchors(mask, online.num_anchors, gen)
                total = online.label_weight_total(ids, mask, anchors, keep)
                rows = torch.tensor_split(torch.arange(len(chosen)), world)[rank]
                local = _to(_batch([chosen[i] for i in rows], with_final, features, width=ids.shape[1]), device)
                rows = rows.to(device)
                out_step = model(**local, anchors=(anchors[rows], keep[rows]), weight_total=total, scale=float(world))
            else:
                out_step = model(**_to(_batch(chosen, with_final, features), device), generator=gen)
        opt.zero_grad(set_to_none=True)
        out_step["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        loss_value, correct, count = out_step["loss"].detach().clone(), out_step["correct"], out_step["count"]
        extras = {k: torch.stack([v[0].detach().float(), v[1].detach().float()])
                  for k, v in out_step.get("extras", {}).items()}
        if world > 1:
            for tensor in (loss_value, correct, count, *extras.values()):
                dist.all_reduce(tensor)
            loss_value /= world
        step_seconds = time.perf_counter() - t0
        elapsed += step_seconds
        window["loss"] += loss_value.item()
        window["n"] += 1
        window["correct"] = correct if window["correct"] is None else window["correct"] + correct
        window["count"] = count if window["count"] is None else window["count"] + count
        for key, pair in extras.items():
            window["extras"][key] = pair if key not in window["extras"] else window["extras"][key] + pair
        bar.update(1)
        if step % config.log_every == 0 and rank == 0:
            acc = (window["correct"] / window["count"].clamp(min=1)).tolist()
            ev = evaluate(online, [sequences[i] for i in eval_ids], config, with_final, features)
            elapsed += time.perf_counter() - t0 - step_seconds  # the budget is wall time, evaluation included
            record = {"step": step, "minutes": elapsed / 60, "lr": lr, "train_loss": window["loss"] / window["n"],
                      "train_acc": acc, **_ratios("train", window["extras"]), **ev}
            history.append(record)
            logger.write(record)
            bar.write(json.dumps({k: (float(f"{v:.3g}") if k == "lr" else round(v, 4) if isinstance(v, float)
                                      else [round(a, 3) for a in v] if isinstance(v, list) else v)
                                  for k, v in record.items()}))
        if step % config.log_every == 0:
            window = {"loss": 0.0, "n": 0, "correct": None, "count": None, "extras": {}}
        if world > 1:
            # Every rank must stop at the same step: the time budget is rank 0's clock.
            clock = torch.tensor([elapsed], dtype=torch.float64)
            dist.broadcast(clock, src=0)
            elapsed = float(clock)
        bar.set_postfix(loss=f"{loss_value.item():.3f}", lr=f"{lr:.1e}", min=f"{elapsed / 60:.1f}")
        if step % config.save_every == 0:
            save()
    bar.close()
    logger.close()
    save()
    if world > 1:
        dist.barrier()
    final = evaluate(online, [sequences[i] for i in eval_ids], config, with_final, features) if rank == 0 else {}
    final.update({"steps": step, "train_minutes": elapsed / 60})
    return {"final": final, "history": history, "settings_changes": changes}


def sequence_key(sequence: Sequence) -> str:
    """What identifies a training sequence across runs: a hash of its token ids."""
    return hashlib.sha256(sequence.input_ids.to(torch.int64).numpy().tobytes()).hexdigest()[:20]


def distinct_sequences(keys: list[str], quiet: bool = False) -> list[int]:
    """The index of each sequence's first copy. A copy on both sides of the split would make the held-out
    evaluation measure memory, and one on the training side only weighs a sequence twice: every copy after
    the first is dropped, with a warning."""
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    repeats = len(keys) - len(first)
    if repeats and not quiet:
        print(f"warning: {repeats} of {len(keys)} sequences repeat an earlier one token for token; each is used once")
    return sorted(first.values())


#: Settings whose change between invocations of one training run is worth a note (the budgets and the log
#: paths change as a matter of course).
_NOTED_SETTINGS = ("lr", "weight_decay", "batch_size", "num_anchors", "gamma", "distill_weight", "seed", "attention",
                   "precision")


def changed_settings(recorded: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {name: (recorded[name], current[name]) for name in _NOTED_SETTINGS
            if name in recorded and name in current and recorded[name] != current[name]}


def held_out_split(unique: list[int], keys: list[str], config: TrainConfig, state: dict[str, Any] | None,
                   quiet: bool = False) -> tuple[list[int], list[int]]:
    """(held-out, training) sequence indices. A resumed run keeps the held-out set its checkpoint recorded
    (by token-id hash), whatever the data, seed or settings now: drawn afresh, a grown data set or another
    seed would hold out sequences the drafter has already trained on. A fresh run (or a checkpoint from
    before the record) draws it from ``config.seed``."""
    recorded = state.get("eval_keys") if state is not None else None
    if recorded:
        held = set(recorded)
        eval_ids = [i for i in unique if keys[i] in held]
        train_ids = [i for i in unique if keys[i] not in held]
        if eval_ids and train_ids:
            return eval_ids, train_ids
        if not quiet:
            print("warning: the data no longer holds the checkpoint's held-out sequences (or holds nothing else); "
                  "a new held-out set is drawn, which may hold sequences already trained on")
    order = list(unique)
    random.Random(config.seed).shuffle(order)
    if config.eval_sequences is not None:
        n_eval = config.eval_sequences
    else:  # capped: evaluation runs inside the time budget, and a large data set must not make it eat training
        n_eval = min(int(len(order) * config.eval_fraction), config.max_eval_sequences)
    n_eval = max(1, min(n_eval, len(order) - 1))
    if config.eval_sequences is not None and n_eval != config.eval_sequences and not quiet:
        print(f"warning: {config.eval_sequences} held-out sequences asked for, {n_eval} held out: the data holds "
              f"{len(order)} distinct sequences and training needs at least one")
    return order[:n_eval], order[n_eval:]


def load_checkpoint(path: Path, drafter: torch.nn.Module, quiet: bool = False) -> dict[str, Any] | None:
    """The training state in ``path``, or None when there is none to resume.

    A checkpoint that cannot be read is named and set aside (``.damaged``), and training
    starts over: losing the steps is better than refusing to train. One whose tensors do
    not fit the drafter being trained was made for another drafter shape: refused by name.
    """
    if not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=False)
        if not isinstance(state, dict) or not {"drafter", "optimizer", "step", "elapsed", "history", "rng"} <= set(state):
            raise ValueError("not a training checkpoint")
    except Exception as err:  # noqa: BLE001 - every unreadable checkpoint is handled the same way
        if quiet:  # another rank (rank 0) sets it aside and says so
            return None
        aside = path.with_name(path.name + ".damaged")
        os.replace(path, aside)
        print(f"warning: damaged checkpoint {path} ({type(err).__name__}: {str(err)[:120]}); moved to {aside.name}, "
              "training starts from step 0")
        return None
    own = drafter.state_dict()
    for name, tensor in state["drafter"].items():
        if name in own and tuple(own[name].shape) != tuple(tensor.shape):
            raise DFlashConfigError(
                f"checkpoint {path} was made for another drafter: tensor {name} has shape {tuple(tensor.shape)}, "
                f"the drafter being trained has {tuple(own[name].shape)}; use --no_resume or another --work_dir"
            )
    missing = sorted(set(own) - set(state["drafter"]))
    if missing:
        raise DFlashConfigError(f"checkpoint {path} was made for another drafter: it lacks {missing[:3]}; "
                                "use --no_resume or another --work_dir")
    return state


@torch.no_grad()
def evaluate(online: OnlineDFlashModel, seqs: list[Sequence], config: TrainConfig, with_final: bool,
             features: TargetFeatures | None = None) -> dict[str, Any]:
    """Held-out loss, per-position top-1 accuracy and the implied expected chain tau."""
    was_training = online.training
    online.eval()
    gen = torch.Generator().manual_seed(12345)
    loss, correct, count, accepted, anchors = 0.0, None, None, 0.0, 0.0
    copy_accepted, copy_anchors = 0.0, 0.0
    extras: dict[str, torch.Tensor] = {}
    batches = [seqs[i : i + config.batch_size] for i in range(0, len(seqs), config.batch_size)]
    for chunk in batches:
        with _autocast(online, config.precision):
            out = online(**_to(_batch(chunk, with_final, features), next(online.parameters()).device), generator=gen)
        loss += float(out["loss"])
        correct = out["correct"] if correct is None else correct + out["correct"]
        count = out["count"] if count is None else count + out["count"]
        accepted += float(out["chain_accepted"])
        anchors += float(out["chain_anchors"])
        copy_accepted += float(out.get("chain_accepted_copyable", 0.0))
        copy_anchors += float(out.get("chain_anchors_copyable", 0.0))
        for key, (total, n) in out.get("extras", {}).items():
            pair = torch.stack([total.float(), n.float()]).cpu()
            extras[key] = pair if key not in extras else extras[key] + pair
    online.train(was_training)
    acc = (correct / count.clamp(min=1)).tolist()
    # Block-wise top-1 accuracies are conditional on nothing; their running product is a
    # rough estimate of chain acceptance (it ignores correlation between positions).
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return {"eval_loss": loss / max(1, len(batches)), "eval_acc": acc, "eval_tau_estimate": tau,
            # Teacher-forced chain tau: every answer position's own block, verified against the truth.
            "eval_chain_tau": 1.0 + accepted / max(1.0, anchors),
            # The same, split by whether the block's anchor ends a bigram seen earlier (copyable).
            "eval_chain_tau_copyable": 1.0 + copy_accepted / max(1.0, copy_anchors),
            "eval_chain_tau_other": 1.0 + (accepted - copy_accepted) / max(1.0, anchors - copy_anchors),
            "eval_copyable_fraction": copy_anchors / max(1.0, anchors),
            # A DFlash2 drafter's selector loss, top-K recall and the unary argmax's chain tau.
            **_ratios("eval", extras)}


def _ratios(prefix: str, sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """``{prefix}_{name}``: sum / count of each (sum, count) pair a model's ``extras`` carry."""
    return {f"{prefix}_{k}": float(v[0]) / max(1e-9, float(v[1])) for k, v in sorted(sums.items())}


#: Files of an exported DFlash drafter; anything else in the output dir (a model card) is kept.
DRAFTER_FILES = ("config.json", "model.safetensors", "model-*.safetensors", "model.safetensors.index.json",
                 "training_metrics.json")


def export(online: OnlineDFlashModel, output_dir: str | Path, card: dict[str, Any]) -> None:
    """Publish the drafter directory only once it is complete (see files.publish_dir); a DFlash2
    drafter in z-lab's DFlash2 layout."""
    from ..dflash2 import DFlash2DraftModel, save_dflash2_drafter

    with publish_dir(output_dir, DRAFTER_FILES) as staging:
        if isinstance(online.drafter, DFlash2DraftModel):
            save_dflash2_drafter(online.drafter, staging, dtype=torch.bfloat16)
        else:
            save_dflash_drafter(online.drafter, staging, dtype=torch.bfloat16)
        atomic_write_json(staging / "training_metrics.json", card, default=float)


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())

