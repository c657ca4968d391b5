"""Stand-in for ``tensorrt_llm/plugin/plugin.py`` (NVIDIA/TensorRT-LLM @ c20322ffd3dc0740ca530c9fad989b22e64f6e06).

``PluginConfig`` keeps the upstream fields and defaults (a plain class here: upstream it is a
pydantic model whose "auto" fields read back as ``dtype``). ``CustomAllReduceHelper``:
``set_workspace_tensor`` declares the ``all_reduce_workspace`` input (int64, ``7 * tp + 3``),
``allocate_workspace`` returns ``(buffers, CPU int64 tensor of their addresses)`` as upstream;
the emulated all-reduce checks that every address it is given is live device memory.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict

import torch
from _emu import device_memory

TRT_LLM_PLUGIN_NAMESPACE = "tensorrt_llm"

_FIELDS = dict(
    dtype="float16", bert_attention_plugin="auto", gpt_attention_plugin="auto", gemm_plugin=None,
    gemm_swiglu_plugin=None, fp8_rowwise_gemm_plugin=None, qserve_gemm_plugin=None, identity_plugin=None,
    nccl_plugin="auto", lora_plugin=None, dora_plugin=False, weight_only_groupwise_quant_matmul_plugin=None,
    weight_only_quant_matmul_plugin=None, smooth_quant_plugins=True, smooth_quant_gemm_plugin=None,
    layernorm_quantization_plugin=None, rmsnorm_quantization_plugin=None, quantize_per_token_plugin=False,
    quantize_tensor_plugin=False, moe_plugin="auto", mamba_conv1d_plugin="auto", low_latency_gemm_plugin=None,
    low_latency_gemm_swiglu_plugin=None, gemm_allreduce_plugin=None, context_fmha=True,
    bert_context_fmha_fp32_acc=False, paged_kv_cache=None, remove_input_padding=True, norm_quant_fusion=False,
    reduce_fusion=False, user_buffer=False, tokens_per_block=32, use_paged_context_fmha=True,
    use_fp8_context_fmha=True, fuse_fp4_quant=False, multiple_profiles=False, paged_state=True,
    streamingllm=False, manage_weights=False, use_fused_mlp=True, pp_reduce_scatter=False,
)
_BOOL_FIELDS = {k for k, v in _FIELDS.items() if isinstance(v, bool)} | {"paged_kv_cache"}
#: What trtllm-build exposes (add_plugin_argument), with its argparse defaults.
CLI_PLUGIN_ARGS = ("gpt_attention_plugin", "gemm_plugin", "nccl_plugin", "context_fmha", "remove_input_padding",
                   "tokens_per_block", "use_paged_context_fmha", "multiple_profiles", "paged_state",
                   "reduce_fusion", "use_fused_mlp")


def _coerce(name, value):
    if value == "enable":
        return True
    if value == "disable":
        return False if name in _BOOL_FIELDS else None
    return value


class PluginConfig:
    def __init__(self, **kwargs):
        object.__setattr__(self, "_values", dict(_FIELDS))
        object.__setattr__(self, "_explicitly_disable_gemm_plugin", False)
        for key, value in kwargs.items():
            if key in _FIELDS:
                setattr(self, key, value)

    def __getattr__(self, name):
        values = object.__getattribute__(self, "_values")
        if name not in values:
            raise AttributeError(name)
        value = values[name]
        return values["dtype"] if value == "auto" else value

    def __setattr__(self, name, value):
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if name not in _FIELDS:
            raise AttributeError(f"PluginConfig has no field {name!r}")
        if name == "dtype" and value == "auto":
            raise ValueError("PluginConfig.dtype cannot be 'auto'")
        self._values[name] = _coerce(name, value)

    @classmethod
    def from_arguments(cls, args):
        config = cls(**{k: v for k, v in vars(args).items() if k in _FIELDS})
        if getattr(args, "gemm_plugin", None) == "disable":
            config._explicitly_disable_gemm_plugin = True
        return config

    def validate(self):
        return None

    # pydantic.BaseModel's own methods upstream (PluginConfig does not override them); only the
    # plain dump and copy are emulated.
    def model_dump(self, *, mode="python", include=None, exclude=None, context=None, by_alias=None,
                   exclude_unset=False, exclude_defaults=False, exclude_none=False, round_trip=False, warnings=True,
                   fallback=None, serialize_as_any=False):
        if include is not None or exclude is not None or exclude_unset or exclude_defaults or exclude_none:
            raise NotImplementedError("the stand-in emulates a plain model_dump()")
        return {k: (v.value if hasattr(v, "value") else v) for k, v in self._values.items()}

    def model_copy(self, *, update=None, deep=False):
        clone = PluginConfig()
        clone._values = dict(self._values)
        for k, v in (update or {}).items():
            setattr(clone, k, v)
        return clone

    def set_nccl_plugin(self, dtype="auto"):
        self.nccl_plugin = dtype
        init_all_reduce_helper()
        return self

    def to_legacy_setting(self):
        return self


# Upstream's pydantic model takes every field as a keyword: say so to inspect.signature (the
# stand-in keeps them in _values so "auto" can read back as dtype).
PluginConfig.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=value) for name, value in _FIELDS.items()])


def add_plugin_argument(parser):
    defaults = PluginConfig()
    for name in CLI_PLUGIN_ARGS:
        value = defaults._values[name]
        if name == "tokens_per_block":
            parser.add_argument("--" + name, type=int, default=value)
        elif name in _BOOL_FIELDS:
            parser.add_argument("--" + name, type=str, choices=["enable", "disable"],
                                default="enable" if value else "disable")
        else:
            parser.add_argument("--" + name, type=str, default=value)
    return parser


class CustomAllReduceHelper:
    POINTERS_PER_RANK = 7
    POINTERS_OF_COUNTER = 3

    def __init__(self) -> None:
        self.workspace = None

    def set_workspace_tensor(self, mapping, num_profiles=None):
        import tensorrt as trt

        from ..functional import Tensor

        workspace_size = self.POINTERS_PER_RANK * mapping.tp_size + self.POINTERS_OF_COUNTER
        dim_range = None
        if num_profiles is not None:
            dim_range = OrderedDict([("all_reduce_size", [workspace_size] * num_profiles)])
        self.workspace = Tensor(name="all_reduce_workspace", dtype=trt.int64, shape=[workspace_size],
                                dim_range=dim_range)

    @staticmethod
    def max_workspace_size_auto(tp_size, support_deterministic=True):
        return 16_000_000 if tp_size <= 2 else 8_000_000

    @staticmethod
    def allocate_workspace(mapping, size):
        """Eight emulated IPC buffers (ping, pong, barriers in/out, three lamport buffers, a
        counter) and the CPU int64 tensor of their per-rank addresses plus three counter pointers."""
        tp = mapping.tp_size
        buffers = [torch.zeros(max(int(size) // 8, 1), dtype=torch.int64) for _ in range(7)]
        counter = torch.zeros(3, dtype=torch.int64)
        pointers = []
        for buf in buffers:
            device_memory.register(buf)
            pointers += [buf.data_ptr()] * tp
        device_memory.register(counter)
        pointers += [counter.data_ptr() + 8 * i for i in range(3)]
        return buffers + [counter], torch.tensor(pointers, dtype=torch.int64)


custom_all_reduce_helper = None


def init_all_reduce_helper():
    global custom_all_reduce_helper
    custom_all_reduce_helper = CustomAllReduceHelper()


def current_all_reduce_helper():
    assert custom_all_reduce_helper is not None, "You must call `init_all_reduce_helper` first"
    return custom_all_reduce_helper
