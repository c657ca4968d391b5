"""The DFlash2 section of a converted checkpoint, and what a DFlash engine refuses in it.

A DFlash2 drafter (``tensorrt_llm_dflash/dflash2``, docs/dflash2.md) converts into the same
``DFlashForCausalLM`` checkpoint as a DFlash drafter, plus ``dflash.dflash2`` in config.json
(the settings below) and the convolution and selector tensors. The engine (model.py) builds
the grouped dynamic convolutions and the candidate selector from that section, so it is checked
three times, with the same rule and the same one-line message: at conversion (weight.py, naming
the drafter's ``dflash_config`` field), by the build entry point before TensorRT-LLM starts
(build.py, naming ``CKPT/config.json dflash.dflash2.<field>``) and when the network is built
another way (model.py).

Imports neither tensorrt nor tensorrt_llm.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from ..errors import DFlashConfigError

#: Integer settings (>= 1) of the section, as in the drafter's ``dflash_config``.
INT_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
#: Float settings; ``final_logit_softcapping`` may be None (no soft cap).
FLOAT_KEYS = ("output_multiplier", "input_embedding_scale", "final_logit_softcapping")
#: The engine picks the K candidates of every draft position with one max pass over the vocabulary
#: each, unrolled in the graph (model.py, ``_top_k``: ties go to the lower token id, as in the
#: PyTorch runtime, which a TensorRT TopK layer does not promise). K passes cost K reads of
#: [block_size - 1, vocab] per step; published DFlash2 drafters use K = 16.
MAX_ENGINE_TOP_K = 64


def engine_section(settings: Any) -> dict[str, Any]:
    """``dflash.dflash2`` of a converted checkpoint from a drafter's ``DFlash2Settings``."""
    return {key: getattr(settings, key) for key in INT_KEYS + FLOAT_KEYS}


def check_section(section: Any, *, hidden_size: int, vocab_size: int, where: str) -> dict[str, Any]:
    """Refuse a section the engine cannot build, naming ``{where}.<field>`` and its value.

    ``where`` is ``dflash_config`` at conversion (the drafter's own field names) or
    ``CKPT/config.json dflash.dflash2`` at build time. Returns the section."""
    if not isinstance(section, dict):
        raise DFlashConfigError(f"{where}={section!r} is invalid: it must be an object with {INT_KEYS + FLOAT_KEYS}")
    for key in INT_KEYS:
        value = section.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DFlashConfigError(f"{where}.{key}={value!r} is invalid: it must be an integer >= 1")
    for key in FLOAT_KEYS:
        value = section.get(key, None if key == "final_logit_softcapping" else 1.0)
        if value is None and key == "final_logit_softcapping":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise DFlashConfigError(f"{where}.{key}={value!r} is invalid: it must be a finite number")
    if section.get("output_multiplier", 1.0) <= 0:
        raise DFlashConfigError(f"{where}.output_multiplier={section['output_multiplier']!r} is invalid: it must "
                                "be > 0 (a multiplier <= 0 reverses or erases the ranking of the candidates)")
    cap = section.get("final_logit_softcapping")
    if cap is not None and cap <= 0:
        raise DFlashConfigError(f"{where}.final_logit_softcapping={cap!r} is invalid: it must be > 0, or null for "
                                "no soft cap")
    if hidden_size % section["conv_group_size"]:
        raise DFlashConfigError(f"{where}.conv_group_size={section['conv_group_size']} does not divide the drafter's "
                                f"hidden_size={hidden_size}")
    top_k = section["selector_top_k"]
    if top_k > MAX_ENGINE_TOP_K:
        raise DFlashConfigError(
            f"{where}.selector_top_k={top_k} is not supported by the engine: it selects the candidates with one "
            f"max pass over the vocabulary each, unrolled in the graph, so that ties go to the lower token id as in "
            f"the PyTorch runtime; at most {MAX_ENGINE_TOP_K} (published DFlash2 drafters use 16); run this drafter "
            "with the PyTorch runtime (examples/run.py --draft_model_dir)")
    if top_k > vocab_size:
        raise DFlashConfigError(f"{where}.selector_top_k={top_k} exceeds vocab_size={vocab_size}")
    return section
