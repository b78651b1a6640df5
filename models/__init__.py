"""Model registry.

Every sibling module registers its model with ``@register(name, ConfigClass)``; the registry
imports all sibling modules on first import (fairseq-style), so adding a model never means
editing this file.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


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
    args: tuple[torch.Tensor, ...]
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]] = field(default_factory=dict)


class EncoderGraph(nn.Module):
    """``model.encode(src, src_len)``, which returns a dict, as an export graph returning the
    dict's ``names`` in order (ONNX outputs are positional; the exporter reads the argument names
    from this signature). The model is a registered submodule, so its weights stay parameters."""

    def __init__(self, model: nn.Module, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, src: torch.Tensor, src_len: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model.encode(src, src_len)
        return tuple(out[n] for n in self.names)


@dataclass
class Entry:
    name: str
    config_cls: type
    model_cls: type


REGISTRY: dict[str, Entry] = {}


class ConfigError(ValueError):
    """A model configuration names an unknown model or an unknown key."""


def register(name: str, config_cls: type) -> Callable[[type], type]:
    """Class decorator: register ``model_cls`` under ``name`` with its config dataclass."""

    def wrap(model_cls: type) -> type:
        if name in REGISTRY:
            raise ConfigError(f"model '{name}' is registered twice")
        REGISTRY[name] = Entry(name, config_cls, model_cls)
        model_cls.arch = name
        return model_cls

    return wrap


def make_config(arch: str, values: dict[str, Any]) -> Any:
    """Build the typed config of ``arch`` from a dict, rejecting unknown keys."""
    if arch not in REGISTRY:
        raise ConfigError(f"unknown model '{arch}'; known models: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[arch].config_cls
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {unknown} for model '{arch}'; valid keys: {sorted(known)}"
        )
    return cls(**values)


def build(arch: str, values: dict[str, Any]) -> nn.Module:
    """Instantiate model ``arch`` from a plain dict of config values."""
    cfg = make_config(arch, values)
    return REGISTRY[arch].model_cls(cfg)


for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_") and _info.name != "layers":
        importlib.import_module(f"{__name__}.{_info.name}")
