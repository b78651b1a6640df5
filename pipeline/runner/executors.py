"""Where stages run: ``LocalExecutor`` (subprocesses on this machine, each with its share of the cores) or
``RayExecutor`` (one Ray task per stage, spread over a cluster's nodes)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.runner.plan import Node, ReproError
from pipeline.runner.warm import Starter, forkable


def _stage_env(root: Path, name: str, threads: int | None) -> dict[str, str]:
    env = {"DVC_ROOT": str(root), "DVC_STAGE": name,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if threads:
        # torch, numpy and onnxruntime read these at start: N stages at once share the cores.
        env.update({v: str(threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
    return env


class LocalExecutor:
    """Each stage a process group of its own (so an interrupt stops the whole stage), logged to a file.

    A ``python -m pipeline.stages.*`` command is forked by a warm starter (``warm.py``) with the stage's
    environment, skipping its seconds of imports; any other command, and a ``tune@`` that searches (its
    Ray trials get their own thread variables), runs through the shell.
    """

    where = "local"

    def __init__(self, root: Path, jobs: int):
        self.root, self.jobs, self.free = root, jobs, jobs
        self.cores = os.cpu_count() or 1
        self.procs: dict[str, tuple[Any, Any, int]] = {}  # a subprocess.Popen or a warm.Forked
        self.starters: dict[tuple, Starter | None] = {}  # by environment; None: it failed, use the shell

    def fits(self, node: Node) -> bool:
        return node.slots <= self.free

    def start(self, node: Node, log: Path) -> None:
        node.threads = threads = max(1, self.cores * node.slots // self.jobs)
        env = {**os.environ, **_stage_env(self.root, node.name, threads)}
        if node.searches:
            # The local Ray a tune@ starts counts the machine's cores, not its share: with fewer
            # slots than jobs its trials would run beside the other stages on cores they hold.
            env["RAY_OVERRIDE_RESOURCES"] = json.dumps({"CPU": threads})
            # Its threads are its trials' to set: Ray gives each trial OMP_NUM_THREADS = its CPUs
            # when the variable is unset. Inherited, two trials of a two-slot tune ran two threads
            # each on two cores: a bahdanau trial step took 4 s instead of about 0.7 s.
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
                env.pop(var, None)
        handle = log.open("wb")
        handle.write(f"# attnzoo repro: {node.name}, {threads} thread(s)\n".encode())
        handle.flush()
        argv = forkable(node.cmd) if not node.searches else None
        proc = self._fork(argv, env, log) if argv else None
        if proc is None:
            proc = subprocess.Popen(node.cmd, shell=True, cwd=self.root, env=env, stdout=handle,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[node.name] = (proc, handle, node.slots)
        self.free -= node.slots

    def _fork(self, argv: list[str], env: dict[str, str], log: Path):
        """The stage forked by the starter for its environment (started on first use), or None."""
        shared = {k: v for k, v in env.items() if k != "DVC_STAGE"}  # what every stage of a thread count has
        key = tuple(sorted(shared.items()))
        if key not in self.starters:
            self.starters[key] = Starter(self.root, shared, log.parent / "warm_starter.log")
        starter = self.starters[key]
        if starter is None:
            return None
        try:
            return starter.spawn(argv, env, log)
        except RuntimeError:  # it could not start (its log says why): the shell it is, from now on
            self.starters[key] = None
            return None

    def finished(self, timeout: float) -> list[tuple[str, int, str]]:
        deadline = time.monotonic() + timeout
        while True:
            done = [(n, p.returncode) for n, (p, _, _) in self.procs.items() if p.poll() is not None]
            if done or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        for name, _ in done:
            _, handle, slots = self.procs.pop(name)
            handle.close()
            self.free += slots
        return [(n, rc, "local") for n, rc in done]

    def stop(self) -> None:
        for proc, _, _ in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, handle, _ in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            handle.close()
        self.procs.clear()
        for starter in self.starters.values():
            if starter is not None:
                starter.close()
        self.starters.clear()


def _run_on_node(cmd: str, root: str, env: dict, log: str) -> tuple[int, str]:
    """A Ray task: run one stage's command in the (shared) checkout on whichever node Ray chose."""
    import ctypes
    import socket

    import ray

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
    full = {**os.environ, **env}
    if cpus >= 1:
        full.update({v: str(int(cpus)) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})

    def die_with_worker():  # a cancelled task's worker is killed: its stage must not live on
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_DEATHSIG

    with open(log, "wb") as handle:
        rc = subprocess.call(cmd, shell=True, cwd=root, env=full, stdout=handle, stderr=subprocess.STDOUT,
                             preexec_fn=die_with_worker)
    return rc, f"{socket.gethostname()}/{ray.get_runtime_context().get_node_id()[:8]}"


class RayExecutor:
    """Each stage a Ray task (SPREAD over the nodes) with its kind's resources from params.yaml."""

    def __init__(self, root: Path, address: str, resources: dict[str, dict]):
        import ray

        from pipeline.cluster import check_address

        try:
            check_address(address)
        except RuntimeError as err:
            raise ReproError(str(err)) from None
        from pipeline.tracking import tracking_uri

        uri = tracking_uri(root)
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False,
                     runtime_env={"env_vars": {"PYTHONPATH": str(root), "MLFLOW_TRACKING_URI": uri}})
        except ConnectionError as err:
            raise ReproError(f"--ray {address}: {err}; start a cluster with `ray start --head` "
                             "(docs/cluster.md) or leave out --ray to run here") from None
        self.ray, self.root, self.resources = ray, root, resources
        self.gcs = ray.get_runtime_context().gcs_address
        self.remote = ray.remote(max_retries=0)(_run_on_node)
        self.refs: dict[Any, str] = {}
        self.where = f"Ray cluster at {self.gcs} ({len([n for n in ray.nodes() if n['Alive']])} nodes)"
        self.jobs = max(1, int(ray.cluster_resources().get("CPU", 1)))  # for the ETA: stages at once, roughly

    def fits(self, node: Node) -> bool:
        return True  # Ray queues a task until a node has its resources

    def start(self, node: Node, log: Path) -> None:
        opts = {"num_cpus": 1, **self.resources.get("default", {}), **self.resources.get(node.kind, {})}
        env = _stage_env(self.root, node.name, None)
        if node.kind == "tune":  # its trials join this cluster instead of starting a local Ray
            env["RAY_ADDRESS"] = self.gcs
        ref = self.remote.options(scheduling_strategy="SPREAD", **opts).remote(
            node.cmd, str(self.root), env, str(log))
        self.refs[ref] = node.name

    def finished(self, timeout: float) -> list[tuple[str, int, str]]:
        if not self.refs:
            time.sleep(timeout)
            return []
        ready, _ = self.ray.wait(list(self.refs), num_returns=len(self.refs), timeout=timeout)
        out = []
        for ref in ready:
            name = self.refs.pop(ref)
            try:
                rc, where = self.ray.get(ref)
            except self.ray.exceptions.RayError as err:  # the node died, the task was cancelled
                rc, where = 1, f"lost: {str(err).strip().splitlines()[0][:200]}"
            out.append((name, rc, where))
        return out

    def stop(self) -> None:
        for ref in list(self.refs):
            with contextlib.suppress(Exception):
                self.ray.cancel(ref, force=True)
        self.refs.clear()
        self.ray.shutdown()
