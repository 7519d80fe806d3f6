#!/usr/bin/env bash
# The grid's capture queue after scripts/capture-queue.sh (session 5; resumable: rerun to
# continue, finished rows are skipped). One thread, so it can run beside other work.
#   mkdir -p logs && setsid nohup scripts/grid-queue.sh > logs/grid-queue.log 2>&1 < /dev/null &
# Order: SmolLM2 on all 9,313 TriviaQA questions (the train split's remaining rows), the
# prompt check of Qwen2.5-Coder-1.5B (plain vs chat, 100 validation questions per dataset),
# then Qwen2.5-Coder-0.5B and -1.5B on the same 1,000 questions per split of each dataset
# (plain 5-shot prompts: the prompt check's choice at both scales), held-out splits first,
# with Gemma-3-270M on NQ-Open and GSM8K before the Qwen pair's GSM8K, and Gemma-3 on all of
# TriviaQA last.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
OUT=${OUT:-stores}
PER_SPLIT=${PER_SPLIT:-1000}
KEEP=(--attention-keys 10 --keep-dense --share-prefix 32 --no-chat-template)
run() { echo "=== $(date -Is) start: $*"; "$@"; echo "=== $(date -Is) end rc=$?: $*"; }
run $A capture --task triviaqa --out "$OUT/smollm2-triviaqa" "${KEEP[@]}" --splits train
[ "${PROMPT_CHECK:-1}" = 0 ] || run scripts/prompt_check.sh qwen2.5-coder-1.5b-instruct
# The Qwen stores run in DTYPE (bfloat16 by default: on this CPU the 1.5B captures 3.2x
# faster than in float32, 61.9 s vs 197.1 s for 32 TriviaQA rows at 1 thread; 22 of 32
# greedy answers came out identical, maps of identical answers correlate .997-.9997), named
# <model>-<task>-bf16; the float32 stores captured before (qwen-0.5b-triviaqa, complete,
# and qwen-1.5b-triviaqa, partial) stay as they are.
DTYPE=${DTYPE:-bfloat16}
SUFFIX=$([ "$DTYPE" = bfloat16 ] && echo -bf16 || { [ "$DTYPE" = float32 ] || echo "-$DTYPE"; })
# the 0.5B's store first (held-out splits, then train): it is 4-5x faster than the 1.5B, so a
# complete store exists early; then the 1.5B on the same questions
qwen_pair() {
  local task=$1 name model short splits
  for name in qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct; do
    model=$(../shared/models/get-model "$name")
    short=qwen-${name:14:4}   # qwen-0.5b, qwen-1.5b
    for splits in validation,test train; do
      run $A capture --task "$task" --model "$model" --out "$OUT/$short-$task$SUFFIX" "${KEEP[@]}" \
        --dtype "$DTYPE" --splits $splits --limit "$PER_SPLIT"
    done
  done
}
GEMMA=$(../shared/models/get-model gemma3-270m)
GKEEP=(--attention-keys 10 --keep-dense --share-prefix 32)
gemma() {
  local task=$1 splits
  for splits in validation,test train; do
    run $A capture --task "$task" --model "$GEMMA" --out "$OUT/gemma3-$task" "${GKEEP[@]}" \
      --splits $splits --limit "$PER_SPLIT"
  done
}
# Session 10: Gemma-3's NQ-Open and GSM8K stores (about 3 rows/s, under 30 min together) come
# before the Qwen pair's GSM8K (about 1.5 h at 0.8 and 2 rows/s), so each dataset has three
# generators sooner.
qwen_pair triviaqa
qwen_pair nq_open
gemma nq_open
gemma gsm8k
qwen_pair gsm8k
run $A capture --task triviaqa --model "$GEMMA" --out "$OUT/gemma3-triviaqa" "${GKEEP[@]}" \
  --splits validation,test,train
# the float32 0.5B store on the same TriviaQA questions (the report's dtype row and
# scripts/dtype_transfer.py; lost with session 9's machine)
Q05=$(../shared/models/get-model qwen2.5-coder-0.5b-instruct)
for splits in validation,test train; do
  run $A capture --task triviaqa --model "$Q05" --out "$OUT/qwen-0.5b-triviaqa" "${KEEP[@]}" \
    --dtype float32 --splits $splits --limit "$PER_SPLIT"
done
echo "=== $(date -Is) queue done"
