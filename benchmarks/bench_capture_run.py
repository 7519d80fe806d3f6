"""End-to-end `actmap capture` rows/s against plain `generate` on the same prompts and settings.

    PYTHONPATH=src python benchmarks/bench_capture_run.py [--task builtin] [--rows 64] [--batch 32]
    PYTHONPATH=src python benchmarks/bench_capture_run.py --task gsm8k --rows 32 --compare-prefix

`capture` is `actmap.capture.run.run_capture` into a fresh store: tokenisation,
generation with the hooks, maps, labels and the store writes, as `actmap
capture` runs them (batches sorted by prompt length, the shared-prefix cache at
the CLI's default). `plain` tokenises and generates the same prompts in the same
batches with no hooks and decodes the answers. Repeats alternate between the
variants. Prints rows/s of each and the median ratio capture/plain beside the
target (>= 0.9). `--compare-prefix` adds a capture with the prefix cache off
(the few-shot tasks share their few-shot block); `--no-sort` captures in task
order.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from actmap.capture import CaptureConfig
from actmap.capture.generate import generate_plain
from actmap.capture.run import order_by_prompt_length, run_capture, store_config
from actmap.capture.job import AUTO_SHARE_PREFIX  # `actmap capture`'s default for a new store
from actmap.data import get_task
from actmap.llm.models import load_model
from actmap.maps import MapConfig
from actmap.store import MapStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--task", default="builtin", help="builtin | gsm8k | triviaqa | nq_open")
    parser.add_argument("--split", default="test")
    parser.add_argument("--rows", type=int, default=64, help="prompts per repeat")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: the task's")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--share-prefix", type=int, default=AUTO_SHARE_PREFIX)
    parser.add_argument("--compare-prefix", action="store_true")
    parser.add_argument("--no-sort", action="store_true")
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, source = load_model(args.model)
    if args.task == "builtin":
        task = get_task("builtin", n_questions=max(args.rows, 40))
        examples = task.load_all()[: args.rows]
    else:
        task = get_task(args.task, data_dir=args.data_dir)
        examples = task.load(args.split, args.rows)
    config = CaptureConfig(
        max_new_tokens=args.new_tokens or task.max_new_tokens,
        batch_size=args.batch,
        stop_strings=tuple(getattr(task, "stop_strings", ())),
        share_prefix=args.share_prefix,
    )
    sort = not args.no_sort
    prompts = [task.prompt(e, tokenizer) for e in examples]
    order = order_by_prompt_length(prompts, tokenizer) if sort else list(range(len(prompts)))

    def plain(cfg: CaptureConfig) -> None:
        for start in range(0, len(order), cfg.batch_size):
            batch = [prompts[i] for i in order[start : start + cfg.batch_size]]
            sequences = generate_plain(model, tokenizer, batch, cfg)
            tokenizer.batch_decode(sequences[:, -cfg.max_new_tokens :], skip_special_tokens=True)

    def capture(cfg: CaptureConfig) -> None:
        with tempfile.TemporaryDirectory() as folder:
            store = MapStore.create(
                Path(folder) / "store", store_config(task, source, cfg, MapConfig(), {})
            )
            run_capture(model, tokenizer, source, task, examples, store, cfg, sort_by_length=sort)

    variants = {"plain": lambda: plain(config), "capture": lambda: capture(config)}
    if args.compare_prefix:
        variants["capture, no prefix cache"] = lambda: capture(replace(config, share_prefix=0))
    plain(replace(config, batch_size=min(args.batch, 4)))  # warm-up, excluded
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            tick = time.perf_counter()
            variants[name]()
            seconds[name].append(time.perf_counter() - tick)
    print(
        f"model {source.name}, task {task.name} ({len(examples)} prompts, batch {args.batch}, "
        f"{config.max_new_tokens} new tokens, sorted {sort}, share_prefix {config.share_prefix}), "
        f"{args.threads} threads, torch {torch.__version__}, load average {os.getloadavg()}"
    )
    for name in variants:
        rates = [len(examples) / s for s in seconds[name]]
        print(f"{name:>24}: rows/s {' '.join(f'{r:.2f}' for r in rates)}")
    for name in names[1:]:
        ratio = statistics.median(
            p / c for c, p in zip(seconds[name], seconds["plain"], strict=True)
        )
        print(f"{name:>24} / plain rows/s = {ratio:.3f}  (now: not measured; target >= 0.9)")


if __name__ == "__main__":
    main()
