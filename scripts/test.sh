#!/usr/bin/env bash
# Set up a fresh machine and run the test suite (CPU; GPU/TensorRT-LLM tests skip with a reason).
#
# With no arguments, both ends of what the project supports:
#   1. the whole suite in the project's environment (a fresh one has the newest transformers 5.x and numpy 2),
#      holding the engine path (run through the stand-in) to 95% line coverage;
#   2. the engine and runtime core on the oldest stack, TensorRT-LLM 1.2.1's pins (transformers 4.57.3,
#      numpy 1.26: scripts/oldest_stack.sh), unless step 1 already ran on it.
# With arguments, pytest runs once, in the project's environment, with those arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || { echo "setup failed"; exit 1; }
source scripts/python_env.sh
"$PY" -m ruff check . || { echo "ruff found problems"; exit 1; }

versions() { "$PY" -c 'import numpy, torch, transformers; print(f"transformers {transformers.__version__}, numpy {numpy.__version__}, torch {torch.__version__}")'; }

run_pytest() {
  "$PY" -m pytest -q -rs "$@"
  local status=$?
  if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: the setup is broken" >&2
    return 1
  fi
  return "$status"
}

if [ $# -gt 0 ]; then
  echo "== tests on $(versions)"
  run_pytest tests "$@"
  exit $?
fi

echo "== 1/2: the whole suite on $(versions)"
run_pytest tests --cov=tensorrt_llm_dflash.trtllm --cov-report=term --cov-fail-under=95
whole=$?

# The engine path is what TensorRT-LLM 1.2.1 users run, on its pinned transformers and numpy; the runtime and
# drafter core are what every other part is checked against.
CORE=(tests/test_compat.py tests/test_lossless.py tests/test_drafter.py tests/test_graphed.py tests/test_padded_prefill.py
      tests/test_model_files.py tests/test_verify_fast.py tests/test_streaming.py tests/test_trtllm_convert.py
      tests/test_trtllm_engine_emulated.py tests/test_trtllm_documented_flow.py tests/test_trtllm_runner.py
      tests/test_dflash2_golden.py)
core=0
if "$PY" -c "import sys, transformers; sys.exit(transformers.__version__.startswith('4.57.'))"; then
  source scripts/oldest_stack.sh
  if [ -n "$OLDEST_PYTHONPATH" ]; then
    export PYTHONPATH="$OLDEST_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH}"
    echo "== 2/2: the engine and runtime core on $(versions)"
    run_pytest "${CORE[@]}"
    core=$?
  else
    echo "== 2/2: FAILED: the oldest stack could not be installed" >&2
    core=1
  fi
else
  echo "== 2/2: skipped: step 1 ran on transformers 4.57 (the oldest supported stack) already"
fi
[ "$whole" -eq 0 ] && [ "$core" -eq 0 ]
