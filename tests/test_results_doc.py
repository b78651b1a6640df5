"""docs/results.md is a reference, and its per-entry figures are the committed ones.

A markdown table whose first header cell names a committed file of an entry, e.g.
``entry (`runs/<model>/metrics.json`)``, is checked against that file, row by row (the row's first
backticked word is the entry):

- a header cell that is one backticked key (``` `best_val_loss` ```, ``` `bleu_by_length.25+.bleu` ```)
  names a value in the file; a dotted path walks dicts by key and lists by index or by the element
  holding that string (``by_source.gettext.bleu``). ``file.json:key`` reads another file of the same
  entry, ``model:key`` another entry's file, and keys combine with `` + ``, `` - `` and `` / ``;
- ``key`` and ``value`` columns do the same per row (for comparisons across entries);
- a first header cell ``key (`runs/<model>/X.json`)`` with entries as the other header cells is the
  same table transposed;
- in a ``parity.json`` table the columns ``cases``, ``largest graph-output difference`` and
  ``largest end-to-end difference`` are computed from the CPU execution provider's cases, and a
  ``tuned.yaml`` column lists what ``tune@`` chose.

A printed number must equal the file's value rounded as printed (an integer exactly). Fast: no
subprocess, no model, only the committed JSON and YAML files.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "results.md"
MODELS = list(yaml.safe_load((ROOT / "params.yaml").read_text())["models"])
NUMBER_WORDS = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]

FILE = re.compile(r"`runs/<model>/([\w.]+\.(?:json|yaml))`")
KEY_CELL = re.compile(r"^`([^`]+)`$")
NUMBER = re.compile(r"^[+-]?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?")
OPERATORS = re.compile(r"\s([-+/])\s")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(text: str) -> list[tuple[int, list[str], list[list[str]]]]:
    """(line number, header cells, rows) of every markdown table, indented ones included."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        rule = i + 1 < len(lines) and re.fullmatch(r"\s*\|[-|: ]+\|\s*", lines[i + 1])
        if lines[i].lstrip().startswith("|") and rule:
            rows, j = [], i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                rows.append(_cells(lines[j]))
                j += 1
            out.append((i + 1, _cells(lines[i]), rows))
            i = j
        else:
            i += 1
    return out


@cache
def _load(model: str, name: str):
    path = ROOT / "runs" / model / name
    return (yaml.safe_load if name.endswith(".yaml") else json.loads)(path.read_text())


def _lookup(data, path: str) -> float:
    node = data
    for part in path.split("."):
        if isinstance(node, dict):
            node = node[part]
        elif part.isdigit():
            node = node[int(part)]
        else:
            node = next(x for x in node if isinstance(x, dict) and part in x.values())
    assert isinstance(node, (int, float)) and not isinstance(node, bool), (path, node)
    return float(node)


def _term(term: str, model: str, default: str) -> float:
    if re.fullmatch(NUMBER, term):
        return float(term)
    source, name = model, default
    while ":" in term:
        head, term = term.split(":", 1)
        if head.endswith((".json", ".yaml")):
            name = head
        else:
            assert head in MODELS, f"unknown entry {head!r}"
            source = head
    return _lookup(_load(source, name), term)


def _value(expression: str, model: str, default: str) -> float:
    """``a - other:b + 1`` or ``a / b``, evaluated left to right."""
    parts = OPERATORS.split(expression)
    total = _term(parts[0], model, default)
    for op, term in zip(parts[1::2], parts[2::2]):
        value = _term(term, model, default)
        total = total + value if op == "+" else total - value if op == "-" else total / value
    return total


def _printed(cell: str) -> str | None:
    """The number a cell starts with, or None for an empty or '—' cell (nothing stated)."""
    cell = cell.replace("−", "-").strip()
    if cell in {"", "—", "-"} or cell.startswith("— "):
        return None
    found = NUMBER.match(cell)
    assert found, f"expected a number, found {cell!r}"
    return found.group(0).replace(",", "")


def _agrees(printed: str, actual: float) -> bool:
    number = Decimal(printed)
    if "." not in printed and "e" not in printed:  # an integer is stated exactly
        return abs(actual - float(number)) <= 1e-9 * max(1.0, abs(actual))
    quantum = float(Decimal(1).scaleb(number.as_tuple().exponent))
    return abs(actual - float(number)) <= quantum / 2 + 1e-9 * max(1.0, abs(actual))


def _parity(model: str) -> dict:
    cases = _load(model, "parity.json")["providers"]["CPUExecutionProvider"]["cases"]
    graph, e2e = {}, {}
    for case in cases:
        for name, g in case["graphs"].items():
            for output, o in g["outputs"].items():
                if o.get("max_abs") is not None:
                    graph[f"{name}.{output}"] = max(graph.get(f"{name}.{output}", 0.0), o["max_abs"])
        for output, o in (case.get("e2e") or {}).items():
            if isinstance(o, dict) and o.get("max_abs") is not None:
                e2e[output] = max(e2e.get(output, 0.0), o["max_abs"])
    return {"cases": len(cases), "graph": graph, "e2e": e2e}


def _check_parity_cell(column: str, cell: str, model: str) -> str | None:
    found = _parity(model)
    if column == "cases":
        return None if int(cell) == found["cases"] else f"{cell} cases, parity.json has {found['cases']}"
    outputs = found["graph" if column.startswith("largest graph") else "e2e"]
    largest = max(outputs.values(), default=0.0)
    printed = _printed(cell)
    if not _agrees(printed, largest):
        return f"{cell}: the largest is {largest:.3g}"
    named = re.findall(r"`([^`]+)`", cell)
    if named and outputs.get(named[0]) != largest:
        return f"{cell}: {named[0]} is not the output with the largest difference ({outputs})"
    return None


def checked_cells() -> list[tuple[int, str, str, str, bool, str | None]]:
    """(line, entry, what, cell, compared, problem) for every checked cell of docs/results.md;
    ``compared`` is false for a cell that states nothing ('—')."""
    out = []
    for line, head, rows in _tables(DOC.read_text()):
        found = FILE.search(head[0])
        if not found:
            continue
        default = found.group(1)
        models_in_head = [m.group(1) if (m := KEY_CELL.match(c)) else None for c in head[1:]]
        if head[0].startswith("key") and all(m in MODELS for m in models_in_head):  # transposed
            for row in rows:
                key = KEY_CELL.match(row[0]).group(1)
                for model, cell in zip(models_in_head, row[1:]):
                    out.append(_cell(line, model, key, cell, default))
            continue
        for row in rows:
            entry = re.search(r"`([^`]+)`", row[0])
            assert entry and entry.group(1) in MODELS, f"docs/results.md:{line}: row {row[0]!r} names no entry"
            model = entry.group(1)
            cells = dict(zip(head[1:], row[1:]))
            for column, cell in cells.items():
                key = KEY_CELL.match(column)
                if key:
                    out.append(_cell(line, model, key.group(1), cell, default))
                elif default == "parity.json" and column in {"cases", "largest graph-output difference",
                                                              "largest end-to-end difference"}:
                    out.append((line, model, column, cell, True, _check_parity_cell(column, cell, model)))
                elif "tuned.yaml" in column:
                    chosen = _load(model, "tuned.yaml") or {}
                    stated = dict(re.findall(r"(\w+) ([\d.]+)", cell))
                    problem = None if stated == {k: str(v) for k, v in chosen.items()} else f"tuned.yaml has {chosen}"
                    out.append((line, model, column, cell, True, problem))
            if "key" in cells and "value" in cells and cells["key"]:
                expression = KEY_CELL.match(cells["key"]).group(1)
                out.append(_cell(line, model, expression, cells["value"], default))
    return out


def _cell(line: int, model: str, key: str, cell: str, default: str):
    printed = _printed(cell)
    if printed is None:
        return (line, model, key, cell, False, None)
    actual = _value(key, model, default)
    return (line, model, key, cell, True, None if _agrees(printed, actual) else f"the file gives {actual!r}")


def test_every_documented_figure_equals_the_committed_file_it_names():
    cells = checked_cells()
    wrong = [f"table at docs/results.md:{line}: {model} {what} = {cell}: {problem}"
             for line, model, what, cell, _, problem in cells if problem]
    assert not wrong, "\n".join(wrong)
    # a meaningful set: every per-entry figure of the document's file tables
    assert sum(compared for *_, compared, _ in cells) >= 300


def test_every_entry_has_its_training_parity_and_int8_figures_checked():
    by_file: dict[str, set[str]] = {}
    for _line, head, rows in _tables(DOC.read_text()):
        found = FILE.search(head[0])
        if found and not head[0].startswith("key"):
            names = {m.group(1) for row in rows if (m := re.search(r"`([^`]+)`", row[0]))}
            by_file.setdefault(found.group(1), set()).update(names)
            if any("int8_metrics.json:" in c for c in head):
                by_file.setdefault("int8_metrics.json", set()).update(names)
    for name in ("train_summary.json", "parity.json", "int8_metrics.json"):
        assert by_file.get(name) == set(MODELS), (name, set(MODELS) - by_file.get(name, set()))


def test_the_summed_training_time_is_the_committed_one():
    text = " ".join(DOC.read_text().split())
    found = re.search(r"The (\d+) `train_seconds` sum to (\d+) h (\d+) min, the (\w+) translation entries' "
                      r"to (\d+) h (\d+) min", text)
    assert found, "docs/results.md does not state the summed training time"
    seconds = {m: _load(m, "train_summary.json")["train_seconds"] for m in MODELS}
    translation = [m for m in MODELS if yaml.safe_load((ROOT / "params.yaml").read_text())["models"][m]["task"]
                   == "translation_de_en"]
    counted = found[4] if found[4].isdigit() else NUMBER_WORDS.index(found[4])
    assert (int(found[1]), int(counted)) == (len(MODELS), len(translation)), found[0]
    for hours, minutes, total in ((found[2], found[3], sum(seconds.values())),
                                  (found[5], found[6], sum(seconds[m] for m in translation))):
        assert int(hours) * 60 + int(minutes) == round(total / 60), (hours, minutes, total)


def test_the_document_is_a_reference_not_a_log():
    text = DOC.read_text()
    lines = text.splitlines()
    assert len(lines) <= 575, len(lines)
    dated = [line for line in lines if line.startswith("#") and re.search(r"20\d\d-\d\d-\d\d", line)]
    assert not dated, dated
    assert not re.findall(r"#\d+", text), re.findall(r".{30}#\d+.{10}", text)
    for word in (r"\bsessions?\b", r"\blanded\b"):
        assert not re.search(word, text, flags=re.I), re.findall(rf".{{40}}{word}.{{20}}", text, flags=re.I)


@pytest.mark.parametrize("printed, actual, ok", [
    ("2.243", 2.2426583, True), ("2.244", 2.2426583, False), ("0", 0.0, True), ("0", 0.3, False),
    ("1e-06", 1.043e-06, True), ("3.2e-05", 3.3e-05, False), ("11231", 11231, True), ("94.00", 94.0043, True),
])
def test_a_figure_agrees_only_when_rounding_the_file_gives_it(printed, actual, ok):
    assert _agrees(printed, actual) is ok


def test_expressions_read_other_entries_and_files():
    bleu = {m: _load(m, "metrics.json")["bleu_beam"] for m in ("bahdanau", "bahdanau_none")}
    assert _value("bleu_beam - bahdanau_none:bleu_beam + 1", "bahdanau", "metrics.json") == pytest.approx(
        bleu["bahdanau"] - bleu["bahdanau_none"] + 1)
    assert _value("int8_metrics.json:gate.conditions.bleu_beam.int8", "bahdanau", "metrics.json") == \
        _load("bahdanau", "int8_metrics.json")["gate"]["conditions"][0]["int8"]
    assert _value("bleu_by_length.25+.bleu", "bahdanau", "metrics.json") == \
        _load("bahdanau", "metrics.json")["bleu_by_length"][-1]["bleu"]


def test_the_transformer_recipe_tables_are_the_committed_comparisons():
    """Each table under "The Transformer's recipe" after the first is ``scripts/transformer_recipe.py``'s
    rendering of one budget of the committed ``docs/transformer_recipe.json``, named with its steps."""
    from transformer_recipe import VARIANTS, table

    kept = json.loads((ROOT / "docs" / "transformer_recipe.json").read_text())
    section = DOC.read_text().split("### The Transformer's recipe", 1)[1].split("\n### ", 1)[0]
    assert kept["comparisons"]
    for comparison in kept["comparisons"]:
        assert list(comparison["rows"])[0] == "recipe"
        # rows of today's recipe are the script's variants; an earlier recipe's name one change from it
        assert comparison.get("base") or set(comparison["rows"]) <= set(VARIANTS)
        assert table(comparison["rows"], comparison.get("base")) in section, comparison["steps"]
        assert f"{comparison['steps']:,} steps" in section
