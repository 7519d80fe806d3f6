"""A store's config: compared by meaning, so a resumed capture continues only the store
it made (`check_config`, `claim_store`); switched-off options are one value (`SWITCHES`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actmap.store.errors import StoreError
from actmap.store.lock import acquire
from actmap.store.schema import MANIFEST, read_manifest

# Options whose "off" may be written None, 0 or False: one value, stored as absent.
SWITCHES = (
    ("keep", "trajectories"),
    ("keep", "attention_keys"),
    ("keep", "dense"),
    ("capture", "attention_keys"),
    ("capture", "keep_dense"),
    ("capture", "share_prefix"),
    ("keep", "positions"),
    ("capture", "keep_positions"),
    ("capture", "lookback_attention"),
)


def normalize_config(config: dict) -> dict:
    """``config`` as stored: JSON values, switched-off options (None, 0, False) left out."""
    out = json.loads(json.dumps(config))
    for section, key in SWITCHES:
        part = out.get(section)
        if isinstance(part, dict) and key in part and part[key] in (None, 0, False):
            del part[key]
    return out


def config_differences(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs; missing = None."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(config_differences(a, b, name + "."))
        elif a != b:
            out.append((name, a, b))
    return out


# recorded by later versions only: a store made before them resumes without them
ADDED_LATER = (("task", "demonstrations"),)


def check_config(root: Path, stored: dict, wanted: dict, ignore: Sequence[str] = ()) -> None:
    """Raise `StoreError` naming the differences when ``wanted`` means another config."""
    wanted = json.loads(json.dumps(wanted))
    for section, key in ADDED_LATER:
        if key not in (stored.get(section) or {}) and isinstance(wanted.get(section), dict):
            wanted[section].pop(key, None)
    changed = [
        (k, a, b)
        for k, a, b in config_differences(normalize_config(stored), normalize_config(wanted))
        if k.split(".")[0] not in ignore
    ]
    if changed:
        raise StoreError(
            f"{root} holds a store made with another config; use a new folder. "
            "Differences (stored -> new): "
            + "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:8])
            + (f"; and {len(changed) - 8} more" if len(changed) > 8 else "")
        )


def claim_store(root: str | Path, config: dict, ignore: Sequence[str] = ("model",)):
    """Before an expensive load (a model): become ``root``'s writer and check its config.

    Refuses at once, with `StoreLocked` or `StoreError`, what `MapStore.create` would
    refuse later; the ``ignore``d sections (known only after the load) are checked then.
    Returns the lock's ticket: release it once the store is created.
    """

    root = Path(root)
    ticket = acquire(root)
    try:
        if (root / MANIFEST).exists():
            check_config(root, read_manifest(root).get("config") or {}, config, ignore)
    except BaseException:
        ticket.release()
        raise
    return ticket
