"""Stand-in for ``tensorrt_llm/layers/embedding.py`` (NVIDIA/TensorRT-LLM @ 97e36d0b1ebd0cbaf13c560b4ef819119ba13009).
(Upstream appends zero rows up to a multiple of 8 before the lookup; lookups are unchanged by it.)"""

from __future__ import annotations

from ..functional import embedding
from ..module import Module
from ..parameter import Parameter


class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: str | None = None, tp_size: int = 1,
                 tp_group: list | None = None, sharding_dim: int = 0, tp_rank: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_size, self.tp_group, self.sharding_dim, self.tp_rank = tp_size, tp_group, sharding_dim, tp_rank
        self.weight = Parameter(shape=(num_embeddings, embedding_dim), dtype=dtype)

    def forward(self, x):
        return embedding(x, self.weight.value, tp_size=self.tp_size, tp_group=self.tp_group,
                         sharding_dim=self.sharding_dim, tp_rank=self.tp_rank)
