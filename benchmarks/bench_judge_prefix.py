"""The same-answer judge with and without its question-prefix cache, on one question's pairs.

    .venv/bin/python benchmarks/bench_judge_prefix.py                     # the 1.5B, bfloat16
    .venv/bin/python benchmarks/bench_judge_prefix.py --judge qwen2.5-coder-0.5b-instruct

Semantic Entropy asks the judge about many pairs of one question's sampled answers; every such
prompt is the same up to "Answer 1:". Timed in one run, 1 thread: each pair's prompt as one
full forward pass (the reference) and `SameAnswerJudge.margin` (the prefix once, then only each
pair's rest). Prints seconds per pair, the speedup, the largest margin difference and how many
verdicts (the margin's sign) agree. The load average is printed: other jobs slow both.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import torch

from actmap.baselines.entailment import load_llm_judge

QUESTION = "Which planet in our solar system has the most moons?"
ANSWERS = ["Saturn", "Jupiter", "saturn", "Uranus", "The planet Saturn", "Neptune", "Jupiter's"]


def full_pass_margin(judge, a: str, b: str) -> float:
    with torch.no_grad():
        logits = judge.model(**judge._encode(judge.render(a, b, QUESTION))).logits[0, -1]
    logp = torch.log_softmax(logits.float(), -1)
    return float(torch.logsumexp(logp[judge.yes_ids], 0) - torch.logsumexp(logp[judge.no_ids], 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--judge", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--pairs", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    judge = load_llm_judge(args.judge, dtype=args.dtype, prompt="same_answer")
    pairs = list(itertools.permutations(ANSWERS, 2))[: args.pairs]
    timed = {}
    for name, margin in (
        ("full pass", lambda a, b: full_pass_margin(judge, a, b)),
        ("prefix cache", lambda a, b: judge.margin(a, b, QUESTION)),
    ):
        start = time.perf_counter()
        timed[name] = ([margin(a, b) for a, b in pairs], (time.perf_counter() - start) / len(pairs))
    (full, t_full), (cached, t_cached) = timed["full pass"], timed["prefix cache"]
    tokens = len(judge._encode(judge.render(*pairs[0], QUESTION))["input_ids"][0])
    print(
        f"{judge.name}, {len(pairs)} pairs of one question, {tokens}-token prompts, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"full pass    {t_full:.3f} s/pair (reference)")
    print(f"prefix cache {t_cached:.3f} s/pair ({t_full / t_cached:.2f}x)")
    diff = max(abs(a - b) for a, b in zip(full, cached, strict=True))
    agree = sum((a > 0) == (b > 0) for a, b in zip(full, cached, strict=True))
    print(f"largest margin difference {diff:.4f} nats; verdicts agree on {agree}/{len(pairs)}")


if __name__ == "__main__":
    main()
