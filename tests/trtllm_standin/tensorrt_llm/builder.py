"""Stand-in for ``tensorrt_llm/builder.py`` (NVIDIA/TensorRT-LLM, newest text index id 205252225; corroborated
@ 008b2b8d23af95e4e19fa6f354f9c5f6349b2bfc): ``BuildConfig``, ``build``, ``Builder``, ``Engine``.

``build`` follows upstream step by step: ``_init_max_seq_len`` / ``check_max_num_tokens``,
``max_draft_len`` taken from the model config when the flag is 0, a speculative mode adds
``max_draft_len`` to ``max_seq_len`` and raises ``max_num_tokens`` to ``B * (D + 1)``,
``prepare_inputs(**prepare_input_args)`` then ``model(**inputs)`` under ``net_guard``,
``_validate_named_dimensions``, and ``build_engine`` under ``IS_BUILDING=1``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field

import tensorrt as trt

from ._common import _is_building
from .llmapi.kv_cache_type import KVCacheType
from .models.modeling_utils import SpeculativeDecodingMode
from .network import Network, net_guard
from .plugin.plugin import PluginConfig

__version__ = "1.2.1"


class _LoraConfig:
    """Placeholder for ``LoraConfig`` (tensorrt_llm/lora_helper.py): nothing here reads LoRA
    settings; the class exists so the field's factory has upstream's name."""

    def to_dict(self):
        return {}


_LoraConfig.__name__ = "LoraConfig"  # upstream's name; __qualname__ stays importable for pickle


@dataclass
class BuildConfig:
    max_input_len: int = 1024
    max_seq_len: int = None
    opt_batch_size: int = 8
    max_batch_size: int = 2048
    max_beam_width: int = 1
    max_num_tokens: int = 8192
    opt_num_tokens: int | None = None
    max_prompt_embedding_table_size: int = 0
    kv_cache_type: KVCacheType = None
    gather_context_logits: bool = False
    gather_generation_logits: bool = False
    strongly_typed: bool = True
    force_num_profiles: int | None = None
    profiling_verbosity: str = "layer_names_only"
    enable_debug_output: bool = False
    max_draft_len: int = 0
    speculative_decoding_mode: SpeculativeDecodingMode = SpeculativeDecodingMode.NONE
    use_refit: bool = False
    input_timing_cache: str = None
    output_timing_cache: str = "model.cache"
    lora_config: _LoraConfig = field(default_factory=_LoraConfig)
    weight_sparsity: bool = False
    weight_streaming: bool = False
    plugin_config: PluginConfig = field(default_factory=PluginConfig)
    use_strip_plan: bool = False
    max_encoder_input_len: int = 1024
    dry_run: bool = False
    visualize_network: str = None
    monitor_memory: bool = False
    use_mrope: bool = False

    def update_kv_cache_type(self, model_architecture: str):
        paged = self.plugin_config.paged_kv_cache
        if self.kv_cache_type is not None:
            if paged is not None:
                assert paged == (self.kv_cache_type == KVCacheType.PAGED), \
                    "kv_cache_type and paged_kv_cache disagree"
            self.plugin_config.paged_kv_cache = self.kv_cache_type == KVCacheType.PAGED
        elif paged is not None:
            self.kv_cache_type = KVCacheType.PAGED if paged else KVCacheType.CONTINUOUS
        else:
            self.kv_cache_type = KVCacheType.PAGED
            self.plugin_config.paged_kv_cache = True

    @classmethod
    def from_dict(cls, config, plugin_config=None):
        config = copy.deepcopy(config)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in config and f.name != "plugin_config":
                kwargs[f.name] = config[f.name]
        if kwargs.get("kv_cache_type") is not None:
            kwargs["kv_cache_type"] = KVCacheType.from_string(kwargs["kv_cache_type"])
        build_config = cls(**kwargs)
        build_config.plugin_config = plugin_config if plugin_config is not None else PluginConfig()
        if "plugin_config" in config:
            build_config.plugin_config = build_config.plugin_config.model_copy(update=config["plugin_config"])
        return build_config

    def update_from_dict(self, config: dict):
        for name, value in config.items():
            if not hasattr(self, name):
                raise AttributeError(f"{self.__class__} object has no attribute {name}")
            if name == "kv_cache_type" and value is not None:
                value = KVCacheType.from_string(value)
            setattr(self, name, value)

    def to_dict(self):
        output = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        output["kv_cache_type"] = None if self.kv_cache_type is None else self.kv_cache_type.name
        output["plugin_config"] = self.plugin_config.model_dump()
        output["lora_config"] = self.lora_config.to_dict()
        output["speculative_decoding_mode"] = int(self.speculative_decoding_mode)
        output.pop("dry_run")
        output.pop("visualize_network")
        return output


class EngineConfig:
    def __init__(self, pretrained_config, build_config, version):
        self.pretrained_config, self.build_config, self.version = pretrained_config, build_config, version

    def to_dict(self):
        return {"version": self.version, "pretrained_config": self.pretrained_config.to_dict(),
                "build_config": self.build_config.to_dict()}


class Engine:
    def __init__(self, config: EngineConfig, engine, managed_weights: dict = {}):  # noqa: B006 (upstream's default)
        self.config, self.engine, self.managed_weights = config, engine, dict(managed_weights)

    def save(self, engine_dir: str):
        os.makedirs(engine_dir, exist_ok=True)
        rank = self.config.pretrained_config.mapping.rank
        if rank == 0:
            with open(os.path.join(engine_dir, "config.json"), "w") as f:
                json.dump(self.config.to_dict(), f, indent=4)
        if self.engine is not None:
            with open(os.path.join(engine_dir, f"rank{rank}.engine"), "wb") as f:
                f.write(self.engine)


class BuilderConfig:
    def __init__(self, **kwargs):
        # Upstream too: never constructed directly, Builder.create_builder_config calls _init.
        pass

    def _init(self, trt_builder_config, **kwargs):
        self._trt_builder_config = trt_builder_config
        for key, value in kwargs.items():
            setattr(self, key, value)
        return self

    @property
    def trt_builder_config(self):
        return self._trt_builder_config


class Builder:
    def __init__(self):
        self._trt_builder = trt.Builder(trt.Logger())
        self.strongly_typed = True

    @property
    def trt_builder(self):
        return self._trt_builder

    def create_network(self) -> Network:
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
        if self.strongly_typed:
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        return Network()._init(self._trt_builder.create_network(flags))

    def create_builder_config(self, precision, timing_cache=None, tensor_parallel=1, use_refit=False, int8=False,
                              strongly_typed=True, force_num_profiles=None, profiling_verbosity="layer_names_only",
                              use_strip_plan=False, weight_streaming=False, precision_constraints="obey",
                              **kwargs) -> BuilderConfig:
        self.strongly_typed = strongly_typed
        return BuilderConfig()._init(self._trt_builder.create_builder_config(), precision=precision,
                                     tensor_parallel=tensor_parallel, use_refit=use_refit, int8=int8,
                                     force_num_profiles=force_num_profiles, strongly_typed=strongly_typed, **kwargs)

    def _validate_named_dimensions(self, network: Network, builder_config) -> bool:
        """Every occurrence of a dimension name must have the same (min, opt, max) in each profile."""
        ok = True
        num_profiles = max((len(t.profiles) for t in network.get_inputs()), default=0)
        for p in range(num_profiles):
            seen: dict[str, list[tuple[tuple, str]]] = {}
            for tensor in network.get_inputs():
                if not tensor.profiles:
                    continue
                dim_range = tensor.profiles[p]
                for name, lo, mid, hi in zip(dim_range.dimension_names, dim_range.min, dim_range.opt, dim_range.max):
                    seen.setdefault(name, []).append(((lo, mid, hi), tensor.name))
            for name, uses in seen.items():
                if len({u[0] for u in uses}) > 1:
                    ok = False
                    lines = "\n".join(f"{r} {name} {t}" for r, t in uses)
                    print(f"[TRT-LLM] [E] Found illegal dimension setting for profile {p}, dimension name is: "
                          f"{name}\nOffensive tensors which have this dimension are:\n{lines}")
        return ok

    def _add_optimization_profile(self, network: Network, builder_config):
        inputs = network.get_inputs()
        num_profiles = len(inputs[0].profiles)
        for p in range(num_profiles):
            profile = self._trt_builder.create_optimization_profile()
            for tensor in inputs:
                if not tensor.profiles:
                    continue
                r = tensor.profiles[p]
                profile.set_shape(tensor.name, r.min, r.opt, r.max)
            builder_config.trt_builder_config.add_optimization_profile(profile)
        assert self._validate_named_dimensions(network, builder_config), \
            "Validation of the tensor dimension ranges failed, please check the dimension ranges, find the " \
            "offensive tensor and dimension name in above the error log"

    @_is_building
    def build_engine(self, network: Network, builder_config, managed_weights: dict = None):
        builder_config.plugin_config = network.plugin_config
        if builder_config.trt_builder_config.num_optimization_profiles == 0:
            self._add_optimization_profile(network, builder_config)
        engine = self._trt_builder.build_serialized_network(network.trt_network, builder_config.trt_builder_config)
        assert engine is not None, "Engine building failed, please check the error log."
        return engine


def _init_max_seq_len(model_config, build_config):
    from ._common import check_max_num_tokens

    if build_config.max_seq_len is None:
        build_config.max_seq_len = getattr(model_config, "max_position_embeddings", None) or 2048
    if build_config.max_input_len > build_config.max_seq_len:
        build_config.max_input_len = build_config.max_seq_len
    build_config.max_num_tokens, build_config.opt_num_tokens = check_max_num_tokens(
        max_num_tokens=build_config.max_num_tokens, opt_num_tokens=build_config.opt_num_tokens,
        max_batch_size=build_config.max_batch_size, max_input_len=build_config.max_input_len,
        max_seq_len=build_config.max_seq_len, max_beam_width=build_config.max_beam_width,
        remove_input_padding=build_config.plugin_config.remove_input_padding,
        enable_context_fmha=build_config.plugin_config.context_fmha,
        tokens_per_block=build_config.plugin_config.tokens_per_block,
        multiple_profiles=build_config.plugin_config.multiple_profiles)


def build(model, build_config: BuildConfig) -> Engine:
    build_config = copy.deepcopy(build_config)
    build_config.plugin_config.dtype = model.config.dtype
    build_config.update_kv_cache_type(model.config.architecture)
    _init_max_seq_len(model.config, build_config)
    if hasattr(model.config, "max_draft_len") and build_config.max_draft_len == 0:
        build_config.max_draft_len = model.config.max_draft_len
    if build_config.speculative_decoding_mode != SpeculativeDecodingMode.NONE:
        build_config.max_seq_len += build_config.max_draft_len
        tokens = build_config.max_batch_size * (build_config.max_draft_len + 1)
        if build_config.max_num_tokens < tokens:
            build_config.max_num_tokens = tokens
    builder = Builder()
    builder_config = builder.create_builder_config(precision=model.config.dtype,
                                                   strongly_typed=build_config.strongly_typed,
                                                   force_num_profiles=build_config.force_num_profiles)
    network = builder.create_network()
    network.plugin_config = build_config.plugin_config
    network.plugin_config.set_nccl_plugin(model.config.dtype if model.config.mapping.world_size > 1 else None)
    use_cache = build_config.kv_cache_type != KVCacheType.DISABLED
    with net_guard(network):
        network.set_named_parameters(model.named_parameters())
        prepare_input_args = {
            "max_batch_size": build_config.max_batch_size, "max_input_len": build_config.max_input_len,
            "max_seq_len": build_config.max_seq_len, "use_cache": use_cache,
            "max_beam_width": build_config.max_beam_width, "max_num_tokens": build_config.max_num_tokens,
            "opt_num_tokens": build_config.opt_num_tokens,
            "prompt_embedding_table_size": build_config.max_prompt_embedding_table_size,
            "max_draft_len": build_config.max_draft_len,
            "speculative_decoding_draft_tokens_external":
                build_config.speculative_decoding_mode == SpeculativeDecodingMode.DRAFT_TOKENS_EXTERNAL,
            "gather_context_logits": build_config.gather_context_logits,
            "lora_target_modules": None,
        }
        if build_config.speculative_decoding_mode in (SpeculativeDecodingMode.EAGLE,
                                                      SpeculativeDecodingMode.LOOKAHEAD_DECODING):
            prepare_input_args["spec_decoding_is_generation_length_variable"] = True
        inputs = model.prepare_inputs(**prepare_input_args)
        model(**inputs)
    engine = None if build_config.dry_run else builder.build_engine(network, builder_config)
    return Engine(EngineConfig(model.config, build_config, __version__), engine)
