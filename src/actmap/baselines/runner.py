"""Run every baseline on a map store's balanced rows, and compare methods on the test rows.

    run_baselines(store, methods)      -> results/<method> tables + manifest["results"][method]
    compare_methods(store, run_dirs)   -> one metrics row per method (and per ActMap run)

Rows: every method reads the identical balanced rows (`actmap.rows.balanced_splits`).
Unsupervised methods score the balanced test rows (``rows="all-balanced"``: every
balanced row); supervised ones (TAD, ACT-ViT, the answer-length control) fit on
the balanced train rows, select on the balanced validation rows and score the
balanced test rows.

Inputs come from the store through one builder per input family (`INPUT_FAMILY`,
`INPUT_BUILDERS`): captured `Generation` records, the same with attention
(RAUQ, TAD), verification pairs (P(True)), sampled answers (Semantic Entropy,
EigenScore; drawn once, kept in the ``samples`` table and reused), and the dense
states (ACT-ViT). A result table holds ``id, split, confidence, raw`` (float64)
plus any per-row details of the method (e.g. ACT-ViT's confidence per seed).
A method whose results already cover the requested rows is skipped unless
``force``; a method that cannot run is reported with its reason and the others
still run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from actmap import __version__
from actmap.baselines.base import BaselineUnavailable, ScoreResult
from actmap.baselines.registry import baseline_class, create_baseline, list_baselines
from actmap.capture.run import latest_rows, read_generations
from actmap.data.splits import SPLITS
from actmap.rows import balanced_splits
from actmap.store import MapStore, decode_array, encode_array

log = logging.getLogger(__name__)

ALIASES = {
    "ppl": "perplexity",
    "mte": "mean_token_entropy",
    "ptrue": "p_true",
    "se": "semantic_entropy",
    "es": "eigenscore",
    "length": "answer_length",
}
# "all", cheapest first; permuted_label wraps another scorer and runs only when named
DEFAULT_METHODS = (
    "perplexity",
    "mean_token_entropy",
    "answer_length",
    "rauq",
    "tad",
    "p_true",
    "eigenscore",
    "semantic_entropy",
    "actvit",
)
ROW_SETS = {"balanced": ("test",), "all-balanced": SPLITS}  # splits unsupervised methods score
JUDGES = {"qwen2.5-coder-1.5b-instruct": "~/.cache/actmap-models/qwen2.5-coder-1.5b-instruct.gguf"}
SAMPLES_TABLE = "samples"
JUDGE_CACHE = "judge-cache.json"
# raw_name of methods whose confidence is an estimate of p(correct) (ECE is meaningful)
PROBABILITY_RAW_NAMES = ("neg_log_p_true", "p_correct_from_length", "p_correct")

Progress = Callable[[str, int, int, str], None]  # (method, done, total, what is happening)


@dataclass(frozen=True)
class BaselineOptions:
    """Settings of one `run_baselines` call; the relevant ones are recorded with each result."""

    force: bool = False  # recompute methods whose stored results already cover the rows
    model: str | None = None  # generator for P(True) and sampling; None = the store's own model
    device: str | None = None  # "cpu" | "cuda"; None = cuda when available
    judge: str | None = "qwen2.5-coder-1.5b-instruct"  # SE's LLM judge (name or path); None = none
    instruct: bool = True  # RAUQ's alpha rule; every generator in the paper is instruction-tuned
    tad_previous: int | None = None  # TAD's K; None = min(10, attention keys in the store)
    n_samples: int = 10  # SE and EigenScore: answers sampled per prompt
    temperature: float = 1.0  # Nature SE sampling
    top_p: float = 0.9  # Nature SE sampling
    sample_max_new_tokens: int | None = None  # None = the store's capture max_new_tokens
    sample_seed: int = 0  # each row's sampling seed derives from it and the row id
    samples_commit_every: int = 16  # prompts per samples shard (what a killed run loses)
    ptrue_batch_size: int = 8  # verification prompts per forward pass
    actvit_grid: str | tuple = "full"  # "full" (24 configs), "small" (6), or ACTViTConfigs
    actvit_epochs: int | None = 15  # ACT-ViT's published 15 epochs; None = each config's own
    actvit_seeds: tuple[int, ...] = (42, 123, 456)  # selection seed first, then retrains
    permuted_inner: str = "tad"  # the supervised scorer permuted_label refits on shuffled labels
    score_chunk: int = 64  # rows per score() call: progress and judge-cache saves in between

    def __post_init__(self) -> None:
        if self.n_samples < 2:
            raise ValueError(f"n_samples must be >= 2 (SE and EigenScore), got {self.n_samples}")
        if self.score_chunk < 1 or self.samples_commit_every < 1:
            raise ValueError("score_chunk and samples_commit_every must be >= 1")
        if isinstance(self.actvit_grid, str) and self.actvit_grid not in ("full", "small"):
            raise ValueError(f"actvit_grid must be 'full' or 'small', got {self.actvit_grid!r}")


@dataclass(frozen=True)
class MethodResult:
    """What happened to one method in a `run_baselines` call."""

    method: str
    status: str  # "done" | "skipped" (results already stored) | "unavailable" | "failed"
    reason: str = ""  # why it was skipped, unavailable or failed
    rows: int = 0  # rows scored now, or already stored when skipped
    record: dict = field(default_factory=dict)  # the manifest entry of the stored results


def resolve_methods(spec: str | Sequence[str]) -> list[str]:
    """Registry names, in order and unique, from "all" or comma-separated names and aliases."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip() for n in names if n.strip()]
    if names == ["all"]:
        return list(DEFAULT_METHODS)
    known = list_baselines()
    out = []
    for name in names:
        method = ALIASES.get(name, name)
        if method not in known:
            raise ValueError(
                f"unknown method {name!r}; known: all, {', '.join(known)} "
                f"(aliases: {', '.join(f'{a}={m}' for a, m in ALIASES.items())})"
            )
        if method not in out:
            out.append(method)
    if not out:
        raise ValueError("no method given; use 'all' or a comma-separated list")
    return out


# -- the run context: the store's rows, and models loaded once, on first need ------------------
@dataclass
class Context:
    """One run's store, balanced rows and options; tables and models are read or loaded once."""

    store: MapStore
    options: BaselineOptions
    splits: dict[str, list[str]]
    model: Any = None
    tokenizer: Any = None
    judge: Any = None
    progress: Progress | None = None
    _generations: dict = field(default_factory=dict)
    _meta: Any = None
    _questions: dict | None = None
    _samples: dict = field(default_factory=dict)  # id -> (SampleSet, sampling seconds)
    _tables: dict = field(default_factory=dict)  # side tables read once (latest row per id)
    _lm_error: BaselineUnavailable | None = None
    sample_counts: dict = field(default_factory=dict)

    def report(self, method: str, done: int, total: int, info: str = "") -> None:
        if self.progress is not None:
            self.progress(method, done, total, info)

    @cached_property
    def split_of(self) -> dict[str, str]:
        return {key: split for split, ids in self.splits.items() for key in ids}

    def meta(self):
        """The maps metadata (no map bytes), indexed by id."""
        if self._meta is None:
            self._meta = self.store.metadata().set_index("id")
        return self._meta

    def labels(self, ids: Sequence[str]) -> np.ndarray:
        return self.meta().loc[list(ids), "label"].to_numpy(dtype=np.int64)

    def questions(self) -> dict[str, str]:
        if self._questions is None:
            table = latest_rows(self.store.read_table("generations", ["id", "question"]))
            self._questions = dict(
                zip(
                    table.column("id").to_pylist(),
                    table.column("question").to_pylist(),
                    strict=True,
                )
            )
        return self._questions

    def generations(self, ids: Sequence[str]) -> list:
        """Generation records (trajectories dropped: no baseline reads them), read once."""
        if not self._generations:
            every = [key for split in SPLITS for key in self.splits[split]]
            for gen, key in zip(read_generations(self.store, every), every, strict=True):
                self._generations[key] = dataclasses.replace(gen, trajectory=_no_trajectory())
        return [self._generations[key] for key in ids]

    def table(self, name: str) -> tuple[pa.Table, dict[str, int]]:
        """A side table (last row per id) and its id -> row index, read once."""
        if name not in self._tables:
            table = latest_rows(self.store.read_table(name))
            index = {key: i for i, key in enumerate(table.column("id").to_pylist())}
            self._tables[name] = (table, index)
        return self._tables[name]

    def generator_name(self) -> str:
        return self.options.model or self.store.manifest.get("config", {}).get("model", {}).get(
            "name", "unknown"
        )

    def lm(self) -> tuple[Any, Any]:
        """(model, tokenizer): the ones passed in, else the store's generator, loaded once."""
        if self._lm_error is not None:  # one failed load answers every later method at once
            raise self._lm_error
        if self.model is None or self.tokenizer is None:
            try:
                self.model, self.tokenizer = _load_generator(self)
            except BaselineUnavailable as err:
                self._lm_error = err
                raise
        return self.model, self.tokenizer

    def entailment_judge(self):
        """The SE judge behind a cache persisted to <store>/judge-cache.json."""
        from actmap.baselines.judges import CachedJudge, load_llm_judge

        if self.judge is None:
            if self.options.judge is None:
                raise BaselineUnavailable(
                    "Semantic Entropy needs an entailment judge and --judge none was given"
                )
            path = JUDGES.get(self.options.judge, self.options.judge)
            self.judge = load_llm_judge(path, device=self.device())
        if not isinstance(self.judge, CachedJudge):
            self.judge = CachedJudge(self.judge, self.store.root / JUDGE_CACHE)
        return self.judge

    def device(self) -> str:
        if self.options.device:
            return self.options.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def _no_trajectory():
    import torch

    return torch.empty(0)


def _load_generator(ctx: Context) -> tuple[Any, Any]:
    from actmap.models import load_model

    stored = ctx.store.manifest.get("config", {}).get("model", {})
    name = ctx.generator_name()
    revision = stored.get("revision") or "main"
    ctx.report("model", 0, 1, f"loading {name}")
    try:
        model, tokenizer, source = load_model(name, revision=revision, device=ctx.device())
    except (OSError, ValueError) as err:  # FileNotFoundError is an OSError
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise BaselineUnavailable(
            f"cannot load the generator {name!r} ({first_line}); pass --model with a local "
            "folder or .gguf file of the model that wrote the store"
        ) from err
    if name == stored.get("name") and source.revision != stored.get("revision"):
        log.warning(
            "generator %s has revision %s but the store was written by revision %s",
            name,
            source.revision,
            stored.get("revision"),
        )
    ctx.report("model", 1, 1, f"loaded {name}")
    return model, tokenizer


# -- rows ---------------------------------------------------------------------------------------
def rows_for(ctx: Context, supervised: bool, rows: str) -> tuple[list, list, list]:
    """(fit ids, selection ids, scored ids) of one method."""
    if supervised:
        return ctx.splits["train"], ctx.splits["validation"], ctx.splits["test"]
    return [], [], [key for split in ROW_SETS[rows] for key in ctx.splits[split]]


def stored_ids(store: MapStore, method: str) -> set[str]:
    return store.ids(f"results/{method}")


# -- input builders: one per input family -------------------------------------------------------
def generation_inputs(ctx: Context, method: str, ids: Sequence[str]) -> list:
    return ctx.generations(ids)


CAPTURE_HINTS = {"attention": "--attention-keys 10", "dense": "--keep-dense"}


def require_table(store: MapStore, table: str, method: str) -> None:
    if not store.has_table(table):
        raise BaselineUnavailable(
            f"{method} reads captured {table} but the store has no '{table}' table; "
            f"capture with {CAPTURE_HINTS[table]}"
        )


def attention_inputs(ctx: Context, method: str, ids: Sequence[str]) -> list:
    require_table(ctx.store, "attention", method)
    return ctx.generations(ids)


def verification_inputs(ctx: Context, method: str, ids: Sequence[str]) -> list:
    from actmap.baselines.ptrue import PTrueInput

    questions, meta = ctx.questions(), ctx.meta()
    return [PTrueInput(question=questions[k], answer=meta.at[k, "answer"]) for k in ids]


def dense_inputs(ctx: Context, method: str, ids: Sequence[str]):
    """(n, 8, 100, D) float16 ACT-ViT inputs from the ``dense`` table."""
    import torch

    from actmap.baselines.actvit import actvit_tensor

    require_table(ctx.store, "dense", method)
    table, index = ctx.table("dense")
    missing = [key for key in ids if key not in index]
    if missing:
        raise BaselineUnavailable(f"{len(missing)} rows have no dense states, e.g. {missing[:3]}")
    tensors = []
    for key in ids:
        row = index[key]
        shape = table.column("shape")[row].as_py()  # (8, N, D)
        array = decode_array(table.column("dense")[row].as_py(), shape).copy()
        tensors.append(actvit_tensor(torch.from_numpy(array)))  # (8, 100, D)
    return torch.stack(tensors)


def sample_inputs(ctx: Context, method: str, ids: Sequence[str]) -> list:
    """SampleSets for ``ids``: reused from the ``samples`` table, the missing ones drawn now."""
    request = sampling_request(ctx)
    key = json.dumps(request, sort_keys=True)
    if not ctx._samples:
        ctx._samples = read_samples(ctx.store, key, ctx)
    todo = [k for k in ids if k not in ctx._samples]
    ctx.sample_counts = {"reused": len(ids) - len(todo), "sampled": len(todo)}
    if todo:
        draw_samples(ctx, method, todo, request, key)
    return [ctx._samples[k][0] for k in ids]


INPUT_FAMILY = {
    "perplexity": "generations",
    "mean_token_entropy": "generations",
    "answer_length": "generations",
    "rauq": "attention",
    "tad": "attention",
    "p_true": "verification",
    "semantic_entropy": "samples",
    "eigenscore": "samples",
    "actvit": "dense",
}
INPUT_BUILDERS: dict[str, Callable[[Context, str, Sequence[str]], Any]] = {
    "generations": generation_inputs,
    "attention": attention_inputs,
    "verification": verification_inputs,
    "samples": sample_inputs,
    "dense": dense_inputs,
}


def input_family(method: str, options: BaselineOptions) -> str:
    if method == "permuted_label":
        return INPUT_FAMILY[options.permuted_inner]
    return INPUT_FAMILY[method]


# -- sampled answers (Semantic Entropy, EigenScore) ---------------------------------------------
def sampling_request(ctx: Context) -> dict:
    """What decides a row's samples; rows sampled under another request are drawn again."""
    from actmap.baselines.sampling import NATURE_STOP_STRINGS

    o = ctx.options
    capture = ctx.store.manifest.get("config", {}).get("capture", {})
    return {
        "model": ctx.generator_name(),
        "n_samples": o.n_samples,
        "temperature": o.temperature,
        "top_p": o.top_p,
        "top_k": 50,
        "max_new_tokens": o.sample_max_new_tokens or capture.get("max_new_tokens", 32),
        "stop_strings": list(NATURE_STOP_STRINGS),
        "logprob_source": "processed",
        "seed": o.sample_seed,
    }


def row_seed(seed: int, key: str) -> int:
    """The sampling seed of one row: fixed by (seed, id), so resuming never changes a sample."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:4], "big") >> 1


def draw_samples(ctx: Context, method: str, todo: list[str], request: dict, key: str) -> None:
    """Sample ``todo`` one prompt at a time; commit a shard every ``samples_commit_every`` rows."""
    from actmap.baselines.sampling import sample_answers

    model, tokenizer = ctx.lm()
    prompts, questions = ctx.meta()["prompt"], ctx.questions()
    kwargs = {k: v for k, v in request.items() if k not in ("model", "seed")}
    pending: list[tuple[str, Any, float]] = []
    for done, row in enumerate(todo, start=1):
        start = time.perf_counter()
        (sampled,) = sample_answers(
            model,
            tokenizer,
            [prompts[row]],
            questions=[questions[row]],
            seed=row_seed(request["seed"], row),
            **kwargs,
        )
        sampled = dataclasses.replace(  # as stored: scores never depend on a resume
            sampled,
            embeddings=sampled.embeddings.half().float(),
            config=dataclasses.replace(sampled.config, seed=request["seed"]),
        )
        pending.append((row, sampled, time.perf_counter() - start))
        if len(pending) == ctx.options.samples_commit_every or done == len(todo):
            ctx.store.write_table(SAMPLES_TABLE, samples_table(pending, key))
            ctx._samples.update({k: (s, t) for k, s, t in pending})
            pending = []
        ctx.report(method, done, len(todo), f"sampling {request['n_samples']} answers")


def samples_table(rows: list[tuple[str, Any, float]], key: str) -> pa.Table:
    sets = [s for _, s, _ in rows]
    return pa.table(
        {
            "id": [k for k, _, _ in rows],
            "request": [key] * len(rows),
            "config": [json.dumps(dataclasses.asdict(s.config)) for s in sets],
            "question": [s.question for s in sets],
            "texts": [list(s.texts) for s in sets],
            "token_ids": pa.array(
                [[list(t) for t in s.token_ids] for s in sets], pa.list_(pa.list_(pa.int32()))
            ),
            "token_logprobs": pa.array(
                [[lp.tolist() for lp in s.token_logprobs] for s in sets],
                pa.list_(pa.list_(pa.float32())),
            ),
            "mean_logprobs": pa.array([s.mean_logprobs.tolist() for s in sets]),
            "stopped": [list(s.stopped) for s in sets],
            "shape": pa.array([list(s.embeddings.shape) for s in sets], pa.list_(pa.int32())),
            "embeddings": [encode_array(s.embeddings.numpy()) for s in sets],
            "sampling_s": pa.array([t for _, _, t in rows], pa.float64()),
        }
    )


def read_samples(store: MapStore, key: str, ctx: Context) -> dict[str, tuple[Any, float]]:
    """{id: (SampleSet, sampling seconds)} of the rows sampled under request ``key``."""
    import torch

    from actmap.baselines.sampling import SampleSet, SamplingConfig

    if not store.has_table(SAMPLES_TABLE):
        return {}
    table = store.read_table(SAMPLES_TABLE)
    table = latest_rows(table.filter(pc.equal(table.column("request"), key)))
    prompts = ctx.meta()["prompt"]
    out = {}
    for row in table.to_pylist():
        config = json.loads(row["config"])
        config = SamplingConfig(**{**config, "stop_strings": tuple(config["stop_strings"])})
        embeddings = decode_array(row["embeddings"], row["shape"]).astype(np.float32)
        out[row["id"]] = (
            SampleSet(
                prompt=prompts.get(row["id"], ""),
                question=row["question"],
                texts=tuple(row["texts"]),
                token_ids=tuple(tuple(t) for t in row["token_ids"]),
                token_logprobs=tuple(torch.tensor(lp) for lp in row["token_logprobs"]),
                mean_logprobs=torch.tensor(row["mean_logprobs"], dtype=torch.float64),
                embeddings=torch.from_numpy(embeddings),
                stopped=tuple(row["stopped"]),
                config=config,
            ),
            row["sampling_s"],
        )
    return out


# -- scorers: constructor arguments that depend on the store or the options ---------------------
def _attention_keys(store: MapStore) -> int:
    shape = store.read_table("attention", ["shape"]).column("shape")[0].as_py()
    return int(shape[-1])  # (T, L, H, K)


def make_tad(ctx: Context):
    from actmap.baselines.tad import TAD

    require_table(ctx.store, "attention", "tad")
    keys = _attention_keys(ctx.store)
    k = ctx.options.tad_previous or min(10, keys)
    if k < 10:
        log.warning(
            "TAD reads K=%d previous tokens (the store keeps %d; upstream uses 10)", k, keys
        )
    return TAD(n_previous=k)


def make_ptrue(ctx: Context):
    from actmap.baselines.ptrue import PTrue

    model, tokenizer = ctx.lm()
    return PTrue(model, tokenizer, batch_size=ctx.options.ptrue_batch_size)


def make_actvit(ctx: Context):
    from actmap.baselines.actvit import SWEEP_GRID, ACTViTScorer

    require_table(ctx.store, "dense", "actvit")
    grid = ctx.options.actvit_grid
    if grid == "full":
        grid = SWEEP_GRID
    elif grid == "small":  # the paper's selected width and depth; every decay and patch shape
        grid = tuple(c for c in SWEEP_GRID if c.dim == 128 and c.depth == 1)
    return ACTViTScorer(
        grid=tuple(grid),
        epochs=ctx.options.actvit_epochs,
        seeds=ctx.options.actvit_seeds,
        device=ctx.options.device,
    )


def make_permuted(ctx: Context):
    from actmap.baselines.controls import PermutedLabelControl

    inner = ctx.options.permuted_inner
    if inner == "permuted_label" or not baseline_class(inner).supervised:
        raise ValueError(f"permuted_label needs a supervised inner scorer, got {inner!r}")
    make_scorer(ctx, inner)  # fail early (e.g. missing attention) rather than inside fit
    return PermutedLabelControl(lambda: make_scorer(ctx, inner))


SCORER_FACTORIES: dict[str, Callable[[Context], Any]] = {
    "rauq": lambda ctx: create_baseline("rauq", instruct=ctx.options.instruct),
    "tad": make_tad,
    "p_true": make_ptrue,
    "semantic_entropy": lambda ctx: create_baseline(
        "semantic_entropy", judge=ctx.entailment_judge()
    ),
    "actvit": make_actvit,
    "permuted_label": make_permuted,
}


def make_scorer(ctx: Context, method: str):
    factory = SCORER_FACTORIES.get(method)
    return factory(ctx) if factory is not None else create_baseline(method)


# -- scoring and storing ------------------------------------------------------------------------
def split_details(details: dict, n: int) -> tuple[dict, dict[str, Any]]:
    """(settings, per-row columns): 1-D arrays of length n and lists of n lists are per row."""

    def per_row(value: Any) -> bool:
        if isinstance(value, np.ndarray):
            return value.ndim == 1 and len(value) == n
        return (
            isinstance(value, list)
            and len(value) == n
            and all(isinstance(v, list | tuple | np.ndarray) for v in value)
        )

    settings, columns = {}, {}
    for key, value in details.items():
        if isinstance(value, dict) and value and all(per_row(v) for v in value.values()):
            columns.update({f"{key}_{sub}": v for sub, v in value.items()})
        elif per_row(value):
            columns[key] = value
        else:
            settings[key] = value
    return settings, columns


def json_safe(value: Any) -> Any:
    """Plain JSON types; non-finite floats become None, dict keys strings."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist())
    if isinstance(value, np.generic):
        return json_safe(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def score_in_chunks(ctx: Context, method: str, scorer, rows) -> tuple[ScoreResult, dict, float]:
    """Score ``rows`` a chunk at a time -> (merged result, per-row columns, scoring seconds)."""
    chunk, n = ctx.options.score_chunk, len(rows)
    confidence, raw, columns, seconds = [], [], {}, 0.0
    settings, raw_name = {}, ""
    judge = getattr(scorer, "judge", None)
    try:
        for start in range(0, n, chunk):
            part = rows[start : start + chunk]
            tick = time.perf_counter()
            result = scorer.score(part)
            seconds += time.perf_counter() - tick
            settings, cols = split_details(result.details, len(part))
            raw_name = result.raw_name
            confidence.append(np.asarray(result.confidence, dtype=np.float64))
            raw.append(np.asarray(result.raw, dtype=np.float64))
            for name, values in cols.items():
                columns.setdefault(name, []).extend(list(values))
            if getattr(judge, "path", None) is not None:
                judge.save()  # a killed run keeps every judged pair
            ctx.report(method, min(start + chunk, n), n, "scoring")
    finally:
        if getattr(judge, "path", None) is not None:
            judge.save()
    if judge is not None and hasattr(judge, "hits"):
        settings["judge_cache"] = {"hits": judge.hits, "misses": judge.misses}
    merged = ScoreResult(np.concatenate(confidence), np.concatenate(raw), raw_name, settings)
    return merged, columns, seconds


def results_table(ids: Sequence[str], split_of: dict, result: ScoreResult, columns: dict):
    table = {
        "id": list(ids),
        "split": [split_of[k] for k in ids],
        "confidence": pa.array(result.confidence, pa.float64()),
        "raw": pa.array(result.raw, pa.float64()),
    }
    for name, values in columns.items():
        table[name] = pa.array([np.asarray(v).tolist() for v in values])
    return pa.table(table)


def timing_record(ctx: Context, method: str, ids, scoring_s: float, fit_s: float | None) -> dict:
    """Latency per answer in ms; sampling methods add their sampling time per answer."""
    n = len(ids)
    record = {"scoring_time_s": scoring_s, "scoring_ms_per_answer": 1000 * scoring_s / n}
    if fit_s is not None:
        record["fit_time_s"] = fit_s
    total = record["scoring_ms_per_answer"]
    if input_family(method, ctx.options) == "samples":
        sampling = 1000 * float(np.mean([ctx._samples[k][1] for k in ids]))
        record["sampling_ms_per_answer"] = sampling
        if method == "semantic_entropy":
            record["judging_ms_per_answer"] = record["scoring_ms_per_answer"]
        record["samples"] = dict(ctx.sample_counts)
        total += sampling
    if method == "actvit":  # ACT-ViT's score() runs the checkpoint of every seed
        record["models_per_answer"] = len(ctx.options.actvit_seeds)
    record["latency_ms_per_answer"] = total
    return record


def run_method(ctx: Context, method: str, rows: str) -> MethodResult:
    started = time.perf_counter()
    supervised = baseline_class(method).supervised
    fit_ids, val_ids, ids = rows_for(ctx, supervised, rows)
    if not ids:
        raise BaselineUnavailable(
            "no balanced rows to score (a split needs both correct and incorrect answers)"
        )
    if not ctx.options.force and set(ids) <= stored_ids(ctx.store, method):
        record = ctx.store.manifest.get("results", {}).get(method, {})
        reason = f"results already cover the {len(ids)} rows (--force recomputes)"
        return MethodResult(method, "skipped", reason, len(ids), record)
    ctx.report(method, 0, len(ids), "preparing")
    scorer = make_scorer(ctx, method)
    build = INPUT_BUILDERS[input_family(method, ctx.options)]
    fit_s = None
    if supervised:
        train, val = build(ctx, method, fit_ids), build(ctx, method, val_ids)
        ctx.report(method, 0, len(ids), f"fitting on {len(fit_ids)} rows")
        tick = time.perf_counter()
        scorer.fit(train, ctx.labels(fit_ids), val, ctx.labels(val_ids))
        fit_s = time.perf_counter() - tick
    result, columns, scoring_s = score_in_chunks(ctx, method, scorer, build(ctx, method, ids))
    if not np.isfinite(result.confidence).all():
        log.warning(
            "%s: %d non-finite confidences", method, int((~np.isfinite(result.confidence)).sum())
        )
    ctx.store.replace_table(f"results/{method}", results_table(ids, ctx.split_of, result, columns))
    record = {
        "raw_name": result.raw_name,
        "details": json_safe(result.details),
        "supervised": supervised,
        "rows": len(ids),
        "splits": {s: sum(ctx.split_of[k] == s for k in ids) for s in SPLITS},
        **({"fit_rows": {"train": len(fit_ids), "validation": len(val_ids)}} if supervised else {}),
        **timing_record(ctx, method, ids, scoring_s, fit_s),
        "wall_time_s": time.perf_counter() - started,
        "finished_at": datetime.now(UTC).isoformat(),
        "package_version": __version__,
    }
    results = {**ctx.store.manifest.get("results", {}), method: json_safe(record)}
    ctx.store.update_manifest(results=results)
    return MethodResult(method, "done", "", len(ids), results[method])


def run_baselines(
    store: MapStore,
    methods: str | Sequence[str],
    *,
    model=None,
    tokenizer=None,
    judge=None,
    rows: str = "balanced",
    progress: Progress | None = None,
    options: BaselineOptions = BaselineOptions(),
) -> dict[str, MethodResult]:
    """Score the store's balanced rows with every method; one `MethodResult` per method.

    ``model``/``tokenizer``: the generator (default: the store's, loaded when a
    method needs it). ``judge``: Semantic Entropy's entailment judge (default:
    ``options.judge`` loaded with `load_llm_judge`); either way it is cached in
    ``<store>/judge-cache.json``. ``progress(method, done, total, info)`` is
    called as work advances.
    """
    if rows not in ROW_SETS:
        raise ValueError(f"rows must be one of {sorted(ROW_SETS)}, got {rows!r}")
    names = resolve_methods(methods)
    ctx = Context(store, options, balanced_splits(store), model, tokenizer, judge, progress)
    results = {}
    for method in names:
        try:
            results[method] = run_method(ctx, method, rows)
        except BaselineUnavailable as err:
            log.warning("%s unavailable: %s", method, err)
            results[method] = MethodResult(method, "unavailable", str(err))
        except Exception as err:  # one method's failure must not stop the others
            log.exception("%s failed", method)
            results[method] = MethodResult(method, "failed", f"{type(err).__name__}: {err}")
    return results


# -- comparison on the balanced test rows -------------------------------------------------------
def _metric_row(method: str, kind: str, per_seed: list[dict], n: int, note: str = "") -> dict:
    """Mean (and std over seeds, ddof=1, when there are several) of per-seed metrics."""
    from actmap.metrics import seed_summary

    row = {"method": method, "kind": kind, "n": n, "seeds": len(per_seed), "note": note}
    for name in ("auroc", "auprc", "ece"):
        values = [m[name] for m in per_seed]
        if any(v is None for v in values):
            row[name], row[f"{name}_std"] = None, None
            continue
        mean, std = seed_summary(values)
        row[name], row[f"{name}_std"] = mean, (std if len(values) > 1 else None)
    return row


def _metrics(confidence: np.ndarray, labels: np.ndarray, probability: bool) -> dict:
    from actmap.metrics import auprc, auroc, ece

    return {
        "auroc": auroc(confidence, labels),
        "auprc": auprc(confidence, labels),
        "ece": ece(confidence, labels) if probability else None,
    }


def is_probability(record: dict, confidence: np.ndarray) -> bool:
    """ECE applies when the method estimates p(correct) and every value lies in [0, 1]."""
    raw_name = str(record.get("raw_name", "")).removeprefix("permuted_")
    estimates_p = raw_name in PROBABILITY_RAW_NAMES or (
        raw_name == "tad_uncertainty" and record.get("details", {}).get("aggregation") == "mean"
    )
    return estimates_p and bool(np.all((confidence >= 0) & (confidence <= 1)))


def baseline_row(store: MapStore, method: str, test: list[str], labels: np.ndarray) -> dict:
    frame = latest_rows(store.read_table(f"results/{method}")).to_pandas().set_index("id")
    keep = np.array([key in frame.index for key in test])
    present = [key for key, k in zip(test, keep, strict=True) if k]
    y = labels[keep]
    record = store.manifest.get("results", {}).get(method, {})
    kind = "control" if method in ("answer_length", "permuted_label") else "baseline"
    notes = [] if len(present) == len(test) else [f"scored {len(present)}/{len(test)} test rows"]
    if len(np.unique(y)) < 2:
        return _metric_row(
            method,
            kind,
            [{"auroc": None, "auprc": None, "ece": None}],
            len(y),
            "; ".join([*notes, "test rows lack a class"]),
        )
    seed_columns = sorted(c for c in frame.columns if c.startswith("confidence_by_seed_"))
    columns = seed_columns if len(seed_columns) > 1 else ["confidence"]
    per_seed = []
    for column in columns:
        confidence = frame.loc[present, column].to_numpy(dtype=np.float64)
        probability = is_probability(record, confidence)
        per_seed.append(_metrics(confidence, y, probability))
    if per_seed[0]["ece"] is None:
        notes.append(f"ECE n/a: confidence is not a probability ({record.get('raw_name', '?')})")
    row = _metric_row(method, kind, per_seed, len(y), "; ".join(notes))
    row["latency_ms"] = record.get("latency_ms_per_answer")
    return row


def length_control_row(store: MapStore, splits: dict[str, list[str]]) -> dict:
    """The answer-length-only control, fit here on the balanced train rows when not stored."""
    from actmap.baselines.controls import AnswerLengthPredictor

    meta = store.metadata().set_index("id")

    def rows(split: str) -> tuple[list, np.ndarray]:
        ids = splits[split]
        lengths = meta.loc[ids, "n_tokens"].tolist()
        return [SimpleNamespace(n_tokens=n) for n in lengths], meta.loc[ids, "label"].to_numpy(
            dtype=np.int64
        )

    (x_train, y_train), (x_test, y_test) = rows("train"), rows("test")
    if len(np.unique(y_train)) < 2:
        return _metric_row(
            "answer_length",
            "control",
            [{"auroc": None, "auprc": None, "ece": None}],
            len(y_test),
            "balanced train rows lack a class",
        )
    scores = AnswerLengthPredictor().fit(x_train, y_train).score(x_test).confidence
    row = _metric_row(
        "answer_length",
        "control",
        [_metrics(scores, y_test, True)],
        len(y_test),
        "fit by compare (not stored)",
    )
    row["latency_ms"] = None
    return row


def actmap_row(run: Path, test: list[str], labels: np.ndarray) -> dict:
    """An `actmap train` run folder: per-seed test metrics, mean ± std over seeds."""
    import pandas as pd

    run = Path(run)
    seed_dirs = sorted(run.glob("seed-*"))
    if not seed_dirs:
        raise ValueError(f"{run} has no seed-*/ folders; is it a run written by `actmap train`?")
    expected = dict(zip(test, labels.tolist(), strict=True))
    per_seed = []
    for folder in seed_dirs:
        scores = pd.read_parquet(folder / "test_scores.parquet")
        ids = [str(k) for k in scores["id"]]
        if set(ids) != set(expected) or len(ids) != len(expected):
            raise ValueError(
                f"{folder} scored {len(ids)} rows that are not the store's {len(expected)} "
                f"balanced test rows ({len(set(ids) - set(expected))} unknown ids); "
                "was the run trained on another store?"
            )
        y = np.array([expected[k] for k in ids])
        if not np.array_equal(y, scores["label"].to_numpy(dtype=np.int64)):
            raise ValueError(f"{folder}: stored labels differ from the store's labels")
        per_seed.append(_metrics(scores["p_correct"].to_numpy(dtype=np.float64), y, True))
    detector = "detector"
    if (run / "manifest.json").is_file():
        detector = json.loads((run / "manifest.json").read_text()).get("detector", detector)
    row = _metric_row(f"actmap-{detector} ({run.name})", "actmap", per_seed, len(test))
    row["latency_ms"] = None
    return row


def compare_methods(store: MapStore, run_dirs: Sequence[Path] | None = None) -> list[dict]:
    """AUROC / AUPRC / ECE of every stored method and ActMap run on the balanced test rows.

    Rows are sorted by AUROC, best first; a method without a metric sorts last.
    """
    splits = balanced_splits(store)
    test = splits["test"]
    if not test:
        raise ValueError(f"{store.root}: the balanced test split is empty (need both labels)")
    labels = store.metadata().set_index("id").loc[test, "label"].to_numpy(dtype=np.int64)
    methods = sorted(t.split("/", 1)[1] for t in store.tables() if t.startswith("results/"))
    rows = [baseline_row(store, m, test, labels) for m in methods]
    if "answer_length" not in methods:
        rows.append(length_control_row(store, splits))
    rows += [actmap_row(run, test, labels) for run in run_dirs or []]
    return sorted(rows, key=lambda r: -r["auroc"] if r["auroc"] is not None else math.inf)


def _cell(row: dict, name: str) -> str:
    value, std = row.get(name), row.get(f"{name}_std")
    if value is None:
        return "n/a"
    return f"{value:.3f} ± {std:.3f}" if std is not None and math.isfinite(std) else f"{value:.3f}"


def format_table(rows: Sequence[dict]) -> str:
    """A Markdown table of `compare_methods` rows (mean ± std over seeds where there are seeds)."""
    lines = [
        "| method | kind | AUROC | AUPRC | ECE | n | seeds | ms/answer | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        latency = row.get("latency_ms")
        lines.append(
            f"| {row['method']} | {row['kind']} | {_cell(row, 'auroc')} | {_cell(row, 'auprc')} "
            f"| {_cell(row, 'ece')} | {row['n']} | {row['seeds']} "
            f"| {'n/a' if latency is None else f'{latency:.2f}'} | {row.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"
