"""Ray cluster wiring shared by the tune stage and the runner's Ray executor: a ``RAY_ADDRESS`` checked
before ``ray.init`` retries for minutes, and what every worker needs (this checkout's code, the MLflow
store)."""

from __future__ import annotations

import socket
from pathlib import Path

from pipeline.config import UserError


def check_address(address: str | None) -> None:
    """Fail fast on a ``RAY_ADDRESS`` nobody listens on: ``ray.init`` would retry for minutes."""
    if not address or address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    host, port = (host, port) if port.isdigit() else (hostport, "6379")  # Ray's default GCS port
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=3):
            return
    except OSError:
        pass
    raise UserError(f"RAY_ADDRESS={address}: no Ray cluster answers there; start the head with "
                    "`ray start --head` (and point RAY_ADDRESS at it) or unset RAY_ADDRESS to run locally")


def runtime_env(tracking_uri: str) -> dict:
    """What every Ray worker needs: this driver's code, and the MLflow store its trials log to.

    A ``working_dir`` of the checkout this process imported ``pipeline`` from (a test's copy
    ships itself), rather than ``py_modules``: with ``py_modules`` Ray also puts the driver's
    current directory first on every worker's ``sys.path``, so a node holding another checkout at
    that path would run its code instead; a ``working_dir`` turns that off. What is not code
    (data, runs, venvs, MLflow stores) is excluded, which keeps the upload to about a MiB, well
    under Ray's 512 MiB limit; ``.gitignore`` is honoured too.
    """
    import pipeline

    code_root = Path(list(pipeline.__path__)[0]).parent  # pipeline is a namespace package: no __file__
    excludes = ["/.git", "/.venv", "/.dvc", "/.cluster", "/data", "/runs", "/results", "/reports",
                "/model_repository", "/mlruns", "/mlartifacts", "*.db", "__pycache__", "*.egg-info"]
    return {"working_dir": str(code_root), "excludes": excludes,
            "env_vars": {"MLFLOW_TRACKING_URI": tracking_uri}}
