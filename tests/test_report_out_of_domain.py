"""The report's out_of_domain section: a hand-written result (two held-out tasks, one with a
first-labels curve) written as `actmap out-of-domain` writes it, read back unchanged, and
rendered with its numbers, its figure and the folders it came from; no folder, or a folder
without a result, is said so in the report."""

from __future__ import annotations

import json

import pytest

from actmap.experiments.out_of_domain import (
    Calibration,
    CurvePoint,
    HeldOut,
    MethodResult,
    OutOfDomain,
    OutOfDomainConfig,
    from_json,
    read_out_of_domain,
)
from actmap.report.parts import out_of_domain as section
from actmap.report.registry import select_sections
from actmap.report.sections import ReportContext, Skipped
from actmap.scoring.intervals import Interval


def iv(estimate, low, high, n=40):
    return Interval(estimate, low, high, n, 100)


def tiny_result() -> OutOfDomain:
    cal = Calibration(0.30, iv(0.12, 0.10, 0.14, 300), 0.02, 0.21)
    words = HeldOut(
        "words", "stores/words", ["lengths"], n_test=40, n_test_all=300, test_prevalence=0.1,
        n_train_all=500,
        methods=[
            MethodResult("generalist", "generalist", iv(0.81, 0.70, 0.90), iv(0.40, 0.1, 0.6),
                         None, None, cal),
            MethodResult("rauq", "label-free", iv(0.66, 0.55, 0.77), iv(0.20, 0.0, 0.4),
                         iv(0.15, 0.05, 0.25), iv(0.20, -0.1, 0.5), None),
            MethodResult("in-domain stacked", "in-domain (reference)", iv(0.90, 0.84, 0.95),
                         iv(0.7, 0.5, 0.9), iv(-0.09, -0.2, 0.01), iv(-0.3, -0.5, -0.1), cal),
        ],
        curve=[
            CurvePoint("recalibrate", 0, 0.81, 0.81, 0.81, 0.12, 0.12, 0.12, 1, 0, 0.0),
            CurvePoint("recalibrate", 25, 0.81, 0.81, 0.81, 0.04, 0.02, 0.09, 3, 0, 2.5),
            CurvePoint("head refit", 25, 0.77, 0.60, 0.85, 0.05, 0.02, 0.10, 3, 1, 2.5),
        ],
        in_domain={"auroc": 0.90, "ece": 0.03},
        generalist={"selected": ["map+scalars"]},
    )  # fmt: skip
    lengths = HeldOut("lengths", "stores/lengths", ["words"],
                      note="held out lengths: no correct answer among its 30 test rows")  # fmt: skip
    config = OutOfDomainConfig(curve_k=(0, 25), draws=3, n_resamples=100)
    return OutOfDomain({"name": "tiny-llama", "dtype": "float32"}, "deployable", config,
                       [words, lengths])  # fmt: skip


def write(result: OutOfDomain, folder):
    folder.mkdir(parents=True)
    (folder / "out_of_domain.json").write_text(json.dumps(result.to_json()))
    return folder


def context(tmp_path, runs):
    return ReportContext(stores={}, runs={}, out=tmp_path / "out", scratch=tmp_path / "s",
                         options={"out_of_domain": {"runs": runs}})  # fmt: skip


def test_a_result_reads_back_as_written():
    result = tiny_result()
    again = from_json(json.loads(json.dumps(result.to_json())))
    assert again.held_out[0] == result.held_out[0]  # (the other's prevalence is NaN)
    assert json.dumps(again.to_json()) == json.dumps(result.to_json())
    assert again.to_markdown() == result.to_markdown()


def test_the_section_renders_the_tables_and_the_curve(tmp_path):
    folder = write(tiny_result(), tmp_path / "ood-tiny")
    assert [s.name for s in select_sections(["out_of_domain"])] == ["out_of_domain"]
    computed = section.compute(context(tmp_path, [folder, tmp_path / "nothing"]))
    assert not isinstance(computed, Skipped)
    figures = tmp_path / "figures"
    text = section.render(computed, figures)
    # the held-out row: the generalist, RAUQ, the paired difference beyond the noise (*)
    assert (
        "| tiny-llama | words | lengths | 40 | 0.810 [0.700, 0.900] | 0.660 [0.550, 0.770] "
        "| +0.150 [+0.050, +0.250] * | 0.400 | 0.200 | 0.900 [0.840, 0.950] |"
    ) in text
    assert "| tiny-llama | lengths | words | - | held out lengths: no correct answer" in text
    # the first labels: AUROC (ECE) per step and k; a step not run at a k is "-"
    assert "| step | k = 0 | k = 25 |" in text
    assert "| recalibrate | 0.810 (0.120) | 0.810 (0.040) |" in text
    assert "| head refit | - | 0.770 (0.050) |" in text
    assert "in-domain detector on all of them: AUROC 0.900, ECE 0.030" in text
    assert (figures / "out_of_domain_0.png").stat().st_size > 0
    assert f"`{folder}`" in text
    assert "not read:" in text and "nothing holds no out_of_domain.json" in text
    assert json.loads(json.dumps(computed.to_json()))["runs"][str(folder)]["preset"] == "deployable"


def test_the_section_says_so_when_no_result_is_there(tmp_path):
    none = section.compute(context(tmp_path, []))
    assert isinstance(none, Skipped) and "--out-of-domain" in none.reason
    assert "_Skipped: no `actmap out-of-domain` results given" in section.render(none, tmp_path)
    empty = section.compute(context(tmp_path, [tmp_path / "empty"]))
    assert isinstance(empty, Skipped) and "empty holds no out_of_domain.json" in empty.reason
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "out_of_domain.json").write_text('{"generator": {}}')
    with pytest.raises(Exception, match="not a result of `actmap out-of-domain`"):
        read_out_of_domain(tmp_path / "bad")
