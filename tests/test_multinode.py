"""Several processes on loopback (torchrun, gloo): the shared loop means the same at every
process count, and a failure on one rank stops them all."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from pipeline.stages.prepare import prepare
from tests.conftest import ROOT, TINY, venv_env
from tests.ports import free_port

pytestmark = pytest.mark.slow
WORKER = str(ROOT / "tests" / "multinode_worker.py")


def torchrun(nodes: int, port: int, rank: int) -> list[str]:
    """One "node" of a torchrun job on loopback: one process per node, a real process group."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node", "1",
            "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port)]


def start(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[str]:
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n\n".join(log[-3000:] for log in logs)
    return logs


def signal_tree(pid: int, sig: int) -> list[psutil.Process]:
    """Send ``sig`` to a process and all its descendants (torchrun starts each worker in a session
    of its own, so signalling torchrun's process group would miss the workers); returns them."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:  # a worker that exited after it was listed
            pass
    return procs


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants and wait for them."""
    psutil.wait_procs(signal_tree(pid, signal.SIGKILL), timeout=30)


def finish_together(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for all; if one fails, stop the others (a node left alone waits in the rendezvous)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            kill_tree(p.pid)
    return [p.communicate()[0] for p in procs]


def copy_root(tmp: Path, train: dict) -> Path:
    """Fixed-length copy sequences (4 vectors each): every item weighs the same in the loss, so
    the mean over two equal slices of a batch is the mean over the batch."""
    prepare("copy", {"seed": 1, "bits": 4, "min_len": 4, "max_len": 4, "train_size": 64, "val_size": 16,
                     "test_size": 4, "test_lengths": [4]}, tmp / "data" / "prepared" / "copy")
    model = {k: v for k, v in TINY["ntm"].items() if k not in ("input_size", "output_size")}
    params = {"train": {}, "models": {"ntm": {"arch": "ntm", "task": "copy", "model": model, "train": train}}}
    (tmp / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp


def lr_by_step(db: Path) -> dict[str, list[tuple[int, float]]]:
    """Each MLflow training run's logged learning rate, by step."""
    con = sqlite3.connect(db)
    out: dict[str, list] = {}
    for run, step, value in con.execute("select run_uuid, step, value from metrics where key = 'lr' order by step"):
        out.setdefault(run, []).append((step, value))
    return out


@pytest.mark.parametrize("batching", ["batch_size", "max_tokens"])
def test_one_and_two_processes_train_the_same_model(tmp_path, batching):
    # batch_size (or max_tokens) is the global batch: 2 processes take 4 items each of the same 8, so
    # with no dropout they take the same steps as 1 process on all 8 (up to float summation order).
    root = copy_root(tmp_path, {"epochs": 2, "eval_every": 8, "batch_size": 8, "warmup_steps": 3, "seed": 3,
                                "log_every": 1, "lr": 0.01})
    if batching == "max_tokens":  # 8 items' worth of tokens: the same 8 batches of 8 an epoch, cut by tokens
        from pipeline.tasks import get_task

        task = get_task("copy")
        length = task.length(task.load(root / "data" / "prepared" / "copy", "train")[0])
        params = yaml.safe_load((root / "params.yaml").read_text())
        params["models"]["ntm"]["train"]["max_tokens"] = 8 * length
        (root / "params.yaml").write_text(yaml.safe_dump(params))
    env = venv_env(tmp_path)
    env["PYTHONPATH"] = str(ROOT)
    finish([start([sys.executable, WORKER, str(root), str(tmp_path / "one")], env)])
    port = free_port()
    finish([start([*torchrun(2, port, rank), WORKER, str(root), str(tmp_path / "two")], env) for rank in (0, 1)])

    one = torch.load(tmp_path / "one" / "rank0.pt")
    r0, r1 = torch.load(tmp_path / "two" / "rank0.pt"), torch.load(tmp_path / "two" / "rank1.pt")
    assert (one["world"], r0["world"], r1["world"]) == (1, 2, 2)
    for key in r0["state"]:
        assert torch.equal(r0["state"][key], r1["state"][key]), key  # ranks never drift apart
        torch.testing.assert_close(r0["state"][key], one["state"][key], rtol=0, atol=2e-6, msg=key)
    # the weights moved: the agreement is not two untouched initialisations
    from models import build

    torch.manual_seed(3)
    fresh = build("ntm", {**TINY["ntm"], "input_size": 5, "output_size": 4}).state_dict()
    assert any((fresh[k] - one["state"][k]).abs().max() > 1e-3 for k in fresh)

    # the same learning rate at every one of the 16 steps (8 per epoch at any process count)
    runs = lr_by_step(tmp_path / "mlflow.db")
    assert len(runs) == 2, runs  # one MLflow run per job: rank 1 never logs
    a, b = runs.values()
    assert [s for s, _ in a] == list(range(1, 17))
    assert a == b
    for name in ("one", "two"):
        summary = json.loads((tmp_path / name / "train_summary.json").read_text())
        assert summary["steps"] == 16 and summary["processes"] == {"one": 1, "two": 2}[name]


def test_nan_on_one_rank_stops_every_rank_with_one_clear_error(tmp_path):
    root = copy_root(tmp_path, {"max_steps": 40, "eval_every": 20, "batch_size": 8, "warmup_steps": 1})
    env = venv_env(tmp_path)
    env["PYTHONPATH"] = str(ROOT)
    port = free_port()
    started = time.monotonic()
    procs = [start([*torchrun(2, port, rank), WORKER, str(root), str(tmp_path / "out"), "--nan-at-step", "3",
                    "--nan-rank", "1"], env) for rank in (0, 1)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs), logs
    assert time.monotonic() - started < 120  # stopped, not hung in a collective until a timeout
    for log in logs:  # each rank names the step, says it may have been another process, and the fix
        assert "error: ntm: loss became non-finite (nan or inf) at step 3 on one or more of 2 processes" in log, log
        assert "lower lr" in log
        assert "Traceback" not in log.split("error: ntm:")[0][-2000:], log


def test_dvc_repro_trains_on_two_torchrun_nodes_via_the_launcher_variable(tmp_path):
    """``ATTNZOO_LAUNCHER`` makes ``dvc repro train@ntm`` (node 0) and the same stage command on
    node 1 one torchrun job; dvc.yaml is not edited and the stage is recorded as usual."""
    from tests.conftest import copy_repo

    repo = copy_repo(tmp_path / "repo")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    entry = params["models"]["ntm"]
    entry["model"] = {k: v for k, v in TINY["ntm"].items() if k not in ("input_size", "output_size")}
    entry["train"] = {"max_steps": 6, "eval_every": 3, "batch_size": 8, "warmup_steps": 1}
    entry["search_space"] = {}  # tune@ntm writes an empty tuned.yaml without starting Ray
    entry["tune"] = {}
    params["models"] = {"ntm": entry}
    params["tasks"] = {"copy": {**params["tasks"]["copy"], "train_size": 64, "val_size": 16, "test_size": 4,
                                "test_lengths": [4]}}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["rm", "-rf", "dvc.lock", "runs", "results", "reports"], cwd=repo, check=True)
    env = venv_env(repo)
    subprocess.run(["git", "init", "-q"], cwd=repo, env=env, check=True)
    port = free_port()

    def launcher(rank: int) -> dict:
        return {**env, "ATTNZOO_LAUNCHER": " ".join(torchrun(2, port, rank))}

    head = subprocess.Popen(["dvc", "repro", "train@ntm"], cwd=repo, env=launcher(0), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    # node 1 joins the rendezvous; torchrun waits there until dvc has prepared the data on node 0
    other = subprocess.Popen([sys.executable, "-m", "pipeline.stages.train", "ntm"], cwd=repo, env=launcher(1),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    logs = finish_together([head, other], timeout=600)
    assert head.returncode == 0 and other.returncode == 0, "\n\n".join(log[-3000:] for log in logs)
    assert "ATTNZOO_LAUNCHER: " in logs[0]
    summary = json.loads((repo / "runs" / "ntm" / "train_summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 6
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert "train@ntm" in lock["stages"]
    status = subprocess.run(["dvc", "status", "train@ntm"], cwd=repo, env=env, capture_output=True, text=True)
    assert "up to date" in status.stdout, status.stdout
