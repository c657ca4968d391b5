#!/usr/bin/env bash
# One-command verification of the TensorRT-LLM engine path on a CUDA GPU machine.
#   scripts/verify_trtllm_gpu.sh            # uses ./.venv-trtllm (created if missing)
#   PYTHON=python3.12 scripts/verify_trtllm_gpu.sh
# Needs: NVIDIA driver + CUDA 12.x/13.x toolkit (nvcc), cmake, Python 3.10 or 3.12
# (TensorRT-LLM 1.2.1 wheels), OpenMPI for the tp=2 test (optional).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-trtllm}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --upgrade pip
# TensorRT-LLM 1.2.1 pins tensorrt~=10.14.1, torch<=2.10, transformers==4.57.3, numpy<2.
"$PY" -m pip install "tensorrt_llm==1.2.1" --extra-index-url https://pypi.nvidia.com
"$PY" -m pip install -e ".[test]"

# The DFlash TensorRT plugins, against the TensorRT that tensorrt_llm pulled in.
TRT_ROOT=$("$PY" - <<'PY'
import os, tensorrt_libs  # the pip TensorRT libraries
print(os.path.dirname(tensorrt_libs.__file__))
PY
) || TRT_ROOT=""
cmake -S plugins -B plugins/build ${TRT_ROOT:+-DTensorRT_ROOT="$TRT_ROOT"}
cmake --build plugins/build -j
test -f plugins/build/libdflash_trt_plugins.so || { echo "libdflash_trt_plugins.so was not built (see cmake output)"; exit 1; }

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
"$PY" -m pytest -m trtllm -rs -v tests/test_trtllm_engine.py
"$PY" -m pytest -q tests/test_trtllm_convert.py tests/test_trtllm_build.py tests/test_trtllm_imports.py
echo "TensorRT-LLM engine path verified."
