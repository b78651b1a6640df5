"""Stage ``prepare@<task>``: raw data (packages, seeds) → ``data/prepared/<task>/`` + manifest.

Writes into a scratch folder (named after the process) renamed into place on success, so a failure (say, a missing
Debian package) leaves any earlier prepared data untouched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

from pipeline import tracking
from pipeline.config import ROOT
from pipeline.entry import exit_after, run_cli, task_entry
from pipeline.files import scratch_beside
from pipeline.tasks import get_task


def checksums(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def prepare(task_name: str, params: dict, out: Path) -> dict:
    """Prepare ``task_name`` with its ``params.yaml`` section into ``out``; returns the manifest."""
    task = get_task(task_name)
    out = Path(out)
    tmp = scratch_beside(out)
    try:
        facts = task.prepare(params, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # No run time in the manifest: it must be a function of the data alone, or re-running an
    # unchanged prepare would change its output's hash and retrain every model downstream. The
    # stage logs its duration to MLflow instead.
    manifest = {"task": task_name, "params": params, **facts, "files": checksums(tmp)}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Prepare one task's data.")
    ap.add_argument("task", help="a params.yaml task, e.g. copy")
    args = ap.parse_args(argv)

    def body():
        params = task_entry(args.task)
        tracking.ensure_reachable()  # before the work, not after it: a dead server fails in seconds
        started = time.time()
        manifest = prepare(args.task, params, ROOT / "data" / "prepared" / args.task)
        seconds = time.time() - started
        print(f"prepared {args.task} in {seconds:.1f} s")
        with tracking.run(args.task, "prepare", params={"task": params}) as mlflow:
            mlflow.log_dict(manifest, "manifest.json")
            mlflow.log_metric("prepare_seconds", round(seconds, 1))
        print(json.dumps({k: v for k, v in manifest.items() if k != "files"}, indent=1))

    run_cli(body)


if __name__ == "__main__":
    exit_after(main)
