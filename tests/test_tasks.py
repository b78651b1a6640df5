"""Task data: the dictionary parser, splits, collate layouts, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.stages.prepare import prepare
from pipeline.tasks import TaskError, get_task
from pipeline.tasks.copy import CopyTask
from pipeline.tasks.translation_de_en import TranslationTask
from pipeline.tasks.translation_de_en.corpus.dictionary import DICT, extract_pairs

INSTALLED = Path("/") / DICT  # make setup installs dict-de-en

DICT_SNIPPET = """Abbruch
 {m}
   demolition
Ich habe am ursprünglichen Entwurf ein paar Änderungen vorgenommen.

   I’ve made one or two modifications to the original design.
Wenn man Sukkulenten als reine Wüstenpflanzen sieht, scheint es paradox,
dass sie in kalten Klimazonen wachsen.

   If you see succulents as pure desert plants, it seems paradoxical that
they grow in cold climates.
Da ist noch Abhilfe möglich.

   He / It is not without remedy.
Sie sah ihn argwöhnisch an.

   She looked at him suspiciously.; She eyed him.
Wir betrachten es als große Ehre, Sie heute abend hier bei uns zu haben.

   We consider it a great honor to have you here with us tonight.
Betrachten Sie sich als entlassen.

   Consider yourself fired.
""".split("\n")


def test_extract_pairs_handles_wrapping_alternatives_and_annotations():
    pairs = extract_pairs(DICT_SNIPPET)
    assert pairs == [
        ("Ich habe am ursprünglichen Entwurf ein paar Änderungen vorgenommen.",
         "I've made one or two modifications to the original design."),
        ("Wenn man Sukkulenten als reine Wüstenpflanzen sieht, scheint es paradox, dass sie in kalten "
         "Klimazonen wachsen.",
         "If you see succulents as pure desert plants, it seems paradoxical that they grow in cold climates."),
        ("Sie sah ihn argwöhnisch an.", "She looked at him suspiciously."),
        ("Wir betrachten es als große Ehre, Sie heute abend hier bei uns zu haben.",
         "We consider it a great honor to have you here with us tonight."),
        ("Betrachten Sie sich als entlassen.", "Consider yourself fired."),
    ]


def test_translation_collate_shifts_targets():
    batch = TranslationTask().collate([{"src": [5, 6, 2], "tgt": [7, 8]}, {"src": [9, 2], "tgt": [4]}])
    assert batch["src"].tolist() == [[5, 6, 2], [9, 2, 0]]
    assert batch["src_len"].tolist() == [3, 2]
    assert batch["tgt_in"].tolist() == [[1, 7, 8], [1, 4, 0]]
    assert batch["tgt_out"].tolist() == [[7, 8, 2], [4, 2, 0]]


def test_copy_collate_layout():
    seq = torch.tensor([[1, 0], [0, 1], [1, 1]], dtype=torch.uint8)
    batch = CopyTask().collate([seq, seq[:1]])
    assert batch["x"].shape == (2, 7, 3)
    assert batch["x"][0, 3].tolist() == [0, 0, 1]  # delimiter channel after the sequence
    assert batch["x"][0, 4:].abs().sum() == 0  # blanks during recall
    assert batch["y"][0, 4:].tolist() == seq.float().tolist()
    assert batch["mask"].tolist() == [[0, 0, 0, 0, 1, 1, 1], [0, 0, 1, 0, 0, 0, 0]]


def test_copy_prepare_is_deterministic(tmp_path):
    params = {"seed": 3, "bits": 4, "min_len": 1, "max_len": 5, "train_size": 50, "val_size": 10,
              "test_size": 8, "test_lengths": [5, 10]}
    a = prepare("copy", params, tmp_path / "a")
    b = prepare("copy", params, tmp_path / "b")
    assert a["files"] == b["files"]
    # The manifest is a function of the data alone, so an unchanged re-run keeps DVC's hash.
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (tmp_path / "b" / "manifest.json").read_bytes()
    c = prepare("copy", {**params, "seed": 4}, tmp_path / "c")
    assert c["files"]["train.pt"] != a["files"]["train.pt"]
    test10 = CopyTask().load(tmp_path / "a", "test_10")
    assert len(test10) == 8 and all(s.shape == (10, 4) for s in test10)
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["model_defaults"] == {
        "input_size": 5, "output_size": 4}


def test_failed_prepare_keeps_earlier_output(tmp_path, monkeypatch):
    params = {"seed": 3, "bits": 4, "min_len": 1, "max_len": 5, "train_size": 5, "val_size": 2,
              "test_size": 2, "test_lengths": [5]}
    prepare("copy", params, tmp_path / "copy")
    before = (tmp_path / "copy" / "manifest.json").read_text()

    def broken(self, params, out):
        raise TaskError("boom")

    monkeypatch.setattr(CopyTask, "prepare", broken)
    with pytest.raises(TaskError):
        prepare("copy", params, tmp_path / "copy")
    assert (tmp_path / "copy" / "manifest.json").read_text() == before


def test_sort_targets_order_the_values(tmp_path):
    params = {"seed": 5, "min_n": 3, "max_n": 6, "train_size": 40, "val_size": 4, "test_size": 5, "test_n": [4, 8]}
    prepare("sort", params, tmp_path)
    task = get_task("sort")
    for item in task.load(tmp_path, "train") + task.load(tmp_path, "test_8"):
        values, target = item["points"][:, 0], item["target"].tolist()
        assert target[-1] == 0 and sorted(target[:-1]) == list(range(1, len(values) + 1))
        assert torch.all(values[torch.tensor(target[:-1]) - 1].diff() >= 0)
    assert {len(i["points"]) for i in task.load(tmp_path, "test_8")} == {8}
    batch = task.collate(task.load(tmp_path, "test_4")[:2] + task.load(tmp_path, "test_8")[:1])
    assert batch["src"].shape == (3, 8, 1) and batch["src_len"].tolist() == [4, 4, 8]
    assert batch["tgt"][0, 5:].tolist() == [-100] * 4  # 4 pointers + END, then padding


def test_convex_hull_matches_a_brute_force_hull():
    import numpy as np

    from pipeline.tasks.convex_hull import ConvexHullTask

    rng = np.random.default_rng(0)
    for _ in range(200):
        points, target = ConvexHullTask().generate(rng, int(rng.integers(3, 12)))
        idx = [t - 1 for t in target]
        # Brute force: i -> j is a counter-clockwise hull edge iff every other point lies to its left.
        edges = set()
        for i in range(len(points)):
            for j in range(len(points)):
                if i != j:
                    d = points[j] - points[i]
                    rel = points - points[i]
                    cross = d[0] * rel[:, 1] - d[1] * rel[:, 0]
                    cross[[i, j]] = 1.0
                    if (cross > 0).all():
                        edges.add((i, j))
        assert points[idx[0], 0] == points[:, 0].min()  # canonical start: the leftmost point
        assert set(zip(idx, idx[1:] + idx[:1])) == edges


def test_parity_labels_count_the_plus_ones():
    import numpy as np

    from pipeline.tasks.parity import make_split

    split = make_split(np.random.default_rng(1), 500, 16)
    x, y, k = split["x"], split["y"], split["k"]
    assert set(x.unique().tolist()) == {-1, 0, 1}
    assert torch.equal((x != 0).sum(1), k) and int(k.min()) >= 1 and int(k.max()) <= 16
    assert torch.equal(y, (x == 1).sum(1) % 2)
    assert 0.4 < float(y.float().mean()) < 0.6


def test_table_qa_answers_follow_the_question():
    import numpy as np

    from pipeline.tasks.table_qa import KINDS, WORDS, make_example

    rng = np.random.default_rng(2)
    for i in range(300):
        kind = list(KINDS)[i % len(KINDS)]
        ex = make_example(rng, int(rng.integers(5, 11)), kind)
        words = [WORDS[t] for t in ex["question"]]
        names = [WORDS[t] for t in ex["columns"]]
        table = ex["table"]
        # Reference: read the question's words, not the generator's choices.
        rows = np.ones(len(table), bool)
        if "greater" in words or "lesser" in words:
            b = names.index(words[words.index("than") - 2])
            rows = table[:, b] > ex["pivot"] if "greater" in words else table[:, b] < ex["pivot"]
        assert rows.any()  # filters always select a row
        if words[0] == "how":
            assert ex["answer"] == rows.sum() and not ex["is_lookup"]
        elif words[0] == "sum":
            assert ex["answer"] == table[rows, names.index(words[2])].sum()
        else:
            a = names.index(words[1])
            picked = np.flatnonzero(rows)
            picked = picked[:1] if words[0] == "first" else picked[-1:] if words[0] == "last" else picked
            expected = np.zeros_like(table)
            expected[picked, a] = 1
            assert ex["is_lookup"] and np.array_equal(ex["cells"], expected)


def test_unknown_task():
    with pytest.raises(TaskError, match="unknown task"):
        get_task("nope")


@pytest.mark.skipif(not INSTALLED.exists(), reason="needs Debian dict-de-en (make setup installs it)")
def test_real_dictionary_yields_enough_sentence_pairs(tmp_path):
    from pipeline.tasks.translation_de_en.corpus import get_source

    pairs = [(p.de, p.en) for p in get_source("dictionary").pairs({"dict-de-en": Path("/")}, {}, tmp_path)]
    assert len(set(pairs)) > 15000
    assert all(de[-1] in ".?!" and en[-1] in ".?!" for de, en in pairs)
