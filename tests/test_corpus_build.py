"""The corpus builder (pipeline.tasks.translation_de_en.corpus): cleaning, the document split and its leak
guard, a user's own corpus through the translation task, and the errors a user can meet."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from pipeline.stages.prepare import prepare
from pipeline.tasks import TaskError, get_task
from pipeline.tasks.translation_de_en.corpus import CorpusError, Pair
from pipeline.tasks.translation_de_en.corpus.build import clean_all, read_file_corpus, split_by_document
from pipeline.tasks.translation_de_en.corpus.clean import Rules, clean_pair, normalise, sentence_pairs, sentences
from pipeline.tasks.translation_de_en.corpus.debian import fetch


def test_normalise_strips_markup_entities_and_accelerators_but_not_words():
    assert normalise("Klicken Sie auf <b>_Datei</b> &amp; dann &Speichern") == "Klicken Sie auf Datei & dann Speichern"
    assert normalise("a && b ~/.config  x_y") == "a && b ~/.config x_y"
    assert normalise("Trenn\u00adung\u200b hier") == "Trenn ung hier"  # format characters become spaces
    assert normalise("Joe <joe@example.com> &lt;b&gt; a < b > c") == "Joe <joe@example.com> <b> a < b > c"


def test_clean_pair_rules():
    rules = Rules()
    assert clean_pair("Öffnen Sie die Datei jetzt.", "Open the file now.", rules) == \
        ("Öffnen Sie die Datei jetzt.", "Open the file now.")
    assert clean_pair("Datei %s wurde gelöscht.", "File %s was deleted.", rules) is None  # placeholder
    assert clean_pair("Fenster {0} schließen jetzt", "Close window {0} now", rules) is None
    assert clean_pair("GNU Image Manipulation Program", "GNU Image Manipulation Program", rules) is None  # untranslated
    assert clean_pair("Ja bitte", "Yes please", rules) is None  # under 3 words
    assert clean_pair("Ein zwei drei", "one two three four five six seven eight", rules) is None  # ratio 2.67
    assert clean_pair("eine kleine Liste hier", "a small list here", Rules(sentence_like=True)) is None
    assert clean_pair("Eine kleine Liste hier.", "A small list here.", Rules(sentence_like=True)) == \
        ("Eine kleine Liste hier.", "A small list here.")


def test_sentences_split_where_both_sides_agree_and_not_after_abbreviations():
    assert sentences("Wählen Sie z. B. Datei. Dann klicken Sie auf OK.") == [
        "Wählen Sie z. B. Datei.", "Dann klicken Sie auf OK."]
    assert sentence_pairs("Eins ist gut. Zwei ist besser.", "One is good. Two is better.") == [
        ("Eins ist gut.", "One is good."), ("Zwei ist besser.", "Two is better.")]
    # 2 German sentences against 1 English: the paragraph stays whole
    assert sentence_pairs("Eins. Zwei.", "One and two.") == [("Eins. Zwei.", "One and two.")]


def _pairs(docs: int, per_doc: int, source: str = "s") -> list[Pair]:
    return [Pair(f"Satz {d} Nummer {i} hier.", f"Sentence {d} number {i} here.", source, f"{source}:{d}", "MIT")
            for d in range(docs) for i in range(per_doc)]


def test_document_split_keeps_documents_whole_and_drops_leaks():
    pairs = _pairs(40, 5)
    # the same English sentence in two documents: wherever the first lands held out, the copy must not train
    pairs.append(Pair("Ein anderer Satz hier.", "Sentence 0 number 0 here.", "s", "s:dup", "MIT"))
    split, facts = split_by_document(pairs, seed=1, val_size=20, test_size=20, max_doc_share=0.25)
    docs = {s: {p.doc for p in rows} for s, rows in split.items()}
    assert not (docs["train"] & docs["test"]) and not (docs["train"] & docs["val"]) and not (docs["val"] & docs["test"])
    assert len(split["test"]) == 20 and len(split["val"]) == 20  # 4 documents of 5 each
    held = {p.en for s in ("val", "test") for p in split[s]}
    assert not any(p.en in held for p in split["train"])
    assert sum(facts["leak_dropped"].values()) == (1 if "Sentence 0 number 0 here." in held else 0)
    again, _ = split_by_document(pairs, seed=1, val_size=20, test_size=20, max_doc_share=0.25)
    assert again == split  # deterministic
    with pytest.raises(CorpusError, match="too few documents"):
        split_by_document(_pairs(3, 5), seed=1, val_size=20, test_size=20, max_doc_share=0.25)


def test_big_documents_always_train():
    pairs = _pairs(30, 2) + _pairs(1, 50, source="big")
    split, _ = split_by_document(pairs, seed=0, val_size=10, test_size=10, max_doc_share=0.5)
    assert all(p.source == "s" for s in ("val", "test") for p in split[s])
    assert sum(p.source == "big" for p in split["train"]) == 50


def test_clean_all_deduplicates_across_sources_keeping_the_first():
    a = Pair("Öffnen Sie die Datei.", "Open the file.", "first", "first:1", "MIT")
    b = Pair("öffnen sie die Datei", "Open the file!", "second", "second:1", "GPL")  # same after folding
    kept, clean, dupes = clean_all([a, b], Rules())
    assert [p.source for p in kept] == ["first"] and clean == {"first": 1, "second": 1} and dupes == {"second": 1}


def _tsv(path, rows: int, header: str = "source\ttarget\tdoc"):
    adjectives = ["rot", "blau", "grün", "groß", "klein", "alt", "neu", "schnell", "langsam", "hell"]
    english = ["red", "blue", "green", "big", "small", "old", "new", "fast", "slow", "bright"]
    lines = [header] + [f"Das Haus Nummer {i} ist sehr {adjectives[i % 10]}.\tHouse number {i} is very "
                        f"{english[i % 10]}.\tstreet{i // 4}" for i in range(rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _houses(tmp_path, monkeypatch) -> tuple:
    """A user's corpus of 400 house pairs as its own task, ``houses`` (``like: translation_de_en``): the file
    and the task's params.yaml block."""
    import pipeline.config

    corpus = tmp_path / "pairs.tsv"
    _tsv(corpus, 400)
    params = {"seed": 3, "vocab_size": 300, "corpus": str(corpus), "val_size": 40, "test_size": 40,
              "max_doc_share": 0.2, "clean": {"min_words": 3, "max_words": 40}}
    real = pipeline.config.load_params()
    monkeypatch.setattr(pipeline.config, "load_params", lambda root=None: {**real, "tasks": {"houses": {
        "like": "translation_de_en", **params}}})
    return corpus, params


def test_own_corpus_under_a_task_of_its_own(tmp_path, monkeypatch):
    """``tasks.houses: {like: translation_de_en, corpus: pairs.tsv}``: the translation task's code
    prepares, loads and batches the user's pairs; the same file gives the same bytes twice."""

    corpus, params = _houses(tmp_path, monkeypatch)
    manifest = prepare("houses", params, tmp_path / "houses")
    assert manifest["task"] == "houses" and manifest["pairs"] == {"train": 320, "val": 40, "test": 40}
    assert manifest["sources"]["file"]["units"] == 400 and manifest["documents"]["test"] == 10
    task = get_task("houses")
    assert task.name == "houses" and get_task("translation_de_en").name == "translation_de_en"
    items = task.load(tmp_path / "houses", "test")
    assert len(items) == 40 and {it["source"] for it in items} == {"file"}
    batch = task.collate(items[:4])
    assert batch["src"].shape[0] == 4 and (batch["src_len"] > 2).all()
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "houses" / "spm.en.model"))
    assert sp.decode(items[0]["tgt"]) == items[0]["tgt_text"]
    again = prepare("houses", params, tmp_path / "again")
    assert again["files"] == manifest["files"]  # deterministic output for the same input
    assert not (tmp_path / "houses" / "test_dict.pt").exists()  # the dictionary check is for the default corpus


def test_own_corpus_errors_name_the_fix(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("de\ten\nHallo Welt hier\tHello world here\n")
    with pytest.raises(CorpusError, match="needs columns 'source' and 'target'"):
        read_file_corpus(bad)
    with pytest.raises(CorpusError, match="does not exist"):
        read_file_corpus(tmp_path / "absent.tsv")
    params = {"seed": 3, "vocab_size": 300, "corpus": str(bad), "val_size": 4, "test_size": 4}
    prepare_dir = tmp_path / "t"
    prepare_dir.mkdir()
    (prepare_dir / "manifest.json").write_text(json.dumps({"earlier": True}))
    with pytest.raises(TaskError, match="source' and 'target'"):
        prepare("translation_de_en", params, prepare_dir)
    assert json.loads((prepare_dir / "manifest.json").read_text()) == {"earlier": True}  # untouched


@pytest.mark.integration
def test_a_package_that_cannot_be_fetched_is_named_with_the_way_out(tmp_path):
    with pytest.raises(CorpusError, match=r"attnzoo-no-such-package could not be fetched .*turn its source off"):
        fetch(["attnzoo-no-such-package"], tmp_path, progress=False)


def _fake_deb(folder: Path, file_name: str) -> Path:
    """A real .deb (dpkg-deb --build) under a name apt would give another package's file."""
    tree = folder / "tree"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text("Package: coreutils\nVersion: 0\nArchitecture: all\n"
                                             "Maintainer: x <x@example.org>\nDescription: planted\n")
    (tree / "usr" / "share").mkdir(parents=True)
    (tree / "usr" / "share" / "planted").write_text("not the package apt lists\n")
    debs = folder / "cache" / "debs"
    debs.mkdir(parents=True)
    subprocess.run(["dpkg-deb", "--build", str(tree), str(debs / file_name)], check=True, capture_output=True)
    return folder / "cache"


@pytest.mark.integration
def test_a_cached_deb_that_differs_from_apts_index_is_refused(tmp_path):
    """The cache is not trusted: a .deb under the name of the version apt lists, but with other
    bytes, is refused before it is unpacked (it was used as it was)."""
    shown = subprocess.run(["apt-cache", "show", "--no-all-versions", "coreutils"], capture_output=True, text=True)
    version = re.search(r"^Version: (\S+)$", shown.stdout, re.M)[1]
    cache = _fake_deb(tmp_path, f"coreutils_{version.replace(':', '%3a')}_amd64.deb")
    with pytest.raises(CorpusError, match="differs from the SHA-256 apt's package index records"):
        fetch(["coreutils"], cache, progress=False)
    assert not list((cache / "trees").iterdir())  # nothing unpacked


@pytest.mark.integration
def test_a_version_from_a_file_name_never_leaves_the_cache(tmp_path):
    """apt's file names are URL-quoted; a planted name whose version unquotes to a path is refused
    before anything is deleted or unpacked (it was joined into a path that was rmtree'd)."""
    outside = tmp_path / "cache" / "outside"
    cache = _fake_deb(tmp_path, "coreutils_..%2f..%2f..%2foutside_amd64.deb")  # trees/coreutils_../../../outside
    (cache / "trees" / "coreutils_..").mkdir(parents=True)
    outside.mkdir()
    (outside / "keep").write_text("mine")
    with pytest.raises(CorpusError, match="is not named as apt names a package"):
        fetch(["coreutils"], cache, progress=False)
    assert (outside / "keep").read_text() == "mine"


@pytest.mark.integration
def test_an_unpacked_tree_changed_in_the_cache_is_unpacked_again(tmp_path):
    """An unpacked tree is not trusted on its marker (the .deb's digest) alone: if it were, a file
    edited in the tree, or one planted there, would be read by the next build. The next fetch finds
    the change and unpacks the (verified) .deb again: edited file restored, planted file gone."""
    cache = tmp_path / "cache"
    _, tree = fetch(["coreutils"], cache, progress=False)["coreutils"]
    copyright_file = tree / "usr/share/doc/coreutils/copyright"
    original = copyright_file.read_bytes()
    copyright_file.write_bytes(original + b"\nplanted\n")
    (tree / "usr/share/planted.po").write_text("msgid \"x\"\nmsgstr \"y\"\n")
    _, again = fetch(["coreutils"], cache, progress=False)["coreutils"]
    assert again == tree and copyright_file.read_bytes() == original
    assert not (tree / "usr/share/planted.po").exists()


def test_package_versions_leave_the_prepared_data_as_it_was_and_a_changed_corpus_is_reported(tmp_path, monkeypatch):
    """The packages' versions and download sizes go to the provenance file, not the manifest: the same pairs
    from newer packages are the same prepared bytes (nothing retrains). Different pairs are reported as
    prepare prints them: the packages that changed, and the pairs added and removed, per split."""
    from pipeline.stages.prepare import changes, package_changes
    from pipeline.tasks.translation_de_en.corpus import build as corpus_build

    corpus, params = _houses(tmp_path, monkeypatch)
    file_corpus = corpus_build.collect

    def from_packages(version: str):  # the user's file standing in for a package of that version
        def collect(options, cache, progress=True):
            pairs, info, _ = file_corpus(options, cache, progress)
            return pairs, info, {"file": {"packages": {"houses-de": version}, "download_bytes": 1000}}
        return collect

    runs = {}
    for name, version in (("old", "1.0-1"), ("new", "1.0-2")):
        monkeypatch.setattr(corpus_build, "collect", from_packages(version))
        runs[name] = prepare("houses", params, tmp_path / name, tmp_path / f"{name}.provenance.json")
    assert runs["old"] == runs["new"] and "provenance" not in runs["new"]
    assert (tmp_path / "old" / "manifest.json").read_bytes() == (tmp_path / "new" / "manifest.json").read_bytes()
    origin = {n: json.loads((tmp_path / f"{n}.provenance.json").read_text()) for n in runs}
    assert origin["new"] == {"sources": {"file": {"packages": {"houses-de": "1.0-2"}, "download_bytes": 1000}},
                             "download_bytes": 1000}
    assert package_changes(origin["old"], origin["new"]) == ["houses-de 1.0-1 → 1.0-2"]
    before = {p.name: p for p in (tmp_path / "old").iterdir()}
    same = changes("houses", runs["new"], before, tmp_path / "new", origin["old"], origin["new"])
    assert same == ["houses: the same data as dvc.lock records; nothing downstream retrains",
                    "packages: houses-de 1.0-1 → 1.0-2"]
    # The next version translates 20 more houses: 20 pairs added, none removed.
    _tsv(corpus, 420)
    monkeypatch.setattr(corpus_build, "collect", from_packages("1.1-1"))
    grown = prepare("houses", params, tmp_path / "grown", tmp_path / "grown.provenance.json")
    lines = changes("houses", grown, before, tmp_path / "grown", origin["new"],
                    json.loads((tmp_path / "grown.provenance.json").read_text()))
    assert lines[:2] == ["houses: the prepared data differs from what dvc.lock records, so its models retrain "
                         "(docs/troubleshooting.md)", "packages: houses-de 1.0-2 → 1.1-1"]
    assert sum(grown["pairs"].values()) - sum(runs["old"]["pairs"].values()) == 20
    assert re.fullmatch(r"pairs: \+20 added, −0 removed; by split, moves between them included: "
                        r"test \+\d+ −\d+, train \+\d+ −\d+, val \+\d+ −\d+", lines[2]), lines[2]
    # Without the recorded data in the cache only the packages can be compared; a first record is counted.
    assert changes("houses", grown, None, tmp_path / "grown", origin["new"], origin["new"]) == []
    assert changes("houses", grown, None, tmp_path / "grown", {}, origin["new"]) == [
        "houses: the data dvc.lock records is not in this DVC cache to compare with",
        "packages: 1 recorded in data/provenance/houses.json, none before to compare with"]
