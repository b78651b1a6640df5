"""Kill -9 at any moment, lose nothing: a real training process (1 process, and 2 under torchrun)
is SIGKILLed mid-epoch between checkpoints, the same command is run again, and the result is the
uninterrupted run's to the bit, in the same MLflow run.

DRAW draws its latents from torch's RNG on every step, so this only holds if resume restores each
rank's RNG state and data position exactly. Bitwise equality is expected: the resumed process
replays the same operations on the same numbers (and gloo's two-rank all-reduce sums in a fixed
order).
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.stages.prepare import prepare
from tests.conftest import ROOT, TINY, venv_env
from tests.test_multinode import free_port, kill_tree, signal_tree

pytestmark = pytest.mark.slow
WORKER = str(ROOT / "tests" / "multinode_worker.py")
STEPS_PER_EPOCH, EPOCHS = 60, 2
CHECKPOINT_SECONDS = 0.1  # the trainer saves at its first step this long after the last save
SLICE_SECONDS = 0.03  # how long the job runs between two looks


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("kill")
    prepare("mnist_binarized", {"seed": 57, "train_size": 8 * STEPS_PER_EPOCH, "val_size": 16, "test_size": 8},
            tmp / "data" / "prepared" / "mnist_binarized")
    model = {k: v for k, v in TINY["draw"].items() if k != "image_size"}
    train = {"epochs": EPOCHS, "batch_size": 8, "warmup_steps": 5, "log_every": 10}
    params = {"train": {}, "models": {"draw": {"arch": "draw", "task": "mnist_binarized", "model": model,
                                               "train": train}}}
    (tmp / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp


def command(root: Path, out: Path, processes: int) -> list[str]:
    worker = [WORKER, str(root), str(out), "--model", "draw"]
    if processes == 1:
        return [sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(processes),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *worker]


def run(cmd: list[str], env: dict) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def saved_state(out: Path) -> dict | None:
    trainer = out / "checkpoint" / "last" / "trainer.pt"
    try:
        return torch.load(trainer, weights_only=False)["state"]
    except (FileNotFoundError, RuntimeError, EOFError):  # not written yet, or renamed under us
        return None


def freeze_mid_epoch(proc: subprocess.Popen, out: Path) -> dict | None:
    """Leave the job frozen (SIGSTOP) just after a mid-epoch checkpoint at step >= 20 and return that state.

    Once the first checkpoint is on disk the job runs in short slices, frozen in between while its checkpoint is
    read. Each freeze lasts at least the checkpoint interval, so a save is due at the job's next step and every
    slice writes one, however fast the machine: a job left to run freely can finish between two looks (on CI the
    one-process run once did).
    """
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and saved_state(out) is None:
        time.sleep(0.005)
    while time.monotonic() < deadline and proc.poll() is None:
        signal_tree(proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        state = saved_state(out)
        if state and 20 <= state["step"] < STEPS_PER_EPOCH * EPOCHS and state["step"] % STEPS_PER_EPOCH:
            return state
        time.sleep(max(0.0, CHECKPOINT_SECONDS - (time.monotonic() - frozen)))
        signal_tree(proc.pid, signal.SIGCONT)
        time.sleep(SLICE_SECONDS)
    return None


@pytest.mark.parametrize("processes", [1, 2])
def test_sigkill_mid_epoch_then_rerun_equals_uninterrupted_run(root, tmp_path, processes):
    env = venv_env(root)
    env["PYTHONPATH"] = str(ROOT)
    env["ATTNZOO_CHECKPOINT_SECONDS"] = str(CHECKPOINT_SECONDS)
    full, killed = tmp_path / "full", tmp_path / "killed"
    run(command(root, full, processes), env)

    proc = subprocess.Popen(command(root, killed, processes), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    at_kill = freeze_mid_epoch(proc, killed)
    assert at_kill is not None and proc.poll() is None, "training ended before it could be killed"
    kill_tree(proc.pid)  # the whole job, torchrun and its workers alike
    proc.wait()
    assert saved_state(killed)["step"] == at_kill["step"]  # nothing was written after the freeze
    assert at_kill["step"] % STEPS_PER_EPOCH != 0, at_kill  # mid-epoch: the data position matters
    assert at_kill["mlflow_run_id"]

    out = run(command(root, killed, processes), env)
    assert f"resuming draw from step {at_kill['step']}" in out
    final = saved_state(killed)
    assert final["step"] == STEPS_PER_EPOCH * EPOCHS
    assert final["mlflow_run_id"] == at_kill["mlflow_run_id"]  # the same MLflow run continues
    a = load_file(str(full / "checkpoint" / "last" / "model.safetensors"))
    b = load_file(str(killed / "checkpoint" / "last" / "model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # that run holds the whole learning-rate curve, before and after the kill
    con = sqlite3.connect(root / "mlflow.db")
    steps = [s for (s,) in con.execute("select step from metrics where key = 'lr' and run_uuid = ? order by step",
                                       (final["mlflow_run_id"],))]
    assert steps[0] == 10 and steps[-1] == STEPS_PER_EPOCH * EPOCHS
    assert set(steps) == set(range(10, STEPS_PER_EPOCH * EPOCHS + 1, 10))
