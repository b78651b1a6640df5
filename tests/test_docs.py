"""docs/serving.md's table of served names gives the inputs and outputs the server really has, for
every kind of served model (read from the tiny published repository); the docs link to and name
only files that exist in the repository, and read as reference: no dated headings, issue numbers
or work log."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from serving.client import LocalClient
from tests.conftest import ROOT

# the tiny repository's model -> the docs/serving.md row that documents its kind
ROWS = {"bahdanau": "bahdanau", "luong": "luong_*", "transformer": "transformer", "ntm": "ntm",
        "pointer": "pointer_sort", "act": "act_parity", "programmer": "neural_programmer", "captioner": "sat_soft",
        "ram": "ram", "draw": "draw", "ocr": "attention_ocr", "speech": "speech_location"}


def _serving_table() -> dict[str, tuple[str, str]]:
    text = (ROOT / "docs" / "serving.md").read_text()
    table = text[text.index("| name | input | outputs |"):]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        name, inputs, outputs = (c.strip() for c in line.strip("|").split(" | ", 2))
        for entry in re.findall(r"`([^`]+)`", name):
            rows[entry] = (inputs, outputs)
    return rows


@pytest.mark.integration  # the published fixture synthesises speech with espeak-ng
@pytest.mark.parametrize("model", sorted(ROWS))
def test_serving_doc_table_matches_the_served_metadata(published, model):
    inputs, outputs = _serving_table()[ROWS[model]]
    meta = LocalClient(published.repo).model_metadata(model)
    for spec in meta["inputs"]:
        assert f"`{spec['name']}`" in inputs, (model, spec, inputs)
    for spec in meta["outputs"]:
        assert f"`{spec['name']}`" in outputs, (model, spec, outputs)


def _reference_docs() -> list:
    """The docs a user reads as reference: the README, CONTRIBUTING, docs/*.md and the READMEs of
    deploy/, data/corpora/, examples/ and profiles/."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
            *(ROOT / folder / "README.md" for folder in ("deploy", "data/corpora", "examples", "profiles"))]


def test_docs_link_only_to_files_in_the_repository():
    for doc in _reference_docs():
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


# A path a doc names in backticks under one of these folders must exist (a renamed or deleted file is
# caught); placeholders (`models/<arch>.py`, `runs/*/`) and pytest node ids (`::`) are not paths.
NAMED_PATH = re.compile(r"`((?:models|pipeline|serving|tests|scripts|deploy|docs|profiles)/[\w./-]*)`")


def test_docs_name_only_paths_that_exist():
    missing = [f"{doc.relative_to(ROOT)}: `{path}`" for doc in _reference_docs()
               for path in NAMED_PATH.findall(doc.read_text()) if not (ROOT / path).exists()]
    assert not missing, "docs name paths the repository does not have:\n" + "\n".join(missing)


# The comments of the committed data files the docs are made from name their scripts without backticks.
BARE_SCRIPT = re.compile(r"\b((?:scripts|pipeline)/[\w/-]+\.py)\b")


def test_the_docs_data_files_name_only_scripts_that_exist():
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc in sorted((ROOT / "docs").glob("*.yaml"))
               for path in BARE_SCRIPT.findall(doc.read_text()) if not (ROOT / path).exists()]
    assert not missing, "docs/*.yaml name scripts the repository does not have:\n" + "\n".join(missing)


# Docs are reference, not a work log: a heading carries no date, no line cites an issue number, and
# no line tells how the work went ("this session", "landed on main", "today's recipe"). Fenced code and `code spans`
# are left out of the word check (`session.run`); an ONNX Runtime session is a session of a
# library, so "ONNX Runtime session(s)" (also onnxruntime's, ORT's, CUDA's, "inference session")
# is allowed. Link targets and URLs are left out of the issue check (anchors, fragments), and so is
# a colour in code (`#000`, `#336699`).
_FENCE = re.compile(r"^\s{0,3}(?:```|~~~)")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s")
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
_ISSUE = re.compile(r"(?<![\w&#/])#\d+(?![\w-])")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK_OR_URL = re.compile(r"\]\([^)]*\)|<?\bhttps?://[^\s)>]*>?")
_COLOUR = re.compile(r"#(?:\d{3}|\d{6})\b")
_WORK_LOG = re.compile(r"\b(?:sessions?|landed|today(?:['’]s)?)\b", re.I)
_LIBRARY_SESSION = re.compile(r"\b(?:ONNX Runtime|onnxruntime|ORT|CUDA|inference)(?:['’]s)?"
                              r"(?:\s+(?!(?:this|that|the|a|an|in|of|for|to|each|every)\b)[\w-]+)?\s+sessions?\b", re.I)


def work_log_lines(text: str) -> list[tuple[int, str]]:
    """``[(line number, what is wrong)]`` of one markdown text, by the rules above."""
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            code = _LINK_OR_URL.sub(" ", line)
            issues = [m.group(0) for m in _ISSUE.finditer(code) if not _COLOUR.fullmatch(m.group(0))]
            found += [(number, f"issue reference {i!r} in code") for i in issues]
            continue
        if _HEADING.match(line) and _DATE.search(line):
            found.append((number, f"dated heading {line.strip()!r}"))
        spans = [m.group(0) for m in _CODE_SPAN.finditer(line)]
        prose = _CODE_SPAN.sub(" ", _LINK_OR_URL.sub(" ", line))
        issues = [m.group(0) for m in _ISSUE.finditer(prose)]
        issues += [m.group(0) for s in spans for m in _ISSUE.finditer(_LINK_OR_URL.sub(" ", s))
                   if not _COLOUR.fullmatch(m.group(0))]
        found += [(number, f"issue reference {i!r}") for i in issues]
        found += [(number, f"work-log word {w!r}") for w in _WORK_LOG.findall(_LIBRARY_SESSION.sub(" ", prose))]
    return found


def test_the_work_log_check_tells_reference_from_history():
    text = "\n".join([
        "# Results (2026-11-25)",                       # 1: dated heading
        "## Results",
        "Fixed in #24, see [the flow](architecture.md#1-the-data-flow) and https://x.org/a#12.",  # 3: #24 only
        "The fifth session measured it; the retrain landed on main.",  # 4: two words
        "One ONNX Runtime session per graph; onnxruntime's CUDA sessions; `session.run` twice.",
        "Measured 2026-11-25 on this machine.",         # a date in prose is not a heading
        "```bash",
        "# 2026-11-25: a shell comment, not a heading; colour '#336699', see #7",  # 8: #7 only
        "sess.run(None, feeds)  # one session",
        "```",
        "A colour in code: `#fff`, `#000`; not in prose: #100.",  # 11: #100
        "No GPU was lent for the CUDA EP in this session.",  # 12: not an ONNX Runtime session
        "The training with today's recipe.",             # 13: a time that passes
    ])
    assert work_log_lines(text) == [
        (1, "dated heading '# Results (2026-11-25)'"),
        (3, "issue reference '#24'"),
        (4, "work-log word 'session'"), (4, "work-log word 'landed'"),
        (8, "issue reference '#7' in code"),
        (11, "issue reference '#100'"),
        (12, "work-log word 'session'"),
        (13, "work-log word \"today's\""),
    ]


def test_docs_read_as_reference_not_as_a_work_log():
    # Fails on a doc that still has dated headings, issue numbers or work-log words: fix the lines it
    # lists (state the fact, drop the story; the story belongs in the commit message).
    offenders = [f"{doc.relative_to(ROOT)}:{number}: {what}" for doc in _reference_docs()
                 for number, what in work_log_lines(doc.read_text())]
    assert not offenders, f"{len(offenders)} line(s) read as a work log:\n" + "\n".join(offenders)


# The same for the code's remarks: a comment or docstring says why, in the present; a ticket's number
# (#24) or a review's "Finding 3" names a list its reader cannot see. This file holds the checks' own
# examples, and generated protobuf modules are left out.
_FINDING = re.compile(r"\b[Ff]inding \d+\b")
CODE_FOLDERS = ("models", "pipeline", "serving", "scripts", "tests", "deploy")


def code_remarks(text: str) -> list[tuple[int, str]]:
    """``[(line number, text)]`` of each comment and each docstring line of one Python source."""
    import ast
    import io
    import tokenize

    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if (doc := ast.get_docstring(node, clean=False)) is not None:
                found += [(node.body[0].lineno + i, line) for i, line in enumerate(doc.splitlines())]
    return sorted(found)


def cited_lists(line: str) -> list[str]:
    issues = [m.group(0) for m in _ISSUE.finditer(_LINK_OR_URL.sub(" ", line)) if not _COLOUR.fullmatch(m.group(0))]
    return issues + _FINDING.findall(line)


def test_code_remarks_are_told_from_code_and_data():
    source = '''"""Module: see #24."""
PATTERN = "[-+ #0]*"  # a colour #336699 is fine; Finding 3 is not
def f():
    """Finding 2: the old way.

    More, #7 here."""
    return "#5"
'''
    remarks = code_remarks(source)
    assert [(n, cited_lists(text)) for n, text in remarks if cited_lists(text)] == [
        (1, ["#24"]), (2, ["Finding 3"]), (4, ["Finding 2"]), (6, ["#7"])]


def test_code_remarks_cite_no_issue_or_review_finding():
    sources = {path: path.read_text() for folder in CODE_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
               if path.name != "test_docs.py" and not path.name.endswith("_pb2.py")}
    # parse only the files that could cite one
    suspects = {path: text for path, text in sources.items() if re.search(r"#\d|[Ff]inding \d", text)}
    offenders = [f"{path.relative_to(ROOT)}:{number}: {cited}" for path, text in suspects.items()
                 for number, line in code_remarks(text) for cited in cited_lists(line)]
    assert not offenders, "remarks that cite a list the reader cannot see (say why instead):\n" + "\n".join(offenders)


@pytest.mark.integration
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


def _inference_rows(n: int) -> tuple[object, dict, list[dict]]:
    """scripts/bench_inference.py, the committed docs/bench_inference.json and its first ``n`` rows as measured."""
    import bench_inference

    kept = json.loads((ROOT / "docs" / "bench_inference.json").read_text())
    return bench_inference, kept, [bench_inference.from_json(r) for r in kept["rows"][:n]]


def test_benchmark_table_heads_with_the_full_run_after_a_subset_is_re_measured():
    # docs/benchmarks.md's inference table: a row re-measured later (here listed first, as bahdanau is)
    # carries a mark naming its command and machine; the header names the run the other rows come from.
    bench_inference, kept, rows = _inference_rows(3)
    rows[0].update(machine="Other CPU, 8 cores", date="2026-12-01")
    for row in rows[1:]:
        row.update(machine="AMD EPYC, 2 cores", date=None)
    table = bench_inference.markdown(rows, kept["threads"], kept["repeats"])
    assert f"--repeats {kept['repeats']}` on AMD EPYC, 2 cores;" in table
    assert f"† These rows: `python scripts/bench_inference.py {rows[0]['model']} --threads " in table
    assert "--write-docs` on Other CPU, 8 cores (the run recorded no CPU flags)." in table and "2026-12-01" not in table
    marked = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "†" in line}
    assert marked == {rows[0]["model"] + "†"}, marked


def test_benchmark_table_names_no_model_when_one_run_measured_them_all():
    bench_inference, _, rows = _inference_rows(3)
    for row in rows:
        row.update(machine="AMD EPYC, 2 cores, AVX-512", date="2026-12-05")
    table = bench_inference.markdown(rows, [1, 2], 5)
    assert ("`python scripts/bench_inference.py --threads 1 2 --repeats 5 --write-docs` on AMD EPYC, 2 cores, "
            "AVX-512 (2026-12-05); median of 5 repeats. ") in table and "These rows" not in table


def test_benchmark_table_marks_the_full_run_with_its_own_command_once_a_later_run_has_more_rows():
    bench_inference, _, rows = _inference_rows(3)
    for row in rows[:2]:
        row.update(machine="AMD EPYC, 2 cores, AVX-512", date="2026-12-05")
    rows[2].update(machine="AMD EPYC, 2 cores", date=None)
    table = bench_inference.markdown(rows, [1, 2], 5)
    head = f"`python scripts/bench_inference.py {rows[0]['model']} {rows[1]['model']} --threads 1 2 --repeats 5 "
    assert head + "--write-docs` on AMD EPYC, 2 cores, AVX-512 (2026-12-05); median of 5 repeats. " in table
    assert ("- † These rows: `python scripts/bench_inference.py --threads 1 2 --repeats 5` on AMD EPYC, 2 cores "
            "(the run recorded no CPU flags).") in table


def _readme_commands() -> list[list[str]]:
    """Every command line in the README's bash code blocks, split as the shell would (comments off)."""
    import shlex

    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.integration
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
                done = subprocess.run([sys.executable, "-m", "pipeline.runner.cli", argv[1], "--help"], cwd=ROOT,
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


@pytest.mark.integration
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


def test_the_stated_output_sizes_are_dvc_locks():
    """docs/troubleshooting.md's sizes of the pipeline's outputs: `dvc.lock`'s `size` fields, summed by kind (to the
    tenth of a GiB stated)."""
    kinds = {"prepared data": lambda p: p.startswith("data/prepared/"),
             "checkpoints": lambda p: p.endswith("/checkpoint"),
             "published versions": lambda p: p.startswith("model_repository/"),
             "ONNX graphs": lambda p: p.endswith(("/onnx", "/int8"))}
    outs = [o for stage in yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"].values()
            for o in stage.get("outs", [])]
    text = " ".join((ROOT / "docs" / "troubleshooting.md").read_text().split())
    for kind, of_kind in kinds.items():
        stated = float(re.search(rf"{kind} ([\d.]+) GiB", text).group(1))
        total = sum(o.get("size", 0) for o in outs if of_kind(o["path"])) / 2**30
        assert abs(stated - total) <= 0.05, (kind, stated, round(total, 2))


def test_troubleshootings_not_served_message_is_the_one_a_changed_version_gets(tmp_path):
    """The start-up error docs/troubleshooting.md quotes for a version whose file changed after publishing is the
    one a repository over such a version records (`<model>`, `<version>`, `<file>` and `...` standing for its parts)."""
    from serving.repository import Repository

    version = tmp_path / "ntm" / "3"
    version.mkdir(parents=True)
    (version / "step.onnx").write_bytes(b"changed after publishing")
    (version / "metadata.json").write_text(json.dumps({"graphs": ["step"], "files_sha256": {"step.onnx": "0" * 64}}))
    repo = Repository(tmp_path, provider="cpu")
    (key, why), = repo.errors.items()
    text = " ".join((ROOT / "docs" / "troubleshooting.md").read_text().split())
    quoted = re.search(r"`(not served: [^`]+)`", text).group(1)
    pattern = re.escape(quoted).replace(re.escape("..."), ".*")
    for placeholder, value in (("<model>", "ntm"), ("<version>", "3"), ("<file>", "step.onnx")):
        pattern = pattern.replace(re.escape(placeholder), re.escape(value))
    assert re.fullmatch(pattern, f"not served: {key} ({why})"), (quoted, key, why)


def test_securitys_content_security_policy_is_the_playgrounds():
    """docs/security.md states the playground's Content-Security-Policy: its default source, the other sources it
    lets images come from, and what it forbids outright."""
    from serving.server import PAGE_HEADERS

    policy = dict(d.strip().split(" ", 1) for d in PAGE_HEADERS["Content-Security-Policy"].split(";"))
    text = " ".join((ROOT / "docs" / "security.md").read_text().split())
    stated = re.search(r"`Content-Security-Policy` is `default-src ([^`]+)` \(([^)]+)\)", text)
    assert stated and stated.group(1) == policy.pop("default-src"), policy
    images = [s for s in policy.pop("img-src").split() if s != "'self'"]
    assert re.findall(r"`(\w+:)`", stated.group(2)) == images
    forbidden = {"object-src": "objects", "form-action": "forms", "base-uri": "base URI", "frame-ancestors": "framing"}
    assert set(policy) == set(forbidden) and all(v == "'none'" for v in policy.values()), policy
    assert all(words in stated.group(2) for words in forbidden.values())


def _script_usage_lines() -> list[tuple[str, list[str]]]:
    """Each `python scripts/...py ARGS` line of a script's own docstring (continuations joined, comments dropped)."""
    import ast
    import shlex

    found = []
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        doc = (ast.get_docstring(ast.parse(path.read_text())) or "").replace("\\\n", " ")
        for line in doc.splitlines():
            if re.match(r"\s*python scripts/", line):
                words = shlex.split(line, comments=True)
                cut = next((i for i, w in enumerate(words) if w in ("&&", "|", ">", ";")), len(words))
                found.append((str(path.relative_to(ROOT)), words[:cut]))
    return found


@pytest.mark.integration  # a python process per usage line
@pytest.mark.parametrize("path, words", _script_usage_lines(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_usage_line_in_a_scripts_docstring_parses(path, words):
    """A script's usage lines (of itself or a script it works with) give only options and choices the named script's
    argument parser takes: argparse reads options left to right, so an unknown option or a value outside its choices
    fails before the trailing --help."""
    done = subprocess.run([sys.executable, *words[1:], "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, (path, " ".join(words), done.stderr[-400:])
