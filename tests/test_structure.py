"""The code's shape, read from its source: functions that fit a screen, no import cycle, stages that import
no other stage, nothing below the runner importing it, and every stage depending on the code it runs; and the
test lanes keeping a group on one worker."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
import yaml

import models

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("models", "pipeline", "serving")
MAX_LINES = 80  # docs/architecture.md: a function fits a screen


def _modules() -> dict[str, Path]:
    """Every module of the packages by its dotted name (a package by its ``__init__``)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports, at the top or inside a function (``from pkg import mod``
    names the module ``pkg.mod`` when there is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # pipeline.stages.train.main -> pipeline.stages.train
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _is_package_of(a: str, b: str) -> bool:
    return b.startswith(a + ".")


def test_no_function_in_pipeline_or_serving_is_longer_than_a_screen():
    long = []
    for package in ("pipeline", "serving"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"split these into named steps (at most {MAX_LINES} lines each): {long}"


def test_no_import_cycle_between_modules():
    """A package's ``__init__`` importing the modules that register themselves in it is the one loop
    allowed (its submodules' registration), so edges from a package into its own submodules are left out."""
    edges = {a: {b for b in bs if not _is_package_of(a, b)} for a, bs in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(edges):
        if name not in state:
            cycle = visit(name)
            assert cycle is None, " -> ".join(cycle)


def test_the_graph_sees_the_imports_it_checks():
    """The checks above read real edges: a stage's helpers, the runner's split, the registry's task."""
    assert {"pipeline.entry", "pipeline.training.loop"} <= GRAPH["pipeline.stages.train"]
    assert {"pipeline.runner.plan", "pipeline.runner.executors", "pipeline.runner.dvc_lock"} <= \
        GRAPH["pipeline.runner.repro"]
    assert "pipeline.bars" in GRAPH["pipeline.stages.publish"]


@pytest.mark.parametrize("stage", sorted(n for n in MODULES if n.startswith("pipeline.stages.")))
def test_a_stage_imports_no_other_stage_and_nothing_of_the_runner(stage):
    bad = sorted(m for m in GRAPH[stage] if m.startswith(("pipeline.stages.", "pipeline.runner")))
    assert not bad, f"{stage} imports {bad}: move what they share into a helper beside pipeline/stages/"


def test_only_the_runner_imports_the_runner():
    bad = sorted(f"{a} -> {b}" for a, bs in GRAPH.items() for b in bs
                 if b.startswith("pipeline.runner") and not a.startswith("pipeline.runner"))
    assert not bad, bad


def test_only_the_stages_and_the_runner_have_a_main():
    """docs/architecture.md: a stage is a pure function and a thin `main()`; besides the runner's commands, those are
    the only `main()`s of the pipeline (every other module is a library the stages share)."""
    mains = sorted(n for n, path in MODULES.items() if n.startswith("pipeline.") and any(
        isinstance(f, ast.FunctionDef) and f.name == "main" for f in ast.parse(path.read_text()).body))
    assert mains and all(n.startswith(("pipeline.stages.", "pipeline.runner.")) for n in mains), mains


def test_serving_imports_neither_torch_nor_the_pipeline():
    """A serving host installs the base package and the serve extra: no torch, no training stack."""
    for name, path in MODULES.items():
        if not name.startswith("serving"):
            continue
        tree = ast.parse(path.read_text())
        roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
        roots |= {node.module.split(".")[0] for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
        assert not roots & {"torch", "pipeline", "models"}, f"{name} imports {sorted(roots & {'torch', 'pipeline'})}"


def _prepare_only_uses(tree: ast.Module, sub: str) -> list[str]:
    """Functions of a task package's module that import its subfolder ``sub`` and are neither
    ``prepare`` nor a top-level function that only ``prepare`` calls."""
    calls_from: dict[str, set[str]] = {}
    importers = set()
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    for fn in functions:
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                calls_from.setdefault(node.func.id, set()).add(fn.name)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(sub):
                importers.add(fn.name)
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    bad = ["<module>"] if any((getattr(n, "module", "") or "").startswith(sub) for n in top) else []
    return bad + [f for f in sorted(importers) if f != "prepare" and calls_from.get(f, {"?"}) != {"prepare"}]


def test_only_prepare_imports_a_task_folders_subfolders():
    """``task_code@`` leaves a task folder's subfolders (``translation_de_en/corpus``) out of the code
    the later stages depend on: they must reach it through the prepared data alone."""
    checked = 0
    for folder in sorted(p for p in (ROOT / "pipeline" / "tasks").iterdir() if (p / "__init__.py").is_file()):
        for sub in (s for s in folder.iterdir() if (s / "__init__.py").is_file()):
            module = ".".join(sub.relative_to(ROOT).parts)
            for path in folder.glob("*.py"):
                checked += 1
                assert _prepare_only_uses(ast.parse(path.read_text()), module) == [], path
    assert checked >= 1  # translation_de_en/__init__.py against its corpus/


@functools.cache
def _runs_nothing(path: Path) -> bool:
    """An ``__init__.py`` holding a docstring alone: importing it cannot change a result."""
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in ast.parse(path.read_text()).body)


@functools.cache
def _reached(module: str) -> frozenset[str]:
    """The files ``module`` runs: what its imports reach, at the top or inside a function, with the
    packages Python runs on the way (``pipeline.tasks`` for ``pipeline.tasks.sort``)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in MODULES]
        todo += GRAPH[name]
    return frozenset(MODULES[n].relative_to(ROOT).as_posix() for n in seen if not _runs_nothing(MODULES[n]))


def _stage_entries():
    """Each ``python -m`` stage of dvc.yaml, expanded over the params.yaml entries it runs for:
    (stage name, module, deps with ``${key}`` / ``${item.*}`` filled in, the entry's arch or None)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for kind, stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items():
        module = re.search(r"python -m (\S+)", stage["do"]["cmd"])[1]
        for key, item in params[stage["foreach"].strip("${}")].items():
            fill = {"${key}": key, **{f"${{item.{k}}}": str(v) for k, v in item.items()}}
            deps = [re.sub(r"\$\{[^}]+\}", lambda m, fill=fill: fill[m[0]], d if isinstance(d, str) else next(iter(d)))
                    for d in stage["do"].get("deps", [])]
            yield f"{kind}@{key}", module, deps, item.get("arch")


STAGES = list(_stage_entries())
# What every model file imports: a stage that builds a model runs these whatever its architecture.
SHARED_MODEL_FILES = ("models/__init__.py", *(f"models/{name}.py" for name in models.SHARED))
# Files a stage runs that cannot change its outputs, left out of its deps on purpose: the file list of a
# training run's identity (the key a checkpoint is resumed by) is train@'s deps exactly
# (tests/test_train.py), and pipeline/sources.py only computes that list.
NOT_AN_INPUT = {("tune", "pipeline/sources.py"), ("train", "pipeline/sources.py")}


def test_every_stage_depends_on_the_code_it_runs():
    """DVC re-runs a stage when a dependency changes, so a file a stage runs and does not list would
    leave its outputs stale after an edit. A task's code is named by ``data/task_code/<task>.json``
    (the stage must depend on it); a model stage runs its own architecture's file, reached through
    the registry, and no other."""
    missing = {}
    for name, module, deps, arch in STAGES:
        files = _reached(module) | (_reached(f"models.{arch}") if arch else frozenset())
        for path in sorted(files):
            if any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps):
                continue
            if (name.split("@")[0], path) in NOT_AN_INPUT:
                continue
            if path.startswith("pipeline/tasks/") and any(d.startswith("data/task_code/") for d in deps):
                continue
            if arch and path.startswith("models/") and path not in SHARED_MODEL_FILES:
                continue  # another architecture's file (the CTranslate2 engine converts Transformers alone)
            missing.setdefault(path, []).append(name)
        if arch and "models/__init__.py" in files and f"models/{arch}.py" not in deps:
            missing.setdefault(f"models/{arch}.py", []).append(name)
    assert not missing, f"add these to the stages' deps in dvc.yaml: {missing}"


def test_the_stage_check_reads_every_stage():
    kinds = {name.split("@")[0] for name, *_ in STAGES}
    assert kinds == {"task_code", "prepare", "tune", "train", "evaluate", "export", "quantize", "publish", "report"}
    export = next(deps for name, _, deps, _ in STAGES if name == "export@bahdanau")
    assert {"runs/bahdanau/checkpoint", "models/bahdanau.py", "data/task_code/translation_de_en.json"} <= set(export)
    assert "pipeline/tasks/sort.py" in _reached("pipeline.tasks.sort")
    assert {"models/layers.py", "models/decode.py", "models/export.py"} <= _reached("models.bahdanau")


@pytest.mark.xdist_group("lanes")
def test_the_lanes_hand_out_a_group_whole(request):
    """The Makefile's lanes run `-n N --dist loadgroup`: pytest-xdist keeps a group on one worker by a
    suffix on its tests' ids, which a pytest it does not match drops without a word (pytest 9.2 with
    pytest-xdist 3.8: every module fixture built on both workers). Under a lane this test's id has it."""
    loadgroup = getattr(request.config.option, "loadgroup", False)  # set in xdist's workers
    assert request.node.nodeid.endswith("@lanes") == bool(loadgroup), request.node.nodeid
