"""The paper's headline claims, checked against our results with their intervals.

    check_claims(results) -> list[Claim]   # results: the report's section results by name

Each claim gets the paper's figure, ours (with its interval and n), and a verdict:

- **holds**: every interval the claim rests on is on the claim's side;
- **does not hold**: an interval is clearly on the other side;
- **inconclusive**: the intervals straddle the line at this sample size, or the
  result the claim needs was not computed here (the reason is given).

The rules, per claim:
1. ActMap beats every non-tensor baseline: the paired AUROC difference of the ActMap
   detector (ViT if present, else the best ActMap detector) and each baseline other than
   ACT-ViT, per store. Holds: every lower bound > 0. Does not hold: an upper bound < 0.
2. ActMap matches ACT-ViT with lower ECE: per store, the paired AUROC difference lies
   within +-0.05 (the paper's largest gap is .048) and the paired ECE difference is < 0.
   Does not hold: the AUROC difference excludes 0 in ACT-ViT's favour, or the ECE
   difference is > 0.
3. Within-task transfer is strong (TriviaQA <-> NQ-Open): lower bound > .5 and the
   estimate within .05 of the target's in-domain AUROC. Does not hold: the interval holds .5.
4. Cross-task, cross-generator and model-scale transfer are near chance: every such
   row's interval holds .5 or its estimate is within .05 of it. Does not hold: a lower
   bound above .6.
5. Coordinate permutation is the most damaging ablation: it has the most negative paired
   difference and its interval excludes 0. Does not hold: another variant's interval lies
   wholly below the permutation's.
6. Classifier choice barely matters: every classifier's paired difference to the reference
   lies within +-0.05. Does not hold: one excludes 0 beyond .05.
7. The signal concentrates mid-depth: the depth band with the largest summed occlusion
   drop lies in the middle half of the map's rows. Inconclusive when no band drops > .005.
8. Capture overhead is within noise: |hooked/plain - 1| is at most the spread of the plain
   repeats ((max - min) / median). Inconclusive with fewer than 3 repeats.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

HOLDS, FAILS, UNSURE = "holds", "does not hold", "inconclusive"
MATCH_MARGIN = 0.05  # AUROC equivalence margin (paper's largest ActMap/ACT-ViT gap: .048)
NEAR_CHANCE = 0.05


@dataclass(frozen=True)
class Claim:
    claim: str
    paper: str
    ours: str
    verdict: str
    rule: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ClaimsResult:
    claims: list[Claim]
    judge_notes: dict[str, str] = field(default_factory=dict)  # judge-labelled store -> check

    def to_json(self) -> dict[str, Any]:
        return {"claims": [c.to_json() for c in self.claims], "judge_notes": self.judge_notes}


def _ci(iv) -> str:
    return f"{iv.estimate:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}] n={iv.n}"


def _auc(iv) -> str:
    return f"{iv.estimate:.3f} [{iv.low:.3f}, {iv.high:.3f}] n={iv.n}"


def _missing(claim: str, paper: str, rule: str, why: str) -> Claim:
    return Claim(claim, paper, f"not measured: {why}", UNSURE, rule)


def _verdict(for_claim: Iterable[bool], against: Iterable[bool]) -> str:
    for_claim, against = list(for_claim), list(against)
    if any(against):
        return FAILS
    if for_claim and all(for_claim):
        return HOLDS
    return UNSURE


def reference_detector(column) -> str | None:
    ours = [c for c in column.cells if c.family == "actmap"]
    if not ours:
        return None
    named = [c for c in ours if c.method == "actmap-vit"]
    return (named or sorted(ours, key=lambda c: -c.auroc.estimate))[0].method


def beats_non_tensor(in_domain) -> Claim:
    claim = "ActMap beats every non-tensor baseline (in-domain AUROC)"
    paper = "highest AUROC on all 12 pairs; mean .825 vs TAD .790, MTE .741"
    rule = "paired AUROC difference vs each baseline except ACT-ViT: every lower bound > 0"
    if in_domain is None or not getattr(in_domain, "columns", None):
        return _missing(claim, paper, rule, "no in-domain results")
    diffs = []
    for column in in_domain.columns:
        ref = reference_detector(column)
        for cell in column.cells:
            if ref is None or cell.family in ("actmap", "control") or cell.method == "actvit":
                continue
            pair = column.pair(ref, cell.method)
            if pair is not None:
                diffs.append((column.store, cell.method, pair.difference))
    if not diffs:
        return _missing(claim, paper, rule, "no ActMap run next to a baseline")
    wins = sum(d.low > 0 for *_, d in diffs)
    losses = [f"{s}/{m} {_ci(d)}" for s, m, d in diffs if d.high < 0]
    worst = min(diffs, key=lambda x: x[2].estimate)
    ours = (
        f"{wins} of {len(diffs)} paired comparisons favour ActMap beyond 0; smallest "
        f"difference {worst[0]}/{worst[1]} {_ci(worst[2])}"
        + (f"; baseline ahead: {', '.join(losses)}" if losses else "")
    )
    verdict = _verdict([d.low > 0 for *_, d in diffs], [d.high < 0 for *_, d in diffs])
    return Claim(claim, paper, ours, verdict, rule)


def matches_actvit(in_domain) -> Claim:
    claim = "ActMap matches ACT-ViT's AUROC with lower ECE"
    paper = "mean AUROC .825 vs .823; lower ECE on 10 of 12 pairs (.063 vs .091)"
    rule = f"paired AUROC difference within +-{MATCH_MARGIN} and paired ECE difference < 0"
    if in_domain is None or not getattr(in_domain, "columns", None):
        return _missing(claim, paper, rule, "no in-domain results")
    parts, ok, bad = [], [], []
    for column in in_domain.columns:
        ref = reference_detector(column)
        auc = column.pair(ref, "actvit") if ref else None
        if auc is None:
            continue
        ece = column.pair(ref, "actvit", "ece")
        d = auc.difference
        ok.append(d.low > -MATCH_MARGIN and d.high < MATCH_MARGIN)
        bad.append(d.high < 0)
        text = f"{column.store}: AUROC diff {_ci(d)}"
        if ece is not None:
            ok.append(ece.difference.high < 0)
            bad.append(ece.difference.low > 0)
            text += f", ECE diff {_ci(ece.difference)}"
        else:
            ok.append(False)
        parts.append(text)
    if not parts:
        return _missing(claim, paper, rule, "no store has both an ActMap run and ACT-ViT results")
    return Claim(claim, paper, "; ".join(parts), _verdict(ok, bad), rule)


WITHIN_TASK = {"triviaqa", "nq_open"}


def _task_of(store: str, tasks: Mapping[str, str]) -> str:
    return tasks.get(store, "")


def transfer_within_task(transfer, tasks: Mapping[str, str]) -> Claim:
    claim = "Within-task transfer is strong (TriviaQA <-> NQ-Open, same generator)"
    paper = "TriviaQA -> NQ-Open .837 (3 models), close to in-domain"
    rule = "lower bound > .5 and estimate within .05 of the target's in-domain AUROC"
    rows = [
        r
        for r in getattr(transfer, "rows", [])
        if r.kind == "cross-dataset"
        and r.auroc is not None
        and {_task_of(r.source, tasks), _task_of(r.target, tasks)} == WITHIN_TASK
    ]
    if not rows:
        return _missing(claim, paper, rule, "no TriviaQA and NQ-Open stores of one generator")
    ok = [
        r.auroc.low > 0.5
        and (r.in_domain is not None and r.auroc.estimate >= r.in_domain.estimate - 0.05)
        for r in rows
    ]
    bad = [r.auroc.low <= 0.5 for r in rows]
    ours = "; ".join(
        f"{r.source} -> {r.target} {_auc(r.auroc)}"
        + (f" (in-domain {_auc(r.in_domain)})" if r.in_domain else "")
        for r in rows
    )
    return Claim(claim, paper, ours, _verdict(ok, bad), rule)


def transfer_near_chance(transfer, tasks: Mapping[str, str]) -> Claim:
    claim = "Cross-task, cross-generator and model-scale transfer are near chance"
    paper = "QA <-> CNN/DM .512/.537; leave-one-generator-out .510; 8B <-> 32B .520/.517"
    rule = "every row's interval holds .5 or its estimate is within .05 of .5; fails: lower > .6"
    rows = [
        r
        for r in getattr(transfer, "rows", [])
        if r.auroc is not None
        and (
            r.kind in ("cross-task", "leave-one-generator-out", "model scale")
            or (  # between short-form tasks of different kinds, e.g. QA -> arithmetic
                r.kind == "cross-dataset"
                and not {_task_of(r.source, tasks), _task_of(r.target, tasks)} <= WITHIN_TASK
            )
        )
    ]
    if not rows:
        return _missing(claim, paper, rule, "no cross-task, cross-generator or scale row")
    ok = [
        (r.auroc.low <= 0.5 <= r.auroc.high) or abs(r.auroc.estimate - 0.5) <= NEAR_CHANCE
        for r in rows
    ]
    bad = [r.auroc.low > 0.6 for r in rows]
    ours = "; ".join(f"{r.kind} {r.source} -> {r.target} {_auc(r.auroc)}" for r in rows)
    return Claim(claim, paper, ours, _verdict(ok, bad), rule)


def permutation_most_damaging(ablations) -> Claim:
    claim = "Hidden-coordinate permutation is the most damaging ablation"
    paper = "full .886 -> permuted .713 (the largest drop)"
    rule = "most negative paired difference to the full map, interval excluding 0"
    most = getattr(ablations, "most_damaging", None)
    if most is None:
        return _missing(claim, paper, rule, "no ablation results")
    worst = most()
    if worst is None:
        return _missing(claim, paper, rule, "no ablation variant with a paired difference")
    variants = [
        v
        for v in ablations.variants
        if v.group in ("map", "pooling") and v.summary and v.summary.difference is not None
    ]
    perm = next((v for v in variants if "permut" in v.name), None)
    if perm is None:
        return _missing(claim, paper, rule, "the permutation variant did not run")
    d = perm.summary.difference
    ours = f"permutation {_ci(d)}; most damaging: {worst.name} {_ci(worst.summary.difference)}"
    if worst.name == perm.name:
        verdict = HOLDS if d.high < 0 else UNSURE
    else:
        verdict = FAILS if worst.summary.difference.high < d.low else UNSURE
    return Claim(claim, paper, ours, verdict, rule)


def classifier_barely_matters(ablations) -> Claim:
    claim = "Classifier choice barely matters (logreg / MLP / 4x MLP / ViT on identical maps)"
    paper = "logreg .877, MLP .892, 4x MLP .893, ViT .886 (spread .016)"
    rule = f"every classifier's paired difference to the reference within +-{MATCH_MARGIN}"
    if not hasattr(ablations, "variants"):
        return _missing(claim, paper, rule, "no ablation results")
    rows = [v for v in ablations.variants if v.group == "classifier" and v.summary is not None]
    diffs = [(v.name, v.summary.difference) for v in rows if v.summary.difference is not None]
    if not diffs:
        return _missing(claim, paper, rule, "no classifier variant with a paired difference")
    ok = [d.low > -MATCH_MARGIN and d.high < MATCH_MARGIN for _, d in diffs]
    bad = [(d.low > MATCH_MARGIN) or (d.high < -MATCH_MARGIN) for _, d in diffs]
    spread = ablations.classifier_spread() if hasattr(ablations, "classifier_spread") else None
    ours = "; ".join(f"{n} {_ci(d)}" for n, d in diffs)
    if spread:
        ours += f" (AUROC spread {spread['spread']:.3f})"
    return Claim(claim, paper, ours, _verdict(ok, bad), rule)


def signal_mid_depth(localization) -> Claim:
    claim = "The detector's signal concentrates mid-depth"
    paper = "occlusion drops .003-.013 in mid-network depth bands; early and late bands ~0"
    rule = "the depth band of largest summed occlusion drop lies in the middle half of rows"
    maps = getattr(localization, "maps", None)
    if not maps:
        return _missing(claim, paper, rule, "no localization results")
    parts, ok, bad = [], [], []
    for name, loc in maps.items():
        profile = loc.depth_profile()
        first, last = loc.peak_depth_band()
        rows = loc.row_edges[-1]
        centre = (first + last + 1) / 2
        mid = rows / 4 <= centre <= 3 * rows / 4
        strong = float(max(profile)) > 0.005
        ok.append(mid and strong)
        bad.append(strong and not mid)
        parts.append(
            f"{name}: peak rows {first}-{last} of {rows} (summed drop {max(profile):.3f}, "
            f"n={loc.n_test})"
        )
    return Claim(claim, paper, "; ".join(parts), _verdict(ok, bad), rule)


def overhead_within_noise(cost) -> Claim:
    claim = "Capture adds no measurable overhead"
    paper = "hooked and plain decoding both ~7 ms/prompt (vLLM, L40S)"
    rule = "|hooked/plain - 1| <= (max - min) / median of the plain repeats"
    capture = getattr(cost, "capture", None)
    if capture is None:
        return _missing(claim, paper, rule, "capture overhead not measured")
    plain = sorted(capture.plain_s)
    noise = (plain[-1] - plain[0]) / plain[len(plain) // 2]
    effect = capture.median_ratio - 1
    ours = (
        f"hooked/plain {capture.median_ratio:.3f} ({100 * effect:+.1f}%), plain run-to-run "
        f"spread {100 * noise:.1f}% ({len(plain)} repeats, {capture.model}, batch {capture.batch})"
    )
    if len(plain) < 3:
        return Claim(claim, paper, ours, UNSURE, rule)
    return Claim(claim, paper, ours, HOLDS if abs(effect) <= noise else FAILS, rule)


def check_claims(results: Mapping[str, Any], tasks: Mapping[str, str]) -> ClaimsResult:
    """Every claim from the results of the report's sections (``tasks``: store -> task)."""
    get = results.get
    return ClaimsResult(
        [
            beats_non_tensor(get("in_domain")),
            matches_actvit(get("in_domain")),
            transfer_within_task(get("transfer"), tasks),
            transfer_near_chance(get("transfer"), tasks),
            permutation_most_damaging(get("ablations")),
            classifier_barely_matters(get("ablations")),
            signal_mid_depth(get("localization")),
            overhead_within_noise(get("cost")),
        ]
    )
