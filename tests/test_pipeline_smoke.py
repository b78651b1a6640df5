"""Smoke test: the README's main command (``make repro``: ``attnzoo repro`` with a job per core) on a
temporary copy of the repository with tiny params, after which plain ``dvc repro`` has nothing to do."""

from __future__ import annotations

import json
import math
import re
import sqlite3
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY, copy_repo, venv_env

pytestmark = pytest.mark.slow

# 550 pairs of LibreOffice help paragraphs (MPL-2.0) from 90 help pages, as a user's own corpus.
SMOKE_CORPUS = str(Path(__file__).resolve().parent / "data" / "smoke_de_en.tsv")

# One entry per architecture, plus the entries a task needs (every report@<task> has a model) and
# those whose distinct pipeline path no other test runs: bahdanau_none (no alignment plots),
# rnn_parity (act: false), draw_none (no read/write windows in the plots). Dropped, each variant's
# path is covered elsewhere (on this 2-core machine each entry costs about a minute here):
#   luong_dot, luong_general, luong_concat -> luong_local_p here (same evaluate/report code);
#       test_layers::test_luong_scores_match_eq_8 (dot, general, concat scores);
#       test_registry::test_luong_variants_export_with_parity (dot/global, concat/local_m, general/local_p)
#       and the test_registry tests on TINY luong (general/global: forward, overfit, export parity)
#   sat_hard -> test_show_attend_tell::test_hard_attention_objective (REINFORCE),
#       ::test_reinforce_trains_attention_but_not_the_cnn, ::test_both_variants_export_with_parity[hard-argmax];
#       sat_soft here runs the same evaluate code
#   attention_ocr -> ocr_rcnn here (its recursive CNN, same evaluate code); recursions 0 is TINY's
#       default in test_registry (forward, overfit, export parity)
#   speech_content -> test_recognition::test_speech_padded_batch_decodes_each_utterance_as_alone_and_learns
#       [content], ::test_location_aware_attention_reads_the_previous_alignment_and_content_does_not;
#       test_registry::test_speech_attention_variants_export_with_parity[content];
#       speech_location here runs the same evaluate code
KEEP = ["bahdanau", "bahdanau_none", "luong_local_p", "transformer", "ntm", "ntm_repeat_copy", "ntm_recall",
        "pointer_sort", "pointer_hull", "act_parity", "rnn_parity", "neural_programmer", "sat_soft", "ram",
        "ram_cluttered", "draw", "draw_none", "ocr_rcnn", "speech_location"]
# Entries whose tune@ runs a real (local Ray) search here; the others keep an empty search space,
# so their tune@ writes an empty tuned.yaml without starting Ray. A real search takes both slots
# (about a minute of the run's wall time each on this machine), and its plumbing is the same for
# every model: each model's training loop runs in its train@ stage, and tests/test_ray_cluster.py
# runs tune@ on a two-node cluster with failing trials.
TUNED = ["ntm"]


def tiny_params(params: dict, keep: list[str] = KEEP) -> dict:
    """Tiny data and models for ``keep`` (tasks no kept model uses are dropped)."""
    params["tasks"]["copy"].update(train_size=3000, val_size=64, test_size=32)
    # A user's own corpus (SMOKE_CORPUS) instead of the Debian download, which is the real pipeline's;
    # tests/test_corpus_*.py cover each source's parsing.
    params["tasks"]["translation_de_en"].update(vocab_size=400, corpus=SMOKE_CORPUS, val_size=40, test_size=40,
                                                max_doc_share=0.25, dict_test_size=0)
    for task in ("sort", "convex_hull", "repeat_copy", "associative_recall"):
        params["tasks"][task].update(train_size=500, val_size=32, test_size=16)
    params["tasks"]["parity"].update(train_size=1000, val_size=64, test_size=300)
    params["tasks"]["table_qa"].update(train_size=500, val_size=64, test_size=300)
    for task in ("mnist_captions", "mnist_translated60", "mnist_cluttered60", "mnist_binarized"):
        params["tasks"][task].update(train_size=300, val_size=32, test_size=32)
    params["tasks"]["ocr_words"].update(train_size=200, val_size=32, test_size=32)
    # 192 utterances: 12 steps of 16 in the one epoch, as every other task (the learning curves' rows)
    params["tasks"]["spoken_digits"].update(train_size=192, val_size=16, test_size=16, test_long_size=8)
    # One pass over each 2-point grid: still two trials (child runs) per model, in one wave on 2 cores.
    params["tune"].update(num_samples=1, max_steps=6, eval_every=3)
    params["models"] = {name: params["models"][name] for name in keep}
    if keep is KEEP:
        assert {e["task"] for e in params["models"].values()} == set(params["tasks"]), "a task lost its last model"
    params["tasks"] = {task: spec for task, spec in params["tasks"].items()
                       if task in {e["task"] for e in params["models"].values()}}
    for name, entry in params["models"].items():
        if name not in TUNED:
            entry["search_space"] = {}
        entry["model"] = {**entry.get("model", {}), **TINY[entry["arch"]]}
        for key in ("src_vocab", "tgt_vocab", "input_size", "output_size", "vocab_size", "image_size", "height"):
            entry["model"].pop(key, None)  # these come from the prepared data
        # A model's own tune budget (RAM, NTM recall) would override the tiny one above; the key stays
        # (empty) because tune@ lists models.<name>.tune among its params and DVC needs it present.
        entry["tune"] = {}
        # A 12-step walking NTM reads with weights ~1e3 times more sensitive to rounding than a
        # plain one: ORT and PyTorch differ by up to 7e-4 there, beyond the real 1e-4 gate. That
        # path's parity is tested in test_registry (tiny, untrained) and gated at export on the
        # trained model (2e-5); here the pipeline runs the plain NTM.
        entry["model"].pop("write_walk", None)
        entry["train"] = {**entry.get("train", {}), "max_steps": 12, "eval_every": 6, "log_every": 3, "epochs": 1,
                          "batch_size": 16, "warmup_steps": 2}
        entry["evaluate"] = {**entry.get("evaluate", {}), "max_sentences": 24, "max_images": 24, "max_utterances": 12,
                             "beam": 3,
                             "beam_examples": 8}
    return params


def run(cmd: list[str], cwd: Path, env: dict) -> str:
    # A guard against a hung stage, not a speed target: on the 2-core development machine the
    # tiny pipeline with all 25 models ran past 30 minutes, stopped at its last, recognition models.
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def attnzoo_repro(repo: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    """``attnzoo repro ARGS`` as a user runs it (``make repro`` is ``--jobs <cores>``)."""
    return subprocess.run(["python", "-m", "pipeline.cli", "repro", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=3600)


def summary(repo: Path) -> dict:
    """The runner's record of its last run: each stage's state, seconds, node and threads."""
    return json.loads((repo / ".dvc" / "tmp" / "repro" / "summary.json").read_text())


def assert_dvc_clean(repo: Path, env: dict, *targets: str) -> None:
    out = run(["dvc", "status", *targets], repo, env)
    assert "up to date" in out and "changed" not in out, out


def test_make_repro_end_to_end_then_dvc_repro_has_nothing_to_do(tmp_path):
    """Every architecture through every stage with ``attnzoo repro --jobs 2``: a training that cannot
    start stops only its branch, a re-run once it is fixed runs only that branch, and afterwards
    plain ``dvc status`` / ``dvc repro`` find nothing to do; a model trained in parallel scores what
    a sequential ``dvc repro`` of it scores."""
    repo = copy_repo(tmp_path / "repo")
    env = venv_env(repo)
    params = tiny_params(yaml.safe_load((repo / "params.yaml").read_text()))
    good = yaml.safe_dump(params, sort_keys=False)
    broken = yaml.safe_load(good)
    broken["models"]["pointer_sort"]["model"]["hidden"] = -1  # its training cannot start
    (repo / "params.yaml").write_text(yaml.safe_dump(broken, sort_keys=False))
    for path in ("dvc.lock", "runs", "results", "reports"):
        subprocess.run(["rm", "-rf", str(repo / path)], check=True)
    run(["git", "init", "-q"], repo, env)

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

    # Fixed, a re-run continues: only the failed branch runs (its tune@ too: its params changed back).
    (repo / "params.yaml").write_text(good)
    second = attnzoo_repro(repo, env, "--jobs", "2")
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
        for graph in meta["graphs"]:
            assert (repo / "model_repository" / name / "1" / f"{graph}.onnx").stat().st_size > 1000
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
