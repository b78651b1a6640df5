"""How a script in this folder ends on a mistake its user can fix: one line ``error: ...`` on stderr and
exit status 2, as the pipeline's stages end (``pipeline.entry.run_cli``), never a traceback.

    if __name__ == "__main__":
        cli_errors.run(main)

The pipeline's own ``UserError`` / ``TaskError`` (an unknown entry, data not prepared, a run not trained)
already name their fix; ``ScriptError`` is a script's own. Torch-free: the serving-host scripts use it
too, and the pipeline's classes are only looked up when the pipeline was imported.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class ScriptError(Exception):
    """A mistake the message (one sentence naming the fix) lets the user correct."""


def _fixable() -> tuple[type, ...]:
    found = [getattr(sys.modules.get(module), name, None)
             for module, name in (("pipeline.config", "UserError"), ("pipeline.tasks", "TaskError"))]
    return (ScriptError, *(c for c in found if isinstance(c, type)))


def run(main: Callable[[], Any]) -> None:
    """``main``'s return value as the exit status when it is a number (else 0); a fixable error as one
    line and 2."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as err:
        if not isinstance(err, _fixable()):
            raise
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(code if isinstance(code, int) else 0)


def entries(names: list[str], root: Path = ROOT) -> list[str]:
    """``names``, each a model entry of ``root``'s params.yaml, or one sentence naming those that are not."""
    import yaml

    known = yaml.safe_load((root / "params.yaml").read_text())["models"]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ScriptError(f"not params.yaml entries: {', '.join(unknown)} (`attnzoo list` shows them)")
    return names


def need_module(module: str, pip: str | None = None) -> None:
    """One sentence naming the install when ``module`` (a package of the dev extra) is missing."""
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        raise ScriptError(f"this script needs {module}: pip install '{pip or module}' "
                          "(or the dev extra: pip install -e '.[dev]')")
