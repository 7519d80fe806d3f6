"""POST /v1/actmap/score and `actmap score`: existing answers read by one teacher-forced pass."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("fastapi")
from conftest import WORDS  # noqa: E402
from serve_helpers import client_for, save_tiny_detector, tiny_engine  # noqa: E402

from actmap.capture import CaptureConfig  # noqa: E402
from actmap.capture.forced import capture_answers  # noqa: E402
from actmap.maps import build_map, stored_form  # noqa: E402
from actmap.scoring.prior import shift_to_prevalence  # noqa: E402
from actmap.serve.audit import AuditTrail, open_audit_store, read_audit  # noqa: E402
from actmap.serve.policy import Policy, PriorSetting, decide  # noqa: E402

POLICY = Policy(accept=0.9, review=0.6, route=0.3, prior=PriorSetting("known", 0.3))


def logged_answers(n: int, seed: int = 0) -> list[dict]:
    """``n`` logged chat answers over the tiny vocabulary (1..7 words; every 25th empty)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        question = " ".join(rng.choice(WORDS, size=rng.integers(2, 8)))
        answer = "" if i % 25 == 0 else " ".join(rng.choice(WORDS, size=rng.integers(1, 8)))
        rows.append({"id": f"a{i}", "messages": [{"role": "user", "content": question}],
                     "answer": answer})  # fmt: skip
    return rows


def detector_on_capture(engine, rows) -> list[float | None]:
    """Raw p(correct) by `capture_answers` + `build_map` + the detector, outside the server."""
    prompts = [engine.render_chat(r["messages"]) for r in rows]
    config = CaptureConfig(max_context=engine.max_context, batch_size=7)
    records = capture_answers(engine.model, engine.tokenizer, prompts, [r["answer"] for r in rows], config)  # fmt: skip
    out = []
    for record in records:
        if record.n_tokens == 0:
            out.append(None)
            continue
        stored = stored_form(build_map(record.trajectory))[None]
        out.append(float(engine.detector.detector.predict_proba(stored)[0]))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    save_tiny_detector(folder)
    return folder


def test_score_endpoint_equals_capture_answers_plus_detector(run, tmp_path):
    rows = logged_answers(100)
    audit_root = tmp_path / "audit"

    def factory():
        trail = AuditTrail(audit_root, flush_rows=1000, flush_interval_s=60)
        return tiny_engine(run, POLICY, audit=trail)

    with client_for(run, factory, max_batch=16) as client:
        results = []
        for start in (0, 50):  # two requests of 50 items, batched 16 at a time inside
            response = client.post("/v1/actmap/score", json={"model": "tiny", "items": rows[start : start + 50]})  # fmt: skip
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["object"] == "actmap.score" and body["detector"].startswith("logreg:")
            results += body["results"]
        expected = detector_on_capture(client.app.state.actmap.engine, rows)
    assert [r["id"] for r in results] == [r["id"] for r in rows]
    diffs = []
    for result, p_raw in zip(results, expected, strict=True):
        if p_raw is None:  # an empty answer has no map: abstain, like an empty generation
            assert result["p_correct"] is None and result["decision"] == "abstain"
            assert result["map_id"] is None and result["n_tokens"] == 0
            continue
        diffs.append(abs(result["p_correct_raw"] - p_raw))
        shifted = shift_to_prevalence([result["p_correct_raw"]], 0.3)[0]
        assert result["p_correct"] == pytest.approx(shifted, abs=1e-9)
        assert result["decision"] == decide(result["p_correct"], POLICY)
        assert result["map_id"] is not None
    # other padding (the server splits batches by length) can flip a float16 map element's
    # last bit: p moves by ~1e-5
    assert len(diffs) == 96 and max(diffs) < 5e-5, max(diffs)
    frame = read_audit(open_audit_store(audit_root))
    assert len(frame) == 96 and set(frame["endpoint"]) == {"score"}
    by_id = frame.set_index("id")["p_correct_raw"]
    for result in results:
        if result["map_id"] is not None:
            assert by_id[result["map_id"]] == pytest.approx(result["p_correct_raw"], abs=1e-12)


def test_scoring_a_generated_answer_gives_its_served_score(run):
    """Generation-time capture (the chat endpoint) and teacher forcing (the score endpoint) of the
    same tokens give the same p(correct): text and token ids alike."""
    with client_for(run) as client:
        for question in ("what is the capital of paris", "who wrote the red river"):
            messages = [{"role": "user", "content": question}]
            served = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 8}).json()  # fmt: skip
            text = served["choices"][0]["message"]["content"]
            engine = client.app.state.actmap.engine
            ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
            items = [{"messages": messages, "answer": text},
                     {"messages": messages, "answer_token_ids": ids}]  # fmt: skip
            scored = client.post("/v1/actmap/score", json={"items": items}).json()["results"]
            for result in scored:
                assert result["n_tokens"] == served["usage"]["completion_tokens"]
                assert result["p_correct_raw"] == pytest.approx(served["actmap"]["p_correct_raw"], abs=1e-5)  # fmt: skip


@pytest.mark.parametrize(
    "items, message, param",
    [
        ([{"messages": [{"role": "user", "content": "a"}], "answer": "the"},
          {"prompt": "the", "messages": [{"role": "user", "content": "a"}], "answer": "x"}],
         "items[1]: give exactly one of 'messages' or 'prompt'", "items[1]"),
        ([{"prompt": "the sum"}], "items[0]: give exactly one of 'answer' or 'answer_token_ids'",
         "items[0]"),
        ([{"prompt": "the", "answer": "a"}, {"prompt": "the", "answer_token_ids": [3, 999]}],
         "items[1]: answer_token_ids holds 999, outside the vocabulary", "items[1].answer_token_ids"),
        ([{"prompt": "  ", "answer": "a"}], "items[0]: prompt must not be empty", "items[0].prompt"),
        ([{"prompt": "the " * 60, "answer": "a " * 10}], "items[0]: prompt (60 tokens) + answer "
         "(10 tokens) exceed this model's context of 64 tokens", "items[0]"),
        ([{"prompt": "the", "answer": "a", "label": 1}], "invalid request: items.0.label", None),
        ([], "invalid request: items", None),
    ],
)  # fmt: skip
def test_bad_items_are_named(run, items, message, param):
    with client_for(run, max_score_items=3) as client:
        response = client.post("/v1/actmap/score", json={"items": items})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["message"].startswith(message), error
        if param is not None:
            assert error["param"] == param


def test_limits_and_model(run):
    with client_for(run, max_score_items=3, max_body_bytes=4000) as client:
        item = {"prompt": "the sum", "answer": "two"}
        response = client.post("/v1/actmap/score", json={"items": [item] * 4})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "4 items exceed this server's limit of 3 per request"  # fmt: skip
        response = client.post("/v1/actmap/score", json={"model": "gpt-4", "items": [item]})
        assert response.status_code == 404
        big = {"items": [{"prompt": "the " * 1200, "answer": "two"}]}
        assert client.post("/v1/actmap/score", json=big).status_code == 413
        response = client.post("/v1/actmap/score", json={"items": [item] * 3})
        assert response.status_code == 200 and len(response.json()["results"]) == 3
        metrics = client.get("/metrics").text
        assert 'actmap_requests_total{endpoint="score",status="200"} 3.0' in metrics


def test_cli_score_writes_the_endpoints_scores(run, tmp_path, tiny_model_dir):
    from typer.testing import CliRunner

    from actmap.cli import app

    rows = logged_answers(13, seed=3)[1:]  # an answers file holds no empty answer
    path = tmp_path / "answers.jsonl"
    # an answers file's prompt is the user's message (wrapped in the chat template, as
    # `actmap capture --answers` does); here the tiny tokenizer has none: used verbatim
    path.write_text("".join(json.dumps({"id": r["id"], "prompt": r["messages"][0]["content"], "answer": r["answer"], "label": i % 2}) + "\n" for i, r in enumerate(rows)))  # fmt: skip
    for out in (tmp_path / "scores.csv", tmp_path / "scores.parquet"):
        result = CliRunner().invoke(
            app, ["score", "--answers", str(path), "--detector", str(run), "--model",
                  str(tiny_model_dir), "--out", str(out), "--batch-size", "5"],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        table = pd.read_csv(out) if out.suffix == ".csv" else pd.read_parquet(out)
        assert list(table["id"]) == [r["id"] for r in rows]
        assert list(table["label"]) == [i % 2 for i in range(12)]
    engine = tiny_engine(run)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine.model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine.tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [r["messages"][0]["content"] for r in rows]
    records = capture_answers(engine.model, engine.tokenizer, prompts, [r["answer"] for r in rows], CaptureConfig(max_context=256))  # fmt: skip
    for record, got in zip(records, table.itertuples(), strict=True):
        if record.n_tokens == 0:
            assert np.isnan(got.p_correct_raw) and got.decision == "abstain"
            continue
        stored = stored_form(build_map(record.trajectory))[None]
        assert got.p_correct_raw == pytest.approx(float(engine.detector.predict_proba(stored)[0]), abs=1e-5)  # fmt: skip
        assert got.decision == decide(got.p_correct, Policy())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "the", "answer": "a"}\n{"prompt": "the"}\n')
    result = CliRunner().invoke(app, ["score", "--answers", str(bad), "--detector", str(run), "--model", str(tiny_model_dir), "--out", str(tmp_path / "x.csv")])  # fmt: skip
    assert result.exit_code != 0 and "line 2" in result.output and "answer" in result.output


@pytest.mark.real_model
def test_score_endpoint_on_smollm2(run, smollm2):
    """A handful of answers on the real model: the endpoint equals capture_answers + detector,
    and scoring a generated answer gives the score it was served with."""
    from fastapi.testclient import TestClient

    from actmap.serve.app import ServeSettings, create_app
    from actmap.serve.engine import Engine
    from actmap.serve.loaded_run import load_detector_run

    model, tokenizer, source = smollm2
    settings = ServeSettings(model="smollm2", detector=run, default_max_tokens=10)
    factory = lambda: Engine(model, tokenizer, source, load_detector_run(run))  # noqa: E731
    questions = ["What is the capital of France?", "Who wrote Hamlet?", "What is 2 plus 3?"]
    with TestClient(create_app(settings, factory)) as client:
        served = [
            client.post("/v1/chat/completions", json={"model": "smollm2", "messages": [{"role": "user", "content": q}]}).json()
            for q in questions
        ]  # fmt: skip
        rows = [{"messages": [{"role": "user", "content": q}], "answer": a} for q, a in
                zip(questions, ["Paris", "William Shakespeare wrote it.", "5"], strict=True)]  # fmt: skip
        rows += [{"messages": [{"role": "user", "content": q}], "answer": s["choices"][0]["message"]["content"]}
                 for q, s in zip(questions, served, strict=True)]  # fmt: skip
        results = client.post("/v1/actmap/score", json={"items": rows}).json()["results"]
        expected = detector_on_capture(client.app.state.actmap.engine, rows)
    for result, p_raw in zip(results, expected, strict=True):
        assert result["p_correct_raw"] == pytest.approx(p_raw, abs=1e-5)
    for result, answer in zip(results[3:], served, strict=True):
        assert result["p_correct_raw"] == pytest.approx(answer["actmap"]["p_correct_raw"], abs=1e-4)


def test_a_shared_chat_prefix_runs_once_and_gives_the_same_rows(run):
    """A template whose system turn every prompt starts with: the pass over its cached prefix
    gives the rows (and scores) of the full pass."""
    from actmap.capture.forced import capture_answers_batch
    from actmap.serve.answers import ScoreJob, chat_prefix, score_answers

    engine = tiny_engine(run)
    engine.tokenizer.chat_template = "the capital of the city is {% for m in messages %}{{ m['content'] }} {% endfor %}"  # fmt: skip
    prefix = chat_prefix(engine)
    assert prefix is not None and len(prefix.ids) == 6  # the template's six words
    rows = logged_answers(12, seed=5)[1:]
    prompts = [engine.render_chat(r["messages"]) for r in rows]
    answers = [r["answer"] for r in rows]
    config = CaptureConfig(max_context=engine.max_context, batch_size=11, greybox=False)
    full = capture_answers_batch(engine.model, engine.tokenizer, prompts, answers, config)
    cached = capture_answers_batch(engine.model, engine.tokenizer, prompts, answers, config, prefix=prefix)  # fmt: skip
    for a, b in zip(full, cached, strict=True):
        assert a.token_ids == b.token_ids and a.prompt_tokens == b.prompt_tokens
        assert (a.trajectory - b.trajectory).abs().max() < 1e-4
    jobs = [ScoreJob(p, a) for p, a in zip(prompts, answers, strict=True)]
    with_prefix, _ = score_answers(engine, jobs, prefix)
    without, _ = score_answers(engine, [ScoreJob(p, a) for p, a in zip(prompts, answers, strict=True)])  # fmt: skip
    for a, b in zip(with_prefix, without, strict=True):
        # the map is stored in float16: a rounding flip of one element (multi-threaded
        # reductions differ with the pass's shape) moves p by up to ~1e-5, the bound the score
        # endpoint's equality test uses
        assert a.p_correct_raw == pytest.approx(b.p_correct_raw, abs=5e-5)
    # a prompt that does not start with the prefix: the batch runs whole, same rows
    odd = capture_answers_batch(engine.model, engine.tokenizer, ["what is two", *prompts[:2]], ["two", *answers[:2]], config, prefix=prefix)  # fmt: skip
    assert [g.token_ids for g in odd[1:]] == [g.token_ids for g in full[:2]]


def test_prefix_cache_learns_a_shared_instruction_and_keeps_the_scores(run):
    """Prompts that share an instruction beyond the template's system turn: the first batch
    computes that prefix once, later batches (one prompt alone too) read over it, prompts that
    do not share it fall back to the system turn; every score equals the full pass's."""
    from actmap.serve.answers import PrefixCache, ScoreJob, chat_prefix, score_answers

    engine = tiny_engine(run)
    engine.tokenizer.chat_template = "the capital of the city is {% for m in messages %}{{ m['content'] }} {% endfor %}"  # fmt: skip
    base = chat_prefix(engine)
    cache = PrefixCache(engine, base, min_gain=8)
    instruction = "paris is the city of the capital of what is the city of rome"  # 13 words
    rows = logged_answers(9, seed=7)[1:]
    prompts = [engine.render_chat([{"role": "user", "content": f"{instruction} {r['messages'][0]['content']}"}]) for r in rows]  # fmt: skip
    answers = [r["answer"] for r in rows]
    config = CaptureConfig(max_context=engine.max_context, greybox=False)
    # reference: the shared instruction found by hand, tokens as the pass reads them
    ids = engine.tokenizer(prompts[:2], add_special_tokens=False)["input_ids"]
    shared = next(i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y)
    assert shared >= len(base.ids) + 8

    def scores(jobs_prompts, jobs_answers, prefix):
        jobs = [ScoreJob(p, a) for p, a in zip(jobs_prompts, jobs_answers, strict=True)]
        return [a.p_correct_raw for a in score_answers(engine, jobs, prefix)[0]]

    got = scores(prompts[:4], answers[:4], cache)
    learned = cache.for_prompts(prompts[4:5], config)
    assert cache.built == 1 and len(learned.ids) >= shared - 1
    assert learned.ids.tolist() == ids[0][: len(learned.ids)]
    got += scores(prompts[4:5], answers[4:5], cache) + scores(prompts[5:], answers[5:], cache)
    assert cache.built == 1  # reused, not computed again
    want = scores(prompts, answers, None)
    assert got == pytest.approx(want, abs=1e-5)  # float rounding (measured 2.5e-6)
    plain = [engine.render_chat(r["messages"]) for r in rows[:2]]
    assert cache.for_prompts(plain, config) is base  # no instruction: the system turn only
    assert cache.built == 1


def test_length_groups_is_the_cheapest_cut_of_the_sorted_rows():
    """Against every cut of the sorted rows into consecutive passes (brute force)."""
    from itertools import combinations

    from actmap.serve.answers import length_groups

    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(1, 9))
        lengths = [(int(rng.integers(1, 60)), int(rng.integers(1, 25))) for _ in range(n)]
        order = sorted(range(n), key=lambda i: (sum(lengths[i]), lengths[i]))

        def cost(groups, lengths=lengths):
            return sum(
                len(g) * (max(lengths[i][0] for i in g) + max(lengths[i][1] for i in g)) + 32
                for g in groups
            )

        cheapest = min(
            cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, n), strict=True)])
            for k in range(n)
            for cuts in combinations(range(1, n), k)
        )
        groups = length_groups(lengths, pass_tokens=32)
        assert sorted(i for g in groups for i in g) == list(range(n))  # each row once
        assert cost(groups) == cheapest
    assert length_groups([(40, 20)] * 16) == [list(range(16))]  # equal rows: one pass
    # one long prompt among short ones costs a pass of its own
    assert sorted(map(len, length_groups([(20, 10)] * 15 + [(400, 10)]))) == [1, 15]


def test_passes_split_by_length_give_the_rows_of_one_pass(run):
    from actmap.capture.forced import capture_answers_batch
    from actmap.serve.answers import ScoreJob, length_groups, score_answers

    engine = tiny_engine(run)
    rows = logged_answers(12, seed=9)
    rows[0]["messages"][0]["content"] = " ".join(["the capital of paris"] * 8)  # a long one
    prompts = [engine.render_chat(r["messages"]) for r in rows]
    answers = [r["answer"] for r in rows]
    answers[1] = " ".join(WORDS[:20])  # a long answer
    scored, timings = score_answers(engine, [ScoreJob(p, a) for p, a in zip(prompts, answers, strict=True)])  # fmt: skip
    config = CaptureConfig(max_context=engine.max_context, batch_size=12, greybox=False)
    whole = capture_answers_batch(engine.model, engine.tokenizer, prompts, answers, config)
    assert timings.size == 12
    lengths = [(engine.count_tokens(p), len(engine.tokenizer(a)["input_ids"])) for p, a in zip(prompts, answers, strict=True)]  # fmt: skip
    assert len(length_groups(lengths)) > 1  # the batch ran as several passes
    assert whole[1].n_tokens >= 20  # the long answer is read (some others are empty)
    for answer, g in zip(scored, whole, strict=True):
        assert answer.n_tokens == g.n_tokens and answer.text == g.answer
        if g.n_tokens:
            expected = engine.detector.predict_proba(stored_form(build_map(g.trajectory))[None])
            assert answer.p_correct_raw == pytest.approx(float(expected[0]), abs=1e-5)


def test_request_encodes_leave_a_worker_threads_padding_alone(run):
    """A fast tokenizer sets padding on its one backend before each encode: a request encoded
    on the event loop (the proxy's answer and prompt ids, the server's token count) between a
    worker's set-up and its encode stripped the worker's batch of its padding (seen as a 500
    in the proxy's benchmark). The worker's padding must survive the request's encodes."""
    import copy
    from concurrent.futures import ThreadPoolExecutor

    from transformers.tokenization_utils_base import PaddingStrategy, TruncationStrategy

    from actmap.serve.answers import answer_ids
    from actmap.serve.proxy import _answer_job

    engine = tiny_engine(run)
    texts = ["the capital of paris", "what is the largest river in the city of rome"]
    worker = ThreadPoolExecutor(1)

    def set_up_padding():  # what transformers does just before encoding a padded batch
        tokenizer = engine.thread_tokenizer
        tokenizer.padding_side = "left"
        tokenizer.set_truncation_and_padding(
            padding_strategy=PaddingStrategy.LONGEST,
            truncation_strategy=TruncationStrategy.DO_NOT_TRUNCATE,
            max_length=None, stride=0, pad_to_multiple_of=None, padding_side="left",
        )  # fmt: skip
        return tokenizer

    reference = copy.deepcopy(engine.tokenizer)
    tokenizer = worker.submit(set_up_padding).result()
    # the event loop's encodes meanwhile: every request-side path of the server and proxy
    assert engine.count_tokens(texts[0]) == len(reference(texts[0])["input_ids"])
    assert answer_ids(engine, "paris") == reference("paris", add_special_tokens=False)["input_ids"]
    state = type("State", (), {"engine": engine})()
    job, info = _answer_job(state, texts[0], texts[0], "completion", "paris", None, [1, 2])
    assert info.mismatch and job.answer == "paris"  # prompt ids [1, 2] differ from the local ones
    encoded = worker.submit(lambda: tokenizer._tokenizer.encode_batch(texts)).result()
    lengths = [len(e.ids) for e in encoded]
    assert lengths[0] == lengths[1] > len(texts[0].split())  # still padded to the longest
    assert engine.thread_tokenizer is not tokenizer
    worker.shutdown()
