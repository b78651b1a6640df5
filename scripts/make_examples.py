"""examples/: one real input per served input kind, made by the task code from each task's test split.

    python scripts/make_examples.py            # (re)write examples/* and examples/README.md
    python scripts/make_examples.py --check    # exit 1 when a file in examples/ differs from what this makes

Each file is the first item of a task's test split, made with the task module's own generation
functions and the task's seed from params.yaml. Prepare draws the train and validation splits
before the test split from one generator, so the draws of those splits are made here too, in
prepare's order, and thrown away; of the test split only the first item is made where prepare's
code allows it (ocr_words renders one test word, spoken_digits synthesises one utterance, the
MNIST tasks render one canvas). The functions ``*_item`` return that item as the task's ``load``
returns it (tests/test_examples.py compares them with ``prepare`` + ``load`` on small splits).

Two files are not test items:
* translation_de_en.txt: the test split needs the Debian corpus build (~10 min on 2 cores, 4.5 GB); the five
  German sources are test sentences 0-4 as ``evaluate@bahdanau`` wrote them into the committed
  runs/bahdanau/metrics.json (``examples``: the first eight test items, source and reference).
* mnist_binarized.json: ``draw``'s served input is prior noise, not an image (the image and
  posterior-noise input is the graph ``draw.infer``, which ``predict --local`` does not serve).
  The noise is the task's own ``noise()`` draw for the trained config (16 steps × 100) at the seed
  ``evaluate@draw`` samples from (evaluate seed + 1): the first sample of runs/draw/plots/samples_steps.png.

Files are written byte for byte the same on every run: PNGs by a minimal writer here (IHDR, IDAT,
IEND: no time or text chunks), WAVs by the standard ``wave`` module (no timestamps). Two files go
through system renderers whose output may change between versions: ocr_words.png (Pillow and
FreeType) and spoken_digits.wav (espeak-ng). ``--check`` compares them byte for byte too, but where
the renderer's version here differs from the one recorded in ``RENDERERS`` a difference is a
warning, not a failure. A PNG whose bytes differ but whose pixels are equal (another zlib) passes.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import struct
import subprocess
import sys
import wave
import zlib
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import cli_errors
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXAMPLES = ROOT / "examples"
METRICS = "runs/bahdanau/metrics.json"  # the committed file the translation sources come from
COPY_LENGTH = 20  # copy: test_20, the training maximum and the headline bit-error length
REPEAT_CASE = "test_L3_R3"  # repeat_copy: the first bar's case
RECALL_ITEMS = 6  # associative_recall: test_6, the training maximum and a bar's length
POINTER_N = 10  # sort and convex_hull: test_10
DRAW_ENTRY = "draw"
# The renderers the committed files were made with (see the module docstring).
RENDERERS = {"ocr_words.png": "Pillow 13.0.0, FreeType 2.14.3", "spoken_digits.wav": "espeak-ng 1.51"}


def renderer_here(file: str) -> str:
    if file == "ocr_words.png":
        import PIL
        import PIL.features

        return f"Pillow {PIL.__version__}, FreeType {PIL.features.version('freetype2')}"
    try:
        out = subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True).stdout.split()
    except OSError:
        return "no espeak-ng"
    return f"espeak-ng {out[out.index('NG') + 2] if 'NG' in out else '?'}"


def task_params(task: str) -> dict:
    from pipeline.config import load_params

    return load_params(ROOT)["tasks"][task]


# ----- the test items, as each task's ``load`` returns them --------------------------------------------------------


def copy_item(p: dict, split: str = f"test_{COPY_LENGTH}"):
    """``CopyTask.load(..., split)[0]``: uint8 [L, bits]."""
    import torch

    from pipeline.tasks.copy import make_sequences

    rng = np.random.default_rng(p["seed"])
    train_lengths = np.arange(p["min_len"], p["max_len"] + 1)
    make_sequences(rng, p["train_size"], p["bits"], train_lengths)
    make_sequences(rng, p["val_size"], p["bits"], train_lengths)
    for length in p["test_lengths"]:
        seqs = make_sequences(rng, p["test_size"], p["bits"], [length])
        if f"test_{length}" == split:
            return torch.from_numpy(seqs[0])
    raise KeyError(split)


def repeat_copy_item(p: dict, split: str = REPEAT_CASE) -> tuple:
    """``RepeatCopyTask.load(..., split)[0]``: (uint8 [L, bits], R)."""
    from pipeline.tasks.repeat_copy import RepeatCopyTask, _case

    task, rng = RepeatCopyTask(), np.random.default_rng(p["seed"])
    lengths, repeats = range(p["min_len"], p["max_len"] + 1), range(p["min_repeats"], p["max_repeats"] + 1)
    task.make_split(rng, p["train_size"], p["bits"], lengths, repeats)
    task.make_split(rng, p["val_size"], p["bits"], lengths, repeats)
    for length, rep in p["test_cases"]:
        split_ = task.make_split(rng, p["test_size"], p["bits"], [length], [rep])
        if _case(length, rep) == split:
            return split_["bits"][0][: int(split_["lengths"][0])], int(split_["repeats"][0])
    raise KeyError(split)


def recall_item(p: dict, split: str = f"test_{RECALL_ITEMS}") -> tuple:
    """``AssociativeRecallTask.load(..., split)[0]``: (uint8 [n, item_len, bits], the queried item's index)."""
    from pipeline.tasks.associative_recall import AssociativeRecallTask

    task, rng = AssociativeRecallTask(), np.random.default_rng(p["seed"])
    sizes = range(p["min_items"], p["max_items"] + 1)
    task.make_split(rng, p["train_size"], p["bits"], p["item_len"], sizes)
    task.make_split(rng, p["val_size"], p["bits"], p["item_len"], sizes)
    for n in p["test_items"]:
        split_ = task.make_split(rng, p["test_size"], p["bits"], p["item_len"], [n])
        if f"test_{n}" == split:
            return split_["items"][0][: int(split_["n"][0])], int(split_["query"][0])
    raise KeyError(split)


def pointer_item(task_name: str, p: dict, split: str = f"test_{POINTER_N}") -> dict:
    """``load(..., split)[0]`` of sort / convex_hull: {"points": [n, d], "target": 1-based positions, END 0}.

    The discarded splits are drawn with the task's own ``make_split``; convex_hull's ``hull`` (no
    random draws) is left out of them: a million hulls would take 20 s and change no draw."""
    from pipeline.tasks import convex_hull, get_task
    from pipeline.tasks.common.pointer import IGNORE

    task = get_task(task_name)
    rng = np.random.default_rng(p["seed"])
    train_sizes = range(p["min_n"], p["max_n"] + 1)
    with mock.patch.object(convex_hull, "hull", lambda points: []):
        task.make_split(rng, p["train_size"], train_sizes)
        task.make_split(rng, p["val_size"], train_sizes)
    for n in p["test_n"]:
        d = task.make_split(rng, p["test_size"], [n])
        if f"test_{n}" == split:
            tgt = d["targets"][0]
            return {"points": d["points"][0][: int(d["n"][0])], "target": tgt[tgt != IGNORE]}
    raise KeyError(split)


def parity_item(p: dict):
    """``ParityTask.load(..., "test")[0]``: (x int8 [bits], parity)."""
    from pipeline.tasks.parity import make_split

    rng = np.random.default_rng(p["seed"])
    for split in ("train", "val", "test"):
        d = make_split(rng, p[f"{split}_size"], p["bits"])
    return d["x"][0], int(d["y"][0])


def table_qa_item(p: dict) -> dict:
    """``TableQATask.load(..., "test")[0]``: the split's padded tensors at index 0."""
    from pipeline.tasks.table_qa import TableQATask

    task, rng = TableQATask(), np.random.default_rng(p["seed"])
    for split in ("train", "val", "test"):
        d = task.make_split(rng, p[f"{split}_size"], p)
    return {k: v[0] for k, v in d.items()}


def mnist_captions_item(p: dict) -> dict:
    """``MnistCaptionsTask.load(..., "test")[0]``: image, tgt, caption, boxes."""
    from pipeline.tasks.common.mnist import CELL, load_mnist
    from pipeline.tasks.mnist_captions import WORD_ID, caption, make_layouts, render

    mnist, rng = load_mnist(), np.random.default_rng(p["seed"])
    for split in ("train", "val", "test"):
        images, labels = mnist[split]
        layout = make_layouts(rng, labels, p[f"{split}_size"], p["grid"], p["jitter"], p["min_digits"],
                              p["max_digits"])
    slots = np.flatnonzero(layout["index"][0] >= 0)
    digits = [int(labels[layout["index"][0, k]]) for k in slots]
    words = caption(digits, [(int(layout["row"][0, k]), int(layout["col"][0, k])) for k in slots])
    boxes = {d: (int(layout["top"][0, k]), int(layout["left"][0, k]), int(layout["top"][0, k]) + CELL,
                 int(layout["left"][0, k]) + CELL) for d, k in zip(digits, slots)}
    return {"image": render(images, layout, 0, p["grid"] * CELL), "tgt": [WORD_ID[w] for w in words],
            "caption": " ".join(words), "boxes": boxes}


def placed_digit_item(p: dict) -> tuple[np.ndarray, int]:
    """``load(..., "test")[0]`` of mnist_translated60 / mnist_cluttered60: (canvas uint8 [S,S], label)."""
    from pipeline.tasks.common.mnist import load_mnist
    from pipeline.tasks.common.placed_digits import make_layout, render

    mnist, rng = load_mnist(), np.random.default_rng(p["seed"])
    piece = p.get("piece", 8)
    for split in ("train", "val", "test"):
        images, labels = mnist[split]
        layout = make_layout(rng, len(labels), p[f"{split}_size"], p["canvas"], p.get("clutter", 0), piece)
    first = {k: v[:1] for k, v in layout.items()}
    return render(images, first, p["canvas"], piece)[0], int(labels[layout["index"][0]])


def ocr_words_item(p: dict) -> dict:
    """``OcrWordsTask.load(..., "test")[0]``: image uint8 [height, W], text, tgt, font.

    Prepare renders every train and validation image before the test split, and each render's
    draws depend on the rendered width, so those 61k renders are made here too (~30 s)."""
    from pipeline.tasks.ocr_words import VOCAB, WORDS_FILE, load_fonts, read_words, render, split_words

    rng = np.random.default_rng(p["seed"])
    words = read_words(WORDS_FILE, p["min_len"], p["max_len"])
    split = split_words(words, rng, p["val_words"], p["test_words"])
    sizes = range(p["font_size"][0], p["font_size"][1] + 1)
    fonts = load_fonts(p["fonts"], sizes)
    names = list(fonts)
    for name in ("train", "val", "test"):
        pool, count = split[name], p[f"{name}_size"]
        chosen = np.concatenate([rng.permutation(len(pool)) for _ in range(-(-count // len(pool)))])[:count]
        font_ids = rng.integers(len(names), size=count)
        for i in range(count if name != "test" else 1):
            word = pool[chosen[i]]
            font = fonts[names[font_ids[i]]][int(rng.choice(sizes))]
            image = render(word, font, rng, p["height"], p["max_width"], p["style"])
    return {"image": image, "text": word, "tgt": [VOCAB.index(c) for c in word], "font": Path(names[font_ids[0]]).stem}


def spoken_digits_item(p: dict) -> dict:
    """Test utterance 0 of spoken_digits before its features: audio float32 [S] at 16 kHz, text, voice.

    ``load(..., "test")[0]["features"]`` is ``stack_frames(log_mel(audio, n_mels))`` in float16.
    Prepare draws every plan of a split before synthesising it: the train and validation plans are
    drawn here, then test plan 0 is synthesised (one espeak-ng call)."""
    from pipeline.tasks import TaskError
    from pipeline.tasks.spoken_digits import DIGITS, NAMES, add_noise, synthesise

    if shutil.which("espeak-ng") is None:  # as prepare says it
        raise TaskError("espeak-ng is missing: install the Debian package `espeak-ng` (`make setup` does)")
    rng = np.random.default_rng(p["seed"])
    voices = [f"{v}+{var}" for v in p["voices"] for var in p["variants"]]
    lo, hi = p["min_digits"], p["max_digits"]
    for split in ("train", "val", "test"):  # test_long comes after test
        plans = []
        for _ in range(p[f"{split}_size"]):
            digits = "".join(rng.choice(list(DIGITS), size=int(rng.integers(lo, hi + 1))))
            plans.append((digits, voices[int(rng.integers(len(voices)))], int(rng.integers(*p["rate"])),
                          int(rng.integers(*p["pitch"])), float(rng.uniform(*p["snr_db"])), int(rng.integers(2**31))))
    digits, voice, rate, pitch, snr, seed = plans[0]
    audio = synthesise(" ".join(NAMES[int(d)] for d in digits), voice, rate, pitch)
    return {"audio": add_noise(audio, snr, np.random.default_rng(seed)), "text": digits, "voice": voice,
            "rate": rate, "pitch": pitch, "snr_db": snr}


def draw_prior_noise() -> tuple[np.ndarray, int]:
    """``MnistBinarizedTask.noise(model, 1, seed)["x"]`` for ``draw``'s trained config, at the seed
    ``evaluate`` draws its samples from."""
    from types import SimpleNamespace

    import yaml

    import models
    from pipeline.config import load_params
    from pipeline.tasks.mnist_binarized import CELL, MnistBinarizedTask

    entry = load_params(ROOT)["models"][DRAW_ENTRY]
    tuned = ROOT / "runs" / DRAW_ENTRY / "tuned.yaml"
    overrides = (yaml.safe_load(tuned.read_text()) or {}) if tuned.exists() else {}
    cfg = models.make_config(entry["arch"], {"image_size": CELL, **entry.get("model", {}), **overrides})
    seed = int((entry.get("evaluate") or {}).get("seed", 0)) + 1
    return MnistBinarizedTask().noise(SimpleNamespace(cfg=cfg), 1, seed)["x"].numpy(), seed


# ----- writers: the same bytes on every run ----------------------------------------------------------------------


def png_bytes(pixels: np.ndarray) -> bytes:
    """8-bit grey PNG of uint8 [H,W]: signature, IHDR, one IDAT, IEND (no time, text or gamma chunks)."""
    height, width = pixels.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + bytes(row) for row in np.ascontiguousarray(pixels, dtype=np.uint8))  # filter 0
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


def wav_bytes(audio: np.ndarray, rate: int) -> bytes:
    """Mono 16-bit PCM WAV of float samples in [-1, 1] (``read_wav`` divides by 32768)."""
    pcm = np.clip(np.round(audio * 32768.0), -32768, 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def num(v) -> str:
    """A float32 as the shortest decimal that reads back to the same float32 (integers without '.0')."""
    v = np.float32(v)
    return str(int(v)) if float(v).is_integer() else repr(float(np.format_float_positional(v, unique=True)))


def json_bytes(tensors: dict) -> bytes:
    """{name: nested list} as JSON, one innermost row a line (numbers as float32 reads them back)."""

    def fmt(value, depth: int) -> str:
        if isinstance(value, str):
            return json.dumps(value, ensure_ascii=False)
        if not isinstance(value, (list, tuple, np.ndarray)):
            return num(value)
        items = list(value)
        if not items or not isinstance(items[0], (list, tuple, np.ndarray)):
            return "[" + ", ".join(fmt(v, depth + 1) for v in items) + "]"
        pad = "  " * (depth + 1)
        return "[\n" + ",\n".join(pad + fmt(v, depth + 1) for v in items) + "\n" + "  " * depth + "]"

    body = ",\n".join(f'  {json.dumps(k)}: {fmt(v, 1)}' for k, v in tensors.items())
    return ("{\n" + body + "\n}\n").encode()


# ----- the examples -------------------------------------------------------------------------------------------------


@dataclass
class Example:
    file: str
    source: str  # task, split, index
    models: str  # the served models that take it
    command: str  # the README line
    reference: str  # the true answer, short (markdown)
    data: bytes
    detail: str = ""  # the reference in full, where it is long


def translation() -> Example:
    examples = json.loads((ROOT / METRICS).read_text())["examples"][:5]
    sources = [e["src"] for e in examples]
    detail = "\n".join(f"{i}. {e['src']} → *{e['ref']}*" for i, e in enumerate(examples))
    return Example("translation_de_en.txt", f"translation_de_en, test, 0–4 (read from `{METRICS}`)",
                   "`bahdanau`, `bahdanau_none`, `luong_*`, `transformer`",
                   "attnzoo translate -i examples/translation_de_en.txt -o en.txt --model bahdanau --local",
                   "the test references, below", "".join(f"{s}\n" for s in sources).encode(), detail)


def copy_example() -> Example:
    from pipeline.tasks.copy import CopyTask

    seq = copy_item(task_params("copy"))
    x = CopyTask().collate([seq])["x"].numpy().astype(np.int64)  # [1, 2L+1, bits+1] of 0/1
    length = len(seq)
    rows = ["".join(map(str, r)) for r in seq.numpy().tolist()]
    return Example("copy.json", f"copy, test_{length}, 0", "`ntm`", "attnzoo predict ntm examples/copy.json",
                   f"`bits` steps {length + 1}–{2 * length} (0-based) repeat the {length} input vectors, below",
                   json_bytes({"x": x}), f"`x` [1,{x.shape[1]},{x.shape[2]}]: {length} vectors of 8 bits, "
                   f"the delimiter, {length} blank steps. The vectors, which `bits` should repeat:\n\n"
                   + "\n".join(f"    {r}" for r in rows))


def repeat_copy_example() -> Example:
    from pipeline.tasks.repeat_copy import RepeatCopyTask

    seq, rep = repeat_copy_item(task_params("repeat_copy"))
    x = RepeatCopyTask().collate([(seq, rep)])["x"].numpy()  # [1, L·(R+1)+2, bits+2]
    length, rows = len(seq), ["".join(map(str, r)) for r in seq.numpy().tolist()]
    command = "attnzoo predict ntm_repeat_copy examples/repeat_copy.json"
    return Example("repeat_copy.json", f"repeat_copy, {REPEAT_CASE.removeprefix('test_')}, 0", "`ntm_repeat_copy`",
                   command, f"`bits` steps {length + 1}–{length * (rep + 1)} (0-based) repeat the {length} input "
                   f"vectors {rep} times, below; step {length * (rep + 1) + 1} ends them (the last output bit)",
                   json_bytes({"x": x.astype(np.float32)}),
                   f"`x` [1,{x.shape[1]},{x.shape[2]}]: {length} vectors of {seq.shape[1]} bits, the delimiter with "
                   f"the repeat count {rep} (scaled as the task does), then blank steps. The vectors:\n\n"
                   + "\n".join(f"    {r}" for r in rows))


def recall_example() -> Example:
    from pipeline.tasks.associative_recall import AssociativeRecallTask

    items, query = recall_item(task_params("associative_recall"))
    x = AssociativeRecallTask().collate([(items, query)])["x"].numpy()  # [1, (n+2)·(item_len+1), bits+2]
    answer = " ".join("".join(map(str, r)) for r in items[query + 1].numpy().tolist())
    return Example("associative_recall.json", f"associative_recall, test_{len(items)}, 0", "`ntm_recall`",
                   "attnzoo predict ntm_recall examples/associative_recall.json",
                   f"`bits` of the last {items.shape[1]} steps: item {query + 2} of {len(items)}, the one after "
                   f"the queried item {query + 1}: {answer}", json_bytes({"x": x.astype(np.float32)}),
                   f"`x` [1,{x.shape[1]},{x.shape[2]}]: {len(items)} items of {items.shape[1]} vectors, each after "
                   f"its delimiter, then the query (item {query + 1}) after the query delimiter, then blank steps.")


def pointer_example(task: str) -> Example:
    item = pointer_item(task, task_params(task))
    points = item["points"].numpy()
    pointers = [int(t) - 1 for t in item["target"][:-1]]  # 1-based positions, END 0 -> 0-based pointers
    if task == "sort":
        values = ", ".join(num(points[i, 0]) for i in pointers)
        ref, model = f"`pointers` {pointers} (the values in order: {values})", "pointer_sort"
    else:
        ref, model = f"`pointers` {pointers} (the hull, counter-clockwise from the leftmost point)", "pointer_hull"
    return Example(f"{task}.json", f"{task}, test_{len(points)}, 0", f"`{model}`",
                   f"attnzoo predict {model} examples/{task}.json", ref, json_bytes({"points": points[None]}))


def parity_example() -> Example:
    x, y = parity_item(task_params("parity"))
    x = x.numpy().astype(np.int64)
    ones, nonzero = int((x == 1).sum()), int((x != 0).sum())
    return Example("parity.json", "parity, test, 0", "`act_parity`, `rnn_parity`",
                   "attnzoo predict act_parity examples/parity.json",
                   f"`bits` [[{y}]] ({ones} of the {nonzero} nonzero inputs are +1)", json_bytes({"x": x[None]}))


def table_qa_example() -> Example:
    from pipeline.tasks.table_qa import KINDS, WORDS

    it = table_qa_item(task_params("table_qa"))
    rows, pivot = int(it["rows"]), float(it["pivot"])
    words = [WORDS[t] for t in it["question"][: int(it["q_len"])].tolist()]
    question = " ".join(num(pivot) if w == "<num>" else w for w in words)  # the server turns the number into <num>
    columns = [WORDS[t] for t in it["columns"].tolist()]
    table = it["table"][:rows].numpy()
    kind = list(KINDS)[int(it["kind"])]
    if bool(it["is_lookup"]):
        cells = np.argwhere(it["cells"][:rows].numpy() > 0)
        picked = ", ".join(f"{num(table[r, c])} (row {r}, {columns[c]})" for r, c in cells)
        ref = f"`is_lookup` true, `cells`: {picked}"
    else:
        ref = f"`answer` {num(it['answer'])}, `is_lookup` false"
    return Example("table_qa.json", f"table_qa, test, 0 ({kind})", "`neural_programmer`",
                   "attnzoo predict neural_programmer examples/table_qa.json", f"“{question}”: {ref}",
                   json_bytes({"question": [question], "columns": [columns], "table": table[None]}))


def mnist_captions_example() -> Example:
    it = mnist_captions_item(task_params("mnist_captions"))
    size = it["image"].shape[0]
    return Example("mnist_captions.png", "mnist_captions, test, 0", "`sat_soft`, `sat_hard`",
                   "attnzoo predict sat_soft examples/mnist_captions.png --attention",
                   f"“{it['caption']}” ({size}×{size})", png_bytes(it["image"]))


def placed_digit_example(task: str, model: str) -> Example:
    canvas, label = placed_digit_item(task_params(task))
    size = canvas.shape[0]
    return Example(f"{task}.png", f"{task}, test, 0", f"`{model}`",
                   f"attnzoo predict {model} examples/{task}.png --attention", f"{label} ({size}×{size})",
                   png_bytes(canvas))


def draw_example() -> Example:
    x, seed = draw_prior_noise()
    return Example("mnist_binarized.json", f"mnist_binarized: `noise(model, 1, seed={seed})[\"x\"]`, no test item",
                   "`draw`, `draw_none`", "attnzoo predict draw examples/mnist_binarized.json",
                   f"none: a sample; `logits` [1,{x.shape[1]},784] (σ: pixel probabilities after each step)",
                   json_bytes({"x": x}))


def ocr_words_example() -> Example:
    it = ocr_words_item(task_params("ocr_words"))
    height, width = it["image"].shape
    return Example("ocr_words.png", f"ocr_words, test, 0 ({it['font']})", "`attention_ocr`, `ocr_rcnn`",
                   "attnzoo predict attention_ocr examples/ocr_words.png --attention",
                   f"“{it['text']}” ({width}×{height})", png_bytes(it["image"]))


def spoken_digits_example() -> Example:
    from serving.features import SAMPLE_RATE

    it = spoken_digits_item(task_params("spoken_digits"))
    seconds = len(it["audio"]) / SAMPLE_RATE
    return Example("spoken_digits.wav", f"spoken_digits, test, 0 ({it['voice']}, {it['rate']} wpm)",
                   "`speech_location`, `speech_content`",
                   "attnzoo predict speech_location examples/spoken_digits.wav --attention",
                   f"{it['text']} ({seconds:.2f} s, 16 kHz mono 16-bit)", wav_bytes(it["audio"], SAMPLE_RATE))


MAKERS = {  # file -> its maker, in the order of the table
    "translation_de_en.txt": translation, "copy.json": copy_example, "repeat_copy.json": repeat_copy_example,
    "associative_recall.json": recall_example, "sort.json": lambda: pointer_example("sort"),
    "convex_hull.json": lambda: pointer_example("convex_hull"), "parity.json": parity_example,
    "table_qa.json": table_qa_example, "mnist_captions.png": mnist_captions_example,
    "mnist_translated60.png": lambda: placed_digit_example("mnist_translated60", "ram"),
    "mnist_cluttered60.png": lambda: placed_digit_example("mnist_cluttered60", "ram_cluttered"),
    "mnist_binarized.json": draw_example, "ocr_words.png": ocr_words_example,
    "spoken_digits.wav": spoken_digits_example,
}


def readme(examples: list[Example]) -> bytes:
    lines = [
        "# Example inputs",
        "",
        "One real input per task from its test split (the table names which; `mnist_binarized.json`: see the notes),",
        "made by the task's own code (`pipeline/tasks/<task>.py`) from its seed in `params.yaml`; the README's",
        "`predict` and `translate` lines use them. Regenerate them all (this file too) with",
        "",
        "```bash",
        "python scripts/make_examples.py          # --check: exit 1 when a file here differs",
        "```",
        "",
        "| file | made from (task, split, index) | served to | reference answer |",
        "|---|---|---|---|",
    ]
    lines += [f"| [`{e.file}`]({e.file}) | {e.source} | {e.models} | {e.reference} |" for e in examples]
    lines += ["", "A command for each (with `attnzoo serve` up, or `--local`):", "", "```bash"]
    lines += [e.command for e in examples]
    lines += ["```", ""]
    for e in examples:
        if e.detail:
            lines += [f"`{e.file}`:", "", e.detail, ""]
    lines += [
        "Notes:",
        "",
        "- `translation_de_en.txt`: the test split needs the Debian corpus build (about 10 minutes on 2 cores"
        " and 4.5 GB),",
        f"  so the sources are read from `{METRICS}`, where `evaluate@bahdanau` wrote test items 0–7.",
        "- `mnist_binarized.json`: `draw`'s served input is prior noise `x` [N,T,100], not an image. The file",
        "  holds the task's own draw (`MnistBinarizedTask.noise`) for the trained config at the seed evaluate",
        "  samples from: the first sample of `runs/draw/plots/samples_steps.png`. The image input is the",
        "  graph `draw.infer` (an image and posterior noise), which `predict --local` does not serve.",
        "- `ocr_words.png` and `spoken_digits.wav` come from system renderers: they were made with "
        + " and ".join(f"{v}" for v in RENDERERS.values()) + ".",
        "  Another version may draw or speak them a little differently; `--check` then warns instead of failing.",
        "- The WAV is the task's audio before its log-mel features, as 16-bit PCM; PNGs are 8-bit grey.",
        "",
    ]
    return "\n".join(lines).encode()


def make_all() -> tuple[dict[str, bytes], dict[str, str]]:
    """(file -> bytes, file -> why it could not be made here: a missing system package)."""
    from pipeline.tasks import TaskError

    examples, missing = [], {}
    for file, maker in MAKERS.items():
        try:
            examples.append(maker())
        except TaskError as err:  # e.g. espeak-ng, the fonts or the word list not installed
            missing[file] = str(err)
            continue
        assert examples[-1].file == file, (file, examples[-1].file)
        print(f"made {file}: {examples[-1].source}", file=sys.stderr, flush=True)
    files = {e.file: e.data for e in examples}
    if missing:
        missing["README.md"] = "it lists every file"
    else:
        files["README.md"] = readme(examples)
    return files, missing


def same_pixels(a: bytes, b: bytes) -> bool:
    from PIL import Image

    try:
        x, y = (Image.open(io.BytesIO(d)) for d in (a, b))
        return x.mode == y.mode and x.size == y.size and np.array_equal(np.asarray(x), np.asarray(y))
    except OSError:
        return False


def check(files: dict[str, bytes], missing: dict[str, str]) -> int:
    failed, warned = 0, 0
    for name, data in files.items():
        path = EXAMPLES / name
        have = path.read_bytes() if path.exists() else None
        if have == data:
            print(f"ok       examples/{name}")
        elif have is not None and name.endswith(".png") and same_pixels(have, data):
            print(f"ok       examples/{name} (the same pixels; this zlib compresses them differently)")
        elif have is not None and name in RENDERERS and renderer_here(name) != RENDERERS[name]:
            warned += 1
            print(f"warning  examples/{name} differs: it was made with {RENDERERS[name]}, this machine has "
                  f"{renderer_here(name)}; not counted as a difference")
        else:
            failed += 1
            print(f"DIFFERS  examples/{name}" + (" (missing)" if have is None else
                                                 f" ({len(have)} bytes here, {len(data)} made)"))
    for name, why in missing.items():
        warned += 1
        print(f"warning  examples/{name} not checked: {why}")
    extra = sorted(p.name for p in EXAMPLES.iterdir() if p.name not in {**files, **missing}) \
        if EXAMPLES.is_dir() else []
    for name in extra:
        print(f"DIFFERS  examples/{name} (not made by this script)")
    if failed or extra:
        print("make_examples: examples/ differs from the task code's output; run `python scripts/make_examples.py`")
        return 1
    print(f"make_examples: all {len(files) - warned + len(missing)} checked files in examples/ are what the task "
          "code makes" + (f" ({warned} not compared, above)" if warned else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file in examples/ differs")
    args = ap.parse_args(argv)
    files, missing = make_all()
    if args.check:
        return check(files, missing)
    if missing:
        for name, why in missing.items():
            print(f"error: cannot make examples/{name}: {why}", file=sys.stderr)
        return 1
    EXAMPLES.mkdir(exist_ok=True)
    for name, data in files.items():
        (EXAMPLES / name).write_bytes(data)
        print(f"wrote examples/{name} ({len(data):,} bytes)")
    for name, recorded in RENDERERS.items():
        if renderer_here(name) != recorded:
            print(f"note: examples/{name} was made with {renderer_here(name)}; RENDERERS records {recorded}: "
                  "update it in scripts/make_examples.py")
    return 0


if __name__ == "__main__":
    cli_errors.run(main)
