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


def generator_result(name: str, auroc: float, sources: list[str], curve=()) -> OutOfDomain:
    """``tiny_result`` as another generator's: its words held out from ``sources`` with the
    generalist at ``auroc`` (RAUQ .66, paired +auroc-.66), its own ``curve`` points."""
    from dataclasses import replace

    base = tiny_result()
    words, lengths = base.held_out
    gen, rauq, ref = words.methods
    methods = [
        replace(gen, auroc=iv(auroc, auroc - 0.1, auroc + 0.1)),
        replace(rauq, vs_auroc=iv(auroc - 0.66, auroc - 0.76, auroc - 0.56)),
        ref,
    ]
    words = replace(words, sources=sources, methods=methods, curve=list(curve))
    return replace(base, generator={"name": name, "dtype": "bfloat16"}, held_out=[words, lengths])


def point(step, k, auroc, mean_correct):
    return CurvePoint(step, k, auroc, auroc, auroc, 0.05, 0.05, 0.05, 10, 0, mean_correct)


def test_four_generators_side_by_side_from_their_folders(tmp_path):
    """Four generators' folders, one of them laid out as scripts/ood-four.sh writes it (one
    held-out-TASK folder per task), one generator given twice: one column per generator, a
    task held out twice taken from the generalist trained on more tasks; and the head refit
    against recalibration binned by the rarer class's labelled answers (hand-counted)."""
    from dataclasses import replace

    curve = [
        point("recalibrate", 25, 0.81, 2.5), point("head refit", 25, 0.77, 2.5),  # rare 2.5: -.04
        point("recalibrate", 50, 0.81, 40.0), point("head refit", 50, 0.90, 40.0),  # 10: +.09
        point("recalibrate", 100, 0.81, 95.0), point("head refit", 100, 0.81, 95.0),  # 5: tie
        point("in-domain refit", 100, 0.95, 95.0),  # not compared
    ]  # fmt: skip
    smol = write(generator_result("smollm2", 0.70, ["lengths"], curve), tmp_path / "ood-smollm2")
    smol_more = write(generator_result("smollm2", 0.72, ["lengths", "digits"]),
                      tmp_path / "ood-smollm2-3")  # fmt: skip
    gemma = write(generator_result("gemma3", 0.61, ["lengths"]), tmp_path / "ood-gemma3")
    qwen05 = write(generator_result("qwen-0.5b", 0.79, ["lengths"], curve[:2]),
                   tmp_path / "ood-qwen05")  # fmt: skip
    four = generator_result("qwen-1.5b", 0.85, ["lengths", "digits", "sums"], curve[2:4])
    qwen15 = tmp_path / "ood-qwen-1.5b-4"  # scripts/ood-four.sh: one folder per held-out task
    for h in four.held_out:
        write(replace(four, held_out=[h]), qwen15 / f"held-out-{h.task}")
    runs = [smol, smol_more, gemma, qwen05, qwen15]
    computed = section.compute(context(tmp_path, runs))
    assert sorted(computed.results) == sorted(
        [str(smol), str(smol_more), str(gemma), str(qwen05),
         str(qwen15 / "held-out-lengths"), str(qwen15 / "held-out-words")]
    )  # fmt: skip
    text = section.render(computed, tmp_path / "figures")
    assert (
        "| held out | smollm2 (bfloat16) | gemma3 (bfloat16) | qwen-0.5b (bfloat16) "
        "| qwen-1.5b (bfloat16) |"
    ) in text
    assert (  # smollm2's words from the generalist trained on two tasks (.72), not one (.70)
        "| words | 0.720 / 0.660, +0.060 [-0.040, +0.160] (n=40, trained on 2) "
        "| 0.610 / 0.660, -0.050 [-0.150, +0.050] (n=40, trained on 1) "
        "| 0.790 / 0.660, +0.130 [+0.030, +0.230] * (n=40, trained on 1) "
        "| 0.850 / 0.660, +0.190 [+0.090, +0.290] * (n=40, trained on 3) |"
    ) in text
    note = "not evaluated: held out lengths: no correct answer among its 30 test rows"
    assert f"| lengths | {note} | {note} | {note} | {note} |" in text
    # the smollm2 curve was replaced with its two-task result (no curve): qwen's points count
    rows = {line.split(" | ")[1]: line for line in text.splitlines()
            if line.startswith("| all | ")}  # fmt: skip
    assert rows["0 to < 3"] == "| all | 0 to < 3 | 1 | 0 | 1 | 0 | -0.040 [-0.040, -0.040] |"
    assert rows[">= 10 (auto: head refit)"] == (
        "| all | >= 10 (auto: head refit) | 1 | 1 | 0 | 0 | +0.090 [+0.090, +0.090] |"
    )
    assert "3 to < 10" not in rows  # no point there
    assert "| qwen-1.5b (bfloat16) | >= 10 (auto: head refit) | 1 | 1 | 0 | 0 |" in text
    # without the duplicate, smollm2's own curve counts: its tie at a rarer class of 5
    alone = section.render(section.compute(context(tmp_path, [smol])), tmp_path / "f2")
    assert "| all | 3 to < 10 | 1 | 0 | 0 | 1 | +0.000 [+0.000, +0.000] |" in alone
    assert "| all | 0 to < 3 | 1 | 0 | 1 | 0 | -0.040 [-0.040, -0.040] |" in alone
