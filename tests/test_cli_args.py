"""Every CLI refuses a bad argument at parse time: exit status 2, one line naming the argument,
and no model, tokenizer or checkpoint is ever opened.

The table holds well over 100 rejected values across the five CLIs (run, benchmark,
train_dflash, train_dflash_lora_inject, convert_checkpoint). Loading anything heavy is
booby-trapped for the whole test, so a value that slips through parsing fails loudly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from example_cli import load_example

ROOT = Path(__file__).resolve().parents[1]
NON_UTF8 = os.fsdecode(b"caf\xe9 \xff")  # Latin-1 bytes on a UTF-8 command line


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Existing inputs the valid part of each command line points at (never loaded)."""
    root = tmp_path_factory.mktemp("cli")
    drafter = root / "drafter"
    drafter.mkdir()
    shipped = ROOT / "tensorrt_llm_dflash/assets/smollm2-135m-instruct-dflash/config.json"
    (drafter / "config.json").write_text(shipped.read_text())  # block_size 8
    for name in ("target", "data", "engine"):
        (root / name).mkdir()
    (root / "a_file.txt").write_text("x")
    (root / "utf16.jsonl").write_bytes('{"prompt": "hi"}\n'.encode("utf-16"))
    return root


def _cases(d: Path) -> list[tuple[str, list[str], str]]:
    """(script, argv, the argument the message must name)."""
    f = str(d / "a_file.txt")
    missing = str(d / "does" / "not" / "exist")
    train = ["--output_dir", str(d / "out"), "--work_dir", str(d / "work")]
    lora = ["--data_dir", str(d / "data"), "--work_dir", str(d / "lwork"), "--output_dir", str(d / "lout")]
    conv = ["--model_dir", str(d / "target"), "--dflash_model_dir", str(d / "drafter"), "--output_dir", str(d / "ckpt")]
    bad_int = ["0", "-5", "8.5", "1e21", "abc", ""]
    cases: list[tuple[str, list[str], str]] = []

    def add(script, base, arg, values):
        cases.extend((script, [*base, arg, v], arg) for v in values)

    # examples/run.py
    add("run", [], "--max_output_len", bad_int)
    add("run", [], "--ddtree_budget", ["-1", "1024", "99999", "8.5", "x"])
    add("run", [], "--temperature", ["inf", "-inf", "nan", "-0.5", "hot"])
    add("run", [], "--top_p", ["0", "-0.1", "1.5", "nan"])
    add("run", [], "--top_k", ["-1", "2.5"])
    add("run", [], "--random_seed", ["1e21", "1000000000000000000000", "-1", "4294967296"])
    add("run", [], "--threads", ["-1", "0", "two"])
    add("run", [], "--dtype", ["fp8", "int8"])
    add("run", [], "--device", ["tpu", "cuda:x", "cpu:0"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"]))
    add("run", [], "--target_model_dir", [missing])
    add("run", [], "--draft_model_dir", [missing, f])
    add("run", [], "--engine_dir", [missing, str(d / "engine")])  # the second: tensorrt_llm is not installed
    add("run", [], "--tokenizer_dir", [missing])
    add("run", [], "--output_json", [str(d), missing + "/out.json"])
    add("run", [], "--input_text", [NON_UTF8, "", "   "])
    add("run", [], "--speculative_decoding_mode", ["medusa"])
    add("run", [], "--backend", ["tensorrt"])
    cases.append(("run", ["--backend", "trt"], "--backend"))
    # examples/benchmark.py
    add("benchmark", [], "--num_prompts", ["0", "-5", "2.5"])
    add("benchmark", [], "--max_output_len", ["0", "-1"])
    add("benchmark", [], "--methods", ["ddtree:0", "ddtree:-3", "warp", "pld:0", "ddtree:x"])
    add("benchmark", [], "--temperature", ["inf", "-1"])
    add("benchmark", [], "--top_p", ["2"])
    add("benchmark", [], "--top_k", ["-2"])
    add("benchmark", [], "--seed", ["1e21", "-1"])
    add("benchmark", [], "--threads", ["0", "-1"])
    add("benchmark", [], "--dataset", [missing, str(d)])
    add("benchmark", [], "--target_model_dir", [missing])
    add("benchmark", [], "--draft_model_dir", [missing])
    add("benchmark", [], "--lora_inject_dir", [missing])
    add("benchmark", [], "--output_dir", [f, f + "/sub"])
    # examples/train_dflash.py
    add("train_dflash", train, "--num_prompts", ["0", "-5", "3.5"])
    add("train_dflash", train, "--max_new_tokens", ["0", "-1"])
    add("train_dflash", train, "--gen_batch_size", ["0", "-3"])
    add("train_dflash", train, "--batch_size", ["0", "-1", "1.5"])
    add("train_dflash", train, "--num_anchors", ["0", "-1"])
    add("train_dflash", train, "--lr", ["-1", "0", "nan", "inf", "fast"])
    add("train_dflash", train, "--gamma", ["0", "-4", "inf"])
    add("train_dflash", train, "--distill_weight", ["-0.1", "1.5", "nan"])
    add("train_dflash", train, "--data_minutes", ["-1", "inf"])
    add("train_dflash", train, "--train_minutes", ["-1", "nan"])
    add("train_dflash", train, "--max_steps", ["0", "-10"])
    add("train_dflash", train, "--num_layers", ["0", "100"])
    add("train_dflash", train, "--block_size", ["1", "0", "100000", "8.5"])
    add("train_dflash", train, "--num_feature_layers", ["0"])
    add("train_dflash", train, "--mask_token_id", ["-1", "16.7"])
    add("train_dflash", train, "--threads", ["-1"])
    add("train_dflash", train, "--precision", ["fp8"])
    add("train_dflash", train, "--save_every", ["0"])
    add("train_dflash", train[2:], "--output_dir", [f])
    add("train_dflash", train[:2], "--work_dir", [f])
    add("train_dflash", train, "--target_model_dir", [missing])
    add("train_dflash", train, "--features", ["disk"])
    add("train_dflash", train, "--device", ["tpu"] + ([] if torch.cuda.is_available() else ["cuda"]))
    add("train_dflash", train, "--seed", ["-1", "1e21"])
    add("train_dflash", train, "--dataset", [missing, str(d)])
    add("train_dflash", train, "--answers", ["dataset"])  # without --dataset
    add("train_dflash", train, "--max_seq_len", ["8", "x"])
    cases.append(("train_dflash", ["--output_dir", str(d / "same"), "--work_dir", str(d / "same")], "--output_dir"))
    # examples/train_dflash_lora_inject.py
    add("train_dflash_lora_inject", lora, "--lora_rank", ["0", "-8"])
    add("train_dflash_lora_inject", lora, "--lora_alpha", ["0", "nan"])
    add("train_dflash_lora_inject", lora, "--block_size", ["1", "100000"])
    add("train_dflash_lora_inject", lora, "--lr", ["-1"])
    add("train_dflash_lora_inject", lora, "--batch_size", ["0"])
    add("train_dflash_lora_inject", lora, "--log_every", ["0"])
    add("train_dflash_lora_inject", lora, "--eval_sequences", ["0"])
    add("train_dflash_lora_inject", lora, "--seed", ["-1"])
    add("train_dflash_lora_inject", lora, "--train_minutes", ["-2"])
    add("train_dflash_lora_inject", lora[:4], "--output_dir", [f, str(d / "lwork")])
    # examples/convert_checkpoint.py
    add("convert_checkpoint", conv, "--tp_size", ["0", "-2", "1.5"])
    add("convert_checkpoint", conv, "--pp_size", ["0", "2"])
    add("convert_checkpoint", conv, "--max_draft_len", ["0", "-1", "6", "257", "8.5"])  # 6 < block_size - 1 = 7
    add("convert_checkpoint", conv, "--dtype", ["int8"])
    add("convert_checkpoint", conv[2:], "--model_dir", [missing, f])
    add("convert_checkpoint", conv[:2] + conv[4:], "--dflash_model_dir", [missing])
    add("convert_checkpoint", conv[:4], "--output_dir", [f, str(d / "target")])
    return cases


@pytest.fixture
def no_model_loads(monkeypatch):
    """Anything that would open a model, tokenizer or checkpoint raises instead."""
    import safetensors.torch
    import transformers

    from tensorrt_llm_dflash import drafter, target
    from tensorrt_llm_dflash.trtllm import weight

    def trap(*_args, **_kwargs):
        raise AssertionError("a model load was reached")

    for auto in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer, transformers.AutoConfig):
        monkeypatch.setattr(auto, "from_pretrained", trap)
    monkeypatch.setattr(safetensors.torch, "load_file", trap)
    monkeypatch.setattr(torch, "load", trap)
    for module, name in ((target, "load_target"), (target, "load_tokenizer"), (drafter, "load_dflash_drafter"),
                         (weight, "convert_checkpoint"), (weight, "load_and_check")):
        monkeypatch.setattr(module, name, trap)


MODULES: dict[str, object] = {}


def _run(script: str, argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    if script not in MODULES:
        MODULES[script] = load_example(script)
    module = MODULES[script]
    for name in ("load_target", "load_dflash_drafter"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("model load")))
    try:
        code = module.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def test_the_table_is_large_and_covers_every_cli(tmp_path):
    cases = _cases(tmp_path)
    assert len(cases) >= 100
    assert {c[0] for c in cases} == {"run", "benchmark", "train_dflash", "train_dflash_lora_inject",
                                     "convert_checkpoint"}


@pytest.mark.parametrize("index", range(len(_cases(Path("/nonexistent")))))
def test_every_rejected_value_exits_2_with_one_line_naming_the_argument(index, dirs, no_model_loads, capsys,
                                                                        monkeypatch):
    script, argv, argument = _cases(dirs)[index]
    code, err = _run(script, argv, capsys, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 2, (script, argv, code, err)
    assert len(lines) == 1, (script, argv, err)
    assert argument in lines[0], (script, argv, err)
    assert "Traceback" not in err


def test_valid_arguments_pass_parsing_and_reach_the_model_load(dirs, no_model_loads, capsys, monkeypatch):
    """The trap is real: valid command lines get past parsing and hit it."""
    for script, argv in (("run", ["--max_output_len", "4"]),
                         ("train_dflash", ["--output_dir", str(dirs / "o2"), "--work_dir", str(dirs / "w2")]),
                         ("convert_checkpoint", ["--model_dir", str(dirs / "target"), "--dflash_model_dir",
                                                 str(dirs / "drafter"), "--output_dir", str(dirs / "c2"),
                                                 "--max_draft_len", "99"])):
        with pytest.raises(AssertionError, match="model load"):
            _run(script, argv, capsys, monkeypatch)


def test_utf16_benchmark_jsonl_is_refused_by_name_before_the_model_loads(dirs, no_model_loads, capsys, monkeypatch):
    code, err = _run("benchmark", ["--dataset", str(dirs / "utf16.jsonl"), "--methods", "ar"], capsys, monkeypatch)
    assert code == 2 and "utf16.jsonl" in err and "UTF-16" in err and len(err.strip().splitlines()) == 1, err


def test_a_real_process_exits_2_with_one_line(dirs):
    """The same contract seen from a shell: status 2, one line on stderr, nothing on stdout."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples/run.py"), "--temperature", "inf"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "run.py: error: argument --temperature: must be a finite number >= 0, got 'inf' (see --help)"]
    assert proc.stdout == ""
