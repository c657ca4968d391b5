"""The package and the PyTorch runtime work without tensorrt / tensorrt_llm installed.

A subprocess marks ``tensorrt`` and ``tensorrt_llm`` as absent (``sys.modules[name] =
None``, so the test means the same on a machine where they are installed), imports the package, the TensorRT-LLM integration
modules that must stay import-free (weight, build, runner, plugins), converts nothing,
and runs a tiny PyTorch DFlash generation end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import sys

    # None in sys.modules makes `import tensorrt` raise ModuleNotFoundError and
    # importlib.util.find_spec("tensorrt") return None: exactly "not installed".
    for blocked in ("tensorrt", "tensorrt_llm"):
        sys.modules[blocked] = None
    sys.path[:0] = [ROOT, ROOT + "/tests"]

    import torch
    torch.set_num_threads(1)
    import tensorrt_llm_dflash
    import tensorrt_llm_dflash.trtllm
    import tensorrt_llm_dflash.trtllm.weight
    import tensorrt_llm_dflash.trtllm.build
    import tensorrt_llm_dflash.trtllm.runner
    import tensorrt_llm_dflash.trtllm.plugins
    for eager in ("tensorrt_llm_dflash.trtllm.config", "tensorrt_llm_dflash.trtllm.model"):
        try:
            __import__(eager)
        except ModuleNotFoundError as err:
            assert "tensorrt" in str(err), err
        else:
            raise AssertionError(eager + " imported without tensorrt_llm")

    from tiny_models import cached_target, tiny_drafter
    from tensorrt_llm_dflash.decode import speculative_generate
    from tensorrt_llm_dflash.proposer import DFlashProposer
    from tensorrt_llm_dflash.target import HFTargetVerifier

    target = cached_target("qwen3", seed=0, vocab=32)
    drafter = tiny_drafter(target, block_size=4)
    verifier = HFTargetVerifier(target, drafter.config.target_layer_ids)
    proposer = DFlashProposer.for_target(drafter, target)
    result = speculative_generate(verifier, proposer, [3, 5, 7, 9], 12, ddtree_budget=4)
    assert len(result.output_ids) == 12, result.output_ids
    leaked = sorted(m for m, mod in sys.modules.items()
                    if mod is not None and m.split(".")[0] in ("tensorrt", "tensorrt_llm"))
    assert not leaked, leaked
    print("OK", result.stats.steps)
    """
)


def test_package_and_pytorch_runtime_need_no_tensorrt():
    code = f"ROOT = {str(ROOT)!r}\n" + SCRIPT
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("OK")


def _package_imports(path: Path, package: str) -> set[str]:
    """Modules of ``package`` that ``path`` imports, at module level or inside functions."""
    import ast

    here = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
    parent = here.rsplit(".", 1)[0] if path.name != "__init__.py" else here.removesuffix(".__init__")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = parent.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            module = name.removesuffix(".__init__")
            if module.startswith(package + ".") and (ROOT / (module.replace(".", "/") + ".py")).is_file():
                found.add(module)
    return found - {here}


def test_trtllm_modules_import_no_circle():
    """No import circle inside tensorrt_llm_dflash/trtllm, function-level imports included (a
    circle once ran build.py -> model.py -> config.py -> build.py; constants now live in
    constants.py). A circle works or breaks depending on which module a process imports first."""
    package = "tensorrt_llm_dflash.trtllm"
    graph = {
        path.relative_to(ROOT).with_suffix("").as_posix().replace("/", "."): _package_imports(path, package)
        for path in sorted((ROOT / "tensorrt_llm_dflash" / "trtllm").glob("*.py")) if path.name != "__init__.py"
    }
    assert "tensorrt_llm_dflash.trtllm.constants" in graph["tensorrt_llm_dflash.trtllm.config"]
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])
