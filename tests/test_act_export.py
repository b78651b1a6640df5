"""ACT's exported graph keeps the ponder loop's early exit (an ONNX ``Loop``) and equals PyTorch's
dynamic loop: when every row halts early, when rows run into the step limit, and with ACT off."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import models
from pipeline.stages.export import export_onnx


def _model(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build("act", {"input_size": 8, "hidden": 16, "max_steps": 6, **overrides}).eval()


def _compare(model, tmp_path) -> dict[str, np.ndarray]:
    export_onnx(model, tmp_path)
    ops = collections.Counter(node.op_type for node in onnx.load(tmp_path / "model.onnx").graph.node)
    assert ops["Loop"] == 1 and ops["Tanh"] == 1, ops  # one step inside the loop, one before it
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    x = (torch.randint(0, 3, (5, 8), generator=torch.Generator().manual_seed(1)) - 1).float()
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x.numpy()})))
    want = model.predict({"x": x})
    for name in ("logits", "halting", "ponder", "steps"):
        np.testing.assert_allclose(got[name], want[name].numpy(), atol=1e-5, rtol=1e-5, err_msg=name)
    assert (got["bits"] == want["bits"].numpy()).all()
    return got


def test_rows_halting_early_stop_the_exported_loop_early(tmp_path):
    # h ≈ σ(1) ≈ 0.73 at first: every row halts at its second step, far below the limit of 6.
    got = _compare(_model(halt_bias=1.0), tmp_path)
    assert got["steps"].max() == 2 and (got["halting"][:, 2:] == 0).all()
    np.testing.assert_allclose(got["halting"].sum(1), 1.0, atol=1e-6)


def test_rows_that_never_halt_stop_at_the_limit(tmp_path):
    # h ≈ σ(-6): no row reaches 1 - ε, the last step takes the remainder (Graves §2: N = max_steps).
    got = _compare(_model(halt_bias=-6.0), tmp_path)
    assert (got["steps"] == 6).all() and (got["halting"][:, -1] > 0.9).all()


@pytest.mark.parametrize("halt_bias", [1.0, -6.0])
def test_without_act_one_step_whatever_the_halting_unit_says(tmp_path, halt_bias):
    got = _compare(_model(act=False, halt_bias=halt_bias), tmp_path)
    assert (got["steps"] == 1).all() and (got["halting"][:, 0] == 1).all() and (got["halting"][:, 1:] == 0).all()
