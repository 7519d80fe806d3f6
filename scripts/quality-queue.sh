#!/usr/bin/env bash
# The stores the stacked detector's comparison needs (the quality issue), captured again on a
# fresh machine with the grid's flags (scripts/grid-queue.sh): Qwen2.5-Coder-1.5B in bfloat16
# on the grid's 1,000 questions per split of TriviaQA, then NQ-Open. One thread, resumable:
#   mkdir -p logs && setsid nohup scripts/quality-queue.sh > logs/quality-queue.log 2>&1 < /dev/null &
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
OUT=${OUT:-stores}
PER_SPLIT=${PER_SPLIT:-1000}
KEEP=(--attention-keys 10 --keep-dense --share-prefix 32 --no-chat-template --dtype bfloat16)
run() { echo "=== $(date -Is) start: $*"; "$@"; echo "=== $(date -Is) end rc=$?: $*"; }
Q15=$(../shared/models/get-model qwen2.5-coder-1.5b-instruct)
for task in ${TASKS:-triviaqa nq_open}; do
  for splits in validation,test train; do
    run $A capture --task "$task" --model "$Q15" --out "$OUT/qwen-1.5b-$task-bf16" "${KEEP[@]}" \
      --splits $splits --limit "$PER_SPLIT"
  done
done
echo "=== $(date -Is) queue done"
