"""Recurrent attention classifiers (RAM): images in, the class and glimpse path out."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from serving import decode
from serving.admission import COMPUTE
from serving.base import ServedModel, check_pixels, specs
from serving.kinds import register
from serving.protocol import RequestError, TensorSpec


@register("glimpse")
class GlimpseModel(ServedModel):
    """start + glimpse graphs of a recurrent attention classifier (RAM): images in; the class, its
    logits and the glimpse path out.

    ``image`` [N, H, W] holds grey-scale pixels in [0, 1]; ``locations`` [N, G, 2] are the glimpse
    centres as (x, y) in [-1, 1] over the image.
    """

    platform = "attnzoo_glimpse"
    limit_axes = {"image": {0: ("images", "rows")}}

    def __init__(self, name: str, version: int, folder: Path, meta: dict, graphs: dict, limits=None):
        self.start, self.step = graphs["start"], graphs["glimpse"]
        self.count = int(meta["serving"]["glimpses"])
        image = specs(self.start.session.get_inputs())[0]
        classes = {s.name: s for s in specs(self.step.session.get_outputs())}["logits"].shape[1]
        super().__init__(name, version, [TensorSpec("image", "FP32", (-1, *image.shape[1:]))], [
            TensorSpec("logits", "FP32", (-1, classes)), TensorSpec("pred", "INT64", (-1,)),
            TensorSpec("locations", "FP32", (-1, self.count, 2))], limits)

    def infer(self, feeds, params):
        images = feeds["image"].astype(np.float32)
        check_pixels("image", images)
        if images.shape[0] == 0:
            raise RequestError("input 'image' needs at least one image")
        # A large request's rows over the --infer-threads cores (each glimpse call is small).
        r = decode.split_rows(lambda f: decode.glimpses(self.start, self.step, f["image"], self.count),
                              {"image": images}, COMPUTE.size)
        return {"logits": (r["logits"], "FP32"), "pred": (r["pred"], "INT64"), "locations": (r["locations"], "FP32")}
