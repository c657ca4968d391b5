"""examples/run.py keeps what it generated: --output_json is written after every prompt, an error
or Ctrl-C saves the finished generations and exits cleanly, and --streaming prints exactly the
decoded text (multi-byte characters included)."""

from __future__ import annotations

import json

import pytest
from example_cli import load_example
from tiny_dirs import save_tiny_target_dir

from tensorrt_llm_dflash.errors import DFlashInputError


@pytest.fixture(scope="module")
def run_module():
    return load_example("run")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target_dir(tmp_path_factory.mktemp("run") / "target", arch="llama", seed=5, layers=2)


def _argv(target_dir, out, prompts):
    return ["--target_model_dir", str(target_dir), "--speculative_decoding_mode", "none", "--max_output_len", "6",
            "--output_json", str(out), "--threads", "1", "--input_text", *prompts]


def _interrupting(real, on_call: int, exc: BaseException, seen: list):
    """speculative_generate that raises ``exc`` on its ``on_call``-th call, recording the
    --output_json contents it finds at every call."""
    calls = {"n": 0}

    def generate(*args, **kwargs):
        calls["n"] += 1
        seen.append(calls["n"])
        if calls["n"] == on_call:
            raise exc
        return real(*args, **kwargs)

    return generate


@pytest.mark.parametrize("exc, code, status", [(KeyboardInterrupt(), 130, "interrupted"),
                                               (DFlashInputError("prompt refused"), 2, "error")])
def test_finished_generations_survive_an_interrupt_or_a_later_error(run_module, target_dir, tmp_path, monkeypatch,
                                                                    capsys, exc, code, status):
    import tensorrt_llm_dflash.decode as decode

    out = tmp_path / "results.json"
    snapshots: list = []
    monkeypatch.setattr(decode, "speculative_generate",
                        _interrupting(decode.speculative_generate, 3, exc, snapshots))
    rc = run_module.main(_argv(target_dir, out, ["abc", "hello there", "third one"]))
    err = capsys.readouterr().err
    assert rc == code
    saved = json.loads(out.read_text())
    assert saved["status"] == status
    assert [o["prompt"] for o in saved["outputs"]] == ["abc", "hello there"]
    assert all(len(o["output_ids"]) == 6 for o in saved["outputs"])
    assert "saved 2 finished generation(s)" in err and "Traceback" not in err


def test_results_are_on_disk_after_every_prompt(run_module, target_dir, tmp_path, monkeypatch):
    import tensorrt_llm_dflash.decode as decode

    out = tmp_path / "results.json"
    real = decode.speculative_generate
    on_disk: list[int] = []

    def generate(*args, **kwargs):
        on_disk.append(len(json.loads(out.read_text())["outputs"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "speculative_generate", generate)
    assert run_module.main(_argv(target_dir, out, ["a", "bb", "ccc"])) == 0
    assert on_disk == [0, 1, 2]
    assert json.loads(out.read_text())["status"] == "complete"


def test_a_prompt_that_cannot_fit_is_refused_before_any_generation(run_module, target_dir, tmp_path, capsys):
    out = tmp_path / "results.json"
    rc = run_module.main(_argv(target_dir, out, ["short", "x" * 600]))  # 600 chars > 512 positions
    err = capsys.readouterr().err
    assert rc == 2 and "--input_text 'xxxx" in err and "max_position_embeddings=512" in err
    assert json.loads(out.read_text())["outputs"] == []


def test_streaming_prints_exactly_the_decoded_text_on_the_embedded_target(run_module, tmp_path, capfd):
    """Emoji, CJK and accented prompts on SmolLM2: what --streaming printed equals the final text."""
    prompts = ["Reply with five party emoji 🎉 and nothing else.",
               "把这句话翻译成英文：我喜欢吃苹果。",
               "Écris une phrase en français avec des accents : é, è, ç, à.",
               "def f(x):\n    return x * 2  # explain this"]
    out = tmp_path / "results.json"
    rc = run_module.main(["--speculative_decoding_mode", "dflash", "--max_output_len", "24", "--streaming",
                          "--output_json", str(out), "--input_text", *prompts])
    assert rc == 0
    printed = capfd.readouterr().out
    saved = json.loads(out.read_text())["outputs"]
    for item in saved:
        header = f"] {item['prompt']!r}\n\n"
        start = printed.index(header) + len(header)
        end = printed.index("\n-- ", start)
        assert printed[start:end] == item["output_text"], (item["prompt"], printed[start:end], item["output_text"])
    assert any(ord(c) > 0x2000 for item in saved for c in item["output_text"]), "no multi-byte output to check"


@pytest.mark.parametrize("dtype, warned", [("bfloat16", True), ("float16", True), ("float32", False)])
def test_speculative_low_precision_runs_warn_that_output_may_differ(run_module, target_dir, tmp_path, capsys,
                                                                     dtype, warned):
    import torch
    from tiny_models import tiny_drafter

    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.target import load_target

    model, _ = load_target(target_dir, dtype=torch.float32)
    drafter_dir = tmp_path / "drafter"
    save_dflash_drafter(tiny_drafter(model, block_size=4), drafter_dir, dtype=torch.float32)
    rc = run_module.main(["--target_model_dir", str(target_dir), "--draft_model_dir", str(drafter_dir),
                          "--dtype", dtype, "--max_output_len", "3", "--input_text", "abc"])
    err = capsys.readouterr().err
    assert rc == 0
    assert (f"warning: --dtype {dtype}: speculative output is not guaranteed" in err) == warned, err


def test_default_run_is_the_cost_aware_tree_and_equals_ar(run_module, target_dir, tmp_path, capsys):
    """No decoding flags: the cost-aware tree with lookup branches; its output is AR's, and a
    fixed --ddtree_budget still runs the plain DDTree."""
    import torch
    from tiny_models import tiny_drafter

    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.target import load_target

    model, _ = load_target(target_dir, dtype=torch.float32)
    drafter_dir = tmp_path / "drafter"
    save_dflash_drafter(tiny_drafter(model, block_size=4), drafter_dir, dtype=torch.float32)
    outputs = {}
    for name, extra in (("default", []), ("fixed", ["--ddtree_budget", "6"]),
                        ("ar", ["--speculative_decoding_mode", "none"])):
        out = tmp_path / f"{name}.json"
        argv = ["--target_model_dir", str(target_dir), "--max_output_len", "12", "--output_json", str(out),
                "--input_text", "abab abab ab", "hello"]
        if name != "ar":
            argv += ["--draft_model_dir", str(drafter_dir)]
        assert run_module.main(argv + extra) == 0
        outputs[name] = json.loads(out.read_text())
    capsys.readouterr()
    assert outputs["default"]["mode"].startswith("cost-aware DDTree (<= 64 nodes, lookup branches)")
    assert outputs["fixed"]["mode"] == "DDTree budget 6"
    ids = {name: [o["output_ids"] for o in doc["outputs"]] for name, doc in outputs.items()}
    assert ids["default"] == ids["ar"] == ids["fixed"]
    stats = outputs["default"]["outputs"][0]["stats"]
    assert len(stats["predicted_tokens"]) == stats["steps"] == len(stats["drafted"])



def test_default_run_continues_the_calibration_of_the_last_run(run_module, target_dir, tmp_path, capsys,
                                                               monkeypatch):
    """run.py keeps the acceptance calibration (per target and drafter) for the next run, which
    starts from it (output still AR's); --recalibrate starts from the priors."""
    import torch

    monkeypatch.setenv("TENSORRT_LLM_DFLASH_CACHE", str(tmp_path / "cache"))  # no other test's calibration
    from tiny_models import tiny_drafter

    from tensorrt_llm_dflash.drafter import save_dflash_drafter
    from tensorrt_llm_dflash.policy import cost_cache_dir
    from tensorrt_llm_dflash.target import load_target

    model, _ = load_target(target_dir, dtype=torch.float32)
    drafter_dir = tmp_path / "drafter"
    save_dflash_drafter(tiny_drafter(model, block_size=4), drafter_dir, dtype=torch.float32)
    argv = ["--target_model_dir", str(target_dir), "--max_output_len", "12", "--input_text", "abab abab ab",
            "--draft_model_dir", str(drafter_dir)]
    saved = cost_cache_dir().parent / "calibration"
    assert not saved.exists()
    outputs = []
    for extra in ([], [], ["--recalibrate"]):
        out = tmp_path / f"run{len(outputs)}.json"
        capsys.readouterr()
        assert run_module.main(argv + extra + ["--output_json", str(out)]) == 0
        outputs.append((json.loads(out.read_text())["outputs"][0]["output_ids"], capsys.readouterr().err))
    (path,) = saved.glob("*.json")
    state = json.loads(path.read_text())
    assert state["block_size"] == 4 and sum(map(sum, state["temperatures"]["0"]["draft"]["trials"])) > 0
    assert "continuing from earlier runs" not in outputs[0][1]
    assert "acceptance calibration: continuing from earlier runs" in outputs[1][1]
    assert "continuing from earlier runs" not in outputs[2][1], "--recalibrate starts from the priors"
    assert outputs[0][0] == outputs[1][0] == outputs[2][0]


@pytest.mark.parametrize("extra, flag", [
    (["--ddtree_budget", "8", "--max_tree_nodes", "4"], "--max_tree_nodes"),
    (["--ddtree_budget", "0", "--no_lookup"], "--no_lookup"),
    (["--speculative_decoding_mode", "none", "--recalibrate"], "--recalibrate"),
])
def test_cost_aware_flags_without_the_cost_aware_tree_are_refused(run_module, extra, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        run_module.main(extra)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"argument {flag}" in err
