"""Test-only stand-in for TensorRT-LLM 1.2.1's Python API (engine backend). See tests/trtllm_standin/README.md.

Importing the real package loads its plugin library (``_common._init`` -> ``initTrtLlmPlugins``),
which registers the GPTAttention plugin and friends in namespace ``tensorrt_llm``; the stand-in
registers its emulated GPTAttention creator here the same way.
"""

from _emu.attention import register_gpt_attention_creator

from . import functional  # noqa: F401
from .builder import BuildConfig, Builder, build  # noqa: F401
from .mapping import Mapping  # noqa: F401

__version__ = "1.2.1"

register_gpt_attention_creator()
