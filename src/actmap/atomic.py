"""One atomic writer: a file (or folder) appears whole under its name, or not at all.

Every artifact actmap writes (store shards and manifests, detector weights, run
results, judge caches, converted models) goes through ``atomic_path``: the
content is written to a temporary name beside the target, flushed to disk, and
renamed onto the target in one step. A writer that fails or is killed midway
leaves at most a hidden ``.tmp-*`` file, never a torn file under the real name.
The temporary file or folder is created with the modes the process's umask gives an
ordinary new file (0644 / 0755 under the usual 022), so a store another user or group
is meant to read stays readable (`tempfile.mkstemp` would make every file 0600).
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TMP_PREFIX = ".tmp-"


def _create_beside(target: Path, directory: bool) -> Path:
    """A new hidden file or folder next to ``target``, its mode from the umask as for any other."""
    while True:
        tmp = (
            target.parent
            / f"{TMP_PREFIX}{secrets.token_hex(8)}{'' if directory else target.suffix}"
        )
        try:
            if directory:
                tmp.mkdir(mode=0o777)
            else:
                os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
        except FileExistsError:  # a name already taken: draw another
            continue


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a folder
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(target: str | Path, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success it replaces ``target``.

    Write the content to the yielded path (a file, or a folder when ``directory``).
    When the block raises, the temporary path is removed and ``target`` is untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _create_beside(target, directory)
    try:
        yield tmp
        if directory:
            if target.exists():
                shutil.rmtree(target)
        else:
            _fsync(tmp)
        os.replace(tmp, target)
        _fsync(target.parent)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(target: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``target`` atomically."""
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")
