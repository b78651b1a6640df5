"""NTM repeat copy (Graves, Wayne & Danihelka 2014, §4.2), scaled down for a CPU budget.

Input: L random ``bits``-wide vectors, then one step with a delimiter flag and the number of
repeats R on a separate channel (R / REPEAT_SCALE); the model must then emit the sequence R times
followed by an end marker on an extra output channel. L and R are uniform in the training ranges;
test sets come at fixed (L, R) pairs, the largest ones beyond the training ranges. Generated from
a seed; sequences are stored as bits and laid out by ``collate``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pipeline.tasks import Task, register_task
from pipeline.tasks.common.ntm import evaluate_ntm

REPEAT_SCALE = 10.0  # the repeat channel carries R / 10 (Graves normalised it to a small range)


def _case(length: int, repeats: int) -> str:
    return f"test_L{length}_R{repeats}"


class RepeatCopyTask(Task):
    name = "repeat_copy"
    card = {"data": "random binary sequences and repeat counts generated from the seed in params.yaml",
            "licence": "generated: no third-party data",
            "paper": "Graves et al. 2014, §4.2 (repeat copy)"}
    serving = {"bit_threshold": 0.0,
               "attention_outputs": {"read_weights": "new_read_w", "write_weights": "new_write_w"}}

    def make_split(self, rng, count: int, bits: int, lengths, repeats) -> dict[str, torch.Tensor]:
        ls = rng.choice(np.asarray(lengths), size=count)
        rs = rng.choice(np.asarray(repeats), size=count)
        seqs = rng.integers(0, 2, size=(count, int(ls.max()), bits), dtype=np.uint8)
        for i, n in enumerate(ls):
            seqs[i, n:] = 0
        return {"bits": torch.from_numpy(seqs), "lengths": torch.from_numpy(ls.astype(np.int64)),
                "repeats": torch.from_numpy(rs.astype(np.int64))}

    def prepare(self, params: dict, out: Path) -> dict:
        rng = np.random.default_rng(params["seed"])
        bits = params["bits"]
        lengths = range(params["min_len"], params["max_len"] + 1)
        repeats = range(params["min_repeats"], params["max_repeats"] + 1)
        splits = {"train": self.make_split(rng, params["train_size"], bits, lengths, repeats),
                  "val": self.make_split(rng, params["val_size"], bits, lengths, repeats)}
        for length, rep in params["test_cases"]:
            splits[_case(length, rep)] = self.make_split(rng, params["test_size"], bits, [length], [rep])
        for name, split in splits.items():
            torch.save(split, out / f"{name}.pt")
        return {"counts": {k: len(v["lengths"]) for k, v in splits.items()},
                "test_cases": [list(c) for c in params["test_cases"]],
                "train_ranges": {"length": [params["min_len"], params["max_len"]],
                                 "repeats": [params["min_repeats"], params["max_repeats"]]},
                "model_defaults": {"input_size": bits + 2, "output_size": bits + 1}}

    def load(self, data_dir: Path, split: str) -> list:
        d = torch.load(data_dir / f"{split}.pt")
        return [(seq[:n], r) for seq, n, r in zip(d["bits"], d["lengths"].tolist(), d["repeats"].tolist())]

    def length(self, item) -> int:
        return len(item[0]) * (item[1] + 1)

    def collate(self, items: list) -> dict:
        """x [B,T,bits+2]: sequence, then delimiter + repeat count, then blanks; y/mask [B,T,·] mark
        the R copies and the end marker (T = L + 1 + L·R + 1)."""
        bsz, bits = len(items), items[0][0].shape[1]
        steps = max(len(s) * (r + 1) + 2 for s, r in items)
        x = torch.zeros(bsz, steps, bits + 2)
        y = torch.zeros(bsz, steps, bits + 1)
        mask = torch.zeros(bsz, steps)
        for b, (seq, rep) in enumerate(items):
            n = len(seq)
            x[b, :n, :bits] = seq.float()
            x[b, n, bits] = 1.0  # delimiter
            x[b, n, bits + 1] = rep / REPEAT_SCALE
            start = n + 1
            y[b, start : start + n * rep, :bits] = seq.float().repeat(rep, 1)  # [n·R, bits]
            y[b, start + n * rep, bits] = 1.0  # end marker
            mask[b, start : start + n * rep + 1] = 1.0
        return {"x": x, "y": y, "mask": mask}

    def evaluate(self, model, run, plots: Path) -> tuple[dict, dict]:
        return evaluate_ntm(self, model, run, plots, [_case(*c) for c in _cases(run.data_dir)])

    def parity_batches(self, data_dir: Path) -> list[tuple[str, dict]]:
        cases = []
        for (length, rep), size in zip(_cases(data_dir), (1, 16, 4, 8)):
            items = self.load(data_dir, _case(length, rep))[:size]
            cases.append((f"L={length} R={rep} × batch {size}", self.collate(items)))
        return cases


def _cases(data_dir: Path) -> list[tuple[int, int]]:
    return [tuple(c) for c in json.loads((data_dir / "manifest.json").read_text())["test_cases"]]


register_task(RepeatCopyTask())
