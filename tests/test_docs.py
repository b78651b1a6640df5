"""The README's serving table names the inputs and outputs the server really has, for every kind
of served model (read from the tiny published repository), and the docs link only to files that
exist in the repository."""

from __future__ import annotations

import json
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
    # Nor does any other file: not a design note, data survey or issue tracker kept elsewhere.
    outside = re.compile(r"DESIGN §|\.\./shared|shared/data|\bDATA\.md|/work/|(?i:\bissues? #?\d|\bthe issues?'s?\b)")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".yaml", ".yml", ".sh", ".txt", ".toml", ".cfg", ""} \
                or path.name == "test_docs.py" or not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        found = outside.search(path.read_text(errors="replace"))
        assert found is None, f"{name}: '{found.group(0)}' refers to something outside the repository"


def test_results_table_is_generated_from_the_committed_metrics():
    # docs/results.md's table of every entry is scripts/results_table.py's output for the
    # committed runs/*/metrics.json: a retrained model's numbers cannot drift from it.
    done = subprocess.run([sys.executable, "scripts/results_table.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    table = (ROOT / "docs" / "results.md").read_text().split("<!-- results_table: start -->")[1].split("<!--")[0]
    entries = yaml.safe_load((ROOT / "params.yaml").read_text())["models"]
    assert table.count("\n| `") == len(entries)
    # The translation row names its three bars and the committed BLEU as measured.
    row = next(line for line in table.splitlines() if line.startswith("| `bahdanau` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["`translation_de_en`", "`bleu_beam`; `bleu_over_copy`; `min_source_over_copy`",
                          ">= 12; >= 5; >= 0"], cells
    bleu = json.loads((ROOT / "runs" / "bahdanau" / "metrics.json").read_text())["bleu_beam"]
    assert cells[4].split(";")[0] == f"{bleu:.2f}", (cells[4], bleu)


def test_benchmark_table_heads_with_the_full_run_after_a_subset_is_re_measured():
    # docs/benchmarks.md's inference table: a row re-measured later (here listed first, as bahdanau is)
    # carries its machine and date and a mark; the header names the run the other rows come from.
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_inference

    kept = json.loads((ROOT / "docs" / "bench_inference.json").read_text())
    rows = [bench_inference.from_json(r) for r in kept["rows"][:3]]
    rows[0].update(machine="Other CPU, 8 cores", date="2026-12-01")
    for row in rows[1:]:
        row.update(machine="AMD EPYC, 2 cores", date=None)
    table = bench_inference.markdown(rows, kept["threads"], kept["repeats"])
    assert f"--repeats {kept['repeats']}` on AMD EPYC, 2 cores;" in table
    assert "† Re-measured on Other CPU, 8 cores (2026-12-01), after retraining: `python scripts/bench_inference.py " \
           f"{rows[0]['model']} --threads" in table
    marked = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "†" in line}
    assert marked == {rows[0]["model"] + "†"}, marked


def _readme_commands() -> list[list[str]]:
    """Every command line in the README's bash code blocks, split as the shell would (comments off)."""
    import shlex

    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_every_readme_command_names_real_commands_options_and_entries():
    # The README's code blocks drift when a command or option is renamed: each `attnzoo` line must
    # name a command, options its --help lists and params.yaml entries; each `dvc repro` target a
    # stage of dvc.yaml; each `make` target a Makefile rule.
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    entries = set(params["models"])
    stages = set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    makefile = (ROOT / "Makefile").read_text()
    commands = _readme_commands()
    assert len(commands) >= 15, commands
    helps: dict[str, str] = {}
    for argv in commands:
        if argv[0] == "attnzoo":
            if argv[1].startswith("-"):
                continue  # attnzoo --help / --version: tests/test_cli.py
            if argv[1] not in helps:
                done = subprocess.run([sys.executable, "-m", "pipeline.cli", argv[1], "--help"], cwd=ROOT,
                                      capture_output=True, text=True, timeout=120)
                assert done.returncode == 0, (argv, done.stderr)
                helps[argv[1]] = done.stdout
            for option in (a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")):
                assert option in helps[argv[1]], (argv, option)
            if argv[1] in {"train", "evaluate", "export", "publish", "predict"}:
                assert argv[2] in entries, argv
        elif argv[0] == "dvc" and argv[1] == "repro":
            for target in argv[2:]:
                kind, _, key = target.partition("@")
                assert kind in stages and key in entries | set(params["tasks"]), argv
        elif argv[0] == "make":
            assert re.search(rf"^{re.escape(argv[1])}:", makefile, flags=re.M), argv


def test_readme_plots_commands_draw_the_learning_curve_they_name():
    # `dvc plots show FILE... -x X -y Y` lines run here on the committed learning curves (they are
    # `cache: false` plots of train@, in git): every file gives points with both fields, x rising.
    import math

    lines = [argv for argv in _readme_commands() if argv[:3] == ["dvc", "plots", "show"]]
    assert lines
    for argv in lines:
        x, y = argv[argv.index("-x") + 1], argv[argv.index("-y") + 1]
        done = subprocess.run([*argv, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (argv, done.stderr)
        data = json.loads(done.stdout)["data"]
        files = [a for a in argv[3:] if a.endswith(".csv")]
        assert files and set(files) <= set(data), (argv, list(data))
        for name in files:
            (plot,) = data[name]
            points = plot["content"]["data"]["values"]
            steps = [int(p[x]) for p in points]
            assert len(points) >= 3 and steps == sorted(steps), (name, steps)
            assert all(math.isfinite(float(p[y])) for p in points), (name, y)
