"""DVC's side of a run: the repository's stages loaded once, asked what changed, their outputs removed
before a run and each finished stage committed to ``dvc.lock``, which is written whole (atomically)."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def open_repo(root: Path):
    from dvc.repo import Repo

    # Wait for the repository lock (`dvc --wait-for-lock`): a user's `dvc status` meanwhile must not
    # fail a finished stage's commit.
    repo = Repo(str(root), _wait_for_lock=True)
    logging.getLogger("dvc").setLevel(logging.WARNING)  # not "Updating lock file" per stage (DVC resets it)
    return repo


class _LockWrites:
    """How the runner has DVC write ``dvc.lock``: whole, and without parsing it again each time.

    Whole: DVC rewrites ``dvc.lock`` in place (open "w+", then dump). Under ``dvc repro`` nothing
    runs meanwhile; here other stages do, and one reading the file then (``publish@`` records its
    upstream's hashes from it) could find it empty or cut off. Written to a file beside it and
    renamed over it, a reader sees the old file or the new one.

    Not parsed again: each commit is DVC's round-trip parse of the whole lock file (2.3 s for 178
    stages here), an update of one entry, and a dump (1.5 s), on the runner's one thread while a
    slot waits for its next stage. When the file still holds exactly the text last written, the
    structure that was dumped is what parsing would give, so it is handed back instead.

    Not dumped whole: DVC's dumper writes ``schema`` and then each stage's entry under ``stages:``,
    and an entry's text depends on that entry only, so the text of each entry is kept and only the
    entries a commit replaced are dumped again, each by DVC's own dumper in the same nesting. The
    result is byte for byte what ``dvc commit`` writes (tested, and on the committed dvc.lock).

    Both are DVC internals (``_common._dump_data``, ``_yaml.parse_yaml_for_update``), so pyproject.toml
    pins DVC to the minor version this is tested on; a DVC without them gets DVC's own writes."""

    def __init__(self):
        self.path = self.text = self.data = None
        self.entries: dict[str, tuple[object, object, str]] = {}  # stage -> (entry, a copy of it, its text)

    def render(self, data, dumper) -> str:
        """The text ``dumper(data)`` writes for a lock file's ``{"schema", "stages"}``, stage by stage."""
        def dumped(item) -> str:
            stream = io.StringIO()
            dumper(item, stream)
            return stream.getvalue()

        def nested(name: str, entry) -> str | None:
            kept = self.entries.get(name)
            if kept is None or kept[0] is not entry or kept[1] != entry:  # a replaced (or changed) entry
                stages = type(data["stages"])()
                stages[name] = entry
                wrapper = type(data)()
                wrapper["stages"] = stages
                text = dumped(wrapper)
                if not text.startswith("stages:\n"):  # not a block under the key: leave it to the whole dump
                    return None
                kept = self.entries[name] = (entry, copy.deepcopy(entry), text[len("stages:\n"):])
            return kept[2]

        if list(data) != ["schema", "stages"] or not data["stages"]:
            return dumped(data)
        head = type(data)()
        head["schema"] = data["schema"]
        texts = [nested(name, entry) for name, entry in data["stages"].items()]
        return dumped(data) if None in texts else "".join([dumped(head), "stages:\n", *texts])

    @contextlib.contextmanager
    def __call__(self):
        from dvc.utils.serialize import _common, _yaml

        if not hasattr(_common, "_dump_data") or not hasattr(_yaml, "parse_yaml_for_update"):
            log.warning("this DVC lacks the internals attnzoo repro wraps: dvc.lock is written in place, as by "
                        "dvc repro; install the DVC version pyproject.toml names")
            yield
            return
        dump, parse = _common._dump_data, _yaml.parse_yaml_for_update

        def atomic(path, data, dumper, fs=None, **dumper_args):
            self.path = None  # a dump that fails leaves no structure that claims the file
            tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
            dump(tmp, data, lambda d, stream: stream.write(self.render(d, dumper)), fs=fs, **dumper_args)
            text = Path(tmp).read_text(encoding="utf-8")
            os.replace(tmp, os.fspath(path))
            self.path, self.text, self.data = os.path.abspath(path), text, data

        def parsed(text, path):
            if self.path == os.path.abspath(path) and text == self.text:
                # handed out to be updated: claimed again only once its dump is written
                self.path = None
                return self.data
            return parse(text, path)

        _common._dump_data, _yaml.parse_yaml_for_update = atomic, parsed
        try:
            yield
        finally:
            _common._dump_data, _yaml.parse_yaml_for_update = dump, parse


class ParamsReads:
    """DVC's params file reads, parsed once per version of the file instead of once per question.

    Hashing a stage's ``params:`` dependency parses the whole params.yaml (0.03 s with ruamel's C
    parser here, 0.1 s in pure Python): a status parses it once for each of the ~150 stages, a commit
    three times (saving the dependency, then twice in the run cache's ``_can_hash``). A file read
    again while its inode, size and mtime are unchanged gets a deep copy of what its last parse gave,
    which is what parsing it again would give.

    A DVC internal (``dvc.dependency.param.load_path``), like ``_LockWrites``' (pyproject.toml pins
    DVC); a DVC without it reads the file each time."""

    def __init__(self):
        self.parsed: dict[tuple, object] = {}

    @contextlib.contextmanager
    def __call__(self):
        from dvc.dependency import param

        load = getattr(param, "load_path", None)
        if load is None:
            yield
            return

        def load_once(path, fs, **kwargs):
            if getattr(fs, "protocol", None) != "local":
                return load(path, fs, **kwargs)
            st = os.stat(path)
            key = (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns, repr(sorted(kwargs.items())))
            if key not in self.parsed:
                self.parsed[key] = load(path, fs, **kwargs)
            return copy.deepcopy(self.parsed[key])

        param.load_path = load_once
        try:
            yield
        finally:
            param.load_path = load


class _Dvc:
    """One DVC repository and its stages, loaded once for a run, as ``dvc repro`` holds them.

    Collecting a stage parses ``dvc.yaml`` and ``dvc.lock`` again (about 2.4 s each time here with
    ~140 stages), and a run asks three times a stage (changed? remove outputs, commit): per stage
    that cost more than a tiny stage itself. A stage object keeps its ``dvc.lock`` entry in memory,
    updated by its own commit, so one load serves the whole run. Each call holds the repository lock
    only while it works, so a user's ``dvc status`` meanwhile waits a moment instead of failing."""

    def __init__(self, root: Path):
        self.root, self.repo, self.stages = root, None, {}
        self.lock_writes = _LockWrites()
        self.params_reads = ParamsReads()

    def stage(self, name: str):
        if self.repo is None:
            self.repo = open_repo(self.root)
            self.stages = {s.addressing: s for s in self.repo.index.stages}
        return self.stages[name]

    def changed(self, name: str) -> bool:
        stage = self.stage(name)
        with self.repo.lock, self.params_reads():  # the stage's read/write locks need the repository lock held
            return stage.changed()

    def remove_outs(self, name: str) -> None:
        """What ``dvc repro`` does before running a stage: delete its outputs that are not ``persist``."""
        stage = self.stage(name)
        with self.repo.lock:
            stage.remove_outs(ignore_remove=False, force=False)

    def commit(self, name: str) -> None:
        """Record a finished stage in dvc.lock (and its outputs in the cache) as ``dvc repro`` does:
        the steps of DVC's ``Repo.commit(name, force=True)`` on the loaded stage."""
        stage = self.stage(name)
        with self.repo.lock, self.lock_writes(), self.params_reads():
            stage.save()
            stage.commit(relink=True)
            stage.dvcfile.dump_stages([stage], update_pipeline=False)

    def close(self) -> None:
        if self.repo is not None:
            self.repo.close()
            self.repo = None
