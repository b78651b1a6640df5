"""Planar convex hulls with pointers (Vinyals et al. 2015 §4.2).

Input: n points drawn uniformly from the unit square; output: the positions of the hull's
vertices counter-clockwise from the leftmost vertex, then END. Training mixes n over
[min_n, max_n]; the bar is on n = 10.

The paper starts from the vertex with the lowest index instead. That start is arbitrary: to
choose it the encoder must first know which points are on the hull, a global fact, before the
decoder can take its first step. Starting from the leftmost vertex makes every step a geometric
choice (the smallest left turn from the current vertex), so the model learns the hull rather
than an indexing convention; the output is still one canonical sequence per point set and is
scored by exact match. Measured on the same budget (docs/results.md): n = 10 accuracy 0.594 with
the lowest-index start.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.tasks import register_task
from pipeline.tasks.common.pointer import PointerTask


def hull(points: np.ndarray) -> list[int]:
    """0-based indices of the convex hull of points [n,2], counter-clockwise from the leftmost point.

    Andrew's monotone chain; uniform random points are in general position (no three collinear)
    with probability one, and collinear boundary points are left out.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i, 0], points[i, 1]))

    def cross(o, a, b) -> float:
        return float((points[a, 0] - points[o, 0]) * (points[b, 1] - points[o, 1])
                     - (points[a, 1] - points[o, 1]) * (points[b, 0] - points[o, 0]))

    lower: list[int] = []
    for i in order:
        while len(lower) >= 2 and cross(lower[-2], lower[-1], i) <= 0:
            lower.pop()
        lower.append(i)
    upper: list[int] = []
    for i in reversed(order):
        while len(upper) >= 2 and cross(upper[-2], upper[-1], i) <= 0:
            upper.pop()
        upper.append(i)
    return lower[:-1] + upper[:-1]  # counter-clockwise; order[0], the leftmost point, comes first


class ConvexHullTask(PointerTask):
    name = "convex_hull"
    card = {"data": "random points in the unit square (5 to 10 a set) generated from the seed in params.yaml, hulls "
                    "computed exactly",
            "licence": "generated: no third-party data",
            "paper": "Vinyals et al. 2015 (Pointer Networks)"}
    point_size = 2

    def generate(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[int]]:
        points = rng.random((n, 2)).astype(np.float32)
        return points, [i + 1 for i in hull(points)]

    def plot_example(self, item: dict, pred: list[int], path: Path, title: str) -> None:
        from pipeline import plots

        plots.hull(item["points"].numpy(), [p - 1 for p in item["target"][:-1].tolist()],
                   [p - 1 for p in pred], path, title)


register_task(ConvexHullTask())
