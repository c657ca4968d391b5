"""Tiny targets, drafters and engine builds shared by the engine tests (stand-in and GPU).

The engines are ones TensorRT-LLM 1.2.1 accepts for tree speculative decoding: bf16 or
fp16 (the gpt attention plugin's XQA path refuses fp32: "Speculative decoding mode doesn't
support the data type or cross attention.", cpp/tensorrt_llm/common/attentionOp.cpp) and a
head size MMHA supports (64). ``max_draft_len`` 40 makes the tree mask two 32-bit words
wide, so a tree of at most 32 nodes on this engine exposes any row-stride mistake.

The weights are rounded to the engine dtype, so that in the stand-in's exact numerics the
engine and the float64 PyTorch runtime compute with the same weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 32
BLOCK_SIZE = 4
MAX_DRAFT_LEN = 40
MAX_NEW = 20
PROMPTS = [[3, 17, 5, 9, 30, 2, 11], [20, 21, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
BUDGETS = [0, 1, 8, MAX_DRAFT_LEN]  # 0 = the DFlash chain; the engine maximum last
ENGINE_DTYPE = {"qwen3": "bfloat16", "llama": "float16"}


def round_to(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    torch_dtype = getattr(torch, dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(torch_dtype).to(p.dtype))
    return model


def make_target(arch: str, *, heads: int = 2, kv_heads: int = 1, head_dim: int = 64, layers: int = 4,
                seed: int = 0, vocab: int = VOCAB) -> torch.nn.Module:
    """A float64 HF target the engine can run: head_dim 64, q/k norm eps as TensorRT-LLM's (1e-5)."""
    from test_trtllm_convert import random_hf_target

    torch.manual_seed(seed)
    # transformers 5.x's LlamaConfig refuses a hidden size that is not a multiple of the head count, even with
    # an explicit head_dim (configuration_llama.py, validate_architecture): 9 heads get 72, the rest 64.
    hidden = 64 if 64 % heads == 0 else heads * -(-64 // heads)
    common = {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 128, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 256,
        "attn_implementation": "sdpa", "rope_theta": 10000.0, "bos_token_id": 0, "eos_token_id": 1,
        # TensorRT-LLM's Attention normalises q/k with its default eps 1e-5 (layers/attention.py;
        # QWenDecoderLayer passes no eps): the same value here keeps the comparison exact.
        "rms_norm_eps": 1e-5,
    }
    model = random_hf_target(arch, common, head_dim)
    model.generation_config.eos_token_id = None
    return round_to(model.double().eval(), ENGINE_DTYPE[arch])


def make_drafter(target: torch.nn.Module, arch: str, *, seed: int = 0, draft_vocab: int | None = None):
    from test_trtllm_convert import make_drafter as convert_drafter

    drafter = convert_drafter(target, layers=2, block_size=BLOCK_SIZE, seed=seed, head_dim=16,
                              draft_vocab=draft_vocab)
    return round_to(drafter.double(), ENGINE_DTYPE[arch])


def write_checkpoint(tmp: Path, arch: str, *, tp: int = 1, heads: int = 2, kv_heads: int = 1,
                     max_draft_len: int = MAX_DRAFT_LEN, draft_vocab: int | None = None):
    """(target, drafter, checkpoint dir): HF target + drafter saved and converted."""
    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.trtllm.weight import convert_checkpoint

    target = make_target(arch, heads=heads, kv_heads=kv_heads)
    drafter = make_drafter(target, arch, draft_vocab=draft_vocab)
    target.save_pretrained(tmp / "target", safe_serialization=True)
    save_dflash_drafter(drafter, tmp / "drafter", dtype=torch.float64)
    convert_checkpoint(tmp / "target", tmp / "drafter", tmp / "ckpt", dtype=ENGINE_DTYPE[arch], tp_size=tp,
                       max_draft_len=max_draft_len, progress=False)
    return target, drafter, tmp / "ckpt"


def build_argv(ckpt: Path, engine: Path, *, max_draft_len: int = MAX_DRAFT_LEN, kv_cache: str = "continuous",
               workers: int = 1, max_batch_size: int = 1, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--checkpoint_dir", str(ckpt), "--output_dir", str(engine), "--speculative_decoding_mode", "dflash",
            "--max_draft_len", str(max_draft_len), "--max_batch_size", str(max_batch_size), "--max_input_len", "32",
            "--max_seq_len", "96", "--kv_cache_type", kv_cache, "--remove_input_padding", "enable",
            "--workers", str(workers), *extra]


def pytorch_run(target, drafter, prompt: list[int], budget: int, max_new: int = MAX_NEW):
    from tensorrt_llm_dflash.decode import speculative_generate
    from tensorrt_llm_dflash.proposer import DFlashProposer
    from tensorrt_llm_dflash.target import HFTargetVerifier

    verifier = HFTargetVerifier(target, drafter.config.target_layer_ids)
    return speculative_generate(verifier, DFlashProposer.for_target(drafter, target), prompt, max_new,
                                ddtree_budget=budget)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def word_tokenizer(directory: Path, vocab: int = VOCAB):
    """A word-level tokenizer over "w00" .. "w{vocab-1}" (offline, for run.py on a tiny engine);
    "w01" is EOS. Equal-width words: a special token is never the prefix of another word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {word(i): i for i in range(vocab)}
    core = Tokenizer(models.WordLevel(words, unk_token=word(0)))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token=word(0), eos_token=word(1))
    tokenizer.save_pretrained(directory)
    return tokenizer


def word(i: int) -> str:
    return f"w{i:02d}"


BF16_TIE_GAP = 0.125  # logits; bf16 keeps 8 significant bits, the tiny targets' logits are O(10)


def greedy_with_gaps(engine, prompt: list[int]) -> tuple[list[int], list[float]]:
    """One-token steps through the engine (a one-node tree per step): tokens and top-2 gaps."""
    from tensorrt_llm_dflash.tree import build_chain

    logits = engine.prefill(prompt)[0]
    tokens, gaps = [], []
    for _ in range(MAX_NEW):
        top = torch.topk(logits, 2).values
        gaps.append(float(top[0] - top[1]))
        tokens.append(int(logits.argmax()))
        logits = engine.verify(engine.compile_tree(build_chain(tokens[-1], [])))[0][0]
        engine.commit([0])
    return tokens, gaps


def assert_bf16_rule(spec: list[int], ar: tuple[list[int], list[float]]) -> None:
    tokens, gaps = ar
    k = first_divergence(spec, tokens)
    assert k is None or gaps[k] <= BF16_TIE_GAP, (k, spec, tokens, gaps[k] if k is not None else None)


def target_greedy_with_gaps(target, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The float64 HF target's own greedy decoding, with the top-2 logit gap of every step."""
    ids = torch.tensor([prompt])
    tokens, gaps = [], []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = target(ids).logits[0, -1]
            top = torch.topk(logits, 2).values
            gaps.append(float(top[0] - top[1]))
            tokens.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, gaps


def check_engine_bf16(engine, target, budgets) -> None:
    """The contract of a bf16/fp16 engine (docs/trtllm_engine.md, "Exactness"), on every prompt and budget."""
    from tensorrt_llm_dflash.decode import speculative_generate
    from tensorrt_llm_dflash.trtllm.runner import EngineProposer

    for prompt in PROMPTS:
        ar = greedy_with_gaps(engine, prompt)
        assert_bf16_rule(ar[0], target_greedy_with_gaps(target, prompt))
        for budget in budgets:
            spec = speculative_generate(engine, EngineProposer(engine), prompt, MAX_NEW, ddtree_budget=budget)
            assert_bf16_rule(spec.output_ids, ar)
            assert engine.walk_log, (prompt, budget)
            for step, (graph_count, graph_bonus, host_count, host_bonus) in enumerate(engine.walk_log):
                assert (graph_count, graph_bonus) == (host_count, host_bonus), (prompt, budget, step)
            assert engine.mismatched_drafts == 0, (prompt, budget)
