"""The monitor over a stream of answers (a server): per-map scores at once, a window test
every ``test_every`` new maps over the last ``window`` maps.

`StreamingMonitor.observe(maps)` takes the maps of one batch of answers and returns one
`MapShift` per map; `state()` is what a server exports as gauges. It knows no server.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from actmap.errors import ActmapUserError
from actmap.monitor.shift import ShiftMonitor, WindowTest


@dataclass(frozen=True)
class MapShift:
    """What the monitor says about one answer's map, and the latest window test."""

    map_distance: float  # squared Mahalanobis distance to the in-domain mean
    map_p_value: float  # conformal p-value among in-domain maps
    flagged: bool  # map_p_value <= the monitor's map_alpha
    window_p_value: float | None  # latest window test (None before the first full window)
    alarm: bool  # the latest window test alarmed

    def to_json(self) -> dict:
        return asdict(self)


class StreamingMonitor:
    """A fitted `ShiftMonitor` applied to answers as they come (thread-safe)."""

    def __init__(self, monitor: ShiftMonitor, window: int = 50, test_every: int | None = None):
        if window < 2:
            raise ActmapUserError(f"the monitor window must hold at least 2 maps, got {window}")
        self.monitor = monitor
        self.window = window
        self.test_every = test_every or window  # by default consecutive windows do not overlap
        self.features: deque[np.ndarray] = deque(maxlen=window)
        self.since_test = 0
        self.last_test: WindowTest | None = None
        self.seen = 0
        self.flagged = 0
        self.tests = 0
        self.alarms = 0
        self._rng = np.random.default_rng(monitor.config.seed)
        self._lock = threading.Lock()

    def observe(self, maps: np.ndarray) -> list[MapShift]:
        """Score a batch of maps, add them to the window, test it when due."""
        features = self.monitor.transform(maps)
        scores = self.monitor.score_features(features)
        with self._lock:
            self.seen += len(features)
            self.flagged += int(scores.flagged.sum())
            self.features.extend(features)
            self.since_test += len(features)
            if len(self.features) == self.window and self.since_test >= self.test_every:
                self.last_test = self.monitor.test_features(np.stack(self.features), self._rng)
                self.since_test = 0
                self.tests += 1
                self.alarms += int(self.last_test.alarm)
            test = self.last_test
        return [
            MapShift(
                map_distance=float(d),
                map_p_value=float(p),
                flagged=bool(f),
                window_p_value=None if test is None else test.p_value,
                alarm=bool(test is not None and test.alarm),
            )
            for d, p, f in zip(scores.distance, scores.p_value, scores.flagged, strict=True)
        ]

    def state(self) -> dict:
        """Counters and the latest window test, for gauges."""
        with self._lock:
            test = self.last_test
            return {
                "maps_seen": self.seen,
                "maps_flagged": self.flagged,
                "windows_tested": self.tests,
                "window_alarms": self.alarms,
                "window_p_value": None if test is None else test.p_value,
                "window_statistic": None if test is None else test.statistic,
                "alarm": bool(test is not None and test.alarm),
            }
