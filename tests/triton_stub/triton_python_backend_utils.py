"""Test double of the module NVIDIA Triton's python backend injects (``triton_python_backend_utils``),
with the calls ``serving/triton_model.py`` makes, behaving as the backend documents them."""

from __future__ import annotations

import json

import numpy as np


class TritonError:
    def __init__(self, message: str):
        self._message = message

    def message(self) -> str:
        return self._message


class TritonModelException(Exception):
    pass


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        if not isinstance(array, np.ndarray):
            raise TypeError("pb_utils.Tensor needs a numpy array")
        if array.dtype == object and array.size and not all(isinstance(v, bytes) for v in array.reshape(-1)):
            raise TypeError("BYTES tensors hold bytes")
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceRequest:
    def __init__(self, inputs: list[Tensor], parameters: dict | None = None):
        self._inputs, self._parameters = inputs, json.dumps(parameters or {})

    def parameters(self) -> str:
        return self._parameters


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor], error: TritonError | None = None):
        self._outputs, self._error = output_tensors, error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request._inputs if t.name() == name), None)
