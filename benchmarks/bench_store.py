"""Store write/read throughput and bytes per map (metadata included).

.venv/bin/python benchmarks/bench_store.py [--rows 2048] [--shard 256]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from actmap.store import MAP_BYTES, MapRecord, MapStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--shard", type=int, default=256)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    maps = rng.standard_normal((args.shard, 12, 32, 128)).astype(np.float32)
    with tempfile.TemporaryDirectory() as folder:
        store = MapStore.create(Path(folder), {"bench": True})
        tick = time.perf_counter()
        for start in range(0, args.rows, args.shard):
            store.write_maps(
                [
                    MapRecord(
                        f"b:{start + i}",
                        str(start + i),
                        "bench",
                        "test",
                        "m",
                        "r",
                        "What is 7 times 8? Reply with just the number.",
                        "56",
                        3,
                        1,
                        maps[i],
                    )
                    for i in range(min(args.shard, args.rows - start))
                ]
            )
        write_s = time.perf_counter() - tick
        tick = time.perf_counter()
        n = sum(batch.shape[0] for batch, _ in store.iter_maps(batch_size=256))
        read_s = time.perf_counter() - tick
        size = sum(p.stat().st_size for p in (Path(folder) / "maps").glob("*.parquet"))
    print(f"write {args.rows / write_s:,.0f} maps/s, stream-read {n / read_s:,.0f} maps/s")
    print(
        f"bytes per stored map incl. metadata: {size / args.rows:,.0f} "
        f"(map alone {MAP_BYTES:,}; target <= 98,304 = 96 KiB)"
    )


if __name__ == "__main__":
    main()
