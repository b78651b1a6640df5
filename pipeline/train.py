"""Stage ``train@<model>``: the one training loop every model shares.

The loop only sees ``Accelerator``: one process by default, many under ``accelerate launch`` or
``torchrun`` (docs/cluster.md). Each model supplies ``loss(batch)``; the loop
handles batching, schedule, clipping, validation, MLflow logging (main process only) and
checkpoints: ``<out>/checkpoint/last`` (weights, optimizer, schedule, every rank's RNG and the
data position, for resuming after a kill) and ``<out>/checkpoint/best`` (weights + resolved
config, lowest validation loss).

Scale-independent semantics: ``batch_size`` is the *global* batch. Every process builds the same
global batches and takes its contiguous slice of each, so an optimizer step sees the same items,
the step count and the learning-rate schedule are the same on 1 or N processes, and (without
dropout, equal-sized slices) the averaged gradient equals the full-batch gradient.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import send_to_device
from torch import nn
from torch.utils.data import DataLoader

import models
from pipeline import checkpoint, tracking
from pipeline.config import ROOT, RunConfig, UserError, as_dict, resolve
from pipeline.tasks import get_task


class NonFiniteLoss(UserError, FloatingPointError):
    """The training loss became NaN or infinite: the CLI prints one sentence (a ``UserError``), Ray
    Tune records the trial as failed (a ``FloatingPointError``)."""


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


def token_batches(lengths: list[int], max_tokens: int, seed: int, shuffle: bool) -> list[list[int]]:
    """Batches of at most ``max_tokens`` padded tokens (items x the batch's longest length), cut from
    the whole set sorted by length, so a batch carries almost no padding.

    The cuts depend on the sorted lengths alone, so every epoch has the same number of batches of the
    same sizes (the schedule's step count is known up front); ties are broken by a ``seed``-shuffled
    order, so batch contents still change between epochs, and the batch order is shuffled. An item
    longer than ``max_tokens`` is a batch of its own. Deterministic given ``seed``.
    """
    order = list(range(len(lengths)))
    rng = random.Random(seed)
    if shuffle:
        rng.shuffle(order)
    order.sort(key=lambda i: lengths[i])  # stable: equal lengths keep the shuffled order
    batches, start = [], 0
    for n, i in enumerate(order):
        if n > start and lengths[i] * (n - start + 1) > max_tokens:  # ascending: lengths[i] is the longest
            batches.append(order[start:n])
            start = n
    batches.append(order[start:])
    if shuffle:
        rng.shuffle(batches)
    return batches


def epoch_batches(cfg, lengths: list[int], epoch: int) -> list[list[int]]:
    """The global training batches of ``epoch``: by tokens (``max_tokens``) or by items (``batch_size``)."""
    if cfg.max_tokens:
        return token_batches(lengths, cfg.max_tokens, cfg.seed + epoch, True)
    return bucket_batches(lengths, cfg.batch_size, cfg.seed + epoch, True)


def shard(batches: list[list[int]], rank: int, world: int, fill: bool = True) -> list[list[int]]:
    """This process's contiguous slice of every global batch.

    With ``fill`` (training) a global batch smaller than ``world`` is repeated to fill every
    slice: a process with an empty slice would leave the others waiting in the gradient
    all-reduce. Without it (validation, no collective per batch) such slices stay empty.
    """
    if world == 1:
        return batches
    out = []
    for b in batches:
        if fill and len(b) < world:
            b = (b * world)[:world]
        out.append(b[rank * len(b) // world : (rank + 1) * len(b) // world])
    return out


def make_loader(task, items: list, batches: list[list[int]]) -> DataLoader:
    # Creating an iterator of this loader draws one seed from torch's global RNG (DataLoader's
    # base seed); resume relies on that happening at the same point as in an uninterrupted run.
    return DataLoader(items, batch_sampler=batches, collate_fn=task.collate)


SCHEDULES = ("cosine", "inverse_sqrt")


def lr_lambda(cfg, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` or inverse-square-root decay."""
    if cfg.schedule not in SCHEDULES:
        raise UserError(f"train.schedule is '{cfg.schedule}'; use one of {', '.join(SCHEDULES)}")

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "inverse_sqrt":
            return math.sqrt(max(1, cfg.warmup_steps) / (step + 1))
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


RNNS = (nn.LSTM, nn.GRU, nn.RNN)  # the recurrent layers PyTorch runs as one fused (oneDNN on CPU) kernel
_BF16_RNN: dict[type, bool] = {}


def cpu_runs_bf16(rnn: type) -> bool:
    """Whether this CPU runs ``rnn`` (one of RNNS) under bf16 autocast. On x86 CPUs without native
    bf16 (AVX2 only, e.g. AMD Zen 3) PyTorch 2.13 hands a bf16 ``nn.LSTM`` to oneDNN all the same,
    which fails with "could not create a primitive descriptor for the LSTM forward propagation
    primitive". Probed once per type and process on a 4-unit layer, whose initialisation draws from
    a forked RNG: the training's random stream is the same with or without the probe."""
    if rnn not in _BF16_RNN:
        try:
            with torch.random.fork_rng(devices=[]), torch.autocast("cpu", dtype=torch.bfloat16):
                rnn(4, 4, batch_first=True)(torch.zeros(1, 2, 4))
            _BF16_RNN[rnn] = True
        except RuntimeError:
            _BF16_RNN[rnn] = False
    return _BF16_RNN[rnn]


def _fp32_forward(forward: Callable) -> Callable:
    def run(input, hx=None):
        # Autocast off inside, inputs cast up (a PackedSequence has .float() too): the layer runs
        # exactly as in an fp32 model; what consumes its output is autocast again.
        with torch.autocast("cpu", enabled=False):
            if hx is not None:
                hx = tuple(h.float() for h in hx) if isinstance(hx, tuple) else hx.float()
            return forward(input.float(), hx)
    return run


def keep_rnns_fp32(model: nn.Module) -> list[str]:
    """bf16 on a CPU that cannot run a recurrent layer under autocast: those layers of ``model``
    run in fp32, everything else stays bf16 (instead of the training stopping in oneDNN). Returns
    their names, empty on a CPU that runs them all (there nothing changes). Since a CPU without
    native bf16 trains wholly in fp32 (cpu_has_native_bf16), this guards CPUs that have bf16 but
    lack a bf16 kernel for one layer type."""
    names = []
    for name, module in model.named_modules():
        kind = next((t for t in RNNS if isinstance(module, t)), None)
        if kind is not None and not cpu_runs_bf16(kind):
            module.forward = _fp32_forward(module.forward)
            names.append(name)
    return names


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware, by oneDNN's own test (AVX-512 BW/VL/DQ on x86,
    bf16 instructions on ARM). Without it PyTorch emulates bf16 autocast, which is correct but far
    slower than fp32: on an AVX2-only AMD EPYC a ``bahdanau`` training step took 13.9 s against
    1.0 s in fp32, a ``transformer`` step 23 s against 1.2 s (docs/results.md, "bf16 on a CPU
    without bf16")."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no bf16 kernels to run natively
        return False


def has_accelerator() -> bool:
    """Whether a GPU-class device is visible. Accelerate only forms a CPU process group (gloo)
    under torchrun when told it runs on the CPU, so CPU-only machines must say so."""
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return (torch.cuda.is_available() or bool(mps and mps.is_available())
            or bool(xpu and xpu.is_available()))


# Wall-clock seconds between resume checkpoints (besides every validation), so a kill loses at
# most this much work. Infrastructure, not a hyper-parameter: it comes from the environment, is
# not part of the run's identity or its saved config, and cannot change what is learned.
CHECKPOINT_SECONDS_ENV = "ATTNZOO_CHECKPOINT_SECONDS"
CHECKPOINT_SECONDS = 120.0


def checkpoint_seconds() -> float:
    value = os.environ.get(CHECKPOINT_SECONDS_ENV, "")
    try:
        seconds = float(value) if value else CHECKPOINT_SECONDS
    except ValueError:
        raise UserError(f"{CHECKPOINT_SECONDS_ENV}='{value}' is not a number of seconds (e.g. 120)") from None
    if seconds <= 0:
        raise UserError(f"{CHECKPOINT_SECONDS_ENV} must be positive seconds (e.g. 120), not {value}")
    return seconds


# The code a run's identity covers: train@'s code deps in dvc.yaml, file for file
# (tests/test_train.py checks they agree), so whenever DVC re-runs train@ for a code change the loop
# starts over instead of taking a finished checkpoint of other code as the result.
TRAIN_CODE = ("models/{arch}.py", "models/layers.py", "models/__init__.py", "pipeline/config.py",
              "pipeline/checkpoint.py", "pipeline/files.py", "pipeline/tracking.py", "pipeline/train.py",
              "pipeline/tasks", "serving/features.py")


def code_files(arch: str) -> list[Path]:
    out = []
    for entry in TRAIN_CODE:
        path = ROOT / entry.format(arch=arch)
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def config_hash(run: RunConfig) -> str:
    """Identity of a training run, checked before resuming: the resolved config, the code that
    trains it (:data:`TRAIN_CODE`) and the prepared data. A checkpoint of other code or data is
    never resumed."""
    digest = hashlib.sha256(json.dumps(as_dict(run), sort_keys=True).encode())
    for path in code_files(run.arch):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    manifest = run.data_dir / "manifest.json"
    if manifest.exists():
        digest.update(json.dumps(json.loads(manifest.read_text()).get("files", {}), sort_keys=True).encode())
    return digest.hexdigest()[:16]


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


def rng_state() -> dict:
    """Every RNG a training step may draw from (torch, numpy, Python), for exact resume."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(saved: dict) -> None:
    torch.set_rng_state(saved["torch"])
    np.random.set_state(saved["numpy"])
    random.setstate(saved["python"])


def gather_rng(accelerator) -> list[dict]:
    """Each process's RNG state, in rank order (ranks draw differently: their slices differ)."""
    if accelerator.num_processes == 1:
        return [rng_state()]
    out: list = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(out, rng_state())
    return out


# Steps between the ranks' agreements (below). Each agreement is a collective of its own, and a
# per-step one cost ~5 ms of a ~170 ms step on 2 CPU processes (docs/benchmarks.md); a non-finite
# loss now stops every rank at most this many steps late, and a wall-clock checkpoint comes that
# many steps after it is due. Validation steps and the last step always agree.
AGREE_EVERY = 10


def agree(accelerator, bad_step: int, due: bool) -> tuple[int, bool]:
    """Over all processes: the first step at which any rank saw a non-finite loss (0: none), and
    whether any rank's checkpoint is due, so every rank takes the same branch (stop, save) and none
    is left waiting in a collective."""
    if accelerator.num_processes == 1:
        return bad_step, due
    # MAX of -step is -(the earliest bad step); ranks without one send -inf
    t = torch.tensor([-bad_step if bad_step else -math.inf, float(due)], device=accelerator.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    first, due = t.tolist()
    return (0 if first == -math.inf else int(-first)), bool(due)


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

    cfg = run.train
    if cfg.precision not in ("fp32", "bf16"):
        raise UserError(f"{run.name}: train.precision is '{cfg.precision}'; use fp32 or bf16")
    # Accelerate keeps its state per process: a second training in one process (tests, a Ray worker
    # reused by another tune trial) would silently keep the first one's precision. The distributed
    # state (PartialState) stays. Only an explicit bf16 is passed: with fp32 the launcher's choice
    # stands (gpu_check launches with --mixed_precision bf16).
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)
    on_cpu = not has_accelerator()
    # bf16 is a speed setting, not part of the recipe: where the CPU would only emulate it, fp32 is
    # an order of magnitude faster (cpu_has_native_bf16), so the run takes fp32 and says so.
    emulated_bf16 = on_cpu and not cpu_has_native_bf16()
    precision = "fp32" if cfg.precision == "bf16" and emulated_bf16 else cfg.precision
    accelerator = Accelerator(cpu=on_cpu, mixed_precision="bf16" if precision == "bf16" else None)
    if precision != cfg.precision:
        accelerator.print(f"{run.name}: precision bf16 runs as fp32 here: this CPU has no native bf16, and emulating "
                          "it makes each step 10-20x slower (train_summary.json: precision)")
    elif accelerator.mixed_precision == "bf16" and emulated_bf16:
        accelerator.print(f"{run.name}: the launcher asked for bf16, which this CPU only emulates (10-20x slower "
                          "than fp32); launch without --mixed_precision bf16 to train in fp32")
    rank, world = accelerator.process_index, accelerator.num_processes
    set_seed(cfg.seed)
    out_dir = Path(out_dir or run.run_dir)
    ckpt = out_dir / "checkpoint"
    task = get_task(run.task)
    train_items = task.load(run.data_dir, "train")
    lengths = [task.length(it) for it in train_items]
    val_items = task.load(run.data_dir, "val")
    if len(val_items) < world:
        raise UserError(f"{run.name}: {len(val_items)} validation items cannot be split over {world} processes; "
                        "prepare a larger validation split or use fewer processes")
    val_batches = bucket_batches([task.length(it) for it in val_items], cfg.batch_size, 0, False)
    val_loader = make_loader(task, val_items, [b for b in shard(val_batches, rank, world, fill=False) if b])
    # Global batches, the same at any process count (by tokens: every epoch cuts the same sizes).
    steps_per_epoch = (len(epoch_batches(cfg, lengths, 0)) if cfg.max_tokens
                       else math.ceil(len(train_items) / cfg.batch_size))
    total = steps_per_epoch * cfg.epochs
    total = min(total, cfg.max_steps) if cfg.max_steps else total
    eval_every = cfg.eval_every or steps_per_epoch

    model = models.build(run.arch, run.model)
    cpu_bf16 = accelerator.mixed_precision == "bf16" and accelerator.device.type == "cpu"
    fp32_rnns = keep_rnns_fp32(model) if cpu_bf16 else []
    if fp32_rnns:
        accelerator.print(f"{run.name}: this CPU cannot run {', '.join(fp32_rnns)} under bf16 autocast (no native "
                          "bf16); they run in fp32, the rest of the model in bf16 (train_summary.json: fp32_rnns)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    # Not passed to accelerator.prepare: a prepared scheduler steps once per *process* on each
    # optimizer step (N times too fast on N processes). Stepped here once per global step.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total))
    wrapped, optimizer = accelerator.prepare(_LossModule(model), optimizer)
    plain = accelerator.unwrap_model(wrapped)  # validation needs no gradient sync

    digest = config_hash(run)
    # "seconds": training time of the processes before this one, up to the checkpoint they left, so that
    # a resumed run's train_seconds counts the whole run, not only its last process.
    # "curve": the learning curve so far ([step, train loss] every log_every steps, [step, val metrics...]
    # at each validation), in the checkpoint so that a resumed run's curve is the uninterrupted one.
    state = {"step": 0, "best": float("inf"), "best_step": 0, "mlflow_run_id": None, "seconds": 0.0,
             "curve": {"train": [], "val": []}}
    resumed = checkpoint.load_last(ckpt, digest, plain.model, optimizer, scheduler)
    saved_rng = None
    if resumed:
        saved_rng = resumed.pop("rng")[rank] if resumed.get("rng") else None
        state.update(resumed)
        accelerator.print(f"resuming {run.name} from step {state['step']}")
    elif accelerator.is_main_process:  # a fresh run: snapshots of another run are not averaged
        shutil.rmtree(ckpt / "average", ignore_errors=True)
    main = accelerator.is_main_process
    every = checkpoint_seconds()
    started, seconds_before = time.time(), state["seconds"]

    def save_last() -> None:
        rngs = gather_rng(accelerator)  # a collective: every rank takes part
        state["seconds"] = seconds_before + time.time() - started
        if main:
            checkpoint.save(ckpt / "last", plain.model, run, optimizer, scheduler,
                            {**state, "hash": digest, "rng": rngs})
        accelerator.wait_for_everyone()

    with tracking.run(run.name, "train", enabled=main, parent_run_id=parent_run_id,
                      params=as_dict(run), run_id=state["mlflow_run_id"]) as mlflow:
        if mlflow:
            state["mlflow_run_id"] = mlflow.active_run().info.run_id
        bar = tqdm(total=total, initial=state["step"], disable=not (main and progress),
                   desc=f"train {run.name}", mininterval=2, dynamic_ncols=True)
        last_val: dict[str, float] = {}
        last_save = time.monotonic()
        bad_step = 0  # the step of this rank's first non-finite loss, until the ranks next agree
        while state["step"] < total:
            epoch, position = divmod(state["step"], steps_per_epoch)
            batches = shard(epoch_batches(cfg, lengths, epoch), rank, world)
            # The saved RNG state is the one right after the last finished step. An uninterrupted
            # run creates an epoch's iterator (which draws a seed) at the epoch's start, so a
            # resume restores the state before creating it at a boundary, after it mid-epoch.
            if saved_rng is not None and position == 0:
                set_rng_state(saved_rng)
                saved_rng = None
            iterator = iter(make_loader(task, train_items, batches[position:]))
            if saved_rng is not None:
                set_rng_state(saved_rng)
                saved_rng = None
            for batch in iterator:
                loss, logs = wrapped(send_to_device(batch, accelerator.device))
                step = state["step"] + 1  # the step being taken
                if not bad_step and not torch.isfinite(loss).item():
                    bad_step = step
                due = False
                if world == 1 or step % AGREE_EVERY == 0 or step % eval_every == 0 or step >= total:
                    bad_step, due = agree(accelerator, bad_step, time.monotonic() - last_save >= every)
                    if bad_step:  # every rank stops here, before a collective the others would never join
                        where = f" on one or more of {world} processes" if world > 1 else ""
                        raise NonFiniteLoss(
                            f"{run.name}: loss became non-finite (nan or inf) at step {bad_step}{where}; "
                            f"lower lr or grad_clip (--set lr=... grad_clip=...) and re-run")
                optimizer.zero_grad(set_to_none=True)
                accelerator.backward(loss)
                if cfg.grad_clip:
                    accelerator.clip_grad_norm_(wrapped.parameters(), cfg.grad_clip)
                optimizer.step()
                scheduler.step()
                state["step"] += 1
                bar.update(1)
                if mlflow and state["step"] % cfg.log_every == 0:
                    mlflow.log_metrics({"train_loss": loss.item(), "lr": scheduler.get_last_lr()[0],
                                        **{f"train_{k}": v.item() for k, v in logs.items()}},
                                       step=state["step"])
                    state["curve"]["train"].append({"step": state["step"], "train_loss": loss.item()})
                    bar.set_postfix(loss=f"{loss.item():.3f}")
                validating = state["step"] % eval_every == 0 or state["step"] >= total
                if validating:
                    last_val = validate(plain, val_loader, accelerator)
                    improved = last_val["val_loss"] < state["best"]
                    if improved:
                        state.update(best=last_val["val_loss"], best_step=state["step"])
                    if mlflow:
                        mlflow.log_metrics(last_val, step=state["step"])
                        state["curve"]["val"].append({"step": state["step"], **last_val})
                    if main and improved:
                        checkpoint.save(ckpt / "best", plain.model, run)
                    if main and snapshot_due(cfg, state["step"], total, eval_every):
                        checkpoint.save(ckpt / "average" / str(state["step"]), plain.model, run)
                    bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{last_val['val_loss']:.3f}")
                if validating or due:
                    save_last()
                    last_save = time.monotonic()
                if validating and report:
                    report({**last_val, "step": state["step"]})
                if state["step"] >= total:
                    break
        bar.close()
        if cfg.average_last and "averaged" not in state:
            average_into_best(run, plain, val_loader, accelerator, ckpt, state)
            save_last()
        if main:  # recorded in last (or never due): the snapshots are spent
            shutil.rmtree(ckpt / "average", ignore_errors=True)
        summary = {"best_val_loss": state["best"], "best_step": state["best_step"],
                   "steps": state["step"], "train_seconds": round(seconds_before + time.time() - started, 1),
                   "processes": world, **({"fp32_rnns": fp32_rnns} if fp32_rnns else {}),
                   **({"averaged": state["averaged"]} if "averaged" in state else {}),
                   # the precision the run used, where it is not the one asked for (cpu_has_native_bf16)
                   **({"precision": precision} if precision != cfg.precision else {})}
        if mlflow:
            mlflow.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            if main:
                (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
                write_curves(out_dir / "learning_curves", state["curve"])
    accelerator.end_training()
    return summary


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


LAUNCHER_ENV = "ATTNZOO_LAUNCHER"


def launch_command(launcher: str, argv: list[str]) -> list[str]:
    """``ATTNZOO_LAUNCHER="torchrun --nnodes 2 ..."`` + this stage's arguments → the command that
    runs this module under that launcher (torchrun and ``accelerate launch`` both take ``-m``)."""
    return [*shlex.split(launcher), "-m", "pipeline.train", *argv]


def main(argv: list[str] | None = None) -> None:
    from pipeline.cli import check_override_types, parse_overrides, run_cli

    ap = argparse.ArgumentParser(
        description="Train one model entry of params.yaml.",
        epilog=f"Multi-node: set {LAUNCHER_ENV} to a launch prefix (e.g. 'torchrun --nnodes 2 --nproc_per_node 1 "
               "--node_rank 0 --master_addr HEAD --master_port 29500') and this command, or `dvc repro "
               "train@MODEL`, re-runs itself under it; see docs/cluster.md.")
    ap.add_argument("model", help="a params.yaml entry, e.g. ntm (`attnzoo list` shows them)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="override config values, e.g. lr=3e-4 epochs=1")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default runs/<model>)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    launcher = os.environ.get(LAUNCHER_ENV, "").strip()
    # A launched worker has RANK set (torchrun, accelerate launch): it trains; it must not launch again.
    if launcher and "RANK" not in os.environ:
        cmd = launch_command(launcher, argv)
        print(f"{LAUNCHER_ENV}: {shlex.join(cmd)}", flush=True)
        try:
            code = subprocess.call(cmd)
        except FileNotFoundError:
            print(f"error: {LAUNCHER_ENV}='{launcher}' names a program that is not installed "
                  f"(install it, or unset {LAUNCHER_ENV} to train in this process)", file=sys.stderr)
            raise SystemExit(2) from None
        raise SystemExit(code)
    overrides = parse_overrides(args.set)

    def body():
        check_override_types(args.model, overrides)
        return train(resolve(args.model, overrides=overrides), args.out)

    run_cli(body)


if __name__ == "__main__":
    main()
