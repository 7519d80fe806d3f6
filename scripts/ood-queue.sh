#!/usr/bin/env bash
# Session 53's capture queue (issues 56 and 57), one thread, resumable (finished rows are skipped):
#   mkdir -p logs && setsid nohup scripts/ood-queue.sh > logs/ood-queue.log 2>&1 < /dev/null &
# 1. the SmolLM2 stores of the leave-one-task-out comparison (grid-stacked.sh, COMPARE=0);
# 2. Qwen2.5-Coder-0.5B x TriviaQA as the cascade's second small model: the first 600 test
#    questions (those the 1.5B answered: `--splits test --limit 600`), 600 validation and
#    1,000 training questions, with what the stacked actmap-plus reads;
# 3. the Gemma-3 stores of the same comparison.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
run() { echo "=== $(date -Is) start: $*"; "$@"; echo "=== $(date -Is) end rc=$?: $*"; }
COMPARE=0 BUILTIN_QUESTIONS=1200 STORES="smollm2:gsm8k" scripts/grid-stacked.sh
qwen=$(../shared/models/get-model qwen2.5-coder-0.5b-instruct)
KEEP=(--attention-keys 10 --lookback-attention --keep-positions --share-prefix 32)
for step in test:600 validation:600 train:1000; do
  run $A capture --task triviaqa --model "$qwen" --out stores/qwen-0.5b-triviaqa-stacked \
    "${KEEP[@]}" --no-chat-template --dtype bfloat16 --splits "${step%%:*}" --limit "${step##*:}"
done
COMPARE=0 BUILTIN_QUESTIONS=400 STORES="gemma3:builtin gemma3:triviaqa gemma3:nq_open gemma3:gsm8k" \
  scripts/grid-stacked.sh
echo "=== $(date -Is) done"
