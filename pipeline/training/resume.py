"""What makes a killed run resumable: its identity (config, code, data), every rank's RNG state, the
wall-clock checkpoints, and the ranks' agreement on when to stop or save."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import torch

from pipeline.config import ROOT, RunConfig, UserError, as_dict
from pipeline.sources import task_files
from pipeline.tasks import code_name

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


# The code a run's identity covers: train@'s code deps in dvc.yaml, file for file (tests/test_train.py
# checks they agree), and the task's code (data/task_code/<task>.json lists the same files), so whenever
# DVC re-runs train@ for a code change the loop starts over instead of taking a finished checkpoint of
# other code as the result.
TRAIN_CODE = ("models/{arch}.py", "models/layers.py", "models/decode.py", "models/export.py", "models/__init__.py",
              "pipeline/config.py", "pipeline/checkpoint.py", "pipeline/files.py", "pipeline/tracking.py",
              "pipeline/training", "pipeline/stages/train.py", "pipeline/entry.py")


def code_files(run: RunConfig) -> list[Path]:
    out = []
    for entry in TRAIN_CODE:
        path = ROOT / entry.format(arch=run.arch)
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out + [p for p in task_files(code_name(run.task), ROOT) if p not in out]


def config_hash(run: RunConfig) -> str:
    """Identity of a training run, checked before resuming: the resolved config, the code that
    trains it (:data:`TRAIN_CODE`) and the prepared data. A checkpoint of other code or data is
    never resumed."""
    digest = hashlib.sha256(json.dumps(as_dict(run), sort_keys=True).encode())
    for path in code_files(run):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    manifest = run.data_dir / "manifest.json"
    if manifest.exists():
        digest.update(json.dumps(json.loads(manifest.read_text()).get("files", {}), sort_keys=True).encode())
    return digest.hexdigest()[:16]


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
