"""The runner's plan: DVC's stage graph as nodes with what changed, each stage's slots, and the order
that starts the longest chains of work first."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipeline.runner.dvc_lock import ParamsReads, open_repo

ROOT = Path(__file__).resolve().parents[2]  # the checkout: pipeline/runner/ is two levels down
LOG_DIR = Path(".dvc") / "tmp" / "repro"  # per-stage logs and the last run's summary (DVC ignores .dvc/tmp)


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
    searches: bool = False     # a tune@ with a search space: it starts Ray (the others write {} at once)
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


def plan(root: Path, targets: list[str], jobs: int, single_item: bool = False) -> Plan:
    """The stages ``targets`` need (all stages when empty; only the targets with ``single_item``),
    their edges, and what DVC says changed."""
    import networkx as nx
    from dvc.exceptions import DvcException

    repo = open_repo(root)
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
        # the stages' read locks need the repository lock; params.yaml is parsed once, not once a stage
        with repo.lock, ParamsReads()():
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
        searches = _searches(stage.addressing, params)
        nodes[stage.addressing] = Node(stage.addressing, stage.cmd if isinstance(stage.cmd, str) else
                                       " && ".join(stage.cmd), ups, kind, stage.addressing in status,
                                       slots=jobs if searches else 1, searches=searches)
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


def _searches(name: str, params: dict) -> bool:
    """A tune@ stage with a search space: it runs its trials on every core (all local slots)."""
    kind, _, key = name.partition("@")
    return kind == "tune" and bool(params.get("models", {}).get(key, {}).get("search_space"))


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
