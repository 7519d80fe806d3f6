"""The CNN/DailyMail factuality judge per article: the vocabulary projection of the last
position only (``logits_to_keep=1``, what `PrefixCache` runs) against every position's.

    .venv/bin/python benchmarks/bench_factuality_judge.py                  # the 1.5B, bfloat16
    .venv/bin/python benchmarks/bench_factuality_judge.py --judge qwen2.5-coder-0.5b-instruct

The judge reads one article (a few hundred to a few thousand tokens) once per summary and
then each claim on top of its key/value cache; only the last position's logits are read. With
every position projected, a 1.5B judge's 151,936-word output layer runs over the whole article.
Timed in one run, 1 thread, alternating the two paths on the first CNN/DM validation articles,
each with its own first highlight sentence as the claim and a fresh article pass per path:
seconds per article, the speedup and the largest difference in support probability. The load
average is printed: other jobs slow both paths.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import torch

from actmap.data.datasets import load_cnn_dm
from actmap.data.factuality import LLMFactualityJudge


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--judge", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--articles", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = subprocess.run(
        ["../shared/models/get-model", args.judge], capture_output=True, text=True, check=True
    ).stdout.strip()
    judge = LLMFactualityJudge.from_pretrained(path, dtype=args.dtype)
    rows = [r for r in load_cnn_dm(None) if r.meta.get("source_split") == "validation"]
    rows = rows[: args.articles]
    model, last_only = judge.model, judge.model.forward

    def every_position(*a, **kwargs):  # the reference: logits for the whole article
        kwargs.pop("logits_to_keep", None)
        return last_only(*a, **kwargs)

    seconds = {"every": 0.0, "last": 0.0}
    largest = 0.0
    for row in rows:  # alternate, so a change in load hits both paths alike
        claim = row.references[0].split("\n")[0]
        support = {}
        for name, forward in (("every", every_position), ("last", last_only)):
            model.forward = forward
            judge._prefix._prefix, judge._cache = None, {}  # a fresh article pass
            start = time.perf_counter()
            support[name] = judge.support_probability(row.question, claim)
            seconds[name] += time.perf_counter() - start
        largest = max(largest, abs(support["every"] - support["last"]))
    model.forward = last_only
    n = len(rows)
    print(f"{args.judge} ({args.dtype}), {n} articles, load average {os.getloadavg()[0]:.1f}")
    print(f"every position's logits {seconds['every'] / n:.2f} s/article (reference)")
    print(
        f"last position's logits  {seconds['last'] / n:.2f} s/article "
        f"({seconds['every'] / seconds['last']:.2f}x)"
    )
    print(f"largest support difference {largest:.1e}")


if __name__ == "__main__":
    main()
