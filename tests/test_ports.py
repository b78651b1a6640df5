"""Who listens on a test server's port: the process started, or another one handed the same number."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.ports import free_port, held_by_another, listens, wait_serving

pytestmark = pytest.mark.integration  # starts processes

LISTENER = """
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
print("up", flush=True); time.sleep(60)
"""
# a parent whose child holds the socket, as `mlflow server` runs uvicorn
PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {LISTENER!r}, sys.argv[1]])"


def _start(code: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    return proc


def test_the_listener_is_the_process_or_its_child_and_no_other():
    port = free_port()
    holder = _start(PARENT, port)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert listens(holder.pid, port)  # through its child
        assert not listens(bystander.pid, port)
        assert not listens(holder.pid, free_port())  # nothing listens there
        assert wait_serving(holder, port, lambda: True, 5)
        assert held_by_another(bystander.pid, port) and not held_by_another(holder.pid, port)
        assert not held_by_another(bystander.pid, free_port())  # nobody holds it
    finally:
        for p in (holder, bystander):
            p.kill()
            p.wait()


def test_a_server_that_lost_its_port_is_not_taken_for_ready():
    """``ready()`` answers (another server's port) but the process started never binds it and exits."""
    port = free_port()
    other = _start(LISTENER, port)
    loser = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        assert not wait_serving(loser, port, lambda: True, 30)
        assert loser.poll() == 0  # it returned when the process ended, not at the timeout
    finally:
        other.kill()
        other.wait()
