#!/usr/bin/env bash
# CNN/DailyMail for the grid (issue: the grid, item 3), resumable, one thread:
#   mkdir -p logs && setsid nohup scripts/judge-queue.sh > logs/judge-queue.log 2>&1 < /dev/null &
# 1. The judge check: 500 validation pairs (an article's own first highlight sentence vs the
#    next article's) with Qwen2.5-Coder-1.5B in JUDGE_DTYPE (bfloat16 by default: on one CPU
#    thread, beside other jobs, 36 s per claim in float32 and 10 s in bfloat16 on the same
#    claims, supports within .012), then with -0.5B in the same dtype (a like-for-like
#    quality-per-second comparison; float32 was 3.7x slower). Each check caches every pair in
#    runs/judge-check/<judge>/judge-check.json and writes check.json at the end.
# 2. SmolLM2 summaries of all 1,500 local articles (384 new tokens, zero-shot).
# 3. Judged labels (every sentence supported at 0.5) with JUDGE in JUDGE_DTYPE, LABEL_LIMIT
#    summaries per run, up to LABEL_UP_TO judged in all (unset: every summary); rerun to
#    continue. JUDGE defaults to the 1.5B: on the first 50 pairs
#    the 0.5B ranks well (AUROC .926) but gives every claim, its own article's highlight
#    included, a support below 0.5 (accuracy .500), so at the paper's 0.5 it would label
#    every summary unsupported.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
GET=../shared/models/get-model
CHECK_15B_PAIRS=${CHECK_15B_PAIRS:-500}
JUDGE=${JUDGE:-qwen2.5-coder-1.5b-instruct}
JUDGE_DTYPE=${JUDGE_DTYPE:-bfloat16}
LABEL_LIMIT=${LABEL_LIMIT:-1500}
UP_TO=(${LABEL_UP_TO:+--up-to "$LABEL_UP_TO"})
TAG=${JUDGE:14:4}   # 1.5b, 0.5b
[ "$JUDGE_DTYPE" = float32 ] || TAG+=-$JUDGE_DTYPE
run() { echo "=== $(date -Is) start: $*"; "$@"; echo "=== $(date -Is) end rc=$?: $*"; }
run $A judge check --judge "$($GET qwen2.5-coder-1.5b-instruct)" --pairs "$CHECK_15B_PAIRS" \
  --judge-dtype "$JUDGE_DTYPE" --out "runs/judge-check/qwen2.5-coder-1.5b-$JUDGE_DTYPE"
run $A judge check --judge "$($GET qwen2.5-coder-0.5b-instruct)" --pairs 500 \
  --judge-dtype "$JUDGE_DTYPE" --out "runs/judge-check/qwen2.5-coder-0.5b-$JUDGE_DTYPE"
run $A capture --task cnn_dm --out stores/smollm2-cnn_dm --attention-keys 10 --keep-dense \
  --splits train,validation,test
run $A judge --store stores/smollm2-cnn_dm --judge "$($GET "$JUDGE")" --judge-dtype "$JUDGE_DTYPE" \
  --out "stores/smollm2-cnn_dm-judged-$TAG" --limit "$LABEL_LIMIT" "${UP_TO[@]}"
echo "=== $(date -Is) queue done"
