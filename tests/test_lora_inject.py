"""The LoRA direct-injection drafter: lossless decoding, injection and cache equivalence, checkpoints, training."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import full_forward, hf_greedy, tiny_target

from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.errors import DFlashConfigError
from tensorrt_llm_dflash.lora_inject import (
    ContextKV,
    DFlashLoRAInjectDraftModel,
    LoRAInjectConfig,
    LoRAInjectProposer,
    additive_mask,
    build_lora_inject_proposer,
    build_verifier,
    injection_mask,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import peft  # noqa: F401,E402 - a hard dependency (requirements.txt): never skip these tests

VOCAB = 64
MASK = VOCAB - 1


@functools.lru_cache(maxsize=8)
def target(arch: str, seed: int = 0, layers: int = 4, hidden: int = 32):
    # Own instances: the drafter marks the target's weights as frozen (requires_grad False).
    return tiny_target(arch, seed=seed, vocab=VOCAB, layers=layers, hidden=hidden)


def drafter(model, block_size: int = 4, seed: int = 0, std: float = 0.1, modules=None, rank: int = 4):
    extra = {} if modules is None else {"lora_target_modules": list(modules)}
    config = LoRAInjectConfig.for_target(model, block_size, MASK, lora_rank=rank, lora_alpha=2.0 * rank, **extra)
    d = DFlashLoRAInjectDraftModel(model, config)
    if std:
        d.randomize_adapters_(std, torch.Generator().manual_seed(seed))
    return d.eval()


def prompt(seed: int, length: int = 9) -> list[int]:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randint(2, VOCAB - 1, (length,), generator=g).tolist()


class Recording:
    """Wraps a proposer and keeps every draft it returns."""

    def __init__(self, inner: LoRAInjectProposer) -> None:
        self.inner, self.block_size, self.logits = inner, inner.block_size, []

    def reset(self) -> None:
        self.inner.reset()
        self.logits = []

    def propose(self, root, context):
        out = self.inner.propose(root, context)
        self.logits.append(out.clone())
        return out


# --------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("seed,block_size,budget", [(0, 4, 0), (1, 4, 8), (2, 6, 0), (3, 6, 16), (4, 3, 3), (5, 8, 32)])
def test_lossless_chain_and_ddtree(arch, seed, block_size, budget):
    model = target(arch, seed=seed % 2)
    d = drafter(model, block_size, seed=seed, std=0.15)
    proposer = LoRAInjectProposer(d, "cache")
    verifier = build_verifier(model, proposer)
    ids = prompt(seed, 5 + seed)
    try:
        result = speculative_generate(verifier, proposer, ids, 40, ddtree_budget=budget)
    finally:
        verifier.close()
    assert result.output_ids == hf_greedy(model, ids, 40)
    assert max(result.stats.tree_sizes) <= (block_size if budget == 0 else budget + 1)


def test_drafts_are_nontrivial():
    """Random adapters change the drafts, and some drafted tokens are accepted."""
    model = target("qwen3")
    plain, adapted = (LoRAInjectProposer(drafter(model, 6, std=s), "cache") for s in (0.0, 0.15))
    logits = []
    for p in (plain, adapted):
        rec = Recording(p)
        verifier = build_verifier(model, p)
        result = speculative_generate(verifier, rec, prompt(7), 48, ddtree_budget=16)
        verifier.close()
        logits.append(rec.logits[0])
    assert (logits[0] - logits[1]).abs().max() > 1e-3
    assert result.stats.mean_acceptance_length > 1.0


# ------------------------------------------------------------------ injection equivalence


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_zero_lora_layers_equal_target_layers_on_injected_input(arch):
    """Zero adapters: every draft layer's block output == the target's own layer run on
    cat(target layer-l input of the context, draft block) with the extended mask."""
    model = target(arch)
    d = drafter(model, 5, std=0.0)  # peft's init: B = 0
    assert all(float(p.detach().abs().max()) == 0 for n, p in d.adapted.named_parameters() if "lora_B" in n)
    ctx_tokens = prompt(1, 11)
    cache, hidden_states, _ = full_forward(model, ctx_tokens)
    s = len(ctx_tokens)
    embeds = d.embed_blocks(torch.tensor([[17]]))
    block_pos = torch.arange(s, s + 5)[None]
    with torch.no_grad():
        _, outs = d(embeds, block_pos, ContextKV.from_cache(cache), return_layer_outputs=True)
        decoder = model.get_decoder()
        allowed = torch.ones(1, 5, s + 5, dtype=torch.bool)
        mask = additive_mask(injection_mask(allowed), torch.float64)
        rope = decoder.rotary_emb(embeds, torch.arange(s + 5)[None])
        x = embeds
        for layer_id, layer in enumerate(decoder.layers):
            ref = layer(torch.cat([hidden_states[layer_id], x], 1), attention_mask=mask, position_embeddings=rope)
            torch.testing.assert_close(outs[layer_id], ref[:, s:], rtol=0, atol=1e-10)
            x = outs[layer_id]  # each layer is compared on the drafter's own input


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_cached_context_equals_literal_injection_per_layer(arch):
    """Nonzero adapters (not on k/v): context K/V from the target's cache == running each adapted
    layer on cat(ctx, block), layer by layer."""
    model = target(arch)
    d = drafter(model, 4, std=0.2)
    ctx_tokens = prompt(2, 10)
    cache, hidden_states, _ = full_forward(model, ctx_tokens)
    s = len(ctx_tokens)
    embeds = d.embed_blocks(torch.tensor([[5]]))
    block_pos = torch.arange(s, s + 4)[None]
    with torch.no_grad():
        out_c, layers_c = d(embeds, block_pos, ContextKV.from_cache(cache), return_layer_outputs=True)
        out_r, layers_r = d.forward_injected(embeds, block_pos, hidden_states[:-1], torch.arange(s)[None],
                                             return_layer_outputs=True)
    for a, b in zip(layers_c, layers_r):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    torch.testing.assert_close(out_c, out_r, rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch,budget", [("qwen3", 0), ("qwen3", 12), ("llama", 6)])
def test_cache_and_recompute_proposers_give_identical_drafts(arch, budget):
    """Whole decodes: drafts reading the verifier's KV cache == drafts recomputed from every layer's
    input (LayerInputVerifier features), at every step, including after tree compaction."""
    model = target(arch, seed=1)
    d = drafter(model, 5, std=0.15)
    runs = []
    for mode in ("cache", "layer_inputs"):
        rec = Recording(LoRAInjectProposer(d, mode))
        verifier = build_verifier(model, rec.inner)
        runs.append((speculative_generate(verifier, rec, prompt(3), 40, ddtree_budget=budget), rec.logits))
        verifier.close()
    (res_c, logits_c), (res_r, logits_r) = runs
    assert res_c.output_ids == res_r.output_ids
    assert res_c.stats.acceptance_lengths == res_r.stats.acceptance_lengths
    assert len(logits_c) == len(logits_r) > 3
    for a, b in zip(logits_c, logits_r):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


def test_kv_adapters_refuse_the_cache_and_stay_lossless_by_recomputing():
    model = target("qwen3")
    d = drafter(model, 4, std=0.15, modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    with pytest.raises(DFlashConfigError, match="k_proj/v_proj"):
        LoRAInjectProposer(d, "cache")
    proposer = LoRAInjectProposer(d, "layer_inputs")
    verifier = build_verifier(model, proposer)
    ids = prompt(4)
    result = speculative_generate(verifier, proposer, ids, 30, ddtree_budget=8)
    verifier.close()
    assert result.output_ids == hf_greedy(model, ids, 30)


def test_unbound_cache_proposer_is_an_error():
    proposer = LoRAInjectProposer(drafter(target("llama"), 4), "cache")
    with pytest.raises(DFlashConfigError, match="bind"):
        proposer.propose(3, None)


# ------------------------------------------------------------------------ checkpoints


def test_save_load_round_trip(tmp_path):
    model = target("llama")
    d = drafter(model, 4, std=0.1)
    d.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "dflash_lora_inject.json"} <= files
    from safetensors.torch import load_file

    names = list(load_file(str(tmp_path / "adapter_model.safetensors")))
    # The names a peft adapter on the HF causal LM itself would have.
    assert all(n.startswith("base_model.model.model.layers.") and ".lora_" in n for n in names)
    verifier, loaded = build_lora_inject_proposer(model, tmp_path)
    assert loaded.context == "cache"
    ids = prompt(5)
    rec = Recording(loaded)
    result = speculative_generate(verifier, rec, ids, 20, ddtree_budget=4)
    verifier.close()
    assert result.output_ids == hf_greedy(model, ids, 20)
    ref = Recording(LoRAInjectProposer(d, "cache"))
    v2 = build_verifier(model, ref.inner)
    speculative_generate(v2, ref, ids, 20, ddtree_budget=4)
    v2.close()
    for a, b in zip(rec.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_adapter_loads_onto_the_hf_target_with_peft(tmp_path):
    """The saved adapter is an ordinary peft adapter of the target model (same tensor names)."""
    from peft import PeftModel

    model = target("llama")
    d = drafter(model, 4, std=0.1)
    d.save_pretrained(tmp_path)
    fresh = tiny_target("llama", seed=0, vocab=VOCAB)
    peft_model = PeftModel.from_pretrained(fresh, str(tmp_path))
    a = peft_model.base_model.model.model.layers[1].self_attn.q_proj.lora_A["default"].weight
    torch.testing.assert_close(a, d.layers[1].self_attn.q_proj.lora_A["default"].weight)


@pytest.mark.parametrize("field_name,kwargs", [
    ("hidden_size", {"hidden": 48}),
    ("num_hidden_layers", {"layers": 3}),
])
def test_target_mismatch_names_the_field(tmp_path, field_name, kwargs):
    drafter(target("qwen3"), 4).save_pretrained(tmp_path)
    other = tiny_target("qwen3", seed=0, vocab=VOCAB, **kwargs)
    with pytest.raises(DFlashConfigError, match=field_name) as err:
        DFlashLoRAInjectDraftModel.from_pretrained(other, tmp_path)
    want = json.loads((tmp_path / "dflash_lora_inject.json").read_text())[field_name]
    assert str(want) in str(err.value) and str(getattr(other.config, field_name)) in str(err.value)


def test_model_type_mismatch_names_both_values(tmp_path):
    drafter(target("qwen3"), 4).save_pretrained(tmp_path)
    with pytest.raises(DFlashConfigError, match=r"model_type='qwen3' but the target has model_type='llama'"):
        DFlashLoRAInjectDraftModel.from_pretrained(target("llama"), tmp_path)


def test_bad_checkpoints_name_the_problem(tmp_path):
    model = target("qwen3")
    with pytest.raises(DFlashConfigError, match="dflash_lora_inject.json"):
        DFlashLoRAInjectDraftModel.from_pretrained(model, tmp_path)
    drafter(model, 4).save_pretrained(tmp_path)
    cfg_path = tmp_path / "dflash_lora_inject.json"
    good = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**good, "mask_token_id": VOCAB + 5}))
    with pytest.raises(DFlashConfigError, match=f"mask_token_id={VOCAB + 5}"):
        DFlashLoRAInjectDraftModel.from_pretrained(model, tmp_path)
    cfg_path.write_text(json.dumps({k: v for k, v in good.items() if k != "block_size"}))
    with pytest.raises(DFlashConfigError, match="block_size"):
        DFlashLoRAInjectDraftModel.from_pretrained(model, tmp_path)
    cfg_path.write_text(json.dumps({**good, "lora_target_modules": ["q_proj"]}))
    with pytest.raises(DFlashConfigError, match="target_modules"):
        DFlashLoRAInjectDraftModel.from_pretrained(model, tmp_path)
    cfg_path.write_text(json.dumps(good))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(DFlashConfigError, match="missing"):
        DFlashLoRAInjectDraftModel.from_pretrained(model, tmp_path)


def test_sliding_window_targets_are_refused():
    model = tiny_target("qwen3", seed=0, vocab=VOCAB, sliding_window=4)
    with pytest.raises(DFlashConfigError, match="layer_types"):
        LoRAInjectConfig.for_target(model, 4, MASK)


def test_drafter_never_changes_the_target():
    model = tiny_target("llama", seed=3, vocab=VOCAB)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    d = drafter(model, 4, std=0.3)
    d.to(torch.float64)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # peft wrapped the mirror only
    assert set(d.state_dict()) == set(d.adapter_state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# --------------------------------------------------------------------------- training


def _online(model, block_size=4, num_anchors=6, std=0.15):
    from tensorrt_llm_dflash.training.lora_inject import OnlineDFlashLoRAInjectModel

    return OnlineDFlashLoRAInjectModel(drafter(model, block_size, std=std), model, num_anchors=num_anchors, gamma=4.0)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_training_blocks_equal_inference_drafts(arch):
    """A training block at anchor a (training mask, target K/V of the whole padded batch) gives the
    same logits as the runtime's draft after committing x[:a] with root x[a]."""
    from tensorrt_llm_dflash.training.model import sample_anchors

    model = target(arch)
    online = _online(model, block_size=4, num_anchors=5)
    seqs = [prompt(10, 24), prompt(11, 18)]
    ids = torch.zeros(2, 24, dtype=torch.long)
    loss_mask = torch.zeros(2, 24, dtype=torch.bool)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.tensor(s)
        loss_mask[row, 6 : len(s)] = True
    gen = torch.Generator().manual_seed(0)
    anchors, keep = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(0))
    captured = {}
    handle = online.drafter.register_forward_hook(lambda _m, _a, out: captured.setdefault("h", out))
    with torch.no_grad():
        out = online(ids, loss_mask, generator=gen)
    handle.remove()
    assert torch.isfinite(out["loss"])
    train_logits = online.drafter.draft_logits(captured["h"].view(2, 5, 4, -1)[:, :, 1:])
    proposer = LoRAInjectProposer(online.drafter, "cache")
    checked = 0
    for row in range(2):
        for j in range(5):
            if not keep[row, j]:
                continue
            a = int(anchors[row, j])
            cache, _, _ = full_forward(model, seqs[row][:a])
            proposer.verifier = type("V", (), {"cache": cache, "past_len": a})()
            draft = proposer.propose(seqs[row][a], None)
            torch.testing.assert_close(train_logits[row, j], draft, rtol=0, atol=1e-9)
            checked += 1
    assert checked >= 6


def test_training_updates_only_adapters_and_learns(tmp_path):
    from tensorrt_llm_dflash.training.data import Sequence
    from tensorrt_llm_dflash.training.trainer import TrainConfig, train

    model = tiny_target("qwen3", seed=5, vocab=VOCAB).float()
    online = _online(model, block_size=4, num_anchors=8, std=0.0)
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    # A learnable pattern: answers repeat a short cycle.
    seqs = []
    for i in range(24):
        ids = torch.tensor(prompt(i, 6) + [(3 * k + i) % 9 + 2 for k in range(30)])
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[6:] = True
        seqs.append(Sequence(ids, mask, torch.zeros(len(ids), 0), None))
    config = TrainConfig(lr=3e-2, batch_size=4, num_anchors=8, max_steps=40, log_every=20, save_every=20,
                         eval_fraction=0.2)
    result = train(online, seqs, config, tmp_path, resume=False)
    first, last = result["history"][0], result["history"][-1]
    assert last["train_loss"] < first["train_loss"]
    assert result["final"]["eval_loss"] < first["eval_loss"]
    assert result["final"]["eval_acc"][0] > 0.3  # chance is 1/64
    for k, v in model.state_dict().items():
        assert torch.equal(v, frozen[k]), k
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["drafter"]
    assert saved and all(".lora_" in k for k in saved)
    # Resume restores the adapters exactly.
    online2 = _online(model, block_size=4, num_anchors=8, std=0.0)
    online2.drafter.load_state_dict(saved)
    for k, v in online2.drafter.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0)


# ------------------------------------------------------------------ harness and CLI


def test_bench_methods_run_through_the_harness(tmp_path, monkeypatch):
    from tensorrt_llm_dflash import bench
    from tensorrt_llm_dflash.bench import register_lora_inject
    from tensorrt_llm_dflash.sampling import SamplingParams

    model = target("llama")
    drafter(model, 5, std=0.15).save_pretrained(tmp_path)
    monkeypatch.setattr(bench, "METHOD_KINDS", dict(bench.METHOD_KINDS))
    register_lora_inject(tmp_path)
    methods = bench.parse_methods(["ar", "lora_inject", "lora_inject_ddtree:8"])
    assert bench.needs_drafter(methods)
    ctx = bench.BenchContext(model, 24, SamplingParams())
    records = bench.run_benchmark(ctx, methods, [prompt(1), prompt(2)], progress=False)
    summary = bench.summarize(records, methods, greedy=True)
    assert summary["all_outputs_match"] is True
    assert ctx._proposers["lora_inject"] is ctx._proposers["lora_inject_ddtree"]  # one drafter for both
    assert all(r.acceptance_lengths for r in records["lora_inject_ddtree:8"])


def _write_shards(path, sequences, answer_start):
    path.mkdir(parents=True)
    torch.save({"prompt_index": list(range(len(sequences))),
                "input_ids": [torch.tensor(s, dtype=torch.int32) for s in sequences],
                "answer_start": [answer_start] * len(sequences),
                "features": [torch.zeros(len(s), 8, dtype=torch.bfloat16) for s in sequences],
                "final_hidden": [torch.zeros(len(s), 8, dtype=torch.bfloat16) for s in sequences]},
               path / "shard_00000.pt")


def test_training_cli_trains_resumes_and_exports(tmp_path, capsys):
    import train_dflash_lora_inject as cli
    from test_bench import save_tiny_target_dir

    model = tiny_target("qwen3", seed=2, vocab=VOCAB).float()
    target_dir = save_tiny_target_dir(model, tmp_path / "target")
    seqs = [prompt(i, 5) + [(2 * k + i) % 7 + 2 for k in range(20)] for i in range(12)]
    _write_shards(tmp_path / "data", seqs, 5)

    def argv(steps: int) -> list[str]:
        return ["--target_model_dir", str(target_dir), "--data_dir", str(tmp_path / "data"), "--work_dir",
                str(tmp_path / "work"), "--output_dir", str(tmp_path / "out"), "--train_minutes", "0",
                "--max_steps", str(steps), "--block_size", "4", "--mask_token_id", str(MASK), "--lora_rank", "4",
                "--num_anchors", "4", "--log_every", "2", "--eval_sequences", "2"]

    assert cli.main(argv(4)) == 0
    assert cli.main(argv(6)) == 0  # resumes at step 4
    assert "resumed from" in capsys.readouterr().out
    out = tmp_path / "out"
    metrics = json.loads((out / "training_metrics.json").read_text())
    assert metrics["train"]["steps"] == 6
    assert metrics["config"]["draft_vocab_size"] == VOCAB  # auto: ids < 8192 cover the tiny vocabulary
    assert "LoRA-inject drafter" in (out / "README.md").read_text()
    from transformers import AutoModelForCausalLM

    loaded_target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    verifier, proposer = build_lora_inject_proposer(loaded_target, out)
    ids = prompt(30)
    result = speculative_generate(verifier, proposer, ids, 16, ddtree_budget=6)
    verifier.close()
    assert result.output_ids == hf_greedy(loaded_target, ids, 16)



def test_training_cli_refuses_a_lora_target_the_loaded_layers_lack_before_any_data_or_training(tmp_path, capsys):
    """The reported defect: a name peft matches to no module was its NoMatchingPeftModuleError traceback once the
    target had loaded. A name that passes the parse-time check (a known projection under the wrong parent) is
    refused by name against the loaded layers, before a work dir is claimed or a shard is made."""
    import train_dflash_lora_inject as cli
    from test_bench import save_tiny_target_dir

    target_dir = save_tiny_target_dir(tiny_target("qwen3", seed=2, vocab=VOCAB).float(), tmp_path / "target")
    _write_shards(tmp_path / "data", [prompt(i, 5) + [3] * 12 for i in range(4)], 5)
    # A short run if the name got through: peft drops a name that matches nothing beside one that does.
    code = cli.main(["--target_model_dir", str(target_dir), "--data_dir", str(tmp_path / "data"), "--work_dir",
                     str(tmp_path / "work"), "--output_dir", str(tmp_path / "out"), "--mask_token_id", str(MASK),
                     "--block_size", "4", "--num_anchors", "2", "--eval_sequences", "1", "--train_minutes", "0",
                     "--max_steps", "1", "--lora_targets", "q_proj", "mlp.q_proj"])
    err = capsys.readouterr().err  # the weights' loading progress bars, then one line
    assert code == 2 and "Traceback" not in err and err.strip().splitlines()[-1] == (
        "error: argument --lora_targets: 'mlp.q_proj' names no linear layer of the target's decoder layers (their "
        "projections: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)"), err
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["shard_00000.pt"] and not (tmp_path / "work").exists()
    assert not (tmp_path / "out").exists()


def test_training_cli_data_minutes_0_is_no_limit_as_in_train_dflash(tmp_path, monkeypatch, capsys):
    """The reported inconsistency: --data_minutes 0 was a zero data budget here (no shard, then a refusal) and
    no limit in examples/train_dflash.py; it is no limit in both, and --help says so."""
    import argparse

    import train_dflash_lora_inject as cli

    from tensorrt_llm_dflash.training import data

    budgets = []
    monkeypatch.setattr(data, "build_distillation_data", lambda *a, **k: budgets.append(k["time_budget_s"]))
    model = tiny_target("llama", vocab=VOCAB)
    for minutes in (0.0, 1.5):
        cli.ensure_data(argparse.Namespace(data_dir=str(tmp_path / "data"), data_minutes=minutes), model, None, False)
    assert budgets == [None, 90.0]
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--data_minutes DATA_MINUTES data stage budget if --data_dir has no shards (0: no limit)" in help_text

def test_reduced_draft_vocabulary_round_trips_and_stays_lossless(tmp_path):
    model = target("qwen3")
    d = drafter(model, 5, std=0.15)
    full = Recording(LoRAInjectProposer(d, "cache"))
    v = build_verifier(model, full.inner)
    speculative_generate(v, full, prompt(8), 12)
    v.close()
    keep = list(range(0, VOCAB, 2))
    d.set_draft_vocab(keep)
    d.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "dflash_lora_inject.json").read_text())["draft_vocab_size"] == len(keep)
    verifier, proposer = build_lora_inject_proposer(model, tmp_path)
    rec = Recording(proposer)
    ids = prompt(8)
    result = speculative_generate(verifier, rec, ids, 30, ddtree_budget=8)
    verifier.close()
    assert result.output_ids == hf_greedy(model, ids, 30)
    first = rec.logits[0]
    assert torch.isinf(first[:, 1::2]).all()
    torch.testing.assert_close(first[:, ::2], full.logits[0][:, ::2], rtol=0, atol=1e-12)
    (tmp_path / "draft_vocab.safetensors").unlink()
    with pytest.raises(DFlashConfigError, match="draft_vocab_size"):
        DFlashLoRAInjectDraftModel.from_pretrained(model, tmp_path)


def test_run_py_with_the_lora_inject_builder(tmp_path, monkeypatch):
    """examples/run.py once its --draft_type lora_inject calls build_run_pytorch (docs/lora_inject.md)."""
    import run
    from test_bench import save_tiny_target_dir

    from tensorrt_llm_dflash.lora_inject import build_run_pytorch

    model = tiny_target("llama", seed=4, vocab=VOCAB)
    target_dir = save_tiny_target_dir(model, tmp_path / "target")
    drafter(model, 4, std=0.15).save_pretrained(tmp_path / "draft")
    monkeypatch.setattr(run, "build_pytorch", build_run_pytorch)
    for budget in ("0", "6"):
        out = tmp_path / f"out{budget}.json"
        argv = ["--target_model_dir", str(target_dir), "--draft_model_dir", str(tmp_path / "draft"), "--dtype",
                "float64", "--input_text", "w7 w9 w4", "--max_output_len", "12", "--ddtree_budget", budget,
                "--output_json", str(out)]
        assert run.main(argv) == 0
        doc = json.loads(out.read_text())
        prompt_ids = [3, 7, 9, 4, 4, 5]  # the chat template: "w3 <text> w4 w5"
        assert doc["outputs"][0]["output_ids"] == hf_greedy(model, prompt_ids, 12)
