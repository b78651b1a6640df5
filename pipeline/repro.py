"""``attnzoo repro``: run the DVC pipeline's changed stages in parallel, on this machine or a Ray cluster.

``dvc repro`` runs one stage at a time (DVC has no parallel execution, and two ``dvc repro`` calls
collide on the repository lock). This runner asks DVC for the graph (``Repo.index.graph``) and
for what changed (``Repo.status``, then ``Stage.changed`` once a stage's upstream ran), runs each
ready stage's own command as ``dvc repro`` would (its non-persistent outputs removed first, the
``DVC_ROOT``/``DVC_STAGE`` variables set), and records each finished stage with the steps of DVC's
own ``Repo.commit`` under the repository lock, one at a time, on stages DVC loaded once for the
run (``_Dvc``). ``dvc.lock`` ends exactly as after
``dvc repro``: a plain ``dvc repro`` afterwards has nothing to do. A failed stage stops its
downstream stages, independent branches go on, and a re-run continues from what was committed.

Locally at most ``--jobs`` stages run at once, each with its share of the cores as its thread count
(a ``tune@`` stage with a search space takes every slot, its Ray trials use the cores, or the free
slots when a training holds the others and no stage ranked above it can start). With
``--ray`` each stage is a Ray task asking for the resources ``params.yaml`` ``repro.resources``
gives its kind (a ``train@`` can ask for a GPU; a ``tune@`` asks for no CPU itself and points its
trials at the same cluster), spread over the nodes. Stages run in the repository's own folder, so
every node must see the checkout at the same path (a shared filesystem), as the data stages read
and write there. Not done: DVC's run-cache restore (a stage is re-run rather than restored).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = Path(".dvc") / "tmp" / "repro"  # per-stage logs and the last run's summary (DVC ignores .dvc/tmp)
DEFAULT_RESOURCES = {"default": {"num_cpus": 1}, "tune": {"num_cpus": 0}}
POLL_S = 0.5
STATUS_EVERY_S = 300  # without a terminal (a CI log, nohup): the running stages and ETA this often


class ReproError(RuntimeError):
    """A problem the user can fix before anything runs (an unknown target, no Ray cluster)."""


@dataclass
class Node:
    name: str                  # DVC's addressing: "train@ntm"
    cmd: str
    upstream: set[str]
    kind: str                  # "train", the part before "@"
    changed: bool              # by the status taken before the run
    slots: int = 1             # local slots it occupies
    threads: int = 0           # the threads it was given (local runs)
    state: str = "waiting"     # waiting | running | ran | up-to-date | failed | blocked
    started: float = 0.0
    seconds: float = 0.0
    where: str = ""            # node (Ray) or "local"
    note: str = ""


@dataclass
class Plan:
    nodes: dict[str, Node]
    order: list[str]           # a topological order: dependencies first
    estimates: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------- the graph
def _repo(root: Path):
    from dvc.repo import Repo

    # Wait for the repository lock (`dvc --wait-for-lock`): a user's `dvc status` meanwhile must not
    # fail a finished stage's commit.
    repo = Repo(str(root), _wait_for_lock=True)
    logging.getLogger("dvc").setLevel(logging.WARNING)  # not "Updating lock file" per stage (DVC resets it)
    return repo


def plan(root: Path, targets: list[str], jobs: int, single_item: bool = False) -> Plan:
    """The stages ``targets`` need (all stages when empty; only the targets with ``single_item``),
    their edges, and what DVC says changed."""
    import networkx as nx
    from dvc.exceptions import DvcException

    repo = _repo(root)
    try:
        graph = repo.index.graph  # edges point from a stage to the stages it depends on
        if targets:
            scope = set()
            by_name = {s.addressing: s for s in graph.nodes}
            for target in targets:
                # A stage's name is looked up in the graph; anything else (a dvc.yaml path, an
                # output) DVC resolves, which takes about a second a target.
                for stage in [by_name[target]] if target in by_name else repo.stage.collect(target):
                    scope.add(stage)
                    if not single_item:  # everything it depends on, from the one graph
                        scope.update(nx.descendants(graph, stage))
        else:
            scope = {s for s in graph.nodes if s.cmd}
        with repo.lock:  # the stages' read locks need it
            status = {s.addressing for s in scope if s.status()}  # {} when the stage is up to date
    except DvcException as err:
        raise ReproError(f"DVC cannot read the pipeline: {err}") from None
    finally:
        repo.close()
    params = _params(root)
    nodes = {}
    for stage in scope:
        kind = stage.addressing.split("@", 1)[0]
        ups = {s.addressing for s in graph.successors(stage) if s in scope}
        nodes[stage.addressing] = Node(stage.addressing, stage.cmd if isinstance(stage.cmd, str) else
                                       " && ".join(stage.cmd), ups, kind, stage.addressing in status,
                                       slots=_slots(stage.addressing, params, jobs))
    sub = nx.DiGraph(graph.subgraph(scope)).reverse()  # dependency -> dependant
    order = [s.addressing for s in nx.lexicographical_topological_sort(sub, key=lambda s: s.addressing)]
    return Plan(nodes, order, _estimates(root, nodes))


def priorities(the_plan: Plan) -> dict[str, float]:
    """Each stage's critical path (its estimate plus its longest chain of dependants): ready stages
    start longest-path first, so a tune@ whose training is long does not wait behind short stages."""
    dependants: dict[str, list[str]] = {n: [] for n in the_plan.nodes}
    for node in the_plan.nodes.values():
        for up in node.upstream:
            dependants[up].append(node.name)
    path: dict[str, float] = {}
    for name in reversed(the_plan.order):
        own = the_plan.estimates.get(name, 30.0)
        path[name] = own + max((path[d] for d in dependants[name]), default=0.0)
    return path


def _ready(node: Node, nodes: dict[str, Node]) -> bool:
    """Could start now: every upstream stage has ended well."""
    return all(nodes[u].state in ("ran", "up-to-date") for u in node.upstream)


def _params(root: Path) -> dict:
    return yaml.safe_load((root / "params.yaml").read_text()) or {}


def _slots(name: str, params: dict, jobs: int) -> int:
    """A tune@ stage with a search space runs its trials on every core: it takes all local slots."""
    kind, _, key = name.partition("@")
    if kind == "tune" and (params.get("models", {}).get(key, {}).get("search_space") or {}):
        return jobs
    return 1


def _shrink(node: Node, todo: list[str], nodes: dict[str, Node], executor) -> bool:
    """A multi-slot stage (a tune@ search) that would wait for every slot while a long training holds
    one: unless a stage ranked above it can start instead, it takes the free slots now (its trials
    then run fewer at a time) rather than leave its training, the longest path, waiting behind a
    whole other training. True when it now fits. ``todo`` is in rank order."""
    free = getattr(executor, "free", 0)
    if node.slots <= 1 or free < 1:
        return False
    if any(_ready(nodes[o], nodes) and nodes[o].slots <= free for o in todo[:todo.index(node.name)]):
        return False  # a stage ranked above it goes first
    node.slots = free
    return True


def _estimates(root: Path, nodes: dict[str, Node]) -> dict[str, float]:
    """Seconds each stage is expected to take, for the ETA: a training's last recorded wall time."""
    out = {}
    for name in nodes:
        kind, _, key = name.partition("@")
        summary = root / "runs" / key / "train_summary.json"
        if kind == "train" and summary.exists():
            with contextlib.suppress(ValueError, OSError):
                out[name] = float(json.loads(summary.read_text()).get("train_seconds", 0)) or 0.0
    return out


# ---------------------------------------------------------------------------------------- executors
def _stage_env(root: Path, name: str, threads: int | None) -> dict[str, str]:
    env = {"DVC_ROOT": str(root), "DVC_STAGE": name,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if threads:
        # torch, numpy and onnxruntime read these at start: N stages at once share the cores.
        env.update({v: str(threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
    return env


class LocalExecutor:
    """Each stage a process group of its own (so an interrupt stops the whole stage), logged to a file."""

    where = "local"

    def __init__(self, root: Path, jobs: int):
        self.root, self.jobs, self.free = root, jobs, jobs
        self.cores = os.cpu_count() or 1
        self.procs: dict[str, tuple[subprocess.Popen, Any, int]] = {}

    def fits(self, node: Node) -> bool:
        return node.slots <= self.free

    def start(self, node: Node, log: Path) -> None:
        node.threads = threads = max(1, self.cores * node.slots // self.jobs)
        env = {**os.environ, **_stage_env(self.root, node.name, threads)}
        if node.kind == "tune":
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
        proc = subprocess.Popen(node.cmd, shell=True, cwd=self.root, env=env, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[node.name] = (proc, handle, node.slots)
        self.free -= node.slots

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

        from pipeline.tune import check_address

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


# ---------------------------------------------------------------------------------------- the run
class _LockWrites:
    """How the runner has DVC write ``dvc.lock``: whole, and without parsing it again each time.

    Whole: DVC rewrites ``dvc.lock`` in place (open "w+", then dump). Under ``dvc repro`` nothing
    runs meanwhile; here other stages do, and one reading the file then (``publish@`` records its
    upstream's hashes from it) could find it empty or cut off. Written to a file beside it and
    renamed over it, a reader sees the old file or the new one.

    Not parsed again: each commit is DVC's round-trip parse of the whole lock file (2.3 s for 178
    stages here), an update of one entry, and a dump (1.5 s), on the runner's one thread while a
    slot waits for its next stage. When the file still holds exactly the text last written, the
    structure that was dumped is what parsing would give, so it is handed back instead; DVC's
    own dumper still writes the result, byte for byte what ``dvc commit`` writes (tested)."""

    def __init__(self):
        self.path = self.text = self.data = None

    @contextlib.contextmanager
    def __call__(self):
        from dvc.utils.serialize import _common, _yaml

        dump, parse = _common._dump_data, _yaml.parse_yaml_for_update

        def atomic(path, data, dumper, fs=None, **dumper_args):
            self.path = None  # a dump that fails leaves no structure that claims the file
            tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
            dump(tmp, data, dumper, fs=fs, **dumper_args)
            text = Path(tmp).read_text(encoding="utf-8")
            os.replace(tmp, os.fspath(path))
            self.path, self.text, self.data = os.path.abspath(path), text, data

        def parsed(text, path):
            if self.path == os.path.abspath(path) and text == self.text:
                # handed out to be updated: claimed again only once its dump is written
                self.path = None
                return self.data
            return parse(text, path)

        _common._dump_data, _yaml.parse_yaml_for_update = atomic, parsed
        try:
            yield
        finally:
            _common._dump_data, _yaml.parse_yaml_for_update = dump, parse


class _Dvc:
    """One DVC repository and its stages, loaded once for a run, as ``dvc repro`` holds them.

    Collecting a stage parses ``dvc.yaml`` and ``dvc.lock`` again (about 2.4 s each time here with
    ~140 stages), and a run asks three times a stage (changed? remove outputs, commit): per stage
    that cost more than a tiny stage itself. A stage object keeps its ``dvc.lock`` entry in memory,
    updated by its own commit, so one load serves the whole run. Each call holds the repository lock
    only while it works, so a user's ``dvc status`` meanwhile waits a moment instead of failing."""

    def __init__(self, root: Path):
        self.root, self.repo, self.stages = root, None, {}
        self.lock_writes = _LockWrites()

    def stage(self, name: str):
        if self.repo is None:
            self.repo = _repo(self.root)
            self.stages = {s.addressing: s for s in self.repo.index.stages}
        return self.stages[name]

    def changed(self, name: str) -> bool:
        stage = self.stage(name)
        with self.repo.lock:  # the stage's read/write locks need the repository lock held
            return stage.changed()

    def remove_outs(self, name: str) -> None:
        """What ``dvc repro`` does before running a stage: delete its outputs that are not ``persist``."""
        stage = self.stage(name)
        with self.repo.lock:
            stage.remove_outs(ignore_remove=False, force=False)

    def commit(self, name: str) -> None:
        """Record a finished stage in dvc.lock (and its outputs in the cache) as ``dvc repro`` does:
        the steps of DVC's ``Repo.commit(name, force=True)`` on the loaded stage."""
        stage = self.stage(name)
        with self.repo.lock, self.lock_writes():
            stage.save()
            stage.commit(relink=True)
            stage.dvcfile.dump_stages([stage], update_pipeline=False)

    def close(self) -> None:
        if self.repo is not None:
            self.repo.close()
            self.repo = None


def _fmt(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def execute(root: Path, the_plan: Plan, executor, echo=print) -> dict[str, Node]:
    """Run the plan: every changed stage once its upstream is done, failures blocking their downstream."""
    from tqdm import tqdm

    nodes, order = the_plan.nodes, the_plan.order
    (root / LOG_DIR).mkdir(parents=True, exist_ok=True)
    rank = priorities(the_plan)
    todo = sorted(order, key=lambda n: -rank[n])  # a stage only starts once its upstream is done
    ran_upstream: set[str] = set()  # stages that ran: their dependants must be re-checked
    rechecked: set[str] = set()
    early: set[str] = set()  # multi-slot stages re-checked before a slot set was free for them
    last_status = time.monotonic()
    bar = tqdm(total=len(order), unit="stage", dynamic_ncols=True, disable=not sys.stderr.isatty(),
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} stages {postfix}")
    lock = threading.Lock()
    dvc = _Dvc(root)

    def eta() -> str:
        done = {n.kind: [] for n in nodes.values()}
        for n in nodes.values():
            if n.state == "ran":
                done[n.kind].append(n.seconds)
        left = 0.0
        for n in nodes.values():
            if n.state == "running" or (n.state == "waiting" and (n.changed or n.upstream & ran_upstream)):
                same_kind = done[n.kind]
                guess = the_plan.estimates.get(n.name) or (sum(same_kind) / len(same_kind) if same_kind else 30.0)
                left += max(0.0, guess - (time.monotonic() - n.started if n.state == "running" else 0.0))
        jobs = getattr(executor, "jobs", 1)
        return f"ETA ~{_fmt(left / max(1, jobs))}"

    try:
        while todo or any(n.state == "running" for n in nodes.values()):
            for name in list(todo):
                node = nodes[name]
                ups = [nodes[u] for u in node.upstream]
                if any(u.state in ("failed", "blocked") for u in ups):
                    node.state, node.note = "blocked", "an upstream stage failed"
                    todo.remove(name)
                    bar.update()
                    continue
                if any(u.state in ("waiting", "running") for u in ups):
                    continue
                # DVC's status before the run holds unless something upstream ran since; then ask
                # DVC again, once, when a slot is free for it: with its upstream done only another
                # `dvc repro` / `attnzoo repro` can change the answer, and asking last sees its work.
                try:
                    if node.changed and not executor.fits(node):
                        # A stage of several slots (a tune@ with a search space) may wait long for
                        # them, behind a training that started meanwhile; if its upstream re-made
                        # identical outputs (a prepare@ in a fresh clone) DVC says it is up to date
                        # and what depends on it can start now: ask once, early, as well.
                        if node.slots > 1 and node.upstream & ran_upstream and name not in early:
                            early.add(name)
                            node.changed = dvc.changed(name)
                            if not node.changed:  # settled: its upstream has ended
                                rechecked.add(name)
                        if node.changed and not _shrink(node, todo, nodes, executor):
                            continue
                    if node.upstream & ran_upstream and name not in rechecked:
                        rechecked.add(name)
                        node.changed = dvc.changed(name)
                    if not node.changed:
                        node.state = "up-to-date"
                        todo.remove(name)
                        bar.update()
                        continue
                    if not executor.fits(node):  # found changed only now
                        continue
                    if not any(_ready(nodes[other], nodes) for other in todo if other != name):
                        # Nothing else can start until a running stage ends: this one takes every
                        # free slot, so the graph's narrow parts (a long training alone at the
                        # end) do not leave cores idle.
                        node.slots = max(node.slots, getattr(executor, "free", node.slots))
                    dvc.remove_outs(name)
                    node.state, node.started = "running", time.monotonic()
                    executor.start(node, root / LOG_DIR / f"{name.replace('@', '_')}.log")
                except Exception as err:  # noqa: BLE001 -- DVC or Ray refusing one stage fails that stage only
                    node.state, node.note = "failed", f"{type(err).__name__}: {err}"[:300]
                    todo.remove(name)
                    bar.update()
                    continue
                todo.remove(name)
                line = f"started   {name}" + (f"  ({node.threads} thread{'s' * (node.threads > 1)})"
                                                 if node.threads else "")
                bar.write(line) if not bar.disable else echo(line)
            for name, rc, where in executor.finished(POLL_S):
                node = nodes[name]
                node.seconds, node.where = time.monotonic() - node.started, where
                if rc == 0:
                    try:
                        with lock:
                            dvc.commit(name)
                        node.state = "ran"
                        ran_upstream.add(name)
                    except Exception as err:  # noqa: BLE001 -- a stage whose outputs DVC refuses is a failure
                        node.state, node.note = "failed", f"dvc commit failed: {err}"
                else:
                    node.state, node.note = "failed", f"exit code {rc}"
                mark = "finished" if node.state == "ran" else "FAILED  "
                line = f"{mark}  {name}  {_fmt(node.seconds)}  ({where})" + (f": {node.note}" if node.note else "")
                bar.write(line) if not bar.disable else echo(line)
                bar.update()
            running = [n for n in nodes.values() if n.state == "running"]
            status = ", ".join(f"{n.name} {_fmt(time.monotonic() - n.started)}" for n in running[:4]) + f" | {eta()}"
            if not bar.disable:
                bar.set_postfix_str(status, refresh=True)
            elif time.monotonic() - last_status >= STATUS_EVERY_S:  # a log, not a terminal: a line now and then
                last_status = time.monotonic()
                settled = sum(n.state not in ("waiting", "running") for n in nodes.values())
                echo(f"[{settled}/{len(order)} stages] running {status}")
    except KeyboardInterrupt:
        for node in nodes.values():
            if node.state == "running":
                node.state, node.note = "failed", "interrupted"
                node.seconds = time.monotonic() - node.started
            elif node.state == "waiting":
                node.state, node.note = "blocked", "interrupted"
        raise
    finally:
        executor.stop()
        bar.close()
        dvc.close()
        _write_summary(root, nodes)
    return nodes


def _write_summary(root: Path, nodes: dict[str, Node]) -> None:
    rows = {n.name: {"state": n.state, "seconds": round(n.seconds, 1), "where": n.where, "note": n.note,
                     **({"threads": n.threads} if n.threads else {})} for n in nodes.values()}
    (root / LOG_DIR / "summary.json").write_text(json.dumps(rows, indent=1, sort_keys=True))


def summarize(nodes: dict[str, Node], wall: float) -> str:
    by_state: dict[str, list[Node]] = {}
    for node in nodes.values():
        by_state.setdefault(node.state, []).append(node)
    ran = by_state.get("ran", [])
    kinds: dict[str, float] = {}
    for node in ran:
        kinds[node.kind] = kinds.get(node.kind, 0.0) + node.seconds
    lines = [f"{len(ran)} stages ran, {len(by_state.get('up-to-date', []))} were up to date, "
             f"{len(by_state.get('failed', []))} failed, {len(by_state.get('blocked', []))} not run; "
             f"wall time {_fmt(wall)}"]
    if kinds:
        lines.append("stage time by kind: " + ", ".join(f"{k} {_fmt(s)}" for k, s in sorted(kinds.items())))
    for node in sorted(by_state.get("failed", []), key=lambda n: n.name):
        log = LOG_DIR / f"{node.name.replace('@', '_')}.log"
        lines.append(f"  failed: {node.name} ({node.note}); its output is in {log}")
    blocked = sorted(n.name for n in by_state.get("blocked", []))
    if blocked:
        lines.append(f"  not run ({len(blocked)}): " + ", ".join(blocked[:12]) + (" ..." if len(blocked) > 12 else ""))
    if by_state.get("failed") or blocked:
        lines.append("fix the failure and run `attnzoo repro` again: what finished is recorded in dvc.lock")
    return "\n".join(lines)


def _init_tracking(root: Path) -> None:
    """Create (migrate) a SQLite MLflow store once, here: stages creating it at once collide."""
    from pipeline.tracking import tracking_uri

    uri = tracking_uri(root)
    if uri.startswith("sqlite:"):
        from mlflow.tracking import MlflowClient

        MlflowClient(uri).search_experiments(max_results=1)


@contextlib.contextmanager
def one_runner(root: Path):
    """Hold the repository's runner lock for a run: a second ``attnzoo repro`` in the same repository
    stops at once with one sentence instead of running stages beside the first (two runs would write
    the same outputs and ``dvc.lock``). The kernel drops the lock with the process, however it ends
    (SIGKILL included), so a crashed run never blocks the next one."""
    import fcntl

    path = root / LOG_DIR.parent / "repro.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.seek(0)
            who = held.read().strip() or "another process"
            raise ReproError(f"another attnzoo repro ({who}) is running in {root}; wait for it to end, or stop "
                             "it, and run this one again: it goes on from what the first one finished") from None
        held.seek(0)
        held.truncate()
        held.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}")
        held.flush()
        yield


def repro(root: Path, targets: list[str], jobs: int, ray_address: str | None, dry: bool = False,
          echo=print, single_item: bool = False) -> dict[str, Node]:
    if dry:
        return _repro(root, targets, jobs, ray_address, dry, echo, single_item)
    with one_runner(root):
        return _repro(root, targets, jobs, ray_address, dry, echo, single_item)


def _repro(root: Path, targets: list[str], jobs: int, ray_address: str | None, dry: bool,
           echo, single_item: bool) -> dict[str, Node]:
    started = time.monotonic()
    the_plan = plan(root, targets, jobs, single_item)
    todo = [n for n in the_plan.order if the_plan.nodes[n].changed]
    if dry:
        for name in todo:
            echo(f"would run {name} (and then re-check what depends on it)")
        echo(f"{len(todo)} of {len(the_plan.order)} stages changed")
        return the_plan.nodes
    if not todo:
        echo(f"Data and pipelines are up to date ({len(the_plan.order)} stages).")
        return the_plan.nodes
    _init_tracking(root)
    if ray_address:
        resources = {**DEFAULT_RESOURCES, **(_params(root).get("repro", {}) or {}).get("resources", {})}
        executor = RayExecutor(root, ray_address, resources)
    else:
        executor = LocalExecutor(root, jobs)
    echo(f"{len(todo)} of {len(the_plan.order)} stages changed; running them "
         + (f"on the {executor.where}" if ray_address else f"{jobs} at a time here") + f"; logs in {LOG_DIR}/")
    try:
        nodes = execute(root, the_plan, executor, echo)
    except KeyboardInterrupt:
        echo(summarize(the_plan.nodes, time.monotonic() - started))
        raise
    echo(summarize(nodes, time.monotonic() - started))
    return nodes


def _run_profile(args: argparse.Namespace) -> int:
    from pipeline import profiles

    try:
        return profiles.run(args.profile, args.targets, args.jobs, args.workdir)
    except profiles.ProfileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: run the same command again to go on", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Run the DVC pipeline's changed stages in parallel (locally or on a Ray cluster) and "
                    "record each in dvc.lock as `dvc repro` does.")
    parser.add_argument("targets", nargs="*", metavar="TARGET",
                        help="stages to bring up to date with everything they depend on (e.g. train@ntm "
                             "or publish@bahdanau); default: the whole pipeline")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                        help="stages running at once on this machine, each with its share of the cores as "
                             "threads (default: the number of cores, %(default)s)")
    parser.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                        help="run each stage as a Ray task on the cluster at ADDRESS (default: auto, the "
                             "cluster `ray start` joined this machine to); the checkout must be at the "
                             "same path on every node")
    parser.add_argument("-s", "--single-item", action="store_true",
                        help="only the TARGETs themselves, not the stages they depend on (as dvc repro -s)")
    parser.add_argument("-n", "--dry", action="store_true", help="list the changed stages and run nothing")
    parser.add_argument("--profile", metavar="NAME",
                        help="run with profiles/NAME.yaml applied to params.yaml (e.g. smoke: tiny data and "
                             "models, every stage in minutes), in a scratch copy of the repository; the "
                             "checkout and its dvc.lock stay untouched")
    parser.add_argument("--workdir", type=Path, metavar="DIR",
                        help="with --profile: the scratch copy (default $ATTNZOO_CACHE/profiles/NAME, "
                             "~/.cache/attnzoo/profiles/NAME); a second run there goes on from the first")
    args = parser.parse_args(argv)

    def interrupted(signum, frame):  # a scheduler's or a terminal's SIGTERM stops the stages as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    # A runner started in the background of a script (nohup ... &) inherits SIGINT ignored, and
    # `kill -INT` would do nothing: Ctrl-C's signal stops it wherever it was started.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give at least 1")
    if args.single_item and not args.targets:
        parser.error("--single-item needs the TARGET stages to run")
    if args.profile:
        if args.ray or args.dry or args.single_item:
            parser.error("--profile runs on this machine: give it without --ray, --dry and --single-item")
        raise SystemExit(_run_profile(args))
    if args.workdir:
        parser.error("--workdir goes with --profile")
    try:
        nodes = repro(Path.cwd() if (Path.cwd() / "dvc.yaml").exists() else ROOT, args.targets, args.jobs,
                      args.ray, args.dry, single_item=args.single_item)
    except ReproError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted: finished stages are recorded in dvc.lock; run `attnzoo repro` again to go on",
              file=sys.stderr)
        raise SystemExit(130) from None
    if any(n.state in ("failed", "blocked") for n in nodes.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
