"""The monitor on stores and run folders: fit next to a run, alarm rates over windows of a store.

fit_on_run(run, store)                 -> a ShiftMonitor fitted on the store's training
                                          rows, saved in <run>/monitor/
window_rows(store, split, prevalence)  -> the row ids a check reads (optionally resampled
                                          to another fraction correct)
alarm_rates(monitor, maps, windows)    -> AlarmRates: per window size, how often it alarms
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy.stats import binomtest

from actmap.errors import ActmapUserError
from actmap.monitor.shift import MonitorConfig, ShiftMonitor
from actmap.store import MapStore
from actmap.store.rows import row_metadata
from actmap.training.run_folder import read_run

MONITOR_DIR = "monitor"  # <run>/monitor/: model.safetensors + config.json
TARGET_WINDOWS = 100  # windows per size a check draws (in passes of disjoint windows)
MAX_PASSES = 50


def monitor_path(run: str | Path) -> Path:
    return Path(run) / MONITOR_DIR


def window_rows(
    store: MapStore,
    split: str | None = None,
    prevalence: float | None = None,
    seed: int = 0,
) -> list[str]:
    """Ids of ``split`` (comma-separated names; all rows when None). With ``prevalence``: the labelled rows, resampled
    without replacement to that fraction correct, as many as the rarer side allows."""
    meta = row_metadata(store)  # an id written twice is one row, its last
    if split is not None:
        known = sorted(meta["split"].unique())
        wanted = [s.strip() for s in split.split(",") if s.strip()]
        for name in wanted:
            if name not in known:
                raise ActmapUserError(
                    f"{store.root} has no rows of split '{name}'; splits there: {', '.join(known)}"
                )
        meta = meta[meta["split"].isin(wanted)]
    if prevalence is None:
        return meta["id"].tolist()
    if not 0 < prevalence < 1:
        raise ActmapUserError(f"prevalence must lie in (0, 1), got {prevalence}")
    labelled = meta[meta["label"].notna()]
    correct = labelled.loc[labelled["label"] == 1, "id"].to_numpy()
    wrong = labelled.loc[labelled["label"] == 0, "id"].to_numpy()
    total = min(len(correct) / prevalence, len(wrong) / (1 - prevalence))
    n_correct, n_wrong = int(total * prevalence), int(total * (1 - prevalence))
    if n_correct < 1 or n_wrong < 1:
        raise ActmapUserError(
            f"{store.root} has too few labelled rows ({len(correct)} correct, {len(wrong)} "
            f"incorrect) to resample to prevalence {prevalence}"
        )
    rng = np.random.default_rng(seed)
    chosen = np.concatenate(
        [rng.choice(correct, n_correct, replace=False), rng.choice(wrong, n_wrong, replace=False)]
    )
    return rng.permutation(chosen).tolist()


def fit_on_run(
    run: str | Path,
    store_path: str | Path,
    split: str = "train",
    config: MonitorConfig = MonitorConfig(),
    out: str | Path | None = None,
) -> tuple[ShiftMonitor, Path]:
    """Fit a monitor on the ``split`` rows of the store a detector was trained on; save it
    in ``out`` (default ``<run>/monitor``). Returns the monitor and where it was saved."""

    read_run(run)  # a real run folder, or a clear error
    store = MapStore.open(store_path)
    ids = window_rows(store, split)
    maps, _ = store.load_maps(ids)
    about = {
        "run": str(run),
        "store": str(store_path),
        "store_created_at": store.manifest.get("created_at"),
        "split": split,
        "rows": len(ids),
    }
    monitor = ShiftMonitor(config).fit(maps, metadata=about)
    target = Path(out) if out is not None else monitor_path(run)
    return monitor, monitor.save(target)


def load_for_run(run: str | Path) -> ShiftMonitor:
    """The monitor saved next to a run (``actmap monitor fit``), or a clear error."""
    path = monitor_path(run)
    if not (path / "config.json").is_file():
        raise ActmapUserError(f"{run} has no monitor; run `actmap monitor fit --run {run}` first")
    return ShiftMonitor.load(path)


@dataclass(frozen=True)
class WindowRate:
    """How often windows of one size alarm."""

    window: int
    windows: int  # windows tested
    alarms: int
    alarm_rate: float
    # exact binomial (Clopper-Pearson) 95% interval over the first pass's disjoint windows,
    # which share no row (windows of later passes reuse rows, so they are not independent)
    interval_low: float
    interval_high: float
    independent_windows: int
    mean_p_value: float
    passes: int

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class AlarmRates:
    """A check of one set of rows: the per-map flag rate and the alarm rate per window size."""

    rows: int
    alpha: float
    map_alpha: float
    map_flag_rate: float  # fraction of rows flagged one by one
    rates: list[WindowRate]
    about: dict

    def to_json(self) -> dict:
        return {**asdict(self), "rates": [r.to_json() for r in self.rates]}


def alarm_rates(
    monitor: ShiftMonitor,
    maps: np.ndarray,
    windows: Sequence[int] = (50, 200),
    n_windows: int = TARGET_WINDOWS,
    seed: int = 0,
    about: dict | None = None,
) -> AlarmRates:
    """Alarm rate of windows of every size in ``windows`` drawn from ``maps``.

    Each pass shuffles the rows and cuts them into disjoint windows; passes are added
    until ``n_windows`` windows are tested (at most MAX_PASSES). A size larger than the
    rows is refused.
    """
    features = monitor.transform(maps)  # once; every window reads its rows
    n = len(features)
    flagged = monitor.score_features(features).flagged
    rng = np.random.default_rng(seed)
    rates = []
    for size in windows:
        per_pass = n // size
        if size < 2 or per_pass < 1:
            raise ActmapUserError(f"window {size} needs 2 to {n} maps ({n} rows given)")
        passes = min(MAX_PASSES, math.ceil(n_windows / per_pass))
        p_values, first = [], []
        for index in range(passes):
            order = rng.permutation(n)
            for w in range(per_pass):
                rows = order[w * size : (w + 1) * size]
                p_value = monitor.test_features(features[rows], rng).p_value
                p_values.append(p_value)
                if index == 0:
                    first.append(p_value)
        alarms = int(np.sum(np.array(p_values) <= monitor.config.alpha))
        first_alarms = int(np.sum(np.array(first) <= monitor.config.alpha))
        ci = binomtest(first_alarms, len(first)).proportion_ci(0.95, method="exact")
        rates.append(
            WindowRate(
                window=size,
                windows=len(p_values),
                alarms=alarms,
                alarm_rate=alarms / len(p_values),
                interval_low=float(ci.low),
                interval_high=float(ci.high),
                independent_windows=len(first),
                mean_p_value=float(np.mean(p_values)),
                passes=passes,
            )
        )
    return AlarmRates(
        rows=n,
        alpha=monitor.config.alpha,
        map_alpha=monitor.config.map_alpha,
        map_flag_rate=float(flagged.mean()),
        rates=rates,
        about=dict(about or {}),
    )
