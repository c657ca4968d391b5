"""Stand-in for ``tensorrt_llm/quantization/mode.py`` (NVIDIA/TensorRT-LLM @ 89fd9b74):
``QuantMode``, the IntFlag the layers take as ``quant_mode=QuantMode(0)`` (no quantization,
the only mode the stand-in emulates)."""

from __future__ import annotations

from enum import IntFlag


class QuantMode(IntFlag):
    INT4_WEIGHTS = 1
    INT8_WEIGHTS = 2
    ACTIVATIONS = 4
    PER_CHANNEL = 8
    PER_TOKEN = 16
    PER_GROUP = 32
    INT8_KV_CACHE = 64
    FP8_KV_CACHE = 128
    FP8_QDQ = 256
    FP8_ROWWISE = 512
    FP8_1x128_128x128 = 1024
    W4A8_QSERVE = 2048
    NVFP4 = 4096
    NVFP4_KV_CACHE = 8192
    W4A8_NVFP4_FP8 = 16384
    W4A8_MXFP4_FP8 = 32768
    W4A8_MXFP4_MXFP8 = 65536
    W4A16_MXFP4 = 131072
    COUNT = 262144
    WEIGHTS_AND_ACTIVATIONS = INT4_WEIGHTS | INT8_WEIGHTS | ACTIVATIONS
    VALID_FLAGS = COUNT - 1
