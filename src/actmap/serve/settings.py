"""What `actmap serve` is started with: common settings plus one group per server mode.

`ServeSettings` holds what every mode reads (the generator, the detector run, policy, audit
trail, shift monitor, request limits, batching, streaming); a mode's own settings sit in its
group, None when the mode is off:

* plain server: ``vllm`` and ``proxy`` both None (transformers + the micro-batcher);
* ``vllm``: `VllmSettings` (``--engine vllm``: vLLM's own server with the actmap plugin,
  started by `actmap.serve.vllm_launch`; ``max_batch`` = requests in flight);
* ``proxy``: `ProxySettings` (``--upstream URL``: answers come from that OpenAI-compatible
  server, `actmap.serve.proxy`);

and the decisions that act (``--route-to``, ``--abstain-message``) in `ActionSettings`
(``actions``; plain and vLLM server only). `ServeSettings.mode` names the mode. The CLI
(`actmap.cli.serve`) builds these from its flags, one flag per field as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MODES = ("local", "vllm", "proxy")


@dataclass(frozen=True)
class VllmSettings:
    """``--engine vllm``: vLLM's own server with the actmap plugin (`actmap.serve.vllm_launch`)."""

    compile: bool | None = None  # compiled model (``--vllm-compile``; None: on a GPU only)
    tensor_parallel_size: int = 1  # vLLM's workers, one per device (``--tensor-parallel-size``)


@dataclass(frozen=True)
class ProxySettings:
    """Proxy mode (`actmap.serve.proxy`): answers come from this OpenAI-compatible server."""

    upstream: str  # its base URL, e.g. http://host:port/v1
    model: str | None = None  # the model name the upstream serves; None = ask it
    timeout_s: float = 60.0  # per upstream request; past it: 504
    api_key: str | None = None  # bearer token the upstream wants
    dtype: str | None = None  # the dtype the upstream computes in; None = ours
    allow_weights_mismatch: bool = False  # serve although the start-up probe differs
    allow_dtype_mismatch: bool = False  # read in another dtype than the detector's maps
    # what reads the upstream's answers: "transformers" (teacher-forced passes of the local
    # weights) or "vllm" (teacher-forced requests to an in-process vLLM engine of them)
    reader: str = "transformers"


@dataclass(frozen=True)
class ActionSettings:
    """Decisions that act (`actmap.serve.actions`): "route" answered by this OpenAI-compatible
    server, "abstain" / "abstain_early" replaced by ``abstain_message`` (None: handed out as
    is)."""

    route_to: str | None = None
    route_model: str | None = None  # the model the route target serves; None = ask it
    route_api_key: str | None = None
    route_timeout_s: float = 60.0  # per routed request; past it the small model's answer, flagged
    abstain_message: str | None = None

    @property
    def acting(self) -> bool:
        """Whether any decision can change an answer (then streams are held until it)."""
        return self.route_to is not None or self.abstain_message is not None


@dataclass(frozen=True)
class ServeSettings:
    """Everything `actmap serve` is started with: the common settings, then the mode groups."""

    model: str = "smollm2-135m-instruct"
    detector: Path | None = None  # run folder from `actmap train` (or one seed-<s>/ folder)
    seed: int | None = None  # which seed of the run; None = best validation AUROC
    policy: Path | None = None  # policy TOML; None = accept at p >= 0.5, else abstain
    audit: Path | None = None  # audit store folder; None = no audit trail
    audit_text: bool = False  # keep prompt and answer text in the audit store (off: hash only)
    audit_max_rows: int | None = None
    audit_max_age_days: float | None = None
    audit_sync: bool = False  # an answer is sent once its audit row is committed (SIGKILL-safe)
    review_sample: float = 0.0  # share of all answers queued for review at random (the audit)
    served_model_name: str | None = None  # the name clients send as "model"; default: model
    api_key: str | None = None  # bearer token; None = no auth
    default_max_tokens: int = 64
    max_tokens_cap: int = 512
    max_body_bytes: int = 1 << 20
    max_context: int | None = None  # prompt + answer tokens; None = the model's own limit
    max_batch: int = 16  # per generation call (local), in flight (vllm), per scoring pass
    batch_window_ms: float = 10.0
    max_queue: int = 256
    timeout_s: float = 120.0
    stream_scores: bool = False  # running p(correct) in every streamed chunk by default
    score_every: int = 1  # tokens between running scores
    device: str = "cpu"
    dtype: str | None = None  # the generator's; None = the dtype the detector's maps came from
    monitor: Path | None = None  # shift monitor folder (or a run folder holding monitor/)
    monitor_window: int = 50  # answers per window test
    max_score_items: int = 64  # answers per POST /v1/actmap/score request
    vllm: VllmSettings | None = None  # --engine vllm; None: not this mode
    proxy: ProxySettings | None = None  # --upstream URL; None: not this mode
    actions: ActionSettings = field(default_factory=ActionSettings)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def mode(self) -> str:
        """ "local" (transformers), "vllm" or "proxy"."""
        if self.proxy is not None:
            return "proxy"
        return "vllm" if self.vllm is not None else "local"
