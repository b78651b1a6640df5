"""Image captioners (Show, Attend and Tell): images in, captions and each word's attention out."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from serving import decode
from serving.base import ServedModel, check_pixels, decode_params, specs
from serving.kinds import register
from serving.protocol import TensorSpec


@register("image_caption")
class CaptionModel(ServedModel):
    """encoder + decoder_step of an image captioner (Show, Attend and Tell): images in, captions
    and each word's attention over the image's feature grid out.

    ``image`` [N, H, W] holds grey-scale pixels in [0, 1]; ``attention`` [N, T, h, w] is α of
    every emitted word and the EOS step (zero after), ``words`` [N, T] the matching words.
    """

    platform = "attnzoo_caption"
    limit_axes = {"image": {0: ("images", "rows")}}

    def __init__(self, name: str, version: int, folder: Path, meta: dict, graphs: dict, limits=None):
        self.encoder, self.step = graphs["encoder"], graphs["decoder_step"]
        self.serving = meta["serving"]
        self.words = self.serving["vocabulary"]
        image = specs(self.encoder.session.get_inputs())[0]
        self.size = image.shape[1:]
        super().__init__(name, version, [TensorSpec("image", "FP32", (-1, *self.size))], [
            TensorSpec("caption", "BYTES", (-1,)), TensorSpec("words", "BYTES", (-1, -1)),
            TensorSpec("attention", "FP32", (-1, -1, -1, -1))], limits)

    def infer(self, feeds, params):
        mode, beam = decode_params(params, "beam", self.serving)
        images = feeds["image"].astype(np.float32)
        check_pixels("image", images)
        s, n = self.serving, images.shape[0]
        found = []
        if n and mode == "greedy":
            r = decode.greedy(self.encoder, self.step, {"image": images}, None, s["bos_id"], s["eos_id"],
                              s["max_len"], s["pad_id"])
            for i in range(n):
                k = int(r["lengths"][i])
                found.append((r["tokens"][i, :k], r["attention"][i, : min(k + 1, r["attention"].shape[1])]))
        for i in range(n if mode == "beam" else 0):
            b = decode.beam_search(self.encoder, self.step, {"image": images[i : i + 1]}, None, s["bos_id"],
                                   s["eos_id"], s["max_len"], beam=beam, **decode.search_options(s))
            found.append((b["tokens"], b["attention"]))
        rows = max((a.shape[0] for _, a in found), default=0)
        regions = found[0][1].shape[1] if found else 0
        side = int(round(np.sqrt(regions)))  # the square canvas gives a square feature grid
        attention = np.zeros((n, rows, side, side), dtype=np.float32)
        words = np.full((n, rows), "", dtype=object)
        for i, (tokens, alpha) in enumerate(found):
            attention[i, : alpha.shape[0]] = alpha.reshape(alpha.shape[0], side, side)  # [T,L] -> [T,h,w]
            names = [self.words[t] for t in tokens] + ["</s>"] * (alpha.shape[0] - len(tokens))
            words[i, : len(names)] = names
        captions = np.array([" ".join(self.words[t] for t in tokens) for tokens, _ in found], dtype=object)
        return {"caption": (captions, "BYTES"), "words": (words, "BYTES"), "attention": (attention, "FP32")}
