#!/usr/bin/env bash
# Everything behind the grid's figures (issue: the grid) on a machine without stores/ and runs/
# (they are not in git; sessions 9 and 18 found new machines), in one resumable command: rerun
# it after a session ends and every step continues where it stopped.
#   mkdir -p logs && setsid nohup scripts/rebuild-all.sh > logs/rebuild-all.log 2>&1 < /dev/null &
# Two lanes of one thread each, the machine's two cores:
#   A  scripts/rebuild-queue.sh: every capture of configs/reproduce-full.toml's short-answer
#      stores (then grid-queue.sh's float32 Qwen-0.5B TriviaQA store, for the dtype check);
#   B  scripts/judge-queue.sh (the CNN/DailyMail judge checks, the 1,500 summaries, and
#      judged labels for LABEL_UP_TO of them, default 608: the count the judged store held when
#      the grid's figures were measured, at about 30 s a summary), the judged store's reproduce
#      stages, then scripts/actvit-sweep.sh (the full 24-configuration ACT-ViT sweep on
#      Gemma-3 x built-in, lane A's first store).
# When lane A's captures are done, each lane runs the reproduce stages (copy, baselines,
# training) of the config's stores, one `actmap reproduce --no-report --store S` call per store:
# A from the config's first store on, B (after its own steps) from the last one back. A store
# the other lane holds is refused at once by its lock and skipped; a store already done is
# skipped by reproduce itself. When both lanes have ended, one `actmap reproduce` renders the
# report (its cost section times things: nothing else should run beside it).
# Progress: logs/rebuild-lane-A.log and logs/rebuild-lane-B.log (`tail -c 400`: bar and eta).
# CONFIG (default configs/reproduce-full.toml), NICE (lanes' nice, default 5).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
CONFIG=${CONFIG:-configs/reproduce-full.toml}
NICE=${NICE:-5}
mkdir -p logs
CAPTURED=logs/.rebuild-captures-done   # written by lane A in this call only
rm -f "$CAPTURED"
mapfile -t STORES < <(.venv/bin/python -c '
import sys, tomllib
for s in tomllib.load(open(sys.argv[1], "rb"))["stores"]:
    print(s["name"])' "$CONFIG")
CNN=smollm2-cnn_dm-judged-1.5b-bfloat16
run() { echo "=== $(date -Is) start: $*"; "$@"; local rc=$?; echo "=== $(date -Is) end rc=$rc: $*"; return $rc; }
reproduce_stores() {  # one call per store, in the order given; a store held elsewhere is skipped
  local store
  for store in "$@"; do
    run nice -n "$NICE" $A reproduce --config "$CONFIG" --no-report --store "$store"
  done
}
lane_a() {
  run scripts/rebuild-queue.sh && touch "$CAPTURED" || return 1
  reproduce_stores "${STORES[@]}"
}
lane_b() {
  LABEL_UP_TO=${LABEL_UP_TO:-608} run scripts/judge-queue.sh
  reproduce_stores "$CNN"
  run nice -n "$NICE" scripts/actvit-sweep.sh
  # a store still being captured waits; if lane A ended without its captures, stop here
  while [ ! -e "$CAPTURED" ] && kill -0 "$pid_a" 2>/dev/null; do sleep 60; done
  [ -e "$CAPTURED" ] || { echo "=== $(date -Is) lane A's captures did not finish: see its log"; return 1; }
  local reversed=() i
  for ((i = ${#STORES[@]} - 1; i >= 0; i--)); do reversed+=("${STORES[i]}"); done
  reproduce_stores "${reversed[@]}"
}
echo "=== $(date -Is) ${#STORES[@]} stores ($CONFIG)"
lane_a >> logs/rebuild-lane-A.log 2>&1 &
pid_a=$!
lane_b >> logs/rebuild-lane-B.log 2>&1 &
pid_b=$!
wait "$pid_a" "$pid_b"
[ -e "$CAPTURED" ] || { echo "=== $(date -Is) the captures did not finish: logs/rebuild-lane-A.log"; exit 1; }
echo "=== $(date -Is) lanes ended; the report over every store"
run $A reproduce --config "$CONFIG"
echo "=== $(date -Is) rebuild done"
