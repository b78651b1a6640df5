"""A published version's folder, ``model_repository/<model>/<version>/``: written by ``publish`` (:func:`write`)
and read by every loader (:func:`check_version`, then ``serving.kinds.load_version``), both here.

Torch-free: the server, ``LocalClient``, the MLflow pyfunc and Triton's python backend (which runs the copy
of ``serving/`` a version carries) read versions through this module. Layout::

    <graph>.onnx ...          e.g. encoder.onnx + decoder_step.onnx
    <task artifacts>          e.g. spm.de.model / spm.en.model tokenizers
    <engine folder>/          an engine's converted model (ctranslate2/), where the serving block names one
    model.py, serving/        Triton's python-backend entry and the serving modules it runs (looping models)
    metadata.json             model, version, graphs, serving block, artifacts, lineage and metrics, and
                              graph_sha256 (the version's identity) and files_sha256 (every file a loader reads)
    MODEL_CARD.md             written by publish beside them
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path, PurePosixPath

SERVING_DIR = Path(__file__).resolve().parent
VERSION_RE = re.compile(r"^[0-9]{1,9}$")  # ASCII digits only ("²".isdigit() is true, int("²") fails)
FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")  # one plain path part: never "..", "/" or "~"
CT2_FILES = ("config.json", "model.bin", "source_vocabulary.json", "target_vocabulary.json")
# serving/ modules bundled into each version for Triton's python backend (model.py imports them):
# the package without the HTTP server and client (Triton is the server).
NOT_BUNDLED = {"server.py", "client.py", "triton_model.py", "pyfunc.py", "pyfunc_model.py"}
LOOPS_IN_PYTHON = ("seq2seq", "recurrent", "glimpse")  # Triton runs these loops in model.py
NOT_RECORDED = ("metadata.json", "MODEL_CARD.md")  # files_sha256 is in the one; the other is for people


def versions_in(repo: Path) -> list[int]:
    """The versions in a model's folder, oldest first."""
    return sorted(int(p.name) for p in Path(repo).iterdir() if p.is_dir() and VERSION_RE.match(p.name))


def bundle() -> list[str]:
    """The serving modules a version carries, relative to ``serving/`` (sorted: part of its digest)."""
    return sorted(str(p.relative_to(SERVING_DIR)) for p in SERVING_DIR.rglob("*.py") if p.name not in NOT_BUNDLED)


def digest(onnx_dir: Path, serving: dict, engine: Path | None = None) -> str:
    """Identity of a version: its graphs, its engine's model (``engine``: a folder), how a server runs
    them and the bundled serving code (a changed decode limit, tokenizer contract or loop is a new
    version even for the same graphs)."""
    h = hashlib.sha256()
    for p in sorted(Path(onnx_dir).glob("*.onnx")) + (sorted(engine.rglob("*")) if engine else []):
        if p.is_file():
            h.update(p.read_bytes())
    h.update(json.dumps(serving, sort_keys=True).encode())
    for f in ["triton_model.py"] + bundle():
        h.update(f.encode())
        h.update((SERVING_DIR / f).read_bytes())
    return h.hexdigest()


def files_sha256(folder: Path) -> dict[str, str]:
    """{path in the version: SHA-256} of every file a server loads or runs (the graphs, tokenizers and
    bundled code); metadata.json, which carries this, and the model card are not among them."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file() and p.name not in NOT_RECORDED}


def write(folder: Path, name: str, version: int, onnx_dir: Path, serving: dict, meta: dict,
          artifacts: list[Path], engine: Path | None, identity: str) -> dict:
    """Fill the empty ``folder`` as version ``version`` of model ``name``: the graphs of ``onnx_dir``, the task's
    ``artifacts``, the ``engine`` folder, the bundled serving code where Triton runs a loop, and metadata.json
    (``meta``, the lineage and metrics, with the layout's own fields; ``identity``: :func:`digest` of these graphs,
    serving block and engine, which the caller has compared with the newest version's). Returns the metadata
    written. Making it a version (an atomic rename beside the others) is the caller's."""
    graphs = sorted(p.stem for p in Path(onnx_dir).glob("*.onnx"))
    for graph in graphs:
        shutil.copy2(onnx_dir / f"{graph}.onnx", folder / f"{graph}.onnx")
    for artifact in artifacts:
        shutil.copy2(artifact, folder / artifact.name)
    if engine is not None:
        shutil.copytree(engine, folder / engine.name)
    if serving.get("loop") in LOOPS_IN_PYTHON:  # Triton python backend: model.py + its modules
        shutil.copy2(SERVING_DIR / "triton_model.py", folder / "model.py")
        for f in bundle():
            (folder / "serving" / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(SERVING_DIR / f, folder / "serving" / f)
    meta = {"model": name, **meta, "version": version, "graphs": graphs, "serving": serving,
            "artifacts": [a.name for a in artifacts], "graph_sha256": identity,
            "files_sha256": files_sha256(folder)}  # what every loader checks before it serves the version
    (folder / "metadata.json").write_text(json.dumps(meta, indent=1))
    return meta


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
    for rel, sha in recorded.items():
        parts = PurePosixPath(rel).parts
        if not parts or any(not FILE_RE.match(p) for p in parts):
            raise ValueError(f"{version}: metadata.json lists {rel[:80]!r}, which is not a path inside the version; "
                             f"{fix}")
        path = folder.joinpath(*parts)
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != sha:
            raise ValueError(f"{version}: {rel} is missing or differs from what publish recorded (files_sha256): "
                             f"the version was changed after it was published; {fix}")
    unrecorded = sorted(set(named) - set(recorded))
    if unrecorded:
        raise ValueError(f"{version}: {unrecorded} are not among the files publish recorded (files_sha256); {fix}")
