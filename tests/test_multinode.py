"""Two "nodes" on loopback (torchrun, gloo): the shared training loop keeps their weights
identical and logs exactly one MLflow run."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys

import pytest
import torch
import yaml

from pipeline.prepare import prepare
from tests.conftest import ROOT, TINY, venv_env

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_stay_in_sync(tmp_path):
    prepare("copy", {"seed": 1, "bits": 4, "min_len": 1, "max_len": 4, "train_size": 256, "val_size": 16,
                     "test_size": 4, "test_lengths": [4]}, tmp_path / "data" / "prepared" / "copy")
    model = {k: v for k, v in TINY["ntm"].items() if k not in ("input_size", "output_size")}
    params = {"train": {}, "models": {"ntm": {"arch": "ntm", "task": "copy", "model": model,
              "train": {"max_steps": 6, "eval_every": 3, "batch_size": 8, "warmup_steps": 1, "seed": 3}}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = venv_env(tmp_path)
    env["PYTHONPATH"] = str(ROOT)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
             str(ROOT / "tests" / "multinode_worker.py"), str(tmp_path), str(tmp_path / "out")],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n\n".join(log[-3000:] for log in logs)
    r0 = torch.load(tmp_path / "out" / "rank0.pt")
    r1 = torch.load(tmp_path / "out" / "rank1.pt")
    assert r0["world"] == r1["world"] == 2
    initial = {k: v.clone() for k, v in r0["state"].items()}
    for key in r0["state"]:
        assert torch.equal(r0["state"][key], r1["state"][key]), key
    # and training moved the weights (the ranks did not merely both stay at their init)
    from models import build

    torch.manual_seed(3)
    fresh = build("ntm", {**model, "input_size": 5, "output_size": 4}).state_dict()
    assert any(not torch.equal(fresh[k], initial[k]) for k in fresh)
    db = sqlite3.connect(tmp_path / "mlflow.db")
    stages = [r[0] for r in db.execute("select value from tags where key = 'stage'")]
    assert stages == ["train"], stages
    assert (tmp_path / "out" / "checkpoint" / "best" / "model.safetensors").exists()
    # a real process group: Accelerate saw two processes, and each took half of the batches
    summary = json.loads((tmp_path / "out" / "train_summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 6
