#!/usr/bin/env bash
# Verify the TensorRT-LLM 1.2.1 engine path on a fresh CUDA GPU machine with internet access.
#
#   scripts/verify_trtllm_gpu.sh --dry-run     # print every step and probe this machine; changes nothing
#   scripts/verify_trtllm_gpu.sh               # install, build, test, run the documented flow, verdict
#
# Options:
#   --dry-run              list the steps (with the probes' findings) and exit 0
#   --work-dir DIR         venv, TensorRT headers, models, engines and logs (default: .verify-trtllm)
#   --no-system-packages   never call apt-get; only check that the system tools are there
#   --model-dir DIR        HF target for the documented flow (default: the engine demo pair, made offline by
#                          `python -m tensorrt_llm_dflash.trtllm.demo_pair`: a random Qwen3 with 4 q / 2 KV heads
#                          of 128). A published pair: --model-dir Qwen3-8B --drafter-dir Qwen3-8B-DFlash-b16
#   --drafter-dir DIR      DFlash drafter for --model-dir (required with it)
#   PYTHON=python3.12      interpreter for the venv (default: python3.12, else python3.10)
#   NVIDIA_SMI=PATH        the nvidia-smi to probe the GPU with (default: nvidia-smi on PATH)
# Not the embedded SmolLM2-135M-Instruct: its 9 q / 3 KV heads of 64 have no TensorRT-LLM
# tree-verification kernel (docs/trtllm_engine.md, "Shapes, blocks and GPUs"); trtllm-build refuses it.
#
# Pins, from TensorRT-LLM 1.2.1 (the PyPI sdist's PKG-INFO Requires-Dist, and the 1.2 installation
# page https://nvidia.github.io/TensorRT-LLM/installation/linux.html):
#   Python 3.10 or 3.12 (the wheel's only classifiers); tensorrt~=10.14.1; torch>=2.9.1,<=2.10.0a0
#   (so torch 2.9.1, installed first from the cu130 index: "to align with the CUDA version used for
#   building TensorRT LLM wheels"); transformers==4.57.3; numpy<2; cuda-python>=13 and
#   nvidia-nccl-cu13 (a CUDA 13.0 wheel); libopenmpi-dev before `pip install tensorrt_llm`.
# TensorRT's pip wheels carry no C++ headers: the plugins compile against the headers of the
# NVIDIA/TensorRT repository at the tag of the installed version (v10.14 = 3b4ddc1d, whose
# NvInferVersion.h says 10.14.1.48) and link the wheel's libnvinfer.so.10.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

DRY_RUN=0
SYSTEM_PACKAGES=1
WORK=.verify-trtllm
MODEL_DIR=""
DRAFTER_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --no-system-packages) SYSTEM_PACKAGES=0 ;;
    --work-dir) WORK=${2:?--work-dir needs a directory}; shift ;;
    --model-dir) MODEL_DIR=${2:?--model-dir needs a directory}; shift ;;
    --drafter-dir) DRAFTER_DIR=${2:?--drafter-dir needs a directory}; shift ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "verify_trtllm_gpu.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if { [ -n "$MODEL_DIR" ] && [ -z "$DRAFTER_DIR" ]; } || { [ -z "$MODEL_DIR" ] && [ -n "$DRAFTER_DIR" ]; }; then
  echo "verify_trtllm_gpu.sh: --model-dir and --drafter-dir go together (a target and the DFlash drafter trained" \
       "for it); without both the engine demo pair is used" >&2
  exit 2
fi

TRTLLM_VERSION=1.2.1
TORCH_VERSION=2.9.1
TORCH_INDEX=https://download.pytorch.org/whl/cu130
NVIDIA_INDEX=https://pypi.nvidia.com
TRT_SERIES=10.14            # tensorrt~=10.14.1
CUDA_MAJOR=13               # the 1.2.1 wheel is a CUDA 13.0 build
MIN_DRIVER=580              # CUDA 13.0 needs an R580 or newer driver
DRAFT_LEN=32
BUDGET=32
PROMPT="Write a Python function that reverses a string."
WORK=$(realpath -m "$WORK")
VENV="$WORK/venv"
PY="$VENV/bin/python"
LOG="$WORK/logs"
TOTAL=15
RESULTS=()
STOPPED_AT=""

if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3.12
  for candidate in python3.12 python3.10; do
    if "$candidate" -c "" 2>/dev/null; then PYTHON=$candidate; break; fi
  done
fi
NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}
SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi

step_no=0
step() { step_no=$((step_no + 1)); CURRENT="[$step_no/$TOTAL] $1"; echo; echo "== $CURRENT"; }
note() { echo "   $*"; }
# `cmd ARGS...` shows the command (copy-pastable); runs it unless --dry-run, output in $LOG/step<N>.log.
cmd() {
  echo "   \$$(printf ' %q' "$@")"
  [ "$DRY_RUN" = 1 ] && return 0
  run "$@"
}
run() {
  mkdir -p "$LOG"
  "$@" > >(tee -a "$LOG/step$step_no.log") 2>&1
}
# `check NAME ARGS...`: one of scripts/verify_trtllm_checks.py's checks, in the venv.
check() { cmd "$PY" scripts/verify_trtllm_checks.py "$@"; }
ok() {
  if [ "$DRY_RUN" = 1 ]; then RESULTS+=("plan  $CURRENT"); else RESULTS+=("ok    $CURRENT${1:+ — $1}"); fi
}
skip() { RESULTS+=("skip  $CURRENT — $1"); }
fail() {
  RESULTS+=("FAIL  $CURRENT — $1")
  STOPPED_AT="$CURRENT"
  verdict 1
}
# In a dry run a probe's failure is reported and the listing goes on; in a real run it stops there.
probe_failed() {
  if [ "$DRY_RUN" = 1 ]; then
    note "!! $1 — a real run stops at this step"
    RESULTS+=("stop  $CURRENT — $1")
    [ -n "$STOPPED_AT" ] || STOPPED_AT="$CURRENT"
  else
    fail "$1"
  fi
}

verdict() {
  echo
  echo "================ TensorRT-LLM $TRTLLM_VERSION engine path: verdict ================"
  printf '%s\n' "${RESULTS[@]}"
  if [ "$DRY_RUN" = 1 ]; then
    if [ -n "$STOPPED_AT" ]; then
      echo "DRY RUN: $TOTAL steps listed, nothing changed. On this machine a real run stops at: $STOPPED_AT"
    else
      echo "DRY RUN: $TOTAL steps listed, nothing changed. The probes found nothing that stops a real run."
    fi
  elif [ "$1" = 0 ]; then
    echo "VERIFIED: plugins built, engine tests passed, the documented convert -> trtllm-build -> run.py flow ran."
  else
    echo "NOT VERIFIED: stopped at $STOPPED_AT"
    if [ -f "$LOG/step$step_no.log" ]; then echo "log: $LOG/step$step_no.log"; fi
  fi
  echo "==================================================================================="
  exit "$1"
}

# ----------------------------------------------------------------------------------------------
step "NVIDIA GPU and a driver for CUDA $CUDA_MAJOR (>= R$MIN_DRIVER)"
if ! command -v "$NVIDIA_SMI" >/dev/null; then
  probe_failed "no NVIDIA GPU here ($NVIDIA_SMI not found); nothing was installed"
else
  driver=$("$NVIDIA_SMI" --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  gpus=$("$NVIDIA_SMI" --query-gpu=name --format=csv,noheader 2>/dev/null | paste -sd, -)
  note "GPU(s): ${gpus:-none}; driver ${driver:-unknown}"
  if [ -z "$driver" ]; then
    probe_failed "nvidia-smi found no GPU"
  elif [ "${driver%%.*}" -lt "$MIN_DRIVER" ]; then
    probe_failed "driver $driver is older than R$MIN_DRIVER (CUDA $CUDA_MAJOR.0 wheels will not load)"
  else
    ok "$gpus, driver $driver"
  fi
fi

# ----------------------------------------------------------------------------------------------
step "System packages: OpenMPI (TensorRT-LLM's install guide), cmake, a C++ compiler, git, Python venv"
packages=(libopenmpi-dev openmpi-bin cmake build-essential git "$(basename "$PYTHON")-venv" "$(basename "$PYTHON")-dev")
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
note "missing: ${missing[*]:-none}"
if [ ${#missing[@]} -eq 0 ]; then
  ok "all present"
elif [ "$SYSTEM_PACKAGES" = 0 ]; then
  probe_failed "missing ${missing[*]} and --no-system-packages was given"
else
  cmd $SUDO apt-get update && cmd $SUDO apt-get install -y "${missing[@]}" || fail "apt-get install failed"
  ok "installed ${missing[*]}"
fi

# ----------------------------------------------------------------------------------------------
step "CUDA $CUDA_MAJOR toolkit (nvcc, and the cuda_runtime_api.h TensorRT's headers include)"
export PATH="/usr/local/cuda/bin:$PATH"
nvcc_version=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
note "nvcc: ${nvcc_version:-not found}"
if [ -n "$nvcc_version" ] && [ "${nvcc_version%%.*}" -ge "$CUDA_MAJOR" ]; then
  ok "nvcc $nvcc_version"
elif [ "$SYSTEM_PACKAGES" = 0 ]; then
  probe_failed "CUDA $CUDA_MAJOR toolkit missing and --no-system-packages was given"
else
  distro=$(. /etc/os-release 2>/dev/null && echo "${ID}${VERSION_ID//./}")
  keyring="https://developer.download.nvidia.com/compute/cuda/repos/${distro:-ubuntu2404}/$(uname -m | sed 's/aarch64/sbsa/')/cuda-keyring_1.1-1_all.deb"
  cmd curl -fsSLo "/tmp/cuda-keyring.deb" "$keyring" || fail "could not download $keyring"
  cmd $SUDO dpkg -i /tmp/cuda-keyring.deb && cmd $SUDO apt-get update \
    && cmd $SUDO apt-get install -y "cuda-toolkit-$CUDA_MAJOR-0" || fail "cuda-toolkit-$CUDA_MAJOR-0 did not install"
  ok "cuda-toolkit-$CUDA_MAJOR-0"
fi

# ----------------------------------------------------------------------------------------------
step "Python venv at $VENV ($PYTHON; TensorRT-LLM $TRTLLM_VERSION has wheels for 3.10 and 3.12)"
pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
note "$PYTHON: ${pyver:-not found}"
case "$pyver" in
  3.10|3.12) cmd "$PYTHON" -m venv "$VENV" && cmd "$PY" -m pip install --upgrade pip setuptools wheel \
               || fail "venv creation failed"; ok "Python $pyver" ;;
  *) probe_failed "Python 3.10 or 3.12 is needed, $PYTHON is '${pyver:-missing}' (set PYTHON=)" ;;
esac

# ----------------------------------------------------------------------------------------------
step "PyTorch $TORCH_VERSION, CUDA 13.0 build (installed before tensorrt_llm so pip keeps it)"
cmd "$PY" -m pip install "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX" || fail "torch $TORCH_VERSION did not install"
ok

# ----------------------------------------------------------------------------------------------
step "TensorRT-LLM $TRTLLM_VERSION and TensorRT $TRT_SERIES from $NVIDIA_INDEX"
cmd "$PY" -m pip install "tensorrt_llm==$TRTLLM_VERSION" --extra-index-url "$NVIDIA_INDEX" \
  || fail "tensorrt_llm==$TRTLLM_VERSION did not install (OpenMPI headers? see the log)"
check versions "$TRTLLM_VERSION" "$TRT_SERIES" "$TORCH_VERSION" || fail "installed versions are not the pinned ones"
ok

# ----------------------------------------------------------------------------------------------
step "This package, non-editable (an editable install does not install its trtllm-build start-up hook)"
cmd "$PY" -m pip install ".[test]" || fail "pip install . failed"
check hook || fail "trtllm-build / start-up hook check failed"
ok

# ----------------------------------------------------------------------------------------------
step "TensorRT C++ headers for the installed TensorRT (git tag v$TRT_SERIES of NVIDIA/TensorRT)"
HEADERS="$WORK/TensorRT-v$TRT_SERIES"
if [ -f "$HEADERS/include/NvInferVersion.h" ]; then
  note "already at $HEADERS"
else
  cmd git clone --quiet --depth 1 -b "v$TRT_SERIES" https://github.com/NVIDIA/TensorRT "$HEADERS" \
    || fail "git clone of NVIDIA/TensorRT v$TRT_SERIES failed"
fi
check headers "$HEADERS/include/NvInferVersion.h" || fail "TensorRT headers do not match the installed TensorRT"
ok

# ----------------------------------------------------------------------------------------------
step "DFlash plugins: CPU library, CUDA kernels and libdflash_trt_plugins.so (links the wheel's libnvinfer)"
if [ "$DRY_RUN" = 1 ]; then
  NVINFER="$VENV/lib/python${pyver:-3.12}/site-packages/tensorrt_libs/libnvinfer.so.10"
  note "(a real run looks libnvinfer.so.10 up in the venv's tensorrt packages)"
else
  NVINFER=$("$PY" scripts/verify_trtllm_checks.py libnvinfer)
fi
[ -n "$NVINFER" ] || fail "libnvinfer.so.10 not found in the venv's tensorrt packages"
cmd cmake -S plugins -B plugins/build -DCMAKE_BUILD_TYPE=Release -DTensorRT_INCLUDE_DIR="$HEADERS/include" \
    -DTensorRT_LIBRARY="$NVINFER" -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo nvcc)" \
  && cmd cmake --build plugins/build -j || fail "the plugin build failed"
if [ "$DRY_RUN" = 0 ] && [ ! -f plugins/build/libdflash_trt_plugins.so ]; then
  fail "cmake ran but libdflash_trt_plugins.so was not built (see the cmake messages in the log)"
fi
export DFLASH_TRT_PLUGIN_LIB="$ROOT/plugins/build/libdflash_trt_plugins.so"
export DFLASH_PLUGIN_LIB="$ROOT/plugins/build/libdflash_plugins_cpu.so"
note "DFLASH_TRT_PLUGIN_LIB=$DFLASH_TRT_PLUGIN_LIB"
ok

# ----------------------------------------------------------------------------------------------
step "Engine tests on the GPU: pytest -m trtllm (a skip counts as a failure, except tp 2 on one GPU)"
# Only the engine tests' file: the venv has the engine's dependencies, not every test module's.
cmd "$PY" -m pytest -m trtllm -rs -v tests/test_trtllm_engine.py --junitxml "$LOG/trtllm.xml" \
  || fail "pytest -m trtllm failed"
check junit "$LOG/trtllm.xml" || fail "engine tests were skipped"
ok

# ----------------------------------------------------------------------------------------------
step "The documented flow's target and drafter"
DEMO_PAIR=0
if [ -z "$MODEL_DIR" ]; then
  DEMO_PAIR=1
  MODEL_DIR="$WORK/demo/target"
  DRAFTER_DIR="$WORK/demo/drafter"
  note "the engine demo pair: a random Qwen3 (4 q / 2 KV heads of 128, bf16) + a random DFlash drafter, fixed seed"
  if [ -f "$MODEL_DIR/config.json" ]; then
    note "already at $WORK/demo"
  else
    cmd "$PY" -m tensorrt_llm_dflash.trtllm.demo_pair --output_dir "$WORK/demo" || fail "making the demo pair failed"
  fi
fi
note "target $MODEL_DIR, drafter $DRAFTER_DIR"
ok

# ----------------------------------------------------------------------------------------------
step "Documented command 1: examples/convert_checkpoint.py"
cmd "$PY" examples/convert_checkpoint.py --model_dir "$MODEL_DIR" --dflash_model_dir "$DRAFTER_DIR" \
    --output_dir "$WORK/ckpt" --dtype bfloat16 || fail "convert_checkpoint.py failed"
ok

# ----------------------------------------------------------------------------------------------
step "Documented command 2: TensorRT-LLM's own trtllm-build with --speculative_decoding_mode dflash"
cmd "$VENV/bin/trtllm-build" --checkpoint_dir "$WORK/ckpt" --output_dir "$WORK/engine" \
    --speculative_decoding_mode dflash --max_draft_len "$DRAFT_LEN" --max_batch_size 1 \
    --remove_input_padding enable --tokens_per_block 64 || fail "trtllm-build failed"
ok

# ----------------------------------------------------------------------------------------------
step "Documented command 3: examples/run.py on the engine, and the PyTorch runtime on the same prompt"
cmd "$PY" examples/run.py --engine_dir "$WORK/engine" --tokenizer_dir "$MODEL_DIR" --speculative_decoding_mode dflash \
    --ddtree_budget "$BUDGET" --use_py_session --input_text "$PROMPT" --max_output_len 128 \
    --output_json "$WORK/engine_run.json" || fail "run.py --engine_dir failed"
cmd "$PY" examples/run.py --target_model_dir "$MODEL_DIR" --draft_model_dir "$DRAFTER_DIR" --dtype bfloat16 \
    --device cuda --ddtree_budget "$BUDGET" --input_text "$PROMPT" --max_output_len 128 \
    --output_json "$WORK/pytorch_run.json" || fail "run.py (PyTorch runtime) failed"
ok

# ----------------------------------------------------------------------------------------------
step "Engine vs PyTorch runtime (bf16 both: an informational comparison, the exactness contract is step 10's)"
# The demo pair's drafter is random: whether it ever guesses right is chance, so only a real pair
# is held to accepting draft tokens.
if [ "$DEMO_PAIR" = 1 ]; then ACCEPTANCE=--any-acceptance; else ACCEPTANCE=--require-acceptance; fi
check compare "$WORK/engine_run.json" "$WORK/pytorch_run.json" "$ACCEPTANCE" || fail "the engine's run is not credible"
ok

verdict 0
