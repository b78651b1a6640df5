"""The GNOME help source on a tiny fake package: Mallard markup stripped, pages aligned block by
block, a page whose structure differs skipped whole."""

from pathlib import Path

from pipeline.tasks.translation_de_en.corpus import Pair, get_source

HEAD = '<?xml version="1.0" encoding="utf-8"?>\n'
NS = ('xmlns="http://projectmallard.org/1.0/" xmlns:if="http://projectmallard.org/if/1.0/" '
      'xmlns:xi="http://www.w3.org/2001/XInclude"')

EN_INTRO = HEAD + f"""<page {NS} type="topic" id="intro">
  <info>
    <link type="guide" xref="index"/>
    <xi:include href="legal.xml"/>
    <credit type="author"><name>Jane Doe</name></credit>
    <desc>Learn what the <app>Calculator</app> can do.</desc>
  </info>
  <title>Getting <em>started</em></title>
  <p>Press <keyseq><key>Ctrl</key> <key>Q</key></keyseq> to quit, or choose
     <guiseq><gui>File</gui><gui>Quit</gui></guiseq>.</p>
  <code>calc --help</code>
  <screen>$ calc
ready</screen>
  <media type="image" src="figures/main.png"><p>The main window</p></media>
  <comment><cite>jd</cite><p>Expand this page.</p></comment>
  <steps>
    <item><p>See <link xref="basics#keys"/> first.</p></item>
    <item><p>Click <if:choose><if:when test="platform:gnome-classic"><gui>Apps</gui></if:when>
       <if:else><gui>Activities</gui></if:else></if:choose>.</p></item>
  </steps>
  <note><p>Read the <link href="https://example.org">manual</link> too.</p></note>
</page>
"""

DE_INTRO = HEAD + f"""<page {NS} type="topic" id="intro" xml:lang="de">
  <info>
    <link type="guide" xref="index"/>
    <xi:include href="legal.xml"/>
    <mal:credit xmlns:mal="http://projectmallard.org/1.0/" type="translator copyright">
      <mal:name>Max Muster</mal:name><mal:years>2021</mal:years>
    </mal:credit>
    <desc>Erfahren Sie, was der <app>Rechner</app> kann.</desc>
  </info>
  <title>Erste <em>Schritte</em></title>
  <p>Drücken Sie <keyseq><key>Strg</key> <key>Q</key></keyseq> zum Beenden, oder wählen Sie
     <guiseq><gui>Datei</gui><gui>Beenden</gui></guiseq>.</p>
  <code>calc --help</code>
  <screen>$ calc
bereit</screen>
  <media type="image" src="figures/main-de.png"><p>Das Hauptfenster</p></media>
  <comment><cite>jd</cite><p>Expand this page.</p></comment>
  <steps>
    <item><p>Lesen Sie zuerst <link xref="basics#keys"/>.</p></item>
    <item><p>Klicken Sie auf <if:choose><if:when test="platform:gnome-classic"><gui>Anwendungen</gui>
       </if:when><if:else><gui>Aktivitäten</gui></if:else></if:choose>.</p></item>
  </steps>
  <note><p>Lesen Sie auch das <link href="https://example.org">Handbuch</link>.</p></note>
</page>
"""

EN_BASICS = HEAD + f"""<page {NS} type="topic" id="basics">
  <info><license href="http://creativecommons.org/licenses/by-sa/4.0/"><p>CC</p></license></info>
  <title>Basics</title>
  <section id="keys"><title>Keyboard shortcuts</title>
    <table><tr><td><p>Undo the last step</p></td></tr></table>
  </section>
</page>
"""

DE_BASICS = HEAD + f"""<page {NS} type="topic" id="basics" xml:lang="de">
  <info><license href="http://creativecommons.org/licenses/by-sa/4.0/"><p>CC</p></license></info>
  <title>Grundlagen</title>
  <section id="keys"><title>Tastenkürzel</title>
    <table><tr><td><p>Den letzten Schritt rückgängig machen</p></td></tr></table>
  </section>
</page>
"""

# The English page gained a paragraph after the translation was made: its blocks no longer match.
EN_OLD = HEAD + f"""<page {NS} type="topic" id="old">
  <title>History</title>
  <p>The history lists past results.</p>
  <p>Click a result to reuse it.</p>
</page>
"""

DE_OLD = HEAD + f"""<page {NS} type="topic" id="old" xml:lang="de">
  <title>Verlauf</title>
  <p>Der Verlauf listet frühere Ergebnisse auf.</p>
</page>
"""

LEGAL = HEAD + """<license xmlns="http://projectmallard.org/1.0/"
  href="http://creativecommons.org/licenses/by-sa/3.0/"><p>CC BY-SA 3.0</p></license>
"""

COPYRIGHT = """Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/

Files: *
Copyright: 2020 Jane Doe
License: GPL-2+

Files: help/*
Copyright: 2020 Jane Doe
License: GFDL-1.1+
"""


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _package(tmp_path: Path) -> Path:
    root = tmp_path / "calc_1.0"
    help_dir = "usr/share/help/{}/calc/"
    for lang, pages in (("C", (EN_INTRO, EN_BASICS, EN_OLD)), ("de", (DE_INTRO, DE_BASICS, DE_OLD))):
        for name, text in zip(("intro", "basics", "old"), pages):
            _write(root, help_dir.format(lang) + f"{name}.page", text)
        _write(root, help_dir.format(lang) + "legal.xml", LEGAL)
    _write(root, "usr/share/help/C/calc/extra.page", EN_OLD.replace('id="old"', 'id="extra"'))  # untranslated
    _write(root, "usr/share/doc/calc/copyright", COPYRIGHT)
    return root


def test_pairs_aligned_and_mismatch_skipped(tmp_path):
    source = get_source("gnome")
    got = list(source.pairs({"calc": _package(tmp_path)}, {}, tmp_path / "cache"))
    intro, basics = "gnome:calc/calc/intro", "gnome:calc/calc/basics"
    cc3, cc4 = "CC-BY-SA-3.0", "CC-BY-SA-4.0"
    assert got == [
        Pair("Grundlagen", "Basics", "gnome", basics, cc4),
        Pair("Tastenkürzel", "Keyboard shortcuts", "gnome", basics, cc4),
        Pair("Den letzten Schritt rückgängig machen", "Undo the last step", "gnome", basics, cc4),
        Pair("Erfahren Sie, was der Rechner kann.", "Learn what the Calculator can do.", "gnome", intro, cc3),
        Pair("Erste Schritte", "Getting started", "gnome", intro, cc3),
        Pair("Drücken Sie Strg+Q zum Beenden, oder wählen Sie Datei ▸ Beenden.",
             "Press Ctrl+Q to quit, or choose File ▸ Quit.", "gnome", intro, cc3),
        Pair("Lesen Sie zuerst Tastenkürzel.", "See Keyboard shortcuts first.", "gnome", intro, cc3),
        Pair("Lesen Sie auch das Handbuch.", "Read the manual too.", "gnome", intro, cc3),
    ]
    assert source.skipped == ["gnome:calc/calc/old"]
    assert source.stats["pages_aligned"] == 2
    assert source.stats["pages_skipped_structure"] == 1
    assert source.stats["blocks_dropped"] == 1  # the paragraph with an inline conditional


def test_licence_from_copyright_and_deterministic(tmp_path):
    root = _package(tmp_path)
    for lang in ("C", "de"):
        (root / f"usr/share/help/{lang}/calc/legal.xml").unlink()  # no <license> left for intro.page
    source = get_source("gnome")
    first = list(source.pairs({"calc": root}, {}, tmp_path))
    assert {p.licence for p in first if p.doc.endswith("/intro")} == {"GFDL-1.1+"}  # Files: help/*
    assert first == list(source.pairs({"calc": root}, {}, tmp_path))


def test_packages_option():
    source = get_source("gnome")
    assert source.packages({"packages": ["b", "a", "c"], "exclude": ["c"]}) == ["a", "b"]
    assert "gnome-user-docs" in source.packages({})
