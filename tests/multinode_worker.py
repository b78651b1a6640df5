"""One training process of the multi-process tests, started by torchrun (or plainly, as 1
process): trains entry MODEL of ROOT/params.yaml with the shared loop into OUT and dumps this
rank's final weights so the test can compare ranks and process counts.

``--nan-at-step S --nan-rank R``: rank R's loss becomes NaN at step S (the others stay finite),
to check that every rank stops with one clear error instead of hanging.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import models
import pipeline.training.loop as train_mod
from pipeline.config import resolve
from pipeline.entry import run_cli


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="ntm")
    ap.add_argument("--nan-at-step", type=int, default=0)
    ap.add_argument("--nan-rank", type=int, default=1)
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    built = []
    original = models.build

    def capture(*a, **kw):  # keep a handle on the model the loop trains
        built.append(original(*a, **kw))
        model = built[-1]
        if args.nan_at_step and rank == args.nan_rank:
            calls = {"n": 0}
            loss = model.loss

            def poisoned(batch):
                calls["n"] += 1
                value, logs = loss(batch)
                return (value * float("nan") if calls["n"] == args.nan_at_step else value), logs

            model.loss = poisoned
        return model

    train_mod.models.build = capture
    run = resolve(args.model, root=args.root, use_tuned=False)
    run_cli(lambda: train_mod.train(run, args.out, progress=False))
    # The loop ends its process group when done; torchrun's variables still name this rank.
    torch.save({"state": built[0].state_dict(), "world": world}, args.out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
