"""Tracking-server mode: the stage CLIs of a tiny model against a real ``mlflow server`` over HTTP.

Artifacts must reach the server's store (proxied ``mlflow-artifacts:``), the registry and its
``production`` alias must read back over HTTP, runs carry ``mlflow.source.git.commit``, a resumed
run id continues its run, and a dead server is one clear sentence within seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.config import UserError
from pipeline.stages.prepare import prepare
from tests.conftest import TINY, copy_repo, venv_env
from tests.mlflow_server import free_port, mlflow_server
from tests.ports import handing_out_first

pytestmark = pytest.mark.slow

PARITY = {"seed": 1, "bits": 6, "train_size": 256, "val_size": 32, "test_size": 300}  # export's cases use 264
# The five stages, each through its CLI entry point, in one interpreter: a process per stage would
# spend most of this test importing torch and MLflow (ACT on parity: the tiny model whose export is fastest).
STAGES = ("from pipeline.stages import evaluate, export, publish, quantize, train\n"
          "for stage in (train, evaluate, export, quantize, publish): stage.main(['act'])")


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A committed copy of the repository whose only model is a tiny ACT on a tiny parity task."""
    repo = copy_repo(tmp_path_factory.mktemp("repo"))
    # the real models' lineage and outputs would otherwise be this one's
    for path in ("dvc.lock", "runs", "results", "reports"):
        subprocess.run(["rm", "-rf", str(repo / path)], check=True)
    model = {k: v for k, v in TINY["act"].items() if k != "input_size"}
    shipped = yaml.safe_load((repo / "params.yaml").read_text())
    params = {"train": {}, "quantize": shipped["quantize"], "tasks": {"parity": PARITY}, "models": {"act": {
        "arch": "act", "task": "parity", "model": model,
        "train": {"max_steps": 4, "eval_every": 2, "batch_size": 16, "warmup_steps": 1},
        "parity": {"atol": 1.0e-4, "rtol": 1.0e-3},
        "bar": [{"metric": "accuracy", "op": ">=", "value": 0.0}]}}}  # met by any model: publish sets the alias
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    prepare("parity", PARITY, repo / "data" / "prepared" / "parity")
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        subprocess.run(git + cmd, cwd=repo, check=True, capture_output=True)
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, artifacts folder) of one server shared by this module's tests (it takes ~12 s to start)."""
    tmp = tmp_path_factory.mktemp("mlflow_server")
    with mlflow_server(tmp) as url:
        yield url, tmp / "artifacts"


def stage(repo: Path, uri: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = venv_env(repo)
    env["MLFLOW_TRACKING_URI"] = uri
    return subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def staged(repo, server) -> subprocess.CompletedProcess:
    """The ACT's train, evaluate, export, quantize and publish stages run once against the server: what
    the tests below read (runs/act, model_repository/act) exists whichever of them runs first, or alone."""
    return stage(repo, server[0], "-c", STAGES)


def test_stages_log_to_a_tracking_server(repo, server, staged):
    import mlflow

    url, artifacts = server
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    proc = staged
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "act: version 1 in model_repository/act (production)" in proc.stdout, proc.stdout
    assert "act-int8: version 1 in model_repository/act-int8 (production)" in proc.stdout, proc.stdout

    client = mlflow.MlflowClient(tracking_uri=url)
    experiment = client.get_experiment_by_name("attnzoo")
    assert experiment.artifact_location.startswith("mlflow-artifacts:"), experiment.artifact_location
    found = client.search_runs([experiment.experiment_id], "tags.model = 'act'")
    runs = {r.data.tags["stage"]: r for r in found}
    assert len(found) == 5 and sorted(runs) == ["evaluate", "export", "publish", "quantize", "train"], found
    assert all(r.data.tags["mlflow.source.git.commit"] == commit for r in found)
    assert all("git_commit" not in r.data.tags for r in found)

    # The files reached the server's --artifacts-destination, not this repository.
    def logged(stage_name: str) -> set[str]:
        root = artifacts / experiment.experiment_id / runs[stage_name].info.run_id / "artifacts"
        return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}

    assert {"plots/by_length.png", "plots/halting.png", "metrics.json"} <= logged("evaluate")
    assert "parity.json" in logged("export")
    graphs = json.loads((repo / "model_repository" / "act" / "1" / "metadata.json").read_text())["graphs"]
    # publish logs an MLflow model (serving/pyfunc.py): its files, the version's folder among them
    stored = {p.relative_to(artifacts).as_posix() for p in artifacts.rglob("*") if p.is_file()}
    assert graphs and all(any(s.endswith(f"artifacts/repository/act/1/{g}.onnx") for s in stored) for g in graphs)
    assert any(s.endswith("artifacts/repository/act/1/metadata.json") for s in stored)
    assert any(s.endswith("/MLmodel") for s in stored) and any("/code/serving/" in s for s in stored)
    assert "MODEL_CARD.md" in logged("publish")  # the version's card, also inside its folder
    card = (repo / "model_repository" / "act" / "1" / "MODEL_CARD.md").read_text()
    assert card.startswith("# act, version 1\n") and f"from commit `{commit}`" in card
    assert not (repo / "mlartifacts").exists()

    # The registry over HTTP: version 1 from the publish run, promoted to production, and loadable
    # from the server as an MLflow model.
    version = client.get_model_version_by_alias("act", "production")
    assert version.version == "1" and version.run_id == runs["publish"].info.run_id
    assert version.tags["repository_version"] == "1" and version.tags["mlflow.source.git.commit"] == commit
    mlflow.set_tracking_uri(url)
    try:
        model = mlflow.pyfunc.load_model("models:/act@production")
    finally:
        mlflow.set_tracking_uri(None)
    (spec,) = model.metadata.get_input_schema().inputs
    out = model.predict({spec.name: np.zeros((2, spec.shape[1]), np.float32)})
    assert sorted(out) == sorted(model.metadata.get_output_schema().input_names()) and out["bits"].shape[0] == 2

    # The int8 variant (quantize@'s graphs, its gate passed) is a model of its own, act-int8, whose
    # version names the fp32 version it was made beside; registered and promoted like it.
    fp32_meta = json.loads((repo / "model_repository" / "act" / "1" / "metadata.json").read_text())
    int8_meta = json.loads((repo / "model_repository" / "act-int8" / "1" / "metadata.json").read_text())
    assert (int8_meta["precision"], int8_meta["fp32_model"], int8_meta["fp32_version"]) == ("int8", "act", 1)
    assert int8_meta["int8_gate"]["passed"] and int8_meta["bar"]["passed"] and int8_meta["production"]
    assert int8_meta["graphs"] == fp32_meta["graphs"] and int8_meta["graph_sha256"] != fp32_meta["graph_sha256"]
    assert client.get_model_version_by_alias("act-int8", "production").tags["repository_version"] == "1"


def test_resume_continues_the_same_run(server, monkeypatch, capsys):
    import mlflow

    from pipeline import tracking

    url, _ = server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    params = {"train": {"lr": 0.01, "sizes": [1, 2]}}
    with tracking.run("resume_probe", "train", params=params) as run:
        first = run.active_run().info.run_id
        run.log_metric("val_loss", 2.0, step=2)
    # as after a SIGKILL: the checkpoint's run id, and the same params logged again
    with tracking.run("resume_probe", "train", params=params, run_id=first) as run:
        assert run.active_run().info.run_id == first
        run.log_metric("val_loss", 1.0, step=4)
    with tracking.run("resume_probe", "train", params=params, run_id="0" * 32) as run:
        fresh = run.active_run().info.run_id
    assert fresh != first
    assert f"MLflow run {'0' * 32} not found" in capsys.readouterr().out

    client = mlflow.MlflowClient(tracking_uri=url)
    assert sorted(m.step for m in client.get_metric_history(first, "val_loss")) == [2, 4]
    assert client.get_run(first).data.params == {"train.lr": "0.01", "train.sizes": "[1, 2]"}
    assert client.get_run(first).info.status == "FINISHED"


def test_unreachable_server_is_one_sentence_within_seconds(repo, staged, monkeypatch):
    from pipeline import tracking

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(UserError, match="start it, or unset MLFLOW_TRACKING_URI"):
        tracking.check_server(dead)
    assert time.monotonic() - started < 5

    # The stage CLI: exit code 2, one line, no traceback, long before MLflow's retries would give up
    # (minutes). Most of the bound is importing torch and MLflow on a busy machine.
    started = time.monotonic()
    proc = stage(repo, dead, "-m", "pipeline.stages.train", "act", "--out", str(repo / "runs" / "unreachable"),
                 timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and dead in errors[0] and "start it, or unset MLFLOW_TRACKING_URI" in errors[0], errors
    assert elapsed < 60, elapsed

    # publish refuses before it writes a version, which a re-run would find unchanged and never register
    from pipeline.config import resolve
    from pipeline.stages.publish import publish

    versions = sorted(p.name for p in (repo / "model_repository" / "act").glob("*"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead)
    with pytest.raises(UserError, match="start it, or unset MLFLOW_TRACKING_URI"):
        publish(resolve("act", root=repo), root=repo)
    assert sorted(p.name for p in (repo / "model_repository" / "act").glob("*")) == versions


def test_publish_refuses_graphs_whose_parity_failed(repo, server, staged, monkeypatch):
    """Nothing of a model whose ONNX graphs do not compute what PyTorch computes enters the
    repository or the registry: one sentence, exit 2 from the CLI."""
    from pipeline.config import resolve
    from pipeline.stages.publish import publish

    parity = repo / "runs" / "act" / "parity.json"
    kept = parity.read_text()
    versions = sorted(p.name for p in (repo / "model_repository" / "act").glob("*"))
    try:
        parity.write_text(json.dumps({**json.loads(kept), "passed": False}))
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server[0])
        with pytest.raises(UserError, match="ONNX parity failed .* nothing was published"):
            publish(resolve("act", root=repo), root=repo)
        proc = stage(repo, server[0], "-m", "pipeline.stages.publish", "act", timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert [line for line in proc.stderr.splitlines() if line.startswith("error:")][0].endswith(
            "run `dvc repro export@act`"), proc.stderr
    finally:
        parity.write_text(kept)
    assert sorted(p.name for p in (repo / "model_repository" / "act").glob("*")) == versions


def test_a_port_another_server_answers_on_is_left_for_a_free_one(tmp_path, monkeypatch):
    """Another xdist worker's server was handed the same free port first and answers /health there:
    this server's bind fails, and it starts again on a fresh port instead of yielding the other's URL."""
    import http.server
    import threading

    from mlflow import MlflowClient

    import tests.mlflow_server as ms

    class Health(http.server.BaseHTTPRequestHandler):
        hits = 0

        def do_GET(self):  # noqa: N802 (http.server's name)
            Health.hits += 1
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    taken = other.server_address[1]
    monkeypatch.setattr(ms, "free_port", handing_out_first(taken))
    try:
        with mlflow_server(tmp_path) as url:
            assert url != f"http://127.0.0.1:{taken}" and Health.hits > 0  # asked the other, then left it
            assert [e.name for e in MlflowClient(url).search_experiments()] == ["Default"]
    finally:
        other.shutdown()
