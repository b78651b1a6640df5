"""Stage ``train@<model>``: the one training loop every model shares.

The loop only sees ``Accelerator``: one process by default, many under ``accelerate launch`` or
``torchrun`` (DESIGN §6). Each model supplies ``loss(batch)``; the loop handles batching,
schedule, clipping, validation, MLflow logging (main process only) and checkpoints:
``<out>/checkpoint/last`` (weights + optimizer + progress, for resuming after a kill) and
``<out>/checkpoint/best`` (weights + resolved config, lowest validation loss).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import models
from pipeline import checkpoint, tracking
from pipeline.config import RunConfig, as_dict, resolve
from pipeline.tasks import get_task


class _LossModule(nn.Module):
    """Routes ``forward`` to ``model.loss`` so DDP's gradient sync sees every step."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch):
        return self.model.loss(batch)


def bucket_batches(lengths: list[int], batch_size: int, seed: int, shuffle: bool) -> list[list[int]]:
    """Batches of similar-length items (less padding, shorter decoder loops), in random order.

    Items are shuffled, sorted by length inside windows of 50 batches, cut into batches, and the
    batches shuffled again; deterministic given ``seed``.
    """
    order = list(range(len(lengths)))
    rng = random.Random(seed)
    if shuffle:
        rng.shuffle(order)
    window = batch_size * 50
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    if shuffle:
        rng.shuffle(batches)
    return batches


def make_loader(task, items: list, batch_size: int, seed: int, shuffle: bool) -> DataLoader:
    lengths = [task.length(it) for it in items]
    return DataLoader(items, batch_sampler=bucket_batches(lengths, batch_size, seed, shuffle),
                      collate_fn=task.collate)


def lr_lambda(cfg, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to ``min_lr_ratio``."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def has_accelerator() -> bool:
    """Whether a GPU-class device is visible. Accelerate only forms a CPU process group (gloo)
    under torchrun when told it runs on the CPU, so CPU-only machines must say so."""
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return (torch.cuda.is_available() or bool(mps and mps.is_available())
            or bool(xpu and xpu.is_available()))


def config_hash(run: RunConfig) -> str:
    """Identity of a training run, checked before resuming: the resolved config, the model's
    source code and the prepared data. A checkpoint of other code or data is never resumed."""
    digest = hashlib.sha256(json.dumps(as_dict(run), sort_keys=True).encode())
    model_module = importlib.import_module(models.REGISTRY[run.arch].model_cls.__module__)
    for module in (model_module, importlib.import_module("models.layers")):
        digest.update(inspect.getsource(module).encode())
    manifest = run.data_dir / "manifest.json"
    if manifest.exists():
        digest.update(json.dumps(json.loads(manifest.read_text()).get("files", {}), sort_keys=True).encode())
    return digest.hexdigest()[:16]


@torch.no_grad()
def validate(model: nn.Module, loader, accelerator) -> dict[str, float]:
    """Mean loss and logs over the loader, summed across processes."""
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    for batch in loader:
        loss, logs = model(batch)
        n = torch.tensor(float(len(next(iter(batch.values())))))
        for key, value in {"loss": loss, **logs}.items():
            totals[key] = totals.get(key, torch.zeros(())) + value.detach().float().cpu() * n
        totals["_n"] = totals.get("_n", torch.zeros(())) + n
    model.train()
    keys = sorted(totals)
    summed = accelerator.reduce(torch.stack([totals[k] for k in keys]).to(accelerator.device), "sum")
    count = summed[keys.index("_n")].item()
    return {f"val_{k}": summed[i].item() / count for i, k in enumerate(keys) if k != "_n"}


def train(
    run: RunConfig,
    out_dir: Path | None = None,
    *,
    report: Callable[[dict], None] | None = None,
    parent_run_id: str | None = None,
    progress: bool = True,
) -> dict:
    """Train ``run`` with the shared loop; returns a summary (best val loss, steps, seconds).

    Args:
        out_dir: where ``checkpoint/`` goes (default ``run.run_dir``).
        report: called with the validation metrics after each validation (Ray Tune).
        parent_run_id: MLflow parent (a tune run); the training run becomes its child.
        progress: show a progress bar on the main process.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    accelerator = Accelerator(cpu=not has_accelerator())
    cfg = run.train
    set_seed(cfg.seed)
    out_dir = Path(out_dir or run.run_dir)
    ckpt = out_dir / "checkpoint"
    task = get_task(run.task)
    train_items = task.load(run.data_dir, "train")
    val_loader = accelerator.prepare(make_loader(task, task.load(run.data_dir, "val"), cfg.batch_size, 0, False))
    steps_per_epoch = math.ceil(len(train_items) / cfg.batch_size)
    steps_per_epoch = math.ceil(steps_per_epoch / accelerator.num_processes)
    total = steps_per_epoch * cfg.epochs
    total = min(total, cfg.max_steps) if cfg.max_steps else total
    eval_every = cfg.eval_every or steps_per_epoch

    model = models.build(run.arch, run.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total))
    wrapped, optimizer, scheduler = accelerator.prepare(_LossModule(model), optimizer, scheduler)

    digest = config_hash(run)
    state = {"step": 0, "best": float("inf"), "best_step": 0, "mlflow_run_id": None}
    resumed = checkpoint.load_last(ckpt, digest, accelerator.unwrap_model(wrapped).model, optimizer, scheduler)
    if resumed:
        state.update(resumed)
        accelerator.print(f"resuming {run.name} from step {state['step']}")
    main = accelerator.is_main_process
    started = time.time()
    with tracking.run(run.name, "train", enabled=main, parent_run_id=parent_run_id,
                      params=as_dict(run)) as mlflow:
        bar = tqdm(total=total, initial=state["step"], disable=not (main and progress),
                   desc=f"train {run.name}", mininterval=2, dynamic_ncols=True)
        last_val: dict[str, float] = {}
        while state["step"] < total:
            epoch = state["step"] // steps_per_epoch
            loader = accelerator.prepare(make_loader(task, train_items, cfg.batch_size, cfg.seed + epoch, True))
            loader = accelerator.skip_first_batches(loader, state["step"] - epoch * steps_per_epoch)
            for batch in loader:
                loss, logs = wrapped(batch)
                optimizer.zero_grad(set_to_none=True)
                accelerator.backward(loss)
                if cfg.grad_clip:
                    accelerator.clip_grad_norm_(wrapped.parameters(), cfg.grad_clip)
                optimizer.step()
                scheduler.step()
                state["step"] += 1
                bar.update(1)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"{run.name}: loss became {loss.item()} at step {state['step']}")
                if mlflow and state["step"] % cfg.log_every == 0:
                    mlflow.log_metrics({"train_loss": loss.item(), "lr": scheduler.get_last_lr()[0],
                                        **{f"train_{k}": v.item() for k, v in logs.items()}},
                                       step=state["step"])
                    bar.set_postfix(loss=f"{loss.item():.3f}")
                if state["step"] % eval_every == 0 or state["step"] >= total:
                    last_val = validate(wrapped, val_loader, accelerator)
                    improved = last_val["val_loss"] < state["best"]
                    if improved:
                        state.update(best=last_val["val_loss"], best_step=state["step"])
                    if mlflow:
                        mlflow.log_metrics(last_val, step=state["step"])
                        state["mlflow_run_id"] = mlflow.active_run().info.run_id
                    if main:
                        unwrapped = accelerator.unwrap_model(wrapped).model
                        checkpoint.save(ckpt / "last", unwrapped, run, optimizer, scheduler, {**state, "hash": digest})
                        if improved:
                            checkpoint.save(ckpt / "best", unwrapped, run)
                    accelerator.wait_for_everyone()
                    bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{last_val['val_loss']:.3f}")
                    if report:
                        report({**last_val, "step": state["step"]})
                if state["step"] >= total:
                    break
        bar.close()
        summary = {"best_val_loss": state["best"], "best_step": state["best_step"],
                   "steps": state["step"], "train_seconds": round(time.time() - started, 1),
                   "processes": accelerator.num_processes}
        if mlflow:
            mlflow.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            if main:
                (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
    accelerator.end_training()
    return summary


def main(argv: list[str] | None = None) -> None:
    from pipeline.cli import parse_overrides, run_cli

    ap = argparse.ArgumentParser(description="Train one model entry of params.yaml.")
    ap.add_argument("model")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="override config values, e.g. lr=3e-4 epochs=1")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default runs/<model>)")
    args = ap.parse_args(argv)
    run_cli(lambda: train(resolve(args.model, overrides=parse_overrides(args.set)), args.out))


if __name__ == "__main__":
    main()
