"""The grid's closing tables from a rendered report (docs/data.md, the grid's issue note).

Reads ``<report>/json/header.json`` and ``in_domain.json`` (what `actmap report` or
`actmap reproduce` wrote) and prints, in markdown:
1. per store: rows, labelled rows, natural accuracy, balanced train / val / test, capture rows/s;
2. per store: every method's test AUROC [95% interval], highest first, on the identical
   balanced test rows, and the paired difference of ActMap's best detector against the
   strongest other method (not a control).

    python scripts/grid_table.py runs/reproduce-full/report
"""

import json
import sys
from pathlib import Path

ACTMAP = ("actmap-vit", "actmap-mlp", "actmap-logreg")
CONTROL = "control"


def num(x: float) -> str:
    return f"{x:.3f}".replace("0.", ".", 1) if x >= 0 else f"-{num(-x)}"


def interval(d: dict) -> str:
    return f"{num(d['estimate'])} [{num(d['low'])}, {num(d['high'])}]"


def store_table(stores: dict) -> list[str]:
    lines = [
        "| store | rows | labelled | natural accuracy | balanced train / val / test | capture rows/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in stores.items():
        c = s["counts"]
        total, splits = c["total"], c["splits"]
        balanced = " / ".join(str(splits[k]["balanced"]) for k in ("train", "validation", "test"))
        rate = c.get("capture_rows_per_s")
        lines.append(
            f"| {name} | {total['rows']:,} | {total['labelled']:,} | {num(total['accuracy'])} "
            f"| {balanced} | {'-' if rate is None else f'{rate:.2f}'} |"
        )
    return lines


def method_lines(column: dict) -> list[str]:
    cells = [c for c in column["cells"] if c.get("auroc")]
    cells.sort(key=lambda c: -c["auroc"]["estimate"])
    listed = "; ".join(f"{c['method']} {interval(c['auroc'])}" for c in cells)
    lines = [f"- **{column['store']}** ({column['n_test']} test rows): {listed}"]
    ours = [c for c in cells if c["method"] in ACTMAP]
    others = [c for c in cells if c["method"] not in ACTMAP and c["family"] != CONTROL]
    if ours and others:
        best, rival = ours[0], others[0]
        pair = next(
            (p for p in column["paired"] if {p["a"], p["b"]} == {best["method"], rival["method"]}),
            None,
        )
        if pair is not None:
            sign = 1 if pair["a"] == best["method"] else -1
            low, high = sorted((sign * pair["low"], sign * pair["high"]))
            lines.append(
                f"  - {best['method']} - {rival['method']}: {num(sign * pair['estimate'])} "
                f"[{num(low)}, {num(high)}]"
                + (" (beyond the noise)" if low > 0 or high < 0 else " (within the noise)")
            )
    return lines


def main(report: Path) -> None:
    header = json.loads((report / "json" / "header.json").read_text())
    in_domain = json.loads((report / "json" / "in_domain.json").read_text())
    print("\n".join(store_table(header["stores"])), end="\n\n")
    for column in in_domain["columns"]:
        print("\n".join(method_lines(column)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
