"""Pointer tasks (Vinyals et al. 2015): point sets of varying size in, a sequence of positions out.

Shared by ``sort`` and ``convex_hull``: storage, collate, exact-sequence accuracy (greedy and beam
search through the same ``serving.decode`` loops the server runs), plots and parity batches.
Targets are 1-based positions followed by 0 (the END slot of ``models/pointer_net.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pipeline.tasks import Task, TaskError

IGNORE = -100  # padding in targets, skipped by the loss


class PointerTask(Task):
    """A pointer task: point sets of varying size in, a sequence of positions out."""

    point_size = 1
    # How a server turns raw points into graph inputs: points in, pointers and their
    # distributions out (serving.repository.PointerModel).
    serving = {"input": "points"}

    def generate(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[int]]:
        """One example: points [n, point_size] float32 and the 1-based target positions."""
        raise TaskError(f"task {self.name} has no example generator")

    def make_split(self, rng: np.random.Generator, count: int, sizes) -> dict[str, torch.Tensor]:
        """``count`` examples with N drawn from ``sizes``, stored padded (one tensor per field)."""
        ns = rng.choice(np.asarray(sizes), size=count)
        width = int(ns.max())
        points = np.zeros((count, width, self.point_size), dtype=np.float32)
        targets = np.full((count, width + 1), IGNORE, dtype=np.int64)
        for i, n in enumerate(ns):
            pts, tgt = self.generate(rng, int(n))
            points[i, :n] = pts
            targets[i, : len(tgt) + 1] = tgt + [0]
        return {"points": torch.from_numpy(points), "n": torch.from_numpy(ns.astype(np.int64)),
                "targets": torch.from_numpy(targets)}

    def prepare(self, params: dict, out: Path) -> dict:
        rng = np.random.default_rng(params["seed"])
        train_sizes = range(params["min_n"], params["max_n"] + 1)
        splits = {"train": self.make_split(rng, params["train_size"], train_sizes),
                  "val": self.make_split(rng, params["val_size"], train_sizes)}
        for n in params["test_n"]:
            splits[f"test_{n}"] = self.make_split(rng, params["test_size"], [n])
        for name, split in splits.items():
            torch.save(split, out / f"{name}.pt")
        return {"counts": {k: len(v["n"]) for k, v in splits.items()}, "test_n": list(params["test_n"]),
                "model_defaults": {"input_size": self.point_size}}

    def load(self, data_dir: Path, split: str) -> list[dict]:
        d = torch.load(data_dir / f"{split}.pt")
        out = []
        for pts, n, tgt in zip(d["points"], d["n"].tolist(), d["targets"]):
            out.append({"points": pts[:n], "target": tgt[tgt != IGNORE]})
        return out

    def length(self, item: dict) -> int:
        return len(item["points"])

    def collate(self, items: list[dict]) -> dict:
        """src [B,N,I] (zero-padded), src_len [B], tgt [B,T] (positions, END = 0, IGNORE pad)."""
        bsz = len(items)
        n_max = max(len(it["points"]) for it in items)
        t_max = max(len(it["target"]) for it in items)
        src = torch.zeros(bsz, n_max, self.point_size)
        tgt = torch.full((bsz, t_max), IGNORE, dtype=torch.long)
        for b, it in enumerate(items):
            src[b, : len(it["points"])] = it["points"]
            tgt[b, : len(it["target"])] = it["target"]
        return {"src": src, "src_len": torch.tensor([len(it["points"]) for it in items]), "tgt": tgt}

    def example_batch(self, cfg: dict, seed: int = 0, batch: int = 3) -> dict:
        """Instances of 7, 5 and 4 points drawn by the task's own generator (right-padded)."""
        rng = np.random.default_rng(seed)
        items = []
        for n in (7, 5, 4)[:batch]:
            points, target = self.generate(rng, n)
            items.append({"points": torch.from_numpy(points), "target": torch.tensor(target + [0])})
        return self.collate(items)

    def evaluate(self, model, run, plots: Path) -> tuple[dict, dict]:
        return evaluate_pointer(self, model, run, plots)

    def parity_batches(self, data_dir: Path) -> list[tuple[str, dict]]:
        """Real test sets at every test N, at batch sizes 1 and 16, and a batch mixing sizes."""
        import json

        sizes = json.loads((data_dir / "manifest.json").read_text())["test_n"]
        cases = []
        for n in sizes:
            items = self.load(data_dir, f"test_{n}")
            cases += [(f"N={n} × batch 1", self.collate(items[:1])), (f"N={n} × batch 16", self.collate(items[:16]))]
        mixed = [self.load(data_dir, f"test_{n}")[i] for i in range(4) for n in sizes]
        cases.append((f"N in {sizes} mixed × batch {len(mixed)}", self.collate(mixed)))
        return cases

    def plot_example(self, item: dict, pred: list[int], path: Path, title: str) -> None:
        """A task-specific picture of one prediction (none by default)."""


def exact(pred: list[int], target: list[int]) -> bool:
    return list(pred) == list(target)


def evaluate_pointer(task: PointerTask, model, run, plots: Path) -> tuple[dict, dict]:
    """Exact-sequence accuracy at each test N, greedy (batched ``predict``) and beam search
    (``serving.decode.beam_search`` over the PyTorch step graphs, as the server runs it)."""
    import json

    from pipeline import plots as P
    from pipeline.graphs import TorchGraph
    from serving import decode

    sizes = json.loads((run.data_dir / "manifest.json").read_text())["test_n"]
    beam = int(run.evaluate.get("beam", decode.BEAM))
    beam_limit = int(run.evaluate.get("beam_examples", 500))
    specs = model.export_graphs()
    enc, step = TorchGraph(specs["encoder"]), TorchGraph(specs["decoder_step"])
    metrics: dict = {"test_examples": {}}
    greedy_acc, beam_acc = {}, {}
    for n in sizes:
        items = task.load(run.data_dir, f"test_{n}")
        right = right_pointers = pointers = 0
        for start in range(0, len(items), 250):
            chunk = items[start : start + 250]
            batch = task.collate(chunk)
            out = model.predict(batch)
            for i, it in enumerate(chunk):
                pred = out["tokens"][i, : int(out["lengths"][i])].tolist()
                target = it["target"][:-1].tolist()  # without END
                right += exact(pred, target)
                m = min(len(pred), len(target))
                right_pointers += sum(p == t for p, t in zip(pred[:m], target[:m]))
                pointers += len(target)
                if start == 0 and i < 2:
                    rows = min(len(pred) + 1, out["attention"].shape[1])
                    labels = ["END"] + [_label(p) for p in it["points"]]
                    P.alignment(out["attention"][i, :rows, : len(labels)].numpy(), labels,
                                [labels[p] for p in pred] + ["END"][: rows - len(pred)],
                                plots / f"pointers_n{n}_{i}.png",
                                f"{run.name}: pointer distributions, N={n}", "input element",
                                "output step (pointed to)")
                    task.plot_example(it, pred, plots / f"example_n{n}_{i}.png", f"{run.name}, N={n}")
        greedy_acc[str(n)] = round(right / len(items), 4)
        metrics[f"pointer_acc_{n}"] = round(right_pointers / pointers, 4)
        hits = 0
        for it in items[:beam_limit]:
            src = it["points"].numpy()[None]
            r = decode.beam_search(enc, step, src, np.array([len(it["points"])]), 0, 0, len(it["points"]) + 1, beam,
                                   **decode.search_options(run.evaluate))
            hits += exact(r["tokens"].tolist(), it["target"][:-1].tolist())
        beam_acc[str(n)] = round(hits / min(len(items), beam_limit), 4)
        metrics["test_examples"][str(n)] = len(items)
    metrics.update({f"accuracy_{n}": v for n, v in greedy_acc.items()})
    metrics.update({f"accuracy_beam_{n}": v for n, v in beam_acc.items()})
    metrics.update(beam=beam, beam_examples=beam_limit)
    row = {"headline": {**{f"accuracy_{n}": v for n, v in greedy_acc.items()},
                        **{f"accuracy_beam_{n}": v for n, v in beam_acc.items()}},
           "by_length": {"metric": "exact-sequence accuracy (greedy)", "xlabel": "N (input points)",
                         "labels": list(greedy_acc), "values": list(greedy_acc.values())}}
    return metrics, row


def _label(point: torch.Tensor) -> str:
    return ",".join(f"{float(v):.2f}" for v in point)
