"""Fetch Debian binary packages without root and unpack them into a cache outside the prepared data.

``apt-get download`` (the system's apt sources; no root needed) puts ``<name>_<version>_<arch>.deb``
into ``<cache>/debs``; ``dpkg-deb -x`` unpacks each into ``<cache>/trees/<name>_<version>``. Both
steps are skipped for what the cache already holds, so a second build downloads nothing. The
versions found are returned for the manifest: the same versions give the same corpus.

The cache is not trusted: every cached ``.deb`` is checked against the SHA-256 that apt's package
index (root's, under /var/lib/apt/lists) records for its version before it is used, an unpacked
tree is reused only while its digest is the one recorded when it was unpacked (else it is unpacked
again), and names and versions taken from file names must be Debian's, so none can reach a path
outside the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

from pipeline.files import scratch_beside
from pipeline.tasks.translation_de_en.corpus import CorpusError


def default_cache() -> Path:
    """``$ATTNZOO_CACHE`` or ``$XDG_CACHE_HOME/attnzoo`` (``~/.cache/attnzoo``): downloads are kept
    across builds and clones, never inside ``data/prepared`` (a DVC output)."""
    if os.environ.get("ATTNZOO_CACHE"):
        return Path(os.environ["ATTNZOO_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnzoo"


NAME_RE = re.compile(r"[a-z0-9][a-z0-9+.-]+")  # Debian policy's package names
VERSION_RE = re.compile(r"[0-9][A-Za-z0-9.+~:-]*")  # [epoch:]upstream[-revision]: never a '/'


def _debs(folder: Path) -> dict[str, Path]:
    """{package name: newest .deb in ``folder``} (file names are name_version_arch.deb)."""
    found: dict[str, Path] = {}
    for deb in sorted(folder.glob("*.deb")):
        found[deb.name.split("_")[0]] = deb  # sorted: a later version of one name wins
    return found


def _version(deb: Path) -> str:
    """The version in a cached file's name, checked: it names a folder of the cache."""
    parts = deb.name.split("_")
    version = unquote(parts[1]) if len(parts) == 3 else ""  # apt writes the epoch's ':' as %3a
    if not NAME_RE.fullmatch(parts[0]) or not VERSION_RE.fullmatch(version):
        raise CorpusError(f"{deb} is not named as apt names a package (name_version_arch.deb): delete it")
    return version


def _indexed_sha256(debs: dict[str, Path]) -> dict[str, str]:
    """{name: the SHA-256 apt's package index records for the cached version of it}."""
    wanted = {name: _version(deb) for name, deb in debs.items()}
    shown = subprocess.run(["apt-cache", "show", "--no-all-versions", *(f"{n}={v}" for n, v in wanted.items())],
                           capture_output=True, text=True).stdout
    out = {}
    for paragraph in shown.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in paragraph.splitlines() if ": " in line and line[0] != " ")
        if wanted.get(fields.get("Package")) == fields.get("Version") and "SHA256" in fields:
            out[fields["Package"]] = fields["SHA256"]
    return out


def _verified(name: str, deb: Path, indexed: dict[str, str]) -> str:
    """The SHA-256 of a cached ``.deb``, once it matches apt's package index."""
    digest = hashlib.sha256(deb.read_bytes()).hexdigest()
    if name not in indexed:
        raise CorpusError(f"{deb} is a version apt's package index does not list (after an apt-get update?): "
                          "delete it and build again to download the listed one")
    if digest != indexed[name]:
        raise CorpusError(f"{deb} differs from the SHA-256 apt's package index records for it (the cache was "
                          "changed): delete it and build again")
    return digest


def _download(names: list[str], folder: Path, hint: str) -> None:
    """``apt-get download`` all ``names`` at once; on failure, one by one to name the culprit."""
    cmd = ["apt-get", "download", "-q"]
    if subprocess.run(cmd + names, cwd=folder, capture_output=True, text=True).returncode == 0:
        return
    for name in names:
        got = subprocess.run(cmd + [name], cwd=folder, capture_output=True, text=True)
        if got.returncode != 0:
            reason = (got.stderr.strip().splitlines() or ["apt-get failed"])[-1].removeprefix("E: ")
            raise CorpusError(f"Debian package {name} could not be fetched ({reason}): check that "
                              f"`apt-get download {name}` works here (network, apt sources), or {hint}")


def fetch(names: list[str], cache: Path, hint: str = "turn its source off in params.yaml",
          progress: bool = True) -> dict[str, tuple[str, Path]]:
    """Download and unpack ``names``; returns {name: (version, unpacked root)}.

    ``hint``: what the error message offers besides fixing apt (e.g. the params.yaml switch).
    """
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise CorpusError("apt-get and dpkg-deb are needed to fetch the Debian packages of the corpus: run "
                          f"on Debian or Ubuntu, or {hint}")
    debs_dir, trees_dir = cache / "debs", cache / "trees"
    debs_dir.mkdir(parents=True, exist_ok=True)
    trees_dir.mkdir(parents=True, exist_ok=True)
    wanted = sorted(set(names))
    have = _debs(debs_dir)
    missing = [n for n in wanted if n not in have]
    if missing:
        from tqdm.auto import tqdm

        # Batches of 20: one apt-get call per batch keeps the progress bar moving on 1,850 packages.
        for at in tqdm(range(0, len(missing), 20), desc="apt-get download", unit="batch", disable=not progress):
            _download(missing[at : at + 20], debs_dir, hint)
        have = _debs(debs_dir)
    out = {}
    missing = [n for n in wanted if n not in have]
    if missing:  # apt-get succeeded but wrote another name (a virtual package)
        raise CorpusError(f"Debian package {missing[0]} could not be fetched (apt-get download gave no "
                          f"{missing[0]}_*.deb): check the name, or {hint}")
    indexed = _indexed_sha256({n: have[n] for n in wanted})
    for name in wanted:
        deb = have[name]
        version = _version(deb)
        digest = _verified(name, deb, indexed)
        tree = trees_dir / f"{name}_{version}"
        if not _unpacked_from(tree, digest):  # never unpacked, from another .deb, or changed since
            _unpack(deb, digest, tree)
        out[name] = (version, tree)
    return out


MARKER = ".unpacked"  # {"deb": SHA-256 of the .deb unpacked, "tree": tree_digest of what it gave}


def tree_digest(tree: Path) -> str:
    """SHA-256 over every path in ``tree`` (but the marker) with its kind and its bytes or link
    target: a file edited, added, removed or relinked changes it."""
    h = hashlib.sha256()
    for path in sorted(tree.rglob("*")):
        rel = path.relative_to(tree).as_posix()
        if rel == MARKER:
            continue
        if path.is_symlink():
            h.update(f"L {rel}\0{os.readlink(path)}\0".encode())
        elif path.is_file():
            with open(path, "rb") as f:
                h.update(f"F {rel}\0{hashlib.file_digest(f, 'sha256').hexdigest()}\0".encode())
        else:
            h.update(f"D {rel}\0".encode())
    return h.hexdigest()


def _unpacked_from(tree: Path, digest: str) -> bool:
    """Whether ``tree`` is what the .deb of SHA-256 ``digest`` unpacked to, unchanged since."""
    try:
        marker = json.loads((tree / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("deb") == digest and marker.get("tree") == tree_digest(tree)


def _unpack(deb: Path, digest: str, tree: Path) -> None:
    shutil.rmtree(tree, ignore_errors=True)
    tmp = scratch_beside(tree)
    got = subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], capture_output=True, text=True)
    if got.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CorpusError(f"{deb.name} could not be unpacked ({got.stderr.strip()[-200:]}): delete it "
                          "from the cache and build again")
    (tmp / MARKER).write_text(json.dumps({"deb": digest, "tree": tree_digest(tmp)}))
    tmp.rename(tree)


def download_bytes(cache: Path, names: list[str]) -> int:
    """Bytes of the ``.deb`` files of ``names`` in the cache (the download a fresh build makes)."""
    have = _debs(cache / "debs")
    return sum(have[n].stat().st_size for n in set(names) if n in have)
