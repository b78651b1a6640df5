"""One "node" of the multi-node test, launched by torchrun: trains with the shared loop and
dumps this rank's final weights so the test can compare ranks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

import models
import pipeline.train as train_mod
from pipeline.config import resolve


def main(root: str, out: str) -> None:
    built = []
    original = models.build

    def capture(*args, **kwargs):  # keep a handle on the model the loop trains
        built.append(original(*args, **kwargs))
        return built[-1]

    train_mod.models.build = capture
    run = resolve("ntm", root=Path(root), use_tuned=False)
    train_mod.train(run, Path(out), progress=False)
    # The loop ends its process group when done; torchrun's variables still name this rank.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.save({"state": built[0].state_dict(), "world": world}, Path(out) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
