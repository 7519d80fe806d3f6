#!/usr/bin/env bash
# Every grid store again on a fresh machine (stores/ and runs/ are not in git: session 9 found
# a new machine without them), most-needed first, resumable, one thread:
#   mkdir -p logs && setsid nohup scripts/rebuild-queue.sh > logs/rebuild-queue.log 2>&1 < /dev/null &
# 1. Gemma-3-270M x built-in (400 rows): the pair of scripts/paper-settings.sh.
# 2. Qwen2.5-Coder-1.5B x TriviaQA in bfloat16, validation first (the answers of
#    scripts/se_judge_check.py: about 20% correct, so 100 correct validation answers), then
#    test and train: the grid's one store with over 200 balanced training rows.
# 3. Qwen2.5-Coder-0.5B on the same questions (the report's model-scale rows): validation +
#    test, then train, 1,000 questions per split.
# 4. scripts/capture-queue.sh (SmolLM2 on the four tasks, Gemma-3 x TriviaQA 400 per split),
#    then scripts/grid-queue.sh without its prompt check (its figures are in docs/data.md).
# Each command is the one of the queue it comes from, so a store built here is the store the
# other queues and configs/reproduce-full.toml expect, and the later queues skip its rows.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
OUT=${OUT:-stores}
GET=../shared/models/get-model
run() { echo "=== $(date -Is) start: $*"; "$@"; echo "=== $(date -Is) end rc=$?: $*"; }
run $A capture --task builtin --builtin-questions 400 --model "$($GET gemma3-270m)" \
  --out "$OUT/gemma3-builtin" --attention-keys 10 --keep-dense
QKEEP=(--attention-keys 10 --keep-dense --share-prefix 32 --no-chat-template --dtype bfloat16
  --limit 1000)
Q05=(--task triviaqa --model "$($GET qwen2.5-coder-0.5b-instruct)" --out "$OUT/qwen-0.5b-triviaqa-bf16")
Q15=(--task triviaqa --model "$($GET qwen2.5-coder-1.5b-instruct)" --out "$OUT/qwen-1.5b-triviaqa-bf16")
run $A capture "${Q15[@]}" "${QKEEP[@]}" --splits validation
run $A capture "${Q15[@]}" "${QKEEP[@]}" --splits validation,test
run $A capture "${Q15[@]}" "${QKEEP[@]}" --splits train
run $A capture "${Q05[@]}" "${QKEEP[@]}" --splits validation,test
run $A capture "${Q05[@]}" "${QKEEP[@]}" --splits train
run scripts/capture-queue.sh
PROMPT_CHECK=0 run scripts/grid-queue.sh
echo "=== $(date -Is) queue done"
