"""What each method reads from a capture, declared once: `actmap capture --methods`, the
reproduce configs' ``methods`` and any caller that builds a `CaptureJob` read it here.

A method not listed needs only the map and the answer (its own passes, such as sampling or
P(True), run later). A served detector's needs follow from what it ``requires``
(`actmap.serve.loaded_run.LoadedDetector.capture_settings`).
"""

from __future__ import annotations

from collections.abc import Sequence

from actmap.errors import ActmapUserError

CAPTURE_NEEDS: dict[str, dict] = {
    "actmap": {},
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
    methods: Sequence[str] | None, greybox: bool | None, attention_keys: int, keep_dense: bool
) -> dict:
    """What one capture keeps (`CaptureConfig`'s greybox, attention_keys and keep_dense): the
    explicit settings, plus whatever the named methods need (``greybox`` None: on, or what
    the methods need; an explicit False that a method needs is refused)."""
    settings = {"greybox": greybox, "attention_keys": attention_keys, "keep_dense": keep_dense}
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
    settings["keep_dense"] = keep_dense or any(n.get("keep_dense", False) for n in needs)
    return settings
