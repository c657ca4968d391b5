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
    (root / "bad_drafter").mkdir()
    (root / "bad_drafter" / "config.json").write_text("{not json")
    # train_dflash work dirs for --extra_data (the shard files are never opened at parse time).
    fingerprints = {"good_work": '{"target": {"a": 1}, "data": {"layer_ids": [1, 2]}}', "corrupt_work": "{not json",
                    "list_work": "[1, 2]", "lora_work": '{"target": {"a": 1}, "drafter": {"kind": "lora_inject"}}',
                    "no_shards_work": '{"target": {"a": 1}, "data": {"layer_ids": [1, 2]}}'}
    for name, text in fingerprints.items():
        (root / name / "data").mkdir(parents=True)
        (root / name / "fingerprint.json").write_text(text)
        if name != "no_shards_work":
            (root / name / "data" / "shard_00000.pt").write_bytes(b"")
    qwen3 = root / "qwen3_target"
    qwen3.mkdir()
    (qwen3 / "config.json").write_text('{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}')
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
    add("train_dflash", train, "--tensorboard", [f])  # a file where the scalars' directory should be
    add("train_dflash", train[:2], "--work_dir", [f])
    add("train_dflash", train, "--target_model_dir", [missing])
    add("train_dflash", train, "--features", ["disk"])
    add("train_dflash", train, "--device", ["tpu"] + ([] if torch.cuda.is_available() else ["cuda"]))
    add("train_dflash", train, "--seed", ["-1", "1e21"])
    add("train_dflash", train, "--dataset", [missing, str(d)])
    add("train_dflash", train, "--answers", ["dataset"])  # without --dataset
    add("train_dflash", train, "--max_seq_len", ["8", "x"])
    cases.append(("train_dflash", ["--output_dir", str(d / "same"), "--work_dir", str(d / "same")], "--output_dir"))
    add("train_dflash", train, "--log_file", [missing + "/log.jsonl", str(d)])
    add("train_dflash", train, "--init_drafter", [f, missing, str(d / "target"), str(d / "bad_drafter")])
    add("train_dflash", train, "--extra_data", [f, str(d / "target"), *(str(d / name) for name in (
        "corrupt_work", "list_work", "lora_work", "no_shards_work"))])
    # --output_dir equal to, or holding, what the run reads or writes: the export replaces it as a whole.
    cases.extend(("train_dflash", argv, "--output_dir") for argv in (
        ["--output_dir", str(d / "tr2"), "--work_dir", str(d / "tr2" / "work")],
        [*train, "--output_dir", str(d), "--init_drafter", str(d / "drafter")],
        [*train, "--output_dir", str(d / "drafter"), "--init_drafter", str(d / "drafter")],
        [*train, "--output_dir", str(d), "--extra_data", str(d / "good_work")],
        [*train, "--output_dir", str(d / "target"), "--target_model_dir", str(d / "target")],
        [*train, "--output_dir", str(d), "--dataset", str(d / "utf16.jsonl")],
        [*train, "--output_dir", "."],
        [*train, "--output_dir", str(Path.cwd())]))
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
    cases.extend(("train_dflash_lora_inject", argv, "--output_dir") for argv in (
        ["--data_dir", str(d / "lo2" / "x" / "data"), "--work_dir", str(d / "lo2" / "w"), "--output_dir", str(d / "lo2")],
        ["--data_dir", str(d / "lo3" / "data"), "--work_dir", str(d / "lo3" / "w"), "--output_dir", str(d / "lo3")],
        [*lora[:4], "--output_dir", str(d / "data")],
        [*lora[:4], "--output_dir", str(d), "--target_model_dir", str(d / "target")],
        [*lora[:4], "--output_dir", "."]))
    add("train_dflash_lora_inject", lora, "--lora_targets", ["foo_proj", "", "q_proj.", "self_attn.foo"])
    cases.append(("train_dflash_lora_inject", [*lora, "--lora_targets", "q_proj", "q_norm", "--target_model_dir",
                                               str(d / "qwen3_target")], "--lora_targets"))
    # examples/convert_checkpoint.py
    add("convert_checkpoint", conv, "--tp_size", ["0", "-2", "1.5"])
    add("convert_checkpoint", conv, "--pp_size", ["0", "2"])
    add("convert_checkpoint", conv, "--max_draft_len", ["0", "-1", "6", "257", "8.5"])  # 6 < block_size - 1 = 7
    add("convert_checkpoint", conv, "--dtype", ["int8"])
    add("convert_checkpoint", conv[2:], "--model_dir", [missing, f])
    add("convert_checkpoint", conv[:2] + conv[4:], "--dflash_model_dir", [missing])
    add("convert_checkpoint", conv[:4], "--output_dir", [f, str(d / "target"), "."])
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
                         ("train_dflash", ["--work_dir", str(dirs / "w3"), "--output_dir", str(dirs / "w3" / "out"),
                                           "--init_drafter", str(dirs / "drafter"), "--extra_data",
                                           str(dirs / "good_work"), "--log_file", str(dirs / "log.jsonl")]),
                         ("train_dflash_lora_inject", ["--data_dir", str(dirs / "data"), "--work_dir",
                                                       str(dirs / "lw3"), "--output_dir", str(dirs / "lw3" / "out"),
                                                       "--lora_targets", "q_proj", "self_attn.o_proj", "down_proj",
                                                       "--target_model_dir", str(dirs / "qwen3_target")]),
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


def test_an_output_dir_holding_the_work_dir_or_the_current_directory_is_refused_by_name(tmp_path, no_model_loads,
                                                                                       capsys, monkeypatch):
    """The reported defect: ``--output_dir tr2 --work_dir tr2/work`` trained, then published over its own work dir;
    ``--output_dir .`` trained for hours, then failed to rename the current directory (EBUSY). Both are refused at
    parse time, relative paths resolved, with the reason."""
    monkeypatch.chdir(tmp_path)
    for argv, says in ((["--output_dir", "tr2", "--work_dir", "tr2/work"], "holds --work_dir 'tr2/work'"),
                       (["--output_dir", "tr2/work/..", "--work_dir", "tr2/work"], "holds --work_dir"),
                       (["--output_dir", ".", "--work_dir", "w"], "current directory"),
                       (["--output_dir", "..", "--work_dir", "w"], "current directory")):
        code, err = _run("train_dflash", argv, capsys, monkeypatch)
        assert code == 2 and len(err.strip().splitlines()) == 1, (argv, err)
        assert "argument --output_dir:" in err and says in err and "replaces" in err, (argv, err)
    assert list(tmp_path.iterdir()) == []  # nothing made, nothing deleted


def test_lora_inject_output_dir_holding_its_data_and_work_dirs_is_refused_by_name(tmp_path, no_model_loads, capsys,
                                                                                 monkeypatch):
    """The reported defect: ``--data_dir lo2/x/data --work_dir lo2/w --output_dir lo2`` published over both."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lo2" / "x" / "data").mkdir(parents=True)
    (tmp_path / "lo2" / "x" / "data" / "shard_00000.pt").write_bytes(b"shard")
    code, err = _run("train_dflash_lora_inject", ["--data_dir", "lo2/x/data", "--work_dir", "lo2/w", "--output_dir",
                                                  "lo2"], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "argument --output_dir: 'lo2' holds --data_dir 'lo2/x/data'" in err
    assert (tmp_path / "lo2" / "x" / "data" / "shard_00000.pt").read_bytes() == b"shard"
    code, err = _run("train_dflash_lora_inject", ["--data_dir", "d", "--work_dir", "w", "--output_dir", "."], capsys,
                     monkeypatch)
    assert code == 2 and "argument --output_dir:" in err and "current directory" in err, err


def test_train_dflash_input_dirs_are_checked_before_any_model_loads(dirs, no_model_loads, capsys, monkeypatch):
    """The reported defects: --log_file in a missing directory, --init_drafter a file, --extra_data with a damaged
    fingerprint.json each ran the data stage (or loaded the model) before failing with a traceback or late error."""
    train = ["--output_dir", str(dirs / "o4"), "--work_dir", str(dirs / "w4")]
    for extra, says in ((["--log_file", "/nonexistent/dir/log.jsonl"], "the directory of '/nonexistent/dir/log.jsonl' "
                                                                       "does not exist"),
                        (["--init_drafter", str(dirs / "a_file.txt")], "a_file.txt' is not a directory"),
                        (["--init_drafter", str(dirs / "target")], "has no config.json"),
                        (["--init_drafter", str(dirs / "bad_drafter")], "is not valid JSON"),
                        (["--extra_data", str(dirs / "corrupt_work")], "fingerprint.json is not valid JSON"),
                        (["--extra_data", str(dirs / "lora_work")], "has no data section"),
                        (["--extra_data", str(dirs / "no_shards_work")], "has no data shards")):
        code, err = _run("train_dflash", [*train, *extra], capsys, monkeypatch)
        assert code == 2 and len(err.strip().splitlines()) == 1, (extra, err)
        assert f"argument {extra[0]}: " in err and says in err, (extra, err)
    assert not (dirs / "w4").exists()
