"""NTM copy task (Graves et al. 2014, §4.1).

Input: a sequence of random ``bits``-wide binary vectors, then a delimiter flag on an extra
channel, then blanks while the model must reproduce the sequence. Generated from a seed, so
``prepare`` is deterministic; training lengths are uniform in [min_len, max_len], test sets come
at fixed lengths (20, and longer to test generalisation).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pipeline.tasks import Task, register_task


def make_sequences(rng: np.random.Generator, count: int, bits: int, lengths) -> list[np.ndarray]:
    """``count`` uint8 arrays [L, bits] of random bits, L drawn from ``lengths``."""
    return [rng.integers(0, 2, size=(int(length), bits), dtype=np.uint8)
            for length in rng.choice(lengths, size=count)]


class CopyTask(Task):
    name = "copy"
    card = {"data": "random binary sequences generated from the seed in params.yaml",
            "licence": "generated: no third-party data",
            "paper": "Graves et al. 2014, §4.1 (copy)"}
    # A bit is 1 where its logit is positive (as NTM.predict); the heads' weightings, carried by the step
    # graph as new_read_w / new_write_w, are returned over time as the attention.
    serving = {"bit_threshold": 0.0,
               "attention_outputs": {"read_weights": "new_read_w", "write_weights": "new_write_w"}}

    def prepare(self, params: dict, out: Path) -> dict:
        rng = np.random.default_rng(params["seed"])
        bits = params["bits"]
        train_lengths = np.arange(params["min_len"], params["max_len"] + 1)
        splits = {
            "train": make_sequences(rng, params["train_size"], bits, train_lengths),
            "val": make_sequences(rng, params["val_size"], bits, train_lengths),
        }
        for length in params["test_lengths"]:
            splits[f"test_{length}"] = make_sequences(rng, params["test_size"], bits, [length])
        for name, seqs in splits.items():
            # One padded array per split: far faster to load than 320k small tensors.
            padded = np.zeros((len(seqs), max(len(s) for s in seqs), bits), dtype=np.uint8)
            for i, s in enumerate(seqs):
                padded[i, : len(s)] = s
            lengths = np.array([len(s) for s in seqs])
            torch.save({"bits": torch.from_numpy(padded), "lengths": torch.from_numpy(lengths)}, out / f"{name}.pt")
        return {
            "counts": {k: len(v) for k, v in splits.items()},
            "test_lengths": list(params["test_lengths"]),
            "model_defaults": {"input_size": bits + 1, "output_size": bits},
        }

    def load(self, data_dir: Path, split: str) -> list:
        d = torch.load(data_dir / f"{split}.pt")
        return [seq[:n] for seq, n in zip(d["bits"], d["lengths"].tolist())]

    def evaluate(self, model, run, plots: Path) -> tuple[dict, dict]:
        return evaluate_copy(model, run, plots)

    def parity_batches(self, data_dir: Path) -> list[tuple[str, dict]]:
        return copy_parity_batches(data_dir)

    def collate(self, items: list) -> dict:
        """x [B,2L+1,bits+1]: sequence, delimiter, blanks; y/mask mark the recall phase."""
        bsz, bits = len(items), items[0].shape[1]
        steps = 2 * max(len(s) for s in items) + 1
        x = torch.zeros(bsz, steps, bits + 1)
        y = torch.zeros(bsz, steps, bits)
        mask = torch.zeros(bsz, steps)
        for b, seq in enumerate(items):
            n = len(seq)
            x[b, :n, :bits] = seq.float()
            x[b, n, bits] = 1.0  # delimiter
            y[b, n + 1 : 2 * n + 1] = seq.float()
            mask[b, n + 1 : 2 * n + 1] = 1.0
        return {"x": x, "y": y, "mask": mask}

    def example_batch(self, cfg: dict, seed: int = 0, batch: int = 3) -> dict:
        """Random sequences of 3, 5 and 2 ``output_size``-bit vectors."""
        g = torch.Generator().manual_seed(seed)
        return self.collate([torch.randint(0, 2, (n, cfg["output_size"]), generator=g, dtype=torch.uint8)
                             for n in (3, 5, 2)[:batch]])


def evaluate_copy(model, run, plots: Path) -> tuple[dict, dict]:
    """Mean bit errors per sequence at each test length; traces of the heads at 20 and 40."""
    from pipeline import plots as P

    task = CopyTask()
    lengths = json.loads((run.data_dir / "manifest.json").read_text())["test_lengths"]
    errors = {}
    for length in lengths:
        seqs = task.load(run.data_dir, f"test_{length}")
        wrong = 0.0
        for start in range(0, len(seqs), 100):
            batch = task.collate(seqs[start : start + 100])
            out = model.predict(batch)
            wrong += float(((out["bits"] != batch["y"]).float() * batch["mask"].unsqueeze(-1)).sum())
            if start == 0 and length in (20, 40):
                n = 2 * length + 1
                P.memory_trace(batch["x"][0, :n].numpy(), batch["y"][0, :n].numpy(), out["bits"][0, :n].numpy(),
                               out["write_weights"][0, :n, 0].numpy(), out["read_weights"][0, :n, 0].numpy(),
                               plots / f"memory_trace_len{length}.png", f"{run.name}: copy, length {length}")
        errors[str(length)] = round(wrong / len(seqs), 4)
    metrics = {"bit_errors_per_seq": errors, **{f"bit_errors_{k}": v for k, v in errors.items()},
               "sequences_per_length": len(task.load(run.data_dir, f"test_{lengths[0]}"))}
    row = {"headline": {f"bit_errors_{k}": errors[k] for k in ("20", "40") if k in errors},
           "by_length": {"metric": "bit errors / sequence", "xlabel": "sequence length",
                         "labels": list(errors), "values": list(errors.values())}}
    return metrics, row


def copy_parity_batches(data_dir: Path) -> list[tuple[str, dict]]:
    """Real test sequences of lengths 10, 20 and 40 at batch sizes 1, 4 and 16."""
    task = CopyTask()
    cases = []
    for length, size in ((10, 1), (20, 4), (40, 16), (10, 16), (40, 1)):
        seqs = task.load(data_dir, f"test_{length}")[:size]
        cases.append((f"length {length} × batch {size}", task.collate(seqs)))
    return cases


register_task(CopyTask())
