#!/usr/bin/env bash
# The baselines the full reproduce run left out (CPU time), on the store copies under
# runs/reproduce-full/stores (issue: the grid, item 5; issue: the report, item 1). Resumable:
# a method whose results cover a store's balanced rows is skipped, and sampled answers are
# kept in each store's samples table (shared by EigenScore and Semantic Entropy).
#   mkdir -p logs && setsid nohup scripts/baselines-queue.sh > logs/baselines-queue.log 2>&1 < /dev/null &
# Order: EigenScore (10 samples, the paper's setting) and ACT-ViT (the paper's selected
# configuration: width 128, depth 1, decay 1e-3, 4x2 patches; 3 seeds) on every store,
# smallest first; then Semantic Entropy (10 samples at T = 1.0, top-p 0.9, reusing
# EigenScore's samples; SE_JUDGE the entailment judge) on SE_STORE, Gemma-3 x built-in by
# default: its 14 balanced test rows are what one CPU thread can judge in a session (with 10
# distinct samples per answer SE asks up to 90 judge questions per answer).
# ACTVIT_GRID=small sweeps 6 configurations (every decay and patch shape), =full all 24
# (width 1024, depth 3): on one CPU thread the 1x1-patch configurations (800 patch tokens)
# took minutes per configuration on 118 training rows and would take hours on the larger
# stores, so the sweeps are left to a GPU or to long background runs.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
STORES=${STORES:-runs/reproduce-full/stores}
run() { echo "=== $(date -Is) start: $*"; "$@"; echo "=== $(date -Is) end rc=$?: $*"; }
# PART=se runs the SE step alone and PART=stores the rest, so the two can run side by side.
GRID=${ACTVIT_GRID:-selected}
PART=${PART:-all}
SE_JUDGE=${SE_JUDGE:-qwen2.5-coder-1.5b-instruct}
SE_STORE=${SE_STORE:-gemma3-builtin}
if [ "$PART" != se ]; then
  for store in gemma3-builtin smollm2-nq_open smollm2-builtin smollm2-gsm8k gemma3-triviaqa \
    smollm2-triviaqa; do
    run $A baselines --store "$STORES/$store" --methods eigenscore,actvit \
      --actvit-grid "$GRID" --n-samples 10 --device cpu
  done
fi
if [ "$PART" != stores ]; then
  run $A baselines --store "$STORES/$SE_STORE" --methods semantic_entropy --n-samples 10 \
    --judge "$SE_JUDGE" --device cpu
fi
echo "=== $(date -Is) queue done"
