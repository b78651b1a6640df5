"""Stage ``evaluate@<model>``: test metrics, plots, and the quality bar.

Writes ``runs/<model>/metrics.json`` (DVC metrics), ``runs/<model>/plots/*.png`` (DVC plots and
MLflow artifacts) and ``results/<task>/<model>.json``, the model's row in the task report.
"""

from __future__ import annotations

import json
import shutil
import time

from pipeline import tracking
from pipeline.bars import check_bar
from pipeline.checkpoint import load_model
from pipeline.config import RunConfig, results_dir, trained
from pipeline.entry import RUN_HELP, exit_after, model_parser, run_cli
from pipeline.plots import by_length as plot_by_length
from pipeline.tasks import get_task


def evaluate(run: RunConfig) -> dict:
    model, _ = load_model(run.run_dir / "checkpoint" / "best")
    plots = run.run_dir / "plots"
    shutil.rmtree(plots, ignore_errors=True)
    plots.mkdir(parents=True)
    started = time.time()
    metrics, row = get_task(run.task).evaluate(model, run, plots)
    metrics["eval_seconds"] = round(time.time() - started, 1)
    summary_path = run.run_dir / "train_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    metrics["parameters"] = sum(p.numel() for p in model.parameters())
    metrics["train_seconds"] = summary.get("train_seconds")
    metrics["bar"] = check_bar(metrics, run.bar)
    (run.run_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    spec = row["by_length"]
    plot_by_length({run.name: spec["values"]}, spec["labels"], plots / "by_length.png", spec["xlabel"],
                   spec["metric"], f"{run.name}: {spec['metric']} by {spec['xlabel']}")
    results = results_dir(run)
    results.mkdir(parents=True, exist_ok=True)
    row.update(model=run.name, arch=run.arch, parameters=metrics["parameters"],
               train_seconds=metrics["train_seconds"],
               bar_passed=metrics["bar"]["passed"] if run.bar else None)
    (results / f"{run.name}.json").write_text(json.dumps(row, indent=1))
    with tracking.run(run.name, "evaluate") as mlflow:
        mlflow.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None})
        mlflow.log_artifacts(str(plots), "plots")
        mlflow.log_artifact(str(run.run_dir / "metrics.json"))
    return metrics


def main(argv: list[str] | None = None) -> None:
    ap = model_parser("Evaluate a trained model on its test set.",
                      f"{RUN_HELP}; results then go to DIR/results/<task>/")
    args = ap.parse_args(argv)

    def body():
        metrics = evaluate(trained(args.model, args.run))
        shown = {k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}
        print(json.dumps({**shown, "bar_passed": metrics["bar"]["passed"]}, indent=1))

    run_cli(body)


if __name__ == "__main__":
    exit_after(main)
