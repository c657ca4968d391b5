#!/usr/bin/env bash
# What to measure on a GPU machine, in priority order, each step time-limited so a cut run keeps what it finished
# (results in ${OUT:-/tmp/out}/results.tgz, a log per step):
#   fused     the plugin library built for this GPU, its kernels and tests, and the fused DDTree build
#             (gpu_check's fused-tree/* checks: equal to the tensor ops, both timed in a CUDA graph, the default
#             decoder both ways), on the SmolLM2-shaped random target in float32;
#   he_fp32   run.py's runtime on 20 HumanEval prompts x 128, T=0: graphed AR and the default (padded, graphed
#             prefill since 249252a), then the default again with DFLASH_FUSED_TREE=on;
#   he_bf16   the same in bfloat16;
#   serve     the serving benchmark, AR and the default at 1-16 clients (float32).
# Usage (from the checkout, the embedded target's GGUF and the server's packages importable):
#   bash benchmarks/gpu_measure.sh [STEP...]   (default: every step)
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}
R=/tmp/res; mkdir -p "$R/serve" "$O"
ONLY=" $* "
step() {  # step NAME SECONDS CMD...
  local name=$1 t=$2; shift 2
  [ "$ONLY" = "  " ] || [[ "$ONLY" == *" $name "* ]] || return 0
  local t0; t0=$(date +%s)
  timeout "$t" "$@" 2>&1 | grep -v '%|' > "$R/$name.log"; local rc=${PIPESTATUS[0]}
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"
  tail -n 40 "$R/$name.log" | cut -c1-220
  tar czf "$O/results.tgz" -C "$R" .
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# gpu_check builds the plugin library for this GPU where the runtime then finds it (DFLASH_PLUGIN_LIB).
export DFLASH_PLUGIN_LIB=/tmp/plugins-build
step fused 180 python3 examples/gpu_check.py --methods auto --dtypes float32 --targets smollm2-135m --plugins on \
  --plugins_dir "$DFLASH_PLUGIN_LIB" --out /tmp/gc --json "$R/fused/gpu_check.json"
B="python3 examples/benchmark.py --device cuda --max_output_len 128 --temperature 0 --no_progress --dataset humaneval \
  --num_prompts 20"
step he_fp32 90 $B --methods ar-graph default --output_dir "$R/he_fp32"
step he_fp32_fused 60 env DFLASH_FUSED_TREE=on $B --methods ar-graph default --output_dir "$R/he_fp32_fused"
step he_bf16 70 $B --dtype bfloat16 --methods ar-graph default --output_dir "$R/he_bf16"
step he_bf16_fused 60 env DFLASH_FUSED_TREE=on $B --dtype bfloat16 --methods ar-graph default \
  --output_dir "$R/he_bf16_fused"
step serve 280 python3 examples/bench_serve.py --device cuda --methods ar default --concurrency 1 2 4 8 16 \
  --datasets humaneval chat --num_prompts 8 --max_tokens 128 --dtype float32 --no_runpy_reference \
  --output_json "$R/serve/bench_serve.json"
nvidia-smi --query-gpu=name,memory.used --format=csv
