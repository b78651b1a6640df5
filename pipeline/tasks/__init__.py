"""Tasks: raw data → prepared tensors, datasets, collate functions (and their metrics)."""

from __future__ import annotations

import importlib
import pkgutil
from copy import copy as shallow_copy  # (pipeline.tasks.copy, the NTM task, takes the name "copy")
from pathlib import Path


class TaskError(RuntimeError):
    """A task cannot run; the message names the fix."""


class Task:
    name: str = ""
    # What a server needs to run this task's models on raw input (merged into the ``serving``
    # block that ``publish`` writes; e.g. the input kind, tokenizers, attention outputs).
    serving: dict = {}
    # What a model card says of the data: where it comes from, its licence, the paper whose task it is.
    card: dict = {"data": "not stated", "licence": "not stated"}

    def prepare(self, params: dict, out: Path) -> dict:
        """Write prepared files into ``out``; return manifest facts (counts, vocab...)."""
        raise TaskError(f"task {self.name} has no prepare step")

    def load(self, data_dir: Path, split: str) -> list:
        """Load one split as a list of items for :meth:`collate`."""
        raise TaskError(f"task {self.name} has no split '{split}'")

    def collate(self, items: list) -> dict:
        raise TaskError(f"task {self.name} has no collate function")

    def evaluate(self, model, run, plots: Path) -> tuple[dict, dict]:
        """Test metrics and plots for a trained model.

        Returns: (metrics for ``metrics.json``, a comparison row for the task report with
        ``headline`` values and a ``by_length`` series).
        """
        raise TaskError(f"task {self.name} has no evaluation")

    def parity_batches(self, data_dir: Path) -> list[tuple[str, dict]]:
        """Real test batches over a grid of batch sizes and lengths, for the parity gate."""
        raise TaskError(f"task {self.name} has no parity batches")

    def model_parity_batches(self, model, data_dir: Path) -> list[tuple[str, dict]]:
        """Parity batches that depend on the model (e.g. noise inputs shaped by its config); by
        default the task's own :meth:`parity_batches`."""
        return self.parity_batches(data_dir)

    def length(self, item) -> int:
        """Size used to bucket items of similar length into batches."""
        return len(item)


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    # Import every task module once (importing one directly must not hide the others).
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    if name not in TASKS:
        _register_like(name)
    if name not in TASKS:
        raise TaskError(f"unknown task '{name}'; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def _register_like(name: str) -> None:
    """A ``params.yaml`` task entry with ``like: <task>`` runs that task's code under its own name
    (its own prepared data, e.g. a user's corpus: ``tasks.fr_en: {like: translation_de_en, corpus: ...}``)."""
    from pipeline.config import load_params  # here: config imports the model registry, not tasks

    base = ((load_params().get("tasks") or {}).get(name) or {}).get("like")
    if base in TASKS:
        clone = shallow_copy(TASKS[base])
        clone.name = name
        register_task(clone)
