"""One writer at a time: the store's ``writer.lock``.

The lock is an advisory ``flock`` on ``STORE/writer.lock``, whose text names the
holder (pid, host, command, start time). The kernel drops the flock when its
process ends, however it ends, so a lock left by a killed writer is stale by
construction: the next writer gets the flock, sees that the recorded pid is no
longer running, logs that it takes the lock over, and writes its own pid. A
second writer while the first still runs gets `StoreLocked`, naming the pid.

Several handles of one store inside one process share the lock (a count), so a
process never locks itself out.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from actmap.store.errors import StoreError

log = logging.getLogger(__name__)

LOCK_FILE = "writer.lock"


class StoreLocked(StoreError):
    """Another live process is writing the store."""

    def __init__(self, message: str, holder: dict) -> None:
        super().__init__(message)
        self.holder = holder


def read_holder(root: str | Path) -> dict:
    """What ``writer.lock`` says about its last holder ({} when it names nobody)."""
    try:
        text = (Path(root) / LOCK_FILE).read_text()
        return json.loads(text) if text.strip() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def holder_is_writing(root: str | Path) -> dict | None:
    """The holder's record when a live process holds the lock now, else None (read only)."""
    path = Path(root) / LOCK_FILE
    if not path.exists():
        return None
    with open(path) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_holder(root) or {"pid": None}
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


@dataclass
class _Held:
    fd: int
    count: int = 0


_HELD: dict[str, _Held] = {}
_GUARD = threading.Lock()


@dataclass
class WriterTicket:
    """One handle's share of the process's writer lock on a store."""

    key: str
    took_over: int | None = None  # pid of a dead writer whose stale lock was taken over
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        with _GUARD:
            if self._released:
                return
            self._released = True
            held = _HELD.get(self.key)
            if held is None:
                return
            held.count -= 1
            if held.count == 0:
                del _HELD[self.key]
                try:
                    os.ftruncate(held.fd, 0)
                finally:
                    os.close(held.fd)  # closing drops the flock


def _command_line() -> str:
    program = "actmap" if "actmap" in sys.argv[0] else Path(sys.argv[0]).name
    return " ".join([program, *sys.argv[1:]])[:200]


def acquire(root: str | Path) -> WriterTicket:
    """Take the writer lock of the store at ``root`` (shared within this process)."""
    root = Path(root)
    key = str(root.resolve())
    with _GUARD:
        held = _HELD.get(key)
        if held is not None:
            held.count += 1
            return WriterTicket(key)
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_holder(root)
            pid = holder.get("pid", "unknown")
            since = f", since {holder['started_at']}" if "started_at" in holder else ""
            command = f" ({holder['command']}{since})" if "command" in holder else ""
            raise StoreLocked(
                f"{root} is being written by process {pid}{command}; "
                "one writer at a time: wait for it to finish or stop it, then run this again",
                holder,
            ) from None
        previous = read_holder(root)
        took_over = None
        old_pid = previous.get("pid")
        if isinstance(old_pid, int) and old_pid != os.getpid():
            took_over = old_pid
            state = "no longer running" if not pid_alive(old_pid) else "not holding it"
            log.warning(
                "%s: taking over the writer lock of process %d, which is %s", root, old_pid, state
            )
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": _command_line(),
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        _HELD[key] = _Held(fd, 1)
        return WriterTicket(key, took_over)
