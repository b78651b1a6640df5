"""Writing outputs so that a killed process never leaves a half-written one, and two processes never
share a scratch folder: build in a scratch folder named after the process, then rename into place
(one atomic step on a POSIX file system); single files go through a temporary file, fsync and rename.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def scratch_beside(path: Path) -> Path:
    """An empty folder beside ``path`` to build in and rename into place: named after this process
    (two writers never share one), with what killed processes left there removed."""
    path = Path(path)
    clear_dead(path.parent)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def clear_dead(folder: Path) -> None:
    """Remove the scratch folders and temporary files (``*.<pid>.tmp``) of processes no longer alive."""
    for stale in Path(folder).glob("*.tmp"):
        pid = stale.name[: -len(".tmp")].rsplit(".", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: readers see the old file or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync_dir(path.parent)


def sync_folder(folder: Path) -> None:
    """fsync every file in ``folder`` (recursively) and the folder itself, before it is renamed into
    place: after a crash the rename is never visible with empty files behind it."""
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    sync_dir(folder)


def sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
