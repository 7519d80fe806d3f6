"""Issue 47's summary table: one line per `actmap compare-stacked` output folder.

    python scripts/grid_summary.py runs/compare-smollm2-triviaqa runs/compare-gemma3-nq_open ...

Each line: balanced test rows, the full preset's AUROC with its interval, the deployable
preset's, the strongest single-pass baseline on validation and the full preset's paired
difference from it (and from RAUQ), actmap-plus v1, and both presets' ECE after prior
correction at natural prevalence. Reads only the folders' stacked.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def num(x: float) -> str:
    text = f"{abs(x):.3f}".removeprefix("0")
    return text if x >= 0 else "-" + text


def signed(x: float) -> str:
    return ("+" if x >= 0 else "") + num(x)


def interval(c: dict, form=num) -> str:
    return f"{form(c['estimate'])} [{form(c['low'])}, {form(c['high'])}]"


def line(folder: Path) -> str:
    d = json.loads((folder / "stacked.json").read_text())
    rows = {r["method"]: r for r in d["rows"]}
    full, deployable = rows["actmap-plus full"], rows["actmap-plus deployable"]
    best = next(r for r in d["rows"] if r["role"] == "strongest baseline")
    # a baseline's row holds each preset's paired difference from it: preset - baseline
    rauq = rows["rauq"]["vs"]["actmap-plus full"] if best["method"] != "rauq" else None
    v1 = rows.get("actmap-plus v1")
    cells = [
        Path(d["store"]).name,
        f"{d['n_test']} ({d['n_test_all']}, {100 * d['test_prevalence']:.1f}%)",
        interval(full["test_auroc"]),
        num(deployable["test_auroc"]["estimate"]),
        f"{best['method']} {num(best['test_auroc']['estimate'])}",
        interval(best["vs"]["actmap-plus full"], signed),
        interval(rauq, signed) if rauq else "-",
        num(v1["test_auroc"]["estimate"]) if v1 else "-",
        f"{num(full['natural_ece_corrected'])} / {num(deployable['natural_ece_corrected'])}",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    print(
        "| store | balanced test rows (all, % correct) | full | deployable | strongest baseline "
        "(on validation) | full - it [95%, paired] | full - RAUQ | v1 | ECE corrected full / "
        "deployable |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for folder in sys.argv[1:]:
        print(line(Path(folder)))


if __name__ == "__main__":
    main()
