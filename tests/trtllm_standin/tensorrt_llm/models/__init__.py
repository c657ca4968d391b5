"""Stand-in for ``tensorrt_llm/models/__init__.py``: ``MODEL_MAP`` is a plain dict (index id 820782731)."""

from .llama.config import LLaMAConfig  # noqa: F401
from .llama.model import LLaMAForCausalLM
from .modeling_utils import PretrainedConfig, PretrainedModel, SpeculativeDecodingMode  # noqa: F401
from .qwen.model import QWenForCausalLM

MODEL_MAP = {
    "QWenForCausalLM": QWenForCausalLM, "Qwen2ForCausalLM": QWenForCausalLM, "Qwen3ForCausalLM": QWenForCausalLM,
    "LlamaForCausalLM": LLaMAForCausalLM, "MistralForCausalLM": LLaMAForCausalLM,
}
