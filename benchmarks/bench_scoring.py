"""Scoring latency, peak memory and training time per epoch of the detectors.

Prints each figure beside the paper's reference (one NVIDIA L40S, Qwen3-8B):
ViT scoring .024 ms per map at batch 256 with 197 MiB peak; training under
20 GPU-minutes per seed. The MLP target is >= 20,000 maps/s on 2 CPU cores.

    python benchmarks/bench_scoring.py --device cuda
    python benchmarks/bench_scoring.py --device cpu --repeats 30 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from actmap.detectors import create_detector
from actmap.training import TrainConfig, resolve_device, train_detector

MAP_SHAPE = (12, 32, 128)
REFERENCE = {
    "vit": "paper: .024 ms/map (41,667 maps/s), 197 MiB peak, L40S",
    "mlp": "target: >= 20,000 maps/s on 2 CPU cores",
    "logreg": "-",
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_kib(field: str) -> int | None:
    """VmRSS / VmHWM of this process from /proc (Linux); None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_cpu_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        return False
    return True


def bench_scoring(name: str, device: torch.device, batch: int, repeats: int, warmup: int) -> dict:
    """Median latency of one batch forward pass in inference mode."""
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        can_peak = _reset_cpu_peak()
        base = _rss_kib("VmRSS")
    model = create_detector(name).to(device).eval()
    x = torch.randn(batch, *MAP_SHAPE, device=device)  # (B, 12, 32, 128)
    times = []
    with torch.inference_mode():
        for _ in range(warmup):
            model(x)
        _sync(device)
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(x)
            _sync(device)
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    if device.type == "cuda":
        peak_mib = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        hwm = _rss_kib("VmHWM")
        peak_mib = (hwm - base) / 1024 if can_peak and hwm and base else float("nan")
    return {
        "detector": name,
        "ms_per_map": 1e3 * median / batch,
        "maps_per_s": batch / median,
        "peak_mib": peak_mib,
    }


def bench_training(name: str, device: torch.device, n_train: int, n_val: int) -> dict:
    """Wall time of one epoch of the paper's recipe (noise, mixup, clip, validation)."""
    g = torch.Generator().manual_seed(0)
    maps = torch.randn((n_train + n_val, *MAP_SHAPE), generator=g).half()
    labels = torch.arange(n_train + n_val) % 2
    cfg = TrainConfig(max_epochs=2, device=str(device))
    torch.manual_seed(0)
    result = train_detector(
        create_detector(name),
        maps[:n_train],
        labels[:n_train],
        maps[n_train:],
        labels[n_train:],
        cfg,
        seed=42,
    )
    epoch_s = result.history[-1].epoch_time_s  # the second epoch, after warm-up effects
    return {"detector": name, "epoch_s": epoch_s, "s_per_1k_maps": 1e3 * epoch_s / n_train}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--repeats", type=int, default=300, help="timed forward passes")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--detectors", nargs="+", default=["vit", "mlp"])
    parser.add_argument("--train-maps", type=int, default=1024, help="0 skips training timing")
    parser.add_argument("--val-maps", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device {device} ({name}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads, batch {args.batch_size}, "
        f"median of {args.repeats}"
    )

    scoring = [
        bench_scoring(d, device, args.batch_size, args.repeats, args.warmup) for d in args.detectors
    ]
    print(f"\n{'detector':<8} {'ms/map':>9} {'maps/s':>10} {'peak MiB':>9}  reference")
    for r in scoring:
        print(
            f"{r['detector']:<8} {r['ms_per_map']:>9.4f} {r['maps_per_s']:>10,.0f} "
            f"{r['peak_mib']:>9.1f}  {REFERENCE.get(r['detector'], '-')}"
        )

    training = []
    if args.train_maps > 0:
        training = [
            bench_training(d, device, args.train_maps, args.val_maps) for d in args.detectors
        ]
        print(
            f"\ntraining: {args.train_maps} synthetic maps + {args.val_maps} validation, "
            "batch 64, noise + mixup + clip"
        )
        print(f"{'detector':<8} {'s/epoch':>9} {'s per 1k maps':>14}  reference")
        for r in training:
            print(
                f"{r['detector']:<8} {r['epoch_s']:>9.2f} {r['s_per_1k_maps']:>14.2f}  "
                "paper: < 20 GPU-minutes per seed (80 epochs at most)"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": str(device),
                    "device_name": name,
                    "scoring": scoring,
                    "training": training,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
