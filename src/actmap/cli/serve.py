"""``actmap serve``, ``actmap policy fit``, ``actmap audit rescore`` and ``actmap audit summary``."""

from __future__ import annotations

from pathlib import Path

import typer

from actmap.cli.app import app
from actmap.cli.common import (
    console,
    sampling_option,
    tensor_parallel_option,
    user_errors,
    vllm_compile_option,
)
from actmap.defaults import DRAIN_TIMEOUT_S, SHUTDOWN_GRACE_S
from actmap.errors import ActmapUserError

policy_app = typer.Typer(help="Decision policies: thresholds on p(correct).", no_args_is_help=True)
audit_app = typer.Typer(
    help="Audit stores written by `actmap serve --audit`.", no_args_is_help=True
)
app.add_typer(policy_app, name="policy")
app.add_typer(audit_app, name="audit")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@app.command()
def serve(
    detector: Path = typer.Option(
        None,
        help="Run folder from `actmap train` (or one seed-<s>/); actmap-plus is the one to "
        "deploy (`actmap train --detector actmap-plus`). Without it: a plain generator.",
    ),
    model: str = typer.Option(
        "smollm2-135m-instruct", help="Generator: short name, .gguf, folder or hub id."
    ),
    seed: int = typer.Option(
        None, help="Seed of the run to serve (default: best validation AUROC)."
    ),
    policy: Path = typer.Option(
        None, help="Policy TOML (`actmap policy fit`); default accept p >= 0.5."
    ),
    audit: Path = typer.Option(
        None, help="Append every answer's map and score to this audit store."
    ),
    audit_text: bool = typer.Option(
        False, help="Keep prompt and answer text in the audit store (default: prompt hash only)."
    ),
    audit_max_rows: int = typer.Option(
        None, help="Audit retention: keep about this many newest rows."
    ),
    audit_max_age_days: float = typer.Option(
        None, help="Audit retention: drop rows older than this."
    ),
    audit_sync: bool = typer.Option(
        False,
        help="Send an answer only once its audit row is committed (group commit): a crash "
        "(SIGKILL) then loses no answer a client received; default: rows flush every second.",
    ),
    shutdown_grace: float = typer.Option(
        SHUTDOWN_GRACE_S,
        min=0,
        help="On SIGTERM: seconds GET /ready answers 503 while requests are still served, "
        "before the server stops listening.",
    ),
    drain_timeout: float = typer.Option(
        DRAIN_TIMEOUT_S,
        min=0,
        help="On SIGTERM, after the grace: seconds in-flight requests may take to finish "
        "before they are cancelled.",
    ),
    review_sample: float = typer.Option(
        0.0,
        min=0.0,
        max=1.0,
        help="Share of all answers (every decision) queued for review at random, beside the "
        "answers decided review; their labels check calibration without bias (--audit).",
    ),
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000),
    api_key: str = typer.Option(
        None,
        envvar="ACTMAP_API_KEY",
        show_default=False,
        help="Require 'Authorization: Bearer KEY' (or set ACTMAP_API_KEY).",
    ),
    served_model_name: str = typer.Option(
        None, help="The model name clients send (default: --model)."
    ),
    max_tokens: int = typer.Option(64, help="max_tokens when a request gives none."),
    max_tokens_cap: int = typer.Option(512, help="Largest max_tokens a request may ask for."),
    max_body_bytes: int = typer.Option(1 << 20, help="Largest request body."),
    max_context: int = typer.Option(
        None, help="Prompt + answer tokens (default: the model's limit)."
    ),
    batch_size: int = typer.Option(16, help="Most requests per generation call."),
    batch_window_ms: float = typer.Option(
        10.0, help="How long the first request of a batch waits for others."
    ),
    queue_size: int = typer.Option(
        256, help="Requests that may wait; beyond it: 429 with Retry-After."
    ),
    timeout: float = typer.Option(120.0, help="Seconds before a request gets 504."),
    stream_scores: bool = typer.Option(
        False, help="Running p(correct) in every streamed chunk by default."
    ),
    score_every: int = typer.Option(1, help="Tokens between running scores while streaming."),
    device: str = typer.Option("cpu", help="cpu | cuda"),
    dtype: str = typer.Option(
        None,
        help="The generator's dtype: float32 | bfloat16 | float16 (default: the one the "
        "detector's training maps were captured in).",
    ),
    monitor: Path = typer.Option(
        None,
        help="Shift monitor (`actmap monitor fit`; its folder or the run holding it): every "
        "answer gets actmap.shift, /metrics gets actmap_shift_* gauges.",
    ),
    monitor_window: int = typer.Option(50, min=2, help="Answers per shift-monitor window test."),
    fallback_run: Path = typer.Option(
        None,
        help="A generalist run (`actmap train --store A --store B ...`) that scores while the "
        "shift monitor (--monitor) alarms; labels of its answers (feedback, review) refit its "
        "recalibration (docs/out_of_domain.md).",
    ),
    engine: str = typer.Option(
        "local",
        help="local (transformers, micro-batches of --batch-size) | vllm (starts vLLM's own "
        "OpenAI server with the actmap plugin, --batch-size requests in flight; pip install "
        "'actmap[vllm]'; docs/vllm.md).",
    ),
    tensor_parallel_size: int = tensor_parallel_option(),
    max_score_items: int = typer.Option(64, min=1, help="Answers per /v1/actmap/score request."),
    vllm_compile: bool = vllm_compile_option(),
    upstream: str = typer.Option(
        None,
        help="Proxy mode: forward chat/completion requests to this OpenAI-compatible server "
        "(e.g. http://host:8001/v1) and score its answers with --model's weights.",
    ),
    upstream_model: str = typer.Option(
        None, help="The model name the upstream serves (default: the one it lists)."
    ),
    upstream_timeout: float = typer.Option(60.0, help="Seconds per upstream request (then 504)."),
    upstream_api_key: str = typer.Option(
        None, envvar="ACTMAP_UPSTREAM_API_KEY", show_default=False, help="Bearer key upstream."
    ),
    allow_weights_mismatch: bool = typer.Option(
        False, help="Serve although the upstream fails the start-up weights probe."
    ),
    reader: str = typer.Option(
        "transformers",
        help="Proxy mode: what reads the upstream's answers: transformers (teacher-forced "
        "passes) | vllm (teacher-forced requests to an in-process vLLM engine of --model; "
        "pip install 'actmap[vllm]').",
    ),
    upstream_dtype: str = typer.Option(
        None,
        help="The dtype the upstream computes in (vLLM's default on CPU: bfloat16); sets the "
        "weights probe's tolerance (default: --dtype's).",
    ),
    allow_dtype_mismatch: bool = typer.Option(
        False,
        help="Proxy mode: read answers in a --dtype other than the detector's maps were "
        "captured in (refused otherwise).",
    ),
    route_to: str = typer.Option(
        None,
        help="Answers decided 'route' are answered by this OpenAI-compatible server (e.g. "
        "http://host:8002/v1); when it fails, the small model's answer, flagged routed: false.",
    ),
    route_model: str = typer.Option(
        None, help="The model name the route target serves (default: the one it lists)."
    ),
    route_api_key: str = typer.Option(
        None, envvar="ACTMAP_ROUTE_API_KEY", show_default=False, help="Bearer key of --route-to."
    ),
    route_timeout: float = typer.Option(
        60.0, min=0.001, help="Seconds per routed request (then the small model's answer)."
    ),
    abstain_message: str = typer.Option(
        None,
        help="Answers decided 'abstain' (or 'abstain_early') are replaced by this text, "
        "finish_reason 'content_filter'; the original stays in the audit store only.",
    ),
) -> None:
    """Serve an OpenAI-compatible API whose every answer carries p(correct) and a decision."""
    with user_errors():
        import uvicorn  # noqa: F401  (the serve extra: a clear error now, not after loading)

        from actmap.serve.app import build_engine, create_app
        from actmap.serve.lifecycle import run_server
        from actmap.serve.settings import ActionSettings, ProxySettings, ServeSettings, VllmSettings

        if engine not in ("local", "vllm"):
            raise ActmapUserError(f"--engine must be 'local' or 'vllm', got {engine!r}")
        if reader not in ("transformers", "vllm"):
            raise ActmapUserError(f"--reader must be 'transformers' or 'vllm', got {reader!r}")
        if reader != "transformers" and upstream is None:
            raise ActmapUserError("--reader reads an upstream's answers: it needs --upstream")
        proxy = None
        if upstream is not None:
            proxy = ProxySettings(
                upstream=upstream, model=upstream_model, timeout_s=upstream_timeout,
                api_key=upstream_api_key, dtype=upstream_dtype,
                allow_weights_mismatch=allow_weights_mismatch,
                allow_dtype_mismatch=allow_dtype_mismatch, reader=reader,
            )  # fmt: skip
        settings = ServeSettings(
            model=model, detector=detector, seed=seed, policy=policy, audit=audit,
            audit_text=audit_text, audit_max_rows=audit_max_rows,
            audit_max_age_days=audit_max_age_days, audit_sync=audit_sync,
            review_sample=review_sample,
            served_model_name=served_model_name,
            api_key=api_key or None, default_max_tokens=max_tokens, max_tokens_cap=max_tokens_cap,
            max_body_bytes=max_body_bytes, max_context=max_context, max_batch=batch_size,
            batch_window_ms=batch_window_ms, max_queue=queue_size, timeout_s=timeout,
            stream_scores=stream_scores, score_every=score_every, device=device, dtype=dtype,
            monitor=monitor, monitor_window=monitor_window, max_score_items=max_score_items,
            vllm=VllmSettings(compile=vllm_compile, tensor_parallel_size=tensor_parallel_size)
            if engine == "vllm" else None,
            proxy=proxy,
            actions=ActionSettings(
                route_to=route_to, route_model=route_model, route_api_key=route_api_key,
                route_timeout_s=route_timeout, abstain_message=abstain_message,
            ),
        )  # fmt: skip
        if fallback_run is not None and (detector is None or monitor is None):
            raise ActmapUserError("--fallback-run needs --detector and --monitor (its alarm)")
        if engine == "vllm":
            from actmap.serve.vllm_launch import exec_vllm_server, vllm_server_command

            command = vllm_server_command(
                settings, host, port, fallback_run=fallback_run, shutdown_grace=shutdown_grace,
                drain_timeout=drain_timeout,
            )  # fmt: skip
        elif tensor_parallel_size != 1:
            raise ActmapUserError("--tensor-parallel-size needs --engine vllm")
        if reader == "vllm":  # the proxy reads the upstream's answers with vLLM
            from actmap.capture.vllm_engine import require_vllm

            require_vllm()
    if host not in LOOPBACK and not settings.api_key:
        console.print(f"[yellow]warning:[/yellow] serving on {host} without --api-key")
    if engine == "vllm":  # this process becomes vLLM's server (signals reach vLLM)
        console.print("starting vLLM's server with the actmap plugin:")
        console.print(command.shown(), soft_wrap=True, markup=False, highlight=False)
        exec_vllm_server(command)
        return
    with user_errors():
        console.print(f"loading {model}" + (f" and {detector}" if detector else "") + " ...")
        engine = build_engine(settings)  # bad paths fail here, as one line
        if fallback_run is not None:
            from actmap.serve.fallback import install_fallback

            install_fallback(engine, fallback_run, device=device)
        if route_to is not None and route_model is None:  # an unlisted target fails here
            from dataclasses import replace

            from actmap.serve.actions import route_model_name

            actions = replace(settings.actions, route_model=route_model_name(settings.actions))
            settings = replace(settings, actions=actions)
        probe = None
        if upstream is not None:  # a weights mismatch fails here, as one line
            from actmap.serve.proxy import probe_upstream

            probe = probe_upstream(engine, settings)
    scored = f"with detector {engine.detector.id}" if engine.detector else "without a detector"
    console.print(
        f"serving '{settings.model_name}' {scored} on http://{host}:{port}"
        + (f", answers from {upstream} ({probe.upstream_model})" if probe else "")
        + (f", 'route' answered by {route_to} ({settings.actions.route_model})" if route_to else "")
    )
    served = create_app(settings, lambda: engine)
    served.state.upstream_probe = probe
    if engine.detector is not None:  # SIGHUP: reload the detector and policy files in use
        from actmap.serve.reload import install_sighup

        install_sighup(served)
    run_server(served, host, port, shutdown_grace, drain_timeout)


@policy_app.command("fit")
def policy_fit(
    run: Path = typer.Option(..., help="Run folder from `actmap train`."),
    store: Path = typer.Option(..., help="Map store with labelled rows (its natural prevalence)."),
    target_risk: float = typer.Option(..., help="Error rate allowed among accepted answers."),
    out: Path = typer.Option(..., "--out", "-o", help="Policy TOML to write."),
    review_risk: float = typer.Option(
        None, help="Error rate allowed once reviewed answers are added."
    ),
    route_risk: float = typer.Option(
        None, help="Error rate allowed once routed answers are added."
    ),
    prior: str = typer.Option("known", help="known | em | none: prior correction of p(correct)."),
    deployment_accuracy: float = typer.Option(
        None, help="For --prior known (default: the split's accuracy)."
    ),
    split: str = typer.Option("validation", help="Store split to fit on (all its labelled rows)."),
    calibrate: bool = typer.Option(
        True,
        help="Fit a temperature (MAP, log-normal prior on T) on the split's labelled rows "
        "at their natural prevalence before the prior shift.",
    ),
    train_prevalence: float = typer.Option(
        None,
        help="Prior the detector's p(correct) holds at (default: read from the detector; "
        "0.5 for detectors trained on balanced rows).",
    ),
    resamples: int = typer.Option(
        2000, min=0, help="Bootstrap resamples for the intervals (0: none)."
    ),
    seed: int = typer.Option(None, help="Seed of the run (default: best validation AUROC)."),
    sampling: str = sampling_option(),
) -> None:
    """Fit accept / review / route thresholds for target risks on a validation risk-coverage curve.

    The temperature and each band's coverage and risk come with 95% bootstrap intervals
    (printed and written to the policy file); fewer than 100 labelled rows is warned about.
    """
    from actmap.store.served import served_sampling

    with user_errors(), served_sampling(sampling):
        from actmap.serve.fit import MIN_POLICY_ROWS, fit_policy_from_store
        from actmap.serve.loaded_run import load_detector_run
        from actmap.serve.policy import save_policy
        from actmap.store import MapStore

        detector = load_detector_run(run, seed)
        fitted = fit_policy_from_store(
            MapStore.open(store), detector, target_risk, review_risk, route_risk, prior,
            deployment_accuracy, split, calibrate, train_prevalence, resamples,
            about={"run": str(run), "detector": detector.id, "store": str(store)},
        )  # fmt: skip
        policy, scores, temperature = fitted.policy, fitted.scores, fitted.temperature
        train_prevalence = fitted.train_prevalence
        save_policy(policy, out)
    console.print(
        f"{len(scores.labels)} {split} rows, accuracy {scores.accuracy:.3f}, "
        f"detector's prior {train_prevalence:.3f}, temperature "
        + (f"{temperature:.3f}" if isinstance(temperature, float) else str(temperature))
        + f"; accept p >= {policy.accept:.4f}, review >= {policy.review:.4f}, "
        f"route >= {policy.route:.4f}"
    )
    for band in ("accept", "review", "route"):
        if band in policy.fitted:
            f = policy.fitted[band]
            line = f"  {band}: target risk {f['target_risk']:.3f} -> coverage {f['coverage']:.3f}"
            if "coverage_low" in f:
                line += f" [{f['coverage_low']:.3f}, {f['coverage_high']:.3f}]"
            line += f", risk {f['risk']:.3f}"
            if "risk_low" in f:
                line += f" [{f['risk_low']:.3f}, {f['risk_high']:.3f}]"
            console.print(line)
    if resamples:
        console.print(
            f"  [...]: 95% bootstrap intervals ({resamples} resamples of the rows; the "
            f"thresholds held fixed); below {MIN_POLICY_ROWS} rows expect them wide"
        )
    if "sampling" in policy.fitted:
        console.print(f"  audit store: labels counted: {policy.fitted['sampling']}")
    console.print(f"policy written to {out}")


@audit_app.command("rescore")
def audit_rescore(
    store: Path = typer.Option(..., help="Audit store written by `actmap serve --audit`."),
    detector: Path = typer.Option(..., help="Run folder of the detector to score with."),
    seed: int = typer.Option(None, help="Seed of the run (default: best validation AUROC)."),
    out: Path = typer.Option(None, "--out", "-o", help="Parquet file for the per-answer scores."),
) -> None:
    """Re-score every stored map with another detector, without the LLM."""
    with user_errors():
        from actmap.serve.audit import open_audit_store, rescore
        from actmap.serve.loaded_run import load_detector_run

        loaded = load_detector_run(detector, seed)
        frame = rescore(open_audit_store(store), loaded)
        frame["detector_new"] = loaded.id
        if out is not None:
            frame.to_parquet(out, index=False)
    if frame.empty:
        console.print("the audit store holds no answers")
        return
    change = (frame["p_correct_raw_new"] - frame["p_correct_raw"]).abs()
    console.print(
        f"{len(frame)} answers re-scored with {loaded.id}: mean p_raw served "
        f"{frame['p_correct_raw'].mean():.4f} -> new {frame['p_correct_raw_new'].mean():.4f}; "
        f"max |change| {change.max():.4f}"
    )
    if out is not None:
        console.print(f"scores written to {out}")


@audit_app.command("summary")
def audit_summary(
    store: Path = typer.Option(..., help="Audit store written by `actmap serve --audit`."),
    every: str = typer.Option("1h", help="Period of each row (pandas frequency: 15min, 1h, 1D)."),
) -> None:
    """Decisions and the p(correct) distribution over time."""
    with user_errors():
        from actmap.serve.audit import open_audit_store, read_audit, summarize

        try:
            summary = summarize(read_audit(open_audit_store(store)), every)
        except ValueError as error:
            raise ActmapUserError(f"--every {every!r}: {error}") from None
    if summary.empty:
        console.print("the audit store holds no answers")
        return
    shown = summary.copy()
    shown.index = shown.index.strftime("%Y-%m-%d %H:%M")
    typer.echo(shown.to_string(float_format=lambda v: f"{v:.3f}"))  # data on stdout
