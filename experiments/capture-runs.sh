#!/usr/bin/env bash
# The real capture runs behind the issue notes. Resumable: rerun to continue.
# Expected wall time on 2 CPU cores (SmolLM2-135M, batch 32): builtin 3,000 ~20 min,
# NQ-Open 7,174 ~60 min, GSM8K 1,200 ~25 min; Gemma-3-270M builtin 1,500 ~20 min.
set -euo pipefail
cd "$(dirname "$0")/.."
ACTMAP=${ACTMAP:-.venv/bin/actmap}
OUT=${OUT:-stores}
GEMMA=$(../shared/models/get-model gemma3-270m 2>/dev/null || true)

$ACTMAP capture --task builtin --builtin-questions 3000 --out "$OUT/smollm2-builtin" \
  --attention-keys 10 --keep-dense --keep-trajectories
$ACTMAP capture --task nq_open --no-chat-template --out "$OUT/smollm2-nq_open" \
  --attention-keys 10 --keep-dense
$ACTMAP capture --task gsm8k --no-chat-template --limit 400 --out "$OUT/smollm2-gsm8k" \
  --attention-keys 10 --keep-dense
if [ -n "$GEMMA" ]; then
  $ACTMAP capture --task builtin --builtin-questions 1500 --model "$GEMMA" --out "$OUT/gemma3-builtin" \
    --attention-keys 10 --keep-dense
fi
