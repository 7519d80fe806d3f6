"""The full preset's signals inside vLLM against map-only capture: one engine, one run.

One in-process vLLM engine (`actmap.capture.vllm_engine.VllmCapture`, grey-box on, eager on
CPU), the same chat prompts (built-in arithmetic questions, greedy, at most ``--max-tokens``
new tokens, SmolLM2 by default, float32), ``c`` requests in flight (a new one added as soon as
one finishes), each request keeping:

* ``map-only``: the pooled states (``actmap``'s needs);
* ``deployable``: + the per-step log-probs and entropies and the position states
  (``actmap-plus:deployable``);
* ``full``: + the lookback attention of K = 10 previous answer tokens, read inside vLLM's
  attention path (``actmap-plus:full``, `actmap.capture.vllm_attention`).

The modes are interleaved ``--repeats`` times; each row is a mode's median run, with the
median over repeats of its run's throughput over the same repeat's map-only run (``paired``)
and of the CPU time per run over map-only's (``CPU``). ``full`` rows also give
``attention_cpu_share``: the CPU time spent in the attention tap (`AttentionTap.record` /
`finish`) over the run's CPU time. Every row gives ``actmap_added_share``: the thread CPU
time of actmap's own code (record points, step planning, the tap, scatter, `actmap_take`,
the rows made `Generation`s) in its run minus map-only's in the same repeat, over the CPU the
run would take without that difference (median over repeats): what the mode adds, measured
directly, so that the machine's speed drifting between runs (identical GEMMs here take 5-12%
longer from one run to the next) does not enter. Target (issue 54, item 3): ``full`` costs at
most +5% over ``map-only``, i.e. throughput ratio full / map-only >= 1 / 1.05 = 0.952
(printed beside each ratio). Record the machine's load with the figures (printed at start
and end); run it alone on the machine:

    OMP_NUM_THREADS=1 python benchmarks/bench_vllm_full_preset.py --concurrency 16,64 \\
        --requests 192 --repeats 4 --modes map-only,full
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import questions  # noqa: E402
from bench_vllm import in_flight  # noqa: E402

TARGET = 1 / 1.05  # full may cost +5% over map-only
MODES = {"map-only": "actmap", "deployable": "actmap-plus:deployable", "full": "actmap-plus:full"}


def timed(owner, names: tuple[str, ...], spent: dict[str, float], depth: list[int]) -> None:
    """Wrap ``owner``'s methods so the thread CPU seconds spent in them accumulate in
    ``spent["seconds"]``; wrappers sharing ``depth`` count only the outermost of nested
    calls."""
    import time

    for name in names:
        original = getattr(owner, name)

        def wrapper(*args, _original=original, **kwargs):
            if depth[0]:
                return _original(*args, **kwargs)
            depth[0] += 1
            tick = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1
                spent["seconds"] += time.thread_time() - tick

        setattr(owner, name, wrapper)


def timed_actmap() -> dict[str, dict[str, float]]:
    """Thread CPU seconds spent in actmap's code inside vLLM's worker, accumulated: the
    attention tap (``tap``: `AttentionTap.record` / `finish`) and all of it (``actmap``: the
    recorder's record points, step planning and ends, scatter, the tap, `actmap_take` and
    the engine's rows made `Generation`s)."""
    from actmap.capture.vllm_attention import AttentionTap
    from actmap.capture.vllm_engine import VllmCapture, _Recorder
    from actmap.capture.vllm_worker import ActmapWorker

    tap, actmap = {"seconds": 0.0}, {"seconds": 0.0}
    timed(AttentionTap, ("record", "finish"), tap, [0])  # inner: counted on its own
    outer = [0]
    timed(_Recorder, ("record", "_begin_step", "_end_step", "scatter"), actmap, outer)
    timed(AttentionTap, ("record",), actmap, outer)  # called by the forward, not the recorder
    timed(ActmapWorker, ("actmap_take",), actmap, outer)
    timed(VllmCapture, ("_rows", "_cut"), actmap, outer)  # the rows made `Generation`s
    return {"tap": tap, "actmap": actmap}


def run(args) -> list[dict]:
    from actmap.capture.needs import CAPTURE_NEEDS
    from actmap.capture.records import CaptureConfig
    from actmap.capture.vllm_engine import VllmCapture, VllmOptions

    widest = max(args.concurrency)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    options = VllmOptions(max_num_seqs=widest, kv_cache_gib=2, enforce_eager=not args.compiled)
    capture = VllmCapture(args.model, args.dtype, options, greybox=True, max_context=2048)
    spent = timed_actmap()
    configs = {
        mode: CaptureConfig(max_new_tokens=args.max_tokens, **CAPTURE_NEEDS[MODES[mode]])
        for mode in args.modes
    }
    chats = [
        capture.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in questions(args.prompts)
    ]
    ids = capture.encode(chats, next(iter(configs.values())))
    rows = []
    for width in args.concurrency:
        n = max(args.requests, width)
        batch = (ids * (n // len(ids) + 1))[:n]
        runs: dict[str, list[dict]] = {mode: [] for mode in configs}
        for config in configs.values():  # warm-up
            in_flight(capture, batch[: min(4, n)], width, args.max_tokens, config=config)
        for _ in range(args.repeats):
            for mode, config in configs.items():
                tap, own = spent["tap"]["seconds"], spent["actmap"]["seconds"]
                result = in_flight(capture, batch, width, args.max_tokens, config=config)
                result["attention_cpu_share"] = round(
                    (spent["tap"]["seconds"] - tap) / result["cpu_s"], 4
                )
                result["actmap_cpu_s"] = round(spent["actmap"]["seconds"] - own, 3)
                runs[mode].append(result)
        median = {}
        for mode, results in runs.items():
            median[mode] = sorted(results, key=lambda r: r["req_per_s"])[len(results) // 2]
            row = {"mode": mode, "concurrency": width, **median[mode]}
            row["all_req_per_s"] = [r["req_per_s"] for r in results]
            rows.append(row)
        first = "map-only" if "map-only" in runs else args.modes[0]
        base = median[first]["req_per_s"]
        for row in rows[-len(configs) :]:
            row["ratio_vs_map_only"] = round(row["req_per_s"] / base, 3)
            # each repeat's run over the same repeat's map-only run (slow drifts of the
            # machine's speed cancel), throughput and CPU time per request
            mine, theirs = runs[row["mode"]], runs[first]
            paired = sorted(
                a["req_per_s"] / b["req_per_s"] for a, b in zip(mine, theirs, strict=True)
            )
            cpu = sorted(a["cpu_s"] / b["cpu_s"] for a, b in zip(mine, theirs, strict=True))
            row["paired_ratios"] = [round(r, 3) for r in paired]
            row["paired_ratio_median"] = round(paired[len(paired) // 2], 3)
            row["cpu_ratio_median"] = round(cpu[len(cpu) // 2], 3)
            # what this mode's own code adds, as a share of the CPU the run would take
            # without it: actmap's CPU in this run over map-only's in the same repeat, both
            # measured, so the machine's drift between runs does not enter
            added = sorted(
                (a["actmap_cpu_s"] - b["actmap_cpu_s"])
                / (a["cpu_s"] - a["actmap_cpu_s"] + b["actmap_cpu_s"])
                for a, b in zip(mine, theirs, strict=True)
            )
            row["actmap_added_share"] = round(added[len(added) // 2], 4)
    capture.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency")
    parser.add_argument("--prompts", type=int, default=64, help="distinct questions")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per mode")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"which of {', '.join(MODES)} to run"
    )
    parser.add_argument("--compiled", action="store_true", help="vLLM's compiled model")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    print(f"load at start: {os.getloadavg()}", flush=True)
    rows = run(args)
    print(f"load at end: {os.getloadavg()}")
    for row in rows:
        ratio = row["ratio_vs_map_only"]
        mark = f"  (target >= {TARGET:.3f}: {'met' if ratio >= TARGET else 'NOT met'})"
        print(
            f"c={row['concurrency']:>3} {row['mode']:<10} {row['req_per_s']:8.3f} req/s "
            f"{row['tokens_per_s']:9.2f} tok/s  p50 {row['p50_s']}s  cpu {row['cpu_s']}s  "
            f"x{ratio:.3f} of map-only (paired median x{row['paired_ratio_median']:.3f}, "
            f"CPU x{row['cpu_ratio_median']:.3f}; actmap's own code adds "
            f"{row['actmap_added_share']:+.1%})"
            + (
                f"{mark}; attention tap {row['attention_cpu_share']:.1%} of CPU"
                if row["mode"] == "full"
                else ""
            )
        )
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
