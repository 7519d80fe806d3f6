"""The cascade through a real server pair: every test question of a small model's store sent
to `actmap serve --route-to` (the small model, its detector, a policy routing p < t), the
answers labelled by the task, the final accuracy compared with `actmap cascade`'s figure.

    # the route target (plain generator) and the small model's server, started first:
    actmap serve --model "$(get-model qwen2.5-coder-1.5b-instruct)" --dtype bfloat16 \
        --served-model-name large --max-tokens 24 --port 8102
    python scripts/cascade_served.py policy --store stores/smollm2-builtin-stacked \
        --run runs/smollm2-builtin-plus --share 0.3 --out runs/served/policy.toml
    actmap serve --model smollm2-135m-instruct --detector runs/smollm2-builtin-plus \
        --policy runs/served/policy.toml --route-to http://127.0.0.1:8102/v1 \
        --route-model large --audit runs/served/audit --port 8101
    python scripts/cascade_served.py ask --store stores/smollm2-builtin-stacked \
        --large-store stores/qwen-1.5b-builtin-test --url http://127.0.0.1:8101/v1 \
        --task builtin --builtin-questions 1200 --max-tokens 24 --out runs/served/served.json

``policy`` writes a policy whose route band is p < t, t the ``share`` quantile of the run's
p(correct) on the store's test questions (no prior shift, no temperature), so the server
routes the same answers `actmap cascade` routes at that share. ``ask`` sends each question's
stored prompt to /v1/completions (greedy), labels the answer with the task, and reports the
served final accuracy, the routed share, and how many served answers equal the stored ones
(the small store's where not routed, the large store's where routed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import numpy as np

from actmap.data import get_task
from actmap.experiments.cascade import store_routers
from actmap.serve.policy import Policy, PriorSetting, save_policy
from actmap.store import MapStore


def write_policy(args) -> None:
    _, _, routers, _ = store_routers(MapStore.open(args.store), Path(args.run), "test", ())
    p = np.sort(routers["actmap"])
    k = int(round(args.share * len(p)))
    threshold = float((p[k - 1] + p[k]) / 2)  # k answers below it
    policy = Policy(
        accept=threshold, review=threshold, route=0.0, prior=PriorSetting(method="none"),
        fitted={"about": f"route p < {threshold:.6f}: {k} of {len(p)} test answers"},
    )  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_policy(policy, args.out)
    print(f"route below p = {threshold:.6f}: {k} of {len(p)} test answers -> {args.out}")


def ask(args) -> None:
    small = MapStore.open(args.store).metadata().drop_duplicates("id", keep="last")
    small = small[(small["split"] == "test") & small["label"].notna()]
    large = MapStore.open(args.large_store).metadata().drop_duplicates("id", keep="last")
    large_answer = dict(zip(large["id"], large["answer"], strict=True))
    options = {"n_questions": args.builtin_questions} if args.task == "builtin" else {}
    task = get_task(args.task, **options)
    examples = {e.source_key: e for e in task.load("test")}
    rows, client = [], httpx.Client(timeout=600)
    for row in small.itertuples():
        body = {"model": args.model, "prompt": row.prompt, "max_tokens": args.max_tokens,
                "temperature": 0}  # fmt: skip
        out = client.post(args.url.rstrip("/") + "/completions", json=body).json()
        raw = out["choices"][0]["text"]
        answer = task.postprocess(raw) if hasattr(task, "postprocess") else raw
        block = out["actmap"]
        routed = bool(block.get("routed"))
        stored = large_answer.get(row.id) if routed else row.answer
        rows.append({
            "id": row.id, "decision": block["decision"], "routed": routed,
            "route_error": block.get("route_error"), "p_correct": block["p_correct"],
            "correct": bool(task.label(answer, examples[row.source_key])),
            "small_correct": bool(row.label), "same_as_stored": stored == answer,
        })  # fmt: skip
        print(len(rows), row.id, block["decision"], routed, rows[-1]["correct"], flush=True)
    n = len(rows)
    summary = {
        "n": n,
        "routed": sum(r["routed"] for r in rows),
        "route_failed": sum(r["decision"] == "route" and not r["routed"] for r in rows),
        "served_accuracy": sum(r["correct"] for r in rows) / n,
        "small_accuracy": sum(r["small_correct"] for r in rows) / n,
        "same_as_stored": sum(r["same_as_stored"] for r in rows),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("policy")
    p.add_argument("--store", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--share", type=float, default=0.3)
    p.add_argument("--out", required=True)
    a = sub.add_parser("ask")
    a.add_argument("--store", required=True)
    a.add_argument("--large-store", required=True)
    a.add_argument("--url", required=True)
    a.add_argument("--model", default="smollm2-135m-instruct")
    a.add_argument("--task", default="builtin")
    a.add_argument("--builtin-questions", type=int, default=400)
    a.add_argument("--max-tokens", type=int, default=24)
    a.add_argument("--out", required=True)
    args = parser.parse_args()
    (write_policy if args.command == "policy" else ask)(args)


if __name__ == "__main__":
    main()
