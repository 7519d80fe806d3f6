"""A new user's path on the embedded model, end to end, as the README tells it.

Own prompts -> store -> train -> evaluate; existing answers -> store -> scored by the
trained detector. Small: ten prompts, eight new tokens, two epochs.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import roc_auc_score
from typer.testing import CliRunner

from actmap.cli import app

runner = CliRunner()
ASK = "Reply with just the number."


def prompt_lines():
    """Per split, questions whose gold answer is right and ones given a wrong gold answer,
    so every split has both labels whatever the small model replies."""
    rows = []
    plan = {
        "train": [(2, 2), (3, 4), (5, 1), (6, 2), (1, 1), (4, 4)],
        "validation": [(2, 3), (7, 1)],
    }
    plan["test"] = [(3, 3), (8, 1)]
    for split, pairs in plan.items():
        for i, (a, b) in enumerate(pairs):
            gold = a + b if i % 2 == 0 else a + b + 50  # odd rows: no reply can match
            rows.append(
                {
                    "id": f"{split}-{i}",
                    "prompt": f"What is {a} + {b}? {ASK}",
                    "answers": [str(gold), f"{a} + {b} = {gold}"],
                    "split": split,
                }
            )
    return rows


def run(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.real_model
def test_own_prompts_then_existing_answers_end_to_end(tmp_path, smollm2):
    prompts = tmp_path / "my-prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in prompt_lines()))
    store, model_run = tmp_path / "stores" / "mine", tmp_path / "runs" / "mine-mlp"
    run(["capture", "--prompts", str(prompts), "--out", str(store), "--max-new-tokens", "8"])
    frame = pd.read_parquet(store / "maps")
    assert sorted(frame["id"]) == sorted(f"prompts:{r['id']}" for r in prompt_lines())
    assert frame["n_tokens"].min() >= 1  # the chat template makes the chat model answer
    assert (frame.groupby("split")["label"].nunique() == 2).all()
    trained = run(["train", "--store", str(store), "--out", str(model_run), "--detector", "mlp",
                   "--seeds", "1", "--max-epochs", "2"])  # fmt: skip
    assert "mlp test metrics" in trained.output
    run(["evaluate", "--run", str(model_run)])
    report = json.loads((model_run / "evaluation.json").read_text())
    scores = pd.read_parquet(model_run / "seed-1" / "test_scores.parquet")
    assert report["per_seed"]["1"]["auroc"] == pytest.approx(
        roc_auc_score(scores["label"], scores["p_correct"])
    )

    # answers made elsewhere (here: the stored answers, as a server log would give them)
    answers = tmp_path / "my-answers.jsonl"
    asked = {f"prompts:{r['id']}": r["prompt"] for r in prompt_lines()}  # the user's message
    lines = [
        {
            "prompt": asked[r["id"]],
            "answer": r["answer"],
            "label": int(r["label"]),
            "split": r["split"],
        }
        for r in frame.to_dict("records")
    ]
    answers.write_text("".join(json.dumps(x) + "\n" for x in lines))
    logged = tmp_path / "stores" / "logged"
    run(["capture", "--answers", str(answers), "--out", str(logged)])
    forced = pd.read_parquet(logged / "maps").set_index("answer")
    generated = frame.set_index("answer")
    assert sorted(forced.index) == sorted(generated.index)
    # teacher forcing the same tokens gives the maps capture gave during generation
    from actmap.store import MapStore

    maps_gen, meta_gen = MapStore.open(store).load_maps()
    maps_forced, meta_forced = MapStore.open(logged).load_maps()
    order = {a: i for i, a in enumerate(meta_forced["answer"])}
    aligned = maps_forced[[order[a] for a in meta_gen["answer"]]].astype(np.float32)
    np.testing.assert_allclose(aligned, maps_gen.astype(np.float32), atol=0.05)
    # score them with the trained detector: the CLI (transfer) and the library agree
    run(
        [
            "evaluate",
            "--run",
            str(model_run),
            "--store",
            str(logged),
            "--out",
            str(tmp_path / "t.json"),
        ]
    )
    from actmap.detectors import CorrectnessDetector

    detector = CorrectnessDetector.load(model_run / "seed-1")
    p = detector.predict_proba(maps_forced)
    assert p.shape == (len(lines),) and ((p >= 0) & (p <= 1)).all()
    transfer = json.loads((tmp_path / "t.json").read_text())
    from actmap.store.rows import balanced_splits

    test_ids = balanced_splits(MapStore.open(logged))["test"]
    test_maps, test_meta = MapStore.open(logged).load_maps(test_ids)
    assert transfer["per_seed"]["1"]["auroc"] == pytest.approx(
        roc_auc_score(test_meta["label"], detector.predict_proba(test_maps))
    )
