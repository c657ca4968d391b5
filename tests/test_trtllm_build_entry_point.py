"""`trtllm-build --speculative_decoding_mode dflash` works with TensorRT-LLM's own command, and
this package never owns that command (defect 7 of docs/trtllm_engine.md).

Two real wheels are installed into a fresh virtual environment in both orders, and this package
is uninstalled: this package's wheel (built from this checkout: setup.py ships the start-up
hook, tensorrt_llm_dflash/trtllm/hook.py) and a stand-in "tensorrt_llm" distribution (the
test-only TensorRT-LLM stand-in, packaged with TensorRT-LLM's console script
``trtllm-build = tensorrt_llm.commands.build:main``). The ``trtllm-build`` file is always
TensorRT-LLM's; with this package installed it builds a DFlash engine; after the uninstall the
dflash mode is TensorRT-LLM's own argparse error again and plain builds are untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "trtllm_standin"

pytestmark = pytest.mark.slow


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, " ".join(map(str, cmd)) + "\n" + result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _standin_wheel(tmp: Path) -> Path:
    project = tmp / "standin-dist"
    for package in ("tensorrt", "tensorrt_llm", "_emu"):
        shutil.copytree(STANDIN / package, project / package, ignore=shutil.ignore_patterns("__pycache__"))
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "tensorrt_llm"\nversion = "1.2.1"\n'
        '[project.scripts]\ntrtllm-build = "tensorrt_llm.commands.build:main"\n'
        '[tool.setuptools.packages.find]\ninclude = ["tensorrt*", "_emu*"]\n'
        '[tool.setuptools.package-data]\n_emu = ["*.c"]\n')
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"),
          str(project)])
    return next((tmp / "dist").glob("tensorrt_llm-*.whl"))


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheels")
    source = tmp / "src"  # a clean copy: the build must not write into the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "runs",
                                                                "benchmarks", "tests", ".venv*"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"),
          str(source)])
    ours = next((tmp / "dist").glob("tensorrt_llm_dflash-*.whl"))
    return ours, _standin_wheel(tmp)


def _running_site_dirs() -> list[str]:
    """The site directories this test runs with (a venv's, pyenv's, Debian's dist-packages, the user site)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if Path(d).is_dir()]


def _venv(path: Path) -> Path:
    """A fresh venv that sees the running environment's packages (torch, transformers) behind its own.

    ``--system-site-packages`` would expose the *base* interpreter's site-packages, which is not
    where torch is when the tests run inside a venv; instead a .pth in the new venv adds the
    running environment's site directories after its own (``site.addsitedir`` also runs their .pth files,
    as a system site would), whatever that environment is: system Python, venv or pyenv.
    """
    _run([sys.executable, "-m", "venv", "--without-pip", str(path)])
    purelib = _run([str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    line = "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in _running_site_dirs())
    (Path(purelib.stdout.strip()) / "_running_environment.pth").write_text(line + "\n")
    return path / "bin"


def _pip(bindir: Path, *args: str) -> None:
    _run([sys.executable, "-m", "pip", "--python", str(bindir / "python"), *args, "-q"])


def _script_target(bindir: Path) -> str:
    text = (bindir / "trtllm-build").read_text()
    return "tensorrt_llm.commands.build" if "from tensorrt_llm.commands.build import main" in text else text


@pytest.fixture
def env(tmp_path):
    from _emu_paths import cpu_library, standin_library

    return {**os.environ, "DFLASH_TRT_PLUGIN_LIB": str(standin_library(tmp_path)),
            "DFLASH_PLUGIN_LIB": str(cpu_library()), "DFLASH_REPO_ROOT": str(ROOT),
            "TRTLLM_STANDIN_NUMERICS": "exact", "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}


def _dflash_build(bindir: Path, ckpt: Path, out: Path, env: dict) -> subprocess.CompletedProcess:
    from engine_case import build_argv

    return subprocess.run([str(bindir / "trtllm-build"), *build_argv(ckpt, out)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=out.parent)


@pytest.mark.parametrize("order", ["ours_first", "trtllm_first"])
def test_trtllm_build_is_tensorrt_llms_and_builds_dflash(tmp_path, wheels, env, order):
    from engine_case import write_checkpoint

    ours, trtllm = wheels
    bindir = _venv(tmp_path / "venv")
    for wheel in ((ours, trtllm) if order == "ours_first" else (trtllm, ours)):
        _pip(bindir, "install", "--no-deps", "--no-index", str(wheel))
    assert _script_target(bindir) == "tensorrt_llm.commands.build"
    assert not (bindir / "trtllm-build").read_text().count("tensorrt_llm_dflash")
    assert (bindir / "dflash-trtllm-build").is_file()
    site = Path(_run([str(bindir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     env=env).stdout.strip())
    assert (site / "tensorrt_llm_dflash-trtllm-build.pth").is_file()

    _, _, ckpt = write_checkpoint(tmp_path / "case", "qwen3")
    result = _dflash_build(bindir, ckpt, tmp_path / "case" / "engine", env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    config = json.loads((tmp_path / "case" / "engine" / "config.json").read_text())
    assert config["pretrained_config"]["architecture"] == "DFlashForCausalLM"
    assert config["build_config"]["speculative_decoding_mode"] == 4  # MEDUSA, as the dflash mode maps
    # A DFlash checkpoint without the mode is refused by name, through TensorRT-LLM's command.
    bad = subprocess.run([str(bindir / "trtllm-build"), "--checkpoint_dir", str(ckpt), "--max_draft_len", "40"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "build it with --speculative_decoding_mode dflash" in bad.stderr


def test_uninstalling_leaves_tensorrt_llms_command_intact(tmp_path, wheels, env):
    from engine_case import write_checkpoint

    ours, trtllm = wheels
    bindir = _venv(tmp_path / "venv")
    _pip(bindir, "install", "--no-deps", "--no-index", str(trtllm))
    _pip(bindir, "install", "--no-deps", "--no-index", str(ours))
    _pip(bindir, "uninstall", "-y", "tensorrt_llm_dflash")
    assert (bindir / "trtllm-build").is_file() and _script_target(bindir) == "tensorrt_llm.commands.build"
    assert not (bindir / "dflash-trtllm-build").exists()
    _, _, ckpt = write_checkpoint(tmp_path / "case", "qwen3")
    result = _dflash_build(bindir, ckpt, tmp_path / "case" / "engine", env)
    assert result.returncode == 2 and "invalid choice: 'dflash'" in result.stderr
