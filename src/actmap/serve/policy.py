"""The deployment policy: what to do with an answer given its p(correct).

A policy is four bands of the (prior-corrected) p(correct)::

    p >= accept           -> "accept"   hand the answer out
    review <= p < accept  -> "review"   hand it out, flagged for a person
    route <= p < review   -> "route"    send the question to a stronger model
    p < route             -> "abstain"  say "I don't know"

(`decide`, a pure function). The thresholds are set by hand in a TOML file or
fitted on labelled validation answers for target risks (`fit_policy`): each
threshold is the lowest score whose accepted set, read from the risk-coverage
curve, keeps its error rate at or below the band's target; `policy_intervals` gives
each band's coverage and risk a bootstrap interval. The file also says
how p(correct) is corrected for the deployment's prevalence (`PriorSetting`,
see `actmap.scoring.prior`). The server adds one more decision, "abstain_early", for a
streamed answer stopped because its running score fell below the request's
``abort_below``.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from actmap.atomic import atomic_write_text
from actmap.errors import ActmapUserError
from actmap.scoring.intervals import N_RESAMPLES, ROW_CHUNK, resample_indices
from actmap.scoring.metrics import risk_coverage_curve
from actmap.scoring.prior import BALANCED, logit, shift_to_prevalence, sigmoid

DECISIONS = ("accept", "review", "route", "abstain", "abstain_early")
PriorMethod = Literal["none", "known", "em"]


@dataclass(frozen=True)
class PriorSetting:
    """How raw detector scores are shifted to the deployment prevalence."""

    method: PriorMethod = "none"  # none | known (deployment_accuracy) | em (estimated online)
    deployment_accuracy: float | None = None  # "known": the generator's accuracy in deployment
    train_prevalence: float = BALANCED  # fraction correct among the detector's training rows
    em_window: int = 1000  # "em": re-estimate from this many most recent raw scores
    em_min_scores: int = 50  # "em": leave scores raw until this many were seen
    # the detector's logit is divided by this before the shift: a temperature fitted on
    # balanced validation rows, so the shift (and EM) start from calibrated posteriors
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in ("none", "known", "em"):
            raise ActmapUserError(f"prior.method must be none, known or em, got {self.method!r}")
        if self.method == "known":
            if self.deployment_accuracy is None:
                raise ActmapUserError("prior.method = 'known' needs prior.deployment_accuracy")
            if not 0.0 < self.deployment_accuracy < 1.0:
                raise ActmapUserError(
                    f"prior.deployment_accuracy must lie in (0, 1), got {self.deployment_accuracy}"
                )
        if not 0.0 < self.train_prevalence < 1.0:
            raise ActmapUserError(
                f"prior.train_prevalence must lie in (0, 1), got {self.train_prevalence}"
            )
        if self.em_window < 1 or self.em_min_scores < 1:
            raise ActmapUserError("prior.em_window and prior.em_min_scores must be >= 1")
        if not self.temperature > 0:
            raise ActmapUserError(f"prior.temperature must be > 0, got {self.temperature}")


@dataclass(frozen=True)
class Policy:
    """Thresholds on p(correct) (0 <= route <= review <= accept; accept may be inf)."""

    accept: float = 0.5
    review: float = 0.5
    route: float = 0.5
    prior: PriorSetting = PriorSetting()
    fitted: dict[str, Any] = field(default_factory=dict)  # how the thresholds were fitted

    def __post_init__(self) -> None:
        for name in ("accept", "review", "route"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or math.isnan(value) or value < 0:
                raise ActmapUserError(f"threshold {name} must be a number >= 0, got {value!r}")
        if not self.route <= self.review <= self.accept:
            raise ActmapUserError(
                "thresholds must satisfy route <= review <= accept, got "
                f"route={self.route}, review={self.review}, accept={self.accept}"
            )


def decide(p_correct: float, policy: Policy) -> str:
    """The decision for one answer's (corrected) p(correct)."""
    if p_correct >= policy.accept:
        return "accept"
    if p_correct >= policy.review:
        return "review"
    if p_correct >= policy.route:
        return "route"
    return "abstain"


def calibrate(p_raw, setting: PriorSetting) -> np.ndarray:
    """The detector's p(correct) with its logit divided by ``setting.temperature``."""
    p = np.asarray(p_raw, dtype=np.float64)
    return p if setting.temperature == 1.0 else sigmoid(logit(p) / setting.temperature)


def correct_prior(p_raw, setting: PriorSetting, prevalence: float | None = None) -> np.ndarray:
    """Raw detector p(correct) -> calibrated p(correct) at the deployment prevalence.

    ``prevalence`` is the current EM estimate for ``method = "em"`` (None: not enough
    scores yet, so the scores are only calibrated).
    """
    p = calibrate(p_raw, setting)
    if setting.method == "known":
        return shift_to_prevalence(p, setting.deployment_accuracy, setting.train_prevalence)
    if setting.method == "em" and prevalence is not None:
        return shift_to_prevalence(p, prevalence, setting.train_prevalence)
    return p


# -- fitting ------------------------------------------------------------------------------


def threshold_for_risk(scores, labels, target_risk: float) -> tuple[float, float, float]:
    """(threshold, coverage, risk) of the largest accepted set whose risk <= target_risk.

    Accepting ``p >= threshold`` reproduces that set (tied scores go together). When no
    threshold reaches the target, threshold is inf and coverage 0.
    """
    if not 0.0 <= target_risk <= 1.0:
        raise ActmapUserError(f"target risk must lie in [0, 1], got {target_risk}")
    s = np.asarray(scores, dtype=np.float64)
    coverage, risk = risk_coverage_curve(s, labels)
    ok = np.flatnonzero(risk <= target_risk + 1e-12)
    if not len(ok):
        return math.inf, 0.0, 0.0
    best = ok[np.argmax(coverage[ok])]
    n_accepted = int(round(coverage[best] * len(s)))
    threshold = float(np.sort(s)[::-1][n_accepted - 1])
    return threshold, float(coverage[best]), float(risk[best])


def fit_policy(
    scores,
    labels,
    target_risk: float,
    review_risk: float | None = None,
    route_risk: float | None = None,
    prior: PriorSetting = PriorSetting(),
    about: dict[str, Any] | None = None,
) -> Policy:
    """Thresholds from labelled validation answers' (corrected) p(correct).

    ``accept`` keeps the accepted answers' risk at ``target_risk``; ``review`` and
    ``route`` extend the handed-out set to ``review_risk`` and ``route_risk`` (None: that
    band is empty). The fitted coverage and risk of each band go into ``fitted``.
    """
    y = np.asarray(labels)
    risks = {"accept": target_risk, "review": review_risk, "route": route_risk}
    previous = None
    thresholds: dict[str, float] = {}
    fitted: dict[str, Any] = {"n": int(len(y)), "accuracy": float(np.mean(y)) if len(y) else 0.0}
    for band in ("accept", "review", "route"):
        wanted = risks[band]
        if wanted is None:
            thresholds[band] = thresholds[previous]  # an empty band
            continue
        if previous is not None and wanted < risks[previous]:
            raise ActmapUserError(
                f"{band} risk {wanted} is below the {previous} risk {risks[previous]}"
            )
        threshold, coverage, risk = threshold_for_risk(scores, y, wanted)
        thresholds[band] = threshold
        fitted[band] = {"target_risk": wanted, "coverage": coverage, "risk": risk}
        previous = band
    fitted.update(about or {})
    return Policy(**thresholds, prior=prior, fitted=fitted)


def policy_intervals(
    policy: Policy,
    scores,
    labels,
    n_resamples: int = N_RESAMPLES,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Bootstrap percentile intervals of each fitted band's coverage and risk.

    The rows are resampled with replacement (``seed``; resamples holding one label drawn
    again, as in `actmap.scoring.intervals`), and on each the band's *fixed* threshold accepts
    ``p >= threshold``: coverage is the accepted fraction, risk the error rate among the
    accepted. The interval says how well those rows pin down what the deployed threshold
    delivers; it does not undo the optimism of having chosen the threshold on the same rows.
    Resamples that accept nothing have no risk: they are left out of the risk's interval and
    counted (``empty_resamples``); a band that accepts nothing on any has no risk interval.
    Returns ``{band: {coverage_low, coverage_high, risk_low, risk_high, empty_resamples}}``
    for the bands in ``policy.fitted``.
    """
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels).astype(np.int64)
    if len(s) != len(y) or not len(y):
        raise ActmapUserError(f"need as many scores as labels (> 0), got {len(s)} and {len(y)}")
    if not 0.0 < level < 1.0:
        raise ActmapUserError(f"level must lie in (0, 1), got {level}")
    idx, _ = resample_indices(y, n_resamples, np.random.default_rng(seed), need_both=True)
    tail = 100 * (1 - level) / 2
    out: dict[str, dict[str, float]] = {}
    for band in ("accept", "review", "route"):
        if band not in policy.fitted:
            continue
        threshold = getattr(policy, band)
        accepted, errors = [], []
        for start in range(0, len(idx), max(1, ROW_CHUNK // len(y))):
            block = idx[start : start + max(1, ROW_CHUNK // len(y))]  # (k, n) row indices
            taken = s[block] >= threshold  # (k, n)
            accepted.append(taken.sum(axis=1))
            errors.append((taken & (y[block] == 0)).sum(axis=1))
        n_accepted, n_errors = np.concatenate(accepted), np.concatenate(errors)
        coverage = n_accepted / len(y)
        some = n_accepted > 0
        low, high = np.percentile(coverage, [tail, 100 - tail])
        result = {"coverage_low": float(low), "coverage_high": float(high)}
        if some.any():
            low, high = np.percentile(n_errors[some] / n_accepted[some], [tail, 100 - tail])
            result.update(risk_low=float(low), risk_high=float(high))
        result["empty_resamples"] = int((~some).sum())
        out[band] = result
    return out


# -- files --------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "inf" if value == math.inf else repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {type(value).__name__} to a policy file")


def _toml_table(name: str, values: dict[str, Any]) -> list[str]:
    lines, nested = [f"[{name}]"], []
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, dict):
            nested.append((f"{name}.{key}", value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for sub, table in nested:
        lines += ["", *_toml_table(sub, table)]
    return lines


def policy_to_toml(policy: Policy) -> str:
    lines = [
        "# actmap decision policy: p >= accept -> accept; >= review -> review;",
        "# >= route -> route; below -> abstain. p is p(correct) after the [prior] correction.",
        *_toml_table(
            "thresholds", {"accept": policy.accept, "review": policy.review, "route": policy.route}
        ),
        "",
        *_toml_table("prior", asdict(policy.prior)),
    ]
    if policy.fitted:
        lines += ["", *_toml_table("fitted", policy.fitted)]
    return "\n".join(lines) + "\n"


def policy_version(policy: Policy) -> str:
    """The policy's version as audit rows and answers name it: a digest of its TOML form
    (thresholds, prior and how it was fitted), so equal policies share one version."""
    import hashlib

    return "policy-" + hashlib.sha256(policy_to_toml(policy).encode()).hexdigest()[:12]


def save_policy(policy: Policy, path: str | Path) -> Path:
    path = Path(path)
    atomic_write_text(path, policy_to_toml(policy))
    return path


def load_policy(path: str | Path) -> Policy:
    """Read a policy TOML file; unknown sections or keys are errors naming the file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"policy file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ActmapUserError(f"{path} is not valid TOML: {error}") from None
    unknown = set(data) - {"thresholds", "prior", "fitted"}
    if unknown:
        raise ActmapUserError(f"{path}: unknown section(s) {sorted(unknown)}")
    thresholds = data.get("thresholds", {})
    extra = set(thresholds) - {"accept", "review", "route"}
    if extra:
        raise ActmapUserError(f"{path}: unknown key(s) in [thresholds]: {sorted(extra)}")
    prior = data.get("prior", {})
    extra = set(prior) - set(PriorSetting.__dataclass_fields__)
    if extra:
        raise ActmapUserError(f"{path}: unknown key(s) in [prior]: {sorted(extra)}")
    accept = thresholds.get("accept", 0.5)
    try:
        return Policy(
            accept=accept,
            review=thresholds.get("review", accept),
            route=thresholds.get("route", thresholds.get("review", accept)),
            prior=PriorSetting(**prior),
            fitted=data.get("fitted", {}),
        )
    except (TypeError, ValueError) as error:
        raise ActmapUserError(f"{path}: {error}") from None
