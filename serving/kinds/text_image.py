"""Attention OCR: text-line images in, the text and each letter's attention out."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from serving import decode
from serving.admission import over_limit
from serving.base import ServedModel, check_pixels, decode_params, specs
from serving.kinds import register
from serving.protocol import RequestError, TensorSpec


@register("text_image")
class TextImageModel(ServedModel):
    """encoder + decoder_step of an attention OCR model: text-line images in, the text and each
    letter's attention over the image's feature grid out.

    ``image`` [N, H, W] holds grey-scale pixels in [0, 1] at the model's height; ``width`` [N]
    (optional) the pixel width of each image in a right-padded batch (default: W for all).
    ``attention`` [N, T, h, w'] is α of every letter and the EOS step over h × w' cells, each
    ``width_step`` pixels wide (zero after); ``letters`` [N, T] the matching letters.
    """

    platform = "attnzoo_text_image"
    limit_axes = {"image": {0: ("images", "rows")}}

    def __init__(self, name: str, version: int, folder: Path, meta: dict, graphs: dict, limits=None):
        self.encoder, self.step = graphs["encoder"], graphs["decoder_step"]
        self.serving = meta["serving"]
        self.height = specs(self.encoder.session.get_inputs())[0].shape[1]
        super().__init__(name, version, [TensorSpec("image", "FP32", (-1, self.height, -1)),
                                         TensorSpec("width", "INT64", (-1,), optional=True)], [
            TensorSpec("text", "BYTES", (-1,)), TensorSpec("letters", "BYTES", (-1, -1)),
            TensorSpec("attention", "FP32", (-1, -1, -1, -1))], limits)

    def infer(self, feeds, params):
        mode, beam = decode_params(params, "beam", self.serving)
        images = feeds["image"].astype(np.float32)
        n, _, full = images.shape
        over_limit("the pixels of an image", self.height * full, "image_pixels", self.limits.image_pixels)
        check_pixels("image", images)
        widths = feeds.get("width", np.full(n, full, dtype=np.int64))
        if widths.shape != (n,) or (n and (widths.min() < 1 or widths.max() > full)):
            raise RequestError(f"input 'width' must hold one width from 1 to {full} per image")
        if n == 0:
            return {"text": (np.array([], dtype=object), "BYTES"), "letters": (np.zeros((0, 0), dtype=object), "BYTES"),
                    "attention": (np.zeros((0, 0, 0, 0), dtype=np.float32), "FP32")}
        step = int(self.serving.get("width_step", 1))
        # each image at its own width, rounded up to the CNN's stride by repeating its last column
        crops = []
        for i, w in enumerate(widths.tolist()):
            padded = -(-w // step) * step
            crops.append(np.pad(images[i, :, :w], ((0, 0), (0, padded - w)), mode="edge"))
        size = np.array([c.shape[1] for c in crops], dtype=np.int64)
        batch = np.zeros((n, self.height, size.max()), dtype=np.float32)
        for i, c in enumerate(crops):
            batch[i, :, : c.shape[1]] = c
        singles = [{"image": c[None], "width": size[i : i + 1]} for i, c in enumerate(crops)]
        found = decode.transcribe(self.encoder, self.step, self.serving, {"image": batch, "width": size}, singles,
                                  mode, beam)
        cols = -(-size // step)  # feature columns of each image, [N]
        # the annotations are rows × columns, row-major over the columns of the decoded batch
        used = np.full(n, cols.max()) if mode == "greedy" else cols
        rows = found[0][1].shape[1] // int(used[0])
        steps = max(a.shape[0] for _, a in found)
        attention = np.zeros((n, steps, rows, cols.max()), dtype=np.float32)
        letters = np.full((n, steps), "", dtype=object)
        for i, (tokens, alpha) in enumerate(found):
            # [T,L] -> [T,h,w'] -> the image's own columns
            alpha = alpha.reshape(alpha.shape[0], rows, int(used[i]))[:, :, : cols[i]]
            attention[i, : alpha.shape[0], :, : cols[i]] = alpha
            names = [self.serving["vocabulary"][t] for t in tokens] + ["</s>"] * (alpha.shape[0] - len(tokens))
            letters[i, : len(names)] = names
        texts = np.array(["".join(self.serving["vocabulary"][t] for t in tokens) for tokens, _ in found], dtype=object)
        return {"text": (texts, "BYTES"), "letters": (letters, "BYTES"), "attention": (attention, "FP32")}
