"""A real ``mlflow server`` on loopback for tests: SQLite backend, proxied artifact store.

Usage::

    with mlflow_server(tmp_path) as url:   # "http://127.0.0.1:PORT"
        ...                                # MLFLOW_TRACKING_URI=url
    # artifacts logged through the server land under tmp_path / "artifacts",
    # runs and the model registry in tmp_path / "server.db", its log in tmp_path / "server.log"
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.ports import free_port, wait_serving

START_TIMEOUT_S = 60.0  # about 12 s on the 2-core development machine
STOP_TIMEOUT_S = 10.0
PORT_TRIES = 3


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we cannot signal still counts as alive
        return True
    return True


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the whole group (the CLI forks a uvicorn server), then SIGKILL what is left."""
    pgid = proc.pid  # start_new_session: the server leads its own group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and (proc.poll() is None or _group_alive(pgid)):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_TIMEOUT_S)


def _start(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """One try: the server on a free port, up once its own process answers ``/health`` there.

    Returns (process, url), or (process, "") where the port went to another process first.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
           "--serve-artifacts", "--artifacts-destination", str(tmp_path / "artifacts")]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    # /health alone can be answered by another worker's server that was handed the same port
    if wait_serving(proc, port, lambda: _healthy(url), START_TIMEOUT_S):
        return proc, url
    if proc.poll() is None:
        _stop(proc)
        raise RuntimeError(f"mlflow server not healthy after {START_TIMEOUT_S:.0f} s:\n{log_path.read_text()[-4000:]}")
    if "address already in use" in log_path.read_text(errors="replace").lower():
        return proc, ""
    raise RuntimeError(f"mlflow server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")


@contextlib.contextmanager
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """Start ``mlflow server`` bound to 127.0.0.1 on a free port; yields its URL.

    Artifacts go to ``tmp_path / "artifacts"`` (``--serve-artifacts``: clients upload through the
    server, as on a cluster where they share no disk). The process group is stopped on exit.
    """
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    # No huey job runner beside the web worker: nothing here uses server-side jobs, and it would
    # be one more process competing for the CPU.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    for _ in range(PORT_TRIES):
        proc, url = _start(tmp_path, env)
        if url:
            break
        _stop(proc)
    else:
        raise RuntimeError(f"mlflow server: {PORT_TRIES} free ports were all taken before it could bind one")
    try:
        yield url
    finally:
        died = proc.poll()
        _stop(proc)
    if died is not None:  # the tests saw "connection refused"; this says why
        log = (tmp_path / "server.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"mlflow server {url} exited with {died} before its tests ended:\n{log}")
