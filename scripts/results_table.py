"""The one results table: every model entry with its headline metric, bar, measured value, the
paper's figure and its training time, generated from the committed metrics so it cannot drift.

    python scripts/results_table.py            # print the table
    python scripts/results_table.py --write    # replace it in docs/results.md
    python scripts/results_table.py --check    # exit 1 when docs/results.md differs (tests/test_docs.py)

Reads ``params.yaml`` (the entries and their tasks), ``runs/<name>/metrics.json`` (the bar and its measured values,
written by evaluate@) and ``runs/<name>/train_summary.json`` (train@'s wall time) and
``runs/<name>/int8_metrics.json`` (quantize@'s gate). The papers' figures are facts about other data sets and budgets,
kept here with their setting: they place a result, they are not a bar.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cli_errors
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "results.md"
START, END = "<!-- results_table: start -->", "<!-- results_table: end -->"

# The paper's own figure for the closest setting it reports (— where it reports curves only).
PAPER = {
    "bahdanau": "26.75 BLEU (RNNsearch-50, WMT'14 En→Fr, Bahdanau et al. 2015)",
    "bahdanau_none": "17.82 BLEU (RNNencdec-50, same)",
    "luong_dot": "20.9 BLEU best single model, local-p + general + unk replacement (WMT'14 En→De, Luong et al. 2015)",
    "luong_general": "20.9 BLEU (as `luong_dot`: the paper's best single model)",
    "luong_concat": "20.9 BLEU (as `luong_dot`)",
    "luong_local_p": "20.9 BLEU (this variant with general score and unk replacement)",
    "transformer": "27.3 BLEU (base model, WMT'14 En→De, Vaswani et al. 2017)",
    "ntm": "— (learning curves: near 0 bits per sequence, generalises past length 20; Graves et al. 2014)",
    "ntm_repeat_copy": "— (learning curves only)",
    "ntm_recall": "— (learning curves only)",
    "pointer_sort": "— (no sorting task in Vinyals et al. 2015)",
    "pointer_hull": "87.0 % at n = 10, lowest-index order (Vinyals et al. 2015; ours starts leftmost, an easier order)",
    "act_parity": "— (error curves, 64-bit inputs; Graves 2016)",
    "rnn_parity": "— (Graves 2016: the one-step RNN does not learn parity)",
    "neural_programmer": "— (its synthetic tables are larger; Neelakantan et al. 2016)",
    "sat_soft": "BLEU-4 19.5 on Flickr8k photos (Xu et al. 2015; captions of 2–3 digits here)",
    "sat_hard": "BLEU-4 21.3 on Flickr8k photos (same)",
    "ram": "1.84 % error (8 glimpses, 60 × 60 translated MNIST, Mnih et al. 2014)",
    "ram_cluttered": "4.04 % error (8 glimpses, 60 × 60 cluttered MNIST, 4 distractors)",
    "draw": "≤ 80.97 nats (T = 64, Gregor et al. 2015)",
    "draw_none": "≤ 87.40 nats (T = 64, no attention)",
    "attention_ocr": "84.2 % sequence accuracy on FSNS street signs (Wojna et al. 2017)",
    "ocr_rcnn": "90.0 % word accuracy on ICDAR 2013, 80.7 % on SVT, no lexicon (Lee & Osindero 2016)",
    "speech_location": "18 % PER on TIMIT phonemes, 20 % on 10× longer utterances; 17.6 % with smoothing "
                       "(Chorowski et al. 2015)",
    "speech_content": "18.7 % PER on TIMIT, but only on utterances as long as the training ones (same paper)",
}
# Entries without a bar (ablations): the metric their comparison is read on.
HEADLINE = {"bahdanau_none": "bleu_beam", "rnn_parity": "accuracy", "ram_cluttered": "test_error_pct",
            "draw_none": "test_nll_bound"}


def _num(value) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _duration(seconds: float | None) -> str:
    if not seconds:
        return "—"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs:02d} s"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def rows(root: Path = ROOT) -> list[list[str]]:
    params = yaml.safe_load((root / "params.yaml").read_text())
    out = []
    for name, entry in params["models"].items():
        metrics = _read(root / "runs" / name / "metrics.json")
        summary = _read(root / "runs" / name / "train_summary.json")
        conditions = (metrics.get("bar") or {}).get("conditions") or []
        if conditions:
            metric = "; ".join(f"`{c['metric']}`" for c in conditions)
            bar = "; ".join(f"{c['op']} {_num(c['value'])}" for c in conditions)
            measured = "; ".join(_num(c["measured"]) for c in conditions)
            met = "met" if metrics["bar"]["passed"] else "**not met**"
        else:
            key = HEADLINE.get(name, "")
            metric, bar, met = f"`{key}`", "— (ablation)", "—"
            measured = _num(metrics[key]) if key in metrics else "not evaluated"
        out.append([f"`{name}`", f"`{entry['task']}`", metric, bar, measured, met, PAPER.get(name, "—"),
                    _duration(summary.get("train_seconds") or metrics.get("train_seconds")),
                    _num(metrics["parameters"]) if "parameters" in metrics else "—",
                    _int8(name, _read(root / "runs" / name / "int8_metrics.json").get("gate") or {})])
    return out


def _int8(name: str, gate: dict) -> str:
    """quantize@'s gate in a cell: published as ``<name>-int8``, or which bar metric missed by how much."""
    if gate.get("passed"):
        return f"passed: `{name}-int8`"
    missed = [c for c in gate.get("conditions") or [] if not c["passed"]]
    if missed:
        return "missed: " + "; ".join(f"`{c['metric']}` {_num(c['fp32'])} → {_num(c['int8'])}" for c in missed)
    note = gate.get("note") or "not run"
    return "— (no bar)" if note.startswith("no quality bar") else note.split(":")[0]


def table(root: Path = ROOT, entries: list[list[str]] | None = None) -> str:
    head = ["entry", "task", "metric", "bar", "measured", "bar met", "paper (its data and budget)",
            "training", "parameters", "int8 gate"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in (rows(root) if entries is None else entries)]
    return "\n".join([
        "Generated by `python scripts/results_table.py --write` from `runs/*/metrics.json` and",
        "`runs/*/train_summary.json` (`dvc metrics show` prints the same numbers). Training is",
        "train@'s wall time; the CPU and threads of each are under \"Training time\". The papers",
        "trained on their own, larger data for far longer: their figures place a result, they are not",
        "the bar. int8: `quantize@`'s dynamic int8 variant on the full test set, each bar metric at most",
        "0.5 points (0.005 on a 0-1 scale) worse than fp32 (`runs/*/int8_metrics.json`); one that passed",
        "is served as `<entry>-int8`.",
        "", *lines])


def replace(text: str, new: str) -> str:
    if START not in text or END not in text:
        raise cli_errors.ScriptError(f"{DOCS} has no {START} ... {END} section to replace")
    head, rest = text.split(START, 1)
    return f"{head}{START}\n\n{new}\n\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="results_table.py", description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="replace the table in docs/results.md")
    group.add_argument("--check", action="store_true", help="exit 1 when docs/results.md's table is not current")
    args = parser.parse_args(argv)
    entries = rows()
    new = table(entries=entries)
    if args.write:
        DOCS.write_text(replace(DOCS.read_text(), new))
        print(f"wrote the table of {len(entries)} entries to {DOCS.relative_to(ROOT)}")
    elif args.check:
        current = DOCS.read_text()
        if replace(current, new) != current:
            print(f"{DOCS.relative_to(ROOT)}: the results table is out of date; run "
                  "python scripts/results_table.py --write", file=sys.stderr)
            raise SystemExit(1)
    else:
        print(new)


if __name__ == "__main__":
    cli_errors.run(main)
