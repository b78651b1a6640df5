"""``attnzoo repro``: the tiny pipeline in parallel (a failure, a resume), then on a two-node Ray cluster.

Each test runs the real runner as a user would (``python -m pipeline.cli repro``) in a copy of the
repository with tiny params, and then asks DVC itself whether anything is left to do.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import copy_repo, venv_env
from tests.ray_cluster import ray_cluster
from tests.test_pipeline_smoke import run, tiny_params

pytestmark = pytest.mark.slow

MODELS = ["rnn_parity", "pointer_sort", "ntm"]  # three tasks: three independent branches


def make_repo(dest: Path, keep: list[str]) -> tuple[Path, dict, dict]:
    repo = copy_repo(dest)
    env = venv_env(repo)
    params = tiny_params(yaml.safe_load((repo / "params.yaml").read_text()), keep)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for path in ("dvc.lock", "runs", "results", "reports"):
        subprocess.run(["rm", "-rf", str(repo / path)], check=True)
    run(["git", "init", "-q"], repo, env)
    return repo, env, params


def attnzoo_repro(repo: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["python", "-m", "pipeline.cli", "repro", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=1800)


def summary(repo: Path) -> dict:
    return json.loads((repo / ".dvc" / "tmp" / "repro" / "summary.json").read_text())


def assert_dvc_clean(repo: Path, env: dict, *targets: str) -> None:
    out = run(["dvc", "status", *targets], repo, env)
    assert "up to date" in out and "changed" not in out, out


def test_parallel_run_with_a_failure_resumes_and_leaves_dvc_nothing_to_do(tmp_path):
    repo, env, params = make_repo(tmp_path / "repo", MODELS)
    good = yaml.safe_dump(params, sort_keys=False)
    # A training that cannot start: its branch stops, the other two branches finish.
    params["models"]["pointer_sort"]["model"]["hidden"] = -1
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    first = attnzoo_repro(repo, env, "--jobs", "2")
    assert first.returncode == 1, first.stdout + first.stderr
    states = summary(repo)
    assert states["train@pointer_sort"]["state"] == "failed", states["train@pointer_sort"]
    for stage in ("evaluate@pointer_sort", "export@pointer_sort", "quantize@pointer_sort", "publish@pointer_sort",
                  "report@sort"):
        assert states[stage]["state"] == "blocked", (stage, states[stage])
    for name, task in (("rnn_parity", "parity"), ("ntm", "copy")):
        for kind in ("prepare", "tune", "train", "evaluate", "export", "quantize", "publish", "report"):
            stage = f"{kind}@{task}" if kind in ("prepare", "report") else f"{kind}@{name}"
            assert states[stage]["state"] == "ran", (stage, states[stage])
    assert "failed: train@pointer_sort" in first.stdout and "train_pointer_sort.log" in first.stdout, first.stdout
    assert "hidden" in (repo / ".dvc" / "tmp" / "repro" / "train_pointer_sort.log").read_text()

    # Fixed, a re-run continues: only the failed branch runs.
    (repo / "params.yaml").write_text(good)
    second = attnzoo_repro(repo, env, "--jobs", "2")
    assert second.returncode == 0, second.stdout + second.stderr
    ran = {stage for stage, row in summary(repo).items() if row["state"] == "ran"}
    assert {"train@pointer_sort", "publish@pointer_sort", "report@sort"} <= ran, ran
    kinds = ("tune", "train", "evaluate", "export", "quantize", "publish")
    branch = {f"{k}@pointer_sort" for k in kinds} | {"report@sort"}
    assert ran <= branch, ran

    # dvc.lock is what `dvc repro` writes: DVC finds nothing to do, and neither does the runner.
    assert_dvc_clean(repo, env)
    out = run(["dvc", "repro"], repo, env)
    assert "Running stage" not in out, out
    third = attnzoo_repro(repo, env)
    assert third.returncode == 0 and "up to date" in third.stdout, third.stdout + third.stderr
    for name in MODELS:
        metrics = json.loads((repo / "runs" / name / "metrics.json").read_text())
        assert isinstance(metrics["bar"]["passed"], bool), metrics
        assert json.loads((repo / "runs" / name / "parity.json").read_text())["passed"] is True
        assert (repo / "model_repository" / name / "1" / "metadata.json").exists()

    # A model trained by the runner scores what a sequential `dvc repro` of it scores, with the
    # thread count the runner gave each stage (its log's first line: a share of the cores, or all
    # of them when nothing else could run beside it).
    parallel = json.loads((repo / "runs" / "rnn_parity" / "metrics.json").read_text())
    subprocess.run(["rm", "-rf", str(repo / "runs" / "rnn_parity" / "checkpoint")], check=True)
    for stage in ("train@rnn_parity", "evaluate@rnn_parity"):
        header = (repo / ".dvc/tmp/repro" / f"{stage.replace('@', '_')}.log").read_text().splitlines()[0]
        threads = re.fullmatch(rf"# attnzoo repro: {stage}, (\d+) thread\(s\)", header).group(1)
        seq_env = {**env, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        run(["dvc", "repro", "-f", "-s", stage], repo, seq_env)
    sequential = json.loads((repo / "runs" / "rnn_parity" / "metrics.json").read_text())
    timing = {k for k in parallel if k.endswith("_seconds")}
    def scores(metrics: dict) -> dict:
        return {k: v for k, v in metrics.items() if k not in timing}

    assert scores(sequential) == scores(parallel)
    assert len(parallel) - len(timing) >= 5, parallel  # accuracy, loss, the bar, ... not just the timings


def test_stages_run_as_ray_tasks_on_both_nodes_of_a_cluster(tmp_path):
    keep = ["rnn_parity", "pointer_sort"]
    repo, env, _ = make_repo(tmp_path / "repo", keep)
    targets = [f"train@{name}" for name in keep]
    with ray_cluster(nodes=2) as address:
        proc = attnzoo_repro(repo, env, "--ray", address, *targets)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    states = summary(repo)
    assert {row["state"] for row in states.values()} == {"ran"}, states
    assert len(states) == 6  # prepare, tune, train for each model
    nodes = {row["where"] for row in states.values()}
    assert len(nodes) == 2, states
    assert_dvc_clean(repo, env, *targets)
