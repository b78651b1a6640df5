"""NTM associative recall (Graves, Wayne & Danihelka 2014, §4.3).

An item is ``item_len`` random ``bits``-wide vectors. The input lists n items, each preceded by
a delimiter on channel ``bits``; then a query delimiter (channel ``bits + 1``), one of the items
but the last, and the query delimiter again; the model must then emit the item that followed the
query in the list. n is uniform in the training range; test sets come at fixed n, the largest
beyond the training range. Generated from a seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pipeline.tasks import Task, register_task
from pipeline.tasks.common.ntm import evaluate_ntm


class AssociativeRecallTask(Task):
    name = "associative_recall"
    card = {"data": "random binary items and queries generated from the seed in params.yaml",
            "licence": "generated: no third-party data",
            "paper": "Graves et al. 2014, §4.3 (associative recall)"}
    serving = {"bit_threshold": 0.0,
               "attention_outputs": {"read_weights": "new_read_w", "write_weights": "new_write_w"}}

    def make_split(self, rng, count: int, bits: int, item_len: int, sizes) -> dict[str, torch.Tensor]:
        ns = rng.choice(np.asarray(sizes), size=count)
        items = rng.integers(0, 2, size=(count, int(ns.max()), item_len, bits), dtype=np.uint8)
        query = np.array([rng.integers(0, n - 1) for n in ns], dtype=np.int64)  # any item but the last
        for i, n in enumerate(ns):
            items[i, n:] = 0
        return {"items": torch.from_numpy(items), "n": torch.from_numpy(ns.astype(np.int64)),
                "query": torch.from_numpy(query)}

    def prepare(self, params: dict, out: Path) -> dict:
        rng = np.random.default_rng(params["seed"])
        bits, item_len = params["bits"], params["item_len"]
        sizes = range(params["min_items"], params["max_items"] + 1)
        splits = {"train": self.make_split(rng, params["train_size"], bits, item_len, sizes),
                  "val": self.make_split(rng, params["val_size"], bits, item_len, sizes)}
        for n in params["test_items"]:
            splits[f"test_{n}"] = self.make_split(rng, params["test_size"], bits, item_len, [n])
        for name, split in splits.items():
            torch.save(split, out / f"{name}.pt")
        return {"counts": {k: len(v["n"]) for k, v in splits.items()}, "test_items": list(params["test_items"]),
                "model_defaults": {"input_size": bits + 2, "output_size": bits}}

    def load(self, data_dir: Path, split: str) -> list:
        d = torch.load(data_dir / f"{split}.pt")
        return [(items[:n], q) for items, n, q in zip(d["items"], d["n"].tolist(), d["query"].tolist())]

    def length(self, item) -> int:
        return len(item[0])

    def collate(self, items: list) -> dict:
        """x [B,T,bits+2]; y/mask mark the recalled item, the last item_len steps of each row
        (T = n·(item_len+1) + 2·(item_len+1))."""
        bsz = len(items)
        item_len, bits = items[0][0].shape[1:]
        block = item_len + 1
        steps = max(len(its) * block + 2 * block for its, _ in items)
        x = torch.zeros(bsz, steps, bits + 2)
        y = torch.zeros(bsz, steps, bits)
        mask = torch.zeros(bsz, steps)
        for b, (its, q) in enumerate(items):
            for i, item in enumerate(its):
                x[b, i * block, bits] = 1.0  # item delimiter
                x[b, i * block + 1 : (i + 1) * block, :bits] = item.float()
            t = len(its) * block
            x[b, t, bits + 1] = 1.0  # query delimiter
            x[b, t + 1 : t + block, :bits] = its[q].float()
            x[b, t + block, bits + 1] = 1.0  # query delimiter again: answer now
            y[b, t + block + 1 : t + 2 * block, :] = its[q + 1].float()
            mask[b, t + block + 1 : t + 2 * block] = 1.0
        return {"x": x, "y": y, "mask": mask}

    def evaluate(self, model, run, plots: Path) -> tuple[dict, dict]:
        sizes = json.loads((run.data_dir / "manifest.json").read_text())["test_items"]
        return evaluate_ntm(self, model, run, plots, [f"test_{n}" for n in sizes])

    def parity_batches(self, data_dir: Path) -> list[tuple[str, dict]]:
        sizes = json.loads((data_dir / "manifest.json").read_text())["test_items"]
        return [(f"{n} items × batch {b}", self.collate(self.load(data_dir, f"test_{n}")[:b]))
                for n, b in zip(sizes, (1, 16, 4, 8))]


register_task(AssociativeRecallTask())
