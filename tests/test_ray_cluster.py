"""``tune@`` on a real two-node Ray cluster (loopback) logging to a real MLflow server.

The tune stage runs as a subprocess of a copy of the repository, as DVC would run it, with
``RAY_ADDRESS`` and ``MLFLOW_TRACKING_URI`` set: the code reaches the trials through Ray's
``runtime_env``, and every trial must be an MLflow child run in the server's store.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pipeline.cluster import check_address
from pipeline.config import UserError
from pipeline.stages.prepare import prepare
from pipeline.stages.tune import pick_best
from tests.conftest import ROOT, TINY, TINY_COPY_TASK, copy_repo, venv_env
from tests.mlflow_server import mlflow_server
from tests.ports import handing_out_first
from tests.ray_cluster import alive_nodes, free_port, ray_cluster

pytestmark = pytest.mark.slow

TUNE_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(nodes=2) as address:
        yield address


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """One copy of the repository with tiny prepared copy-task data; each test writes its params."""
    repo = copy_repo(tmp_path_factory.mktemp("repo"))
    prepare("copy", TINY_COPY_TASK, repo / "data" / "prepared" / "copy")
    return repo


def tune(repo: Path, space: dict, env: dict[str, str], timeout: float = TUNE_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python -m pipeline.stages.tune ntm`` over ``space`` with a 6-step budget, one sample per grid point."""
    model = {k: v for k, v in TINY["ntm"].items() if k not in ("input_size", "output_size")}
    params = {"train": {}, "tune": {"num_samples": 1, "max_steps": 6, "eval_every": 3, "grace_period": 2,
                                    "cpus_per_trial": 1},
              "models": {"ntm": {"arch": "ntm", "task": "copy", "model": model, "search_space": space,
                                 "train": {"batch_size": 8, "warmup_steps": 1, "lr": 0.01}}}}
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    (repo / "runs" / "ntm" / "tuned.yaml").unlink(missing_ok=True)
    return subprocess.run([sys.executable, "-m", "pipeline.stages.tune", "ntm"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=timeout)


def stage_env(repo: Path, address: str, url: str) -> dict[str, str]:
    env = venv_env(repo)
    env.update(RAY_ADDRESS=address, MLFLOW_TRACKING_URI=url)
    return env


def tune_runs(url: str) -> tuple[object, list]:
    """The newest tune run on the server and its child runs."""
    from mlflow import MlflowClient

    client = MlflowClient(url)
    experiment = client.get_experiment_by_name("attnzoo")
    parent = client.search_runs([experiment.experiment_id], "tags.stage = 'tune'", order_by=["start_time DESC"],
                                max_results=1)[0]
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return parent, children


def test_trials_spread_over_both_nodes_and_log_to_the_server(cluster, server, repo):
    out = tune(repo, {"lr": {"grid": [0.01, 0.02]}}, stage_env(repo, cluster, server))
    assert out.returncode == 0, out.stderr[-6000:]
    tuned = yaml.safe_load((repo / "runs" / "ntm" / "tuned.yaml").read_text())
    assert tuned["lr"] in (0.01, 0.02)
    parent, children = tune_runs(server)
    assert len(children) == 2  # one MLflow child run per trial, in the server's store
    assert {c.data.tags["stage"] for c in children} == {"train"}
    # FINISHED, or KILLED where ASHA cut the trial (the rung at step 6 may, with two trials); never FAILED
    assert {c.info.status for c in children} <= {"FINISHED", "KILLED"}
    nodes = {c.data.tags["ray.node_id"] for c in children}
    assert len(nodes) == 2 and nodes <= set(alive_nodes(cluster)), (nodes, alive_nodes(cluster))
    assert parent.data.metrics["ray_nodes"] == 2 and parent.data.params["best.lr"] == str(tuned["lr"])


def test_a_trials_run_left_open_when_ray_stopped_it_ends_killed(server, monkeypatch):
    """A trial whose worker Ray stopped before it could end its MLflow run leaves the run RUNNING; once the search is
    over the driver ends such children KILLED, and only them: a finished or failed trial and the parent keep theirs."""
    from mlflow import MlflowClient

    from pipeline.stages.tune import end_stopped_runs

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    client = MlflowClient()
    experiment = client.create_experiment("stopped-trials")
    parent = client.create_run(experiment).info.run_id
    children = {status: client.create_run(experiment, tags={"mlflow.parentRunId": parent}).info.run_id
                for status in ("RUNNING", "FINISHED", "FAILED")}
    for status, run_id in children.items():
        if status != "RUNNING":
            client.set_terminated(run_id, status)
    end_stopped_runs(experiment, parent)
    assert {s: client.get_run(r).info.status for s, r in children.items()} == {
        "RUNNING": "KILLED", "FINISHED": "FINISHED", "FAILED": "FAILED"}
    assert client.get_run(parent).info.status == "RUNNING"  # the search's own run: its stage ends it


def test_crashing_and_non_finite_trials_leave_the_best_finished_one(cluster, server, repo):
    # lr 1e9 stays finite here (the loss grows to ~1e9; gradients are clipped and Adam's step is bounded),
    # so inf plants the non-finite loss; memory_size -1 crashes while the model is built.
    space = {"lr": {"grid": [0.01, math.inf]}, "memory_size": {"grid": [12, -1]}}
    out = tune(repo, space, stage_env(repo, cluster, server))
    assert out.returncode == 0, out.stderr[-6000:]
    assert "non-finite" in out.stderr and "Dimension size must be non-negative" in out.stderr
    assert yaml.safe_load((repo / "runs" / "ntm" / "tuned.yaml").read_text()) == {"lr": 0.01, "memory_size": 12}
    parent, children = tune_runs(server)
    assert parent.data.metrics["trials"] == 4 and parent.data.metrics["trials_failed"] == 3
    # the inf trial got as far as training (a failed child run); the crashed ones never started one
    assert sorted(c.info.status for c in children) == ["FAILED", "FINISHED"]  # the one left is never cut


def test_no_finished_trial_fails_in_one_sentence(cluster, server, repo):
    out = tune(repo, {"memory_size": {"grid": [-1]}}, stage_env(repo, cluster, server))
    assert out.returncode == 2, out.stderr[-3000:]
    error = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert error == [error[-1]] and "no trial finished (1 of 1 failed)" in error[0], out.stderr[-3000:]
    assert "RuntimeError: zeros: Dimension size must be non-negative." in error[0]
    assert not (repo / "runs" / "ntm" / "tuned.yaml").exists()


def test_unreachable_ray_address_is_one_sentence(repo, tmp_path):
    env = venv_env(repo)
    env["RAY_ADDRESS"] = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    out = tune(repo, {"lr": {"grid": [0.01]}}, env, timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"error: RAY_ADDRESS={env['RAY_ADDRESS']}: ")
    assert "ray start --head" in out.stderr and "unset RAY_ADDRESS" in out.stderr
    assert time.monotonic() - started < 30


def test_check_address_accepts_a_listening_head_and_local_runs(cluster):
    """No error for the head's address (plain or ray://) and for a local run; one for a port nobody holds."""
    check_address(cluster)
    check_address(f"ray://{cluster}")
    for local in (None, "", "auto", "local"):
        check_address(local)
    closed = f"127.0.0.1:{free_port()}"
    with pytest.raises(UserError, match=rf"RAY_ADDRESS={closed}: no Ray cluster answers there"):
        check_address(closed)


def _result(config, loss=None, error=None):
    return SimpleNamespace(config=config, metrics={"val_loss": loss} if loss is not None else {}, error=error)


def test_pick_best_skips_errors_and_nan():
    results = [_result({"lr": 1}, error=FloatingPointError("loss became nan")), _result({"lr": 2}, float("nan")),
               _result({"lr": 3}, 0.5), _result({"lr": 4}, 0.4), _result({"lr": 5}, error=RuntimeError("boom"))]
    assert pick_best("m", results) == ({"lr": 4}, 0.4)


def test_pick_best_names_a_missing_package():
    # how Ray hands it over: the trial's exception as a RayTaskError's cause, or only its text
    class RayTaskError(Exception):
        def __init__(self, cause):
            super().__init__(f"ray::ImplicitFunc.train() (pid=1)\n{cause!r}")
            self.cause = cause

    for error in (RayTaskError(ModuleNotFoundError("No module named 'sacrebleu'", name="sacrebleu")),
                  RuntimeError("actor died: ModuleNotFoundError: No module named 'torch.nn'")):
        with pytest.raises(UserError, match=r"cannot import '(sacrebleu|torch)'; install attnzoo's training extra"):
            pick_best("m", [_result({"lr": 1}, 0.5), _result({"lr": 2}, error=error)])


def test_pick_best_with_nothing_finished_names_the_first_error():
    with pytest.raises(UserError, match=r"no trial finished \(2 of 2 failed\); the first error: ValueError: bad lr$"):
        pick_best("m", [_result({}, error=ValueError("bad lr")), _result({}, error=RuntimeError("x"))])


def test_a_head_port_another_listener_holds_is_left_before_any_worker_joins(monkeypatch):
    """Another test's server was handed the head's port first and listens there: the head's GCS fails to
    bind, so no worker may start pointed at that port (it would join whatever answers); the cluster starts
    again on fresh ports and both nodes are alive there."""
    import socket

    import tests.ray_cluster as rc

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(8)
        taken = other.getsockname()[1]
        monkeypatch.setattr(rc, "free_port", handing_out_first(taken))
        commands: list[list[str]] = []
        popen = subprocess.Popen

        def recording(cmd, *args, **kwargs):
            commands.append(list(cmd))
            return popen(cmd, *args, **kwargs)

        monkeypatch.setattr(rc.subprocess, "Popen", recording)
        with ray_cluster(nodes=2) as address:
            assert address != f"127.0.0.1:{taken}"
            assert len(set(alive_nodes(address))) == 2
    heads = [c[c.index("--port") + 1] for c in commands if "--head" in c]
    joins = [c[c.index("--address") + 1] for c in commands if "start" in c and "--address" in c]
    assert heads[0] == str(taken) and len(heads) == 2  # the first head lost its port; the second started
    assert joins == [address]  # the one worker joined the second head only


def test_the_code_ray_ships_is_code_only_at_the_size_the_cluster_doc_states(tmp_path):
    """runtime_env's working_dir, zipped by Ray's own packaging code with its excludes: no data, runs,
    environment or store of this checkout goes (they exist here), and the upload is the size
    docs/cluster.md states."""
    import re
    import zipfile

    from ray._private.runtime_env import packaging

    from pipeline.cluster import runtime_env

    env = runtime_env("sqlite:///mlflow.db")
    packaging._zip_files(env["working_dir"], env["excludes"], str(tmp_path / "code.zip"), include_gitignore=True)
    names = zipfile.ZipFile(tmp_path / "code.zip").namelist()
    assert {"pipeline/cluster.py", "models/layers.py", "params.yaml", "dvc.yaml"} <= set(names)
    tops = {n.split("/")[0] for n in names}
    stores = {".git", ".venv", ".dvc", "data", "runs", "results", "reports", "model_repository", "mlruns"}
    assert not tops & stores, tops
    assert not [n for n in names if n.endswith(".db") or "__pycache__" in n]
    stated = re.search(r"about (\d+) MiB, which Ray zips", (ROOT / "docs" / "cluster.md").read_text())
    assert stated, "docs/cluster.md no longer states the upload's size"
    mib = (tmp_path / "code.zip").stat().st_size / 2**20
    assert 0.6 * int(stated[1]) <= mib <= 1.4 * int(stated[1]), f"{mib:.1f} MiB; docs/cluster.md: {stated[1]}"
