"""Stage ``task_code@<task>``: the source files a task's code is made of → ``data/task_code/<task>.json``.

A task's module builds on others (``convex_hull`` on ``common/pointer.py``, the recognition tasks on
``common/recognition.py``, its evaluation on ``pipeline/plots.py`` ...) and a ``like:`` task runs
another task's code, so no fixed path in ``dvc.yaml`` names them for every entry. This stage lists
them (``pipeline/sources.py``): the task's module (a folder: the files in it), then every file of this
repository its ``import`` statements reach, each with its SHA-256; ``<task>.prepare.json`` lists what
only ``prepare`` runs (the folder's subfolders). The stages of the task's models depend on these lists
rather than on all of ``pipeline/tasks``: an edit to one task re-runs the stages of its own models,
and re-running this stage for an edit elsewhere rewrites the same bytes, so nothing downstream re-runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from pipeline.config import ROOT
from pipeline.entry import exit_after, run_cli, task_entry
from pipeline.sources import task_files
from pipeline.tasks import code_name


def task_code(task: str, code: str, root: Path = ROOT) -> tuple[dict, dict]:
    """What task ``task`` (running the code of task ``code``) is made of: ``{"task", "code", "files":
    {path: sha256}}`` for every stage of its models, then the same for the files only ``prepare`` runs."""
    def listed(paths: list[Path]) -> dict:
        files = {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
        return {"task": task, "code": code, "files": files}

    runs = task_files(code, root)
    return listed(runs), listed([p for p in task_files(code, root, prepare=True) if p not in runs])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="List the source files one task's code is made of.")
    ap.add_argument("task", help="a params.yaml task, e.g. copy")
    args = ap.parse_args(argv)

    def body():
        task_entry(args.task)
        runs, prepare_only = task_code(args.task, code_name(args.task))
        out = ROOT / "data" / "task_code"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.task}.json").write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n")
        (out / f"{args.task}.prepare.json").write_text(json.dumps(prepare_only, indent=1, sort_keys=True) + "\n")
        print(f"{args.task}: {len(runs['files'])} files of {runs['code']}'s code, "
              f"{len(prepare_only['files'])} more for prepare")

    run_cli(body)


if __name__ == "__main__":
    exit_after(main)
