"""Stand-in for ``tensorrt_llm/mapping.py`` (NVIDIA/TensorRT-LLM @ b35ac1b64368513d215c57d2ed01d62d910df8da, 1.2.0rc2).

Tensor and pipeline parallelism only (cp, moe and attention-dp sizes are accepted and must be trivial)."""

from __future__ import annotations


class Mapping:
    def __init__(self, world_size=1, rank=0, gpus_per_node=8, *, cp_size=1, cp_config=None, tp_size=1, pp_size=1,
                 moe_cluster_size=-1, moe_tp_size=-1, moe_ep_size=-1, attn_tp_size=-1, attn_cp_size=-1,
                 enable_attention_dp=False, enable_lm_head_tp_in_adp=False):
        if tp_size * pp_size * cp_size != world_size:
            raise ValueError(f"world_size must equal to tp_size * pp_size * cp_size, but got {world_size} != "
                             f"{tp_size} * {pp_size} * {cp_size}")
        if cp_size != 1 or enable_attention_dp:
            raise ValueError("the stand-in Mapping only emulates tensor and pipeline parallelism")
        self.world_size, self.gpus_per_node = world_size, gpus_per_node
        self.tp_size, self.pp_size, self.cp_size = tp_size, pp_size, cp_size
        self.cp_config = cp_config or {}
        self.moe_tp_size = tp_size if moe_tp_size == -1 else moe_tp_size
        self.moe_ep_size = 1 if moe_ep_size == -1 else moe_ep_size
        self.moe_cluster_size = 1 if moe_cluster_size == -1 else moe_cluster_size
        self.attn_tp_size = tp_size if attn_tp_size == -1 else attn_tp_size
        self.attn_cp_size = 1 if attn_cp_size == -1 else attn_cp_size
        self.enable_attention_dp, self.enable_lm_head_tp_in_adp = enable_attention_dp, enable_lm_head_tp_in_adp
        self.rank = rank

    @property
    def rank(self):
        return self._rank

    @rank.setter
    def rank(self, rank):
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"Rank should be an integer between 0 and {self.world_size - 1}, but got {rank}.")
        self._rank = rank

    @property
    def tp_rank(self):
        return self.rank % self.tp_size

    @property
    def pp_rank(self):
        return self.rank // (self.tp_size * self.cp_size)

    @property
    def tp_group(self):
        base = self.pp_rank * self.tp_size * self.cp_size
        return list(range(base, base + self.tp_size))

    def has_tp(self):
        return self.tp_size > 1

    def has_pp(self):
        return self.pp_size > 1

    def is_first_pp_rank(self):
        return self.pp_rank == 0

    def is_last_pp_rank(self):
        return self.pp_rank == self.pp_size - 1

    def pp_layers(self, num_layers):
        per = [num_layers // self.pp_size + (1 if i < num_layers % self.pp_size else 0) for i in range(self.pp_size)]
        start = sum(per[: self.pp_rank])
        return list(range(start, start + per[self.pp_rank]))

    def to_dict(self):
        return {"world_size": self.world_size, "rank": self.rank, "gpus_per_node": self.gpus_per_node,
                "cp_size": self.cp_size, "tp_size": self.tp_size, "pp_size": self.pp_size,
                "moe_tp_size": self.moe_tp_size, "moe_cluster_size": self.moe_cluster_size,
                "moe_ep_size": self.moe_ep_size, "attn_tp_size": self.attn_tp_size,
                "attn_cp_size": self.attn_cp_size, "cp_config": self.cp_config,
                "enable_attention_dp": self.enable_attention_dp,
                "enable_lm_head_tp_in_adp": self.enable_lm_head_tp_in_adp}

    @classmethod
    def from_dict(cls, mapping):
        return cls(**mapping)

    def __eq__(self, other):
        return isinstance(other, Mapping) and self.to_dict() == other.to_dict()

    def __hash__(self):
        return hash((self.world_size, self.rank, self.tp_size, self.pp_size))
