"""``attnzoo repro``'s scheduler on its own: slots, threads and failures with real local processes.

DVC's part (status, removing outputs, committing) is replaced by no-ops here; tests/test_pipeline_smoke.py
runs the whole thing against DVC.
"""

from __future__ import annotations

import json
import re

import pytest

from pipeline.runner import dvc_lock, repro


@pytest.fixture
def no_dvc(monkeypatch):
    monkeypatch.setattr(repro._Dvc, "remove_outs", lambda self, name: None)
    monkeypatch.setattr(repro._Dvc, "commit", lambda self, name: None)
    monkeypatch.setattr(repro._Dvc, "changed", lambda self, name: True)


def _plan(tmp_path, graph: dict[str, set[str]], cmd=None) -> repro.Plan:
    cmd = cmd or {}
    nodes = {name: repro.Node(name, cmd.get(name, f"echo $OMP_NUM_THREADS > {tmp_path}/{name}.threads"),
                              ups, name.split("@")[0], True) for name, ups in graph.items()}
    order = list(graph)  # written dependencies first
    return repro.Plan(nodes, order, {})


def _threads(tmp_path, name: str) -> int:
    return int((tmp_path / f"{name}.threads").read_text())


@pytest.mark.integration
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


@pytest.mark.integration
def test_a_failure_blocks_only_its_downstream(tmp_path, no_dvc):
    graph = {"train@x": set(), "evaluate@x": {"train@x"}, "train@y": set(), "evaluate@y": {"train@y"}}
    executor = repro.LocalExecutor(tmp_path, jobs=2)
    nodes = repro.execute(tmp_path, _plan(tmp_path, graph, {"train@x": "exit 3"}), executor,
                          echo=lambda line: None)
    assert {name: n.state for name, n in nodes.items()} == {
        "train@x": "failed", "evaluate@x": "blocked", "train@y": "ran", "evaluate@y": "ran"}
    assert nodes["train@x"].note == "exit code 3"
    assert "train@x (exit code 3)" in repro.summarize(nodes, 1.0)


@pytest.mark.integration
def test_a_waiting_tune_whose_data_came_out_identical_does_not_hold_back_its_training(tmp_path, monkeypatch):
    # A fresh clone: prepare@t re-makes its data identically, so tune@x (a search: every slot) is
    # up to date. While train@y holds one of the two slots, tune@x must be found up to date at
    # once and train@x start beside train@y, not after it.
    monkeypatch.setattr(repro._Dvc, "remove_outs", lambda self, name: None)
    monkeypatch.setattr(repro._Dvc, "commit", lambda self, name: None)
    monkeypatch.setattr(repro._Dvc, "changed", lambda self, name: name != "tune@x")
    stamp = "python -c 'import time; print(time.time())' >> {}/{}.{}"
    cmd = {"prepare@t": "sleep 0.5", "train@x": stamp.format(tmp_path, "train_x", "start"),
           "train@y": f"{stamp.format(tmp_path, 'train_y', 'start')}; sleep 4; "
                      f"{stamp.format(tmp_path, 'train_y', 'end')}"}
    graph = {"prepare@t": set(), "train@y": set(), "tune@x": {"prepare@t"}, "train@x": {"tune@x"}}
    plan = _plan(tmp_path, graph, cmd)
    plan.nodes["tune@x"].slots, plan.nodes["tune@x"].searches = 2, True  # a search
    nodes = repro.execute(tmp_path, plan, repro.LocalExecutor(tmp_path, jobs=2), echo=lambda line: None)
    assert {name: n.state for name, n in nodes.items()} == {
        "prepare@t": "ran", "train@y": "ran", "tune@x": "up-to-date", "train@x": "ran"}
    started_x = float((tmp_path / "train_x.start").read_text())
    assert started_x < float((tmp_path / "train_y.end").read_text()) - 1.0


@pytest.mark.integration
def test_a_tune_takes_the_free_slot_when_a_training_holds_the_other(tmp_path, no_dvc):
    # train@y (one slot) starts first; tune@x (a search: every slot) would otherwise wait the whole
    # training for both. Nothing else can start, so it starts now on the free slot, and the local Ray
    # it starts is told it has that one core.
    stamp = "python -c 'import time; print(time.time())' >> {}/{}.{}"
    cmd = {"train@y": f"{stamp.format(tmp_path, 'train_y', 'start')}; sleep 4; "
                      f"{stamp.format(tmp_path, 'train_y', 'end')}",
           "tune@x": f"echo ${{OMP_NUM_THREADS:-unset}} $RAY_OVERRIDE_RESOURCES > {tmp_path}/tune_x.env; "
                     f"{stamp.format(tmp_path, 'tune_x', 'start')}"}
    graph = {"train@y": set(), "tune@x": set(), "train@x": {"tune@x"}}
    plan = _plan(tmp_path, graph, cmd)
    plan.nodes["tune@x"].slots, plan.nodes["tune@x"].searches = 2, True  # a search
    plan.order = ["train@y", "tune@x", "train@x"]
    # train@y first: the longest path starts first (its estimate is the training's last wall time).
    plan.estimates.update({"train@y": 100.0})
    executor = repro.LocalExecutor(tmp_path, jobs=2)
    nodes = repro.execute(tmp_path, plan, executor, echo=lambda line: None)
    assert {n.state for n in nodes.values()} == {"ran"}
    # Its trials' threads are Ray's to set (OMP_NUM_THREADS = a trial's CPUs), not inherited.
    assert (tmp_path / "tune_x.env").read_text().split() == ["unset", '{"CPU":', "1}"]
    assert float((tmp_path / "tune_x.start").read_text()) < float((tmp_path / "train_y.end").read_text()) - 1.0
    assert executor.free == 2


@pytest.mark.integration
def test_a_stage_ranked_above_the_tune_takes_the_free_slot_first(tmp_path, no_dvc):
    # train@y and evaluate@z rank above tune@x and start first; when evaluate@z ends, the tune takes
    # the slot it left (one thread) instead of waiting for train@y's as well.
    stamp = "python -c 'import time; print(time.time())' >> {}/{}.{}"
    cmd = {"train@y": f"sleep 4; {stamp.format(tmp_path, 'train_y', 'end')}",
           "evaluate@z": f"{stamp.format(tmp_path, 'evaluate_z', 'start')}; sleep 1",
           "tune@x": f"echo $RAY_OVERRIDE_RESOURCES > {tmp_path}/tune@x.cpus; "
                     f"{stamp.format(tmp_path, 'tune_x', 'start')}"}
    graph = {"train@y": set(), "evaluate@z": set(), "tune@x": set()}
    plan = _plan(tmp_path, graph, cmd)
    plan.nodes["tune@x"].slots, plan.nodes["tune@x"].searches = 2, True  # a search
    plan.estimates.update({"train@y": 100.0, "evaluate@z": 50.0, "tune@x": 10.0})
    executor = repro.LocalExecutor(tmp_path, jobs=2)
    executor.cores = 2
    nodes = repro.execute(tmp_path, plan, executor, echo=lambda line: None)
    assert {n.state for n in nodes.values()} == {"ran"}
    started = float((tmp_path / "tune_x.start").read_text())
    assert float((tmp_path / "evaluate_z.start").read_text()) < started < float((tmp_path / "train_y.end").read_text())
    assert (tmp_path / "tune@x.cpus").read_text().split() == ['{"CPU":', "1}"]


def test_dvc_lock_is_replaced_whole_so_a_running_stage_never_reads_half_of_it(tmp_path):
    """The runner commits a finished stage while others run (publish@ reads dvc.lock): DVC's own
    rewrite of the file, under the runner, leaves the old file in place until the new one is whole."""
    from dvc.utils.serialize import _common

    lock = tmp_path / "dvc.lock"
    lock.write_text("schema: '2.0'\nstages: {}\n")
    seen = []

    def dumper(data, fd):
        fd.write("schema: '2.0'\n")
        fd.flush()
        seen.append(lock.read_text())  # what a stage reading the file at this moment finds
        fd.write("stages: {a: {cmd: x}}\n")

    # DVC's lock file dump: parse the file, update the stages' entries, write it back
    with dvc_lock._LockWrites()(), _common._modify_data(lock, lambda text, path: text, dumper):
        pass
    assert seen == ["schema: '2.0'\nstages: {}\n"]
    assert lock.read_text() == "schema: '2.0'\nstages: {a: {cmd: x}}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["dvc.lock"]  # no temporary file left
    assert _common._dump_data.__module__ == _common.__name__  # DVC's own writer again afterwards


@pytest.mark.integration
def test_the_runner_writes_dvc_lock_byte_for_byte_as_dvc_commit_does_without_parsing_it_again(tmp_path, monkeypatch):
    """After ``dvc repro`` of a first stage, two stages committed one after another by the runner (the
    lock file parsed once, then its dumped structure reused; params.yaml parsed once per version of
    the file) and by ``dvc commit``: the same dvc.lock, byte for byte, with params.yaml edited
    between the two commits."""
    import subprocess

    from dvc.dependency import param
    from dvc.utils.serialize import _yaml

    stages = "".join(f"  s{i}:\n    cmd: echo {i} > out{i}.txt\n    deps: [in.txt]\n    params: [p.v{i}]\n"
                     f"    outs: [out{i}.txt]\n" for i in range(3))
    lock_texts = []
    for how in ("runner", "dvc"):
        root = tmp_path / how
        root.mkdir()
        subprocess.run("git init -q && dvc init -q && echo x > in.txt", shell=True, cwd=root, check=True)
        (root / "dvc.yaml").write_text("stages:\n" + stages)
        (root / "params.yaml").write_text("p: {v0: 0, v1: 1, v2: 2}\n")
        edit = (root / "params.yaml").write_text  # after the first commit: the second records the new value
        subprocess.run("dvc repro -q s0", shell=True, cwd=root, check=True)  # a lock file to start from
        for i in (1, 2):
            (root / f"out{i}.txt").write_text(f"{i}\n")
        if how == "dvc":
            for i in (1, 2):
                subprocess.run(f"dvc commit -q -f s{i}", shell=True, cwd=root, check=True)
                edit("p: {v0: 0, v1: 1, v2: 22}\n")
        else:
            parses, params_reads = [], []

            def counted(text, path, original=_yaml.parse_yaml_for_update, parses=parses):
                parses.append(path)
                return original(text, path)

            def loaded(path, fs, original=param.load_path, params_reads=params_reads, **kwargs):
                params_reads.append(path)
                return original(path, fs, **kwargs)

            monkeypatch.setattr(_yaml, "parse_yaml_for_update", counted)
            monkeypatch.setattr(param, "load_path", loaded)
            monkeypatch.chdir(root)  # stage names are relative to the working folder, as under the runner
            dvc = repro._Dvc(root)
            try:
                for i in (1, 2):
                    dvc.commit(f"s{i}")
                    edit("p: {v0: 0, v1: 1, v2: 22}\n")
            finally:
                dvc.close()
            monkeypatch.undo()
            assert len(parses) == 1  # the second commit reused what the first one dumped
            assert len(params_reads) == 2  # DVC asks six times: once per version of the file
        lock_texts.append((root / "dvc.lock").read_text())
    assert "s2:" in lock_texts[0] and "p.v2: 22" in lock_texts[0]
    assert lock_texts[0] == lock_texts[1]


def test_the_lock_file_dumped_entry_by_entry_is_dvcs_whole_dump():
    """The committed dvc.lock, cut to one stage of each kind, parsed as DVC parses it: written entry
    by entry it is the same text as DVC's whole dump, also after one entry is replaced by DVC's
    serialised form of a stage (a plain dict), and a second write dumps only the replaced entry."""
    import io

    from dvc.utils.serialize import _yaml

    from pipeline.config import ROOT
    from pipeline.runner.dvc_lock import _LockWrites

    def whole(data) -> str:
        stream = io.StringIO()
        _yaml._dump(data, stream)
        return stream.getvalue()

    head, *entries = re.split(r"(?m)^(?=  \S)", (ROOT / "dvc.lock").read_text())  # "  <stage>:" opens an entry
    kinds = {}
    for entry in entries:
        kinds.setdefault(entry.split("@")[0].strip(), entry)
    text = head + "".join(kinds.values())
    data = _yaml.parse_yaml_for_update(text, "dvc.lock")
    assert len(data["stages"]) >= 9 and "train@bahdanau" in data["stages"]
    assert whole(data) == text
    writes, calls = _LockWrites(), []

    def counted(item, stream):
        calls.append(item)
        _yaml._dump(item, stream)

    assert writes.render(data, counted) == text
    name = "train@bahdanau"
    data["stages"][name] = {**{k: data["stages"][name][k] for k in ("cmd", "deps", "params")},
                            "outs": [{"path": "runs/bahdanau/checkpoint", "hash": "md5", "md5": "0" * 32 + ".dir",
                                      "size": 1, "nfiles": 1}]}
    calls.clear()
    assert writes.render(data, counted) == whole(data) != text
    assert len(calls) == 2  # the schema line and the replaced entry


def test_dvc_is_a_version_the_lock_writes_are_tested_on():
    """dvc_lock wraps three DVC internals: pyproject.toml pins DVC's minor version, the installed DVC is
    in that range, and the internals are where the wrapper looks for them."""
    import tomllib
    from importlib.metadata import version

    from dvc.utils.serialize import _common, _yaml
    from packaging.requirements import Requirement

    from pipeline.config import ROOT

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    dvc = next(Requirement(d) for d in deps if Requirement(d).name == "dvc")
    assert dvc.specifier.contains(version("dvc")), (str(dvc.specifier), version("dvc"))
    assert any(s.operator == "<" for s in dvc.specifier), "an upper bound: a later DVC may move its internals"
    assert callable(_common._dump_data) and callable(_yaml.parse_yaml_for_update)
    from dvc.dependency import param

    assert callable(param.load_path)


def test_only_a_tune_with_a_search_space_starts_ray_and_takes_every_slot():
    # the others write an empty tuned.yaml at once: one slot, forked by the warm starter like any stage
    from pipeline.runner.plan import _searches

    params = {"models": {"a": {"search_space": {"lr": {"loguniform": [1e-4, 1e-2]}}}, "b": {"search_space": {}},
                         "c": {"model": {}}}}
    assert [_searches(f"tune@{key}", params) for key in "abc"] == [True, False, False]
    assert not _searches("train@a", params) and not _searches("tune@missing", params)
