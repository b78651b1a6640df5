"""Parity (Graves 2016 §4.1), scaled from 64 to ``bits`` inputs.

Each input vector has a random number k ∈ [1, bits] of randomly chosen entries set to ±1 (the
rest 0); the target is 1 when an odd number of them are +1. The whole vector arrives at once, so
any gain from ACT comes from pondering over it. Generated from a seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pipeline.tasks import Task, register_task


def make_split(rng: np.random.Generator, count: int, bits: int) -> dict[str, torch.Tensor]:
    """x [count,bits] in {-1,0,1} (int8), y [count] parity of the +1 entries, k nonzero counts."""
    k = rng.integers(1, bits + 1, size=count)
    x = np.zeros((count, bits), dtype=np.int8)
    for i, n in enumerate(k):
        x[i, rng.permutation(bits)[:n]] = rng.choice(np.array([-1, 1], dtype=np.int8), size=n)
    y = ((x == 1).sum(1) % 2).astype(np.int64)
    return {"x": torch.from_numpy(x), "y": torch.from_numpy(y), "k": torch.from_numpy(k.astype(np.int64))}


class ParityTask(Task):
    name = "parity"
    card = {"data": "random vectors of 16 inputs in {-1, 0, 1} generated from the seed in params.yaml",
            "licence": "generated: no third-party data",
            "paper": "Graves 2016, §4.1 (Adaptive Computation Time)"}
    serving = {}  # one graph, served as it is

    def prepare(self, params: dict, out: Path) -> dict:
        rng = np.random.default_rng(params["seed"])
        splits = {s: make_split(rng, params[f"{s}_size"], params["bits"]) for s in ("train", "val", "test")}
        for name, split in splits.items():
            torch.save(split, out / f"{name}.pt")
        return {"counts": {k: len(v["y"]) for k, v in splits.items()},
                "model_defaults": {"input_size": params["bits"], "output_size": 1}}

    def load(self, data_dir: Path, split: str) -> list:
        d = torch.load(data_dir / f"{split}.pt")
        return list(zip(d["x"], d["y"].tolist()))

    def length(self, item) -> int:
        return 1

    def collate(self, items: list) -> dict:
        return {"x": torch.stack([x for x, _ in items]).float(), "y": torch.tensor([y for _, y in items])}

    def example_batch(self, cfg: dict, seed: int = 0, batch: int = 3) -> dict:
        split = make_split(np.random.default_rng(seed), batch, cfg["input_size"])
        return self.collate(list(zip(split["x"], split["y"].tolist())))

    def evaluate(self, model, run, plots: Path) -> tuple[dict, dict]:
        from pipeline import plots as P

        data = torch.load(run.data_dir / "test.pt")
        outs = [model.predict({"x": data["x"][i : i + 1000].float()}) for i in range(0, len(data["y"]), 1000)]
        bits = torch.cat([o["bits"][:, 0] for o in outs])
        ponder = torch.cat([o["ponder"] for o in outs])
        halting = torch.cat([o["halting"] for o in outs])
        right = (bits == data["y"]).float()
        counts = sorted(set(data["k"].tolist()))
        by_k = {k: data["k"] == k for k in counts}
        acc_k = [round(float(right[m].mean()), 4) for m in by_k.values()]
        ponder_k = [round(float(ponder[m].mean()), 3) for m in by_k.values()]
        P.by_length({run.name: ponder_k}, [str(k) for k in counts], plots / "ponder_by_nonzero.png",
                    "nonzero inputs", "ponder time N + R", f"{run.name}: ponder time per input")
        used = int((halting > 0).any(0).nonzero().max()) + 1  # steps any input took
        P.alignment(halting[:12, :used].numpy(), [str(n + 1) for n in range(used)],
                    [f"k={int(data['k'][i])}" for i in range(12)], plots / "halting.png",
                    f"{run.name}: halting distribution over ponder steps (rows: test inputs)", "ponder step",
                    "test input (k nonzero)")
        metrics = {"accuracy": round(float(right.mean()), 4), "mean_ponder": round(float(ponder.mean()), 3),
                   "max_steps_used": used, "test_examples": len(right),
                   "accuracy_by_nonzero": dict(zip(map(str, counts), acc_k)),
                   "ponder_by_nonzero": dict(zip(map(str, counts), ponder_k))}
        row = {"headline": {"accuracy": metrics["accuracy"], "mean_ponder": metrics["mean_ponder"]},
               "by_length": {"metric": "accuracy", "xlabel": "nonzero inputs",
                             "labels": [str(k) for k in counts], "values": acc_k}}
        return metrics, row

    def parity_batches(self, data_dir: Path) -> list[tuple[str, dict]]:
        items = self.load(data_dir, "test")
        return [(f"batch {n}", self.collate(items[s : s + n])) for s, n in ((0, 1), (1, 7), (8, 256))]


register_task(ParityTask())
