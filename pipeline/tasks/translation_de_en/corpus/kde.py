"""KDE handbooks: the DocBook manuals of KDE applications, German and English, from Debian.

Each handbook is shipped pre-rendered as ``usr/share/doc/HTML/<lang>/<app>/index.cache.bz2``: the
chunked HTML of the whole book, one ``<FILENAME filename="page.html">…</FILENAME>`` per page (a
chapter or a section). The German book is generated from a German DocBook that KDE's po-based
workflow builds from the English one by replacing each translated message, so its pages have the
English element tree and the same DocBook ids, as long as the English has not changed since.

Alignment: pages are paired by file name and cut into sections at the author-written anchors
(``<a name="sect-id">``, identical in both languages); within a section, the n-th text block
(paragraph, list item, term, table cell, title) of one language is paired with the n-th of the
other. Nothing is guessed: a section is used only when its *shape* (the sequence of block kinds
and generated anchors) is identical in both languages, except that translator credits found only
in the German may be dropped to get there; other sections are skipped and named in ``skipped``.
A whole book is skipped when the German title page carries another revision date than the English
(the translation is of an older text: its shape often still matches while some paragraphs say
different things); option ``stale`` keeps such books. Untranslated messages stay English in the
German book; :func:`pipeline.tasks.translation_de_en.corpus.clean.clean_pair` drops those pairs.

Code (``<pre>`` screens and program listings, command synopses), navigation bars, headers,
footers and tables of contents are not prose, or repeat titles on every page, and are left out.
A document (the split unit) is one chapter of one handbook: a page together with the section
pages below it, found through the pages' ``<link rel="up">``.
"""

from __future__ import annotations

import bz2
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatch
from html.parser import HTMLParser
from pathlib import Path

from tqdm.auto import tqdm

from pipeline.tasks.translation_de_en.corpus import CorpusError, Pair, Source, register

# Binary packages of Debian bookworm holding a German KDE handbook whose English original exists,
# plus the package of that original where it lives elsewhere (k3b: German in k3b-i18n, English in
# k3b-data). Obtained once (2026-11) by downloading the KDE packages among 504 candidates (bookworm
# packages with KDE, GNOME or Qt translations; those maintained by the Qt/KDE team or
# linked to kdoctools, khelpcenter or KF5) and listing ``usr/share/doc/HTML/{de,en}/**/index.cache.bz2``
# with ``dpkg-deb -c``: 163 packages, 247 handbooks in both languages (~575 MB of .deb files).
# Fetching all candidates at build time to rediscover this would be too slow.
PACKAGES = [
    "akonadi-import-wizard", "akregator", "ark", "artikulate", "blinken", "bomber", "bovo", "cantor",
    "cervisia", "choqok", "dolphin", "dragonplayer", "elisa", "filelight", "granatier", "gwenview", "juk",
    "k3b-data", "k3b-i18n", "kaddressbook", "kajongg", "kalarm", "kalgebra-common", "kalzium-data", "kamera",
    "kamoso", "kanagram", "kapman", "kapptemplate", "kate5-data", "katomic", "kbackup", "kbibtex-data",
    "kblackbox", "kblocks", "kbounce", "kbreakout", "kbruch", "kcachegrind", "kcalc", "kcharselect",
    "kde-cli-tools-data", "kde-config-cddb", "kde-config-cron", "kde-config-tablet", "kde-spectacle",
    "kdenlive-data", "kdepim-runtime", "kdepim-themeeditors", "kdesvn", "kdf", "kdiamond", "kdiff3-doc",
    "keditbookmarks", "kexi-data", "kfind", "kfloppy", "kfourinline", "kgamma5", "kgeography-data", "kget",
    "kgoldrunner", "kgpg", "khangman", "khelpcenter", "khotkeys-data", "kid3", "kig", "kigo", "kile-doc",
    "killbots", "kimagemapeditor", "kinfocenter", "kio", "kio-audiocd", "kio-extras-data", "kio-gdrive",
    "kio-gopher", "kiriki", "kiten", "kjumpingcube", "kleopatra", "klettres-data", "klickety", "klines",
    "kmag", "kmahjongg", "kmail", "kmenuedit", "kmines", "kmix", "kmousetool", "kmouth", "kmplot",
    "kmymoney-common", "knavalbattle", "knetwalk", "knights", "knotes", "kolf", "kollision", "kolourpaint",
    "kompare", "konqueror", "konquest", "konsole", "konsolekalendar", "kontact", "konversation-data",
    "korganizer", "kpat", "kphotoalbum", "krdc", "kreversi", "krfb", "kronometer", "kruler", "krusader",
    "kshisen", "ksirk", "ksnakeduel", "kspaceduel", "ksquares", "ksudoku", "ksystemlog", "kteatime", "ktimer",
    "ktimetracker", "ktorrent-data", "ktouch-data", "ktuberling-data", "kturtle", "kubrick", "kwalletmanager",
    "kwave", "kwin-data", "kwordquiz", "kwrite", "libkf5kdelibs4support-data", "lokalize", "lskat-data",
    "marble-data", "minuet-data", "okteta", "okular", "palapeli-data", "parley-data", "partitionmanager",
    "picmi", "pim-sieve-editor", "plasma-desktop-data", "plasma-pa", "plasma-workspace-data",
    "powerdevil-data", "rocs", "rsibreak", "skanlite", "skrooge-common", "step", "sweeper", "systemsettings",
    "tellico-doc", "umbrello-data",
]

_PAGE = re.compile(r'<FILENAME filename="([^"]+)">(.*?)</FILENAME>', re.S)
_UP = re.compile(r'<link rel="up" href="([^"#]+)')
_DATE = re.compile(r'<span class="date">([^<]*)<')
_INLINE = frozenset("a abbr acronym b big cite code dfn em font i kbd mark nobr q s samp small span strike strong "
                    "sub sup tt u var".split())
_VOID = frozenset("area base br col embed hr img input link meta param source track wbr".split())
_SKIP_TAGS = frozenset(("head", "script", "style", "pre", "title"))
# Page furniture (navigation, header, footer, tables of contents, lists of figures) and code.
_SKIP_CLASSES = frozenset(("navCenter", "navigation", "toc", "list-of-figures", "list-of-tables",
                           "list-of-examples", "cmdsynopsis", "funcsynopsis", "programlistingco", "screenco"))
_SKIP_IDS = frozenset(("header", "footer"))
# Ids DocBook XSL generates for elements without one (idm123, idp456, id789, id-1.2.3): numbered per
# build, so they differ between the two languages.
_GENERATED_ID = re.compile(r"id[a-z]?-?[0-9][0-9.]*")
# Translator credits, present only in the German book (on the title page and in "Credits and License").
_CREDIT = re.compile(r"[Üü]bersetz")  # "Deutsche Übersetzung: …", "GUI-Übersetzung", "…, Übersetzung"


@dataclass
class _Block:
    label: str  # tag and first class, e.g. "li.listitem": the unit of the structure comparison
    text: list[str] = field(default_factory=list)


class _Blocks(HTMLParser):
    """Text blocks and DocBook anchors of one HTML page, in document order.

    Every element that is not inline is a block: text directly inside it becomes one unit; a
    nested block ends the text before it (a list item's text, then its paragraphs), so the units
    follow the element tree of the page the same way in both languages. ``items`` holds
    ``(label, text)`` units and ``("#", name)`` for each ``<a name>`` anchor.
    """

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.items: list[tuple[str, str]] = []
        self._stack: list[tuple[str, _Block | None, bool]] = []  # (tag, its block or None, skipped)
        self._blocks: list[_Block] = [_Block("page")]
        self._skipping = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag in _VOID:
            if tag == "br":
                self.handle_data(" ")
            return
        classes = (a.get("class") or "").split()
        skip = tag in _SKIP_TAGS or a.get("id") in _SKIP_IDS or not _SKIP_CLASSES.isdisjoint(classes)
        self._skipping += skip
        block = None
        if tag not in _INLINE:
            self._flush(self._blocks[-1])
            block = _Block(f"{tag}.{classes[0]}" if classes else tag)
            self._blocks.append(block)
        elif tag == "a" and a.get("name") and not self._skipping:
            self.items.append(("#", a["name"] or ""))
        self._stack.append((tag, block, skip))

    def handle_endtag(self, tag: str) -> None:
        if not any(t == tag for t, _, _ in self._stack):
            return  # a stray end tag: ignore it rather than unwind the page
        while self._stack:
            t, block, skip = self._stack.pop()
            if block is not None:
                self._flush(block)
                self._blocks.pop()
            self._skipping -= skip
            if t == tag:
                return

    def handle_data(self, data: str) -> None:
        if not self._skipping:
            self._blocks[-1].text.append(data)

    def close(self) -> None:
        super().close()
        self._flush(self._blocks[0])

    def _flush(self, block: _Block) -> None:
        text = " ".join("".join(block.text).split())
        block.text.clear()
        if text and not self._skipping:
            self.items.append((block.label, text))


@dataclass
class Section:
    """The units from one DocBook anchor to the next named one; ``shape`` is what must agree."""

    shape: list[str]  # labels of the units, "#" for each anchor with a generated id
    units: list[tuple[str, str]]  # (label, text)


def sections(html: str) -> dict[str, Section]:
    """{anchor: section} of one rendered page ("" for what precedes the first anchor). Anchors
    written by the author (``sect1`` ids) are the same in both languages and key the sections;
    generated ones (``idm123``) are numbered per build, so only their positions count."""
    parser = _Blocks()
    parser.feed(html)
    parser.close()
    out: dict[str, Section] = {"": Section([], [])}
    current = out[""]
    for label, text in parser.items:
        if label == "#" and not _GENERATED_ID.fullmatch(text):
            key = text if text not in out else f"{text}#{len(out)}"  # ids are unique; be safe anyway
            current = out[key] = Section([], [])
        elif label == "#":
            current.shape.append("#")
        else:
            current.shape.append(label)
            current.units.append((label, text))
    return out


def align(de: Section, en: Section) -> list[tuple[str, str]] | None:
    """The unit pairs of a section whose shapes agree, else None. A German section may carry extra
    translator credits (units naming an "Übersetzung"); they are dropped when, and only when, that
    makes the shapes agree."""
    if de.shape != en.shape:
        de = _without_credits(de)
        if de.shape != en.shape:
            return None
    return [(d[1], e[1]) for d, e in zip(de.units, en.units)]


def _without_credits(section: Section) -> Section:
    out = Section([], [])
    units = iter(section.units)
    for label in section.shape:
        unit = next(units) if label != "#" else None
        if unit is None or not _CREDIT.search(unit[1]):
            out.shape.append(label)
            if unit is not None:
                out.units.append(unit)
    return out


def read_book(path: Path) -> dict[str, str]:
    """{page file name: its HTML} of one ``index.cache.bz2``."""
    try:
        text = bz2.decompress(path.read_bytes()).decode("utf-8", errors="replace")
    except (OSError, EOFError) as err:
        raise CorpusError(f"{path} could not be read ({err}): delete its package from the corpus cache "
                          "and build again") from err
    return {m[1]: m[2] for m in _PAGE.finditer(text)}


def chapters(pages: dict[str, str]) -> dict[str, str]:
    """{page: the chapter page it belongs to}: its ancestor just below the book (``index.html``)."""
    up = {name: (m[1] if (m := _UP.search(html, 0, html.find("</head>"))) else "") for name, html in pages.items()}
    out = {}
    for name in pages:
        node, seen = name, set()
        while up.get(node) not in ("", "index.html", None) and node not in seen:
            seen.add(node)
            node = up[node]
        out[name] = node
    return out


def handbooks(trees: dict[str, Path], lang: str) -> dict[str, tuple[str, Path]]:
    """{app (path under ``HTML/<lang>``, e.g. "kcalc", "kcontrol/kcmcron"): (package, book file)};
    where two packages ship the same app, the first in sorted order wins."""
    found: dict[str, tuple[str, Path]] = {}
    for package in sorted(trees):
        root = trees[package] / "usr/share/doc/HTML" / lang
        for book in sorted([*root.glob("*/index.cache.bz2"), *root.glob("*/*/index.cache.bz2")]):
            if book.is_file():
                found.setdefault(book.parent.relative_to(root).as_posix(), (package, book))
    return found


def doc_licence(tree: Path, package: str, default: str) -> str:
    """The ``License:`` of the handbooks in the package's machine-readable copyright file: of the
    paragraph whose ``Files:`` covers ``doc/index.docbook`` or names ``po/<lang>/docs/``, else of the first GFDL
    paragraph (KDE handbooks are GFDL upstream; some copyright files only say so in passing), else
    of ``Files: *``, else ``default`` (no readable copyright file, e.g. a symlinked doc folder)."""
    copyright_file = tree / "usr/share/doc" / package / "copyright"
    if not copyright_file.is_file():
        return default
    gfdl = catch_all = None
    for stanza in re.split(r"\n\s*\n", copyright_file.read_text(encoding="utf-8", errors="replace")):
        fields = dict(re.findall(r"^(Files|License):[ \t]*(.*(?:\n[ \t]+\S.*)*)", stanza, re.M))
        licence = fields.get("License", "").split("\n")[0].strip()
        if not licence:
            continue
        patterns = fields.get("Files", "").split()
        if any(p != "*" and (fnmatch("doc/index.docbook", p) or fnmatch("doc/x/index.docbook", p) or "/docs/" in p)
               for p in patterns):
            return licence
        if gfdl is None and "GFDL" in licence:
            gfdl = licence
        if catch_all is None and patterns == ["*"]:
            catch_all = licence
    return gfdl or catch_all or default


def revision(pages: dict[str, str]) -> str:
    """The handbook's revision date from its title page (``<span class="date">``), "" if none."""
    found = _DATE.search(pages.get("index.html", ""))
    return found[1].strip() if found else ""


class KdeHandbooks(Source):
    """German/English KDE application handbooks, aligned block by block within structure-identical sections.

    After :meth:`pairs` has run, :attr:`stats` counts books and sections aligned or skipped and
    :attr:`skipped` names what was skipped.

    Options (``params.yaml`` block of source ``kde``):
      packages: list of Debian packages to read instead of the built-in list :data:`PACKAGES`
        (default: that list). A German handbook whose English original is in no listed package is
        ignored.
      stale: true to also read handbooks whose German translation has another revision date than
        the English original (default false). Their structure usually still matches (the English
        was edited, not restructured), but some paragraphs were rewritten after translation, so a
        matched pair may say different things (about 1 in 12 in a spot check); 45 of 247 books.
    """

    name = "kde"
    licence = "GFDL-1.2+"  # KDE's default for handbooks; used where the copyright file says nothing
    description = "KDE application handbooks (DocBook), German translation paired with the English original"

    def __init__(self) -> None:
        # What was left out, for reports: "<app>/<page>#<anchor>" sections whose structures differ,
        # "<app> (stale: de <date>, en <date>)" books.
        self.skipped: list[str] = []
        self.stats: Counter[str] = Counter()

    def packages(self, options: dict) -> list[str]:
        names = options.get("packages", PACKAGES)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CorpusError("kde: option 'packages' must be a list of Debian package names; fix it in params.yaml")
        return sorted(set(names))

    def pairs(self, trees: dict[str, Path], options: dict, cache: Path) -> Iterator[Pair]:
        self.skipped, self.stats = [], Counter()
        german, english = handbooks(trees, "de"), handbooks(trees, "en")
        licences: dict[str, str] = {}
        for app in tqdm(sorted(german.keys() & english.keys()), desc="kde handbooks", unit="book", leave=False):
            de_pages, en_pages = read_book(german[app][1]), read_book(english[app][1])
            de_date, en_date = revision(de_pages), revision(en_pages)
            if de_date != en_date and not options.get("stale", False):
                self.skipped.append(f"{app} (stale: de {de_date or '?'}, en {en_date or '?'})")
                self.stats["books_stale"] += 1
                continue
            self.stats["books"] += 1
            package = english[app][0]  # the original's package names the document
            if package not in licences:
                licences[package] = doc_licence(trees[package], package, self.licence)
            yield from self._book(app, f"{self.name}:{package}/{app}", licences[package], de_pages, en_pages)

    def _book(self, app: str, prefix: str, licence: str, de_pages: dict[str, str],
              en_pages: dict[str, str]) -> Iterator[Pair]:
        chapter = chapters(en_pages)
        for page in sorted(de_pages.keys() & en_pages.keys()):
            doc = f"{prefix}/{chapter[page].removesuffix('.html')}"
            de_sections, en_sections = sections(de_pages[page]), sections(en_pages[page])
            for anchor, en in en_sections.items():
                if not en.units:  # only anchors (or nothing) before the first title
                    continue
                de = de_sections.get(anchor)
                pairs = align(de, en) if de is not None else None
                if pairs is None:
                    self.skipped.append(f"{app}/{page}#{anchor}")
                    self.stats["sections_skipped"] += 1
                    continue
                self.stats["sections"] += 1
                for de_text, en_text in pairs:
                    yield Pair(de_text, en_text, source=self.name, doc=doc, licence=licence)


register(KdeHandbooks())
