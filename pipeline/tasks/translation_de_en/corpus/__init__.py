"""Parallel text for translation tasks: sources that yield aligned pairs, one module per source.

A *source* turns fetched Debian packages (or a file of the user's) into raw aligned text units:
``Pair(de, en, source, doc, licence)``. ``build`` in :mod:`pipeline.tasks.translation_de_en.corpus.build` cleans them
(:mod:`pipeline.tasks.translation_de_en.corpus.clean`), splits agreeing paragraphs into sentences, deduplicates across
sources and package versions, and splits by document so near-duplicates cannot leak from
training into validation or test. Nothing here imports torch: the translation task tokenises.

Every source module registers one :class:`Source`; ``params.yaml``
``tasks.translation_de_en.sources`` turns each on or off by name.
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class CorpusError(RuntimeError):
    """A corpus cannot be built; the message names the fix (one sentence)."""


@dataclass(frozen=True)
class Pair:
    de: str  # source-language side (German for the default corpus)
    en: str  # target-language side
    source: str  # the Source's name, e.g. "libreoffice"
    doc: str  # the document it came from ("libreoffice:text/swriter/guide/x.xhp"): the split unit
    licence: str  # of the package it came from, e.g. "MPL-2.0"


class Source(ABC):
    """One origin of aligned text. Subclasses set ``name``/``licence`` and implement ``pairs`` (and
    ``packages`` / ``versions`` when they read any)."""

    name: str = ""
    licence: str = ""
    description: str = ""  # one line for the manifest and the model card

    def packages(self, options: dict) -> list[str]:
        """Debian binary packages to fetch (``apt-get download``); ``options`` is the source's own
        ``params.yaml`` block (``{}`` when it is just switched on)."""
        return []

    @abstractmethod
    def pairs(self, trees: dict[str, Path], options: dict, cache: Path) -> Iterator[Pair]:
        """Aligned text units found in the extracted packages: ``trees[package]`` is the root of its
        unpacked file system. Units may be paragraphs (cleaned and split later) and may still carry
        inline markup the source knows how to strip. ``cache`` is a folder the source may use for
        what it downloads itself (DDTP's translation indexes)."""

    def versions(self, options: dict, cache: Path) -> dict[str, str]:
        """What the source read besides packages (e.g. index files and their hashes), for the
        manifest; packages' versions are recorded by the fetcher."""
        return {}


SOURCES: dict[str, Source] = {}


def register(source: Source) -> Source:
    SOURCES[source.name] = source
    return source


def get_source(name: str) -> Source:
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("build", "clean", "debian"):
            importlib.import_module(f"{__name__}.{info.name}")
    if name not in SOURCES:
        raise CorpusError(f"unknown corpus source '{name}'; known sources: {', '.join(sorted(SOURCES))}")
    return SOURCES[name]
