#!/usr/bin/env bash
# Issue 47, item 4 on the rest of the grid: capture each store again with what the stacked
# actmap-plus reads (position states, lookback attention beside the fused kernel, grey-box
# statistics) in the same pass, on the grid's 1,000 questions per split, then compare both
# presets with every single-pass baseline (actmap compare-stacked). No dense states (ACT-ViT
# is not in this comparison). One thread, resumable (finished rows are skipped):
#   mkdir -p logs && setsid nohup scripts/grid-stacked.sh > logs/grid-stacked.log 2>&1 < /dev/null &
# STORES="smollm2:triviaqa gemma3:nq_open ..." picks the stores, in order; a built-in store
# takes BUILTIN_QUESTIONS questions (the grid: 400 for Gemma-3, 1,200 for SmolLM2). COMPARE=0
# captures only (the out-of-domain stores of issue 57 are compared by leave-one-task-out).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
PER_SPLIT=${PER_SPLIT:-1000}
KEEP=(--attention-keys 10 --lookback-attention --keep-positions --share-prefix 32)
run() { echo "=== $(date -Is) start: $*"; "$@"; echo "=== $(date -Is) end rc=$?: $*"; }
DEFAULT="smollm2:triviaqa smollm2:nq_open gemma3:triviaqa gemma3:nq_open qwen-0.5b:triviaqa"
DEFAULT+=" qwen-0.5b:nq_open smollm2:gsm8k gemma3:gsm8k qwen-0.5b:gsm8k"
for item in ${STORES:-$DEFAULT}; do
  gen=${item%%:*} task=${item##*:}
  case $gen in  # the grid's model, prompt form and dtype per generator
    smollm2) model=smollm2-135m-instruct flags=(--no-chat-template) ;;
    gemma3) model=$(../shared/models/get-model gemma3-270m) flags=() ;;
    qwen-0.5b) model=$(../shared/models/get-model qwen2.5-coder-0.5b-instruct)
      flags=(--no-chat-template --dtype bfloat16) ;;
    qwen-0.5b-f32) model=$(../shared/models/get-model qwen2.5-coder-0.5b-instruct)
      flags=(--no-chat-template) ;;  # the grid's float32 twin of the bfloat16 store
    qwen-1.5b) model=$(../shared/models/get-model qwen2.5-coder-1.5b-instruct)
      flags=(--no-chat-template --dtype bfloat16) ;;
    *) echo "unknown generator $gen"; exit 2 ;;
  esac
  store="stores/$gen-$task-stacked"
  if [ "$task" = builtin ]; then  # one generated question set, split by the task itself
    run $A capture --task builtin --builtin-questions "${BUILTIN_QUESTIONS:-400}" --model "$model" \
      --out "$store" "${KEEP[@]}" "${flags[@]}"
  else for splits in validation,test train; do
    run $A capture --task "$task" --model "$model" --out "$store" "${KEEP[@]}" "${flags[@]}" \
      --splits $splits --limit "$PER_SPLIT"
  done; fi
  [ "${COMPARE:-1}" = 1 ] && run $A compare-stacked --store "$store" --out "runs/compare-$gen-$task"
done
echo "=== $(date -Is) done"
