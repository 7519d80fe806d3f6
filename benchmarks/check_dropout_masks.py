"""Do the ViT's CPU dropout masks change what the recipe learns? torch's masks vs `dropout_mask`.

    PYTHONPATH=src python benchmarks/check_dropout_masks.py --store stores/smollm2-builtin

Trains the paper's ViT with the paper's recipe (float32 by default, epochs
capped by `--epochs`) once per seed with each source of dropout masks, both
drawn from the same seeded torch generator:

- `torch`: `F.dropout` (torch's CPU `bernoulli_`, one draw per entry; the masks
  of the ViT before `actmap.detectors.vit.dropout_mask`);
- `fast`: `dropout_mask` (32 random bits per entry from 64-bit draws, five
  times faster on this CPU; the ViT's CPU masks now).

Prints, per seed and mask source, the best validation AUROC, its epoch, the test
AUROC of the selected weights and the CPU seconds per epoch per 1,000 maps, then
the mean and the seed-to-seed spread of each. The store is only read (its
balanced splits must already be recorded, as after `actmap train`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from dataclasses import replace

import torch
from check_bf16_auroc import balanced_tensors
from previous_vit import torch_masks
from sklearn.metrics import roc_auc_score

from actmap.detectors import create_detector
from actmap.training.recipe import TrainConfig, predict_logits, train_detector


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 123, 456])
    parser.add_argument("--precision", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = balanced_tensors(args.store)
    sizes = {k: len(labels) for k, (_, labels) in data.items()}
    config = replace(TrainConfig(), max_epochs=args.epochs, device="cpu", precision=args.precision)
    rows: dict[str, list[dict]] = {"torch": [], "fast": []}
    for seed in args.seeds:
        for masks in ("torch", "fast"):
            torch.manual_seed(seed)
            model = create_detector("vit")
            context = torch_masks() if masks == "torch" else contextlib.nullcontext()
            cpu = time.process_time()
            with context:
                result = train_detector(model, *data["train"], *data["validation"], config, seed)
            cpu_per_1k = 1e3 * (time.process_time() - cpu) / len(result.history) / sizes["train"]
            maps, labels = data["test"]
            logits = predict_logits(model, maps, 256, torch.device("cpu"), args.precision)
            row = {
                "seed": seed,
                "best_val_auroc": result.best_val_auroc,
                "best_epoch": result.best_epoch,
                "test_auroc": float(roc_auc_score(labels, torch.sigmoid(logits).numpy())),
                "cpu_s_per_1k_maps": cpu_per_1k,
            }
            rows[masks].append(row)
            print(
                f"seed {seed} {masks:>5} masks: val AUROC {row['best_val_auroc']:.4f} "
                f"(epoch {row['best_epoch']}), test AUROC {row['test_auroc']:.4f}, "
                f"{cpu_per_1k:.1f} CPU s per epoch per 1,000 maps",
                flush=True,
            )
    for masks, values in rows.items():
        summary = []
        for key in ("best_val_auroc", "test_auroc", "cpu_s_per_1k_maps"):
            column = [r[key] for r in values]
            spread = statistics.stdev(column) if len(column) > 1 else float("nan")
            summary.append(f"{key} {statistics.mean(column):.4f} (sd {spread:.4f})")
        print(f"{masks:>5} masks, mean over {len(values)} seeds: " + ", ".join(summary))
    print(json.dumps({"load_average": os.getloadavg(), **rows}))


if __name__ == "__main__":
    main()
