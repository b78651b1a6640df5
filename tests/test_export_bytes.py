"""A published graph's bytes depend on the model alone: not on where the checkout lies, nor on the line
numbers of the code that built it, and no published file names the builder's directories."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Run inside a checkout: export a tiny Pointer Network (profiles/smoke.yaml's size) and publish it as
# version 1 into the checkout's own model_repository/, as publish@ does.
EXPORT_AND_PUBLISH = """
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

import models
from pipeline.serving_meta import serving_meta
from pipeline.stages import publish
from pipeline.stages.export import export_onnx

here = Path.cwd()
tiny = yaml.safe_load((here / "profiles" / "smoke.yaml").read_text())["archs"]["pointer_net"]
torch.manual_seed(0)
model = models.build("pointer_net", tiny).eval()
export_onnx(model, here / "onnx")
graphs = sorted(p.stem for p in (here / "onnx").glob("*.onnx"))
block = serving_meta(model.cfg, graphs, SimpleNamespace(task="convex_hull", evaluate={}))
publish.write_version(here / "model_repository" / "pointer_net", "pointer_net", here / "onnx", block,
                      {"arch": "pointer_net", "task": "convex_hull", "production": True}, [])
"""


def _checkout(at: Path, shift_lines: bool) -> Path:
    """The code export and publish run, copied to ``at``; ``shift_lines`` moves every line of the
    model and the layers it uses down by a comment, as an unrelated edit above them would."""
    for folder in ("models", "pipeline", "serving", "profiles"):
        shutil.copytree(ROOT / folder, at / folder, ignore=shutil.ignore_patterns("__pycache__"))
    if shift_lines:
        for name in ("pointer_net.py", "layers.py"):
            path = at / "models" / name
            path.write_text("# a comment that moves every line below it\n" + path.read_text())
    return at


def _run(checkout: Path) -> None:
    done = subprocess.run([sys.executable, "-c", EXPORT_AND_PUBLISH], cwd=checkout, capture_output=True,
                          text=True, timeout=600, env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin",
                                                       "HOME": str(checkout), "MLFLOW_TRACKING_URI": ""})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_two_checkouts_at_different_paths_export_byte_identical_graphs_and_publish_no_path(tmp_path):
    one = _checkout(tmp_path / "one" / "attnzoo", shift_lines=False)
    two = _checkout(tmp_path / "elsewhere" / "deeper" / "zoo", shift_lines=True)
    for checkout in (one, two):
        _run(checkout)
    graphs = sorted(p.name for p in (one / "onnx").glob("*.onnx"))
    assert graphs == ["decoder_step.onnx", "encoder.onnx"]
    for name in graphs:
        assert (one / "onnx" / name).read_bytes() == (two / "onnx" / name).read_bytes(), name
    for checkout in (one, two):
        published = [p for p in (checkout / "model_repository").rglob("*") if p.is_file()]
        assert {p.name for p in published} >= {"decoder_step.onnx", "encoder.onnx", "metadata.json"}
        # Neither checkout's own path, nor the temporary folder both lie in, nor the interpreter's.
        for path in published:
            data = path.read_bytes()
            for absolute in (str(checkout), str(tmp_path), sys.prefix, str(ROOT)):
                assert absolute.encode() not in data, f"{path.relative_to(checkout)} names {absolute}"
