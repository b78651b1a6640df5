"""The source files a task's code is made of: its module (a folder: the files in it; its subfolders are
``prepare``'s), then every file of this repository its ``import`` statements reach, at the top or inside
a function.

``task_code@<task>`` writes them with their hashes for the stages of the task's models to depend on,
and a training run's identity (``training/resume.py``) covers the same files.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pipeline.config import ROOT

PACKAGES = ("models", "pipeline", "serving")  # the repository's own top-level packages
REGISTRY = "pipeline/tasks/__init__.py"  # the Task base class; its like-lookup imports the config, not task code


def module_file(module: str, root: Path) -> Path | None:
    """``pipeline.tasks.sort`` → ``pipeline/tasks/sort.py`` (or a package's ``__init__.py``)."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(path: Path) -> set[str]:
    """The repository modules ``path`` imports, anywhere in it (``from a import b``: ``a.b`` where that
    is a module, else ``a``), with the packages Python runs on the way (``a`` for ``a.b``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    out = set()
    for name in names:
        if name.split(".")[0] in PACKAGES:
            parts = name.split(".")
            out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return out


def task_files(code: str, root: Path = ROOT, prepare: bool = False) -> list[Path]:
    """The files the code of task ``code`` is made of: its module, then what its imports reach.

    A task that is a folder keeps what only its ``prepare`` runs in subfolders (``translation_de_en/corpus``):
    the later stages see that code through the prepared data alone, so it is listed with ``prepare=True``
    only (``tests/test_structure.py`` checks that nothing but ``prepare`` imports it)."""
    start = root / "pipeline" / "tasks" / code
    if not start.is_dir():
        todo = [start.with_suffix(".py")]
    else:
        todo = sorted(start.rglob("*.py") if prepare else start.glob("*.py"))
    todo += [root / REGISTRY]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen or (not prepare and start.is_dir() and path.parent != start and start in path.parents):
            continue
        seen.add(path)
        if path == root / REGISTRY:
            continue
        todo += [f for m in imported_modules(path) if (f := module_file(m, root)) is not None]
    return sorted(seen)
