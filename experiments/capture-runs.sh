#!/usr/bin/env bash
# The real capture runs behind the issue notes. Resumable: rerun to continue.
# LIMIT caps each split (NQ-Open and GSM8K); drop it to capture every row.
# Measured wall times on 2 CPU cores are in the issue notes and docs/data.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ACTMAP=${ACTMAP:-.venv/bin/actmap}
OUT=${OUT:-stores}
GEMMA=$(../shared/models/get-model gemma3-270m 2>/dev/null || true)

$ACTMAP capture --task builtin --builtin-questions "${BUILTIN:-1200}" --out "$OUT/smollm2-builtin" \
  --attention-keys 10 --keep-dense --keep-trajectories
LIMIT=${LIMIT:-400}
$ACTMAP capture --task nq_open --no-chat-template --limit "$LIMIT" --out "$OUT/smollm2-nq_open" \
  --attention-keys 10 --keep-dense
$ACTMAP capture --task gsm8k --no-chat-template --limit "$((LIMIT / 4))" --out "$OUT/smollm2-gsm8k" \
  --attention-keys 10 --keep-dense
if [ -n "$GEMMA" ]; then
  $ACTMAP capture --task builtin --builtin-questions 400 --model "$GEMMA" --out "$OUT/gemma3-builtin" \
    --attention-keys 10 --keep-dense
fi
# CNN/DM summaries (384 new tokens) labelled by the offline LLM judge: CNN_DM=1 to run.
if [ -n "${CNN_DM:-}" ]; then
  JUDGE=$(../shared/models/get-model qwen2.5-coder-1.5b-instruct)
  $ACTMAP capture --task cnn_dm --limit "$LIMIT" --judge "$JUDGE" --out "$OUT/smollm2-cnn_dm" \
    --attention-keys 10
fi
