"""``actmap store verify`` and ``actmap store repair``: find damage, set it aside, resume past it.

`verify_store` reads every shard of every table and reports *damage* (the store
cannot be trusted as it is) and *notes* (harmless, explained). Damage is:

- a shard that cannot be read (truncated, not Parquet) or whose schema differs
  from its table's (the maps schema, or the schema its other shards share);
- a shard whose row count differs from the one the manifest recorded, or a
  shard the manifest records that is gone;
- an id that appears more than once in ``maps`` (two writers, a copied shard);
- a map that is not the store's byte length or not finite;
- a ``maps`` row without its row in a capture side table (``generations``,
  ``trajectories``, ``attention``, ``dense``);
- balanced rows (``splits``) naming ids that are not in ``maps``.

Notes: side-table rows whose id has no ``maps`` row (an interrupted batch: the
rerun writes them again and readers keep the last), temporary files of an
interrupted write (invisible to readers), shards the manifest does not record
(stores written before it recorded them).

`repair_store` never deletes: it moves unreadable or inconsistent shards into
``STORE/quarantine/`` (same relative path), rewrites a ``maps`` shard without
its bad rows (the original goes to quarantine), fixes the manifest's shard
records, and names the ids a resumed ``actmap capture`` will generate again
(every copy of a duplicated id is dropped, so a rerun writes one fresh row with
matching side-table rows).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from actmap.atomic import TMP_PREFIX
from actmap.store import QUARANTINE, MapStore, maps_schema
from actmap.store.lock import holder_is_writing
from actmap.store.served import COLUMNS_ADDED_LATER

CAPTURE_TABLES = ("generations", "trajectories", "attention", "dense", "positions")
EXAMPLES = 5  # ids named per finding


@dataclass(frozen=True)
class Finding:
    """One thing verify found: ``damage`` or a ``note``, about a file or table of the store."""

    severity: str  # "damage" | "note"
    where: str  # path relative to the store
    message: str

    def __str__(self) -> str:
        return f"{self.severity:6s} {self.where}: {self.message}"


@dataclass
class StoreReport:
    """What `verify_store` found, plus what `repair_store` needs to act on it."""

    root: Path
    rows: dict[str, int] = field(default_factory=dict)  # readable rows per table
    shards: dict[str, int] = field(default_factory=dict)  # shards per table
    findings: list[Finding] = field(default_factory=list)
    writer: dict | None = None  # the live writer's lock record, when one holds it
    bad_shards: dict[Path, str] = field(default_factory=dict)  # unreadable or foreign schema
    bad_map_ids: dict[str, str] = field(default_factory=dict)  # id -> why its maps row goes
    bad_split_shards: list[Path] = field(default_factory=list)
    uncommitted: set[str] = field(default_factory=set)  # side-table ids without a maps row
    unrecorded: dict[str, dict[str, int]] = field(default_factory=dict)  # table -> {shard: rows}
    missing: dict[str, list[str]] = field(default_factory=dict)  # table -> recorded, absent
    lost_rows: int = 0  # rows the manifest recorded for unreadable maps shards
    temporary: list[Path] = field(default_factory=list)

    @property
    def damage(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "damage"]

    @property
    def ok(self) -> bool:
        return not self.damage

    def _add(self, severity: str, where: Path | str, message: str) -> None:
        where = where.relative_to(self.root) if isinstance(where, Path) else where
        self.findings.append(Finding(severity, str(where), message))


def _examples(ids) -> str:
    ids = sorted(ids)
    more = f" and {len(ids) - EXAMPLES} more" if len(ids) > EXAMPLES else ""
    return ", ".join(ids[:EXAMPLES]) + more


def _same_fields(a: pa.Schema, b: pa.Schema, later: tuple[str, ...] = ()) -> bool:
    """Whether two schemas agree, leaving out ``later`` (columns older shards may lack)."""
    return _fields(a, later) == _fields(b, later)


def _fields(schema: pa.Schema, later: tuple[str, ...] = ()) -> tuple:
    return tuple((f.name, str(f.type)) for f in schema if f.name not in later)


def _read_shards(store: MapStore, table: str, report: StoreReport) -> dict[Path, pa.Table]:
    """Every readable shard of ``table``; the others go to ``report.bad_shards``."""
    readable: dict[Path, pa.Table] = {}
    for shard in store.shards(table):
        try:
            readable[shard] = pq.read_table(shard)
        except (pa.ArrowException, OSError) as error:
            report.bad_shards[shard] = f"unreadable ({error})"
            report._add("damage", shard, f"unreadable: {error}")
    expected = maps_schema(store.map_bytes) if table == "maps" else None
    later = COLUMNS_ADDED_LATER.get(table, ())
    if table != "maps":  # the schema most of the table's shards share
        counts = Counter(_fields(t.schema, later) for t in readable.values())
        common = counts.most_common(1)[0][0] if counts else ()
        expected = next(
            (t.schema for t in readable.values() if _fields(t.schema, later) == common), None
        )
    for shard, data in list(readable.items()):
        if "id" not in data.column_names:
            why = "has no 'id' column"
        elif expected is not None and not _same_fields(data.schema, expected, later):
            why = f"schema differs from the table's: {data.schema.names}"
        else:
            continue
        report.bad_shards[shard] = why
        report._add("damage", shard, why)
        del readable[shard]
    return readable


def _check_counts(store: MapStore, table: str, report: StoreReport, readable: dict) -> None:
    recorded = store.recorded_rows(table)
    if recorded is None:
        return
    for shard, data in readable.items():
        if shard.name not in recorded:
            report.unrecorded.setdefault(table, {})[shard.name] = data.num_rows
        elif recorded[shard.name] != data.num_rows:
            why = f"holds {data.num_rows} rows, the manifest records {recorded[shard.name]}"
            report.bad_shards[shard] = why
            report._add("damage", shard, why)
    on_disk = {s.name for s in store.shards(table)}
    gone = sorted(set(recorded) - on_disk)
    if gone:
        report.missing[table] = gone
        report._add(
            "damage",
            table,
            f"{len(gone)} shard(s) the manifest records are missing: {', '.join(gone[:3])}"
            + (" ..." if len(gone) > 3 else ""),
        )
    for shard in store.shards(table):
        if shard in report.bad_shards and table == "maps":
            report.lost_rows += int(recorded.get(shard.name, 0))


def _check_maps(store: MapStore, report: StoreReport, readable: dict[Path, pa.Table]) -> set[str]:
    where: dict[str, list[str]] = defaultdict(list)
    for shard, data in readable.items():
        if shard in report.bad_shards:
            continue
        ids = data.column("id").to_pylist()
        if None in ids:
            report.bad_shards[shard] = "rows without an id"
            report._add("damage", shard, "has rows without an id")
            continue
        for key in ids:
            where[key].append(shard.name)
        column = data.column("map").combine_chunks()
        lengths = pc.binary_length(column).to_numpy(zero_copy_only=False)
        wrong = {k for k, n in zip(ids, lengths, strict=True) if n != store.map_bytes}
        nulls = {k for k, v in zip(ids, column.is_null().to_pylist(), strict=True) if v}
        ok = [i for i, k in enumerate(ids) if k not in wrong and k not in nulls]
        values = np.frombuffer(
            b"".join(column.take(pa.array(ok, pa.int64())).to_pylist()), dtype=np.float16
        ).reshape(len(ok), -1)
        finite = np.isfinite(values).all(axis=1)
        bad_values = {ids[i] for i, good in zip(ok, finite, strict=True) if not good}
        for keys, why in (
            (wrong | nulls, f"map not {store.map_bytes} bytes"),
            (bad_values, "map not finite"),
        ):
            if keys:
                report._add("damage", shard, f"{len(keys)} {why}: {_examples(keys)}")
                report.bad_map_ids.update(dict.fromkeys(keys, why))
    duplicated = {k: shards for k, shards in where.items() if len(shards) > 1}
    if duplicated:
        files = sorted({s for shards in duplicated.values() for s in shards})
        report._add(
            "damage",
            "maps",
            f"{len(duplicated)} ids appear more than once ({_examples(duplicated)}), "
            f"in {', '.join(files[:4])}" + (" ..." if len(files) > 4 else ""),
        )
        report.bad_map_ids.update(dict.fromkeys(duplicated, "duplicate id"))
    return set(where)


def verify_store(store: MapStore | str | Path) -> StoreReport:
    """Read every shard of ``store`` and report damage and notes (see the module docstring)."""

    store = store if isinstance(store, MapStore) else MapStore.open(store)
    writer = holder_is_writing(store.root)
    if writer is not None and writer.get("pid") == os.getpid():
        writer = None  # this process (a repair) is the writer
    report = StoreReport(root=store.root, writer=writer)
    if report.writer is not None:
        report._add(
            "note",
            ".",
            f"process {report.writer.get('pid')} is writing this store now; "
            "rows of its batch in flight show as uncommitted",
        )
    for tmp in sorted(store.root.rglob(f"{TMP_PREFIX}*")):
        if QUARANTINE not in tmp.relative_to(store.root).parts and report.writer is None:
            report.temporary.append(tmp)
            report._add("note", tmp, "temporary file of an interrupted write (readers ignore it)")
    tables = store.tables()
    if "maps" not in tables and not store.recorded_rows("maps"):
        report._add("note", "maps", "no maps yet")
    contents: dict[str, dict[Path, pa.Table]] = {}
    for table in sorted(set(tables) | set(store.manifest.get("shards", {}))):
        readable = _read_shards(store, table, report)
        _check_counts(store, table, report, readable)
        contents[table] = {s: t for s, t in readable.items() if s not in report.bad_shards}
        report.shards[table] = len(store.shards(table))
        report.rows[table] = sum(t.num_rows for t in contents[table].values())
    map_ids = _check_maps(store, report, contents.get("maps", {}))
    skipped = {k for t in contents.get("skipped", {}).values() for k in t.column("id").to_pylist()}
    for table, readable in contents.items():
        if table in ("maps", "skipped") or not readable:
            continue
        ids = {k for t in readable.values() for k in t.column("id").to_pylist()}
        if table == "splits":
            unknown = ids - map_ids
            if unknown:
                report.bad_split_shards.extend(readable)
                report._add(
                    "damage",
                    table,
                    f"balanced rows name {len(unknown)} ids not in maps: {_examples(unknown)}",
                )
            continue
        if table in CAPTURE_TABLES:
            absent = map_ids - ids
            if absent:
                report._add(
                    "damage",
                    table,
                    f"{len(absent)} maps rows have no row here: {_examples(absent)}",
                )
                for key in absent:
                    report.bad_map_ids.setdefault(key, f"no {table} row")
        orphans = ids - map_ids - skipped
        if orphans:
            if table in CAPTURE_TABLES:
                report.uncommitted |= orphans
            report._add(
                "note",
                table,
                f"{len(orphans)} ids without a maps row (an interrupted batch or set-aside "
                f"rows; a resumed capture writes them again): {_examples(orphans)}",
            )
    for table, shards in report.unrecorded.items():
        report._add(
            "note",
            table,
            f"{len(shards)} shard(s) not recorded in the manifest (an older store, or a writer "
            "stopped right after writing one); repair records them",
        )
    return report


@dataclass
class RepairResult:
    """What `repair_store` did."""

    before: StoreReport
    after: StoreReport
    quarantined: list[tuple[str, str]]  # (moved file, why), paths relative to the store
    rewritten: list[tuple[str, str | None, int]]  # (original shard, new shard, rows dropped)
    regenerate: list[str]  # ids a resumed capture generates again
    lost_rows: int  # rows of unreadable maps shards (their ids may be unknown)


def repair_store(store: MapStore | str | Path) -> RepairResult:
    """Set damaged shards aside in ``quarantine/`` and make the store verify again."""
    store = store if isinstance(store, MapStore) else MapStore.open(store)
    store.acquire_writer()
    before = verify_store(store)
    quarantined: list[tuple[str, str]] = []
    rewritten: list[tuple[str, str | None, int]] = []

    def set_aside(path: Path, why: str) -> None:
        relative = str(path.relative_to(store.root))
        store.quarantine(path)
        quarantined.append((relative, why))

    for tmp in before.temporary:
        set_aside(tmp, "temporary file of an interrupted write")
    for shard, why in before.bad_shards.items():
        table = str(shard.parent.relative_to(store.root))
        set_aside(shard, why)
        store.forget_shards(table, [shard])
    for table, gone in before.missing.items():
        store.forget_shards(table, [store.root / table / name for name in gone])
    for table, shards in before.unrecorded.items():
        for name, rows in shards.items():
            store.set_manifest_key(("shards", table, name), rows)

    # side tables set aside above may leave maps rows without their side rows: look again
    middle = verify_store(store)
    removed: set[str] = set()
    for shard in store.shards("maps"):
        data = pq.read_table(shard)
        ids = data.column("id").to_pylist()
        drop = [k for k in ids if k in middle.bad_map_ids]
        if not drop:
            continue
        keep = pa.array([k not in middle.bad_map_ids for k in ids])
        cleaned = data.filter(keep)
        reasons = Counter(middle.bad_map_ids[k] for k in drop)
        why = ", ".join(f"{r}: {n}" for r, n in reasons.items())
        new = store.write_table("maps", cleaned).name if cleaned.num_rows else None
        kept = f"its {cleaned.num_rows} good rows kept in maps/{new}" if new else "no good rows"
        set_aside(shard, f"{len(drop)} bad rows ({why}); {kept}")
        store.forget_shards("maps", [shard])
        rewritten.append((str(shard.relative_to(store.root)), new, len(drop)))
        removed.update(drop)
    for shard in middle.bad_split_shards:
        if shard.exists():
            set_aside(shard, "balanced rows name ids not in maps (made anew when next needed)")
            store.forget_shards("splits", [shard])

    after = verify_store(store)
    regenerate = sorted(removed | after.uncommitted)
    store.update_manifest(
        repairs=[
            *store.manifest.get("repairs", []),
            {
                "at": datetime.now(UTC).isoformat(timespec="seconds"),
                "quarantined": [path for path, _ in quarantined],
                "removed_ids": sorted(removed),
                "regenerate": regenerate,
                "lost_rows": before.lost_rows,
            },
        ]
    )
    return RepairResult(before, after, quarantined, rewritten, regenerate, before.lost_rows)
