"""NVIDIA Triton python-backend entry point for one published version (copied there as ``model.py``).

``publish`` writes, next to the graphs, this file and a copy of the ``serving`` modules it needs, and
a Triton ``config.pbtxt`` (``backend: "python"``) for the model folder, so ``tritonserver
--model-repository model_repository`` serves the same models with the same loops as ``attnzoo
serve``. Triton's Python environment needs numpy, onnxruntime(-gpu) and sentencepiece.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by Triton's python backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the bundled copy of serving/

from serving.kinds import load_version  # noqa: E402
from serving.protocol import DATATYPES, RequestError  # noqa: E402


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        folder = Path(args["model_repository"]) / args["model_version"]
        provider = "cuda" if args.get("model_instance_kind") == "GPU" else "cpu"
        self.model, _, _ = load_version(args["model_name"], int(args["model_version"]), folder, provider)
        if self.model is None:
            raise pb_utils.TritonModelException(f"{folder}: metadata.json has no serving loop")

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                feeds = {}
                for spec in self.model.inputs:
                    tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
                    if tensor is None and spec.optional:
                        continue
                    if tensor is None:
                        raise RequestError(f"missing input '{spec.name}'")
                    array = tensor.as_numpy()
                    if spec.datatype == "BYTES":  # Triton hands strings over as bytes
                        array = _map(array, lambda b: b.decode() if isinstance(b, bytes) else str(b))
                    feeds[spec.name] = array.astype(DATATYPES[spec.datatype], copy=False)
                params = json.loads(request.parameters() or "{}")
                outs = self.model.infer(feeds, params)
                tensors = []
                for name, (array, datatype) in outs.items():
                    if datatype == "BYTES":
                        array = _map(array, lambda v: str(v).encode())
                    tensors.append(pb_utils.Tensor(name, np.ascontiguousarray(array)))
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except (RequestError, ValueError) as err:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(err))))
        return responses


def _map(array: np.ndarray, fn) -> np.ndarray:
    """Apply ``fn`` to every element into an object array of the same shape (empty arrays too)."""
    return np.array([fn(v) for v in array.reshape(-1)], dtype=object).reshape(array.shape)
