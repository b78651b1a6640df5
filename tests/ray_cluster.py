"""A real two-node Ray cluster on loopback, for tests: a head and one worker, separate processes.

Each node is a ``ray start --block`` process in its own session, so this context manager owns
exactly those processes and their children: on exit it signals the two process groups and never
runs ``ray stop``, which would also stop every other Ray instance on the machine. Every port a
node would otherwise take from a fixed default (client server 10001, dashboard agent 52365, ...)
is a free one, and each node has its own short ``--temp-dir``, so clusters started side by side
(other tests, other engineers) do not collide.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.ports import free_port, held_by_another, proc_stats, wait_serving

RAY = str(Path(sys.executable).parent / "ray")
HOST = "127.0.0.1"


def _node_ports() -> list[str]:
    """Free ports for the per-node services whose defaults are fixed numbers."""
    return ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
            "--metrics-export-port", str(free_port()), "--runtime-env-agent-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port())]


# A small object store: trials pass only metrics, and /dev/shm is shared with other work.
COMMON = ["--block", "--node-ip-address", HOST, "--num-cpus", "1", "--num-gpus", "0",
          "--object-store-memory", "100000000", "--disable-usage-stats", "--log-style", "record"]

# The script run by the readiness check: a driver that joins, lists the nodes and leaves.
_PROBE = """
import json, sys, ray
ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False, configure_logging=False)
print(json.dumps([n["NodeID"] for n in ray.nodes() if n["Alive"]]))
"""


def _stop(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM each node's process group, then SIGKILL whatever is left after ``grace`` seconds."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    # Raylet and GCS share the group of `ray start`, but each worker process gets a group of its own:
    # sweep the whole session (start_new_session made `ray start` its leader) for leftovers.
    for proc in procs:
        for pid in [proc.pid, *_session_members(proc.pid)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _session_members(sid: int) -> list[int]:
    """Pids in session ``sid`` (Linux /proc; elsewhere none are found and the group kill has to do)."""
    return [pid for pid, fields in proc_stats().items() if int(fields[3]) == sid and pid != os.getpid()]


def alive_nodes(address: str, env: dict[str, str] | None = None) -> list[str]:
    """Node ids of the alive nodes, asked by a throwaway driver (a subprocess: this one stays Ray-free)."""
    env = env if env is not None else {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", _PROBE, address], env=env, capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0:
        return []
    return json.loads(out.stdout.strip().splitlines()[-1])


class _NodeExited(RuntimeError):
    """A node's ``ray start`` ended while the cluster was starting."""


# A node that exits while starting (or a head whose port another process listens on) gets one more go, on fresh
# ports: its port may have been taken meanwhile, or the GCS did not register it within the 30 s `ray start`
# waits (fixed in ray/_private/node.py; seen once on a loaded 2-core machine).
START_TRIES = 2


@contextlib.contextmanager
def ray_cluster(nodes: int = 2, timeout: float = 90.0) -> Iterator[str]:
    """Start a head and ``nodes - 1`` workers (1 CPU each) on 127.0.0.1; yields ``127.0.0.1:PORT``.

    Raises RuntimeError with the nodes' logs if they are not all alive within ``timeout`` seconds, or if a
    node exits on each of ``START_TRIES`` starts (each on fresh ports).
    """
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_AUTH_MODE"] = "disabled"
    # A node drains for up to 30 s on SIGTERM (for Serve replicas); these run none, so they stop at once.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    for attempt in range(START_TRIES):
        # /tmp, short: Ray puts Unix sockets under the temp dir, and their paths are limited to ~107 bytes
        state = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))
        procs: list[subprocess.Popen] = []
        try:
            address = _start(nodes, timeout, env, state, procs)
            break
        except BaseException as exc:
            _stop(procs)
            shutil.rmtree(state, ignore_errors=True)
            if not isinstance(exc, _NodeExited) or attempt + 1 == START_TRIES:
                raise
    try:
        yield address
    finally:
        _stop(procs)
        shutil.rmtree(state, ignore_errors=True)


def _start(nodes: int, timeout: float, env: dict[str, str], state: Path, procs: list[subprocess.Popen]) -> str:
    """Start the nodes (appending each process to ``procs``) and wait for them all; returns the head's address."""
    port = free_port()
    address = f"{HOST}:{port}"
    # --include-dashboard false still runs a minimal dashboard process, on port 8265 unless told otherwise
    commands = [[RAY, "start", "--head", "--port", str(port), "--include-dashboard", "false",
                 "--dashboard-port", str(free_port()), "--temp-dir", str(state / "head"), *COMMON, *_node_ports()]]
    commands += [[RAY, "start", "--address", address, "--temp-dir", str(state / f"n{i}"), *COMMON, *_node_ports()]
                 for i in range(1, nodes)]
    logs: list[Path] = []
    for i, cmd in enumerate(commands):
        logs.append(state / f"node{i}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        if i == 0:  # workers need the head's GCS to be listening
            _wait_for_port(HOST, port, procs[0], timeout, logs)
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise _NodeExited(f"a Ray node exited with code {dead[0].returncode}:\n{_tails(logs)}")
        with contextlib.suppress(subprocess.TimeoutExpired, ValueError, IndexError):
            seen = alive_nodes(address, env)
        if len(set(seen)) >= nodes:
            return address
        time.sleep(2)
    raise RuntimeError(f"{len(set(seen))} of {nodes} Ray nodes alive after {timeout:.0f} s:\n{_tails(logs)}")


def _wait_for_port(host: str, port: int, proc: subprocess.Popen, timeout: float, logs: list[Path]) -> None:
    """Wait until the head's own GCS listens on ``port``. Another server that took the number in between
    (``free_port`` is free only when asked) would answer a bare connect: workers would then start pointed at
    it, or join another test's cluster, while this head exits on its failed bind."""

    def ready() -> bool:
        # A head whose GCS failed to bind takes about 40 s to give up (its GCS client's retries): the port
        # held by another process is answer enough.
        if held_by_another(proc.pid, port):
            raise _NodeExited(f"another process listens on the Ray head's port {port}")
        return _connects(host, port)

    if wait_serving(proc, port, ready, timeout):
        return
    if proc.poll() is not None:
        raise _NodeExited(f"the Ray head exited with code {proc.returncode}:\n{_tails(logs)}")
    raise RuntimeError(f"the Ray head did not listen on {host}:{port} within {timeout:.0f} s:\n{_tails(logs)}")


def _connects(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def _tails(logs: list[Path], chars: int = 3000) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in logs if p.exists())
