"""quantize@<model>: the gate, the onnxruntime twin the task's evaluation scores, and the int8 variant's
publishing. Every architecture's graphs, fp32 and int8, scored by its task: tests/test_pipeline_smoke.py,
on the models the tiny pipeline trained."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import yaml

import models
from pipeline.config import UserError
from pipeline.stages.export import export_onnx
from pipeline.stages.quantize import NotFromGraphs, OnnxTwin, gate, settings
from tests.conftest import ROOT, TINY, tiny_batch


def test_gate_takes_the_direction_from_the_bar_and_allows_the_tolerance():
    bar = [{"metric": "seq_acc_beam", "op": ">=", "value": 95}, {"metric": "cer", "op": "<=", "value": 5}]
    ok = gate({"seq_acc_beam": 99.0, "cer": 0.2}, {"seq_acc_beam": 98.5, "cer": 0.7}, bar, 0.5)
    assert ok["passed"] and [c["worse_by"] for c in ok["conditions"]] == [0.5, 0.5]
    better = gate({"seq_acc_beam": 99.0, "cer": 0.2}, {"seq_acc_beam": 99.5, "cer": 0.0}, bar, 0.5)
    assert better["passed"] and [c["worse_by"] for c in better["conditions"]] == [-0.5, -0.2]
    bad = gate({"seq_acc_beam": 99.0, "cer": 0.2}, {"seq_acc_beam": 98.4, "cer": 0.2}, bar, 0.5)
    assert not bad["passed"] and [c["passed"] for c in bad["conditions"]] == [False, True]
    missing = gate({"seq_acc_beam": 99.0}, {}, bar[:1], 0.5)
    assert not missing["passed"] and missing["conditions"][0]["worse_by"] is None
    none = gate({"accuracy": 1.0}, {"accuracy": 1.0}, [], 0.5)
    assert not none["passed"] and none["note"] == "no quality bar to compare on"


def test_settings_read_the_params_block_with_per_model_tolerances():
    params = {"quantize": {"op_types": ["MatMul"], "tolerance": 0.5, "tolerance_by_model": {"sat_soft": 0.005}}}
    assert settings("sat_soft", params) == {"op_types": ["MatMul"], "tolerance": 0.005}
    assert settings("ntm", params)["tolerance"] == 0.5
    shipped = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert settings("ntm", shipped)["tolerance"] == 0.5 and "Conv" not in settings("ntm", shipped)["op_types"]
    with pytest.raises(UserError, match="params.yaml quantize: missing op_types, tolerance"):
        settings("ntm", {})  # the values live in params.yaml only
    assert set(shipped["quantize"].get("tolerance_by_model", {})) <= set(shipped["models"])


@pytest.fixture(scope="module")
def ntm_graphs(tmp_path_factory):
    """The graphs of :func:`_ntm`, exported once for the module's tests (conftest.py groups them)."""
    folder = tmp_path_factory.mktemp("ntm-onnx")
    export_onnx(_ntm(), folder)
    return folder


def _ntm():
    torch.manual_seed(0)
    return models.build("ntm", TINY["ntm"]).eval()  # the seed-0 tiny NTM


def test_the_twin_refuses_what_only_pytorch_computes(ntm_graphs):
    ntm = _ntm()
    twin = OnnxTwin(ntm, ntm_graphs)
    batch = tiny_batch("ntm")
    out = twin.predict(batch)
    torch.testing.assert_close(out["logits"], ntm.predict(batch)["logits"], atol=1e-4, rtol=1e-3)
    assert twin.cfg is ntm.cfg
    assert not hasattr(twin, "decode_uncached")  # a task's PyTorch-only self-check is skipped
    with pytest.raises(NotFromGraphs, match="loss"):
        twin.loss(batch)
    missing = sorted(set(ntm.predict(batch)) - set(out))
    assert "bits" in missing  # the loop returns logits; the server thresholds them
    with pytest.raises(NotFromGraphs, match="bits"):  # without a run there is no served model
        out["bits"]


def test_what_the_loop_lacks_comes_from_the_served_model_once(ntm_graphs, monkeypatch):
    """The NTM's bits: the twin asks the server's own model (serving/kinds) for them, on the same
    feeds, and only when the evaluation reads a key the loop does not return."""
    from serving.kinds.recurrent import RecurrentModel

    ntm = _ntm()
    calls = []
    infer = RecurrentModel.infer
    monkeypatch.setattr(RecurrentModel, "infer", lambda self, f, p: calls.append(1) or infer(self, f, p))
    run = SimpleNamespace(task="copy", name="ntm", evaluate={}, limits={}, run_dir=None)
    twin = OnnxTwin(ntm, ntm_graphs, run=run)
    batch = tiny_batch("ntm")
    out = twin.predict(batch)
    assert out["logits"].shape == batch["x"].shape[:2] + (TINY["ntm"]["output_size"],) and calls == []
    want = ntm.predict(batch)
    assert torch.equal(out["bits"].float(), (out["logits"] > 0).float()) and calls == [1]
    assert (out["bits"].float() == want["bits"]).float().mean() > 0.99  # fp32 graphs vs PyTorch
    torch.testing.assert_close(out["read_weights"], want["read_weights"], atol=1e-4, rtol=1e-3)
    out["write_weights"]
    assert calls == [1]  # the served answer is asked for once per predict()
    served = twin._served_model
    twin.predict(batch)["bits"]
    assert twin._served_model is served and calls == [1, 1]  # the server's model is built once
    with pytest.raises(NotFromGraphs, match="neither the exported loop nor the served model"):
        out["probs"]


def test_publish_serves_the_int8_variant_as_its_own_model_only_when_its_gate_passed(tmp_path, monkeypatch):
    """``<name>-int8``: versions of its own beside the fp32 model, answered by the same loop; none
    while the gate fails (the folder stays, empty: DVC's output); promoted only if the int8 metrics
    meet the bar too."""
    import numpy as np

    from pipeline.serving_meta import serving_meta
    from pipeline.stages.publish import publish_int8
    from serving.client import LocalClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    torch.manual_seed(0)
    act = models.build("act", TINY["act"]).eval()
    runs = tmp_path / "runs"
    run = SimpleNamespace(name="act", arch="act", task="parity", run_dir=runs / "act",
                          bar=[{"metric": "accuracy", "op": ">=", "value": 0.5}])
    export_onnx(act, run.run_dir / "int8")  # stands for quantize@'s graphs: publish copies what is there
    serving = serving_meta(act.cfg, ["model"], SimpleNamespace(task="parity", evaluate={}))
    lineage = {"arch": "act", "task": "parity", "parity_passed": True}

    def publish_with(gate_passed: bool, accuracy: float, promote: bool = True) -> dict:
        (run.run_dir / "int8_metrics.json").write_text(json.dumps({
            "quantization": {"method": "dynamic", "weights": "int8"}, "metrics": {"accuracy": accuracy},
            "gate": {"tolerance": 0.5, "passed": gate_passed, "conditions": []}}))
        return publish_int8(run, tmp_path, serving, lineage, [], fp32_version=3, promote=promote,
                            repository=tmp_path / "model_repository", register=True)

    refused = publish_with(False, 0.9)
    assert refused == {"model": "act-int8", "published": False,
                       "reason": "int8 is worse than fp32 by more than the gate allows (runs/act/int8_metrics.json)"}
    repo = tmp_path / "model_repository"
    assert (repo / "act-int8").is_dir() and not any((repo / "act-int8").iterdir())

    # The gate passed but int8's own accuracy misses the bar: published, not promoted.
    assert publish_with(True, 0.4) == {"model": "act-int8", "published": True, "version": 1, "production": False}
    meta = json.loads((repo / "act-int8" / "1" / "metadata.json").read_text())
    assert (meta["precision"], meta["fp32_model"], meta["fp32_version"]) == ("int8", "act", 3)
    assert meta["bar"]["conditions"][0]["measured"] == 0.4 and not meta["bar"]["passed"]
    assert str(meta["mlflow_version"]) == "1"  # registered as MLflow model act-int8
    card = (repo / "act-int8" / "1" / "MODEL_CARD.md").read_text()
    assert card.startswith("# act-int8, version 1\n")
    assert "Precision: int8 (onnxruntime dynamic quantisation of `act` version 3)." in card
    assert "| accuracy | >= 0.5 | 0.4 | no |" in card and "Promoted to production: no" in card
    assert "Licence: generated: no third-party data." in card and "after Graves 2016" in card
    assert "curl -s localhost:8000/v2/models/act-int8/versions/1/infer" in card

    local = LocalClient(repo)
    spec = local.model_metadata("act-int8", 1)
    assert spec["name"] == "act-int8" and spec["versions"] == ["1"]
    batch = tiny_batch("act")
    served = local.infer("act-int8", {"x": batch["x"].numpy()}, version=1)
    direct = act.predict(batch)
    common = sorted(set(served) & set(direct))
    assert common and all(np.allclose(served[k], direct[k].numpy(), atol=1e-4) for k in common)
