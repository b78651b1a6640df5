"""LibreOffice help: every paragraph of the German help paired with the English one of the same id.

The help is written once in English (``help/en-US``) and translated string by string in Pootle/
Weblate; each rendered page keeps the source's stable element ids (``par_id3149398``, ``hd_id…``)
on the translated paragraph. So two pages of the same path pair exactly by id: no fuzzy
alignment. Inline elements (menu items, keys, links) contribute their text; ``<pre>``/code blocks,
scripts and bookmarks do not. A page is a document for the split (2,560 pages, ~10 paragraphs each).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

from pipeline.tasks.translation_de_en.corpus import CorpusError, Pair, Source, register

_ID = re.compile(r"(par|hd)_id\w+")
_SKIP = {"script", "style", "pre", "code", "img"}
HELP = Path("usr/share/libreoffice/help")


class _Paragraphs(HTMLParser):
    """{element id: its text} for the elements whose id is a help paragraph id (first occurrence:
    a page may embed another's paragraph twice)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found: dict[str, str] = {}
        self._open: list[tuple[str, str | None]] = []  # (tag, paragraph id it starts or None)
        self._text: dict[str, list[str]] = {}
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("br", "img", "meta", "link", "input", "hr"):  # void elements never close
            return
        ident = dict(attrs).get("id") or ""
        starts = ident if _ID.fullmatch(ident) and ident not in self.found and ident not in self._text else None
        if starts:
            self._text[starts] = []
        if tag in _SKIP:
            self._skip += 1
        self._open.append((tag, starts))

    def handle_endtag(self, tag):
        # Close up to the matching open tag (tolerates unclosed inline elements).
        while self._open:
            open_tag, starts = self._open.pop()
            if open_tag in _SKIP:
                self._skip -= 1
            if starts:
                self.found[starts] = " ".join("".join(self._text.pop(starts)).split())
            if open_tag == tag:
                break

    def handle_data(self, data):
        if not self._skip:
            for ident in self._text:
                self._text[ident].append(data)


def paragraphs(page: Path) -> dict[str, str]:
    parser = _Paragraphs()
    parser.feed(page.read_text(encoding="utf-8", errors="replace"))
    parser.close()
    return {k: v for k, v in parser.found.items() if v}


class LibreOfficeHelp(Source):
    """``libreoffice-help-de`` against ``libreoffice-help-en-us``, paired by paragraph id.

    Options: ``language`` (default ``de``): the help language package paired with en-US.
    """

    name = "libreoffice"
    licence = "MPL-2.0"
    description = "LibreOffice help pages (libreoffice-help-de / -en-us), paragraphs paired by id"

    def packages(self, options: dict) -> list[str]:
        return sorted([f"libreoffice-help-{options.get('language', 'de')}", "libreoffice-help-en-us"])

    def pairs(self, trees: dict[str, Path], options: dict, cache: Path) -> Iterator[Pair]:
        lang = options.get("language", "de")
        de_root = trees[f"libreoffice-help-{lang}"] / HELP / lang
        en_root = trees["libreoffice-help-en-us"] / HELP / "en-US"
        if not de_root.is_dir() or not en_root.is_dir():
            raise CorpusError(f"no LibreOffice help under {de_root} or {en_root}: the packages' layout changed; "
                              "turn the source off with tasks.translation_de_en.sources.libreoffice: false")
        for page in sorted(de_root.rglob("*.html")):
            rel = page.relative_to(de_root)
            english = en_root / rel
            if not english.exists():
                continue
            en = paragraphs(english)
            for ident, de_text in sorted(paragraphs(page).items()):
                if ident in en:
                    yield Pair(de_text, en[ident], self.name, f"{self.name}:{rel.with_suffix('')}", self.licence)


register(LibreOfficeHelp())
