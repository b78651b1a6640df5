"""The man-page source on a tiny fake pair of unpacked packages: roff stripped, sections and
paragraphs aligned, a page whose structure differs skipped, the right English package chosen."""

from __future__ import annotations

import gzip
from pathlib import Path

from pipeline.tasks.translation_de_en.corpus import Pair
from pipeline.tasks.translation_de_en.corpus.manpages import ManPages, parse, unescape

CREDITS = """.SH ÜBERSETZUNG
Die deutsche Übersetzung dieser Handbuchseite wurde von
Jemand <jemand@example.org>
erstellt.
"""

DEMO_DE = r""".\" -*- coding: UTF-8 -*-
.\" This file was generated with po4a. Translate the source file.
.TH DEMO 1 "Mai 2023" "demo 1.2" "Benutzerbefehle"
.SH BEZEICHNUNG
demo \- zeigt Beispiele an
.SH ÜBERSICHT
\fBdemo\fP [\fIOPTION\fP]…
.SH BESCHREIBUNG
\fBdemo\fP gibt die \fIDATEI\fP auf der Standardausgabe aus \(em ohne
Umwege.
.PP
Die Konfiguration wird aus \fI/etc/demo.conf\fP gelesen, siehe \fBdemo.conf\fP(5).
.TP
\fB\-r\fP, \fB\-\-recursive\fP
verarbeitet Verzeichnisse rekursiv. \" a comment
.TP
.B \-\-help
zeigt eine Hilfe an und beendet das Programm.
.nf
demo \-r /tmp
.fi
.SS "Weitere Hinweise"
.ie n .sp
.el .sp 1v
.if t \{\
Dieser Text erscheint nur im Satz.
.\}
Ein Beispiel findet sich unter
.UR https://example.org/demo
der Projektseite
.UE .
.TS
tab(;);
l l.
Spalte;Wert
.TE
""" + CREDITS

DEMO_EN = r""".TH DEMO 1 "May 2023" "demo 1.2" "User Commands"
.SH NAME
demo \- show examples
.SH SYNOPSIS
.B demo
[\fIOPTION\fR]...
.SH DESCRIPTION
.B demo
prints the \fIFILE\fR to standard output \(em without detours.
.PP
The configuration is read from \fI/etc/demo.conf\fR, see \fBdemo.conf\fR(5).
.TP
\fB\-r\fR, \fB\-\-recursive\fR
process directories recursively.
.TP
.B \-\-help
display help and exit.
.nf
demo \-r /tmp
.fi
.SS "Further notes"
.sp
An example is on
.UR https://example.org/demo
the project page
.UE .
"""

TINY_DE = r""".Dd $Mdocdate: 3. März 2023 $
.Dt TINY 1
.Os
.Sh BEZEICHNUNG
.Nm tiny
.Nd ein kleines Werkzeug
.Sh BESCHREIBUNG
Das Programm
.Nm
liest
.Ar Datei
und schreibt sie nach
.Pa /dev/null .
.Bl -tag -width Ds
.It Fl v
Gibt mehr Meldungen aus
.Pq siehe Xr syslog 3 .
.El
.Sh FEHLER
Es gibt einen Fehler.
.Pp
Und noch einen zweiten.
""" + CREDITS.replace(".SH", ".Sh")

TINY_EN = r""".Dd $Mdocdate: March 3 2023 $
.Dt TINY 1
.Os
.Sh NAME
.Nm tiny
.Nd a small tool
.Sh DESCRIPTION
The
.Nm
program reads
.Ar file
and writes it to
.Pa /dev/null .
.Bl -tag -width Ds
.It Fl v
Print more messages
.Pq see Xr syslog 3 .
.El
.Sh BUGS
There is one bug.
"""

# The English page has a section (EXAMPLES) the translated version did not have: skipped whole.
BROKEN_DE = r""".TH BROKEN 8 "2023" "demo 1.2"
.SH BEZEICHNUNG
broken \- passt nicht
.SH BESCHREIBUNG
Dieser Text ist übersetzt.
""" + CREDITS

BROKEN_EN = r""".TH BROKEN 8 "2023" "demo 1.2"
.SH NAME
broken \- does not fit
.SH DESCRIPTION
This text is translated.
.SH EXAMPLES
broken \-\-now
"""


def _page(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))


def _trees(tmp_path: Path) -> dict[str, Path]:
    de = tmp_path / "manpages-de" / "usr/share/man/de"
    _page(de / "man1/demo.1.gz", DEMO_DE)
    _page(de / "man1/tiny.1.gz", TINY_DE)
    _page(de / "man8/broken.8.gz", BROKEN_DE)
    _page(de / "man1/lonely.1.gz", BROKEN_DE)  # no English page of that name: not counted
    _page(de / "man1/redirect.1.gz", ".so man1/demo.1\n")  # repeats demo.1
    (de / "man1/alias.1.gz").symlink_to("demo.1.gz")  # repeats demo.1

    en = tmp_path / "demo-en"
    _page(en / "usr/share/man/man1/demo.1.gz", DEMO_EN)
    _page(en / "usr/share/man/man1/tiny.1.gz", TINY_EN)
    _page(en / "usr/share/man/man8/broken.8.gz", BROKEN_EN)
    _page(en / "usr/share/man/man1/redirect.1.gz", DEMO_EN)
    (en / "usr/share/doc/demo-en").mkdir(parents=True)
    (en / "usr/share/doc/demo-en/copyright").write_text(
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\n"
        "Files: *\nCopyright: 2023 Someone\nLicense: MIT\n\nFiles: debian/*\nLicense: GPL-2+\n"
    )
    # An older demo.1 in another package (sorted first): same skeleton, other version; not the one translated.
    _page(tmp_path / "aaa-old/usr/share/man/man1/demo.1.gz", DEMO_EN.replace('"demo 1.2"', '"demo 0.9"'))
    return {"manpages-de": tmp_path / "manpages-de", "demo-en": en, "aaa-old": tmp_path / "aaa-old"}


def test_pairs(tmp_path):
    source = ManPages()
    got = list(source.pairs(_trees(tmp_path), {}, tmp_path))
    licence = "GPL-3+ (translation); original: MIT"
    demo = [
        ("demo - zeigt Beispiele an", "demo - show examples"),
        ("demo gibt die DATEI auf der Standardausgabe aus — ohne Umwege.",
         "demo prints the FILE to standard output — without detours."),
        ("Die Konfiguration wird aus /etc/demo.conf gelesen, siehe demo.conf(5).",
         "The configuration is read from /etc/demo.conf, see demo.conf(5)."),
        ("verarbeitet Verzeichnisse rekursiv.", "process directories recursively."),
        ("zeigt eine Hilfe an und beendet das Programm.", "display help and exit."),
        ("Weitere Hinweise", "Further notes"),
        ("Ein Beispiel findet sich unter der Projektseite.", "An example is on the project page."),
    ]
    tiny = [
        ("tiny — ein kleines Werkzeug", "tiny — a small tool"),
        ("Das Programm tiny liest Datei und schreibt sie nach /dev/null.",
         "The tiny program reads file and writes it to /dev/null."),
        ("Gibt mehr Meldungen aus (siehe syslog(3)).", "Print more messages (see syslog(3))."),
    ]
    assert got == [Pair(de, en, "manpages", "manpages:demo.1", licence) for de, en in demo] + [
        Pair(de, en, "manpages", "manpages:tiny.1", licence) for de, en in tiny
    ]
    assert source.report["pages"] == 3
    assert list(source.report["skipped"]) == ["manpages:broken.8"]
    assert "2 sections in German, 3 in English" in source.report["skipped"]["manpages:broken.8"]
    assert source.report["sections_skipped"] == 1  # tiny's FEHLER/BUGS: 2 paragraphs against 1
    assert list(source.pairs(_trees(tmp_path / "again"), {}, tmp_path)) == got  # deterministic


def test_wrong_paragraph_rejected(tmp_path):
    """Same skeleton, but the English paragraph documents another option: the anchors disagree."""
    trees = _trees(tmp_path)
    changed = DEMO_EN.replace(r"see \fBdemo.conf\fR(5).", r"or with \fB\-\-user\-config\fR from \fI~/.config/demo\fR.")
    _page(trees["demo-en"] / "usr/share/man/man1/demo.1.gz", changed)
    _page(trees["aaa-old"] / "usr/share/man/man1/demo.1.gz", changed)
    got = [p.en for p in ManPages().pairs(trees, {}, tmp_path) if p.doc == "manpages:demo.1"]
    assert len(got) == 6 and not any("configuration" in en for en in got)


def test_roff_text():
    assert unescape(r"\fBls\fP \-\-all \(em \[u00E4]\*(lqx\*(rq \e \&.") == "ls --all — ä“x” \\ ."
    page = parse(".TH X 1\n.SH NAME\nx \\- y\n.SH \"SEE ALSO\"\n.BR ls (1),\n.IR cp (1)\n")
    assert [(s.heading, s.paragraphs) for s in page.sections] == [
        ("NAME", ["x - y"]), ("SEE ALSO", ["ls(1), cp(1)"])
    ]


def test_so_includes_and_links_cannot_leave_the_package_roots(tmp_path):
    """The man-page reader must not follow ``.so ../../…`` (or a linked directory) outside the
    unpacked packages, where it would read files that belong to no package. A redirection or link
    that leads outside every root reads nothing; one that stays inside is still followed."""
    from pipeline.tasks.translation_de_en.corpus.manpages import read_page

    root = tmp_path / "pkg"
    man = root / "usr/share/man"
    (tmp_path / "secret.7").write_text(".TH SECRET 7\nnot part of any package\n")
    _page(man / "man1/up.1.gz", ".so ../../../../secret.7\n")
    (man / "man5").symlink_to(tmp_path, target_is_directory=True)  # a directory link out of the package
    _page(man / "man1/via.1.gz", ".so man5/secret.7\n")
    (man / "man1/abs.1.gz").symlink_to(tmp_path / "secret.7")
    (man / "man1/rel.1.gz").symlink_to("../../../../../secret.7")
    for name in ("up", "via", "abs", "rel"):
        assert read_page(man / f"man1/{name}.1.gz", [root]) is None, name
    _page(man / "man1/real.1.gz", DEMO_EN)
    _page(man / "man1/ok.1.gz", ".so man1/real.1\n")
    assert read_page(man / "man1/ok.1.gz", [root]) == DEMO_EN
