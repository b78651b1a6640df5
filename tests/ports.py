"""Loopback ports for the servers tests start, and who listens on them.

``free_port()`` asks the kernel for a port that is free *now*; a server started on it binds it a
few seconds later. Tests run on several xdist workers at once, so another worker can be handed the
same number in between: one server then fails to bind, and its health check, polling the port,
answers with the other worker's server until that one stops (seen once as "connection refused"
half-way through a module). ``listens(proc, port)`` tells the two apart: the listening socket
must belong to the process started, or to one of its children.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

LISTEN = "0A"  # TCP state in /proc/net/tcp
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, in /proc/net/tcp and tcp6 (IPv4-mapped)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def handing_out_first(port: int) -> Callable[[], int]:
    """A ``free_port`` that returns ``port`` once, then free ones: for tests of a server whose port another
    worker's server was handed first."""
    first = iter([port])
    return lambda: next(first, None) or free_port()


def _listening_rows(port: int) -> list[list[str]] | None:
    """The /proc/net/tcp{,6} rows of the sockets listening on ``port`` (any address), or None where /proc/net
    cannot be read."""
    rows, readable = [], False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            lines = Path(table).read_text().splitlines()[1:]
            readable = True
            for line in lines:
                fields = line.split()  # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
                if fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    rows.append(fields)
    return rows if readable else None


def _listening_inodes(port: int) -> set[str] | None:
    """Inodes of the sockets listening on ``port`` (any address), or None where /proc/net cannot be read."""
    rows = _listening_rows(port)
    return None if rows is None else {fields[9] for fields in rows}


def listening_addresses(port: int) -> list[str]:
    """Hex local addresses of the sockets listening on ``port`` (/proc/net/tcp{,6}): "0100007F" is 127.0.0.1."""
    return [fields[1].rsplit(":", 1)[0] for fields in _listening_rows(port) or []]


def assert_loopback_only(port: int) -> None:
    """Something listens on ``port``, and only on 127.0.0.1: a test's server is never reachable from outside
    the machine."""
    addresses = listening_addresses(port)
    assert addresses and set(addresses) <= LOOPBACK, f"port {port} must be listened on at 127.0.0.1 only: {addresses}"


def proc_stats() -> dict[int, list[str]]:
    """Every process's /proc/PID/stat fields after "(comm)": [state, ppid, pgrp, session, ...] (Linux; elsewhere
    none)."""
    stats = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            stats[int(stat.parent.name)] = stat.read_text().rsplit(")", 1)[1].split()  # comm may hold spaces
    return stats


def _descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (Linux /proc)."""
    parent = {p: int(fields[1]) for p, fields in proc_stats().items()}
    family, grew = {pid}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in family} - family
        family |= more
        grew = bool(more)
    return family


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` or a child of it holds the socket listening on ``port``.

    True where it cannot be told (no /proc): the caller's health check is then all there is.
    """
    inodes = _listening_inodes(port)
    if inodes is None:
        return True
    for member in _descendants(pid):
        for fd in Path(f"/proc/{member}/fd").glob("*"):
            with contextlib.suppress(OSError):
                if (link := str(fd.readlink())).startswith("socket:[") and link[8:-1] in inodes:
                    return True
    return False


def held_by_another(pid: int, port: int) -> bool:
    """Whether a process outside ``pid``'s tree listens on ``port`` (False where it cannot be told): a server
    started there can then not bind it, however long it takes to give up."""
    return bool(_listening_inodes(port)) and not listens(pid, port)


def wait_serving(proc: subprocess.Popen, port: int, ready: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``ready()`` until it is true and ``proc`` (or a child) is the one listening on ``port``.

    False once ``timeout_s`` passes or ``proc`` exits (a server that lost the port to another
    worker's exits on its failed bind, while ``ready()`` may be answered by that other server).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if ready() and listens(proc.pid, port):
            return True
        time.sleep(0.1)
    return False
