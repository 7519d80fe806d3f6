"""The paper's data: datasets, prompts, correctness labels and source-key-disjoint splits.

A capture run does, per split::

    task = get_task("triviaqa")                   # or gsm8k, nq_open, cnn_dm, builtin
    for example in task.load("test", limit):
        text = task.prompt(example, tokenizer)    # exact model input
        raw = generate(text)                      # kept as the raw answer
        correct = task.label(task.postprocess(raw), example)

Task classes are imported on first use, so ``import actmap.data`` stays light.
"""

from __future__ import annotations

import importlib
import importlib.util

from actmap.data.base import DataError, Example, Task

# name -> "module:Class"; imported lazily by get_task
TASK_REGISTRY: dict[str, str] = {
    "triviaqa": "actmap.data.datasets:TriviaQATask",
    "nq_open": "actmap.data.datasets:NQOpenTask",
    "gsm8k": "actmap.data.datasets:GSM8KTask",
    "cnn_dm": "actmap.data.datasets:CNNDMTask",
    "builtin": "actmap.data.builtin:BuiltinArithmeticTask",
}


def _task_class(name: str) -> type:
    if name not in TASK_REGISTRY:
        raise DataError(f"unknown task {name!r}; choose one of {sorted(TASK_REGISTRY)}")
    module_name, class_name = TASK_REGISTRY[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        raise DataError(
            f"task {name!r} needs module {module_name}, which is not installed"
        ) from None
    return getattr(module, class_name)


def get_task(name: str, **kwargs) -> Task:
    """An instance of the task registered as ``name``; ``kwargs`` go to its constructor."""
    return _task_class(name)(**kwargs)


def available_tasks() -> list[str]:
    """Registered task names whose module can be imported here."""
    names = []
    for name, target in TASK_REGISTRY.items():
        if importlib.util.find_spec(target.split(":")[0]) is not None:
            names.append(name)
    return names


__all__ = ["TASK_REGISTRY", "DataError", "Example", "Task", "available_tasks", "get_task"]
