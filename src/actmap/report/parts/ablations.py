"""The ablation section: `actmap.experiments.ablations` on the store with the most balanced
rows that holds trajectories."""

from __future__ import annotations

from pathlib import Path

from actmap.experiments.ablations import (
    DEFAULT_VARIANTS,
    AblationConfig,
    recapture_hidden,
    run_ablations,
)
from actmap.llm.models import load_model, stored_dtype
from actmap.report.parts.choice import largest_stores, open_store, read_only_splits, same_fit
from actmap.report.plots import save_figure
from actmap.report.plots.ablations import plot_ablations
from actmap.report.sections import (
    ReportContext,
    Section,
    Skipped,
    figure_markdown,
    skipped_markdown,
)


def compute_ablations(context: ReportContext):

    refs = largest_stores(context, "ablations", table="trajectories")
    if not refs:
        return Skipped("no store with trajectories (capture with --keep-trajectories)")
    variants = context.option("ablations", "variants", DEFAULT_VARIANTS)
    config = AblationConfig(
        detector=context.option("ablations", "detector", "mlp"),
        seeds=context.seeds,
        max_epochs=context.max_epochs,
        vit_max_epochs=context.option("ablations", "vit_max_epochs"),
        variants=tuple(variants),
        n_resamples=context.n_resamples,
    )
    store = open_store(refs[0])
    splits = read_only_splits(store)
    hidden = None
    if context.option("ablations", "recapture", True):
        with context.timings.measure("ablations/recapture"):
            hidden = unpooled_states(store, splits, context.device)
    with context.timings.measure("ablations/" + refs[0].name):
        known = known_fits(context, refs[0], config)
        return run_ablations(store, config, hidden=hidden, splits=splits, known=known)


def known_fits(context: ReportContext, ref, config) -> dict:
    """{variant: test scores} of the reference and classifier variants that are the report's
    ActMap detectors (the same detector, recipe, seeds and rows): read, not trained again."""
    found = {}
    for name in config.variants:
        if name != "full" and not name.startswith("classifier_"):
            continue
        detector = config.detector if name == "full" else name.removeprefix("classifier_")
        scores = same_fit(context, ref, detector, config.recipe(detector), config.seeds)
        if scores is not None:
            found[name] = scores
    return found


def unpooled_states(store, splits: dict, device: str | None):
    """The balanced rows' unpooled states by a teacher-forced pass of the store's generator,
    or None (the pooling controls then read the dense states) when it cannot be loaded."""
    import logging

    config = store.manifest.get("config", {})
    name = config.get("model", {}).get("name")
    if not name:
        return None
    try:
        model, tokenizer, _ = load_model(name, device=device or "cpu", dtype=stored_dtype(config))
    except Exception as error:  # noqa: BLE001 -- the controls fall back to the dense states
        logging.getLogger(__name__).warning(
            "cannot load %s (%s): pooling controls use dense", name, error
        )
        return None
    ids = [k for keys in splits.values() for k in keys]
    return recapture_hidden(store, ids, model, tokenizer)


def render_ablations(result, figure_dir: Path) -> str:

    if isinstance(result, Skipped):
        return skipped_markdown(result)
    path = save_figure(plot_ablations(result), figure_dir / "ablations.png")
    c = result.config
    source = (
        "re-captured by one teacher-forced pass of the generator over every stored answer"
        if result.pooling_source == "hidden"
        else "the stored dense states: 8 max-pooled layer groups, first 100 tokens"
    )
    caption = (
        f"Seed-mean test AUROC per variant ({len(c.seeds)} seeds, {c.detector} on the map "
        f"variants), 95% bootstrap interval over the {result.rows['test']} balanced test rows."
    )
    return (
        f"Store `{Path(result.store).name}`, balanced rows {result.rows}. Every variant trains "
        f"seeds {list(c.seeds)} on the same rows (recipe epochs: "
        f"{c.max_epochs or 80}; ViT {c.vit_max_epochs or c.max_epochs or 80}). Δ is the "
        "paired bootstrap interval of the seed-mean AUROC difference to the reference "
        "(the store's maps; for the pooling controls, contiguous pooling of the same "
        f"unpooled states, here {source}).\n\n"
        + result.to_markdown()
        + "\n"
        + figure_markdown(path, caption)
    )


SECTION = Section("ablations", "Ablations and controls", compute_ablations, render_ablations)
