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
from dataclasses import dataclass
from typing import Any

from torch import nn


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


SHARED = ("layers", "decode", "export")  # what the model files share; they register nothing

for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_") and _info.name not in SHARED:
        importlib.import_module(f"{__name__}.{_info.name}")
