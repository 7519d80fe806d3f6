"""Quiet, readable output: no transformers progress bars, nothing folded at 80 columns when piped."""

from __future__ import annotations

import json

import pytest
from test_cli import synthetic_store
from typer.testing import CliRunner

from actmap.cli import app
from actmap.cli.common import PIPED_WIDTH, console

runner = CliRunner()


def test_capture_shows_no_transformers_progress_bar(tmp_path, tiny_llama, word_tokenizer):
    folder = tmp_path / "model"
    tiny_llama.save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "what is the capital", "split": "test"}) + "\n")
    args = [
        "capture",
        "--prompts",
        str(prompts),
        "--model",
        str(folder),
        "--out",
        str(tmp_path / "s"),
    ]
    result = runner.invoke(app, [*args, "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    assert "Loading weights" not in result.output and "it/s]" not in result.output
    assert "wrote 1 rows" in result.output
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # restored for the library's other users


def test_piped_output_keeps_paths_and_tables_on_one_line(tmp_path):
    assert not console.is_terminal and console.width == PIPED_WIDTH
    deep = tmp_path / ("a-rather-long-folder-name-" * 8) / "run-with-a-long-name"  # > PIPED_WIDTH
    synthetic_store(tmp_path / "store")
    args = ["train", "--store", str(tmp_path / "store"), "--out", str(deep), "--detector", "logreg"]
    trained = runner.invoke(app, [*args, "--seeds", "123456789,987654321", "--max-epochs", "2"])
    assert trained.exit_code == 0, trained.output
    assert f"run written to {deep}" in trained.output.splitlines()  # one line, not folded at 80
    evaluated = runner.invoke(app, ["evaluate", "--run", str(deep)])
    assert f"metrics written to {deep / 'evaluation.json'}" in evaluated.output.splitlines()
    report = json.loads((deep / "evaluation.json").read_text())
    row = next(line for line in evaluated.output.splitlines() if "123456789" in line)
    assert f"{report['per_seed']['123456789']['auroc']:.3f}" in row and "…" not in evaluated.output
    compared = runner.invoke(
        app, ["compare", "--store", str(tmp_path / "store"), "--run", str(deep)]
    )
    assert compared.exit_code == 0, compared.output
    header = "| method | kind | AUROC | AUPRC | ECE | n | seeds | ms/answer | note |"
    assert header in compared.output.splitlines()  # plain Markdown when not a terminal
    assert f"actmap-logreg ({deep.name})" in compared.output


def test_piped_progress_prints_plain_lines_with_counts_and_eta():
    """A logged background run (stderr not a terminal) sees its progress as plain lines."""
    import io

    from rich.console import Console

    from actmap.cli.common import progress_bar

    log = io.StringIO()
    with progress_bar(every_s=0, on=Console(file=log, force_terminal=False, width=200)) as bar:
        job = bar.add_task("capture/test", total=10, info="32 rows a batch")
        bar.advance(job, 3)
        bar.update(job, completed=7, info="batch 3")
        done = bar.add_task("finished", total=1, info="")
        bar.update(done, completed=1)
        bar.add_task("later stage", total=5, info="", visible=False)
        bar.advance(job, 1)
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("capture/test: 3/10 32 rows a batch elapsed 0:00:0")
    assert "capture/test: 7/10 batch 3 elapsed" in lines[1] and " eta " in lines[1]
    assert any(line.startswith("capture/test: 8/10") for line in lines)
    assert not any(line.startswith("finished:") for line in lines)  # a finished task is quiet
    assert not any(line.startswith("later stage:") for line in lines)  # so is a hidden one

    terminal = io.StringIO()
    with progress_bar(every_s=0, on=Console(file=terminal, force_terminal=True)) as bar:
        bar.advance(bar.add_task("capture/test", total=10, info=""), 3)
    assert "capture/test: 3/10" not in terminal.getvalue()  # a terminal gets the bar only


def test_piped_eta_falls_back_to_the_mean_rate_when_batches_are_slow():
    from types import SimpleNamespace

    from actmap.cli.common import _eta

    slow = SimpleNamespace(time_remaining=None, total=1000, completed=250, elapsed=300.0)
    assert _eta(slow) == 750 * 300.0 / 250  # 900 s: three times what 250 rows took
    assert _eta(SimpleNamespace(time_remaining=12.0, total=10, completed=1, elapsed=1.0)) == 12.0
    assert _eta(SimpleNamespace(time_remaining=None, total=None, completed=5, elapsed=9.0)) is None
    assert _eta(SimpleNamespace(time_remaining=None, total=10, completed=0, elapsed=9.0)) is None


def fake_clock_bar(log=None):
    """A piped `LoggedProgress` with an eta column on a clock the test sets: (bar, now)."""
    import io

    from rich.console import Console

    from actmap.cli.common import EtaColumn, LoggedProgress

    now = [0.0]
    bar = LoggedProgress(
        EtaColumn(),
        console=Console(file=log or io.StringIO(), force_terminal=False, width=200),
        every_s=0,
        get_time=lambda: now[0],
    )
    return bar, now


def test_a_resumed_count_is_not_this_runs_work_in_the_eta():
    """A run resumed at 180 of 390 epochs, whose next epoch takes 100 s, has about 209 x 100 s
    left, not 209 x 100 / 181 s; a fresh task's first slow batch still counts."""
    import io

    log = io.StringIO()
    bar, now = fake_clock_bar(log)
    resumed = bar.add_task("actvit", total=390, info="")
    now[0] = 0.5
    bar.update(resumed, completed=180)  # restored from the sweep's progress file
    fresh = bar.add_task("capture", total=1000, info="")  # starts at 0.5 s
    now[0] = 100.5
    bar.update(resumed, completed=181)
    bar.advance(fresh, 32)
    by_id = {t.id: t for t in bar.tasks}
    assert bar.eta(by_id[resumed]) == pytest.approx(209 * 100.0)
    assert bar.eta(by_id[fresh]) == pytest.approx((1000 - 32) * 100.0 / 32)
    assert "actvit: 181/390 elapsed 0:01:40 eta 5:48:20" in log.getvalue().splitlines()
    column = bar.columns[0]
    assert column.render(by_id[resumed]).plain == "5:48:20"  # the terminal bar's eta

    bar.reset(resumed, total=10, completed=2)  # a count that starts over: its own start
    now[0] = 110.5
    bar.update(resumed, completed=4)
    assert bar.eta(bar.tasks[0]) == pytest.approx(6 * 10.0 / 2)


def test_a_count_that_starts_over_restarts_the_task_clock():
    """A reproduce stage reports one baseline method's rows after another: the next method's
    count restarts the task (its own elapsed and eta), a growing count only updates it."""
    import io

    from rich.console import Console

    from actmap.cli.common import progress_bar, task_progress

    log = io.StringIO()
    with progress_bar(every_s=0, on=Console(file=log, force_terminal=False, width=200)) as bar:
        job = bar.add_task("baselines/s", total=None, info="")
        progress = task_progress(bar, job)
        progress(2, 10, "eigenscore (1/2)")
        started = bar.tasks[0].start_time
        progress(6, 10, "eigenscore (1/2)")
        assert bar.tasks[0].start_time == started and bar.tasks[0].completed == 6
        progress(1, 4, "semantic_entropy (2/2)")
        task = bar.tasks[0]
        assert (task.completed, task.total) == (1, 4) and task.start_time > started
        progress(4, 4, "semantic_entropy (2/2)")
        progress(2, 2, "eigenscore: done, semantic_entropy: done")  # the stage's closing count
        assert bar.tasks[0].finished
        bar.update(bar.add_task("next stage", total=3, info=""), completed=1)
    lines = log.getvalue().splitlines()
    assert not any(line.startswith("baselines/s: 2/2") for line in lines)  # finished: quiet
    assert lines[0].startswith("baselines/s: 2/10 eigenscore (1/2) elapsed")
    assert any(line.startswith("baselines/s: 1/4 semantic_entropy (2/2) elapsed") for line in lines)


def test_a_sweep_resumed_after_its_preparing_rows_gets_this_runs_rate():
    """`actmap baselines` runs ACT-ViT as 'preparing' over its rows, then, after loading the
    tensors (long past the task's first second), reports the sweep's epochs resumed at 270 of
    390: a count in another total, so its own start. An epoch of 100 s leaves 119 x 100 s."""
    from actmap.cli.common import method_progress

    bar, now = fake_clock_bar()
    progress = method_progress(bar)  # what `actmap baselines` reports through
    progress("actvit", 0, 56, "preparing")
    now[0] = 40.0  # the dense tensors loaded
    progress("actvit", 270, 390, "config 19/24 epoch 0/15")
    now[0] = 140.0
    progress("actvit", 271, 390, "config 19/24 epoch 1/15")
    progress("perplexity", 0, 56, "preparing")  # the next method: a task of its own
    assert [t.description for t in bar.tasks] == ["actvit", "perplexity"]
    assert bar.eta(bar.tasks[0]) == pytest.approx(119 * 100.0)


def test_restored_work_reported_late_is_still_not_this_runs_work():
    """A capture resumed at 1,120 of 1,500 finds its stored rows only after planning (30 s of
    rendering and tokenizing prompts under load); `resume` takes them as restored all the
    same, so 32 summaries in 2,400 s leave (1,500 - 1,152) x 75 s."""
    bar, now = fake_clock_bar()
    job = bar.add_task("capture cnn_dm", total=1500, info="")
    now[0] = 30.0
    bar.resume(job, 1120)
    now[0] = 2430.0
    bar.advance(job, 32)
    assert bar.tasks[0].completed == 1152
    assert bar.eta(bar.tasks[0]) == pytest.approx(348 * 2400.0 / 32)


def test_seed_bars_count_each_seeds_epochs_and_show_from_its_first_epoch():
    """`actmap train` and `actmap demo`'s training progress: one count of epochs per seed."""
    import io

    from rich.console import Console

    from actmap.cli.common import progress_bar
    from actmap.cli.train import SeedBars

    log = io.StringIO()
    with progress_bar(every_s=0, on=Console(file=log, force_terminal=False, width=200)) as bar:
        seeds = SeedBars(bar, (42, 123), max_epochs=5, visible=False)
        seeds(0, {"seed": 42, "train_loss": 0.7, "val_auroc": 0.5})
        seeds(2, {"seed": 42, "train_loss": 0.25, "val_auroc": 0.75})
        assert [t.completed for t in bar.tasks] == [3, 0]
        seeds.finish()  # seed 42 stopped early; seed 123 was never reported
        assert [(t.completed, t.total, t.visible) for t in bar.tasks] == [(5, 5, True)] * 2
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("seed 42: 1/5 loss 0.700 val AUROC 0.500 elapsed")
    assert lines[1].startswith("seed 42: 3/5 loss 0.250 val AUROC 0.750 elapsed")
    assert not any(line.startswith("seed 123:") for line in lines)  # hidden until it trains


def test_one_seed_prints_its_value_not_plus_minus_nan():
    from actmap.cli.common import mean_std
    from actmap.cli.train import print_summary

    assert mean_std(0.78125, float("nan")) == "0.781"
    assert mean_std(0.78125, None) == "0.781"
    assert mean_std(0.78125, 0.0123) == "0.781 ± 0.012"
    metrics = {"auroc": 0.78125, "auprc": 0.7, "ece": 0.05}
    with console.capture() as captured:
        print_summary(
            {
                "detector": "actmap-plus",
                "per_seed": {"0": metrics},
                "mean": metrics,
                "std": dict.fromkeys(metrics, float("nan")),
            }
        )
    text = captured.get()
    assert "nan" not in text and "one seed" in text and "0.781" in text


def test_capture_overhead_reads_as_noise_when_inside_the_plain_runs_spread():
    from actmap.capture.overhead import Overhead

    # plain runs 1.0, 1.2, 0.8 s: median 1.0, half-range 0.2 -> spread 20%
    noisy = Overhead(plain_s=[1.0, 1.2, 0.8], hooked_s=[0.875, 1.05, 0.7], identical_tokens=True)
    assert noisy.overhead_pct == pytest.approx(-12.5)  # every ratio is 0.875
    assert noisy.plain_spread_pct == pytest.approx(20.0)
    assert noisy.within_noise
    assert noisy.describe() == "-12.5% (median of 3; plain runs spread ±20.0%: within noise)"
    # plain runs 1.0, 1.02, 0.98: spread 2%; hooked 30% slower is a measured cost
    costly = Overhead(
        plain_s=[1.0, 1.02, 0.98], hooked_s=[1.3, 1.326, 1.274], identical_tokens=True
    )
    assert costly.overhead_pct == pytest.approx(30.0)
    assert not costly.within_noise and "beyond the plain runs' spread" in costly.describe()
    one = Overhead(plain_s=[2.0], hooked_s=[2.1], identical_tokens=True)  # one repeat: no spread
    assert one.plain_spread_pct == 0.0 and not one.within_noise
