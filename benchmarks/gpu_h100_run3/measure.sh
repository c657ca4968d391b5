#!/usr/bin/env bash
# Real-weight GPU measurements, in priority order; each step time-limited so partial results come back.
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}
R=/tmp/res; mkdir -p $R
step() {  # step NAME SECONDS CMD...
  local name=$1 t=$2; shift 2
  local t0=$(date +%s)
  timeout "$t" "$@" 2>&1 | grep -v '%|' > "$R/$name.log"; local rc=${PIPESTATUS[0]}
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"
  grep -E '^\| (ar-graph|default|dflash-graph|ddtree-graph|auto-graph)' "$R/$name/results.md" 2>/dev/null | cut -d'|' -f2-9
  grep -E '^\[|Output check' "$R/$name.log" 2>/dev/null | tail -n 12
  tar czf $O/results.tgz -C $R .
}
B="python examples/benchmark.py --device cuda --max_output_len 128 --temperature 0 --no_progress"
step humaneval_t0 190 $B --dataset humaneval --num_prompts 20 --methods ar-graph default auto-graph-in-step ddtree-graph:32 --output_dir $R/humaneval_t0
step chat_t0 100 $B --dataset chat --num_prompts 8 --methods ar-graph default auto-graph-in-step --output_dir $R/chat_t0
step humaneval_t0_bf16 110 $B --dataset humaneval --num_prompts 20 --dtype bfloat16 --methods ar-graph default auto-graph-in-step --output_dir $R/humaneval_t0_bf16
nvidia-smi --query-gpu=name,memory.used --format=csv
