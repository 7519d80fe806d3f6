"""The judge check beside every figure of a judge-labelled (CNN/DM) store in the report."""

from __future__ import annotations

import json

import numpy as np
import pytest
from report_stores import synthetic_store
from test_judge_pass import OverlapJudge, article_rows
from test_report_in_domain import write_result
from typer.testing import CliRunner

from actmap.artifacts import write_json
from actmap.cli import app
from actmap.errors import ActmapUserError
from actmap.labelling.judge_pass import CHECK_RESULT, claim_pairs, judge_check, read_judge_check
from actmap.report.inputs import read_judge_checks
from actmap.reproduce import config_from_dict
from actmap.store import MapStore
from actmap.store.rows import rows_to_score


def checked(folder, judge=None):
    """Run a real judge check into ``folder`` and write its result as the CLI does."""
    result = judge_check(judge or OverlapJudge(), claim_pairs(article_rows(12), 12), folder)
    write_json(folder / CHECK_RESULT, result.to_json())
    return result


def test_a_written_judge_check_reads_back_whole_and_bad_files_are_named(tmp_path):
    result = checked(tmp_path / "overlap")
    assert read_judge_check(tmp_path / "overlap") == result
    assert read_judge_check(tmp_path / "overlap" / CHECK_RESULT) == result
    line = result.summary()
    assert "overlap" in line and f"{result.accuracy:.3f}" in line and str(result.auroc) in line
    with pytest.raises(ActmapUserError, match="actmap judge check --out"):
        read_judge_check(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / CHECK_RESULT).write_text('{"judge": "x"}')
    with pytest.raises(ActmapUserError, match="not a judge-check result"):
        read_judge_check(tmp_path / "bad")
    checked(tmp_path / "again")  # the same judge twice: which one to show is not ours to guess
    with pytest.raises(ActmapUserError, match="two judge checks of overlap"):
        read_judge_checks([tmp_path / "overlap", tmp_path / "again"])


def test_reproduce_config_resolves_judge_checks_beside_the_config(tmp_path):
    raw = {"out": "out", "stores": [{"name": "s"}], "judge_checks": ["checks/a", "../b"]}
    config = config_from_dict(raw, tmp_path / "configs")
    assert config.judge_checks == ((tmp_path / "configs/checks/a"), (tmp_path / "b"))
    with pytest.raises(ActmapUserError, match="judge_checks"):
        config_from_dict({**raw, "judge_checks": "checks/a"}, tmp_path)


def test_report_shows_the_judge_check_beside_every_cnn_dm_figure(tmp_path):
    """A QA store and two CNN/DM stores of one generator, one labelled by a checked judge and
    one by a judge without a check: the judge-check section lists the check; the in-domain,
    paired and transfer tables (and the claims citing their rows) mark both CNN/DM stores and say, under the table, what their
    labels are worth; the QA store gets no such note."""
    qa = synthetic_store(tmp_path / "qa", generator="g", task="triviaqa", signal=2.0, seed=1)
    cnn = synthetic_store(
        tmp_path / "cnn", generator="g", task="cnn_dm", signal=2.0, seed=2, judge="overlap"
    )
    other = synthetic_store(
        tmp_path / "cnn-other", generator="g", task="cnn_dm", signal=2.0, seed=3, judge="llm:x"
    )
    rng = np.random.default_rng(0)
    for root in (qa, cnn, other):
        ids = rows_to_score(MapStore.open(root), "balanced").ids
        write_result(root, "perplexity", ids, rng.random(len(ids)), False)
    check = checked(tmp_path / "check")
    out = tmp_path / "report"
    args = ["report", "--out", str(out), "--judge-check", str(tmp_path / "check")]
    args += [a for s in (qa, cnn, other) for a in ("--store", str(s))]
    args += ["--only", "judge_check,in_domain,transfer,claims", "--seeds", "1", "--max-epochs", "2"]
    args += ["--n-resamples", "100"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    report = (out / "report.md").read_text()
    saved = json.loads((out / "json" / "judge_check.json").read_text())
    assert saved["checks"] == [json.loads(json.dumps(check.to_json()))]
    unchecked = "judge llm:x: no judge check given (labels unchecked)"
    assert saved["stores"] == {"cnn": check.summary(), "cnn-other": unchecked}
    in_domain = report.split("## Main results")[1].split("## Transfer")[0]
    transfer = report.split("## Transfer")[1].split("## The paper's claims")[0]
    claims = report.split("## The paper's claims")[1]
    auroc_table = in_domain.split("### AUROC")[1].split("###")[0]
    assert "| family | method | qa | cnn ‡ | cnn-other ‡ |" in auroc_table
    for part in (auroc_table, in_domain.split("### ActMap against")[1], transfer, claims):
        assert f"- ‡ labels of cnn: {check.summary()}" in part
        assert f"- ‡ labels of cnn-other: {unchecked}" in part
        assert "labels of qa" not in part
    cross_task = [line for line in transfer.splitlines() if line.startswith("| cross-task")]
    assert cross_task and all("cnn ‡" in line or "cnn-other ‡" in line for line in cross_task)
