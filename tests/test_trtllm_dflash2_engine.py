"""The DFlash2 drafter in the TensorRT-LLM engine, executed through the stand-in (issue 38, item 5).

A DFlash2 drafter (grouped dynamic convolutions around every sublayer, the candidate selector;
docs/dflash2.md) is converted with the DFlash target into one ``DFlashForCausalLM`` checkpoint,
built by the project's ``trtllm-build`` entry point and driven by ``DFlashEngineTarget`` with
``decode.speculative_generate``, and compared with the PyTorch runtime (``tensorrt_llm_dflash.dflash2``,
float64) on the same (bf16/fp16-rounded) weights, in the stand-in's exact numerics:

* tokens, per-step acceptance and tree sizes equal, chain and DFlash2 trees, Qwen3 (bf16) and
  Llama (fp16) targets, with drafters in both published layouts; every step's selector tables (candidates, and the score of every
  candidate after every predecessor a chain or tree can reach) equal the PyTorch draft's, and the
  chain the engine walked in-graph is the selector's greedy walk over them;
* the Qwen3 drafter's layers slide a window of 6 tokens, which binds in every run; an engine
  without the window mask drafts differently (so the comparison sees it), for DFlash drafters too;
* T > 0: with top_k 1 the sampled chain's draws and rejection sampling follow the PyTorch
  runtime's token for token; at T = 1 the engine's draft after a root it did not draft from is
  a valid proposal (chi-square on the first committed token);
* faithful numerics (declared bf16): the in-graph walks agree with the host's and the output
  follows the bf16 rule against the engine's own greedy decoding;
* refusals by name: a ``selector_top_k`` above the engine's limit at conversion and at build
  time, malformed ``dflash.dflash2`` sections, a network built without the build entry point;
* the documented flow on the engine demo pair (``demo_pair --dflash2``): convert_checkpoint.py,
  trtllm-build, run.py --engine_dir equal run.py with the PyTorch runtime.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import standin
import torch
from engine_case import ENGINE_DTYPE, MAX_DRAFT_LEN, MAX_NEW, PROMPTS, build_argv, make_target, round_to
from test_sampling import chi2_threshold, chi_square
from tiny_models import tiny_dflash2_config

from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.dflash2 import DFlash2Config, DFlash2DraftModel, DFlash2Proposer, save_dflash2_drafter
from tensorrt_llm_dflash.dflash2.selector import SelectorDraft
from tensorrt_llm_dflash.errors import DFlashConfigError, DFlashInputError
from tensorrt_llm_dflash.sampling import SamplingParams
from tensorrt_llm_dflash.target import HFTargetVerifier
from tensorrt_llm_dflash.tree import build_chain

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 4
WINDOW = 6  # >= the block (DFlash2's rule), < every sequence below: the window binds
BUDGETS = [0, 1, 8, MAX_DRAFT_LEN]
#: The Qwen3 engine's drafter: z-lab's nested layout (Muse-Glimmer-30B-DFlash2) with sliding layers
#: and every scalar in use, float32-exact (the engine holds its scalars in float32), 3 taps.
SETTINGS = {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 16,
            "output_multiplier": 0.75, "final_logit_softcapping": 20.0, "input_embedding_scale": 1.5}
#: The Llama engine's: the flat layout (Qwen3.8-27B-DFlash2 style: top-level block_size and
#: rope_theta, full attention), no multiplier, no soft cap, no embedding scale, the published 2 taps.
FLAT_SETTINGS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 16}
DRAFTERS = {"qwen3": ("nested", SETTINGS), "llama": ("flat", FLAT_SETTINGS)}
#: Drafter seeds picked (among 0..5) so that some step of the cases below accepts two draft tokens:
#: random drafters rarely do, and a comparison of one-token steps proves little about the trees.
DRAFTER_SEED = {"qwen3": 0, "llama": 3}


# ----------------------------------------------------------------------------- models


def dflash2_drafter(target, arch: str, *, seed: int = 0, window: int = WINDOW, **overrides) -> DFlash2DraftModel:
    """A random float64 DFlash2 drafter for ``target`` (2 layers; ``DRAFTERS[arch]``: layout and
    settings; nested layouts slide a window of ``window``), its weights rounded to the engine dtype;
    convolutions near the identity, and codebooks of std 0.3, small enough that the tiny targets
    accept several draft tokens in some steps (with std 1 no step accepts two)."""
    layout, settings = DRAFTERS[arch]
    raw = tiny_dflash2_config(target, block_size=BLOCK_SIZE, layers=2, layout=layout, **{**settings, **overrides})
    if layout == "nested":
        raw["sliding_window"] = window
    torch.manual_seed(3000 + seed)
    model = DFlash2DraftModel(DFlash2Config.from_dict(raw)).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("base_kernel"):
                p.normal_(0, 0.2)
                p[:, 0] += 1.0
            elif "codebook" in name:
                p.normal_(0, 0.3)
            elif p.dim() > 1:
                p.normal_(0, 0.2)
            else:
                p.uniform_(0.5, 1.5)
    return round_to(model, ENGINE_DTYPE[arch]).eval()


def write_checkpoint(tmp: Path, arch: str, *, tp: int = 1, vocab: int = 32, **overrides):
    """(target, drafter, checkpoint dir): a target and a DFlash2 drafter saved and converted."""
    from tensorrt_llm_dflash.trtllm.weight import convert_checkpoint

    target = make_target(arch, vocab=vocab, heads=2, kv_heads=2 if tp == 2 else 1)
    drafter = dflash2_drafter(target, arch, **{"seed": DRAFTER_SEED[arch], **overrides})
    target.save_pretrained(tmp / "target", safe_serialization=True)
    save_dflash2_drafter(drafter, tmp / "drafter", dtype=torch.float64)
    convert_checkpoint(tmp / "target", tmp / "drafter", tmp / "ckpt", dtype=ENGINE_DTYPE[arch], tp_size=tp,
                       max_draft_len=MAX_DRAFT_LEN, progress=False)
    return target, drafter, tmp / "ckpt"


def build_engine(tmp: Path, ckpt: Path, **kwargs) -> Path:
    from tensorrt_llm_dflash.trtllm import build

    engine = tmp / "engine"
    assert build.main(build_argv(ckpt, engine, **kwargs)) == 0
    return engine


class Recorder:
    """A proposer that keeps every (root, draft) it hands to the decode loop."""

    def __init__(self, inner) -> None:
        self.inner, self.block_size, self.drafts = inner, inner.block_size, []

    def reset(self) -> None:
        self.inner.reset()
        self.drafts = []

    def propose(self, root: int, context):
        draft = self.inner.propose(root, context)
        self.drafts.append((root, draft))
        return draft


def pytorch_run(target, drafter, prompt, budget, sampling=None, max_new=MAX_NEW):
    proposer = Recorder(DFlash2Proposer.for_target(drafter, target))
    verifier = HFTargetVerifier(target, drafter.config.target_layer_ids)
    result = speculative_generate(verifier, proposer, prompt, max_new, sampling=sampling, ddtree_budget=budget)
    return result, proposer.drafts


def engine_run(engine_dir: Path, prompt, budget, sampling=None, max_new=MAX_NEW):
    from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget, EngineProposer

    engine = DFlashEngineTarget(engine_dir, device="cpu")
    proposer = Recorder(EngineProposer(engine))
    assert proposer.inner.selects_tokens == (engine.dflash2 is not None)
    result = speculative_generate(engine, proposer, prompt, max_new, sampling=sampling, ddtree_budget=budget)
    return result, proposer.drafts, engine


#: Scores agree to ~5e-6 in exact numerics, not to float64 rounding: the target's RoPE in the engine
#: reads TensorRT-LLM's float32 cos/sin table (the attention plugin's ``rotary_cos_sin``), so the
#: features the drafter reads already differ by ~1e-6 (the DFlash engine's target logits and block
#: logits do too). A wrong convolution or selector term is off by O(1).
SCORE_ATOL = 1e-4


def assert_same_drafts(engine_drafts, torch_drafts, atol: float = SCORE_ATOL) -> None:
    """Step by step: the same root and candidates, the same score for every candidate after every
    predecessor a chain or tree can reach, and the in-graph chain = the selector's greedy walk
    over the engine's tables = the PyTorch runtime's chain."""
    assert len(engine_drafts) == len(torch_drafts) > 0
    for step, ((root, got), (torch_root, expected)) in enumerate(zip(engine_drafts, torch_drafts)):
        assert root == torch_root == got.root, step
        assert torch.equal(got.tokens.cpu(), expected.tokens.cpu()), step
        for depth in range(got.depth):
            for predecessor in [root] if depth == 0 else expected.tokens[depth - 1].tolist():
                torch.testing.assert_close(got.scores(depth, predecessor).double().cpu(),
                                           expected.scores(depth, predecessor).double().cpu(), rtol=0, atol=atol)
        walked = SelectorDraft.chain(got, root, got.depth).tokens.tolist()
        assert walked == [root, *got.chain_tokens.tolist()], step
        assert walked == expected.chain(root, expected.depth).tokens.tolist(), step


def assert_walks_agree(engine) -> None:
    assert engine.walk_log
    for step, (graph_count, graph_bonus, host_count, host_bonus) in enumerate(engine.walk_log):
        assert (graph_count, graph_bonus) == (host_count, host_bonus), step
    assert engine.mismatched_drafts == 0


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A Qwen3 (bf16) and a Llama (fp16) engine with DFlash2 drafters, built once for the module."""
    built = {}
    root = tmp_path_factory.mktemp("dflash2_engines")
    with standin.active(root / "lib"):
        for arch in ("qwen3", "llama"):
            target, drafter, ckpt = write_checkpoint(root / arch, arch)
            built[arch] = (target, drafter, ckpt, build_engine(root / arch, ckpt))
    return root, built


# ------------------------------------------------------------------------ conversion


def test_converted_checkpoint_carries_the_dflash2_section_and_tensors(engines):
    from safetensors.torch import load_file

    _, built = engines
    _, drafter, ckpt, _ = built["qwen3"]
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architecture"] == "DFlashForCausalLM"
    assert config["dflash"]["dflash2"] == SETTINGS
    assert config["dflash"]["sliding_window"] == WINDOW
    assert config["dflash"]["layer_types"] == ["sliding_attention"] * 2
    tensors = load_file(str(ckpt / "rank0.safetensors"))
    state = drafter.state_dict()
    for name in ("layers.1.mlp_conv.base_kernel", "layers.0.attention_conv.kernel_projection.weight",
                 "candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
                 "candidate_selector.successor_codebook"):
        assert torch.equal(tensors["dflash." + name].double(), state[name]), name


# ------------------------------------------------------------------ engine == PyTorch


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_equals_pytorch_runtime_chain_and_trees(engines, arch):
    """Both published layouts: Qwen3 with the nested one (sliding window, soft cap, multiplier,
    embedding scale, 3 taps), Llama with the flat one (full attention, none of the three, 2 taps)."""
    root, built = engines
    target, drafter, ckpt, engine_dir = built[arch]
    # Qwen3: sliding layers whose window (6) every draft's context outgrows (prompts of 3 to 12
    # tokens, blocks of 4, 20 new tokens); Llama: full attention.
    section = json.loads((ckpt / "config.json").read_text())["dflash"]
    assert section["layer_types"] == (["sliding_attention"] * 2 if arch == "qwen3" else ["full_attention"] * 2)
    longest, steps = 0, 0
    with standin.active(root / "lib"):
        for prompt in PROMPTS:
            for budget in BUDGETS:
                got, engine_drafts, engine = engine_run(engine_dir, prompt, budget)
                expected, torch_drafts = pytorch_run(target, drafter, prompt, budget)
                assert got.output_ids == expected.output_ids, (arch, prompt, budget)
                assert got.stats.acceptance_lengths == expected.stats.acceptance_lengths, (arch, prompt, budget)
                assert got.stats.tree_sizes == expected.stats.tree_sizes, (arch, prompt, budget)
                assert_walks_agree(engine)
                assert_same_drafts(engine_drafts, torch_drafts)
                longest = max(longest, max(got.stats.acceptance_lengths))
                steps += len(engine_drafts)
    assert longest >= 3, "the cases must accept several tokens in a step, or the comparison proves little"
    assert steps > 100


def test_an_engine_without_the_window_mask_drafts_differently(tmp_path, monkeypatch, engines):
    """The same checkpoint built with the sliding-window mask left out: the drafter then attends to
    keys beyond its window and its selector tables leave the PyTorch runtime's by far more than
    rounding (so the comparison above sees the window), while the target's tokens, which do not
    depend on the draft, stay the same."""
    _, built = engines
    target, drafter, ckpt, _ = built["qwen3"]
    with standin.active(tmp_path / "lib"):
        from tensorrt_llm_dflash.trtllm import model

        monkeypatch.setattr(model, "sliding_window", lambda sub, layer: None)
        engine_dir = build_engine(tmp_path, ckpt)
        got, engine_drafts, _ = engine_run(engine_dir, PROMPTS[2], 0)
    expected, torch_drafts = pytorch_run(target, drafter, PROMPTS[2], 0)
    assert got.output_ids == expected.output_ids
    with pytest.raises(AssertionError):
        assert_same_drafts(engine_drafts, torch_drafts)
    # 12 prompt tokens and a block of 4 already span more than the window at the first draft.
    gaps = [float((e.unary - t.unary).abs().max()) for (_, e), (_, t) in zip(engine_drafts, torch_drafts)]
    assert min(gaps) > 1e-3, gaps


def test_a_dflash_drafter_with_a_binding_window_equals_the_pytorch_runtime(tmp_path, monkeypatch):
    """The window mask is the DFlash engine's too: a DFlash drafter with one sliding-window layer
    (window 6) and one full-attention layer drafts the PyTorch runtime's block logits at every step
    (before the mask, a DFlash engine attended to the whole context in every layer), and without
    the mask it does not."""
    from engine_case import make_target as dflash_target
    from engine_case import pytorch_run as dflash_run
    from test_trtllm_convert import make_drafter

    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.proposer import DFlashProposer
    from tensorrt_llm_dflash.trtllm.weight import convert_checkpoint

    target = dflash_target("qwen3")
    drafter = round_to(make_drafter(target, layers=2, block_size=BLOCK_SIZE, head_dim=16, sliding_window=WINDOW,
                                    layer_types=["sliding_attention", "full_attention"]).double(), "bfloat16")
    target.save_pretrained(tmp_path / "target", safe_serialization=True)
    save_dflash_drafter(drafter, tmp_path / "drafter", dtype=torch.float64)
    convert_checkpoint(tmp_path / "target", tmp_path / "drafter", tmp_path / "ckpt", dtype="bfloat16",
                       max_draft_len=MAX_DRAFT_LEN, progress=False)
    reference = Recorder(DFlashProposer.for_target(drafter, target))
    verifier = HFTargetVerifier(target, drafter.config.target_layer_ids)
    expected = speculative_generate(verifier, reference, PROMPTS[0], MAX_NEW, ddtree_budget=8)
    assert expected.output_ids == dflash_run(target, drafter, PROMPTS[0], 8).output_ids
    gaps = {}
    for masked in (True, False):
        with standin.active(tmp_path / "lib"), monkeypatch.context() as patch:
            from tensorrt_llm_dflash.trtllm import model

            if not masked:
                patch.setattr(model, "sliding_window", lambda sub, layer: None)
            engine_dir = build_engine(tmp_path / str(masked), tmp_path / "ckpt")
            got, drafts, engine = engine_run(engine_dir, PROMPTS[0], 8)
        assert got.output_ids == expected.output_ids and engine.dflash2 is None
        if masked:  # the same drafts, so the same trees and acceptance, step by step
            assert [r for r, _ in drafts] == [r for r, _ in reference.drafts]
            assert got.stats.acceptance_lengths == expected.stats.acceptance_lengths
        # The first draft (7 prompt tokens, block at positions 7..10) already reaches past the window.
        gaps[masked] = [float((d.double() - e.double()).abs().max()) for (_, d), (_, e) in
                        zip(drafts, reference.drafts)][: None if masked else 1]
    assert max(gaps[True]) < SCORE_ATOL and gaps[False][0] > 1e-3, gaps


# ------------------------------------------------------------------------------ T > 0


def test_sampled_chain_follows_the_pytorch_runtime_with_top_k_1(engines):
    """T = 0.8 with top_k 1: the target's distribution is one-hot, so the sampled root is the
    engine's greedy bonus and its tables are the PyTorch draft's; the chain is then drawn from the
    selector's sparse q (0.8) and accepted by rejection sampling in both runtimes with the same
    generator draws: the same tokens and acceptance, chain and tree."""
    root, built = engines
    target, drafter, _, engine_dir = built["qwen3"]
    with standin.active(root / "lib"):
        for budget in (0, 8):
            sampling = SamplingParams(temperature=0.8, top_k=1, seed=11)
            got, engine_drafts, engine = engine_run(engine_dir, PROMPTS[0], budget, sampling=sampling)
            expected, torch_drafts = pytorch_run(target, drafter, PROMPTS[0], budget, sampling=sampling)
            assert got.output_ids == expected.output_ids, budget
            assert got.stats.acceptance_lengths == expected.stats.acceptance_lengths, budget
            assert engine.mismatched_drafts == 0
            if budget == 0:  # the chain was sampled (the q rows kept for the acceptance), not walked
                assert all(d.sampled_q is not None for _, d in engine_drafts)


def test_a_draft_after_another_root_is_a_valid_proposal(engines):
    """At T > 0 the host samples a root the engine did not draft from: the engine's draft (its first
    step scored after the engine's own root) is still what the chain is drawn from and accepted
    against, so the first committed token follows the target's distribution (chi-square), and an
    engine run at T = 1 decodes through such steps."""
    root, built = engines
    _, _, _, engine_dir = built["qwen3"]
    with standin.active(root / "lib"):
        got, drafts, engine = engine_run(engine_dir, PROMPTS[1], 0, sampling=SamplingParams(temperature=1.0, seed=3))
    assert len(got.output_ids) == MAX_NEW and engine.mismatched_drafts > 0
    draft = next(d for r, d in drafts if r != d.root)
    other_root = next(r for r, d in drafts if r != d.root)
    vocab, depth = int(draft.tokens.max()) + 1, draft.depth
    generator = torch.Generator().manual_seed(0)
    node_logits = torch.randn(depth + 1, max(vocab, 32), generator=generator, dtype=torch.float64) * 2
    sampling = SamplingParams(temperature=1.0)
    target_p = torch.softmax(node_logits[0], -1).numpy()
    counts = np.zeros(node_logits.shape[1], dtype=np.int64)
    for _ in range(3000):
        tree = draft.build_tree(other_root, 0, depth, sampling, generator)
        path, bonus = draft.accept(tree, node_logits[: tree.num_nodes], sampling, generator)
        counts[int(tree.tokens[1]) if len(path) > 1 else bonus] += 1
    stat, df = chi_square(counts, target_p)
    assert stat < chi2_threshold(df), (stat, df)


def test_engine_draft_scores_only_the_predecessors_it_tabled(engines):
    root, built = engines
    with standin.active(root / "lib"):
        _, drafts, _ = engine_run(built["llama"][3], PROMPTS[1], 0, max_new=2)
    draft = drafts[0][1]
    outsider = next(t for t in range(32) if t not in draft.tokens[0].tolist())
    with pytest.raises(DFlashInputError, match=f"token {outsider} is not a depth-1 candidate"):
        draft.scores(1, outsider)
    assert "EngineSelectorDraft(depth=3, top_k=16" in repr(draft)


# ----------------------------------------------------------------------------- faithful


def test_faithful_numerics_walks_agree_and_output_is_the_engines_greedy(tmp_path):
    """Declared dtypes (bf16 weights, float32 selector tables): the in-graph target walk and the
    in-graph selector chain agree with the host's walks over the same outputs, and the output is
    the same engine's one-token-per-step greedy decoding, except that a first difference, if any, is
    at a near-tie of that greedy step (the bf16 rule, docs/trtllm_engine.md "Exactness")."""
    from engine_case import assert_bf16_rule, greedy_with_gaps

    with standin.active(tmp_path / "lib", numerics="faithful"):
        from tensorrt_llm_dflash.trtllm.runner import DFlashEngineTarget

        _, _, ckpt = write_checkpoint(tmp_path, "qwen3")
        engine_dir = build_engine(tmp_path, ckpt)
        greedy = greedy_with_gaps(DFlashEngineTarget(engine_dir, device="cpu"), PROMPTS[0])
        for budget in (0, 8):
            got, drafts, engine = engine_run(engine_dir, PROMPTS[0], budget)
            assert_bf16_rule(got.output_ids, greedy)  # equal, except a first difference at a near-tie
            assert_walks_agree(engine)
            for root, draft in drafts:
                assert draft.unary.dtype == torch.float32 and draft.edges.dtype == torch.float32
                assert SelectorDraft.chain(draft, root, draft.depth).tokens[1:].tolist() == \
                    draft.chain_tokens.tolist()


@pytest.mark.slow
def test_tp2_engine_equals_pytorch_runtime(tmp_path):
    """Tensor parallelism 2 (two spawn build workers, two rank processes over gloo, as in
    test_trtllm_engine_emulated.py): the convolution and selector tensors are replicated, the
    logits gathered, and a vocabulary of 33 is padded to 34, a column the selector must never
    pick. Tokens, acceptance and the in-graph walks equal the PyTorch runtime's, chain and tree."""
    import subprocess

    from test_trtllm_engine_emulated import TP_DRIVER, _free_port

    with standin.active(tmp_path / "lib") as env:
        target, drafter, ckpt = write_checkpoint(tmp_path, "qwen3", tp=2, vocab=33)
        assert json.loads((ckpt / "config.json").read_text())["mapping"]["tp_size"] == 2
        engine_dir = build_engine(tmp_path, ckpt, workers=2)
        out, budgets = tmp_path / "tp2.json", [0, 8]
        code = TP_DRIVER.format(paths=[str(ROOT), str(ROOT / "tests")], engine=str(engine_dir), prompts=PROMPTS[:2],
                                budgets=budgets, max_new=MAX_NEW, out=str(out))
        port = str(_free_port())
        procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env={**env, "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
                                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                                  "OMP_NUM_THREADS": "1"}) for rank in range(2)]
        logs = [proc.communicate(timeout=600)[0] for proc in procs]
        assert all(proc.returncode == 0 for proc in procs), "\n".join(log[-3000:] for log in logs)
    runs = iter(json.loads(out.read_text()))
    for prompt in PROMPTS[:2]:
        for budget in budgets:
            expected, _ = pytorch_run(target, drafter, prompt, budget)
            output_ids, acceptance, walk_log = next(runs)
            assert output_ids == expected.output_ids, (prompt, budget)
            assert acceptance == expected.stats.acceptance_lengths, (prompt, budget)
            assert walk_log and all(tuple(step[:2]) == tuple(step[2:]) for step in walk_log), (prompt, budget)


# ----------------------------------------------------------------------------- refusals


def test_convert_refuses_a_top_k_beyond_the_engine_in_one_line(tmp_path, capsys):
    """selector_top_k 65 (the PyTorch runtime runs it): examples/convert_checkpoint.py exits 2 with
    one line naming the drafter's field, its value and the engine's limit, before any weight is read."""
    sys.path.insert(0, str(ROOT / "examples"))
    import convert_checkpoint

    target = make_target("qwen3", vocab=80)
    drafter = dflash2_drafter(target, "qwen3", selector_top_k=65)
    target.save_pretrained(tmp_path / "target", safe_serialization=True)
    save_dflash2_drafter(drafter, tmp_path / "drafter", dtype=torch.float64)
    (tmp_path / "drafter" / "model.safetensors").write_bytes(b"not read")  # the refusal comes first
    capsys.readouterr()  # transformers 5 reports saving the target on stderr
    code = convert_checkpoint.main(["--model_dir", str(tmp_path / "target"), "--dflash_model_dir",
                                    str(tmp_path / "drafter"), "--output_dir", str(tmp_path / "ckpt"),
                                    "--dtype", "bfloat16", "--no_progress"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "dflash_config.selector_top_k=65 is not supported by the engine" in lines[0]
    assert "at most 64" in lines[0]
    assert not (tmp_path / "ckpt").exists()


BAD_SECTIONS = [
    ({"selector_top_k": 65}, "dflash.dflash2.selector_top_k=65 is not supported by the engine"),
    ({"selector_top_k": 33}, "dflash.dflash2.selector_top_k=33 exceeds vocab_size=32"),
    ({"conv_group_size": 7}, "dflash.dflash2.conv_group_size=7 does not divide the drafter's hidden_size=64"),
    ({"selector_rank": 0}, "dflash.dflash2.selector_rank=0 is invalid: it must be an integer >= 1"),
    ({"conv_kernel_size": None}, "dflash.dflash2.conv_kernel_size=None is invalid"),
    ({"output_multiplier": 0.0}, "dflash.dflash2.output_multiplier=0.0 is invalid: it must be > 0"),
    ({"input_embedding_scale": float("nan")}, "dflash.dflash2.input_embedding_scale=nan is invalid"),
    ({"final_logit_softcapping": -1.0}, "dflash.dflash2.final_logit_softcapping=-1.0 is invalid"),
    ({"final_logit_softcapping": "20"}, "dflash.dflash2.final_logit_softcapping='20' is invalid"),
]


@pytest.mark.parametrize("change,message", BAD_SECTIONS, ids=[m.split("=")[0].split(".")[-1] + str(i)
                                                               for i, (_, m) in enumerate(BAD_SECTIONS)])
def test_build_refuses_a_malformed_dflash2_section_in_one_line(engines, tmp_path, capsys, change, message):
    """A checkpoint whose dflash.dflash2 was edited: the build entry point exits 2 with one line naming
    CKPT/config.json and the field, before TensorRT-LLM starts; the network refuses the same when it
    is built without the entry point's check."""
    import shutil

    root, built = engines
    ckpt = tmp_path / "ckpt"
    shutil.copytree(built["qwen3"][2], ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["dflash"]["dflash2"].update(change)
    (ckpt / "config.json").write_text(json.dumps(config))
    with standin.active(root / "lib"):
        from tensorrt_llm_dflash.trtllm import build

        assert build.main(build_argv(ckpt, tmp_path / "engine")) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"{ckpt}/config.json {message}" in lines[0], lines
        assert not (tmp_path / "engine").exists()
        if change.get("selector_top_k") == 65:
            from unittest import mock

            with mock.patch.object(build, "check_checkpoint", lambda argv, is_dflash: (True, MAX_DRAFT_LEN)):
                with pytest.raises(DFlashConfigError, match=re.escape(message)):
                    build.main(build_argv(ckpt, tmp_path / "engine"))


def test_a_dflash2_section_that_is_not_an_object_is_refused():
    from tensorrt_llm_dflash.trtllm.dflash2_support import check_section

    with pytest.raises(DFlashConfigError, match=r"where=\[16\] is invalid: it must be an object"):
        check_section([16], hidden_size=64, vocab_size=32, where="where")


# ----------------------------------------------------------------------- documented flow


@pytest.mark.slow
def test_demo_pair_dflash2_three_commands_equal_the_pytorch_runtime(tmp_path, capsys):
    """``demo_pair --dflash2`` (deterministic), then the README's three commands with that drafter:
    convert_checkpoint.py, the trtllm-build entry point (--speculative_decoding_mode dflash, paged KV
    in 64-token blocks), run.py --engine_dir: the tokens and per-step acceptance of run.py with the
    float64 PyTorch runtime on the same directories, for the chain and a DFlash2 tree."""
    from safetensors.torch import load_file

    from tensorrt_llm_dflash.trtllm import demo_pair

    sys.path.insert(0, str(ROOT / "examples"))
    import convert_checkpoint
    import run

    for name in ("demo", "again"):
        assert demo_pair.main(["--dflash2", "--output_dir", str(tmp_path / name)]) == 0
    assert "DFlash2, selector top 16 of rank 32" in capsys.readouterr().out
    a, b = (load_file(str(tmp_path / n / "drafter" / "model.safetensors")) for n in ("demo", "again"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "candidate_selector.predecessor_codebook" in a
    target_dir, drafter_dir = tmp_path / "demo" / "target", tmp_path / "demo" / "drafter"
    prompt, max_new, max_draft_len = "Write a Python function that reverses a string.", 16, 16
    # --max_draft_len reads the drafter's config before any weight: a nested-layout DFlash2 one too.
    assert convert_checkpoint.main(["--model_dir", str(target_dir), "--dflash_model_dir", str(drafter_dir),
                                    "--output_dir", str(tmp_path / "ckpt"), "--dtype", "bfloat16",
                                    "--max_draft_len", str(max_draft_len), "--no_progress"]) == 0
    with standin.active(tmp_path / "lib"):
        from tensorrt_llm_dflash.trtllm import build

        assert build.main(["--checkpoint_dir", str(tmp_path / "ckpt"), "--output_dir", str(tmp_path / "engine"),
                           "--speculative_decoding_mode", "dflash", "--max_draft_len", str(max_draft_len),
                           "--max_batch_size", "1", "--remove_input_padding", "enable",
                           "--tokens_per_block", "64"]) == 0
        for budget in (0, max_draft_len):
            common = ["--input_text", prompt, "--max_output_len", str(max_new), "--ddtree_budget", str(budget),
                      "--device", "cpu"]
            assert run.main(["--engine_dir", str(tmp_path / "engine"), "--tokenizer_dir", str(target_dir),
                             "--speculative_decoding_mode", "dflash", "--use_py_session",
                             "--output_json", str(tmp_path / f"engine_{budget}.json"), *common]) == 0
            assert run.main(["--target_model_dir", str(target_dir), "--draft_model_dir", str(drafter_dir),
                             "--dtype", "float64", "--output_json", str(tmp_path / f"torch_{budget}.json"),
                             *common]) == 0
            got = json.loads((tmp_path / f"engine_{budget}.json").read_text())["outputs"][0]
            expected = json.loads((tmp_path / f"torch_{budget}.json").read_text())["outputs"][0]
            assert len(got["output_ids"]) == max_new
            assert got["output_ids"] == expected["output_ids"], budget
            assert got["stats"]["acceptance_lengths"] == expected["stats"]["acceptance_lengths"], budget
            assert got["stats"]["tree_sizes"] == expected["stats"]["tree_sizes"], budget


def test_the_chain_of_an_engine_draft_is_capped_by_the_depth_asked():
    """The decode loop asks for fewer draft tokens near the end of the output: the in-graph chain is cut."""
    from tensorrt_llm_dflash.trtllm.runner import EngineSelectorDraft

    draft = EngineSelectorDraft(unary=torch.zeros(3, 2), tokens=torch.tensor([[4, 5], [6, 7], [8, 9]]),
                                edges=torch.zeros(3, 2, 2), root=1, chain_tokens=torch.tensor([5, 7, 9]))
    assert draft.build_tree(1, 0, 2).tokens.tolist() == build_chain(1, [5, 7]).tokens.tolist()
    # After another root, the greedy walk over the table (first maximum: index 0 on these ties).
    assert draft.build_tree(2, 0, 3).tokens.tolist() == [2, 4, 6, 8]
