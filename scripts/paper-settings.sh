#!/usr/bin/env bash
# The paper's baseline settings on one pair (issue: the grid, item 5), resumable, one thread:
#   mkdir -p logs && setsid nohup scripts/paper-settings.sh > logs/paper-settings.log 2>&1 < /dev/null &
# ACT-ViT's full 24-configuration sweep (widths 128/1024, depths 1/3, decays 1/1e-3, patches
# 1x1/8x1/4x2, 15 epochs with seed 42, then the selected configuration retrained with 123 and
# 456) on Gemma-3-270M x built-in, the store with the fewest training rows (118 balanced), on
# a hard-linked copy of the full reproduce run's store (so the report's selected-configuration
# ACT-ViT row stays). Each finished configuration is kept in the copy's actvit-sweeps/ folder:
# a killed run resumes at the next one. Measured on this CPU at 1 thread beside two other jobs,
# one epoch over the 118 rows takes 2-120 s per configuration (1x1 patches and width 1024 the
# slowest), about 7 hours for the sweep; NICE (default 10) leaves the cores to the capture
# queues first. Memory: the depth-3 configuration with 1x1 patches (800 patch tokens) reached
# 12.8 GB RSS and was killed for memory beside the 1.5B capture and judge (session 7, after
# the six width-128 depth-1 configurations had finished and been kept): run it with the
# machine to itself, or beside jobs that leave it 14 GB.
# Semantic Entropy at its settings (10 samples, T = 1.0, top-p 0.9; the copy's samples from
# session 6 are reused) runs first, on the same balanced test rows, with the Qwen2.5-Coder-1.5B
# judge in bfloat16 asked the same-answer prompt (SE_PROMPT): asked the Nature prompt, the
# 1.5B answers "neutral" to every pair and the 0.5B "entailment" to every pair (session 6 ran
# SE on this store with the 0.5B: a constant), so SE's clusters are meaningless with either;
# scripts/se_judge_check.py measures both prompts on real answer pairs (docs/results/log.md).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
SOURCE=${SOURCE:-runs/reproduce-full/stores/gemma3-builtin}
COPY=${COPY:-runs/paper-settings/stores/gemma3-builtin}
run() { echo "=== $(date -Is) start: $*"; "$@"; local rc=$?; echo "=== $(date -Is) end rc=$rc: $*"; return $rc; }
if [ ! -d "$COPY" ]; then  # shards hard-linked, the manifest copied, the writer lock left behind
  .venv/bin/python -c "import sys; from pathlib import Path; from actmap.reproduce \
import link_copy; link_copy(Path(sys.argv[1]), Path(sys.argv[2]))" "$SOURCE" "$COPY.partial" \
    && mv "$COPY.partial" "$COPY"
fi
SE_DONE="$COPY/results-se-${SE_PROMPT:=same_answer}.done"
if [ ! -e "$SE_DONE" ]; then  # --force replaces the session 6 result (0.5B judge) once
  run $A baselines --store "$COPY" --methods semantic_entropy --n-samples 10 \
    --judge qwen2.5-coder-1.5b-instruct --judge-dtype bfloat16 --judge-prompt "$SE_PROMPT" \
    --force --device cpu && touch "$SE_DONE"
fi
[ -n "${SE_ONLY:-}" ] && exit 0
run nice -n "${NICE:-10}" $A baselines --store "$COPY" --methods actvit --actvit-grid full \
  --force --device cpu
echo "=== $(date -Is) queue done"
