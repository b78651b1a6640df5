"""Sorting with pointers (Vinyals et al. 2015 §4.4; Vinyals, Bengio & Kudlur 2016 §4.1).

Input: N floats drawn uniformly from [0, 1); output: their positions in increasing order of value,
then END. Training sets mix N over [min_n, max_n]; test sets come at fixed N (5 and 10 for the
bar, longer ones to show how far the model generalises). Generated from a seed.

The storage, collate and scoring are ``common/pointer.py``'s, shared with ``convex_hull``.
"""

from __future__ import annotations

import numpy as np

from pipeline.tasks import register_task
from pipeline.tasks.common.pointer import PointerTask


class SortTask(PointerTask):
    name = "sort"
    card = {"data": "random floats (5 to 10 a list) generated from the seed in params.yaml",
            "licence": "generated: no third-party data",
            "paper": "Vinyals et al. 2015 (Pointer Networks)"}

    def generate(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[int]]:
        values = rng.random(n).astype(np.float32)
        return values[:, None], (np.argsort(values, kind="stable") + 1).tolist()


register_task(SortTask())
