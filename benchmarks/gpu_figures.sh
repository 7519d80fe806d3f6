#!/usr/bin/env bash
# The cost figures that need a GPU, in one run of about 7 minutes on one H100:
#   capture overhead on a random-weight Llama-3-8B-shaped generator (bfloat16, batch 64,
#   32 new tokens; map-only, grey-box, and with what the baselines keep, whose tokens are
#   checked in float32 at batch 16), ViT / MLP scoring
#   latency and peak memory at batch 256, ACT-ViT's at an 8B's hidden size (4,096), and
#   training seconds per epoch of the paper's recipe; torch.compile last.
#
#   PYTHONPATH=src python benchmarks/bench_capture.py --save-tokenizer runs/gpu-bench/tokenizer
#   OUT=runs/gpu-bench benchmarks/gpu_figures.sh runs/gpu-bench/tokenizer    # on the GPU machine
#
# No weights travel: the generator is built on the GPU from its shape, with the embedded
# default's tokenizer. Each step has its own time limit, so one slow step costs only itself.
set -uo pipefail
tokenizer=${1:?usage: gpu_figures.sh TOKENIZER_DIR}
out=${OUT:-runs/gpu-bench}
python=${PYTHON:-python3}
export PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p "$out"

step() {  # step SECONDS NAME COMMAND...: run it under a time limit, output to $out/NAME.txt
    local seconds=$1 name=$2
    shift 2
    echo "=== $(date -Iseconds) $name: $*"
    timeout "$seconds" "$@" 2>&1 | grep -v "Loading weights" | tee "$out/$name.txt"
    echo "=== $name rc=${PIPESTATUS[0]}"
}

nvidia-smi -L
"$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
capture=(benchmarks/bench_capture.py --shape llama-8b --tokenizer "$tokenizer" --device cuda
    --new-tokens 32 --threads 4)
step 150 capture-8b "$python" "${capture[@]}" --dtype bfloat16 --batch 64 --repeats 12
step 100 capture-8b-baselines "$python" "${capture[@]}" --dtype bfloat16 --batch 64 --repeats 3 \
    --attention-keys 10 --keep-dense
step 150 capture-8b-fp32-baselines "$python" "${capture[@]}" --dtype float32 --batch 16 \
    --repeats 2 --attention-keys 10 --keep-dense
step 180 scoring "$python" benchmarks/bench_scoring.py --device cuda --repeats 300 \
    --train-maps 4096 --val-maps 512 --json "$out/scoring.json"
step 60 actvit-8b "$python" -c "
from actmap.experiments.cost import detector_scoring_costs
for cost in detector_scoring_costs(d_model=4096, batch=256, repeats=100, device='cuda'):
    print(cost)"
step 120 scoring-compiled "$python" benchmarks/bench_scoring.py --device cuda --repeats 300 \
    --compile --train-maps 0
