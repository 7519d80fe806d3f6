"""Capture overhead: map-only and grey-box capture vs plain generation, interleaved repeats.

    PYTHONPATH=src python benchmarks/bench_capture.py [--batch 32] [--repeats 5] [--threads 2]

One batch of the built-in task's prompts, the same settings for every variant:
`plain` (`generate` without hooks), `map-only` (layer hooks and pooling, nothing
per step over the vocabulary) and `greybox` (also the per-step log-softmax and
entropy). Each repeat runs the three in turn (the order rotates), so a slow
moment of a shared machine touches all of them. Prints the median over repeats
of each hooked/plain time ratio beside the issue's reference and target, and
asserts that every variant generates the same tokens.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from actmap.capture import CaptureConfig
from actmap.capture.generate import generate_batch, generate_plain
from actmap.data.builtin import BuiltinArithmeticTask
from actmap.models import load_model

REFERENCE = {  # quiet 2-core machine, SmolLM2 batch 32, before map-only capture existed
    "map-only": "now +3.8% (all statistics on) -> target <= +1%",
    "greybox": "now +3.8% -> target <= +2%",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--attention-keys", type=int, default=0, help="Also keep RAUQ/TAD attention (eager)."
    )
    parser.add_argument("--keep-dense", action="store_true", help="Also keep ACT-ViT's states.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, source = load_model(args.model, device=args.device)
    task = BuiltinArithmeticTask(n_questions=args.batch)
    prompts = [task.prompt(e, tokenizer) for e in task.load_all()][: args.batch]
    common = dict(
        max_new_tokens=args.new_tokens,
        batch_size=args.batch,
        attention_keys=args.attention_keys,
        keep_dense=args.keep_dense,
    )
    configs = {
        "map-only": CaptureConfig(**common, greybox=False),
        "greybox": CaptureConfig(**common, greybox=True),
    }

    def plain():
        return generate_plain(model, tokenizer, prompts, configs["greybox"])

    runs = {"plain": plain}
    runs.update(
        {
            name: (lambda c=config: generate_batch(model, tokenizer, prompts, c))
            for name, config in configs.items()
        }
    )
    for run in runs.values():
        run()  # warm-up, excluded
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    identical = True
    names = list(runs)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            tick = time.perf_counter()
            result = runs[name]()
            seconds[name].append(time.perf_counter() - tick)
            if name == "plain":
                reference = result
            else:
                start = reference.shape[1] - args.new_tokens  # the left-padded prompt width
                for row, record in enumerate(result):
                    got = reference[row, start : start + record.n_tokens].tolist()
                    identical &= record.token_ids == got
    print(
        f"model {source.name} on {args.device} ({platform.processor() or platform.machine()}, "
        f"{args.threads} threads), torch {torch.__version__}, load average {os.getloadavg()}"
    )
    print(
        f"batch {len(prompts)}, {args.new_tokens} new tokens, {args.repeats} interleaved "
        f"repeats, attention keys {args.attention_keys}, dense {args.keep_dense}"
    )
    for name in runs:
        print(f"{name:>9} s/batch: {' '.join(f'{t:.2f}' for t in seconds[name])}")
    for name in configs:
        ratios = [h / p for h, p in zip(seconds[name], seconds["plain"], strict=True)]
        ratio = statistics.median(ratios)
        print(
            f"{name:>9}: median hooked/plain = {ratio:.4f} -> overhead {100 * (ratio - 1):+.2f}%"
            f"  ({REFERENCE[name]})"
        )
    print(f"identical tokens: {identical}")
    if not identical:
        raise SystemExit("capture changed the generated tokens")


if __name__ == "__main__":
    main()
