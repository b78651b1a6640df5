"""Stage ``report@<task>``: compare every model of a task side by side.

Reads the rows ``evaluate`` wrote to ``results/<task>/*.json`` and writes
``reports/<task>.md`` and ``reports/<task>_by_length.png`` (e.g. Bahdanau's Fig. 2: BLEU by
source length for RNNsearch vs the RNNencdec ablation).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline import plots, tracking
from pipeline.config import ROOT
from pipeline.entry import exit_after, run_cli, task_entry

BAR = {True: "met", False: "not met", None: "none set"}


def report(task: str, root: Path = ROOT) -> str:
    folder = root / "results" / task
    rows = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json")) if not p.name.endswith(".latency.json")]
    for r in rows:  # export@<model> times the inference loop once parity passed
        timing = folder / f"{r['model']}.latency.json"
        r["latency"] = json.loads(timing.read_text())["total"] if timing.exists() else {}
    out = root / "reports"
    out.mkdir(exist_ok=True)
    if not rows:
        text = f"# {task}\n\nNo evaluated model yet.\n"
        (out / f"{task}.md").write_text(text)
        return text
    heads = sorted({k for r in rows for k in r["headline"]})
    lines = [f"# {task}: model comparison", "",
             "| model | arch | " + " | ".join(heads) + " | parameters | train s | ORT ms | PyTorch ms | bar |",
             "|---|---|" + "---|" * len(heads) + "---|---|---|---|---|"]
    for r in rows:
        vals = " | ".join(str(r["headline"].get(h, "")) for h in heads)
        ort, torch_ms = (r["latency"].get(k, "—") for k in ("onnxruntime_ms", "pytorch_ms"))
        lines.append(f"| {r['model']} | {r['arch']} | {vals} | {r['parameters']:,} | "
                     f"{r['train_seconds']} | {ort} | {torch_ms} | {BAR[r['bar_passed']]} |")
    lines += ["", "ORT / PyTorch ms: the whole inference loop (onnxruntime on the CPU execution provider vs "
              "`model.predict`) over the parity cases of `export@<model>`, the median of 5 runs each, "
              "summed (`results/<task>/<model>.latency.json`); — where the export predates the timing."]
    spec = rows[0]["by_length"]
    lines += ["", f"## {spec['metric']} by {spec['xlabel']}", "",
              "| model | " + " | ".join(spec["labels"]) + " |", "|---|" + "---|" * len(spec["labels"])]
    lines += [f"| {r['model']} | " + " | ".join(str(v) for v in r["by_length"]["values"]) + " |" for r in rows]
    lines += ablation_gaps(rows)
    if spec.get("counts"):  # how many test items each bucket holds (same for every model)
        lines.append("| *test items* | " + " | ".join(str(v) for v in spec["counts"]) + " |")
    lines += ["", f"![by length]({task}_by_length.png)", ""]
    lines += by_group(rows)
    plots.by_length({r["model"]: r["by_length"]["values"] for r in rows}, spec["labels"],
                    out / f"{task}_by_length.png", spec["xlabel"], spec["metric"], task)
    text = "\n".join(lines)
    (out / f"{task}.md").write_text(text)
    return text


def ablation_gaps(rows: list[dict]) -> list[str]:
    """A row per model whose ``attention: none`` ablation is in the task (params.yaml names it
    ``<model>_none``): the model minus the ablation per bucket, the quantity of Bahdanau's Fig. 2,
    which should grow with source length if attention is what holds long sentences."""
    by_name = {r["model"]: r for r in rows}
    lines = []
    for r in rows:
        ablation = by_name.get(f"{r['model']}_none")
        if ablation is None or ablation["arch"] != r["arch"]:
            continue
        gaps = [round(a - b, 2) for a, b in zip(r["by_length"]["values"], ablation["by_length"]["values"])]
        lines.append(f"| *{r['model']} − {ablation['model']}* | " + " | ".join(str(g) for g in gaps) + " |")
    return lines


def by_group(rows: list[dict]) -> list[str]:
    """A task's per-group table (translation: BLEU by corpus source), with its floor row (copying
    the source) when the task gives one; rows without groups add nothing."""
    grouped = [r for r in rows if r.get("by_group")]
    if not grouped:
        return []
    spec = grouped[0]["by_group"]
    labels = sorted({label for r in grouped for label in r["by_group"]["labels"]})
    lines = [f"## {spec['metric']} by {spec['title']}", "", spec.get("note", ""), "",
             "| model | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for r in grouped:
        got = dict(zip(r["by_group"]["labels"], r["by_group"]["values"]))
        lines.append(f"| {r['model']} | " + " | ".join(str(got.get(label, "—")) for label in labels) + " |")
    for key, name in (("floor", "*copy the source*"), ("counts", "*test items*")):
        if spec.get(key):
            got = dict(zip(spec["labels"], spec[key]))
            lines.append(f"| {name} | " + " | ".join(str(got.get(label, "—")) for label in labels) + " |")
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the comparison report of one task.")
    ap.add_argument("task", help="a params.yaml task, e.g. translation_de_en")
    args = ap.parse_args(argv)

    def body():
        task_entry(args.task)  # a misspelled task: one sentence, before any report or MLflow run is written
        print(report(args.task, root=ROOT))
        with tracking.run(args.task, "report") as mlflow:  # the table and its plot beside the stages' runs
            for name in (f"{args.task}.md", f"{args.task}_by_length.png"):
                if (ROOT / "reports" / name).exists():
                    mlflow.log_artifact(str(ROOT / "reports" / name))

    run_cli(body)


if __name__ == "__main__":
    exit_after(main)
