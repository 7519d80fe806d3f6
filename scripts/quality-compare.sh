#!/usr/bin/env bash
# Issue 47's comparison on the Qwen2.5-Coder-1.5B stores the quality queue captures
# (scripts/quality-queue.sh): add position states to a copy of each store by teacher forcing
# (scripts/add_positions.py; follows a capture still writing), then compare both presets of the
# stacked actmap-plus with every single-pass baseline (actmap compare-stacked). One thread,
# resumable (a rerun skips rows that have their positions):
#   mkdir -p logs && setsid nohup scripts/quality-compare.sh > logs/quality-compare.log 2>&1 < /dev/null &
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH=${PYTHONPATH:-src}
PY=${PY:-.venv/bin/python}
A=${ACTMAP:-.venv/bin/actmap}
LANE=${LANE:-stores}  # where scripts/quality-queue.sh writes
Q15=$(../shared/models/get-model qwen2.5-coder-1.5b-instruct)
run() { echo "=== $(date -Is) start: $*"; "$@"; echo "=== $(date -Is) end rc=$?: $*"; }
for task in ${TASKS:-triviaqa nq_open}; do
  src="$LANE/qwen-1.5b-$task-bf16"
  run $PY scripts/add_positions.py --source "$src" --out "stores/qwen-1.5b-$task-bf16-pos" \
    --model "$Q15" --rounds 0 --wait 120
  run $A compare-stacked --store "stores/qwen-1.5b-$task-bf16-pos" \
    --out "runs/compare-qwen-1.5b-$task"
done
echo "=== $(date -Is) done"
