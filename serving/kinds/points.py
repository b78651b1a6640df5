"""Pointer networks: point sets in, pointer sequences and their distributions out."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from serving import decode
from serving.base import ServedModel, decode_params, specs
from serving.kinds import register
from serving.protocol import RequestError, TensorSpec


@register("points")
class PointerModel(ServedModel):
    """encoder + decoder_step of a pointer network: point sets in, pointer sequences out.

    ``points`` [N, n, d] holds N sets of n points each; ``pointers`` are 0-based indices into each
    set (-1 after the end), ``attention`` the pointer distribution of every output step over
    [END, point 0, ..., point n-1].
    """

    platform = "attnzoo_pointer"
    limit_axes = {"points": {0: ("point sets", "rows"), 1: ("points in a set", "steps")}}

    def __init__(self, name: str, version: int, folder: Path, meta: dict, graphs: dict, limits=None):
        self.encoder, self.step = graphs["encoder"], graphs["decoder_step"]
        self.serving = meta["serving"]
        src = specs(self.encoder.session.get_inputs())[0]
        super().__init__(name, version, [TensorSpec("points", "FP32", (-1, -1, src.shape[-1]))], [
            TensorSpec("pointers", "INT64", (-1, -1)), TensorSpec("lengths", "INT64", (-1,)),
            TensorSpec("attention", "FP32", (-1, -1, -1))], limits)

    def infer(self, feeds, params):
        mode, beam = decode_params(params, "greedy", self.serving)
        points = feeds["points"].astype(np.float32)
        sets, n = points.shape[0], points.shape[1]
        if n == 0 or n + 1 > self.serving["max_len"]:
            raise RequestError(f"each set needs 1 to {self.serving['max_len'] - 1} points, got {n}")
        if not np.isfinite(points).all():
            raise RequestError("input 'points' must be finite numbers")
        s = self.serving
        lens = np.full((sets,), n, dtype=np.int64)
        pointers = np.full((sets, n), -1, dtype=np.int64)
        attention = np.zeros((sets, n + 1, n + 1), dtype=np.float32)  # [N, steps incl. END, END + points]
        lengths = np.zeros((sets,), dtype=np.int64)
        if sets == 0:
            return {"pointers": (pointers, "INT64"), "lengths": (lengths, "INT64"), "attention": (attention, "FP32")}
        if mode == "greedy":
            r = decode.greedy(self.encoder, self.step, points, lens, s["bos_id"], s["eos_id"], n + 1, s["pad_id"])
            found = [(r["tokens"][i, : r["lengths"][i]], r["attention"][i]) for i in range(sets)]
        else:
            found = []
            for i in range(sets):
                b = decode.beam_search(self.encoder, self.step, points[i : i + 1], lens[:1], s["bos_id"],
                                       s["eos_id"], n + 1, beam=beam, **decode.search_options(s))
                found.append((b["tokens"], b["attention"]))
        for i, (tokens, dist) in enumerate(found):
            lengths[i] = len(tokens)
            pointers[i, : len(tokens)] = np.asarray(tokens) - 1  # positions 1..n -> point indices
            rows = min(len(tokens) + 1, dist.shape[0])
            attention[i, :rows] = dist[:rows]
        return {"pointers": (pointers, "INT64"), "lengths": (lengths, "INT64"), "attention": (attention, "FP32")}
