"""A published version as an MLflow model (``mlflow.pyfunc``): the registered model versions that
``publish`` writes load with ``mlflow.pyfunc.load_model("models:/<name>@production")`` and
``predict`` gives the server's answer, computed in process by :class:`serving.client.LocalClient`
(the same ONNX graphs, request checks and decoding loops). Imported by MLflow only; the server and
the Triton bundle never import it (it needs ``mlflow``). A registered model is logged as code:
``serving/pyfunc_model.py`` builds it when MLflow loads it, so loading one never unpickles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np

from serving.decode import BEAM
from serving.protocol import DATATYPES  # v2 datatypes -> numpy (BYTES: Python strings)

DECODING_KINDS = ("translation", "image_caption", "text_image", "audio", "points")  # take decode / beam


class PublishedModel(mlflow.pyfunc.PythonModel):
    """Version ``version`` of published model ``name`` (the model's ``model_config``), whose folder
    MLflow keeps as the artifact ``repository`` (laid out as ``<name>/<version>/``, as in
    ``model_repository/``). Logged as code (``serving/pyfunc_model.py``), not pickled."""

    def load_context(self, context) -> None:
        from serving.client import LocalClient

        self.name, self.version = context.model_config["name"], int(context.model_config["version"])
        self.client = LocalClient(Path(context.artifacts["repository"]))
        self.client.model_metadata(self.name, self.version)  # load the graphs now, not on the first call

    def predict(self, context, model_input: Any, params: dict | None = None) -> dict[str, np.ndarray]:
        """``model_input``: named arrays (a dict, or a pandas DataFrame of one column per input);
        ``params``: the server's request parameters (``decode``, ``beam``)."""
        if hasattr(model_input, "to_dict") and hasattr(model_input, "columns"):  # a DataFrame
            model_input = {c: np.asarray(model_input[c].tolist()) for c in model_input.columns}
        given = {k: v for k, v in (params or {}).items() if v is not None}
        return self.client.infer(self.name, dict(model_input), self.version, parameters=given or None)


def signature(metadata: dict, kind: str | None, serving: dict):
    """The MLflow signature of a served model from its Open Inference Protocol metadata (dynamic
    axes stay -1) and, for decoding kinds, the ``decode`` and ``beam`` parameters (the version's
    serving block's beam width)."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ParamSchema, ParamSpec, Schema, TensorSpec

    def schema(specs: list[dict]) -> Schema:
        return Schema([TensorSpec(np.dtype(DATATYPES[s["datatype"]]), tuple(s["shape"]), s["name"]) for s in specs])

    beam = int(serving.get("beam", BEAM))
    params = ParamSchema([ParamSpec("decode", "string", "beam"), ParamSpec("beam", "long", beam)]) \
        if kind in DECODING_KINDS else None
    return ModelSignature(schema(metadata["inputs"]), schema(metadata["outputs"]), params)


def input_example(metadata: dict) -> dict[str, np.ndarray] | None:
    """A one-row example request for the MLflow model page, where one can be made without knowing
    the task: a sentence for a text model, zeros for inputs of fixed shape (an image, a bit vector).
    None where an input has a free axis or a vocabulary of its own (sequences, OCR lines, tables)."""
    example = {}
    for spec in metadata["inputs"]:
        dims = spec["shape"][1:]
        if spec["datatype"] == "BYTES" and spec["name"] == "text" and not dims:
            example[spec["name"]] = np.array(["Guten Morgen."], dtype=object)
        elif spec["datatype"] != "BYTES" and all(d > 0 for d in dims):
            example[spec["name"]] = np.zeros((1, *dims), dtype=DATATYPES[spec["datatype"]])
        else:
            return None
    return example
