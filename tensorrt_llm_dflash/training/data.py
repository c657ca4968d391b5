"""Self-distillation data: the target's own greedy answers plus its hidden states.

Each prompt goes through the target's chat template; the target answers greedily; one
more forward pass over prompt + answer captures the hidden states the drafter reads
(``target_layer_ids``, HF convention) and the final normed hidden state (for optional
logit distillation). Only the answer tokens carry loss.

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


@dataclass
class Sequence:
    input_ids: torch.Tensor  # int64 [S]
    loss_mask: torch.Tensor  # bool [S]: True on answer tokens
    features: torch.Tensor  # bf16 [S, len(layer_ids) * H]
    final_hidden: torch.Tensor | None  # bf16 [S, H]


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


@torch.inference_mode()
def greedy_answers(
    model: Any, prompt_ids: list[list[int]], max_new_tokens: int, stop_ids: set[int], pad_id: int
) -> list[list[int]]:
    """Batched greedy generation with left padding; answers end at the first stop token."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompt_ids):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    out = model.generate(
        input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
        max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=sorted(stop_ids),
    )[:, width:].tolist()
    answers = []
    for row in out:
        answer: list[int] = []
        for token in row:
            answer.append(token)
            if token in stop_ids:
                break
        answers.append(answer)
    return answers


@torch.inference_mode()
def capture_hidden_states(
    model: Any, sequences: list[list[int]], layer_ids: list[int], pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(features [S, K*H], final normed hidden [S, H]) per sequence, bf16, right padded batch."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
    out = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), output_hidden_states=True)
    hs = out.hidden_states
    feats = torch.cat([hs[i + 1] for i in layer_ids], dim=-1).to(torch.bfloat16).cpu()
    final = hs[-1].to(torch.bfloat16).cpu()
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
) -> dict[str, Any]:
    """Write shards ``shard_00000.pt ...`` and ``meta.json`` into ``out_dir``; resumable."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stop_ids = {int(t) for t in _as_list(model.generation_config.eos_token_id)}
    pad_id = int(model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None else min(stop_ids))
    encoded = [(i, chat_prompt_ids(tokenizer, p)) for i, p in enumerate(prompts)]
    # Similar lengths share a batch: less padding, and the order stays deterministic.
    encoded.sort(key=lambda item: len(item[1]))
    batches = [encoded[i : i + batch_size] for i in range(0, len(encoded), batch_size)]
    # The time budget counts every invocation: a resumed run continues the same clock.
    meta_path = out / "meta.json"
    spent = json.loads(meta_path.read_text()).get("seconds", 0.0) if meta_path.exists() else 0.0
    start = time.perf_counter()
    bar = tqdm(batches, desc="self-distillation data", unit="batch", mininterval=5.0)
    for index, batch in enumerate(bar):
        shard = out / f"shard_{index:05d}.pt"
        if shard.exists():
            continue
        if time_budget_s is not None and spent + time.perf_counter() - start > time_budget_s:
            bar.write(f"data time budget of {time_budget_s:.0f}s reached: {index} of {len(batches)} batches")
            break
        answers = greedy_answers(model, [p for _, p in batch], max_new_tokens, stop_ids, pad_id)
        seqs = [p + a for (_, p), a in zip(batch, answers)]
        hidden = capture_hidden_states(model, seqs, layer_ids, pad_id)
        torch.save({
            "prompt_index": [i for i, _ in batch],
            "input_ids": [torch.tensor(s, dtype=torch.int32) for s in seqs],
            "answer_start": [len(p) for _, p in batch],
            "features": [h[0] for h in hidden],
            "final_hidden": [h[1] for h in hidden],
        }, shard)
        bar.set_postfix(answer_tokens=sum(len(a) for a in answers))
    bar.close()
    stats = {"sequences": 0, "answer_tokens": 0, "total_tokens": 0, "batches": 0}
    for shard in sorted(out.glob("shard_*.pt")):
        data = torch.load(shard)
        stats["batches"] += 1
        stats["sequences"] += len(data["input_ids"])
        stats["answer_tokens"] += sum(len(s) - a for s, a in zip(data["input_ids"], data["answer_start"]))
        stats["total_tokens"] += sum(len(s) for s in data["input_ids"])
    meta = {"layer_ids": list(layer_ids), "max_new_tokens": max_new_tokens, "num_prompts": len(prompts),
            "seconds": spent + time.perf_counter() - start, **stats}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_distillation_data(data_dir: str | Path, with_final_hidden: bool = False) -> list[Sequence]:
    shards = sorted(Path(data_dir).glob("shard_*.pt"))
    if not shards:
        raise FileNotFoundError(f"no shard_*.pt files in {str(data_dir)!r}")
    sequences: list[Sequence] = []
    for shard in shards:
        data = torch.load(shard)
        for ids, start, feats, final in zip(data["input_ids"], data["answer_start"], data["features"], data["final_hidden"]):
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[start:] = True
            sequences.append(Sequence(ids.long(), mask, feats, final if with_final_hidden else None))
    return sequences


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
