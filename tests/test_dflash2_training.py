"""Training DFlash2 drafters: the identity-initialised convolutions, the training layout, the
selector loss (the gold token inserted when the top-K misses it), learning on a toy task, and
the CLI end to end (a DFlash run and a DFlash2 run on one work dir's data, a SIGKILL inside a
checkpoint write, resume, export in z-lab's DFlash2 layout, examples/run.py decoding it == AR).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import tiny_dflash2_drafter, tiny_drafter, tiny_drafter_config, tiny_target

from tensorrt_llm_dflash.dflash2 import DFlash2DraftModel, DFlash2Proposer, DFlash2Settings
from tensorrt_llm_dflash.drafter import DraftContextCache
from tensorrt_llm_dflash.proposer import DFlashProposer
from tensorrt_llm_dflash.training.data import Sequence, capture_hidden_states
from tensorrt_llm_dflash.training.dflash2 import (
    OnlineDFlash2Model,
    init_dflash2_for_training,
    init_dflash2_from_drafter,
    make_dflash2_config,
    selector_training_candidates,
)
from tensorrt_llm_dflash.training.model import OnlineDFlashModel, sample_anchors
from tensorrt_llm_dflash.training.trainer import TrainConfig, train

SETTINGS = DFlash2Settings(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=4)


def _online(drafter, target, cls=OnlineDFlash2Model, **kw):
    return cls(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight, **kw)


def _batch(target, seed=0, rows=2, length=20, features=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, target.config.vocab_size - 1, (rows, length), generator=g)
    feats = torch.randn(rows, length, features, generator=g, dtype=target.dtype)
    mask = torch.ones(rows, length, dtype=torch.bool)
    mask[:, :3] = False
    return ids, feats, mask


def _dflash2_from(dflash, settings=SETTINGS):
    drafter = DFlash2DraftModel(make_dflash2_config(dflash.config, settings)).to(dflash.fc.weight.dtype)
    init_dflash2_for_training(drafter)
    init_dflash2_from_drafter(drafter, dflash, "the DFlash drafter")
    return drafter


# ------------------------------------------------------------------------------- initialisation


def test_identity_initialised_convolutions_leave_the_block_unchanged():
    """At step 0 a DFlash2 drafter started from a DFlash drafter computes its block exactly (float64):
    in the runtime's one-block forward, in the training layout, and in what it drafts (the pairwise
    term is zero, so the selector's chain is the unary argmax, DFlash's chain)."""
    target = tiny_target("qwen3", seed=1, dtype=torch.float64)
    dflash = tiny_drafter(target, block_size=4, layers=2)
    drafter = _dflash2_from(dflash)
    for conv in [c for layer in drafter.layers for c in (layer.attention_conv, layer.mlp_conv)]:
        assert torch.equal(conv.kernel_projection.weight, torch.zeros_like(conv.kernel_projection.weight))
        assert torch.equal(conv.base_kernel[:, 0], torch.ones_like(conv.base_kernel[:, 0]))
        assert torch.equal(conv.base_kernel[:, 1:], torch.zeros_like(conv.base_kernel[:, 1:]))

    ids, feats, mask = _batch(target, features=dflash.config.num_context_features)
    # The runtime's forward: one block against a cached context.
    embeds = torch.randn(2, 4, 32, dtype=torch.float64)
    positions = torch.arange(20, 24)[None].expand(2, 4)
    outs = []
    for model in (dflash, drafter):
        cache = DraftContextCache()
        model.extend_context(cache, feats, torch.arange(20)[None].expand(2, 20))
        outs.append(model(embeds, positions, cache))
    assert torch.equal(outs[0], outs[1])
    # The training layout: many blocks per row under the block mask.
    anchors = sample_anchors(mask, 5, torch.Generator().manual_seed(3))
    hidden = [_online(d, target, cls).draft_hidden(ids, feats, *anchors)
              for d, cls in ((dflash, OnlineDFlashModel), (drafter, OnlineDFlash2Model))]
    assert torch.equal(hidden[0], hidden[1])
    # What it drafts: the DFlash proposer's argmax chain.
    marginals = DFlashProposer.for_target(dflash, target).propose(7, feats[0, :9])
    draft = DFlash2Proposer.for_target(drafter, target).propose(7, feats[0, :9])
    assert list(draft.chain(7, 3).tokens[1:]) == marginals.argmax(-1).tolist()
    assert torch.count_nonzero(draft.successors) == 0

    # The identity is a starting point, not a constraint: the dynamic term trains from step 0 ...
    online = _online(drafter, target, num_anchors=5)
    online(ids, feats, mask, anchors=anchors)["loss"].backward()
    grads = {n: p.grad for n, p in drafter.named_parameters()}
    assert all(grads[f"layers.{i}.{c}.kernel_projection.weight"].abs().max() > 0
               for i in range(2) for c in ("attention_conv", "mlp_conv"))
    assert grads["candidate_selector.successor_codebook"].abs().max() > 0
    # ... and a non-zero one changes the block (so the equalities above can fail).
    with torch.no_grad():
        drafter.layers[0].attention_conv.kernel_projection.weight.normal_(0, 0.1)
    assert not torch.allclose(_online(drafter, target).draft_hidden(ids, feats, *anchors), hidden[0])


def test_init_from_a_dflash_drafter_copies_the_shared_parts_and_refuses_another_shape():
    from tensorrt_llm_dflash.errors import DFlashConfigError

    target = tiny_target("qwen3", seed=1, dtype=torch.float64)
    dflash = tiny_drafter(target, block_size=4, layers=2)
    drafter = DFlash2DraftModel(make_dflash2_config(dflash.config, SETTINGS)).double()
    init_dflash2_for_training(drafter)
    selector_before = drafter.candidate_selector.predecessor_codebook.clone()
    copied = init_dflash2_from_drafter(drafter, dflash, "dir")
    assert set(copied) == {k for k in dflash.state_dict() if "rotary" not in k}
    assert all(torch.equal(drafter.state_dict()[k], dflash.state_dict()[k]) for k in copied)
    assert torch.equal(drafter.candidate_selector.predecessor_codebook, selector_before)
    # A DFlash2 drafter gives everything, selector included.
    other = tiny_dflash2_drafter(target, block_size=4, layers=2, layout="flat", **{
        "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4, "mask_token_id": dflash.config.mask_token_id,
        "target_layer_ids": dflash.config.target_layer_ids})
    init_dflash2_from_drafter(drafter, other, "dir2")
    assert torch.equal(drafter.candidate_selector.successor_codebook, other.candidate_selector.successor_codebook)
    with pytest.raises(DFlashConfigError, match="block_size is 6"):
        init_dflash2_from_drafter(drafter, tiny_drafter(target, block_size=6, layers=2), "dir3")


# ---------------------------------------------------------------------------- training layout


def test_training_layout_equals_one_block_per_row():
    """Every kept block of the training forward (N blocks in a row under the DFlash mask, the
    convolutions restarting at each) equals the runtime's forward of that block alone against the
    context before its anchor."""
    target = tiny_target("qwen3", seed=2, dtype=torch.float64)
    drafter = tiny_dflash2_drafter(target, block_size=4, layers=2)
    with torch.no_grad():  # a convolution far from the identity, so crossing a block edge would show
        for name, p in drafter.named_parameters():
            if "kernel_projection" in name:
                p.normal_(0, 0.3)
    ids, feats, mask = _batch(target, seed=5, length=24, features=drafter.config.num_context_features)
    online = _online(drafter, target, num_anchors=6)
    anchors, keep = sample_anchors(mask, 6, torch.Generator().manual_seed(1))
    hidden = online.draft_hidden(ids, feats, anchors, keep)
    checked = 0
    for row in range(2):
        for j, a in enumerate(anchors[row].tolist()):
            if not keep[row, j]:
                continue
            cache = DraftContextCache()
            drafter.extend_context(cache, feats[row:row + 1, :a], torch.arange(a)[None])
            block = torch.full((1, 4), drafter.config.mask_token_id)
            block[0, 0] = ids[row, a]
            alone = drafter(target.get_input_embeddings()(block), torch.arange(a, a + 4)[None], cache)
            torch.testing.assert_close(hidden[row, j], alone[0, 1:], rtol=0, atol=1e-10)
            checked += 1
    assert checked >= 10


# ------------------------------------------------------------------------------ selector loss


def test_training_candidates_insert_the_gold_token_in_place_of_the_weakest():
    candidates = torch.tensor([[5, 3, 9], [1, 2, 7], [4, 8, 6]])
    gold = torch.tensor([3, 11, 6])
    training, index, hit = selector_training_candidates(candidates, gold)
    assert training.tolist() == [[5, 3, 9], [1, 2, 11], [4, 8, 6]]
    assert index.tolist() == [1, 2, 2] and hit.tolist() == [True, False, True]
    assert candidates.tolist() == [[5, 3, 9], [1, 2, 7], [4, 8, 6]], "the strict candidates are left as they are"


def test_selector_loss_equals_a_reference_with_the_gold_token_inserted_when_missing():
    """The loss of a random DFlash2 drafter equals a per-position reference written from the
    definition (block CE over the vocabulary + K-way CE over the top-K with the gold token in the
    K-th place when missing, teacher-forced predecessors, DFlash's decay); both the hit and the
    miss case occur; the metrics use the strict top-K (a missed gold token is never correct)."""
    target = tiny_target("llama", seed=3, dtype=torch.float64)
    drafter = tiny_dflash2_drafter(target, block_size=4, layers=1, selector_top_k=3)
    ids, feats, mask = _batch(target, seed=7, length=16, features=drafter.config.num_context_features)
    online = _online(drafter, target, num_anchors=4, gamma=2.0, selector_weight=0.7)
    anchors, keep = sample_anchors(mask, 4, torch.Generator().manual_seed(2))
    out = online(ids, feats, mask, anchors=(anchors, keep))
    hidden = online.draft_hidden(ids, feats, anchors, keep).detach()
    head = target.get_output_embeddings().weight.detach()
    sel = drafter.candidate_selector.requires_grad_(False)
    block = selector = total = 0.0
    hits = misses = 0
    for row in range(2):
        for j, a in enumerate(anchors[row].tolist()):
            for k in range(1, 4):
                if not keep[row, j] or a + k >= ids.shape[1] or not mask[row, a + k]:
                    continue
                w = float(np.exp(-(k - 1) / 2.0))
                h = hidden[row, j, k - 1]
                unary = h @ head.T
                gold, pred = int(ids[row, a + k]), int(ids[row, a + k - 1])
                block += w * float(torch.logsumexp(unary, 0) - unary[gold])
                top = [int(t) for t in torch.argsort(unary, descending=True)[:3]]
                cands = top if gold in top else top[:2] + [gold]
                scores = torch.stack([unary[c] + (sel.predecessor_codebook[pred] * sel.hidden_projection(h)
                                                  * sel.successor_codebook[c]).sum() for c in cands])
                selector += w * float(torch.logsumexp(scores, 0) - scores[cands.index(gold)])
                total += w
                hits += gold in top
                misses += gold not in top
    assert hits > 0 and misses > 0, (hits, misses)
    assert float(out["loss"].detach()) == pytest.approx((block + 0.7 * selector) / total, rel=1e-9)
    assert float(out["extras"]["selector_loss"][0]) == pytest.approx(selector, rel=1e-9)
    assert float(out["extras"]["candidate_recall"][0]) == hits
    assert float(out["correct"].sum()) <= hits


# ------------------------------------------------------------------------------ learning


def _pairs_data(target, count=40, pairs=18, seed=0):
    """Sequences ``x1 f(x1) x2 f(x2) ...``: each x uniform, f a fixed permutation. A block cannot
    know a token two offsets after an f(x) anchor (the x before it is random), but given that x
    the token is certain: what the selector's predecessor term can learn and the block cannot."""
    rng = np.random.default_rng(seed)
    tokens = np.arange(2, target.config.vocab_size - 1)  # the last id is the MASK
    f = dict(zip(tokens.tolist(), rng.permutation(tokens).tolist()))
    seqs = []
    for _ in range(count):
        x = []
        for _ in range(pairs):
            a = int(rng.choice(tokens))
            x += [a, f[a]]
        seqs.append(x)
    out = []
    for x, (feats, final) in zip(seqs, capture_hidden_states(target, seqs, [1], 1)):
        loss_mask = torch.ones(len(x), dtype=torch.bool)
        loss_mask[:2] = False
        out.append(Sequence(torch.tensor(x), loss_mask, feats, final))
    return out


def test_loss_falls_and_the_selector_learns_what_the_block_cannot_see(tmp_path):
    target = tiny_target("qwen3", seed=4, vocab=24, dtype=torch.float32)
    settings = DFlash2Settings(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=16)
    config = make_dflash2_config(tiny_drafter_config(target, block_size=4, layers=1, target_layer_ids=[1]), settings)
    torch.manual_seed(0)
    drafter = DFlash2DraftModel(config)
    init_dflash2_for_training(drafter)
    online = _online(drafter, target, num_anchors=8)
    result = train(online, _pairs_data(target), TrainConfig(lr=3e-3, max_steps=160, log_every=40, save_every=10_000,
                                                            batch_size=4, eval_fraction=0.2),
                   tmp_path / "work", resume=False)
    first, last = result["history"][0], result["history"][-1]
    assert last["train_loss"] < 0.85 * first["train_loss"]
    assert last["train_selector_loss"] < 0.8 * first["train_selector_loss"]
    # Held out: the selector's choice (what decoding drafts) against the unary argmax (DFlash's rule).
    assert last["eval_selector_accuracy"] > last["eval_unary_accuracy"] + 0.1, last
    assert last["eval_chain_tau"] > last["eval_unary_chain_tau"], last


# ---------------------------------------------------------------------------------- the CLI

PRELOAD = ["torch", "transformers", "transformers.models.qwen3.modeling_qwen3", "jinja2", "safetensors.torch",
           "tqdm.auto", "tensorrt_llm_dflash.training.trainer", "tensorrt_llm_dflash.training.dflash2",
           "tensorrt_llm_dflash.training.data", "tensorrt_llm_dflash.training.prompts",
           "tensorrt_llm_dflash.dflash2", "tensorrt_llm_dflash.target", "kill_child"]


def _run_cli(ctx, argv, log, kill_at=None):
    """Run examples/train_dflash.py in a child; with ``kill_at=(marker, k)`` SIGKILL it as soon as
    the k-th hidden temporary whose name holds ``marker`` appears in the work dir (a write under
    way). Returns (killed, exit code)."""
    from kill_child import run_cli

    work = Path(argv[argv.index("--work_dir") + 1])
    proc = ctx.Process(target=run_cli, args=("train_dflash", argv, str(log), kill_at is not None))
    proc.start()
    seen: set[str] = set()
    started = time.monotonic()
    while kill_at is not None and proc.is_alive() and time.monotonic() - started < 120:
        if work.is_dir():
            seen |= {e.name for e in os.scandir(work) if e.name.startswith(".") and kill_at[0] in e.name}
        if len(seen) >= kill_at[1]:
            break
        time.sleep(0.001)
    killed = kill_at is not None and proc.is_alive()
    if killed:
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(300)
    code = proc.exitcode
    proc.close()
    return killed, code


def test_cli_trains_beside_a_dflash_run_resumes_after_a_kill_and_decodes_losslessly(tmp_path):
    from example_cli import load_example
    from tiny_dirs import save_tiny_target_dir

    from tensorrt_llm_dflash.dflash2 import check_dflash2_dir, load_dflash2_drafter

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    target_dir = save_tiny_target_dir(tmp_path / "target", arch="qwen3", seed=3, layers=6)
    work, log = tmp_path / "work", tmp_path / "child.log"
    common = ["--target_model_dir", str(target_dir), "--work_dir", str(work), "--num_prompts", "16",
              "--max_new_tokens", "8", "--gen_batch_size", "4", "--data_minutes", "0", "--train_minutes", "0",
              "--num_feature_layers", "2", "--num_layers", "1", "--block_size", "4", "--threads", "1",
              "--batch_size", "2", "--num_anchors", "6", "--log_every", "10"]
    # 1. A DFlash run makes the data and a DFlash drafter.
    assert _run_cli(ctx, common + ["--output_dir", str(tmp_path / "dflash"), "--max_steps", "10"], log) == (False, 0), \
        log.read_text()[-3000:]
    shards = sorted(p.name for p in (work / "data").glob("shard_*.pt"))
    # 2. A DFlash2 run on the same work dir, from the DFlash drafter, killed inside its second checkpoint write.
    out = tmp_path / "dflash2"
    argv = common + ["--output_dir", str(out), "--arch", "dflash2", "--max_steps", "40", "--save_every", "5",
                     "--init_drafter", str(tmp_path / "dflash"), "--conv_group_size", "8", "--selector_rank", "8",
                     "--selector_top_k", "4"]
    killed, _ = _run_cli(ctx, argv, log, kill_at=(".checkpoint_dflash2.pt", 2))
    assert killed
    assert not out.exists(), "nothing is published before training ends"
    step = torch.load(work / "checkpoint_dflash2.pt", weights_only=False)["step"]
    assert 5 <= step < 40
    assert torch.load(work / "checkpoint.pt", weights_only=False)["step"] == 10, "the DFlash run's state is its own"
    # 3. The same command resumes and finishes.
    assert _run_cli(ctx, argv, log) == (False, 0), log.read_text()[-3000:]
    text = log.read_text()
    assert f"resumed from {work / 'checkpoint_dflash2.pt'} at step {step}" in text
    assert "tensors copied (layers, fc, norms" in text
    assert sorted(p.name for p in (work / "data").glob("shard_*.pt")) == shards, "the data were reused"
    fingerprint = json.loads((work / "fingerprint.json").read_text())
    assert fingerprint["drafter_dflash2"]["dflash2"]["selector_top_k"] == 4 and "init_drafter" not in fingerprint[
        "drafter"]
    assert torch.load(work / "checkpoint_dflash2.pt", weights_only=False)["step"] == 40
    records = [json.loads(line) for line in (work / "train_log_dflash2.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30, 40] and "eval_unary_chain_tau" in records[-1]

    # The export: z-lab's DFlash2 layout, checksummed, that examples/run.py decodes == AR (float64).
    config = check_dflash2_dir(out)
    assert (config.dflash2.selector_rank, config.dflash2.selector_top_k, config.base.block_size) == (8, 4, 4)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    assert json.loads((out / "training_metrics.json").read_text())["drafter"]["arch"] == "dflash2"
    load_dflash2_drafter(out)
    run = load_example("run")
    ids = {}
    for name, extra in (("chain", ["--ddtree_budget", "0", "--draft_model_dir", str(out)]),
                        ("tree", ["--ddtree_budget", "6", "--draft_model_dir", str(out)]),
                        ("ar", ["--speculative_decoding_mode", "none"])):
        path = tmp_path / f"{name}.json"
        assert run.main(["--target_model_dir", str(target_dir), "--dtype", "float64", "--max_output_len", "20",
                         "--output_json", str(path), "--input_text", "abc abc ab", "def f(x):"] + extra) == 0
        ids[name] = [o["output_ids"] for o in json.loads(path.read_text())["outputs"]]
    assert ids["chain"] == ids["tree"] == ids["ar"]


def test_cli_refuses_dflash2_flags_that_do_not_apply_before_any_data_is_made(tmp_path, capsys, monkeypatch):
    from example_cli import load_example
    from tiny_dirs import save_tiny_target_dir

    train_dflash = load_example("train_dflash")
    base = ["--output_dir", str(tmp_path / "out"), "--work_dir", str(tmp_path / "work")]

    def refused(argv):
        try:
            code = train_dflash.main(base + argv)
        except SystemExit as exit_:
            code = exit_.code
        return code, capsys.readouterr().err.strip()

    monkeypatch.setattr(train_dflash, "load_target", lambda *a, **k: (_ for _ in ()).throw(AssertionError("load")))
    for argv, argument in ((["--selector_rank", "8"], "--selector_rank"),
                           (["--selector_weight", "0.5"], "--selector_weight"),
                           (["--arch", "dflash2", "--draft_vocab", "auto"], "--draft_vocab"),
                           (["--arch", "dflash2", "--block_size", "2", "--conv_kernel_size", "3"], "--conv_kernel_size"),
                           (["--arch", "dflash2", "--selector_weight", "-1"], "--selector_weight"),
                           (["--arch", "transformer"], "--arch")):
        code, err = refused(argv)
        assert code == 2 and len(err.splitlines()) == 1 and argument in err, (argv, code, err)
    # Settings the target's shape refuses: by flag, after the target loads, before the data stage.
    monkeypatch.undo()
    target_dir = save_tiny_target_dir(tmp_path / "target", layers=6)
    code, err = refused(["--target_model_dir", str(target_dir), "--arch", "dflash2", "--conv_group_size", "7",
                         "--num_feature_layers", "2"])
    assert code == 2 and "--conv_group_size 7 does not divide the target's hidden size 32" in err, err
    assert not (tmp_path / "work" / "data").exists()
