"""The cascade, measured: route the small model's least trusted answers to a large model.

On the questions both models answered (the same ids in two stores), a router ranks the
small model's answers by a confidence; routing a share ``q`` sends the ``round(q * n)``
least confident to the large model, whose answer replaces the small one. The final
accuracy is ``(sum(small) + sum over routed rows of (large - small)) / n``
(`routed_accuracy`). Rows tied at the routing boundary are routed in proportion: the
expected accuracy of breaking the tie at random, so a router that gives every row the same
confidence is exactly random routing's expectation (the "random" router).

Routers: actmap's p(correct) (a trained run read on the small model's store), the grey-box
baselines read from the same store (perplexity, RAUQ, answer length; confidences, higher =
more likely correct, `actmap.baselines`), random, and the oracle (it routes exactly the
small model's wrong answers that the large one gets right first, then the rows where the
two agree, never first a right answer the large model gets wrong).

Intervals: `actmap.scoring.intervals.bootstrap` resamples the questions; every router, the
small and the large model are read on the same resampled questions (the row positions go
through the bootstrap as its "scores", the same seed draws the same resamples for every
figure), so an interval of a difference between two routers is a paired one. The share of
the oracle's gain a router reaches is ``(router - small) / (oracle - small)`` at the same
share (0 where the oracle gains nothing on a resample).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from actmap.errors import ActmapUserError
from actmap.scoring.intervals import N_RESAMPLES, Interval, RowMetric, bootstrap
from actmap.scoring.metrics import auroc

log = logging.getLogger(__name__)

DEFAULT_SHARES = (0.1, 0.2, 0.3, 0.5)
BASELINE_ROUTERS = ("perplexity", "rauq", "answer_length")
REFERENCE = "actmap"  # the router every other is compared with (paired)


# -- the formula ------------------------------------------------------------------------------


def _routed_gain(confidence: np.ndarray, gain: np.ndarray, k: int) -> np.ndarray:
    """(R,) the summed gain of routing the k least confident of each row of (R, n) arrays,
    the boundary's tie group routed in proportion."""
    r, n = confidence.shape
    if k <= 0:
        return np.zeros(r)
    order = np.argsort(confidence, axis=1, kind="stable")
    c = np.take_along_axis(confidence, order, axis=1)
    g = np.take_along_axis(gain, order, axis=1)
    cum = np.concatenate([np.zeros((r, 1)), np.cumsum(g, axis=1)], axis=1)  # (R, n + 1)
    if k >= n:
        return cum[:, n]
    boundary = c[:, k - 1 : k]  # the confidence of the last routed row
    start = (c < boundary).sum(axis=1)  # its tie group: [start, end)
    end = (c <= boundary).sum(axis=1)
    rows = np.arange(r)
    group = cum[rows, end] - cum[rows, start]
    return cum[rows, start] + (k - start) / (end - start) * group


def routed_accuracy(confidence, small, large, share: float) -> float:
    """The final accuracy when the ``round(share * n)`` least confident answers are routed."""
    c, s, g = _arrays(confidence, small, large)
    k = _routed(share, len(s))
    return float((s.sum() + _routed_gain(c[None], (g - s)[None], k)[0]) / len(s))


def _routed(share: float, n: int) -> int:
    if not 0.0 <= share <= 1.0:
        raise ActmapUserError(f"a routed share must lie in [0, 1], got {share}")
    return int(round(share * n))


def _arrays(confidence, small, large) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    c = np.asarray(confidence, dtype=np.float64)
    s = np.asarray(small, dtype=np.float64)
    g = np.asarray(large, dtype=np.float64)
    if not (c.shape == s.shape == g.shape) or c.ndim != 1:
        raise ActmapUserError(
            f"confidence, small and large correctness must be (n,) each, got {c.shape}, "
            f"{s.shape}, {g.shape}"
        )
    if not np.isfinite(c).all():
        raise ActmapUserError("a router's confidence holds NaN or inf")
    for name, v in (("small", s), ("large", g)):
        if not np.isin(v, (0.0, 1.0)).all():
            raise ActmapUserError(f"{name} correctness must be 0 or 1")
    return c, s, g


def oracle_confidence(small, large) -> np.ndarray:
    """The oracle's ranking: small wrong and large right first (0), then the rows where
    routing changes nothing (0.5), last small right and large wrong (1)."""
    s, g = np.asarray(small), np.asarray(large)
    return np.where((s == 0) & (g == 1), 0.0, np.where((s == 1) & (g == 0), 1.0, 0.5))


# -- the measurement --------------------------------------------------------------------------


@dataclass(frozen=True)
class CascadePoint:
    router: str
    share: float  # asked
    routed: int  # rows routed: round(share * n)
    accuracy: Interval  # final accuracy
    oracle_gain_share: Interval  # (accuracy - small) / (oracle - small)
    vs_reference: Interval | None  # reference router's accuracy minus this one's (paired)

    def to_json(self) -> dict:
        out = asdict(self)
        for key in ("accuracy", "oracle_gain_share", "vs_reference"):
            value = getattr(self, key)
            out[key] = None if value is None else value.to_json()
        return out


@dataclass(frozen=True)
class CascadeResult:
    n: int  # questions both models answered
    small_accuracy: float
    large_accuracy: float
    # how the two models' correctness overlaps: the ceiling of any router
    counts: dict[str, int]  # both_right, small_only, large_only, both_wrong
    shares: tuple[float, ...]
    reference: str
    points: list[CascadePoint]
    # per router: AUROC of its confidence for the small model's correctness (what it was made
    # for) and for the large model's (how much it sends the questions the large model fails
    # too: above .5, its least trusted answers are hard for both)
    aurocs: dict[str, dict[str, float]] = field(default_factory=dict)
    about: dict = field(default_factory=dict)  # stores, run, split, resamples

    def to_json(self) -> dict:
        out = asdict(self)
        out["points"] = [p.to_json() for p in self.points]
        return out

    def point(self, router: str, share: float) -> CascadePoint:
        return next(p for p in self.points if p.router == router and p.share == share)

    @property
    def routers(self) -> list[str]:
        return list(dict.fromkeys(p.router for p in self.points))

    def to_markdown(self) -> str:
        """Accuracy [95% interval] per router and share; the reference's paired lead; the
        share of the oracle's gain."""
        head = " | ".join(f"{100 * q:g}% routed" for q in self.shares)
        lines = [
            f"n = {self.n} questions; small alone {self.small_accuracy:.3f}, large alone "
            f"{self.large_accuracy:.3f}; " + ", ".join(f"{k} {v}" for k, v in self.counts.items()),
            "",
            f"| router | {head} |",
            "|---" * (len(self.shares) + 1) + "|",
        ]
        for router in self.routers:
            cells = []
            for q in self.shares:
                p = self.point(router, q)
                cell = f"{p.accuracy} ({100 * p.oracle_gain_share.estimate:.0f}% of oracle gain)"
                if p.vs_reference is not None:
                    cell += f"; {self.reference} - it: {p.vs_reference.estimate:+.3f} [{p.vs_reference.low:+.3f}, {p.vs_reference.high:+.3f}]"  # fmt: skip
                cells.append(cell)
            lines.append(f"| {router} | " + " | ".join(cells) + " |")
        if self.aurocs:
            lines += ["", "| router | AUROC for the small model's correctness | AUROC for the large model's |", "|---|---|---|"]  # fmt: skip
            lines += [f"| {r} | {a['small']:.3f} | {a['large']:.3f} |" for r, a in self.aurocs.items()]  # fmt: skip
        return "\n".join(lines) + "\n"


def _metric(routers: Mapping[str, np.ndarray], small, large, share: float, kind: str, a, b=None):
    """A `RowMetric` over row positions (the bootstrap's "scores"): ``kind`` is "accuracy" (of
    router ``a``), "difference" (a minus b) or "oracle" (a's share of the oracle's gain)."""
    n = len(small)
    k = _routed(share, n)
    gain = large - small

    def accuracy(name: str, idx: np.ndarray) -> np.ndarray:
        c, s = routers[name][idx], small[idx]
        return (s.sum(axis=1) + _routed_gain(c, gain[idx], k)) / n

    def rows(positions: np.ndarray, labels: np.ndarray, _value: float) -> np.ndarray:
        idx = np.atleast_2d(positions).astype(np.int64)
        if kind == "accuracy":
            return accuracy(a, idx)
        if kind == "difference":
            return accuracy(a, idx) - accuracy(b, idx)
        base = small[idx].mean(axis=1)
        ceiling = accuracy("oracle", idx) - base
        reached = accuracy(a, idx) - base
        return np.divide(reached, ceiling, out=np.zeros_like(reached), where=ceiling > 0)

    def scalar(positions, labels, value) -> float:
        return float(rows(np.asarray(positions)[None], None, value)[0])

    return RowMetric(scalar, rows, share)


def measure_cascade(
    small,
    large,
    routers: Mapping[str, Sequence[float]],
    shares: Sequence[float] = DEFAULT_SHARES,
    reference: str = REFERENCE,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
    about: dict | None = None,
) -> CascadeResult:
    """Final accuracy at each routed share for each router (``{name: confidence}``, higher =
    more likely the small answer is right), plus "random" and "oracle", with bootstrap
    intervals on shared resamples. ``reference`` (when among the routers) is compared with
    every other router, paired."""
    s = np.asarray(small, dtype=np.float64)
    g = np.asarray(large, dtype=np.float64)
    if len(s) < 2 or len(np.unique(s)) < 2:
        raise ActmapUserError(
            f"need questions the small model gets right and wrong, got {len(s)} rows with "
            f"{int(s.sum())} right"
        )
    every = {name: _arrays(c, s, g)[0] for name, c in routers.items()}
    every["random"] = np.zeros(len(s))  # one tie group: random routing's expectation
    every["oracle"] = oracle_confidence(s, g)
    positions = np.arange(len(s), dtype=np.float64)
    points = []
    for name in every:
        for q in shares:

            def interval(kind: str, b=None, name=name, q=q) -> Interval:
                metric = _metric(every, s, g, q, kind, name, b)
                return bootstrap(positions, s, metric, n_resamples=n_resamples, seed=seed)

            versus = None
            if name != reference and reference in every:
                versus = bootstrap(
                    positions, s, _metric(every, s, g, q, "difference", reference, name),
                    n_resamples=n_resamples, seed=seed,
                )  # fmt: skip
            points.append(
                CascadePoint(
                    name,
                    float(q),
                    _routed(q, len(s)),
                    interval("accuracy"),
                    interval("oracle"),
                    versus,
                )  # fmt: skip
            )
    counts = {
        "both_right": int(((s == 1) & (g == 1)).sum()),
        "small_only": int(((s == 1) & (g == 0)).sum()),
        "large_only": int(((s == 0) & (g == 1)).sum()),
        "both_wrong": int(((s == 0) & (g == 0)).sum()),
    }
    aurocs = {}
    if len(np.unique(g)) == 2:
        aurocs = {name: {"small": auroc(c, s), "large": auroc(c, g)} for name, c in every.items()
                  if name not in ("random", "oracle")}  # fmt: skip
    return CascadeResult(
        len(s), float(s.mean()), float(g.mean()), counts, tuple(float(q) for q in shares),
        reference, points, aurocs, dict(about or {}, n_resamples=n_resamples, seed=seed),
    )  # fmt: skip


# -- from stores ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CascadeInputs:
    ids: list[str]
    small: np.ndarray  # (n,) 0/1 the small model's answer is right
    large: np.ndarray  # (n,) 0/1 the large model's answer is right
    routers: dict[str, np.ndarray]  # name -> (n,) confidence
    unavailable: dict[str, str]  # router -> why it could not be read


def store_routers(
    store, run: Path | None, split: str = "test", baselines: Sequence[str] = BASELINE_ROUTERS,
    fit_split: str = "train",
) -> tuple[list[str], np.ndarray, dict[str, np.ndarray], dict[str, str]]:  # fmt: skip
    """(ids, labels, {router: confidence}, {router: why unavailable}) of every labelled row of
    ``split`` of the small model's ``store`` (its natural prevalence): actmap's raw p(correct)
    from ``run`` (`actmap.serve.fit.scored`, as a policy is fitted) and each baseline's
    confidence on the same rows; a supervised baseline (answer_length: a logistic fit on the
    token count) is fitted on the labelled rows of ``fit_split`` (validation rows beside)."""
    from actmap.baselines.base import BaselineUnavailable
    from actmap.baselines.inputs import StoreInputs
    from actmap.baselines.options import BaselineOptions
    from actmap.data.splits import SPLITS
    from actmap.store.rows import natural_ids, read_rows, split_labels

    labelled = natural_ids(store)
    if not labelled.get(split):
        raise ActmapUserError(f"{store.root} has no labelled rows in split '{split}'")
    ids = labelled[split]
    labels = split_labels(store, ids)
    routers, unavailable = {}, {}
    if run is not None:
        from actmap.serve.fit import scored
        from actmap.serve.loaded_run import load_detector_run

        rows = read_rows(store, ids, f"labelled '{split}' rows")
        routers[REFERENCE] = scored(store, load_detector_run(run), rows, split).p_raw
    fit_ids = labelled.get(fit_split) or []
    val_ids = (labelled.get("validation") or []) if fit_split != "validation" else []
    chosen = {split: ids, fit_split: fit_ids, "validation": val_ids}
    inputs = StoreInputs(store, BaselineOptions(), {s: chosen.get(s, []) for s in SPLITS})
    for method in baselines:
        try:
            scorer = inputs.make_scorer(method)
            if getattr(scorer, "supervised", False):
                if not fit_ids:
                    raise BaselineUnavailable(f"{method} is fitted on '{fit_split}' rows; the store has none")  # fmt: skip
                val = inputs.scorer_inputs(scorer, val_ids, method) if val_ids else None
                scorer.fit(
                    inputs.scorer_inputs(scorer, fit_ids, method), split_labels(store, fit_ids),
                    val, split_labels(store, val_ids) if val_ids else None,
                )  # fmt: skip
            result = scorer.score(inputs.scorer_inputs(scorer, ids, method))
            routers[method] = np.asarray(result.confidence, dtype=np.float64)
        except BaselineUnavailable as error:
            unavailable[method] = str(error)
            log.warning("router %s unavailable: %s", method, error)
    return ids, labels, routers, unavailable


def cascade_inputs(
    small_store, large_store, run: Path | None, split: str = "test",
    baselines: Sequence[str] = BASELINE_ROUTERS,
) -> CascadeInputs:  # fmt: skip
    """The small model's routers and correctness and the large model's correctness on the
    questions both stores hold labelled (joined on the row id, ``dataset:source``)."""
    ids, small, routers, unavailable = store_routers(small_store, run, split, baselines)
    meta = large_store.metadata(latest=True).set_index("id")
    meta = meta[meta["label"].notna()]
    keep = [i for i, key in enumerate(ids) if key in meta.index]
    if not keep:
        raise ActmapUserError(
            f"{large_store.root} holds no labelled row of the {len(ids)} {split} questions of "
            f"{small_store.root} (rows are joined on their id, e.g. {ids[:1]})"
        )
    kept = [ids[i] for i in keep]
    large = meta.loc[kept, "label"].to_numpy(dtype=np.float64)
    return CascadeInputs(
        kept, small[keep].astype(np.float64), large,
        {name: c[keep] for name, c in routers.items()}, unavailable,
    )  # fmt: skip


# -- the figure -------------------------------------------------------------------------------


def plot_cascade(result: CascadeResult, path: str | Path) -> Path:
    """Final accuracy against the routed share, one line per router with its 95% band, the
    small and the large model alone as dotted lines (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    shares = np.array(result.shares) * 100
    for router in result.routers:
        points = [result.point(router, q) for q in result.shares]
        est = [p.accuracy.estimate for p in points]
        low = [p.accuracy.low for p in points]
        high = [p.accuracy.high for p in points]
        style = {"oracle": "k--", "random": "k:"}.get(router, "-o")
        (line,) = ax.plot(shares, est, style, label=router, markersize=4)
        ax.fill_between(shares, low, high, color=line.get_color(), alpha=0.12)
    ax.axhline(result.small_accuracy, color="grey", lw=0.8, ls="-.", label="small alone")
    ax.axhline(result.large_accuracy, color="grey", lw=0.8, ls="--", label="large alone")
    ax.set_xlabel("answers routed to the large model (%)")
    ax.set_ylabel("final accuracy")
    ax.set_title(f"cascade on {result.n} questions (95% bootstrap bands)")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
