#!/usr/bin/env bash
# The full 24-configuration ACT-ViT sweep (issue: the grid, item 5) on the store whose balanced
# rows also have Semantic Entropy at 10 samples, resumable per configuration, one thread:
#   mkdir -p logs && setsid nohup scripts/actvit-sweep.sh > logs/actvit-sweep.log 2>&1 < /dev/null &
# It writes into a hard-linked copy under runs/actvit-sweep/stores (the source store is only
# read; the report's store copies keep their selected-configuration ACT-ViT), then prints the
# comparison with 95% intervals. Deviations from the paper's settings, for CPU time: the
# forward pass runs in bfloat16 autocast (float32 weights; about 2x at width 1024 on this
# CPU), and each 128-row batch runs as 32-row micro batches (memory; the same step). On
# Gemma-3 x built-in's 118 balanced training rows the width-1024, 1x1-patch configurations
# cost most: about 2 h of one full core in all.
# SWEEP_STORE picks the store (a name under stores/); ACTVIT_PRECISION=float32 runs the
# paper's precision.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
PY=${PYTHON:-.venv/bin/python}
STORE=${SWEEP_STORE:-gemma3-builtin}
PRECISION=${ACTVIT_PRECISION:-bfloat16}
COPY=runs/actvit-sweep/stores/$STORE-$PRECISION
run() { echo "=== $(date -Is) start: $*"; "$@"; echo "=== $(date -Is) end rc=$?: $*"; }
if [ ! -d "$COPY" ]; then
  mkdir -p "$(dirname "$COPY")"
  run "$PY" -c "import sys; from pathlib import Path; from actmap.reproduce import \
link_copy; link_copy(Path(sys.argv[1]), Path(sys.argv[2]))" "stores/$STORE" "$COPY"
fi
run $A baselines --store "$COPY" --methods actvit,ppl,answer_length --actvit-grid full \
  --actvit-precision "$PRECISION" --actvit-micro-batch 32 --device cpu
run $A compare --store "$COPY" --out "runs/actvit-sweep/$STORE-$PRECISION.md"
echo "=== $(date -Is) sweep done"
