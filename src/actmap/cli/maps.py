"""``actmap build-maps``: rebuild a store's maps from its stored trajectories."""

from __future__ import annotations

from pathlib import Path

import typer

from actmap.cli.app import app
from actmap.cli.common import console, parse_resolution, progress_bar, user_errors


@app.command("build-maps")
def build_maps_command(
    store_path: Path = typer.Option(
        ..., "--store", help="A store captured with --keep-trajectories."
    ),
    out: Path = typer.Option(
        ..., "--out", "-o", help="Folder of the new map store (train and evaluate read it)."
    ),
    segments: int = typer.Option(4, min=1, help="Segment means: 1, 4 or 8."),
    resolution: str = typer.Option(
        "32x128",
        callback=parse_resolution,
        help="Layers x coordinates, e.g. 16x64, 32x128, 64x256.",
    ),
    channels: str = typer.Option(None, help="Comma-separated channel names to keep (default all)."),
    normalization: str = typer.Option("channel", help="channel | global"),
) -> None:
    """Rebuild maps from stored trajectories with other operator settings (ablations)."""
    with user_errors():
        from actmap.maps import MapConfig
        from actmap.store import MapStore
        from actmap.store.derived import build_map_store

        layers_out, coords_out = resolution
        config = MapConfig(
            n_segments=segments,
            layers_out=layers_out,
            coords_out=coords_out,
            channels=tuple(c.strip() for c in channels.split(",")) if channels else None,
            normalization=normalization,
        )
        source = MapStore.open(store_path)
        with progress_bar() as bar:
            job = bar.add_task("build maps", total=len(source.ids("trajectories")), info="")
            store = build_map_store(source, out, config, progress=lambda n: bar.advance(job, n))
        console.print(
            f"wrote {len(store.ids())} maps of shape {store.map_shape} to the store {out}"
        )
