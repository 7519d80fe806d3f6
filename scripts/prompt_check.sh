#!/usr/bin/env bash
# Which prompt suits a generator: natural accuracy on 100 validation questions per dataset,
# plain 5-shot text vs the chat-template few-shot prompt (issue: the grid, item 1).
# Resumable (each cell is a small store under $OUT); prints one table at the end.
# Usage: scripts/prompt_check.sh qwen2.5-coder-0.5b-instruct [qwen2.5-coder-1.5b-instruct ...]
set -euo pipefail
cd "$(dirname "$0")/.."
ACTMAP=${ACTMAP:-.venv/bin/actmap}
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-stores/prompt-check}
N=${N:-100}
for name in "$@"; do
  model=$(../shared/models/get-model "$name")
  for task in triviaqa nq_open gsm8k; do
    for style in plain chat; do
      flag=$([ "$style" = plain ] && echo --no-chat-template || echo --chat-template)
      $ACTMAP capture --task "$task" --model "$model" "$flag" --splits validation --limit "$N" \
        --no-greybox --out "$OUT/$name-$task-$style"
    done
  done
done
$PYTHON - "$OUT" <<'PY'
import sys
from pathlib import Path

from actmap.store.rows import natural_accuracy
from actmap.store import MapStore

print("| generator | dataset | prompt | rows | natural accuracy |")
print("|---|---|---|---|---|")
for folder in sorted(Path(sys.argv[1]).iterdir()):
    store = MapStore.open(folder)
    name, style = folder.name.rsplit("-", 1)
    task = store.manifest["config"]["task"]["task"]
    generator = name[: -len(task) - 1]
    acc = natural_accuracy(store).get("validation")
    rows = len(store.ids("maps"))
    print(f"| {generator} | {task} | {style} | {rows} | {acc:.3f} |")
PY
