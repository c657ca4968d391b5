"""``DFlashConfig``: the TensorRT-LLM config of a DFlash engine (the Medusa layout).

Like ``MedusaConfig`` (``tensorrt_llm/models/medusa/config.py``), it wraps the target's own
config class, ``QWenConfig`` (``models/qwen/config.py``) or ``LLaMAConfig``
(``models/llama/config.py``), built from the checkpoint's config.json, and forwards
attribute reads to it. The extra fields are ``dflash`` (the drafter's sizes, block size,
mask token, target layer ids, draft vocabulary), ``max_draft_len`` and
``num_medusa_heads`` (= block_size - 1).

``max_draft_len``: ``tensorrt_llm/builder.py::build`` reconciles ``model.config.max_draft_len``
with the build config (1.2 copies it when ``--max_draft_len`` is absent; older releases
always overwrote the flag with it), so the flag is carried here by
``$TRTLLM_DFLASH_MAX_DRAFT_LEN`` (set by ``trtllm/build.py``) and the two always agree.

Attribute writes go to the wrapped config too (``commands/build.py::build_model`` sets
``model_config.logits_dtype``), so ``to_dict()``, the engine's config.json, keeps them.

Imports tensorrt_llm at module level: import this module only where TensorRT-LLM is
installed (the package itself never imports it eagerly).
"""

from __future__ import annotations

import os
from importlib import import_module
from typing import Any

from tensorrt_llm.models.llama.config import LLaMAConfig
from tensorrt_llm.models.modeling_utils import PretrainedConfig
from tensorrt_llm.models.qwen.config import QWenConfig

from .constants import MAX_DRAFT_LEN_ENV

DFLASH_FIELDS = ("dflash", "max_draft_len", "num_medusa_heads", "base_family", "base_architecture")


class DFlashConfig(PretrainedConfig):
    def __init__(
        self,
        *,
        dflash: dict[str, Any],
        max_draft_len: int | None = None,
        num_medusa_heads: int | None = None,
        base_family: str = "qwen",
        base_architecture: str | None = None,
        **kwargs: Any,
    ) -> None:
        family_config = QWenConfig if base_family == "qwen" else LLaMAConfig
        # The wrapped config holds every PretrainedConfig field (mapping, dtype, ...).
        object.__setattr__(self, "config", family_config(**kwargs))
        block_size = int(dflash["block_size"])
        override = os.environ.get(MAX_DRAFT_LEN_ENV)
        if override:
            max_draft_len = int(override)
        self.config.dflash = dict(dflash)
        self.config.max_draft_len = int(max_draft_len if max_draft_len is not None else block_size - 1)
        self.config.num_medusa_heads = int(num_medusa_heads if num_medusa_heads is not None else block_size - 1)
        self.config.base_family = base_family
        self.config.base_architecture = base_architecture

    def to_dict(self) -> dict[str, Any]:
        output = self.config.to_dict()
        for name in DFLASH_FIELDS:
            output[name] = getattr(self.config, name)
        return output

    # Reads go to the wrapped target config (as MedusaConfig); so do writes, so that what the
    # builder sets (logits_dtype, the rank) is what to_dict() serialises.
    def __getattr__(self, name: str) -> Any:
        if name == "config":  # not yet set (unpickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.config, name, value)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # parallel_build's spawn workers unpickle the config and then look its architecture up
        # in MODEL_MAP: importing model.py registers DFlashForCausalLM there.
        import_module(".model", __package__)
