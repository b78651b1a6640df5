"""Stage ``train@<model>``: train one params.yaml entry with :func:`pipeline.training.loop.train`, in this
process or re-run under a launcher (``ATTNZOO_LAUNCHER``: torchrun, ``accelerate launch``) for many."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from pipeline.config import resolve
from pipeline.entry import check_override_types, exit_after, parse_overrides, run_cli
from pipeline.training.loop import train

LAUNCHER_ENV = "ATTNZOO_LAUNCHER"


def launch_command(launcher: str, argv: list[str]) -> list[str]:
    """``ATTNZOO_LAUNCHER="torchrun --nnodes 2 ..."`` + this stage's arguments → the command that
    runs this module under that launcher (torchrun and ``accelerate launch`` both take ``-m``)."""
    return [*shlex.split(launcher), "-m", "pipeline.stages.train", *argv]


def main(argv: list[str] | None = None) -> None:
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
    exit_after(main)
