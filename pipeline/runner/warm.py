"""The warm starter: local stages forked from a Python process that has already imported their libraries.

A stage run as ``python -m pipeline.stages.<kind> <key>`` spends 4-7 s of a core importing torch,
MLflow with its SQL store, matplotlib and ONNX before its first line of work, and a pipeline of tiny
models is mostly such starts. ``LocalExecutor`` instead asks a starter to fork a child per stage.
The child is what the command would have been: its own session (the runner's stop signals reach its
whole group), the stage's environment, working folder, ``sys.argv`` and log as stdout and stderr,
the module run as ``__main__`` (``runpy``, as ``python -m`` does) and the exit ``python -m`` makes
(its status, threads joined, atexit handlers, output flushed) without the interpreter's teardown.

There is one starter per distinct stage environment (per thread count), started with that
environment, so torch, OpenMP, MKL and OpenBLAS read the same thread variables at import as in a
fresh process. A starter only imports modules: it runs no torch op and touches no GPU, so no thread
pool of its own or CUDA context exists to be copied by a fork. The native threads its imports do start
(OpenBLAS's pool, the background thread of pyarrow's jemalloc) are their libraries' to stop and
restart around a fork (both register ``pthread_atfork`` handlers); ``main`` checks that no Python
thread runs.

Protocol, one JSON object per line: runner to starter ``{"id", "argv", "env", "cwd", "log"}``
(``argv``: the module and its arguments); starter to runner ``{"id", "pid"}`` once forked and
``{"id", "rc"}`` (``Popen.returncode``'s convention) when the child has exited. A starter exits when
its stdin closes; its running children finish as orphans, as ``start_new_session`` children do.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline.entry import exit_after

# What the stages import before their first line of work (``python -X importtime -m pipeline.stages.X``).
# Not onnxruntime: its import starts a native thread of its own (0.3 s saved is not worth the doubt).
PRELOAD = ("numpy", "yaml", "torch", "torch._dynamo", "torch.onnx", "onnx", "onnxscript", "safetensors",
           "accelerate", "matplotlib.pyplot", "mlflow", "mlflow.store.tracking.sqlalchemy_store",
           "mlflow.store.model_registry.sqlalchemy_store")
SHELL_SYNTAX = set(";&|<>$`\\\"'*?~(){}[]#\n")


def forkable(cmd: str) -> list[str] | None:
    """``[module, *args]`` of a plain ``python -m pipeline.stages.<kind> ...`` command; None for anything else."""
    argv = cmd.split()
    if SHELL_SYNTAX & set(cmd) or len(argv) < 3 or argv[:2] != ["python", "-m"]:
        return None
    return argv[2:] if argv[2].startswith("pipeline.stages.") else None


class Starter:
    """The runner's end of one starter process."""

    def __init__(self, root: Path, env: dict[str, str], log: Path):
        python = shutil.which("python", path=env.get("PATH")) or sys.executable  # the one the shell would run
        with log.open("ab") as err:
            self.proc = subprocess.Popen([python, "-m", "pipeline.runner.warm"], cwd=root, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        self.root, self.log = root, log
        self.children: dict[int, Forked] = {}
        self.pending, self.next_id, self.alive = b"", 0, True

    def spawn(self, argv: list[str], env: dict[str, str], log: Path) -> Forked:
        """Fork a child running ``python -m argv`` with ``env``, appending to ``log``; returns once it has a pid."""
        self.next_id += 1
        child = self.children[self.next_id] = Forked(self, self.next_id, log)
        request = {"id": child.id, "argv": argv, "env": env, "cwd": str(self.root), "log": str(log)}
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            self.alive = False
        while child.pid is None and self.alive:  # the first request waits for the imports, a later one for a fork
            self.pump(1.0)
        if child.pid is None:
            raise RuntimeError(f"the warm starter stopped before starting a stage: see {self.log}")
        return child

    def pump(self, timeout: float) -> None:
        """Read what the starter has said within ``timeout`` seconds."""
        if not self.alive:
            time.sleep(timeout)
            return
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            return
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            self.alive = False
            return
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        for line in lines:
            said = json.loads(line)
            child = self.children[said["id"]]
            if "pid" in said:
                child.pid = said["pid"]
            else:
                child.returncode = said["rc"]
                del self.children[said["id"]]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Forked:
    """A forked stage as ``subprocess.Popen`` shows one: ``pid``, ``poll()``, ``wait()``, ``returncode``."""

    def __init__(self, starter: Starter, id_: int, log: Path):
        self.starter, self.id, self.log = starter, id_, log
        self.pid: int | None = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.starter.pump(0)
        if self.returncode is None and not self.starter.alive and not _exists(self.pid):
            # The starter died before reporting this child, which has exited since: its status is lost.
            with self.log.open("a") as log:
                print("attnzoo repro: the warm starter died; this stage's exit status is unknown", file=log)
            self.returncode = 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"stage {self.id}", timeout)
            self.starter.pump(0.2)
        return self.returncode


def _exists(pid: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, TypeError):
        return False
    except PermissionError:
        return True
    return True


# ---- the starter process ----

def _reply(**said) -> None:
    os.write(1, json.dumps(said).encode() + b"\n")


def _serve() -> None:
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (request id, pid)
    pending = b""
    while True:
        for fd in select.select([0, *children], [], [])[0]:
            if fd != 0:
                rid, pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _reply(id=rid, rc=os.waitstatus_to_exitcode(status))
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return  # the runner has gone
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _become(request, children)  # only leaves by exiting
                try:
                    children[os.pidfd_open(pid)] = (request["id"], pid)
                except OSError:  # unwatchable: stopped before its pid is reported, so the runner runs it itself
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    raise
                _reply(id=request["id"], pid=pid)


def _become(request: dict, children: dict[int, tuple[int, int]]) -> None:
    """In the forked child: turn into ``python -m <argv>`` as the shell would have started it."""
    for fd in children:
        os.close(fd)
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, onto in ((null, 0), (log, 1), (log, 2)):
        os.dup2(fd, onto)
    os.close(log), os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _name(request["env"].get("DVC_STAGE") or request["argv"][0])
    module, *args = request["argv"]
    sys.argv = ["-m", *args]  # runpy puts the module's file first, as `python -m` does
    exit_after(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))


def _name(title: str) -> None:
    """The process name `ps -o comm` and `top` show (15 bytes): the stage, rather than the starter's."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the runner's to handle
    try:  # a child is watched through its pidfd (Linux 5.3+); without one, stages start through the shell
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as err:
        sys.exit(f"the warm starter needs os.pidfd_open (Linux 5.3 or later): {err}")
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    if threading.active_count() != 1:  # a fork copies only the forking thread: that one's work would be lost
        sys.exit(f"the warm starter runs {threading.enumerate()} after its imports; it cannot fork them")
    # What the imports built stays out of the collector's reach: a child's collections neither walk it
    # nor write to its pages.
    gc.freeze()
    sys.stdout.flush()
    _serve()


if __name__ == "__main__":
    main()
