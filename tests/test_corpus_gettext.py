"""The gettext source on fake unpacked packages: .mo catalogs written here in the real binary format."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from pipeline.tasks.translation_de_en.corpus import SOURCES, CorpusError, Pair
from pipeline.tasks.translation_de_en.corpus.gettext import Gettext

HEADER = "Content-Type: text/plain; charset=UTF-8\nLanguage: {lang}\nPlural-Forms: nplurals=2; plural=(n != 1);\n"


def write_mo(path: Path, entries: dict, lang: str = "de") -> None:
    """A GNU .mo file (as msgfmt writes it, without the optional hash table). Keys: msgid, or
    (msgid, msgid_plural) with a tuple of forms as value; "ctx\\x04msgid" for a context."""
    messages = {b"": HEADER.format(lang=lang).encode()}
    for key, value in entries.items():
        if isinstance(key, tuple):
            messages["\0".join(key).encode()] = "\0".join(value).encode()
        else:
            messages[key.encode()] = value.encode()
    keys = sorted(messages)
    ids = strs = b""
    offsets = []
    for k in keys:
        offsets.append((len(ids), len(k), len(strs), len(messages[k])))
        ids += k + b"\0"
        strs += messages[k] + b"\0"
    start = 7 * 4 + 16 * len(keys)
    table = b"".join(struct.pack("<II", n, start + o) for o, n, _, _ in offsets)
    table += b"".join(struct.pack("<II", n, start + len(ids) + o) for _, _, o, n in offsets)
    header = struct.pack("<7I", 0x950412DE, 0, len(keys), 28, 28 + 8 * len(keys), 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + table + ids + strs)


@pytest.fixture
def trees(tmp_path: Path) -> dict[str, Path]:
    game = tmp_path / "game-data_1.0"
    locale = game / "usr/share/games/game/locale"
    write_mo(locale / "de/LC_MESSAGES/game.mo", {
        "Hello there, traveller.": "Hallo, Reisender.",
        "menu\x04Open the <b>door</b>.": "Öffne die <b>Tür</b>.",
        ("You found one coin.", "You found %d coins."): ("Du hast eine Münze gefunden.", "Du hast %d Münzen gefunden."),
        "<npcname> waves at you.": "<npcname> winkt dir zu.",  # a placeholder: skipped
        "Press <F|f> to flee.": "Drücke <F|f> zum Fliehen.",  # template syntax: skipped
        "<color_red>Danger</color> lies ahead!": "<color_red>Gefahr</color> liegt voraus!",
        "First line here.\nSecond line here.": "Erste Zeile hier.<br/>Zweite Zeile hier.",
        "A long sentence that is\nwrapped right here.": "Ein langer Satz, der hier\numgebrochen ist.",
        "One.\nTwo.\nThree.": "Eins, zwei.\nDrei.",  # lines merged: which matches which is a guess
        "<i>(bows)</i>\nWelcome home, my lord.": "Willkommen daheim, Herr.",  # a line dropped
        "Not translated yet.": "",
    })
    write_mo(locale / "de_DE/LC_MESSAGES/game.mo", {"Hello there, traveller.": "Grüß Gott, Reisender."})
    write_mo(game / "usr/share/locale/de_DE/LC_MESSAGES/extra.mo", {"An extra sentence.": "Ein zusätzlicher Satz."})
    # Headers copied from another language's catalog are common: the folder says German.
    write_mo(game / "usr/share/locale/de/LC_MESSAGES/mislabelled.mo", {"A copied header.": "Ein kopierter Kopf."},
             lang="pt")
    write_mo(game / "usr/share/locale/de/LC_MESSAGES/freedroidrpg-dialogs.mo",
             {"[b]Tux:[/b] Hello, [r]friend[n]!": "[b]Tux:[/b] Hallo, [r]Freund[n]!"})
    write_mo(game / "usr/share/locale/de/LC_MESSAGES/freeciv-core.mo",
             {"?unit:Settlers found new cities.": "?unit:Siedler gründen neue Städte.",
              "?terrain:Hills are good for defence.": "Hügel sind gut zur Verteidigung."})
    write_mo(game / "usr/share/doc/game-data/examples/locale/de/LC_MESSAGES/example.mo", {"Example.": "Beispiel."})
    (game / "usr/share/locale/de/LC_MESSAGES/broken.mo").write_bytes(b"not a catalog at all")
    (game / "usr/share/locale/de/LC_MESSAGES/link.mo").symlink_to("/usr/share/locale/de/LC_MESSAGES/x.mo")
    write_mo(game / "usr/share/locale/fr/LC_MESSAGES/game.mo", {"Hello there, traveller.": "Bonjour."})
    doc = game / "usr/share/doc/game-data"
    (doc / "copyright").write_text("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\n"
                                   "Files: *\nCopyright: 2020 Someone\nLicense: GPL-2+\n This program is free...\n\n"
                                   "Files: data/*\nLicense: CC-BY-SA-3.0\n")

    big = tmp_path / "big-game_2.0"
    write_mo(big / "usr/share/locale/de/LC_MESSAGES/big.mo",
             {f"This is sentence number {i:04d}.": f"Das ist Satz Nummer {i:04d}." for i in range(2001)})
    (big / "usr/share/doc").mkdir(parents=True)
    (big / "usr/share/doc/big-game").symlink_to("game-data")  # a -data package's doc folder

    lonely = tmp_path / "lonely_3.0"
    write_mo(lonely / "usr/share/locale/de/LC_MESSAGES/lonely.mo", {"Stand alone here.": "Allein hier stehen."})
    free_form = lonely / "usr/share/doc/lonely/copyright"  # a License: heading with prose: no short name
    free_form.parent.mkdir(parents=True)
    free_form.write_text("Upstream: someone\n\nLicense:\n    This program is free software.\n")
    return {"game-data": game, "big-game": big, "lonely": lonely}


def test_pairs_strip_markup_and_skip_doubtful_entries(trees, tmp_path):
    source = Gettext()
    got = list(source.pairs(trees, {}, tmp_path / "cache"))
    game = [p for p in got if p.doc.startswith("gettext:game-data/")]
    pair = lambda de, en, doc: Pair(de, en, "gettext", f"gettext:game-data/{doc}", "GPL-2+")  # noqa: E731
    assert game == [
        pair("Ein zusätzlicher Satz.", "An extra sentence.", "extra"),  # de_DE read where no de catalog exists
        pair("Hügel sind gut zur Verteidigung.", "Hills are good for defence.", "freeciv-core"),
        pair("Siedler gründen neue Städte.", "Settlers found new cities.", "freeciv-core"),
        pair("Tux: Hallo, Freund!", "Tux: Hello, friend!", "freedroidrpg-dialogs"),
        pair("Gefahr liegt voraus!", "Danger lies ahead!", "game"),
        pair("Ein langer Satz, der hier umgebrochen ist.", "A long sentence that is wrapped right here.", "game"),
        pair("Erste Zeile hier.", "First line here.", "game"),
        pair("Zweite Zeile hier.", "Second line here.", "game"),
        pair("Hallo, Reisender.", "Hello there, traveller.", "game"),  # de wins over de_DE
        pair("Öffne die Tür.", "Open the door.", "game"),  # context and tags gone
        pair("Du hast eine Münze gefunden.", "You found one coin.", "game"),  # plural form 0 only
        pair("Ein kopierter Kopf.", "A copied header.", "mislabelled"),
    ]  # not read: the broken catalog, the symlink, fr/, the example below usr/share/doc
    assert source.skipped == {"entries with placeholder tags": 2, "entries whose lines differ": 2,
                              "unreadable catalogs": 1}
    assert [p for p in got if p.doc.startswith("gettext:lonely/")] == [
        Pair("Allein hier stehen.", "Stand alone here.", "gettext", "gettext:lonely/lonely",
             "see /usr/share/doc/lonely/copyright")]


def test_large_catalog_is_split_into_blocks(trees, tmp_path):
    got = [p for p in Gettext().pairs(trees, {}, tmp_path) if p.doc.startswith("gettext:big-game/")]
    assert len(got) == 2001
    assert {p.licence for p in got} == {"GPL-2+"}  # read through the symlinked doc folder
    docs = [p.doc for p in got]
    assert sorted(set(docs)) == [f"gettext:big-game/big/{n:03d}" for n in range(1, 22)]  # 100 msgids each
    assert docs.count("gettext:big-game/big/001") == 100 and docs[-1] == "gettext:big-game/big/021"
    assert got[500].en == "This is sentence number 0500." and got[500].doc == "gettext:big-game/big/006"


def test_deterministic(trees, tmp_path):
    source = Gettext()
    assert list(source.pairs(trees, {}, tmp_path)) == list(source.pairs(dict(reversed(trees.items())), {}, tmp_path))


def test_packages_option():
    source = SOURCES["gettext"]  # registered on import
    games = source.packages({})
    assert games == sorted(games) and "cataclysm-dda-data" in games
    assert source.packages({"packages": "games"}) == games
    assert len(source.packages({"packages": "top40"})) == 40
    every = source.packages({"packages": "all"})
    assert len(every) > 1800 and set(games) <= set(every)
    assert source.packages({"packages": ["b", "a", "b"]}) == ["a", "b"]
    with pytest.raises(CorpusError, match="games, top40, all"):
        source.packages({"packages": "everything"})
