"""The package and the PyTorch runtime work without tensorrt / tensorrt_llm installed.

A subprocess marks ``tensorrt`` and ``tensorrt_llm`` as absent (``sys.modules[name] =
None``, so the test means the same on a machine where they are installed), imports the package, the TensorRT-LLM integration
modules that must stay import-free (weight, build, runner, batch, serve_runner, plugins), converts nothing,
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
    import tensorrt_llm_dflash.trtllm.batch
    import tensorrt_llm_dflash.trtllm.serve_runner
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


#: Imports made inside a function, on purpose, that close a circle: (importer, imported) -> why.
LAZY_BACK_EDGES = {
    ("tensorrt_llm_dflash.trtllm.config", "tensorrt_llm_dflash.trtllm.model"):
        "DFlashConfig.__setstate__: a spawn worker that unpickles the config must find "
        "DFlashForCausalLM in MODEL_MAP, which importing model.py registers",
}


def _package_imports(path: Path, package: str) -> dict[str, bool]:
    """Modules of ``package`` that ``path`` imports -> whether at module level (``import`` /
    ``from`` statements, and ``import_module`` calls with a literal name)."""
    import ast

    here = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
    parent = here.rsplit(".", 1)[0]

    def absolute(name: str, level: int) -> str:
        if not level:
            return name
        anchor = parent.split(".")[: len(parent.split(".")) - (level - 1)]
        return ".".join(anchor + ([name] if name else []))

    found: dict[str, bool] = {}

    def visit(node: ast.AST, top: bool) -> None:
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = absolute(node.module or "", node.level)
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            target = node.args[0].value
            names = [absolute(target.lstrip("."), len(target) - len(target.lstrip(".")))]
        for name in names:
            if name.startswith(package + ".") and (ROOT / (name.replace(".", "/") + ".py")).is_file() and name != here:
                found[name] = found.get(name, False) or top
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text()), True)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    circles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return circles


def test_trtllm_modules_import_no_circle():
    """No import circle inside tensorrt_llm_dflash/trtllm at module level (one once ran
    build.py -> model.py -> config.py -> build.py: config.py read a constant from build.py;
    constants now live in constants.py); a module-level circle works or breaks depending on
    which module a process imports first. Function-level imports may close a circle only where
    LAZY_BACK_EDGES says why."""
    package = "tensorrt_llm_dflash.trtllm"
    imports = {
        path.relative_to(ROOT).with_suffix("").as_posix().replace("/", "."): _package_imports(path, package)
        for path in sorted((ROOT / "tensorrt_llm_dflash" / "trtllm").glob("*.py")) if path.name != "__init__.py"
    }
    assert imports["tensorrt_llm_dflash.trtllm.config"]["tensorrt_llm_dflash.trtllm.constants"] is True
    module_level = {m: {n for n, top in found.items() if top} for m, found in imports.items()}
    assert not _circles(module_level), _circles(module_level)
    everything = {m: set(found) for m, found in imports.items()}
    for circle in _circles(everything):
        edges = set(zip(circle, circle[1:]))
        assert edges & set(LAZY_BACK_EDGES), f"import circle through function-level imports: {' -> '.join(circle)}"
    for importer, imported in LAZY_BACK_EDGES:
        assert imports[importer].get(imported) is False, f"{importer} -> {imported} is no longer a lazy import"
