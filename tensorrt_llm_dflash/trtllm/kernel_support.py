"""Which target shapes, KV block sizes and GPUs TensorRT-LLM's tree-verification attention can run.

A DFlash engine verifies its tree with the gpt attention plugin in spec-decoding mode, and
TensorRT-LLM runs that mode on XQA kernels only: when no XQA kernel fits, the plugin stops at
the first verify step with "No available XQA kernels are found for speculative decoding mode."
inside a ``noexcept`` path, so the process aborts (TensorRT-LLM issues #6158, #6067). This
module states the rule once, in this project's words, so that ``trtllm-build`` (build.py), the
network (model.py) and the runner refuse such an engine by name before any heavy work.

Read (not copied) from NVIDIA/TensorRT-LLM; the stored index has no ``v1.2.1`` tag (the newest
version string is 1.2.0rc2 @ b35ac1b6), so each rule names the commit it was read at:

* ``cpp/tensorrt_llm/common/attentionOp.cpp`` @ eea41b73 (``AttentionOp::initialize``,
  ``enqueueGeneration``): spec decoding needs fp16/bf16 and XQA; bf16 needs SM >= 80.
* ``cpp/tensorrt_llm/kernels/xqaDispatcher.cpp`` @ 026da036: on the SM100 family (SM 100/103)
  XQA goes to the TRTLLM-GEN kernels, whose ``isSupported()`` is false for speculative decoding.
* ``.../decoderMaskedMultiheadAttention/decoderXQARunner.cpp`` @ 83b43274
  (``getImplFromXQAParams``): with several query tokens and a bf16/fp16 KV cache, a head group
  (q heads / KV heads of a rank) dividing 64 goes to the JIT kernels, any other group to the
  precompiled cubins.
* ``.../decoderXQAImplJIT/kernelUtils.cpp`` @ 602593ac (``supportConfigHMMA``): SM >= 80, head
  size a multiple of 16 in 16..256, head group <= 32, paged blocks of 16, 32, 64 or 128 tokens.
* ``.../decoderXQAImplPrecompiled.cpp`` @ 000a01de (``shouldUse``) and ``.../cubin/
  xqa_kernel_cubin.h`` @ 2340c776: multi-query cubins exist for head size 128 only, contiguous
  KV or paged blocks of 64 or 128 tokens, SM 80, 86, 89 and 90.

The test-only stand-in implements the same routing independently (``tests/trtllm_standin/
_emu/xqa.py``), following the upstream code path; a test holds the two to the same answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DFlashConfigError

#: Engine dtypes the plugin's spec-decoding (XQA) path takes.
SPEC_DTYPES = ("float16", "bfloat16")
#: JIT (HMMA) kernels: paged KV block sizes (kernelUtils.cpp, supportConfigHMMA).
JIT_TOKENS_PER_BLOCK = (16, 32, 64, 128)
#: Precompiled multi-query cubins (xqa_kernel_cubin.h): head size, paged block sizes, GPUs.
CUBIN_HEAD_SIZE = 128
CUBIN_TOKENS_PER_BLOCK = (64, 128)
CUBIN_SMS = (80, 86, 89, 90)
#: GPUs whose XQA dispatcher refuses spec decoding (xqaDispatcher.cpp, isSM100Family).
TRTLLM_GEN_SMS = (100, 103)
#: TensorRT-LLM's default ``--tokens_per_block`` (tensorrt_llm/plugin/plugin.py @ c20322ff, PluginConfig).
DEFAULT_TOKENS_PER_BLOCK = 32

RUNNER_SRC = "decoderXQARunner.cpp @ 83b43274"
HMMA_SRC = "kernelUtils.cpp @ 602593ac supportConfigHMMA"
CUBIN_SRC = "xqa_kernel_cubin.h @ 2340c776"
DISPATCH_SRC = "xqaDispatcher.cpp @ 026da036"
OP_SRC = "attentionOp.cpp @ eea41b73"
ABORT = 'the engine would abort at its first verify step ("No available XQA kernels are found for speculative ' \
        'decoding mode")'
WHAT_WORKS = ("what works: q/KV heads per rank in a group dividing 64 (1, 2, 4, 8, 16 or 32) with a head size that "
              "is a multiple of 16 up to 256 (e.g. Qwen3-8B: 32/8 heads of 128), or head size 128 with "
              "--tokens_per_block 64 or 128 (or --kv_cache_type continuous) on SM 80/86/89/90; "
              "table in docs/trtllm_engine.md")


@dataclass(frozen=True)
class TargetAttention:
    """The target's attention as one tensor-parallel rank of the engine sees it."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: str
    tp_size: int = 1

    @property
    def rank_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def rank_kv_heads(self) -> int:
        # KV heads are duplicated when there are fewer than tp ranks (weight.py, dup_kv_weight).
        return max(self.num_kv_heads // self.tp_size, 1)

    @property
    def group(self) -> int:
        return max(self.rank_heads // self.rank_kv_heads, 1)

    def describe(self) -> str:
        per_rank = " per rank" if self.tp_size > 1 else ""
        return (f"target attention ({self.rank_heads} q / {self.rank_kv_heads} KV heads{per_rank}, head size "
                f"{self.head_size}, {self.dtype})")


def device_sm(device: object = None) -> int | None:
    """The SM version (major * 10 + minor) of a CUDA device, or None without one (the build then
    checks what holds on every GPU, and the runner checks the SM when it loads the engine)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of this package
        return None
    if not torch.cuda.is_available():
        return None
    if device is not None and getattr(torch.device(device), "type", "cuda") != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def spec_decoding_kernel(shape: TargetAttention, *, paged: bool, tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK,
                         sm: int | None = None) -> str:
    """The XQA kernel family that verifies trees for this engine; raises DFlashConfigError (one
    line: field, value, rule, source, what works) when TensorRT-LLM has none. ``sm`` None: the
    GPU is not known yet, only what fails on every GPU is refused."""
    what = shape.describe()
    if shape.dtype not in SPEC_DTYPES:
        raise DFlashConfigError(
            f"dtype={shape.dtype!r}: TensorRT-LLM verifies trees (spec decoding) in fp16/bf16 only ({OP_SRC}, "
            "AttentionOp::initialize: \"Speculative decoding mode doesn't support the data type\"); convert with "
            "--dtype bfloat16 or float16")
    if shape.num_heads % shape.tp_size or shape.rank_heads % shape.rank_kv_heads:
        raise DFlashConfigError(
            f"{what}: q heads per rank must be a multiple of KV heads per rank ({OP_SRC}: \"mNumHeads should be "
            f"multiples of mNumKVHeads\") at tp_size={shape.tp_size}")
    if sm is not None and sm in TRTLLM_GEN_SMS:
        raise DFlashConfigError(
            f"GPU SM {sm}: on the SM100 family XQA runs the TRTLLM-GEN kernels, whose isSupported() is false for "
            f"speculative decoding ({DISPATCH_SRC}: \"TRTLLM-GEN does not support Speculative decoding\"; "
            f"TensorRT-LLM issue #6158): {ABORT}; build and run on SM 80/86/89/90 (A100, L40S, H100/H200)")
    if sm is not None and sm < 80:
        raise DFlashConfigError(
            f"GPU SM {sm}: TensorRT-LLM's XQA kernels for tree verification need SM >= 80 ({HMMA_SRC}; {CUBIN_SRC}; "
            f"bf16 too, {OP_SRC}): {ABORT}; use an Ampere or newer GPU (SM 80/86/89/90)")
    if 64 % shape.group == 0:
        # decoderXQARunner: JIT kernels (mha.cu compiled at run time, HMMA for a bf16/fp16 cache).
        if shape.head_size % 16 or not 16 <= shape.head_size <= 256 or shape.group > 32:
            raise DFlashConfigError(
                f"{what}: head group {shape.group} divides 64, so {RUNNER_SRC} picks the JIT XQA kernels, which need "
                f"a head size that is a multiple of 16 in 16..256 and a head group <= 32 ({HMMA_SRC}): {ABORT}; "
                f"{WHAT_WORKS}")
        if paged and tokens_per_block not in JIT_TOKENS_PER_BLOCK:
            raise DFlashConfigError(
                f"--tokens_per_block={tokens_per_block}: the JIT XQA kernels take paged KV blocks of "
                f"{'/'.join(map(str, JIT_TOKENS_PER_BLOCK))} tokens only ({HMMA_SRC}): {ABORT}; pass "
                "--tokens_per_block 64 (or 16, 32, 128)")
        return f"JIT XQA (HMMA, head group {shape.group}; {RUNNER_SRC}, {HMMA_SRC})"
    # Any other group: the precompiled multi-query cubins.
    if shape.head_size != CUBIN_HEAD_SIZE:
        raise DFlashConfigError(
            f"{what}: head group {shape.group} does not divide 64, so {RUNNER_SRC} picks the precompiled XQA cubins, "
            f"whose multi-query (spec-decoding) kernels exist for head size {CUBIN_HEAD_SIZE} only ({CUBIN_SRC}): "
            f"{ABORT}; {WHAT_WORKS}")
    if paged and tokens_per_block not in CUBIN_TOKENS_PER_BLOCK:
        raise DFlashConfigError(
            f"--tokens_per_block={tokens_per_block}: head group {shape.group} does not divide 64, so {RUNNER_SRC} "
            f"picks the precompiled XQA cubins, which exist for paged KV blocks of "
            f"{'/'.join(map(str, CUBIN_TOKENS_PER_BLOCK))} tokens only ({CUBIN_SRC}): {ABORT}; pass "
            "--tokens_per_block 64 or 128, or --kv_cache_type continuous")
    if sm is not None and sm not in CUBIN_SMS:
        raise DFlashConfigError(
            f"GPU SM {sm}: head group {shape.group} does not divide 64, so {RUNNER_SRC} picks the precompiled XQA "
            f"cubins, built for SM {'/'.join(map(str, CUBIN_SMS))} only ({CUBIN_SRC}): {ABORT}; run on one of "
            "those GPUs or use a target whose head group divides 64")
    return f"precompiled XQA cubin (head group {shape.group}, head size 128; {RUNNER_SRC}, {CUBIN_SRC})"
