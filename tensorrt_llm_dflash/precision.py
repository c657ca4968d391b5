"""What "lossless" means in each dtype: the one statement of the guarantee.

Speculative decoding commits only tokens the target itself chooses, from the logits of a
verify pass that feeds it several tokens (the root plus a draft chain or tree) at once.

* **float64, float32, greedy (T=0):** the speculative output equals the target's own greedy
  (one token per forward) output, token for token. Tested: ``tests/test_lossless.py`` in
  float64 on tiny Qwen3/Llama targets over many seeds, block sizes and budgets; the
  embedded SmolLM2-135M target in float32 (``tests/test_real_model.py``, and the HumanEval
  runs in BENCHMARKS.md, where every output equals AR). In exact arithmetic the verify
  logits equal the one-token logits. In floating point they differ, in float32 by about
  2e-6 of the logit scale (measured below). A flip would need a top-2 logit gap that
  small, and the tests never met one.
* **float16, bfloat16, greedy:** *not guaranteed.* A verify pass over N tokens runs other
  kernels (other GEMM and attention shapes, so other reduction orders and roundings) than
  a one-token step. Where the target's top-2 logits nearly tie, the argmax can differ, and
  from that token on the two outputs go separate ways. Each committed token is still the
  argmax of the target's low-precision logits in the verify pass, so the output is a
  valid greedy decode of the target up to rounding. It is just not the same rounding as
  the AR loop's.
* **Sampling (T>0):** in exact arithmetic the output distribution is the target's
  (chi-square tests on tiny vocabularies, float64). In any dtype, sampled outputs are
  never compared token for token with AR.

Measured on the embedded SmolLM2-135M-Instruct target on this project's 2-core AMX CPU
(torch 2.13, oneDNN). Setup: 5 HumanEval prompts with the chat template, 72 greedy tokens
each, decoded one token per forward. The same tokens were then fed back as 9-token chain
verifies, root plus 8 drafted. That gives 360 positions per dtype:

=========  ======================  =====================  ====================
dtype      max abs(logit diff),    abs change of the      verify argmax
           verify vs 1-token       top-2 gap, med / max   differs from AR
=========  ======================  =====================  ====================
bfloat16   0.95 (median 0.41)      0.0625 / 0.5           2 of 360 (0.6%)
float16    0.14                    0.0078 / 0.0625        0 of 360
float32    5.9e-5                  3.8e-6 / 2.5e-5        0 of 360
=========  ======================  =====================  ====================

The top logit is about 32, where one bf16 step is 0.25. The top-2 gaps of the bf16 AR
logits are exactly 0 (bf16 logits are quantised) at 1.1% of positions, <= 0.125 at 3.6%,
<= 0.25 at 7.2% and <= 0.5 at 13.3%. A bf16 verify moves the gap by up to 0.5, so a few
tenths of a percent of tokens flip. At 0.6% per token a 128-token output diverges with
probability 1 - 0.994^128, about one half. In float32 the 1st-percentile gap (0.076) is
3,000 times the largest change (2.5e-5). float16 keeps 3 more mantissa bits than bfloat16
and moves the gap 8 times less. There is no flip in these 360 positions, but a near-tie
can still flip. End to end, in bf16 with the shipped demo
drafter on the first 5 HumanEval prompts (128 tokens), the outputs equal to AR were:
dflash 3/5, ddtree:8 4/5, ddtree:32 3/5, first differences at tokens 39-77. The user
report saw 11 of 15 runs differ on its own prompts.

Where the difference comes from: compare layer by layer on the same inputs. On this CPU
the bf16 GEMMs give rows bit-identical to M=1 for every M up to 32. From M=33 on, oneDNN
picks another kernel, and the rows differ from M=1 for every M in 33..64. RMSNorm, RoPE
and SiLU act row by row. The first layer that differs at M=9 is attention: transformers
runs a one-token step through SDPA with no mask and grouped KV heads (``enable_gqa``), but
a multi-token verify with a boolean (chain) or additive (tree) mask over repeated KV
heads. That is another kernel with another rounding: the last bit at layer 0, 0.66 logits
at the output.

**Can bf16 verification be made exact against bf16 AR at reasonable cost?** Not with
stock kernels, and not portably. Every verified node has to reproduce the reduction order
and rounding of the one-token step at its position. There are three ways to do that:

1. N separate one-token forwards. That is exact, but it costs what AR costs: 9 one-token
   steps take 9 x 36 ms here, against 40 ms for one 9-token verify (bf16, 2 threads,
   best of 20).
2. Batch-invariant kernels everywhere. A row's reduction order must not depend on how
   many rows, or which masked-out keys, share the call: fixed GEMM tiling with no split-K
   chosen by M, and attention that reduces over a node's visible keys in the one-token
   step's order and blocking. The AR reference has to run on the same kernels, so both
   give up some speed. On GPUs, where cuBLAS and flash attention pick kernels by shape,
   that means custom kernels. TensorRT-LLM engines don't have them, so they are held to
   the near-tie rule in docs/trtllm_engine.md.
3. What this CPU allows, tried as an experiment and not shipped. Run the verify's
   attention one query at a time: gather each node's visible keys in order and call the
   SDPA that a one-token step calls. The bf16 verify logits then equal AR's bit for bit:
   0 difference at all 108 positions with 9-token verifies and all 128 with 32-token
   ones. With 33-token verifies the difference is back to 0.94, from the M=33 GEMM switch.
   End to end, dflash matched 5/5 and ddtree:8 5/5. ddtree:32 (33-node verifies) still
   matched only 3/5. The Python loop over queries costs 57 vs 40 ms at 9 tokens, 83 vs 46 at
   17 and 132 vs 59 at 33. A fused kernel would cost less. The result still rests on an
   unpromised property of one oneDNN build on one CPU.

So the project promises exactness in float32/float64 only. Low-precision runs are
reported as a *match rate* against AR: fraction of prompts equal, mean first-difference
position. See ``bench.summarize``.

API: ``EXACT_DTYPES``, ``LOW_PRECISION_DTYPES``, ``SAMPLING_GUARANTEE``, ``canonical_dtype``
(normalises "bf16", ``torch.bfloat16``, ...), ``is_exact``, ``guarantee`` (one line, for ``--help`` texts)
and ``low_precision_warning`` (the stderr line a CLI prints before a speculative
fp16/bf16 run). This module does not import torch, so ``--help`` stays fast.
"""

from __future__ import annotations

from typing import Any

from .errors import DFlashInputError

#: Dtypes in which greedy speculative output equals the target's own greedy output (tested).
EXACT_DTYPES: tuple[str, ...] = ("float64", "float32")
#: Dtypes in which it may differ at near-ties (the verify pass rounds differently).
LOW_PRECISION_DTYPES: tuple[str, ...] = ("float16", "bfloat16")

_ALIASES = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32",
            "fp16": "float16", "half": "float16", "bf16": "bfloat16"}

SAMPLING_GUARANTEE = ("sampling (T>0): the output distribution is the target's in exact arithmetic "
                      "(tested in float64); sampled outputs are never compared token for token")


def canonical_dtype(dtype: Any) -> str:
    """Canonical name ("float32", "bfloat16", ...) of a dtype name, alias or ``torch.dtype``.

    Raises DFlashInputError for anything that is not one of the four supported dtypes.
    """
    text = str(dtype).strip().lower()
    text = text.removeprefix("torch.")
    text = _ALIASES.get(text, text)
    if text not in EXACT_DTYPES + LOW_PRECISION_DTYPES:
        raise DFlashInputError(
            f"dtype {dtype!r} is not one of {', '.join(EXACT_DTYPES + LOW_PRECISION_DTYPES)}")
    return text


def is_exact(dtype: Any) -> bool:
    """True where greedy speculative output is guaranteed (and tested) to equal greedy AR output."""
    return canonical_dtype(dtype) in EXACT_DTYPES


def guarantee(dtype_name: Any) -> str:
    """One line: what greedy speculative decoding guarantees in this dtype (for ``--help``)."""
    name = canonical_dtype(dtype_name)
    if name in EXACT_DTYPES:
        return (f"{name}: greedy speculative output equals the target's own greedy output token for "
                "token (tested on the CPU; on a CUDA GPU up to near-ties of the top-2 logits, see README)")
    return (f"{name}: greedy speculative output is not guaranteed to equal {name} greedy AR output: "
            "the multi-token verify pass rounds differently from a one-token step, so outputs can "
            "diverge where the top-2 logits nearly tie (use float32 for exact output)")


def low_precision_warning(dtype_name: Any, speculative: bool) -> str | None:
    """The warning a CLI prints to stderr before a speculative run in float16/bfloat16, else None.

    ``speculative`` is False for plain AR decoding, which is its own reference and needs no
    warning. Applies to sampling too: in low precision the verify pass's logits (so the
    sampled distribution) are not bit-identical to AR's.
    """
    name = canonical_dtype(dtype_name)
    if not speculative or name in EXACT_DTYPES:
        return None
    return (f"warning: --dtype {name}: speculative output is not guaranteed to equal plain {name} "
            "decoding token for token. The multi-token verify pass rounds differently from a one-token "
            "step, so outputs can diverge where the top-2 logits nearly tie. Use --dtype float32 "
            "for output guaranteed to equal the target's greedy output.")
