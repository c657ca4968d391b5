"""DFlash training: the block mask, anchors, the loss going down, and train -> export -> lossless generation."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy, tiny_drafter, tiny_target

from tensorrt_llm_dflash.decode import speculative_generate
from tensorrt_llm_dflash.drafter import load_dflash_drafter, save_dflash_drafter
from tensorrt_llm_dflash.proposer import DFlashProposer
from tensorrt_llm_dflash.target import HFTargetVerifier
from tensorrt_llm_dflash.training.data import Sequence, capture_hidden_states
from tensorrt_llm_dflash.training.model import OnlineDFlashModel, sample_anchors, training_mask_bool
from tensorrt_llm_dflash.training.trainer import TrainConfig, train


def brute_force_mask(anchors, keep, seq_len, block):
    b, n = anchors.shape
    out = torch.zeros(b, n * block, seq_len + n * block, dtype=torch.bool)
    for i in range(b):
        for q in range(n * block):
            qb = q // block
            for k in range(seq_len + n * block):
                if k < seq_len:
                    out[i, q, k] = bool(keep[i, qb]) and k < int(anchors[i, qb])
                else:
                    out[i, q, k] = (k - seq_len) // block == qb
    return out


@pytest.mark.parametrize("seed", range(6))
def test_dense_training_mask_equals_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    b, s, n, block = 2, 13, 3, 4
    loss_mask = torch.rand(b, s, generator=g) > 0.3
    anchors, keep = sample_anchors(loss_mask, n, g)
    assert torch.equal(training_mask_bool(anchors, keep, s, block), brute_force_mask(anchors, keep, s, block))


@pytest.mark.parametrize("seed", range(20))
def test_anchors_only_at_valid_positions(seed):
    g = torch.Generator().manual_seed(seed)
    b, s = 3, 40
    loss_mask = torch.rand(b, s, generator=g) > 0.5
    loss_mask[0] = False  # a sequence with nothing to learn keeps no anchor
    anchors, keep = sample_anchors(loss_mask, 8, g)
    for i in range(b):
        for a, k in zip(anchors[i].tolist(), keep[i].tolist()):
            if k:
                assert a + 1 < s and loss_mask[i, a] and loss_mask[i, a + 1]
        kept = [a for a, k in zip(anchors[i].tolist(), keep[i].tolist()) if k]
        assert kept == sorted(set(kept))
        valid = int((loss_mask[i, :-1] & loss_mask[i, 1:]).sum())
        assert len(kept) == min(8, valid)
    assert not keep[0].any()


def _data(target, layer_ids, count=48, prompt_len=5, answer=24):
    seqs = []
    for i in range(count):
        g = torch.Generator().manual_seed(100 + i)
        prompt = torch.randint(2, target.config.vocab_size - 1, (prompt_len,), generator=g).tolist()
        # Sampled (not greedy) answers: greedy answers of a random tiny model fall into short
        # cycles that make every block position equally easy; with sampling, uncertainty compounds
        # with distance, as it does in real text.
        torch.manual_seed(1000 + i)
        out = target.generate(torch.tensor([prompt]), max_new_tokens=answer, do_sample=True, temperature=0.7,
                              top_k=0, eos_token_id=None, pad_token_id=1)
        full = out[0].tolist()
        feats, final = capture_hidden_states(target, [full], layer_ids, 1)[0]
        mask = torch.zeros(len(full), dtype=torch.bool)
        mask[prompt_len:] = True
        seqs.append(Sequence(torch.tensor(full), mask, feats, final))
    return seqs


def markov_like_target():
    """A tiny Qwen3 whose next token depends mostly on the current one (weak decoder layers, a
    strong untied lm_head): sampled text is then a peaked Markov chain, so the first draft
    position is predictable from the anchor and uncertainty compounds with distance, as in
    real text."""
    target = tiny_target("qwen3", seed=4, vocab=24, dtype=torch.float32)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if ".layers." in name and p.dim() > 1:
                p.mul_(0.1)
        target.lm_head.weight.mul_(3.0)
    return target


def untrained_drafter(target):
    drafter = tiny_drafter(target, block_size=4, seed=4).float()
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.mul_(0.1)
    return drafter


@pytest.fixture(scope="module")
def setup():
    target = markov_like_target()
    drafter = untrained_drafter(target)
    return target, drafter, _data(target, drafter.config.target_layer_ids)


def test_flex_attention_loss_equals_dense(setup):
    pytest.importorskip("torch.nn.attention.flex_attention")
    target, drafter, seqs = setup
    batch = {"input_ids": torch.stack([s.input_ids for s in seqs[:2]]),
             "loss_mask": torch.stack([s.loss_mask for s in seqs[:2]]),
             "features": torch.stack([s.features for s in seqs[:2]]).float()}
    losses = {}
    for attention in ("dense", "flex"):
        online = OnlineDFlashModel(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                                   num_anchors=6, gamma=4.0, attention=attention)
        with torch.no_grad():  # flex attention has no CPU backward; the forward is what must agree
            losses[attention] = online(**batch, generator=torch.Generator().manual_seed(0))["loss"]
    torch.testing.assert_close(losses["flex"], losses["dense"], rtol=1e-5, atol=1e-5)


def test_loss_falls_and_position_one_is_most_accurate_then_round_trip(setup, tmp_path):
    target, drafter, seqs = setup
    online = OnlineDFlashModel(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                               num_anchors=8, gamma=4.0)
    result = train(online, seqs, TrainConfig(lr=3e-3, max_steps=300, log_every=50, save_every=10_000, batch_size=4,
                                             eval_fraction=0.15), tmp_path / "work", resume=False)
    history = result["history"]
    assert history[-1]["train_loss"] < 0.8 * history[0]["train_loss"]
    acc = history[-1]["train_acc"]
    assert acc[0] == max(acc)

    # Resume continues from the checkpoint rather than starting over.
    more = train(online, seqs, TrainConfig(lr=3e-3, max_steps=310, log_every=5, save_every=10_000, batch_size=4,
                                           eval_fraction=0.15), tmp_path / "work", resume=True)
    assert more["final"]["steps"] == 310

    # Export in the published format, load it in the runtime, generate losslessly in float64.
    save_dflash_drafter(online.drafter, tmp_path / "drafter", dtype=torch.float32)
    loaded = load_dflash_drafter(tmp_path / "drafter", dtype=torch.float64)
    target64 = target.to(torch.float64)
    try:
        proposer = DFlashProposer.for_target(loaded, target64)
        prompt = seqs[0].input_ids[:5].tolist()
        verifier = HFTargetVerifier(target64, loaded.config.target_layer_ids)
        for budget in (0, 6):
            out = speculative_generate(verifier, proposer, prompt, 20, ddtree_budget=budget)
            assert out.output_ids == hf_greedy(target64, prompt, 20)
            assert max(out.stats.acceptance_lengths) > 1  # the trained drafter gets tokens accepted
    finally:
        target.to(torch.float32)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_generation_records_the_features_of_a_full_forward(arch):
    """Batched, left-padded greedy generation that drops finished rows gives each prompt HF's own
    greedy answer and, at every fed position, the features a full forward pass computes."""
    from tensorrt_llm_dflash.training.data import generate_with_hidden_states

    target = tiny_target(arch, seed=1, dtype=torch.float64)
    prompts = [torch.randint(2, target.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (3, 7, 5, 11)]
    # A stop token from the middle of one answer: that row leaves the batch early.
    stop = generate_with_hidden_states(target, prompts[:1], [0], 12, set(), 1)[0].answer[3]
    generated = generate_with_hidden_states(target, prompts, [0, 1], 12, {stop}, 1)
    lengths = set()
    for prompt, g in zip(prompts, generated):
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=stop,
                              pad_token_id=1)[0, len(prompt):].tolist()
        assert g.answer == ref
        lengths.add(len(g.answer))
        full = prompt + g.answer
        feats, final = capture_hidden_states(target, [full], [0, 1], 1)[0]
        assert g.features.shape == feats.shape and g.final_hidden.shape == final.shape
        torch.testing.assert_close(g.features[:-1], feats[:-1], rtol=0, atol=0)
        torch.testing.assert_close(g.final_hidden[:-1], final[:-1], rtol=0, atol=0)
    assert len(lengths) > 1, "rows must finish at different steps for this test to cover row dropping"


def test_training_prompts_never_ask_for_a_humaneval_function():
    from tensorrt_llm_dflash.training.prompts import (
        build_prompt_set,
        check_no_overlap,
        humaneval_entry_points,
        is_plain_prompt,
    )

    prompts = build_prompt_set()
    assert len(set(prompts)) > 2000
    assert prompts == build_prompt_set(), "the prompt set must be deterministic"
    check_no_overlap(prompts)
    # No default value's repr: memory addresses differ per run, os.environ would leak the machine.
    assert not any(" at 0x" in p or "environ(" in p or "<built-in " in p for p in prompts)
    assert not is_plain_prompt("def parse(fp=None, environ=environ({'HOME': '/root'})):\n")
    assert not is_plain_prompt("def f(key=<function <lambda> at 0x7f5f84ae3ce0>):\n")
    entry = sorted(humaneval_entry_points())[0]
    for leak in (f"def {entry}(x):\n    pass\n", f"Write a Python function `{entry}(x)`. Do it."):
        with pytest.raises(ValueError, match=entry):
            check_no_overlap(prompts[:3] + [leak])


def test_doctest_task_prompts_have_correct_examples_in_humaneval_format():
    import doctest

    from tensorrt_llm_dflash.training.doctest_tasks import TASKS, doctest_prompts
    from tensorrt_llm_dflash.training.prompts import build_prompt_set

    prompts = doctest_prompts()
    assert len(prompts) == 16 * len(TASKS) and len(set(prompts)) == len(prompts)
    assert prompts == doctest_prompts(), "deterministic for a seed"
    assert set(prompts) <= set(build_prompt_set()), "they are part of the training prompt set"
    by_name = {name: task.reference for task in TASKS for name in task.names}
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for prompt in prompts:
        name = prompt.split("def ", 1)[1].split("(", 1)[0]
        assert prompt.startswith("from typing import") == ("List[" in prompt or "Dict[" in prompt or "Tuple[" in prompt)
        docstring = prompt.split('"""')[1]
        test = parser.get_doctest(docstring, {name: by_name[name]}, name, None, 0)
        assert test.examples, prompt
        result = runner.run(test, out=lambda _: None)
        assert result.failed == 0, f"a wrong example in:\n{prompt}"
    # The test can fail: a wrong expected value is caught.
    bad = parser.get_doctest(">>> count_negatives([-1, 2])\n2\n", {"count_negatives": by_name["count_negatives"]},
                             "bad", None, 0)
    assert runner.run(bad, out=lambda _: None).failed == 1
    # A HumanEval entry point among a task's names is skipped.
    first = TASKS[0].names[0]
    assert all(f"def {first}(" not in p for p in doctest_prompts(exclude_names={first}))


class _CharTokenizer:
    """Just enough of a chat tokenizer for the data stage: one token per character."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [2 + ord(c) % 60 for c in messages[0]["content"]]


def test_data_stage_resumes_by_prompt_content(tmp_path):
    """A second run over a changed, reordered prompt list answers only the prompts no shard has,
    skips prompts over the length cap, and numbers its shards after the existing ones."""
    from tensorrt_llm_dflash.training.data import build_distillation_data, load_distillation_data

    target = tiny_target("llama", seed=2, dtype=torch.float32)
    first = ["abc", "hello", "xyz!", "qq"]
    meta = build_distillation_data(tmp_path, target, _CharTokenizer(), first, [0, 1], max_new_tokens=5, batch_size=2)
    assert meta["sequences"] == 4 and meta["complete"]
    second = ["qq", "new one", "abc", "fresh", "x" * 50]
    meta = build_distillation_data(tmp_path, target, _CharTokenizer(), second, [0, 1], max_new_tokens=5,
                                   batch_size=2, max_prompt_tokens=20)
    assert meta["sequences"] == 6 and meta["batches"] == 3
    seqs = load_distillation_data(tmp_path)
    prompts = sorted(tuple(s.input_ids[~s.loss_mask].tolist()) for s in seqs)
    expected = sorted(tuple(_CharTokenizer().apply_chat_template([{"content": p}]))
                      for p in ["abc", "hello", "xyz!", "qq", "new one", "fresh"])
    assert prompts == expected


def test_bf16_autocast_training_matches_fp32_loss_and_learns(setup, tmp_path):
    """--precision bf16: the autocast forward gives the fp32 loss to bf16 accuracy, the loss falls,
    and the trained weights stay fp32 (what gets exported is not quantised by training)."""
    from tensorrt_llm_dflash.training.trainer import _autocast

    target, _, seqs = setup  # the fixture's drafter may have been trained by another test
    online = OnlineDFlashModel(untrained_drafter(target), target.get_input_embeddings().weight,
                               target.get_output_embeddings().weight, num_anchors=8, gamma=4.0)
    batch = {"input_ids": torch.stack([s.input_ids for s in seqs[:4]]),
             "loss_mask": torch.stack([s.loss_mask for s in seqs[:4]]),
             "features": torch.stack([s.features for s in seqs[:4]]).float()}
    with torch.no_grad():
        fp32 = online(**batch, generator=torch.Generator().manual_seed(0))["loss"]
        with _autocast(online, "bf16"):
            bf16 = online(**batch, generator=torch.Generator().manual_seed(0))["loss"]
    torch.testing.assert_close(bf16.float(), fp32, rtol=2e-2, atol=2e-2)
    assert bf16.item() != fp32.item(), "autocast was not active"

    result = train(online, seqs, TrainConfig(lr=3e-3, max_steps=150, log_every=50, save_every=10_000, batch_size=4,
                                             eval_fraction=0.15, precision="bf16"), tmp_path / "work", resume=False)
    history = result["history"]
    assert history[-1]["train_loss"] < 0.8 * history[0]["train_loss"]
    assert all(p.dtype == torch.float32 for p in online.drafter.parameters())


def test_unknown_precision_is_refused_by_name():
    from tensorrt_llm_dflash.errors import DFlashConfigError

    with pytest.raises(DFlashConfigError, match="precision='fp16'"):
        TrainConfig(precision="fp16")


@pytest.mark.parametrize("seed", range(4))
def test_chain_metric_counts_the_leading_run_of_each_block(seed):
    """The teacher-forced chain acceptance equals a per-block loop: count correct positions
    until the first wrong or label-less one; blocks without a first label are not anchors."""
    from tensorrt_llm_dflash.training.model import block_metrics

    g = torch.Generator().manual_seed(seed)
    correct = torch.rand(3, 5, 7, generator=g) < 0.7
    valid = torch.rand(3, 5, 7, generator=g) < 0.9
    accepted, anchors = 0, 0
    for b in range(3):
        for n in range(5):
            if not valid[b, n, 0]:
                continue
            anchors += 1
            for k in range(7):
                if not (valid[b, n, k] and correct[b, n, k]):
                    break
                accepted += 1
    out = block_metrics(correct & valid, valid)
    assert out["chain_accepted"].item() == accepted and out["chain_anchors"].item() == anchors
    assert out["count"].tolist() == valid.sum((0, 1)).float().tolist()
    # Split by copyable anchors: the copyable share is the same loop restricted to them.
    copyable = torch.rand(3, 5, generator=g) < 0.5
    split = block_metrics(correct & valid, valid, copyable)
    only = block_metrics(correct & valid & copyable[..., None], valid & copyable[..., None])
    assert split["chain_accepted_copyable"].item() == only["chain_accepted"].item()
    assert split["chain_anchors_copyable"].item() == only["chain_anchors"].item()
    assert split["chain_accepted"].item() == accepted


@pytest.mark.parametrize("seed", range(6))
def test_copyable_anchors_follow_the_benchmark_rule(seed):
    """An anchor is copyable iff the bigram ending at it ends somewhere earlier too: the same rule
    (and a brute-force scan) as the benchmark's per-step split."""
    from tensorrt_llm_dflash import bench
    from tensorrt_llm_dflash.training.model import copyable_anchors

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4, (2, 30), generator=g)
    anchors = torch.sort(torch.randint(0, 30, (2, 9), generator=g), dim=1).values
    got = copyable_anchors(ids, anchors)
    for b in range(2):
        t = ids[b].tolist()
        for n, a in enumerate(anchors[b].tolist()):
            want = a >= 1 and any((t[p - 1], t[p]) == (t[a - 1], t[a]) for p in range(1, a))
            assert bool(got[b, n]) == want
            if a >= 1:  # one step whose last committed token is the anchor
                assert bench.copyable_steps(t[:a], t[a:], [1]) == [want]


def test_prompt_set_does_not_depend_on_the_calling_process(tmp_path):
    """A ``chunk.py`` beside the calling script (sys.path[0]) must not replace the stdlib's
    ``chunk``, and an earlier ``import torch`` (which patches ``inspect.getfile``) must not drop
    a function: the set, and so the data order of a training run, would change with the
    directory a script runs from and what it imported first."""
    import subprocess
    import sys

    script = ("import hashlib, sys\n"
              "from tensorrt_llm_dflash.training.prompts import build_prompt_set\n"
              "prompts = build_prompt_set()\n"
              "print(len(prompts), hashlib.sha256('\\n'.join(prompts).encode()).hexdigest(),\n"
              "      any('read_shadow_chunk' in p for p in prompts))\n")
    results = []
    for name, shadow in (("clean", False), ("shadowed", True), ("after_torch", False)):
        folder = tmp_path / name
        folder.mkdir()
        # torch replaces inspect.getfile when imported: the scan must not see the replacement.
        (folder / "count.py").write_text(("import torch\n" if name == "after_torch" else "") + script)
        if shadow:
            (folder / "chunk.py").write_text(
                "def read_shadow_chunk(size):\n"
                "    '''Read one chunk of the given size from the shadowing module of this test.'''\n")
        out = subprocess.run([sys.executable, str(folder / "count.py")], cwd=folder, capture_output=True, text=True,
                             check=True, timeout=300)
        results.append(out.stdout.split())
    assert results[0][2] == results[1][2] == "False"
    assert results[0] == results[1], "the shadowing file changed the prompt set"
    assert results[0] == results[2], "importing torch first changed the prompt set"
