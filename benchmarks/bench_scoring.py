"""Scoring latency, peak memory and training time per epoch of the detectors.

    PYTHONPATH=src python benchmarks/bench_scoring.py                 # CPU, 2 threads, ~3 min
    PYTHONPATH=src python benchmarks/bench_scoring.py --compile       # + torch.compile (~5 min more)
    PYTHONPATH=src python benchmarks/bench_scoring.py --device cuda --repeats 300 --compile

Scoring: one batch (default 256) of random maps, every variant timed in the same
run with interleaved repeats (median, warm-up excluded):

- `fp32 <- fp32`: `model(x)` on float32 maps, the reference of the first figures;
- `fp32 <- fp16`: `predict_logits` on stored float16 maps (this thread's reused buffer;
  on the CPU the ViT's `cpu_scoring_rows` = 64 maps per forward pass);
- `bf16 <- fp16`: the same with `precision="bfloat16"` (bf16 autocast; float16 -> bf16
  staged through float32 in cache-sized slices);
- `fp32 <- fp16 prev`, `bf16 <- fp16 prev`: the path before this version, the whole
  batch in one forward pass (the reference of the two above);
- `compiled fp32`, `compiled bf16`: `predict_logits(..., compile=True)` (`--compile`;
  torch.compile, compile time printed apart and excluded);
- `graphs fp32`, `graphs bf16` (`--compile` on a GPU): `compile="reduce-overhead"`, the
  batch replayed as one CUDA graph.

Training: the paper's recipe (noise, mixup, clipping, validation) on synthetic
maps; the median epoch's wall time per 1,000 training maps (epochs 2-3), float32
(the paper's recipe) and bf16 autocast (`TrainConfig(precision="bfloat16")`), each
beside the ViT's training path before this version (`prev`: torch's dropout masks
and the fused-kernel attention, `benchmarks/previous_vit.py`; `--no-previous-training`
skips it). The last table prints each target figure beside
its reference (the quiet 2-core figure before this version, or the paper's L40S)
and its target. The load average is printed: on a shared machine every figure
is slower; the "cpu" columns (process CPU time, all threads) are disturbed less.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch
from previous_vit import previous_training

from actmap.detectors import create_detector
from actmap.device import resolve_device
from actmap.experiments.cost import time_calls
from actmap.training.recipe import (
    TrainConfig,
    bf16_supported,
    predict_logits,
    train_detector,
)

MAP_SHAPE = (12, 32, 128)
# The figures each target is read from: (detector, variant) -> (unit, reference, target).
# References: the quiet 2-core re-run before this version (docs/performance.md), or the paper.
SCORING_TARGETS = {
    ("cpu", "vit", "bf16 <- fp16"): ("ms/map", 1.29, "<= 1.0"),
    ("cpu", "vit", "fp32 <- fp16"): ("ms/map", 3.36, "<= 1.0"),
    ("cpu", "vit", "compiled bf16"): ("ms/map", 1.29, "<= 1.0"),
    ("cpu", "mlp", "bf16 <- fp16"): ("maps/s", 44_126, ">= 30,000"),
    ("cuda", "vit", "fp32 <- fp16"): ("ms/map", 0.024, "<= .010 (paper .024 on L40S)"),
    ("cuda", "vit", "bf16 <- fp16"): ("ms/map", 0.024, "<= .010 (paper .024 on L40S)"),
    ("cuda", "vit", "graphs bf16"): ("ms/map", 0.024, "<= .010 (paper .024 on L40S)"),
}
TRAINING_TARGETS = {  # (detector, precision) -> (reference s per epoch per 1,000 maps, target)
    ("vit", "float32"): (11.3, "<= 5"),
    ("vit", "bfloat16"): (7.4, "<= 5"),
}


def _rss_kib(field: str) -> int | None:
    """VmRSS / VmHWM of this process from /proc (Linux); None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _whole_batch(model: torch.nn.Module, maps: torch.Tensor, precision: str) -> torch.Tensor:
    """Scoring as before this version: the whole batch in one forward pass."""
    rows = model.__dict__.get("cpu_scoring_rows")
    model.cpu_scoring_rows = len(maps)  # this instance only
    try:
        return predict_logits(model, maps, len(maps), precision=precision)
    finally:
        if rows is None:
            del model.cpu_scoring_rows
        else:
            model.cpu_scoring_rows = rows


def _variants(name: str, device: torch.device, batch: int, compile_model: bool) -> dict:
    torch.manual_seed(0)
    model = create_detector(name).to(device).eval()
    x32 = torch.randn(batch, *MAP_SHAPE, device=device)  # (B, 12, 32, 128)
    x16 = x32.half()
    plain = torch.inference_mode()(model)
    variants = {
        "fp32 <- fp32": lambda: plain(x32),
        "fp32 <- fp16": lambda: predict_logits(model, x16, batch, device),
        "fp32 <- fp16 prev": lambda: _whole_batch(model, x16, "float32"),
    }
    precisions = ["float32"]
    if bf16_supported(device):
        precisions.append("bfloat16")
        variants["bf16 <- fp16"] = lambda: predict_logits(model, x16, batch, device, "bfloat16")
        variants["bf16 <- fp16 prev"] = lambda: _whole_batch(model, x16, "bfloat16")
    if compile_model:
        modes = {"compiled": "default"}
        if device.type == "cuda":
            modes["graphs"] = "reduce-overhead"  # CUDA graphs: one launch per batch
        for prefix, mode in modes.items():
            for precision in precisions:
                label = f"{prefix} " + ("bf16" if precision == "bfloat16" else "fp32")
                twin = create_detector(name).to(device).eval()  # one compiled graph per variant
                twin.load_state_dict(model.state_dict())
                start = time.perf_counter()
                compiled = predict_logits(twin, x16, batch, device, precision, compile=mode)
                eager = predict_logits(model, x16, batch, device, precision)
                print(
                    f"{name}: compiling {mode} for {precision} took "
                    f"{time.perf_counter() - start:.0f} s; "
                    f"max |logit difference| from eager {(compiled - eager).abs().max():.1e}",
                    flush=True,
                )
                variants[label] = lambda twin=twin, precision=precision, mode=mode: predict_logits(
                    twin, x16, batch, device, precision, compile=mode
                )
    return variants


def bench_scoring(
    name: str, device: torch.device, batch: int, repeats: int, warmup: int, compile_model: bool
) -> list[dict]:
    """Median latency of one batch per variant, repeats interleaved across the variants."""
    variants = _variants(name, device, batch, compile_model)
    # process CPU time (all threads) of each timed call: less disturbed by other jobs
    cpu_times: dict[str, list[float]] = {label: [] for label in variants}

    def with_cpu_time(label, fn):
        def call():
            start = time.process_time()
            fn()
            cpu_times[label].append(time.process_time() - start)

        return call

    timed = {label: with_cpu_time(label, fn) for label, fn in variants.items()}
    times, peak = time_calls(timed, device, repeats, warmup)
    cpu_times = {label: values[warmup:] for label, values in cpu_times.items()}  # timed repeats
    rows = []
    for label in variants:
        median = statistics.median(times[label])
        rows.append(
            {
                "detector": name,
                "variant": label,
                "ms_per_map": 1e3 * median / batch,
                "maps_per_s": batch / median,
                # process CPU time (all threads): less disturbed by other jobs on a shared machine
                "cpu_ms_per_map": 1e3 * statistics.median(cpu_times[label]) / batch,
                "peak_mib": float("nan") if peak[label] is None else peak[label],
            }
        )
    return rows


def bench_training(
    name: str,
    device: torch.device,
    n_train: int,
    n_val: int,
    precision: str = "float32",
    epochs: int = 3,
    previous: bool = False,
) -> dict:
    """Wall time of one epoch of the paper's recipe (noise, mixup, clip, validation):
    the median over the epochs after the first (which pays warm-up effects).

    Also the process CPU time (all threads) per epoch, averaged over all
    epochs, which other jobs on a shared machine disturb less.
    """
    g = torch.Generator().manual_seed(0)
    maps = torch.randn((n_train + n_val, *MAP_SHAPE), generator=g).half()
    labels = torch.arange(n_train + n_val) % 2
    cfg = TrainConfig(max_epochs=epochs, device=str(device), precision=precision)
    torch.manual_seed(0)
    cpu_start = time.process_time()
    with previous_training() if previous else contextlib.nullcontext():
        result = train_detector(
            create_detector(name),
            maps[:n_train],
            labels[:n_train],
            maps[n_train:],
            labels[n_train:],
            cfg,
            seed=42,
        )
    cpu_epoch_s = (time.process_time() - cpu_start) / len(result.history)
    epoch_s = statistics.median(r.epoch_time_s for r in result.history[1:] or result.history)
    return {
        "detector": name,
        "precision": precision + (" prev" if previous else ""),
        "epoch_s": epoch_s,
        "s_per_1k_maps": 1e3 * epoch_s / n_train,
        "cpu_s_per_1k_maps": 1e3 * cpu_epoch_s / n_train,
    }


def print_targets(
    scoring: list[dict], training: list[dict], device: torch.device, threads: int
) -> None:
    """Each target figure beside its reference and target, in one table.

    `cpu / threads` is the process CPU time divided by the torch threads: about
    the figure on otherwise idle cores, when the machine is shared (wall figures
    on a busy machine are slower by the load).
    """
    print(f"\n{'figure':<46} {'measured':>9} {'cpu/threads':>11} {'reference':>9}  target")

    def fmt(value: float, unit: str) -> str:
        return f"{value:,.0f}" if unit == "maps/s" else f"{value:.3f}"

    for r in scoring:
        key = (device.type, r["detector"], r["variant"])
        if key in SCORING_TARGETS:
            unit, reference, target = SCORING_TARGETS[key]
            cpu_ms = r["cpu_ms_per_map"] / threads
            value, idle = (
                (r["ms_per_map"], cpu_ms) if unit == "ms/map" else (r["maps_per_s"], 1e3 / cpu_ms)
            )
            figure = f"{r['detector']} scoring {r['variant']}, {unit}"
            print(
                f"{figure:<46} {fmt(value, unit):>9} {fmt(idle, unit):>11} "
                f"{fmt(reference, unit):>9}  {target}"
            )
    for r in training:
        if (r["detector"], r["precision"]) in TRAINING_TARGETS:
            reference, target = TRAINING_TARGETS[(r["detector"], r["precision"])]
            figure = f"{r['detector']} training {r['precision']}, s/epoch per 1k maps"
            idle = r["cpu_s_per_1k_maps"] / threads
            print(
                f"{figure:<46} {r['s_per_1k_maps']:>9.2f} {idle:>11.2f} {reference:>9.2f}  {target}"
            )
    print(
        "references: the quiet 2-core re-run before this version (docs/performance.md); "
        "the paper's recipe trains in float32"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, auto, ...")
    parser.add_argument("--repeats", type=int, default=15, help="timed passes per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--detectors", nargs="+", default=["vit", "mlp"])
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument("--train-maps", type=int, default=512, help="0 skips training timing")
    parser.add_argument("--val-maps", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3, help="training epochs per timing")
    parser.add_argument(
        "--no-previous-training",
        dest="previous_training",
        action="store_false",
        help="skip the ViT's training path before this version (benchmarks/previous_vit.py)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name}, driver CUDA {torch.version.cuda}"
    else:
        name = f"cpu, bf16 native {bf16_supported(device)}"
    print(
        f"device {device} ({name}), torch {torch.__version__}, {torch.get_num_threads()} CPU "
        f"threads, batch {args.batch_size}, median of {args.repeats}, "
        f"load average {os.getloadavg()}"
    )
    scoring = [
        row
        for d in args.detectors
        for row in bench_scoring(
            d, device, args.batch_size, args.repeats, args.warmup, args.compile
        )
    ]
    print(
        f"\n{'detector':<8} {'variant':<18} {'ms/map':>9} {'maps/s':>10} {'cpu ms/map':>10} "
        f"{'peak MiB':>9}"
    )
    for r in scoring:
        print(
            f"{r['detector']:<8} {r['variant']:<18} {r['ms_per_map']:>9.4f} "
            f"{r['maps_per_s']:>10,.0f} {r['cpu_ms_per_map']:>10.4f} {r['peak_mib']:>9.1f}"
        )

    training = []
    if args.train_maps > 0:
        precisions = ["float32"] + (["bfloat16"] if bf16_supported(device) else [])
        training = [
            bench_training(d, device, args.train_maps, args.val_maps, precision, args.epochs, prev)
            for d in args.detectors
            for precision in precisions
            for prev in ((False, True) if d == "vit" and args.previous_training else (False,))
        ]
        print(
            f"\ntraining: {args.train_maps} synthetic maps + {args.val_maps} validation, "
            f"batch 64, noise + mixup + clip, median of epochs 2-{args.epochs}; float32 is the "
            "paper's recipe, bfloat16 autocast is TrainConfig(precision='bfloat16')"
        )
        print(
            f"{'detector':<8} {'precision':<13} {'s/epoch':>9} {'s per 1k maps':>14} "
            f"{'cpu s per 1k':>13}"
        )
        for r in training:
            print(
                f"{r['detector']:<8} {r['precision']:<13} {r['epoch_s']:>9.2f} "
                f"{r['s_per_1k_maps']:>14.2f} {r['cpu_s_per_1k_maps']:>13.2f}"
            )
        print("paper: < 20 GPU-minutes per seed (80 epochs at most)")
    print_targets(scoring, training, device, torch.get_num_threads())
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": str(device),
                    "device_name": name,
                    "load_average": os.getloadavg(),
                    "scoring": scoring,
                    "training": training,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
