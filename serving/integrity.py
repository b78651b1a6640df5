"""The check every loader of a published version runs first (the server's repository, ``LocalClient``,
the MLflow pyfunc and Triton's python backend, all through :func:`serving.kinds.load_version`): the
files are the ones publish recorded in ``metadata.json`` (``files_sha256``), and every file the
metadata names lies inside the version. Standard library only: it is bundled for Triton too."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path, PurePosixPath

CT2_FILES = ("config.json", "model.bin", "source_vocabulary.json", "target_vocabulary.json")
FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")  # one plain path part: never "..", "/" or "~"


def check_version(folder: Path) -> None:
    """Refuse a version whose metadata names a file outside its folder, has no ``files_sha256``, or
    whose files differ from it: a version changed after publishing, or published before files were
    recorded, is never loaded. Raises ValueError, one sentence naming the version and the fix."""
    folder = Path(folder)
    version = f"{folder.parent.name} version {folder.name}"
    fix = "republish it (dvc repro publish@<model>), which records and checks every file"
    meta = json.loads((folder / "metadata.json").read_text())
    serving = meta.get("serving") or {}
    named = [f"{g}.onnx" if isinstance(g, str) else g for g in meta.get("graphs") or []]
    named += [serving[k] for k in ("source_tokenizer", "target_tokenizer") if k in serving]
    engine = (serving.get("ctranslate2") or {}).get("folder")
    named += [engine] if engine is not None else []
    for name in named:
        if not isinstance(name, str) or not FILE_RE.match(name):
            raise ValueError(f"{version}: metadata.json names {str(name)[:80]!r}, which is not a file name in the "
                             f"version; {fix}")
    if engine is not None:  # the files CTranslate2 loads from its folder
        named = [n for n in named if n != engine] + [f"{engine}/{f}" for f in CT2_FILES]
    recorded = meta.get("files_sha256")
    if not isinstance(recorded, dict):
        raise ValueError(f"{version} has no files_sha256 in its metadata.json, so its files cannot be verified; {fix}")
    for rel, digest in recorded.items():
        parts = PurePosixPath(rel).parts
        if not parts or any(not FILE_RE.match(p) for p in parts):
            raise ValueError(f"{version}: metadata.json lists {rel[:80]!r}, which is not a path inside the version; "
                             f"{fix}")
        path = folder.joinpath(*parts)
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise ValueError(f"{version}: {rel} is missing or differs from what publish recorded (files_sha256): "
                             f"the version was changed after it was published; {fix}")
    unrecorded = sorted(set(named) - set(recorded))
    if unrecorded:
        raise ValueError(f"{version}: {unrecorded} are not among the files publish recorded (files_sha256); {fix}")
