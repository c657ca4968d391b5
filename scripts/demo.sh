#!/usr/bin/env bash
# Set up a fresh machine and run the default demo: embedded SmolLM2 target + shipped DFlash drafter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python_env.sh
"$PY" examples/run.py --streaming "$@"
