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
import os
import signal
import sys
import threading
import time
from pathlib import Path

from pipeline.runner.dvc_lock import _Dvc
from pipeline.runner.executors import LocalExecutor, RayExecutor
from pipeline.runner.plan import LOG_DIR, ROOT, Node, Plan, ReproError, _ready, _shrink, plan, priorities

POLL_S = 0.5
STATUS_EVERY_S = 300  # without a terminal (a CI log, nohup): the running stages and ETA this often


def _fmt(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def execute(root: Path, the_plan: Plan, executor, echo=print) -> dict[str, Node]:
    """Run the plan: every changed stage once its upstream is done, failures blocking their downstream."""
    run = _Run(root, the_plan, executor, echo)
    try:
        while run.todo or any(n.state == "running" for n in run.nodes.values()):
            for name in list(run.todo):
                run.try_start(name)
            run.collect_finished()
            run.show_status()
    except KeyboardInterrupt:
        run.interrupted()
        raise
    finally:
        run.close()
    return run.nodes


class _Run:
    """One run of a plan: what is left to start (``todo``, in rank order), what ran, and the progress shown."""

    def __init__(self, root: Path, the_plan: Plan, executor, echo):
        from tqdm import tqdm

        self.root, self.plan, self.executor, self.echo = root, the_plan, executor, echo
        self.nodes, self.order = the_plan.nodes, the_plan.order
        (root / LOG_DIR).mkdir(parents=True, exist_ok=True)
        rank = priorities(the_plan)
        self.todo = sorted(self.order, key=lambda n: -rank[n])  # a stage only starts once its upstream is done
        self.ran_upstream: set[str] = set()  # stages that ran: their dependants must be re-checked
        self.rechecked: set[str] = set()
        self.early: set[str] = set()  # multi-slot stages re-checked before a slot set was free for them
        self.last_status = time.monotonic()
        self.bar = tqdm(total=len(self.order), unit="stage", dynamic_ncols=True, disable=not sys.stderr.isatty(),
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} stages {postfix}")
        self.lock = threading.Lock()
        self.dvc = _Dvc(root)

    def _say(self, line: str) -> None:
        self.bar.write(line) if not self.bar.disable else self.echo(line)

    def _settle(self, name: str, state: str, note: str = "") -> None:
        """``name`` leaves the to-do list without running (up to date, blocked, failed to start)."""
        node = self.nodes[name]
        node.state, node.note = state, note or node.note
        self.todo.remove(name)
        self.bar.update()

    def try_start(self, name: str) -> None:
        """Start ``name`` if its upstream is done, DVC says it changed and a slot is free for it."""
        node = self.nodes[name]
        ups = [self.nodes[u] for u in node.upstream]
        if any(u.state in ("failed", "blocked") for u in ups):
            return self._settle(name, "blocked", "an upstream stage failed")
        if any(u.state in ("waiting", "running") for u in ups):
            return
        try:
            if not self._still_changed(node) or not self.executor.fits(node):
                return
            if not any(_ready(self.nodes[other], self.nodes) for other in self.todo if other != name):
                # Nothing else can start until a running stage ends: this one takes every
                # free slot, so the graph's narrow parts (a long training alone at the
                # end) do not leave cores idle.
                node.slots = max(node.slots, getattr(self.executor, "free", node.slots))
            self.dvc.remove_outs(name)
            node.state, node.started = "running", time.monotonic()
            self.executor.start(node, self.root / LOG_DIR / f"{name.replace('@', '_')}.log")
        except Exception as err:  # noqa: BLE001 -- DVC or Ray refusing one stage fails that stage only
            return self._settle(name, "failed", f"{type(err).__name__}: {err}"[:300])
        self.todo.remove(name)
        self._say(f"started   {name}" + (f"  ({node.threads} thread{'s' * (node.threads > 1)})"
                                           if node.threads else ""))

    def _still_changed(self, node: Node) -> bool:
        """Whether ``node`` is still to run. DVC's status before the run holds unless something upstream
        ran since; then DVC is asked again, once, when a slot is free for it: with its upstream done only
        another `dvc repro` / `attnzoo repro` can change the answer, and asking last sees its work. A
        stage found up to date is settled here; False also while it waits for slots."""
        name = node.name
        if node.changed and not self.executor.fits(node):
            # A stage of several slots (a tune@ with a search space) may wait long for
            # them, behind a training that started meanwhile; if its upstream re-made
            # identical outputs (a prepare@ in a fresh clone) DVC says it is up to date
            # and what depends on it can start now: ask once, early, as well.
            if node.slots > 1 and node.upstream & self.ran_upstream and name not in self.early:
                self.early.add(name)
                node.changed = self.dvc.changed(name)
                if not node.changed:  # settled: its upstream has ended
                    self.rechecked.add(name)
            if node.changed and not _shrink(node, self.todo, self.nodes, self.executor):
                return False
        if node.upstream & self.ran_upstream and name not in self.rechecked:
            self.rechecked.add(name)
            node.changed = self.dvc.changed(name)
        if not node.changed:
            self._settle(name, "up-to-date")
            return False
        return True

    def collect_finished(self) -> None:
        """Record the stages that ended (committed to dvc.lock when they succeeded)."""
        for name, rc, where in self.executor.finished(POLL_S):
            node = self.nodes[name]
            node.seconds, node.where = time.monotonic() - node.started, where
            if rc == 0:
                try:
                    with self.lock:
                        self.dvc.commit(name)
                    node.state = "ran"
                    self.ran_upstream.add(name)
                except Exception as err:  # noqa: BLE001 -- a stage whose outputs DVC refuses is a failure
                    node.state, node.note = "failed", f"dvc commit failed: {err}"
            else:
                node.state, node.note = "failed", f"exit code {rc}"
            mark = "finished" if node.state == "ran" else "FAILED  "
            self._say(f"{mark}  {name}  {_fmt(node.seconds)}  ({where})" + (f": {node.note}" if node.note else ""))
            self.bar.update()

    def eta(self) -> str:
        done = {n.kind: [] for n in self.nodes.values()}
        for n in self.nodes.values():
            if n.state == "ran":
                done[n.kind].append(n.seconds)
        left = 0.0
        for n in self.nodes.values():
            if n.state == "running" or (n.state == "waiting" and (n.changed or n.upstream & self.ran_upstream)):
                same_kind = done[n.kind]
                guess = self.plan.estimates.get(n.name) or (sum(same_kind) / len(same_kind) if same_kind else 30.0)
                left += max(0.0, guess - (time.monotonic() - n.started if n.state == "running" else 0.0))
        jobs = getattr(self.executor, "jobs", 1)
        return f"ETA ~{_fmt(left / max(1, jobs))}"

    def show_status(self) -> None:
        running = [n for n in self.nodes.values() if n.state == "running"]
        status = ", ".join(f"{n.name} {_fmt(time.monotonic() - n.started)}" for n in running[:4]) + f" | {self.eta()}"
        if not self.bar.disable:
            self.bar.set_postfix_str(status, refresh=True)
        elif time.monotonic() - self.last_status >= STATUS_EVERY_S:  # a log, not a terminal: a line now and then
            self.last_status = time.monotonic()
            settled = sum(n.state not in ("waiting", "running") for n in self.nodes.values())
            self.echo(f"[{settled}/{len(self.order)} stages] running {status}")

    def interrupted(self) -> None:
        for node in self.nodes.values():
            if node.state == "running":
                node.state, node.note = "failed", "interrupted"
                node.seconds = time.monotonic() - node.started
            elif node.state == "waiting":
                node.state, node.note = "blocked", "interrupted"

    def close(self) -> None:
        self.executor.stop()
        self.bar.close()
        self.dvc.close()
        _write_summary(self.root, self.nodes)


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
        from pipeline.config import UserError, load_params, repro_resources

        try:
            resources = repro_resources(load_params(root))
        except UserError as err:
            raise ReproError(str(err)) from None
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
