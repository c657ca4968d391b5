"""docs/trtllm_engine.md lists every tensorrt_llm symbol the package imports, with a source path."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "trtllm_engine.md"


def imported_trtllm_symbols() -> dict[str, set[str]]:
    """``tensorrt_llm.x.y`` for every ``from tensorrt_llm.x import y`` / ``import tensorrt_llm...``."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tensorrt_llm_dflash").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tensorrt_llm":
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "tensorrt_llm"]
            for name in names:
                found.setdefault(name, set()).add(path.name)
    return found


def test_every_tensorrt_llm_symbol_is_documented_with_its_source():
    symbols = imported_trtllm_symbols()
    assert len(symbols) > 30  # the model imports most of the surface
    rows = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"\| `(tensorrt_llm[\w.]*)` \| (.+?) \|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    missing = sorted(set(symbols) - set(rows))
    assert not missing, f"not listed in docs/trtllm_engine.md: {missing}"
    for name in symbols:
        assert re.search(r"tensorrt_llm/[\w/]+\.py|cpp/tensorrt_llm/", rows[name]), f"{name} has no source path"
