"""Loaders for the paper's four datasets, and the ``Task`` implementations built on them.

Each loader reads local JSON-lines files (``<stem>.jsonl`` or ``<stem>.jsonl.gz``) from
``<data_dir>/<dataset>/`` and, when none exists there, the Hugging Face hub through the
optional ``datasets`` package. Every row keeps a stable source key; splits are made by that key (see
``actmap.data.splits``). Which local files are read, and how the dataset's own splits
map onto train / validation / test:

- gsm8k: ``train`` and ``test`` (both required). Key: ``id``, else
  ``gsm8k-<split>-<index>`` (the local ids' format). Splits: test -> test, train -> train
  with validation carved out of it.
- nq_open: ``dev``, ``efficientqa_dev``, ``efficientqa_test``. Key: ``id``, else ``nq-``
  + sha1(question)[:16]. Splits: all pooled, seeded 80/10/10 (no train split locally).
- triviaqa: ``validation`` (+ ``train`` if present). Key: ``question_id``. Splits: a lone
  validation file is pooled, seeded 80/10/10; with a train file, train -> train (validation
  carved out) and validation -> test.
- cnn_dm: any of ``train``, ``validation``, ``test``. Key: ``id``. Splits kept; a missing
  train or validation split is carved out of the other (locally: train and validation
  both come from the validation file, test is the test file).

Hub fallback: ``trivia_qa/rc.nocontext`` (train -> train, validation -> test; its test has
no answers and is skipped), ``nq_open`` (train -> train, validation -> test),
``gsm8k/main``, ``cnn_dailymail/3.0.0`` (their own splits).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from actmap.data.base import DataError, Example
from actmap.data.factuality import SUPPORT_THRESHOLD, SummaryFactualityJudge, summary_is_factual
from actmap.data.labels import get_label_rule, gsm8k_correct, gsm8k_gold, qa_correct
from actmap.data.prompts import (
    CONTEXT_LENGTH,
    GSM8K_INSTRUCTION,
    QA_INSTRUCTION,
    SUMMARY_MAX_NEW_TOKENS,
    check_prompt_style,
    extract_answer,
    extract_summary,
    qa_prompt,
    summary_prompt,
    uses_chat_template,
)
from actmap.data.splits import DEFAULT_FRACTIONS, SPLITS, assign_splits, key_uniform
from actmap.defaults import SHORT_MAX_NEW_TOKENS

logger = logging.getLogger(__name__)


def default_data_dir() -> Path | None:
    """``../shared/data`` relative to the working directory when it exists, else None."""
    path = Path("../shared/data")
    return path if path.is_dir() else None


@dataclass(frozen=True)
class SourceRow:
    """One row as read from its source, before our split is assigned."""

    source_key: str  # stable id; splits are disjoint by it
    source_split: str | None  # the dataset's own split mapped to ours; None = pooled
    question: str  # question, or article for summarization
    references: tuple[str, ...]  # aliases, gold number, or highlights
    meta: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- reading rows


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, JSON object) for every non-blank line of a .jsonl or .jsonl.gz file."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            for line_no, raw in enumerate(fh, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(
                        f"{path}: line {line_no}: not valid UTF-8 (byte 0x{raw[err.start]:02x} "
                        f"at column {err.start + 1})"
                    ) from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}: line {line_no}: invalid JSON ({err.msg})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}: line {line_no}: expected a JSON object")
                yield line_no, record
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None


def _get(record: Mapping[str, Any], dotted: str, where: str) -> Any:
    """The value at a dotted field path; DataError naming the place and the field if absent."""
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or value.get(part) is None:
            raise DataError(f"{where}: missing field '{dotted}'")
        value = value[part]
    return value


def _text(record: Mapping[str, Any], dotted: str, where: str) -> str:
    value = _get(record, dotted, where)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field '{dotted}' must be a non-empty string")
    return value


def _strings(record: Mapping[str, Any], dotted: str, where: str) -> list[str]:
    value = _get(record, dotted, where)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise DataError(f"{where}: field '{dotted}' must be a non-empty list of strings")
    return value


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


# A parser turns one record into a SourceRow: (record, where, dataset split, index) -> row.
Parser = Callable[[Mapping[str, Any], str, str | None, str, int], SourceRow]


def parse_gsm8k(record, where, split, stem, index) -> SourceRow:
    question = _text(record, "question", where)
    # the local files carry the gold number as "final"; the hub only inside "answer"
    gold_field = "final" if record.get("final") is not None else "answer"
    raw = str(record["final"]) if gold_field == "final" else _text(record, "answer", where)
    try:
        gold = gsm8k_gold(raw if gold_field == "answer" else "#### " + raw)
    except DataError as err:
        raise DataError(f"{where}: field '{gold_field}': {err}") from None
    key = record.get("id") or f"gsm8k-{stem}-{index:05d}"
    return SourceRow(str(key), split, question, (gold,), {"source_split": stem})


def parse_nq_open(record, where, split, stem, index) -> SourceRow:
    question = _text(record, "question", where)
    field_name = "answers" if "answers" in record else "answer"
    answers = _strings(record, field_name, where)
    key = record.get("id") or f"nq-{_digest(question)}"
    return SourceRow(str(key), split, question, tuple(answers), {"source_split": stem})


def parse_triviaqa(record, where, split, stem, index) -> SourceRow:
    question = _text(record, "question", where)
    key = _text(record, "question_id", where)
    aliases = _strings(record, "answer.aliases", where)
    answer = record["answer"]
    value = answer.get("value")
    refs = list(
        dict.fromkeys(
            ([value] if isinstance(value, str) and value.strip() else [])
            + aliases
            + [a for a in (answer.get("normalized_aliases") or []) if isinstance(a, str)]
        )
    )
    meta = {"source_split": stem}
    if isinstance(value, str) and value.strip():
        meta["value"] = value
    return SourceRow(key, split, question, tuple(refs), meta)


def parse_cnn_dm(record, where, split, stem, index) -> SourceRow:
    article = _text(record, "article", where)
    highlights = _text(record, "highlights", where)
    key = _text(record, "id", where)
    return SourceRow(key, split, article, (highlights,), {"source_split": stem})


# ---------------------------------------------------------------- sources


@dataclass(frozen=True)
class DatasetSource:
    """Where one dataset lives: local file stems and the hub fallback."""

    name: str  # folder under data_dir
    parser: Parser
    local_splits: Callable[[set[str]], dict[str, str | None]]  # present stems -> our splits
    hub_args: tuple[str, ...]  # datasets.load_dataset(*hub_args)
    hub_splits: Mapping[str, str]  # hub split -> ours; others are skipped


def _fixed(mapping: Mapping[str, str | None]) -> Callable[[set[str]], dict[str, str | None]]:
    return lambda present: {stem: split for stem, split in mapping.items() if stem in present}


def _gsm8k_local(present: set[str]) -> dict[str, str | None]:
    return {"train": "train", "test": "test"}


def _triviaqa_local(present: set[str]) -> dict[str, str | None]:
    if "train" in present:
        return {"train": "train", "validation": "test"}
    return {"validation": None}


SOURCES: dict[str, DatasetSource] = {
    "gsm8k": DatasetSource(
        "gsm8k", parse_gsm8k, _gsm8k_local, ("gsm8k", "main"), {"train": "train", "test": "test"}
    ),
    "nq_open": DatasetSource(
        "nq_open",
        parse_nq_open,
        _fixed({"dev": None, "efficientqa_dev": None, "efficientqa_test": None}),
        ("nq_open",),
        {"train": "train", "validation": "test"},
    ),
    "triviaqa": DatasetSource(
        "triviaqa",
        parse_triviaqa,
        _triviaqa_local,
        ("trivia_qa", "rc.nocontext"),
        {"train": "train", "validation": "test"},
    ),
    "cnn_dm": DatasetSource(
        "cnn_dm",
        parse_cnn_dm,
        _fixed({"train": "train", "validation": "validation", "test": "test"}),
        ("cnn_dailymail", "3.0.0"),
        {"train": "train", "validation": "validation", "test": "test"},
    ),
}
KNOWN_STEMS = ("train", "validation", "test", "dev", "efficientqa_dev", "efficientqa_test")


def _local_file(folder: Path, stem: str) -> Path | None:
    for suffix in (".jsonl", ".jsonl.gz"):
        path = folder / f"{stem}{suffix}"
        if path.is_file():
            return path
    return None


def _dedupe(rows: list[SourceRow], origin: str) -> list[SourceRow]:
    seen: set[str] = set()
    kept = []
    for row in rows:
        if row.source_key not in seen:
            seen.add(row.source_key)
            kept.append(row)
    if len(kept) < len(rows):
        logger.warning(
            "%s: dropped %d rows whose source key repeats", origin, len(rows) - len(kept)
        )
    return kept


def _read_local(source: DatasetSource, folder: Path, present: dict[str, Path]) -> list[SourceRow]:
    mapping = source.local_splits(set(present))
    rows: list[SourceRow] = []
    for stem, split in mapping.items():
        path = present.get(stem) or folder / f"{stem}.jsonl.gz"
        for index, (line_no, record) in enumerate(read_jsonl(path)):
            rows.append(source.parser(record, f"{path}: line {line_no}", split, stem, index))
    logger.info("%s: read %d rows from %s", source.name, len(rows), folder)
    return _dedupe(rows, str(folder))


def _read_hub(source: DatasetSource) -> list[SourceRow]:
    import datasets  # optional dependency, imported only for the hub fallback

    hub = datasets.load_dataset(*source.hub_args)
    rows: list[SourceRow] = []
    for hub_split, split in source.hub_splits.items():
        if hub_split not in hub:
            raise DataError(f"hub:{'/'.join(source.hub_args)} has no split {hub_split!r}")
        for index, record in enumerate(hub[hub_split]):
            where = f"hub:{'/'.join(source.hub_args)}[{hub_split}]: row {index}"
            rows.append(source.parser(record, where, split, hub_split, index))
    logger.info("%s: read %d rows from the hub", source.name, len(rows))
    return _dedupe(rows, "hub")


def load_rows(dataset: str, data_dir: str | Path | None = None) -> tuple[list[SourceRow], str]:
    """All rows of ``dataset`` and where they came from (a folder path or ``hub:<id>``).

    Local files in ``<data_dir>/<dataset>/`` win; ``data_dir`` None means
    ``default_data_dir()``. Without local files the hub is used if ``datasets`` imports.
    """
    if dataset not in SOURCES:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {sorted(SOURCES)}")
    source = SOURCES[dataset]
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    folder = root / source.name if root is not None else None
    present = {}
    if folder is not None:
        present = {s: p for s in KNOWN_STEMS if (p := _local_file(folder, s)) is not None}
        present = {s: p for s, p in present.items() if s in source.local_splits(set(present))}
    if present:
        return _read_local(source, folder, present), str(folder)
    try:
        import datasets  # noqa: F401
    except ImportError:
        looked = f"in {folder}" if folder is not None else "(no data dir: ../shared/data absent)"
        raise DataError(
            f"no local {dataset} files {looked} (expected e.g. "
            f"{', '.join(f'{s}.jsonl.gz' for s in source.local_splits(set(KNOWN_STEMS)))}), "
            f"and the 'datasets' package is not installed for the hub fallback "
            f"({'/'.join(source.hub_args)}); pip install datasets or provide the files"
        ) from None
    return _read_hub(source), "hub:" + "/".join(source.hub_args)


def load_gsm8k(data_dir: str | Path | None = None) -> list[SourceRow]:
    return load_rows("gsm8k", data_dir)[0]


def load_nq_open(data_dir: str | Path | None = None) -> list[SourceRow]:
    return load_rows("nq_open", data_dir)[0]


def load_triviaqa(data_dir: str | Path | None = None) -> list[SourceRow]:
    return load_rows("triviaqa", data_dir)[0]


def load_cnn_dm(data_dir: str | Path | None = None) -> list[SourceRow]:
    return load_rows("cnn_dm", data_dir)[0]


# ---------------------------------------------------------------- tasks


class SourceTask:
    """Shared mechanics: read rows once, split by source key, hold out demonstrations.

    ``load(split, limit)`` returns the split's examples in a seeded order fixed per source
    key, so ``limit`` takes a random subset and raising it only adds rows.

    Few-shot demonstrations: the task's hand-checked ``DEMONSTRATION_KEYS`` when the data
    holds them (the local files; answers chosen clean, checked against the gold), else the
    first ``n_shots`` train rows in source order. Demonstration rows are removed from every
    split under both prompt styles, so they are never evaluated and few-shot and zero-shot
    results are on the same rows. ``pooled=True`` ignores the dataset's own splits and splits all
    keys by ``fractions`` (the paper's Table 1 sizes, e.g. GSM8K 879 test rows of 8,792,
    match a pooled 10% test split).

    ``stop_strings``: the texts that end an answer during capture (`CaptureConfig`). The
    short-answer tasks stop at the first newline after the answer starts: the label reads
    the first line only (``postprocess``), and a model that learned the few-shot format
    goes on with an invented next question that would otherwise fill the map. The greedy
    tokens before the stop are the same either way; only the trajectory gets shorter.
    """

    name: str = ""
    max_new_tokens: int = SHORT_MAX_NEW_TOKENS
    stop_strings: tuple[str, ...] = ("\n",)
    # (source key, demonstration answer or None for the row's gold) of the local files
    DEMONSTRATION_KEYS: tuple[tuple[str, str | None], ...] = ()

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        prompt_style: str = "few_shot",
        n_shots: int = 5,
        seed: int = 0,
        fractions: Mapping[str, float] | None = None,
        chat_template: bool = True,  # False: plain "Question:/Answer:" text for chat models too
        pooled: bool = False,  # True: ignore the dataset's own splits, seeded split of all keys
        demonstrations: Sequence[Mapping[str, str]] | None = None,  # a store's, to reuse
    ) -> None:
        self.data_dir = data_dir
        self.given_demonstrations = [dict(d) for d in demonstrations or []]
        self.pooled = pooled
        self.chat_template = chat_template
        self.prompt_style = check_prompt_style(prompt_style)
        if n_shots < 0:
            raise ValueError(f"n_shots must be >= 0, got {n_shots}")
        self.n_shots = n_shots
        self.seed = seed
        self.fractions = dict(fractions if fractions is not None else DEFAULT_FRACTIONS)
        self._examples: dict[str, list[Example]] | None = None
        self._demos: list[Example] = []
        self.source = ""

    def _build(self) -> dict[str, list[Example]]:
        if self._examples is not None:
            return self._examples
        rows, self.source = load_rows(self.name, self.data_dir)
        splits = assign_splits(
            [r.source_key for r in rows],
            None if self.pooled else [r.source_split for r in rows],
            seed=self.seed,
            fractions=self.fractions,
        )
        by_split: dict[str, list[Example]] = {s: [] for s in SPLITS}
        for row, split in zip(rows, splits, strict=True):
            by_split[split].append(
                Example(row.source_key, self.name, split, row.question, row.references, row.meta)
            )
        self._demos = (
            self._given(by_split)
            or self._fixed_demonstrations(by_split)
            or self._fallback_demonstrations(by_split["train"])
        )
        if len(self._demos) < self.n_shots:
            raise DataError(
                f"{self.name}: {len(by_split['train'])} train rows, fewer than "
                f"n_shots={self.n_shots}"
            )
        demo_keys = {d.source_key for d in self._demos}
        for split in SPLITS:
            by_split[split] = [e for e in by_split[split] if e.source_key not in demo_keys]
        for examples in by_split.values():
            examples.sort(key=lambda e: key_uniform(e.source_key, self.seed, salt="order"))
        self._examples = by_split
        return by_split

    def _fixed_demonstrations(self, by_split: dict[str, list[Example]]) -> list[Example]:
        """The task's hand-checked ``DEMONSTRATION_KEYS`` when the data holds them all, else []."""
        wanted = self.DEMONSTRATION_KEYS[: self.n_shots]
        if not self.n_shots or len(wanted) < self.n_shots:
            return []
        by_key = {e.source_key: e for examples in by_split.values() for e in examples}
        if any(key not in by_key for key, _ in wanted):
            return []
        demos = []
        for key, answer in wanted:
            example = by_key[key]
            if answer is not None:
                if not self._accepts(answer, example):
                    raise DataError(
                        f"{self.name}: demonstration answer {answer!r} is not gold for {key}"
                    )
                example = replace(example, meta={**example.meta, "demo_answer": answer})
            demos.append(example)
        return demos

    def _accepts(self, answer: str, example: Example) -> bool:
        return True

    def _given(self, by_split: dict[str, list[Example]]) -> list[Example]:
        """Demonstrations handed in (a store's recorded ones), exactly as that store showed them."""
        if not self.given_demonstrations:
            return []
        if len(self.given_demonstrations) < self.n_shots:
            raise DataError(
                f"{self.name}: {len(self.given_demonstrations)} demonstrations given, "
                f"fewer than n_shots={self.n_shots}"
            )
        return [
            Example(
                d["key"],
                self.name,
                "train",
                d["question"],
                [d["answer"]],
                {"demo_answer": d["answer"]},
            )
            for d in self.given_demonstrations[: self.n_shots]
        ]

    def _fallback_demonstrations(self, train: list[Example]) -> list[Example]:
        """Demonstrations picked from the data, with a warning when the fixed ones are missing
        (prompts then differ from stores made with the fixed demonstrations)."""
        picked = self._pick_demonstrations(train)
        if self.DEMONSTRATION_KEYS and self.n_shots and self.prompt_style == "few_shot":
            logger.warning(
                "%s: the fixed demonstration keys (%s) are not all in %s; using %s instead, so "
                "prompts differ from stores made with the fixed ones (reuse a store's "
                "demonstrations with --demonstrations-from STORE)",
                self.name,
                ", ".join(k for k, _ in self.DEMONSTRATION_KEYS[: self.n_shots]),
                self.source or "the data",
                ", ".join(e.source_key for e in picked),
            )
        return picked

    def _pick_demonstrations(self, train: list[Example]) -> list[Example]:
        """The first ``n_shots`` train examples in source order."""
        return train[: self.n_shots]

    def load(self, split: str, limit: int | None = None) -> list[Example]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        examples = self._build()[split]
        return list(examples if limit is None else examples[:limit])

    def demonstrations(self) -> list[Example]:
        """The held-out train examples shown as few-shot demonstrations."""
        self._build()
        return list(self._demos)

    def postprocess(self, raw: str) -> str:
        """The text the label is computed on (the raw generation is kept separately)."""
        return extract_answer(raw)

    def add_special_tokens(self, tokenizer) -> bool:
        """How to tokenize this task's prompts: False when the chat template supplied them."""
        return not uses_chat_template(tokenizer, self.chat_template)

    def describe(self) -> dict[str, Any]:
        """The settings to record with results made with this task."""
        self._build()  # fills self.source
        return {
            "task": self.name,
            "source": self.source,
            "prompt_style": self.prompt_style,
            "chat_template": self.chat_template,
            "n_shots": self.n_shots,
            "split_seed": self.seed,
            "pooled": self.pooled,
            "fractions": self.fractions,
            "max_new_tokens": self.max_new_tokens,
            **self._recorded_demonstrations(),
        }

    def _recorded_demonstrations(self) -> dict[str, Any]:
        """The few-shot demonstrations as shown (key, question, answer), for the store config."""
        if self.prompt_style != "few_shot" or not self.n_shots:
            return {}
        pairs = getattr(self, "_demo_pairs", lambda: [])()
        if not pairs:
            return {}
        return {
            "demonstrations": [
                {"key": d.source_key, "question": q, "answer": a}
                for d, (q, a) in zip(self._demos, pairs, strict=True)
            ]
        }


class _ShortAnswerTask(SourceTask):
    instruction: str = QA_INSTRUCTION

    def _demo_pairs(self) -> list[tuple[str, str]]:
        if self.prompt_style == "zero_shot":
            return []
        return [
            (d.question, d.meta.get("demo_answer") or d.meta.get("value") or d.references[0])
            for d in self.demonstrations()
        ]

    def prompt(self, example: Example, tokenizer) -> str:
        return qa_prompt(
            example.question,
            tokenizer,
            instruction=self.instruction,
            demonstrations=self._demo_pairs(),
            chat=self.chat_template,
        )


class _QATask(_ShortAnswerTask):
    def __init__(self, data_dir: str | Path | None = None, *, label_rule: str = "paper", **kw):
        super().__init__(data_dir, **kw)
        self.label_rule = label_rule
        self._rule = get_label_rule(label_rule)

    def label(self, answer: str, example: Example) -> bool:
        return self._rule(answer, example.references)

    def _accepts(self, answer: str, example: Example) -> bool:
        return qa_correct(answer, example.references)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "label_rule": self.label_rule}


class TriviaQATask(_QATask):
    """TriviaQA without context: short factual answers, matched against the aliases."""

    name = "triviaqa"
    DEMONSTRATION_KEYS = (
        ("tqa-unfiltered-dev-00000", "David Seville"),
        ("tqa-unfiltered-dev-00001", "Scorpio"),
        ("tqa-unfiltered-dev-00008", "Utah"),
        ("tqa-unfiltered-dev-00026", "Pink Floyd"),
        ("tqa-unfiltered-dev-00063", "27"),
    )

    def _pick_demonstrations(self, train: list[Example]) -> list[Example]:
        """The first ``n_shots`` train examples that have a canonical ``answer.value``.

        Used when the fixed keys are absent (hub data, whose values are all set): alias
        lists are noisy ("Cancer pathology"), the value is the clean answer.
        """
        with_value = [e for e in train if "value" in e.meta]
        return (
            with_value[: self.n_shots] if len(with_value) >= self.n_shots else train[: self.n_shots]
        )


class NQOpenTask(_QATask):
    """NQ-Open: short factual answers, matched against the answer list."""

    name = "nq_open"
    DEMONSTRATION_KEYS = (
        ("nq-dev-00000", "December 1972"),
        ("nq-dev-00001", "Bobby Scott"),
        ("nq-dev-00003", "2017"),
        ("nq-dev-00004", "South Carolina"),
        ("nq-dev-00007", "James I"),
    )


class GSM8KTask(_ShortAnswerTask):
    """GSM8K in direct-answer mode: exact match of one stated number to the gold number."""

    name = "gsm8k"
    instruction = GSM8K_INSTRUCTION
    DEMONSTRATION_KEYS = tuple((f"gsm8k-train-{i:05d}", None) for i in range(5))

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        number: Literal["first", "final"] = "first",  # which stated number is the answer
        **kw,
    ):
        super().__init__(data_dir, **kw)
        if number not in ("first", "final"):
            raise ValueError(f"number must be 'first' or 'final', got {number!r}")
        self.number = number

    def label(self, answer: str, example: Example) -> bool:
        return gsm8k_correct(answer, example.references[0], which=self.number)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "label_rule": f"numeric_exact:{self.number}"}


class CNNDMTask(SourceTask):
    """CNN/DailyMail summaries, labelled factual by a judge (MiniCheck rule).

    Zero-shot only (demonstration articles would not fit the context). Without a judge,
    ``label`` returns None: labels are added in a separate judging pass.
    """

    name = "cnn_dm"
    max_new_tokens = SUMMARY_MAX_NEW_TOKENS
    stop_strings = ()  # summaries span lines; they end at end-of-sequence or 384 tokens

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        judge: SummaryFactualityJudge | None = None,
        threshold: float = SUPPORT_THRESHOLD,
        context_length: int = CONTEXT_LENGTH,
        truncation_side: Literal["left", "right"] = "left",
        prompt_style: str = "zero_shot",
        **kw,
    ):
        if prompt_style != "zero_shot":
            raise ValueError("cnn_dm supports only prompt_style='zero_shot'")
        super().__init__(data_dir, prompt_style="zero_shot", n_shots=0, **kw)
        self.judge = judge
        self.threshold = threshold
        self.context_length = context_length
        self.truncation_side = truncation_side

    def prompt(self, example: Example, tokenizer) -> str:
        return summary_prompt(
            example.question,
            tokenizer,
            context_length=self.context_length,
            max_new_tokens=self.max_new_tokens,
            truncation_side=self.truncation_side,
            chat=self.chat_template,
        )

    def postprocess(self, raw: str) -> str:
        return extract_summary(raw)

    def label(self, answer: str, example: Example) -> bool | None:
        if self.judge is None:
            return None
        return summary_is_factual(self.judge, example.question, answer, self.threshold)

    @property
    def judge_name(self) -> str | None:
        return None if self.judge is None else self.judge.name

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "label_rule": "minicheck_all_sentences",
            "judge": self.judge_name,
            "threshold": self.threshold,
            "context_length": self.context_length,
            "truncation_side": self.truncation_side,
        }
