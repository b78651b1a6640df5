"""Validation during training, the learning curves DVC plots, and the average of the last checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.utils import send_to_device
from torch import nn

from pipeline import checkpoint
from pipeline.config import RunConfig


@torch.no_grad()
def validate(model: nn.Module, loader, accelerator) -> dict[str, float]:
    """Mean loss and logs over this process's slices of the validation batches, summed across
    processes (so the figure is the same at every process count)."""
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    for batch in loader:
        loss, logs = model(send_to_device(batch, accelerator.device))
        n = torch.tensor(float(len(next(iter(batch.values())))))
        for key, value in {"loss": loss, **logs}.items():
            totals[key] = totals.get(key, torch.zeros(())) + value.detach().float().cpu() * n
        totals["_n"] = totals.get("_n", torch.zeros(())) + n
    model.train()
    keys = sorted(totals)
    summed = accelerator.reduce(torch.stack([totals[k] for k in keys]).to(accelerator.device), "sum")
    count = summed[keys.index("_n")].item()
    return {f"val_{k}": summed[i].item() / count for i, k in enumerate(keys) if k != "_n"}


def write_curves(folder: Path, curve: dict[str, list[dict]]) -> None:
    """``train_loss.csv`` and ``val_loss.csv`` (step first, the plotted loss last: DVC plots take the
    last column as y), declared as DVC plots of the train stage and drawn by ``dvc plots show``."""
    import csv

    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train_loss", curve["train"]), ("val_loss", curve["val"])):
        fields = ["step", *sorted({k for r in rows for k in r} - {"step", name}), name]
        with open(folder / f"{name}.csv", "w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
            out.writeheader()
            out.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)


def snapshot_due(cfg, step: int, total: int, eval_every: int) -> bool:
    """Whether the validation at ``step`` is one of the last ``average_last`` (their weights are kept)."""
    return cfg.average_last > 0 and step > total - cfg.average_last * eval_every


def mean_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the floating-point tensors of ``files`` (safetensors); other tensors
    are taken from the last file."""
    from safetensors.torch import load_file

    total: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            total[k] = total[k] + v.double() if k in total and v.is_floating_point() else (
                v.double() if v.is_floating_point() else v)
    last = load_file(str(files[-1]))
    return {k: (v / len(files)).to(last[k].dtype) if last[k].is_floating_point() else v for k, v in total.items()}


def average_into_best(run: RunConfig, plain: nn.Module, val_loader, accelerator, ckpt: Path, state: dict) -> None:
    """Average the snapshots in ``ckpt/average`` (the last ``average_last`` validations), validate the
    average, and make it the best checkpoint when its validation loss is lower. Records the outcome in
    ``state["averaged"]``; the snapshots are removed once it is recorded (in ``last``, by the caller)."""
    folder = ckpt / "average"
    files = sorted(folder.glob("*/model.safetensors"), key=lambda f: int(f.parent.name))
    count = torch.tensor(float(len(files)) if accelerator.is_main_process else 0.0, device=accelerator.device)
    count = int(accelerator.reduce(count, "sum").item())  # only the main process writes snapshots
    if count < 2:
        return
    weights = [mean_weights(files) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        torch.distributed.broadcast_object_list(weights, src=0)
    final = {k: v.clone() for k, v in plain.model.state_dict().items()}
    plain.model.load_state_dict(weights[0])
    val = validate(plain, val_loader, accelerator)["val_loss"]
    kept = val < state["best"]
    state["averaged"] = {"checkpoints": count, "steps": [int(f.parent.name) for f in files], "val_loss": val,
                         "kept": kept}
    if kept:
        state.update(best=val, best_step=state["step"])
        if accelerator.is_main_process:
            checkpoint.save(ckpt / "best", plain.model, run)
    else:
        plain.model.load_state_dict(final)
    accelerator.wait_for_everyone()
