#!/usr/bin/env bash
# The capture queue behind docs/data.md's session-4 table (resumable: rerun to continue).
# Each split group is its own step, so held-out rows (validation, test) exist early and the
# training rows follow. One thread, so it can run beside other work.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
OUT=${OUT:-stores}
KEEP=(--attention-keys 10 --keep-dense)
GEMMA=$(../shared/models/get-model gemma3-270m 2>/dev/null)
run() { echo "=== $(date -Is) start: $*"; "$@"; echo "=== $(date -Is) end rc=$?: $*"; }
run $A capture --task builtin --builtin-questions 1200 --out "$OUT/smollm2-builtin" "${KEEP[@]}" --keep-trajectories
TQ=(--task triviaqa --no-chat-template --out "$OUT/smollm2-triviaqa" "${KEEP[@]}" --share-prefix 32)
run $A capture "${TQ[@]}" --splits validation,test
run $A capture "${TQ[@]}" --splits train --limit 3000
run $A capture --task triviaqa --limit 400 --model "$GEMMA" --out "$OUT/gemma3-triviaqa" "${KEEP[@]}" --share-prefix 32
NQ=(--task nq_open --no-chat-template --out "$OUT/smollm2-nq_open" "${KEEP[@]}" --share-prefix 32)
GS=(--task gsm8k --no-chat-template --out "$OUT/smollm2-gsm8k" "${KEEP[@]}" --share-prefix 32)
run $A capture "${NQ[@]}" --splits test
run $A capture "${GS[@]}" --splits test
run $A capture --task builtin --builtin-questions 400 --model "$GEMMA" --out "$OUT/gemma3-builtin" "${KEEP[@]}"
run $A capture "${NQ[@]}" --splits validation,train --limit 4000
run $A capture "${GS[@]}" --splits validation,train --limit 5000
