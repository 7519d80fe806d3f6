#!/usr/bin/env bash
# The grid's capture queue after experiments/capture-queue.sh (session 5; resumable: rerun to
# continue, finished rows are skipped). One thread, so it can run beside other work.
#   setsid nohup experiments/grid-queue.sh > logs/grid-queue.log 2>&1 < /dev/null &
# Order: SmolLM2 on all 9,313 TriviaQA questions (the train split's remaining rows), the
# prompt check of Qwen2.5-Coder-1.5B (plain vs chat, 100 validation questions per dataset),
# then Qwen2.5-Coder-0.5B and -1.5B on the same 1,000 questions per split of each dataset
# (plain 5-shot prompts: the prompt check's choice for 0.5B), held-out splits first.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
OUT=${OUT:-stores}
PER_SPLIT=${PER_SPLIT:-1000}
KEEP=(--attention-keys 10 --keep-dense --share-prefix 32 --no-chat-template)
run() { echo "=== $(date -Is) start: $*"; "$@"; echo "=== $(date -Is) end rc=$?: $*"; }
run $A capture --task triviaqa --out "$OUT/smollm2-triviaqa" "${KEEP[@]}" --splits train
run experiments/prompt_check.sh qwen2.5-coder-1.5b-instruct
for task in triviaqa nq_open gsm8k; do
  for splits in validation,test train; do
    for name in qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct; do
      model=$(../shared/models/get-model "$name")
      short=qwen-${name:14:4}   # qwen-0.5b, qwen-1.5b
      run $A capture --task $task --model "$model" --out "$OUT/$short-$task" "${KEEP[@]}" \
        --splits $splits --limit "$PER_SPLIT"
    done
  done
done
echo "=== $(date -Is) queue done"
