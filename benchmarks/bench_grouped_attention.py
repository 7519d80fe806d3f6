"""Capture with attention weights: transformers' eager attention against the grouped one.

    .venv/bin/python benchmarks/bench_grouped_attention.py                  # SmolLM2, 900-token prompts
    .venv/bin/python benchmarks/bench_grouped_attention.py --model qwen2.5-coder-0.5b-instruct \
        --dtype bfloat16 --prompt-tokens 300

RAUQ and TAD read attention weights, which only eager attention returns; for a grouped-query
model eager attention copies the whole key/value cache to the query heads' count at every
token. Timed in one run, 1 thread, alternating: `generate_batch` with `attention_keys=10` on the
grouped eager attention (`actmap.capture.attention`) and on transformers' eager attention (the
reference). Long prompts stand for CNN/DailyMail articles. Prints seconds per batch, the
speedup and the largest difference of the captured maps and attention weights; the load
average is printed, since other jobs slow both.
"""

from __future__ import annotations

import argparse
import os
import time
from unittest import mock

import torch

from actmap.capture import attention
from actmap.capture.generate import generate_batch
from actmap.capture.records import CaptureConfig
from actmap.llm.models import load_model

WORDS = (
    "the council said on tuesday that the new bridge over the river would open next spring".split()
)


def prompts(tokenizer, n: int, tokens: int) -> list[str]:
    """n different prompts of about ``tokens`` tokens each (a shifted word cycle per row)."""
    out = []
    for i in range(n):
        words = [WORDS[(i + j) % len(WORDS)] for j in range(tokens)]
        text = " ".join(words)
        ids = tokenizer(text)["input_ids"][:tokens]
        out.append(tokenizer.decode(ids) + "\nSummary:")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=900)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer, _ = load_model(args.model, dtype=args.dtype)
    config = CaptureConfig(
        max_new_tokens=args.new_tokens,
        attention_keys=10,
        batch_size=args.batch,
        max_context=args.prompt_tokens + args.new_tokens + 16,
    )
    batch = prompts(tokenizer, args.batch, args.prompt_tokens)
    grouped = attention.weights_implementation(model)
    if grouped == "eager":
        raise SystemExit(
            f"{args.model} is not a grouped-query model of {attention.GROUPED_FAMILIES}"
        )
    times: dict[str, list[float]] = {"eager": [], "grouped": []}
    results = {}
    for _ in range(args.repeats):
        for name in ("eager", "grouped"):
            families = frozenset() if name == "eager" else attention.GROUPED_FAMILIES
            with mock.patch.object(attention, "GROUPED_FAMILIES", families):
                start = time.perf_counter()
                results[name] = generate_batch(model, tokenizer, batch, config)
                times[name].append(time.perf_counter() - start)
    eager, ours = min(times["eager"]), min(times["grouped"])
    text = model.config
    print(
        f"{args.model} ({args.dtype}): {text.num_attention_heads} query / "
        f"{text.num_key_value_heads} key-value heads; batch {args.batch} x {args.prompt_tokens} "
        f"prompt tokens, {args.new_tokens} new; best of {args.repeats}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"eager (reference) {eager:.2f} s/batch")
    print(f"grouped           {ours:.2f} s/batch ({eager / ours:.2f}x)")
    pairs = list(zip(results["eager"], results["grouped"], strict=True))
    same = [(a, b) for a, b in pairs if a.token_ids == b.token_ids]
    print(
        f"same answer tokens on {len(same)}/{len(pairs)} rows (a fused kernel rounds otherwise: a near tie can flip)"
    )
    if same:
        maps = max(float((a.trajectory - b.trajectory).abs().max()) for a, b in same)
        att = max(float((a.attention - b.attention).abs().max()) for a, b in same)
        print(f"on those rows: largest state difference {maps:.2e}, attention {att:.2e}")


if __name__ == "__main__":
    main()
