"""Measured comparisons behind the Transformer's recipe: dropout, label smoothing, schedule.

Each variant trains ``transformer`` with params.yaml's recipe and one value changed for ``--steps``
steps (the schedule spanning them), then is scored on the validation set (the test set stays for the
final model): best validation loss, token accuracy, and BLEU / chrF with the evaluation's beam.
Variants run one after another, each alone on the machine; a finished variant's folder is reused, so
an interrupted comparison resumes where it stopped. ``--recipe-run DIR`` takes a finished run of the
unchanged recipe at the same steps (e.g. ``runs/transformer`` at its 6,000) instead of training it.

    python scripts/transformer_recipe.py --work ~/.cache/attnzoo/recipe --json docs/transformer_recipe.json
    python scripts/transformer_recipe.py --work ~/.cache/attnzoo/recipe6000 --steps 6000 \\
        --only recipe "dropout 0.1" --recipe-run runs/transformer --json docs/transformer_recipe.json

Each prints its table; ``--json`` keeps one comparison per step budget in the file, which
docs/results.md shows ("The Transformer's recipe", checked by tests/test_results_doc.py). A
comparison measured on an earlier recipe says how that recipe differed (``base``): its rows name
one change each from it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import cli_errors

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "peers"))
sys.path.insert(0, str(ROOT / "scripts"))

MODEL = "transformer"
# The recipe (params.yaml) and one change each: the label names what differs.
VARIANTS = {
    "recipe": {},
    "dropout 0.1": {"dropout": 0.1},
    "label smoothing 0": {"label_smoothing": 0.0},
    "inverse square root": {"schedule": "inverse_sqrt"},
}


def folder(work: Path, label: str) -> Path:
    return work / label.replace(" ", "_").replace(".", "")


def train(work: Path, label: str, steps: int, eval_every: int) -> Path:
    """Train one variant into its own folder (skipped when its summary exists)."""
    out = folder(work, label)
    if not (out / "train_summary.json").exists():
        sets = {"max_steps": steps, "eval_every": eval_every, "average_last": 0, **VARIANTS[label]}
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}
        cmd = [sys.executable, "-m", "pipeline.runner.cli", "train", MODEL, "--out", str(out),
               "--set", *[f"{k}={v}" for k, v in sets.items()]]
        print(f"[{label}] {' '.join(cmd[2:])}", flush=True)
        if subprocess.run(cmd, cwd=ROOT, env=env).returncode:  # its own error is printed above
            raise cli_errors.ScriptError(f"[{label}] training stopped (its output above); {out} keeps what it saved")
    return out


def measure(run: Path, scores: Path, beam: int) -> dict:
    """A trained run's figures: training time, best validation loss and accuracy, and validation
    BLEU / chrF of its best checkpoint (kept in ``scores``, computed once)."""
    from peers import attnzoo_bleu

    summary = json.loads((run / "train_summary.json").read_text())
    with open(run / "learning_curves" / "val_loss.csv") as f:
        curve = {int(r["step"]): r for r in csv.DictReader(f)}
    best = curve[summary["best_step"]]
    if not scores.exists():
        scores.parent.mkdir(parents=True, exist_ok=True)
        scores.write_text(json.dumps(attnzoo_bleu(run / "checkpoint" / "best", beam, split="val")))
    return {"steps": summary["steps"], "train_seconds": summary["train_seconds"],
            "best_step": summary["best_step"], "val_loss": round(float(best["val_loss"]), 4),
            "val_token_acc": round(float(best["val_token_acc"]), 4), **json.loads(scores.read_text())}


def table(rows: dict, base: dict | None = None) -> str:
    """The comparison as docs/results.md prints it: each variant against the recipe's row (when measured). ``base``: how
    the recipe then differed from params.yaml's (a comparison measured before the recipe changed)."""
    first = rows.get("recipe")  # none: the variants alone (``--only`` without it), no Δ
    lines = ["| variant | val loss | token accuracy | val BLEU beam | Δ BLEU | chrF | training |",
             "|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        delta = "—" if label == "recipe" or first is None else f"{r['bleu'] - first['bleu']:+.2f}"
        if label == "recipe" and base:
            label = "recipe with " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in base.items())
        m, s = divmod(round(r["train_seconds"]), 60)
        lines.append(f"| {label} | {r['val_loss']:.3f} | {100 * r['val_token_acc']:.1f} % | {r['bleu']:.2f} "
                     f"| {delta} | {r['chrf']:.2f} | {m} min {s:02d} s |")
    return "\n".join(lines)


def keep(path: Path, steps: int, beam: int, rows: dict) -> None:
    """Put this budget's comparison into ``path`` beside the other budgets' (sorted by steps)."""
    from bench_inference import machine

    kept = json.loads(path.read_text()) if path.exists() else {"split": "val", "comparisons": []}
    others = [c for c in kept["comparisons"] if c["steps"] != steps]  # a base of its own stays with its budget
    kept["comparisons"] = sorted([*others, {"steps": steps, "beam": beam, "machine": machine(), "rows": rows}],
                                 key=lambda c: c["steps"])
    path.write_text(json.dumps(kept, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="folder for the variants' runs")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--only", nargs="*", choices=list(VARIANTS), help="variants to run (default all)")
    ap.add_argument("--recipe-run", type=Path, help="a finished run of the unchanged recipe at --steps")
    ap.add_argument("--json", type=Path, help="keep the comparison in this file")
    args = ap.parse_args(argv)
    if args.recipe_run and not (args.recipe_run / "train_summary.json").exists():
        raise cli_errors.ScriptError(f"--recipe-run {args.recipe_run} holds no train_summary.json: give a finished "
                                     "run (attnzoo train transformer --out DIR)")
    if args.json and args.only and "recipe" not in args.only:
        raise cli_errors.ScriptError("--json keeps a comparison against the recipe's row: add recipe to --only")
    args.work.mkdir(parents=True, exist_ok=True)
    rows = {}
    for label in args.only or list(VARIANTS):
        given = args.recipe_run if label == "recipe" else None
        if given and json.loads((given / "train_summary.json").read_text())["steps"] != args.steps:
            raise cli_errors.ScriptError(f"{given} did not train {args.steps} steps; drop --recipe-run")
        run = given or train(args.work, label, args.steps, args.eval_every)
        rows[label] = measure(run, folder(args.work, label) / "valid_bleu.json", args.beam)
    if args.json:
        keep(args.json, args.steps, args.beam, rows)
    print(table(rows))


if __name__ == "__main__":
    cli_errors.run(main)
