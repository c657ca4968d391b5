"""SIGKILL at random moments: training, data generation and conversion leave either the previous
good state or the new complete one, and resumed training ends with a lossless drafter.

Each loop starts the real CLI (examples/train_dflash.py, examples/convert_checkpoint.py) in a
child process with slowed-down writes, kills it either after a random delay or right as its
k-th file write is under way (a hidden temporary has appeared), then checks every file a
user or a resumed run could read. The kill counts per stage are asserted, not assumed.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from kill_child import PRELOAD, run_cli
from tiny_dirs import save_tiny_target_dir

KILLS_PER_STAGE = 20
EXPORT_KILLS = 5
PROMPTS = 40
STEPS = 300
SAVE_EVERY = 10
TEMP_TAGS = (".tmp-", ".staging-", ".old-")


@pytest.fixture(scope="module")
def ctx():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _temporaries(directories: list[Path], marker: str = "") -> set[str]:
    found = set()
    for d in directories:
        if d.is_dir():
            found.update(str(d / e.name) for e in os.scandir(d) if e.name.startswith(".") and marker in e.name
                         and any(t in e.name for t in TEMP_TAGS))
    return found


def run_and_maybe_kill(ctx, script: str, argv: list[str], log: Path, watch: list[Path], *,
                       delay: float | None = None, at_write: tuple[str, int] | None = None) -> dict:
    """Start the CLI and SIGKILL it ``delay`` seconds after its start, or as soon as the
    ``k``-th temporary whose name contains ``marker`` appears, plus ``extra`` seconds
    (``at_write=(marker, k, extra)``: the write is then under way), or never (neither given).
    Returns what happened."""
    earlier = _temporaries(watch)  # left by an earlier kill: not this run's writes
    proc = ctx.Process(target=run_cli, args=(script, argv, str(log), delay is not None or at_write is not None))
    proc.start()
    started = time.monotonic()
    if delay is not None:
        proc.join(delay)
    elif at_write is not None:
        marker, k, extra = at_write
        seen: set[str] = set()
        while proc.is_alive() and time.monotonic() - started < 120:
            seen |= _temporaries(watch, marker) - earlier
            if len(seen) >= k:
                time.sleep(extra)
                break
            time.sleep(0.001)
    else:
        proc.join(300)
    killed = proc.is_alive()
    if killed:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it finished between is_alive() and the kill: not killed
            killed = False
    proc.join(60)
    exitcode = proc.exitcode
    proc.close()
    return {"killed": killed, "exitcode": exitcode, "temporaries_left": _temporaries(watch) - earlier}


def pick_kill(rng: random.Random, marker: str, remaining_writes: int, kills_needed: int) -> dict:
    """A random kill moment that still leaves room for ``kills_needed`` more kills: a random
    delay after the start (start-up included), or inside the k-th write of ``marker`` files,
    k drawn so that on average the stage does not finish before enough kills have landed."""
    if rng.random() < 0.25:
        return {"delay": rng.uniform(0.2, 1.0)}
    spread = max(2, remaining_writes // max(1, kills_needed))  # 2: a stage's last write is passed too
    return {"at_write": (marker, rng.randint(1, spread), rng.uniform(0.0, 0.03))}


# -------------------------------------------------------------------- validity checks


def check_work_dir(work: Path) -> dict:
    """Everything a resumed run reads must load; returns the state (data complete, step)."""
    state = {"data_complete": False, "step": None, "shards": 0}
    allowed = {"fingerprint.json", "data", "checkpoint.pt", "train_log.jsonl"}
    if not work.exists():
        return state
    visible = {p.name for p in work.iterdir() if not p.name.startswith(".")}
    assert visible <= allowed, f"unexpected files in the work dir: {visible - allowed}"
    if (work / "fingerprint.json").exists():
        assert isinstance(json.loads((work / "fingerprint.json").read_text()), dict)
    data = work / "data"
    if data.exists():
        for p in data.iterdir():
            if p.name.startswith("."):
                continue
            assert p.name == "meta.json" or (p.name.startswith("shard_") and p.suffix == ".pt"), p.name
            if p.suffix == ".pt":
                shard = torch.load(p, weights_only=True)
                assert len(shard["input_ids"]) == len(shard["features"]) > 0
                state["shards"] += 1
        if (data / "meta.json").exists():
            state["data_complete"] = bool(json.loads((data / "meta.json").read_text()).get("complete"))
    if (work / "checkpoint.pt").exists():
        ckpt = torch.load(work / "checkpoint.pt", weights_only=False)
        assert {"drafter", "optimizer", "step"} <= set(ckpt)
        state["step"] = ckpt["step"]
    if (work / "train_log.jsonl").exists():  # every line whole (each is one append)
        for line in (work / "train_log.jsonl").read_text().splitlines():
            assert isinstance(json.loads(line)["step"], int)
    return state


def check_drafter_dir(out: Path) -> bool:
    """Absent, or a complete drafter that loads (checksums included). True if present."""
    from tensorrt_llm_dflash.drafter import load_dflash_drafter

    if not out.exists():
        return False
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "training_metrics.json"}
    load_dflash_drafter(out)
    json.loads((out / "training_metrics.json").read_text())
    return True


def checkpoint_signature(out: Path) -> tuple | None:
    """(dtype, world size) of a converted checkpoint after checking that its files agree."""
    from safetensors import safe_open

    if not out.exists():
        return None
    config = json.loads((out / "config.json").read_text())
    world = config["mapping"]["world_size"]
    ranks = sorted(p.name for p in out.glob("rank*.safetensors"))
    assert ranks == [f"rank{r}.safetensors" for r in range(world)], (ranks, world)
    assert {p.name for p in out.iterdir()} == {"config.json", *ranks}
    want = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[config["dtype"]]
    for name in ranks:
        with safe_open(str(out / name), "pt") as f:
            for key in f.keys():
                if "d2t" in key or "draft_ids" in key:
                    continue
                dtype = f.get_slice(key).get_dtype()
                assert dtype in (want, "I64", "I32"), (name, key, dtype)
    return config["dtype"], world


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target_dir(tmp_path_factory.mktemp("kill") / "target", arch="qwen3", seed=3, layers=6)


def test_training_and_data_generation_survive_sigkill_and_resume_to_a_lossless_drafter(ctx, target_dir, tmp_path):
    from tensorrt_llm_dflash.decode import speculative_generate
    from tensorrt_llm_dflash.drafter import load_dflash_drafter
    from tensorrt_llm_dflash.proposer import DFlashProposer
    from tensorrt_llm_dflash.sampling import SamplingParams
    from tensorrt_llm_dflash.target import HFTargetVerifier, load_target

    work, out = tmp_path / "work", tmp_path / "drafter"
    argv = ["--target_model_dir", str(target_dir), "--output_dir", str(out), "--work_dir", str(work),
            "--num_prompts", str(PROMPTS), "--max_new_tokens", "6", "--gen_batch_size", "1", "--data_minutes", "0",
            "--train_minutes", "0", "--max_steps", str(STEPS), "--save_every", str(SAVE_EVERY), "--log_every", "150",
            "--num_feature_layers", "2", "--threads", "1"]
    rng = random.Random(2026)
    counts = {"data": 0, "train": 0, "export": 0}
    inside_write = {"data": 0, "train": 0, "export": 0}
    watch = [work, work / "data", tmp_path]
    log = tmp_path / "child.log"
    for _ in range(8 * KILLS_PER_STAGE):
        state = check_work_dir(work)
        if not state["data_complete"]:
            stage = "data"
            when = pick_kill(rng, ".shard_", PROMPTS - state["shards"], KILLS_PER_STAGE - counts["data"])
        elif (state["step"] or 0) < STEPS:
            stage = "train"
            when = pick_kill(rng, ".checkpoint.pt", (STEPS - (state["step"] or 0)) // SAVE_EVERY,
                             KILLS_PER_STAGE - counts["train"])
        elif counts["export"] < EXPORT_KILLS:
            stage = "export"
            when = ({"at_write": (f".{out.name}.staging-", 1, rng.uniform(0.0, 0.1))} if rng.random() < 0.7
                    else {"delay": rng.uniform(0.2, 1.0)})
        else:
            break
        # Enough kills in this stage: let it finish and kill in the next one.
        if stage == "data" and counts["data"] >= KILLS_PER_STAGE:
            stage, when = "train", {"at_write": (".checkpoint.pt", 1, 0.0)}
        elif stage == "train" and counts["train"] >= KILLS_PER_STAGE:
            stage, when = "export", {"at_write": (f".{out.name}.staging-", 1, rng.uniform(0.0, 0.1))}
        result = run_and_maybe_kill(ctx, "train_dflash", argv, log, watch, **when)
        check_work_dir(work)
        exported = check_drafter_dir(out)
        if not result["killed"]:
            assert result["exitcode"] == 0, log.read_text()[-3000:]
            continue
        counts[stage] += 1
        inside_write[stage] += bool(result["temporaries_left"])
        assert not exported or stage == "export", "a drafter was published before training finished"
    assert min(counts["data"], counts["train"]) >= KILLS_PER_STAGE and counts["export"] >= EXPORT_KILLS, counts
    assert min(inside_write.values()) > 0, inside_write

    final = run_and_maybe_kill(ctx, "train_dflash", argv, log, watch)
    assert final["exitcode"] == 0, log.read_text()[-3000:]
    assert check_work_dir(work)["step"] == STEPS
    assert check_drafter_dir(out)
    assert _temporaries(watch) == set(), "the finished run left temporaries behind"

    model, _ = load_target(target_dir, dtype=torch.float64)
    drafter = load_dflash_drafter(out, dtype=torch.float64)
    for budget in (0, 4):
        for prompt in ([5, 9, 12, 3], [7, 7, 30, 41, 2, 18]):
            ar = speculative_generate(HFTargetVerifier(model, []), None, prompt, 24, SamplingParams(), [], 0)
            spec = speculative_generate(HFTargetVerifier(model, drafter.config.target_layer_ids),
                                        DFlashProposer.for_target(drafter, model), prompt, 24, SamplingParams(), [],
                                        budget)
            assert spec.output_ids == ar.output_ids
    print(f"kills per stage {counts}, inside a write {inside_write}")


def test_conversion_survives_sigkill(ctx, target_dir, tmp_path):
    """A killed re-conversion leaves the previous checkpoint or the new one, never a mix."""
    from tiny_models import tiny_drafter

    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.target import load_target

    model, _ = load_target(target_dir, dtype=torch.float32)
    drafter_dir = tmp_path / "drafter"
    save_dflash_drafter(tiny_drafter(model, block_size=4, layers=1), drafter_dir, dtype=torch.float32)
    out = tmp_path / "ckpt"
    base = ["--model_dir", str(target_dir), "--dflash_model_dir", str(drafter_dir), "--output_dir", str(out),
            "--no_progress"]
    rng = random.Random(7)
    log = tmp_path / "child.log"
    first = run_and_maybe_kill(ctx, "convert_checkpoint", base + ["--tp_size", "2", "--dtype", "float32"], log,
                               [tmp_path])
    assert first["exitcode"] == 0, log.read_text()[-3000:]
    old = checkpoint_signature(out)
    assert old == ("float32", 2)
    new_argv = base + ["--tp_size", "1", "--dtype", "bfloat16"]
    seen, kills, inside = set(), 0, 0
    for _ in range(3 * KILLS_PER_STAGE):
        if kills >= KILLS_PER_STAGE:
            break
        when = ({"delay": rng.uniform(0.0, 1.0)} if rng.random() < 0.4 else
                {"at_write": (f".{out.name}.staging-", 1, rng.uniform(0.0, 0.15))})
        result = run_and_maybe_kill(ctx, "convert_checkpoint", new_argv, log, [tmp_path], **when)
        signature = checkpoint_signature(out)
        assert signature in (old, ("bfloat16", 1)), signature
        seen.add(signature)
        kills += result["killed"]
        inside += bool(result["temporaries_left"])
        if signature != old:  # published: start the next round from the old checkpoint again
            run_and_maybe_kill(ctx, "convert_checkpoint", base + ["--tp_size", "2", "--dtype", "float32"], log,
                               [tmp_path])
            assert checkpoint_signature(out) == old
    assert kills >= KILLS_PER_STAGE and inside > 0, (kills, inside)
    final = run_and_maybe_kill(ctx, "convert_checkpoint", new_argv, log, [tmp_path])
    assert final["exitcode"] == 0 and checkpoint_signature(out) == ("bfloat16", 1)
    print(f"conversion: {kills} kills, {inside} inside a write, states seen {seen}")
