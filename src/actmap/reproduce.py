"""The paper's evaluation as one resumable chain: capture -> copy -> baselines -> train -> report.

    config = load_config("reproduce.toml")
    for stage in plan(config):                     # each stage knows whether it is done
        if not stage.done(): stage.run(progress)

Everything is written under ``config.out``: ``stores/<name>`` (a copy of each store,
hard-linked where possible, that baselines write their results into; the source store is
only read), ``runs/<name>/<detector>/seed-<s>/`` and ``report/``. A stage that finished
leaves ``state/<stage>.json`` (with the settings it ran with); a later call skips it
while the settings are unchanged, so a killed run resumes where it stopped.
A store that does not exist is captured first, from its ``[stores.capture]`` table (the
fields of `actmap.capture.job.CaptureJob`, checked when the config is read), by
`actmap.capture.job.capture_store`, as ``actmap capture`` does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tomllib
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from actmap.artifacts import read_json, write_json
from actmap.baselines.options import BaselineOptions
from actmap.baselines.runner import run_baselines
from actmap.capture.job import CaptureJob, CaptureProgress, capture_store
from actmap.detectors import ALIASES, all_detectors, detector_name
from actmap.errors import ActmapUserError
from actmap.experiments.seeds import recipe_config, train_on_store
from actmap.experiments.stacked import train_plus_run
from actmap.report.assemble import build_report
from actmap.report.inputs import find_runs, read_judge_checks, store_refs
from actmap.report.registry import select_sections
from actmap.report.sections import ReportContext, check_rows
from actmap.store import MapStore
from actmap.store.lock import StoreLocked, acquire
from actmap.training.run_folder import (
    ONE_FIT_SEED,
    extend_run_record,
    prepare_run_folder,
    seed_finished,
)

log = logging.getLogger(__name__)

# progress(completed, total, info)
Progress = Callable[[int, int, str], None]

DETECTORS = ("vit", "mlp", "logreg")
SINGLE_PASS = ("perplexity", "mean_token_entropy", "answer_length", "rauq", "tad")


@dataclass(frozen=True)
class StoreSpec:
    """One (generator, task) store: ``path`` is read (and captured first when ``capture``
    holds `CaptureJob` options and the store is missing)."""

    name: str
    path: Path
    capture: dict[str, Any] | None = None
    baselines: tuple[str, ...] = SINGLE_PASS


@dataclass(frozen=True)
class ReproduceConfig:
    out: Path
    stores: tuple[StoreSpec, ...]
    detectors: tuple[str, ...] = DETECTORS
    seeds: tuple[int, ...] = (42, 123, 456)
    max_epochs: int | None = None  # None: the paper's recipe
    device: str | None = None
    n_resamples: int = 2000
    rows: str = "balanced"
    sections: tuple[str, ...] | None = None  # None: every section
    baseline_options: dict[str, Any] = field(default_factory=dict)  # BaselineOptions fields
    report_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per section
    judge_checks: tuple[Path, ...] = ()  # `actmap judge check` folders, read by the report

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), default=str))


def _tuple(value, name: str) -> tuple:
    if not isinstance(value, list | tuple):
        raise ActmapUserError(f"reproduce config: '{name}' must be a list, got {value!r}")
    return tuple(value)


def load_config(path: str | Path) -> ReproduceConfig:
    """Read a reproduce TOML file; relative paths are relative to the file's folder."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ActmapUserError(f"reproduce config {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ActmapUserError(f"reproduce config {path} is not valid TOML: {error}") from None
    return config_from_dict(raw, path.resolve().parent)


def config_from_dict(raw: dict[str, Any], base: Path) -> ReproduceConfig:
    known = {f.name for f in fields(ReproduceConfig)} - {"report_options"} | {"report"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ActmapUserError(f"reproduce config: unknown key(s) {unknown}; known: {sorted(known)}")
    if "out" not in raw or not raw.get("stores"):
        raise ActmapUserError("reproduce config needs 'out' and at least one [[stores]] table")
    stores = []
    for entry in raw["stores"]:
        extra = sorted(set(entry) - {"name", "path", "capture", "baselines"})
        if extra or "name" not in entry:
            raise ActmapUserError(
                f"reproduce config: a [[stores]] table needs 'name' (and 'path'); unknown {extra}"
            )
        # resolved: a stage's fingerprint names the store, so two spellings of one folder
        # (``../stores/x`` from configs/ and from runs/) must not read as two stores
        store_path = (base / entry.get("path", Path("stores") / entry["name"])).resolve()
        baselines = _tuple(entry.get("baselines", list(SINGLE_PASS)), "baselines")
        if entry.get("capture") is not None:  # a misspelt option fails now, not hours later
            CaptureJob.from_options(store_path, entry["capture"])
        stores.append(StoreSpec(entry["name"], store_path, entry.get("capture"), baselines))
    names = [s.name for s in stores]
    if len(set(names)) != len(names):
        raise ActmapUserError(f"reproduce config: store names repeat: {names}")
    report = dict(raw.get("report", {}))
    sections = report.pop("sections", None)
    detectors = _tuple(raw.get("detectors", list(DETECTORS)), "detectors")

    known = (*all_detectors(), *ALIASES)  # `actmap.detectors.catalog`: one name each
    bad = [d for d in detectors if d not in known]
    if bad:
        raise ActmapUserError(
            f"reproduce config: unknown detector(s) {bad}; known: {', '.join(known)}"
        )

    return ReproduceConfig(
        out=(base / raw["out"]).resolve(),
        stores=tuple(stores),
        detectors=detectors,
        seeds=tuple(int(s) for s in _tuple(raw.get("seeds", [42, 123, 456]), "seeds")),
        max_epochs=raw.get("max_epochs"),
        device=raw.get("device"),
        n_resamples=int(raw.get("n_resamples", 2000)),
        rows=check_rows(raw.get("rows", "balanced")),
        sections=None if sections is None else _tuple(sections, "report.sections"),
        baseline_options=dict(raw.get("baseline_options", {})),
        report_options={k: dict(v) for k, v in report.items()},
        judge_checks=tuple(
            (base / p).resolve() for p in _tuple(raw.get("judge_checks", []), "judge_checks")
        ),
    )


def select_stores(config: ReproduceConfig, names: Sequence[str]) -> ReproduceConfig:
    """The config restricted to the named stores (in the config's order), for running the
    stores that exist while others are still being captured; the report then reads only
    these. No names: the config unchanged."""
    if not names:
        return config
    known = [s.name for s in config.stores]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ActmapUserError(f"reproduce: no store named {unknown} in the config; it has {known}")
    return replace(config, stores=tuple(s for s in config.stores if s.name in names))


# --- stages ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One step of the chain. ``settings`` is what makes its result valid: a change re-runs it."""

    name: str  # e.g. "train/smollm2-builtin/vit"
    settings: Callable[[], dict[str, Any]]  # read when asked: a capture stage changes the copy's
    work: Callable[[Progress], Any]
    state_dir: Path
    ready: Callable[[], bool] = lambda: True  # its own completeness check (beyond the marker)
    store: str | None = None  # the store it works on
    renews_store: bool = False  # capture / copy: when it runs, the later stages of its store do too

    @property
    def marker(self) -> Path:
        return self.state_dir / (self.name.replace("/", "__") + ".json")

    def fingerprint(self) -> str:
        text = json.dumps(self.settings(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def done(self) -> bool:
        recorded = (read_json(self.marker) or {}).get("fingerprint")
        return recorded == self.fingerprint() and self.ready()

    def run(self, progress: Progress) -> Any:
        result = self.work(progress)
        write_json(
            self.marker,
            {"stage": self.name, "fingerprint": self.fingerprint(), "settings": self.settings()},
        )
        return result


# Manifest keys that log what was done to a store without changing its rows: a capture that
# resumes a finished store appends a run record with nothing written.
LOG_KEYS = ("runs",)
# What a reader derives from the rows and writes back (`actmap train` on the source store
# writes its balanced split): a function of the rows, so the copy derives the same itself.
DERIVED_KEYS = ("balanced",)
DERIVED_TABLES = ("splits",)


def source_content(path: Path) -> str | None:
    """A digest of the store's manifest without its log keys and derived tables: what the
    copy holds. It changes when shards, config or results change, not when a no-op capture
    run is logged or a training run writes the balanced split into the source."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return None
    try:
        data = json.loads(manifest.read_text())
    except ValueError:
        return None
    kept = {k: v for k, v in data.items() if k not in LOG_KEYS + DERIVED_KEYS}
    if isinstance(kept.get("shards"), dict):
        kept["shards"] = {k: v for k, v in kept["shards"].items() if k not in DERIVED_TABLES}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def link_copy(source: Path, target: Path) -> None:
    """A copy of a store whose immutable shards are hard links (a copy where links fail);
    the manifest is copied, and the writer lock is left behind."""
    if target.exists():
        shutil.rmtree(target)

    def link(src: str, dst: str) -> None:
        if Path(src).name in ("manifest.json",):
            shutil.copy2(src, dst)
            return
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(
        source, target, copy_function=link, ignore=shutil.ignore_patterns("writer.lock")
    )


def copy_holds_source(source: Path, target: Path) -> bool:
    """``target`` is a copy of ``source`` as it is now: the same config, and every table of the
    source (but the derived ones) listed with the same shards. Such a copy needs no new link
    even when its stage marker is lost, and keeps what later stages wrote into it."""
    ours, theirs = read_json(source / "manifest.json"), read_json(target / "manifest.json")
    if ours is None or theirs is None:
        return False
    shards = {k: v for k, v in (ours.get("shards") or {}).items() if k not in DERIVED_TABLES}
    copied = theirs.get("shards") or {}
    return (
        bool(shards)
        and ours.get("config") == theirs.get("config")
        and all(copied.get(table) == listed for table, listed in shards.items())
    )


def store_is_complete(path: Path) -> bool:
    """A store exists and no writer holds it (a capture in progress holds ``writer.lock``)."""

    if not (path / "manifest.json").is_file():
        return False
    try:
        MapStore.open(path)
    except ActmapUserError:
        return False
    return not _lock_held(path / "writer.lock")


def _lock_held(lock: Path) -> bool:
    import fcntl

    if not lock.exists():
        return False
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False


def copy_path(config: ReproduceConfig, spec: StoreSpec) -> Path:
    return config.out / "stores" / spec.name


def run_path(config: ReproduceConfig, spec: StoreSpec, detector: str) -> Path:
    """A detector's run folder: its name, a version's colon as a dash (actmap-plus-full)."""
    return config.out / "runs" / spec.name / detector.replace(":", "-")


def plan(config: ReproduceConfig, report: bool = True) -> list[Stage]:
    """Every stage in order: per store capture (if needed), copy, baselines, training; then
    the report, unless ``report`` is false (calls that each run some stores in parallel, and
    one report over all of them afterwards)."""
    state = config.out / "state"
    stages: list[Stage] = []
    for spec in config.stores:
        if spec.capture is not None:
            stages.append(capture_stage(spec, state))
        stages.append(copy_stage(config, spec, state))
        if spec.baselines:
            stages.append(baselines_stage(config, spec, state))
        stages += [train_stage(config, spec, d, state) for d in config.detectors]
    if report:
        stages.append(report_stage(config, state))
    return stages


class StageProgress(CaptureProgress):
    """A capture's progress as a stage's ``progress(done, total, info)``."""

    def __init__(self, progress: Progress) -> None:
        self.progress, self.done, self.total, self.task = progress, 0, 0, ""

    def start(self, task: str, total: int) -> None:
        self.total, self.task = total, task
        self.progress(0, total, task)

    def advance(self, n: int) -> None:
        self.done += n
        self.progress(self.done, self.total, self.task)

    resume = advance


def capture_stage(spec: StoreSpec, state: Path) -> Stage:
    def work(progress: Progress) -> None:
        capture_store(
            CaptureJob.from_options(spec.path, spec.capture or {}), StageProgress(progress)
        )

    return Stage(
        f"capture/{spec.name}",
        lambda: {"path": str(spec.path), "capture": spec.capture},
        work,
        state,
        ready=lambda: store_is_complete(spec.path),
        store=spec.name,
        renews_store=True,
    )


def copy_stage(config: ReproduceConfig, spec: StoreSpec, state: Path) -> Stage:
    target = copy_path(config, spec)

    def work(progress: Progress) -> None:
        if not store_is_complete(spec.path):
            raise ActmapUserError(
                f"store {spec.path} does not exist or is still being written (writer.lock held)"
            )
        if copy_holds_source(spec.path, target):
            # the marker went, not the rows: the copy's baseline results stay, and the later
            # stages find their finished work (methods with results, seeds with the same key)
            log.info("copy/%s: %s already holds the rows of %s; kept", spec.name, target, spec.path)
            progress(1, 1, "kept (it holds the source's rows)")
            return
        progress(0, 1, f"{spec.path} -> {target}")
        link_copy(spec.path, target)
        progress(1, 1, "")

    def settings() -> dict[str, Any]:
        return {"source": str(spec.path), "content": source_content(spec.path)}

    return Stage(
        f"copy/{spec.name}",
        settings,
        work,
        state,
        ready=lambda: (target / "manifest.json").is_file(),
        store=spec.name,
        renews_store=True,
    )


def baselines_stage(config: ReproduceConfig, spec: StoreSpec, state: Path) -> Stage:
    def work(progress: Progress) -> None:

        options = BaselineOptions(**{"device": config.device, **config.baseline_options})
        store = MapStore.open(copy_path(config, spec))
        names = list(spec.baselines)

        def on_progress(method: str, n: int, total: int, info: str = "") -> None:
            # the current method's rows (the bar starts over with each method)
            which = f" ({names.index(method) + 1}/{len(names)})" if method in names else ""
            progress(n, total, f"{method}{which} {info}".rstrip())

        try:
            results = run_baselines(store, names, options=options, progress=on_progress)
        finally:
            store.close()
        failed = {k: r.reason for k, r in results.items() if r.status == "failed"}
        for method, reason in failed.items():
            log.warning("baseline %s failed on %s: %s", method, spec.name, reason)
        progress(len(names), len(names), ", ".join(f"{k}: {r.status}" for k, r in results.items()))

    def ready() -> bool:
        """Every method has results in the copy (a call killed mid-stage, or an older copy's
        marker, leaves one without)."""

        target = copy_path(config, spec)
        if not (target / "manifest.json").is_file():
            return False
        store = MapStore.open(target)
        return all(store.has_table(f"results/{method}") for method in spec.baselines)

    return Stage(
        f"baselines/{spec.name}",
        lambda: {"methods": list(spec.baselines), "options": config.baseline_options},
        work,
        state,
        ready=ready,
        store=spec.name,
    )


TRAIN_KEY = "stage-key.json"  # in a train stage's run folder: what its finished seeds hold for


def train_stage(config: ReproduceConfig, spec: StoreSpec, detector: str, state: Path) -> Stage:
    out = run_path(config, spec, detector)

    name = detector_name(detector)
    if name.startswith("actmap-plus:") and name != "actmap-plus:v1":  # a stacked preset
        return plus_stage(config, spec, detector, state)
    plus = name == "actmap-plus:v1"  # one fit, settings chosen on validation: no seeds, no recipe

    def seeds() -> tuple[int, ...]:

        return (ONE_FIT_SEED,) if plus else config.seeds

    def work(progress: Progress) -> None:

        if plus:
            key = {"settings": settings(), "source": source_content(spec.path)}
            prepare_run_folder(out, "actmap-plus", None, overwrite=True)  # what it saves
            progress(0, 1, "fitting actmap-plus")
            train_plus_run(copy_path(config, spec), out)
            write_json(out / TRAIN_KEY, key)
            progress(1, 1, "")
            return
        recipe = recipe_config(config.max_epochs)
        # a killed stage keeps the seeds it finished and the epoch checkpoint of the one it
        # was training, if nothing it was trained on has changed since (the source store's
        # rows, the recipe, the seeds, the device)
        key = {
            "settings": settings(),
            "recipe": recipe.to_dict(),
            "source": source_content(spec.path),
        }
        same = read_json(out / TRAIN_KEY) == key
        kept = [s for s in config.seeds if same and seed_finished(out, s)]
        if not same:  # another run's folder, or none
            prepare_run_folder(out, detector, recipe.to_dict(), overwrite=True)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / TRAIN_KEY, key)
        todo = [s for s in config.seeds if s not in kept]
        if kept:
            log.info("train/%s/%s: seeds %s kept from a killed run", spec.name, detector, kept)
        total = recipe.max_epochs * len(config.seeds)
        finished = {s: recipe.max_epochs for s in kept}

        def on_epoch(epoch: int, info: dict) -> None:
            finished[int(info["seed"])] = epoch + 1
            auroc = info.get("val_auroc", float("nan"))
            progress(sum(finished.values()), total, f"seed {info['seed']} val AUROC {auroc:.3f}")

        if todo:
            train_on_store(
                copy_path(config, spec), detector, todo, out, recipe, config.device, on_epoch
            )
        extend_run_record(out)
        progress(total, total, "")

    def settings() -> dict[str, Any]:
        if plus:
            return {"seeds": list(seeds())}
        return {
            "seeds": list(config.seeds),
            "max_epochs": config.max_epochs,
            "device": config.device,
        }

    def ready() -> bool:
        # finished seeds, of the rows the source holds now (a run folder without a key
        # predates the key, and is taken as it is)
        key = read_json(out / TRAIN_KEY)
        current = key is None or key.get("source") == source_content(spec.path)
        return current and all(seed_finished(out, s) for s in seeds())

    return Stage(
        f"train/{spec.name}/{detector}",
        settings,
        work,
        state,
        ready=ready,
        store=spec.name,
    )


def plus_stage(config: ReproduceConfig, spec: StoreSpec, detector: str, state: Path) -> Stage:
    """One stacked actmap-plus preset on a store's copy: no epochs, no seeds (seed-0)."""
    out = run_path(config, spec, detector)

    def work(progress: Progress) -> None:

        prepare_run_folder(out, "actmap-plus", None, overwrite=True)
        progress(0, 1, detector)
        train_plus_run(copy_path(config, spec), out, detector.split(":", 1)[1])
        write_json(out / TRAIN_KEY, {"source": source_content(spec.path)})
        progress(1, 1, "")

    def ready() -> bool:
        key = read_json(out / TRAIN_KEY)
        return (
            key is not None
            and key.get("source") == source_content(spec.path)
            and seed_finished(out, ONE_FIT_SEED)
        )

    return Stage(f"train/{spec.name}/{detector}", dict, work, state, ready=ready, store=spec.name)


def report_context(config: ReproduceConfig):

    refs = store_refs([copy_path(config, s) for s in config.stores])
    return ReportContext(
        stores=refs,
        runs=find_runs(config.out / "runs", refs) if (config.out / "runs").is_dir() else {},
        out=config.out / "report",
        scratch=config.out / "scratch",
        seeds=config.seeds,
        rows=config.rows,  # type: ignore[arg-type]
        n_resamples=config.n_resamples,
        device=config.device,
        max_epochs=config.max_epochs,
        options=config.report_options,
        judge_checks=read_judge_checks(config.judge_checks),
    )


def report_stage(config: ReproduceConfig, state: Path) -> Stage:
    def work(progress: Progress):

        sections = select_sections(config.sections)
        finished = []

        def on_section(name: str, status: str) -> None:
            if status != "start":
                finished.append(name)
            progress(len(finished), len(sections), f"{name}: {status}")

        return build_report(report_context(config), sections, on_section)

    # the report is cheap next to the rest and reads everything: always rebuilt
    return Stage("report", lambda: {"always": os.urandom(4).hex()}, work, state)


def lock_stores(stages: Sequence[Stage], held: ExitStack) -> None:
    """Take ``state/locks/<store>`` for every store of ``stages`` until ``held`` closes: two
    reproduce calls never run one store's stages at once (calls on other stores run side by
    side). Another live call's lock is an error that names it; a killed call's lock is free
    (see `actmap.store.lock`)."""

    folders = {s.store: s.state_dir / "locks" / s.store for s in stages if s.store is not None}
    for store, folder in folders.items():
        try:
            held.callback(acquire(folder).release)
        except StoreLocked as err:
            raise ActmapUserError(
                f"reproduce: the stages of store {store!r} are running in another call ({err}); "
                "give this call the other stores with --store"
            ) from None


def run_plan(stages: Sequence[Stage], progress_for: Callable[[Stage], Progress]) -> dict[str, str]:
    """Run every stage not yet done, in order; ``{stage: "done" | "skipped (done before)"}``.

    A capture or copy that runs makes every later stage of its store run too (a new copy of
    a store has none of the baseline results of the old one, and detectors trained on the old
    rows are stale). Their markers go before it runs, so a call killed after it still leaves
    them to run. Each store is locked for the whole call (`lock_stores`)."""
    status, rerun = {}, set()
    with ExitStack() as held:
        lock_stores(stages, held)
        for index, stage in enumerate(stages):
            if stage.store not in rerun and stage.done():
                status[stage.name] = "skipped (done before)"
                continue
            if stage.renews_store and stage.store is not None:
                rerun.add(stage.store)
                for later in stages[index + 1 :]:
                    if later.store == stage.store:
                        later.marker.unlink(missing_ok=True)
            stage.run(progress_for(stage))
            status[stage.name] = "done"
    return status
