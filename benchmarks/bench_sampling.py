"""Sampled answers: one shared prompt pass against N prompt copies, and the fused top-k/top-p
step against transformers' two warpers, on a store's prompts.

    .venv/bin/python benchmarks/bench_sampling.py --store stores/qwen-1.5b-triviaqa-bf16
    .venv/bin/python benchmarks/bench_sampling.py --store stores/smollm2-gsm8k --prompts 4
    .venv/bin/python benchmarks/bench_sampling.py --store stores/gemma3-builtin --compare warpers

EigenScore and Semantic Entropy draw N = 10 answers per prompt. ``--compare prompt`` (the
default): ``sample_answers`` runs the prompt once and copies its key/value cache to the N rows;
``num_return_sequences=N`` runs the prompt N times. ``--compare warpers``: `TopKTopP` sorts
the k = 50 kept scores each step; transformers' top-p warper sorts the whole vocabulary. Timed
in one run, 1 thread, on the store's first prompts with the store's generator and dtype,
alternating the two paths: seconds per prompt, the speedup, and how many of the N x prompts
answers are the same under one seed (each pair of paths sees the same distribution; in bfloat16
a logit can round differently, and tied scores can break either way, so a few answers may
differ). The load average is printed: other jobs slow both paths.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from actmap.baselines import sampling
from actmap.llm.models import load_model, stored_dtype
from actmap.store import MapStore


def prompt_copies(model, encoded: dict, n: int) -> tuple[dict, dict]:
    """The reference: ``generate`` expands the batch to N copies of every prompt."""
    return {**encoded, "num_return_sequences": n}, {}


def transformers_warpers(config) -> dict:
    """The reference: ``generate``'s own top-k and top-p warpers."""
    return {"top_p": config.top_p, "top_k": config.top_k}


# --compare: (the sampling function the reference replaces, the reference, the two labels)
COMPARISONS = {
    "prompt": ("_shared_prompt", prompt_copies, "N prompt copies", "shared prompt pass"),
    "warpers": ("_warpers", transformers_warpers, "transformers' warpers", "TopKTopP"),
}


def timed(model, tokenizer, prompts: list[str], seed: int) -> tuple[list, float]:
    start = time.perf_counter()
    sets = [sampling.sample_answers(model, tokenizer, [p], seed=seed)[0] for p in prompts]
    return sets, (time.perf_counter() - start) / len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="a store whose prompts and generator to use")
    parser.add_argument("--model", default=None, help="the generator (default: the store's)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="prompt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = MapStore.open(args.store)
    config = store.manifest.get("config", {})
    name = args.model or config["model"]["name"]
    revision = config["model"].get("revision") or "main"
    model, tokenizer, _ = load_model(name, revision, "cpu", stored_dtype(config))
    prompts = list(store.metadata()["prompt"][: args.prompts])
    attribute, reference, old_label, new_label = COMPARISONS[args.compare]
    current = getattr(sampling, attribute)
    totals = {"old": 0.0, "new": 0.0}
    same = total = 0
    for prompt in prompts:  # alternate, so a change in load hits both paths alike
        setattr(sampling, attribute, reference)
        (old,), t_old = timed(model, tokenizer, [prompt], args.seed)
        setattr(sampling, attribute, current)
        (new,), t_new = timed(model, tokenizer, [prompt], args.seed)
        totals["old"] += t_old / len(prompts)
        totals["new"] += t_new / len(prompts)
        same += sum(a == b for a, b in zip(old.token_ids, new.token_ids, strict=True))
        total += old.n_samples
    tokens = [len(tokenizer(p)["input_ids"]) for p in prompts]
    print(
        f"{name} ({stored_dtype(config)}), {len(prompts)} prompts of {min(tokens)}-{max(tokens)} "
        f"tokens, N = {sampling.N_SAMPLES}, load average {os.getloadavg()[0]:.1f}"
    )
    width = max(len(old_label), len(new_label))
    print(f"{old_label:<{width}} {totals['old']:.2f} s/prompt (reference)")
    print(
        f"{new_label:<{width}} {totals['new']:.2f} s/prompt ({totals['old'] / totals['new']:.2f}x)"
    )
    print(f"same answers under one seed: {same}/{total}")


if __name__ == "__main__":
    main()
