"""Planar convex hulls with pointers (Vinyals et al. 2015 §4.2).

Input: n points drawn uniformly from the unit square; output: the positions of the hull's
vertices in the paper's canonical order — starting from the vertex with the lowest index, going
counter-clockwise — then END. Training mixes n over [min_n, max_n]; the bar is on n = 10.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.tasks import register_task
from pipeline.tasks.sort import PointerTask


def hull(points: np.ndarray) -> list[int]:
    """0-based indices of the convex hull of points [n,2], counter-clockwise from the lowest index.

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
    ring = lower[:-1] + upper[:-1]  # counter-clockwise, starting at the leftmost point
    start = ring.index(min(ring))
    return ring[start:] + ring[:start]


class ConvexHullTask(PointerTask):
    name = "convex_hull"
    point_size = 2

    def generate(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[int]]:
        points = rng.random((n, 2)).astype(np.float32)
        return points, [i + 1 for i in hull(points)]

    def plot_example(self, item: dict, pred: list[int], path: Path, title: str) -> None:
        from pipeline import plots

        plots.hull(item["points"].numpy(), [p - 1 for p in item["target"][:-1].tolist()],
                   [p - 1 for p in pred], path, title)


register_task(ConvexHullTask())
