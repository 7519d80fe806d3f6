"""The report's assembly: sections run in order, JSON per section, figures, failures kept apart."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from report_stores import synthetic_store
from typer.testing import CliRunner

from actmap.cli import app
from actmap.errors import ActmapUserError
from actmap.report.assemble import build_report
from actmap.report.inputs import find_runs, store_refs
from actmap.report.parts import map_channels
from actmap.report.sections import ReportContext, Section, Skipped
from actmap.store import MapStore


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return synthetic_store(tmp_path_factory.mktemp("report") / "gen-a-task-a")


@dataclass(frozen=True)
class Seen:
    names: list[str]

    def to_json(self) -> dict:
        return {"seen": self.names}


def test_build_report_runs_sections_in_order_and_keeps_failures_apart(store, tmp_path):
    def broken(context):
        raise ValueError("no luck")

    def reader(context):  # a later section reads the earlier results (as claims does)
        return Seen(sorted(context.results))

    sections = [
        map_channels.SECTION,
        Section("broken", "Broken", broken, lambda r, d: "never"),
        Section("skipped", "Skipped", lambda c: Skipped("no CNN/DM store"), lambda r, d: "skip"),
        Section("reader", "Reader", reader, lambda r, d: f"saw {r.names}\n"),
    ]
    refs = store_refs([store])
    context = ReportContext(stores=refs, runs={}, out=tmp_path / "out", scratch=tmp_path / "s")
    done = build_report(context, sections)
    text = done.report.read_text()
    assert text.index("A real generation's map") < text.index("## Broken") < text.index("## Reader")
    assert "no luck" in text and "saw ['map_channels', 'skipped']" in text
    assert done.sections["broken"].startswith("failed") and done.sections["map_channels"] == "done"
    assert done.sections["skipped"] == "skipped: no CNN/DM store"
    assert json.loads((done.json_dir / "broken.json").read_text())["failed"].endswith("no luck")
    head = json.loads((done.json_dir / "header.json").read_text())
    assert head["stores"]["gen-a-task-a"]["generator"] == "gen-a"
    # the store table: rows and natural accuracy against a naive count of the metadata
    meta = MapStore.open(store).metadata()
    counts = head["stores"]["gen-a-task-a"]["counts"]
    correct = int((meta["label"] == 1).sum())
    assert counts["total"]["rows"] == len(meta) and counts["total"]["correct"] == correct
    per_split = {s: meta[meta["split"] == s]["label"] for s in ("train", "validation", "test")}
    balanced = [2 * min(int(v.sum()), len(v) - int(v.sum())) for v in per_split.values()]
    assert [counts["splits"][s]["balanced"] for s in per_split] == balanced
    assert counts["capture_rows_per_s"] is None  # written directly: no capture run timed
    row = f"| gen-a-task-a | {len(meta):,} | {len(meta):,} | {correct / len(meta):.3f} | "
    row += " / ".join(map(str, balanced)) + " | - |"
    assert row in text.splitlines()
    assert set(head["timings_s"]) >= {"map_channels", "broken", "reader"}
    # the figure is a PNG of the map the JSON holds, and that map is the store's
    example = json.loads((done.json_dir / "map_channels.json").read_text())
    maps, _ = MapStore.open(store).load_maps([example["row_id"]])
    np.testing.assert_allclose(example["map"], maps[0], atol=1e-3)
    assert (done.figure_dir / "map_channels.png").read_bytes()[:4] == b"\x89PNG"


def test_find_runs_lists_detectors_with_seed_folders(tmp_path):
    (tmp_path / "s1" / "mlp" / "seed-42").mkdir(parents=True)
    (tmp_path / "s1" / "mlp" / "seed-42" / "config.json").write_text("{}")
    (tmp_path / "s1" / "empty").mkdir()
    assert find_runs(tmp_path, ["s1", "s2"]) == {"s1": {"mlp": tmp_path / "s1" / "mlp"}}


def test_store_refs_read_each_manifest_and_refuse_two_stores_of_one_name(tmp_path):
    a = synthetic_store(tmp_path / "a" / "s", generator="g", task="cnn_dm", judge="llm:j")
    refs = store_refs([a])
    assert (refs["s"].generator, refs["s"].task, refs["s"].judge) == ("g", "cnn_dm", "llm:j")
    assert refs["s"].dtype == "float32"  # no dtype recorded: float32
    b = synthetic_store(tmp_path / "b" / "s", dtype="bfloat16")
    assert store_refs([b])["s"].judge is None and store_refs([b])["s"].dtype == "bfloat16"
    with pytest.raises(ActmapUserError, match="two stores are named 's'"):
        store_refs([a, b])


def test_header_names_a_local_generator_by_its_file_and_keeps_the_path_in_json():
    from actmap.report.assemble import header_markdown

    stores = {
        "q": {"generator": "/models/qwen-1.5b.gguf", "task": "nq_open", "path": "stores/q"},
        "h": {"generator": "HuggingFaceTB/SmolLM2-135M-Instruct", "task": "gsm8k", "path": "h"},
    }
    head = {
        "actmap_version": "0",
        "git_commit": "x",
        "created_utc": "t",
        "rows": "balanced",
        "seeds": [42],
        "n_resamples": 10,
        "max_epochs": None,
        "stores": stores,
        "runs": {},
    }
    rows = header_markdown(head, {}).splitlines()
    assert "| q | qwen-1.5b.gguf | float32 | nq_open | task rule | `stores/q` |" in rows
    assert "| h | HuggingFaceTB/SmolLM2-135M-Instruct | float32 | gsm8k | task rule | `h` |" in rows
    assert not any(r.startswith("| store | rows |") for r in rows)  # a header without counts
    split = {"balanced": 0}
    stores["q"]["counts"] = {
        "total": {"rows": 2455, "labelled": 2455, "accuracy": 0.078},
        "splits": {"train": {"balanced": 164}, "validation": {"balanced": 112}, "test": split},
        "capture_rows_per_s": 0.3,
    }
    rows = header_markdown(head, {}).splitlines()
    assert "| q | 2,455 | 2,455 | 0.078 | 164 / 112 / 0 | 0.30 |" in rows
    assert not any(r.startswith("| h | ") and "2,455" in r for r in rows)


def test_report_cli_writes_report_and_refuses_bad_rows(store, tmp_path):
    out = tmp_path / "r"
    args = ["report", "--store", str(store), "--out", str(out), "--only", "map_channels"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (out / "report.md").is_file() and (out / "figures" / "map_channels.png").is_file()
    bad = CliRunner().invoke(app, [*args, "--rows", "natural"])
    assert bad.exit_code == 2 and "balanced, test or all" in bad.output
