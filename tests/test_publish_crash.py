"""A publish killed at any moment (SIGKILL, a real process) leaves every version whole: each
version folder appears complete or not at all, metadata.json and config.pbtxt are never half
written, config.pbtxt names no version that is not in place, the server loads every version with
its files verified, and the next run registers in MLflow a version the killed run wrote but did
not register."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import torch
import yaml

import models
from pipeline.stages.export import export_onnx
from pipeline.stages.prepare import prepare
from serving.repository import Repository
from tests.conftest import ROOT, TINY
from tests.test_deploy import triton_config

pytestmark = pytest.mark.integration  # starts servers or processes

# Publishes versions start..stop-1 of `ntm` in the scratch project argv[1], one after another: each
# with other serving limits, so each is a new version, registered in MLflow like the pipeline's.
WRITER = """
import dataclasses, sys
from pathlib import Path
from pipeline.config import resolve
from pipeline.stages.publish import publish
root, start, stop = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
run = resolve("ntm", root=root)
for i in range(start, stop):
    print("publishing", i, flush=True)
    meta = publish(dataclasses.replace(run, limits={"rows": 64 + i}), root)
    print("published", i, meta["version"], flush=True)
"""
DELAYS = [0.0, 0.4, 0.8, 1.2, 1.6, 2.0]  # seconds after a publish began: in the copy, the rename, MLflow


def _project(tmp: Path) -> Path:
    """A scratch project with an exported tiny NTM and what publish reads beside it."""
    prepare("copy", {"seed": 1, "bits": 4, "min_len": 1, "max_len": 4, "train_size": 8, "val_size": 4,
                     "test_size": 4, "test_lengths": [4]}, tmp / "data" / "prepared" / "copy")
    model = {k: v for k, v in TINY["ntm"].items() if k not in ("input_size", "output_size")}
    (tmp / "params.yaml").write_text(yaml.safe_dump({"train": {}, "models": {"ntm": {
        "arch": "ntm", "task": "copy", "model": model}}}))
    run_dir = tmp / "runs" / "ntm"
    torch.manual_seed(0)
    net = models.build("ntm", TINY["ntm"]).eval()
    export_onnx(net, run_dir / "onnx")
    (run_dir / "checkpoint" / "best").mkdir(parents=True)
    (run_dir / "checkpoint" / "best" / "config.json").write_text(json.dumps({"arch": "ntm", "model": TINY["ntm"]}))
    (run_dir / "parity.json").write_text(json.dumps({"passed": True}))
    (run_dir / "metrics.json").write_text(json.dumps({"accuracy": 1.0, "bar": {"passed": True}}))
    (run_dir / "int8_metrics.json").write_text(json.dumps({"gate": {"passed": False, "note": "not tried"}}))
    # The tracking store exists before the kills (a store killed while MLflow creates its tables is
    # MLflow's to repair, not a published version's).
    mlflow.set_tracking_uri(f"sqlite:///{tmp / 'mlflow.db'}")
    mlflow.MlflowClient().search_experiments()
    return tmp


def _writer(root: Path, start: int, stop: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(start), str(stop)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI":
                                 f"sqlite:///{root / 'mlflow.db'}"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _config_versions(repo: Path) -> list[int] | None:
    """The versions ntm's config.pbtxt names (Triton's version_policy), None without the file; the
    file must be whole."""
    path = repo / "ntm" / "config.pbtxt"
    if not path.exists():
        return None
    config = path.read_text()
    assert config.startswith('name: "ntm"') and config.endswith("\n"), config[-200:]
    policy = triton_config(config).version_policy
    assert policy.HasField("specific"), config
    return list(policy.specific.versions)


def _check_whole(repo: Path) -> list[int]:
    """Every version folder is complete and verified, and config.pbtxt names none that is not. Its versions.

    A version is renamed into place before config.pbtxt is rewritten to name it: a kill between the
    two leaves config.pbtxt naming the versions before it (none at a model's first version), and so
    it stays until a publish writes a new version (a re-run finds the killed run's version unchanged
    and writes nothing)."""
    folder = repo / "ntm"
    versions = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []
    for v in versions:
        json.loads((folder / str(v) / "metadata.json").read_text())
    if versions:
        served = Repository(repo)
        assert not served.errors, served.errors
        assert served.versions("ntm") == versions
    named = _config_versions(repo)
    assert named is None or (named and named == versions[:len(named)]), (named, versions)
    return versions


def test_publish_killed_at_any_moment_leaves_every_version_whole(tmp_path):
    """Each round kills a publish at another moment, then runs again from the version that was in
    flight, as a re-run of the pipeline does after a crash."""
    root = _project(tmp_path)
    repo = root / "model_repository"
    at = 0  # the publish in flight when the last writer was killed
    for delay in DELAYS:
        proc = _writer(root, at, at + 50)
        for line in proc.stdout:
            if line.startswith("publishing"):
                break
        else:
            raise AssertionError(f"the writer stopped:\n{proc.communicate()[0]}")
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        rest = line + proc.communicate(timeout=30)[0]
        at = max(int(x.split()[1]) for x in rest.splitlines() if x.startswith("publishing"))
        _check_whole(repo)
    # The run after the last kill: the publish in flight again, then a new version, which config.pbtxt
    # names with every version before it.
    proc = _writer(root, at, at + 2)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out
    versions = _check_whole(repo)
    assert len(versions) == at + 2  # every publish a version, none written twice
    assert _config_versions(repo) == versions
    metas = [json.loads((repo / "ntm" / str(v) / "metadata.json").read_text()) for v in versions]
    assert len({m["graph_sha256"] for m in metas}) == len(metas)
    assert all("mlflow_version" in m for m in metas), [m.get("mlflow_version") for m in metas]
    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    registered = {mv.tags["repository_version"] for mv in mlflow.MlflowClient().search_model_versions("name='ntm'")}
    assert registered == {str(v) for v in versions}
    assert not [p for p in (repo / "ntm").iterdir() if p.name.endswith(".tmp")]  # the last run removed the dead ones
