"""The GPTAttention plugin (TensorRT-LLM namespace ``tensorrt_llm``, version ``1``), emulated.

The input contract is the one the CUDA kernels read (sources and commits in
``tests/trtllm_standin/README.md``; notes from cpp/tensorrt_llm/plugins/gptAttentionPlugin/
gptAttentionPlugin.cpp @ 026da036, common/attentionOp.cpp @ 00dbe288 / eea41b73,
kernels/decoderMaskedMultiheadAttention/decoderXQAImplJIT.cpp @ 89fd9b74, kernels/xqa/mha_sm90.cu
@ 014dadcd, kernels/unfusedAttentionKernels/unfusedAttentionKernels_2_template.h @ 0097566b,
kernels/kvCacheUtils.h @ 0ccf9032):

* requests: all context requests first (``host_request_types`` 0), then generation (1);
  a continuous cache cannot mix them in one call;
* context request b: ``host_context_lengths[b]`` packed tokens, past =
  ``sequence_length[b] - context_lengths[b]``, token j at cache slot and RoPE position past + j,
  causal;
* generation request with spec decoding on (``spec_decoding_use[0] != 0``): the tokens are
  packed tightly by ``spec_decoding_generation_lengths``; past = ``sequence_length[b] - G_b``;
  token i is written at slot past + i and rotated at past + ``position_offsets[g * W + i]``
  with W = ``position_offsets.shape[1]``; its mask row is row ``cu[g] + i`` of the packed mask,
  read with ``ceil(Q / 32)`` words per row, Q = ``spec_decoding_max_generation_length`` when
  the generation length is variable, else W; bit j (LSB first) lets it see tree token j;
  every key before past is visible;
* without spec decoding a generation request has exactly one token;
* K is stored after RoPE (GPT-NeoX halves); continuous cache ``[b, 2, kv_heads, S, d]`` with
  S = ``cache_indirection.shape[2]`` (present is the buffer written; a different past buffer
  is first copied into it); paged cache through ``host_kv_cache_pool_pointers``,
  ``host_kv_cache_pool_mapping`` and ``kv_cache_block_offsets`` (KVBlockArray: block
  ``[kv_heads, tokens_per_block, d]`` at pool + ((block * layers_in_pool + layer) * 2 + kv) *
  bytes_per_block);
* refused as the plugin refuses: spec decoding outside fp16/bf16 ("Speculative decoding mode
  doesn't support the data type or cross attention."), head sizes MMHA lacks, heads not a
  multiple of KV heads, bf16 below SM 80; at run time, a spec-decoding step with no XQA kernel
  for the shape, block size and SM of the emulated GPU (``$TRTLLM_STANDIN_SM``, default 90):
  the routing of decoderXQARunner / the JIT kernels / the precompiled cubins, each rule cited
  in ``_emu/xqa.py``;
* faithful numerics: the XQA kernels round the unnormalised softmax probabilities to the
  input type (bf16/fp16) before the multiply by V, and divide by the row sum of the unrounded
  ones afterwards (``cpp/kernels/xqa/test/refAttention.cpp`` @ 18d5b389, ``refAttention``: ``x``
  rounded to ``MathElem`` before ``gemm1``, ``rowSum`` from the float ``x``); emulated for the
  spec-decoding generation steps (XQA). The context phase (FMHA) keeps float32 probabilities.
While ``IS_BUILDING=1`` (TensorRT timing the layer) ``enqueue`` returns at once, as upstream.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields

import torch

from .core import EmulatedMemoryFault, EmulationError, compute_dtype, device_memory, numerics_mode, physical_dtype
from .xqa import SpecStep, emulated_sm, spec_decoding_kernel

PLUGIN_NAME = "GPTAttention"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "tensorrt_llm"
MMHA_HEAD_SIZES = (32, 48, 64, 80, 96, 104, 112, 128, 144, 160, 192, 224, 256)
ROPE_TYPES = (1, 2, 3, 8, 9)  # rope_gptj, rope_gpt_neox, long_rope, yarn, mrope (PositionEmbeddingType)
KV_INDEX_MASK = (1 << 30) - 1


@dataclass
class GPTAttentionFields:
    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    q_scaling: float
    rotary_embedding_dim: int
    position_embedding_type: int
    mask_type: int
    tp_size: int
    tp_rank: int
    paged_kv_cache: bool
    tokens_per_block: int
    dtype: str
    kv_dtype: str
    remove_input_padding: bool
    use_cache: bool
    is_spec_decoding_enabled: bool
    spec_decoding_is_generation_length_variable: bool
    spec_decoding_max_generation_length: int
    max_context_length: int
    do_cross_attention: bool
    attn_logit_softcapping_scale: float


def input_names(f: GPTAttentionFields) -> list[str]:
    """The plugin's inputs in IdxEntry order, for these fields."""
    if f.use_cache:
        names = ["qkv", "sequence_length", "host_past_key_value_lengths", "host_max_attention_window_sizes",
                 "host_sink_token_length", "context_lengths", "cache_indirection", "host_request_types"]
        names += (["kv_cache_block_offsets", "host_kv_cache_block_offsets", "host_kv_cache_pool_pointers",
                   "host_kv_cache_pool_mapping"] if f.paged_kv_cache else ["past_key_value"])
    else:
        names = ["qkv", "host_max_attention_window_sizes", "host_sink_token_length", "context_lengths",
                 "host_request_types"]
    if f.position_embedding_type in ROPE_TYPES:
        names += ["rotary_inv_freq", "rotary_cos_sin"]
    if f.remove_input_padding:
        names.append("host_context_lengths")
    if f.is_spec_decoding_enabled:
        names += ["spec_decoding_generation_lengths", "spec_decoding_packed_mask", "spec_decoding_position_offsets",
                  "spec_decoding_use"]
    return names + ["host_runtime_perf_knobs", "host_context_progress"]


INT64_INPUTS = ("host_runtime_perf_knobs", "host_context_progress", "host_kv_cache_pool_pointers")
FLOAT32_INPUTS = ("rotary_inv_freq", "rotary_cos_sin")


def check_initialize(f: GPTAttentionFields) -> None:
    """AttentionOp::initialize's refusals."""
    if f.is_spec_decoding_enabled:
        if f.dtype not in ("float16", "bfloat16") or not f.use_cache or f.do_cross_attention:
            raise EmulationError(f"GPTAttention (layer {f.layer_idx}): Speculative decoding mode doesn't support "
                                 "the data type or cross attention. (spec decoding runs on XQA: fp16/bf16 with a KV "
                                 f"cache; got {f.dtype})")
        if f.num_heads % f.num_kv_heads:
            raise EmulationError("GPTAttention: mNumHeads should be multiples of mNumKVHeads.")
    if f.dtype == "bfloat16" and emulated_sm() < 80:
        raise EmulationError("GPTAttention: Unsupported data type, pre SM 80 GPUs do not support bfloat16")
    if f.head_size not in MMHA_HEAD_SIZES:
        raise EmulationError(f"GPTAttention: Head size {f.head_size} is not supported by MMHA.")
    if f.position_embedding_type in ROPE_TYPES and f.rotary_embedding_dim == 0:
        raise EmulationError("GPTAttention: RoPE needs rotary_embedding_dim != 0")


class GPTAttentionPlugin:
    plugin_name, plugin_version, plugin_namespace = PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE

    def __init__(self, f: GPTAttentionFields) -> None:
        check_initialize(f)
        self.f = f
        self.names = input_names(f)
        self.index = {n: i for i, n in enumerate(self.names)}

    def get_fields_to_serialize(self):
        import tensorrt as trt

        return trt.PluginFieldCollection([trt.PluginField(k, v) for k, v in asdict(self.f).items()])

    # -- build --------------------------------------------------------------------------
    def get_output_data_types(self, input_types):
        if len(input_types) != len(self.names):
            raise EmulationError(f"GPTAttention expects {len(self.names)} inputs {self.names}, got {len(input_types)}")
        for name, t in zip(self.names, input_types):
            want = "int64" if name in INT64_INPUTS else "float32" if name in FLOAT32_INPUTS else \
                self.f.kv_dtype if name == "past_key_value" else self.f.dtype if name == "qkv" else "int32"
            if t.value != want:
                raise EmulationError(f"GPTAttention supportsFormatCombination: input {name!r} must be {want}, "
                                     f"got {t.value}")
        types = [input_types[0]]
        if self.f.use_cache and not self.f.paged_kv_cache:
            types.append(input_types[self.index["past_key_value"]])
        return types

    def get_output_shapes(self, input_shapes):
        out = [(input_shapes[0][0], self.f.num_heads * self.f.head_size)]
        if self.f.use_cache and not self.f.paged_kv_cache:
            out.append(tuple(input_shapes[self.index["past_key_value"]]))
        return out

    def infer_output_shapes(self, inputs):
        return self.get_output_shapes([tuple(t.shape) for t in inputs])

    # -- run ----------------------------------------------------------------------------
    def enqueue(self, inputs, outputs) -> int:
        if os.environ.get("IS_BUILDING") == "1":
            return 0  # gptAttentionPlugin.cpp: nothing runs while TensorRT builds
        x = {n: inputs[i] for n, i in self.index.items()}
        _Run(self.f, x, outputs).run()
        return 0


class GPTAttentionCreator:
    name, plugin_version, plugin_namespace = PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE

    def create_plugin(self, name, field_collection, phase):
        values = {f.name: f.data for f in field_collection}
        kwargs = {}
        for fd in fields(GPTAttentionFields):
            value = values[fd.name]
            kwargs[fd.name] = value.item() if hasattr(value, "item") else value
        return GPTAttentionPlugin(GPTAttentionFields(**kwargs))


def create_gpt_attention_plugin(f: GPTAttentionFields) -> GPTAttentionPlugin:
    return GPTAttentionPlugin(f)


def register_gpt_attention_creator() -> None:
    import tensorrt as trt

    trt.get_plugin_registry().register_creator(GPTAttentionCreator(), PLUGIN_NAMESPACE)


def _host(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.reshape(-1).tolist()]


class _Run:
    """One enqueue: requests split, K/V written, attention computed, output rows filled."""

    def __init__(self, f: GPTAttentionFields, x: dict, outputs: list) -> None:
        self.f, self.x, self.out = f, x, outputs[0]
        self.present = outputs[1] if len(outputs) > 1 else None
        self.work = compute_dtype(f.dtype)

    # -- cache access -------------------------------------------------------------------
    def _linear_cache(self) -> torch.Tensor:
        """[b, 2, kv_heads, S, d] over the present buffer, S from cache_indirection (KVLinearBuffer)."""
        past = self.x["past_key_value"]
        if self.present.data_ptr() != past.data_ptr():
            self.present.copy_(past)  # gptAttentionPlugin.cpp: copy past into present, then update in place
        batch = past.shape[0]
        window = int(self.x["cache_indirection"].shape[2])
        need = batch * 2 * self.f.num_kv_heads * window * self.f.head_size
        flat = self.present.reshape(-1)
        if need > flat.numel():
            raise EmulatedMemoryFault(f"KV cache of {flat.numel()} elements read as {need} "
                                      f"(max attention window {window} from cache_indirection)")
        return flat[:need].view(batch, 2, self.f.num_kv_heads, window, self.f.head_size)

    def _paged_block(self, seq: int, kv: int, block: int) -> torch.Tensor:
        f = self.f
        pool, layer_in_pool = (int(v) for v in self.x["host_kv_cache_pool_mapping"][f.layer_idx].tolist())
        offsets = self.x["kv_cache_block_offsets"]
        if block >= offsets.shape[3]:
            raise EmulatedMemoryFault(f"token block {block} beyond max_blocks_per_seq={offsets.shape[3]}")
        value = int(offsets[pool, seq, kv, block])
        secondary = (value >> 30) & 3
        entry = value & KV_INDEX_MASK
        base = int(self.x["host_kv_cache_pool_pointers"][pool, 1 if secondary else 0])
        dtype = physical_dtype(f.kv_dtype)
        elem = torch.empty((), dtype=dtype).element_size()
        bytes_per_block = f.tokens_per_block * f.num_kv_heads * f.head_size * elem
        address = base + layer_in_pool * 2 * bytes_per_block + entry * bytes_per_block
        return device_memory.view(address, (f.num_kv_heads, f.tokens_per_block, f.head_size), dtype)

    def _write_kv(self, cache, seq: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if cache is not None:
            if slot >= cache.shape[3]:
                raise EmulatedMemoryFault(f"KV slot {slot} beyond the attention window {cache.shape[3]}")
            cache[seq, 0, :, slot] = k.to(cache.dtype)
            cache[seq, 1, :, slot] = v.to(cache.dtype)
            return
        tpb = self.f.tokens_per_block
        for kv, value in ((0, k), (1, v)):
            block = self._paged_block(seq, kv, slot // tpb)
            block[:, slot % tpb] = value.to(block.dtype)

    def _read_kv(self, cache, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots 0..length-1: [kv_heads, length, d] each."""
        if cache is not None:
            if length > cache.shape[3]:
                raise EmulatedMemoryFault(f"KV read of {length} slots beyond the attention window {cache.shape[3]}")
            return cache[seq, 0, :, :length].to(self.work), cache[seq, 1, :, :length].to(self.work)
        tpb = self.f.tokens_per_block
        parts = [[], []]
        for kv in (0, 1):
            for block in range(math.ceil(length / tpb)):
                parts[kv].append(self._paged_block(seq, kv, block))
        k, v = (torch.cat(p, dim=1)[:, :length].to(self.work) for p in parts)
        return k, v

    # -- rope ---------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """GPT-NeoX rotation of the first rotary_dim dims, cos/sin from rotary_cos_sin (float32 pairs)."""
        f = self.f
        if f.position_embedding_type not in ROPE_TYPES:
            return x
        if f.position_embedding_type != 2:
            raise EmulationError("the emulated attention rotates GPT-NeoX style (rope_gpt_neox) only")
        rot, half = f.rotary_embedding_dim, f.rotary_embedding_dim // 2
        table = self.x["rotary_cos_sin"].reshape(-1, half, 2)
        inv_freq = self.x["rotary_inv_freq"].reshape(-1).to(torch.float32)
        cos_rows, sin_rows = [], []
        for p in positions:
            if p < table.shape[0]:
                cos_rows.append(table[p, :, 0])
                sin_rows.append(table[p, :, 1])
            else:  # V1 kernel: recompute from inv_freq past the table
                angle = torch.tensor(float(p), dtype=torch.float32) * inv_freq
                cos_rows.append(torch.cos(angle))
                sin_rows.append(torch.sin(angle))
        cos = torch.stack(cos_rows).to(self.work)[:, None, :]  # [T, 1, half]
        sin = torch.stack(sin_rows).to(self.work)[:, None, :]
        x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    # -- one call -----------------------------------------------------------------------
    def run(self) -> None:
        f, x = self.f, self.x
        types = _host(x["host_request_types"])
        num_ctx = 0
        while num_ctx < len(types) and types[num_ctx] == 0:
            num_ctx += 1
        if any(t != 1 for t in types[num_ctx:]):
            raise EmulationError("GPTAttention: context requests must come before generation requests")
        if num_ctx and num_ctx < len(types) and not f.paged_kv_cache:
            raise EmulationError("GPTAttention: a batch mixing context and generation requests needs "
                                 "remove_input_padding and the paged KV cache")
        if not f.use_cache:
            raise EmulationError("the emulated attention needs a KV cache")
        self.qkv = x["qkv"].to(self.work)
        cache = self._linear_cache() if not f.paged_kv_cache else None
        seq_lens = _host(x["sequence_length"])
        ctx_lens = _host(x["context_lengths"])
        host_ctx = _host(x["host_context_lengths"])
        token = 0
        for b in range(num_ctx):
            n = host_ctx[b]
            if ctx_lens[b] != n:
                raise EmulationError(f"context request {b}: context_lengths={ctx_lens[b]} but "
                                     f"host_context_lengths={n}")
            past = seq_lens[b] - n
            if past < 0:
                raise EmulationError(f"context request {b}: sequence_length {seq_lens[b]} < context length {n}")
            positions = [past + j for j in range(n)]
            self._attend(cache, b, token, n, past, positions, allowed=None)
            token += n
        num_gen = len(types) - num_ctx
        gen_tokens = self.qkv.shape[0] - token
        spec_on = f.is_spec_decoding_enabled and _host(x["spec_decoding_use"])[0] != 0
        if num_gen:
            if spec_on:
                lengths = _host(x["spec_decoding_generation_lengths"])[:num_gen]
                self._check_xqa_spec(lengths)
                offsets = x["spec_decoding_position_offsets"]
                width = int(offsets.shape[1])
                if width == 1:
                    raise EmulationError("Speculative decoding mode needs a valid packed_mask input tensor.")
                if sum(lengths) != gen_tokens:
                    raise EmulationError(f"generation tokens {gen_tokens} != sum(spec_decoding_generation_lengths) "
                                         f"{sum(lengths)}")
                q_max = f.spec_decoding_max_generation_length if f.spec_decoding_is_generation_length_variable \
                    else width
                words = math.ceil(q_max / 32)
                mask = x["spec_decoding_packed_mask"].reshape(-1)
                flat_offsets = offsets.reshape(-1)
                row = 0
                for g in range(num_gen):
                    b, n = num_ctx + g, lengths[g]
                    if n > width:
                        raise EmulationError(f"generation length {n} exceeds position_offsets width {width}")
                    past = seq_lens[b] - n
                    positions = [past + int(flat_offsets[g * width + i]) for i in range(n)]
                    end = (row + n) * words
                    if end > mask.numel():
                        raise EmulatedMemoryFault(f"packed mask read of {end} words, {mask.numel()} bound")
                    rows = mask[row * words: end].reshape(n, words)
                    allowed = _unpack(rows, n)
                    self._attend(cache, b, token, n, past, positions, allowed=allowed)
                    token += n
                    row += n
            else:
                if gen_tokens != num_gen:
                    raise EmulationError("Only speculative decoding mode supports input length > 1 in the "
                                         "generation phase")
                for g in range(num_gen):
                    b = num_ctx + g
                    past = seq_lens[b] - 1
                    self._attend(cache, b, token, 1, past, [past], allowed=None)
                    token += 1
        if token != self.qkv.shape[0]:
            raise EmulationError(f"{self.qkv.shape[0]} tokens given, the requests account for {token}")

    def _check_xqa_spec(self, lengths: list[int]) -> None:
        """AttentionOp::enqueueGeneration: spec decoding runs on an XQA kernel or aborts. Which
        kernel, if any, follows the upstream routing (_emu/xqa.py, each rule cited there)."""
        f, x = self.f, self.x
        windows = _host(x["host_max_attention_window_sizes"])
        step = SpecStep(
            num_q_heads=f.num_heads, num_kv_heads=f.num_kv_heads, head_size=f.head_size, dtype=f.dtype,
            kv_dtype=f.kv_dtype, paged=f.paged_kv_cache, tokens_per_block=f.tokens_per_block, mask_type=f.mask_type,
            position_embedding_type=f.position_embedding_type, q_scaling=f.q_scaling,
            sink_token_length=_host(x["host_sink_token_length"])[0], cross_attention=f.do_cross_attention,
            # gptAttentionPlugin.cpp: cyclic window = this layer's, max window = the largest of all layers
            cyclic_window_equals_max=windows[f.layer_idx] == max(windows), generation_length=max(lengths, default=1))
        sm = emulated_sm()
        kernel, why = spec_decoding_kernel(step, sm)
        if kernel is None:
            raise EmulationError(f"GPTAttention (layer {f.layer_idx}): No available XQA kernels are found for "
                                 f"speculative decoding mode. [stand-in: {f.num_heads} q / {f.num_kv_heads} KV heads "
                                 f"of size {f.head_size}, {f.dtype}, "
                                 f"{'paged ' + str(f.tokens_per_block) if f.paged_kv_cache else 'contiguous'} KV, "
                                 f"SM {sm}: {why}]")
        self.xqa_kernel = kernel

    def _attend(self, cache, seq: int, token: int, n: int, past: int, positions: list[int],
                allowed: torch.Tensor | None) -> None:
        """Write the n new tokens' K/V at slots past.., then attend (causal, or the tree mask)."""
        f = self.f
        qkv = self.qkv[token: token + n]
        h, kvh, d = f.num_heads, f.num_kv_heads, f.head_size
        q = self._rope(qkv[:, : h * d].reshape(n, h, d), positions)
        k = self._rope(qkv[:, h * d: (h + kvh) * d].reshape(n, kvh, d), positions)
        v = qkv[:, (h + kvh) * d:].reshape(n, kvh, d)
        for i in range(n):
            self._write_kv(cache, seq, past + i, k[i], v[i])
        total = past + n
        keys, values = self._read_kv(cache, seq, total)  # [kvh, total, d]
        group = h // kvh
        keys = keys.repeat_interleave(group, dim=0)
        values = values.repeat_interleave(group, dim=0)
        scores = torch.einsum("nhd,htd->hnt", q, keys) / (math.sqrt(d) * f.q_scaling)
        visible = torch.ones(n, total, dtype=torch.bool)
        if allowed is None:
            visible[:, past:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        else:
            visible[:, past:] = allowed
        scores = scores.masked_fill(~visible[None], float("-inf"))
        if allowed is not None and numerics_mode() == "faithful":
            # XQA (refAttention.cpp @ 18d5b389): x = exp(s - rowMax) in float32, rowSum from that
            # x, x rounded to the input type for the P.V product, the product divided by rowSum.
            x = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
            row_sum = x.sum(dim=-1, keepdim=True)  # [h, n, 1]
            x = x.to(physical_dtype(f.dtype)).to(self.work)
            context = (torch.einsum("hnt,htd->hnd", x, values) / row_sum).permute(1, 0, 2).reshape(n, h * d)
        else:
            probs = torch.softmax(scores, dim=-1)
            context = torch.einsum("hnt,htd->nhd", probs, values).reshape(n, h * d)
        self.out[token: token + n] = context.to(self.out.dtype)


def _unpack(rows: torch.Tensor, n: int) -> torch.Tensor:
    """[n, words] int32 -> bool [n, n]: bit j (LSB first) of row i."""
    bits = []
    words = rows.to(torch.int64) & 0xFFFFFFFF
    for j in range(n):
        bits.append(((words[:, j // 32] >> (j % 32)) & 1).bool())
    return torch.stack(bits, dim=1)
