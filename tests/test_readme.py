"""The README's Python API and command-line sections run as written (embedded model, small sizes)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from test_user_path import prompt_lines
from typer.testing import CliRunner

from actmap.cli import app

README = Path(__file__).resolve().parents[1] / "README.md"
# small sizes for the test only: fewer new tokens, one seed, two epochs
SMALL = {"capture": ["--max-new-tokens", "8"], "train": ["--seeds", "42", "--max-epochs", "2"]}


def section_blocks(title: str, language: str) -> list[str]:
    """The ``language`` code blocks of the README section headed ``## <title>``."""
    text = README.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README has no section '{title}'"
    return re.findall(rf"```{language}\n(.*?)```", match.group(1), re.S)


def test_the_sections_have_the_blocks_this_test_runs():
    assert len(section_blocks("The Python API", "python")) == 3
    assert len(section_blocks("The command line", "bash")) == 1


def test_predict_proba_takes_a_list_an_array_or_a_tensor():
    from actmap.detectors import CorrectnessDetector
    from actmap.training.recipe import TrainConfig

    rng = np.random.default_rng(0)
    maps = rng.standard_normal((12, 12, 32, 128)).astype(np.float32)
    labels = np.arange(12) % 2
    maps[labels == 1, 0] += 1.0
    config = TrainConfig(max_epochs=2, seeds=(0,))
    detector = CorrectnessDetector("logreg", config=config).fit(maps, labels, maps, labels)
    stacked = detector.predict_proba(maps)
    as_list = detector.predict_proba([torch.from_numpy(m) for m in maps])  # what build_map gives
    as_arrays = detector.predict_proba(list(maps))
    as_tensor = detector.predict_proba(torch.from_numpy(maps))
    expected = 1 / (1 + np.exp(-detector.decision_function(maps)))  # independent sigmoid
    np.testing.assert_allclose(stacked, expected, rtol=1e-5, atol=1e-6)
    for other in (as_list, as_arrays, as_tensor):
        np.testing.assert_array_equal(other, stacked)
    with pytest.raises(ValueError, match="empty"):
        detector.predict_proba([])


def answers_lines():
    """Answers made elsewhere, both labels in every split."""
    return [
        {
            "prompt": r["prompt"],
            "answer": r["answers"][0],
            "label": int(i % 2 == 0),
            "split": r["split"],
        }
        for i, r in enumerate(prompt_lines())
    ]


@pytest.mark.real_model
def test_readme_runs_as_written(tmp_path, monkeypatch, smollm2):
    monkeypatch.chdir(tmp_path)
    Path("my-prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompt_lines()))
    Path("my-answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in answers_lines()))
    runner = CliRunner()
    (commands,) = section_blocks("The command line", "bash")
    for line in commands.splitlines():
        args = shlex.split(line, comments=True)
        if not args:
            continue
        assert args[0] == "actmap", line
        result = runner.invoke(app, [*args[1:], *SMALL.get(args[1], [])])
        assert result.exit_code == 0, (line, result.output)
    assert json.loads(Path("runs/mine-mlp/evaluation.json").read_text())["detector"] == "mlp"
    assert (
        Path("stores/mine/compare.md").is_file()
        and Path("stores/mine-8seg/manifest.json").is_file()
    )

    namespace: dict = {}
    api, existing, training = section_blocks("The Python API", "python")
    exec(compile(api, "README.md (Python API)", "exec"), namespace)
    assert [m.shape for m in namespace["maps"]] == [(12, 32, 128)] * 2
    p = namespace["p_correct"]
    assert p.shape == (2,) and ((p >= 0) & (p <= 1)).all()
    exec(compile(existing, "README.md (existing answers)", "exec"), namespace)
    tokenizer = namespace["tokenizer"]
    assert [r.token_ids for r in namespace["records"]] == [
        tokenizer(a, add_special_tokens=False)["input_ids"] for a in ("12", "Paris")
    ]
    exec(compile(training, "README.md (training)", "exec"), namespace)
    detector = namespace["detector"]
    assert detector.best_epoch_ >= 0 and len(detector.history_) >= 1
