"""The generalist as the server's fallback detector on a new domain (``actmap serve
--fallback-run RUN``), recalibrated as the new domain's labels arrive.

A server started with ``--detector IN_DOMAIN --monitor ... --fallback-run GENERALIST`` scores
with its in-domain run while the shift monitor's latest window test holds, and with the
generalist (`actmap train --store A --store B ...`) while it alarms: the answers then carry the
generalist's id in ``actmap.detector`` (and its policy version in ``actmap.policy``), so every
answer says which detector scored it; ``GET /health`` names the one scoring now. When the alarm
clears, the in-domain run scores again. A reload (``POST /v1/actmap/reload``, SIGHUP) replaces
the in-domain run and its policy (`Fallback.reload`): while the alarm holds, the generalist
keeps scoring and the reloaded pair scores once the alarm clears.

The switch is `Engine.swap` (the reload's): it takes effect between two batches, so a batch is
scored, decided and audited by one detector and one policy. The monitor sees the alarm while
a batch is being scored; the swap is handed to a thread that waits for that batch to end, so
the next batch or the one after is the first the other detector scores.

The generalist's p(correct) holds at a prevalence of 0.5 and its probabilities are the part
that does not carry to a new domain (docs/out_of_domain.md: EM misjudged every held-out task's
prior; 25 labels recalibrated far better). So it serves under a policy of its own, with the
in-domain policy's thresholds: before any label, the prior is EM's on the served scores
(``[prior] method = "em"``, temperature 1: the learning curve's k = 0); with every label that
arrives for an answer the generalist scored (``POST /v1/actmap/feedback``, which the review page
uses too; labels counted as `actmap.store.served` counts them: under ``--review-sample``, the
uniform sample only), the recalibration is refit (`recalibrated_policy`): a temperature
(`actmap.serve.fit.fit_policy_temperature`, the MAP fit `actmap policy fit` uses) and the known
prior, the labelled answers' own accuracy: the learning curve's "recalibrate" step, which paid
from 25 labels. With labels of one class only, the prior alone moves (Laplace's estimate).
The fallback keeps the labelled (p_raw, label) pairs of the generalist's answers: it reads the
audit store once at start (so a restarted server refits from the labels it has), then follows
the trail's commits (`AuditTrail.on_commit`: the raw p(correct) of each answer the generalist
scored) and retention (`AuditTrail.on_drop`: the labelled answers it drops leave the fit at
once), and each label adds or replaces one pair: no label re-reads the store.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from actmap.errors import ActmapUserError
from actmap.serve.policy import Policy, policy_version

log = logging.getLogger(__name__)


class AlarmWatch:
    """A `StreamingMonitor` that reports its alarm after every batch it observes (everything
    else is the monitor's own)."""

    def __init__(self, monitor, on_alarm) -> None:
        self.inner, self.on_alarm = monitor, on_alarm

    def observe(self, maps: np.ndarray):
        shifts = self.inner.observe(maps)
        self.on_alarm(bool(self.inner.state()["alarm"]))
        return shifts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def fallback_policy(policy: Policy, train_prevalence: float, fitted: dict | None = None) -> Policy:
    """The generalist's policy before any label: ``policy``'s thresholds, EM's prior from
    the generalist's training prevalence, temperature 1."""
    prior = replace(
        policy.prior, method="em", deployment_accuracy=None, train_prevalence=train_prevalence,
        temperature=1.0,
    )  # fmt: skip
    return Policy(policy.accept, policy.review, policy.route, prior, fitted or {"fallback": "em"})


def recalibrated_policy(
    policy: Policy, p_raw, labels, train_prevalence: float
) -> tuple[Policy, dict[str, Any]]:
    """``policy`` (the generalist's) with its prior setting refit on labelled answers the
    generalist scored (``p_raw``: its raw p(correct); ``labels``: 1 = correct): with both
    labels a MAP temperature and the answers' accuracy as the known prior (`actmap policy
    fit`'s calibration); with one, the prior alone, (correct + 1) / (n + 2). Returns the policy
    and what was fitted."""
    from actmap.serve.fit import fit_policy_temperature

    p = np.asarray(p_raw, dtype=np.float64)
    y = np.asarray(labels).astype(np.int64)
    n, n_pos = len(y), int(y.sum())
    if 0 < n_pos < n:
        temperature = fit_policy_temperature(p, y, train_prevalence)
        accuracy = n_pos / n
    else:
        temperature, accuracy = 1.0, (n_pos + 1) / (n + 2)
    prior = replace(
        policy.prior, method="known", deployment_accuracy=accuracy,
        train_prevalence=train_prevalence, temperature=temperature,
    )  # fmt: skip
    fitted = {"labels": n, "correct": n_pos, "temperature": temperature, "prior": accuracy}
    return Policy(policy.accept, policy.review, policy.route, prior, {"fallback": fitted}), fitted


class Fallback:
    """The in-domain run and the generalist of one server, swapped on the monitor's alarm."""

    def __init__(self, engine, generalist) -> None:
        from actmap.serve.fit import detector_train_prevalence

        self.engine, self.generalist = engine, generalist
        self.primary = (engine.detector, engine.policy)
        self.train_prevalence = detector_train_prevalence(generalist)
        self.policy = fallback_policy(engine.policy, self.train_prevalence)
        self.fitted: dict[str, Any] = {"labels": 0}
        self._pairs_lock = threading.Lock()  # the pairs below and every refit
        self._scored: dict[str, tuple[float, bool]] = {}  # its answers: p_raw, in the sample
        self._labels: dict[str, int] = {}  # the latest label of each of them
        self._any_sample = False  # whether the review queue holds a uniform random sample
        self._fitted_on: dict = {}  # the counted pairs the recalibration was fit on
        self.active = False  # the state the alarm asks for
        self._state_lock = threading.Lock()
        self._swap_lock = threading.Lock()  # one swap at a time, the latest state wins
        self.swapped = threading.Event()  # set after each swap (tests wait on it)
        engine.monitor = AlarmWatch(engine.monitor, self.on_alarm)

    @property
    def scoring(self) -> str:
        """The id of the detector scoring now."""
        return self.engine.detector.id

    def on_alarm(self, alarm: bool) -> None:
        """From the batch being scored: a change of the alarm schedules a swap after it."""
        with self._state_lock:
            if alarm == self.active:
                return
            self.active = alarm
        log.warning(
            "shift monitor %s: %s scores from the next batch",
            "alarm" if alarm else "alarm cleared",
            self.generalist.id if alarm else self.primary[0].id,
        )  # fmt: skip
        threading.Thread(target=self._apply, name="actmap-fallback", daemon=True).start()

    def _apply(self) -> None:
        with self._swap_lock:
            with self._state_lock:
                active = self.active
            current = self.engine.detector
            if active and current is not self.generalist:
                self.engine.swap(self.generalist, self.policy)
            elif not active and current is self.generalist:
                self.engine.swap(*self.primary)
            self.swapped.set()

    def reload(self, detector, policy: Policy) -> None:
        """A reload's pair (`actmap.serve.reload`) becomes the in-domain one: it scores from
        the next batch when the in-domain run is scoring; while the alarm holds, the generalist
        keeps scoring and the new pair is the one it hands back to when the alarm clears. A
        detector the engine could not swap in raises ValueError and nothing changes."""
        with self._swap_lock:
            self.engine.check_swap(detector)
            self.primary = (detector, policy)
            if self.engine.detector is not self.generalist:
                self.engine.swap(detector, policy)
        log.info("fallback: in-domain run now %s (%s scoring)", detector.id, self.scoring)

    def load(self) -> dict[str, Any]:
        """At start: read the audit store once (the generalist's answers, their latest labels,
        whether the review queue holds a uniform sample), refit on the labels that count, and
        from then on follow the trail's commits and retention. Returns what was fitted."""
        from actmap.serve.audit import read_audit
        from actmap.store.served import latest_labels, review_rows

        trail = self.engine.audit
        if trail is None:
            return self.fitted
        trail.on_commit.append(self._committed)  # first: a commit during the read is not lost
        trail.on_drop.append(self._dropped)
        trail.flush()
        frame = read_audit(trail.store)
        queue = review_rows(trail.store)
        sampled = set(queue.index[queue["in_sample"].astype(bool)])
        mine = frame[(frame["detector"] == self.generalist.id) & frame["p_correct_raw"].notna()]
        pairs = zip(mine["id"], mine["p_correct_raw"], strict=True)
        scored = {key: (float(p), key in sampled) for key, p in pairs}
        labels = latest_labels(trail.store)["label"]
        with self._pairs_lock:
            self._any_sample |= bool(sampled)
            self._scored.update(scored)
            self._labels.update({key: int(y) for key, y in labels.items() if key in scored})
            return self._refit()

    def _committed(self, entries) -> None:
        """From the audit trail's commit: remember the raw p(correct) of the generalist's
        answers and whether each is in the uniform review sample."""
        in_sample = [self.engine.audit.in_sample(e.record.id) for e in entries]
        with self._pairs_lock:
            self._any_sample |= any(in_sample)
            for entry, sampled in zip(entries, in_sample, strict=True):
                p = entry.p_correct_raw
                if entry.detector == self.generalist.id and p is not None and not np.isnan(p):
                    self._scored[entry.record.id] = (float(p), sampled)

    def _dropped(self, ids: set[str]) -> None:
        """From the audit trail's retention: forget the answers it dropped, and refit when
        labelled ones were among them, so that the fit is always the one a restarted server
        makes from what the store still holds. A label that arrives for an answer already
        dropped does not count (`labelled`: the pair is gone)."""
        with self._pairs_lock:
            gone = ids & self._scored.keys()
            for key in gone:
                del self._scored[key]
                self._labels.pop(key, None)
            if gone:
                self._refit()  # nothing to do unless a counted pair went

    def labelled(self, map_id: str, label: int) -> dict[str, Any]:
        """A label of a served answer (written to the audit store): when the generalist scored
        it, its pair joins (a relabel replaces it) and the recalibration is refit on the pairs
        that count, without reading the store; the new policy is swapped in when the
        generalist is scoring. Returns what was fitted."""
        with self._pairs_lock:
            if map_id not in self._scored:  # an answer the in-domain run scored
                return self.fitted
            self._labels[map_id] = int(label)
            return self._refit()

    def _refit(self) -> dict[str, Any]:
        """Refit on the labelled pairs that count (the caller holds the pairs lock): under a
        uniform review sample, the sample's only (`actmap.store.served`)."""
        counted = {
            key: (self._scored[key][0], y)
            for key, y in self._labels.items()
            if not self._any_sample or self._scored[key][1]
        }
        if counted == self._fitted_on:
            return self.fitted
        if counted:
            p_raw, labels = zip(*counted.values(), strict=True)
            policy, fitted = recalibrated_policy(self.policy, p_raw, labels, self.train_prevalence)
        else:
            policy, fitted = fallback_policy(self.policy, self.train_prevalence), {"labels": 0}
        with self._swap_lock:
            self.policy, self.fitted, self._fitted_on = policy, fitted, counted
            if self.engine.detector is self.generalist:
                self.engine.swap(self.generalist, policy)
        log.info("fallback %s recalibrated: %s (%s)", self.generalist.id, fitted,
                 policy_version(policy))  # fmt: skip
        return fitted


def install_fallback(engine, run: str | Path, seed: int | None = None, device: str = "cpu"):
    """Load the generalist of ``run`` as ``engine``'s fallback (``engine.fallback``); the
    engine needs a detector and a shift monitor, and the generalist must read the maps and
    inputs its detector reads (a swap cannot change the capture). Labels already in the audit
    store refit its recalibration at once."""
    from actmap.serve.loaded_run import load_detector_run

    if engine.detector is None or engine.monitor is None:
        raise ActmapUserError(
            "--fallback-run needs a detector (--detector RUN) and its shift monitor (--monitor): "
            "the monitor's alarm is what switches to the fallback"
        )
    try:
        generalist = load_detector_run(run, seed, device)
    except FileNotFoundError as error:
        raise ActmapUserError(f"--fallback-run: {error}") from None
    served = engine.detector
    if generalist.map_config != served.map_config:
        raise ActmapUserError(
            f"--fallback-run {run} reads maps of another config ({generalist.map_config}) than "
            f"--detector {served.id} ({served.map_config}): a fallback reads the same maps"
        )
    if generalist.capture_settings() != served.capture_settings():
        raise ActmapUserError(
            f"--fallback-run {run} reads {', '.join(generalist.requires)}, --detector "
            f"{served.id} reads {', '.join(served.requires)}: a fallback reads the same inputs "
            "(train both with the same preset)"
        )
    if engine.audit is None:
        log.warning("--fallback-run without --audit: labels cannot recalibrate the fallback")
    fallback = Fallback(engine, generalist)
    engine.fallback = fallback
    fallback.load()
    return fallback
