"""The README's serving table names the inputs and outputs the server really has, for every kind
of served model (read from the tiny published repository), and the docs link only to files that
exist in the repository."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from serving.client import LocalClient
from tests.conftest import ROOT

# the tiny repository's model -> the README row that documents its kind
ROWS = {"bahdanau": "bahdanau", "luong": "luong_*", "transformer": "transformer", "ntm": "ntm",
        "pointer": "pointer_sort", "act": "act_parity", "programmer": "neural_programmer", "captioner": "sat_soft",
        "ram": "ram", "draw": "draw", "ocr": "attention_ocr", "speech": "speech_location"}


def _serving_table() -> dict[str, tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| name | input | outputs |"):]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        name, inputs, outputs = (c.strip() for c in line.strip("|").split(" | ", 2))
        for entry in re.findall(r"`([^`]+)`", name):
            rows[entry] = (inputs, outputs)
    return rows


@pytest.mark.parametrize("model", sorted(ROWS))
def test_readme_serving_table_matches_the_served_metadata(published, model):
    inputs, outputs = _serving_table()[ROWS[model]]
    meta = LocalClient(published.repo).model_metadata(model)
    for spec in meta["inputs"]:
        assert f"`{spec['name']}`" in inputs, (model, spec, inputs)
    for spec in meta["outputs"]:
        assert f"`{spec['name']}`" in outputs, (model, spec, outputs)


def test_docs_link_only_to_files_in_the_repository():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), (doc.name, target)
    for path in [*ROOT.glob("*/**/*.py"), *ROOT.glob("scripts/*.sh")]:
        if ".venv" in path.parts or path.name == "test_docs.py":
            continue
        text = path.read_text()
        assert "DESIGN §" not in text and "../shared" not in text and "../DATA.md" not in text, path


def test_results_table_is_generated_from_the_committed_metrics():
    # docs/results.md's table of every entry is scripts/results_table.py's output for the
    # committed runs/*/metrics.json: a retrained model's numbers cannot drift from it.
    done = subprocess.run([sys.executable, "scripts/results_table.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    table = (ROOT / "docs" / "results.md").read_text().split("<!-- results_table: start -->")[1].split("<!--")[0]
    entries = yaml.safe_load((ROOT / "params.yaml").read_text())["models"]
    assert table.count("\n| `") == len(entries)
    assert "| `bahdanau` | `translation_de_en` | `bleu_beam` | >= 12 |" in table
