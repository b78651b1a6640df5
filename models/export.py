"""The graphs a model exports: ``ExportSpec`` names one graph, ``graph`` builds it from a model function.

Every model's ``export_graphs()`` returns ``{graph name: ExportSpec}``; ``pipeline/stages/export.py``
writes each as ``<graph name>.onnx`` and the server runs the loops over them. A graph is a function
of the model, ``fn(model, *inputs)``, returning its outputs in order: no model keeps a wrapper class.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass
class ExportSpec:
    """One ONNX graph a model exports.

    Args:
        module: the ``nn.Module`` whose ``forward`` is the graph.
        args: example inputs, in ``input_names`` order.
        input_names / output_names: ONNX tensor names.
        dynamic_axes: ``{tensor name: {axis: symbolic name}}``.
    """

    module: nn.Module
    args: tuple[Tensor, ...]
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]] = field(default_factory=dict)


class Graph(nn.Module):
    """``fn(model, *inputs)`` as a module. The model is a registered submodule, so its weights stay
    parameters (``model.*`` in the graph). Built by :func:`graph`, whose subclass gives ``forward``
    the graph's input names."""

    def __init__(self, model: nn.Module, fn: Callable[..., tuple[Tensor, ...]]):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        return self.fn(self.model, *inputs)


@functools.cache
def _named(input_names: tuple[str, ...]) -> type[Graph]:
    """A ``Graph`` whose ``forward`` declares ``input_names`` as its parameters. The exporter pairs
    ``dynamic_axes`` with the inputs through ``inspect.signature(module.forward)``, one parameter per
    input; a bare ``*inputs`` would be one parameter for all of them."""

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        return Graph.forward(self, *inputs)

    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    forward.__signature__ = inspect.Signature([inspect.Parameter(n, positional) for n in ("self", *input_names)])
    return type("Graph", (Graph,), {"forward": forward, "__module__": __name__})


def graph(model: nn.Module, fn: Callable[..., tuple[Tensor, ...]], inputs: dict[str, Tensor],
          outputs: list[str], dynamic_axes: dict[str, dict[int, str]]) -> ExportSpec:
    """The spec of the graph ``fn(model, *inputs)``: ``inputs`` maps each input's name to its example
    (in the graph's input order), ``outputs`` names what ``fn`` returns, in order."""
    module = _named(tuple(inputs))(model, fn)
    return ExportSpec(module, tuple(inputs.values()), list(inputs), list(outputs), dynamic_axes)


def encoder(model: nn.Module, *inputs: Tensor) -> tuple[Tensor, ...]:
    """The graph of ``model.encode(*inputs)`` where ``encode`` returns the encoding as a tuple."""
    return tuple(model.encode(*inputs))


def picked(names: list[str]) -> Callable[..., tuple[Tensor, ...]]:
    """The graph of ``model.encode(*inputs)`` where ``encode`` returns a dict: its ``names`` in order
    (ONNX outputs are positional)."""

    def encoding(model: nn.Module, *inputs: Tensor) -> tuple[Tensor, ...]:
        out = model.encode(*inputs)
        return tuple(out[n] for n in names)

    return encoding


def log_probs_first(out: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """A decoder step's outputs with its first, the logits [B,V], as log-probabilities: what greedy
    and beam search both consume."""
    return (torch.log_softmax(out[0], dim=-1), *out[1:])


def decoder_step(model: nn.Module, *inputs: Tensor) -> tuple[Tensor, ...]:
    """The graph of ``model.step(*inputs)`` whose outputs are (logits, carried state ..., attention)
    as the served loop reads them, the logits as log-probabilities."""
    return log_probs_first(model.step(*inputs))
