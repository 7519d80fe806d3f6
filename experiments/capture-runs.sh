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
