"""The training loop: ``train(run)`` builds the model, optimizer and schedule, resumes what a killed
run left, steps through the global batches, validates, and keeps the best and last checkpoints."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import send_to_device
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader

import models
from models.layers import ChunkedLoss
from pipeline import checkpoint, tracking
from pipeline.config import RunConfig, UserError, as_dict, switched_on
from pipeline.tasks import Task, get_task
from pipeline.training.batches import bucket_batches, epoch_batches, make_loader, shard
from pipeline.training.memory import keep_freed_memory, lay_out
from pipeline.training.precision import keep_rnns_fp32, make_accelerator
from pipeline.training.resume import AGREE_EVERY, agree, checkpoint_seconds, config_hash, gather_rng, set_rng_state
from pipeline.training.validation import average_into_best, snapshot_due, validate, write_curves


class NonFiniteLoss(UserError, FloatingPointError):
    """The training loss became NaN or infinite: the CLI prints one sentence (a ``UserError``), Ray
    Tune records the trial as failed (a ``FloatingPointError``)."""


def compile_method(model: nn.Module, name: str, entry: str) -> None:
    """Replace ``model.<name>`` with its ``torch.compile``d self. A method, not the module: the state_dict
    keeps its names (checkpoints load anywhere), and validation runs the same code (its own graph, no grad)."""
    method = getattr(model, name, None)
    if not callable(method):
        raise UserError(f"{entry}: train.compile is '{name}', which this model does not have; use loss or the "
                        "method its loss calls at every time step (step, _readout)")
    setattr(model, name, torch.compile(method))


def step_kernels(cfg, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """A context for each training step's forward: on a CPU, the SDPA backends ``train.cpu_sdpa`` allows and
    the token loss ``train.cpu_loss`` names."""
    explicit = switched_on("cpu_sdpa", cfg.cpu_sdpa, "PyTorch's choice", "math")
    chunked = switched_on("cpu_loss", cfg.cpu_loss, "PyTorch's cross-entropy", "chunked")
    wanted = []
    if device.type == "cpu" and explicit:
        wanted.append(lambda: sdpa_kernel(SDPBackend.MATH))
    if device.type == "cpu" and chunked:
        wanted.append(ChunkedLoss)

    def entered() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for context in wanted:
            stack.enter_context(context())
        return stack

    return entered if wanted else contextlib.nullcontext


class _LossModule(nn.Module):
    """Routes ``forward`` to ``model.loss`` so DDP's gradient sync sees every step."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch):
        return self.model.loss(batch)


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
    from accelerate.utils import set_seed

    accelerator, precision = make_accelerator(run)
    set_seed(run.train.seed)
    out_dir = Path(out_dir or run.run_dir)
    trainer = _Trainer(run, accelerator, _load_data(run, get_task(run.task), accelerator), out_dir)
    with tracking.run(run.name, "train", enabled=trainer.main, parent_run_id=parent_run_id,
                      params=as_dict(run), run_id=trainer.state["mlflow_run_id"]) as mlflow:
        if mlflow:
            trainer.state["mlflow_run_id"] = mlflow.active_run().info.run_id
        trainer.fit(mlflow, report, progress)
        summary = trainer.finish(mlflow, precision)
    accelerator.end_training()
    return summary


@dataclass
class _Data:
    """The run's items and the schedule's step counts, the same at any process count."""

    task: Task
    train_items: list
    lengths: list[int]
    val_loader: DataLoader   # this process's slice of every validation batch
    steps_per_epoch: int
    total: int
    eval_every: int


def _load_data(run: RunConfig, task: Task, accelerator) -> _Data:
    cfg, rank, world = run.train, accelerator.process_index, accelerator.num_processes
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
    return _Data(task, train_items, lengths, val_loader, steps_per_epoch, total, cfg.eval_every or steps_per_epoch)


class _Trainer:
    """One run's model, optimizer, schedule and progress (``state``, saved in ``checkpoint/last``)."""

    def __init__(self, run: RunConfig, accelerator, data: _Data, out_dir: Path):
        cfg = self.cfg = run.train
        self.run, self.acc, self.data, self.out_dir = run, accelerator, data, out_dir
        self.ckpt = out_dir / "checkpoint"
        model = models.build(run.arch, run.model)
        cpu_bf16 = accelerator.mixed_precision == "bf16" and accelerator.device.type == "cpu"
        self.fp32_rnns = keep_rnns_fp32(model) if cpu_bf16 else []
        if self.fp32_rnns:
            accelerator.print(f"{run.name}: this CPU cannot run {', '.join(self.fp32_rnns)} under bf16 autocast (no "
                              "native bf16); they run in fp32, the rest of the model in bf16 (train_summary.json: "
                              "fp32_rnns)")
        lay_out(model, cfg.memory_format)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                      **({"fused": True} if cfg.fused_adamw else {}))
        if cfg.compile:
            compile_method(model, cfg.compile, run.name)
        self.kernels = step_kernels(cfg, accelerator.device)
        keep_freed_memory(cfg.cpu_heap, accelerator.device.type)
        # Not passed to accelerator.prepare: a prepared scheduler steps once per *process* on each
        # optimizer step (N times too fast on N processes). Stepped here once per global step.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, data.total))
        self.wrapped, self.optimizer = accelerator.prepare(_LossModule(model), optimizer)
        self.plain = accelerator.unwrap_model(self.wrapped)  # validation needs no gradient sync
        self.digest = config_hash(run)
        # "seconds": training time of the processes before this one, up to the checkpoint they left, so that
        # a resumed run's train_seconds counts the whole run, not only its last process.
        # "curve": the learning curve so far ([step, train loss] every log_every steps, [step, val metrics...]
        # at each validation), in the checkpoint so that a resumed run's curve is the uninterrupted one.
        self.state = {"step": 0, "best": float("inf"), "best_step": 0, "mlflow_run_id": None, "seconds": 0.0,
                      "curve": {"train": [], "val": []}}
        self.saved_rng = self._resume()
        self.main = accelerator.is_main_process
        self.every = checkpoint_seconds()
        self.started, self.seconds_before = time.time(), self.state["seconds"]
        self.last_save = time.monotonic()
        self.bad_step = 0  # the step of this rank's first non-finite loss, until the ranks next agree

    def _resume(self) -> dict | None:
        """Take up ``checkpoint/last`` of this run's identity; returns this rank's saved RNG state."""
        resumed = checkpoint.load_last(self.ckpt, self.digest, self.plain.model, self.optimizer, self.scheduler)
        if not resumed:
            if self.acc.is_main_process:  # a fresh run: snapshots of another run are not averaged
                shutil.rmtree(self.ckpt / "average", ignore_errors=True)
            return None
        saved_rng = resumed.pop("rng")[self.acc.process_index] if resumed.get("rng") else None
        self.state.update(resumed)
        self.acc.print(f"resuming {self.run.name} from step {self.state['step']}")
        return saved_rng

    def save_last(self) -> None:
        rngs = gather_rng(self.acc)  # a collective: every rank takes part
        self.state["seconds"] = self.seconds_before + time.time() - self.started
        if self.main:
            checkpoint.save(self.ckpt / "last", self.plain.model, self.run, self.optimizer, self.scheduler,
                            {**self.state, "hash": self.digest, "rng": rngs})
        self.acc.wait_for_everyone()

    def fit(self, mlflow, report: Callable[[dict], None] | None, progress: bool) -> None:
        """Step until ``total``: each step, then its validation and checkpoints when due."""
        from tqdm.auto import tqdm

        state, data = self.state, self.data
        bar = tqdm(total=data.total, initial=state["step"], disable=not (self.main and progress),
                   desc=f"train {self.run.name}", mininterval=2, dynamic_ncols=True)
        self.last_save = time.monotonic()
        while state["step"] < data.total and not state.get("stopped_early"):
            for batch in self._epoch(*divmod(state["step"], data.steps_per_epoch)):
                loss, due = self._step(batch, mlflow, bar)
                validating = state["step"] % data.eval_every == 0 or state["step"] >= data.total
                last_val = self._validate(loss, mlflow, bar) if validating else {}
                if validating and self._out_of_patience():
                    state["stopped_early"] = True  # saved with last just below: a resume stops too
                if validating or due:
                    self.save_last()
                    self.last_save = time.monotonic()
                if validating and report:
                    report({**last_val, "step": state["step"]})
                if state["step"] >= data.total or state.get("stopped_early"):
                    break
        bar.close()

    def _out_of_patience(self) -> bool:
        """``patience`` validations in a row without a lower validation loss (every process agrees: the
        validation loss is the all-processes figure)."""
        patience = self.cfg.patience
        return bool(patience) and self.state["step"] - self.state["best_step"] >= patience * self.data.eval_every

    def _epoch(self, epoch: int, position: int):
        """An iterator over this process's batches of ``epoch`` from batch ``position`` on."""
        data, rank, world = self.data, self.acc.process_index, self.acc.num_processes
        batches = shard(epoch_batches(self.cfg, data.lengths, epoch), rank, world)
        # The saved RNG state is the one right after the last finished step. An uninterrupted
        # run creates an epoch's iterator (which draws a seed) at the epoch's start, so a
        # resume restores the state before creating it at a boundary, after it mid-epoch.
        if self.saved_rng is not None and position == 0:
            set_rng_state(self.saved_rng)
            self.saved_rng = None
        iterator = iter(make_loader(data.task, data.train_items, batches[position:]))
        if self.saved_rng is not None:
            set_rng_state(self.saved_rng)
            self.saved_rng = None
        return iterator

    def _step(self, batch, mlflow, bar) -> tuple[torch.Tensor, bool]:
        """One optimizer step; returns its loss and whether a wall-clock checkpoint is due."""
        cfg, state, world = self.cfg, self.state, self.acc.num_processes
        with self.kernels():  # the backward follows the ops its forward ran
            loss, logs = self.wrapped(send_to_device(batch, self.acc.device))
        step = state["step"] + 1  # the step being taken
        if not self.bad_step and not torch.isfinite(loss).item():
            self.bad_step = step
        due = False
        if world == 1 or step % AGREE_EVERY == 0 or step % self.data.eval_every == 0 or step >= self.data.total:
            self.bad_step, due = agree(self.acc, self.bad_step, time.monotonic() - self.last_save >= self.every)
            if self.bad_step:  # every rank stops here, before a collective the others would never join
                where = f" on one or more of {world} processes" if world > 1 else ""
                raise NonFiniteLoss(f"{self.run.name}: loss became non-finite (nan or inf) at step {self.bad_step}"
                                    f"{where}; lower lr or grad_clip (--set lr=... grad_clip=...) and re-run")
        self.optimizer.zero_grad(set_to_none=True)
        self.acc.backward(loss)
        if cfg.grad_clip:
            self.acc.clip_grad_norm_(self.wrapped.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        state["step"] += 1
        bar.update(1)
        if mlflow and state["step"] % cfg.log_every == 0:
            mlflow.log_metrics({"train_loss": loss.item(), "lr": self.scheduler.get_last_lr()[0],
                                **{f"train_{k}": v.item() for k, v in logs.items()}}, step=state["step"])
            state["curve"]["train"].append({"step": state["step"], "train_loss": loss.item()})
            bar.set_postfix(loss=f"{loss.item():.3f}")
        return loss, due

    def _validate(self, loss: torch.Tensor, mlflow, bar) -> dict[str, float]:
        """Validate; keep the best weights, and a snapshot when it is one of the last ``average_last``."""
        state, data = self.state, self.data
        last_val = validate(self.plain, data.val_loader, self.acc)
        improved = last_val["val_loss"] < state["best"]
        if improved:
            state.update(best=last_val["val_loss"], best_step=state["step"])
        if mlflow:
            mlflow.log_metrics(last_val, step=state["step"])
            state["curve"]["val"].append({"step": state["step"], **last_val})
        if self.main and improved:
            checkpoint.save(self.ckpt / "best", self.plain.model, self.run)
        if self.main and snapshot_due(self.cfg, state["step"], data.total, data.eval_every):
            checkpoint.save(self.ckpt / "average" / str(state["step"]), self.plain.model, self.run)
        bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{last_val['val_loss']:.3f}")
        return last_val

    def finish(self, mlflow, precision: str) -> dict:
        """Average the last checkpoints (``average_last``), then the run's summary, logged and written."""
        state, cfg = self.state, self.cfg
        if cfg.average_last and "averaged" not in state:
            average_into_best(self.run, self.plain, self.data.val_loader, self.acc, self.ckpt, state)
            self.save_last()
        if self.main:  # recorded in last (or never due): the snapshots are spent
            shutil.rmtree(self.ckpt / "average", ignore_errors=True)
        summary = {"best_val_loss": state["best"], "best_step": state["best_step"], "steps": state["step"],
                   "train_seconds": round(self.seconds_before + time.time() - self.started, 1),
                   "processes": self.acc.num_processes, **({"fp32_rnns": self.fp32_rnns} if self.fp32_rnns else {}),
                   **({"stopped_early": True} if state.get("stopped_early") else {}),
                   **({"averaged": state["averaged"]} if "averaged" in state else {}),
                   # the precision the run used, where it is not the one asked for (cpu_has_native_bf16)
                   **({"precision": precision} if precision != cfg.precision else {})}
        if mlflow:
            mlflow.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            if self.main:
                (self.out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
                write_curves(self.out_dir / "learning_curves", state["curve"])
        return summary
