"""DDTP source: parsing and joining fake Translation-de/-en indexes; the download is not run."""

from __future__ import annotations

import gzip
import hashlib
import lzma
from collections import Counter

import pytest

from pipeline.tasks.translation_de_en.corpus import CorpusError, ddtp
from pipeline.tasks.translation_de_en.corpus.ddtp import DDTP, MIRROR, pairs_from_lists

PREFIX = "deb.debian.org_debian_dists_{}_main_i18n_Translation-{}"

# libfoo-dev and libfoo-doc share one English description (md5 aaa...): one document.
BOOKWORM_EN = """\
Package: libfoo-doc
Description-md5: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
Description-en: documentation of the foo library
 Foo reads bar files quickly. It follows the object-oriented idiom
 - including inheritance - and is small.
 .
 Features:
  * fast parsing
    of large files
  * small memory use
 .
  $ foo --bar baz
  $ foo --help
 .
 This package contains the documentation.

Package: libfoo-dev
Description-md5: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
Description-en: documentation of the foo library
 Foo reads bar files quickly. It follows the object-oriented idiom
 - including inheritance - and is small.
 .
 Features:
  * fast parsing
    of large files
  * small memory use
 .
  $ foo --bar baz
  $ foo --help
 .
 This package contains the documentation.

Package: zed
Description-md5: bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb
Description-en: text editor
 Zed edits text.
 .
 It is fast.

Package: quux
Description-md5: cccccccccccccccccccccccccccccccc
Description-en: quux tool
 Quux has modes:
  * one
  * two
 .
 Quux is old.

Package: untranslated
Description-md5: dddddddddddddddddddddddddddddddd
Description-en: not translated at all
"""

BOOKWORM_DE = """\
Package: libfoo-dev
Description-md5: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
Description-de: Dokumentation der Foo-Bibliothek
 Foo liest bar-Dateien schnell. Es folgt dem objektorientierten Idiom
 - einschließlich Vererbung - und ist klein.
 .
 Funktionen:
  * schnelles Einlesen
    großer Dateien
  * geringer Speicherbedarf
 .
  $ foo --bar baz
  $ foo --help
 .
 Dieses Paket enthält die Dokumentation.

Package: libfoo-doc
Description-md5: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
Description-de: Dokumentation der Foo-Bibliothek
 Foo liest bar-Dateien schnell. Es folgt dem objektorientierten Idiom
 - einschließlich Vererbung - und ist klein.
 .
 Funktionen:
  * schnelles Einlesen
    großer Dateien
  * geringer Speicherbedarf
 .
  $ foo --bar baz
  $ foo --help
 .
 Dieses Paket enthält die Dokumentation.

Package: zed
Description-md5: bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb
Description-de: Texteditor
 Zed bearbeitet Text. Er ist schnell.

Package: quux
Description-md5: cccccccccccccccccccccccccccccccc
Description-de: Quux-Werkzeug
 Quux hat die Modi eins und zwei.
 .
 Quux ist alt.

Package: gone
Description-md5: eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee
Description-de: Übersetzung eines verschwundenen Originals
"""

# trixie: the same foo description with a revised last paragraph; its indexes are kept compressed.
TRIXIE_EN = BOOKWORM_EN.split("\n\nPackage: zed")[0] + "\n"
TRIXIE_DE = (BOOKWORM_DE.split("\n\nPackage: libfoo-doc")[0]
             .replace("Dieses Paket enthält die Dokumentation.", "Das Paket enthält die Dokumentation.") + "\n")


@pytest.fixture
def lists(tmp_path):
    folder = tmp_path / "lists"
    folder.mkdir()
    (folder / PREFIX.format("bookworm", "en")).write_text(BOOKWORM_EN)
    (folder / PREFIX.format("bookworm", "de")).write_text(BOOKWORM_DE)
    (folder / (PREFIX.format("trixie", "en") + ".xz")).write_bytes(lzma.compress(TRIXIE_EN.encode()))
    (folder / (PREFIX.format("trixie", "de") + ".gz")).write_bytes(gzip.compress(TRIXIE_DE.encode()))
    (folder / "deb.debian.org_debian_dists_bookworm_InRelease").write_text("not an index\n")
    return folder


EXPECTED = [
    ("Dokumentation der Foo-Bibliothek", "documentation of the foo library", "ddtp:libfoo-dev"),
    ("Foo liest bar-Dateien schnell. Es folgt dem objektorientierten Idiom - einschließlich Vererbung - "
     "und ist klein.",
     "Foo reads bar files quickly. It follows the object-oriented idiom - including inheritance - and is small.",
     "ddtp:libfoo-dev"),
    ("Funktionen:", "Features:", "ddtp:libfoo-dev"),
    ("schnelles Einlesen großer Dateien", "fast parsing of large files", "ddtp:libfoo-dev"),
    ("geringer Speicherbedarf", "small memory use", "ddtp:libfoo-dev"),
    ("Dieses Paket enthält die Dokumentation.", "This package contains the documentation.", "ddtp:libfoo-dev"),
    ("Das Paket enthält die Dokumentation.", "This package contains the documentation.", "ddtp:libfoo-dev"),
    ("Quux-Werkzeug", "quux tool", "ddtp:quux"),
    ("Quux ist alt.", "Quux is old.", "ddtp:quux"),
    ("Texteditor", "text editor", "ddtp:zed"),
]


def test_join_align_and_skip(lists):
    skipped = Counter()
    got = list(pairs_from_lists(lists, ["bookworm", "trixie"], "L", skipped))
    assert [(p.de, p.en, p.doc) for p in got] == EXPECTED
    assert {(p.source, p.licence) for p in got} == {("ddtp", "L")}
    assert skipped == Counter({
        "preformatted paragraphs": 2,  # the shell example, in both suites' foo translations
        "paragraphs with different structure": 1,  # quux: a list in English, a sentence in German
        "descriptions with different paragraph counts (synopsis only)": 1,  # zed
        "translations without their English original": 1,  # gone
    })


def test_output_is_stable_and_suite_order_only_reorders(lists):
    one = list(pairs_from_lists(lists, ["trixie", "bookworm"], "L"))
    assert one == list(pairs_from_lists(lists, ["trixie", "bookworm"], "L"))
    assert {(p.de, p.en, p.doc) for p in one} == set(EXPECTED)


def test_paragraphs():
    synopsis, pars = ddtp.paragraphs("syn\nText\n- wrapped dash\n.\nList:\n - a\n - b\n.\n  code\n.\n- item\n  more")
    assert synopsis == "syn"
    assert pars == [[("p", "Text - wrapped dash")], [("p", "List:"), ("li", "a"), ("li", "b")], None,
                    [("li", "item more")]]


def _cache(tmp_path, lists, suites):
    """A cache as a finished download leaves it."""
    root = tmp_path / "cache" / "ddtp"
    root.mkdir(parents=True)
    lists.rename(root / "lists")
    (root / "sources.list").write_text(ddtp._sources_list(MIRROR, suites))
    ddtp.record_lists(root, suites)
    return tmp_path / "cache"


def test_source_reuses_cached_indexes(tmp_path, lists, monkeypatch):
    cache = _cache(tmp_path, lists, ["bookworm", "trixie"])
    monkeypatch.setattr(ddtp, "_update", lambda *a: pytest.fail("apt-get update must not run"))
    source, options = DDTP(), {"suites": ["bookworm", "trixie"]}
    assert source.packages(options) == []
    got = list(source.pairs({}, options, cache))
    assert [(p.de, p.en, p.doc) for p in got] == EXPECTED
    assert source.skipped["translations without their English original"] == 1
    versions = source.versions(options, cache)
    name = PREFIX.format("trixie", "de") + ".gz"
    files = [PREFIX.format("bookworm", "de"), PREFIX.format("bookworm", "en"), name,
             PREFIX.format("trixie", "en") + ".xz"]
    assert sorted(versions) == sorted(f"ddtp/{f}" for f in files)
    assert versions[f"ddtp/{name}"] == hashlib.sha256((cache / "ddtp" / "lists" / name).read_bytes()).hexdigest()


def test_changed_suites_download_again(tmp_path, lists, monkeypatch):
    cache = _cache(tmp_path, lists, ["bookworm", "trixie"])
    calls = []
    monkeypatch.setattr(ddtp, "_update", lambda root, sources: calls.append(sources))
    with pytest.raises(CorpusError, match="sid/Translation-de"):
        ddtp.download({"suites": ["bookworm", "sid"]}, cache)
    assert calls == [ddtp._sources_list(MIRROR, ["bookworm", "sid"])]


def test_missing_apt_get_names_the_switch(tmp_path, monkeypatch):
    monkeypatch.setattr(ddtp.shutil, "which", lambda name: None)
    with pytest.raises(CorpusError, match=r"sources\.ddtp: false"):
        list(DDTP().pairs({}, {}, tmp_path))


@pytest.mark.integration
def test_private_apt_config(tmp_path):
    config = ddtp._apt_config(tmp_path, tmp_path / "sources.list")
    assert 'Dir::Etc::Parts "/dev/null";' in config and 'Dir::Etc::main "/dev/null";' in config
    assert f'Dir::State::Lists "{tmp_path}/lists";' in config
    assert 'Acquire::Languages { "de"; "en"; };' in config


def test_a_cached_index_changed_after_its_download_is_downloaded_again(tmp_path, lists, monkeypatch):
    """Cached DDTP lists are not reused as they are found, or an edited or planted index would feed
    the corpus. Their digests are recorded when apt-get update has written them; an index edited, or
    removed and planted, afterwards makes the next download run apt-get update again (repair), and
    an untouched cache does not."""
    suites = ["bookworm", "trixie"]
    cache = _cache(tmp_path, lists, suites)
    folder = cache / "ddtp" / "lists"
    calls = []

    def update(root, sources):
        calls.append(sources)
        (folder / PREFIX.format("bookworm", "de")).write_text(BOOKWORM_DE)  # what apt-get would restore

    monkeypatch.setattr(ddtp, "_update", update)
    ddtp.download({"suites": suites}, cache)
    assert calls == []
    (folder / PREFIX.format("bookworm", "de")).write_text(BOOKWORM_DE.replace("Foo-Bibliothek", "Planted"))
    ddtp.download({"suites": suites}, cache)
    assert len(calls) == 1
    assert (folder / PREFIX.format("bookworm", "de")).read_text() == BOOKWORM_DE
    ddtp.download({"suites": suites}, cache)  # repaired and recorded again: no second update
    assert len(calls) == 1
