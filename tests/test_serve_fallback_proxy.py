"""The fallback detector in proxy mode (``actmap serve --upstream URL --fallback-run RUN``):
a real uvicorn upstream on 127.0.0.1 answers (a plain `actmap serve` over the same tiny
weights), the proxy reads its answers with the in-domain run until the shift monitor alarms,
then with the generalist; its raw p(correct) equals the generalist scoring the upstream's
answer directly, streamed answers say so too, and labels through the proxy's feedback API
refit its recalibration (the documented MAP fit, minimised on a grid); the command line
builds the same. The vLLM plugin takes no fallback: it refuses the setting by name."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from serve_helpers import ServerThread, reference, tiny_engine, tiny_generator  # noqa: E402
from test_serve_fallback import WINDOW, map_temperature, runs, send_labels  # noqa: E402, F401
from test_serve_proxy import chat_body, plain_upstream  # noqa: E402

from actmap.errors import ActmapUserError  # noqa: E402
from actmap.monitor.stream import StreamingMonitor  # noqa: E402
from actmap.serve.app import ServeSettings, create_app  # noqa: E402
from actmap.serve.audit import AuditTrail  # noqa: E402
from actmap.serve.fallback import install_fallback  # noqa: E402
from actmap.serve.policy import Policy  # noqa: E402
from actmap.serve.settings import ProxySettings  # noqa: E402

QUESTIONS = ["what is the capital", "red blue green", "one two three", "paris rome",
             "the moon is", "cats and dogs", "blue sky", "ten nine"]  # fmt: skip


def streamed_block(client, content: str) -> tuple[str, dict]:
    """(answer text, actmap block) of one streamed chat answer through the proxy."""
    text, block = "", None
    with client.stream("POST", "/v1/chat/completions",
                       json=chat_body(content, max_tokens=5, stream=True)) as response:  # fmt: skip
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("actmap"):
                block = chunk["actmap"]
            for choice in chunk.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
    assert block is not None
    return text, block


def test_the_proxy_reads_the_upstreams_answers_with_the_generalist_on_the_alarm(runs, tmp_path):  # noqa: F811
    primary, generalist, monitor = runs
    policy = Policy(accept=0.6, review=0.4, route=0.2)
    built = {}

    def factory():  # what `actmap serve --upstream ... --fallback-run` builds
        trail = AuditTrail(tmp_path / "audit", background=False)  # the feedback flushes
        engine = tiny_engine(primary, policy, audit=trail,
                             monitor=StreamingMonitor(monitor, WINDOW))  # fmt: skip
        built["fallback"] = install_fallback(engine, generalist)
        built["engine"] = engine
        return engine

    with ServerThread(plain_upstream()) as upstream:
        settings = ServeSettings(model="tiny", detector=primary, audit=tmp_path / "audit",
                                 proxy=ProxySettings(upstream.url + "/v1", timeout_s=30))  # fmt: skip
        with (
            ServerThread(create_app(settings, factory)) as proxy,
            httpx.Client(base_url=proxy.url, timeout=60) as client,
        ):
            engine, fallback = built["engine"], built["fallback"]
            primary_id, generalist_id = engine.detector.id, fallback.generalist.id
            assert primary_id != generalist_id

            def ask(content):
                out = client.post("/v1/chat/completions", json=chat_body(content, max_tokens=5))
                assert out.status_code == 200, out.text
                out = out.json()
                return out["choices"][0]["message"]["content"], out["actmap"]

            first = [ask(q)[1] for q in QUESTIONS[:WINDOW]]
            # the in-domain run read the first window; its test alarmed on the last answer
            assert [a["detector"] for a in first] == [primary_id] * WINDOW
            assert [a["shift"]["alarm"] for a in first] == [False] * (WINDOW - 1) + [True]
            assert fallback.swapped.wait(30)
            assert client.get("/health").json()["detector"] == generalist_id
            # the upstream's answer, read by the generalist: as scoring it directly
            prompt = engine.render_chat([{"role": "user", "content": QUESTIONS[WINDOW]}])
            gen, p_gen = reference(engine, prompt, max_tokens=5)  # engine.detector: generalist
            text, block = ask(QUESTIONS[WINDOW])
            assert text == gen.answer and block["tokens"]["source"] == "retokenized"
            assert block["detector"] == generalist_id
            assert block["p_correct_raw"] == pytest.approx(p_gen, abs=1e-5)
            later = [block] + [ask(q)[1] for q in QUESTIONS[WINDOW + 1 :]]
            assert {a["detector"] for a in later} == {generalist_id}
            # a streamed answer's score chunk names the generalist as well
            streamed_text, streamed = streamed_block(client, QUESTIONS[WINDOW])
            assert streamed_text == gen.answer and streamed["detector"] == generalist_id
            assert streamed["p_correct_raw"] == pytest.approx(p_gen, abs=1e-5)
            # labels of its answers, through the proxy's feedback API, refit its recalibration
            labels = np.array([1, 0, 0, 1, 1])[: len(later)]
            p_raw = send_labels(client, later, labels, first[0])
            n_pos = int(labels.sum())
            assert fallback.fitted["labels"] == len(labels) and fallback.fitted["correct"] == n_pos
            want_t = map_temperature(p_raw, labels)
            assert fallback.fitted["temperature"] == pytest.approx(want_t, rel=1e-3)
            _, after = ask(QUESTIONS[0])
            z = math.log(after["p_correct_raw"] / (1 - after["p_correct_raw"]))
            prior = n_pos / len(labels)
            want = 1 / (1 + math.exp(-(z / want_t + math.log(prior / (1 - prior)))))
            assert after["detector"] == generalist_id
            assert after["p_correct"] == pytest.approx(want, rel=1e-3)


def test_actmap_serve_upstream_with_fallback_run_from_the_command_line(runs, tmp_path, monkeypatch):  # noqa: F811
    """The command a user types (``actmap serve --upstream URL --monitor ... --fallback-run
    RUN``): the app it would serve, run here on loopback, reads the upstream's answers with
    the in-domain run, then with the generalist once the monitor alarms."""
    from typer.testing import CliRunner

    import actmap.serve.lifecycle as lifecycle
    from actmap.cli import app
    from actmap.serve.loaded_run import load_detector_run

    primary, generalist, monitor = runs
    model_dir = tmp_path / "tiny"  # the upstream's weights (the start-up probe checks them)
    for part in tiny_generator():
        part.save_pretrained(model_dir)
    monitor.save(tmp_path / "monitor")
    served = {}
    monkeypatch.setattr(lifecycle, "run_server", lambda app, *a: served.setdefault("app", app))
    with ServerThread(plain_upstream()) as upstream:
        args = ["serve", "--model", str(model_dir), "--served-model-name", "tiny",
                "--detector", str(primary), "--monitor", str(tmp_path / "monitor"),
                "--monitor-window", str(WINDOW), "--fallback-run", str(generalist),
                "--upstream", upstream.url + "/v1", "--audit", str(tmp_path / "audit"),
                "--max-tokens", "5"]  # fmt: skip
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert f"answers from {upstream.url}/v1" in result.output
        with (
            ServerThread(served["app"]) as proxy,
            httpx.Client(base_url=proxy.url, timeout=60) as client,
        ):
            fallback = proxy.app.state.actmap.engine.fallback
            ids = [load_detector_run(run).id for run in (primary, generalist)]
            assert [fallback.primary[0].id, fallback.generalist.id] == ids
            first = [client.post("/v1/chat/completions", json=chat_body(q)).json()["actmap"]
                     for q in QUESTIONS[:WINDOW]]  # fmt: skip
            assert [a["detector"] for a in first] == [ids[0]] * WINDOW and first[-1]["shift"][
                "alarm"
            ]
            assert fallback.swapped.wait(30)
            later = client.post("/v1/chat/completions", json=chat_body(QUESTIONS[WINDOW])).json()
            assert later["actmap"]["detector"] == ids[1]


def test_the_vllm_plugin_refuses_a_fallback_by_name():
    from actmap.serve.vllm_plugin import plugin_settings

    for key in ("fallback_run", "fallback-run"):
        with pytest.raises(ActmapUserError) as refused:
            plugin_settings({"detector": "runs/in-domain", key: "runs/generalist"}, "m")
        message = str(refused.value)
        assert key in message and "actmap serve" in message and "\n" not in message
    settings, _ = plugin_settings({"detector": "runs/in-domain"}, "m")  # without it: as before
    assert str(settings.detector) == "runs/in-domain"
