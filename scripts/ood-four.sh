#!/usr/bin/env bash
# Issue 57 on one generator's four task stores: each task held out in turn from a generalist fit
# on the other three, against RAUQ, perplexity, mean token entropy, TAD and the paper's MLP
# trained on the others and the task's own detector, then its first labels (k = 0, 25, 50, 100,
# 200, 10 draws): `actmap out-of-domain`, one `--held-out` task per run, each into its own
# folder OUT/held-out-TASK. Resumable: a task whose out_of_domain.json is written is skipped (a
# run cut off midway starts that task over). One thread. Log: OUT.log.
#   setsid nohup scripts/ood-four.sh qwen-1.5b > /dev/null 2>&1 < /dev/null &
# The stores are stores/GEN-{triviaqa,nq_open,builtin,gsm8k}-stacked (GEN: the first argument;
# TASKS="..." and STORE_DIR=... change them); OUT defaults to runs/ood-GEN-4. A store missing,
# or still being written by an `actmap capture` process, stops the script before anything runs;
# WAIT_FOR=PATTERN first waits while a process matching PATTERN runs (e.g. the capture queue,
# WAIT_FOR=scripts/grid-stacked.sh). EXTRA="..." adds options to every out-of-domain run (a
# smoke run: EXTRA="--k 0,25 --draws 2 --no-mlp --resamples 50"). Then every generator side by
# side (`actmap report` reads OUT's held-out-* folders):
#   actmap report --store stores/GEN-triviaqa-stacked --only out_of_domain --out report-ood \
#     --out-of-domain runs/ood-smollm2-3 --out-of-domain runs/ood-gemma3-3 \
#     --out-of-domain runs/ood-qwen05-4 --out-of-domain runs/ood-GEN-4
set -uo pipefail
cd "$(dirname "$0")/.."
GEN=${1:?usage: scripts/ood-four.sh GENERATOR (stores STORE_DIR/GENERATOR-TASK-stacked)}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
A=${ACTMAP:-.venv/bin/actmap}
TASKS=${TASKS:-triviaqa nq_open builtin gsm8k}
STORE_DIR=${STORE_DIR:-stores}
OUT=${OUT:-runs/ood-$GEN-4}
mkdir -p "$(dirname "$OUT")"
LOG=$OUT.log
say() { echo "=== $(date -Is) $*" | tee -a "$LOG"; }

if [ -n "${WAIT_FOR:-}" ]; then
  while pgrep -f -- "$WAIT_FOR" > /dev/null; do sleep 60; done
fi
stores=()
for task in $TASKS; do
  store=$STORE_DIR/$GEN-$task-stacked
  if [ ! -f "$store/manifest.json" ]; then
    say "stop: no store $store (no manifest.json)"; exit 1
  fi
  if pgrep -f -- "capture .*--out $store( |$)" > /dev/null; then
    say "stop: $store is still being captured (WAIT_FOR=... waits for the capture queue)"; exit 1
  fi
  stores+=(--store "$store")
done

failed=0
for task in $TASKS; do
  folder=$OUT/held-out-$task
  if [ -f "$folder/out_of_domain.json" ]; then
    say "skip: $task held out (done: $folder)"; continue
  fi
  say "start: $task held out -> $folder"
  # shellcheck disable=SC2086  # EXTRA: words, on purpose
  $A out-of-domain "${stores[@]}" --held-out "$task" --out "$folder" ${EXTRA:-} >> "$LOG" 2>&1
  rc=$?
  say "end rc=$rc: $task held out"
  [ $rc = 0 ] || failed=1
done
say "done (failed: $failed); the held-out folders: $OUT/held-out-*"
exit $failed
