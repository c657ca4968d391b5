"""Stand-in for ``tensorrt_llm/models/modeling_utils.py`` (NVIDIA/TensorRT-LLM @
b35ac1b64368513d215c57d2ed01d62d910df8da, 1.2.0rc2).

``PretrainedConfig`` (keyword-only; unknown keys become attributes and are serialised),
``PretrainedModel`` (``from_checkpoint`` reads ``rank{N}.safetensors`` and ``load`` refuses
missing tensors by name, warns on extra ones), ``prepare_inputs`` (wraps the flat inputs into
``KeyValueCacheParams`` / ``AttentionParams``), ``DecoderLayerList`` and
``DecoderModelForCausalLM.forward`` (last-token gather, ``logits`` and, for a continuous
cache, ``present_key_value_{i}`` marked as outputs). Quantization and ``optimize_model``'s
rewrites (fused gate/fc MLP, shared embedding table) are numerically neutral and not emulated.
"""

from __future__ import annotations

import copy
import enum
import json
import os
import warnings

from .._utils import str_dtype_to_trt
from ..functional import PositionEmbeddingType, Tensor, gather_last_token_logits
from ..layers.attention import Attention, AttentionParams, KeyValueCacheParams
from ..llmapi.kv_cache_type import KVCacheType
from ..mapping import Mapping
from ..module import Module, ModuleList
from .generation_mixin import GenerationMixin


class SpeculativeDecodingMode(enum.IntFlag):
    NONE = enum.auto()
    DRAFT_TOKENS_EXTERNAL = enum.auto()
    MEDUSA = enum.auto()
    LOOKAHEAD_DECODING = enum.auto()
    EXPLICIT_DRAFT_TOKENS = enum.auto()
    EAGLE = enum.auto()
    NGRAM = enum.auto()
    USER_PROVIDED = enum.auto()
    SAVE_HIDDEN_STATES = enum.auto()
    AUTO = enum.auto()

    @staticmethod
    def from_arguments(args):
        mode = getattr(args, "speculative_decoding_mode", None)
        if mode is None:
            return SpeculativeDecodingMode.NONE
        names = {"draft_tokens_external": "DRAFT_TOKENS_EXTERNAL", "medusa": "MEDUSA",
                 "lookahead_decoding": "LOOKAHEAD_DECODING", "explicit_draft_tokens": "EXPLICIT_DRAFT_TOKENS",
                 "eagle": "EAGLE", "ngram": "NGRAM", "user_provided": "USER_PROVIDED", "auto": "AUTO",
                 "save_hidden_states": "SAVE_HIDDEN_STATES"}
        assert mode in names, "Unknown speculative_decoding_mode " + str(mode)
        return SpeculativeDecodingMode[names[mode]]


class QuantConfig:
    # Upstream is a dataclass with these fields; only "no quantization" is emulated.
    def __init__(self, quant_algo=None, kv_cache_quant_algo=None, group_size=128, smoothquant_val=0.5,
                 clamp_val=None, use_meta_recipe=False, has_zero_point=False, pre_quant_scale=False,
                 exclude_modules=None, mamba_ssm_cache_dtype=None):
        if quant_algo is not None or kv_cache_quant_algo is not None:
            raise NotImplementedError("the stand-in does not emulate quantization")
        self.quant_algo, self.kv_cache_quant_algo = quant_algo, kv_cache_quant_algo
        self.group_size, self.smoothquant_val, self.clamp_val = group_size, smoothquant_val, clamp_val
        self.use_meta_recipe, self.has_zero_point, self.pre_quant_scale = use_meta_recipe, has_zero_point, \
            pre_quant_scale
        self.exclude_modules, self.mamba_ssm_cache_dtype = exclude_modules, mamba_ssm_cache_dtype

    @classmethod
    def from_dict(cls, config):
        return cls(**config)

    def to_dict(self):
        return dict(vars(self))


class PretrainedConfig:
    def __init__(self, *, architecture: str, dtype: str, hidden_size: int, num_hidden_layers: int,
                 num_attention_heads: int, vocab_size: int | None = None, hidden_act: str = "gelu",
                 logits_dtype: str = "float32", norm_epsilon: float = 1e-5,
                 position_embedding_type: PositionEmbeddingType | str = PositionEmbeddingType.learned_absolute,
                 max_position_embeddings: int | None = None, rotary_embedding_dim: int | None = None,
                 num_key_value_heads: int | None = None, intermediate_size: int | None = None,
                 mapping: Mapping | dict | None = None, quantization=None,
                 use_parallel_embedding: bool = False, embedding_sharding_dim: int = 0,
                 head_size: int | None = None, qk_layernorm: bool = False, runtime_defaults=None, **kwargs):
        self.architecture, self.dtype, self.vocab_size = architecture, dtype, vocab_size
        self.hidden_size, self.num_hidden_layers, self.num_attention_heads = hidden_size, num_hidden_layers, \
            num_attention_heads
        self.hidden_act, self.logits_dtype, self.norm_epsilon = hidden_act, logits_dtype, norm_epsilon
        if isinstance(position_embedding_type, str):
            position_embedding_type = PositionEmbeddingType.from_string(position_embedding_type)
        self.position_embedding_type = position_embedding_type
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.intermediate_size = intermediate_size or 4 * hidden_size
        self.max_position_embeddings = max_position_embeddings
        if mapping is None:
            mapping = Mapping()
        elif isinstance(mapping, dict):
            mapping = Mapping.from_dict(mapping)
        self.mapping = mapping
        if quantization is None:
            quantization = QuantConfig()
        elif isinstance(quantization, dict):
            quantization = QuantConfig.from_dict(quantization)
        self.quantization = quantization
        self.use_parallel_embedding, self.embedding_sharding_dim = use_parallel_embedding, embedding_sharding_dim
        self.head_size = head_size or hidden_size // num_attention_heads
        self.qk_layernorm = qk_layernorm
        self.rotary_embedding_dim = rotary_embedding_dim or kwargs.get(
            "rotary_dim", int(self.head_size * kwargs.get("rotary_pct", 1.0)))
        self.runtime_defaults = runtime_defaults
        for key, value in kwargs.items():  # upstream: "Implicitly setting ..." then setattr
            setattr(self, key, value)

    @property
    def kv_dtype(self):
        return self.dtype

    @property
    def quant_mode(self):
        return None

    def set_rank(self, rank):
        self.mapping.rank = rank

    def to_dict(self):
        output = copy.deepcopy(self.__dict__)
        output["position_embedding_type"] = str(self.position_embedding_type.name)
        output["mapping"] = self.mapping.to_dict()
        output["mapping"].pop("rank")
        output["quantization"] = self.quantization.to_dict()
        return output

    @classmethod
    def from_dict(cls, config):
        from . import MODEL_MAP

        config = copy.deepcopy(config)
        architecture = config.get("architecture", cls.__name__)
        model_cls = MODEL_MAP[architecture]
        config_cls = getattr(model_cls, "config_class", cls)
        return config_cls(**config)

    @classmethod
    def from_json_file(cls, config_file: str):
        with open(config_file) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str):
        return cls.from_json_file(os.path.join(ckpt_dir, "config.json"))

    def to_json_file(self, config_file: str):
        with open(config_file, "w") as f:
            json.dump(self.to_dict(), f, indent=4)


class PostInitCaller(type):
    def __call__(cls, *args, **kwargs):
        obj = type.__call__(cls, *args, **kwargs)
        obj.__post_init__()
        return obj


class PretrainedModel(Module, GenerationMixin, metaclass=PostInitCaller):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        from ..plugin.plugin import init_all_reduce_helper

        init_all_reduce_helper()
        self.config = config

    def __post_init__(self):
        return None

    def check_config(self, config):
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: PretrainedConfig):
        return cls(config)

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str, rank: int | None = None, config: PretrainedConfig | None = None,
                        *, preprocess_weights_hook=None):
        from safetensors.torch import load_file

        if config is None:
            config = PretrainedConfig.from_json_file(os.path.join(ckpt_dir, "config.json"))
        if rank is not None:
            config.set_rank(rank)
        rank = config.mapping.rank
        weights_path = os.path.join(ckpt_dir, f"rank{rank}.safetensors")
        assert os.path.isfile(weights_path), f"{weights_path} does not exist"
        weights = load_file(weights_path)
        if preprocess_weights_hook is not None:
            weights = preprocess_weights_hook(weights)
        model = cls(config)
        model.load(weights)
        return model

    def load(self, weights, from_pruned=False):
        required = {name for name, param in self.named_parameters() if not param.is_inited()}
        if any(name.endswith("vocab_embedding.weight") for name in weights):
            required.discard("lm_head.weight")
        missing = required - set(weights)
        if missing:
            raise RuntimeError(f"Required but not provided tensors:{sorted(missing)}")
        extra = set(weights) - {name for name, _ in self.named_parameters()}
        if extra:
            warnings.warn(f"Provided but not required tensors: {sorted(extra)}", stacklevel=2)
        for name, param in self.named_parameters():
            if name in weights:
                try:
                    param.value = weights[name]
                except Exception as err:
                    raise RuntimeError(f"Encounter error '{err}' for parameter '{name}'") from err

    def prepare_inputs(self, max_batch_size, max_input_len, max_seq_len, max_num_tokens, use_cache,
                       max_beam_width: int = 1, opt_num_tokens: int = None, prompt_embedding_table_size: int = 0,
                       position_encoding_2d: bool = False, max_draft_len: int = 0,
                       speculative_decoding_draft_tokens_external: bool = False,
                       spec_decoding_is_generation_length_variable: bool = False, gather_context_logits: bool = False,
                       lora_target_modules: list[str] = None, opt_batch_size: int = 0,
                       num_hidden_layers: int = None, mrope_rotary_cos_sin_size: int = None):
        from .._common import default_net

        pc = default_net().plugin_config
        kv_cache_type = KVCacheType.DISABLED if not use_cache else (
            KVCacheType.PAGED if pc.paged_kv_cache else KVCacheType.CONTINUOUS)
        model_inputs = self.prepare_basic_inputs(
            max_batch_size=max_batch_size, max_beam_width=max_beam_width, max_input_len=max_input_len,
            max_seq_len=max_seq_len, hidden_size=self.config.hidden_size,
            num_kv_heads=self.config.num_key_value_heads, head_size=self.config.head_size,
            num_layers=num_hidden_layers or self.config.num_hidden_layers,
            kv_dtype=str_dtype_to_trt(self.config.kv_dtype), remove_input_padding=pc.remove_input_padding,
            use_gpt_attention_plugin=pc.gpt_attention_plugin, use_gemm_plugin=pc.gemm_plugin,
            kv_cache_type=kv_cache_type, tokens_per_block=pc.tokens_per_block,
            num_heads=self.config.num_attention_heads, max_num_tokens=max_num_tokens,
            opt_num_tokens=opt_num_tokens, dtype=str_dtype_to_trt(self.config.dtype),
            prompt_embedding_table_size=prompt_embedding_table_size, position_encoding_2d=position_encoding_2d,
            mapping=self.config.mapping, gather_context_logits=gather_context_logits,
            use_lora_plugin=pc.lora_plugin, max_draft_len=max_draft_len,
            speculative_decoding_draft_tokens_external=speculative_decoding_draft_tokens_external,
            spec_decoding_is_generation_length_variable=spec_decoding_is_generation_length_variable,
            lora_target_modules=lora_target_modules, multiple_profiles=pc.multiple_profiles,
            streamingllm=pc.streamingllm, opt_batch_size=opt_batch_size, pp_reduce_scatter=pc.pp_reduce_scatter,
            mrope_rotary_cos_sin_size=mrope_rotary_cos_sin_size)
        result = {
            "input_ids": model_inputs["input_ids"],
            "position_ids": model_inputs["position_ids"],
            "use_cache": kv_cache_type != KVCacheType.DISABLED,
            "last_token_ids": model_inputs["last_token_ids"],
            "attention_mask": model_inputs["attention_mask"],
            "kv_cache_params": KeyValueCacheParams(
                past_key_value=model_inputs["past_key_value"],
                host_past_key_value_lengths=model_inputs["host_past_key_value_lengths"],
                host_max_attention_window_sizes=model_inputs["host_max_attention_window_sizes"],
                host_sink_token_length=model_inputs["host_sink_token_length"],
                kv_cache_block_offsets=model_inputs["kv_cache_block_offsets"],
                host_kv_cache_block_offsets=model_inputs["host_kv_cache_block_offsets"],
                host_kv_cache_pool_pointers=model_inputs["host_kv_cache_pool_pointers"],
                host_kv_cache_pool_mapping=model_inputs["host_kv_cache_pool_mapping"],
                cache_indirection=model_inputs["cache_indirection"]),
            "attention_params": AttentionParams(
                sequence_length=model_inputs["sequence_length"], context_lengths=model_inputs["context_lengths"],
                host_context_lengths=model_inputs["host_context_lengths"], max_context_length=max_input_len,
                host_request_types=model_inputs["host_request_types"],
                host_runtime_perf_knobs=model_inputs["host_runtime_perf_knobs"],
                host_context_progress=model_inputs["host_context_progress"]),
        }
        if model_inputs["spec_decoding_params"] is not None:
            result["spec_decoding_params"] = model_inputs["spec_decoding_params"]
        return result


class DecoderLayerList(ModuleList):
    def __init__(self, cls, config):
        self.num_hidden_layers = config.num_hidden_layers
        self.layer_list = config.mapping.pp_layers(config.num_hidden_layers)
        super().__init__([cls(config, idx) for idx in self.layer_list])

    def forward(self, hidden_states, use_cache=False, attention_mask=None, kv_cache_params=None,
                attention_params=None, mrope_params=None, position_ids=None, lora_params=None,
                spec_decoding_params=None, vision_token_mask=None):
        kv_cache_params.fill_none_tensor_list(len(self))
        presents = []
        for layer, past in zip(self, kv_cache_params.past_key_value):
            kwargs = {}
            if position_ids is not None:
                kwargs["position_ids"] = position_ids
            if spec_decoding_params is not None:
                kwargs["spec_decoding_params"] = spec_decoding_params
            if mrope_params is not None:
                kwargs["mrope_params"] = mrope_params
            hidden_states = layer(
                hidden_states, use_cache=use_cache, attention_mask=attention_mask,
                kv_cache_params=KeyValueCacheParams(
                    past_key_value=[past],
                    host_past_key_value_lengths=kv_cache_params.host_past_key_value_lengths,
                    host_max_attention_window_sizes=kv_cache_params.host_max_attention_window_sizes,
                    host_sink_token_length=kv_cache_params.host_sink_token_length,
                    kv_cache_block_offsets=kv_cache_params.kv_cache_block_offsets,
                    host_kv_cache_block_offsets=kv_cache_params.host_kv_cache_block_offsets,
                    host_kv_cache_pool_pointers=kv_cache_params.host_kv_cache_pool_pointers,
                    host_kv_cache_pool_mapping=kv_cache_params.host_kv_cache_pool_mapping,
                    cache_indirection=kv_cache_params.cache_indirection),
                attention_params=attention_params, **kwargs)
            if use_cache:
                presents.append(hidden_states[1])
                hidden_states = hidden_states[0]
        if use_cache:
            return hidden_states, presents
        return hidden_states


class DecoderModelForCausalLM(PretrainedModel):
    def __init__(self, config: PretrainedConfig, transformer, lm_head):
        super().__init__(config)
        self.transformer = transformer
        self.lm_head = lm_head
        self.mup_width_multiplier = getattr(config, "mup_width_multiplier", None)
        Attention.create_attention_const_params(self, config)
        self.position_embedding_type = config.position_embedding_type

    def forward(self, input_ids: Tensor, position_ids=None, use_cache=False, last_token_ids=None,
                attention_mask=None, kv_cache_params=None, attention_params=None, mrope_params=None,
                hidden_states=None, prompt_embedding_table: Tensor | None = None,
                prompt_tasks: Tensor | None = None, prompt_vocab_size: Tensor | None = None,
                lora_params=None, spec_decoding_params=None):
        from .._common import default_net

        attention_params = Attention.fill_attention_params(self, attention_params)
        kwargs = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": use_cache,
                  "attention_mask": attention_mask, "kv_cache_params": kv_cache_params,
                  "attention_params": attention_params}
        if spec_decoding_params is not None:
            kwargs["spec_decoding_params"] = spec_decoding_params
        hidden_states = self.transformer.forward(**kwargs)
        if use_cache:
            hidden_states, presents = hidden_states
        all_hidden_states = hidden_states
        hidden_states = gather_last_token_logits(hidden_states, last_token_ids,
                                                 default_net().plugin_config.remove_input_padding)
        lm_logits = self.lm_head(hidden_states)
        multiplier = getattr(self.config, "output_multiplier_scale", 1.0)
        if multiplier != 1.0:
            lm_logits = lm_logits * multiplier
        lm_logits.mark_output("logits", self.config.logits_dtype)
        if use_cache and not default_net().plugin_config.paged_kv_cache:
            for i, present in zip(self.config.mapping.pp_layers(self.config.num_hidden_layers), presents):
                present.mark_output(f"present_key_value_{i}", self.config.kv_dtype)
            return lm_logits, presents, hidden_states
        return lm_logits, hidden_states, all_hidden_states


def get_kv_cache_type_from_legacy(use_cache: bool, paged_kv_cache: bool) -> KVCacheType:
    if not use_cache:
        return KVCacheType.DISABLED
    return KVCacheType.PAGED if paged_kv_cache else KVCacheType.CONTINUOUS
