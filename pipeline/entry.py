"""What every command's ``main()`` shares: one-line errors, typed ``--set`` overrides, the arguments
that name a model entry and its run folder.

Stages and runner commands import this module and never each other, so ``python -m pipeline.stages.X``
loads one stage and its helpers only.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import os
import re
import signal
import sys
import threading
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import yaml

RUN_HELP = "the run folder (default runs/<model>), e.g. one `attnzoo train MODEL --out DIR` wrote"


def model_parser(description: str, run_help: str | None = None, **kwargs) -> argparse.ArgumentParser:
    """A stage's parser: the params.yaml entry, and ``--run DIR`` when ``run_help`` says what it holds."""
    ap = argparse.ArgumentParser(description=description, **kwargs)
    ap.add_argument("model", help="a params.yaml entry, e.g. ntm (`attnzoo list` shows them)")
    if run_help is not None:
        ap.add_argument("--run", type=Path, default=None, metavar="DIR", help=run_help)
    return ap


def task_entry(task: str) -> dict:
    """``params.yaml``'s ``tasks.<task>``; an unknown task is one sentence listing the known ones."""
    from pipeline.config import UserError, load_params

    tasks = load_params().get("tasks", {})
    if task not in tasks:
        raise UserError(f"unknown task '{task}'; params.yaml lists: {', '.join(tasks)}")
    return tasks[task]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["lr=3e-4", "attention=none"]`` -> ``{"lr": 0.0003, "attention": "none"}`` (YAML-typed)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"error: override '{item}' is not KEY=VALUE (e.g. --set lr=0.001)")
        key, value = item.split("=", 1)
        parsed = yaml.safe_load(value)
        if isinstance(parsed, str):  # YAML 1.1 reads 3e-4 (no dot) as a string; Python and users read a float
            parsed = float(parsed) if re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", parsed) else parsed
        out[key] = parsed
    return out


def _accepts(hint: Any, value: Any) -> bool:
    """Whether ``value`` (as YAML read it) fits the type hint of a config field."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(h, value) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, tuple) or hint in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    return "none" if hint is type(None) else getattr(hint, "__name__", str(hint))


def check_override_types(name: str, overrides: dict[str, Any], root: Path | None = None) -> None:
    """Each ``--set`` value of model entry ``name`` against the type of the config field it sets
    (TrainConfig, or the model's config dataclass), so ``--set lr=abc`` fails here in one sentence
    instead of deep in training. Unknown entries and keys are left to
    :func:`pipeline.config.resolve`, which lists the valid ones."""
    import models
    from pipeline.config import ROOT, TrainConfig, UserError, _split_overrides, load_params

    arch = load_params(Path(root or ROOT)).get("models", {}).get(name, {}).get("arch")
    train, model = _split_overrides(overrides)
    for cls, values in ((TrainConfig, train), (models.REGISTRY[arch].config_cls if arch in models.REGISTRY else None,
                                                model)):
        if cls is None:
            continue
        hints = typing.get_type_hints(cls)
        for key, value in values.items():
            if key in hints and not _accepts(hints[key], value):
                default = next((f.default for f in dataclasses.fields(cls) if f.name == key), None)
                example = f" (e.g. {key}={default})" if default is not dataclasses.MISSING else ""
                raise UserError(f"--set {key}={value!r}: {key} takes {_type_name(hints[key])}{example}")


def run_cli(fn: Callable[[], Any]) -> Any:
    """Run a stage body, turning user-fixable errors into one line on stderr and exit code 2."""
    from pipeline.config import UserError
    from pipeline.tasks import TaskError

    try:
        return fn()
    except (UserError, TaskError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted: the last saved checkpoint is kept; re-run to resume", file=sys.stderr)
        raise SystemExit(130) from None


def exit_after(run: Callable[[], Any]) -> NoReturn:
    """Run a program's ``main``, then leave as ``python -m`` would: the same exit status (a traceback
    and 1 for an error, -SIGINT for Ctrl-C), non-daemon threads joined, then the atexit handlers
    (logging's flush, MLflow's), then buffered output written. Skipped: the interpreter tearing down
    every module and object imported (torch, MLflow, ONNX), 2.5 s of a core in a fresh stage process
    (``dvc repro``'s), and in one forked by the runner's warm starter more, as it writes to each page
    shared with the starter (a forked ``task_code@`` took 2.6 s, 0.3 s without it). Outputs are
    written by then; only a process's last act: it never returns."""
    interrupted = False
    try:
        run()
        code = 0
    except SystemExit as exit_:  # sys.exit(None | int | message), as the interpreter reads it
        code = exit_.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted, code = True, 130
    except BaseException:  # noqa: BLE001 -- printed as the interpreter prints it
        sys.excepthook(*sys.exc_info())
        code = 1
    # What the interpreter runs first on its way out: the thread pools' own exit hooks (their idle workers
    # would wait for work forever), then a join of every non-daemon thread.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:  # as the interpreter ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)
