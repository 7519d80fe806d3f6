#!/usr/bin/env bash
# Detectors and cheap baselines on the stores of capture-runs.sh, one line of figures each.
# STORES: store names under stores/ (default: every store there). VIT_EPOCHS caps the ViT's
# epochs on CPU (default 15; the paper's recipe is 80). Reruns skip finished runs.
set -euo pipefail
cd "$(dirname "$0")/.."
ACTMAP=${ACTMAP:-.venv/bin/actmap}
VIT_EPOCHS=${VIT_EPOCHS:-15}
STORES=${STORES:-$(cd stores && ls -d */ | tr -d / | grep -v '^nostop$')}
CHEAP=perplexity,mean_token_entropy,answer_length,rauq,tad,permuted_label

for name in $STORES; do
  store=stores/$name
  [ -f "$store/manifest.json" ] || { echo "skip $name: no store"; continue; }
  for detector in mlp logreg; do
    [ -f "runs/$name-$detector/summary.json" ] ||
      $ACTMAP train --store "$store" --detector "$detector" --out "runs/$name-$detector"
  done
  [ -f "runs/$name-vit$VIT_EPOCHS/summary.json" ] ||
    $ACTMAP train --store "$store" --detector vit --max-epochs "$VIT_EPOCHS" \
      --out "runs/$name-vit$VIT_EPOCHS"
  $ACTMAP baselines --store "$store" --methods "$CHEAP" || echo "baselines on $name: see above"
  $ACTMAP compare --store "$store" --run "runs/$name-mlp" --run "runs/$name-logreg" \
    --run "runs/$name-vit$VIT_EPOCHS"
done
