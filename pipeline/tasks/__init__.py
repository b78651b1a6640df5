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
        """Write prepared files into ``out``; return manifest facts (counts, vocab...). A fact ``provenance``
        (where the data came from: package versions, downloaded bytes) is kept out of the manifest, in
        ``data/provenance/<task>.json``: it changes with a package's version although the data does not."""
        raise TaskError(f"task {self.name} has no prepare step")

    def changes(self, before: dict[str, Path], after: Path) -> list[str]:
        """What changed in the prepared data, a line each, when a re-run wrote other files than the ones
        ``dvc.lock`` records (``before``: those files by name, ``after``: the new folder). Default: nothing
        beyond the stage's own note."""
        return []

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

    def example_batch(self, cfg: dict, seed: int = 0, batch: int = 3) -> dict:
        """A small deterministic batch in this task's format for a model configured by ``cfg`` (its
        vocabulary, input and image sizes): what the tests feed each architecture's tiny model
        (``profiles/smoke.yaml`` names the task each architecture's tiny configuration fits)."""
        raise TaskError(f"task {self.name} has no example batch")


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    TASKS[task.name] = task
    return task


def task_names() -> list[str]:
    """The tasks with code of their own: every module or package here but ``common`` (no import)."""
    return sorted(i.name for i in pkgutil.iter_modules(__path__) if i.name != "common")


def code_name(name: str) -> str:
    """The task whose code runs ``name``: itself, or the task a ``like:`` entry names."""
    if name in task_names():
        return name
    from pipeline.config import load_params  # here: config imports the model registry, not tasks

    base = ((load_params().get("tasks") or {}).get(name) or {}).get("like")
    if base not in task_names():
        raise TaskError(f"unknown task '{name}'; known tasks: {', '.join(task_names())} "
                        f"(or a params.yaml entry tasks.{name} with like: <one of them>)")
    return base


def get_task(name: str) -> Task:
    """The task ``name``, importing its module alone (and what it builds on), so a stage runs and
    depends on the code of its own task only."""
    if name not in TASKS:
        base = code_name(name)
        importlib.import_module(f"{__name__}.{base}")
        if name != base:
            # A ``params.yaml`` task entry with ``like: <task>`` runs that task's code under its own name
            # (its own prepared data, e.g. a user's corpus: ``tasks.fr_en: {like: translation_de_en, corpus: ...}``).
            clone = shallow_copy(TASKS[base])
            clone.name = name
            register_task(clone)
    return TASKS[name]
