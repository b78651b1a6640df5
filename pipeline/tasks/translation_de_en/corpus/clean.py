"""Cleaning shared by every source: markup, accelerator marks, placeholders, lengths, sentences.

Sources strip their own structure (HTML, roff, Mallard) and yield text units; :func:`clean_pair`
decides whether a unit is a usable pair, :func:`sentence_pairs` splits paragraphs whose two sides
have the same number of sentences. Thresholds come from ``params.yaml``
(``tasks.translation_de_en.clean``) through :class:`Rules`.
"""

from __future__ import annotations

import html
import re
import unicodedata
from dataclasses import dataclass

# Markup tags only (a name, attributes): "<joe@example.com>" or "a < b > c" are text and stay.
_TAG = re.compile(r"""</?[A-Za-z][\w:.-]*(\s+[\w:.-]+(\s*=\s*("[^"]*"|'[^']*'|[^\s"'>]+))?)*\s*/?>""")
_SPACE = re.compile(r"\s+")
# UI accelerator marks: "_Datei", "&Datei", "~Datei" (not "&&", "a & b", "~/.config").
_ACCEL = re.compile(r"(?<![\w&_~])[_&~](?=[^\W\d_])")
# Format strings and template variables: a pair carrying them is a UI fragment, not a sentence.
_PLACEHOLDER = re.compile(r"%(\d+\$)?[-+ #0]*\d*(\.\d+)?[sdifuxXcglpz]|%\d|\{\d*\}|\{[a-z_]+\}|\$\{?\w+\}?|@\w+@")
_SENT_END = re.compile(r"[.!?:;]['\")»“”]?$")
# Sentence boundary: end mark, space, then an upper-case letter, a digit or an opening quote. Not
# after common abbreviations of either language (the lookbehinds are fixed-width, hence one each).
_ABBREV = ("z. B.", "z.B.", "d. h.", "d.h.", "u. a.", "bzw.", "usw.", "ggf.", "evtl.", "ca.", "Nr.", "vgl.",
           "e.g.", "i.e.", "etc.", "vs.", "Dr.", "Mr.", "Mrs.", "No.", "Fig.", "Abb.", "S.", "Bd.")
_BOUNDARY = re.compile(r"(?<=[.!?])\s+(?=[\"„“»(]?[A-ZÄÖÜ0-9])")


@dataclass(frozen=True)
class Rules:
    min_words: int = 3
    max_words: int = 40
    max_ratio: float = 2.5  # words of the longer side / words of the shorter side
    sentence_like: bool = False  # also require capitalised, ≥ 4 words, final punctuation on both sides

    @classmethod
    def of(cls, values: dict | None) -> Rules:
        return cls(**(values or {}))


def normalise(text: str) -> str:
    """NFC, tags removed, entities decoded (after: "&lt;b&gt;" is text), accelerator marks removed,
    whitespace collapsed."""
    text = unicodedata.normalize("NFC", html.unescape(_TAG.sub(" ", text)))
    text = "".join(" " if unicodedata.category(c)[0] == "C" else c for c in text)  # controls, soft hyphens
    text = _ACCEL.sub("", text)
    return _SPACE.sub(" ", text).strip()


def key(text: str) -> str:
    """Deduplication / leak key: case, punctuation and spacing folded."""
    return _SPACE.sub(" ", re.sub(r"[^\w ]", " ", text.casefold())).strip()


def clean_pair(de: str, en: str, rules: Rules) -> tuple[str, str] | None:
    """The normalised pair, or None when it is not usable as a training sentence pair."""
    de, en = normalise(de), normalise(en)
    if not de or not en or key(de) == key(en):  # untranslated
        return None
    if _PLACEHOLDER.search(de) or _PLACEHOLDER.search(en):
        return None
    nd, ne = len(de.split()), len(en.split())
    if min(nd, ne) < rules.min_words or max(nd, ne) > rules.max_words:
        return None
    if max(nd, ne) > rules.max_ratio * min(nd, ne):
        return None
    if rules.sentence_like and not (sentence_like(de) and sentence_like(en)):
        return None
    return de, en


def sentence_like(text: str) -> bool:
    return text[:1].isupper() and len(text.split()) >= 4 and bool(_SENT_END.search(text))


def sentences(text: str) -> list[str]:
    """Split a paragraph at sentence ends (not after the abbreviations above)."""
    # Spaces inside abbreviations ("z. B.") become NULs first, so no boundary falls within one.
    for a in _ABBREV:
        text = text.replace(a, a.replace(" ", "\0"))
    parts, start = [], 0
    for m in _BOUNDARY.finditer(text):
        head = text[start : m.start()]
        if any(head.endswith(a.replace(" ", "\0")) for a in _ABBREV):
            continue
        parts.append(head.strip())
        start = m.end()
    parts.append(text[start:].strip())
    return [p.replace("\0", " ") for p in parts if p]


def sentence_pairs(de: str, en: str) -> list[tuple[str, str]]:
    """The paragraph pair as sentence pairs when both sides have the same number (> 1) of
    sentences, else the paragraph pair itself."""
    a, b = sentences(de), sentences(en)
    if len(a) == len(b) > 1:
        return list(zip(a, b))
    return [(de, en)]
