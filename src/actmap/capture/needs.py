"""What each method reads from a capture, declared once: `actmap capture --methods`, the
reproduce configs' ``methods``, any caller that builds a `CaptureJob`, and a served detector
(`actmap.serve.loaded_run.LoadedDetector.capture_settings`) read it here.

`needs_of(requires, attention_keys)` is the one translation of what a detector reads (its
``requires``) into the `CaptureConfig` fields that keep it: every detector's
``capture_needs()`` and the detectors' entries of `CAPTURE_NEEDS` (by name, for the capture
command) are built with it. A method not listed needs only the map and the answer (its own
passes, such as sampling or P(True), run later).
"""

from __future__ import annotations

from collections.abc import Sequence

from actmap.errors import ActmapUserError


def needs_of(requires, attention_keys: int = 0, lookback: bool = False) -> dict:
    """The `CaptureConfig` fields a detector reading ``requires`` (`actmap.detectors.inputs`:
    "maps", "scalars", "positions", "attention") needs: ``greybox`` (always named: the scalars
    and attention-based blocks read the per-step log-probs), ``attention_keys`` (and
    ``lookback_attention`` when ``lookback``) when it reads attention, ``keep_positions``."""
    need = set(requires)
    settings: dict = {"greybox": bool(need & {"scalars", "attention"})}
    if "attention" in need:
        settings["attention_keys"] = int(attention_keys)
        if lookback:
            settings["lookback_attention"] = True
    if "positions" in need:
        settings["keep_positions"] = True
    return settings


# the detectors' entries are what each declares (``capture_needs()``, built with `needs_of`;
# tests/test_contract.py checks them against the detectors); the baselines' are their own
CAPTURE_NEEDS: dict[str, dict] = {
    "actmap": needs_of(("maps",)),
    "actmap-plus:v1": needs_of(("maps", "scalars")),
    "actmap-plus:deployable": needs_of(("maps", "scalars", "positions")),
    "actmap-plus:full": needs_of(("maps", "scalars", "positions", "attention"), 10, True),
    "answer_length": {},
    "permuted_label": {},
    "p_true": {},
    "semantic_entropy": {},
    "eigenscore": {},
    "perplexity": {"greybox": True},
    "mean_token_entropy": {"greybox": True},
    "rauq": {"greybox": True, "attention_keys": 1},
    "tad": {"greybox": True, "attention_keys": 10},
    "actvit": {"keep_dense": True},
}


def capture_settings(
    methods: Sequence[str] | None,
    greybox: bool | None,
    attention_keys: int,
    keep_dense: bool,
    keep_positions: bool = False,
    lookback_attention: bool = False,
) -> dict:
    """What one capture keeps (`CaptureConfig`'s greybox, attention_keys, keep_dense,
    keep_positions and lookback_attention): the explicit settings, plus whatever the named
    methods need (``greybox`` None: on, or what the methods need; an explicit False that a
    method needs is refused)."""
    settings = {
        "greybox": greybox,
        "attention_keys": attention_keys,
        "keep_dense": keep_dense,
        "keep_positions": keep_positions,
        "lookback_attention": lookback_attention,
    }
    if methods is None:
        return {**settings, "greybox": True if greybox is None else greybox}
    names = [m.strip() for m in methods if m.strip()]
    unknown = [m for m in names if m not in CAPTURE_NEEDS]
    if unknown or not names:
        raise ActmapUserError(
            f"unknown method {unknown[0]!r} in --methods; known: {', '.join(CAPTURE_NEEDS)}"
            if unknown
            else "--methods names no method"
        )
    needs = [CAPTURE_NEEDS[m] for m in names]
    if greybox is None:
        settings["greybox"] = any(n.get("greybox", False) for n in needs)
    elif not greybox and any(n.get("greybox", False) for n in needs):
        needy = [m for m in names if CAPTURE_NEEDS[m].get("greybox")]
        raise ActmapUserError(f"--no-greybox contradicts --methods: {', '.join(needy)} need it")
    settings["attention_keys"] = max([attention_keys] + [n.get("attention_keys", 0) for n in needs])
    for flag in ("keep_dense", "keep_positions", "lookback_attention"):
        settings[flag] = settings[flag] or any(n.get(flag, False) for n in needs)
    return settings
