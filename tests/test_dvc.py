"""DVC behaviour a cluster relies on, through real ``dvc`` commands on a temporary copy of the
repository reduced to one task (``copy``) and one tiny model (``ntm``):

- a change to the training code re-runs ``train@`` and trains again from step 0;
- ``prepare@`` is deterministic, so re-running it invalidates nothing downstream;
- outputs pushed to a shared-filesystem remote can be pulled into a fresh clone;
- a remote that refuses a push fails loudly and leaves the local cache intact.

The tests share one repository (one ``dvc repro train@ntm``) and run in file order; the last one
edits ``pipeline/training/loop.py``.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY, copy_repo, venv_env

pytestmark = pytest.mark.slow


def tiny_params(params: dict) -> dict:
    params["tasks"] = {"copy": {**params["tasks"]["copy"], "train_size": 400, "val_size": 32, "test_size": 16}}
    entry = params["models"]["ntm"]
    entry["model"] = {k: v for k, v in TINY["ntm"].items() if k not in ("input_size", "output_size")}
    entry["train"] = {**entry["train"], "max_steps": 12, "eval_every": 6, "epochs": 1, "batch_size": 16,
                      "warmup_steps": 2}
    # No search: tune@ntm writes an empty tuned.yaml without starting Ray (the questions here are DVC's;
    # the end-to-end run and tests/test_ray_cluster.py search for real).
    entry["search_space"] = {}
    entry["tune"] = {}  # tune@ lists models.<name>.tune among its params: DVC needs the key present
    params["models"] = {"ntm": entry}
    return params


def dvc(args: list[str], repo: Path, env: dict, ok: bool = True) -> subprocess.CompletedProcess:
    # The timeout guards against a hung stage on the shared 2-core machine, not a speed target.
    proc = subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    if ok:
        assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def lock_outs(repo: Path, stage: str) -> dict[str, str]:
    entry = yaml.safe_load((repo / "dvc.lock").read_text())["stages"][stage]
    return {o["path"]: o["md5"] for o in entry.get("outs", [])}


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dvc")
    repo = copy_repo(tmp / "repo")
    env = venv_env(repo)
    env.update(GIT_AUTHOR_NAME="test", GIT_AUTHOR_EMAIL="test@example.com",
               GIT_COMMITTER_NAME="test", GIT_COMMITTER_EMAIL="test@example.com")
    params = tiny_params(yaml.safe_load((repo / "params.yaml").read_text()))
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for path in ("dvc.lock", "runs", "results", "reports"):
        subprocess.run(["rm", "-rf", str(repo / path)], check=True)
    dvc(["git", "init", "-q"], repo, env)
    dvc(["dvc", "repro", "train@ntm"], repo, env)
    return repo, env


def test_prepare_is_deterministic(tiny_repo):
    # No run time, absolute path or unordered set in a prepared output: a forced re-run gives the
    # same hash, so it never retrains a model downstream.
    repo, env = tiny_repo
    first = lock_outs(repo, "prepare@copy")
    assert first
    dvc(["dvc", "repro", "--force", "--single-item", "prepare@copy"], repo, env)
    assert lock_outs(repo, "prepare@copy") == first
    out = dvc(["dvc", "status", "--with-deps", "train@ntm"], repo, env).stdout
    assert "Data and pipelines are up to date" in out, out


def test_remote_push_then_pull_in_a_fresh_clone(tiny_repo, tmp_path):
    # A local-path remote stands for a shared filesystem between cluster nodes.
    repo, env = tiny_repo
    dvc(["dvc", "repro", "train@ntm"], repo, env)  # a no-op in file order; up to date either way
    dvc(["dvc", "remote", "add", "-d", "store", str(tmp_path / "store")], repo, env)
    dvc(["git", "add", "-A"], repo, env)
    dvc(["git", "commit", "-qm", "tiny pipeline"], repo, env)
    dvc(["dvc", "push"], repo, env)
    clone = tmp_path / "clone"
    dvc(["git", "clone", "-q", str(repo), str(clone)], tmp_path, env)
    # Only the stages this file runs: the later ones (evaluate, export, publish, report) took over
    # 3 minutes for this tiny NTM on the 2-core machine, and unrun stages have nothing to pull.
    dvc(["dvc", "pull", "--with-deps", "train@ntm"], clone, env)
    out = dvc(["dvc", "status", "--with-deps", "train@ntm"], clone, env).stdout
    assert "Data and pipelines are up to date" in out, out
    for rel in ("data/prepared/copy/manifest.json", "runs/ntm/checkpoint/last/model.safetensors"):
        assert (clone / rel).read_bytes() == (repo / rel).read_bytes(), rel


def test_push_to_a_refusing_remote_fails_and_keeps_the_cache(tiny_repo, tmp_path):
    # Tests run as root, so a chmod-ed folder would not refuse: the remote's parent is a regular file.
    repo, env = tiny_repo
    (tmp_path / "not_a_folder").write_text("")
    remote = tmp_path / "not_a_folder" / "store"
    dvc(["dvc", "remote", "add", "broken", str(remote)], repo, env)
    proc = dvc(["dvc", "push", "-r", "broken"], repo, env, ok=False)
    message = proc.stdout + proc.stderr
    assert proc.returncode != 0, message
    assert "Not a directory" in message and str(remote) in message, message
    # attnzoo push: the same failure as one sentence naming the remote and the fix, exit 2; run as
    # `.venv/bin/attnzoo` is without the venv activated (no `dvc` on PATH)
    bare = {**env, "PATH": "/usr/bin:/bin"}
    proc = dvc([sys.executable, "-m", "pipeline.runner.cli", "push", "-r", "broken"], repo, bare, ok=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(errors) == 1 and "remote 'broken'" in errors[0] and str(remote) in errors[0], proc.stderr
    assert "Not a directory" in errors[0] and "dvc remote modify broken url" in errors[0], errors
    # Every cached output in the lock file is still in the local cache, down to each file of a folder.
    cache = repo / ".dvc" / "cache" / "files" / "md5"
    for stage, path in (("prepare@copy", "data/prepared/copy"), ("train@ntm", "runs/ntm/checkpoint")):
        md5 = lock_outs(repo, stage)[path]
        obj = cache / md5[:2] / md5[2:]
        assert obj.is_file() and md5.endswith(".dir"), (stage, path)
        for entry in json.loads(obj.read_text()):
            assert (cache / entry["md5"][:2] / entry["md5"][2:]).is_file(), (path, entry["relpath"])
    out = dvc(["dvc", "status", "--with-deps", "train@ntm"], repo, env).stdout
    assert "Data and pipelines are up to date" in out, out


def test_training_code_change_retrains_from_step_zero(tiny_repo):
    repo, env = tiny_repo
    with (repo / "pipeline" / "training" / "loop.py").open("a") as f:
        f.write("# a harmless change: the stage must still re-run and train afresh\n")
    status = dvc(["dvc", "status", "train@ntm"], repo, env).stdout
    assert "pipeline/training" in status, status
    # --single-item: tune@ntm depends on the loop too; train is the question.
    proc = dvc(["dvc", "repro", "--single-item", "train@ntm"], repo, env)
    out = proc.stdout + proc.stderr
    assert "Running stage 'train@ntm'" in out, out
    # The persisted checkpoint of the old code is at its last step: resuming it would train nothing.
    assert "resuming" not in out, out[-3000:]
    db = sqlite3.connect(repo / "mlflow.db")
    runs = [r for (r,) in db.execute(
        "select run_uuid from runs"
        " where run_uuid in (select run_uuid from tags where key = 'stage' and value = 'train')"
        " and run_uuid not in (select run_uuid from tags where key = 'mlflow.parentRunId') order by start_time")]
    assert len(runs) == 2, runs  # train@ntm's two runs
    for run in runs:  # each validated at steps 6 and 12: each trained all 12 steps
        steps = [s for (s,) in db.execute(
            "select step from metrics where run_uuid = ? and key = 'val_loss' order by step", (run,))]
        assert steps == [6, 12], (run, steps)
