#!/usr/bin/env bash
# Issue 47, item 4 on the grid's judged CNN/DailyMail store: SmolLM2's summaries of the 1,500
# local articles captured again with what the stacked actmap-plus reads (position states,
# lookback attention beside the fused kernel, grey-box statistics), then labelled by the 1.5B
# judge in bfloat16 (every sentence supported at 0.5), then compared. Each step resumes where
# it stopped (captured rows and judged summaries are skipped); one thread:
#   mkdir -p logs && setsid nohup scripts/cnn-dm-stacked.sh > logs/cnn-dm-stacked.log 2>&1 < /dev/null &
# Cost on this machine: 384-token summaries at about 9 a minute (1 thread, 800 in 86 minutes), then
# 3.1 s of judge per summary alone at 2 threads (608 in 31.5 minutes; ~40 s at load 6-7 on one
# thread, docs/data.md). UP_TO caps the judged summaries (the grid's store judged 608: 198
# balanced test rows).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
STORE=stores/smollm2-cnn_dm-stacked
run() { echo "=== $(date -Is) start: $*"; "$@"; echo "=== $(date -Is) end rc=$?: $*"; }
run $A capture --task cnn_dm --out "$STORE" --attention-keys 10 --lookback-attention \
  --keep-positions --splits test,validation,train
run $A judge --store "$STORE" --judge "$(../shared/models/get-model qwen2.5-coder-1.5b-instruct)" \
  --judge-dtype bfloat16 --out "$STORE-judged" --up-to "${UP_TO:-608}"
run $A compare-stacked --store "$STORE-judged" --out runs/compare-smollm2-cnn_dm
echo "=== $(date -Is) done"
