"""Can an offline LLM judge tell two equivalent answers from two different ones? Semantic
Entropy's entailment judge, checked on real TriviaQA answers (issue: the grid, item 5).

Pairs: a generator's answer and the gold alias closest to it (token F1), from one store's
validation split; `--pairs` answers the store labels correct (the answer matches an alias, so
the two name the same thing) and as many labelled wrong (mostly they do not; the labels are
the store's alias match, so a few are noisy either way). Each judge prompt is asked one way
(answer -> alias, with the question):

- entailment: the Nature prompt, greedy, parsed (`LLMEntailmentJudge`); "entailment" counts yes;
- same_answer: "do the two answers name the same thing?", yes vs no (`SameAnswerJudge`); its
  margin log p(yes) - log p(no) also gives an AUROC.

Verdicts and margins are cached per judge in --out (a killed run resumes); the result, with
accuracy, AUROC (95% bootstrap interval) and seconds per pair, goes to <out>/check.json:

    OMP_NUM_THREADS=1 .venv/bin/python scripts/se_judge_check.py \
        --store stores/qwen-1.5b-triviaqa-bf16 --pairs 100 --judge-dtype bfloat16 \
        --out runs/se-judge-check/qwen2.5-coder-1.5b-bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from actmap.atomic import atomic_write_text
from actmap.baselines.entailment import (
    ENTAILMENT,
    JUDGE_PROMPTS,
    LLMEntailmentJudge,
    SameAnswerJudge,
    load_llm_judge,
)
from actmap.data.labels import token_f1
from actmap.scoring.intervals import bootstrap
from actmap.store import MapStore


def check_pairs(store: MapStore, per_class: int, seed: int = 0) -> list[dict]:
    """``per_class`` correct and as many wrong validation answers, each with its closest alias."""
    maps = store.read_latest("maps", columns=["id", "split", "answer", "label"]).to_pylist()
    gens = store.read_latest("generations", columns=["id", "question", "references"])
    gens = {g["id"]: g for g in gens.to_pylist()}
    rows = [r for r in maps if r["split"] == "validation" and r["answer"].strip()]
    rng, pairs = random.Random(seed), []
    for label in (1, 0):
        pool = sorted((r for r in rows if r["label"] == label), key=lambda r: r["id"])
        if len(pool) < per_class:
            raise SystemExit(f"{store.root}: {len(pool)} validation rows labelled {label}")
        for row in rng.sample(pool, per_class):
            gen, answer = gens[row["id"]], row["answer"].strip()
            alias = max(gen["references"], key=lambda a: token_f1(answer, a))
            pairs.append(
                {
                    "id": row["id"],
                    "label": label,
                    "question": gen["question"],
                    "answer": answer,
                    "alias": alias,
                }
            )
    return pairs


def judge_pairs(judge, pairs: list[dict], cache_path: Path) -> dict:
    """Verdict (and the same-answer margin) per pair id; cached in ``cache_path``."""
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    if cache and cache.get("judge") != judge.name:
        raise SystemExit(f"{cache_path} belongs to {cache.get('judge')}, not {judge.name}")
    done = cache.setdefault("pairs", {})
    cache["judge"] = judge.name
    for pair in tqdm([p for p in pairs if p["id"] not in done], desc=judge.name):
        start = time.perf_counter()
        args = (pair["answer"], pair["alias"], pair["question"])
        if isinstance(judge, SameAnswerJudge):
            margin = judge.margin(*args)
            record = {"same": margin > 0, "margin": margin}
        else:
            record = {"same": judge.check_implication(*args) == ENTAILMENT}
        record["seconds"] = time.perf_counter() - start
        done[pair["id"]] = record
        atomic_write_text(cache_path, json.dumps(cache))
    return done


def summary(pairs: list[dict], verdicts: dict) -> dict:
    labels = np.array([p["label"] for p in pairs])
    said = np.array([verdicts[p["id"]]["same"] for p in pairs], dtype=float)
    scores = np.array([verdicts[p["id"]].get("margin", said[i]) for i, p in enumerate(pairs)])
    interval = bootstrap(scores, labels)
    return {
        "pairs": len(pairs),
        "accuracy": float((said == labels).mean()),
        "said_same": float(said.mean()),
        "auroc": [interval.estimate, interval.low, interval.high],
        "seconds_per_pair": float(np.mean([verdicts[p["id"]]["seconds"] for p in pairs])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--pairs", type=int, default=100, help="pairs per class")
    parser.add_argument("--judge", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--judge-dtype", default="float32")
    parser.add_argument("--prompts", default=",".join(JUDGE_PROMPTS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = check_pairs(MapStore.open(args.store), args.pairs)
    result = {"store": args.store, "pairs_per_class": args.pairs, "judges": {}}
    judge = None
    for prompt in args.prompts.split(","):
        if judge is None:  # one model, two prompts
            judge = load_llm_judge(args.judge, dtype=args.judge_dtype, prompt=prompt)
        else:
            kind = SameAnswerJudge if prompt == "same_answer" else LLMEntailmentJudge
            judge = kind(judge.model, judge.tokenizer, judge.model_name)
        verdicts = judge_pairs(judge, pairs, out / f"{prompt}.json")
        result["judges"][judge.name] = {"prompt": prompt, **summary(pairs, verdicts)}
        print(judge.name, json.dumps(result["judges"][judge.name]))
    atomic_write_text(out / "check.json", json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
