"""Input kinds: how a published version is served on raw input, one module each.

A module here defines a :class:`serving.base.ServedModel` subclass and registers it under a kind
name with :func:`register`; ``publish`` writes the kind into the version's ``metadata.json``
(``serving.kind``), and :func:`load_version` builds the registered class. A model that brings a new
input modality adds one module here (and its task declares ``serving = {"kind": ...}``); nothing
else is edited: every module of this package is imported below.

Every kind's constructor takes ``(name, version, folder, meta, graphs, limits)``.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path

KINDS: dict[str, type] = {}


def register(kind: str):
    def wrap(cls):
        if kind in KINDS and KINDS[kind] is not cls:
            raise ValueError(f"serving kind {kind!r} is registered twice ({KINDS[kind].__name__}, {cls.__name__})")
        cls.kind = kind
        KINDS[kind] = cls
        return cls

    return wrap


def kind_of(serving: dict, graphs: list[str]) -> str | None:
    """The kind of a version's ``serving`` block: as written by ``publish``, or (versions published
    before kinds were recorded) read from its loop and input. None: only its graphs are served."""
    if serving.get("kind"):
        return serving["kind"]
    loop, given = serving.get("loop"), serving.get("input")
    if loop == "seq2seq":
        if "source_tokenizer" in serving:
            return "translation"
        return {"points": "points", "text_image": "text_image", "audio": "audio", "image": "image_caption"}.get(given)
    if loop in ("glimpse", "recurrent"):
        return loop
    if loop == "single":
        if given == "table_question":
            return "table_question"
        return "graph" if len(graphs) == 1 else None
    return None


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def load_version(name: str, version: int, folder: Path, provider: str = "auto", threads: int = 0, wrap=None,
                 loop_threads: int | None = None):
    """One published version folder -> (the whole model on raw input or None, its graphs, metadata).

    ``wrap(name, graphs) -> graphs`` wraps the graphs of a model that loops over them (the
    server's step batching); the returned graphs are the plain ones. ``loop_threads`` (default:
    ``threads``) are the ONNX Runtime intra-op threads of a model with several graphs, whose loops
    make many small calls (ORT's spinning thread pool then only competes with the loop)."""
    from serving.admission import Limits, Memory
    from serving.base import GraphModel
    from serving.runtime import OrtGraph
    from serving.version import check_version

    folder = Path(folder)
    check_version(folder)  # every loader: files as publish recorded them, or nothing is loaded
    meta = json.loads((folder / "metadata.json").read_text())
    engine_threads = threads  # an engine of the kind's own (CTranslate2) runs whole searches: not a loop's threads
    if len(meta["graphs"]) > 1 and loop_threads is not None:
        threads = loop_threads
    graphs = {g: OrtGraph(folder / f"{g}.onnx", provider, threads) for g in meta["graphs"]}
    limits = Limits.of(meta.get("serving", {}).get("limits"))  # versions published before limits: defaults
    memory = Memory.of_version(meta)  # ... before memory: a default
    kind = kind_of(meta.get("serving", {}), list(graphs))
    if kind == "graph":
        model = GraphModel(name, version, next(iter(graphs.values())), limits)
        model.memory = memory
        return model, graphs, meta
    if kind is None:
        return None, graphs, meta
    if kind not in KINDS:
        raise ValueError(f"{folder}: serving kind {kind!r} is not known to this server (known: {sorted(KINDS)}); "
                         "upgrade the server")
    looped = wrap(name, graphs) if wrap and len(graphs) > 1 else graphs
    model = KINDS[kind](name, version, folder, meta, looped, limits)
    model.memory = memory
    model.open_engine(provider, engine_threads)
    return model, graphs, meta
