"""Real `actmap serve` processes for the fault tests, started in about a second each.

Each server is its own process running the CLI (``actmap serve ...``: uvicorn, its signal
handling, the lifespan, the audit trail) on a loopback port, so SIGTERM and SIGKILL hit it
as they hit a deployed server. The processes are forked from a multiprocessing forkserver that
imported torch, transformers and actmap once (`PRELOAD`): a fresh interpreter spends most of
its start-up importing those (10-30 s on a loaded 2-core machine), a fork of the preloaded one
does not. The models are the suite's tiny random-weight Llama and word tokenizer, saved to a
folder (`tiny_model_folder`).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

import httpx

PRELOAD = [
    "actmap.cli",
    "actmap.serve.app",
    "actmap.serve.lifecycle",
    "actmap.serve.audit",
    "actmap.serve.proxy",
    "actmap.llm.models",
    "transformers.models.llama.modeling_llama",
    "uvicorn",
]
MODEL_NAME = "tiny"
_context = None


def forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model_folder(root: Path) -> Path:
    """The tiny Llama + word tokenizer (with a chat template) as a model folder."""
    from serve_helpers import tiny_generator

    folder = root / "model"
    if not (folder / "config.json").is_file():
        model, tokenizer = tiny_generator()
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def wait_ready(base: str, alive, output, kill, limit_s: float) -> None:
    """Until ``GET /ready`` answers 200; RuntimeError with the server's ``output()`` when it
    exits first or is not up in ``limit_s`` (then it is ``kill()``-ed)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"actmap serve exited: {output()[-3000:]}")
        try:
            if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    kill()
    raise RuntimeError(f"actmap serve did not come up in {limit_s:.0f} s: {output()[-3000:]}")


def _serve(args: list[str], log: str) -> None:  # the child: `actmap serve ARGS`, output to log
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ["COLUMNS"] = "200"  # one-line console output
    from actmap.cli import app

    app(["serve", *args], prog_name="actmap")


class ServeProcess:
    """``actmap serve ARGS --port PORT`` in a forked process, up (``GET /ready`` 200) on return."""

    def __init__(self, args: list[str], log: Path, port: int | None = None, limit_s: float = 90):
        self.port = port or free_port()
        self.log = Path(log)
        self.base = f"http://127.0.0.1:{self.port}"
        self.process = forkserver().Process(
            target=_serve, args=([*args, "--port", str(self.port)], str(self.log))
        )
        self.process.start()
        wait_ready(self.base, self.process.is_alive, self.output, self.process.kill, limit_s)

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM (the graceful shutdown) and wait; the exit code."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        return self.process.exitcode
