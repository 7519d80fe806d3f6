"""`actmap serve --engine vllm`: vLLM's own OpenAI server with the actmap plugin.

The command is a launcher. `vllm_server_command` turns ``actmap serve``'s settings into the
command line of vLLM's server with actmap's worker extension, middleware and settings
(`actmap.capture.vllm_worker`, `actmap.serve.vllm_plugin`; docs/vllm.md)::

    python -m vllm.entrypoints.openai.api_server --model FOLDER --host H --port P ...
        --worker-extension-cls actmap.capture.vllm_worker.ActmapWorker
        --middleware actmap.serve.vllm_plugin.ActmapMiddleware
        --additional-config '{"actmap": {"detector": ..., ...}}'

and `exec_vllm_server` replaces the ``actmap`` process with it: vLLM's API server, engine core
and worker processes generate and answer, the plugin captures and scores (one code path with a
deployment started with vLLM's own command), and Ctrl-C or SIGTERM reach vLLM itself, which
shuts its processes down. A flag the plugin does not carry is refused by name
(`NOT_CARRIED`); the detector, its generator and what it reads are checked before vLLM starts.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from actmap.defaults import DRAIN_TIMEOUT_S, SHUTDOWN_GRACE_S
from actmap.errors import ActmapUserError
from actmap.serve.settings import ServeSettings, VllmSettings
from actmap.serve.vllm_plugin import CONFIG_KEY, SETTINGS, WORKER_EXTENSION

MIDDLEWARE = "actmap.serve.vllm_plugin.ActmapMiddleware"
API_SERVER = "vllm.entrypoints.openai.api_server"
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's server reads its key from here (kept off the command line)

# ServeSettings fields of `actmap serve` that vLLM's server with the plugin does not have:
# (field, the flag that sets it, what there is instead); refused when not at the default
NOT_CARRIED = (
    ("proxy", "--upstream", "the plugin scores vLLM's own answers"),
    ("actions", "--route-to / --abstain-message", "decisions are returned, not acted on"),
    ("audit_sync", "--audit-sync", "audit rows are committed every second"),
    ("batch_window_ms", "--batch-window-ms", "vLLM's scheduler admits requests every step"),
    ("max_queue", "--queue-size", "vLLM's scheduler queues every request"),
    ("timeout_s", "--timeout", "vLLM has no per-request deadline"),
    ("max_body_bytes", "--max-body-bytes", "vLLM reads any body"),
)


@dataclass(frozen=True)
class VllmCommand:
    """vLLM's server with the plugin: its command line and the environment it adds."""

    argv: list[str]
    env: dict[str, str]  # added to this process's environment (the API key)

    def shown(self) -> str:
        """The command line as a shell would take it (the key stays in the environment)."""
        return shlex.join(self.argv)


def model_type(folder: str) -> str | None:
    """The ``model_type`` of a model folder's config.json (its text model's, for a model with
    one), or None where it cannot be read."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return (config.get("text_config") or {}).get("model_type") or config.get("model_type")


def refused_flags(
    settings: ServeSettings,
    fallback_run: Path | None = None,
    shutdown_grace: float = SHUTDOWN_GRACE_S,
    drain_timeout: float = DRAIN_TIMEOUT_S,
) -> list[str]:
    """``actmap serve``'s flags given with ``--engine vllm`` that the plugin does not carry,
    each with what vLLM's server does instead."""
    default = ServeSettings()
    out = [f"{flag} ({why})" for name, flag, why in NOT_CARRIED
           if getattr(settings, name) != getattr(default, name)]  # fmt: skip
    if fallback_run is not None:
        out.append("--fallback-run (the plugin scores with one detector)")
    if shutdown_grace != SHUTDOWN_GRACE_S or drain_timeout != DRAIN_TIMEOUT_S:
        out.append("--shutdown-grace / --drain-timeout (vLLM's server has its own shutdown)")
    return out


def plugin_options(settings: ServeSettings) -> dict:
    """``additional_config["actmap"]``: the plugin's settings (`actmap.serve.vllm_plugin`)
    from ``actmap serve``'s, those not at None, paths as text; ``score_route`` on, as
    ``actmap serve`` always serves ``POST /v1/actmap/score``."""
    out = {}
    for name in SETTINGS:
        value = getattr(settings, name)
        if value is not None:
            out[name] = str(value) if isinstance(value, Path) else value
    out["score_route"] = True
    return out


def vllm_server_command(
    settings: ServeSettings,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    fallback_run: Path | None = None,
    shutdown_grace: float = SHUTDOWN_GRACE_S,
    drain_timeout: float = DRAIN_TIMEOUT_S,
    gpu: bool | None = None,
) -> VllmCommand:
    """vLLM's server with the plugin for ``actmap serve --engine vllm`` started with
    ``settings`` (``settings.vllm``: the engine's own flags; ``gpu``: whether vLLM runs on a
    GPU, where its compiled model is the default; None: torch says). Refused in one line: a
    flag the plugin does not carry, no detector, a detector that reads attention weights or
    was trained on another generator."""
    refused = refused_flags(settings, fallback_run, shutdown_grace, drain_timeout)
    if refused:
        raise ActmapUserError(
            "--engine vllm runs vLLM's own server with the actmap plugin, which does not take "
            + "; ".join(refused)
        )
    if settings.detector is None:
        raise ActmapUserError(
            "--engine vllm needs --detector RUN (without one, run vLLM's own server: "
            f"python -m {API_SERVER} --model MODEL)"
        )
    from actmap.capture.vllm_engine import require_vllm, vllm_model_folder
    from actmap.serve.loaded_run import (
        generator_problem,
        load_detector_run,
        refuse_what_vllm_cannot_read,
    )

    require_vllm()
    detector = load_detector_run(settings.detector, settings.seed)  # bad paths fail here
    folder, source = vllm_model_folder(settings.model)  # a GGUF: its de-quantized folder
    refuse_what_vllm_cannot_read(
        detector, "serve a deployable run, or use --engine local", model_type(folder)
    )
    problem = generator_problem(detector, source)
    if problem is not None:
        raise ActmapUserError(problem)
    engine = settings.vllm or VllmSettings()
    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    argv = [
        sys.executable, "-m", API_SERVER, "--model", folder,
        "--served-model-name", settings.model_name, "--host", host, "--port", str(port),
        "--dtype", settings.dtype or detector.dtype, "--max-num-seqs", str(settings.max_batch),
        "--tensor-parallel-size", str(engine.tensor_parallel_size),
    ]  # fmt: skip
    if settings.max_context is not None:
        argv += ["--max-model-len", str(settings.max_context)]
    if engine.compile is False or (engine.compile is None and not gpu):
        argv.append("--enforce-eager")  # eager on CPU: Inductor takes minutes on a few cores
    argv += [
        "--worker-extension-cls", WORKER_EXTENSION, "--middleware", MIDDLEWARE,
        "--additional-config", json.dumps({CONFIG_KEY: plugin_options(settings)}),
    ]  # fmt: skip
    env = {API_KEY_ENV: settings.api_key} if settings.api_key else {}
    return VllmCommand(argv, env)


def exec_vllm_server(command: VllmCommand) -> None:
    """Replace this process with vLLM's server (signals then reach vLLM; it never returns)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command.argv[0], command.argv, {**os.environ, **command.env})
