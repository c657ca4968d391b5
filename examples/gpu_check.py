#!/usr/bin/env python
"""One command that proves the graph-ready runtime (``GraphedDecoder``) on a GPU; the same code runs on the CPU
at tiny sizes (``--tiny``, tests/test_gpu_check.py), so it cannot rot.

    python examples/gpu_check.py                                    # CUDA, fp32 + bf16, then the plugin library
    python examples/gpu_check.py --tiny --device cpu --out /tmp/gc  # tiny random models on the CPU

It needs torch, transformers (4.57 or 5.x) and numpy, nothing else: the targets are random-weight models built from
their configs (SmolLM2-135M's shape, and a small Qwen3 whose upper layers use a sliding window), the drafters are
loaded with the project's loader (the shipped SmolLM2 drafter; a random one for the Qwen3, saved and loaded like a
checkpoint), and the prompt ids are made here (no tokenizer, no GGUF, no datasets).

Per target and dtype, for AR, the DFlash chain, DDTree 32 and the cost-aware tree, with the real drafter and with
an *oracle* drafter (it drafts the target's own greedy continuation, right most of the time, so long paths are
accepted and compaction, the walk and the context update move many rows; a random target gives the real drafter
almost nothing to accept):

* capture: seconds and MiB of every size's graphs (and the cost-aware tree's cost curve);
* graphed against the same decoder run eagerly on the same device and dtype (``use_graphs=False``: the stage
  functions the graphs were captured from), and against the eager runtime (``decode.speculative_generate``) for
  AR, chain and DDTree 32: token ids and acceptance lengths must be identical in fp32 (in bf16 they are reported);
* every fp32 output equals the eager runtime's AR output (greedy is lossless);
* ms per stage per step, per tree size; graphed AR against eager AR in tok/s; the prefill's ms (padded to a power of
  two and replayed from a graph, as on CUDA: every decoder here prefills that way, on a CPU too) against the eager
  runtime's;
* the re-capture paths: a second request at T=0.8 (new graphs, a new cost curve, the learned tables untouched;
  its tokens eager AR's sampled tokens for the same seed),
  a prompt longer than the static state (it grows and re-captures), ``prepare()`` after that growth;
* the compaction boundary: DDTree 3 with a block of 8 or 16, a 200-token prompt, 51 new tokens (a state sized from
  the tree instead of the block was written past its end there), then a capture right after it;
* batch > 1: four prompts of different lengths through the rows of one decoder, admitted one step apart (graphs per
  batch bucket, tree size and window): each row against the same prompt decoded alone (equal in fp32; the match
  rate in bf16), graphed against the same batched decoder eager (ids and tree sizes), the graph sets captured, and
  total tok/s against the four prompts decoded one after the other.

Last, with ``--plugins on`` (``auto``: when CUDA, nvcc and cmake are all there), the plugin library is built with
cmake for this GPU's architecture, its CUDA kernels are run on the GPU against the Python reference, and the plugin
tests (tests/test_plugins_*.py, if pytest is installed) run against the fresh build.

Every sub-check is recorded in one JSON file (``--json``, default ``<--out>/gpu_check.json``, rewritten after each
check) with one summary line per figure on stdout; a failing check is recorded and the run goes on; the exit code
is 1 if any check failed. The file says ``"complete": true`` only once every check has run, and ``"ok": true`` only
then (and with none failed): the file a run cut short leaves behind never reads as a pass.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tensorrt_llm_dflash import cli, fused_tree, kernels  # noqa: E402
from tensorrt_llm_dflash.assets import DEMO_DRAFTER_DIR  # noqa: E402
from tensorrt_llm_dflash.config import DFlashDraftConfig, build_target_layer_ids  # noqa: E402
from tensorrt_llm_dflash.decode import GenerationResult, speculative_generate  # noqa: E402
from tensorrt_llm_dflash.device_lookup import Grafted, graft_device, lookup_device  # noqa: E402
from tensorrt_llm_dflash.device_policy import POLICY_BUCKETS, DevicePolicy  # noqa: E402
from tensorrt_llm_dflash.device_tree import build_ddtree_device, visibility_device, walk_device  # noqa: E402
from tensorrt_llm_dflash.drafter import DFlashDraftModel, load_dflash_drafter, save_dflash_drafter  # noqa: E402
from tensorrt_llm_dflash.errors import DFlashInputError  # noqa: E402
from tensorrt_llm_dflash.files import atomic_write_json  # noqa: E402
from tensorrt_llm_dflash.graphed import CAPACITY_STEP, STEP_STAGES, GraphedDecoder  # noqa: E402
from tensorrt_llm_dflash.proposer import DFlashProposer  # noqa: E402
from tensorrt_llm_dflash.sampling import SamplingParams  # noqa: E402
from tensorrt_llm_dflash.target import HFTargetVerifier, _sliding_window, target_dims  # noqa: E402

#: ``auto`` chooses each step's size ahead (CUDA's default); ``auto-in-step`` inside the step (the CPU's default, one
#: host read per step: graphs of two sizes replay in one step).
METHODS = ("ar", "chain", "ddtree:32", "auto", "auto-in-step", "oracle-chain", "oracle-ddtree:32", "oracle-auto",
           "oracle-auto-in-step")
#: All but the oracle's in-step run (a GPU run's time is short).
DEFAULT_METHODS = tuple(m for m in METHODS if m != "oracle-auto-in-step")
#: The shipped drafter's target: SmolLM2-135M(-Instruct).
SMOLLM2 = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192}
#: Where the compaction boundary once broke: 200 + 51 + (tree of 4) + 1 = 256 slots, one compacted block more.
#: --tiny keeps the sum (240 + 11) with fewer steps.
BOUNDARY_BUDGET, BOUNDARY_NEW, TINY_BOUNDARY_NEW = 3, 51, 11
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
#: The cost-aware tree's sizes in --tiny: half the graphs (and cost timing) of the default six.
TINY_BUCKETS = (2, 8, 32)


# ------------------------------------------------------------------------------------------------ the report


@dataclass
class Check:
    name: str
    status: str = "ok"  # ok, FAIL or skip
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class Report:
    """Every check with its figures, in one JSON file rewritten after each check (a crash keeps what ran)."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path, self.meta, self.checks = path, meta, []
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def check(self, name: str) -> Iterator[Check]:
        """Run one sub-check: an exception fails it (recorded with its traceback's last frames) and the run goes on."""
        entry = Check(name)
        start = time.perf_counter()
        try:
            yield entry
        except Skip as why:
            entry.status, entry.error = "skip", str(why)
        except Exception as err:  # noqa: BLE001 - every failure is recorded, then the next check runs
            entry.status = "FAIL"
            entry.error = f"{type(err).__name__}: {err}"
            entry.figures["traceback"] = traceback.format_exc(limit=-4)
        entry.seconds = time.perf_counter() - start
        self.checks.append(entry)
        self._print(entry)
        self.write()

    def _print(self, entry: Check) -> None:
        shown = {k: v for k, v in entry.figures.items() if k != "traceback" and not k.startswith("_")}
        if entry.status != "ok":
            print(f"{entry.status:4} {entry.name}: {entry.error}", flush=True)
            return
        if not shown:
            print(f"ok   {entry.name} ({entry.seconds:.1f} s)", flush=True)
        for key, value in shown.items():
            print(f"ok   {entry.name} {key}: {_fmt(value)}", flush=True)

    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "FAIL"]

    def write(self, complete: bool = False) -> None:
        """``complete``: the run's last write, after every check. The writes after each check say false, and so
        is their ``ok``: a run cut short (a GPU run's time limit, a kill) must not read as a pass."""
        data = {**self.meta, "seconds": time.perf_counter() - self.start, "complete": complete,
                "failed": self.failed(), "ok": complete and not self.failed(), "checks": [vars(c) for c in self.checks]}
        atomic_write_json(self.path, _json_safe(data))


class Skip(Exception):
    """A check that does not apply here (recorded as skipped, not failed)."""


class Mismatch(AssertionError):
    """An equality the check requires did not hold."""


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)) and len(value) > 12:
        return f"[{', '.join(_fmt(v) for v in value[:12])}, ... ({len(value)})]"
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(_fmt(v) for v in value)}]"
    return str(value)


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return value


# ------------------------------------------------------------------------------------------------ models


@dataclass
class Shape:
    """One target (and, without a drafter directory, the random drafter made for it)."""

    name: str
    arch: str  # llama or qwen3
    config: dict[str, Any]
    sliding_window: int | None = None
    window_from_layer: int = 0
    drafter_dir: Path | None = None  # the shipped drafter; None: a random one of ``drafter_block``
    drafter_block: int = 16


def shapes(tiny: bool) -> list[Shape]:
    if not tiny:
        return [Shape("smollm2-135m", "llama", SMOLLM2, drafter_dir=DEMO_DRAFTER_DIR),
                Shape("qwen3-swa", "qwen3", {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 768,
                                             "num_hidden_layers": 8, "num_attention_heads": 4,
                                             "num_key_value_heads": 2, "head_dim": 64,
                                             "max_position_embeddings": 4096},
                      sliding_window=64, window_from_layer=4, drafter_block=16)]
    small = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}
    return [Shape("smollm2-135m-tiny", "llama", small, drafter_block=8),
            Shape("qwen3-swa-tiny", "qwen3", {**small, "head_dim": 16}, sliding_window=16, window_from_layer=2,
                  drafter_block=16)]


def build_target(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Any:
    """A random-weight causal LM of ``shape`` (config classes and constructors alike in transformers 4.57 and 5.x).

    Matrices are drawn with std 0.2, wider than an untrained init, so that the greedy choice is clear (top-2 logit
    gaps of about 1 instead of 0.05) and fp32 rounding differences between kernels cannot flip it. Only the
    parameters take ``dtype``: buffers (RoPE frequencies) stay float32, as ``from_pretrained(dtype=...)`` leaves them.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = {**shape.config, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
              "attn_implementation": "sdpa"}
    if shape.arch == "llama":
        config, cls = LlamaConfig(tie_word_embeddings=True, **common), LlamaForCausalLM
    else:
        layers = shape.config["num_hidden_layers"]
        window: dict[str, Any] = {}
        if shape.sliding_window is not None:
            window = {"use_sliding_window": True, "sliding_window": shape.sliding_window,
                      "max_window_layers": shape.window_from_layer,
                      "layer_types": ["full_attention" if i < shape.window_from_layer else "sliding_attention"
                                      for i in range(layers)]}
        config, cls = Qwen3Config(tie_word_embeddings=False, **window, **common), Qwen3ForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            p.data = p.data.to(dtype)
    return model.eval()


def random_drafter_dir(target: Any, block_size: int, where: Path, seed: int = 0) -> Path:
    """A random DFlash drafter for ``target``, saved as a checkpoint (then loaded by the project's loader)."""
    c = target.config
    layers = int(c.num_hidden_layers)
    config = DFlashDraftConfig(
        hidden_size=int(c.hidden_size), intermediate_size=2 * int(c.hidden_size), num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=int(c.hidden_size) // 4, vocab_size=int(c.vocab_size),
        block_size=block_size, mask_token_id=int(c.vocab_size) - 1,
        target_layer_ids=build_target_layer_ids(layers, 2 if layers > 4 else 1), num_target_layers=layers,
        rope_theta=10000.0, max_position_embeddings=int(c.max_position_embeddings), dtype="float32")
    torch.manual_seed(1000 + seed)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    save_dflash_drafter(model, where, dtype=torch.float32)
    return where


class OracleDrafter:
    """Drafts the target's own greedy continuation ``stream`` (prompt + output): at each depth the true token gets the
    top logit with probability 1 - ``noise``, otherwise a decoy does and the truth is second (a DDTree still finds
    it). Everything is a gather from device tables built per static state, so a draft reads nothing on the host and
    captures as a CUDA graph. The interface is the one ``GraphedDecoder`` takes from any drafter object."""

    def __init__(self, stream: list[int], block_size: int, vocab: int, noise: float = 0.25, seed: int = 0) -> None:
        self.stream, self.block_size, self.vocab, self.noise, self.seed = list(stream), block_size, vocab, noise, seed

    def static_proposer(self, model: Any, capacity: int, batch: int) -> _OracleState:
        return _OracleState(self, model.device, capacity)


class _OracleState:
    def __init__(self, oracle: OracleDrafter, device: torch.device, capacity: int) -> None:
        self.block_size, self.draft_ids, self.target_layer_ids = oracle.block_size, None, []
        depth, length = oracle.block_size - 1, capacity + oracle.block_size + 1
        gen = torch.Generator().manual_seed(oracle.seed)
        stream = torch.full((length,), -1, dtype=torch.long)
        known = oracle.stream[:length]
        stream[: len(known)] = torch.tensor(known, dtype=torch.long)
        self.stream = stream.to(device)
        self.wrong = (torch.rand(length, depth, generator=gen) < oracle.noise).to(device)
        self.decoy = torch.randint(0, oracle.vocab, (length, depth), generator=gen).to(device)
        # Small distinct background logits: no ties among the rest of the vocabulary.
        rows = torch.arange(depth, dtype=torch.float32)[:, None] + 1.0
        self.base = (0.5 * torch.sin(rows * torch.arange(oracle.vocab, dtype=torch.float32) * 0.37)).to(device)
        self.offsets = torch.arange(1, oracle.block_size, device=device)

    def extend(self, features: torch.Tensor, start: torch.Tensor, row: int | None = None) -> None:
        pass  # the oracle needs no context: it reads the stream by position

    def draft(self, root: torch.Tensor, context_len: torch.Tensor, window: int | None = None) -> torch.Tensor:
        truth = self.stream[context_len[:, None] + self.offsets]  # [B, D], -1 past the known stream
        known = truth >= 0
        wrong = self.wrong[context_len] & known
        truth = truth.clamp(min=0)
        decoy = self.decoy[context_len]
        decoy = torch.where(decoy == truth, (truth + 1) % self.base.shape[1], decoy)
        logits = self.base.expand(root.shape[0], -1, -1).clone()
        at_truth = logits.gather(2, truth[..., None])[..., 0]
        logits.scatter_(2, truth[..., None], torch.where(known, torch.where(wrong, 11.0, 12.0), at_truth)[..., None])
        at_decoy = logits.gather(2, decoy[..., None])[..., 0]
        logits.scatter_(2, decoy[..., None], torch.where(wrong, 12.0, at_decoy)[..., None])
        return logits


def make_prompt(length: int, vocab: int, seed: int) -> list[int]:
    """Random ids in 2..vocab-2 whose first 16 come back at the end, so prompt lookup finds a match."""
    ids = [int(t) for t in np.random.default_rng(seed).integers(2, vocab - 2, size=max(length - 16, 1))]
    return (ids + ids[:16])[:length]


# ------------------------------------------------------------------------------------------------ runs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eager_run(model: Any, drafter: Any | None, prompt: list[int], new: int, budget: int = 0,
              sampling: SamplingParams | None = None) -> GenerationResult:
    """The eager runtime (``decode.speculative_generate``): AR without a drafter, else the chain or a DDTree."""
    layer_ids = list(drafter.config.target_layer_ids) if drafter is not None else None
    verifier = HFTargetVerifier(model, layer_ids)
    try:
        proposer = DFlashProposer.for_target(drafter, model) if drafter is not None else None
        return speculative_generate(verifier, proposer, prompt, new, sampling, ddtree_budget=budget)
    finally:
        verifier.close()  # its hooks on the target's layers must not stay for the graphed runs


def tok_per_s(result: GenerationResult) -> float:
    return result.stats.new_tokens / max(result.stats.total_seconds, 1e-9)


def tau(result: GenerationResult) -> float:
    """Mean tokens committed per target step (the bonus token included; 1.0 for AR)."""
    lengths = result.stats.acceptance_lengths
    return sum(lengths) / max(len(lengths), 1)


def method_budget(method: str) -> int | None:
    name = method.removeprefix("oracle-")
    return {"ar": 0, "chain": 0, "auto": None, "auto-in-step": None}.get(name, int(name.partition(":")[2] or 0))


def method_size_choice(method: str) -> str:
    return "in_step" if method.endswith("-in-step") else "ahead"


#: Top-2 logit gap (the AR reference's, at the first differing token) under which a float32 difference between a
#: tree verify and a one-token AR step counts as a near-tie flip, not a bug. On a GPU the verify of N rows and the AR
#: step run different GEMM kernels (cuBLAS picks them by shape), so their float32 logits differ in the last bits;
#: the first H100 run (benchmarks/gpu_h100) saw one such flip on a random-weight target, where top-2 gaps are small.
NEAR_TIE_GAP = 1e-3


def top2_gap(model: Any, prompt: list[int], reference: list[int], position: int) -> float:
    """The gap between the two largest logits the target gives the token at ``position`` of ``reference`` (one eager
    forward over the prompt and the tokens before it)."""
    ids = torch.tensor([prompt + reference[:position]], device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, -1].double()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def graphed_decoder(*args: Any, **kwargs: Any) -> GraphedDecoder:
    """A ``GraphedDecoder`` that prefills as it does on CUDA (``padded_prefill``), on a CPU too: the ``--tiny`` CPU
    run checks the arithmetic a GPU runs."""
    decoder = GraphedDecoder(*args, **kwargs)
    decoder.padded_prefill = True
    return decoder


def compare(got: GenerationResult, want: GenerationResult, what: str, exact: bool, figures: dict[str, Any],
            lengths: bool = True, sizes: bool = False, tie_gap: Callable[[int], float] | None = None) -> None:
    """Token ids (and acceptance lengths, tree sizes) equal; required when ``exact``, else reported.

    ``tie_gap`` (comparisons against AR or the eager runtime): the reference's top-2 logit gap at a position. A
    difference whose first token has a gap of at most ``NEAR_TIE_GAP`` is recorded as a near-tie flip
    (``near_tie_<what>``), not failed, whatever the two accepted after it."""
    same_ids = got.output_ids == want.output_ids
    same_lengths = not lengths or got.stats.acceptance_lengths == want.stats.acceptance_lengths
    same_sizes = not sizes or got.stats.tree_sizes == want.stats.tree_sizes
    figures[f"equal_{what}"] = same_ids and same_lengths and same_sizes
    if not same_ids:
        first = next((i for i, (a, b) in enumerate(zip(got.output_ids, want.output_ids)) if a != b),
                     min(len(got.output_ids), len(want.output_ids)))
        figures[f"first_difference_{what}"] = first
        if tie_gap is not None and first < len(want.output_ids):
            gap = figures[f"top2_gap_{what}"] = tie_gap(first)
            if exact and gap <= NEAR_TIE_GAP:  # after a flip, what each accepts differs too
                figures[f"near_tie_{what}"] = True
                return
    if exact and not figures[f"equal_{what}"]:
        raise Mismatch(f"differs from {what}: ids {same_ids}, acceptance lengths {same_lengths}, tree sizes "
                       f"{same_sizes} (got {got.output_ids[:12]}... tau {got.stats.acceptance_lengths[:12]}; want "
                       f"{want.output_ids[:12]}... tau {want.stats.acceptance_lengths[:12]})")


@dataclass
class Context:
    shape: Shape
    dtype: torch.dtype
    device: torch.device
    new_tokens: int
    model: Any = None
    drafter: Any = None
    prompt: list[int] = field(default_factory=list)
    buckets: tuple[int, ...] = POLICY_BUCKETS  # the cost-aware tree's sizes (fewer in --tiny: a shorter CI run)
    repeats: int = 5  # timed steps per figure of ms per stage
    ar: GenerationResult | None = None  # the eager runtime's AR: the reference output
    decoders: dict[str, GraphedDecoder] = field(default_factory=dict)
    results: dict[str, GenerationResult] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return self.dtype in (torch.float32, torch.float64)

    @property
    def tag(self) -> str:
        return f"{self.shape.name}/{str(self.dtype).removeprefix('torch.')}"

    def needs(self, *what: Any) -> None:
        if any(w is None for w in what):
            raise Skip("an earlier check of this target and dtype failed")


def drafter_for(ctx: Context, method: str, prompt: list[int], reference: list[int]) -> Any:
    if method == "ar":
        return None
    if method.startswith("oracle-"):
        return OracleDrafter(prompt + reference, ctx.drafter.config.block_size, int(ctx.model.config.vocab_size))
    return ctx.drafter


def check_method(report: Report, ctx: Context, method: str) -> None:
    """Capture, run graphed (twice: the second is timed), compare with the eager twin and the eager runtime."""
    tag, budget = f"{ctx.tag}/{method}", method_budget(method)
    decoder: GraphedDecoder | None = None
    captured = 0.0
    with report.check(f"{tag}/capture") as c:
        ctx.needs(ctx.model, ctx.ar)
        drafter = drafter_for(ctx, method, ctx.prompt, ctx.ar.output_ids)
        # Costs as timed at start-up, not refined by the runs: the eager twin below must make the same choices.
        decoder = graphed_decoder(ctx.model, drafter, budget=budget, policy_buckets=ctx.buckets, refine_costs=False,
                                 size_choice=method_size_choice(method))
        decoder.reserve(len(ctx.prompt), ctx.new_tokens)
        start = time.perf_counter()
        decoder.prepare()
        sync(ctx.device)
        c.figures.update(prepare_s=time.perf_counter() - start, capture_s=decoder.capture_seconds,
                         capture_mib=decoder.capture_bytes / 2**20, graphs=len(decoder._graphs) * len(decoder._stage_fns()),
                         sizes=list(decoder.sizes()), capacity=decoder.capacity,
                         windows=sorted({key[2] for key in decoder._graphs}))
        if decoder.policy is not None:
            c.figures["cost_ms"] = [1000 * v for v in decoder.policy.costs.tolist()]
        sets = len(decoder.sizes()) * len(decoder.windows_from(decoder._window_needed(1)))  # every size and window
        if decoder.use_graphs and len(decoder._graphs) != sets:
            raise Mismatch(f"{len(decoder._graphs)} graph sets for {len(decoder.sizes())} sizes and every window")
        captured = decoder.capture_seconds
        ctx.decoders[method] = decoder
    graphed: list[GenerationResult] = []
    with report.check(f"{tag}/graphed") as c:
        ctx.needs(decoder)
        graphed = [decoder.generate(ctx.prompt, ctx.new_tokens) for _ in range(2)]
        if decoder.capture_seconds != captured:  # prepare() captured every shape a request can reach
            raise Mismatch(f"a request captured graphs ({decoder.capture_seconds - captured:.2f} s) after prepare()")
        out = graphed[1]
        steps = max(out.stats.steps, 1)
        c.figures.update(tok_per_s=tok_per_s(out), tau=tau(out), steps=out.stats.steps,
                         prefill_ms=1000 * out.stats.stage_seconds.get("prefill", 0.0),
                         tree_sizes=sorted(set(out.stats.tree_sizes)),
                         stage_ms_per_step={k: 1000 * out.stats.stage_seconds.get(k, 0.0) / steps
                                            for k in STEP_STAGES})
        ctx.results[method] = out
        compare(out, ctx.ar, "eager_ar", ctx.exact, c.figures, lengths=False,
                tie_gap=lambda i: top2_gap(ctx.model, ctx.prompt, ctx.ar.output_ids, i))
    with report.check(f"{tag}/vs-eager-stages") as c:
        ctx.needs(decoder, graphed or None)
        costs = decoder.step_costs("greedy", 1) if decoder.policy is not None else None
        twin = graphed_decoder(ctx.model, drafter_for(ctx, method, ctx.prompt, ctx.ar.output_ids), budget=budget,
                              use_graphs=False, policy_buckets=ctx.buckets, policy_costs=costs,
                              size_choice=decoder.size_choice)
        for i in range(2):  # the same two requests: the policy learns the same things in the same order
            compare(graphed[i], twin.generate(ctx.prompt, ctx.new_tokens), f"eager_stages_{i}", ctx.exact, c.figures,
                    sizes=True)
    if method in ("ar", "chain", "ddtree:32"):
        with report.check(f"{tag}/vs-eager-runtime") as c:
            ctx.needs(graphed or None)
            eager = ctx.ar if method == "ar" else eager_run(ctx.model, ctx.drafter, ctx.prompt, ctx.new_tokens,
                                                             budget or 0)
            c.figures["eager_tok_per_s"] = tok_per_s(eager)
            c.figures["eager_prefill_ms"] = 1000 * eager.stats.stage_seconds.get("prefill", 0.0)
            # The graphed decoder prefills at a padded length on CUDA (other GEMM shapes): a float32 flip at a
            # near-tie is numerics there, recorded with its gap, as against AR.
            compare(graphed[1], eager, "eager_runtime", ctx.exact, c.figures,
                    tie_gap=lambda i, r=eager.output_ids: top2_gap(ctx.model, ctx.prompt, r, i))
    for size in decoder.sizes() if decoder is not None else ():
        with report.check(f"{tag}/stage-ms@{size}") as c:
            c.figures["ms"] = decoder.time_stages(size, ctx.repeats)


def check_ar_speed(report: Report, ctx: Context) -> None:
    with report.check(f"{ctx.tag}/ar-graphed-vs-eager") as c:
        ctx.needs(ctx.results.get("ar"), ctx.ar)
        eager = eager_run(ctx.model, None, ctx.prompt, ctx.new_tokens)  # warm: the reference run was the first
        graphed = tok_per_s(ctx.results["ar"])
        c.figures.update(graphed_tok_per_s=graphed, eager_tok_per_s=tok_per_s(eager),
                         speedup=graphed / max(tok_per_s(eager), 1e-9))


def policy_tables(decoder: GraphedDecoder) -> dict[str, torch.Tensor]:
    return decoder.policy.state()


def tables_equal(decoder: GraphedDecoder, tables: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, decoder.policy.state()[k]) for k, v in tables.items())


def check_recapture(report: Report, ctx: Context) -> None:
    """A second request at T=0.8 (new graphs and cost curve; the learned tables untouched), then a prompt longer
    than the static state (it grows and re-captures; the tables carry over), then prepare() after that growth."""
    decoder = ctx.decoders.get("auto")
    with report.check(f"{ctx.tag}/recapture-temperature") as c:
        ctx.needs(decoder, ctx.results.get("auto"))
        tables, graphs, captured = policy_tables(decoder), len(decoder._graphs), decoder.capture_seconds
        new_sets = len(decoder.sizes()) * len(decoder.windows_from(decoder._window_needed(1)))  # every window
        greedy_costs = decoder.policy.costs.tolist()
        decoder.prepare(SAMPLED)
        sync(ctx.device)
        c.figures.update(capture_s=decoder.capture_seconds - captured, greedy_cost_ms=[1000 * v for v in greedy_costs],
                         sampled_cost_ms=[1000 * v for v in decoder.policy.costs.tolist()])
        if not tables_equal(decoder, tables):
            raise Mismatch("re-preparing for T=0.8 changed the policy's learned tables")
        if decoder.use_graphs and len(decoder._graphs) != graphs + new_sets:
            raise Mismatch(f"{len(decoder._graphs) - graphs} new graph sets for {len(decoder.sizes())} sizes "
                           f"x {new_sets // len(decoder.sizes())} windows")
        out = decoder.generate(ctx.prompt, ctx.new_tokens, SAMPLED)
        c.figures.update(tau=tau(out), tok_per_s=tok_per_s(out))
        if len(out.output_ids) != ctx.new_tokens or not all(0 <= t < ctx.model.config.vocab_size for t in out.output_ids):
            raise Mismatch(f"a sampled request gave {len(out.output_ids)} tokens: {out.output_ids[:12]}")
        # Draws keyed by the seed and the token's index: the cost-aware tree samples eager AR's own tokens.
        compare(out, eager_run(ctx.model, None, ctx.prompt, ctx.new_tokens, sampling=SAMPLED), "ar_T0.8", ctx.exact,
                c.figures, lengths=False)
    ddtree = ctx.decoders.get("ddtree:32")
    with report.check(f"{ctx.tag}/sampled-vs-eager-stages") as c:
        ctx.needs(ddtree)
        twin = graphed_decoder(ctx.model, ctx.drafter, budget=32, use_graphs=False)
        compare(ddtree.generate(ctx.prompt, ctx.new_tokens, SAMPLED), twin.generate(ctx.prompt, ctx.new_tokens, SAMPLED),
                "eager_stages_T0.8", ctx.exact, c.figures)
    with report.check(f"{ctx.tag}/recapture-longer-prompt") as c:
        ctx.needs(decoder)
        longer = make_prompt(decoder.capacity + 40, int(ctx.model.config.vocab_size), seed=11)
        reference = eager_run(ctx.model, None, longer, ctx.new_tokens)
        tables, before, captured = policy_tables(decoder), decoder.capacity, decoder.capture_seconds
        decoder.reserve(len(longer), ctx.new_tokens)
        decoder.prepare(SamplingParams())
        if not tables_equal(decoder, tables):
            raise Mismatch("growing the static state changed (or reset) the policy's learned tables")
        out = decoder.generate(longer, ctx.new_tokens)
        c.figures.update(capacity=[before, decoder.capacity], capture_s=decoder.capture_seconds - captured,
                         tau=tau(out))
        compare(out, reference, "eager_ar", ctx.exact, c.figures, lengths=False,
                tie_gap=lambda i: top2_gap(ctx.model, longer, reference.output_ids, i))
    with report.check(f"{ctx.tag}/prepare-after-growth") as c:
        ctx.needs(decoder)
        decoder.prepare(SAMPLED)  # outside inference mode, on state allocated inside it
        decoder.generate(ctx.prompt, 4, SAMPLED)


def check_boundary(report: Report, ctx: Context, new: int) -> None:
    """DDTree 3 with the drafter's block (8 or 16), prompt + ``new`` tokens = 256 - 5 (the slots a state sized from the
    tree holds): 200 + 51, where it once broke; then a capture right after that request."""
    for kind in ("drafter", "oracle"):
        with report.check(f"{ctx.tag}/compaction-boundary-{kind}") as c:
            ctx.needs(ctx.model, ctx.drafter)
            prompt = make_prompt(CAPACITY_STEP - new - BOUNDARY_BUDGET - 2, int(ctx.model.config.vocab_size), seed=5)
            reference = eager_run(ctx.model, None, prompt, new)
            drafter = ctx.drafter if kind == "drafter" else OracleDrafter(
                prompt + reference.output_ids, ctx.drafter.config.block_size, int(ctx.model.config.vocab_size))
            decoder = graphed_decoder(ctx.model, drafter, budget=BOUNDARY_BUDGET)
            out = decoder.generate(prompt, new)
            sync(ctx.device)
            c.figures.update(prompt=len(prompt), new=new, block=decoder.path_width, capacity=decoder.capacity,
                             end=decoder.last_past,
                             max_accepted=max(out.stats.acceptance_lengths or [0]))
            # The same stages run eagerly must agree exactly (the graphs are what is under test here); against AR a
            # float32 flip at a near-tie is numerics (see NEAR_TIE_GAP), recorded with its gap.
            twin = graphed_decoder(ctx.model, drafter, budget=BOUNDARY_BUDGET, use_graphs=False)
            compare(out, twin.generate(prompt, new), "eager_stages", ctx.exact, c.figures, sizes=True)
            compare(out, reference, "eager_ar", ctx.exact, c.figures, lengths=False,
                    tie_gap=lambda i, p=prompt, r=reference.output_ids: top2_gap(ctx.model, p, r, i))
            decoder.prepare(SAMPLED)  # a capture whose warm-up follows a request that ended at the boundary
            sync(ctx.device)


#: Rows of the batch check, and the extra prompt lengths of its four prompts (beside the main prompt's).
BATCH_ROWS = 4
BATCH_EXTRA_LENGTHS = (37, 5, 90)


def check_batch(report: Report, ctx: Context, method: str) -> None:
    """Four prompts through four rows of one decoder (CUDA graphs per batch bucket), admitted one step apart."""
    tag, budget = f"{ctx.tag}/batch{BATCH_ROWS}-{method}", method_budget(method)
    with report.check(tag) as c:
        ctx.needs(ctx.model, ctx.drafter)
        vocab = int(ctx.model.config.vocab_size)
        prompts = [ctx.prompt] + [make_prompt(len(ctx.prompt) + extra, vocab, seed=30 + i)
                                  for i, extra in enumerate(BATCH_EXTRA_LENGTHS)]
        drafter = None if method == "ar" else ctx.drafter
        solo_decoder = graphed_decoder(ctx.model, drafter, budget=budget, policy_buckets=ctx.buckets)
        start = time.perf_counter()
        solo = [solo_decoder.generate(p, ctx.new_tokens) for p in prompts]
        sync(ctx.device)
        solo_s = time.perf_counter() - start
        decoder = graphed_decoder(ctx.model, drafter, budget=budget, batch=BATCH_ROWS, policy_buckets=ctx.buckets,
                                 refine_costs=False)  # the eager twin below must make the same choices
        decoder.prepare()
        first = decoder.generate_many(prompts, ctx.new_tokens)  # warm: every shape it needs is captured now
        captured = decoder.capture_seconds
        start = time.perf_counter()
        batched = decoder.generate_many(prompts, ctx.new_tokens)
        sync(ctx.device)
        batched_s = time.perf_counter() - start
        # Diagnostics of the timed run: captures it still made (none expected) and its longest row's steps (the
        # batch steps together); on the H200 this run took 5.7 s for 4 x 64 tokens of the cost-aware tree.
        c.figures.update(captured_in_timed_run_s=decoder.capture_seconds - captured,
                         timed_steps=max(b.stats.steps for b in batched))
        same = [b.output_ids == s.output_ids for b, s in zip(batched, solo)]
        c.figures.update(rows=len(prompts), equal_solo=sum(same), capture_s=decoder.capture_seconds,
                         graph_sets=len(decoder._graphs), shapes=sorted({k[:2] for k in decoder._graphs}),
                         tokens=sum(len(b.output_ids) for b in batched), batched_s=batched_s, solo_s=solo_s,
                         speedup_vs_one_by_one=solo_s / max(batched_s, 1e-9),
                         tree_sizes=sorted({n for b in batched for n in b.stats.tree_sizes}))
        costs = decoder.step_costs("greedy", BATCH_ROWS) if decoder.policy is not None else None
        twin = graphed_decoder(ctx.model, drafter, budget=budget, batch=BATCH_ROWS, use_graphs=False,
                              policy_buckets=ctx.buckets,
                              policy_costs=None if costs is None else (lambda b, n: decoder.step_costs("greedy", b)[
                                  decoder.sizes().index(n)]))
        # The same two runs in the same order: the policy learns the same things, so it chooses the same sizes.
        eager = [twin.generate_many(prompts, ctx.new_tokens) for _ in range(2)]
        c.figures["equal_eager_stages"] = all(
            [r.output_ids for r in e] == [r.output_ids for r in g]
            and [r.stats.tree_sizes for r in e] == [r.stats.tree_sizes for r in g]
            for e, g in zip(eager, (first, batched)))
        if ctx.exact and not c.figures["equal_eager_stages"]:
            raise Mismatch("the batched decoder's graphs give other tokens or tree sizes than its stages run eagerly")
        if ctx.exact and not all(same):
            raise Mismatch(f"batched rows differ from their solo runs (batch variance in {ctx.tag}?): {same}")


def run_target(report: Report, shape: Shape, dtype: torch.dtype, device: torch.device, args: argparse.Namespace,
               work: Path) -> None:
    ctx = Context(shape, dtype, device, args.max_new_tokens, repeats=args.repeats,
                  buckets=TINY_BUCKETS if args.tiny else POLICY_BUCKETS)
    with report.check(f"{ctx.tag}/setup") as c:
        start = time.perf_counter()
        ctx.model = build_target(shape, dtype, device)
        if shape.drafter_dir is not None:
            drafter_dir = shape.drafter_dir
        else:
            drafter_dir = random_drafter_dir(ctx.model, shape.drafter_block, work / f"{shape.name}-drafter")
        ctx.drafter = load_dflash_drafter(drafter_dir, dtype=dtype, device=device)
        ctx.drafter.config.validate_for_target(**target_dims(ctx.model))
        window, mixed = _sliding_window(ctx.model.config)
        ctx.prompt = make_prompt(args.prompt_len, int(ctx.model.config.vocab_size), seed=1)
        sync(device)
        c.figures.update(build_s=time.perf_counter() - start,
                         params_m=sum(p.numel() for p in ctx.model.parameters()) / 1e6,
                         sliding_window=window, mixed_layers=mixed, drafter=str(drafter_dir.name),
                         block=ctx.drafter.config.block_size)
    with report.check(f"{ctx.tag}/eager-ar") as c:
        ctx.needs(ctx.model)
        ctx.ar = eager_run(ctx.model, None, ctx.prompt, args.max_new_tokens)
        c.figures["tok_per_s"] = tok_per_s(ctx.ar)
    for method in args.methods:
        check_method(report, ctx, method)
    if "ar" in args.methods:
        check_ar_speed(report, ctx)
    if "auto" in args.methods and "ddtree:32" in args.methods:
        check_recapture(report, ctx)
    check_boundary(report, ctx, TINY_BOUNDARY_NEW if args.tiny else BOUNDARY_NEW)
    for method in ("ar", "ddtree:32", "auto"):
        if method in args.methods:
            check_batch(report, ctx, method)
    ctx.decoders.clear()
    ctx.model = ctx.drafter = None
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ shipped drafter


def check_shipped_drafter(report: Report, device: torch.device) -> None:
    """The shipped drafter loads with the project's loader and fits SmolLM2-135M's shape (also in --tiny)."""
    with report.check("shipped-drafter") as c:
        drafter = load_dflash_drafter(DEMO_DRAFTER_DIR, dtype=torch.float32, device=device)
        drafter.config.validate_for_target(hidden_size=SMOLLM2["hidden_size"], vocab_size=SMOLLM2["vocab_size"],
                                           num_hidden_layers=SMOLLM2["num_hidden_layers"],
                                           embedding_rows=SMOLLM2["vocab_size"])
        c.figures.update(block=drafter.config.block_size, layers=drafter.config.num_hidden_layers,
                         target_layer_ids=list(drafter.config.target_layer_ids))


# ------------------------------------------------------------------------------------------------ plugins


def check_plugins(report: Report, device: torch.device, mode: str, build: Path) -> Path | None:
    """Build the plugin library for this GPU with cmake into ``build`` and run its CUDA kernels on the GPU against the
    Python reference. Returns the CUDA library's path (None when none was built)."""
    library: Path | None = None
    with report.check("plugins/cmake") as c:
        missing = [what for what, ok in (("a CUDA device", device.type == "cuda"), ("nvcc", shutil.which("nvcc")),
                                         ("cmake", shutil.which("cmake"))) if not ok]
        if mode == "off" or (mode == "auto" and missing):
            raise Skip("--plugins off" if mode == "off" else f"missing here: {', '.join(missing)}")
        if missing:
            raise RuntimeError(f"--plugins on, but missing here: {', '.join(missing)}")
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"{major}{minor}"
        start = time.perf_counter()
        for command in (["cmake", "-S", str(REPO / "plugins"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                         f"-DDFLASH_CUDA_ARCHITECTURES={arch}", f"-DCMAKE_CUDA_ARCHITECTURES={arch}"],
                        ["cmake", "--build", str(build), "--target", "dflash_plugins_cpu", "dflash_plugins_cuda",
                         "-j", str(os.cpu_count() or 4)]):
            done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
        library = build / "libdflash_plugins_cuda.so"
        c.figures.update(build_s=time.perf_counter() - start, arch=arch)
    with report.check("plugins/kernels-on-gpu") as c:
        if library is None:
            raise Skip("no CUDA library was built")
        c.figures.update(run_plugin_kernels(library, device))
    return library


def check_plugin_tests(report: Report, library: Path | None) -> None:
    """``tests/test_plugins_*.py`` against the fresh build (last: the slowest plugin check, compiling every kernel)."""
    with report.check("plugins/tests") as c:
        if library is None:
            raise Skip("no library was built")
        build = library.parent
        if importlib.util.find_spec("pytest") is None:
            raise Skip("pytest is not installed (pip install pytest)")
        tests = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_plugins_*.py"))
        env = {**os.environ, "DFLASH_PLUGIN_LIB": str(build)}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=300, check=False)
        tail = (done.stdout + done.stderr).strip().splitlines()
        c.figures["result"] = tail[-1] if tail else ""
        if done.returncode != 0:
            c.figures["output_tail"] = "\n".join(tail[-40:])
            raise RuntimeError(f"pytest exited {done.returncode}: {c.figures['result']}")


# ------------------------------------------------------------------------------------------------ fused tree build


@contextlib.contextmanager
def fused_tree_mode(value: str) -> Iterator[None]:
    """``DFLASH_FUSED_TREE`` set to ``value`` for a while (read whenever a tree is built: at capture on CUDA)."""
    saved = os.environ.get(fused_tree.FUSED_TREE_ENV)
    os.environ[fused_tree.FUSED_TREE_ENV] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(fused_tree.FUSED_TREE_ENV, None)
        else:
            os.environ[fused_tree.FUSED_TREE_ENV] = saved


def random_marginals(rng: np.random.Generator, batch: int, depth: int, k: int, device: torch.device,
                     ties: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DDTree inputs: log-probabilities [batch, depth, k] sorted per depth (exact ties if ``ties``), tokens, roots."""
    if ties:
        lp = rng.choice(np.array([0.0, -0.5, -1.0, -2.0]), size=(batch, depth, k))
    else:
        lp = np.log(rng.dirichlet(np.full(k, 0.3), size=(batch, depth)) + 1e-300)
    lp = -np.sort(-lp, axis=-1)
    return (torch.tensor(lp, dtype=torch.float32, device=device),
            torch.tensor(rng.integers(0, 49152, size=(batch, depth, k)), device=device),
            torch.arange(batch, device=device))


def time_build(build: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """ms per call: replayed from a CUDA graph on CUDA (as the graphed runtime runs it), eager on a CPU."""
    build()
    if device.type == "cuda":
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            build()  # warm-up on a side stream, as torch's capture recipe asks
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            build()
        run = graph.replay
    else:
        run = build
    run()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    sync(device)
    return 1000 * (time.perf_counter() - start) / repeats


def check_fused_tree(report: Report, device: torch.device, args: argparse.Namespace, cuda_library: Path | None,
                     work: Path) -> None:
    """The fused DDTree build (``fused_tree``: the plugin library's one launch) on this device: bit for bit the tensor
    ops' tree on random marginals (ties, -inf, depth limits; batches of 1 to 16; budgets to 255), and the fused path
    values, the walk, prompt-lookup branches and their grafting, the select, the visibility mask and the learning step
    equal to the tensor ops'; both builds timed at the
    cost-aware pool's shape (63 nodes, 15 depths: in a CUDA graph on CUDA), and the default decoder with it decoding
    the same tokens, acceptance lengths and tree sizes as with the tensor ops, its tree-build and commit stages timed
    both ways.
    On CUDA it needs the library ``plugins/cmake`` built; on a CPU the CPU library (skipped where neither is, and with
    ``--plugins off``)."""
    where: str | None = None
    with report.check("fused-tree/equal") as c:
        if args.plugins == "off":
            raise Skip("--plugins off")
        if device.type == "cuda":
            if cuda_library is None:
                raise Skip("no CUDA plugin library was built (plugins/cmake)")
            os.environ[kernels.LIBRARY_ENV_VAR] = str(cuda_library.parent)
            fused_tree._cuda_library, fused_tree._cuda_searched = None, False  # look again, at the fresh build
        with fused_tree_mode("on"):
            try:
                where = fused_tree.backend(device)
            except DFlashInputError as err:
                raise (RuntimeError(str(err)) if device.type == "cuda" else Skip(str(err))) from None
        rng = np.random.default_rng(0)
        policy = DevicePolicy(16, POLICY_BUCKETS, device)
        trees = nodes = paths = branches = selected = 0
        learners = [DevicePolicy(16, POLICY_BUCKETS, device) for _ in range(2)]  # learning fused, and by tensor ops
        # Every fused call below names its implementation (fused=True/False); "on" lets the True ones run on CUDA.
        with fused_tree_mode("on"):
            for turn in range(48):
                batch = (1, 4, 16)[turn % 3]
                depth, k = int(rng.integers(1, 17)), int(rng.integers(1, 81))
                budget = (1, 7, 31, 63, 127, 255)[turn % 6]
                lp, tokens, roots = random_marginals(rng, batch, depth, k, device, ties=turn % 4 == 0)
                if turn % 5 == 0:
                    lp[:, :, int(rng.integers(1, k + 1)):] = float("-inf")  # a reduced draft vocabulary
                limit = torch.tensor(rng.integers(0, depth + 2, size=batch), device=device) if turn % 2 else None
                fused = fused_tree.build_ddtree_fused(roots, lp, tokens, budget, limit, where=where)
                ops = build_ddtree_device(roots, lp, tokens, budget, limit, fused=False)
                for name in ("tokens", "parents", "depths", "valid", "num_nodes", "scores"):
                    if not torch.equal(getattr(fused, name), getattr(ops, name)):
                        raise Mismatch(f"fused DDTree build: {name} differs from the tensor ops (turn {turn}, batch "
                                       f"{batch}, depth {depth}, k {k}, budget {budget})")
                # The cost-aware tree's path values on it (random conditionals): one pass against the depth rounds.
                cond = torch.where(ops.parents < 0, 1.0, torch.rand(ops.tokens.shape, dtype=torch.float64, device=device))
                candidates = Grafted(ops, cond, torch.zeros_like(ops.valid))
                with fused_tree_mode("on"):
                    one_pass = policy.path_values(candidates, depth, fused=True)
                if not torch.equal(one_pass, policy.path_values(candidates, depth, fused=False)):
                    raise Mismatch(f"fused path values differ from the depth rounds (turn {turn}, batch {batch})")
                # The walk, on choices that follow real paths (each parent's choice is one of its children's tokens).
                choices = torch.randint(0, 49152, ops.tokens.shape, device=device).scatter_(
                    1, ops.parents.clamp(min=0)[:, 1:], ops.tokens[:, 1:].clamp(min=0))
                for width in (depth + 1, budget + 1):
                    with fused_tree_mode("on"):
                        walked = walk_device(ops, choices, width, fused=True)
                    if not all(torch.equal(a, b) for a, b in zip(walked, walk_device(ops, choices, width, fused=False))):
                        raise Mismatch(f"the fused walk differs from the tensor ops (turn {turn}, width {width})")
                paths += int((walked[1] > 1).sum())
                # Lookup branches in a repetitive history (a view of a wider buffer), grafted into the pool.
                vocab = int(rng.integers(2, 9))
                buffer = torch.tensor(rng.integers(0, vocab, size=(batch, 300)), device=device)
                history, lengths = buffer[:, :256], torch.tensor(rng.integers(0, 257, size=batch), device=device)
                look = [lookup_device(history, lengths, 10, limit, 4, 1, 2, fused=f) for f in (True, False)]
                if not all(torch.equal(getattr(look[0], f), getattr(look[1], f)) for f in ("tokens", "lengths", "ngram")):
                    raise Mismatch(f"the fused lookup differs from the tensor ops (turn {turn})")
                # A pool over the same small vocabulary (distinct tokens per depth, as a DDTree's), so they share prefixes.
                ranks = min(k, vocab)
                draws = torch.argsort(torch.rand(batch, depth, vocab, device=device), dim=-1)[:, :, :ranks]
                pool = build_ddtree_device(roots, lp[:, :, :ranks], draws, budget, limit, fused=False)
                cond = policy.draft_conditional(pool)
                grafts = [graft_device(pool, cond, look[1], policy.lookup_conditional(look[1]), fused=f)
                          for f in (True, False)]
                same = all(torch.equal(getattr(grafts[0].tree, f), getattr(grafts[1].tree, f))
                           for f in ("tokens", "parents", "depths", "valid", "num_nodes", "scores"))
                if not (same and torch.equal(grafts[0].cond, grafts[1].cond)
                        and torch.equal(grafts[0].on_branch, grafts[1].on_branch)):
                    raise Mismatch(f"the fused graft differs from the tensor ops (turn {turn})")
                # The cost-aware tree's best nodes of those candidates, and the verifier's mask of both trees.
                values = policy.path_values(grafts[1], max(depth, 10), fused=False)
                for size in (1, 2, 16, 64):
                    size = min(size, grafts[1].tree.tokens.shape[1])
                    picks = [policy.select(grafts[1], values, size, fused=f) for f in (True, False)]
                    same = all(torch.equal(getattr(picks[0].tree, f), getattr(picks[1].tree, f))
                               for f in ("tokens", "parents", "depths", "valid", "num_nodes", "scores"))
                    if not (same and torch.equal(picks[0].cond, picks[1].cond)
                            and torch.equal(picks[0].on_branch, picks[1].on_branch)):
                        raise Mismatch(f"the fused select differs from the tensor ops (turn {turn}, size {size})")
                    for chosen in (grafts[1].tree, picks[1].tree):
                        masks = [visibility_device(chosen, fused=f) for f in (True, False)]
                        if not torch.equal(*masks):
                            raise Mismatch(f"the fused visibility differs from the tensor ops (turn {turn}, size {size})")
                    selected += int(picks[1].tree.num_nodes.sum())
                # Both policies learn from the last tree (choices that follow most edges); their tables must not part.
                chosen = picks[1].tree
                follow = torch.where(torch.rand(chosen.tokens[:, 1:].shape, device=device) < 0.6,
                                     chosen.tokens[:, 1:].clamp(min=0), 0)
                choices = torch.randint(0, vocab, chosen.tokens.shape, device=device).scatter_(
                    1, chosen.parents.clamp(min=0)[:, 1:], follow)
                live = torch.rand(batch, device=device) < 0.8
                for learner, f in zip(learners, (True, False)):
                    learner.learn(picks[1], choices, look[1].ngram, live, fused=f)
                if not all(torch.equal(getattr(learners[0], name), getattr(learners[1], name))
                           for name in DevicePolicy.LEARNED):
                    raise Mismatch(f"the fused learning step's tables differ from the tensor ops' (turn {turn})")
                branches += int((look[1].lengths > 0).sum())
                trees += batch
                nodes += int(ops.num_nodes.sum())
        c.figures.update(backend=where, trees=trees, nodes=nodes, accepted_paths=paths, lookup_branches=branches,
                         selected_nodes=selected, learned_trials=float(learners[1].trials.sum()))
    with report.check("fused-tree/ms") as c:
        if where is None:
            raise Skip("the fused build does not run here")
        repeats = 20 if args.tiny else 200
        for batch in (1, 16):
            lp, tokens, roots = random_marginals(np.random.default_rng(batch), batch, 15, 63, device)
            for name, fused in (("fused", True), ("ops", False)):
                with fused_tree_mode("on"):
                    c.figures[f"{name}_ms@{batch}"] = time_build(
                        lambda f=fused, r=roots, v=lp, t=tokens: build_ddtree_device(r, v, t, 63, fused=f), device,
                        repeats)
    with report.check("fused-tree/decoder") as c:
        if where is None:
            raise Skip("the fused build does not run here")
        shape = shapes(args.tiny)[0]
        model = build_target(shape, torch.float32, device)
        drafter_dir = shape.drafter_dir or random_drafter_dir(model, shape.drafter_block, work / "fused-drafter")
        drafter = load_dflash_drafter(drafter_dir, dtype=torch.float32, device=device)
        prompt = make_prompt(args.prompt_len, int(model.config.vocab_size), seed=1)
        buckets = TINY_BUCKETS if args.tiny else POLICY_BUCKETS
        results, costs = {}, None
        for mode in ("off", "on"):
            with fused_tree_mode(mode):
                # The same step costs for both (the first's, as timed): the sizes must not follow the build's speed.
                decoder = graphed_decoder(model, drafter, budget=None, policy_buckets=buckets, refine_costs=False,
                                          policy_costs=costs)
                decoder.reserve(len(prompt), args.max_new_tokens)
                decoder.prepare()
                costs = costs or decoder.step_costs("greedy", 1)
                results[mode] = [decoder.generate(prompt, args.max_new_tokens) for _ in range(2)]
                stages = decoder.time_stages(max(buckets), max(args.repeats, 3))
                c.figures[f"tree_build_ms_{mode}"] = stages["tree_build"]
                c.figures[f"commit_ms_{mode}"] = stages["commit"]  # the learning step's kernel is here
                c.figures[f"tok_per_s_{mode}"] = tok_per_s(results[mode][1])
        for i in range(2):
            compare(results["on"][i], results["off"][i], f"tensor_ops_{i}", True, c.figures, sizes=True)
        del model, drafter, decoder
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_plugin_kernels(library: Path, device: torch.device, trees: int = 64) -> dict[str, Any]:
    """DFlashTreeMask and DFlashKVCompact (linear) on the GPU, through the C ABI on torch tensors' device pointers,
    against tensorrt_llm_dflash.tree's reference (bit for bit)."""
    from tensorrt_llm_dflash import tree
    from tensorrt_llm_dflash.kernels import OK, _ErrorDetail

    lib = ctypes.CDLL(str(library))
    stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    rng = np.random.default_rng(0)
    ptr = ctypes.c_void_p
    masks = 0
    for _ in range(trees):
        batch, nodes = int(rng.integers(1, 5)), int(rng.integers(1, 65))
        max_nodes = nodes + int(rng.integers(0, 40))
        parents = np.full((batch, nodes), -1, dtype=np.int32)
        for b in range(batch):
            parents[b, 1:] = np.floor(rng.random(nodes - 1) * np.arange(1, nodes)).astype(np.int32)
        lengths = rng.integers(1, nodes + 1, size=batch).astype(np.int32)
        want = tree.batched_tree_inputs(parents, lengths, max_nodes)
        words = (max_nodes + 31) // 32
        p_dev, l_dev = torch.from_numpy(parents).to(device), torch.from_numpy(lengths).to(device)
        packed = torch.zeros(batch * nodes, words, dtype=torch.int32, device=device)
        offsets = torch.zeros(batch, max_nodes, dtype=torch.int32, device=device)
        lengths_out = torch.zeros(batch, dtype=torch.int32, device=device)
        detail = _ErrorDetail()
        code = lib.dflash_tree_mask_cuda(ptr(p_dev.data_ptr()), ptr(l_dev.data_ptr()), batch, nodes, max_nodes,
                                         ptr(packed.data_ptr()), ptr(offsets.data_ptr()), ptr(lengths_out.data_ptr()),
                                         stream, ctypes.byref(detail))
        if code != OK:
            raise RuntimeError(f"dflash_tree_mask_cuda returned {code} (detail {detail.value})")
        sync(device)
        for name, got, ref in zip(("packed_mask", "position_offsets", "generation_lengths"),
                                  (packed, offsets, lengths_out), want):
            if not np.array_equal(got.cpu().numpy(), ref):
                raise Mismatch(f"tree mask kernel: {name} differs from tree.batched_tree_inputs (batch {batch}, "
                               f"N {nodes}, M {max_nodes})")
        masks += 1
    compactions = 0
    for _ in range(trees):
        batch, layers, heads, seq, dim = int(rng.integers(1, 4)), 3, 2, 96, 16
        cache = [torch.randn(batch, 2, heads, seq, dim, device=device) for _ in range(layers)]
        before = [x.clone() for x in cache]
        past = rng.integers(0, seq - 33, size=batch).astype(np.int32)
        paths = [np.sort(np.concatenate([[0], rng.choice(np.arange(1, 32), int(rng.integers(0, 10)), replace=False)]))
                 for _ in range(batch)]
        width = max(len(p) for p in paths)
        accepted = np.zeros((batch, width), dtype=np.int32)
        for b, p in enumerate(paths):
            accepted[b, : len(p)] = p
        counts = np.array([len(p) for p in paths], dtype=np.int32)
        layer_ptrs = (ctypes.c_void_p * layers)(*[x.data_ptr() for x in cache])
        past_dev, acc_dev, cnt_dev = (torch.from_numpy(a).to(device) for a in (past, accepted, counts))
        detail = _ErrorDetail()
        code = lib.dflash_kv_compact_linear_cuda(layer_ptrs, layers, batch, heads, seq, dim * 4,
                                                 ptr(past_dev.data_ptr()), ptr(acc_dev.data_ptr()), width,
                                                 ptr(cnt_dev.data_ptr()), stream, ctypes.byref(detail))
        if code != OK:
            raise RuntimeError(f"dflash_kv_compact_linear_cuda returned {code} (detail {detail.value})")
        sync(device)
        for layer in range(layers):
            want = before[layer].clone()
            for b in range(batch):
                source = torch.as_tensor(past[b] + paths[b], device=device)
                want[b, :, :, past[b]: past[b] + len(paths[b])] = before[layer][b][:, :, source]
            if not torch.equal(cache[layer], want):
                raise Mismatch(f"KV compaction kernel: layer {layer} differs from the reference (batch {batch})")
        compactions += 1
    return {"tree_masks": masks, "compactions": compactions}


# ------------------------------------------------------------------------------------------------ main


#: The largest figures accepted on the command line (a GPU run's time is short; the target's limit applies too).
MAX_NEW_TOKENS, MAX_PROMPT_LEN, MAX_REPEATS = 1 << 16, 1 << 16, 10_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=cli.device, default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu, cuda or cuda:N (default: cuda where torch sees one)")
    ap.add_argument("--tiny", action="store_true", help="tiny random targets and drafters (the CPU test's sizes)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    ap.add_argument("--targets", nargs="+", default=None, help="target shapes to run (default: both)")
    # None, not 0, stands for the default: a 0 given is refused by its range, never turned into the default.
    ap.add_argument("--max_new_tokens", type=cli.integer(2, MAX_NEW_TOKENS), default=None,
                    help="tokens per request (default 64; --tiny 8)")
    ap.add_argument("--prompt_len", type=cli.integer(2, MAX_PROMPT_LEN), default=None,
                    help="prompt tokens (default 96; --tiny 24)")
    ap.add_argument("--repeats", type=cli.integer(1, MAX_REPEATS), default=None,
                    help="timed steps per ms-per-stage figure (default 5; --tiny 1)")
    ap.add_argument("--plugins", choices=["auto", "on", "off"], default="auto",
                    help="build and check the plugin library (auto: when CUDA, nvcc and cmake are there)")
    ap.add_argument("--plugins_dir", type=cli.output_dir, default=None,
                    help="build the plugin library here and keep it (default: a scratch folder, removed at the end); "
                         "point DFLASH_PLUGIN_LIB at it to run the runtime with it afterwards")
    ap.add_argument("--threads", type=cli.threads, default=None,
                    help="torch CPU threads (default: torch's; --tiny on a CPU: 1, faster for tiny models)")
    ap.add_argument("--out", type=cli.output_dir, default="gpu_check_out",
                    help="directory for the JSON file and scratch files")
    ap.add_argument("--json", default=None, help="the JSON file (default <--out>/gpu_check.json)")
    args = ap.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 8 if args.tiny else 64
    if args.prompt_len is None:
        args.prompt_len = 24 if args.tiny else 96
    if args.repeats is None:
        args.repeats = 1 if args.tiny else 5
    if args.threads is None and args.tiny and args.device == "cpu":
        args.threads = 1
    if args.json is not None:
        # Its directory is created (as the default's, under --out): checked like a directory that may not exist yet.
        if Path(args.json).is_dir():
            cli.refuse(ap, "--json", f"{args.json!r} is a directory")
        try:
            cli.output_dir(str(Path(args.json).parent))
        except argparse.ArgumentTypeError as err:
            cli.refuse(ap, "--json", f"its directory: {err}")
    names = [s.name for s in shapes(args.tiny)]
    args.targets = args.targets or names
    unknown = [t for t in args.targets if t not in names]
    if unknown:
        cli.refuse(ap, "--targets", f"unknown {unknown} (here: {names})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else out / "gpu_check.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    import transformers

    meta = {"command": " ".join(["python", "examples/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__,
            "cuda": torch.version.cuda, "tiny": args.tiny, "dtypes": args.dtypes, "methods": args.methods,
            "max_new_tokens": args.max_new_tokens, "prompt_len": args.prompt_len, "threads": torch.get_num_threads()}
    report = Report(json_path, meta)
    print(f"gpu_check: {meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}, "
          f"numpy {meta['numpy']}{', tiny' if args.tiny else ''}", flush=True)
    check_shipped_drafter(report, device)
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        for shape in shapes(args.tiny):
            if shape.name not in args.targets:
                continue
            for dtype_name in args.dtypes:
                run_target(report, shape, getattr(torch, dtype_name), device, args, Path(scratch))
        build = Path(args.plugins_dir) if args.plugins_dir else Path(scratch) / "plugins-build"
        cuda_library = check_plugins(report, device, args.plugins, build)
        check_fused_tree(report, device, args, cuda_library, Path(scratch))
        check_plugin_tests(report, cuda_library)
    report.write(complete=True)
    failed = report.failed()
    skipped = sum(c.status == "skip" for c in report.checks)
    print(f"gpu_check: {len(report.checks)} checks, {len(failed)} failed, {skipped} skipped, "
          f"{time.perf_counter() - report.start:.1f} s; wrote {json_path}", flush=True)
    for name in failed:
        print(f"FAILED {name}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
