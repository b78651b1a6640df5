"""``attnzoo`` command line: one sub-command per stage, plus serving, remotes and ``list``.

Errors a user can fix (missing package, unknown model or key, a ``--set`` value of the wrong type,
corrupt checkpoint, failed parity) end with one clear sentence and exit code 2 — never a bare
traceback. Each sub-command owns its argument parser (``attnzoo COMMAND --help``); this module only
dispatches, so ``serve`` and ``predict`` never import torch.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from pathlib import Path
from typing import Any

from pipeline.entry import run_cli

STAGES = ["prepare", "tune", "train", "evaluate", "export", "quantize", "publish", "report"]
# The module behind each command other than a stage (pipeline.stages.<stage>); "module:function" when the
# command is not the module's main(). serve, predict and translate import no torch; push and pull are dvc
# push / pull ending with one clear sentence on failure.
MODULES = {"repro": "pipeline.runner.repro", "quickstart": "pipeline.runner.quickstart",
           "push": "pipeline.runner.remote:main", "pull": "pipeline.runner.remote:pull",
           "serve": "serving.server", "predict": "serving.predict", "translate": "serving.predict:translate_main"}
# A base install is the torch-free server (pyproject.toml); the rest comes with an extra. A command that
# needs a module of one names the extra to install instead of ending in a traceback.
EXTRAS = {"onnxruntime": "serve", **{m: "train,cpu" for m in (
    "torch", "accelerate", "onnx", "onnxscript", "ray", "mlflow", "dvc", "safetensors", "sacrebleu", "matplotlib",
    "scipy")}}
DESCRIPTIONS = {
    "quickstart": "train, check, publish and ask three real models in about 8 minutes on 2 cores (the real pipeline)",
    "repro": "run the pipeline's changed stages in parallel (--jobs N), on a Ray cluster (--ray), or with a "
             "profile in a scratch copy (--profile smoke)",
    "prepare": "prepare one task's data (the DVC stage prepare@TASK)",
    "tune": "search hyper-parameters of a model entry with Ray Tune (tune@MODEL)",
    "train": "train a model entry with Accelerate, 1 process or many (train@MODEL)",
    "evaluate": "score a trained model on its task's test set (evaluate@MODEL)",
    "export": "export a trained model to ONNX and check parity with PyTorch (export@MODEL)",
    "quantize": "make an int8 variant of the exported graphs and gate its test metrics against fp32 (quantize@MODEL)",
    "publish": "publish an exported model as a versioned, servable artifact (publish@MODEL)",
    "report": "write a task's comparison table and plots (report@TASK)",
    "list": "list the model entries: task, bar status, published versions",
    "serve": "serve the published models over the Open Inference Protocol (KServe v2)",
    "predict": "ask a running server for a prediction (--local: run the published model here)",
    "translate": "translate a text file line by line with a published translation model",
    "push": "dvc push, ending with one clear sentence when the remote refuses",
    "pull": "dvc pull, ending with one clear sentence when the remote refuses",
}


def version() -> str:
    """The package's version (pyproject.toml is its one source; see ``serving.__version__``)."""
    from serving import __version__

    return __version__


def entries(root: Path | None = None) -> list[dict[str, Any]]:
    """Every params.yaml entry with its task, recorded bar status and published versions."""
    import json

    from pipeline.config import ROOT, load_params
    from serving.version import versions_in

    root = Path(root or ROOT)
    rows = []
    for name, entry in load_params(root).get("models", {}).items():
        result = root / "results" / entry["task"] / f"{name}.json"
        passed = json.loads(result.read_text()).get("bar_passed", "?") if result.exists() else "?"
        if not entry.get("bar"):
            passed = None  # a baseline, e.g. an ablation without attention
        folder = root / "model_repository" / name
        versions = versions_in(folder)[::-1] if folder.is_dir() else []  # newest first
        rows.append({"name": name, "arch": entry["arch"], "task": entry["task"],
                     "bar": {True: "met", False: "not met", None: "no bar", "?": "not evaluated"}[passed],
                     "published": versions})
    return rows


def list_main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="attnzoo list", description=DESCRIPTIONS["list"])
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    args = ap.parse_args(argv)
    rows = run_cli(entries)
    try:
        _print_rows(rows, args.json)
    except BrokenPipeError:  # `attnzoo list | head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes stdout again at exit


def _print_rows(rows: list[dict[str, Any]], as_json: bool) -> None:
    import json

    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    widths = [max(len(h), *(len(str(r[k])) for r in rows)) for h, k in
              (("model", "name"), ("arch", "arch"), ("task", "task"), ("bar", "bar"))]
    print("  ".join(h.ljust(w) for h, w in zip(("model", "arch", "task", "bar"), widths)) + "  published versions")
    for r in rows:
        cells = [r["name"], r["arch"], r["task"], r["bar"]]
        print("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + "  "
              + (", ".join(map(str, r["published"])) or "-"))


def usage() -> str:
    width = max(map(len, DESCRIPTIONS))
    lines = ["usage: attnzoo [--version] [-h] COMMAND ...", "",
             "Train, export, check and serve classic attention models (`dvc repro` runs the stages).", "",
             "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in DESCRIPTIONS.items()]
    lines += ["", "`attnzoo COMMAND --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        print(f"attnzoo {version()}")
        return
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    command = argv[0]
    if command not in DESCRIPTIONS:
        near = difflib.get_close_matches(command, DESCRIPTIONS, n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        print(f"error: unknown command '{command}'{hint} (`attnzoo --help` lists them)", file=sys.stderr)
        raise SystemExit(2)
    try:
        _dispatch(command, argv[1:])
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".")[0]
        if missing not in EXTRAS:
            raise
        print(f"error: `attnzoo {command}` needs {missing}, which is not installed here; install it with "
              f"pip install \"attnzoo[{EXTRAS[missing]}]\" (in a checkout: make setup)", file=sys.stderr)
        raise SystemExit(1) from None


def _dispatch(command: str, args: list[str]) -> None:
    if command == "list":
        return list_main(args)
    sys.argv[0] = f"attnzoo {command}"  # argparse's prog in each command's usage and errors
    module, _, function = MODULES.get(command, f"pipeline.stages.{command}").partition(":")
    getattr(importlib.import_module(module), function or "main")(args)


if __name__ == "__main__":
    main()
