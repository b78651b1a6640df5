"""onnxruntime sessions behind a name-based call: ``graph(feeds) -> {output name: array}``."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from serving.admission import COMPUTE, check_deadline

log = logging.getLogger("attnzoo.serving")


# onnxruntime's CUDA EP lets MatMul/Conv run in TF32 on Ampere and later GPUs by default. Measured on
# an H100 (docs/benchmarks.md, GPU): graph outputs then differ from PyTorch fp32 by up to 4.7e-3, past
# the export gate's fp32 tolerances, and both OCR models decoded other tokens than the gated ones. With
# TF32 off every model passed the gate on CUDA; whole loops took -9 % to +14 % the time of TF32 ones.
CUDA_OPTIONS = {"use_tf32": "0"}


def providers(requested: str = "auto") -> list[str | tuple[str, dict]]:
    """Execution providers: CUDA (fp32: :data:`CUDA_OPTIONS`) when present (``auto``) or asked for,
    CPU always last."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if requested == "cpu":
        return ["CPUExecutionProvider"]
    if requested == "cuda" and "CUDAExecutionProvider" not in available:
        raise RuntimeError("CUDAExecutionProvider requested but onnxruntime has no CUDA here")
    # onnxruntime-gpu lists CUDA even without a GPU and falls back silently; only ask for it
    # when a CUDA device is actually visible.
    if "CUDAExecutionProvider" in available and _cuda_device_visible():
        return [("CUDAExecutionProvider", CUDA_OPTIONS), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def uses_cuda(requested: str = "auto") -> bool:
    """Whether :func:`providers` puts the CUDA EP first (sessions would run on the GPU)."""
    first = providers(requested)[0]
    return (first[0] if isinstance(first, tuple) else first) == "CUDAExecutionProvider"


def _cuda_device_visible() -> bool:
    return Path("/dev/nvidiactl").exists()


class OrtGraph:
    """One ONNX graph. Feeds only the inputs the graph declares (exporters may drop unused ones)."""

    def __init__(self, path: Path | str, provider: str = "auto", threads: int = 0):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        # No CPU memory arena: the arena keeps its peak for the life of the session, so one long request
        # (1,000 source tokens through the Transformer's step graphs) left a server 440 MB larger for good;
        # without it the memory goes back after the request (tests/test_serving_production.py).
        opts.enable_cpu_mem_arena = False
        self.path = str(path)
        self.session = ort.InferenceSession(self.path, opts, providers=providers(provider))
        self.provider = self.session.get_providers()[0]
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ValueError(f"{self.path}: missing inputs {missing}")
        check_deadline()  # a request past its deadline stops at its next graph call (HTTP 504)
        with COMPUTE:  # at most --infer-threads ONNX Runtime calls compete for the cores
            outs = self.session.run(None, {n: feeds[n] for n in self.input_names})
        return dict(zip(self.output_names, outs))
