"""Throughput of the map operator Phi on the CPU: the fused operator vs the previous one vs a loop.

    PYTHONPATH=src python benchmarks/bench_maps.py [--threads 2] [--batch 256] [--repeats 5]
    git show COMMIT:src/actmap/maps.py > /tmp/maps_then.py   # any other version, timed beside
    PYTHONPATH=src python benchmarks/bench_maps.py --also /tmp/maps_then.py

One row per (T, L) (default T = 32, L = 30, the issue's reference point), in
maps per second of wall-clock time, every variant timed in the same run with
interleaved repeats (best of `--repeats`):

- `fused`: `actmap.maps.build_maps` on a batch of full-length answers, fresh output;
- `fused+out`: the same into a reused output buffer (`out=`), as a streaming caller does;
- `mixed`: `build_maps` on answers of mixed lengths (uniform in 1..T, right-padded);
- `previous`: the operator before this version (`benchmarks/previous_maps.py`);
- `looped`: `build_map` on one trajectory at a time (`--looped` answers);
- `also`, `also mixed` (with `--also FILE`): another version's `build_maps` (a
  copy of `src/actmap/maps.py` from any commit) into the reused buffer, and on
  the mixed lengths; `x also` is fused+out / also.

`cpu` is `fused` per second of process CPU time (all threads), which other
processes on a shared machine disturb less. Trajectories are random (L, T, 128)
float32. The machine's load average is printed: on a shared machine every
figure is slower.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from functools import partial

import torch
from previous_maps import build_maps as previous_build_maps

from actmap.maps import build_map, build_maps

NOW = {(32, 30): 1328.0}  # previous operator, quiet 2-core machine, maps/s
TARGET = {(32, 30): 5000.0}


def build_each(trajectories: list[torch.Tensor]) -> None:
    for trajectory in trajectories:
        build_map(trajectory)


def load_operator(path: str):
    """`build_maps` of another version of the operator module, loaded from a file."""
    spec = importlib.util.spec_from_file_location("maps_also", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["maps_also"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.build_maps


def interleaved_best(variants: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """Best (wall, process CPU) seconds of each variant, repeats interleaved across variants."""
    for fn in variants.values():
        fn()  # warm-up
    best = {name: (float("inf"), float("inf")) for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--looped", type=int, default=16, help="answers in the build_map loop")
    parser.add_argument("--max-batch-mib", type=int, default=256)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32])
    parser.add_argument("--layers", type=int, nargs="+", default=[30])
    parser.add_argument("--also", default=None, help="another maps.py to time beside")
    args = parser.parse_args()
    also = load_operator(args.also) if args.also else None
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)

    print(f"torch {torch.__version__}, {args.threads} threads, load average {os.getloadavg()}")
    names = ("fused", "fused+out", "mixed", "previous", "looped")
    if also is not None:
        names += ("also", "also mixed")
    header = f"{'T':>4} {'L':>3} {'B':>4} | " + " ".join(f"{n:>9}" for n in names)
    extra = f" {'x also':>6}" if also is not None else ""
    print(header + f" {'cpu':>7} {'x prev':>6}{extra} | now (quiet) -> target, maps/s")
    print("-" * (len(header) + 45))
    for n_tokens in args.tokens:
        for n_layers in args.layers:
            per_answer = n_layers * n_tokens * 128 * 4
            batch = max(1, min(args.batch, args.max_batch_mib * 2**20 // per_answer))
            x = torch.randn(batch, n_layers, n_tokens, 128, generator=generator)
            full = torch.full((batch,), n_tokens)
            mixed = torch.randint(1, n_tokens + 1, (batch,), generator=generator)
            out = torch.empty(batch, 12, 32, 128)
            singles = list(x[: args.looped])
            variants = {
                "fused": partial(build_maps, x, full),
                "fused+out": partial(build_maps, x, full, out=out),
                "mixed": partial(build_maps, x, mixed),
                "previous": partial(previous_build_maps, x, full),
                "looped": partial(build_each, singles),
            }
            if also is not None:
                variants["also"] = partial(also, x, full, out=out)
                variants["also mixed"] = partial(also, x, mixed)
            best = interleaved_best(variants, args.repeats)
            rate = {k: (len(singles) if k == "looped" else batch) / v[0] for k, v in best.items()}
            cpu = batch / best["fused"][1]
            key = (n_tokens, n_layers)
            note = f"{NOW[key]:,.0f} -> >= {TARGET[key]:,.0f}" if key in NOW else ""
            print(
                f"{n_tokens:>4} {n_layers:>3} {batch:>4} | "
                + " ".join(f"{rate[n]:>9,.0f}" for n in names)
                + f" {cpu:>7,.0f} {rate['fused'] / rate['previous']:>6.2f}"
                + (f" {rate['fused+out'] / rate['also']:>6.2f}" if also is not None else "")
                + f" | {note}",
                flush=True,
            )
            del x


if __name__ == "__main__":
    main()
