"""Small helpers shared by the CLI commands: progress bars and error reporting."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from actmap.errors import ActmapUserError

PIPED_WIDTH = 200  # columns when stderr is not a terminal: no folding at rich's default 80
PIPED_PROGRESS_EVERY_S = 60.0  # a plain progress line this often when stderr is not a terminal

JUDGE_DTYPE_HELP = (
    "The LLM judge's weights: float32, or bfloat16 (about 4x faster on a CPU with AVX512-BF16; "
    "named in the judge's name, so its labels and checks are not mixed with float32 ones)."
)


def make_console() -> Console:
    """Messages, tables and progress on stderr; when piped or captured, messages are never
    folded and tables are wide, so paths, option names and numbers stay on one line."""
    console = Console(stderr=True)
    if not console.is_terminal:
        console.width = PIPED_WIDTH  # tables
        console.soft_wrap = True  # a message (a path of any length) is never folded
    return console


console = make_console()


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def _eta(task, since: tuple[float, float] = (0.0, 0.0)) -> float | None:
    """rich's estimate (its recent speed), else the mean rate since ``since``: batches that come
    further apart than rich's 30-second speed window still get an eta.

    ``since`` is (seconds after the task's start, count then): the count a resumed run starts
    from (rows or epochs done before it) is not work of this run, so it does not count toward
    the rate; see `LoggedProgress`."""
    if task.time_remaining is not None:
        return task.time_remaining
    offset, start_count = since
    done, seconds = task.completed - start_count, (task.elapsed or 0.0) - offset
    if task.total is None or done <= 0 or seconds <= 0:
        return None
    return (task.total - task.completed) * seconds / done


class EtaColumn(ProgressColumn):
    """Time remaining by `LoggedProgress.eta`: rich's recent speed, else the mean rate of this
    run (rich's own column shows nothing once batches come more than 30 s apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.progress: LoggedProgress | None = None  # set by the progress that holds it

    def render(self, task) -> Text:
        eta = self.progress.eta(task) if self.progress is not None else task.time_remaining
        return Text(_clock(eta), style="progress.remaining")


class LoggedProgress(Progress):
    """A rich progress display that, when its console is not a terminal (a background run
    logged to a file, where rich draws nothing until the end), also prints one plain line
    per unfinished task at most every ``every_s`` seconds: done/total, elapsed and eta.

    The eta's rate counts this run's work only. A count the library reports as restored
    (`resume`: a capture's stored rows, a judge's cached pairs, however long it took to find
    them) and whatever count a task reaches within ``STARTUP_S`` of its start (`add_task` or
    `reset`: a resumed sweep's epochs) are taken as done before this run, so a task resumed at
    180 of 390 epochs is not estimated as if its first epoch had taken 1/181 of its time.
    """

    STARTUP_S = 1.0  # updates this soon after a task's start report restored progress

    def __init__(self, *columns, every_s: float = PIPED_PROGRESS_EVERY_S, **kwargs) -> None:
        super().__init__(*columns, **kwargs)
        self.every_s = every_s
        self._last_line = time.monotonic()
        self._since: dict[TaskID, tuple[float, float]] = {}  # (offset s, count) per task
        for column in self.columns:
            if isinstance(column, EtaColumn):
                column.progress = self

    def eta(self, task) -> float | None:
        """Seconds left for ``task`` at the rate of this run's work (None: not known yet)."""
        return _eta(task, self._since.get(task.id, (0.0, 0.0)))

    def _mark_start(self, task_id: TaskID) -> None:
        """Take the count reached so far as the task's starting count, if it is still starting
        (right after `add_task` or `reset`, whose clock starts at 0, it always is)."""
        with self._lock:
            task = self._tasks[task_id]
            offset = task.elapsed or 0.0
            if offset <= self.STARTUP_S:
                self._since[task_id] = (offset, task.completed)

    def resume(self, task_id: TaskID, advance: float) -> None:
        """Advance ``task_id`` by work an earlier run did: the eta's rate starts from here."""
        super().advance(task_id, advance)
        with self._lock:
            task = self._tasks[task_id]
            self._since[task_id] = (task.elapsed or 0.0, task.completed)
        self._log_lines()

    def add_task(self, *args, **kwargs) -> TaskID:
        task_id = super().add_task(*args, **kwargs)
        self._mark_start(task_id)
        return task_id

    def update(self, task_id, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._mark_start(task_id)
        self._log_lines()

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._mark_start(task_id)
        self._log_lines()

    def reset(self, task_id, **kwargs) -> None:
        super().reset(task_id, **kwargs)
        # rich's reset never finishes a task, even one reset to its total (a reproduce stage's
        # closing "9/9 methods"); an update does, so a finished count stops printing lines
        super().update(task_id)
        self._mark_start(task_id)
        self._log_lines()

    def _log_lines(self) -> None:
        now = time.monotonic()
        if self.console.is_terminal or now - self._last_line < self.every_s:
            return
        self._last_line = now
        for task in self.tasks:
            if task.finished or not task.visible:  # done, or not started (a later stage)
                continue
            total = "?" if task.total is None else f"{task.total:g}"
            info = task.fields.get("info", "")
            self.console.print(
                f"{task.description}: {task.completed:g}/{total}{' ' + info if info else ''}"
                f" elapsed {_clock(task.elapsed)} eta {_clock(self.eta(task))}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )


def progress_bar(
    every_s: float = PIPED_PROGRESS_EVERY_S, on: Console | None = None
) -> LoggedProgress:
    """The CLI's progress bar (stderr); piped, a plain line every ``every_s`` seconds."""
    return LoggedProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        EtaColumn(),
        console=console if on is None else on,
        every_s=every_s,
    )


def task_progress(bar: Progress, task_id) -> Callable[[int, int, str], None]:
    """``progress(completed, total, info)`` for one task of ``bar``. A count that starts over
    (a smaller ``completed`` or another ``total``: the next baseline method of a stage)
    restarts the task's clock, so its elapsed time and eta are the new count's."""
    last = {"completed": 0, "total": None}

    def progress(completed: int, total: int, info: str) -> None:
        total_or_none = total or None
        if completed < last["completed"] or total_or_none != last["total"]:
            bar.reset(task_id, total=total_or_none, completed=completed, info=info)
        else:
            bar.update(task_id, completed=completed, total=total_or_none, info=info)
        last.update(completed=completed, total=total_or_none)

    return progress


def method_progress(bar: Progress) -> Callable[[str, int, int, str], None]:
    """``progress(method, completed, total, info)`` with one task of ``bar`` per method, each
    a `task_progress`: a method's count that starts over (ACT-ViT's rows while it prepares,
    then its sweep's epochs, resumed ones included) restarts its task, so the eta measures
    the new count from its own start."""
    tasks: dict[str, Callable[[int, int, str], None]] = {}

    def progress(method: str, completed: int, total: int, info: str) -> None:
        if method not in tasks:
            tasks[method] = task_progress(bar, bar.add_task(method, total=None, info=info))
        tasks[method](completed, total, info)

    return progress


# set by ``actmap --debug`` for the command it runs (typer gives commands no click context)
SHOW_TRACEBACKS: ContextVar[bool] = ContextVar("actmap_show_tracebacks", default=False)


@contextmanager
def user_errors() -> Iterator[None]:
    """A user's mistake becomes one red line and exit code 2; ``--debug`` shows its traceback.

    Only `ActmapUserError` (raised by the library for bad input) and a missing file count
    as the user's; any other exception is a bug and keeps its traceback.
    """

    try:
        yield
    except (ActmapUserError, FileNotFoundError) as error:
        if SHOW_TRACEBACKS.get():
            raise
        console.print(
            f"[red]error:[/red] {escape(one_line(error))}", soft_wrap=True, highlight=False
        )
        raise typer.Exit(2) from None


def one_line(error: BaseException) -> str:
    """The error's message on one line (a FileNotFoundError from the OS names its path)."""
    if isinstance(error, OSError) and error.filename:
        text = f"{error.filename}: {error.strerror or 'not found'}"
    else:
        text = str(error)
    return " ".join(text.split())


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def fraction(value: float) -> str:
    """A figure such as an accuracy, or "n/a" when there was nothing to compute it on."""
    return "n/a" if value != value else f"{value:.3f}"  # NaN is the only value != itself


def parse_resolution(text: str) -> tuple[int, int]:
    """'LxD' (e.g. 32x128) -> (L, D), both positive integers; typer reports anything else."""
    parts = text.lower().split("x")
    try:
        layers, coords = (int(p) for p in parts) if len(parts) == 2 else (0, 0)
    except ValueError:
        layers = coords = 0
    if layers < 1 or coords < 1:
        raise typer.BadParameter(f"expected LxD with positive integers (e.g. 32x128), got {text!r}")
    return layers, coords


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' and the hub's own progress bars and info messages off (actmap shows its own)."""
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bars()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
            enable_progress_bars()


def mean_std(mean: float, std: float | None) -> str:
    """'0.781 ± 0.012'; one seed (std NaN or None) has no spread: '0.781'."""
    if std is None or not math.isfinite(std):
        return f"{mean:.3f}"
    return f"{mean:.3f} ± {std:.3f}"


def vllm_compile_option():
    """``--vllm-compile/--vllm-eager`` of the commands that can run vLLM (None: the default)."""
    return typer.Option(
        None,
        "--vllm-compile/--vllm-eager",
        show_default=False,
        help="vLLM engines: run vLLM's compiled model (piecewise CUDA graphs on a GPU) or eager "
        "mode (default: compiled on a GPU, eager on CPU, where Inductor takes minutes).",
    )


def tensor_parallel_option():
    """``--tensor-parallel-size`` of the commands that can run vLLM."""
    return typer.Option(
        1,
        min=1,
        help="--engine vllm: vLLM's tensor parallel size (one worker per device; on the CPU "
        'build bind each worker\'s threads: VLLM_CPU_OMP_THREADS_BIND="0|1").',
    )


def sampling_option():
    """``--sampling`` of the commands that read an audit store's labelled rows."""
    return typer.Option(
        "auto",
        help="Audit stores (`serve --audit`): which labels count. sample: only answers in the "
        "review queue's uniform random sample (unbiased: the review band is over-sampled) | "
        "all: every label | auto: sample when the queue holds a random sample, else all.",
    )


def write_result(out, name: str, result) -> None:
    """Print ``result.to_markdown()`` and write it as ``<out>/<name>.md`` beside
    ``<out>/<name>.json`` (``result.to_json()``)."""
    import json

    from rich.markdown import Markdown

    from actmap.artifacts import json_safe
    from actmap.atomic import atomic_write_text

    text = result.to_markdown()
    console.print(Markdown(text))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"{name}.md", text)
    atomic_write_text(
        out / f"{name}.json", json.dumps(json_safe(result.to_json()), indent=2) + "\n"
    )
    console.print(f"written to {out / f'{name}.md'} and {out / f'{name}.json'}")
