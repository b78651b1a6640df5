"""``attnzoo`` command line: one sub-command per stage, plus helpers shared by stage mains.

Errors a user can fix (missing package, unknown model or key, corrupt checkpoint, failed parity)
end with one clear sentence and exit code 2 — never a bare traceback.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import yaml

STAGES = ["prepare", "tune", "train", "evaluate", "export", "publish", "report"]
SERVING = {"serve": "serving.server", "predict": "serving.client"}  # no torch behind these
REMOTE = {"push": "main", "pull": "pull"}  # dvc push / pull with one clear sentence on failure


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["lr=3e-4", "attention=none"]`` -> ``{"lr": 0.0003, "attention": "none"}`` (YAML-typed)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"error: override '{item}' is not KEY=VALUE")
        key, value = item.split("=", 1)
        out[key] = yaml.safe_load(value)
    return out


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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = STAGES + list(SERVING) + list(REMOTE)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: attnzoo {" + ",".join(commands) + "} ...\n"
              "Each stage sub-command is one DVC stage; `serve` starts the inference server, `predict`\n"
              "asks it; `push`/`pull` move DVC outputs to/from a remote; `attnzoo COMMAND --help` for options.")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if argv[0] in REMOTE:
        from pipeline import remote

        return getattr(remote, REMOTE[argv[0]])(argv[1:])
    module = SERVING.get(argv[0], f"pipeline.{argv[0]}")
    importlib.import_module(module).main(argv[1:])


if __name__ == "__main__":
    main()
