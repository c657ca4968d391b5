#!/usr/bin/env python
"""The checks scripts/verify_trtllm_gpu.sh runs inside its venv, one subcommand each.

Each check is a function of plain inputs (tested on CPU in tests/test_verify_trtllm_gpu.py) plus
a thin command line that gathers those inputs on the GPU machine. A failed check exits non-zero
with one line saying what was found and what was expected.

    python scripts/verify_trtllm_checks.py versions 1.2.1 10.14 2.9.1
    python scripts/verify_trtllm_checks.py hook
    python scripts/verify_trtllm_checks.py headers TensorRT/include/NvInferVersion.h
    python scripts/verify_trtllm_checks.py libnvinfer
    python scripts/verify_trtllm_checks.py junit logs/trtllm.xml
    python scripts/verify_trtllm_checks.py compare engine_run.json pytorch_run.json [--any-acceptance]
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# What TensorRT-LLM 1.2.1 pins besides the three versions the shell script passes in
# (PKG-INFO of the tensorrt_llm 1.2.1 sdist: transformers==4.57.3, numpy<2).
TRANSFORMERS_PIN = "4.57.3"
# The one engine test that may skip on a single-GPU machine (tests/test_trtllm_engine.py).
ALLOWED_SKIP = "2 CUDA GPUs"


def versions(found: dict[str, str], trtllm: str, trt_series: str, torch_version: str, cuda: bool) -> list[str]:
    """Problems with the installed versions (empty when they are TensorRT-LLM 1.2.1's pins)."""
    expected = {
        "tensorrt_llm": (found.get("tensorrt_llm") == trtllm, trtllm),
        "tensorrt": (str(found.get("tensorrt", "")).startswith(trt_series + "."), f"{trt_series}.x"),
        "torch": (str(found.get("torch", "")).split("+")[0] == torch_version, torch_version),
        "transformers": (found.get("transformers") == TRANSFORMERS_PIN, TRANSFORMERS_PIN),
        "numpy": (str(found.get("numpy", "9")).split(".")[0].isdigit()
                  and int(str(found.get("numpy", "9")).split(".")[0]) < 2, "<2"),
    }
    problems = [f"{name} {found.get(name, 'missing')} (expected {want})" for name, (good, want) in expected.items()
                if not good]
    if not cuda:
        problems.append("torch sees no CUDA device")
    return problems


def hook(script_text: str, pth_files: list[Path]) -> list[str]:
    """Problems with the trtllm-build set-up: the script must be TensorRT-LLM's own, and this
    package's start-up hook (the .pth) must be installed next to it."""
    problems = []
    if "tensorrt_llm.commands.build" not in script_text:
        problems.append("the trtllm-build script does not run tensorrt_llm.commands.build (another package owns it)")
    if not pth_files:
        problems.append("tensorrt_llm_dflash-trtllm-build.pth is not in site-packages (editable install?)")
    return problems


def header_version(text: str) -> str:
    """MAJOR.MINOR.PATCH from NvInferVersion.h."""
    parts = []
    for key in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"#define\s+TRT_{key}_ENTERPRISE\s+(\d+)", text)
        if match is None:
            raise ValueError(f"TRT_{key}_ENTERPRISE is not defined in NvInferVersion.h")
        parts.append(match.group(1))
    return ".".join(parts)


def headers(text: str, installed: str) -> list[str]:
    v = header_version(text)
    return [] if installed.startswith(v + ".") or installed == v else [f"headers are {v}, tensorrt is {installed}"]


def junit(xml_text: str) -> tuple[int, list[tuple[str, str]], list[str]]:
    """(tests run, skipped (name, reason), problems) of pytest's junit report."""
    cases = list(ET.fromstring(xml_text).iter("testcase"))
    skipped = [(c.get("name", "?"), (c.find("skipped").get("message") or "")) for c in cases
               if c.find("skipped") is not None]
    problems = [f"{name} skipped: {why}" for name, why in skipped if ALLOWED_SKIP not in why]
    failed = [c.get("name", "?") for c in cases if c.find("failure") is not None or c.find("error") is not None]
    problems += [f"{name} failed" for name in failed]
    if not cases:
        problems.append("no engine test was collected")
    return len(cases), skipped, problems


def compare(engine: dict, pytorch: dict, require_acceptance: bool = True) -> tuple[list[str], list[str]]:
    """(report lines, problems) for run.py's --output_json of the engine and of the PyTorch runtime.
    ``require_acceptance``: a trained drafter must get draft tokens accepted; the random engine
    demo pair's drafter (demo_pair.py) only guesses, so there it is reported, not required."""
    a, b = engine["output_ids"], pytorch["output_ids"]
    tau_a = engine["stats"]["mean_acceptance_length"]
    tau_b = pytorch["stats"]["mean_acceptance_length"]
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
    lines = [f"engine: {len(a)} tokens, tau {tau_a:.2f}; PyTorch runtime: {len(b)} tokens, tau {tau_b:.2f}",
             "tokens identical" if k is None else
             f"first differing token: {k} of {min(len(a), len(b))} (bf16 rounds differently in the two)"]
    problems = []
    if not a:
        problems.append("the engine generated no token")
    elif tau_a <= 1.0 and require_acceptance:
        problems.append(f"the engine accepted no draft token (tau {tau_a:.2f})")
    return lines, problems


def _site_packages() -> list[Path]:
    import site

    return [Path(p) for p in site.getsitepackages()]


def _finish(problems: list[str]) -> int:
    for p in problems:
        print(f"   !! {p}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    name, args = argv[0], argv[1:]
    if name == "versions":
        import importlib.metadata as md

        import torch

        found = {}
        for dist in ("tensorrt_llm", "tensorrt", "torch", "transformers", "numpy"):
            try:
                found[dist] = md.version(dist)
            except md.PackageNotFoundError:
                pass
        print("   " + ", ".join(f"{k} {v}" for k, v in found.items()) + f"; CUDA: {torch.cuda.is_available()}")
        return _finish(versions(found, *args, cuda=torch.cuda.is_available()))
    if name == "hook":
        script = Path(sys.prefix, "bin", "trtllm-build")
        text = script.read_text() if script.is_file() else ""
        pth = [p for d in _site_packages() for p in d.glob("tensorrt_llm_dflash*.pth")]
        print(f"   {script}: {'found' if text else 'missing'}; hook: {[p.name for p in pth]}")
        return _finish(hook(text, pth))
    if name == "headers":
        import importlib.metadata as md

        installed = md.version("tensorrt")
        text = Path(args[0]).read_text()
        print(f"   headers {header_version(text)}, installed tensorrt {installed}")
        return _finish(headers(text, installed))
    if name == "libnvinfer":
        hits = sorted(p for d in _site_packages() for p in d.glob("tensorrt*/libnvinfer.so.1*"))
        if not hits:
            return _finish(["libnvinfer.so.10 is not in the venv's tensorrt packages"])
        print(hits[0])
        return 0
    if name == "junit":
        count, skipped, problems = junit(Path(args[0]).read_text())
        print(f"   {count} engine tests, {len(skipped)} skipped")
        return _finish(problems)
    if name == "compare":
        runs = [json.loads(Path(p).read_text())["outputs"][0] for p in args[:2]]
        lines, problems = compare(*runs, require_acceptance="--any-acceptance" not in args[2:])
        for line in lines:
            print(f"   {line}")
        return _finish(problems)
    print(f"unknown check {name!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
