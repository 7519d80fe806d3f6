"""Readiness and graceful shutdown of `actmap serve`.

``GET /ready`` is the readiness probe a load balancer polls (``GET /health`` stays the
liveness probe): 200 ``{"status": "ready"}`` while the server takes requests, 503
``{"status": "draining"}`` (with ``Retry-After``) from the moment it is asked to stop.

`run_server` runs uvicorn so that SIGTERM shuts down in three steps:

1. readiness turns off at once (``/ready`` answers 503) while the server goes on accepting
   and answering for ``shutdown_grace_s`` seconds, the time a load balancer needs to see it
   and stop sending (Kubernetes removes a pod from its endpoints asynchronously);
2. uvicorn stops listening and waits for the requests in flight (streams included) for at most
   ``drain_timeout_s`` seconds (its ``timeout_graceful_shutdown``); a request still running
   then is cancelled, and uvicorn says so on the log;
3. the lifespan ends: the batcher stops and the audit trail flushes and closes.

So a SIGTERM ends the process within ``shutdown_grace_s + drain_timeout_s`` plus the final
audit flush. SIGINT (Ctrl-C) skips the grace period.
"""

from __future__ import annotations

import signal
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from actmap.defaults import DRAIN_TIMEOUT_S, SHUTDOWN_GRACE_S
from actmap.serve.request_path import RETRY_AFTER_S


def install_readiness(app: FastAPI) -> None:
    """``GET /ready``: 200 while serving, 503 once draining (`mark_draining`) or not started."""
    app.state.draining = False

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        state = getattr(request.app.state, "actmap", None)
        if state is None or request.app.state.draining:
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            return JSONResponse({"status": "draining"}, status_code=503, headers=headers)
        return JSONResponse({"status": "ready", "queue": state.batcher.depth})


def mark_draining(app: FastAPI) -> None:
    """Readiness off (``/ready`` answers 503); requests are still served."""
    app.state.draining = True


def run_server(
    app: FastAPI,
    host: str,
    port: int,
    shutdown_grace_s: float = SHUTDOWN_GRACE_S,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
    log_level: str = "warning",
) -> None:
    """uvicorn with the shutdown above (blocks until the server has stopped)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        exit_at: float | None = None

        def handle_exit(self, sig: int, frame) -> None:
            mark_draining(app)
            if sig == signal.SIGTERM and shutdown_grace_s > 0 and not self.should_exit:
                if self.exit_at is None:  # a second SIGTERM does not extend the grace
                    self.exit_at = time.monotonic() + shutdown_grace_s
                return  # the process then exits 0 after a clean shutdown
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:  # every 0.1 s
            if self.exit_at is not None and time.monotonic() >= self.exit_at:
                self.should_exit = True
            return await super().on_tick(counter)

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout_s
    )
    DrainingServer(config).run()
