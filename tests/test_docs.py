"""The README's serving table names the inputs and outputs the server really has, for every kind
of served model (read from the tiny published repository), and the docs link only to files that
exist in the repository."""

from __future__ import annotations

import re

import pytest

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
