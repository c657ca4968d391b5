#!/usr/bin/env bash
# Set up a fresh machine and run the whole test suite (CPU; GPU/TensorRT-LLM tests skip with a reason).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || { echo "setup failed"; exit 1; }
PY=${PYTHON:-python3}
$PY -m ruff check . || { echo "ruff found problems"; exit 1; }
$PY -m pytest -q -rs tests "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: the setup is broken" >&2
    exit 1
fi
exit "$status"
