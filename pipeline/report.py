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
    lines += ["", f"![by length]({task}_by_length.png)", ""]
    plots.by_length({r["model"]: r["by_length"]["values"] for r in rows}, spec["labels"],
                    out / f"{task}_by_length.png", spec["xlabel"], spec["metric"], task)
    text = "\n".join(lines)
    (out / f"{task}.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    from pipeline.cli import run_cli

    ap = argparse.ArgumentParser(description="Write the comparison report of one task.")
    ap.add_argument("task")
    args = ap.parse_args(argv)

    def body():
        print(report(args.task, root=ROOT))
        with tracking.run(args.task, "report") as mlflow:  # the table and its plot beside the stages' runs
            for name in (f"{args.task}.md", f"{args.task}_by_length.png"):
                if (ROOT / "reports" / name).exists():
                    mlflow.log_artifact(str(ROOT / "reports" / name))

    run_cli(body)


if __name__ == "__main__":
    main()
