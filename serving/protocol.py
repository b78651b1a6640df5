"""Open Inference Protocol (KServe v2) JSON tensors <-> numpy, with the checks a server owes its callers.

Every problem with a request raises :class:`RequestError`, which the server answers with HTTP 400
(or the status it carries) and ``{"error": message}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# v2 datatype -> numpy dtype (BYTES travel as str / object arrays).
DATATYPES: dict[str, Any] = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_,
}
ONNX_TYPES = {"tensor(float)": "FP32", "tensor(double)": "FP64", "tensor(float16)": "FP16",
              "tensor(int64)": "INT64", "tensor(int32)": "INT32", "tensor(int8)": "INT8",
              "tensor(uint8)": "UINT8", "tensor(bool)": "BOOL", "tensor(string)": "BYTES"}
MAX_ELEMENTS = 1 << 24  # per tensor; the body limit usually bites first


class RequestError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TensorSpec:
    """A declared input or output: ``shape`` uses -1 for any size. An ``optional`` input may be
    left out of a request (Triton's model configuration has the same flag)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    optional: bool = False

    def as_json(self) -> dict:
        out = {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}
        return {**out, "optional": True} if self.optional else out


def _flatten(data: Any, out: list) -> None:
    if isinstance(data, list):
        for item in data:
            _flatten(item, out)
    else:
        out.append(data)


def _check_values(name: str, datatype: str, flat: list) -> None:
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise RequestError(f"input '{name}': BYTES data must be strings")
    elif datatype == "BOOL":
        if not all(isinstance(v, bool) for v in flat):
            raise RequestError(f"input '{name}': BOOL data must be true/false")
    elif datatype.startswith(("INT", "UINT")):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            raise RequestError(f"input '{name}': {datatype} data must be integers")
        info = np.iinfo(DATATYPES[datatype])
        if flat and (min(flat) < info.min or max(flat) > info.max):
            raise RequestError(f"input '{name}': a value is out of range for {datatype}")
    else:
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
            raise RequestError(f"input '{name}': {datatype} data must be numbers")
        if not all(math.isfinite(v) for v in flat):
            raise RequestError(f"input '{name}': {datatype} data must be finite")


def decode_input(tensor: Any) -> tuple[str, np.ndarray, str]:
    """One request input ``{"name", "shape", "datatype", "data"}`` -> (name, array, datatype)."""
    if not isinstance(tensor, dict):
        raise RequestError("each input must be an object with name, shape, datatype and data")
    name, shape, datatype = tensor.get("name"), tensor.get("shape"), tensor.get("datatype")
    if not isinstance(name, str) or not name:
        raise RequestError("an input has no 'name'")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise RequestError(f"input '{name}': 'shape' must be a list of non-negative integers")
    if datatype not in DATATYPES:
        raise RequestError(f"input '{name}': unknown datatype {datatype!r}; one of {', '.join(DATATYPES)}")
    if "data" not in tensor:
        raise RequestError(f"input '{name}': no 'data'")
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        raise RequestError(f"input '{name}': {count} elements is more than the limit {MAX_ELEMENTS}")
    flat: list = []
    _flatten(tensor["data"], flat)
    if len(flat) != count:
        raise RequestError(f"input '{name}': shape {shape} needs {count} values, got {len(flat)}")
    _check_values(name, datatype, flat)
    array = np.array(flat, dtype=DATATYPES[datatype]).reshape(shape)  # row-major, as the spec says
    return name, array, datatype


def check_against(spec: TensorSpec, array: np.ndarray, datatype: str) -> None:
    if datatype != spec.datatype:
        raise RequestError(f"input '{spec.name}' must be {spec.datatype}, got {datatype}")
    if len(array.shape) != len(spec.shape) or any(w not in (-1, d) for w, d in zip(spec.shape, array.shape)):
        raise RequestError(f"input '{spec.name}' must have shape {list(spec.shape)} (-1: any), "
                           f"got {list(array.shape)}")


def parse_request(body: Any, inputs: list[TensorSpec], outputs: list[TensorSpec]
                  ) -> tuple[dict[str, np.ndarray], list[str], dict]:
    """Validate an inference request against a model's declared tensors.

    Returns (named input arrays, requested output names in order, request parameters).
    """
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object with 'inputs'")
    raw = body.get("inputs")
    if not isinstance(raw, list) or not raw:
        raise RequestError("'inputs' must be a non-empty list")
    params = body.get("parameters", {})
    if not isinstance(params, dict):
        raise RequestError("'parameters' must be an object")
    declared = {s.name: s for s in inputs}
    feeds = {}
    for tensor in raw:
        name, array, datatype = decode_input(tensor)
        if name not in declared:
            raise RequestError(f"unknown input '{name}'; this model takes {sorted(declared)}")
        if name in feeds:
            raise RequestError(f"input '{name}' given twice")
        check_against(declared[name], array, datatype)
        feeds[name] = array
    missing = sorted(n for n, spec in declared.items() if n not in feeds and not spec.optional)
    if missing:
        raise RequestError(f"missing input(s) {missing}")
    names = [s.name for s in outputs]
    requested = body.get("outputs")
    if requested is None:
        return feeds, names, params
    if not isinstance(requested, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                  for o in requested):
        raise RequestError("'outputs' must be a list of objects with a 'name'")
    wanted = [o["name"] for o in requested]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise RequestError(f"unknown output(s) {unknown}; this model returns {names}")
    return feeds, wanted, params


def encode_output(name: str, array: np.ndarray, datatype: str) -> dict:
    """numpy -> ``{"name", "datatype", "shape", "data"}`` with flat row-major data."""
    array = np.asarray(array)
    if datatype == "BYTES":
        data = [v.decode() if isinstance(v, bytes) else str(v) for v in array.reshape(-1).tolist()]
    else:  # a flat numpy array: orjson writes it without a Python list in between
        data = np.ascontiguousarray(array.astype(DATATYPES[datatype], copy=False).reshape(-1))
        if datatype == "FP16":
            data = data.astype(np.float32)  # orjson has no float16
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": data}
