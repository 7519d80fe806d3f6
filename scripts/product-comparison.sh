#!/usr/bin/env bash
# actmap-plus against the strongest single-pass baseline and the paper's ViT (80-epoch recipe,
# three seeds) on every store with at least 200 balanced training rows (docs/results/log.md).
# Reads the stores and ViT runs that `actmap reproduce --config configs/reproduce-full.toml`
# leaves under runs/reproduce-full (store copies with their baselines, runs/<store>/vit), and
# writes runs/product/<store>/{comparison.md,comparison.json,rows.json}. Resumable: a store
# whose comparison exists is skipped.
#   scripts/product-comparison.sh smollm2-builtin smollm2-triviaqa smollm2-nq_open smollm2-gsm8k
set -uo pipefail
cd "$(dirname "$0")/.."
A=${ACTMAP:-.venv/bin/actmap}
PY=${PYTHON:-.venv/bin/python}
R=${REPRODUCE:-runs/reproduce-full}
OUT=${OUT:-runs/product}
for name in "$@"; do
  store=$R/stores/$name vit=$R/runs/$name/vit out=$OUT/$name
  [ -f "$vit/summary.json" ] || { echo "skip $name: no finished ViT run at $vit"; continue; }
  if [ ! -f "$out/comparison.json" ]; then
    echo "=== $(date -Is) compare-product $name"
    $A compare-product --store "$store" --out "$out" --vit-run "$vit" --permutations 5 --device cpu
  fi
  if [ ! -f "$out/rows.json" ]; then
    echo "=== $(date -Is) product rows $name"
    $PY scripts/product_rows.py --store "$store" --vit-run "$vit" --out "$out/rows.json"
  fi
done
