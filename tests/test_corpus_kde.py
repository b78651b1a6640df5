"""KDE handbooks source: a fake unpacked package tree with rendered handbooks in both languages."""

from __future__ import annotations

import bz2
from pathlib import Path

from pipeline.tasks.translation_de_en.corpus import Pair
from pipeline.tasks.translation_de_en.corpus.kde import KdeHandbooks


def page(title: str, body: str, up: str = "") -> str:
    """One page of an ``index.cache.bz2`` as meinproc writes it: head, navigation, content, footer."""
    up_link = f'<link rel="up" href="{up}" title="x">' if up else ""
    return (f'<html><head><title>{title}</title><link rel="home" href="index.html" title="x">{up_link}'
            '<meta name="GENERATOR" content="KDE XSL Stylesheet V1.14 using libxslt"></head><body>'
            '<div id="content"><div id="header"><div id="header_content">The <span>Foo</span> Handbook</div></div>'
            '<div class="navCenter"><table class="navigation"><tr><td class="prevCell">'
            '<a accesskey="p" href="index.html">Prev</a></td></tr></table></div>'
            f'<div id="contentBody">{body}</div>'
            '<div id="footer"><div id="footer_text">Would you like to make a comment?<br>Send feedback</div></div>'
            "</div></body></html>")


def book(pages: dict[str, str]) -> bytes:
    return bz2.compress("".join(f'<FILENAME filename="{n}">{h}</FILENAME>' for n, h in pages.items()).encode())


def write(root: Path, package: str, lang: str, app: str, pages: dict[str, str]) -> None:
    folder = root / package / "usr/share/doc/HTML" / lang / app
    folder.mkdir(parents=True)
    (folder / "index.cache.bz2").write_bytes(book(pages))


def title_page(title: str, date: str, extra: str = "") -> str:
    return page(title, f'<div class="book"><div class="titlepage"><h1 class="title"><a name="foo"></a>{title}</h1>'
                       f'<div class="authorgroup"><p class="author">Ann Author</p>{extra}</div>'
                       f'<div>Revision <span class="releaseinfo">1.0 (<span class="date">{date}</span>)</span></div>'
                       '</div><div class="toc"><p><b>Contents</b></p><dl class="toc"><dt>'
                       '<a href="usage.html">1. Usage</a></dt></dl></div></div>')


EN_USAGE = page("Chapter 1. Usage", up="index.html", body=(
    '<div class="chapter"><h1 class="title"><a name="usage"></a>Chapter 1. Usage</h1>'
    '<p>Start <span class="application">Foo</span> from the <span class="guimenu">Applications</span> menu.</p>'
    '<div class="itemizedlist"><ul class="itemizedlist"><li class="listitem"><p>Open a file &amp; edit it.</p></li>'
    '<li class="listitem"><p>Save it with <span class="keycap"><strong>Ctrl</strong></span>+S.</p></li></ul></div>'
    '<pre class="screen"><code class="prompt">%</code> foo --help</pre>'
    '<div class="variablelist"><dl><dt><a name="idm101"></a><span class="term">Quit</span></dt>'
    "<dd><p>Leaves the program.</p></dd></dl></div></div>"))
DE_USAGE = page("Kapitel 1. Arbeiten mit Foo", up="index.html", body=(
    '<div class="chapter"><h1 class="title"><a name="usage"></a>Kapitel 1. Arbeiten mit Foo</h1>'
    '<p>Starten Sie <span class="application">Foo</span> aus dem Menü <span class="guimenu">Anwendungen</span>.</p>'
    '<div class="itemizedlist"><ul class="itemizedlist"><li class="listitem"><p>Öffnen Sie eine Datei.</p></li>'
    '<li class="listitem"><p>Speichern Sie sie mit <span class="keycap"><strong>Strg</strong></span>+S.</p></li>'
    '</ul></div><pre class="screen"><code class="prompt">%</code> foo --help</pre>'
    '<div class="variablelist"><dl><dt><a name="idm577"></a><span class="term">Beenden</span></dt>'
    "<dd><p>Beendet das Programm.</p></dd></dl></div></div>"))
# A section page below the chapter: its pairs belong to the chapter's document.
EN_SECT = page("Menus", up="usage.html", body=(
    '<div class="sect1"><h2 class="title"><a name="menus"></a>Menus</h2><p>The menus are simple.</p>'
    '<div class="sect2"><h3 class="title"><a name="file-menu"></a>File Menu</h3><p>It opens files.</p>'
    "<p>It also closes them.</p></div></div>"))
# The German "File Menu" section predates the second paragraph: skipped, the rest of the page is kept.
DE_SECT = page("Menüs", up="usage.html", body=(
    '<div class="sect1"><h2 class="title"><a name="menus"></a>Menüs</h2><p>Die Menüs sind einfach.</p>'
    '<div class="sect2"><h3 class="title"><a name="file-menu"></a>Menü Datei</h3><p>Es öffnet Dateien.</p>'
    "</div></div>"))
EN_CREDITS = page("Chapter 2. Credits", up="index.html", body=(
    '<div class="chapter"><h1 class="title"><a name="credits"></a>Chapter 2. Credits and License</h1>'
    "<p>Program copyright 2020 Ann Author</p><p>This documentation is licensed under the GFDL.</p></div>"))
DE_CREDITS = page("Kapitel 2. Danksagungen", up="index.html", body=(
    '<div class="chapter"><h1 class="title"><a name="credits"></a>Kapitel 2. Danksagungen und Lizenz</h1>'
    "<p>Copyright für das Programm 2020 Ann Author</p><p>Übersetzung: Max Muster</p>"
    "<p>Diese Dokumentation ist unter der GFDL lizenziert.</p></div>"))

COPYRIGHT = """Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: foo

Files: *
Copyright: 2020, Ann Author
License: GPL-2+

Files: doc/*
       po/de/docs/*
Copyright: 2020, Ann Author
License: GFDL-NIV-1.2+
"""


def fake_trees(root: Path) -> dict[str, Path]:
    write(root, "foo", "en", "foo", {"index.html": title_page("The Foo Handbook", "2023-01-02"),
                                      "usage.html": EN_USAGE, "menus.html": EN_SECT, "credits.html": EN_CREDITS})
    write(root, "foo", "de", "foo", {
        "index.html": title_page("Das Handbuch zu Foo", "2023-01-02", "<p>Deutsche Übersetzung: Max Muster</p>"),
        "usage.html": DE_USAGE, "menus.html": DE_SECT, "credits.html": DE_CREDITS})
    (root / "foo/usr/share/doc/foo").mkdir(parents=True)
    (root / "foo/usr/share/doc/foo/copyright").write_text(COPYRIGHT)
    # English and German in two packages (like k3b-data / k3b-i18n), and the German is stale.
    bar_en = page("Chapter 1. Playing", up="index.html", body='<h1 class="title"><a name="play"></a>Play</h1>'
                                                              "<p>Click the ball to move it.</p>")
    bar_de = page("Kapitel 1. Spielen", up="index.html", body='<h1 class="title"><a name="play"></a>Spielen</h1>'
                                                              "<p>Klicken Sie auf den Ball.</p>")
    write(root, "bar-data", "en", "bar", {"index.html": title_page("The Bar Handbook", "2021-10-01"),
                                          "play.html": bar_en})
    write(root, "bar-i18n", "de", "bar", {"index.html": title_page("Das Handbuch zu Bar", "2016-05-10"),
                                          "play.html": bar_de})
    return {name: root / name for name in ("bar-data", "bar-i18n", "foo")}


FOO = "kde:foo/foo"
GFDL = "GFDL-NIV-1.2+"
EXPECTED_FOO = [
    Pair("Kapitel 2. Danksagungen und Lizenz", "Chapter 2. Credits and License", "kde", f"{FOO}/credits", GFDL),
    Pair("Copyright für das Programm 2020 Ann Author", "Program copyright 2020 Ann Author", "kde", f"{FOO}/credits",
         GFDL),
    Pair("Diese Dokumentation ist unter der GFDL lizenziert.", "This documentation is licensed under the GFDL.", "kde",
         f"{FOO}/credits", GFDL),
    Pair("Das Handbuch zu Foo", "The Foo Handbook", "kde", f"{FOO}/index", GFDL),
    Pair("Ann Author", "Ann Author", "kde", f"{FOO}/index", GFDL),
    Pair("Revision 1.0 (2023-01-02)", "Revision 1.0 (2023-01-02)", "kde", f"{FOO}/index", GFDL),
    Pair("Menüs", "Menus", "kde", f"{FOO}/usage", GFDL),
    Pair("Die Menüs sind einfach.", "The menus are simple.", "kde", f"{FOO}/usage", GFDL),
    Pair("Kapitel 1. Arbeiten mit Foo", "Chapter 1. Usage", "kde", f"{FOO}/usage", GFDL),
    Pair("Starten Sie Foo aus dem Menü Anwendungen.", "Start Foo from the Applications menu.", "kde",
         f"{FOO}/usage", GFDL),
    Pair("Öffnen Sie eine Datei.", "Open a file & edit it.", "kde", f"{FOO}/usage", GFDL),
    Pair("Speichern Sie sie mit Strg+S.", "Save it with Ctrl+S.", "kde", f"{FOO}/usage", GFDL),
    Pair("Beenden", "Quit", "kde", f"{FOO}/usage", GFDL),
    Pair("Beendet das Programm.", "Leaves the program.", "kde", f"{FOO}/usage", GFDL),
]


def test_pairs_are_aligned_per_section_and_mismatches_skipped(tmp_path: Path) -> None:
    source = KdeHandbooks()
    pairs = list(source.pairs(fake_trees(tmp_path), {}, tmp_path / "cache"))
    assert pairs == EXPECTED_FOO
    # Left out: the stale book, the code block, navigation, header, footer, table of contents, and
    # the German translator credits (title page and credits chapter; dropped so that the shapes agree).
    assert source.skipped == ["bar (stale: de 2016-05-10, en 2021-10-01)", "foo/menus.html#file-menu"]
    assert source.stats == {"books": 1, "books_stale": 1, "sections": 4, "sections_skipped": 1}


def test_stale_books_on_request_and_deterministic(tmp_path: Path) -> None:
    source = KdeHandbooks()
    trees = fake_trees(tmp_path)
    pairs = list(source.pairs(trees, {"stale": True}, tmp_path / "cache"))
    bar = [p for p in pairs if p.doc.startswith("kde:bar-data/")]
    # Named by the English original's package; no copyright file there: KDE's default licence.
    assert [p.doc for p in bar[:3]] == ["kde:bar-data/bar/index"] * 3  # title, author, revision
    assert bar[3:] == [Pair("Spielen", "Play", "kde", "kde:bar-data/bar/play", "GFDL-1.2+"),
                   Pair("Klicken Sie auf den Ball.", "Click the ball to move it.", "kde", "kde:bar-data/bar/play",
                        "GFDL-1.2+")]
    assert bar[0].doc < FOO and pairs[len(bar):] == EXPECTED_FOO
    assert list(source.pairs(trees, {"stale": True}, tmp_path / "cache")) == pairs


def test_packages_default_and_option() -> None:
    source = KdeHandbooks()
    names = source.packages({})
    assert names == sorted(names) and {"k3b-data", "k3b-i18n", "okular"} <= set(names)
    assert source.packages({"packages": ["okular", "kcalc"]}) == ["kcalc", "okular"]
