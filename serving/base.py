"""What every served model is: a name, a version, declared tensors, limits and ``infer``.

Input kinds (``serving/kinds/``) subclass :class:`ServedModel`; :class:`GraphModel` is one ONNX
graph as it is (``<model>.<graph>``, and one-graph models under their own name).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from serving.admission import Limits, Memory, over_budget, over_limit
from serving.decode import BEAM
from serving.protocol import ONNX_TYPES, RequestError, TensorSpec
from serving.runtime import OrtGraph


class ServedModel(ABC):
    """``infer(feeds, params) -> {name: (array, datatype)}`` over validated inputs.

    ``limit_axes`` maps an input to ``{axis: (what, limit)}``: the generic checks of
    :meth:`check_limits` (rows on axis 0, time steps on axis 1, ...), run before any work.
    ``memory`` (the version's, set by its loader) estimates a request's peak memory from the same
    axes: :meth:`check_memory`.
    """

    platform = "onnxruntime_onnx"
    kind = "graph"
    batchable = False  # True: requests may be concatenated along axis 0 and split afterwards
    limit_axes: dict[str, dict[int, tuple[str, str]]] = {}
    # Free output axes whose size a request fixes: {output axis: (input, its axis)}, e.g. an NTM's
    # outputs have the input's time steps on axis 1; every output has the input's rows on axis 0.
    output_axes: dict[int, tuple[str, int]] = {}
    memory = Memory()  # a version published before its memory was recorded: the conservative default
    # Names along an output's last axis, {output: [name, ...]} (a Neural Programmer's operations):
    # the metadata's parameters carry them, so a client labels what it draws.
    labels: dict[str, list[str]] = {}

    def __init__(self, name: str, version: int, inputs: list[TensorSpec], outputs: list[TensorSpec],
                 limits: Limits | None = None):
        self.name, self.version, self.inputs, self.outputs = name, version, inputs, outputs
        self.limits = limits or Limits()

    def metadata(self, versions: list[int]) -> dict:
        return {"name": self.name, "versions": [str(v) for v in versions], "platform": self.platform,
                "inputs": [s.as_json() for s in self.inputs], "outputs": [s.as_json() for s in self.outputs],
                **({"parameters": {"labels": self.labels}} if self.labels else {})}

    def check_limits(self, shapes: dict[str, tuple[int, ...]], params: dict) -> None:
        """413 for a request over one of this model's limits, 400 for an empty input, from its
        inputs' shapes alone: the server checks the shapes a request declares before it reads the data."""
        for name, shape in shapes.items():
            # ONNX Runtime aborts the whole process on some graphs given an axis of size 0
            if 0 in shape:
                raise RequestError(f"input '{name}' has an empty axis (shape {list(shape)}): every axis "
                                   "needs at least one element")
        for name, axes in self.limit_axes.items():
            if name in shapes:
                for axis, (what, limit) in axes.items():
                    if len(shapes[name]) > axis:
                        over_limit(f"input '{name}': the number of {what} (axis {axis})", shapes[name][axis],
                                   limit, getattr(self.limits, limit))
        if "beam" in params and isinstance(params["beam"], int):
            over_limit("parameter 'beam'", params["beam"], "beam", self.limits.beam)
        over_limit("the answer's size in values (at least)", self.least_output(shapes), "output_elements",
                   self.limits.output_elements)

    def memory_size(self, shapes: dict[str, tuple[int, ...]], feeds: dict | None,
                    params: dict) -> tuple[int, int, int]:
        """(rows, length, beam hypotheses) of a request for :attr:`memory`: the largest size of a
        ``rows`` axis and of a ``steps`` axis among :attr:`limit_axes` (an input without any: 1).
        ``feeds`` is None before the data is read; kinds whose length is in the data override this."""
        sizes = {"rows": 1, "steps": 1}
        for name, axes in self.limit_axes.items():
            for axis, (_, limit) in axes.items():
                if limit in sizes and len(shapes.get(name, ())) > axis:
                    sizes[limit] = max(sizes[limit], shapes[name][axis])
        return sizes["rows"], sizes["steps"], 0

    def check_memory(self, shapes: dict[str, tuple[int, ...]], feeds: dict | None, params: dict,
                     budget: float) -> float:
        """The request's estimated peak memory in bytes; 413 when it exceeds ``budget``, before any work."""
        rows, steps, hypotheses = self.memory_size(shapes, feeds, params)
        need = self.memory.bytes(rows, steps, hypotheses)
        over_budget(need, budget, rows, steps)
        return need

    def least_output(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """Values the answer has at least, known before any work: declared sizes, the rows, the
        :attr:`output_axes`; other free sizes count as 1."""
        first = next(iter(shapes.values()), ())
        rows = first[0] if first else 1
        total = 0
        for spec in self.outputs:
            size = 1
            for axis, d in enumerate(spec.shape):
                name, at = self.output_axes.get(axis, (None, 0))
                if d != -1:
                    size *= d
                elif axis == 0:
                    size *= rows
                elif name in shapes and len(shapes[name]) > at:
                    size *= shapes[name][at]
            total += size
        return total

    def open_engine(self, provider: str = "auto", threads: int = 0) -> None:
        """Start what runs beside the graphs on this machine (an engine of its own); the graphs'
        sessions are already made. ``provider`` as the graphs got it; ``threads``: the server's
        ``--ort-threads`` (0: one per core), whole searches' threads, not a loop's."""
        return None  # the graphs are all most kinds run

    @abstractmethod
    def infer(self, feeds: dict[str, np.ndarray], params: dict) -> dict[str, tuple[np.ndarray, str]]:
        """Run on validated inputs; raise RequestError for input the model cannot take."""


def decode_params(params: dict, mode: str, serving: dict) -> tuple[str, int]:
    """The request's ``decode`` and ``beam`` parameters, checked; ``mode`` is the kind's default decoding,
    the version's serving block its beam width."""
    mode, beam = params.get("decode", mode), params.get("beam", serving.get("beam", BEAM))
    if mode not in ("beam", "greedy"):
        raise RequestError("parameter 'decode' must be 'beam' or 'greedy'")
    if not isinstance(beam, int) or isinstance(beam, bool) or beam < 1:
        raise RequestError("parameter 'beam' must be a positive integer")
    return mode, beam


def specs(items) -> list[TensorSpec]:
    """onnxruntime's input/output descriptions as declared tensors (symbolic sizes: -1)."""
    return [TensorSpec(i.name, ONNX_TYPES.get(i.type, i.type),
                       tuple(d if isinstance(d, int) else -1 for d in i.shape)) for i in items]


def check_pixels(name: str, images: np.ndarray, low: float = 0.0) -> None:
    if not np.isfinite(images).all() or images.min(initial=0) < low or images.max(initial=0) > 1:
        raise RequestError(f"input '{name}' must hold pixel values from {low:g} to 1")


class GraphModel(ServedModel):
    """One ONNX graph as it is. Batchable when every input and output has a free batch axis 0."""

    def __init__(self, name: str, version: int, graph: OrtGraph, limits: Limits | None = None):
        sess = graph.session
        super().__init__(name, version, specs(sess.get_inputs()), specs(sess.get_outputs()), limits)
        self.graph = graph
        self.batchable = all(s.shape and s.shape[0] == -1 for s in self.inputs + self.outputs)
        # rows on axis 0, sequence lengths on any other free axis
        self.limit_axes = {s.name: {a: (("rows", "rows") if a == 0 else ("steps", "steps"))
                                    for a, d in enumerate(s.shape) if d == -1} for s in self.inputs}

    def infer(self, feeds, params):
        outs = self.graph(feeds)
        types = {s.name: s.datatype for s in self.outputs}
        return {k: (v, types[k]) for k, v in outs.items()}
