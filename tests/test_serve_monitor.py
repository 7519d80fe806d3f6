"""The shift monitor inside the server: every answer carries actmap.shift, computed from the
answer's own map, and /metrics carries the monitor's gauges."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from serve_helpers import save_tiny_detector, tiny_engine  # noqa: E402

from actmap.monitor import MonitorConfig, ShiftMonitor  # noqa: E402
from actmap.monitor.stream import StreamingMonitor  # noqa: E402
from actmap.serve.app import ServeSettings, create_app, load_streaming_monitor  # noqa: E402

WINDOW = 3


def test_answers_carry_the_monitor_view_and_metrics_its_gauges(tmp_path):
    run = tmp_path / "run"
    save_tiny_detector(run)
    maps = np.random.default_rng(0).normal(size=(60, 12, 32, 128)).astype(np.float16)
    ShiftMonitor(MonitorConfig(n_components=4, n_permutations=39)).fit(maps).save(run / "monitor")
    streaming = load_streaming_monitor(run, WINDOW)  # a run folder holding monitor/ works
    assert isinstance(streaming, StreamingMonitor)
    monitor = streaming.monitor

    engine = tiny_engine(run, monitor=streaming)
    settings = ServeSettings(model="tiny", detector=run, default_max_tokens=5, max_tokens_cap=16)
    shifts = []
    with TestClient(create_app(settings, lambda: engine)) as client:
        for prompt in ("what is the capital", "red blue green", "one two three", "paris rome"):
            body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}]}
            answer = client.post("/v1/chat/completions", json=body).json()
            shifts.append(answer["actmap"]["shift"])
        metrics = client.get("/metrics").text
    # the window test runs once three maps are in: not before
    assert [s["window_p_value"] is None for s in shifts] == [True, True, False, False]
    assert all(0 < s["map_p_value"] <= 1 and s["map_distance"] > 0 for s in shifts)
    # the per-map score is the monitor's own score of the answer's map (random maps of the
    # tiny model are far from these Gaussian maps: flagged one by one)
    assert all(s["flagged"] == (s["map_p_value"] <= monitor.config.map_alpha) for s in shifts)
    assert "actmap_shift_maps_seen 4.0" in metrics
    assert "actmap_shift_windows_tested 1.0" in metrics
    assert "actmap_shift_window_p_value" in metrics and "actmap_shift_alarm" in metrics


def test_streamed_maps_get_the_scores_of_the_monitor():
    rng = np.random.default_rng(1)
    maps = rng.normal(size=(90, 2, 4, 8)).astype(np.float16)
    monitor = ShiftMonitor(MonitorConfig(n_components=3, n_permutations=39)).fit(maps)
    stream = StreamingMonitor(monitor, window=4, test_every=2)
    new = rng.normal(size=(6, 2, 4, 8)).astype(np.float16) + 2.0
    first = stream.observe(new[:3])
    second = stream.observe(new[3:])
    expected = monitor.score_maps(new)
    np.testing.assert_allclose([s.map_distance for s in first + second], expected.distance)
    assert first[0].window_p_value is None  # 3 maps: the window of 4 is not full yet
    # the test ran on the last four maps; shifted by 2 sd they alarm
    assert second[0].alarm and stream.state()["windows_tested"] == 1
