"""MLflow wiring: a SQLite store in the repository unless ``MLFLOW_TRACKING_URI`` is set.

Only the main process of a distributed job ever talks to MLflow (DESIGN §1).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.config import ROOT

EXPERIMENT = "attnzoo"


def tracking_uri(root: Path = ROOT) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(root).resolve() / 'mlflow.db'}"


def git_commit(root: Path = ROOT) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def setup(root: Path = ROOT):
    """Point MLflow at the store and make sure the experiment exists; returns the module."""
    import logging

    import mlflow

    logging.getLogger("alembic").setLevel(logging.WARNING)
    mlflow.set_tracking_uri(tracking_uri(root))
    if mlflow.get_experiment_by_name(EXPERIMENT) is None:
        with contextlib.suppress(Exception):  # a concurrent trial may have created it
            mlflow.create_experiment(EXPERIMENT, artifact_location=(Path(root).resolve() / "mlartifacts").as_uri())
    mlflow.set_experiment(EXPERIMENT)
    return mlflow


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else v
    return out


@contextlib.contextmanager
def run(name: str, stage: str, *, enabled: bool = True, parent_run_id: str | None = None,
        params: dict | None = None, root: Path = ROOT) -> Iterator[Any]:
    """Start an MLflow run tagged with stage, model and git commit; yields the mlflow module
    (or None when disabled, e.g. on non-main ranks)."""
    if not enabled:
        yield None
        return
    mlflow = setup(root)
    tags = {"stage": stage, "model": name, "git_commit": git_commit(root)}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    with mlflow.start_run(run_name=f"{stage}:{name}", tags=tags):
        if params:
            mlflow.log_params({k: v for k, v in flatten(params).items()})
        yield mlflow
