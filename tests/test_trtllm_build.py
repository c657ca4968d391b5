"""The ``trtllm-build`` entry point (trtllm/build.py), with stand-in tensorrt_llm modules.

What runs here: the argv translation (``dflash`` -> ``medusa``, every other flag passed
through unchanged), the checkpoint checks, ``$TRTLLM_DFLASH_MAX_DRAFT_LEN``, and that
``tensorrt_llm.commands.build.main`` is called with the translated ``sys.argv``.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from tensorrt_llm_dflash.trtllm import build
from tensorrt_llm_dflash.trtllm.plugins import load_plugin_library as REAL_LOAD_PLUGIN_LIBRARY

#: The attention fields of converted checkpoints (config.json): Qwen3-8B, which TensorRT-LLM's
#: tree-verification kernels run (head group 4, head size 128).
QWEN3_8B = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_size": 128, "dtype": "bfloat16",
            "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1}}


def write_ckpt(path, **fields):
    config = {"architecture": "DFlashForCausalLM", "dflash": {"block_size": 8}, **QWEN3_8B, **fields}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """A DFlash build publishes its --output_dir (default engine_outputs, relative to the current directory)."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def dflash_ckpt(tmp_path):
    return write_ckpt(tmp_path)


@pytest.fixture
def fake_trtllm(monkeypatch):
    """Stand-ins: tensorrt_llm.commands.build.main records sys.argv; MODEL_MAP is a dict."""
    calls: dict = {"argv": None, "plugins": 0, "registered": 0, "mpi_world_size": 1}
    commands_build = types.ModuleType("tensorrt_llm.commands.build")

    def fake_main() -> None:
        """Records sys.argv and, as a real build does, writes config.json and a rank engine per rank into
        --output_dir when it exists (the staging directory of a DFlash build)."""
        calls["argv"] = list(sys.argv)
        out, ckpt = (build._flag_value(sys.argv[1:], flag) for flag in ("--output_dir", "--checkpoint_dir"))
        if out is None or not Path(out).is_dir() or ckpt is None:
            return
        out = Path(out)
        config = json.loads((Path(ckpt) / "config.json").read_text())
        for name in ["config.json", *(f"rank{r}.engine" for r in range(config["mapping"]["world_size"]))]:
            (out / name).write_text("built")

    commands_build.main = fake_main
    for name, module in {
        "tensorrt_llm": types.ModuleType("tensorrt_llm"),
        "tensorrt_llm.commands": types.ModuleType("tensorrt_llm.commands"),
        "tensorrt_llm.commands.build": commands_build,
        "tensorrt_llm._utils": types.SimpleNamespace(mpi_world_size=lambda: calls["mpi_world_size"]),
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr("tensorrt_llm_dflash.trtllm.plugins.load_plugin_library",
                        lambda path=None: calls.__setitem__("plugins", calls["plugins"] + 1))
    monkeypatch.setattr(build, "register_model", lambda: calls.__setitem__("registered", calls["registered"] + 1))
    monkeypatch.setattr(build, "device_sm", lambda device=None: None)  # the build machine's GPU: none here
    monkeypatch.delenv(build.MAX_DRAFT_LEN_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", ["trtllm-build"])
    return calls


def test_translate_argv_maps_only_the_mode():
    argv = ["--checkpoint_dir", "c", "--speculative_decoding_mode", "dflash", "--max_draft_len", "7",
            "--gemm_plugin", "auto", "--max_batch_size", "4"]
    out, is_dflash = build.translate_argv(argv)
    assert is_dflash
    assert out == ["--checkpoint_dir", "c", "--speculative_decoding_mode", "medusa", "--max_draft_len", "7",
                   "--gemm_plugin", "auto", "--max_batch_size", "4"]
    assert build.translate_argv(["--speculative_decoding_mode=dflash"]) == (["--speculative_decoding_mode=medusa"], True)
    assert build.translate_argv(["--speculative_decoding_mode", "eagle"]) == (["--speculative_decoding_mode", "eagle"],
                                                                               False)


def test_main_passes_everything_else_through(fake_trtllm, dflash_ckpt, monkeypatch, tmp_path):
    """Everything but the mode and --output_dir goes through as given; a DFlash build writes into a staging
    sibling of --output_dir, published whole when TensorRT-LLM returns (a killed rebuild used to leave a new
    config.json beside old rank engines)."""
    import os

    argv = ["--checkpoint_dir", str(dflash_ckpt), "--output_dir", "engine", "--speculative_decoding_mode", "dflash",
            "--max_draft_len", "31", "--max_batch_size", "1", "--kv_cache_type", "continuous"]
    assert build.main(argv) == 0
    staging = fake_trtllm["argv"][4]
    assert staging.startswith(str(tmp_path / ".engine.staging-")) and not os.path.exists(staging)
    assert fake_trtllm["argv"] == ["trtllm-build", "--checkpoint_dir", str(dflash_ckpt), "--output_dir", staging,
                                   "--speculative_decoding_mode", "medusa", "--max_draft_len", "31",
                                   "--max_batch_size", "1", "--kv_cache_type", "continuous"]
    assert (tmp_path / "engine").is_dir()
    assert os.environ[build.MAX_DRAFT_LEN_ENV] == "31"
    assert fake_trtllm["plugins"] == 1 and fake_trtllm["registered"] == 1


def test_plain_checkpoint_builds_as_with_trtllm_build(fake_trtllm, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM"}))
    argv = ["--checkpoint_dir", str(tmp_path), "--max_batch_size", "2"]
    assert build.main(argv) == 0
    assert fake_trtllm["argv"] == ["trtllm-build", *argv]
    assert fake_trtllm["plugins"] == 0  # no DFlash layers: the plugin library is not needed


def test_dflash_mode_refuses_other_checkpoints(fake_trtllm, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM"}))
    assert build.main(["--checkpoint_dir", str(tmp_path), "--speculative_decoding_mode", "dflash"]) == 2
    assert "architecture 'LlamaForCausalLM'" in capsys.readouterr().err
    assert fake_trtllm["argv"] is None


@pytest.mark.parametrize("value", ["6", "257", "1024"])
def test_max_draft_len_range(fake_trtllm, dflash_ckpt, capsys, value):
    code = build.main(["--checkpoint_dir", str(dflash_ckpt), "--speculative_decoding_mode", "dflash",
                       "--max_draft_len", value])
    assert code == 2
    assert f"--max_draft_len={value} is out of range" in capsys.readouterr().err
    assert fake_trtllm["argv"] is None


@pytest.mark.parametrize("mode", [None, "eagle"])
def test_dflash_checkpoint_needs_the_dflash_mode(fake_trtllm, dflash_ckpt, capsys, mode):
    # TensorRT-LLM 1.2's builder no longer forces MEDUSA for a config with max_draft_len: a DFlash
    # checkpoint built in another mode would get no room for the tree.
    argv = ["--checkpoint_dir", str(dflash_ckpt), "--max_draft_len", "7"]
    if mode is not None:
        argv += ["--speculative_decoding_mode", mode]
    assert build.main(argv) == 2
    err = capsys.readouterr().err
    assert "is a DFlash checkpoint: build it with --speculative_decoding_mode dflash" in err
    assert f"--speculative_decoding_mode={mode!r}" in err
    assert fake_trtllm["argv"] is None


def test_max_draft_len_must_be_an_integer_and_equals_form_is_read(fake_trtllm, dflash_ckpt, capsys):
    assert build.main(["--checkpoint_dir", str(dflash_ckpt), "--speculative_decoding_mode", "dflash",
                       "--max_draft_len", "many"]) == 2
    assert "--max_draft_len='many' is not an integer" in capsys.readouterr().err
    assert build.main([f"--checkpoint_dir={dflash_ckpt}", "--speculative_decoding_mode=dflash",
                       "--max_draft_len=300"]) == 2
    assert "--max_draft_len=300 is out of range 7..256" in capsys.readouterr().err
    assert fake_trtllm["argv"] is None


def test_checkpoint_max_draft_len_is_checked_when_the_flag_is_absent(fake_trtllm, tmp_path, capsys):
    write_ckpt(tmp_path, max_draft_len=500)
    assert build.main(["--checkpoint_dir", str(tmp_path), "--speculative_decoding_mode", "dflash"]) == 2
    assert "config.json max_draft_len=500 is out of range 7..256" in capsys.readouterr().err


# ------------------------------------------- attention kernels for tree verification (issue 31)

#: SmolLM2-135M-Instruct (the embedded target): 9 q / 3 KV heads (group 3) of size 64.
SMOLLM2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "head_size": 64}


def test_smollm2_checkpoint_is_refused_before_anything_is_built(fake_trtllm, tmp_path, capsys):
    """Head group 3 does not divide 64: decoderXQARunner sends it to the precompiled cubins, which
    have spec-decoding kernels for head size 128 only, so the engine would abort at its first
    verify step. The build refuses it in one line naming the shape, the rule, the source and
    what works, before TensorRT-LLM or the plugin library is touched."""
    write_ckpt(tmp_path, **SMOLLM2)
    assert build.main(["--checkpoint_dir", str(tmp_path), "--speculative_decoding_mode", "dflash",
                       "--max_draft_len", "32", "--max_batch_size", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    for part in ("9 q / 3 KV heads, head size 64, bfloat16", "head group 3 does not divide 64",
                 "decoderXQARunner.cpp @ 83b43274", "head size 128 only", "xqa_kernel_cubin.h @ 2340c776",
                 "No available XQA kernels are found for speculative decoding mode", "what works:"):
        assert part in err, (part, err)
    assert fake_trtllm["argv"] is None and fake_trtllm["plugins"] == 0


@pytest.mark.parametrize(("name", "fields", "flags", "refused"), [
    ("qwen3-8b, default 32-token blocks", {}, [], None),
    ("qwen3-8b, 8-token blocks", {}, ["--tokens_per_block", "8"], "the JIT XQA kernels take paged KV blocks of 16/32"),
    ("qwen3-14b (group 5), default 32-token blocks", {"num_attention_heads": 40}, [],
     "--tokens_per_block=32: head group 5 does not divide 64"),
    ("qwen3-14b, 64-token blocks", {"num_attention_heads": 40}, ["--tokens_per_block", "64"], None),
    ("qwen3-14b, continuous KV", {"num_attention_heads": 40}, ["--kv_cache_type", "continuous"], None),
    ("qwen2.5-7b (group 7), =128", {"num_attention_heads": 28, "num_key_value_heads": 4},
     ["--tokens_per_block=128"], None),
    ("qwen2.5-7b, legacy --paged_kv_cache disable", {"num_attention_heads": 28, "num_key_value_heads": 4},
     ["--paged_kv_cache", "disable"], None),
    ("head group 64", {"num_attention_heads": 64, "num_key_value_heads": 1}, [], "head group <= 32"),
    ("head size 72", {"head_size": 72}, [], "a head size that is a multiple of 16 in 16..256"),
    ("the CI engines (2/1 heads of 64)", {"num_attention_heads": 2, "num_key_value_heads": 1, "head_size": 64},
     ["--tokens_per_block", "16"], None),
    ("fp32", {"dtype": "float32"}, [], "dtype='float32': TensorRT-LLM verifies trees (spec decoding) in fp16/bf16"),
    ("no KV cache", {}, ["--kv_cache_type", "disabled"], "--kv_cache_type=disabled"),
    ("tp 8 duplicates KV heads", {"num_key_value_heads": 4, "mapping": {"world_size": 8, "tp_size": 8}}, [], None),
    ("heads not divisible", {"num_attention_heads": 12, "num_key_value_heads": 8}, [],
     "must be a multiple of KV heads per rank"),
])
def test_tree_attention_kernel_rule_by_shape(fake_trtllm, tmp_path, capsys, name, fields, flags, refused):
    write_ckpt(tmp_path, **fields)
    code = build.main(["--checkpoint_dir", str(tmp_path), "--speculative_decoding_mode", "dflash", *flags])
    err = capsys.readouterr().err
    if refused is None:
        assert code == 0, (name, err)
        assert fake_trtllm["argv"] is not None
    else:
        assert code == 2 and refused in err, (name, err)
        assert fake_trtllm["argv"] is None


@pytest.mark.parametrize(("sm", "fields", "flags", "refused"), [
    (90, {}, [], None),
    (100, {}, [], "GPU SM 100: on the SM100 family XQA runs the TRTLLM-GEN kernels"),
    (103, {}, [], "TRTLLM-GEN does not support Speculative decoding"),
    (75, {}, [], "need SM >= 80"),
    (120, {}, [], None),  # group 4: JIT (HMMA) kernels, SM >= 80
    (120, {"num_attention_heads": 40}, ["--tokens_per_block", "64"], "built for SM 80/86/89/90 only"),
    (89, {"num_attention_heads": 40}, ["--tokens_per_block", "64"], None),
])
def test_the_build_machines_gpu_is_checked(fake_trtllm, tmp_path, capsys, monkeypatch, sm, fields, flags, refused):
    """TensorRT-LLM builds for the GPU it runs on: where the build machine has one, its SM is
    checked too (Blackwell's TRTLLM-GEN path has no spec decoding; the cubins stop at SM 90)."""
    monkeypatch.setattr(build, "device_sm", lambda device=None: sm)
    write_ckpt(tmp_path, **fields)
    code = build.main(["--checkpoint_dir", str(tmp_path), "--speculative_decoding_mode", "dflash", *flags])
    err = capsys.readouterr().err
    assert (code, refused is None or refused in err) == (0 if refused is None else 2, True), err


def test_malformed_kernel_fields_are_named(fake_trtllm, tmp_path, capsys):
    write_ckpt(tmp_path, head_size="64")
    assert build.main(["--checkpoint_dir", str(tmp_path), "--speculative_decoding_mode", "dflash"]) == 2
    assert "config.json head_size='64': a positive integer is required" in capsys.readouterr().err
    write_ckpt(tmp_path)
    assert build.main(["--checkpoint_dir", str(tmp_path), "--speculative_decoding_mode", "dflash",
                       "--tokens_per_block", "many"]) == 2
    assert "--tokens_per_block='many' is not an integer" in capsys.readouterr().err
    assert fake_trtllm["argv"] is None


def test_device_sm_is_none_without_a_cuda_device(monkeypatch):
    import torch

    from tensorrt_llm_dflash.trtllm.kernel_support import device_sm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_sm() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert device_sm() == 90 and device_sm("cuda:0") == 90
    assert device_sm("cpu") is None


# ------------------------------------------------------------ the start-up hook (hook.py)


def test_hook_recognises_dflash_builds(tmp_path, dflash_ckpt):
    from tensorrt_llm_dflash.trtllm import hook

    assert hook.wants_dflash(["--speculative_decoding_mode", "dflash"])
    assert hook.wants_dflash(["--speculative_decoding_mode=dflash"])
    assert hook.wants_dflash(["--checkpoint_dir", str(dflash_ckpt)])  # the mode missing: refused by name later
    assert hook.wants_dflash([f"--checkpoint_dir={dflash_ckpt}"])
    assert not hook.wants_dflash(["--checkpoint_dir", str(tmp_path / "none")])
    assert not hook.wants_dflash(["--speculative_decoding_mode", "medusa", "--max_batch_size", "8"])
    # Abbreviated, as trtllm-build's argparse takes them: still ours (TensorRT-LLM would refuse 'dflash' unexplained).
    assert hook.wants_dflash(["--speculative_decoding", "dflash"])
    assert hook.wants_dflash(["--spec=dflash", "--max_batch_size", "1"])
    assert hook.wants_dflash(["--checkpoint", str(dflash_ckpt)])
    assert hook.wants_dflash(["--checkpoint_d=" + str(tmp_path / "none"), "--checkpoint_dir", str(dflash_ckpt)])
    assert not hook.wants_dflash(["--checkpoint", str(tmp_path / "none"), "--spec", "medusa"])


def test_hook_wraps_tensorrt_llms_main_on_import(tmp_path, monkeypatch, dflash_ckpt):
    """A stand-in tensorrt_llm.commands.build on sys.path: importing it after install() gives the
    wrapped main; a plain build reaches the original, a DFlash build our entry point, which calls
    the original (its __wrapped__) with the translated argv."""
    from tensorrt_llm_dflash.trtllm import build as dflash_build
    from tensorrt_llm_dflash.trtllm import hook

    package = tmp_path / "site" / "tensorrt_llm" / "commands"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package.parent / "_utils.py").write_text("def mpi_world_size():\n    return 1\n")
    (package / "build.py").write_text(
        "import pathlib, sys\nCALLS = []\ndef main():\n    CALLS.append(list(sys.argv))\n"
        "    if '--output_dir' in sys.argv:  # an engine, as a real build writes it\n"
        "        for name in ('config.json', 'rank0.engine'):\n"
        "            (pathlib.Path(sys.argv[sys.argv.index('--output_dir') + 1]) / name).write_text('built')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in ("tensorrt_llm", "tensorrt_llm.commands", "tensorrt_llm.commands.build"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(dflash_build, "register_model", lambda: None)
    monkeypatch.setattr(dflash_build, "device_sm", lambda device=None: None)
    monkeypatch.setattr("tensorrt_llm_dflash.trtllm.plugins.load_plugin_library", lambda path=None: None)
    monkeypatch.delenv(build.MAX_DRAFT_LEN_ENV, raising=False)
    hook.install()
    hook.install()  # idempotent
    assert sum(isinstance(f, hook._Finder) for f in sys.meta_path) == 1
    from tensorrt_llm.commands import build as commands

    assert commands.main._dflash_hooked and hook.wrap_main(commands.main) is commands.main
    monkeypatch.setattr(sys, "argv", ["trtllm-build", "--checkpoint_dir", str(tmp_path / "plain")])
    commands.main()
    assert commands.CALLS[-1] == ["trtllm-build", "--checkpoint_dir", str(tmp_path / "plain")]
    monkeypatch.setattr(sys, "argv", ["trtllm-build", "--checkpoint_dir", str(dflash_ckpt),
                                      "--speculative_decoding_mode", "dflash", "--max_draft_len", "9"])
    assert commands.main() == 0
    assert commands.CALLS[-1][:-1] == ["trtllm-build", "--checkpoint_dir", str(dflash_ckpt),
                                       "--speculative_decoding_mode", "medusa", "--max_draft_len", "9", "--output_dir"]
    assert ".engine_outputs.staging-" in commands.CALLS[-1][-1]  # published as ./engine_outputs
    hook.install()  # already imported: wrapping again is a no-op
    assert commands.main._dflash_hooked


# ------------------------------- flags as trtllm-build's argparse reads them (abbreviations)


@pytest.mark.parametrize(("flags", "refused"), [
    (["--max_draft", "300"], "--max_draft_len=300 is out of range 7..256"),
    (["--max_draft=300"], "--max_draft_len=300 is out of range 7..256"),
    (["--max_draft_l", "6"], "--max_draft_len=6 is out of range 7..256"),
    (["--max_draft", "many"], "--max_draft_len='many' is not an integer"),
    (["--tokens", "8"], "the JIT XQA kernels take paged KV blocks of 16/32"),
    (["--kv_cache=disabled"], "--kv_cache_type=disabled"),
    (["--max_d", "300"], "ambiguous option: --max_d could match --max_decoder_seq_len, --max_draft_len"),
    (["--max_draft_len", "31", "--spec", "eagle"], "(got --speculative_decoding_mode='eagle')"),
])
def test_abbreviated_flags_are_checked(fake_trtllm, dflash_ckpt, capsys, flags, refused):
    """trtllm-build's argparse takes a unique prefix of any flag: ``--max_draft 300`` built an
    engine with max_draft_len=300 past every check. Flags resolve as argparse resolves them."""
    code = build.main(["--checkpoint", str(dflash_ckpt), "--speculative_decoding_mode", "dflash",
                       "--max_batch_size", "1", "--remove_input_padding", "enable", *flags])
    err = capsys.readouterr().err
    assert code == 2 and refused in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert fake_trtllm["argv"] is None


def test_abbreviated_flags_reach_the_build(fake_trtllm, dflash_ckpt):
    import os

    assert build.main([f"--checkpoint={dflash_ckpt}", "--speculative_decoding", "dflash", "--max_draft", "31",
                       "--max_batch_size", "1"]) == 0
    staging = fake_trtllm["argv"][-1]  # trtllm-build's default --output_dir, engine_outputs, staged
    assert fake_trtllm["argv"] == ["trtllm-build", f"--checkpoint={dflash_ckpt}", "--speculative_decoding_mode",
                                   "medusa", "--max_draft", "31", "--max_batch_size", "1", "--output_dir", staging]
    assert ".engine_outputs.staging-" in staging and (dflash_ckpt / "engine_outputs").is_dir()
    assert os.environ[build.MAX_DRAFT_LEN_ENV] == "31"
    assert build.translate_argv(["--speculative_decoding=dflash", "--spec", "dflash"]) == (
        ["--speculative_decoding_mode=medusa", "--speculative_decoding_mode", "medusa"], True)
    # a value is never read as a flag, and nothing after "--" is an option
    assert build.translate_argv(["--output_dir", "--speculative_decoding_mode", "dflash"])[1]
    assert build.translate_argv(["--", "--speculative_decoding_mode", "dflash"]) == (
        ["--", "--speculative_decoding_mode", "dflash"], False)
    assert build._flag_value(["--max_draft_len", "-5"], "--max_draft_len") == "-5"  # argparse's negative number


def test_the_abbreviated_dflash_mode_cannot_skip_the_checks(fake_trtllm, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM"}))
    for mode in (["--speculative_decoding", "dflash"], ["--speculative_decoding=dflash"], ["--spec=dflash"]):
        assert build.main(["--checkpoint_dir", str(tmp_path), *mode]) == 2, mode
        assert "architecture 'LlamaForCausalLM'" in capsys.readouterr().err
    assert fake_trtllm["argv"] is None


def test_flags_come_from_trtllm_builds_own_parser_once_it_is_loaded(fake_trtllm, dflash_ckpt, capsys):
    """Through hook.py, TensorRT-LLM's module is imported: its parser decides what a prefix means."""
    import argparse

    def parse_arguments(allow_abbrev=True, extra=("--max_draft_tokens",)):
        parser = argparse.ArgumentParser(allow_abbrev=allow_abbrev)
        for flag in ("--checkpoint_dir", "--speculative_decoding_mode", "--max_draft_len", *extra):
            parser.add_argument(flag)
        return parser

    commands_build = sys.modules["tensorrt_llm.commands.build"]
    argv = ["--checkpoint_dir", str(dflash_ckpt), "--speculative_decoding_mode", "dflash", "--max_draft", "300"]
    commands_build.parse_arguments = parse_arguments
    assert build.main(argv) == 2
    assert "ambiguous option: --max_draft could match --max_draft_len, --max_draft_tokens" in capsys.readouterr().err
    commands_build.parse_arguments = lambda: parse_arguments(extra=())
    assert build.main(argv) == 2
    assert "--max_draft_len=300 is out of range" in capsys.readouterr().err
    commands_build.parse_arguments = lambda: parse_arguments(allow_abbrev=False)
    assert build.known_flags()[1] is False
    assert build._flag_value(argv, "--max_draft_len") is None  # that parser refuses the prefix itself


def test_pinned_flags_cover_the_standin_parser_and_the_qa_command_is_refused(tmp_path, capsys):
    """The pinned list holds every flag of (the stand-in of) TensorRT-LLM 1.2.1's parser; the QA
    pass's command is refused with the stand-in's own module loaded (hook.py's case) and without."""
    import standin

    ckpt = write_ckpt(tmp_path)
    argv = ["--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "E8"), "--speculative_decoding_mode",
            "dflash", "--max_batch_size", "1", "--remove_input_padding", "enable", "--max_draft", "300"]
    with standin.active(tmp_path / "lib"):
        from tensorrt_llm_dflash.trtllm import build as standin_build

        assert standin_build.main(argv) == 2
        import tensorrt_llm.commands.build as commands_build

        parser_flags = {s for action in commands_build.parse_arguments()._actions for s in action.option_strings}
        assert parser_flags <= build.TRTLLM_BUILD_FLAGS, parser_flags - build.TRTLLM_BUILD_FLAGS
        assert standin_build.known_flags() == (frozenset(parser_flags), True)
        assert standin_build.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("--max_draft_len=300 is out of range 7..256" in line for line in err), err
    assert not (tmp_path / "E8").exists()


# ------------------------------------------------- the checkpoint's config.json, refused by name


@pytest.mark.parametrize(("content", "refused"), [
    ("{not json", "config.json is not valid JSON (Expecting property name enclosed in double quotes: line 1"),
    ("[1, 2]", "config.json holds a JSON list, a JSON object is required"),
    (json.dumps({"architecture": "DFlashForCausalLM", **QWEN3_8B}),
     "config.json dflash=None: a DFlash checkpoint needs its dflash section"),
    (json.dumps({"architecture": "DFlashForCausalLM", "dflash": [8], **QWEN3_8B}), "config.json dflash=[8]"),
    (json.dumps({"architecture": "DFlashForCausalLM", "dflash": {}, **QWEN3_8B}),
     "config.json dflash.block_size=None: a positive integer is required"),
    (json.dumps({"architecture": "DFlashForCausalLM", "dflash": {"block_size": "8"}, **QWEN3_8B}),
     "config.json dflash.block_size='8': a positive integer is required"),
    (json.dumps({"architecture": "DFlashForCausalLM", "dflash": {"block_size": 8}, "max_draft_len": "9", **QWEN3_8B}),
     "config.json max_draft_len='9': an integer is required"),
    (json.dumps({"architecture": "DFlashForCausalLM", "dflash": {"block_size": 8, "dflash2": {}}, **QWEN3_8B}),
     "config.json dflash.hidden_size=None: a positive integer is required"),
])
def test_malformed_config_json_is_one_line_naming_the_field(fake_trtllm, tmp_path, capsys, content, refused):
    (tmp_path / "config.json").write_text(content)
    assert build.main(["--checkpoint_dir", str(tmp_path), "--speculative_decoding_mode", "dflash"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and refused in err, err
    assert str(tmp_path) in err
    assert fake_trtllm["argv"] is None


def test_a_missing_checkpoint_dir_is_named(fake_trtllm, tmp_path, capsys):
    missing = str(tmp_path / "nope")
    for argv in (["--checkpoint_dir", missing, "--speculative_decoding_mode", "dflash"], ["--checkpoint_dir", missing]):
        assert build.main(argv) == 2
        assert capsys.readouterr().err.strip() == f"error: --checkpoint_dir={missing!r} does not exist"
    assert build.main(["--checkpoint_dir", str(tmp_path), "--speculative_decoding_mode", "dflash"]) == 2
    assert f"--checkpoint_dir={str(tmp_path)!r} has no config.json" in capsys.readouterr().err
    assert build.main(["--speculative_decoding_mode", "dflash"]) == 2
    assert "needs --checkpoint_dir" in capsys.readouterr().err
    assert fake_trtllm["argv"] is None


def test_a_dflash_build_never_writes_over_its_checkpoint_and_a_failed_build_publishes_nothing(fake_trtllm, tmp_path,
                                                                                           capsys):
    """--output_dir equal to --checkpoint_dir replaced the checkpoint's config.json with the engine's; a build that
    fails (or is killed) leaves the previous engine as it was."""
    ckpt = write_ckpt(tmp_path)
    assert build.main(["--checkpoint_dir", str(ckpt), "--output_dir", str(ckpt), "--speculative_decoding_mode",
                       "dflash"]) == 2
    assert "is also --checkpoint_dir" in capsys.readouterr().err and fake_trtllm["argv"] is None
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text("previous")
    (engine / "rank0.engine").write_text("previous")

    def failing_build():
        out = sys.argv[sys.argv.index("--output_dir") + 1]
        (Path(out) / "config.json").write_text("new")
        raise RuntimeError("killed mid-build")

    sys.modules["tensorrt_llm.commands.build"].main = failing_build
    with pytest.raises(RuntimeError):
        build.main(["--checkpoint_dir", str(ckpt), "--output_dir", str(engine), "--speculative_decoding_mode", "dflash"])
    assert (engine / "config.json").read_text() == "previous" and (engine / "rank0.engine").read_text() == "previous"
    assert not list(tmp_path.glob(".engine.staging-*"))


def test_a_missing_or_damaged_plugin_library_is_one_line_before_the_build(fake_trtllm, dflash_ckpt, tmp_path, capsys,
                                                                        monkeypatch):
    """trtllm-build --speculative_decoding_mode dflash without a usable libdflash_trt_plugins.so ended in a Python
    traceback (FileNotFoundError, or ctypes' bare OSError for a damaged file); now one line naming the file, exit 2,
    and nothing built or published."""
    from tensorrt_llm_dflash.trtllm import plugins

    monkeypatch.setattr(plugins, "load_plugin_library", REAL_LOAD_PLUGIN_LIBRARY)
    monkeypatch.setattr(plugins, "REPO_BUILD_DIR", tmp_path / "no_build")
    argv = ["--checkpoint_dir", str(dflash_ckpt), "--output_dir", "engine", "--speculative_decoding_mode", "dflash"]
    damaged = tmp_path / "libdflash_trt_plugins.so"
    damaged.write_bytes(b"\x7fELF half a library")
    for library, says in ((tmp_path / "absent.so", "libdflash_trt_plugins.so not found (tried"),
                          (damaged, f"{damaged} is not a loadable shared library")):
        monkeypatch.setenv(plugins.PLUGIN_LIBRARY_ENV_VAR, str(library))
        assert build.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1, err
    assert fake_trtllm["argv"] is None and not (tmp_path / "engine").exists()


def test_the_current_directory_and_a_symlinked_output_dir(fake_trtllm, tmp_path, capsys):
    """--output_dir . or .. is refused by one check shared with files.publish_dir (files.holds_current_directory),
    worded for the flag; an --output_dir that is a link to a directory publishes the engine where it points and
    keeps the link (the link was replaced by a real directory and hidden under a staging name)."""
    (tmp_path / "ckpt").mkdir()
    dflash_ckpt = write_ckpt(tmp_path / "ckpt")
    for output in (".", "..", str(tmp_path)):
        assert build.main(["--checkpoint_dir", str(dflash_ckpt), "--output_dir", output,
                           "--speculative_decoding_mode", "dflash"]) == 2
        err = capsys.readouterr().err
        assert f"--output_dir={output!r} is (or holds) the current directory: the engine directory is published " \
               "whole, replacing it" in err, err
    assert fake_trtllm["argv"] is None
    real = tmp_path / "disk" / "engine"
    real.mkdir(parents=True)
    (tmp_path / "engine").symlink_to(real)

    def build_engine():
        out = Path(sys.argv[sys.argv.index("--output_dir") + 1])
        (out / "config.json").write_text("engine")
        (out / "rank0.engine").write_text("engine")

    sys.modules["tensorrt_llm.commands.build"].main = build_engine
    assert build.main(["--checkpoint_dir", str(dflash_ckpt), "--output_dir", "engine",
                       "--speculative_decoding_mode", "dflash"]) == 0
    assert (tmp_path / "engine").is_symlink() and (real / "rank0.engine").read_text() == "engine"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_dry_run_or_an_incomplete_build_never_replaces_the_engine(fake_trtllm, tmp_path, capsys):
    """``--dry_run`` over an existing engine directory deleted its rank engines: TensorRT-LLM writes config.json
    alone in a dry run, and that staging directory was published whole in place of the engine. A dry run now
    publishes nothing, and a build whose staging directory lacks a rank engine of the checkpoint's world size is
    refused by name, the previous engine kept."""
    (tmp_path / "ckpt").mkdir()
    ckpt = write_ckpt(tmp_path / "ckpt", mapping={"world_size": 2, "tp_size": 2, "pp_size": 1})
    engine = tmp_path / "engine"
    engine.mkdir()
    for name in ("config.json", "rank0.engine", "rank1.engine"):
        (engine / name).write_text("previous")
    written: list[list[str]] = []

    def build_writing(*names: str):
        def main():
            out = Path(sys.argv[sys.argv.index("--output_dir") + 1])
            for name in names:
                (out / name).write_text("new")
            written.append(sorted(p.name for p in out.iterdir()))
        return main

    argv = ["--checkpoint_dir", str(ckpt), "--output_dir", "engine", "--speculative_decoding_mode", "dflash"]
    commands_build = sys.modules["tensorrt_llm.commands.build"]
    commands_build.main = build_writing("config.json")  # what TensorRT-LLM's Engine.save writes in a dry run
    assert build.main([*argv, "--dry_run"]) == 0
    assert "--dry_run: nothing is published" in capsys.readouterr().err
    assert written == [["config.json"]]
    commands_build.main = build_writing("config.json", "rank0.engine")  # a rank missing, however that came about
    for code, says in ((2, "the build wrote no complete engine: it has no rank1.engine (the checkpoint's world_size "
                           "is 2); engine is unchanged"), (0, "")):
        if code == 0:
            commands_build.main = build_writing("config.json", "rank0.engine", "rank1.engine")
        assert build.main(argv) == code
        err = capsys.readouterr().err
        assert says in err, err
        kept = code == 2
        assert all((engine / name).read_text() == ("previous" if kept else "new")
                   for name in ("config.json", "rank0.engine", "rank1.engine"))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_context_logits_are_refused_by_name_before_tensorrt_llm_starts(fake_trtllm, dflash_ckpt, capsys):
    """``--gather_context_logits`` reached TensorRT-LLM's main, which raises a RuntimeError for any draft length
    (tensorrt_llm/commands/build.py): a traceback after TensorRT-LLM's import. Now one line, exit 2."""
    for flag, named in (("--gather_context_logits", "--gather_context_logits"),
                        ("--gather_context", "--gather_context_logits"),
                        ("--gather_all_token_logits", "--gather_all_token_logits")):  # main sets context logits too
        assert build.main(["--checkpoint_dir", str(dflash_ckpt), "--output_dir", "engine", flag,
                           "--speculative_decoding_mode", "dflash"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {named}: ") and len(err.strip().splitlines()) == 1, err
    assert fake_trtllm["argv"] is None


def test_a_draft_length_left_in_the_environment_never_overrides_the_checkpoint(fake_trtllm, dflash_ckpt,
                                                                                 monkeypatch):
    """$TRTLLM_DFLASH_MAX_DRAFT_LEN carries --max_draft_len to DFlashConfig; without the flag it was left as it was,
    so a value exported in the shell, or set by an earlier build in the same process, became the engine's
    max_draft_len unchecked (40 over a checkpoint of 7; 300, past the 256 limit, alike). Now the build sees
    exactly the flag, or none (the checkpoint's value)."""
    import os

    seen = []
    build_main = sys.modules["tensorrt_llm.commands.build"].main

    def recording_main():
        seen.append(os.environ.get(build.MAX_DRAFT_LEN_ENV))
        build_main()

    sys.modules["tensorrt_llm.commands.build"].main = recording_main
    argv = ["--checkpoint_dir", str(dflash_ckpt), "--output_dir", "engine", "--speculative_decoding_mode", "dflash"]
    monkeypatch.setenv(build.MAX_DRAFT_LEN_ENV, "300")
    assert build.main(argv) == 0
    assert build.main([*argv, "--max_draft_len", "40"]) == 0
    assert build.main(argv) == 0
    assert seen == [None, "40", None]


def test_under_mpirun_the_ranks_build_into_one_directory(fake_trtllm, tmp_path, capsys):
    """mpirun -n 2 trtllm-build: each process builds its ranks into --output_dir (TensorRT-LLM's parallel_build);
    a staging directory per process held one rank's engine each, and the build refused both (or, before that check,
    each published its own, the last replacing the other). Under MPI the build goes straight to --output_dir."""
    (tmp_path / "ckpt").mkdir()
    ckpt = write_ckpt(tmp_path / "ckpt", mapping={"world_size": 2, "tp_size": 2, "pp_size": 1})
    fake_trtllm["mpi_world_size"] = 2
    (tmp_path / "engine").mkdir()  # TensorRT-LLM's main makes it (the stand-in main here writes into it alone)
    assert build.main(["--checkpoint_dir", str(ckpt), "--output_dir", "engine", "--speculative_decoding_mode",
                       "dflash"]) == 0
    assert build._flag_value(fake_trtllm["argv"][1:], "--output_dir") == "engine"
    assert "note: built under mpirun (2 processes): the engine is written to" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "engine").iterdir()) == ["config.json", "rank0.engine", "rank1.engine"]
