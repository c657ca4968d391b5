"""Which XQA kernel TensorRT-LLM's gpt attention plugin runs a spec-decoding generation step on.

Tree verification (``spec_decoding_use != 0``, several query tokens per request) runs only on
XQA: ``AttentionOp::enqueueGeneration`` tries ``mXqaDispatcher->shouldUse`` and otherwise stops
with "No available XQA kernels are found for speculative decoding mode." (a ``TLLM_CHECK`` in a
``noexcept`` path: the process aborts). This module answers, from the plugin's fields and the
GPU's SM version, whether a kernel exists, following the upstream routing step by step. The
rules were read (not copied) from NVIDIA/TensorRT-LLM; no ``v1.2.1`` tag is in the stored index,
so each rule names the commit read:

R1  ``cpp/tensorrt_llm/common/attentionOp.cpp`` @ eea41b73, ``AttentionOp::initialize``: XQA is
    enabled for spec decoding with fp16/bf16 and a KV cache; ``mEnableXQA =
    mXqaDispatcher->isSupported()``; bf16 needs SM >= 80 ("pre SM 80 GPUs do not support
    bfloat16"). ``enqueueGeneration``: XQA if ``mEnableXQA && mXqaDispatcher->shouldUse(...)``,
    else the spec-decoding refusal above.
R2  ``cpp/tensorrt_llm/kernels/xqaDispatcher.cpp`` @ 026da036: on the SM100 family
    (``isSM100Family``: SM 100 and 103, ``tests/utils/util.py``) the dispatcher uses the TRTLLM-GEN
    kernels, and ``isSupported()`` returns false for spec decoding ("TRTLLM-GEN does not support
    Speculative decoding."), so XQA is off and every spec-decoding step is refused. Elsewhere it
    asks ``DecoderXQARunner::shouldUse`` (``forConfigurePlugin=false``).
R3  ``cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttention/decoderXQARunner.cpp`` @ 83b43274,
    ``getImplFromXQAParams``: multi-query tokens take the JIT implementation when
    ``(SM == 90 && kv == e4m3 && group <= 64) || (SM == 120 && MLA && kv == e4m3) ||
    (!MLA && 64 % group == 0)``, otherwise the precompiled cubins (group = q heads / KV heads of
    the rank). ``$TRTLLM_ENABLE_XQA_JIT`` would force one side; it is not emulated (unset).
R4  ``.../decoderXQAImplJIT/decoderXQAImplJIT.cpp`` @ 89fd9b74: ``shouldUse`` = ``supportConfig``
    (QGMMA or HMMA or MLA) and ``mayHavePerfGain`` (always true for multi-query tokens).
R5  ``.../decoderXQAImplJIT/kernelUtils.cpp`` @ 602593ac: ``supportConfigCommon`` (causal mask,
    no cross attention, no sinks or position shift, q heads a multiple of KV heads, RoPE GPT-J /
    GPT-NeoX / M / long / learned-absolute / YaRN, no chunked attention); ``supportConfigQGMMA``
    (SM 90, fp16/bf16, **e4m3 KV cache** in this era, beam 1, head size a multiple of 16 in
    16..256, group * beam <= 32, paged blocks of 8/16/32/64/128 tokens);
    ``supportConfigHMMA`` (SM >= 80, fp16/bf16, KV fp16/bf16/int8/e4m3, beam 1 or 4, head size a
    multiple of 16 in 16..256, group * beam <= 32, **paged blocks of 16/32/64/128 tokens**).
R6  ``.../decoderXQAImplPrecompiled.cpp`` @ 000a01de, ``shouldUse``: fp16/bf16; head size
    64/128/256; causal; ``q_scaling == 1``; no cross attention; paged blocks of 32/64/128;
    beam 1; ``cyclic_attention_window_size == max_attention_window_size``; no sinks; then the
    cubin table lookup ``XQAKernelList::supportConfig`` (multi-query kernels: key with
    ``num_q_heads_over_kv`` 0, M tile 16 if the generation length <= 16 else 32).
R7  ``.../cubin/xqa_kernel_cubin.h`` @ 2340c776 (the same multi-query rows in the newer text
    that lists only multi-query kernels): multi-query cubins exist for **head size 128 only**,
    data type fp16/bf16 with KV of the same type or int8 (e4m3 on SM 89/90), contiguous KV or
    paged blocks of **64 or 128** tokens, M tile 16 or 32, SM **80, 86, 89, 90**
    (``getXQAKernels`` maps SM 121 to 120, which has none).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SM_ENV = "TRTLLM_STANDIN_SM"
#: The emulated GPU: an H100 (SM 90) unless ``$TRTLLM_STANDIN_SM`` says otherwise.
DEFAULT_SM = 90

CAUSAL = 1  # AttentionMaskType::CAUSAL (the stand-in's mask_type field)
# PositionEmbeddingType values supportConfigCommon accepts (R5): learned_absolute 0, rope_gptj 1,
# rope_gpt_neox 2, long_rope 3, yarn 8, mrope (kROPE_M) 9.
JIT_POSITION_TYPES = (0, 1, 2, 3, 8, 9)
SM100_FAMILY = (100, 103)
#: R7: (head size, SMs, paged tokens per block) of the multi-query precompiled cubins.
PRECOMPILED_HEAD_SIZE = 128
PRECOMPILED_SMS = (80, 86, 89, 90)
PRECOMPILED_TOKENS_PER_BLOCK = (64, 128)
HMMA_TOKENS_PER_BLOCK = (16, 32, 64, 128)
QGMMA_TOKENS_PER_BLOCK = (8, 16, 32, 64, 128)
PRECOMPILED_SHOULD_USE_TOKENS_PER_BLOCK = (32, 64, 128)


def emulated_sm() -> int:
    """The SM version of the emulated GPU (``getSMVersion()`` on a real one)."""
    return int(os.environ.get(SM_ENV, str(DEFAULT_SM)))


@dataclass(frozen=True)
class SpecStep:
    """What ``convertMMHAParamsToXQAParams`` hands XQA for one spec-decoding generation call."""

    num_q_heads: int  # of this rank
    num_kv_heads: int  # of this rank
    head_size: int
    dtype: str  # fp16 / bf16 (the plugin's type)
    kv_dtype: str  # the KV cache's element type
    paged: bool
    tokens_per_block: int
    mask_type: int
    position_embedding_type: int
    q_scaling: float
    sink_token_length: int = 0
    cross_attention: bool = False
    beam_width: int = 1
    cyclic_window_equals_max: bool = True
    generation_length: int = 1


def _common(s: SpecStep) -> str | None:
    """R5 supportConfigCommon: None when it passes, else the failed condition."""
    if s.mask_type != CAUSAL:
        return "mask_type != CAUSAL"
    if s.cross_attention:
        return "cross attention"
    if s.sink_token_length > 0:
        return "sink tokens (StreamingLLM)"
    if s.num_kv_heads and s.num_q_heads % s.num_kv_heads:
        return "q heads not a multiple of KV heads"
    if s.position_embedding_type not in JIT_POSITION_TYPES:
        return f"position embedding type {s.position_embedding_type}"
    return None


def _group(s: SpecStep) -> int:
    return 1 if s.num_kv_heads == 0 else s.num_q_heads // s.num_kv_heads


def jit_qgmma(s: SpecStep, sm: int) -> str | None:
    """R5 supportConfigQGMMA."""
    why = _common(s)
    if why:
        return why
    if sm != 90:
        return f"QGMMA needs SM 90, the GPU is SM {sm}"
    if s.dtype not in ("float16", "bfloat16"):
        return f"QGMMA needs fp16/bf16, got {s.dtype}"
    if s.kv_dtype != "fp8":
        return f"QGMMA needs an e4m3 KV cache, got {s.kv_dtype}"
    if s.beam_width != 1:
        return "QGMMA needs beam width 1"
    return _jit_shape(s, QGMMA_TOKENS_PER_BLOCK)


def _jit_shape(s: SpecStep, tokens_per_block: tuple[int, ...]) -> str | None:
    """The shape checks both JIT kernels make alike (head size, head group x beam, paged block size)."""
    if s.head_size % 16 or not 16 <= s.head_size <= 256:
        return f"head size {s.head_size} is not a multiple of 16 in 16..256"
    if _group(s) * s.beam_width > 32:
        return f"head group {_group(s)} x beam {s.beam_width} > 32"
    if s.paged and s.tokens_per_block not in tokens_per_block:
        return f"tokens_per_block {s.tokens_per_block} not in {tokens_per_block}"
    return None


def jit_hmma(s: SpecStep, sm: int) -> str | None:
    """R5 supportConfigHMMA, with the inference-time checks (forConfigurePlugin = false)."""
    why = _common(s)
    if why:
        return why
    if sm < 80:
        return f"HMMA needs SM >= 80, the GPU is SM {sm}"
    if s.dtype not in ("float16", "bfloat16"):
        return f"HMMA needs fp16/bf16, got {s.dtype}"
    if s.kv_dtype not in ("float16", "bfloat16", "int8", "fp8"):
        return f"HMMA has no KV cache type {s.kv_dtype}"
    if s.beam_width not in (1, 4):
        return f"beam width {s.beam_width}"
    return _jit_shape(s, HMMA_TOKENS_PER_BLOCK)


def precompiled(s: SpecStep, sm: int) -> str | None:
    """R6 DecoderXQAImplPrecompiled::shouldUse, then the R7 cubin table."""
    if s.dtype not in ("float16", "bfloat16"):
        return f"data type {s.dtype}"
    if s.head_size not in (64, 128, 256):
        return f"head_size {s.head_size}"
    if s.mask_type != CAUSAL:
        return "mask_type"
    if s.q_scaling != 1.0:
        return f"q_scaling {s.q_scaling} != 1"
    if s.cross_attention:
        return "cross_attention"
    if s.paged and s.tokens_per_block not in PRECOMPILED_SHOULD_USE_TOKENS_PER_BLOCK:
        return f"paged_kv_cache with tokens_per_block {s.tokens_per_block}"
    if s.beam_width != 1:
        return "beam_width"
    if not s.cyclic_window_equals_max:
        return "cyclic_attention_window_size != max_attention_window_size"
    if s.sink_token_length > 0:
        return "streaming-llm"
    # The cubin table (R7): XQAKernelList::supportConfig looks the key up for this SM.
    table_sm = 120 if sm == 121 else sm
    kv_ok = s.kv_dtype == s.dtype or s.kv_dtype == "int8" or (s.kv_dtype == "fp8" and table_sm in (89, 90))
    if s.head_size != PRECOMPILED_HEAD_SIZE:
        return f"no multi-query cubin for head size {s.head_size} (only {PRECOMPILED_HEAD_SIZE})"
    if table_sm not in PRECOMPILED_SMS:
        return f"no multi-query cubin for SM {sm} (only {PRECOMPILED_SMS})"
    if not kv_ok:
        return f"no multi-query cubin for KV cache type {s.kv_dtype} with {s.dtype}"
    if s.paged and s.tokens_per_block not in PRECOMPILED_TOKENS_PER_BLOCK:
        return f"no multi-query cubin for paged blocks of {s.tokens_per_block} tokens " \
               f"(only {PRECOMPILED_TOKENS_PER_BLOCK})"
    return None


def spec_decoding_kernel(s: SpecStep, sm: int) -> tuple[str | None, str]:
    """(the kernel that runs the step, or None; why / which path), per R1-R7."""
    if s.dtype == "bfloat16" and sm < 80:
        return None, "bf16 needs SM >= 80 (AttentionOp::initialize)"
    if sm in SM100_FAMILY:
        return None, f"SM {sm} (SM100 family) routes XQA to TRTLLM-GEN, which does not support speculative decoding"
    group = _group(s)
    use_jit = (sm == 90 and s.kv_dtype == "fp8" and group <= 64) or 64 % group == 0  # R3 (MLA is never used here)
    if use_jit:
        why_q = jit_qgmma(s, sm)
        if why_q is None:
            return "JIT QGMMA (mha_sm90.cu)", "decoderXQAImplJIT"
        why_h = jit_hmma(s, sm)
        if why_h is None:
            return "JIT HMMA (mha.cu)", "decoderXQAImplJIT"
        return None, f"head group {group} divides 64 -> JIT XQA, which refuses: {why_h}"
    why_p = precompiled(s, sm)
    if why_p is None:
        return "precompiled multi-query cubin (mha.cu)", "decoderXQAImplPrecompiled"
    return None, f"head group {group} does not divide 64 -> precompiled XQA cubins, which refuse: {why_p}"
