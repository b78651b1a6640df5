"""The one place configuration is merged (docs/architecture.md §4).

Priority, lowest first: model dataclass defaults → facts from the prepared task
(``manifest.json`` ``model_defaults``, e.g. vocabulary sizes) → ``params.yaml`` ``train`` →
``params.yaml`` ``models.<name>.train`` / ``.model`` → ``runs/<name>/tuned.yaml`` → overrides
(a tune trial, the CLI). Infrastructure (devices, precision, nodes) is not configured here: it
comes from the launcher.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import models

ROOT = Path(__file__).resolve().parent.parent
PARAMS = "params.yaml"


class UserError(RuntimeError):
    """A problem the user can fix; the CLI prints its message, never a traceback."""


@dataclass
class TrainConfig:
    """Hyper-parameters of the shared training loop."""

    seed: int = 0
    batch_size: int = 64  # items per global batch (validation always; training unless max_tokens)
    # Token-based training batches (translation): each global batch holds at most this many padded
    # tokens (items x the longest item's length, task.length), cut from the length-sorted corpus. 0: batch_size.
    max_tokens: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.0
    epochs: int = 10
    max_steps: int = 0  # 0: no cap beyond epochs
    warmup_steps: int = 100
    # After the linear warm-up: cosine decay to min_lr_ratio over the run, or inverse_sqrt
    # (lr * sqrt(warmup_steps / step), Vaswani et al. §5.3: the same at any run length).
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1  # cosine decay floor, relative to lr
    # Average the weights of the last N validations (eval_every steps apart); the average becomes the
    # best checkpoint when its validation loss is lower. 0: off.
    average_last: int = 0
    grad_clip: float = 1.0
    # bf16: autocast matmuls to bfloat16 (weights, optimizer state and the loss stay fp32). On a CPU
    # with AVX512-BF16 a Transformer step took 0.62x the fp32 time (docs/benchmarks.md). fp32: the
    # launcher decides (accelerate launch --mixed_precision), fp32 when launched plainly.
    precision: str = "fp32"
    eval_every: int = 0  # steps between validations; 0: once per epoch
    log_every: int = 50
    # Speed settings (OPT_IN_KEYS): how the recipe's arithmetic runs, not what it computes beyond rounding.
    # Off by default; params.yaml turns them on entry by entry where scripts/train_efficiency.py measured a gain.
    # compile: the model method to torch.compile, "loss" (the whole step; for models whose loop lengths stay
    # fixed) or the per-time-step method its loss loops over ("step", bahdanau's "_readout"), one graph reused at
    # every time step; "" is off. Its compile time is paid in the first steps.
    # fused_adamw: AdamW's fused kernel, one pass over all parameters instead of a loop over tensors.
    compile: str = ""
    fused_adamw: bool = False
    # Stop after this many validations without a lower validation loss (0: run the whole budget). The
    # schedule still spans the budget, so a run that stops early followed the same curve until then.
    patience: int = 0
    # cpu_sdpa: "math" runs F.scaled_dot_product_attention as its explicit matmul-softmax-matmul in training
    # steps on a CPU, where the fused flash kernel's backward is slow (PyTorch 2.13, torch.profiler: 32.5 % of
    # a bf16 Transformer step on a 2-core Xeon with AMX-BF16); "" keeps PyTorch's choice. GPUs keep theirs.
    cpu_sdpa: str = ""
    # cpu_loss: "chunked" computes the token loss (models.layers.token_loss: label-smoothed cross-entropy and
    # accuracy) a cache-sized block of rows at a time in CPU training steps, where PyTorch's kernel makes several
    # float32 passes over the [tokens, vocabulary] logits (a sixth of a translation step); "" keeps PyTorch's.
    cpu_loss: str = ""
    # cpu_heap: "keep" has glibc's allocator keep freed memory for the next step instead of returning every block
    # over its mmap threshold (at most 32 MB) to the kernel: a step that allocates a [tokens, vocabulary] tensor then
    # pays a page fault for every 4 kB of it, every step (34 MB: 15 ms on a Zen 4 core). Process-wide, CPU only.
    cpu_heap: str = ""
    # memory_format: "channels_last" lays the convolution weights, and so the images they produce, out channel-minor,
    # where the CPU's pooling, batch norm and convolution kernels are vectorised (pipeline/training/memory.py).
    memory_format: str = ""


# Left out of a run's recorded config (as_dict) while at their defaults, so that a run without them
# records, and checkpoints, exactly what it did before they existed.
OPT_IN_KEYS = ("compile", "fused_adamw", "patience", "cpu_sdpa", "cpu_loss", "cpu_heap", "memory_format")


def switched_on(key: str, value: str, default: str, on: str) -> bool:
    """A speed setting that is '' (``default`` says what that keeps) or ``on``: whether it is on; any other value
    is a UserError naming both."""
    if value not in ("", on):
        raise UserError(f"train.{key} is '{value}'; use '' ({default}) or '{on}'")
    return value == on


@dataclass
class RunConfig:
    """Everything one model entry needs, resolved."""

    name: str
    arch: str
    task: str
    model: dict[str, Any]
    train: TrainConfig
    data_dir: Path
    run_dir: Path
    search_space: dict[str, Any] = field(default_factory=dict)
    parity: dict[str, Any] = field(default_factory=dict)
    bar: dict[str, Any] = field(default_factory=dict)
    evaluate: dict[str, Any] = field(default_factory=dict)
    # serving limits published with the model (serving/admission.py Limits: its defaults, then
    # params.yaml serving.limits, then the entry's own limits)
    limits: dict[str, Any] = field(default_factory=dict)
    # what serves the published versions: their ONNX graphs, or CTranslate2 (pre-norm Transformers;
    # pipeline/ctranslate2_engine.py), whose own int8 conversion then serves the int8 variant too.
    engine: str = "onnxruntime"


ENGINES = ("onnxruntime", "ctranslate2")


def load_params(root: Path = ROOT) -> dict:
    path = Path(root) / PARAMS
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError as err:
        raise UserError(f"{path} not found: run from the repository root") from err


def read_manifest(data_dir: Path) -> dict:
    path = data_dir / "manifest.json"
    if not path.exists():
        raise UserError(f"{path} is missing: run `dvc repro prepare` first")
    return json.loads(path.read_text())


def _split_overrides(overrides: dict[str, Any]) -> tuple[dict, dict]:
    """Flat override keys go to the train config if they name a TrainConfig field, else to the
    model config (a ``model.``/``train.`` prefix forces the choice)."""
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    train, model = {}, {}
    for key, value in overrides.items():
        if key.startswith("train."):
            train[key[6:]] = value
        elif key.startswith("model."):
            model[key[6:]] = value
        elif key in train_keys:
            train[key] = value
        else:
            model[key] = value
    return train, model


def resolve(
    name: str,
    params: dict | None = None,
    overrides: dict[str, Any] | None = None,
    root: Path = ROOT,
    use_tuned: bool = True,
) -> RunConfig:
    """Resolve model entry ``name`` of ``params.yaml`` into a :class:`RunConfig`.

    Raises:
        UserError: unknown entry, unknown model or config key, missing prepared data.
    """
    root = Path(root)
    params = params if params is not None else load_params(root)
    entry = _entry(params, name)
    data_dir = root / "data" / "prepared" / entry["task"]
    run_dir = root / "runs" / name
    model_cfg = dict(read_manifest(data_dir).get("model_defaults", {}))
    train_cfg = dict(params.get("train", {}))
    train_cfg.update(entry.get("train", {}))
    model_cfg.update(entry.get("model", {}))
    tuned = run_dir / "tuned.yaml"
    layers = [yaml.safe_load(tuned.read_text()) or {}] if use_tuned and tuned.exists() else []
    layers.append(overrides or {})
    for layer in layers:
        t, m = _split_overrides(layer)
        train_cfg.update(t)
        model_cfg.update(m)
    try:
        models.make_config(entry["arch"], model_cfg)  # validates keys and the arch
        train = TrainConfig(**train_cfg)
    except models.ConfigError as err:
        raise UserError(f"{name}: {err}") from err
    except TypeError as err:
        known = [f.name for f in dataclasses.fields(TrainConfig)]
        raise UserError(f"{name}: bad train config ({err}); valid keys: {known}") from err
    return RunConfig(name=name, arch=entry["arch"], task=entry["task"], model=model_cfg, train=train,
                     data_dir=data_dir, run_dir=run_dir, search_space=entry.get("search_space", {}),
                     **_stage_blocks(name, entry, params))


def _entry(params: dict, name: str) -> dict:
    """The entry ``name`` of params.yaml's ``models``, or one sentence listing the entries there are."""
    entries = params.get("models") or {}
    if name not in entries:
        raise UserError(f"unknown model entry '{name}'; params.yaml lists: {', '.join(entries)}")
    return entries[name]


def _stage_blocks(name: str, entry: dict, params: dict) -> dict:
    """The entry's blocks the stages after training read (their DVC params), as RunConfig fields."""
    engine = entry.get("engine", "onnxruntime")
    if engine not in ENGINES:
        raise UserError(f"{name}: engine {engine!r} is not one of {', '.join(ENGINES)}")
    return {"parity": entry.get("parity", {}), "bar": entry.get("bar", {}), "evaluate": entry.get("evaluate", {}),
            "limits": {**(params.get("serving") or {}).get("limits", {}), **entry.get("limits", {})},
            "engine": engine}


@dataclass
class TuneBudget:
    """Ray Tune's budget for one entry: ``params.yaml`` ``tune``, then the entry's own ``tune``."""

    num_samples: int     # repeats of the grid; sampled (non-grid) dimensions draw this many
    max_steps: int       # each trial's training steps
    eval_every: int      # steps between a trial's validations (ASHA's rungs)
    grace_period: int    # validations before ASHA may stop a trial
    cpus_per_trial: int


@dataclass
class QuantizeSettings:
    """``quantize@``'s recipe for one entry: ``params.yaml`` ``quantize`` (``tolerance_by_model`` over
    ``tolerance``)."""

    op_types: list[str]  # the op types onnxruntime's dynamic quantisation converts
    tolerance: float     # the most int8 may be worse than fp32 on each bar metric, in its own unit


def _block(cls, values: dict, where: str):
    """``cls`` from a params.yaml block, with one sentence naming a missing or unknown key."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    missing = [n for n in names if n not in values]
    if unknown or missing:
        raise UserError(f"params.yaml {where}: " + "; ".join(
            ([f"unknown key(s) {', '.join(unknown)}"] if unknown else [])
            + ([f"missing {', '.join(missing)}"] if missing else [])) + f" (its keys: {', '.join(names)})")
    return cls(**values)


def tune_budget(name: str, params: dict) -> TuneBudget:
    entry = (params.get("models") or {}).get(name) or {}
    return _block(TuneBudget, {**(params.get("tune") or {}), **(entry.get("tune") or {})},
                  f"tune (with models.{name}.tune)")


def quantize_settings(name: str, params: dict) -> QuantizeSettings:
    block = dict(params.get("quantize") or {})
    by_model = block.pop("tolerance_by_model", None) or {}
    if name in by_model:
        block["tolerance"] = by_model[name]
    settings = _block(QuantizeSettings, block, "quantize")
    return dataclasses.replace(settings, op_types=list(settings.op_types), tolerance=float(settings.tolerance))


def repro_resources(params: dict) -> dict[str, dict]:
    """``params.yaml`` ``repro.resources``: the Ray task options of each stage kind (``default`` for the rest)."""
    resources = ((params.get("repro") or {}).get("resources")) or {}
    if "default" not in resources:
        raise UserError("params.yaml repro.resources needs a `default` entry (e.g. default: {num_cpus: 1})")
    return resources


def results_dir(run: RunConfig) -> Path:
    """Where a stage writes a run's rows for the task report: ``results/<task>/`` beside ``runs/``
    for the pipeline's own run folder (``runs/<name>``), inside the folder otherwise (an ad-hoc
    ``train --out DIR``), so trying a model never overwrites the pipeline's results."""
    if run.run_dir.parent.name == "runs" and run.run_dir.name == run.name:
        return run.run_dir.parent.parent / "results" / run.task
    return run.run_dir / "results" / run.task


def trained(name: str, folder: Path | None = None, root: Path = ROOT, params: dict | None = None) -> RunConfig:
    """The one config of the stages after training (evaluate, export, quantize, publish): what training decided,
    read from the checkpoint's ``config.json`` (arch, task, model and training config, ``--set`` and tuned values
    included), and the entry's own blocks of params.yaml for the rest (evaluate, parity, bar, limits, engine: those
    stages' DVC params, so a changed bar re-runs evaluate@ with the new bar). Nothing else is merged: neither the
    prepared task's facts nor tuned.yaml, which the checkpoint already holds.

    ``folder``: a ``train --out`` folder in place of ``runs/<name>``; its outputs go there too.
    """
    root = Path(root)
    params = params if params is not None else load_params(root)
    entry = _entry(params, name)
    run_dir = Path(folder) if folder is not None else root / "runs" / name
    path = run_dir / "checkpoint" / "best" / "config.json"
    if not path.is_file():
        raise UserError(f"{run_dir} holds no trained model (checkpoint/best); "
                        + (f"pass the folder `attnzoo train {name} --out DIR` wrote" if folder is not None
                           else f"run `dvc repro train@{name}` first"))
    saved = json.loads(path.read_text())
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(saved["train"]) - known)
    if unknown:
        raise UserError(f"{path} was trained by other code (train keys {', '.join(unknown)} are unknown here): "
                        f"retrain it (`dvc repro train@{name}`) or use the code that trained it")
    data_dir = root / "data" / "prepared" / saved["task"]
    if not (data_dir / "manifest.json").is_file():  # every later stage reads the task's data
        raise UserError(f"{data_dir / 'manifest.json'} is missing: run `dvc repro prepare@{saved['task']}` first")
    return RunConfig(name=name, arch=saved["arch"], task=saved["task"], model=saved["model"],
                     train=TrainConfig(**saved["train"]), data_dir=data_dir, run_dir=run_dir,
                     **_stage_blocks(name, entry, params))


def as_dict(run: RunConfig) -> dict:
    """JSON-friendly view (for MLflow params and checkpoint metadata)."""
    train = dataclasses.asdict(run.train)
    defaults = TrainConfig()
    for key in OPT_IN_KEYS:
        if train[key] == getattr(defaults, key):
            del train[key]
    return {"name": run.name, "arch": run.arch, "task": run.task, "model": run.model, "train": train}
