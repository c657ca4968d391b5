"""Stand-in for ``tensorrt_llm/layers/normalization.py`` (NVIDIA/TensorRT-LLM @ 8134b8364431bfb2e2120feb71204fd7780209e9)."""

from __future__ import annotations

from ..functional import rms_norm
from ..module import Module
from ..parameter import Parameter


class RmsNorm(Module):
    def __init__(self, normalized_shape, num_groups=1, eps=1e-06, elementwise_affine=True, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.num_groups, self.eps, self.dtype = num_groups, eps, dtype
        if elementwise_affine:
            self.weight = Parameter(shape=self.normalized_shape, dtype=dtype)
        else:
            self.register_parameter("weight", None)

    def forward(self, x, normalized_shape=None):
        weight = None if self._parameters.get("weight") is None else self.weight.value
        return rms_norm(x, normalized_shape or self.normalized_shape, self.num_groups, weight, self.eps)
