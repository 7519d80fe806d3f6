#!/usr/bin/env bash
# Model-scale and dtype transfer on TriviaQA (issue: the grid; the report's "model scale" and
# "dtype" rows) without the full reproduce run: an MLP (3 seeds, the paper's recipe) per Qwen
# store, laid out as <OUT>/runs/<store>/mlp, then the report's transfer and in-domain sections
# over the Qwen2.5-Coder-0.5B stores (float32 and bfloat16) and the 1.5B store (bfloat16).
# Needs the stores complete (scripts/grid-queue.sh); STORES (space-separated names) picks
# others, e.g. only the bfloat16 pair. One thread:
#   scripts/model-scale.sh
#   STORES="qwen-0.5b-triviaqa-bf16 qwen-1.5b-triviaqa-bf16" scripts/model-scale.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
OUT=${OUT:-runs/model-scale}
read -r -a STORES <<< "${STORES:-qwen-0.5b-triviaqa qwen-0.5b-triviaqa-bf16 qwen-1.5b-triviaqa-bf16}"
for store in "${STORES[@]}"; do
  [ -f "$OUT/runs/$store/mlp/summary.json" ] && continue
  $A train --store "stores/$store" --detector mlp --seeds 42,123,456 --out "$OUT/runs/$store/mlp"
done
$A report "${STORES[@]/#/--store=stores/}" --runs "$OUT/runs" --out "$OUT/report" \
  --only in_domain,transfer
