"""Debian package descriptions and their German translations from the DDTP.

The Debian Description Translation Project (https://ddtp.debian.org) translates package
descriptions; the archive publishes them per suite as ``main/i18n/Translation-<lang>`` indexes,
which ``apt-get update`` downloads when ``Acquire::Languages`` asks for them. They are not in any
package, so this source fetches them itself: ``apt-get update`` with a private configuration
(``APT_CONFIG``: no system ``apt.conf``/``apt.conf.d``, so no update hooks run), a private
sources list, lists, state and cache folder under ``<cache>/ddtp``. Root is neither needed nor
relied on, and the system's apt state is not touched.

Alignment: every entry is ``Package`` / ``Description-md5`` / ``Description-<lang>``; the md5 is
that of the English description, and a German entry carries the md5 of the English text it was
translated from, so joining ``Translation-de`` with ``Translation-en`` on it pairs a translation
with exactly its original. The synopses (first lines) are paired; the long descriptions are split
at `` .`` lines into paragraphs and paired paragraph by paragraph only where both have the same
number of paragraphs (translators rarely merge or split paragraphs, and the separators are an
exact anchor); otherwise only the synopsis is kept. Within a paragraph, list items (`` * ``,
`` - ``, `` + ``) are units of their own, and a paragraph is paired only when both sides have the
same sequence of units; paragraphs with preformatted lines (two leading spaces outside a list
item: tables, code, ASCII art) are skipped. A dash starting an unindented line inside running
text is a wrapped dash, not an item (translators rewrap lines, so that would break the pairing).

A description shared by several packages (``-dev``/``-doc`` siblings have one md5) is one
document, ``ddtp:<first package of that md5 in sorted order>``, so the siblings land in the same
split. A (German, English) unit is yielded once: the same description is in several suites, and
where its translation was revised only the changed units are new. Output order: documents by
name, then md5, then the translations in ``suites`` order (first suite first).
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
import os
import pwd
import re
import shutil
import subprocess
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

from pipeline.tasks.translation_de_en.corpus import CorpusError, Pair, Source, register

SUITES = ("bookworm", "bullseye", "trixie", "sid")
MIRROR = "http://deb.debian.org/debian"
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
OFF = "or turn the source off (`tasks.translation_de_en.sources.ddtp: false` in params.yaml)"
LANGS = ("de", "en")

_OPENERS = {"": open, ".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open, ".lzma": lzma.open}
_BULLET = re.compile(r"[*+\-•]\s+(?=\S)")
_updated: set[str] = set()  # sources lists already updated in this process (refresh: once per build)


class DDTP(Source):
    """DDTP German translations of Debian package descriptions, joined with the English originals.

    Options (``tasks.translation_de_en.sources.ddtp``):

    - ``suites``: Debian suites whose ``main`` translation indexes are read, in the order in which
      their translations of one description are read (default bookworm, bullseye, trixie, sid).
    - ``mirror``: the Debian mirror (default ``http://deb.debian.org/debian``).
    - ``refresh``: run ``apt-get update`` on every build (default false: the indexes already in the
      cache are reused, so a rebuild reads the same indexes and gives the same corpus).
    """

    name = "ddtp"
    licence = "DDTP (see https://ddtp.debian.org; descriptions follow their packages' licences)"
    description = "Debian package descriptions (synopsis and paragraphs) translated by the DDTP"

    def __init__(self) -> None:
        self.skipped: Counter = Counter()  # of the last pairs() call: what was left out, and why

    def packages(self, options: dict) -> list[str]:
        return []  # the indexes come from apt-get update, not from packages

    def pairs(self, trees: dict[str, Path], options: dict, cache: Path) -> Iterator[Pair]:
        lists = download(options, cache)
        self.skipped = Counter()
        yield from pairs_from_lists(lists, _suites(options), self.licence, self.skipped)

    def versions(self, options: dict, cache: Path) -> dict[str, str]:
        """{``ddtp/<index file name>``: sha256} of every index read."""
        lists = download(options, cache)
        out = {}
        for (_suite, _lang), path in sorted(index_files(lists, _suites(options)).items()):
            out[f"ddtp/{path.name}"] = _sha256(path)
        return out


def _suites(options: dict) -> list[str]:
    suites = options.get("suites", SUITES)
    if isinstance(suites, str) or not suites:
        raise CorpusError("`suites` of the ddtp source must be a non-empty list of Debian suites, e.g. [bookworm, sid]")
    return list(dict.fromkeys(suites))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- download -----------------------------------------------------------------------------------


def download(options: dict, cache: Path) -> Path:
    """The private lists folder holding ``Translation-{de,en}`` of every suite; runs ``apt-get
    update`` when an index is missing or differs from what the last update recorded (the changed
    ones are deleted first), the sources changed, or ``refresh`` asks for it."""
    suites = _suites(options)
    mirror = str(options.get("mirror", MIRROR)).rstrip("/")
    root = cache / "ddtp"
    lists = root / "lists"
    sources = _sources_list(mirror, suites)
    sources_file = root / "sources.list"
    changed = _changed(root, suites)
    for path in changed:  # changed since apt-get update wrote it: apt must fetch it afresh
        path.unlink()
    stale = (not sources_file.exists() or sources_file.read_text() != sources
             or len(index_files(lists, suites)) < len(suites) * len(LANGS) or bool(changed))
    if stale or (options.get("refresh", False) and str(sources_file) not in _updated):
        _update(root, sources)
        _updated.add(str(sources_file))
        record_lists(root, suites)
    found = index_files(lists, suites)
    missing = [f"{s}/Translation-{lang}" for s in suites for lang in LANGS if (s, lang) not in found]
    if missing:
        raise CorpusError(f"apt-get update gave no {', '.join(missing)} from {mirror}: check the suite names "
                          f"(`suites` option of the ddtp source) {OFF}")
    return lists


RECORD = "lists.sha256.json"  # {index file name: SHA-256} as apt-get update left them


def record_lists(root: Path, suites: list[str]) -> None:
    """Record the digest of every index just downloaded (apt-get update verified them against the
    suite's signed Release file), so that a later build reads them only as they were then."""
    found = index_files(root / "lists", suites)
    (root / RECORD).write_text(json.dumps({p.name: _sha256(p) for p in found.values()}, sort_keys=True))


def _changed(root: Path, suites: list[str]) -> list[Path]:
    """The indexes to be read that :func:`record_lists` did not record with these bytes (all of them
    when nothing was recorded)."""
    found = list(index_files(root / "lists", suites).values())
    try:
        recorded = json.loads((root / RECORD).read_text())
    except (OSError, ValueError):
        return found
    if not isinstance(recorded, dict):
        return found
    return [p for p in found if recorded.get(p.name) != _sha256(p)]


def _sources_list(mirror: str, suites: list[str]) -> str:
    # target=Translations: only the translation indexes (no Packages files, ~10 MB per suite saved).
    signed = f" signed-by={KEYRING}" if KEYRING.exists() else ""
    return "".join(f"deb [target=Translations{signed}] {mirror} {s} main\n" for s in suites)


def _apt_config(root: Path, sources_file: Path) -> str:
    """A configuration that reads nothing of the system's apt configuration but its network settings."""
    user = pwd.getpwuid(os.getuid()).pw_name
    lines = [
        'Dir::Etc::main "/dev/null";',  # no /etc/apt/apt.conf ...
        'Dir::Etc::Parts "/dev/null";',  # ... nor apt.conf.d (update hooks, "Languages none", ...)
        f'Dir::Etc::SourceList "{sources_file}";',
        'Dir::Etc::SourceParts "/dev/null";',
        f'Dir::State "{root}/state";',
        f'Dir::State::Lists "{root}/lists";',
        f'Dir::State::status "{root}/state/status";',  # empty: the installed packages do not matter
        f'Dir::Cache "{root}/cache";',
        'Dir::Cache::pkgcache "";',  # no binary caches: only the downloaded indexes are wanted
        'Dir::Cache::srcpkgcache "";',
        'Acquire::Languages { "de"; "en"; };',
        'Acquire::GzipIndexes "false";',  # store indexes decompressed
        # Root would drop to _apt for downloading, which cannot enter a cache under /root;
        # downloading as the calling user works for root and non-root alike.
        f'APT::Sandbox::User "{user}";',
    ]
    return "\n".join(lines + _system_network()) + "\n"


def _system_network() -> list[str]:
    """The system apt configuration's settings for reaching a mirror: proxies and other HTTP(S)
    settings, and whether an old Release file is accepted (a mirror behind a snapshot cache)."""
    trees = ["Acquire::http", "Acquire::https", "Acquire::Check-Valid-Until", "Acquire::Check-Date"]
    if not shutil.which("apt-config"):
        return []
    got = subprocess.run(["apt-config", "dump", *trees], capture_output=True, text=True)
    return [line for line in got.stdout.splitlines() if line.startswith(tuple(trees)) and not line.endswith(' "";')]


def _update(root: Path, sources: str) -> None:
    if not shutil.which("apt-get"):
        raise CorpusError(f"apt-get is needed to download the DDTP translation indexes: run on Debian or Ubuntu, {OFF}")
    for folder in ("lists/partial", "state", "cache/archives/partial"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    (root / "state" / "status").touch()
    # The sources list is put in place only after a successful update: its presence says the
    # lists folder matches it.
    (root / "sources.list").unlink(missing_ok=True)
    pending = root / "sources.list.new"
    pending.write_text(sources)
    (root / "apt.conf").write_text(_apt_config(root, pending))
    env = {**os.environ, "APT_CONFIG": str(root / "apt.conf"), "LC_ALL": "C"}
    got = subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True)
    errors = [line for line in (got.stdout + got.stderr).splitlines() if line.startswith(("E:", "Err:"))]
    if got.returncode != 0 or errors:
        reason = (errors or got.stderr.strip().splitlines() or ["apt-get update failed"])[-1].strip()[:200]
        hint = ""
        if "NO_PUBKEY" in got.stderr or "not signed" in got.stderr:
            hint = "install the Debian archive keys (package debian-archive-keyring), "
        raise CorpusError(f"downloading the DDTP translation indexes failed ({reason}): {hint}check the network "
                          f"and the mirror (`mirror` option of the ddtp source), {OFF}")
    pending.replace(root / "sources.list")


def index_files(lists: Path, suites: list[str]) -> dict[tuple[str, str], Path]:
    """{(suite, language): index file} of the lists folder; apt names them
    ``<mirror>_dists_<suite>_main_i18n_Translation-<lang>`` (plus a suffix if kept compressed)."""
    found = {}
    if not lists.is_dir():
        return found
    for suite in suites:
        for lang in LANGS:
            stem = f"_dists_{suite}_main_i18n_Translation-{lang}"
            hits = sorted(p for p in lists.iterdir() if p.is_file() and stem in p.name
                          and p.name[p.name.index(stem) + len(stem):] in _OPENERS)
            if hits:
                found[(suite, lang)] = hits[0]  # the decompressed file sorts before "<name>.gz"
    return found


# --- parsing and alignment ----------------------------------------------------------------------


def read_index(path: Path) -> Iterator[tuple[str, str, str]]:
    """(package, description md5, description) of each entry; the description keeps its
    continuation lines (without the field's leading space) after the synopsis line."""
    suffix = path.name[path.name.rindex("Translation-"):].partition(".")[2]
    opener = _OPENERS["." + suffix if suffix else ""]
    entry: dict[str, str] = {}
    field = ""
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                yield from _entry(entry)
                entry, field = {}, ""
            elif line[0] in " \t" and field:
                entry[field] += "\n" + line[1:]
            else:
                field, _, value = line.partition(":")
                entry[field] = value.strip()
    yield from _entry(entry)


def _entry(entry: dict[str, str]) -> Iterator[tuple[str, str, str]]:
    text = next((v for k, v in entry.items() if k.startswith("Description-") and k != "Description-md5"), None)
    if entry.get("Package") and entry.get("Description-md5") and text is not None:
        yield entry["Package"], entry["Description-md5"], text


def paragraphs(description: str) -> tuple[str, list[list[tuple[str, str]] | None]]:
    """(synopsis, paragraphs of the long description); a paragraph is a list of (kind, text)
    units, kind "p" (running text) or "li" (list item), or None when it is preformatted."""
    synopsis, *lines = description.split("\n")
    blocks: list[list[str]] = [[]]
    for line in lines:
        if line.strip() == ".":
            blocks.append([])
        else:
            blocks[-1].append(line)
    return synopsis.strip(), [_units(block) for block in blocks if any(s.strip() for s in block)]


def _units(lines: list[str]) -> list[tuple[str, str]] | None:
    units: list[tuple[str, list[str]]] = []
    for line in lines:
        body = line.lstrip()
        bullet = _bullet(line, units)
        if bullet:
            units.append(("li", [body[bullet.end():]]))
        elif units and units[-1][0] == "li":  # an item's continuation, indented or not
            units[-1][1].append(body)
        elif line[:1].isspace():  # indented outside a list: preformatted text
            return None
        elif units:
            units[-1][1].append(body)
        else:
            units.append(("p", [body]))
    return [(kind, " ".join(w for w in words if w)) for kind, words in units]


def _bullet(line: str, units: list[tuple[str, list[str]]]) -> re.Match | None:
    """The list marker starting ``line``, if it starts a list item. A dash at the start of an
    unindented line inside running text is prose wrapped there ("... idiom\n- including ..."),
    not an item: it starts one only at the top of a paragraph, after an item or after a colon."""
    body = line.lstrip()
    bullet = _BULLET.match(body)
    if bullet and body[0] == "-" and not line[:1].isspace() and units and units[-1][0] == "p":
        return bullet if units[-1][1][-1].rstrip().endswith(":") else None
    return bullet


def align(de: str, en: str, skipped: Counter) -> list[tuple[str, str]]:
    """The (German, English) units of one description and its translation (see the module doc)."""
    de_syn, de_pars = paragraphs(de)
    en_syn, en_pars = paragraphs(en)
    out = [(de_syn, en_syn)]
    if len(de_pars) != len(en_pars):
        skipped["descriptions with different paragraph counts (synopsis only)"] += 1
        return out
    for a, b in zip(de_pars, en_pars):
        if a is None and b is None:
            skipped["preformatted paragraphs"] += 1
        elif a is None or b is None or [k for k, _ in a] != [k for k, _ in b]:
            skipped["paragraphs with different structure"] += 1
        else:
            out += [(x, y) for (_, x), (_, y) in zip(a, b)]
    return out


def pairs_from_lists(lists: Path, suites: list[str], licence: str, skipped: Counter | None = None) -> Iterator[Pair]:
    """The pairs of the ``Translation-{de,en}`` indexes of ``suites`` in ``lists`` (no network)."""
    skipped = Counter() if skipped is None else skipped
    files = index_files(lists, suites)
    owners: dict[str, set[str]] = defaultdict(set)  # md5 -> packages with that description
    german: dict[str, list[str]] = defaultdict(list)  # md5 -> its translations, first suite first
    for suite in suites:
        for package, md5, text in read_index(files[(suite, "de")]):
            owners[md5].add(package)
            if text not in german[md5]:
                german[md5].append(text)
    english: dict[str, str] = {}
    for suite in suites:  # only the originals of translated descriptions are kept in memory
        for package, md5, text in read_index(files[(suite, "en")]):
            if md5 in german:
                owners[md5].add(package)
                english.setdefault(md5, text)
    seen: set[tuple[str, str]] = set()
    for md5 in sorted(german, key=lambda m: (min(owners[m]), m)):
        if md5 not in english:
            skipped["translations without their English original"] += 1
            continue
        doc = f"ddtp:{min(owners[md5])}"
        for de in german[md5]:
            for unit in align(de, english[md5], skipped):
                if "\ufffd" in unit[0] + unit[1]:  # undecodable bytes, or a literal "tofu" sign
                    skipped["units with replacement characters"] += 1
                elif unit not in seen and unit[0] and unit[1]:
                    seen.add(unit)
                    yield Pair(unit[0], unit[1], source="ddtp", doc=doc, licence=licence)


register(DDTP())
