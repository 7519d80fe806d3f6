"""The upstream OpenAI-compatible server of proxy mode: the HTTP client and the weights probe.

`Upstream` wraps one ``httpx.AsyncClient``: every failure becomes an
`UpstreamFailure` carrying the OpenAI-style status the proxy answers with
(connection refused, a 5xx or a malformed body: 502; a timeout: 504). Retries
happen only where nothing can have been generated: httpx's transport retries a
connection that could not be opened, never a request that was sent.

`probe_weights` checks, before the proxy serves, that the upstream runs the
weights the detector reads: one fixed greedy chat request. Where the upstream
returns its answer's token ids, the local model reads them teacher-forced: each
must be the local greedy token or within the tolerance of it (a near tie that
rounding may flip), and the upstream's log-probs (when it returns them) must
equal the local ones within the tolerance. Without ids the greedy answer texts
must be equal. The tolerance depends on the coarser of the two dtypes
(`probe_tolerance`). `ProbeResult.problem` is the one line that says what differed.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import torch

from actmap.capture.generate import stop_ids
from actmap.serve.answers import strip_end_tokens

log = logging.getLogger(__name__)

PROBE_MESSAGES = (
    {"role": "user", "content": "Name the capital of France, then count from one to five."},
)
PROBE_PROMPT = "The capital of France is"  # for a model without a chat template (completions)
PROBE_TOKENS = 8
# Log-prob tolerance (nats, largest over the probe's tokens) by the coarser dtype of the two
# sides. float32 on two stacks (vLLM's kernels vs transformers) differed by < 1e-4 nats;
# another checkpoint differs by whole nats. A 16-bit side rounds every weight and activation
# (bfloat16: 8 mantissa bits): SmolLM2-135M-Instruct greedy answers of vLLM in float32 or
# bfloat16 read by transformers in float32 or bfloat16 differed by up to .18 nats over 8
# tokens of 31 chat prompts (.04-.07 on the probe's); relative weight noise of 1% (2%) moved
# the probe's log-probs by .16-.18 (.40) and put the upstream's greedy token .5 (1.0) nats
# below the local one (benchmarks/check_probe_tolerance.py, docs/proxy.md). float16 (10
# mantissa bits) is finer than bfloat16: it gets bfloat16's bound, unmeasured.
PROBE_TOLERANCE = {"float32": 0.05, "bfloat16": 0.25, "float16": 0.25}
PROBE_LOGPROB_TOLERANCE = PROBE_TOLERANCE["float32"]


class UpstreamFailure(Exception):
    """The upstream did not give a usable answer; ``status`` is what the proxy returns."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


KEEPALIVE_S = 2.0  # an idle upstream connection is reused for this long at most


class Upstream:
    """An async client of ``base_url`` (e.g. ``http://host:port/v1``)."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 60.0,
        api_key: str | None = None,
        connect_retries: int = 2,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            base_url=self.base_url + "/",
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            headers=headers,
            transport=httpx.AsyncHTTPTransport(retries=connect_retries),  # connect errors only
            # idle connections close before the upstream closes them (uvicorn's and vLLM's
            # keep-alive is 5 s, httpx's default expiry too): a request sent on a connection
            # the server is closing fails with "Server disconnected" and is not retried
            limits=httpx.Limits(
                max_connections=256, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S
            ),
        )
        self.timeout_s = timeout_s

    def _failure(self, error: Exception) -> UpstreamFailure:
        if isinstance(error, httpx.TimeoutException):
            return UpstreamFailure(
                504, "timeout", f"the upstream {self.base_url} did not answer within "
                f"{self.timeout_s:g} s ({type(error).__name__})",
            )  # fmt: skip
        if isinstance(error, httpx.ConnectError):
            return UpstreamFailure(
                502, "unreachable", f"the upstream {self.base_url} is unreachable: {error}"
            )
        return UpstreamFailure(
            502,
            "transport",
            f"the upstream {self.base_url} failed: {type(error).__name__}: {error}",
        )

    async def post_json(self, path: str, body: dict) -> tuple[int, dict]:
        """(status, JSON body) of a POST; 5xx, non-JSON and transport errors raise."""
        try:
            response = await self.client.post(path, json=body)
        except httpx.HTTPError as error:
            raise self._failure(error) from None
        return response.status_code, self.read_json(response, response.content)

    def read_json(self, response: httpx.Response, content: bytes) -> dict:
        if response.status_code >= 500:
            raise UpstreamFailure(
                502, "http_5xx", f"the upstream returned {response.status_code}: "
                f"{content[:200].decode('utf-8', 'replace')}",
            )  # fmt: skip
        try:
            body = json.loads(content)
        except ValueError:
            raise UpstreamFailure(
                502, "malformed", f"the upstream's answer is not JSON (status "
                f"{response.status_code}): {content[:80].decode('utf-8', 'replace')!r}",
            ) from None  # fmt: skip
        if not isinstance(body, dict):
            raise UpstreamFailure(502, "malformed", "the upstream's answer is not a JSON object")
        return body

    async def open_stream(self, path: str, body: dict) -> httpx.Response:
        """The streamed response once its headers arrived (the caller closes it)."""
        request = self.client.build_request("POST", path, json=body)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as error:
            raise self._failure(error) from None
        if response.status_code >= 400:
            try:
                content = await response.aread()
            except httpx.HTTPError as error:
                raise self._failure(error) from None
            finally:
                await response.aclose()
            raise UpstreamStatus(response.status_code, self.read_json(response, content))
        return response

    def failure(self, error: Exception) -> UpstreamFailure:
        return self._failure(error)

    async def close(self) -> None:
        await self.client.aclose()


class UpstreamStatus(Exception):
    """The upstream refused a request with a 4xx: its own error body goes back to the client."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(f"upstream status {status}")
        self.status, self.body = status, body


# -- which model, and are they the same weights -----------------------------------------------


def upstream_model_name(
    base_url: str,
    wanted: str | None,
    local_name: str,
    timeout: float,
    option: str = "--upstream-model",
) -> str:
    """The model id to send upstream: ``wanted``, else the one model ``GET /models`` lists
    (``option``: the CLI option that chooses one, named when there are several)."""
    if wanted:
        return wanted
    url = base_url.rstrip("/") + "/models"
    try:
        listed = httpx.get(url, timeout=timeout).json()
        ids = [m["id"] for m in listed["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        raise UpstreamFailure(
            502, "unreachable", f"could not list the upstream's models at {url}: {error}"
        ) from None
    if len(ids) == 1:
        return ids[0]
    if local_name in ids:
        return local_name
    raise UpstreamFailure(502, "models", f"the upstream serves {ids}; choose one with {option}")


def probe_tolerance(local_dtype: str, upstream_dtype: str) -> float:
    """The probe's tolerance in nats: that of the coarser of the two dtypes."""
    for dtype in (local_dtype, upstream_dtype):
        if dtype not in PROBE_TOLERANCE:
            raise ValueError(
                f"no probe tolerance for dtype {dtype!r}: {', '.join(PROBE_TOLERANCE)}"
            )
    return max(PROBE_TOLERANCE[local_dtype], PROBE_TOLERANCE[upstream_dtype])


def model_dtype(model) -> str:
    """``float32`` | ``bfloat16`` | ``float16``: the dtype of the model's weights."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ProbeResult:
    upstream_model: str
    token_ids: bool  # the upstream returns token ids (``return_token_ids``)
    upstream_answer: str
    local_answer: str
    max_logprob_diff: float | None  # None: the upstream returned no log-probs
    problem: str | None  # one line saying what differed; None = the same weights
    # how far below the local greedy token's log-prob the upstream's tokens are (nats; 0: the
    # same greedy answer); None without the upstream's ids
    max_margin: float | None = None
    dtypes: tuple[str, str] = ("float32", "float32")  # (local, upstream)
    tolerance: float = PROBE_LOGPROB_TOLERANCE

    def to_json(self) -> dict:
        return self.__dict__.copy()


def local_greedy(engine, prompt: str, n: int) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, greedy answer ids, their log-probs) of the local model, end token dropped."""
    prompt_ids = engine.encode(prompt)
    device = next(engine.model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    ends = stop_ids(engine.model, engine.tokenizer)
    answer, logprobs = [], []
    with engine.lock, torch.inference_mode():
        for _ in range(n):  # a few whole passes: no cache to get wrong
            logits = engine.model(input_ids=ids, use_cache=False).logits
            logp = torch.log_softmax(logits[0, -1].float(), -1)
            token = int(logp.argmax())
            if token in ends:
                break
            answer.append(token)
            logprobs.append(float(logp[token]))
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return prompt_ids, answer, logprobs


def local_reading(
    engine, prompt_ids: Sequence[int], answer: Sequence[int], ended: bool
) -> tuple[list[float], list[float], list[int]]:
    """The local model reading ``answer`` teacher-forced: (each token's log-prob, how far it
    lies below the local greedy token's, the local greedy token), plus, when ``ended``, one
    more margin and greedy token after the answer (the margin: the best end token's)."""
    device = next(engine.model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(answer)], device=device)
    with engine.lock, torch.inference_mode():
        logits = engine.model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 :]
    logp = torch.log_softmax(logits.float(), -1)  # (T + 1, V): row t predicts answer token t
    index = torch.tensor(list(answer), dtype=torch.long, device=device)[:, None]
    chosen = logp[: len(answer)].gather(-1, index)[:, 0]
    margins = (logp[: len(answer)].max(-1).values - chosen).tolist()
    if ended:
        ends = sorted(stop_ids(engine.model, engine.tokenizer))
        margins.append(float(logp[-1].max() - logp[-1, ends].max()))
    best = logp[: len(margins)].argmax(-1).tolist()
    return chosen.tolist(), margins, best


def _first_difference(a: Sequence, b: Sequence) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def probe_weights(
    engine, base_url: str, upstream_model: str, timeout: float, upstream_dtype: str | None = None
) -> ProbeResult:
    """Send the fixed greedy probe upstream and compare it with the local model's reading
    (``upstream_dtype``: the dtype the upstream computes in; None = the local model's)."""
    local_dtype = model_dtype(engine.model)
    upstream_dtype = upstream_dtype or local_dtype
    tolerance = probe_tolerance(local_dtype, upstream_dtype)
    chat = bool(getattr(engine.tokenizer, "chat_template", None))
    body = {"model": upstream_model, "max_tokens": PROBE_TOKENS, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    if chat:
        body.update(messages=list(PROBE_MESSAGES), logprobs=True)
    else:  # the completions API: its log-probs option is a count
        body.update(prompt=PROBE_PROMPT, logprobs=1)
    url = base_url.rstrip("/") + ("/chat/completions" if chat else "/completions")
    try:
        response = httpx.post(url, json=body, timeout=timeout)
        if 400 <= response.status_code < 500:  # a server that refuses the extra fields
            body.pop("return_token_ids"), body.pop("logprobs")
            response = httpx.post(url, json=body, timeout=timeout)
        response.raise_for_status()
        out = response.json()
        choice = out["choices"][0]
        text = (choice["message"]["content"] if chat else choice["text"]) or ""
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
        raise UpstreamFailure(
            502, "probe", f"the weights probe to {url} failed: {type(error).__name__}: {error}"
        ) from None
    prompt = engine.render_chat(list(PROBE_MESSAGES)) if chat else PROBE_PROMPT
    prompt_ids, local_ids, local_logprobs = local_greedy(engine, prompt, PROBE_TOKENS)
    local_text = engine.tokenizer.decode(local_ids, skip_special_tokens=True)
    ids = choice.get("token_ids")
    problem = margin = None
    sides = f"local {local_dtype}, upstream {upstream_dtype}"
    upstream_prompt = out.get("prompt_token_ids", choice.get("prompt_token_ids"))
    if upstream_prompt is not None and list(upstream_prompt) != prompt_ids:
        i = _first_difference(upstream_prompt, prompt_ids)
        problem = (
            f"the upstream tokenizes the probe prompt differently ({len(upstream_prompt)} vs "
            f"{len(prompt_ids)} tokens, first difference at token {i})"
        )
    elif ids is not None:
        ids = strip_end_tokens(engine, ids)
        ended = len(ids) < PROBE_TOKENS  # the upstream chose an end token after them
        local_logprobs, margins, best = local_reading(engine, prompt_ids, ids, ended)
        margin = max(margins, default=0.0)
        if ids != local_ids and margin > tolerance:
            i = next(k for k, m in enumerate(margins) if m > tolerance)
            theirs = engine.tokenizer.decode(ids[i : i + 1]) if i < len(ids) else "<end>"
            ours = engine.tokenizer.decode([best[i]])  # after the upstream's tokens before it
            problem = (
                f"greedy probe token {i} is {theirs!r} upstream but {ours!r} here ({theirs!r} "
                f"lies {margins[i]:.3f} nats below it; tolerance {tolerance}, {sides})"
            )
    elif text.strip() != local_text.strip():
        problem = f"greedy probe answer is {text!r} upstream but {local_text!r} here"
    diff = None
    returned = choice.get("logprobs") or {}
    theirs = [c["logprob"] for c in returned.get("content") or []]  # chat
    theirs = theirs or returned.get("token_logprobs") or []  # completions
    if theirs and problem is None:
        theirs = [float(v) for v in theirs[: len(local_logprobs)]]
        diff = max((abs(a - b) for a, b in zip(theirs, local_logprobs, strict=False)), default=0.0)
        if not math.isfinite(diff) or diff > tolerance:
            problem = (
                f"greedy probe log-probs differ by up to {diff:.3f} nats (tolerance {tolerance}, "
                f"{sides}): same tokens, other weights or dtype"
                + (
                    ""
                    if upstream_dtype != local_dtype
                    else " (--upstream-dtype names the upstream's)"
                )
            )
    return ProbeResult(
        upstream_model, ids is not None, text, local_text, diff, problem, margin,
        (local_dtype, upstream_dtype), tolerance,
    )  # fmt: skip
