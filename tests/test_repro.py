"""``attnzoo repro`` on a two-node Ray cluster. The whole tiny pipeline in parallel, with a failure,
a resume and a sequential re-run to compare, is tests/test_pipeline_smoke.py; the scheduler on its
own is tests/test_repro_schedule.py.

The test runs the real runner as a user would (``python -m pipeline.runner.cli repro``) in a copy of the
repository with tiny params, and then asks DVC itself whether anything is left to do.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import copy_repo, venv_env
from tests.ray_cluster import ray_cluster
from tests.test_pipeline_smoke import assert_dvc_clean, attnzoo_repro, run, summary, tiny_params

pytestmark = pytest.mark.slow

def make_repo(dest: Path, keep: list[str]) -> tuple[Path, dict, dict]:
    repo = copy_repo(dest)
    env = venv_env(repo)
    params = tiny_params(yaml.safe_load((repo / "params.yaml").read_text()), keep)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for path in ("dvc.lock", "runs", "results", "reports"):
        subprocess.run(["rm", "-rf", str(repo / path)], check=True)
    run(["git", "init", "-q"], repo, env)
    return repo, env, params


def test_stages_run_as_ray_tasks_on_both_nodes_of_a_cluster(tmp_path):
    keep = ["rnn_parity", "pointer_sort"]
    repo, env, _ = make_repo(tmp_path / "repo", keep)
    targets = [f"train@{name}" for name in keep]
    with ray_cluster(nodes=2) as address:
        proc = attnzoo_repro(repo, env, "--ray", address, *targets)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    states = summary(repo)
    assert {row["state"] for row in states.values()} == {"ran"}, states
    assert len(states) == 8  # task_code, prepare, tune, train for each model
    nodes = {row["where"] for row in states.values()}
    assert len(nodes) == 2, states
    assert_dvc_clean(repo, env, *targets)
