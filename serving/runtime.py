"""onnxruntime sessions behind a name-based call: ``graph(feeds) -> {output name: array}``."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from serving.admission import COMPUTE, check_deadline

log = logging.getLogger("attnzoo.serving")


def providers(requested: str = "auto") -> list[str]:
    """Execution providers: CUDA when present (``auto``) or asked for, CPU always last."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if requested == "cpu":
        return ["CPUExecutionProvider"]
    if requested == "cuda" and "CUDAExecutionProvider" not in available:
        raise RuntimeError("CUDAExecutionProvider requested but onnxruntime has no CUDA here")
    # onnxruntime-gpu lists CUDA even without a GPU and falls back silently; only ask for it
    # when a CUDA device is actually visible.
    if "CUDAExecutionProvider" in available and _cuda_device_visible():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _cuda_device_visible() -> bool:
    return Path("/dev/nvidiactl").exists()


class OrtGraph:
    """One ONNX graph. Feeds only the inputs the graph declares (exporters may drop unused ones)."""

    def __init__(self, path: Path | str, provider: str = "auto", threads: int = 0):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
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
