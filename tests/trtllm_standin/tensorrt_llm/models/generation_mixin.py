"""Stand-in for ``tensorrt_llm/models/generation_mixin.py`` (NVIDIA/TensorRT-LLM @
03ec464e2179899bff818504d30279113bbdd617; newest text index id 83493268).

The inputs (names, dtypes, shapes, named dimensions, per-profile ranges) that the real
``prepare_basic_inputs`` / ``prepare_attention_inputs`` declare with ``remove_input_padding``
and the GPT attention plugin, for a continuous or a paged KV cache, with or without
explicit spec-decoding inputs, at any tensor-parallel size (``all_reduce_workspace``).
Pipeline parallelism, LoRA, prompt tuning and mrope inputs are refused by name.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import tensorrt as trt

from ..functional import Tensor
from ..layers.attention import SpecDecodingParams
from ..llmapi.kv_cache_type import KVCacheType
from ..mapping import Mapping
from ..plugin.plugin import current_all_reduce_helper


class GenerationMixin:
    @staticmethod
    def has_ctx_gen_opt_profiles(use_gpt_attention_plugin: bool = False, use_gemm_plugin: bool = False,
                                 use_mamba_conv1d_plugin: bool = False, remove_input_padding: bool = False,
                                 paged_state: bool = False,
                                 kv_cache_type: KVCacheType = KVCacheType.CONTINUOUS) -> bool:
        if use_gpt_attention_plugin and use_gemm_plugin:
            return False
        if remove_input_padding and use_gpt_attention_plugin:
            in_flight_batching = kv_cache_type in (KVCacheType.PAGED, KVCacheType.DISABLED)
        elif remove_input_padding and use_mamba_conv1d_plugin:
            in_flight_batching = paged_state
        else:
            in_flight_batching = False
        return not in_flight_batching

    @staticmethod
    def default_range(max_range, offset=0, min_range=1, opt_offset=0):
        result = [min_range, (max_range + min_range + opt_offset) // 2, max_range]
        return [elem + offset for elem in result]

    @staticmethod
    def split_num_tokens_range(max_num_tokens):
        split_points = [64, 128, 256, 512, 1024]
        num_tokens_ranges = []
        for i, p in enumerate(split_points):
            if max_num_tokens > p:
                num_tokens_ranges.append([split_points[i - 1] if i else 1, p, p])
        num_tokens_ranges.append([num_tokens_ranges[-1][2] if num_tokens_ranges else 1, max_num_tokens,
                                  max_num_tokens])
        return num_tokens_ranges

    @staticmethod
    def get_profiles_ranges(*, max_batch_size, max_beam_width, max_input_len, max_num_tokens, max_draft_len,
                            opt_batch_size, opt_num_tokens, enable_ctx_gen_opt_profiles, multiple_profiles,
                            kv_cache_type: KVCacheType = KVCacheType.CONTINUOUS):
        default_range = GenerationMixin.default_range
        if opt_batch_size:
            bb_range_ctx = [1, opt_batch_size, max_batch_size]
            bb_range_gen = [1, opt_batch_size * max_beam_width, max_batch_size * max_beam_width]
        else:
            bb_range_ctx = default_range(max_batch_size)
            bb_range_gen = default_range(max_batch_size * max_beam_width)
        tokens_per_engine_step = max_draft_len + 1
        tokens_per_engine_step_range = [1, tokens_per_engine_step, tokens_per_engine_step]
        bbd_range_ctx = [bb_range_ctx[0]] + [v * tokens_per_engine_step for v in bb_range_ctx[1:]]
        bbd_range_gen = [bb_range_gen[0]] + [v * tokens_per_engine_step for v in bb_range_gen[1:]]
        inlen_range_ctx = default_range(max_input_len)
        inlen_range_gen = [1, 1, tokens_per_engine_step]
        if enable_ctx_gen_opt_profiles:
            num_profiles = 2
            bb_range = [bb_range_ctx, bb_range_gen]
            bbd_range = [bbd_range_ctx, bbd_range_gen]
            inlen_range = [inlen_range_ctx, inlen_range_gen]
            position_ids_inlen_range = [inlen_range_ctx, [1, 1, 1]]
            num_tokens_range = [default_range(max_batch_size * max_input_len),
                                default_range(max_batch_size * max(tokens_per_engine_step, max_beam_width))]
            if kv_cache_type == KVCacheType.DISABLED:
                num_profiles = 1
                bb_range, bbd_range, inlen_range = bb_range[:1], bbd_range[:1], inlen_range[:1]
                position_ids_inlen_range, num_tokens_range = position_ids_inlen_range[:1], num_tokens_range[:1]
        else:
            if multiple_profiles:
                num_tokens_range = GenerationMixin.split_num_tokens_range(max_num_tokens)
            else:
                if opt_num_tokens is None:
                    opt_num_tokens = min(max_num_tokens, max_batch_size * max_beam_width)
                num_tokens_range = [[1, opt_num_tokens, max_num_tokens]]
            num_profiles = len(num_tokens_range)
            bb_range = [bb_range_gen] * num_profiles
            bbd_range = [bbd_range_gen] * num_profiles
            inlen_range = [[1, 1, max_input_len]] * num_profiles
            position_ids_inlen_range = [[1, 1, max_input_len]] * num_profiles
        position_ids_num_tokens_range = num_tokens_range
        if max_draft_len != 0:
            position_ids_num_tokens_range = [[math.ceil(r[0] / tokens_per_engine_step), r[1], r[2]]
                                             for r in num_tokens_range]
        ranges = {
            "bb_range": bb_range,
            "bbd_range": bbd_range,
            "inlen_range": inlen_range,
            "position_ids_inlen_range": position_ids_inlen_range,
            "num_tokens_range": num_tokens_range,
            "tokens_per_engine_step_range": [tokens_per_engine_step_range] * num_profiles,
            "position_ids_num_tokens_range": position_ids_num_tokens_range,
        }
        return num_profiles, ranges

    def prepare_attention_inputs(self, *, max_batch_size, max_beam_width, max_input_len, max_seq_len, num_kv_heads,
                                 head_size, num_layers, kv_dtype, kv_cache_type: KVCacheType, num_profiles=1,
                                 enable_ctx_gen_opt_profiles=False, remove_input_padding=False,
                                 use_gpt_attention_plugin=False, tokens_per_block=32, mapping=Mapping(),  # noqa: B008
                                 streamingllm=False, attn_layer_idx=None, opt_batch_size=None,
                                 num_kv_heads_per_layer: list[int] | None = None):
        if not use_gpt_attention_plugin:
            raise NotImplementedError("the stand-in emulates the GPT attention plugin path only")
        default_range = GenerationMixin.default_range
        if opt_batch_size:
            bb_ctx = [1, opt_batch_size, max_batch_size]
            bb_gen = [1, opt_batch_size * max_beam_width, max_batch_size * max_beam_width]
        else:
            bb_ctx, bb_gen = default_range(max_batch_size), default_range(max_batch_size * max_beam_width)
        bb_range = [bb_ctx, bb_gen] if enable_ctx_gen_opt_profiles else [bb_gen] * num_profiles
        bb_range = bb_range[:num_profiles]
        bs_range = [default_range(max_batch_size)] * num_profiles
        beam_width_range = [default_range(max_beam_width)] * num_profiles
        max_len_range = [default_range(max_seq_len)] * num_profiles
        kv_max = max_seq_len + (tokens_per_block - 1 if streamingllm else 0) + (tokens_per_block if max_beam_width > 1
                                                                                 else 0)
        kv_cache_range = [default_range(kv_max)] * num_profiles
        layers = mapping.pp_layers(num_layers)
        kv_heads = (num_kv_heads + mapping.tp_size - 1) // mapping.tp_size
        past_key_value, paged = [], {}
        if kv_cache_type == KVCacheType.CONTINUOUS:
            for i in layers:
                past_key_value.append(Tensor(
                    name=f"past_key_value_{i}", dtype=kv_dtype, shape=[-1, 2, kv_heads, -1, head_size],
                    dim_range=OrderedDict([("batch_size_beam_width", bb_range), ("kv", [2] * num_profiles),
                                           ("num_heads", [kv_heads] * num_profiles),
                                           ("past_key_len", kv_cache_range),
                                           ("head_size", [head_size] * num_profiles)])))
        elif kv_cache_type == KVCacheType.PAGED:
            blocks = [[math.ceil(v / tokens_per_block) for v in r] for r in kv_cache_range]
            pools = [[1, 1, len(layers)]] * num_profiles
            for name in ("kv_cache_block_offsets", "host_kv_cache_block_offsets"):
                paged[name] = Tensor(name=name, dtype=trt.int32, shape=[-1, -1, 2, -1], dim_range=OrderedDict([
                    ("num_kv_cache_pools", pools), ("batch_size_beam_width", bb_range), ("kv", [2] * num_profiles),
                    ("max_blocks_per_seq", blocks)]))
            paged["host_kv_cache_pool_pointers"] = Tensor(
                name="host_kv_cache_pool_pointers", dtype=trt.int64, shape=[-1, 2],
                dim_range=OrderedDict([("num_pools_layers", pools), ("num_pools_kv", [2] * num_profiles)]))
            paged["host_kv_cache_pool_mapping"] = Tensor(
                name="host_kv_cache_pool_mapping", dtype=trt.int32, shape=[len(layers), 2],
                dim_range=OrderedDict([("pools_mapping", [len(layers)] * num_profiles),
                                       ("layer_cache_pool_locator", [2] * num_profiles)]))
            past_key_value = [None] * len(layers)

        def per_batch(name: str, dtype=trt.int32) -> Tensor:
            return Tensor(name=name, dtype=dtype, shape=[-1],
                          dim_range=OrderedDict([("batch_size_beam_width", bb_range)]))

        result = {"past_key_value": past_key_value, "attention_mask": None,
                  "kv_cache_block_offsets": paged.get("kv_cache_block_offsets"),
                  "host_kv_cache_block_offsets": paged.get("host_kv_cache_block_offsets"),
                  "host_kv_cache_pool_pointers": paged.get("host_kv_cache_pool_pointers"),
                  "host_kv_cache_pool_mapping": paged.get("host_kv_cache_pool_mapping")}
        cache = kv_cache_type != KVCacheType.DISABLED
        result["sequence_length"] = per_batch("sequence_length") if cache else None
        result["host_request_types"] = per_batch("host_request_types")
        result["host_past_key_value_lengths"] = per_batch("host_past_key_value_lengths") if cache else None
        result["context_lengths"] = per_batch("context_lengths")
        result["host_runtime_perf_knobs"] = Tensor(name="host_runtime_perf_knobs", dtype=trt.int64, shape=[16],
                                                   dim_range=OrderedDict([("perf_knob_size", [16] * num_profiles)]))
        result["host_context_progress"] = Tensor(name="host_context_progress", dtype=trt.int64, shape=[1],
                                                 dim_range=OrderedDict([("context_progress_size", [1] * num_profiles)]))
        result["host_context_lengths"] = per_batch("host_context_lengths") if remove_input_padding else None
        result["host_max_attention_window_sizes"] = Tensor(
            name="host_max_attention_window_sizes", dtype=trt.int32, shape=[len(layers)],
            dim_range=OrderedDict([("num_layers", [len(layers)] * num_profiles)]))
        result["host_sink_token_length"] = Tensor(name="host_sink_token_length", dtype=trt.int32, shape=[1],
                                                  dim_range=OrderedDict([("scalar", [1] * num_profiles)]))
        result["cache_indirection"] = Tensor(
            name="cache_indirection", dtype=trt.int32, shape=[-1, -1, -1],
            dim_range=OrderedDict([("batch_size_cache", bs_range), ("beam_width", beam_width_range),
                                   ("max_seq_len", max_len_range)])) if cache else None
        return result

    def prepare_basic_inputs(self, *, max_batch_size, max_beam_width, max_input_len, max_seq_len, max_num_tokens,
                             hidden_size, num_kv_heads, head_size, num_layers, kv_dtype, kv_cache_type: KVCacheType,
                             remove_input_padding=False, use_gpt_attention_plugin=False, use_gemm_plugin=False,
                             tokens_per_block=32, gather_context_logits=False, dtype=None, num_heads=None,
                             mapping=Mapping(), opt_num_tokens=None, prompt_embedding_table_size: int = 0,  # noqa: B008
                             position_encoding_2d=False, use_lora_plugin: bool = False,
                             lora_target_modules: list[str] = None,
                             speculative_decoding_draft_tokens_external: bool = False,
                             spec_decoding_is_generation_length_variable: bool = False, max_draft_len=0,
                             multiple_profiles: bool = False, streamingllm: bool = False, opt_batch_size=None,
                             pp_reduce_scatter: bool = False, mrope_rotary_cos_sin_size: int = None):
        unsupported = {"prompt_embedding_table_size": prompt_embedding_table_size, "use_lora_plugin": use_lora_plugin,
                       "position_encoding_2d": position_encoding_2d, "mrope": mrope_rotary_cos_sin_size,
                       "pp_size > 1": mapping.pp_size > 1, "remove_input_padding disabled": not remove_input_padding}
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(f"the stand-in does not emulate {bad}")
        enable_ctx_gen = GenerationMixin.has_ctx_gen_opt_profiles(
            use_gpt_attention_plugin=use_gpt_attention_plugin, use_gemm_plugin=use_gemm_plugin,
            remove_input_padding=remove_input_padding, kv_cache_type=kv_cache_type)
        num_profiles, ranges = GenerationMixin.get_profiles_ranges(
            max_batch_size=max_batch_size, max_beam_width=max_beam_width, max_input_len=max_input_len,
            max_num_tokens=max_num_tokens, max_draft_len=max_draft_len, opt_batch_size=opt_batch_size,
            opt_num_tokens=opt_num_tokens, enable_ctx_gen_opt_profiles=enable_ctx_gen,
            multiple_profiles=multiple_profiles, kv_cache_type=kv_cache_type)
        assert use_gpt_attention_plugin, "remove_input_padding needs the GPT attention plugin"
        input_ids = Tensor(name="input_ids", dtype=trt.int32, shape=[-1],
                           dim_range=OrderedDict([("num_tokens", ranges["num_tokens_range"])]))
        position_ids = Tensor(name="position_ids", dtype=trt.int32, shape=[-1], dim_range=OrderedDict(
            [("position_ids_num_tokens_range", ranges["position_ids_num_tokens_range"])]))
        if mapping.tp_size > 1:
            current_all_reduce_helper().set_workspace_tensor(mapping, num_profiles)
        last_token_ids = None
        if not gather_context_logits:
            last_token_ids = Tensor(name="last_token_ids", dtype=trt.int32, shape=[-1], dim_range=OrderedDict(
                [("batch_size_last_token_ids", ranges["bbd_range"])]))
        spec_decoding_params = None
        if max_draft_len > 0 and not speculative_decoding_draft_tokens_external:
            tokens = max_draft_len + 1
            bb0 = [[0] + list(r[1:]) for r in ranges["bb_range"]]
            lengths = Tensor(name="spec_decoding_generation_lengths", dtype=trt.int32, shape=[-1],
                             dim_range=OrderedDict([("batch_size_beam_width_0", bb0)]))
            offsets = Tensor(name="spec_decoding_position_offsets", dtype=trt.int32, shape=[-1, -1],
                             dim_range=OrderedDict([("batch_size_beam_width_0", bb0),
                                                    ("spec_decoding_position_ids_dim0",
                                                     ranges["tokens_per_engine_step_range"])]))
            packed = Tensor(name="spec_decoding_packed_mask", dtype=trt.int32, shape=[-1, -1], dim_range=OrderedDict([
                ("spec_decoding_packed_mask_dim0",
                 [GenerationMixin.default_range(max_batch_size * max_beam_width * tokens, min_range=0)] * num_profiles),
                ("spec_decoding_packed_mask_dim1", [[0, 1, math.ceil(tokens / 32)]] * num_profiles)]))
            use = Tensor(name="spec_decoding_use", dtype=trt.int32, shape=[1],
                         dim_range=OrderedDict([("spec_decoding_use_dim", [1] * num_profiles)]))
            spec_decoding_params = SpecDecodingParams(
                spec_decoding_is_generation_length_variable=spec_decoding_is_generation_length_variable,
                spec_decoding_max_generation_length=tokens, spec_decoding_generation_lengths=lengths,
                spec_decoding_position_offsets=offsets, spec_decoding_packed_mask=packed, spec_decoding_use=use)
        attention = self.prepare_attention_inputs(
            max_batch_size=max_batch_size, max_beam_width=max_beam_width, max_input_len=max_input_len,
            max_seq_len=max_seq_len, num_kv_heads=num_kv_heads, head_size=head_size, num_layers=num_layers,
            kv_dtype=kv_dtype, num_profiles=num_profiles, enable_ctx_gen_opt_profiles=enable_ctx_gen,
            remove_input_padding=remove_input_padding, use_gpt_attention_plugin=use_gpt_attention_plugin,
            kv_cache_type=kv_cache_type, tokens_per_block=tokens_per_block, mapping=mapping,
            streamingllm=streamingllm, opt_batch_size=opt_batch_size)
        result = {"input_ids": input_ids, "hidden_states_input": None, "position_ids": position_ids,
                  "last_token_ids": last_token_ids, "prompt_embedding_table": None, "tasks": None,
                  "prompt_vocab_size": None, "lora_ranks": None, "lora_weights_pointers": None,
                  "spec_decoding_params": spec_decoding_params, "mrope_params": None}
        result.update(attention)
        return result
