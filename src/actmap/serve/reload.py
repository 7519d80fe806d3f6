"""``POST /v1/actmap/reload`` (and SIGHUP): swap the served detector and policy in place.

A retrained detector (``actmap train --store audit/``) and a refitted policy (``actmap policy
fit --store audit/``) go live without a restart and without failing a request: the new pair
is loaded beside the old one (in a worker thread, the event loop keeps serving), then
swapped in between two batches (`actmap.serve.engine.Engine.swap`): the batch running at
that moment finishes with the old pair, every later one uses the new. Every answer's
``actmap`` block and audit row name the detector id and the policy version
(`actmap.serve.policy.policy_version`) that scored and decided it.

The body ``{"detector"?: RUN, "seed"?: N, "policy"?: TOML}`` names what to load; what it
leaves out is reloaded from the paths in use (those the server started with, or given to
the last reload), so replacing the files and posting ``{}`` (or sending SIGHUP) picks them
up. Under ``--fallback-run`` a reload replaces the in-domain pair (`actmap.serve.fallback`):
while the shift alarm holds the generalist keeps scoring (``scoring`` in the reply) and the
reloaded pair scores once it clears. A detector that reads another map or other inputs than
the served one needs a restart (400); a path that fails to load is a 400 and the served pair
stays. One reload at a time.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from pydantic import ConfigDict

from actmap.errors import ActmapUserError
from actmap.serve.policy import policy_version
from actmap.serve.protocol import OpenAIBaseModel
from actmap.serve.request_path import APIError

log = logging.getLogger(__name__)


class ReloadRequest(OpenAIBaseModel):
    model_config = ConfigDict(extra="forbid")
    detector: str | None = None  # a run folder (or one seed-<s>/); default: the one in use
    seed: int | None = None  # which seed of the run; default: the one in use
    policy: str | None = None  # a policy TOML; default: the one in use (none: the default)


class ReloadResponse(OpenAIBaseModel):
    object: str = "actmap.reload"
    detector: str  # the id loaded (the served one; with --fallback-run, the in-domain one)
    policy: str  # the version of the policy loaded
    previous_detector: str
    previous_policy: str
    scoring: str  # the id scoring now: ``detector``, or the fallback's while its alarm holds
    load_s: float


@dataclass
class Paths:
    detector: Path | None
    seed: int | None
    policy: Path | None


def load_pair(detector: Path | None, seed: int | None, policy: Path | None, device: str):
    """(detector or None, policy): a run folder's detector and a policy TOML (None: the
    default policy); what the server starts with (`actmap.serve.app.load_scoring`) and what a
    reload swaps in."""
    from actmap.serve.loaded_run import load_detector_run
    from actmap.serve.policy import Policy, load_policy

    loaded = load_detector_run(detector, seed, device) if detector is not None else None
    return loaded, (load_policy(policy) if policy else Policy())


class Reloader:
    """Loads and swaps; remembers the paths in use. One reload at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.paths: Paths | None = None

    def reload(self, state, request: ReloadRequest | None = None) -> ReloadResponse:
        request = request or ReloadRequest()
        engine = state.engine
        if engine.detector is None:
            raise ActmapUserError("this server has no detector to reload (a plain generator)")
        with self.lock:
            settings = state.settings
            paths = self.paths or Paths(settings.detector, settings.seed, settings.policy)
            wanted = Paths(
                Path(request.detector) if request.detector else paths.detector,
                request.seed if request.seed is not None else paths.seed,
                Path(request.policy) if request.policy else paths.policy,
            )
            if wanted.detector is None:
                raise ActmapUserError("no detector run folder to reload from: name one")
            started = time.perf_counter()
            detector, policy = load_pair(
                wanted.detector, wanted.seed, wanted.policy, settings.device
            )
            fallback = getattr(engine, "fallback", None)  # --fallback-run: its in-domain pair
            served = fallback.primary if fallback is not None else (engine.detector, engine.policy)
            try:
                if fallback is not None:
                    fallback.reload(detector, policy)
                else:
                    engine.swap(detector, policy)
            except ValueError as error:
                raise ActmapUserError(str(error)) from None
            self.paths = wanted
            log.info("reloaded: detector %s, %s", detector.id, policy_version(policy))
            return ReloadResponse(
                detector=detector.id,
                policy=policy_version(policy),
                previous_detector=served[0].id,
                previous_policy=policy_version(served[1]),
                scoring=engine.detector.id,
                load_s=time.perf_counter() - started,
            )


def reloader(app: FastAPI) -> Reloader:
    return app.state.actmap_reloader


def install_reload_route(app: FastAPI) -> None:
    app.state.actmap_reloader = Reloader()

    @app.post("/v1/actmap/reload")
    async def reload(body: ReloadRequest, request: Request) -> ReloadResponse:
        state = request.app.state.actmap
        try:
            return await asyncio.to_thread(reloader(request.app).reload, state, body)
        except (ActmapUserError, OSError, ValueError) as error:
            raise APIError(
                400, f"reload failed, still serving the previous pair: {error}"
            ) from None


def install_sighup(app: FastAPI):
    """SIGHUP reloads from the paths in use (as ``POST /v1/actmap/reload {}``), in a thread;
    a failure is logged and the served pair stays. Returns the previous handler."""

    def on_hangup(signum, frame) -> None:
        def work() -> None:
            try:
                done = reloader(app).reload(app.state.actmap)
                log.warning("SIGHUP: now serving %s with %s", done.detector, done.policy)
            except Exception as error:  # the server goes on with the pair it has
                log.error("SIGHUP reload failed, still serving the previous pair: %s", error)

        threading.Thread(target=work, name="actmap-reload", daemon=True).start()

    return signal.signal(signal.SIGHUP, on_hangup)
