"""Stand-in for ``tensorrt_llm/quantization/__init__.py``: re-exports ``QuantMode``."""

from .mode import QuantMode

__all__ = ["QuantMode"]
