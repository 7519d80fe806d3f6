#!/usr/bin/env bash
# CNN/DailyMail for the grid (issue: the grid, item 3), resumable, one thread:
#   setsid nohup experiments/judge-queue.sh > logs/judge-queue.log 2>&1 < /dev/null &
# 1. The judge check: 500 validation pairs (an article's own first highlight sentence vs the
#    next article's) with Qwen2.5-Coder-0.5B, and the same first pairs with -1.5B as far as
#    CHECK_15B_PAIRS (on one CPU thread the 1.5B reads an article in minutes, so its 500 pairs
#    are a GPU job; a smaller check still gives its accuracy, AUROC and s/claim on the same
#    pairs). Each check caches every pair in runs/judge-check/<judge>/judge-check.json.
# 2. SmolLM2 summaries of all 1,500 local articles (384 new tokens, zero-shot).
# 3. Judged labels (every sentence supported at 0.5) with JUDGE, LABEL_LIMIT summaries per
#    run; rerun to continue. JUDGE defaults to the 1.5B: on the first 50 pairs the 0.5B ranks
#    well (AUROC .926) but gives every claim, its own article's highlight included, a support
#    below 0.5 (accuracy .500), so at the paper's 0.5 it would label every summary unsupported.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
GET=../shared/models/get-model
CHECK_15B_PAIRS=${CHECK_15B_PAIRS:-50}
JUDGE=${JUDGE:-qwen2.5-coder-1.5b-instruct}
LABEL_LIMIT=${LABEL_LIMIT:-1500}
run() { echo "=== $(date -Is) start: $*"; "$@"; echo "=== $(date -Is) end rc=$?: $*"; }
run $A judge check --judge "$($GET qwen2.5-coder-0.5b-instruct)" --pairs 500 \
  --out runs/judge-check/qwen2.5-coder-0.5b
run $A judge check --judge "$($GET qwen2.5-coder-1.5b-instruct)" --pairs "$CHECK_15B_PAIRS" \
  --out runs/judge-check/qwen2.5-coder-1.5b
run $A capture --task cnn_dm --out stores/smollm2-cnn_dm --attention-keys 10 --keep-dense \
  --splits train,validation,test
run $A judge --store stores/smollm2-cnn_dm --judge "$($GET "$JUDGE")" \
  --out "stores/smollm2-cnn_dm-judged-${JUDGE:14:4}" --limit "$LABEL_LIMIT"
echo "=== $(date -Is) queue done"
