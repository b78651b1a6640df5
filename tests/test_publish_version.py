"""publish's version writing loads the new version into the server's code once: the model card, Triton's
``config.pbtxt`` and the MLflow signature all take that one load."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import models
from pipeline.serving_meta import serving_meta
from pipeline.stages import publish
from pipeline.stages.export import export_onnx
from tests.conftest import TINY


def test_a_new_version_is_loaded_once_and_triton_sees_what_a_fresh_load_sees(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = models.build("ntm", TINY["ntm"]).eval()
    export_onnx(model, tmp_path / "onnx")
    graphs = sorted(p.stem for p in (tmp_path / "onnx").glob("*.onnx"))
    block = serving_meta(model.cfg, graphs, SimpleNamespace(task="copy", evaluate={}))
    from serving import kinds

    loads, original = [], kinds.load_version

    def counted(*args, **kwargs):
        loads.append(args[:2])
        return original(*args, **kwargs)

    monkeypatch.setattr("serving.kinds.load_version", counted)
    repo = tmp_path / "repo" / "ntm"
    meta, created, served = publish.write_version(repo, "ntm", tmp_path / "onnx", block,
                                                  {"arch": "ntm", "task": "copy", "production": True}, [])
    assert created and meta["version"] == 1 and (repo / "1" / "model.py").is_file()  # Triton's python backend
    assert loads == [("ntm", 1)]
    assert served == original("ntm", 1, repo / "1", "cpu")[0].metadata([1])
    # config.pbtxt as a fresh load of the newest version writes it
    fresh = publish.config_pbtxt("ntm", repo, tmp_path / "onnx", graphs, (0, None))
    assert (repo / "config.pbtxt").read_text() == fresh
    assert 'input [\n  { name: "x" data_type: TYPE_FP32 dims: [ -1, -1, 5 ] }' in fresh
    # An unchanged model writes nothing and loads nothing.
    loads.clear()
    assert publish.write_version(repo, "ntm", tmp_path / "onnx", block, {"arch": "ntm"}, [])[1:] == (False, None)
    assert loads == []
