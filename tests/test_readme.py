"""The README as a newcomer meets it: short, its two first commands, generated tables that match the
committed runs, every command in its code blocks run by some test, and the quick start's code path
(the real stages, then the published models answering the sample inputs) run end to end on the smoke
profile in a scratch copy that leaves the checkout untouched."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import profiles
from tests.conftest import ROOT
from tests.test_pipeline_smoke import checkout_state

pytestmark = pytest.mark.integration  # starts servers or processes

README = ROOT / "README.md"

# Each kind of README command line -> the test that runs it (file::function). A new command in the
# README needs a line here, and so a test that runs it. Two are run by a file instead: `make test` by CI
# (.ci/run calls it on a fresh clone), and `source .venv/bin/activate` activates what scripts/setup.sh makes,
# which every `make` target and CI run.
SERVING_BLOCK = ("tests/test_readme_commands.py::"
                 "test_readme_serving_block_runs_as_written_through_the_server_and_locally")
COVERED = {
    ("make", "repro"): "tests/test_pipeline_smoke.py::test_make_repro_end_to_end_then_dvc_repro_has_nothing_to_do",
    ("make", "test"): ".ci/run",
    ("make", "quickstart"): "tests/test_readme.py::test_quickstart_trains_publishes_and_answers_the_sample_inputs",
    ("attnzoo", "quickstart"): "tests/test_readme.py::test_quickstart_trains_publishes_and_answers_the_sample_inputs",
    ("attnzoo", "repro"): "tests/test_pipeline_smoke.py::test_make_repro_end_to_end_then_dvc_repro_has_nothing_to_do",
    ("attnzoo", "serve"): SERVING_BLOCK,
    ("attnzoo", "predict"): SERVING_BLOCK,
    ("attnzoo", "translate"): SERVING_BLOCK,
    ("attnzoo", "train"): "tests/test_readme.py::test_readme_single_stage_block_runs_as_written",
    ("attnzoo", "evaluate"): "tests/test_readme.py::test_readme_single_stage_block_runs_as_written",
    ("attnzoo", "export"): "tests/test_readme.py::test_readme_single_stage_block_runs_as_written",
    ("attnzoo", "quantize"): "tests/test_readme.py::test_readme_single_stage_block_runs_as_written",
    ("attnzoo", "publish"): "tests/test_readme.py::test_readme_single_stage_block_runs_as_written",
    ("attnzoo", "list"): "tests/test_readme.py::test_readme_single_stage_block_runs_as_written",
    ("attnzoo", "--help"): "tests/test_readme.py::test_readme_single_stage_block_runs_as_written",
    ("dvc", "repro"): "tests/test_readme.py::test_readme_single_stage_block_runs_as_written",
    ("dvc", "plots"): "tests/test_docs.py::test_readme_plots_commands_draw_the_learning_curve_they_name",
    ("source", ".venv/bin/activate"): "scripts/setup.sh",
}


def readme_commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_readme_is_short_and_opens_with_its_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 160, len(text.splitlines())
    first = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    assert [shlex.split(line, comments=True) for line in first.splitlines()] == [["make", "repro"], ["make", "test"]]


def test_readme_generated_tables_match_the_committed_runs():
    done = subprocess.run([sys.executable, "scripts/readme_tables.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_every_readme_command_is_run_by_a_test():
    for argv in readme_commands():
        key = tuple(argv[:2])
        assert key in COVERED, f"no test runs the README line {' '.join(argv)}: add one and name it in COVERED"
        where, _, test = COVERED[key].partition("::")
        assert (ROOT / where).exists(), where
        if test:
            assert re.search(rf"^def {re.escape(test)}\(", (ROOT / where).read_text(), flags=re.M), COVERED[key]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """`attnzoo quickstart --profile smoke` in a scratch folder: (its work folder, what it printed)."""
    work = tmp_path_factory.mktemp("quickstart") / "work"
    before = checkout_state()
    done = subprocess.run([sys.executable, "-m", "pipeline.runner.cli", "quickstart", "--profile", "smoke", "--workdir",
                           str(work), "--jobs", "2"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert checkout_state() == before
    return work, done.stdout


@pytest.mark.slow
def test_quickstart_trains_publishes_and_answers_the_sample_inputs(quickstart):
    """`attnzoo quickstart` (what `make quickstart` runs after the setup) on the smoke profile: every
    stage of its three entries, then each published model answers its sample input of examples/."""
    work, out = quickstart
    for name, example in (("neural_programmer", "examples/table_qa.json"), ("pointer_sort", "examples/sort.json"),
                          ("act_parity", "examples/parity.json")):
        assert f"$ attnzoo predict {name} {example} --local --attention" in out, out
        assert (work / "model_repository" / name / "1" / "metadata.json").exists()
        assert f"attention plots: runs/{name}/plots/" in out, out
    # the answers are read off the models' outputs: a table answer, a permutation of the 5+ numbers, a parity bit
    assert re.search(r"answer: +(-?[\d.e+]+|the cells at)", out), out
    pointers = [int(i) for i in re.search(r"pointers: \[([\d, ]+)\]", out).group(1).split(",")]
    assert sorted(pointers) == list(range(len(pointers))) and len(pointers) >= 5, pointers
    assert re.search(r"parity: +[01] ", out), out


@pytest.mark.slow
def test_readme_single_stage_block_runs_as_written(quickstart, tmp_path):
    """The README's single-stage lines (`dvc repro STAGE`, ad-hoc `attnzoo train/evaluate/publish`
    into a folder, `attnzoo list`, `--help`) in the quick start's smoke-profile folder, its ad-hoc
    folder under tmp_path; the `dvc plots` line runs in tests/test_docs.py."""
    work, _ = quickstart
    kinds = [["dvc", "repro"], *(["attnzoo", c] for c in ("train", "evaluate", "export", "quantize", "publish", "list",
                                                           "--help"))]
    lines = [argv for argv in readme_commands() if argv[:2] in kinds]
    assert len(lines) >= 5, lines
    env = {**profiles.env_for(work), "PATH": f"{sys.prefix}/bin:" + os.environ["PATH"]}
    for argv in lines:
        argv = [str(tmp_path / a[len("/tmp/"):]) if a.startswith("/tmp/") else a for a in argv]
        cmd = argv if argv[0] == "dvc" else [sys.executable, "-m", "pipeline.runner.cli", *argv[1:]]
        done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (argv, done.stdout[-3000:], done.stderr[-3000:])
        if argv[1] == "publish":
            out = argv[argv.index("--run") + 1]
            assert list((Path(out) / "model_repository").glob("*/1/metadata.json")), argv


def quick_start_output() -> str:
    """The README's quick-start transcript: its one ```text block."""
    return re.search(r"```text\n(.*?)```", README.read_text(), flags=re.S).group(1)


def test_readme_quick_start_output_quotes_the_committed_metrics():
    """The quick start's printed bars in the README are the committed runs/<entry>/metrics.json."""
    import json

    text = quick_start_output()
    quoted = re.findall(r"^(\w+) \(version \d+; bar: (\w+) ([\d.]+) >= ([\d.]+): met\)$", text, flags=re.M)
    assert {name for name, *_ in quoted} == {"neural_programmer", "pointer_sort", "act_parity"}, text
    for name, metric, measured, bar in quoted:
        (cond,) = [c for c in json.loads((ROOT / "runs" / name / "metrics.json").read_text())["bar"]["conditions"]
                   if c["metric"] == metric]
        assert (float(measured), float(bar)) == (cond["measured"], cond["value"]), (name, metric)


def test_readme_quick_start_output_shows_the_sample_inputs_of_examples():
    """Each answer in the README's quick-start output is printed beside its input as the quick start prints it
    (pipeline/runner/quickstart.py): examples/table_qa.json's question, sort.json's numbers, parity.json's bits."""
    import json

    text = quick_start_output()
    table = json.loads((ROOT / "examples" / "table_qa.json").read_text())
    assert f"  question: {table['question'][0]}\n" in text, text
    numbers = [round(p[0], 3) for p in json.loads((ROOT / "examples" / "sort.json").read_text())["points"][0]]
    assert f"  numbers:  {numbers}\n" in text, text
    bits = json.loads((ROOT / "examples" / "parity.json").read_text())["x"][0]
    assert f"  inputs:  {bits} ({bits.count(1)} of them +1)\n" in text, text


def _inline_commands(text: str, program: str) -> list[list[str]]:
    """Every ``program ...`` in the text's inline code (`...`) and code blocks, as argv (comments cut)."""
    found = re.findall(rf"`({program} [^`\n]+)`", text)
    found += [line.split("  #")[0] for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
              for line in block.splitlines() if line.startswith(program + " ")]
    return [shlex.split(c) for c in found]


def test_repro_commands_in_the_docs_name_real_stages():
    """A documented `attnzoo repro` names stages that exist (a foreach group, or group@key of dvc.yaml), with no
    placeholder, and never `-s` before a prepare@ stage (it would skip the task_code@ stage prepare needs)."""
    import yaml

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    keys = {"tasks": set(params["tasks"]), "models": set(params["models"])}
    named = 0
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for argv in _inline_commands(path.read_text(), "attnzoo repro"):
            options_with_values = {"-j", "--jobs", "--profile", "--workdir", "--ray"}
            targets = [a for i, a in enumerate(argv[2:], 2) if not a.startswith("-")
                       and argv[i - 1] not in options_with_values]
            for target in targets:
                group, _, key = target.partition("@")
                assert group in stages and "…" not in target and "..." not in target, (path.name, argv)
                if key and not re.fullmatch(r"<\w+>", key):  # <model>: a metavariable the sentence explains
                    over = stages[group]["foreach"].strip("${}")
                    assert key in keys[over], (path.name, argv)
                named += 1
            assert not ("-s" in argv and any(t.startswith("prepare") for t in targets)), (path.name, argv)
    assert named >= 3  # the check reads the documented commands


def test_the_readme_serve_line_lists_the_servers_providers():
    from serving import server

    line = next(line for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith("attnzoo serve ") and "--provider" in line)
    listed = re.search(r"--provider ([\w|]+)", line).group(1).split("|")
    assert listed == list(server.PROVIDERS) and server.ServeConfig().provider == listed[0]


def test_a_new_architecture_without_a_readme_family_is_one_sentence(capsys):
    """docs/adding-a-model.md: the generated model table needs a new architecture's row in FAMILY, and a new
    entry without a bar its headline metric in HEADLINE."""
    import readme_tables

    assert readme_tables.family_of("luong") == readme_tables.family_of("transformer")  # one row, two archs
    fixable = readme_tables.cli_errors.ScriptError  # one line `error: ...`, exit 2
    with pytest.raises(fixable, match=r"^architecture 'newnet' has no family: add its README row name to FAMILY$"):
        readme_tables.family_of("newnet")
    assert readme_tables.headline_of("rnn_parity") == "accuracy"
    with pytest.raises(fixable, match=r"^entry 'newnet_none' has no bar and no headline metric: add the metric its "
                                      r"row shows to HEADLINE in scripts/results_table.py$"):
        readme_tables.headline_of("newnet_none")


def test_adding_a_model_shows_the_real_params_yaml_entry():
    """docs/adding-a-model.md's worked `params.yaml` entry is act_parity's and parity's as the file has them
    (a copy that restated defaults would fail tests/test_config.py's one-home check)."""
    text = (ROOT / "docs" / "adding-a-model.md").read_text()
    block = text[text.index("## 3. The `params.yaml` entry"):]
    shown = yaml.safe_load(re.search(r"```yaml\n(.*?)```", block, flags=re.S).group(1))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert shown["tasks"] == {"parity": params["tasks"]["parity"]}
    assert shown["models"] == {"act_parity": params["models"]["act_parity"]}
