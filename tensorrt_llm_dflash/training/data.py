"""Self-distillation data: the target's own greedy answers plus its hidden states.

Each prompt goes through the target's chat template; the target answers greedily, and the
same decode steps record the hidden states the drafter reads (``target_layer_ids``, HF
convention) and the final normed hidden state (for optional logit distillation). Only the
answer tokens carry loss.

Why cache rather than regenerate: the target is frozen, so its hidden states never
change, and on a CPU a target forward costs several times a drafter training step.
Caching them once (bf16: SmolLM2 hidden states reach |h| ~ 25k, beyond fp16) makes
every epoch cost only the drafter. Data are written in shards as they are produced,
so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import DFlashConfigError
from ..files import atomic_torch_save, atomic_write_json, remove_stale_temporaries


@dataclass
class Sequence:
    input_ids: torch.Tensor  # int64 [S]
    loss_mask: torch.Tensor  # bool [S]: True on answer tokens
    features: torch.Tensor  # bf16 [S, len(layer_ids) * H]
    final_hidden: torch.Tensor | None  # bf16 [S, H]


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


@dataclass
class Generated:
    answer: list[int]  # greedy answer tokens, ending at the first stop token if one came
    features: torch.Tensor  # bf16 [len(prompt) + len(answer), K*H]
    final_hidden: torch.Tensor  # bf16 [len(prompt) + len(answer), H]


@torch.inference_mode()
def generate_with_hidden_states(
    model: Any,
    prompt_ids: list[list[int]],
    layer_ids: list[int],
    max_new_tokens: int,
    stop_ids: set[int],
    pad_id: int,
) -> list[Generated]:
    """Batched greedy generation that records the drafter's features on the way.

    Why not ``generate`` plus a second forward pass: the decode steps already compute every
    hidden state the drafter reads, a finished row would keep costing a full step until the
    longest answer ends, and a full forward would also pay the lm_head on every prompt
    position. Here prefill keeps only the last logits, finished rows leave the batch (and
    its KV cache), and each step's hidden states are kept. The last answer token is never
    fed, so its features are zeros: no block ever reads them (context is strictly before an
    anchor, and an anchor needs a label after it).
    """
    device = model.device
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, p in enumerate(prompt_ids):
        ids[row, width - len(p):] = torch.tensor(p)
        attn[row, width - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True,
                output_hidden_states=True, logits_to_keep=1)
    feats, finals = _layer_features(out.hidden_states, layer_ids)
    rows_feats = [[feats[row, width - len(p):]] for row, p in enumerate(prompt_ids)]
    rows_final = [[finals[row, width - len(p):]] for row, p in enumerate(prompt_ids)]
    answers: list[list[int]] = [[] for _ in prompt_ids]
    cache = out.past_key_values
    active = torch.arange(len(prompt_ids), device=device)  # batch row -> prompt index
    next_tokens = out.logits[:, -1].argmax(-1)
    next_pos = positions[:, -1] + 1
    for step in range(max_new_tokens):
        done = []
        for index, token in zip(active.tolist(), next_tokens.tolist()):
            answers[index].append(token)
            done.append(token in stop_ids or step == max_new_tokens - 1)
        keep = torch.tensor([not d for d in done], device=device)
        if not keep.any():
            break
        if not keep.all():
            rows = keep.nonzero().squeeze(1)
            cache.batch_select_indices(rows)
            active, next_tokens, next_pos, attn = active[rows], next_tokens[rows], next_pos[rows], attn[rows]
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        out = model(input_ids=next_tokens[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                    past_key_values=cache, use_cache=True, output_hidden_states=True)
        feats, finals = _layer_features(out.hidden_states, layer_ids)
        for row, index in enumerate(active.tolist()):
            rows_feats[index].append(feats[row])
            rows_final[index].append(finals[row])
        cache = out.past_key_values
        next_tokens = out.logits[:, -1].argmax(-1)
        next_pos = next_pos + 1
    results = []
    for index, answer in enumerate(answers):
        f = torch.cat(rows_feats[index])
        h = torch.cat(rows_final[index])
        # The last answer token was never fed: pad its (never read) features with zeros.
        results.append(Generated(answer, torch.cat([f, f.new_zeros(1, f.shape[1])]),
                                 torch.cat([h, h.new_zeros(1, h.shape[1])])))
    return results


def _layer_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    feats = torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1).to(torch.bfloat16).cpu()
    return feats, hidden_states[-1].to(torch.bfloat16).cpu()


@torch.inference_mode()
def capture_hidden_states(
    model: Any, sequences: list[list[int]], layer_ids: list[int], pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(features [S, K*H], final normed hidden [S, H]) per sequence, bf16, right padded batch:
    one full forward pass, the reference the decode-time capture is tested against."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
    out = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), output_hidden_states=True)
    feats, final = _layer_features(out.hidden_states, layer_ids)
    return [(feats[row, : len(s)].clone(), final[row, : len(s)].clone()) for row, s in enumerate(sequences)]


def build_distillation_data(
    out_dir: str | Path,
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    layer_ids: list[int],
    *,
    max_new_tokens: int = 128,
    batch_size: int = 48,
    time_budget_s: float | None = None,
    max_prompt_tokens: int = 384,
) -> dict[str, Any]:
    """Write shards ``shard_00000.pt ...`` and ``meta.json`` into ``out_dir``; resumable.

    A resumed run skips every prompt some shard already answered (matched by its tokens, so
    resuming stays correct if the prompt list changed), and numbers new shards after the
    existing ones. Prompts longer than ``max_prompt_tokens`` are skipped: a batch is left
    padded to its longest prompt, so one outlier would multiply the whole batch's cost.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stop_ids = {int(t) for t in _as_list(model.generation_config.eos_token_id)}
    pad_id = int(model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None else min(stop_ids))
    remove_stale_temporaries(out)
    done: set[tuple[int, ...]] = set()
    stats = {"sequences": 0, "answer_tokens": 0, "total_tokens": 0, "batches": 0}
    existing = []
    for shard, data in readable_shards(out, remove_damaged=True):
        existing.append(shard)
        done.update(tuple(ids[:start].tolist()) for ids, start in zip(data["input_ids"], data["answer_start"]))
        _count(stats, data["input_ids"], data["answer_start"])
    # New shards are numbered after the highest existing one, so a rebuilt gap never overwrites a good shard.
    first_index = 1 + max((int(p.stem.split("_")[1]) for p in existing), default=-1)
    encoded = [(i, chat_prompt_ids(tokenizer, p)) for i, p in enumerate(prompts)]
    too_long = sum(len(ids) > max_prompt_tokens for _, ids in encoded)
    if too_long:
        print(f"skipping {too_long} prompts longer than {max_prompt_tokens} tokens")
    encoded = [(i, ids) for i, ids in encoded if len(ids) <= max_prompt_tokens and tuple(ids) not in done]
    # Similar lengths share a batch (less padding), but only within windows of 8 batches of
    # the given (shuffled) order: a time budget that stops early still sees every kind of
    # prompt, not just the shortest ones.
    window = batch_size * 8
    encoded = [item for w in range(0, len(encoded), window)
               for item in sorted(encoded[w : w + window], key=lambda item: len(item[1]))]
    batches = [encoded[i : i + batch_size] for i in range(0, len(encoded), batch_size)]
    # The time budget counts every invocation: a resumed run continues the same clock.
    meta_path = out / "meta.json"
    spent = _read_meta(meta_path).get("seconds", 0.0)
    start = time.perf_counter()
    bar = tqdm(batches, desc="self-distillation data", unit="batch", mininterval=5.0)
    answer_tokens = 0
    for index, batch in enumerate(bar, start=first_index):
        shard = out / f"shard_{index:05d}.pt"
        if time_budget_s is not None and spent + time.perf_counter() - start > time_budget_s:
            bar.write(f"data time budget of {time_budget_s:.0f}s reached: {index - first_index} of {len(batches)} "
                      f"new batches ({len(existing)} from earlier runs)")
            break
        generated = generate_with_hidden_states(model, [p for _, p in batch], layer_ids, max_new_tokens, stop_ids, pad_id)
        data = {
            "prompt_index": [i for i, _ in batch],
            "input_ids": [torch.tensor(p + g.answer, dtype=torch.int32) for (_, p), g in zip(batch, generated)],
            "answer_start": [len(p) for _, p in batch],
            "features": [g.features for g in generated],
            "final_hidden": [g.final_hidden for g in generated],
        }
        atomic_torch_save(data, shard)
        _count(stats, data["input_ids"], data["answer_start"])
        answer_tokens += sum(len(g.answer) for g in generated)
        # Keep the clock on disk after every shard, so an interrupted run resumes its budget too.
        atomic_write_json(meta_path, {"seconds": spent + time.perf_counter() - start, "complete": False}, indent=None)
        bar.set_postfix(answer_tok_per_s=f"{answer_tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    meta = {"layer_ids": list(layer_ids), "max_new_tokens": max_new_tokens, "num_prompts": len(prompts),
            "seconds": spent + time.perf_counter() - start, "complete": True, **stats}
    atomic_write_json(meta_path, meta)
    return meta


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        print(f"warning: {path} is damaged ({err}); the data stage's clock restarts at 0")
        return {}
    return meta if isinstance(meta, dict) else {}


def readable_shards(data_dir: Path, remove_damaged: bool, mmap: bool = False) -> list[tuple[Path, dict[str, Any]]]:
    """(path, contents) of every shard that loads; a damaged one is named, and deleted when
    ``remove_damaged`` (the data stage then answers its prompts again), else skipped."""
    good = []
    for shard in sorted(data_dir.glob("shard_*.pt")):
        try:
            data = torch.load(shard, mmap=mmap, weights_only=True)
            if not isinstance(data, dict) or not {"input_ids", "answer_start", "features"} <= set(data):
                raise ValueError("not a data shard (missing input_ids / answer_start / features)")
        except Exception as err:  # noqa: BLE001 - any unreadable shard is handled the same way
            action = "deleted; its prompts are answered again" if remove_damaged else "skipped"
            print(f"warning: damaged data shard {shard} ({type(err).__name__}: {str(err)[:120]}): {action}")
            if remove_damaged:
                shard.unlink(missing_ok=True)
            continue
        good.append((shard, data))
    return good


def _count(stats: dict[str, int], input_ids: list[torch.Tensor], answer_starts: list[int]) -> None:
    stats["batches"] += 1
    stats["sequences"] += len(input_ids)
    stats["answer_tokens"] += sum(len(ids) - a for ids, a in zip(input_ids, answer_starts))
    stats["total_tokens"] += sum(len(ids) for ids in input_ids)


def load_distillation_data(data_dir: str | Path, with_final_hidden: bool = False) -> list[Sequence]:
    shards = readable_shards(Path(data_dir), remove_damaged=False)
    if not shards:
        raise DFlashConfigError(f"no readable shard_*.pt files in {str(data_dir)!r}")
    sequences: list[Sequence] = []
    for _, data in shards:
        for ids, start, feats, final in zip(data["input_ids"], data["answer_start"], data["features"], data["final_hidden"]):
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[start:] = True
            sequences.append(Sequence(ids.long(), mask, feats, final if with_final_hidden else None))
    return sequences


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
