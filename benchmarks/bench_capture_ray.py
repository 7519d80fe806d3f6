"""`actmap capture --engine ray` with 1 and 2 local workers against the local engine.

    PYTHONPATH=src python benchmarks/bench_capture_ray.py [--questions 256] [--batch 32]

Each variant runs the CLI, as a user would, into a fresh store on the built-in
task with the embedded SmolLM2 (map-only capture), one CPU thread per model
replica (the local engine too). Prints, per variant, the command's wall time
(start-up, Ray's actors and model loads included), the capture's rows/s from
the store's run log, and the speed-up over the 1-worker Ray run, beside the
ideal (2.0 for 2 workers). The load average before and after is printed: on a
shared machine the figures are only as good as the quiet it had.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(args: list[str], out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "actmap.cli", "capture", "--out", str(out), *args]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    log = json.loads((out / "manifest.json").read_text())["runs"][-1]
    return {"wall_s": wall, "rows": log["written"], "capture_s": log["wall_time_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    opts = parser.parse_args()
    common = [
        "--task", "builtin", "--builtin-questions", str(opts.questions), "--model", opts.model,
        "--batch-size", str(opts.batch), "--methods", "actmap",
    ]  # fmt: skip
    variants = {
        "local": [],
        "ray, 1 worker": ["--engine", "ray", "--workers", "1"],
        "ray, 2 workers": ["--engine", "ray", "--workers", "2"],
    }
    print(f"load average before: {os.getloadavg()}, {os.cpu_count()} CPUs")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in variants.items():
            results[name] = run(common + extra, Path(tmp) / name.replace(" ", "").replace(",", "-"))
            r = results[name]
            print(
                f"{name:15s} {r['rows']} rows: command {r['wall_s']:.1f} s, capture "
                f"{r['capture_s']:.1f} s = {r['rows'] / r['capture_s']:.2f} rows/s",
                flush=True,
            )
    one, two = results["ray, 1 worker"], results["ray, 2 workers"]
    print(
        f"speed-up of 2 workers over 1: {one['capture_s'] / two['capture_s']:.2f} "
        f"(ideal 2.00); command wall {one['wall_s'] / two['wall_s']:.2f}"
    )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
