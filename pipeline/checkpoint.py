"""Checkpoints: ``model.safetensors`` + ``config.json`` (the resolved config, so export and
serving never read params.yaml), plus ``trainer.pt`` (optimizer, schedule, progress, every
process's RNG states) in ``last``.

Writes go to a temporary folder that is renamed into place, so a kill mid-save never leaves a
half-written checkpoint behind; a kill between the two renames leaves the previous checkpoint as
``<name>.old``, which :func:`load_last` falls back to. The temporary folder carries the process
id, so two processes saving beside each other never write into one folder.

``trainer.pt`` is read with ``torch.load(weights_only=True)``: a checkpoint pulled from a shared DVC
remote is data, never code. Its only non-tensor objects are numpy's RNG state, allowed by name
(:data:`TRAINER_GLOBALS`); anything else in it is refused and the run starts fresh.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import models
from pipeline.config import RunConfig, UserError, as_dict
from pipeline.files import scratch_beside

# What trainer.pt may hold beyond tensors and plain containers: numpy's RNG state (np.random.get_state(),
# a uint32 array); the weights_only unpickler refuses every other global.
TRAINER_GLOBALS = [getattr(np, "_core", getattr(np, "core", None)).multiarray._reconstruct, np.ndarray, np.dtype,
                   type(np.dtype(np.uint32))]


def save(path: Path, model: nn.Module, run: RunConfig, optimizer=None, scheduler=None,
         state: dict | None = None) -> None:
    path = Path(path)
    tmp = scratch_beside(path)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
              str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(as_dict(run), indent=2))
    if optimizer is not None:
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "state": state}, tmp / "trainer.pt")
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_last(ckpt: Path, digest: str, model: nn.Module, optimizer, scheduler) -> dict | None:
    """Restore ``ckpt/last`` into model/optimizer/scheduler if it was written with the same
    config (``digest``); returns the saved progress (with ``rng``, one state per process), or
    None to start fresh. The caller restores the RNG states at the right moment."""
    folder = Path(ckpt) / "last"
    if not (folder / "trainer.pt").exists():  # killed between save()'s two renames
        folder = Path(ckpt) / "last.old"
    trainer = folder / "trainer.pt"
    if not trainer.exists():
        return None
    try:
        with torch.serialization.safe_globals(TRAINER_GLOBALS):
            saved = torch.load(trainer, weights_only=True)
        if saved["state"].get("hash") != digest:
            return None
        model.load_state_dict(load_file(str(folder / "model.safetensors")))
    except pickle.UnpicklingError as err:  # not what save() writes: never run it, start over
        named = re.search(r"GLOBAL (\S+)", str(err))
        print(f"warning: ignoring checkpoint {trainer}: it asks to load {named[1] if named else 'an object'}, "
              "and only tensors and numpy's RNG state are loaded; starting fresh")
        return None
    except Exception as err:  # a corrupt file must not kill the run: start over, say why
        print(f"warning: ignoring unreadable checkpoint {trainer.parent} ({err}); starting fresh")
        return None
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    return {k: v for k, v in saved["state"].items() if k != "hash"}


def load_model(path: Path) -> tuple[nn.Module, dict]:
    """Load a checkpoint folder into an eval-mode model; returns (model, resolved config)."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
        model = models.build(config["arch"], config["model"])
        model.load_state_dict(load_file(str(path / "model.safetensors")))
    except FileNotFoundError as err:
        raise UserError(f"no checkpoint at {path}: run `dvc repro train@<model>` first") from err
    except models.ConfigError as err:
        raise UserError(f"checkpoint {path} has a bad config: {err}") from err
    except Exception as err:
        raise UserError(f"checkpoint {path} is corrupt ({type(err).__name__}: {err}); "
                        f"delete it and re-run `dvc repro train@<model>`") from err
    return model.eval(), config
