#!/usr/bin/env bash
# Set up a fresh machine and run the whole test suite (CPU; GPU/TensorRT-LLM tests skip with a reason).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || { echo "setup failed"; exit 1; }
source scripts/python_env.sh
"$PY" -m ruff check . || { echo "ruff found problems"; exit 1; }
if [ $# -eq 0 ]; then
    # The whole suite: also hold the engine path (run in CI through the stand-in) to 95% line coverage.
    set -- --cov=tensorrt_llm_dflash.trtllm --cov-report=term --cov-fail-under=95
fi
"$PY" -m pytest -q -rs tests "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: the setup is broken" >&2
    exit 1
fi
exit "$status"
