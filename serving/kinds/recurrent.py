"""Recurrent models (e.g. the NTM): ``x`` [N, T, I] in, outputs and the heads' weightings over time out."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from serving import decode
from serving.admission import COMPUTE
from serving.base import ServedModel, specs
from serving.kinds import register
from serving.protocol import RequestError, TensorSpec


@register("recurrent")
class RecurrentModel(ServedModel):
    """init + step graphs unrolled over the input's time axis (e.g. the NTM)."""

    platform = "attnzoo_recurrent"
    limit_axes = {"x": {0: ("sequences", "rows"), 1: ("time steps", "steps")}}
    output_axes = {1: ("x", 1)}  # every output is per time step

    def __init__(self, name: str, version: int, folder: Path, meta: dict, graphs: dict, limits=None):
        self.init, self.step = graphs["init"], graphs["step"]
        self.serving = meta["serving"]
        x = specs(self.init.session.get_inputs())[0]
        step_out = {s.name: s for s in specs(self.step.session.get_outputs())}
        logits = step_out["logits"]
        self.attention = self.serving.get("attention_outputs", {})  # served name -> step output
        outputs = [TensorSpec("logits", "FP32", (-1, -1, *logits.shape[1:]))]
        if "bit_threshold" in self.serving:
            outputs.append(TensorSpec("bits", "UINT8", (-1, -1, *logits.shape[1:])))
        outputs += [TensorSpec(k, "FP32", (-1, -1, *step_out[v].shape[1:])) for k, v in self.attention.items()]
        super().__init__(name, version, [TensorSpec("x", "FP32", x.shape)], outputs, limits)

    def infer(self, feeds, params):
        x = feeds["x"].astype(np.float32)
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise RequestError("input 'x' needs at least one sequence of at least one step")
        # A large request's rows over the --infer-threads cores (each step call is small).
        r = decode.split_rows(lambda f: decode.unroll(self.init, self.step, f["x"], tuple(self.attention.values())),
                              {"x": x}, COMPUTE.size)
        out = {"logits": (r["logits"], "FP32")}
        if "bit_threshold" in self.serving:
            out["bits"] = ((r["logits"] > self.serving["bit_threshold"]).astype(np.uint8), "UINT8")
        out.update({k: (r[v], "FP32") for k, v in self.attention.items()})
        return out
