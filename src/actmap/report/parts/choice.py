"""Which store and which detectors the analysis sections (ablations, learning curve,
localization, calibration) read.

Each runs on the store with the most balanced rows (the learning curve on the two largest),
unless ``[report.<section>] store = "<name>"`` names one; ActMap detectors come from the
context's runs of that store, else they are trained here. Nothing is written into a store:
splits are read with ``persist=False``; fits stay in memory or in the scratch folder.
"""

from __future__ import annotations

from pathlib import Path

from actmap.report.sections import ReportContext, StoreRef


def read_only_splits(store) -> dict[str, list[str]]:
    """The store's balanced {split: ids}, computed without writing into it."""
    from actmap.rows import balanced_splits

    return balanced_splits(store, persist=False)


def balanced_rows(ref: StoreRef) -> int:
    """Balanced rows of a store (all splits), computed without writing into it."""
    return sum(len(v) for v in read_only_splits(open_store(ref)).values())


def largest_stores(
    context: ReportContext, section: str, count: int = 1, table: str | None = None
) -> list[StoreRef]:
    """The ``count`` stores with the most balanced rows (holding ``table`` when given), or
    the one ``[report.<section>] store`` names."""
    from actmap.store import MapStore

    named = context.option(section, "store")
    if named is not None:
        return [context.stores[named]] if named in context.stores else []
    refs = [
        ref
        for ref in context.stores.values()
        if table is None or MapStore.open(ref.path).has_table(table)
    ]
    return sorted(refs, key=lambda r: (-balanced_rows(r), r.name))[:count]


def open_store(ref: StoreRef):
    from actmap.store import MapStore

    return MapStore.open(ref.path)


def frozen_detector(context: ReportContext, ref: StoreRef, detector: str, train, val):
    """Seed ``context.seeds[0]`` of the context's run of ``detector`` on ``ref``, else one
    trained here on the balanced rows (saved under the scratch folder)."""
    from actmap.detectors import load_detector
    from actmap.experiments.runs import recipe_config, run_seeds

    seed = context.seeds[0]
    run = context.runs.get(ref.name, {}).get(detector)
    if run is not None and (Path(run) / f"seed-{seed}").is_dir():
        return load_detector(Path(run) / f"seed-{seed}")
    out = Path(context.scratch) / "localization" / ref.name / detector
    runs = run_seeds(
        train,
        val,
        val,
        out,
        detector=detector,
        config=recipe_config(context.max_epochs),
        seeds=(seed,),
    )
    return runs.runs[0].detector


def balanced_maps(store):
    from actmap.experiments.runs import LabeledMaps

    out = {}
    for split, ids in read_only_splits(store).items():
        maps, meta = store.load_maps(ids)
        out[split] = LabeledMaps(maps, meta["label"].to_numpy(dtype="int64"), ids)
    return out
