"""examples/ (scripts/make_examples.py): every file reads through the readers `attnzoo predict` uses
at the inputs its served model declares, the script remakes every file as committed (`--check`), and
its test items are the ones the tasks' own prepare + load give (on small splits)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import make_examples
import numpy as np
import pytest
import torch

import models
from pipeline.config import load_params
from tests.conftest import ROOT

EXAMPLES = ROOT / "examples"


def served_inputs() -> dict[str, tuple[str, list[dict]]]:
    """file -> (a served model that takes it, its inputs as `GET /v2/models/<model>` declares them): the
    fixed sizes are those the published models are built with (task parameters, model configs)."""
    from pipeline.tasks.common.mnist import CELL
    from pipeline.tasks.convex_hull import ConvexHullTask
    from pipeline.tasks.sort import SortTask

    params = load_params(ROOT)
    tasks = params["tasks"]
    draw = models.make_config("draw", {"image_size": CELL, **params["models"]["draw"].get("model", {})})

    def spec(name, datatype, *shape):
        return {"name": name, "datatype": datatype, "shape": list(shape)}

    caption_side = tasks["mnist_captions"]["grid"] * CELL
    return {
        "translation_de_en.txt": ("bahdanau", [spec("text", "BYTES", -1)]),
        "copy.json": ("ntm", [spec("x", "FP32", -1, -1, tasks["copy"]["bits"] + 1)]),
        "repeat_copy.json": ("ntm_repeat_copy", [spec("x", "FP32", -1, -1, tasks["repeat_copy"]["bits"] + 2)]),
        "associative_recall.json": ("ntm_recall", [spec("x", "FP32", -1, -1, tasks["associative_recall"]["bits"] + 2)]),
        "sort.json": ("pointer_sort", [spec("points", "FP32", -1, -1, SortTask.point_size)]),
        "convex_hull.json": ("pointer_hull", [spec("points", "FP32", -1, -1, ConvexHullTask.point_size)]),
        "parity.json": ("act_parity", [spec("x", "FP32", -1, tasks["parity"]["bits"])]),
        "table_qa.json": ("neural_programmer", [spec("question", "BYTES", -1), spec("columns", "BYTES", -1, -1),
                                                spec("table", "FP32", -1, -1, -1)]),
        "mnist_captions.png": ("sat_soft", [spec("image", "FP32", -1, caption_side, caption_side)]),
        "mnist_translated60.png": ("ram", [spec("image", "FP32", -1, *[tasks["mnist_translated60"]["canvas"]] * 2)]),
        "mnist_cluttered60.png": ("ram_cluttered",
                                  [spec("image", "FP32", -1, *[tasks["mnist_cluttered60"]["canvas"]] * 2)]),
        "mnist_binarized.json": ("draw", [spec("x", "FP32", -1, -1, draw.latent)]),
        "ocr_words.png": ("attention_ocr", [spec("image", "FP32", -1, tasks["ocr_words"]["height"], -1),
                                            spec("width", "INT64", -1)]),
        "spoken_digits.wav": ("speech_location", [spec("audio", "FP32", -1, -1), spec("samples", "INT64", -1)]),
    }


def test_examples_folder_holds_the_files_and_their_table():
    expected = served_inputs()
    assert sorted(p.name for p in EXAMPLES.iterdir()) == sorted([*expected, "README.md"])
    table = (EXAMPLES / "README.md").read_text()
    assert "python scripts/make_examples.py" in table
    for name in expected:
        size = (EXAMPLES / name).stat().st_size
        assert 0 < size < 100_000, (name, size)
        assert f"| [`{name}`]({name}) |" in table, name


class _Recorder:
    """A client that records what `predict` would send and answers with placeholders."""

    def __init__(self):
        self.inputs = None

    def infer(self, name, inputs, version=None, outputs=None, parameters=None, **_):
        self.inputs = inputs
        return {"text": np.array(["?"], dtype=object), "caption": np.array(["?"], dtype=object),
                "pred": np.array([0])}


@pytest.mark.parametrize("name", sorted(served_inputs()))
def test_example_reads_through_the_predict_readers_at_the_declared_inputs(name):
    from serving.client import as_tensor
    from serving.predict import predict_one
    from serving.protocol import DATATYPES

    model, declared = served_inputs()[name]
    path = str(EXAMPLES / name)
    if name.endswith(".txt"):  # `attnzoo translate -i`: UTF-8, one sentence a line, sent as `text` BYTES [N]
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        assert len(lines) == 5 and all(line.strip() for line in lines)
        sent = {"text": as_tensor(lines)[0]}
    else:  # `attnzoo predict MODEL FILE`: the reader predict_one picks for the declared inputs
        outputs = [{"name": "caption"}] if model.startswith("sat_") else [{"name": "pred"}]
        client = _Recorder()
        predict_one(client, {"inputs": declared, "outputs": outputs},
                    Namespace(model=model, version=None, decode="beam", attention=False), path)
        sent = client.inputs
    given = {d["name"]: d for d in declared}
    optional = {"width", "samples"}  # per-row sizes of a padded batch; predict sends one row
    assert set(given) - optional <= set(sent) <= set(given), (sent.keys(), given.keys())
    for key, value in sent.items():
        array, dims = np.asarray(value), given[key]["shape"]
        assert array.dtype == np.dtype(DATATYPES[given[key]["datatype"]]), (key, array.dtype)
        assert array.ndim == len(dims) and array.shape[0] == (len(lines) if key == "text" else 1), (key, array.shape)
        assert all(d in (-1, n) for d, n in zip(dims, array.shape)), (key, array.shape, dims)
        if array.dtype == np.float32:
            assert np.isfinite(array).all()
        if key == "image":  # grey pixels in [0, 1], not blank
            assert 0 <= array.min() and array.max() <= 1 and array.std() > 0.05
    if model == "neural_programmer":
        from pipeline.tasks.table_qa import COLUMNS

        assert sent["columns"].shape == (1, COLUMNS) and sent["table"].shape[2] == COLUMNS
    if name.endswith(".wav"):
        assert 0.5 < sent["audio"].shape[1] / 16000 < 3.5  # seconds of speech


def served_names_table() -> tuple[str, list[list[str]]]:
    """(file, rows) of the documentation's table of served names (docs/serving.md; README.md before it)."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        if "| name | input | outputs |" in lines:
            rows = []
            for line in lines[lines.index("| name | input | outputs |") + 2 :]:
                if not line.startswith("|"):
                    break
                rows.append(line.split(" | "))
            return str(path.relative_to(ROOT)), rows
    pytest.fail("no table of served names ('| name | input | outputs |') in README.md or docs/*.md")


def test_the_declared_inputs_are_the_documented_ones():
    """Each example's inputs as the served-names table states them (a letter there is any size)."""
    where, rows = served_names_table()
    for name, (model, declared) in served_inputs().items():
        row = next((r for r in rows if f"`{model}`" in r[0]), None)
        assert row, f"{where}: the table of served names has no row for {model} ({name})"
        stated = {m[0]: (m[1], m[2].split(",")) for m in re.findall(r"`(\w+)` (\w+) \[([^\]]*)\]", row[1])}
        for d in declared:
            assert d["name"] in stated, (where, model, d["name"], row[1])
            datatype, dims = stated[d["name"]]
            assert datatype == d["datatype"], (where, model, d, stated[d["name"]])
            assert len(dims) == len(d["shape"]), (where, model, d, dims)
            assert all(int(s) == n for s, n in zip(dims, d["shape"]) if s.isdigit()), (where, model, d, dims)


@pytest.mark.slow  # about a minute: the discarded train splits are drawn as prepare draws them
def test_make_examples_check_passes():
    """The committed files are what the task code makes now (the script's own --check)."""
    done = subprocess.run([sys.executable, "scripts/make_examples.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    checked = len(served_inputs()) + 1  # and examples/README.md
    assert f"make_examples: all {checked} checked files in examples/ are what the task code makes\n" in done.stdout, \
        done.stdout


def _small(task: str, **sizes) -> dict:
    return {**load_params(ROOT)["tasks"][task], **sizes}


def _first(task: str, params: dict, split: str, tmp_path):
    """Item 0 of ``split`` as the task's own ``prepare`` writes it and ``load`` reads it back."""
    from pipeline.tasks import get_task

    out = tmp_path / task
    out.mkdir()
    manifest = get_task(task).prepare(params, out)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return get_task(task).load(out, split)[0]


SMALL = dict(train_size=30, val_size=5, test_size=3)


def test_copy_sort_hull_parity_table_items_are_prepares(tmp_path):
    p = _small("copy", **SMALL)
    assert torch.equal(make_examples.copy_item(p), _first("copy", p, "test_20", tmp_path))
    p = _small("repeat_copy", **SMALL)
    (seq, rep), (seq2, rep2) = make_examples.repeat_copy_item(p), _first("repeat_copy", p, "test_L3_R3", tmp_path)
    assert torch.equal(seq, seq2) and rep == rep2
    p = _small("associative_recall", **SMALL)
    (items, q), (items2, q2) = make_examples.recall_item(p), _first("associative_recall", p, "test_6", tmp_path)
    assert torch.equal(items, items2) and q == q2
    for task in ("sort", "convex_hull"):
        p = _small(task, **SMALL)
        mine, theirs = make_examples.pointer_item(task, p), _first(task, p, "test_10", tmp_path)
        assert torch.equal(mine["points"], theirs["points"]) and torch.equal(mine["target"], theirs["target"]), task
    p = _small("parity", **SMALL)
    (x, y), (x2, y2) = make_examples.parity_item(p), _first("parity", p, "test", tmp_path)
    assert torch.equal(x, x2) and y == y2
    p = _small("table_qa", **SMALL)
    mine, theirs = make_examples.table_qa_item(p), _first("table_qa", p, "test", tmp_path)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_mnist_items_are_prepares(tmp_path):
    p = _small("mnist_captions", **SMALL)
    mine, theirs = make_examples.mnist_captions_item(p), _first("mnist_captions", p, "test", tmp_path)
    assert np.array_equal(mine["image"], theirs["image"])
    assert (mine["caption"], mine["tgt"], mine["boxes"]) == (theirs["caption"], theirs["tgt"], theirs["boxes"])
    for task in ("mnist_translated60", "mnist_cluttered60"):
        p = _small(task, **SMALL)
        (canvas, label), (canvas2, label2) = make_examples.placed_digit_item(p), _first(task, p, "test", tmp_path)
        assert np.array_equal(canvas, canvas2) and label == label2, task


def test_ocr_words_item_is_prepares(tmp_path):
    p = _small("ocr_words", train_size=20, val_size=5, test_size=3)
    mine, theirs = make_examples.ocr_words_item(p), _first("ocr_words", p, "test", tmp_path)
    assert np.array_equal(mine["image"], theirs["image"])
    assert (mine["text"], mine["tgt"], mine["font"]) == (theirs["text"], theirs["tgt"], theirs["font"])


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")
def test_spoken_digits_item_is_prepares(tmp_path):
    """The WAV's audio (before its 16-bit rounding) gives test item 0's features exactly."""
    from serving.features import log_mel, stack_frames

    p = _small("spoken_digits", train_size=2, val_size=1, test_size=2, test_long_size=1, workers=1)
    mine, theirs = make_examples.spoken_digits_item(p), _first("spoken_digits", p, "test", tmp_path)
    assert mine["text"] == theirs["text"] and mine["voice"].split("+")[0] == theirs["voice"]
    assert np.array_equal(stack_frames(log_mel(mine["audio"], p["n_mels"]).astype(np.float16)), theirs["features"])


def test_translation_sources_are_the_first_test_sentences_every_translation_run_wrote():
    lines = (EXAMPLES / "translation_de_en.txt").read_text(encoding="utf-8").splitlines()
    entries = [m for m, e in load_params(ROOT)["models"].items() if e["task"] == "translation_de_en"]
    assert entries
    for entry in entries:  # the same test split: each run's first test items (every entry has its metrics)
        metrics = json.loads((ROOT / "runs" / entry / "metrics.json").read_text())
        assert [e["src"] for e in metrics["examples"][:5]] == lines, entry


def test_png_and_wav_writers_are_plain_and_readable(tmp_path):
    from PIL import Image

    from serving.predict import read_wav

    pixels = (np.arange(12 * 7) % 256).astype(np.uint8).reshape(12, 7)
    data = make_examples.png_bytes(pixels)
    assert data == make_examples.png_bytes(pixels)
    assert [c for c in (b"tIME", b"tEXt", b"iTXt", b"zTXt", b"pHYs") if c in data] == []
    (tmp_path / "a.png").write_bytes(data)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "a.png")), pixels)
    audio = np.sin(np.arange(1600) / 5).astype(np.float32) * 0.5
    (tmp_path / "a.wav").write_bytes(make_examples.wav_bytes(audio, 16000))
    assert np.abs(read_wav(str(tmp_path / "a.wav")) - audio).max() <= 1 / 32768


def test_every_served_model_has_an_example():
    """The README's promise: examples/ holds an input for every model `publish` serves (each params.yaml entry),
    named in the table's "served to" column (`luong_*`: every luong entry)."""
    rows = [line.split(" | ") for line in (EXAMPLES / "README.md").read_text().splitlines() if line.startswith("| [`")]
    names = {n for row in rows for n in re.findall(r"`([\w*]+)`", row[2])}
    for entry in load_params(ROOT)["models"]:
        assert entry in names or any(n.endswith("*") and entry.startswith(n[:-1]) for n in names), entry
