"""The README's serving block, run as written: `attnzoo serve` (on loopback instead of 0.0.0.0, on a
free port) and every `attnzoo predict` / `attnzoo translate` line, against a tiny repository that
holds each model the README names, built as `publish` builds one. Each line runs once through the
server and once with `--local`, and both must give the same answer."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import wave

import numpy as np
import pytest
import torch
import yaml

import models
from tests.conftest import ROOT, TINY, stop_process
from tests.serving_repo import _publish
from tests.test_cli import cli

# The README's ntm example: 8 bits and the delimiter channel, as the copy task's data has them.
SHAPES = {"ntm": {"input_size": 9, "output_size": 8}}


def readme_serving_lines() -> list[list[str]]:
    """The `attnzoo serve / predict / translate` lines of the README's bash blocks, split as the shell would."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    lines = [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()]
    return [argv for argv in lines if argv[:2] in (["attnzoo", "serve"], ["attnzoo", "predict"],
                                                   ["attnzoo", "translate"])]


def _model_of(argv: list[str]) -> str:
    return argv[argv.index("--model") + 1] if argv[1] == "translate" else argv[2]


@pytest.fixture(scope="module")
def readme_repo(published, tmp_path_factory):
    """model_repository/<name> for every model a README line names: the tiny published model of the
    same architecture (tests/serving_repo.py), copied under the README's name, or one built here
    where the README's input needs other sizes."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())["models"]
    tmp = tmp_path_factory.mktemp("readme")
    repo = tmp / "model_repository"
    by_arch = {}
    for folder in sorted(published.repo.iterdir()):
        meta = json.loads((folder / "1" / "metadata.json").read_text())
        by_arch.setdefault(meta["arch"], folder)
    for seed, name in enumerate(sorted({_model_of(argv) for argv in readme_serving_lines() if argv[1] != "serve"})):
        arch = params[name]["arch"]
        if name in SHAPES:
            torch.manual_seed(seed)
            _publish(repo, name, arch, params[name]["task"], models.build(arch, {**TINY[arch], **SHAPES[name]}).eval(),
                     tmp, [])
            continue
        assert arch in by_arch, f"the README names {name}; give tests/serving_repo.py a tiny {arch}"
        shutil.copytree(by_arch[arch] / "1", repo / name / "1")
        meta_path = repo / name / "1" / "metadata.json"
        meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "model": name}))
    return repo, tmp


def _inputs(url: str, tmp, argv: list[str]) -> None:
    """The line's input file, written where the line expects it (cwd ``tmp``) at the model's sizes."""
    from PIL import Image

    with urllib.request.urlopen(f"{url}/v2/models/{_model_of(argv)}", timeout=10) as r:
        meta = json.loads(r.read())
    for i, arg in enumerate(argv):
        if arg.endswith(".png"):
            # [N, H, W]: an image model's fixed size; a text line's free width (-1) is scaled to its height
            height, width = (d if d > 0 else 32 * (k + 1) for k, d in enumerate(meta["inputs"][0]["shape"][1:3]))
            pixels = (np.random.default_rng(0).random((height, width)) * 255).astype(np.uint8)
            Image.fromarray(pixels, mode="L").save(tmp / arg)
        elif arg.endswith(".wav"):
            with wave.open(str(tmp / arg), "wb") as w:  # one second of a 440 Hz tone, 16 kHz mono 16-bit
                w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
                w.writeframes((np.sin(np.arange(16000) * 2 * np.pi * 440 / 16000) * 8000).astype("<i2").tobytes())
        elif argv[i - 1] == "-i":
            (tmp / arg).write_text("\n".join(["Wo ist der Hund?", "Ich habe heute keine Zeit.", ""]) + "\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str], cwd) -> subprocess.CompletedProcess:
    """A README line, ``attnzoo ...``, as the user runs it."""
    return cli(*argv[1:], cwd=cwd, timeout=180)


def test_readme_serving_block_runs_as_written_through_the_server_and_locally(readme_repo):
    repo, tmp = readme_repo
    lines = readme_serving_lines()
    (serve,) = [argv for argv in lines if argv[1] == "serve"]
    assert len(lines) >= 10, lines
    port = _free_port()
    # As written, but loopback only and a free port: --host/--port replaced, --repository the tiny one.
    swap = {"--host": "127.0.0.1", "--port": str(port), "--repository": str(repo)}
    argv = [swap.get(serve[i - 1], a) if i else a for i, a in enumerate(serve)]
    server = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *argv[1:]], cwd=tmp,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None and time.time() < deadline, "the README's serve line did not come up"
            time.sleep(0.5)
        ran = 0
        for line in lines:
            if line[1] == "serve":
                continue
            _inputs(url, tmp, line)
            plain = [a for a in line if a != "--local"]
            if line[1] == "translate":
                via_server = _run([*plain[:plain.index("-o") + 1], "en.server.txt",
                                   *plain[plain.index("-o") + 2:], "--url", url], tmp)
                local = _run([*plain, "--local", "--repository", str(repo)], tmp)
                assert via_server.returncode == 0 and local.returncode == 0, (line, via_server.stderr, local.stderr)
                out = (tmp / plain[plain.index("-o") + 1]).read_text().splitlines()
                assert len(out) == 3 and out[2] == "" and all(out[:2]), out  # line for line, the blank line kept
                assert (tmp / "en.server.txt").read_text().splitlines() == out
            else:
                via_server = _run([*plain, "--url", url], tmp)
                local = _run([*plain, "--local", "--repository", str(repo)], tmp)
                assert via_server.returncode == 0, (line, via_server.stderr)
                assert local.returncode == 0, (line, local.stderr)
                assert via_server.stdout.strip(), line
                if via_server.stdout.lstrip().startswith("{"):  # JSON answers: the same numbers, to float noise
                    a, b = json.loads(via_server.stdout), json.loads(local.stdout)
                    assert a.keys() == b.keys(), line
                    for key in a:
                        np.testing.assert_allclose(np.asarray(a[key], dtype=float), np.asarray(b[key], dtype=float),
                                                   atol=1e-5, err_msg=f"{line}: {key}")
                else:  # text answers (a translation, a caption, a class and its glimpse path)
                    assert via_server.stdout == local.stdout, line
            ran += 1
        assert ran == len(lines) - 1
    finally:
        stop_process(server)
