"""The README's serving lines, run as written: `attnzoo serve` (on loopback, on a free port) and every
`attnzoo predict` / `attnzoo translate` line, against a tiny repository that holds each model the
README names, built as `publish` builds one. Their inputs are the files of examples/
(scripts/make_examples.py: real test items), used as they are: the lines run in a folder that holds
examples/ (a link to the repository's), and the tiny models take the examples' real sizes. Each line
runs once through the server and once with `--local`, and both must give the same answer."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import models
from pipeline.config import load_params
from serving.client import Client
from tests.conftest import ROOT, TINY, stop_process
from tests.ports import free_port, wait_serving
from tests.serving_repo import _Publisher
from tests.test_cli import cli

pytestmark = pytest.mark.integration  # starts servers or processes

README = ROOT / "README.md"
# What `predict` reads as a file (serving/predict.py): images, WAV, .npy, JSON; `translate -i`: text.
FILE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".wav", ".npy", ".json", ".txt"}


def shapes() -> dict[str, dict]:
    """Served name -> the sizes its tiny model needs to take the example's real input (over TINY)."""
    tasks = load_params(ROOT)["tasks"]
    params = load_params(ROOT)["models"]
    from pipeline.tasks.sort import SortTask

    bits, canvas = tasks["copy"]["bits"], {t: tasks[t]["canvas"] for t in ("mnist_translated60", "mnist_cluttered60")}
    draw_latent = models.make_config("draw", params["draw"].get("model", {})).latent
    return {
        "ntm": {"input_size": bits + 1, "output_size": bits},  # 8 bits and the delimiter channel
        "pointer_sort": {"input_size": SortTask.point_size},  # one float a point (pointer_hull: 2, as TINY)
        "act_parity": {"input_size": tasks["parity"]["bits"]},
        "rnn_parity": {"input_size": tasks["parity"]["bits"]},
        "ram": {"image_size": canvas["mnist_translated60"]},
        "ram_cluttered": {"image_size": canvas["mnist_cluttered60"]},
        "draw": {"latent": draw_latent},
        "draw_none": {"latent": draw_latent},
        "attention_ocr": {"height": tasks["ocr_words"]["height"]},
        "ocr_rcnn": {"height": tasks["ocr_words"]["height"]},
    }


def readme_serving_lines() -> list[list[str]]:
    """The `attnzoo serve / predict / translate` lines of the README's bash blocks, split as the shell would."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    lines = [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()]
    return [argv for argv in lines if argv[:2] in (["attnzoo", "serve"], ["attnzoo", "predict"],
                                                   ["attnzoo", "translate"])]


def _model_of(argv: list[str]) -> str:
    return argv[argv.index("--model") + 1] if argv[1] == "translate" else argv[2]


def _file_inputs(argv: list[str]) -> list[str]:
    """The input files a predict / translate line names (`-i FILE`; a predict INPUT read as a file)."""
    if argv[1] == "translate":
        flag = "-i" if "-i" in argv else "--input"
        return [argv[argv.index(flag) + 1]]
    inputs = []
    for arg in argv[3:]:
        if arg.startswith("--"):
            break
        if Path(arg).suffix.lower() in FILE_SUFFIXES and not arg.lstrip().startswith("{"):
            inputs.append(arg)
    return inputs


def test_readme_inputs_are_files_of_examples():
    """Every input file a README line names is one of examples/, there in the repository."""
    lines = [argv for argv in readme_serving_lines() if argv[1] != "serve"]
    named = [(argv, path) for argv in lines for path in _file_inputs(argv)]
    assert named, "the README's predict / translate lines name no input file"
    for argv, path in named:
        assert Path(path).parts[0] == "examples" and len(Path(path).parts) == 2, (shlex.join(argv), path)
        assert (ROOT / path).is_file(), f"{shlex.join(argv)}: {path} is not in the repository"


@pytest.fixture(scope="module")
def readme_repo(published, tmp_path_factory):
    """model_repository/<name> for every model a README line names: the tiny published model of the
    same architecture (tests/serving_repo.py), copied under the README's name, or one built here at
    the example's sizes (``shapes()``); and a folder to run the lines in, holding examples/."""
    params = load_params(ROOT)["models"]
    tmp = tmp_path_factory.mktemp("readme")
    repo, work = tmp / "model_repository", tmp_path_factory.mktemp("readme-export")
    (tmp / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    by_arch = {}
    for folder in sorted(published.repo.iterdir()):
        meta = json.loads((folder / "1" / "metadata.json").read_text())
        by_arch.setdefault(meta["arch"], folder)
    sized, publish = shapes(), _Publisher(repo, work)
    for seed, name in enumerate(sorted({_model_of(argv) for argv in readme_serving_lines() if argv[1] != "serve"})):
        arch = params[name]["arch"]
        if name in sized:
            torch.manual_seed(seed)
            publish(name, arch, params[name]["task"], models.build(arch, {**TINY[arch], **sized[name]}).eval(), [])
            continue
        assert arch in by_arch, f"the README names {name}; give tests/serving_repo.py a tiny {arch}"
        shutil.copytree(by_arch[arch] / "1", repo / name / "1")
        meta_path = repo / name / "1" / "metadata.json"
        meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "model": name}))
    publish.finish()
    return repo, tmp


def _run(argv: list[str], cwd) -> subprocess.CompletedProcess:
    """A README line, ``attnzoo ...``, as the user runs it."""
    return cli(*argv[1:], cwd=cwd, timeout=180)


def _same_answer(line: list[str], via_server: subprocess.CompletedProcess, local: subprocess.CompletedProcess):
    if via_server.stdout.lstrip().startswith("{"):  # JSON answers: the same numbers, to float noise
        a, b = json.loads(via_server.stdout), json.loads(local.stdout)
        assert a.keys() == b.keys(), line
        for key in a:
            if np.asarray(a[key]).dtype.kind in "US":  # names (the Neural Programmer's operations): the same
                assert a[key] == b[key], (line, key)
                continue
            np.testing.assert_allclose(np.asarray(a[key], dtype=float), np.asarray(b[key], dtype=float),
                                       atol=1e-5, err_msg=f"{line}: {key}")
    else:  # text answers (a translation, a caption, a class and its glimpse path)
        assert via_server.stdout == local.stdout, line


def test_readme_serving_block_runs_as_written_through_the_server_and_locally(readme_repo):
    repo, tmp = readme_repo
    lines = readme_serving_lines()
    serves = [argv for argv in lines if argv[1] == "serve"]
    assert serves, "the README has no `attnzoo serve` line"
    serve = serves[0]
    for other in serves[1:]:  # every serve line serves the same repository
        assert other[other.index("--repository") + 1] == serve[serve.index("--repository") + 1], other
    asked = []  # each distinct predict / translate line once
    for argv in lines:
        if argv[1] != "serve" and argv not in asked:
            asked.append(argv)
    assert len(asked) >= 8, asked
    port = free_port()
    # As written, but loopback only and a free port: --host/--port replaced, --repository the tiny one.
    swap = {"--host": "127.0.0.1", "--port": str(port), "--repository": str(repo)}
    argv = [swap.get(serve[i - 1], a) if i else a for i, a in enumerate(serve)]
    server = subprocess.Popen([sys.executable, "-m", "pipeline.runner.cli", *argv[1:]], cwd=tmp,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        # Ready, and on its own port (not another worker's server handed the same port first).
        assert wait_serving(server, port, Client(url, timeout=2).ready, 120), "the README's serve line did not come up"
        for line in asked:
            plain = [a for a in line if a != "--local"]
            if line[1] == "translate":
                out_name = plain[plain.index("-o") + 1]
                via_server = _run([*plain[:plain.index("-o") + 1], "server." + out_name,
                                   *plain[plain.index("-o") + 2:], "--url", url], tmp)
                local = _run([*plain, "--local", "--repository", str(repo)], tmp)
                assert via_server.returncode == 0 and local.returncode == 0, (line, via_server.stderr, local.stderr)
                source = (tmp / _file_inputs(line)[0]).read_text(encoding="utf-8").splitlines()
                out = (tmp / out_name).read_text(encoding="utf-8").splitlines()
                assert len(out) == len(source), (line, out)  # line for line, blank lines kept blank
                assert all(bool(o.strip()) == bool(s.strip()) for o, s in zip(out, source)), (line, out)
                assert (tmp / ("server." + out_name)).read_text(encoding="utf-8").splitlines() == out
            else:
                via_server = _run([*plain, "--url", url], tmp)
                local = _run([*plain, "--local", "--repository", str(repo)], tmp)
                assert via_server.returncode == 0, (line, via_server.stderr)
                assert local.returncode == 0, (line, local.stderr)
                assert via_server.stdout.strip(), line
                _same_answer(line, via_server, local)
    finally:
        stop_process(server)
