"""The published model repository as servable models (onnxruntime only, never torch).

``model_repository/<model>/<version>/`` (written by ``pipeline/stages/publish.py``) holds the graphs,
tokenizers and ``metadata.json`` whose ``serving`` block says how to run them. Each version
becomes up to two kinds of servable model:

* ``<model>`` — the whole model on raw input, served by its input kind (``serving/kinds/``:
  translation, recurrent, points, image_caption, text_image, audio, glimpse, table_question, or a
  one-graph model as that graph);
* ``<model>.<graph>`` — each exported graph on its own (e.g. ``bahdanau.encoder``), a plain
  ONNX model whose requests the server may batch together.

Version policy: a request without a version gets the model's *default* version — the newest one
``publish`` promoted (``production``: parity passed and the quality bar met), else the newest one
whose parity and bar passed; with none, the request is refused (409) and explicit versions stay
reachable. Model names and versions are matched against what is on disk, never joined into paths.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from serving.admission import Memory
from serving.base import GraphModel, ServedModel, check_version  # noqa: F401  (load_version runs it)
from serving.kinds import load_version
from serving.protocol import RequestError

log = logging.getLogger("attnzoo.serving")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
VERSION_RE = re.compile(r"^[0-9]{1,9}$")  # ASCII digits only ("²".isdigit() is true, int("²") fails)
def default_version(metas: dict[int, dict]) -> tuple[int | None, str]:
    """(the version served without one in the URL, why) from each version's metadata."""
    promoted = [v for v, m in metas.items() if m.get("production")]
    if promoted:
        return max(promoted), "the newest version publish promoted to production (parity passed, bar met)"
    passed = [v for v, m in metas.items()
              if m.get("parity_passed") and (m.get("bar") or {}).get("passed") and "production" not in m]
    if passed:
        return max(passed), "the newest version whose parity and quality bar passed"
    return None, ("no version was promoted to production (parity failed or the quality bar was not met); "
                  "ask for a version explicitly: /v2/models/{name}/versions/{version}")


class Repository:
    """Every version of every model under ``root``, loaded once at start-up."""

    def __init__(self, root: Path | str, provider: str = "auto", threads: int = 0, wrap=None,
                 loop_threads: int | None = None):
        """``wrap(model name, graphs) -> graphs``, when given, wraps the graphs a decode loop calls
        (the server's step batching); the ``<model>.<graph>`` models always get the graphs themselves."""
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"no model repository at {self.root}: run `dvc repro` (publish) first")
        self.models: dict[str, dict[int, ServedModel]] = {}
        self.metas: dict[str, dict[int, dict]] = {}  # per served name: each version's metadata.json
        self.errors: dict[str, str] = {}
        self.providers: set[str] = set()
        for model_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and NAME_RE.match(p.name)):
            for version_dir in sorted((p for p in model_dir.iterdir() if p.is_dir() and VERSION_RE.match(p.name)),
                                      key=lambda p: int(p.name)):
                try:
                    self._load(model_dir.name, int(version_dir.name), version_dir, provider, threads, wrap,
                               loop_threads)
                except Exception as err:  # one broken version must not take the others down
                    self.errors[f"{model_dir.name}/{version_dir.name}"] = f"{type(err).__name__}: {err}"
                    log.error("could not load %s version %s: %s", model_dir.name, version_dir.name, err)

    def _add(self, model: ServedModel, meta: dict) -> None:
        self.models.setdefault(model.name, {})[model.version] = model
        self.metas.setdefault(model.name, {})[model.version] = meta

    def _load(self, name: str, version: int, folder: Path, provider: str, threads: int, wrap, loop_threads) -> None:
        whole, graphs, meta = load_version(name, version, folder, provider, threads, wrap, loop_threads)
        self.providers.update(g.provider for g in graphs.values())
        if whole is not None:
            self._add(whole, meta)
        else:
            log.warning("%s version %d has no serving loop in its metadata (published before serving "
                        "existed, or a single graph): only its graphs are served, as %s.<graph>", name, version, name)
        for graph_name, graph in graphs.items():
            part = GraphModel(f"{name}.{graph_name}", version, graph, whole.limits if whole else None)
            part.memory = whole.memory if whole else Memory.of_version(meta)
            self._add(part, meta)

    def get(self, name: str, version: str | None = None) -> ServedModel:
        versions = self.models.get(name)
        if not versions:
            raise RequestError(f"unknown model '{name}'; served: {sorted(self.models)}", status=404)
        if version is None:
            default, why = self.default(name)
            if default is None:
                raise RequestError(f"model '{name}': {why.format(name=name, version=max(versions))}", status=409)
            return versions[default]
        if not VERSION_RE.match(version) or int(version) not in versions:
            raise RequestError(f"model '{name}' has no version '{version}'; versions: {sorted(versions)}",
                               status=404)
        return versions[int(version)]

    def default(self, name: str) -> tuple[int | None, str]:
        return default_version(self.metas.get(name, {}))

    def versions(self, name: str) -> list[int]:
        return sorted(self.models.get(name, {}))
