"""`generator_problem`: a detector scores only answers of the generator its maps came from."""

from __future__ import annotations

from pathlib import Path

import pytest

from actmap.llm.models import ModelSource
from actmap.maps import MapConfig
from actmap.serve.loaded_run import LoadedDetector, generator_problem


def detector(generator: dict | None) -> LoadedDetector:
    return LoadedDetector(None, "logreg:run/seed-0:abc", MapConfig(), Path("run"), "float32",
                          generator)  # fmt: skip


def folder(path: Path) -> ModelSource:
    return ModelSource(str(path), str(path), None, "local")


def test_local_folders_match_by_resolved_path(tmp_path):
    (tmp_path / "model").mkdir()
    served = folder(tmp_path / "model")
    same = detector({"name": str(tmp_path / "model" / ".." / "model"), "revision": "local"})
    assert generator_problem(same, served) is None
    other = detector({"name": str(tmp_path / "other"), "revision": "local"})
    problem = generator_problem(other, served)
    assert problem is not None and "\n" not in problem
    assert str(tmp_path / "other") in problem and str(tmp_path / "model") in problem


def test_a_gguf_matches_its_file_and_its_dequantized_folder(tmp_path):
    gguf = detector({"name": "smollm2", "revision": "b179c9", "gguf_file": "Small.Q4_1.gguf"})
    assert generator_problem(gguf, folder(tmp_path / "Small.Q4_1-b179c9")) is None
    assert generator_problem(gguf, ModelSource("x", "/m", "Small.Q4_1.gguf", "b179c9")) is None
    assert generator_problem(gguf, ModelSource("x", "/m", "Small.Q4_1.gguf", "000000")) is not None
    assert generator_problem(gguf, folder(tmp_path / "Small.Q4_1-000000")) is not None


def test_hub_ids_match_by_id_and_revision():
    hub = detector({"name": "Qwen/Qwen2.5-0.5B", "revision": "main"})
    assert generator_problem(hub, ModelSource("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", None,
                                              "main")) is None  # fmt: skip
    assert generator_problem(hub, ModelSource("Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B", None,
                                              "main")) is not None  # fmt: skip


@pytest.mark.parametrize("generator", [None, {}, {"dtype": "bfloat16"}])
def test_a_run_without_a_recorded_generator_is_not_checked(generator, tmp_path):
    assert generator_problem(detector(generator), folder(tmp_path)) is None
