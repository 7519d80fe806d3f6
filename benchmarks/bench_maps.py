"""Throughput of the map operator Phi on the CPU: maps per second, batched vs one map at a time.

Reference target: 2,000 maps/s for T = 32 tokens, L = 30 layers on 2 cores.

    PYTHONPATH=src python benchmarks/bench_maps.py [--threads 2] [--batch 256] [--repeats 2]

Prints one row per (T, L), in maps per second of wall-clock time: `build_maps`
on a batch of full-length answers (and per second of process CPU time summed
over threads, a figure that other processes on a shared machine disturb less),
the same batch with mixed lengths (uniform in 1..T, right-padded), and a loop
of `build_map` over single trajectories ("x" = batched / looped). Trajectories
are random (L, T, 128) float32. Large (T, L) use a smaller batch so the input
stays under `--max-batch-mib`. The machine's load average is printed too: on a shared
machine other processes slow every figure down (with several threads, setting
OMP_WAIT_POLICY=PASSIVE avoids threads spinning on a busy core).
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import torch

from actmap.maps import build_map, build_maps

REFERENCE = {(32, 30): 2000.0}  # maps/s, 2 cores


def build_each(trajectories: list[torch.Tensor]) -> None:
    for trajectory in trajectories:
        build_map(trajectory)


def best_seconds(fn, repeats: int) -> tuple[float, float]:
    """Best wall-clock seconds and best process CPU seconds (all threads) of `fn`."""
    fn()  # warm-up
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--looped", type=int, default=16, help="answers in the build_map loop")
    parser.add_argument("--max-batch-mib", type=int, default=256)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128, 384])
    parser.add_argument("--layers", type=int, nargs="+", default=[18, 30, 64])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)

    print(f"torch {torch.__version__}, {args.threads} threads, load average {os.getloadavg()}")
    header = (
        f"{'T':>4} {'L':>3} {'B':>4} | {'batched':>8} {'per-cpu-s':>9} {'mixed':>8} "
        f"{'looped':>8} {'x':>5}"
    )
    print(header + " | reference (maps/s, 2 cores)")
    print("-" * (len(header) + 30))
    for n_tokens in args.tokens:
        for n_layers in args.layers:
            per_answer = n_layers * n_tokens * 128 * 4
            batch = max(1, min(args.batch, args.max_batch_mib * 2**20 // per_answer))
            x = torch.randn(batch, n_layers, n_tokens, 128, generator=generator)
            full = torch.full((batch,), n_tokens)
            mixed = torch.randint(1, n_tokens + 1, (batch,), generator=generator)
            wall, cpu = best_seconds(partial(build_maps, x, full), args.repeats)
            batched, per_cpu = batch / wall, batch / cpu
            ragged = batch / best_seconds(partial(build_maps, x, mixed), args.repeats)[0]
            singles = list(x[: args.looped])
            looped = best_seconds(partial(build_each, singles), args.repeats)[0]
            one_by_one = len(singles) / looped
            reference = REFERENCE.get((n_tokens, n_layers))
            note = f"{reference:,.0f}" if reference else ""
            print(
                f"{n_tokens:>4} {n_layers:>3} {batch:>4} | {batched:>8,.0f} {per_cpu:>9,.0f} "
                f"{ragged:>8,.0f} "
                f"{one_by_one:>8,.0f} {batched / one_by_one:>5.1f} | {note}",
                flush=True,
            )
            del x


if __name__ == "__main__":
    main()
