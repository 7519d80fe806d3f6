"""Does bf16 scoring from stored float16 maps keep the AUROC? fp32 vs bf16 on a real store.

    PYTHONPATH=src python benchmarks/check_bf16_auroc.py --store stores/smollm2-builtin

Trains each detector once with the paper's recipe (float32, epochs capped by
`--mlp-epochs` / `--vit-epochs`, seed 42) on the store's balanced train and
validation rows, then scores the balanced test rows from their stored float16
maps twice: `precision="float32"` and `precision="bfloat16"` (the float16 ->
bf16 staging path). Prints both AUROCs and the largest difference in p(correct).
The store is only read (its balanced splits must already be recorded, as after
`actmap train`); copy it first if they are not.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from actmap.detectors import create_detector
from actmap.experiments.seeds import load_balanced
from actmap.training.recipe import TrainConfig, predict_logits, train_detector


def balanced_tensors(store: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{split: (maps, labels)} of the store's recorded balanced rows, as tensors; prints their
    sizes and the machine's load beside the store."""
    splits, _ = load_balanced(store)
    data = {k: (torch.as_tensor(v.maps), torch.as_tensor(v.labels)) for k, v in splits.items()}
    sizes = {k: len(labels) for k, (_, labels) in data.items()}
    print(f"store {store}, balanced rows {sizes}, load average {os.getloadavg()}", flush=True)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--mlp-epochs", type=int, default=30)
    parser.add_argument("--vit-epochs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = balanced_tensors(args.store)
    cpu = torch.device("cpu")
    rows = {}
    for name, epochs in (("mlp", args.mlp_epochs), ("vit", args.vit_epochs)):
        torch.manual_seed(0)
        model = create_detector(name)
        start = time.perf_counter()
        config = replace(TrainConfig(), max_epochs=epochs, device="cpu")
        train_detector(model, *data["train"], *data["validation"], config, seed=42)
        maps16, labels = data["test"]
        p = {
            precision: torch.sigmoid(predict_logits(model, maps16, 256, cpu, precision)).numpy()
            for precision in ("float32", "bfloat16")
        }
        rows[name] = {
            "epochs": epochs,
            "auroc_fp32": roc_auc_score(labels, p["float32"]),
            "auroc_bf16": roc_auc_score(labels, p["bfloat16"]),
            "max_abs_dp": float(np.abs(p["float32"] - p["bfloat16"]).max()),
            "train_s": time.perf_counter() - start,
        }
        r = rows[name]
        print(
            f"{name}: {epochs} epochs, test AUROC fp32 {r['auroc_fp32']:.4f}, bf16 "
            f"{r['auroc_bf16']:.4f}, max |dp| {r['max_abs_dp']:.1e} ({r['train_s']:.0f} s)",
            flush=True,
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
