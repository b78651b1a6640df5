"""An exported graph computes what the model computes: the exporter's optimiser drops no small constant.

onnxscript's no-op rewrites treat a constant within 1e-8 of 0 as 0 (and within 1e-5 relative of 1 as
1), so ``x + 1e-8`` became ``x``: a trained NTM's cosine addressing lost its eps and its step graph
differed from PyTorch by 6.5e-4 where float32 stays within 6e-6 of float64. The export keeps them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from models.export import graph


class _Eps(nn.Module):
    """The NTM's three kinds of eps: a guarded division, a guarded log (both in float64, as its
    addressing) and a factor within 1e-5 of 1."""

    def export_graphs(self):
        inputs = {"x": torch.ones(2, 3), "n": torch.ones(2, 3)}
        return {"eps": graph(self, _guarded, inputs, ["ratio_out", "log_out", "scaled_out"], {})}


def _guarded(model: nn.Module, x: Tensor, n: Tensor) -> tuple[Tensor, ...]:
    ratio = x.double() / (n.double() + 1e-8)
    log = torch.log(n.double() + 1e-8)
    return ratio.float(), log.float(), x * 1.000001


@pytest.mark.slow
def test_the_graph_keeps_constants_the_optimiser_took_for_no_ops(tmp_path):
    from onnxscript import rewriter

    from pipeline.stages.export import export_onnx
    from serving.runtime import OrtGraph

    before = rewriter._DEFAULT_REWRITE_RULES
    model = _Eps().eval()
    export_onnx(model, tmp_path)
    assert rewriter._DEFAULT_REWRITE_RULES is before  # the exporter's rules are restored

    # n = 0 is where eps matters: 1 / 1e-8 and log(1e-8) are finite, 1 / 0 and log(0) are not.
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=np.float32)
    n = np.array([[0.0, 1.0, 2.0], [0.0, 0.0, 3.0]], dtype=np.float32)
    got = OrtGraph(tmp_path / "eps.onnx", provider="cpu")({"x": x, "n": n})
    want = [t.numpy() for t in _guarded(model, torch.from_numpy(x), torch.from_numpy(n))]
    for name, expected in zip(["ratio_out", "log_out", "scaled_out"], want):
        assert np.isfinite(got[name]).all(), (name, got[name])
        np.testing.assert_allclose(got[name], expected, rtol=1e-6, err_msg=name)
    assert got["scaled_out"][1, 2] != x[1, 2]  # 6 · 1.000001, not 6
