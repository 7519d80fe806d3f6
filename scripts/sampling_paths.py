"""Do a store's stored sampled answers depend on the sampling path that drew them?

Two speed-ups changed how `sample_answers` draws (docs/baselines-sampling.md): the prompt
runs once and its cache is copied to the N rows (instead of N prompt copies through
``num_return_sequences``), and top-k then top-p run as one step (`TopKTopP`) instead of
transformers' two warpers. This draws every test row of a store again, with the same
per-row seeds and sampling request as its ``samples`` table, through an older path, and
prints how many rows drew other answers and EigenScore's test AUROC from the stored samples
and from the new draws:

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python scripts/sampling_paths.py \
        runs/reproduce-full/stores/qwen-0.5b-nq_open-bf16 --path copies-warpers

``--path current`` (the library as it is; a check that draws repeat), ``warpers``
(transformers' warpers, shared prompt pass) or ``copies-warpers`` (N prompt copies and
transformers' warpers: the path before both speed-ups).
"""

from __future__ import annotations

import argparse

from sklearn.metrics import roc_auc_score

from actmap.baselines import sampling
from actmap.baselines.eigenscore import EigenScore
from actmap.baselines.inputs import StoreInputs
from actmap.baselines.options import BaselineOptions
from actmap.baselines.samples_table import read_samples, row_seed, sampling_request
from actmap.store import MapStore
from actmap.store.rows import balanced_splits


def transformers_warpers(config) -> dict:
    return {"top_p": config.top_p, "top_k": config.top_k}


def prompt_copies(model, encoded: dict, n: int) -> tuple[dict, dict]:
    return {**encoded, "num_return_sequences": n}, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", help="a store whose test rows have sampled answers")
    parser.add_argument(
        "--path", choices=("current", "warpers", "copies-warpers"), default="current"
    )
    args = parser.parse_args()
    if args.path in ("warpers", "copies-warpers"):
        sampling._warpers = transformers_warpers
    if args.path == "copies-warpers":
        sampling._shared_prompt = prompt_copies

    store = MapStore.open(args.store)
    test = balanced_splits(store, persist=False)["test"]
    inputs = StoreInputs(store, BaselineOptions(), {"train": [], "validation": [], "test": test})
    capture = store.manifest["config"].get("capture", {})
    request = sampling_request(inputs.generator_name(), inputs.options, capture)
    stored = read_samples(store, request, inputs.meta["prompt"])
    missing = [key for key in test if key not in stored]
    if missing:
        raise SystemExit(f"{len(missing)} test rows have no stored samples, e.g. {missing[0]}")
    model, tokenizer = inputs.generator()
    kwargs = {k: v for k, v in request.items() if k not in ("model", "seed")}
    kept_sets, drawn_sets, differ = [], [], 0
    for key in test:
        prompt = inputs.meta.at[key, "prompt"]
        seed = row_seed(request["seed"], key)
        (drawn,) = sampling.sample_answers(model, tokenizer, [prompt], seed=seed, **kwargs)
        kept = stored[key][0]
        differ += [list(t) for t in drawn.token_ids] != [list(t) for t in kept.token_ids]
        kept_sets.append(kept)
        drawn_sets.append(drawn)
    before = EigenScore().score(kept_sets).confidence
    after = EigenScore().score(drawn_sets).confidence
    labels = inputs.labels(test)
    print(f"{args.store}: {len(test)} test rows, {differ} drew other answers ({args.path})")
    print(
        f"EigenScore test AUROC: stored samples {roc_auc_score(labels, before):.3f}, "
        f"drawn through '{args.path}' {roc_auc_score(labels, after):.3f}"
    )


if __name__ == "__main__":
    main()
