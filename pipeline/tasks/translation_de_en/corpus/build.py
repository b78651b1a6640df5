"""Build a split parallel corpus: fetch → align (each source) → clean → sentence-split →
deduplicate → split by document → leak guard.

Deterministic for the same packages and options: sources yield in a fixed order, duplicates keep
their first occurrence in source order, documents are shuffled with the task's seed. The manifest
records, per source, the packages and versions read and the count left after each step, so a
change in any number points at the step that made it.
"""

from __future__ import annotations

import csv
import random
from collections import Counter, defaultdict
from pathlib import Path

from pipeline.tasks.translation_de_en.corpus import CorpusError, Pair, get_source
from pipeline.tasks.translation_de_en.corpus.clean import Rules, clean_pair, key, sentence_pairs
from pipeline.tasks.translation_de_en.corpus.debian import download_bytes, fetch

SPLITS = ("train", "val", "test")


def enabled_sources(switches: dict) -> list[tuple[str, dict]]:
    """``sources`` of params.yaml, in its order: ``name: true`` / ``false`` / ``{options}``."""
    out = []
    for name, value in (switches or {}).items():
        if value is False or value is None:
            continue
        out.append((name, value if isinstance(value, dict) else {}))
    return out


def read_file_corpus(path: Path) -> list[Pair]:
    """A user's pairs: TSV (header row ``source<TAB>target``, optional ``doc``, ``licence``) or Parquet
    with the same columns. Without a ``doc`` column each row is its own document."""
    if not path.exists():
        raise CorpusError(f"corpus file {path} does not exist: set tasks.<task>.corpus to a TSV or Parquet file "
                          "with columns source and target")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        with path.open(encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows or not {"source", "target"} <= set(rows[0]):
        found = ", ".join(rows[0]) if rows else "no rows"
        raise CorpusError(f"{path} needs columns 'source' and 'target' (found: {found}): add a header row "
                          "'source<TAB>target'")
    return [Pair(str(r["source"] or ""), str(r["target"] or ""), "file", f"file:{r.get('doc') or i}",
                 str(r.get("licence") or "not stated")) for i, r in enumerate(rows)]


def collect(options: dict, cache: Path, progress: bool = True) -> tuple[list[Pair], dict, dict]:
    """Every enabled source's raw units, the manifest's ``sources`` block (what each is, its units) and each
    source's provenance (its packages and their versions, the index files it read, the bytes downloaded)."""
    if options.get("corpus"):
        pairs = read_file_corpus(Path(options["corpus"]))
        return pairs, {"file": {"path": str(options["corpus"]), "units": len(pairs)}}, {}
    chosen = enabled_sources(options.get("sources"))
    if not chosen:
        raise CorpusError("no corpus source is switched on: set tasks.<task>.sources (e.g. libreoffice: true) "
                          "or tasks.<task>.corpus to a file of pairs")
    sources = [(get_source(name), opts) for name, opts in chosen]
    names = sorted({p for s, opts in sources for p in s.packages(opts)})
    fetched = fetch(names, cache, progress=progress) if names else {}
    trees = {n: tree for n, (_, tree) in fetched.items()}
    pairs, info, provenance = [], {}, {}
    for source, opts in sources:
        own = source.packages(opts)
        units = list(source.pairs({n: trees[n] for n in own}, opts, cache))
        pairs += units
        info[source.name] = {"description": source.description, "licence": source.licence, "units": len(units)}
        provenance[source.name] = {"packages": {n: fetched[n][0] for n in own},
                                   "download_bytes": download_bytes(cache, own), **source.versions(opts, cache)}
    return pairs, info, provenance


def clean_all(pairs: list[Pair], rules: Rules) -> tuple[list[Pair], Counter, Counter]:
    """Sentence-split, clean and deduplicate; returns kept pairs and per-source counts
    (clean sentences, duplicates dropped)."""
    kept, seen = [], set()
    clean, dupes = Counter(), Counter()
    for p in pairs:
        for de, en in sentence_pairs(p.de, p.en):
            got = clean_pair(de, en, rules)
            if got is None:
                continue
            clean[p.source] += 1
            k = (key(got[0]), key(got[1]))
            if k in seen:
                dupes[p.source] += 1
                continue
            seen.add(k)
            kept.append(Pair(got[0], got[1], p.source, p.doc, p.licence))
    return kept, clean, dupes


def split_by_document(pairs: list[Pair], seed: int, val_size: int, test_size: int,
                      max_doc_share: float = 0.05) -> tuple[dict[str, list[Pair]], dict]:
    """Whole documents go to test, then validation, until each holds its size; the rest trains.

    A document larger than ``max_doc_share`` of a held-out set always trains, so no single manual
    or game dominates what the test measures. Then the leak guard: a training (or validation) pair
    whose English or German side equals a held-out one (case and punctuation folded) is dropped,
    since the same sentence recurs across documents (boilerplate, shared UI strings).
    """
    by_doc: dict[str, list[Pair]] = defaultdict(list)
    for p in pairs:
        by_doc[p.doc].append(p)
    docs = sorted(by_doc)
    random.Random(seed).shuffle(docs)
    out = {s: [] for s in SPLITS}
    for doc in docs:
        rows = by_doc[doc]
        name = "train"
        for held, size in (("test", test_size), ("val", val_size)):
            if len(out[held]) < size and len(rows) <= max(1, int(max_doc_share * size)):
                name = held
                break
        out[name] += rows
    leaked = {}
    for name, guards in (("val", ("test",)), ("train", ("test", "val"))):
        sides = {key(x) for g in guards for p in out[g] for x in (p.de, p.en)}
        before = len(out[name])
        out[name] = [p for p in out[name] if key(p.de) not in sides and key(p.en) not in sides]
        leaked[name] = before - len(out[name])
    short = [s for s, size in (("test", test_size), ("val", val_size)) if len(out[s]) < size]
    if short:
        raise CorpusError(f"the corpus has too few documents for {' and '.join(short)} sets of the sizes asked "
                          f"({len(pairs)} pairs in {len(by_doc)} documents): lower val_size/test_size or switch "
                          "more sources on")
    return out, {"documents": {s: len({p.doc for p in out[s]}) for s in SPLITS}, "leak_dropped": leaked}


def build(options: dict, cache: Path, progress: bool = True) -> tuple[dict[str, list[Pair]], dict]:
    """The split corpus and its manifest facts, the sources' provenance among them (``provenance``: the prepare
    stage keeps it out of the prepared data, whose identity is the pairs'). ``options``: the task's params.yaml
    block."""
    raw, sources, provenance = collect(options, cache, progress)
    kept, clean, dupes = clean_all(raw, Rules.of(options.get("clean")))
    split, facts = split_by_document(kept, options["seed"], options["val_size"], options["test_size"],
                                     options.get("max_doc_share", 0.05))
    for name, info in sources.items():
        info.update(clean=clean[name], duplicates=dupes[name],
                    **{s: sum(p.source == name for p in split[s]) for s in SPLITS})
    total = sum(info.get("download_bytes", 0) for info in provenance.values())
    return split, {"sources": sources, **facts, "pairs": {s: len(split[s]) for s in SPLITS},
                   "provenance": {"sources": provenance, "download_bytes": total}}
