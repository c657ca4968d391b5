"""Issue 31: what TensorRT-LLM's kernels would refuse, refused in the stand-in and by the build.

* The stand-in's gpt attention plugin runs a spec-decoding (tree verification) step only on an
  XQA kernel that exists for the shape, the KV block size and the emulated GPU's SM
  (``tests/trtllm_standin/_emu/xqa.py``, each rule cited there); otherwise it stops with
  TensorRT-LLM's "No available XQA kernels are found for speculative decoding mode."
* The project's own rule (``tensorrt_llm_dflash/trtllm/kernel_support.py``, used by the build,
  the network and the runner) gives the same answer as the stand-in on every case here.
* Faithful numerics: XQA rounds the softmax probabilities to bf16/fp16 before P.V.
* The emulated TensorRT runtime checks named dimensions and host/device placement.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict

import pytest
import standin
import torch
from engine_case import MAX_DRAFT_LEN, PROMPTS, build_argv, write_checkpoint

from tensorrt_llm_dflash.errors import DFlashConfigError


@pytest.fixture
def active(tmp_path):
    with standin.active(tmp_path / "lib", numerics="faithful"):
        yield


def _step(heads, kv, head, *, dtype="bfloat16", paged=True, tpb=32, **extra):
    from _emu.xqa import SpecStep

    fields = {"num_q_heads": heads, "num_kv_heads": kv, "head_size": head, "dtype": dtype, "kv_dtype": dtype,
              "paged": paged, "tokens_per_block": tpb, "mask_type": 1, "position_embedding_type": 2,
              "q_scaling": 1.0}
    return SpecStep(**{**fields, **extra})


# ------------------------------------------------------------------- the emulated routing

@pytest.mark.parametrize(("case", "shape", "sm", "kernel", "why"), [
    ("SmolLM2-135M", (9, 3, 64, {}), 90, None, "does not divide 64 -> precompiled XQA cubins, which refuse: "
                                               "no multi-query cubin for head size 64"),
    ("Qwen3-8B", (32, 8, 128, {}), 90, "JIT HMMA", "decoderXQAImplJIT"),
    ("CI engines (2/1 of 64)", (2, 1, 64, {"tpb": 16}), 90, "JIT HMMA", "decoderXQAImplJIT"),
    ("Qwen3-14B default blocks", (40, 8, 128, {}), 90, None, "paged blocks of 32 tokens"),
    ("Qwen3-14B 64-token blocks", (40, 8, 128, {"tpb": 64}), 90, "precompiled", "Precompiled"),
    ("Qwen3-14B contiguous", (40, 8, 128, {"paged": False}), 86, "precompiled", "Precompiled"),
    ("Qwen2.5-7B on SM 120", (28, 4, 128, {"tpb": 128}), 120, None, "no multi-query cubin for SM 120"),
    ("Qwen3-8B on SM 120", (32, 8, 128, {}), 120, "JIT HMMA", "decoderXQAImplJIT"),
    ("Qwen3-8B on Blackwell", (32, 8, 128, {}), 100, None, "TRTLLM-GEN, which does not support"),
    ("Qwen3-8B on B300", (32, 8, 128, {}), 103, None, "SM100 family"),
    ("bf16 on Turing", (32, 8, 128, {}), 75, None, "bf16 needs SM >= 80"),
    ("fp16 on Turing", (32, 8, 128, {"dtype": "float16"}), 75, None, "HMMA needs SM >= 80"),
    ("8-token blocks", (32, 8, 128, {"tpb": 8}), 90, None, "tokens_per_block 8 not in (16, 32, 64, 128)"),
    ("group 64", (64, 1, 128, {}), 90, None, "head group 64 x beam 1 > 32"),
    ("fp8 KV on Hopper", (40, 8, 128, {"kv_dtype": "fp8"}), 90, "JIT QGMMA", "decoderXQAImplJIT"),
    ("sinks", (32, 8, 128, {"sink_token_length": 4}), 90, None, "sink tokens"),
    ("q_scaling on the cubin path", (40, 8, 128, {"tpb": 64, "q_scaling": 2.0}), 90, None, "q_scaling 2.0 != 1"),
])
def test_emulated_xqa_routing(active, case, shape, sm, kernel, why):
    from _emu.xqa import spec_decoding_kernel

    heads, kv, head, extra = shape
    got, reason = spec_decoding_kernel(_step(heads, kv, head, **extra), sm)
    assert (got is None) == (kernel is None), (case, got, reason)
    if kernel is not None:
        assert got.startswith(kernel), (case, got)
    assert why.lower() in reason.lower() or why in reason, (case, reason)


def test_project_rule_agrees_with_the_emulated_kernels(active):
    """kernel_support.spec_decoding_kernel (build, network, runner) refuses exactly what the
    stand-in's upstream routing finds no kernel for: over head groups 1..9 and 16/32/64, head
    sizes 64/72/128/256, bf16 and fp16, paged blocks 8..128 and contiguous KV, SM 75..121."""
    from _emu.xqa import spec_decoding_kernel as emulated

    from tensorrt_llm_dflash.trtllm.kernel_support import TargetAttention, spec_decoding_kernel

    checked = 0
    for group, head, dtype, tpb, sm in itertools.product(
            (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32, 64), (64, 72, 128, 256), ("bfloat16", "float16"),
            (None, 8, 16, 32, 64, 128), (75, 80, 86, 89, 90, 100, 103, 120, 121)):
        kv = 2
        kernel, reason = emulated(_step(group * kv, kv, head, dtype=dtype, paged=tpb is not None, tpb=tpb or 0), sm)
        try:
            spec_decoding_kernel(TargetAttention(group * kv, kv, head, dtype), paged=tpb is not None,
                                 tokens_per_block=tpb or 0, sm=sm)
            ours = True
        except DFlashConfigError:
            ours = False
        assert ours == (kernel is not None), (group, head, dtype, tpb, sm, reason)
        checked += 1
    assert checked == 12 * 4 * 2 * 6 * 9


# ------------------------------------------- engines the kernels cannot run (bypassing the build)

def _build_unchecked(tmp, ckpt, monkeypatch, **kwargs):
    """Build as TensorRT-LLM would without this project's checks (build.py and model.py)."""
    from tensorrt_llm_dflash.trtllm import build, model

    monkeypatch.setattr(build, "check_kernels", lambda *args: "unchecked")
    monkeypatch.setattr(model, "spec_decoding_kernel", lambda *args, **kw: "unchecked")
    engine = tmp / "engine"
    assert build.main(build_argv(ckpt, engine, **kwargs)) == 0
    return engine


def _first_verify(engine_dir):
    from tensorrt_llm_dflash.decode import speculative_generate
    from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget, EngineProposer

    target = DFlashEngineTarget(engine_dir, device="cpu")
    return speculative_generate(target, EngineProposer(target), PROMPTS[0], 4, ddtree_budget=8)


def test_smollm2_shaped_engine_aborts_at_the_first_verify_step(tmp_path, monkeypatch):
    """Item 1: SmolLM2-135M's attention shape (9 q / 3 KV heads of 64). The old stand-in ran it;
    TensorRT-LLM's plugin has no XQA kernel for it (group 3 -> precompiled cubins, head size
    128 only) and aborts at the first spec-decoding step; so does the stand-in now. The build
    entry point refuses the checkpoint by name before building (exit 2)."""
    from tensorrt_llm_dflash.trtllm import build

    with standin.active(tmp_path / "lib"):
        from _emu import EmulationError

        _, _, ckpt = write_checkpoint(tmp_path, "llama", heads=9, kv_heads=3, max_draft_len=8)
        assert build.main(build_argv(ckpt, tmp_path / "refused", max_draft_len=8)) == 2
        assert not (tmp_path / "refused" / "rank0.engine").exists()
        for kv_cache in ("paged", "continuous"):
            engine = _build_unchecked(tmp_path / kv_cache, ckpt, monkeypatch, max_draft_len=8, kv_cache=kv_cache)
            with pytest.raises(EmulationError, match="No available XQA kernels are found for speculative decoding "
                                                     r"mode\. \[stand-in: 9 q / 3 KV heads of size 64.*head size 64"):
                _first_verify(engine)


def test_block_size_the_jit_kernels_lack_aborts(tmp_path, monkeypatch):
    """Item 2: paged blocks of 8 tokens; the JIT kernels take 16/32/64/128 (kernelUtils.cpp).
    Any power of two used to be accepted; the stand-in refuses at the first verify step, the
    build by name."""
    from tensorrt_llm_dflash.trtllm import build

    with standin.active(tmp_path / "lib"):
        from _emu import EmulationError

        _, _, ckpt = write_checkpoint(tmp_path, "qwen3", max_draft_len=8)
        extra = ("--tokens_per_block", "8")
        assert build.main(build_argv(ckpt, tmp_path / "refused", max_draft_len=8, kv_cache="paged", extra=extra)) == 2
        engine = _build_unchecked(tmp_path, ckpt, monkeypatch, max_draft_len=8, kv_cache="paged", extra=extra)
        with pytest.raises(EmulationError, match=r"tokens_per_block 8 not in \(16, 32, 64, 128\)"):
            _first_verify(engine)


def test_blackwell_and_pre_ampere_gpus_are_refused(tmp_path, monkeypatch):
    """Item 3: on SM 100/103 XQA goes to TRTLLM-GEN, which has no spec decoding; bf16 needs SM 80.
    The stand-in refuses as the plugin does (at the first verify step; bf16 at plugin creation);
    the runner refuses at load, by name, when it sees the GPU's SM."""
    from tensorrt_llm_dflash.trtllm import runner

    with standin.active(tmp_path / "lib"):
        from _emu import EmulationError

        _, _, ckpt = write_checkpoint(tmp_path, "qwen3", max_draft_len=8)
        from tensorrt_llm_dflash.trtllm import build

        engine = tmp_path / "engine"
        assert build.main(build_argv(ckpt, engine, max_draft_len=8)) == 0  # no GPU here: the SM is unknown
        monkeypatch.setenv("TRTLLM_STANDIN_SM", "100")
        with pytest.raises(EmulationError, match="SM 100: SM 100 .SM100 family. routes XQA to TRTLLM-GEN"):
            _first_verify(engine)
        monkeypatch.setenv("TRTLLM_STANDIN_SM", "75")
        with pytest.raises(EmulationError, match="pre SM 80 GPUs do not support bfloat16"):
            _first_verify(engine)
        monkeypatch.setenv("TRTLLM_STANDIN_SM", "90")
        assert _first_verify(engine).output_ids
        monkeypatch.setattr(runner, "device_sm", lambda device=None: 100)
        with pytest.raises(DFlashConfigError, match="GPU SM 100: on the SM100 family XQA runs the TRTLLM-GEN"):
            runner.DFlashEngineTarget(engine, device="cpu")


# --------------------------------------------------------------------- faithful numerics

def test_xqa_rounds_softmax_probabilities_before_pv(active):
    """Item 5: XQA (cpp/kernels/xqa/test/refAttention.cpp, refAttention) rounds exp(s - rowMax) to
    the input type before the P.V product and divides by the row sum of the unrounded values.
    The emulated spec-decoding step equals that reference bit for bit, and differs from keeping
    float32 probabilities (what the emulation did before)."""
    from _emu.attention import GPTAttentionFields, _Run

    torch.manual_seed(0)
    n, past, h, d = 5, 11, 2, 64
    fields = GPTAttentionFields(
        layer_idx=0, num_heads=h, num_kv_heads=1, head_size=d, q_scaling=1.0, rotary_embedding_dim=0,
        position_embedding_type=0, mask_type=1, tp_size=1, tp_rank=0, paged_kv_cache=False, tokens_per_block=32,
        dtype="bfloat16", kv_dtype="bfloat16", remove_input_padding=True, use_cache=True,
        is_spec_decoding_enabled=True, spec_decoding_is_generation_length_variable=True,
        spec_decoding_max_generation_length=8, max_context_length=64, do_cross_attention=False,
        attn_logit_softcapping_scale=0.0)
    cache = (torch.randn(1, 2, 1, 32, d) * 2).bfloat16()
    qkv = (torch.randn(n, (h + 2) * d) * 2).bfloat16()
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    allowed[3, 1] = False
    run = _Run(fields, {}, [torch.empty(n, h * d, dtype=torch.bfloat16)])
    run.qkv = qkv.float()
    run._attend(cache, 0, 0, n, past, list(range(past, past + n)), allowed=allowed)

    q = qkv.float()[:, : h * d].view(n, h, d)
    keys, values = cache[0, 0, 0, : past + n].float(), cache[0, 1, 0, : past + n].float()
    visible = torch.ones(n, past + n, dtype=torch.bool)
    visible[:, past:] = allowed
    scores = torch.einsum("nhd,td->hnt", q, keys) / math.sqrt(d)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    x = torch.exp(scores - scores.amax(-1, keepdim=True))
    rounded = (torch.einsum("hnt,td->hnd", x.bfloat16().float(), values) / x.sum(-1, keepdim=True))
    unrounded = torch.einsum("hnt,td->hnd", torch.softmax(scores, -1), values)
    as_out = lambda t: t.permute(1, 0, 2).reshape(n, h * d).bfloat16()  # noqa: E731
    assert torch.equal(run.out, as_out(rounded))
    assert not torch.equal(as_out(rounded), as_out(unrounded))  # the rounding is visible in bf16


# ------------------------------------------------------- the emulated TensorRT runtime

def _two_input_engine(first=("batch", "hidden"), second=("batch", "hidden"), names=("x", "y")):
    """x [b, 4] float32 -> 2x, y [b, 4] int32 -> float, separate outputs; both b in 1..4."""
    import tensorrt as trt
    from tensorrt_llm.builder import Builder
    from tensorrt_llm.functional import Tensor, cast
    from tensorrt_llm.network import net_guard
    from tensorrt_llm.runtime import Session

    builder = Builder()
    network = builder.create_network()
    with net_guard(network):
        x = Tensor(name=names[0], dtype=trt.float32, shape=[-1, 4],
                   dim_range=OrderedDict([(first[0], [(1, 2, 4)]), (first[1], [4])]))
        y = Tensor(name=names[1], dtype=trt.int32, shape=[-1, 4],
                   dim_range=OrderedDict([(second[0], [(1, 2, 4)]), (second[1], [4])]))
        (x * 2.0).mark_output("out_x", trt.float32)
        cast(y, "float32").mark_output("out_y", trt.float32)
    engine = builder.build_engine(network, builder.create_builder_config(precision="float32"))
    return Session.from_serialized_engine(engine)


def test_named_dimensions_must_agree_at_run_time(active):
    """Item 5: TensorRT checks at run time that dimensions with one name have one value
    (NvInfer.h, ITensor::setDimensionName); the build-time check (same ranges) cannot see it."""
    from _emu import EmulationError

    session = _two_input_engine()
    x, y = torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.int32)
    outs = {"out_x": torch.empty(2, 4), "out_y": torch.empty(3, 4)}
    session.set_shapes({"x": x, "y": y})  # each inside its profile
    with pytest.raises(EmulationError, match="dimension 'batch' is 2 in input 'x' but 3 in input 'y'"):
        session.run({"x": x, "y": y}, outs, 0)
    other = _two_input_engine(second=("rows", "hidden"))
    other.set_shapes({"x": x, "y": y})
    assert other.run({"x": x, "y": y}, outs, 0)  # different names: no constraint


def test_host_and_device_memory_are_not_one_allocation(active):
    """Item 5: TensorRT-LLM's plugins read host_* inputs on the CPU; every other I/O is device
    memory (NvInferRuntime.h, setTensorAddress). One buffer bound as both is refused, and so is
    a KV pool pointer into host memory."""
    from _emu import EmulationError

    session = _two_input_engine(names=("x", "host_y"))
    buf = torch.zeros(16)
    x, host_y = buf[:8].view(2, 4), buf[8:].view(torch.int32).view(2, 4)
    outs = {"out_x": torch.empty(2, 4), "out_y": torch.empty(2, 4)}
    session.set_shapes({"x": x, "host_y": host_y})
    with pytest.raises(EmulationError, match="'host_y' .host memory. and 'x' .device memory. are bound to the "
                                             "same allocation"):
        session.run({"x": x, "host_y": host_y}, outs, 0)
    assert session.run({"x": x.clone(), "host_y": host_y.clone()}, outs, 0)

    import tensorrt as trt
    from tensorrt_llm.builder import Builder
    from tensorrt_llm.functional import Tensor, cast
    from tensorrt_llm.network import net_guard
    from tensorrt_llm.runtime import Session

    builder = Builder()
    network = builder.create_network()
    with net_guard(network):
        pools = Tensor(name="host_kv_cache_pool_pointers", dtype=trt.int64, shape=[1, 2],
                       dim_range=OrderedDict([("num_pools_layers", [1]), ("num_pools_kv", [2])]))
        lengths = Tensor(name="host_lengths", dtype=trt.int32, shape=[4], dim_range=OrderedDict([("n", [4])]))
        (cast(pools, "int32") * 0).mark_output("z", trt.int32)
        (lengths * 1).mark_output("l", trt.int32)
    session = Session.from_serialized_engine(builder.build_engine(network, builder.create_builder_config(precision="float32")))
    host_lengths, pool = torch.zeros(4, dtype=torch.int32), torch.zeros(64)
    outs = {"z": torch.empty(1, 2, dtype=torch.int32), "l": torch.empty(4, dtype=torch.int32)}
    for pointer, ok in ((pool.data_ptr(), True), (host_lengths.data_ptr(), False)):
        table = torch.tensor([[pointer, 0]], dtype=torch.int64)
        session.set_shapes({"host_kv_cache_pool_pointers": table, "host_lengths": host_lengths})
        if ok:
            assert session.run({"host_kv_cache_pool_pointers": table, "host_lengths": host_lengths}, outs, 0)
        else:
            with pytest.raises(EmulationError, match="inside 'host_lengths' .host memory.: the attention kernels"):
                session.run({"host_kv_cache_pool_pointers": table, "host_lengths": host_lengths}, outs, 0)


def test_runner_binds_every_engine_with_consistent_names_and_placement(tmp_path):
    """The runner's passes satisfy both runtime checks on a paged engine (host tables apart from
    the device ones, pools in device memory, every named dimension consistent): chain and tree."""
    with standin.active(tmp_path / "lib"):
        from tensorrt_llm_dflash.decode import speculative_generate
        from tensorrt_llm_dflash.trtllm import build
        from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget, EngineProposer

        _, _, ckpt = write_checkpoint(tmp_path, "qwen3")
        engine_dir = tmp_path / "engine"
        assert build.main(build_argv(ckpt, engine_dir, kv_cache="paged", extra=("--tokens_per_block", "16"))) == 0
        target = DFlashEngineTarget(engine_dir, device="cpu")
        for budget in (0, MAX_DRAFT_LEN):
            assert len(speculative_generate(target, EngineProposer(target), PROMPTS[0], 6,
                                            ddtree_budget=budget).output_ids) == 6
