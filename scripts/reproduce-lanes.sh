#!/usr/bin/env bash
# The reproduce config's stores in LANES parallel calls of one thread each, then one report.
#   mkdir -p logs && setsid nohup scripts/reproduce-lanes.sh > logs/reproduce-lanes.log 2>&1 < /dev/null &
# Each lane is `actmap reproduce --no-report --store ...` over its share of the stores (dealt
# round-robin in the config's order, so each lane gets a mix of big and small stores); lanes
# never share a store (reproduce locks each store for the whole call). When every lane has
# ended, one `actmap reproduce` over all stores skips the finished stages and renders the
# report. Resumable: rerun it; finished stages are skipped, a killed stage starts over (EigenScore
# and Semantic Entropy keep the samples they committed). Each lane logs to
# logs/reproduce-lane-<i>.log; `tail -c 400` shows its progress bar and ETA.
# CONFIG (default configs/reproduce-full.toml), LANES (default 4), NICE (lanes' nice, default 5).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${OMP_NUM_THREADS:-1}
A=${ACTMAP:-.venv/bin/actmap}
CONFIG=${CONFIG:-configs/reproduce-full.toml}
LANES=${LANES:-4}
NICE=${NICE:-5}
mkdir -p logs
mapfile -t STORES < <(.venv/bin/python -c '
import sys, tomllib
for s in tomllib.load(open(sys.argv[1], "rb"))["stores"]:
    print(s["name"])' "$CONFIG")
echo "=== $(date -Is) ${#STORES[@]} stores in $LANES lanes ($CONFIG)"
pids=()
for ((lane = 0; lane < LANES; lane++)); do
  args=()
  for ((i = lane; i < ${#STORES[@]}; i += LANES)); do args+=(--store "${STORES[i]}"); done
  [ ${#args[@]} -gt 0 ] || continue
  log=logs/reproduce-lane-$lane.log
  echo "=== $(date -Is) lane $lane: ${args[*]} -> $log"
  (nice -n "$NICE" $A reproduce --config "$CONFIG" --no-report "${args[@]}" >> "$log" 2>&1
   rc=$?
   echo "=== $(date -Is) lane $lane end rc=$rc" >> "$log"
   exit $rc) &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
echo "=== $(date -Is) lanes ended, $failed of ${#pids[@]} failed; the report over every store"
$A reproduce --config "$CONFIG"
echo "=== $(date -Is) end rc=$?"
