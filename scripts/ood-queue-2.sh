#!/usr/bin/env bash
# Issue 57's next generator after scripts/ood-queue.sh: Qwen2.5-Coder-0.5B (bfloat16) on the
# built-in questions, NQ-Open and GSM8K, with what the stacked actmap-plus reads, for the
# leave-one-task-out comparison beside its TriviaQA store. Waits for the first queue, then one
# thread, resumable (finished rows are skipped):
#   mkdir -p logs && setsid nohup scripts/ood-queue-2.sh > logs/ood-queue-2.log 2>&1 < /dev/null &
set -uo pipefail
cd "$(dirname "$0")/.."
while pgrep -f scripts/ood-queue.sh > /dev/null; do sleep 60; done
COMPARE=0 BUILTIN_QUESTIONS=400 STORES="qwen-0.5b:builtin qwen-0.5b:nq_open qwen-0.5b:gsm8k" \
  scripts/grid-stacked.sh
