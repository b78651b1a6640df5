"""``attnzoo repro``'s scheduler on its own: slots, threads and failures with real local processes.

DVC's part (status, removing outputs, committing) is replaced by no-ops here; tests/test_repro.py
runs the whole thing against DVC.
"""

from __future__ import annotations

import json

import pytest

from pipeline import repro


@pytest.fixture
def no_dvc(monkeypatch):
    monkeypatch.setattr(repro, "_remove_outs", lambda root, name: None)
    monkeypatch.setattr(repro, "_commit", lambda root, name: None)
    monkeypatch.setattr(repro, "_still_changed", lambda root, name: True)


def _plan(tmp_path, graph: dict[str, set[str]], cmd=None) -> repro.Plan:
    cmd = cmd or {}
    nodes = {name: repro.Node(name, cmd.get(name, f"echo $OMP_NUM_THREADS > {tmp_path}/{name}.threads"),
                              ups, name.split("@")[0], True) for name, ups in graph.items()}
    order = list(graph)  # written dependencies first
    return repro.Plan(nodes, order, {})


def _threads(tmp_path, name: str) -> int:
    return int((tmp_path / f"{name}.threads").read_text())


def test_a_stage_that_nothing_can_run_beside_gets_every_core(tmp_path, no_dvc):
    # prepare -> (train@x, train@y) -> report: the two trainings share the cores, the stages
    # before and after them run alone and get all of them.
    graph = {"prepare@t": set(), "train@x": {"prepare@t"}, "train@y": {"prepare@t"},
             "report@t": {"train@x", "train@y"}}
    executor = repro.LocalExecutor(tmp_path, jobs=2)
    executor.cores = 4
    nodes = repro.execute(tmp_path, _plan(tmp_path, graph), executor, echo=lambda line: None)
    assert {n.state for n in nodes.values()} == {"ran"}
    assert {name: _threads(tmp_path, name) for name in graph} == {
        "prepare@t": 4, "train@x": 2, "train@y": 2, "report@t": 4}
    summary = json.loads((tmp_path / repro.LOG_DIR / "summary.json").read_text())
    assert summary["train@x"]["threads"] == 2 and summary["report@t"]["threads"] == 4
    header = (tmp_path / repro.LOG_DIR / "train_x.log").read_text().splitlines()[0]
    assert header == "# attnzoo repro: train@x, 2 thread(s)"
    assert executor.free == 2  # every slot given back


def test_a_failure_blocks_only_its_downstream(tmp_path, no_dvc):
    graph = {"train@x": set(), "evaluate@x": {"train@x"}, "train@y": set(), "evaluate@y": {"train@y"}}
    executor = repro.LocalExecutor(tmp_path, jobs=2)
    nodes = repro.execute(tmp_path, _plan(tmp_path, graph, {"train@x": "exit 3"}), executor,
                          echo=lambda line: None)
    assert {name: n.state for name, n in nodes.items()} == {
        "train@x": "failed", "evaluate@x": "blocked", "train@y": "ran", "evaluate@y": "ran"}
    assert nodes["train@x"].note == "exit code 3"
    assert "train@x (exit code 3)" in repro.summarize(nodes, 1.0)


def test_a_waiting_tune_whose_data_came_out_identical_does_not_hold_back_its_training(tmp_path, monkeypatch):
    # A fresh clone: prepare@t re-makes its data identically, so tune@x (a search: every slot) is
    # up to date. While train@y holds one of the two slots, tune@x must be found up to date at
    # once and train@x start beside train@y, not after it.
    monkeypatch.setattr(repro, "_remove_outs", lambda root, name: None)
    monkeypatch.setattr(repro, "_commit", lambda root, name: None)
    monkeypatch.setattr(repro, "_still_changed", lambda root, name: name != "tune@x")
    stamp = "python -c 'import time; print(time.time())' >> {}/{}.{}"
    cmd = {"prepare@t": "sleep 0.5", "train@x": stamp.format(tmp_path, "train_x", "start"),
           "train@y": f"{stamp.format(tmp_path, 'train_y', 'start')}; sleep 4; "
                      f"{stamp.format(tmp_path, 'train_y', 'end')}"}
    graph = {"prepare@t": set(), "train@y": set(), "tune@x": {"prepare@t"}, "train@x": {"tune@x"}}
    plan = _plan(tmp_path, graph, cmd)
    plan.nodes["tune@x"].slots = 2
    nodes = repro.execute(tmp_path, plan, repro.LocalExecutor(tmp_path, jobs=2), echo=lambda line: None)
    assert {name: n.state for name, n in nodes.items()} == {
        "prepare@t": "ran", "train@y": "ran", "tune@x": "up-to-date", "train@x": "ran"}
    started_x = float((tmp_path / "train_x.start").read_text())
    assert started_x < float((tmp_path / "train_y.end").read_text()) - 1.0
