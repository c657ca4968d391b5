"""Nothing is lost: atomic files, directory results published whole, damaged shards and checkpoints
named and rebuilt on resume, and a work dir that refuses a target it was not made for."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from example_cli import load_example
from tiny_dirs import save_tiny_target_dir
from tiny_models import tiny_drafter, tiny_target

from tensorrt_llm_dflash.errors import DFlashConfigError, DFlashInputError
from tensorrt_llm_dflash.files import atomic_torch_save, atomic_write, atomic_write_text, publish_dir


class Boom(Exception):
    pass


def _fail_midway(f):
    f.write(b"half of the new conte")
    raise Boom


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "checkpoint.pt"
    atomic_torch_save({"step": 1}, path)
    with pytest.raises(Boom):
        atomic_write(path, _fail_midway)
    assert torch.load(path) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_a_failed_publish_leaves_the_previous_directory(tmp_path):
    out = tmp_path / "ckpt"
    with publish_dir(out, ["config.json", "rank*.safetensors"]) as staging:
        atomic_write_text(staging / "config.json", "old")
        atomic_write_text(staging / "rank0.safetensors", "r0")
    with pytest.raises(Boom), publish_dir(out, ["config.json", "rank*.safetensors"]) as staging:
        atomic_write_text(staging / "config.json", "new")
        raise Boom
    assert (out / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_republished_directory_drops_stale_result_files_and_keeps_the_users_own(tmp_path):
    out = tmp_path / "ckpt"
    with publish_dir(out, ["config.json", "rank*.safetensors"]) as staging:
        for name in ("config.json", "rank0.safetensors", "rank1.safetensors"):
            atomic_write_text(staging / name, "tp2")
    (out / "NOTES.md").write_text("mine")
    with publish_dir(out, ["config.json", "rank*.safetensors"]) as staging:
        atomic_write_text(staging / "config.json", "tp1")
        atomic_write_text(staging / "rank0.safetensors", "tp1")
    assert sorted(p.name for p in out.iterdir()) == ["NOTES.md", "config.json", "rank0.safetensors"]
    assert (out / "rank0.safetensors").read_text() == "tp1" and (out / "NOTES.md").read_text() == "mine"


def test_a_republished_directory_keeps_the_users_subdirectories_and_links(tmp_path):
    """A conversion written over the directory holding its input models, or a training run whose work directory is
    inside its output: every subdirectory and link the result does not own is carried over (a hard-linked copy: the
    same data), an owned subdirectory is replaced, and a failed publish leaves everything where it was."""
    out = tmp_path / "demo"
    (out / "target" / "nested").mkdir(parents=True)
    (out / "target" / "model.safetensors").write_bytes(b"weights")
    (out / "target" / "nested" / "deep.txt").write_text("deep")
    (out / "work").mkdir()
    (out / "work" / "checkpoint.pt").write_bytes(b"ckpt")
    (out / "stale_shards").mkdir()
    (out / "stale_shards" / "x").write_text("old")
    (out / "link").symlink_to("target/model.safetensors")
    owned = ["config.json", "stale_shards"]
    with pytest.raises(Boom), publish_dir(out, owned) as staging:
        raise Boom
    with publish_dir(out, owned) as staging:
        atomic_write_text(staging / "config.json", "new")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "link", "target", "work"]
    assert (out / "target" / "model.safetensors").read_bytes() == b"weights"
    assert (out / "target" / "nested" / "deep.txt").read_text() == "deep"
    assert (out / "work" / "checkpoint.pt").read_bytes() == b"ckpt"
    assert (out / "link").is_symlink() and (out / "link").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no staging or old directory left


def test_the_current_directory_is_refused_before_the_work(tmp_path, monkeypatch):
    """``--output_dir .`` once failed at the very end (EBUSY renaming "."), after all the work."""
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    for final in (".", tmp_path / "run", tmp_path):
        ran = False
        with pytest.raises(DFlashInputError, match="holds\\) the current directory"):
            with publish_dir(final, ["config.json"]):
                ran = True
        assert not ran


def test_reconverting_with_fewer_ranks_leaves_no_stale_rank_and_a_failure_keeps_the_old_checkpoint(tmp_path):
    """The reported defect: a failed re-conversion left config.json bf16, rank0 fp32, rank1 bf16."""
    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.trtllm.weight import convert_checkpoint

    target_dir = save_tiny_target_dir(tmp_path / "target", layers=4)
    model = tiny_target("qwen3", seed=0, vocab=64, layers=4, dtype=torch.float32, max_positions=512)
    save_dflash_drafter(tiny_drafter(model, block_size=4), tmp_path / "drafter", dtype=torch.float32)
    out = tmp_path / "ckpt"
    convert_checkpoint(target_dir, tmp_path / "drafter", out, dtype="float32", tp_size=2, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.safetensors", "rank1.safetensors"]
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    import safetensors.torch

    calls = {"n": 0}
    real = safetensors.torch.save_file

    def disk_full_on_second_rank(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real(tensors, filename, metadata=metadata)

    safetensors.torch.save_file = disk_full_on_second_rank
    try:
        with pytest.raises(OSError):
            convert_checkpoint(target_dir, tmp_path / "drafter", out, dtype="bfloat16", tp_size=2, progress=False)
    finally:
        safetensors.torch.save_file = real
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "drafter", "target"]

    convert_checkpoint(target_dir, tmp_path / "drafter", out, dtype="bfloat16", tp_size=1, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.safetensors"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


class _CharTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [2 + ord(c) % 60 for c in messages[0]["content"]]


def test_a_damaged_shard_is_named_and_its_prompts_answered_again(tmp_path, capsys):
    from tensorrt_llm_dflash.training.data import build_distillation_data, load_distillation_data

    target = tiny_target("llama", seed=2, dtype=torch.float32)
    prompts = ["abc", "hello", "xyz!", "qq"]
    build_distillation_data(tmp_path, target, _CharTokenizer(), prompts, [0, 1], max_new_tokens=4, batch_size=1)
    shards = sorted(tmp_path.glob("shard_*.pt"))
    assert len(shards) == 4
    shards[1].write_bytes(shards[1].read_bytes()[:100])  # truncated, as an in-place write killed midway left it
    meta = build_distillation_data(tmp_path, target, _CharTokenizer(), prompts, [0, 1], max_new_tokens=4,
                                   batch_size=1)
    out = capsys.readouterr().out
    assert f"damaged data shard {shards[1]}" in out and "answered again" in out
    assert meta["sequences"] == 4
    names = sorted(p.name for p in tmp_path.glob("shard_*.pt"))
    assert names == ["shard_00000.pt", "shard_00002.pt", "shard_00003.pt", "shard_00004.pt"]  # no overwrite
    answered = sorted(tuple(s.input_ids[~s.loss_mask].tolist()) for s in load_distillation_data(tmp_path))
    assert answered == sorted(tuple(_CharTokenizer().apply_chat_template([{"content": p}])) for p in prompts)


def test_a_damaged_checkpoint_is_set_aside_and_training_starts_over(tmp_path, capsys):
    from tensorrt_llm_dflash.training.trainer import CHECKPOINT, load_checkpoint

    model = tiny_target("qwen3", seed=0, vocab=64, layers=4, dtype=torch.float32)
    drafter = tiny_drafter(model, block_size=4).float()
    (tmp_path / CHECKPOINT).write_bytes(b"PK\x03\x04 truncated zip")
    assert load_checkpoint(tmp_path / CHECKPOINT, drafter) is None
    assert "damaged checkpoint" in capsys.readouterr().out
    assert (tmp_path / (CHECKPOINT + ".damaged")).exists() and not (tmp_path / CHECKPOINT).exists()

    other = tiny_drafter(model, block_size=4, layers=2).float()
    torch.save({"drafter": other.state_dict(), "optimizer": {}, "step": 5, "elapsed": 1.0, "history": [],
                "rng": None}, tmp_path / CHECKPOINT)
    bigger = tiny_drafter(model, block_size=4, layers=2, intermediate_size=96).float()
    with pytest.raises(DFlashConfigError, match="made for another drafter: tensor .*mlp"):
        load_checkpoint(tmp_path / CHECKPOINT, bigger)


def test_work_dir_refuses_a_second_target_of_the_same_shape(tmp_path, capsys):
    """The reported defect: a second target of the same shape reused the first one's data and checkpoint."""
    train_dflash = load_example("train_dflash")

    first = save_tiny_target_dir(tmp_path / "first", seed=1)
    second = save_tiny_target_dir(tmp_path / "second", seed=2)  # same config, same tokenizer, other weights
    work = tmp_path / "work"
    common = ["--work_dir", str(work), "--num_prompts", "2", "--max_new_tokens", "3", "--data_minutes", "0",
              "--train_minutes", "0", "--max_steps", "2", "--log_every", "1", "--num_feature_layers", "2",
              "--threads", "1"]
    assert train_dflash.main(["--target_model_dir", str(first), "--output_dir", str(tmp_path / "d1"), *common]) == 0
    capsys.readouterr()
    assert train_dflash.main(["--target_model_dir", str(second), "--output_dir", str(tmp_path / "d2"), *common]) == 2
    err = capsys.readouterr().err
    assert f"--work_dir {str(work)!r} was made for another target" in err and "weights_sha256" in err
    assert not (tmp_path / "d2").exists()
    # The same target resumes; a changed data recipe is refused by name.
    assert train_dflash.main(["--target_model_dir", str(first), "--output_dir", str(tmp_path / "d1"), *common]) == 0
    changed = [a if a != "3" else "5" for a in common]
    assert train_dflash.main(["--target_model_dir", str(first), "--output_dir", str(tmp_path / "d1"), *changed]) == 2
    assert "data.max_new_tokens 3 (recorded) != 5 (now)" in capsys.readouterr().err
    # A work dir with data but no fingerprint (made before fingerprints, or by hand) is refused too.
    os.remove(work / "fingerprint.json")
    assert train_dflash.main(["--target_model_dir", str(first), "--output_dir", str(tmp_path / "d1"), *common]) == 2
    assert "no fingerprint.json" in capsys.readouterr().err


def test_lora_inject_training_end_to_end_publishes_a_lossless_adapter_and_guards_its_data(tmp_path, capsys):
    """examples/train_dflash_lora_inject.py on the shards of a DFlash work dir: the adapter is
    published whole and decodes losslessly; another target may not train on those shards."""
    from tensorrt_llm_dflash.decode import speculative_generate
    from tensorrt_llm_dflash.lora_inject import build_lora_inject_proposer
    from tensorrt_llm_dflash.sampling import SamplingParams
    from tensorrt_llm_dflash.target import HFTargetVerifier, load_target

    first = save_tiny_target_dir(tmp_path / "first", seed=1)
    work = tmp_path / "work"
    assert load_example("train_dflash").main([
        "--target_model_dir", str(first), "--output_dir", str(tmp_path / "d1"), "--work_dir", str(work),
        "--num_prompts", "3", "--max_new_tokens", "4", "--data_minutes", "0", "--train_minutes", "0",
        "--max_steps", "1", "--log_every", "1", "--num_feature_layers", "2", "--threads", "1"]) == 0
    lora = load_example("train_dflash_lora_inject")
    common = ["--data_dir", str(work / "data"), "--train_minutes", "0", "--max_steps", "4", "--log_every", "2",
              "--block_size", "4", "--lora_rank", "4", "--threads", "1"]
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "NOTES.md").write_text("mine")
    assert lora.main(["--target_model_dir", str(first), "--work_dir", str(tmp_path / "lw"), "--output_dir", str(out),
                      *common]) == 0
    assert {p.name for p in out.iterdir()} == {"NOTES.md", "README.md", "adapter_config.json",
                                               "adapter_model.safetensors", "dflash_lora_inject.json",
                                               "draft_vocab.safetensors", "training_metrics.json"}
    model, _ = load_target(first, dtype=torch.float64)
    verifier, proposer = build_lora_inject_proposer(model, out)
    ar = speculative_generate(HFTargetVerifier(model, []), None, [5, 9, 12], 16, SamplingParams(), [], 0)
    for budget in (0, 4):
        assert speculative_generate(verifier, proposer, [5, 9, 12], 16, SamplingParams(), [], budget).output_ids \
            == ar.output_ids
    capsys.readouterr()
    second = save_tiny_target_dir(tmp_path / "second", seed=2)
    assert lora.main(["--target_model_dir", str(second), "--work_dir", str(tmp_path / "lw2"), "--output_dir",
                      str(tmp_path / "adapter2"), *common]) == 2
    assert f"--data_dir {str(work)!r} was made for another target" in capsys.readouterr().err


# ------------------------------------------------------------------ packed weights


def _packed_dir(tmp_path: Path) -> tuple[Path, bytes]:
    import lzma

    source = tmp_path / "drafter"
    source.mkdir()
    payload = bytes(range(256)) * 1000
    (source / "model.safetensors.xz").write_bytes(lzma.compress(payload))
    (source / "config.json").write_text('{"a": 1}')
    (source / ".hidden").write_text("not copied")
    return source, payload


def test_unpacked_makes_one_complete_plain_copy(tmp_path, monkeypatch):
    from tensorrt_llm_dflash.files import unpacked

    monkeypatch.setenv("TENSORRT_LLM_DFLASH_CACHE", str(tmp_path / "cache"))
    source, payload = _packed_dir(tmp_path)
    plain = unpacked(source)
    assert plain != source and plain.parent == tmp_path / "cache" / "unpacked"
    assert (plain / "model.safetensors").read_bytes() == payload
    assert (plain / "config.json").read_text() == '{"a": 1}' and not (plain / ".hidden").exists()
    assert not (plain / "model.safetensors.xz").exists()
    mtime = (plain / "model.safetensors").stat().st_mtime_ns
    assert unpacked(source) == plain and (plain / "model.safetensors").stat().st_mtime_ns == mtime  # made once
    assert [p.name for p in plain.parent.iterdir()] == [plain.name]  # no staging left behind
    # A plain directory (or one whose packed file already has its unpacked sibling) is used as it is.
    assert unpacked(plain) == plain
    (source / "model.safetensors").write_bytes(payload)
    assert unpacked(source) == source


def test_unpacked_refuses_a_damaged_archive_and_leaves_nothing(tmp_path, monkeypatch):
    from tensorrt_llm_dflash.files import unpacked

    monkeypatch.setenv("TENSORRT_LLM_DFLASH_CACHE", str(tmp_path / "cache"))
    source, _ = _packed_dir(tmp_path)
    archive = source / "model.safetensors.xz"
    archive.write_bytes(archive.read_bytes()[:-40])
    with pytest.raises(DFlashInputError, match="model.safetensors.xz are damaged"):
        unpacked(source)
    assert list((tmp_path / "cache" / "unpacked").iterdir()) == []


def test_unpacked_loses_a_race_gracefully(tmp_path, monkeypatch):
    """Two processes unpacking at once: the second rename finds the first's complete copy and uses it."""
    import tensorrt_llm_dflash.files as files

    monkeypatch.setenv("TENSORRT_LLM_DFLASH_CACHE", str(tmp_path / "cache"))
    source, payload = _packed_dir(tmp_path)
    first = files.unpacked(source)
    real_is_dir = Path.is_dir
    calls = {"n": 0}

    def not_there_yet(self: Path) -> bool:  # the other process has not published when this one looks
        if self == first and calls["n"] == 0:
            calls["n"] += 1
            return False
        return real_is_dir(self)

    monkeypatch.setattr(Path, "is_dir", not_there_yet)
    assert files.unpacked(source) == first
    assert (first / "model.safetensors").read_bytes() == payload
    assert [p.name for p in first.parent.iterdir()] == [first.name]


def test_shipped_assets_are_packed_and_load():
    """The demo drafter and the LoRA-inject adapter ship xz-packed (a third smaller than bf16 raw) and load
    through the loaders as plain directories."""
    from tensorrt_llm_dflash.assets import DEMO_DRAFTER_DIR, demo_drafter_dir
    from tensorrt_llm_dflash.drafter import load_dflash_drafter
    from tensorrt_llm_dflash.lora_inject import SHIPPED_DRAFTER_DIR

    assert (DEMO_DRAFTER_DIR / "model.safetensors.xz").is_file()
    assert (SHIPPED_DRAFTER_DIR / "adapter_model.safetensors.xz").is_file()
    plain = demo_drafter_dir()
    assert (plain / "model.safetensors").is_file() and (plain / "config.json").is_file()
    assert load_dflash_drafter(DEMO_DRAFTER_DIR).config.block_size == load_dflash_drafter(plain).config.block_size
