"""docs/benchmarks.md and docs/gpu.md are references of current figures: the inference block is the render of the
committed docs/bench_inference.json, the GPU tables are the summaries of docs/gpu_check/*.json, the
list of int8 variants that are not published matches runs/*/int8_metrics.json, and it stays short,
undated and about the figures (no account of how the work went). Reads files only: fast."""

from __future__ import annotations

import json
import re
import subprocess

import bench_inference
import decode_bench
import gpu_check
import pytest
import train_efficiency

from tests.conftest import ROOT

DOC = ROOT / "docs" / "benchmarks.md"
GPU_DOC = ROOT / "docs" / "gpu.md"
GPU_REPORTS = sorted((ROOT / "docs" / "gpu_check").glob("*.json"))


def _text() -> str:
    return DOC.read_text()


def test_the_inference_block_is_the_render_of_the_committed_json():
    text = _text()
    block = text[text.index(bench_inference.START):text.index(bench_inference.END) + len(bench_inference.END)]
    assert block == bench_inference.rendered()
    # --check-docs agrees, and --render-docs would leave the file as it is.
    assert bench_inference.with_table(text, bench_inference.rendered()) == text


def test_the_block_names_the_machine_of_every_run_in_the_json():
    kept = json.loads((ROOT / "docs" / "bench_inference.json").read_text())
    block = bench_inference.rendered()
    machines = {r.get("machine") or kept["machine"] for r in kept["rows"]} | {kept["machine"]}
    for machine in machines:
        assert f" {machine}" in block, machine
    # one line per model and variant: every model of the JSON twice, fp32 and int8
    for row in kept["rows"]:
        lines = [line for line in block.splitlines() if re.match(rf"\| {re.escape(row['model'])}\W* \|", line)]
        assert [line.split(" | ")[2] for line in lines] == ["fp32", "int8"], row["model"]


def test_the_decode_table_is_the_render_of_the_committed_runs_of_one_plan():
    runs = json.loads((ROOT / "docs" / "peers_decode.json").read_text())
    assert decode_bench.table(runs) in _text()
    assert f"on the {runs['machine'].replace(', ', ' ', 1).rsplit(', ', 1)[0]}" in _text()  # the machine named
    # `decode_bench.py --all` is what made them: run i is the plan's i-th (threads, precision, engines)
    made = {r["run"]: (r["threads"], r["precision"]) for r in runs["rows"]}
    assert [made[i] for i in sorted(made)] == [(t, p) for t, p, _ in decode_bench.PLAN]
    for i, (_, _, engines) in enumerate(decode_bench.PLAN, 1):
        assert {r["engine"] for r in runs["rows"] if r["run"] == i} == set(engines)


def test_check_docs_exits_1_when_the_block_differs(tmp_path, monkeypatch):
    changed = tmp_path / "benchmarks.md"
    text = _text()
    start = text.index(bench_inference.START)
    changed.write_text(text[:start] + text[start:].replace("| fp32 |", "| fp32 (edited) |", 1))
    monkeypatch.setattr(bench_inference, "DOCS", changed)
    with pytest.raises(SystemExit) as stopped:
        bench_inference.main(["--check-docs"])
    assert stopped.value.code not in (None, 0)
    bench_inference.main(["--render-docs"])  # rewrites the block from the JSON, measuring nothing
    assert changed.read_text() == _text()


def _report(path) -> dict:
    """A docs/gpu_check JSON as gpu_check.summary_lines takes it (batch sizes are ints there)."""
    report = json.loads(path.read_text())
    report["timing"] = {m: {int(k) if k.isdigit() else k: v for k, v in t.items()}
                        for m, t in report["timing"].items()}
    return report


@pytest.mark.parametrize("path", GPU_REPORTS, ids=lambda p: p.stem)
def test_the_gpu_figures_are_those_of_docs_gpu_check(path):
    report = _report(path)
    text = GPU_DOC.read_text()
    heading = f"### {report['device']}\n"
    assert heading in text, report["device"]
    section = text[text.index(heading):]
    section = section[:section.index("\n### ", 1)] if "\n### " in section[1:] else section
    assert f"PyTorch {report['torch']}, onnxruntime {report['onnxruntime']}" in section
    assert f"docs/gpu_check/{path.name}" in section
    expected = [line for line in gpu_check.summary_lines(report, list(report["parity"]))
                if line.startswith("|") or line.startswith("Transformer (")]
    shown = [line for line in section.splitlines() if line.startswith("|") or line.startswith("Transformer (")]
    assert shown == expected
    # the commands above the tables name the models of the report, in its order
    commands = [line for line in section.splitlines() if line.startswith("bash scripts/gpu_check.sh")]
    named = [m for c in commands for m in c.split("--models ")[1].split("#")[0].split()]
    assert list(dict.fromkeys(named)) == report["models"]


def test_the_training_rates_climbing_are_those_of_the_h200_report():
    """docs/gpu.md's rates before and in the steady window are the committed H200 training row's."""
    train = json.loads((GPU_DOC.parent / "gpu_check" / "nvidia-h200.json").read_text())["train"]
    window = train["steady_window"]
    before = window["from_step"] / (train["seconds"] - window["seconds"])  # steps/s up to the window
    assert (f"{before:.1f} steps/s over its first {window['from_step']:,} steps, "
            f"{window['steps'] / window['seconds']:.1f} over the next {window['steps']:,})") in " ".join(
        GPU_DOC.read_text().split())  # the text as read, its line breaks aside


def test_every_gpu_report_has_a_section():
    headings = re.findall(r"^### (NVIDIA .+)$", GPU_DOC.read_text(), flags=re.M)
    assert sorted(headings) == sorted(json.loads(p.read_text())["device"] for p in GPU_REPORTS)


def test_the_int8_variants_said_unpublished_are_those_whose_gate_fails():
    text = " ".join(_text().split())
    said = text[text.index("it does not for "):]
    said = said[:said.index("no quality bar to compare on")]
    named = set(re.findall(r"`([a-z_0-9]+)`", said))
    failing = {p.parent.name for p in (ROOT / "runs").glob("*/int8_metrics.json")
               if not json.loads(p.read_text())["gate"]["passed"]}
    assert named == failing


def test_the_training_table_agrees_with_its_parameter_count():
    metrics = json.loads((ROOT / "runs" / "sat_soft" / "metrics.json").read_text())
    assert f"{metrics['parameters']:,} parameters" in " ".join(_text().split())


@pytest.mark.parametrize(("doc", "most_lines"), [(DOC, 360), (GPU_DOC, 150)], ids=lambda v: getattr(v, "stem", v))
def test_short_undated_and_about_the_figures(doc, most_lines):
    text = doc.read_text()
    assert len(text.splitlines()) <= most_lines
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert headings and not [h for h in headings if re.search(r"20\d\d-\d\d-\d\d", h)]
    assert not re.search(r"#\d+", text), re.search(r".{30}#\d+.{10}", text)
    for word in (r"\bsessions?\b", r"\blanded\b", r"\blent\b", r"\bthis task\b"):
        found = re.search(word, text, flags=re.I)
        assert found is None, text[max(0, found.start() - 60):found.end() + 20]


def test_the_training_efficiency_block_is_the_render_of_the_committed_json():
    text = _text()
    block = text[text.index(train_efficiency.START):text.index(train_efficiency.END) + len(train_efficiency.END)]
    assert block == train_efficiency.rendered()


def test_an_entry_below_half_the_peak_is_told_apart_by_its_bound():
    """Below 50 % of peak with a bound (products at the peak) over 50 %, the products are what is slow; with a
    bound under it, the work outside them is."""

    def ceiling(bound: float) -> dict:
        return {"outside": [{"op": "copy_", "share": 0.1}], "peak_gflops_now": 200.0, "bound_pct": bound,
                "gemm_time_share": 0.6, "ceiling_pct": 100.0}

    kept = {"entries": {"a": {"fast_pct_of_peak": 55.0, "ceiling": ceiling(60.0)},
                        "b": {"fast_pct_of_peak": 45.0, "ceiling": ceiling(58.0)},
                        "c": {"fast_pct_of_peak": 30.0, "ceiling": ceiling(40.0)},
                        "d": {"fast_pct_of_peak": 40.0}}}  # no GEMM figures: not counted
    text = train_efficiency._ceilings(kept)
    assert text.startswith(" The 3 entries with GEMM figures (a, b, c) train at 30–55 % of peak")
    assert ("1 of them at 50 % or more; b below it with a bound of 58 %: their products run slower within the "
            "step than alone at the same shapes; for c 50 % needs that work cut, not faster products.") in text
    kept["entries"] = {"a": kept["entries"]["a"]}
    assert ": all of them at 50 % or more." in train_efficiency._ceilings(kept)


def test_every_entry_has_its_efficiency_figures_and_the_projection_is_theirs():
    from pipeline.config import load_params

    kept = json.loads(train_efficiency.JSON_OUT.read_text())
    assert kept["cpu"]["model_name"] and kept["cpu"]["family"] and kept["cpu"]["model"]
    assert all(kept["peak"][p][t]["gflops"] > 0 for p in ("fp32", "bf16") for t in ("1", "2"))
    assert set(kept["entries"]) == set(load_params(ROOT)["models"])
    for name, e in kept["entries"].items():
        for key in ("baseline_steps", "baseline_steps_per_s", "steps", "steps_per_s", "compile_s", "gflop_per_step",
                    "peak_gflops", "outside_ops", "baseline_steps_per_s_2_threads", "learns_the_same"):
            assert key in e, (name, key)
        # the baseline's own run, as recorded when measured: its steps and validation curve (this tree's runs are
        # the new recipe's once retrained), which the fast step count and the rendered figures come from
        curve = e["baseline_val_curve"]
        assert curve and curve[-1][0] <= e["baseline_steps"] and all(a[0] < b[0] for a, b in zip(curve, curve[1:]))
        assert e["steps"] == train_efficiency.fast_steps(e["fast_settings"], e["baseline_steps"], curve), name
        if "max_steps" in e["fast_settings"]:  # a shorter budget: its own run met the entry's bar in those steps
            check = e["budget_check"]
            assert check["steps"] == e["steps"] and check["bar"] and all(c["passed"] for c in check["bar"]), name
            # and that run is the committed one (trained on the budget), as docs/results.md quotes it
            assert check == train_efficiency.budget_check(name, e, ROOT), name
    assert kept["projected"] == train_efficiency.projected(kept["entries"])
    # the baseline's runs were those of the commit measured against (runs/ is the same there as in this tree until
    # the retrain replaces it): each entry's recorded steps and curve are that commit's files
    baseline = kept["baseline_code"]
    shown = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{baseline}^{{commit}}"], capture_output=True)
    if shown.returncode == 0:  # a clone with the history (a shallow one lacks the commit)
        for name, e in kept["entries"].items():
            summary = subprocess.run(["git", "-C", str(ROOT), "show", f"{baseline}:runs/{name}/train_summary.json"],
                                     capture_output=True, text=True, check=True).stdout
            assert e["baseline_steps"] == json.loads(summary)["steps"], name


def test_a_budget_run_takes_a_new_max_steps_without_a_speed_run_and_refuses_other_changes(tmp_path, monkeypatch):
    """``--budget-run`` records a shorter budget's own run; a changed max_steps leaves the measured step rates alone,
    so the entry's steps, ratio and the projection follow params.yaml, while any other change asks for a speed run."""
    import yaml

    kept = json.loads(train_efficiency.JSON_OUT.read_text())
    out = tmp_path / "efficiency.json"
    out.write_text(json.dumps(kept))
    ntm = kept["entries"]["ntm"]
    run = tmp_path / "scratch" / "runs" / "ntm"
    run.mkdir(parents=True)
    (run / "train_summary.json").write_text(json.dumps({"steps": 6000, "best_val_loss": 0.002, "best_step": 6000}))
    bar = {"metric": "bit_errors_40", "op": "<=", "value": 1.0, "measured": 0.0, "passed": True}
    (run / "metrics.json").write_text(json.dumps({"bar": {"passed": True, "conditions": [bar]}}))
    # The recipe measured against this tree's: ntm's with another max_steps (and ntm's measured settings).
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    monkeypatch.setenv("BASELINE_PARAMS", str(ROOT / "params.yaml"))
    recipe = tmp_path / "params.yaml"
    monkeypatch.setenv("FAST_PARAMS", str(recipe))

    def with_ntm_train(train: dict) -> None:
        ntm_entry = {**params["models"]["ntm"], "train": {**params["models"]["ntm"]["train"], **train}}
        recipe.write_text(yaml.safe_dump({**params, "models": {**params["models"], "ntm": ntm_entry}}))

    with_ntm_train({**ntm["fast_settings"], "max_steps": 6000})
    args = ["--entries", "ntm", "--budget-run", str(tmp_path / "scratch"), "--out", str(out)]
    assert train_efficiency.main(args) == 0
    got = json.loads(out.read_text())
    e = got["entries"]["ntm"]
    assert e["steps"] == 6000 and e["fast_settings"]["max_steps"] == 6000
    assert e["steps_per_s"] == ntm["steps_per_s"] and e["baseline_steps_per_s"] == ntm["baseline_steps_per_s"]
    assert e["ratio"] == round((ntm["baseline_steps"] / ntm["baseline_steps_per_s"])
                               / (6000 / ntm["steps_per_s"] + ntm["compile_s"]), 2) > ntm["ratio"]
    assert e["budget_check"]["steps"] == 6000 and e["budget_check"]["bar"] == [bar]
    # the committed run's validation by the step the default recipe reaches in the fast run's time
    reached = 6000 * ntm["baseline_steps_per_s"] / ntm["steps_per_s"]
    assert 0 < e["budget_check"]["committed_at_equal_time"]["step"] <= reached
    assert got["projected"] == train_efficiency.projected(got["entries"])
    assert got["projected"]["fast_s"] < kept["projected"]["fast_s"]
    # Another setting changed: the measured rate is not this recipe's.
    with_ntm_train({"precision": "bf16", "max_steps": 6000})
    with pytest.raises(train_efficiency.cli_errors.ScriptError,
                       match=r"^ntm's settings in params.yaml differ from those measured by more "
                             r"than max_steps; measure it again with --entries ntm$"):
        train_efficiency.main(args)


def test_a_validation_accuracy_quoted_from_a_learning_curve_is_the_curves():
    """"N % at step S (`runs/<entry>/learning_curves/val_loss.csv`)": the file's val_token_acc at that step."""
    import csv

    quoted = re.findall(r"([\d.]+) % at step ([\d,]+) \(`(runs/\w+/learning_curves/val_loss\.csv)`\)",
                        " ".join(_text().split()))
    assert quoted
    for pct, step, path in quoted:
        with open(ROOT / path) as f:
            acc = {int(r["step"]): float(r["val_token_acc"]) for r in csv.DictReader(f)}
        assert round(100 * acc[int(step.replace(",", ""))], 1) == float(pct), (path, step, pct)
