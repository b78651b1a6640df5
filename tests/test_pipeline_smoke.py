"""Smoke test: the README's main command (``make repro``: ``attnzoo repro`` with a job per core) on a
temporary copy of the repository with tiny params, after which plain ``dvc repro`` has nothing to do."""

from __future__ import annotations

import json
import math
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import yaml

from pipeline import profiles
from tests.conftest import LOCAL_RAY, venv_env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(LOCAL_RAY)]  # Ray without a cluster: tests/conftest.py

# The smoke profile (profiles/smoke.yaml, `attnzoo repro --profile smoke`): tiny data and models for
# one entry per architecture and each distinct pipeline path; it lists why each dropped variant's
# path is covered by a kept one. On this 2-core machine each entry costs about a minute here. The
# dropped variants' own code is covered elsewhere:
#   luong_dot, luong_general, luong_concat: test_layers::test_luong_scores_match_eq_8 (dot, general,
#       concat scores); test_registry::test_luong_variants_export_with_parity
#   sat_hard: test_show_attend_tell::test_hard_attention_objective (REINFORCE),
#       ::test_reinforce_trains_attention_but_not_the_cnn, ::test_both_variants_export_with_parity[hard-argmax]
#   attention_ocr: recursions 0 is TINY's default in test_registry (forward, overfit, export parity)
#   speech_content: test_recognition::test_speech_padded_batch_decodes_each_utterance_as_alone_and_learns
#       [content]; test_registry::test_speech_attention_content_variant_exports_with_parity
SMOKE = profiles.load("smoke")
KEEP = SMOKE["keep"]
TUNED = SMOKE["tuned"]  # a real Ray search takes both slots here; tests/test_ray_cluster.py runs it on two nodes
SMOKE_CORPUS = str(profiles.ROOT / SMOKE["tasks"]["translation_de_en"]["corpus"])


def tiny_params(params: dict, keep: list[str] | None = None) -> dict:
    """params.yaml with the smoke profile applied, narrowed to ``keep`` (tasks no kept model uses dropped)."""
    return profiles.apply(params, SMOKE, keep)


def run(cmd: list[str], cwd: Path, env: dict) -> str:
    # A guard against a hung stage, not a speed target: on the 2-core development machine the
    # tiny pipeline with all 25 models ran past 30 minutes, stopped at its last, recognition models.
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def attnzoo_repro(repo: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    """``attnzoo repro ARGS`` as a user runs it (``make repro`` is ``--jobs <cores>``)."""
    return subprocess.run(["python", "-m", "pipeline.runner.cli", "repro", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=3600)


def summary(repo: Path) -> dict:
    """The runner's record of its last run: each stage's state, seconds, node and threads."""
    return json.loads((repo / ".dvc" / "tmp" / "repro" / "summary.json").read_text())


def assert_dvc_clean(repo: Path, env: dict, *targets: str) -> None:
    out = run(["dvc", "status", *targets], repo, env)
    assert "up to date" in out and "changed" not in out, out


def checkout_state() -> tuple[str, bytes, bool]:
    """What a profile run must not change in the checkout: git's view, dvc.lock, the MLflow store."""
    status = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all", "--",
                             "dvc.lock", "runs", "results", "reports", "model_repository", "mlflow.db"],
                            cwd=profiles.ROOT, capture_output=True, text=True, check=True).stdout
    mlflow_db = profiles.ROOT / "mlflow.db"
    return status, (profiles.ROOT / "dvc.lock").read_bytes(), mlflow_db.exists() and mlflow_db.stat().st_mtime


def assert_graphs_score_as_pytorch(repo: Path, params: dict) -> None:
    """For the first entry of each architecture: its task's evaluation of the exported fp32 graphs on
    onnxruntime (greedy through the serving loop, beam through the export specs; the NTM's bits from
    the served model, DRAW's bound from its ``infer`` graph) gives every test metric evaluate@ wrote
    with PyTorch, exactly; and the int8 graphs quantize@ scored hold integer MatMuls, convolutions
    left in fp32 (params.yaml ``quantize.op_types``), and score what quantize@ recorded."""
    import onnx

    from pipeline.checkpoint import load_model
    from pipeline.config import resolve
    from pipeline.stages.quantize import evaluate_graphs

    firsts = {}
    for name, entry in params["models"].items():
        firsts.setdefault(entry["arch"], name)
    shipped = yaml.safe_load((profiles.ROOT / "params.yaml").read_text())["models"]
    assert set(firsts) == {e["arch"] for e in shipped.values()}  # every architecture
    for name in firsts.values():
        run_dir = repo / "runs" / name
        model, _ = load_model(run_dir / "checkpoint" / "best")
        got = evaluate_graphs(model, resolve(name, params=params, root=repo), run_dir / "onnx", threads=1)
        wrote = json.loads((run_dir / "metrics.json").read_text())
        want = {k: v for k, v in wrote.items() if k not in ("eval_seconds", "parameters", "train_seconds")
                and isinstance(v, (int, float)) and not isinstance(v, bool)}
        assert len(want) >= 1 and got == want, name
    ocr = repo / "runs" / firsts["attention_ocr"]
    ops = {n.op_type for g in (ocr / "int8").glob("*.onnx") for n in onnx.load(str(g)).graph.node}
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= ops and "ConvInteger" not in ops, ops
    int8 = json.loads((ocr / "int8_metrics.json").read_text())
    model, _ = load_model(ocr / "checkpoint" / "best")
    assert evaluate_graphs(model, resolve(ocr.name, params=params, root=repo), ocr / "int8", threads=1) == \
        int8["metrics"]  # the int8 graphs score what quantize@ recorded
    (cond,) = int8["gate"]["conditions"]  # held to evaluate@'s fp32 figure, worse by what the two differ
    fp32 = json.loads((ocr / "metrics.json").read_text())["seq_acc_beam"]
    assert (cond["metric"], cond["fp32"], cond["int8"]) == ("seq_acc_beam", fp32, int8["metrics"]["seq_acc_beam"])
    assert cond["worse_by"] == round(fp32 - cond["int8"], 6)
    assert cond["passed"] == (cond["worse_by"] <= int8["gate"]["tolerance"]) == int8["gate"]["passed"]


def test_make_repro_end_to_end_then_dvc_repro_has_nothing_to_do(tmp_path):
    """Every architecture through every stage with ``attnzoo repro --jobs 2``: a training that cannot
    start stops only its branch, a re-run once it is fixed runs only that branch, and afterwards
    plain ``dvc status`` / ``dvc repro`` find nothing to do; a model trained in parallel scores what
    a sequential ``dvc repro`` of it scores."""
    repo = profiles.lay_out(profiles.ROOT, tmp_path / "repo", "smoke")  # as `attnzoo repro --profile smoke` does
    env = venv_env(repo)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert {e["task"] for e in params["models"].values()} == set(params["tasks"]) == set(
        yaml.safe_load((profiles.ROOT / "params.yaml").read_text())["tasks"]), "a task lost its last model"
    broken = yaml.safe_load((repo / "params.yaml").read_text())
    broken["models"]["pointer_sort"]["model"]["hidden"] = -1  # its training cannot start
    (repo / "params.yaml").write_text(yaml.safe_dump(broken, sort_keys=False))

    first = attnzoo_repro(repo, env, "--jobs", "2")  # what `make repro` runs on this 2-core machine
    assert first.returncode == 1, first.stdout[-4000:] + first.stderr[-4000:]
    states = summary(repo)
    assert states["train@pointer_sort"]["state"] == "failed", states["train@pointer_sort"]
    branch = {f"{kind}@pointer_sort" for kind in ("evaluate", "export", "quantize", "publish")} | {"report@sort"}
    assert {stage for stage, row in states.items() if row["state"] == "blocked"} == branch
    others = set(states) - branch - {"train@pointer_sort"}
    assert {states[stage]["state"] for stage in others} == {"ran"}, {s: states[s] for s in others}
    assert "failed: train@pointer_sort" in first.stdout and "train_pointer_sort.log" in first.stdout, first.stdout
    assert "hidden" in (repo / ".dvc" / "tmp" / "repro" / "train_pointer_sort.log").read_text()

    # Fixed by the user's command from the checkout: `attnzoo repro --profile smoke` lays the profile's
    # params.yaml out again in the same work folder and goes on, leaving the checkout as it was. Only
    # the failed branch runs (its tune@ too: its params changed back).
    before = checkout_state()
    second = subprocess.run([sys.executable, "-m", "pipeline.runner.cli", "repro", "--profile", "smoke", "--workdir",
                             str(repo), "--jobs", "2"], cwd=profiles.ROOT, capture_output=True, text=True,
                            timeout=3600, env={k: v for k, v in env.items() if k not in ("PYTHONPATH",
                                                                                          "MLFLOW_TRACKING_URI")})
    assert checkout_state() == before
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    ran = {stage for stage, row in summary(repo).items() if row["state"] == "ran"}
    assert {"train@pointer_sort", "publish@pointer_sort", "report@sort"} <= ran, ran
    assert ran <= branch | {"tune@pointer_sort", "train@pointer_sort"}, ran
    models = list(params["models"])
    for name in models:
        metrics = json.loads((repo / "runs" / name / "metrics.json").read_text())
        parity = json.loads((repo / "runs" / name / "parity.json").read_text())
        assert parity["passed"] is True
        cases = parity["providers"]["CPUExecutionProvider"]["cases"]
        assert len(cases) >= 3 and all(c["passed"] for c in cases)
        assert "bar" in metrics and isinstance(metrics["bar"]["passed"], bool)
        meta = json.loads((repo / "model_repository" / name / "1" / "metadata.json").read_text())
        assert meta["version"] == 1 and meta["dvc"], meta
        for graph in meta["graphs"]:  # a real graph, whole
            proto = onnx.load(str(repo / "model_repository" / name / "1" / f"{graph}.onnx"))
            onnx.checker.check_model(proto)
            assert proto.graph.node, (name, graph)
        assert (repo / "runs" / name / "tuned.yaml").exists()
    assert (repo / "runs" / "bahdanau" / "plots" / "alignment_0.png").exists()
    assert (repo / "runs" / "ntm" / "plots" / "memory_trace_len20.png").exists()
    assert "bahdanau_none" in (repo / "reports" / "translation_de_en.md").read_text()
    for task in params["tasks"]:  # every task's report lists each of its models
        report = (repo / "reports" / f"{task}.md").read_text()
        assert all(name in report for name, e in params["models"].items() if e["task"] == task), task
    # Learning curves, the train stage's DVC plots: `dvc plots show` draws each model's losses over steps.
    shown = json.loads(run(["dvc", "plots", "show", "--json"], repo, env))["data"]
    for name in models:
        for curve, steps in (("train_loss", ["3", "6", "9", "12"]), ("val_loss", ["6", "12"])):
            (plot,) = shown[f"runs/{name}/learning_curves/{curve}.csv"]
            values = plot["content"]["data"]["values"]
            assert [v["step"] for v in values] == steps, (name, curve)
            assert all(math.isfinite(float(v[curve])) for v in values), (name, curve)
    # One training run per model, child runs for tune trials, a registered version per model and one
    # per int8 variant that passed its gate (model <name>-int8).
    db = sqlite3.connect(repo / "mlflow.db")
    names = [r[0] for r in db.execute("select name from registered_models")]
    int8 = [f"{n}-int8" for n in models
            if json.loads((repo / "runs" / n / "int8_metrics.json").read_text())["gate"]["passed"]]
    assert int8 and sorted(names) == sorted(models + int8)
    assert all((repo / "model_repository" / n / "1" / "metadata.json").exists() for n in int8)
    parents = dict(db.execute("select run_uuid, value from tags where key = 'mlflow.parentRunId'"))
    assert len(parents) >= 2 * len(TUNED)  # every tune trial is a child run (2-point grids)
    assert all(params["models"][name]["search_space"] for name in TUNED)
    assert_graphs_score_as_pytorch(repo, params)
    # dvc.lock is what `dvc repro` writes: DVC finds nothing changed, its own repro runs no stage,
    # and neither does the runner.
    assert_dvc_clean(repo, env)
    out = run(["dvc", "repro"], repo, env)
    assert "Running stage" not in out, out
    third = attnzoo_repro(repo, env)
    assert third.returncode == 0 and "up to date" in third.stdout, third.stdout + third.stderr

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
