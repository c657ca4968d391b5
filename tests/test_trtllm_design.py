"""The engine's one-pass algorithm (model.py + runner.py), emulated in PyTorch on CPU.

model.py cannot run here, but its arithmetic can: this emulator computes exactly what the
engine graph computes, from the converted checkpoint's TensorRT-LLM tensor names —

* the in-graph greedy walk (``accepted[i] = token[i] == argmax[parent[i]] and
  accepted[parent[i]]``, block_size - 1 rounds of a gather over parents; bonus at the
  deepest accepted node),
* every pass token's drafter context K/V (k_norm, RoPE at past + depth),
* the next block attending to [context buffer, *all* pass tokens with the rejected ones
  masked out, the block] instead of a compacted cache,
* the runner's bookkeeping (buffer rows appended from the host path at commit, the
  cached block returned by ``propose``),

and drives it with the unchanged ``decode.speculative_generate``. It must give the
PyTorch runtime's tokens and per-step acceptance exactly, and its drafts must equal
``DFlashProposer``'s to 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_trtllm_convert import (
    make_drafter,
    make_target,
    merge_shards,
    read_checkpoint,
    rms,
    rope,
)

from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.drafter import save_dflash_drafter
from tensorrt_llm_dflash.proposer import DFlashProposer
from tensorrt_llm_dflash.target import HFTargetVerifier
from tensorrt_llm_dflash.tree import walk
from tensorrt_llm_dflash.trtllm.weight import DRAFTER_PREFIX, convert_checkpoint

P = DRAFTER_PREFIX


def greedy_walk(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, rounds: int):
    """model.py::_greedy_walk for one request: (accepted mask [N], count, bonus)."""
    choice = logits.argmax(-1)
    parent_index = parents.clamp(min=0)
    is_root = torch.arange(tokens.shape[0]) == 0
    acc = (tokens == choice[parent_index]) | is_root
    for _ in range(rounds):
        acc = acc & (acc[parent_index] | is_root)
    last = int(torch.argmax(acc.long() * (torch.arange(tokens.shape[0]) + 1)))
    return acc, int(acc.sum()), int(choice[last])


class EmulatedEngine:
    """TargetVerifier + cached drafts, computed the way the DFlash engine does."""

    def __init__(self, target, config: dict, W: dict) -> None:
        self.config, self.W, self.sub = config, W, config["dflash"]
        self.hf = HFTargetVerifier(target, self.sub["target_layer_ids"])
        self.vocab_size, self.max_positions, self.device = self.hf.vocab_size, self.hf.max_positions, self.hf.device
        self.block_size = self.sub["block_size"]
        self.mismatches = 0

    def synchronize(self) -> None:
        pass

    # ------------------------------------------------------------ drafter maths
    def _qkv(self, layer: int, x: torch.Tensor):
        sub, p = self.sub, f"{P}layers.{layer}."
        heads, kv, d = sub["num_attention_heads"], sub["num_key_value_heads"], sub["head_size"]
        q, k, v = F.linear(x, self.W[p + "attention.qkv.weight"]).split([heads * d, kv * d, kv * d], -1)
        q = rms(q.view(-1, heads, d).transpose(0, 1), self.W[p + "attention.q_layernorm.weight"], sub["norm_epsilon"])
        k = rms(k.view(-1, kv, d).transpose(0, 1), self.W[p + "attention.k_layernorm.weight"], sub["norm_epsilon"])
        return q, k, v.view(-1, kv, d).transpose(0, 1)

    def token_context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple]:
        """dflash_token_context_kv: per drafter layer (k [kv, T, d], v [kv, T, d])."""
        ctx = rms(F.linear(features, self.W[P + "fc.weight"]), self.W[P + "hidden_norm.weight"],
                  self.sub["norm_epsilon"])
        out = []
        for layer in range(self.sub["num_hidden_layers"]):
            _, k, v = self._qkv(layer, ctx)
            out.append((rope(k, positions, self.sub["rotary_base"]), v))
        return out

    def draft_block(self, pass_kv: list[tuple], acc: torch.Tensor, bonus: int, committed: int) -> torch.Tensor:
        sub, bsz = self.sub, self.block_size
        ids = torch.full((bsz,), sub["mask_token_id"])
        ids[0] = bonus
        x = self.W["transformer.vocab_embedding.weight"][ids]
        pos = torch.arange(committed, committed + bsz)
        heads, kv, d = sub["num_attention_heads"], sub["num_key_value_heads"], sub["head_size"]
        for layer in range(sub["num_hidden_layers"]):
            p = f"{P}layers.{layer}."
            q, k, v = self._qkv(layer, rms(x, self.W[p + "input_layernorm.weight"], sub["norm_epsilon"]))
            q, k = rope(q, pos, sub["rotary_base"]), rope(k, pos, sub["rotary_base"])
            buf_k, buf_v = self.buffer[layer]
            keys = torch.cat([buf_k, pass_kv[layer][0], k], 1).repeat_interleave(heads // kv, 0)
            values = torch.cat([buf_v, pass_kv[layer][1], v], 1).repeat_interleave(heads // kv, 0)
            keep = torch.cat([torch.ones(buf_k.shape[1], dtype=torch.bool), acc, torch.ones(bsz, dtype=torch.bool)])
            scores = (q @ keys.transpose(1, 2)) / d**0.5 + torch.where(keep, 0.0, -1e30)
            out = (scores.softmax(-1) @ values).transpose(0, 1).reshape(bsz, heads * d)
            x = x + F.linear(out, self.W[p + "attention.dense.weight"])
            h = rms(x, self.W[p + "post_layernorm.weight"], sub["norm_epsilon"])
            x = x + F.linear(F.silu(F.linear(h, self.W[p + "mlp.fc.weight"])) * F.linear(h, self.W[p + "mlp.gate.weight"]),
                             self.W[p + "mlp.proj.weight"])
        out = rms(x, self.W[P + "norm.weight"], sub["norm_epsilon"])[1:]
        return F.linear(out, self.W["lm_head.weight"])  # medusa_logits[:, 0, :vocab]

    # ---------------------------------------------------------- TargetVerifier
    @torch.no_grad()
    def prefill(self, prompt: list[int]):
        logits, features = self.hf.prefill(prompt)
        n = len(prompt)
        self.buffer = [(torch.zeros(self.sub["num_key_value_heads"], 0, self.sub["head_size"]),) * 2
                       for _ in range(self.sub["num_hidden_layers"])]
        pass_kv = self.token_context_kv(features, torch.arange(n))
        bonus = int(logits.argmax())  # a context pass accepts the whole prompt
        self.cached = self.draft_block(pass_kv, torch.ones(n, dtype=torch.bool), bonus, n)
        self.cached_bonus = bonus
        self.buffer = [(torch.cat([b[0], k], 1), torch.cat([b[1], v], 1)) for b, (k, v) in zip(self.buffer, pass_kv)]
        self.past = n
        return logits, None

    def compile_tree(self, tree):
        self._tree = tree
        return self.hf.compile_tree(tree)

    @torch.no_grad()
    def verify(self, compiled):
        tree = self._tree
        logits, features = self.hf.verify(compiled)
        self._pass_kv = self.token_context_kv(features, torch.as_tensor(self.past + tree.depths.astype(np.int64)))
        acc, count, bonus = greedy_walk(torch.as_tensor(tree.tokens), torch.as_tensor(tree.parents), logits,
                                        self.block_size - 1)
        path, host_bonus = walk(tree, logits.argmax(-1).numpy())
        assert sorted(np.flatnonzero(acc.numpy()).tolist()) == path and bonus == host_bonus  # same walk
        self.cached = self.draft_block(self._pass_kv, acc, bonus, self.past + count)
        self.cached_bonus = bonus
        return logits, None

    def commit(self, path: list[int]) -> None:
        self.hf.commit(path)
        index = torch.as_tensor(path)
        self.buffer = [(torch.cat([b[0], k[:, index]], 1), torch.cat([b[1], v[:, index]], 1))
                       for b, (k, v) in zip(self.buffer, self._pass_kv)]
        self.past += len(path)


class EmulatedProposer:
    def __init__(self, engine: EmulatedEngine) -> None:
        self.engine, self.block_size = engine, engine.block_size
        self.drafts: list[torch.Tensor] = []

    def reset(self) -> None:
        pass

    def propose(self, root: int, new_context) -> torch.Tensor:
        if root != self.engine.cached_bonus:
            self.engine.mismatches += 1
        self.drafts.append(self.engine.cached)
        return self.engine.cached


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def setup(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    # A 16-token vocabulary: a 200-node DDTree covers most of depth 1 and 2, so steps accept
    # 1-3 tokens even with a random drafter and the masked-row / commit paths are exercised.
    target = make_target(request.param, vocab=16, kv_heads=2)
    drafter = make_drafter(target, layers=2, block_size=5)
    target.save_pretrained(tmp / "target", safe_serialization=True)
    save_dflash_drafter(drafter, tmp / "drafter", dtype=torch.float32)
    config = convert_checkpoint(tmp / "target", tmp / "drafter", tmp / "ckpt", dtype="float32", progress=False)
    _, shards = read_checkpoint(tmp / "ckpt")
    return target, drafter, config, merge_shards(config, shards)


class RecordingProposer(DFlashProposer):
    def propose(self, root_token, new_context):
        out = super().propose(root_token, new_context)
        self.drafts.append(out)
        return out


@pytest.mark.parametrize("budget", [0, 3, 200])
def test_one_pass_engine_algorithm_equals_pytorch_runtime(setup, budget):
    target, drafter, config, W = setup
    accepted = []
    for prompt in ([3, 1, 5, 9, 12, 2, 11], [4, 14, 7, 7, 7]):
        reference = RecordingProposer.for_target(drafter, target)
        reference.drafts = []
        expected = speculative_generate(HFTargetVerifier(target, drafter.config.target_layer_ids), reference,
                                        prompt, 20, ddtree_budget=budget)
        engine = EmulatedEngine(target, config, W)
        proposer = EmulatedProposer(engine)
        got = speculative_generate(engine, proposer, prompt, 20, ddtree_budget=budget)
        assert got.output_ids == expected.output_ids
        assert got.stats.acceptance_lengths == expected.stats.acceptance_lengths
        accepted += got.stats.acceptance_lengths
        assert engine.mismatches == 0
        assert len(proposer.drafts) == len(reference.drafts)
        for mine, theirs in zip(proposer.drafts, reference.drafts):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    if budget == 200:
        assert max(accepted) >= 3, accepted  # multi-token commits really happened
