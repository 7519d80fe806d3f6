"""Input providers: what a scorer `requires`, read from the store (or loaded) once per run.

As LM-Polygraph's stat calculators do, each input is computed once and shared
by every scorer that reads it: the captured generations, the attention
entries, the dense states, the verification pairs, the sampled answers, and
the generator and judge themselves. `StoreInputs.rows(requires, ids)` hands a
scorer its rows; `make_scorer(name)` builds a registered scorer, through its
``from_inputs`` classmethod when it has one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa

from actmap.baselines.actvit import actvit_tensor
from actmap.baselines.base import BaselineUnavailable
from actmap.baselines.entailment import CachedJudge, load_llm_judge
from actmap.baselines.ptrue import PTrueInput
from actmap.baselines.registry import baseline_class
from actmap.baselines.samples_table import draw_samples, read_samples, sampling_request
from actmap.capture.from_store import read_generations
from actmap.data.splits import SPLITS
from actmap.detectors.inputs import INPUT_NAMES, read_inputs
from actmap.llm.models import load_model, stored_dtype
from actmap.scoring.contract import row_input
from actmap.store import MapStore, decode_rows

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int, str], None]  # (method, done, total, what is happening)
CAPTURE_HINTS = {"attention": "--attention-keys 10", "dense": "--keep-dense"}


class StoreInputs:
    """One run's store, balanced rows and options; every input is read or loaded once."""

    def __init__(
        self,
        store: MapStore,
        options,
        splits: dict[str, list[str]],
        model=None,
        tokenizer=None,
        judge=None,
        progress: Progress | None = None,
    ) -> None:
        self.store, self.options, self.splits = store, options, splits
        self.progress = progress
        self._model, self._tokenizer, self._judge = model, tokenizer, judge
        self._generations: dict[str, Any] = {}
        self._tables: dict[str, tuple[pa.Table, dict[str, int]]] = {}
        self._samples: dict[str, tuple[Any, float]] | None = None  # id -> (SampleSet, seconds)
        self._lm_error: BaselineUnavailable | None = None
        self.sample_counts: dict[str, int] = {}

    def report(self, method: str, done: int, total: int, info: str = "") -> None:
        if self.progress is not None:
            self.progress(method, done, total, info)

    # -- scorers ---------------------------------------------------------------------------
    def make_scorer(self, name: str):
        """The registered scorer ``name``, built from this run's inputs and options."""
        cls = baseline_class(name)
        build = getattr(cls, "from_inputs", None)
        return build(self) if build is not None else cls()

    def rows(self, requires: Sequence[str], ids: Sequence[str], method: str = ""):
        """The rows a scorer reads for ``ids``, by its most specific row input; a detector
        (it requires "maps") gets the one bundle every detector reads (`read_inputs`)."""
        kind = row_input(requires)
        if kind == "maps":
            return read_inputs(self.store, list(ids), [r for r in requires if r in INPUT_NAMES])
        if kind == "attention":
            self.require_table("attention", method)
        return ROW_PROVIDERS[kind](self, ids, method)

    # -- the store -------------------------------------------------------------------------
    @cached_property
    def split_of(self) -> dict[str, str]:
        return {key: split for split, ids in self.splits.items() for key in ids}

    @cached_property
    def meta(self):
        """The maps metadata (no map bytes), indexed by id."""
        return self.store.metadata().set_index("id")

    def labels(self, ids: Sequence[str]) -> np.ndarray:
        return self.meta.loc[list(ids), "label"].to_numpy(dtype=np.int64)

    @cached_property
    def questions(self) -> dict[str, str]:
        table = self.store.read_latest("generations", ["question"])
        ids, questions = table.column("id").to_pylist(), table.column("question").to_pylist()
        return dict(zip(ids, questions, strict=True))

    def generations(self, ids: Sequence[str], method: str = "") -> list:
        """Generation records (trajectories dropped: no scorer reads them), read once."""
        if not self._generations:
            import torch

            every = [key for split in SPLITS for key in self.splits[split]]
            for gen, key in zip(read_generations(self.store, every), every, strict=True):
                self._generations[key] = dataclasses.replace(gen, trajectory=torch.empty(0))
        return [self._generations[key] for key in ids]

    def table(self, name: str) -> tuple[pa.Table, dict[str, int]]:
        """A side table (last row per id of this run's rows) and its id -> row index, read once."""
        if name not in self._tables:
            table = self.store.read_latest(name, ids=self.split_of)
            index = {key: i for i, key in enumerate(table.column("id").to_pylist())}
            self._tables[name] = (table, index)
        return self._tables[name]

    def require_table(self, table: str, method: str) -> None:
        if not self.store.has_table(table):
            raise BaselineUnavailable(
                f"{method} reads captured {table} but the store has no '{table}' table; "
                f"capture with {CAPTURE_HINTS[table]}"
            )

    def attention_keys(self, method: str) -> int:
        """How many previous tokens' attention the store keeps per step."""
        self.require_table("attention", method)
        shape = self.store.read_table("attention", ["shape"]).column("shape")[0].as_py()
        return int(shape[-1])  # (T, L, H, K)

    # -- models ----------------------------------------------------------------------------
    def device(self) -> str:
        if self.options.device:
            return self.options.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def generator_name(self) -> str:
        stored = self.store.manifest.get("config", {}).get("model", {})
        return self.options.model or stored.get("name", "unknown")

    def generator(self) -> tuple[Any, Any]:
        """(model, tokenizer): the ones passed in, else the store's generator, loaded once."""
        if self._lm_error is not None:  # one failed load answers every later method at once
            raise self._lm_error
        if self._model is None or self._tokenizer is None:
            try:
                self._model, self._tokenizer = self._load_generator()
            except BaselineUnavailable as err:
                self._lm_error = err
                raise
        return self._model, self._tokenizer

    def _load_generator(self) -> tuple[Any, Any]:

        config = self.store.manifest.get("config", {})
        stored = config.get("model", {})
        name = self.generator_name()
        self.report("model", 0, 1, f"loading {name}")
        try:
            model, tokenizer, source = load_model(
                name, stored.get("revision") or "main", self.device(), stored_dtype(config)
            )
        except (OSError, ValueError) as err:  # FileNotFoundError is an OSError
            text = str(err).strip()
            first_line = text.splitlines()[0] if text else type(err).__name__
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
        self.report("model", 1, 1, f"loaded {name}")
        return model, tokenizer

    def entailment_judge(self):
        """The entailment judge behind a cache persisted to <store>/judge-cache.json."""

        if self._judge is None:
            if self.options.judge is None:
                raise BaselineUnavailable(
                    "Semantic Entropy needs an entailment judge and --judge none was given"
                )
            self._judge = load_llm_judge(
                self.options.judge,
                device=self.device(),
                dtype=self.options.judge_dtype,
                prompt=self.options.judge_prompt,
            )
        if not isinstance(self._judge, CachedJudge):
            self._judge = CachedJudge(self._judge, self.store.root / JUDGE_CACHE)
        return self._judge

    # -- sampled answers -------------------------------------------------------------------
    def samples(self, ids: Sequence[str], method: str = "") -> list:
        """SampleSets for ``ids``: reused from the ``samples`` table, the missing ones drawn now."""
        capture = self.store.manifest.get("config", {}).get("capture", {})
        request = sampling_request(self.generator_name(), self.options, capture)
        if self._samples is None:
            self._samples = read_samples(self.store, request, self.meta["prompt"])
        todo = [k for k in ids if k not in self._samples]
        self.sample_counts = {"reused": len(ids) - len(todo), "sampled": len(todo)}
        if todo:
            model, tokenizer = self.generator()
            prompts, questions = self.meta["prompt"], self.questions
            rows = [(k, prompts[k], questions[k]) for k in todo]

            def done(shard: dict, count: int) -> None:
                self._samples.update(shard)
                self.report(method, count, len(todo), f"sampling {request['n_samples']} answers")

            commit = self.options.samples_commit_every
            draw_samples(self.store, model, tokenizer, rows, request, commit, done)
        return [self._samples[k][0] for k in ids]

    def sampling_ms(self, ids: Sequence[str]) -> float:
        """Mean sampling time per answer of ``ids``, in ms."""
        return 1000 * float(np.mean([self._samples[k][1] for k in ids]))

    # -- the other row inputs --------------------------------------------------------------
    def verification(self, ids: Sequence[str], method: str = "") -> list:

        questions, meta = self.questions, self.meta
        return [PTrueInput(question=questions[k], answer=meta.at[k, "answer"]) for k in ids]

    def dense(self, ids: Sequence[str], method: str = ""):
        """(n, 8, 100, D) float16 ACT-ViT inputs from the ``dense`` table."""
        import torch

        self.require_table("dense", method)
        table, _ = self.table("dense")
        arrays = decode_rows(table, "dense", ids)  # id -> (8, N, D)
        missing = [key for key in ids if key not in arrays]
        if missing:
            raise BaselineUnavailable(
                f"{len(missing)} rows have no dense states, e.g. {missing[:3]}"
            )
        # (8, 100, D) each
        return torch.stack([actvit_tensor(torch.from_numpy(arrays[k].copy())) for k in ids])


JUDGE_CACHE = "judge-cache.json"
ROW_PROVIDERS: dict[str, Callable[[StoreInputs, Sequence[str], str], Any]] = {
    "generations": StoreInputs.generations,
    "attention": StoreInputs.generations,
    "verification": StoreInputs.verification,
    "samples": StoreInputs.samples,
    "dense": StoreInputs.dense,
}
