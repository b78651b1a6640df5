"""Every ONNX export of a recurrent model as if it were the first of its process.

For a dynamic sequence axis, torch.onnx (torch 2.13) swaps in while-loop kernels for ``aten.gru`` and
``aten.lstm`` (``torch.export._patches``) by editing each op's Python kernels, without clearing the
op's dispatch cache. In a process that has already traced one of these ops, a later export can run the
cached kernel instead: the plain Python loop over time steps, which fixes the sequence length to the
example's, and torch.export then refuses the dynamic axis ("tracing inferred a static shape of 5").
Exporting the Neural Programmer and then RNNencdec in one process fails that way. ``export_onnx``
(``pipeline/stages/export.py``) clears the two caches before each graph it exports, so a process that
exports several models (a test session, ``scripts/gpu_check.py``) exports each as a fresh one would.
"""

from __future__ import annotations


def clear_rnn_dispatch() -> None:
    """Forget the kernels ``aten.gru.input`` and ``aten.lstm.input`` cached from earlier traces."""
    import torch

    for op in (torch.ops.aten.gru.input, torch.ops.aten.lstm.input):
        op._dispatch_cache.clear()
