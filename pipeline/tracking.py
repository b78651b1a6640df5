"""MLflow wiring: a SQLite store in the repository unless ``MLFLOW_TRACKING_URI`` is set.

Two modes:

- default: ``sqlite:///<repo>/mlflow.db`` with artifacts in ``<repo>/mlartifacts``;
- a tracking server (``MLFLOW_TRACKING_URI=http://host:port``): the server chooses where artifacts
  go (``mlflow-artifacts:`` proxied through it, e.g. ``mlflow server --serve-artifacts``), so they
  reach its store rather than this machine's disk.

Only the main process of a distributed job ever talks to MLflow (docs/architecture.md §1).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.config import ROOT, UserError

EXPERIMENT = "attnzoo"
GIT_COMMIT_TAG = "mlflow.source.git.commit"  # MLflow's own tag: its UI links runs to the commit
HEALTH_TIMEOUT_S = 3.0

_reachable: set[str] = set()  # servers already checked by this process (tune trials call setup often)


def tracking_uri(root: Path = ROOT) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(root).resolve() / 'mlflow.db'}"


def is_server(uri: str) -> bool:
    return uri.split(":", 1)[0].lower() in ("http", "https")


def git_commit(root: Path = ROOT) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def check_server(uri: str, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """Raise a UserError within ``timeout`` seconds if nothing answers at ``uri``.

    MLflow's client retries a dead server with backoff for minutes before failing with a
    traceback; one short GET of ``/health`` turns that into one sentence up front.
    """
    if uri in _reachable:
        return
    context = None
    if uri.lower().startswith("https:"):  # the same TLS settings MLflow's own client honours
        import ssl

        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
            context = ssl._create_unverified_context()
        elif os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
            context = ssl.create_default_context(cafile=os.environ["MLFLOW_TRACKING_SERVER_CERT_PATH"])
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout, context=context):
            pass
    except urllib.error.HTTPError as err:
        # 401/403: a server behind authentication, which MLflow's client handles (or reports) itself;
        # anything else (a gateway's 502, a 404 from whatever else listens there) is no MLflow server.
        if err.code not in (401, 403):
            raise UserError(f"no MLflow tracking server answers at {uri} (MLFLOW_TRACKING_URI; /health gave HTTP "
                            f"{err.code}): start it, or unset MLFLOW_TRACKING_URI to use the local SQLite store"
                            ) from None
    except (OSError, http.client.HTTPException, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise UserError(f"the MLflow tracking server at {uri} (MLFLOW_TRACKING_URI) is unreachable ({reason}): "
                        "start it, or unset MLFLOW_TRACKING_URI to use the local SQLite store") from None
    _reachable.add(uri)


def ensure_reachable(root: Path = ROOT) -> None:
    """UserError now if the configured tracking server does not answer (a SQLite store always does)."""
    uri = tracking_uri(root)
    if is_server(uri):
        check_server(uri)


def setup(root: Path = ROOT):
    """Point MLflow at the store and make sure the experiment exists; returns the module."""
    import logging

    ensure_reachable(root)
    uri = tracking_uri(root)

    import mlflow

    logging.getLogger("alembic").setLevel(logging.WARNING)
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(EXPERIMENT) is None:
        # A server picks the artifact root itself (mlflow-artifacts:/ when it serves artifacts); a
        # file:// location here would make clients write artifacts to their own disks instead.
        location = None if is_server(uri) else (Path(root).resolve() / "mlartifacts").as_uri()
        with contextlib.suppress(Exception):  # a concurrent trial may have created it
            mlflow.create_experiment(EXPERIMENT, artifact_location=location)
    experiment = mlflow.set_experiment(EXPERIMENT)
    if is_server(uri) and experiment.artifact_location.startswith("file:"):
        print(f"warning: experiment '{EXPERIMENT}' on {uri} keeps artifacts at {experiment.artifact_location}, "
              "on each client's own disk; delete it on the server so that it is recreated with the server's store",
              file=sys.stderr)
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


def _existing_run(mlflow, run_id: str):
    """The run to resume, or None when this store has no live run by that id in our experiment
    (e.g. a checkpoint written while tracking went to another store)."""
    from mlflow.exceptions import MlflowException

    try:
        found = mlflow.MlflowClient().get_run(run_id)
    except MlflowException:
        return None
    experiment = mlflow.get_experiment_by_name(EXPERIMENT)
    same_experiment = experiment is not None and found.info.experiment_id == experiment.experiment_id
    return found if same_experiment and found.info.lifecycle_stage == "active" else None


@contextlib.contextmanager
def run(name: str, stage: str, *, enabled: bool = True, parent_run_id: str | None = None,
        params: dict | None = None, root: Path = ROOT, run_id: str | None = None) -> Iterator[Any]:
    """Start an MLflow run tagged with stage, model and git commit; yields the mlflow module
    (or None when disabled, e.g. on non-main ranks).

    ``run_id`` resumes that run (a training run restarted from its checkpoint keeps one MLflow
    run); if the store does not have it, a new run starts.
    """
    if not enabled:
        yield None
        return
    mlflow = setup(root)
    tags = {"stage": stage, "model": name}
    commit = git_commit(root)
    if commit != "unknown":  # outside a git checkout: no tag rather than a value that is not a commit
        tags[GIT_COMMIT_TAG] = commit
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    existing = _existing_run(mlflow, run_id) if run_id else None
    if run_id and existing is None:
        print(f"MLflow run {run_id} not found in {tracking_uri(root)}; starting a new {stage} run for {name}")
    with mlflow.start_run(run_id=existing.info.run_id if existing else None, run_name=f"{stage}:{name}", tags=tags):
        if params:
            # A resumed run already holds its params; MLflow rejects a param logged twice with a
            # different rendering, so only the missing ones are logged.
            logged = existing.data.params if existing else {}
            new = {k: v for k, v in flatten(params).items() if k not in logged}
            if new:
                mlflow.log_params(new)
        yield mlflow
