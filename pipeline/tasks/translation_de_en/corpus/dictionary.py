"""Example sentences of the TU Chemnitz "Ding" dictionary (Debian ``dict-de-en``, GPL-2+).

The dictionary holds, between word entries, example sentences: a German sentence ending in
``.?!`` followed by its English translation, indented three spaces. Lines wrap at 72 columns
with unindented continuation lines. We keep pairs where both sides are full sentences, strip
annotations and drop ambiguous alternatives. Short everyday sentences, unlike the software
documentation of the other sources: the translation task holds some out as an out-of-domain
test set; as a training source it is off by default.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from pathlib import Path

from pipeline.tasks.translation_de_en.corpus import CorpusError, Pair, Source, register

PACKAGE = "dict-de-en"
DICT = Path("usr/share/dictd/german-english.dict.dz")
WRAP = 60  # a line at least this long may continue on the next, unindented line
_ANNOT = re.compile(r"\{[^}]*\}|\[[^\]]*\]|/[^/]*/|\([^)]*\)")
_SENT_END = re.compile(r"[.?!]$")
_QUOTES = str.maketrans({"’": "'", "‘": "'", "“": '"', "”": '"', "„": '"', "‚": "'", "–": "-"})


def _clean(text: str) -> str:
    text = _ANNOT.sub(" ", text.translate(_QUOTES))
    return re.sub(r"\s+", " ", text).strip()


def _continues(prev: str, line: str) -> bool:
    """Is ``line`` the wrapped tail of ``prev``? Only long lines wrap; a new entry after a
    sentence-final line starts with a capital, a wrapped tail usually does not."""
    if len(prev) < WRAP or not line or line.startswith(" "):
        return False
    return not _SENT_END.search(prev.rstrip()) or not line[0].isupper()


def dictionary_entries(lines: list[str]) -> list[tuple[str, str]]:
    """Parse the dictd text into raw (german, english) entries, wrapped lines joined."""
    pairs = []
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        if not line or line.startswith(" "):
            i += 1
            continue
        german = line
        j = i + 1
        while j < n and _continues(lines[j - 1], lines[j]):
            german += " " + lines[j]
            j += 1
        # Optional part-of-speech line (" {f} [tag]") or blank line before the English side.
        if j < n and (lines[j] == "" or (lines[j].startswith(" ") and not lines[j].startswith("   "))):
            j += 1
        if j < n and lines[j].startswith("   "):
            english = lines[j].strip()
            k = j + 1
            while k < n and _continues(lines[k - 1], lines[k]):
                english += " " + lines[k]
                k += 1
            pairs.append((german.strip(), english))
            i = k
        else:
            i = j
    return pairs


_PLACEHOLDERS = ("sth.", "sb.", "etw.", "jdm.", "jdn.", "jds.", "jd.")


def extract_pairs(lines: list[str]) -> list[tuple[str, str]]:
    """Example sentence pairs: both sides full sentences, first English alternative."""
    out = []
    for german, english in dictionary_entries(lines):
        if not _SENT_END.search(german) or "/" in german or "/" in english:
            continue
        english = english.split(";")[0].split("|")[0].strip()
        german, english = _clean(german), _clean(english)
        if not (_SENT_END.search(german) and _SENT_END.search(english)):
            continue
        if not german[0].isupper() or not english[0].isupper():
            continue
        if any(p in english or p in german for p in _PLACEHOLDERS):
            continue
        if 3 <= len(german.split()) and 3 <= len(english.split()):
            out.append((german, english))
    return out


def read_lines(tree: Path) -> list[str]:
    path = tree / DICT
    if not path.exists():
        raise CorpusError(f"{path} is missing from the unpacked {PACKAGE}: delete that folder from the cache "
                          "and build again")
    return gzip.open(path, "rt", encoding="utf-8").read().split("\n")


class DictionaryExamples(Source):
    """Example sentence pairs of ``dict-de-en``; each its own document (they are independent)."""

    name = "dictionary"
    licence = "GPL-2+"
    description = "example sentences of the TU Chemnitz Ding dictionary (dict-de-en)"

    def packages(self, options: dict) -> list[str]:
        return [PACKAGE]

    def pairs(self, trees: dict[str, Path], options: dict, cache: Path) -> Iterator[Pair]:
        for n, (de, en) in enumerate(extract_pairs(read_lines(trees[PACKAGE]))):
            yield Pair(de, en, self.name, f"{self.name}:{n}", self.licence)


register(DictionaryExamples())
