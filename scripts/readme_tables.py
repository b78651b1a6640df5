"""The README's two generated tables, from the committed runs so they cannot drift: results at a
glance (each family's entries with their headline test metric) and how long the full pipeline takes
(per model family and CPU class).

    python scripts/readme_tables.py            # print both
    python scripts/readme_tables.py --write    # replace them in README.md
    python scripts/readme_tables.py --check    # exit 1 when README.md differs (tests/test_readme.py)

Reads ``params.yaml`` (entries, architectures, tasks), ``runs/<entry>/metrics.json`` (the bar,
``eval_seconds``), ``runs/<entry>/train_summary.json`` (``train_seconds``) and ``docs/run_times.yaml``
(the CPU class of each committed run, and the times measured on the other class).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cli_errors
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_table import HEADLINE, _num  # noqa: E402  (the one rule for an ablation's headline metric)

BLOCKS = ("results_glance", "run_times")
# architecture -> the family's name in the table (the README's model table groups them alike)
MT = "translation (RNNsearch, Luong, Transformer)"
FAMILY = {"bahdanau": MT, "luong": MT, "transformer": MT, "ntm": "Neural Turing Machines",
          "pointer_net": "Pointer Networks", "act": "ACT", "neural_programmer": "Neural Programmer",
          "show_attend_tell": "Show, Attend and Tell", "ram": "RAM", "draw": "DRAW", "attention_ocr": "attention OCR",
          "speech_attention": "location-aware speech"}


def family_of(arch: str) -> str:
    """The README row of ``arch``: one sentence naming the fix for an architecture the table has no row for."""
    if arch not in FAMILY:
        raise cli_errors.ScriptError(f"architecture '{arch}' has no family: add its README row "
                                     "name to FAMILY")
    return FAMILY[arch]


def headline_of(name: str) -> str:
    """The metric a bar-less entry (an ablation) is shown on: one sentence naming the fix for one without."""
    if name not in HEADLINE:
        raise cli_errors.ScriptError(f"entry '{name}' has no bar and no headline metric: add the "
                                     "metric its row shows to HEADLINE in scripts/results_table.py")
    return HEADLINE[name]


# task -> the metric its entries are compared on at a glance (otherwise the bar's first metric)
GLANCE_METRIC = {"translation_de_en": "bleu_beam"}


def run_file(root: Path, name: str, file: str) -> dict:
    """runs/<name>/<file>, or one sentence naming the stage that writes it."""
    path = root / "runs" / name / file
    if not path.exists():
        stage = "evaluate" if file == "metrics.json" else "train"
        raise cli_errors.ScriptError(f"runs/{name}/{file} is missing: run `attnzoo repro {stage}@{name}` first")
    return json.loads(path.read_text())


def glance(root: Path = ROOT) -> str:
    """One row per family: its task(s), the metric, each entry's measured value (✓: bar met)."""
    entries = yaml.safe_load((root / "params.yaml").read_text())["models"]
    fams: dict[str, list[tuple[str, str, str]]] = {}
    tasks: dict[str, list[str]] = {}
    for name, entry in entries.items():
        metrics = run_file(root, name, "metrics.json")
        conditions = (metrics.get("bar") or {}).get("conditions") or []
        key = GLANCE_METRIC.get(entry["task"]) or (conditions[0]["metric"] if conditions else headline_of(name))
        if key not in metrics:
            raise cli_errors.ScriptError(f"runs/{name}/metrics.json has no {key}: run `attnzoo repro evaluate@{name}` "
                                         "again")
        mark = " ✓" if conditions and metrics["bar"]["passed"] else (" ✗" if conditions else " (ablation)")
        family = family_of(entry["arch"])
        fams.setdefault(family, []).append((name, key, f"{_num(metrics[key])}{mark}"))
        if f"`{entry['task']}`" not in tasks.setdefault(family, []):
            tasks[family].append(f"`{entry['task']}`")
    lines = ["Test-set figures of the committed models (`runs/*/metrics.json`; ✓: the entry's quality bar "
             "is met); written by `python scripts/readme_tables.py --write`.", "",
             "| family | task | metric | entries |", "|---|---|---|---|"]
    for fam, cells in fams.items():
        keys = {key for _, key, _ in cells}
        metric = f"`{keys.pop()}`" if len(keys) == 1 else "see each"
        shown = "; ".join(f"`{n}` {v}" if metric != "see each" else f"`{n}` `{k}` {v}" for n, k, v in cells)
        lines.append(f"| {fam} | {', '.join(tasks[fam])} | {metric} | {shown} |")
    return "\n".join(lines)


def _hm(seconds: float) -> str:
    minutes = round(seconds / 60)
    if minutes == 0:
        return "< 1 min"
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def rows(root: Path = ROOT) -> tuple[list[list[str]], dict]:
    entries = yaml.safe_load((root / "params.yaml").read_text())["models"]
    facts = yaml.safe_load((root / "docs" / "run_times.yaml").read_text())
    classes = list(facts["classes"])
    committed_class = {name: cls for cls, names in facts["committed"].items() for name in names}
    by_family: dict[str, dict] = {}
    for name, entry in entries.items():
        fam = by_family.setdefault(family_of(entry["arch"]), {"entries": [], "eval": 0.0,
                                                          **{c: [0.0, 0] for c in classes}})
        fam["entries"].append(name)
        fam["eval"] += run_file(root, name, "metrics.json").get("eval_seconds", 0.0)
        own = committed_class.get(name, "native_bf16")
        measured = {own: run_file(root, name, "train_summary.json")["train_seconds"]}
        measured.update({c: t[name] for c, t in facts.get("other", {}).items() if name in t})
        for cls, seconds in measured.items():
            fam[cls][0] += seconds
            fam[cls][1] += 1
    out, total = [], {c: [0.0, 0] for c in classes}
    for family, fam in by_family.items():
        n = len(fam["entries"])
        cells = []
        for cls in classes:
            seconds, count = fam[cls]
            cells.append("—" if not count else _hm(seconds) + ("" if count == n else f" ({count} of {n})"))
            total[cls][0] += seconds
            total[cls][1] += count
        out.append([family, str(n), *cells, _hm(fam["eval"])])
    n_all = sum(len(f["entries"]) for f in by_family.values())
    out.append(["**all**", str(n_all),
                *[_hm(s) + ("" if c == n_all else f" ({c} of {n_all})") for s, c in total.values()],
                _hm(sum(f["eval"] for f in by_family.values()))])
    return out, facts


def table(root: Path = ROOT) -> str:
    body, facts = rows(root)
    names = {"native_bf16": "training, native-bf16 CPU", "avx2": "training, AVX2-only CPU"}
    head = ["family", "entries", *[names.get(c, c) for c in facts["classes"]], "test evaluations"]
    lines = ["Each stage's own time, summed (`train_seconds` of `runs/*/train_summary.json`, `eval_seconds` of "
             "`runs/*/metrics.json`; *k of n*: measured for k of the family's n entries); written by "
             "`python scripts/readme_tables.py --write`. CPUs: "
             + "; ".join(f"{names.get(c, c).split(', ')[1]}: {d}" for c, d in facts["classes"].items()) + ".", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def replace(readme: str, blocks: dict[str, str]) -> str:
    for name, text in blocks.items():
        start, end = f"<!-- {name}: start -->", f"<!-- {name}: end -->"
        if start not in readme or end not in readme:
            raise cli_errors.ScriptError(f"README.md has no {start} ... {end} block to put the table in")
        head, rest = readme.split(start, 1)
        readme = f"{head}{start}\n{text}\n{end}{rest.split(end, 1)[1]}"
    return readme


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="replace the tables in README.md")
    ap.add_argument("--check", action="store_true", help="exit 1 when README.md's tables differ")
    args = ap.parse_args(argv)
    blocks = {"results_glance": glance(), "run_times": table()}
    if not (args.write or args.check):
        print("\n\n".join(blocks.values()))
        return
    readme = README.read_text()
    new = replace(readme, blocks)
    if args.check:
        if new != readme:
            print("README.md's generated tables differ from the committed runs: "
                  "python scripts/readme_tables.py --write", file=sys.stderr)
            raise SystemExit(1)
        return
    README.write_text(new)


if __name__ == "__main__":
    cli_errors.run(main)
