"""The published model repository as servable models (onnxruntime only, never torch).

``model_repository/<model>/<version>/`` (its files and their check: ``serving/version.py``) holds the graphs,
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
import threading
from pathlib import Path

from serving.admission import Memory
from serving.base import GraphModel, ServedModel
from serving.kinds import load_version
from serving.protocol import RequestError
from serving.version import VERSION_RE, versions_in

log = logging.getLogger("attnzoo.serving")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
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
    """Every version of every model under ``root``: loaded at start-up (``load_all``: every version;
    else none), then changed only by :meth:`load`, :meth:`unload` and :meth:`poll` (the server's
    ``--model-control``).

    Request handlers on the event loop and worker threads read :attr:`models` and :attr:`metas`
    without a lock: a change builds new dicts and swaps them in whole (copy-on-write), so a reader
    never sees a dict being changed. Changes themselves run one at a time (:attr:`lock`)."""

    def __init__(self, root: Path | str, provider: str = "auto", threads: int = 0, wrap=None,
                 loop_threads: int | None = None, load_all: bool = True):
        """``wrap(model name, graphs) -> graphs``, when given, wraps the graphs a decode loop calls
        (the server's step batching); the ``<model>.<graph>`` models always get the graphs themselves."""
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"no model repository at {self.root}: run `dvc repro` (publish) first")
        self.options = (provider, threads, wrap, loop_threads)
        self.models: dict[str, dict[int, ServedModel]] = {}
        self.metas: dict[str, dict[int, dict]] = {}  # per served name: each version's metadata.json
        self.errors: dict[str, str] = {}  # versions that failed at start-up ("model/version": why)
        # (model folder, version) -> (state, reason) of every version not served: LOADING or UNAVAILABLE
        self.states: dict[tuple[str, int], tuple[str, str]] = {}
        self.parts: dict[tuple[str, int], list[str]] = {}  # (model folder, version) -> the names it serves
        self.names: dict[tuple[str, int], list[str]] = {}  # ... or served, once unloaded (for the index)
        self.sizes: dict[tuple[str, int], int] = {}  # a served version -> its files' bytes
        self.batchers: dict[tuple[str, int], list] = {}  # a served version -> its step batchers
        self.failed: dict[tuple[str, int], float] = {}  # a refused version -> its newest ctime then
        self.providers: set[str] = set()
        self.lock = threading.Lock()
        if load_all:
            for (name, version), folder in self.on_disk().items():
                if not self.load_one(name, version, folder):
                    self.errors[f"{name}/{version}"] = self.states[(name, version)][1]

    def _state(self, key: tuple[str, int], value: tuple[str, str] | None) -> None:
        """Set (None: clear) a version's state, swapping in a new dict: the index may be reading the old one."""
        states = {k: v for k, v in self.states.items() if k != key}
        if value is not None:
            states[key] = value
        self.states = states

    def on_disk(self, only: str | None = None) -> dict[tuple[str, int], Path]:
        """(model folder, version) -> its folder, of every version folder under the root (or of ``only``)."""
        found = {}
        for model_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and NAME_RE.match(p.name)):
            if only is not None and model_dir.name != only:
                continue
            for version in versions_in(model_dir):
                found[(model_dir.name, version)] = model_dir / str(version)
        return found

    def load_one(self, name: str, version: int, folder: Path) -> bool:
        """Load one version folder and serve it (the caller's thread does the work; requests keep
        being answered meanwhile). False when it is refused: its state is then UNAVAILABLE with why."""
        provider, threads, wrap, loop_threads = self.options
        self._state((name, version), ("LOADING", ""))
        batchers = []  # what wrap made: their threads end when the version is unloaded

        def wrapped(model: str, graphs: dict) -> dict:
            made = wrap(model, graphs)
            batchers.extend(made.values())
            return made

        try:
            whole, graphs, meta = load_version(name, version, folder, provider, threads, wrap and wrapped,
                                               loop_threads)
        except Exception as err:  # one broken version must not take the others down
            _close(batchers)
            why = f"{type(err).__name__}: {err}"
            self._state((name, version), ("UNAVAILABLE", why))
            self.failed[(name, version)] = _newest_change(folder)
            log.error("could not load %s version %s: %s", name, version, why)
            return False
        self.providers.update(g.provider for g in graphs.values())
        added = [whole] if whole is not None else []
        if whole is None:
            log.warning("%s version %d has no serving loop in its metadata (published before serving "
                        "existed, or a single graph): only its graphs are served, as %s.<graph>", name, version, name)
        for graph_name, graph in graphs.items():
            part = GraphModel(f"{name}.{graph_name}", version, graph, whole.limits if whole else None)
            part.memory = whole.memory if whole else Memory.of_version(meta)
            added.append(part)
        models = {n: dict(v) for n, v in self.models.items()}
        metas = {n: dict(v) for n, v in self.metas.items()}
        for model in added:
            models.setdefault(model.name, {})[model.version] = model
            metas.setdefault(model.name, {})[model.version] = meta
        # A reader between these two sees the version without its metadata: served only when asked by number.
        self.models, self.metas = models, metas
        self.parts[(name, version)] = [m.name for m in added]
        self.batchers[(name, version)] = batchers
        self.names = {**self.names, (name, version): self.parts[(name, version)]}
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        self.sizes = {**self.sizes, (name, version): size}  # a new dict: loaded_bytes may be summing the old one
        self._state((name, version), None)
        self.failed.pop((name, version), None)
        self.errors.pop(f"{name}/{version}", None)  # refused at start-up, served now
        return True

    def unload_one(self, name: str, version: int, reason: str) -> list[ServedModel]:
        """Stop serving one version (its ``<model>.<graph>`` names too): new requests get 404 at once;
        requests that already hold it finish on it. Returns what was removed."""
        names = self.parts.pop((name, version), [])
        self.sizes = {k: v for k, v in self.sizes.items() if k != (name, version)}
        _close(self.batchers.pop((name, version), []))  # requests still decoding on it go on without them
        removed = [self.models[n][version] for n in names if version in self.models.get(n, {})]
        models = {n: {v: m for v, m in vs.items() if not (n in names and v == version)}
                  for n, vs in self.models.items()}
        metas = {n: {v: m for v, m in vs.items() if not (n in names and v == version)}
                 for n, vs in self.metas.items()}
        self.models = {n: vs for n, vs in models.items() if vs}
        self.metas = {n: vs for n, vs in metas.items() if vs}
        self._state((name, version), ("UNAVAILABLE", reason))
        self.errors.pop(f"{name}/{version}", None)
        log.info("unloaded %s version %d (%s)", name, version, reason)
        return removed

    def load(self, name: str) -> list[str]:
        """Every version of model folder ``name`` not served yet (explicit control); versions gone
        from disk are unloaded. Returns the refusals (one sentence each; empty: all loaded)."""
        if not NAME_RE.match(name):
            raise RequestError(f"no model '{name[:80]}' in the repository", status=404)
        with self.lock:
            disk = self.on_disk(only=name)
            if not disk:
                raise RequestError(f"no model '{name}' in the repository {self.root.name}/ (folders: "
                                   f"{sorted({n for n, _ in self.on_disk()})})", status=404)
            for key in [k for k in self.parts if k[0] == name and k not in disk]:
                self.unload_one(*key, "removed from the repository")
            refused = []
            for (model, version), folder in disk.items():
                if (model, version) not in self.parts and not self.load_one(model, version, folder):
                    refused.append(self.states[(model, version)][1])
            return refused

    def unload(self, name: str) -> list[ServedModel]:
        """Every served version of model folder ``name`` (explicit control)."""
        with self.lock:
            keys = [k for k in self.parts if k[0] == name]
            if not keys and not (NAME_RE.match(name) and self.on_disk(only=name)):
                raise RequestError(f"no model '{name[:80]}' is served or in the repository; load or unload a "
                                   f"model by its folder name (a model's graphs go with it)", status=404)
            return [m for key in keys for m in self.unload_one(*key, "unloaded")]

    def poll(self) -> list[ServedModel]:
        """One re-scan (poll control): new version folders are loaded, removed ones unloaded. A
        refused version is tried again only once its files change. Returns what was unloaded."""
        with self.lock:
            disk = self.on_disk()
            removed = [m for key in [k for k in self.parts if k not in disk]
                       for m in self.unload_one(*key, "removed from the repository")]
            for key in [k for k in self.states if k not in disk and k not in self.parts]:
                self._state(key, None)  # refused or unloaded, and gone: nothing to report any more
                self.names = {k: v for k, v in self.names.items() if k != key}
                self.errors.pop(f"{key[0]}/{key[1]}", None)
                self.failed.pop(key, None)
            for key, folder in disk.items():
                if key in self.parts or not (folder / "metadata.json").is_file():
                    continue  # served, or still being copied in by hand (publish renames a whole folder)
                if key in self.failed and self.failed[key] == _newest_change(folder):
                    continue
                self.load_one(*key, folder)
            return removed

    def loaded_bytes(self) -> int:
        """The size of the served versions' files."""
        return sum(self.sizes.values())

    def index(self, ready_only: bool = False) -> list[dict]:
        """Every served version READY, and every version not served with its state and reason
        (``ready_only``: the READY ones alone, the protocol's ``"ready": true``)."""
        entries = [{"name": name, "version": str(v), "state": "READY"}
                   for name, versions in self.models.items() for v in versions]
        names = self.names
        if not ready_only:
            entries += [{"name": served, "version": str(v), "state": state, "reason": reason}
                        for (name, v), (state, reason) in self.states.items()
                        for served in names.get((name, v), [name])]
        return sorted(entries, key=lambda e: (e["name"], int(e["version"])))

    def get(self, name: str, version: str | None = None) -> ServedModel:
        versions = self.models.get(name)  # one read: a version unloaded meanwhile is not looked up twice
        if not versions:
            folder = name.split(".")[0]
            gone = sorted((v, state, why) for (model, v), (state, why) in self.states.items() if model == folder)
            if gone:  # known, not served now: say why
                v, state, why = gone[-1]
                raise RequestError(f"model '{name}' is not served: version {v} is {state} ({why or 'being loaded'})",
                                   status=404)
            raise RequestError(f"unknown model '{name}'; served: {sorted(self.models)}", status=404)
        if version is None:
            default, why = default_version({v: self.metas.get(name, {}).get(v, {}) for v in versions})
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


def _close(batchers: list) -> None:
    for batcher in batchers:
        if hasattr(batcher, "close"):
            batcher.close()


def _newest_change(folder: Path) -> float:
    """The newest status change (ctime) of a version folder and its files: a refused version is
    retried when this changes (a file written, or the folder replaced; a copy cannot keep a ctime,
    as ``shutil.copy2`` keeps mtimes)."""
    try:
        return max([folder.stat().st_ctime, *(p.stat().st_ctime for p in folder.rglob("*"))])
    except OSError:
        return 0.0
