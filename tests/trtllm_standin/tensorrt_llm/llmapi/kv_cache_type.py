"""Stand-in for ``tensorrt_llm/llmapi/kv_cache_type.py`` (NVIDIA/TensorRT-LLM @ 18836202): in 1.2 a plain
Python enum (it never compares equal to the C++ binding's KVCacheType)."""

from __future__ import annotations

import enum


class KVCacheType(enum.Enum):
    CONTINUOUS = "continuous"
    PAGED = "paged"
    DISABLED = "disabled"

    @classmethod
    def from_string(cls, value):
        if isinstance(value, cls):
            return value
        try:
            return cls[str(value).upper()]
        except KeyError as err:
            raise ValueError(f"Unknown KVCacheType: {value}") from err
