"""gettext catalogs: the German ``.mo`` files of Debian packages (UI strings, game dialogue and lore).

A compiled catalog (``<locale>/de/LC_MESSAGES/<domain>.mo``) maps each English ``msgid`` to the
German ``msgstr`` a translator wrote for exactly that string, so the alignment is given by the
format: nothing is guessed across the two languages. What remains is the catalog's own markup:

* the ``""`` header entry is skipped; the locale folder, not the header's ``Language`` field,
  says a catalog is German (every catalog whose field disagreed was German: "pt", "templates",
  "en" are copied headers); fuzzy entries are never compiled into a ``.mo``;
* ``msgctxt`` (stored as ``"context\\x04msgid"``) is dropped: the context disambiguates, it is
  not text;
* plural entries: :class:`gettext.GNUTranslations` keeps only the singular ``msgid`` (keys
  ``(msgid, form)``), so form 0 is paired with it where the catalog's plural rule maps n = 1 to
  form 0 (German's ``n != 1``); the other forms would need ``msgid_plural``, which the reader
  discards, and nearly always carry a number placeholder that :mod:`~pipeline.tasks.translation_de_en.corpus.clean`
  rejects anyway;
* Pango/HTML-style formatting tags (``<b>…</b>``, Cataclysm's ``<color_red>…</color>``) are
  removed, but an unclosed ``<word>`` is a placeholder the program fills in (``<npcname>``,
  ``<swear>``): deleting it would leave a broken sentence, so such an entry is skipped;
* a game's own markup: FreedroidRPG's colour codes (``[b]``, ``[/b]``, ``[r]``…), Freeciv's
  ``?qualifier:`` prefixes;
* ``\\n`` inside a string: the lines are paired one by one when both sides have the same number
  of lines; a hard-wrapped paragraph (a line going on in lower case) is joined into one unit; an
  entry whose sides have different numbers of lines otherwise is skipped: there the translator
  dropped, added or merged lines (Wesnoth's stage directions), and which line matches which is
  a guess.

Accelerator marks, ``%s``-style placeholders, entities and length limits are left to
:mod:`~pipeline.tasks.translation_de_en.corpus.clean`.
The split unit is the catalog, ``gettext:<package>/<domain>``, or a
block of 100 of its msgids for a catalog of more than 200 (``…/<domain>/007``; see BLOCK).
"""

from __future__ import annotations

import gettext
import logging
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from pipeline.tasks.translation_de_en.corpus import CorpusError, Pair, Source, register

log = logging.getLogger(__name__)

# German catalogs: "de", and "de_DE" only for a domain without a "de" one. de_AT / de_CH are
# regional variants (Swiss German writes ss for ß) and would duplicate the de pairs.
_LOCALES = ("de", "de_DE")

# A catalog of a game holds the whole game (cataclysm-dda: 20k strings). As one document the
# train/val/test split would put all of it on one side, so a large catalog becomes documents of
# 100 consecutive msgids in sorted order: variants of one string ("A broken manhack.", "A broken
# manhack.  Much less threatening…") sort next to each other and stay in the same document. 100
# msgids give ~50 clean pairs, under the build's largest held-out document (max_doc_share 0.05 of
# 2,000 pairs), so game dialogue reaches validation and test too.
SPLIT_ABOVE = 200
BLOCK = 100

# Games whose catalogs are mostly natural sentences (dialogue, narration, item and level
# descriptions), chosen by sentence-like pairs (clean.py's Rules(sentence_like=True)) per MB of
# download in a survey of all 1,850 packages of gettext_packages.txt (bookworm, 2026-11-26):
# 394.7 MB, 19.6k sentence-like pairs. The Wesnoth campaigns are small packages of pure dialogue
# (6.7k together); wesnoth-1.16-data (146 MB for 0.9k), widelands-data (381 MB for 2.3k) and
# warzone2100-data (143 MB for 0.5k) weigh their graphics, not their text, and are left to top40.
GAMES = sorted([
    "cataclysm-dda-data",  # 30 MB, 7.9k: item lore, NPC dialogue
    "freedroidrpg-data",  # 228 MB, 4.7k: dialogue
    "kgoldrunner",  # 5 MB, 0.3k: level hints
    "wesnoth-1.16-did", "wesnoth-1.16-dm", "wesnoth-1.16-dw", "wesnoth-1.16-ei", "wesnoth-1.16-httt",
    "wesnoth-1.16-l", "wesnoth-1.16-low", "wesnoth-1.16-nr", "wesnoth-1.16-sof", "wesnoth-1.16-sota",
    "wesnoth-1.16-sotbe", "wesnoth-1.16-thot", "wesnoth-1.16-trow", "wesnoth-1.16-tsg", "wesnoth-1.16-ttb",
    "wesnoth-1.16-utbs",
])

# The 40 packages that gave the most sentence-like pairs in the same survey (every package of
# gettext_packages.txt downloaded and read by this module): 1.28 GB, 47.0k sentence-like pairs
# of 113k for all 1,850 packages (4.5 GB). Mostly applications' help texts and messages.
TOP40 = sorted([
    "cairo-dock-plug-in-data", "calligrasheets-data", "cataclysm-dda-data", "claws-mail-i18n", "digikam-data",
    "dolphin-emu-data", "evolution-common", "filezilla-common", "freeciv-data", "freedroidrpg-data",
    "gcc-11-locales", "gcc-12-locales", "gimp-data", "gnucash-common", "gnumed-client", "gnumeric-common",
    "gramps", "grass-core", "inkscape", "k3b-i18n", "kicad", "kmymoney-common", "kstars-data",
    "mercurial-common", "mkvtoolnix", "php-horde-imp", "phpmyadmin", "postgresql-15", "sawfish-data",
    "siril-common", "sympa", "vlc-l10n", "warzone2100-data", "wesnoth-1.16-data", "wesnoth-1.16-httt",
    "wesnoth-1.16-nr", "wesnoth-1.16-trow", "wesnoth-1.16-utbs", "widelands-data", "zypper-common",
])

# Tags: a closing tag, or an opening one. Attributes are allowed (<span weight="bold">).
_TAG = re.compile(r"<(/?)([A-Za-z][\w.:-]*)\b[^<>]*?(/?)>")
# Tags that break a line (HTML-ish catalogs).
_BREAK = {"br", "p", "li", "div"}
# FreedroidRPG's text codes: [b]…[/b] bold, [n] [w] [r]… colours.
_FREEDROID_CODE = re.compile(r"\[/?[a-z]\]")
# Freeciv's disambiguation prefix, "?unit:Settlers" (its own msgctxt).
_QUALIFIER = re.compile(r"^\?[^:\n]+:")
_OTHER_TAG = re.compile(r"<[^<>\s][^<>]*>")
_WRAPPED = re.compile(r"^[a-zäöüß]")


class Gettext(Source):
    """gettext ``.mo`` catalogs of Debian packages, English ``msgid`` ↔ German ``msgstr``.

    Options (``params.yaml``, the source's block):

    ``packages``
        ``"games"`` (default): game packages rich in dialogue and narration (:data:`GAMES`:
        Cataclysm DDA, FreedroidRPG, KGoldrunner and the 16 Wesnoth campaigns; 395 MB of
        downloads, 19.6k sentence-like pairs). ``"top40"``: the 40 packages with the most
        sentence-like pairs (:data:`TOP40`, 1.3 GB, 47k). ``"all"``: every package of
        ``gettext_packages.txt`` beside this module (1,850 packages, 4.5 GB, 113k; mostly short
        UI strings). Or a list of Debian package names.
    """

    name = "gettext"
    licence = "per package (see /usr/share/doc/<package>/copyright)"
    description = "English msgid / German msgstr pairs from the gettext catalogs of Debian packages (games by default)"

    def __init__(self) -> None:
        self.skipped: Counter[str] = Counter()  # why units or catalogs were left out, by the last pairs()

    def packages(self, options: dict) -> list[str]:
        chosen = (options or {}).get("packages", "games")
        if chosen == "games":
            return list(GAMES)
        if chosen == "top40":
            return list(TOP40)
        if chosen == "all":
            return _listed_packages()
        if isinstance(chosen, list) and chosen and all(isinstance(n, str) and n for n in chosen):
            return sorted(set(chosen))
        raise CorpusError(f"the gettext source's option packages is {chosen!r}: set it to games, top40, all or "
                          "a list of Debian package names")

    def pairs(self, trees: dict[str, Path], options: dict, cache: Path) -> Iterator[Pair]:
        self.skipped = Counter()
        for package in sorted(trees):
            licence = package_licence(package, trees)
            for domain, path in sorted(catalogs(trees[package]).items()):
                entries = self._entries(path)
                doc = f"{self.name}:{package}/{domain}"
                for at, (msgid, msgstr) in enumerate(entries):
                    part = f"{doc}/{at // BLOCK + 1:03d}" if len(entries) > SPLIT_ABOVE else doc
                    for en, de in self._units(domain, msgid, msgstr):
                        yield Pair(de=de, en=en, source=self.name, doc=part, licence=licence)
        if self.skipped:
            log.info("gettext: left out %s", ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())))

    def _entries(self, path: Path) -> list[tuple[str, str]]:
        """(msgid, msgstr) of one catalog, sorted; [] for a catalog that cannot be read."""
        try:
            with path.open("rb") as fp:
                translations = gettext.GNUTranslations(fp)
        except (OSError, ValueError, LookupError):  # bad magic, unknown charset, unparsable header or plural rule
            self.skipped["unreadable catalogs"] += 1
            return []
        return catalog_entries(translations)

    def _units(self, domain: str, msgid: str, msgstr: str) -> list[tuple[str, str]]:
        """(en, de) text units of one entry: its lines, or the whole entry."""
        en, de = program_markup(domain, msgid, msgstr)
        en, de = strip_markup(en), strip_markup(de)
        if en is None or de is None:
            self.skipped["entries with placeholder tags"] += 1
            return []
        units = split_lines(en, de)
        if units is None:
            self.skipped["entries whose lines differ"] += 1
            return []
        return units


def catalogs(root: Path) -> dict[str, Path]:
    """{domain: German .mo file} below an unpacked package (usr/share/locale, games' own locale
    folders…); where a domain occurs twice the first locale of :data:`_LOCALES`, then the first
    path in sorted order, wins."""
    found: dict[str, tuple[int, str, Path]] = {}
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        if Path(folder) == root / "usr/share":
            dirs[:] = [d for d in dirs if d != "doc"]  # example catalogs of libraries (ruby-gettext's)
        here = Path(folder)
        if here.name != "LC_MESSAGES" or here.parent.name not in _LOCALES:
            continue
        rank = _LOCALES.index(here.parent.name)
        for file in sorted(files):
            path = here / file
            # A symlink may point outside the tree (an absolute /usr/share/… path would read this
            # machine's files); its target, if packaged, is read under its own name anyway.
            if not file.endswith(".mo") or path.is_symlink() or not path.is_file():
                continue
            domain = file[: -len(".mo")]
            mine = (rank, str(path), path)
            if domain not in found or mine[:2] < found[domain][:2]:
                found[domain] = mine
    return {domain: path for domain, (_, _, path) in found.items()}


def catalog_entries(translations: gettext.GNUTranslations) -> list[tuple[str, str]]:
    """Sorted (msgid, msgstr) of a parsed catalog: no header, no untranslated entries, contexts
    stripped, plural entries as (singular msgid, form 0) where form 0 is the singular."""
    singular_first = _plural_form(translations, 1) == 0
    out = set()
    for key, msgstr in translations._catalog.items():
        if isinstance(key, tuple):
            key, form = key
            if form != 0 or not singular_first:
                continue
        _, _, msgid = key.rpartition("\x04")  # "context\x04msgid"; a msgid holds no \x04
        if msgid and msgstr:
            out.add((msgid, msgstr))
    return sorted(out)


def program_markup(domain: str, msgid: str, msgstr: str) -> tuple[str, str]:
    """Markup that only one program's catalogs use, chosen by the domain's name."""
    if domain.startswith("freedroidrpg"):
        return _FREEDROID_CODE.sub("", msgid), _FREEDROID_CODE.sub("", msgstr)
    if domain.startswith("freeciv") and _QUALIFIER.match(msgid):
        # Freeciv's Q_() drops "?qualifier:" from the msgid, and from a msgstr that kept it.
        return _QUALIFIER.sub("", msgid), _QUALIFIER.sub("", msgstr)
    return msgid, msgstr


def strip_markup(text: str) -> str | None:
    """Text without formatting tags (line-breaking ones become newlines); None when it holds an
    unclosed tag, i.e. a placeholder such as ``<npcname>``."""
    closed = {m.group(2).lower() for m in _TAG.finditer(text) if m.group(1)}

    def replace(m: re.Match) -> str:
        slash, name, self_closing = m.group(1), m.group(2).lower(), m.group(3)
        if name in _BREAK:
            return "\n"
        if slash or self_closing or name in closed or (name.startswith("color_") and "color" in closed):
            return ""
        raise _Placeholder

    try:
        text = _TAG.sub(replace, text)
    except _Placeholder:
        return None
    return None if _OTHER_TAG.search(text) else text  # <F|f>, <->: template syntax, not text


def split_lines(en: str, de: str) -> list[tuple[str, str]] | None:
    """(en, de) units of an entry: line by line where both sides have the same number of
    non-empty lines, one joined unit where either side is a hard-wrapped paragraph (a line going
    on in lower case); None where the numbers of lines differ otherwise (lines were dropped,
    added or merged: a guess which matches which)."""
    a = [line.strip() for line in en.split("\n") if line.strip()]
    b = [line.strip() for line in de.split("\n") if line.strip()]
    if not a or not b:
        return []
    if _wrapped(a) or _wrapped(b):
        return [(" ".join(a), " ".join(b))]
    if len(a) != len(b):
        return None
    return list(zip(a, b))


def package_licence(package: str, trees: dict[str, Path]) -> str:
    """The first ``License:`` field of the package's copyright file (machine-readable format);
    a doc folder that is a link to another fetched package's (common for -data packages) is
    followed into that package's tree."""
    fallback = f"see /usr/share/doc/{package}/copyright"
    doc = trees[package] / "usr/share/doc" / package
    if doc.is_symlink():
        target = os.readlink(doc)
        if "/" in target or target not in trees:
            return fallback
        doc = trees[target] / "usr/share/doc" / target
        fallback = f"see /usr/share/doc/{target}/copyright"
    copyright = doc / "copyright"
    if copyright.is_symlink() or not copyright.is_file():
        return fallback
    # An old free-form file may have a "License:" heading with prose below it: no short name.
    found = re.search(r"^License:[ \t]*([^\n]*)", copyright.read_text(errors="replace"), re.MULTILINE)
    value = found.group(1).strip() if found else ""
    return value or fallback


def _listed_packages() -> list[str]:
    listed = Path(__file__).with_name("gettext_packages.txt")
    if not listed.is_file():
        raise CorpusError(f"{listed} is missing: restore it from the repository, or set the gettext source's "
                          "packages option to games or top40")
    lines = (line.strip() for line in listed.read_text().splitlines())
    return sorted({line for line in lines if line and not line.startswith("#")})


def _plural_form(translations: gettext.GNUTranslations, n: int) -> int | None:
    try:
        return translations.plural(n)
    except (ArithmeticError, ValueError, TypeError):  # a broken Plural-Forms expression
        return None


def _wrapped(lines: list[str]) -> bool:
    return any(_WRAPPED.match(line) for line in lines[1:])


class _Placeholder(Exception):
    """Raised inside :func:`strip_markup`'s substitution to give up on the text."""


register(Gettext())
