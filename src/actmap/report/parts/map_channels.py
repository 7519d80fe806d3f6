"""The report's first figure: the twelve channels of a real generation's map."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actmap.maps import MapConfig, channel_names
from actmap.report.plots import save_figure
from actmap.report.plots.maps import plot_map_channels
from actmap.report.sections import (
    ReportContext,
    Section,
    Skipped,
    figure_markdown,
    skipped_markdown,
)
from actmap.store import MapStore
from actmap.store.rows import split_labels


@dataclass(frozen=True)
class ExampleMap:
    store: str
    row_id: str
    prompt: str
    answer: str
    label: int
    channels: list[str]
    activation_map: np.ndarray  # (C, layers, coordinates) float32

    def to_json(self) -> dict:
        return {
            "store": self.store,
            "row_id": self.row_id,
            "prompt": self.prompt,
            "answer": self.answer,
            "label": self.label,
            "channels": self.channels,
            "shape": list(self.activation_map.shape),
            "map": np.round(self.activation_map, 4).tolist(),
        }


def example_map(context: ReportContext) -> ExampleMap | Skipped:
    """The first balanced-test row of the first store (a built-in store when there is one)."""

    if not context.stores:
        return Skipped("no store")
    refs = sorted(context.stores.values(), key=lambda s: (s.task != "builtin", s.name))
    ref = refs[0]
    store = MapStore.open(ref.path)
    meta = store.metadata().set_index("id")
    labelled = meta[meta["label"].notna() & (meta["split"] == "test")]
    if labelled.empty:
        return Skipped(f"{ref.name} has no labelled test row")
    key = str(labelled.index[0])
    maps, _ = store.load_maps([key])
    stored = dict(store.manifest.get("config", {}).get("map", {}))
    if stored.get("channels") is not None:
        stored["channels"] = tuple(stored["channels"])
    config = MapConfig(**stored)
    return ExampleMap(
        ref.name,
        key,
        str(meta.at[key, "prompt"]),
        str(meta.at[key, "answer"]),
        int(split_labels(store, [key])[0]),
        list(channel_names(config)),
        np.asarray(maps[0], dtype=np.float32),
    )


def render(result: ExampleMap | Skipped, figure_dir: Path) -> str:

    if isinstance(result, Skipped):
        return skipped_markdown(result)
    verdict = "correct" if result.label == 1 else "incorrect"
    figure = plot_map_channels(
        result.activation_map, result.channels, f"{result.store}, row {result.row_id} ({verdict})"
    )
    path = save_figure(figure, figure_dir / "map_channels.png")
    prompt = result.prompt.strip().replace("\n", " ")
    prompt = prompt if len(prompt) < 300 else prompt[-300:]
    caption = (
        f"The {len(result.channels)} channels of one map ({result.store}, row {result.row_id}, "
        f"answer labelled {verdict}); rows are depth (layers pooled to "
        f"{result.activation_map.shape[1]}), columns pooled hidden coordinates"
    )
    return f"Prompt (end): `{prompt}`\n\nAnswer: `{result.answer.strip()}`\n\n" + figure_markdown(
        path, caption
    )


SECTION = Section("map_channels", "A real generation's map", example_map, render)
