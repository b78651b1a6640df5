"""The published model repository as servable models (onnxruntime only, never torch).

``model_repository/<model>/<version>/`` (written by ``pipeline/publish.py``) holds the graphs,
tokenizers and ``metadata.json`` whose ``serving`` block says how to run them. Each version
becomes up to three kinds of servable model:

* ``<model>`` — the whole model on raw input, the loop run here (``serving/decode.py``):
  translation takes ``text`` (BYTES) and returns the translation with its alignment; recurrent
  models take ``x`` and return outputs with the heads' weightings over time.
  Pointer networks take ``points`` and return pointer sequences with their distributions.
  Captioners take ``image`` and return captions with each word's attention over the image.
  Recurrent attention classifiers (RAM) take ``image`` and return the class and glimpse path.
  Attention OCR takes a text-line ``image`` and returns the text with each letter's attention;
  speech recognisers take raw ``audio`` and return the transcript with its alignment.
  A model exported as one graph (e.g. ACT) is that graph, under the model's own name.
* ``<model>.<graph>`` — each exported graph on its own (e.g. ``bahdanau.encoder``), a plain
  ONNX model whose requests the server may batch together.

Model names are matched against what is on disk, never joined into paths.
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from serving import decode
from serving.features import STACK, log_mel, stack_frames
from serving.protocol import ONNX_TYPES, RequestError, TensorSpec
from serving.runtime import OrtGraph

log = logging.getLogger("attnzoo.serving")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
MAX_TEXT_CHARS = 2000


class ServedModel(ABC):
    """A name, a version, declared tensors and ``infer(feeds, params) -> {name: (array, datatype)}``."""

    platform = "onnxruntime_onnx"
    batchable = False  # True: requests may be concatenated along axis 0 and split afterwards

    def __init__(self, name: str, version: int, inputs: list[TensorSpec], outputs: list[TensorSpec]):
        self.name, self.version, self.inputs, self.outputs = name, version, inputs, outputs

    def metadata(self, versions: list[int]) -> dict:
        return {"name": self.name, "versions": [str(v) for v in versions], "platform": self.platform,
                "inputs": [s.as_json() for s in self.inputs], "outputs": [s.as_json() for s in self.outputs]}

    @abstractmethod
    def infer(self, feeds: dict[str, np.ndarray], params: dict) -> dict[str, tuple[np.ndarray, str]]:
        """Run on validated inputs; raise RequestError for input the model cannot take."""


def decode_params(params: dict, mode: str, beam: int) -> tuple[str, int]:
    """The request's ``decode`` and ``beam`` parameters, checked; the arguments are the defaults."""
    mode, beam = params.get("decode", mode), params.get("beam", beam)
    if mode not in ("beam", "greedy"):
        raise RequestError("parameter 'decode' must be 'beam' or 'greedy'")
    if not isinstance(beam, int) or isinstance(beam, bool) or not 1 <= beam <= 32:
        raise RequestError("parameter 'beam' must be an integer from 1 to 32")
    return mode, beam


def _specs(items) -> list[TensorSpec]:
    return [TensorSpec(i.name, ONNX_TYPES.get(i.type, i.type),
                       tuple(d if isinstance(d, int) else -1 for d in i.shape)) for i in items]


class GraphModel(ServedModel):
    """One ONNX graph as it is. Batchable when every input and output has a free batch axis 0."""

    def __init__(self, name: str, version: int, graph: OrtGraph):
        sess = graph.session
        super().__init__(name, version, _specs(sess.get_inputs()), _specs(sess.get_outputs()))
        self.graph = graph
        self.batchable = all(s.shape and s.shape[0] == -1 for s in self.inputs + self.outputs)

    def infer(self, feeds, params):
        outs = self.graph(feeds)
        types = {s.name: s.datatype for s in self.outputs}
        return {k: (v, types[k]) for k, v in outs.items()}


class TranslationModel(ServedModel):
    """encoder + decoder_step + SentencePiece tokenizers: text in, translation and alignment out."""

    platform = "attnzoo_seq2seq"

    def __init__(self, name: str, version: int, folder: Path, meta: dict, graphs: dict[str, OrtGraph]):
        import sentencepiece as spm

        super().__init__(name, version, [TensorSpec("text", "BYTES", (-1,))], [
            TensorSpec("translation", "BYTES", (-1,)),
            TensorSpec("attention", "FP32", (-1, -1, -1)),  # [N, target pieces (+EOS), source pieces]
            TensorSpec("source_pieces", "BYTES", (-1, -1)),
            TensorSpec("target_pieces", "BYTES", (-1, -1)),
        ])
        self.serving = meta["serving"]
        self.encoder, self.step = graphs["encoder"], graphs["decoder_step"]
        self.src_sp = spm.SentencePieceProcessor(model_file=str(folder / self.serving["source_tokenizer"]))
        self.tgt_sp = spm.SentencePieceProcessor(model_file=str(folder / self.serving["target_tokenizer"]))

    def encode(self, text: str) -> list[int]:
        if len(text) > MAX_TEXT_CHARS:
            raise RequestError(f"a text of {len(text)} characters is longer than the limit {MAX_TEXT_CHARS}")
        ids = self.src_sp.encode(text)
        return ids + [self.serving["eos_id"]] if self.serving.get("append_eos") else ids

    def translate(self, texts: list[str], mode: str, beam: int) -> list[dict]:
        """Each text -> {"tokens": target ids without EOS, "attention": [T(+1), S'], "src": ids}."""
        s = self.serving
        srcs = [self.encode(t) for t in texts]
        if mode == "beam":
            out = []
            for src in srcs:
                r = decode.beam_search(self.encoder, self.step, np.array([src], dtype=np.int64),
                                       np.array([len(src)], dtype=np.int64), s["bos_id"], s["eos_id"],
                                       s["max_len"], beam=beam, length_penalty=s.get("length_penalty", 1.0))
                out.append({"tokens": r["tokens"].tolist(), "attention": r["attention"], "src": src})
            return out
        width = max(len(x) for x in srcs)
        src = np.full((len(srcs), width), s["pad_id"], dtype=np.int64)  # [N,S] right-padded
        for i, ids in enumerate(srcs):
            src[i, : len(ids)] = ids
        lens = np.array([len(x) for x in srcs], dtype=np.int64)
        r = decode.greedy(self.encoder, self.step, src, lens, s["bos_id"], s["eos_id"], s["max_len"], s["pad_id"])
        out = []
        for i in range(len(srcs)):
            n = int(r["lengths"][i])
            rows = min(n + 1, r["attention"].shape[1])  # the emitted pieces and the EOS step
            out.append({"tokens": r["tokens"][i, :n].tolist(), "attention": r["attention"][i, :rows], "src": srcs[i]})
        return out

    def infer(self, feeds, params):
        mode, beam = decode_params(params, "beam", self.serving.get("beam", 5))
        texts = [str(t) for t in feeds["text"].reshape(-1)]
        if not texts:
            return {"translation": (np.array([], dtype=object), "BYTES"),
                    "attention": (np.zeros((0, 0, 0), np.float32), "FP32"),
                    "source_pieces": (np.zeros((0, 0), dtype=object), "BYTES"),
                    "target_pieces": (np.zeros((0, 0), dtype=object), "BYTES")}
        results = self.translate(texts, mode, beam)
        rows = max(r["attention"].shape[0] for r in results)
        cols = max(r["attention"].shape[1] for r in results)
        attention = np.zeros((len(results), rows, cols), dtype=np.float32)  # zero-padded [N,T,S]
        src_pieces = np.full((len(results), max(len(r["src"]) for r in results)), "", dtype=object)
        tgt_pieces = np.full((len(results), rows), "", dtype=object)
        for i, r in enumerate(results):
            a = r["attention"]
            attention[i, : a.shape[0], : a.shape[1]] = a
            src_pieces[i, : len(r["src"])] = [self.src_sp.id_to_piece(t) for t in r["src"]]
            pieces = [self.tgt_sp.id_to_piece(t) for t in r["tokens"]]
            pieces += ["</s>"] * (a.shape[0] - len(pieces))  # the EOS step's row, when decoded
            tgt_pieces[i, : len(pieces)] = pieces
        translations = np.array([self.tgt_sp.decode(r["tokens"]) for r in results], dtype=object)
        return {"translation": (translations, "BYTES"), "attention": (attention, "FP32"),
                "source_pieces": (src_pieces, "BYTES"), "target_pieces": (tgt_pieces, "BYTES")}


class RecurrentModel(ServedModel):
    """init + step graphs unrolled over the input's time axis (e.g. the NTM)."""

    platform = "attnzoo_recurrent"

    def __init__(self, name: str, version: int, meta: dict, graphs: dict[str, OrtGraph]):
        self.init, self.step = graphs["init"], graphs["step"]
        self.serving = meta["serving"]
        x = _specs(self.init.session.get_inputs())[0]
        step_out = {s.name: s for s in _specs(self.step.session.get_outputs())}
        logits = step_out["logits"]
        self.attention = self.serving.get("attention_outputs", {})  # served name -> step output
        outputs = [TensorSpec("logits", "FP32", (-1, -1, *logits.shape[1:]))]
        if "bit_threshold" in self.serving:
            outputs.append(TensorSpec("bits", "UINT8", (-1, -1, *logits.shape[1:])))
        outputs += [TensorSpec(k, "FP32", (-1, -1, *step_out[v].shape[1:])) for k, v in self.attention.items()]
        super().__init__(name, version, [TensorSpec("x", "FP32", x.shape)], outputs)

    def infer(self, feeds, params):
        x = feeds["x"].astype(np.float32)
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise RequestError("input 'x' needs at least one sequence of at least one step")
        r = decode.unroll(self.init, self.step, x, tuple(self.attention.values()))
        out = {"logits": (r["logits"], "FP32")}
        if "bit_threshold" in self.serving:
            out["bits"] = ((r["logits"] > self.serving["bit_threshold"]).astype(np.uint8), "UINT8")
        out.update({k: (r[v], "FP32") for k, v in self.attention.items()})
        return out


class PointerModel(ServedModel):
    """encoder + decoder_step of a pointer network: point sets in, pointer sequences out.

    ``points`` [N, n, d] holds N sets of n points each; ``pointers`` are 0-based indices into each
    set (-1 after the end), ``attention`` the pointer distribution of every output step over
    [END, point 0, ..., point n-1].
    """

    platform = "attnzoo_pointer"

    def __init__(self, name: str, version: int, meta: dict, graphs: dict[str, OrtGraph]):
        self.encoder, self.step = graphs["encoder"], graphs["decoder_step"]
        self.serving = meta["serving"]
        src = _specs(self.encoder.session.get_inputs())[0]
        super().__init__(name, version, [TensorSpec("points", "FP32", (-1, -1, src.shape[-1]))], [
            TensorSpec("pointers", "INT64", (-1, -1)), TensorSpec("lengths", "INT64", (-1,)),
            TensorSpec("attention", "FP32", (-1, -1, -1))])

    def infer(self, feeds, params):
        mode, beam = decode_params(params, "greedy", self.serving.get("beam", 3))
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
                                       s["eos_id"], n + 1, beam=beam, length_penalty=s.get("length_penalty", 1.0))
                found.append((b["tokens"], b["attention"]))
        for i, (tokens, dist) in enumerate(found):
            lengths[i] = len(tokens)
            pointers[i, : len(tokens)] = np.asarray(tokens) - 1  # positions 1..n -> point indices
            rows = min(len(tokens) + 1, dist.shape[0])
            attention[i, :rows] = dist[:rows]
        return {"pointers": (pointers, "INT64"), "lengths": (lengths, "INT64"), "attention": (attention, "FP32")}


class CaptionModel(ServedModel):
    """encoder + decoder_step of an image captioner (Show, Attend and Tell): images in, captions
    and each word's attention over the image's feature grid out.

    ``image`` [N, H, W] holds grey-scale pixels in [0, 1]; ``attention`` [N, T, h, w] is α of
    every emitted word and the EOS step (zero after), ``words`` [N, T] the matching words.
    """

    platform = "attnzoo_caption"

    def __init__(self, name: str, version: int, meta: dict, graphs: dict[str, OrtGraph]):
        self.encoder, self.step = graphs["encoder"], graphs["decoder_step"]
        self.serving = meta["serving"]
        self.words = self.serving["vocabulary"]
        image = _specs(self.encoder.session.get_inputs())[0]
        self.size = image.shape[1:]
        super().__init__(name, version, [TensorSpec("image", "FP32", (-1, *self.size))], [
            TensorSpec("caption", "BYTES", (-1,)), TensorSpec("words", "BYTES", (-1, -1)),
            TensorSpec("attention", "FP32", (-1, -1, -1, -1))])

    def infer(self, feeds, params):
        mode, beam = decode_params(params, "beam", self.serving.get("beam", 3))
        images = feeds["image"].astype(np.float32)
        if not np.isfinite(images).all() or images.min(initial=0) < 0 or images.max(initial=0) > 1:
            raise RequestError("input 'image' must hold pixel values from 0 to 1")
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
                                   s["eos_id"], s["max_len"], beam=beam, length_penalty=s.get("length_penalty", 1.0))
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


def _transcribe(encoder, step, serving: dict, batch: dict[str, np.ndarray], singles: list[dict[str, np.ndarray]],
                mode: str, beam: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Greedy decoding of the padded ``batch`` or beam search of each item of ``singles`` ->
    per item (token ids without EOS, attention [T+1, S'] incl. the EOS step)."""
    s = serving
    if mode == "greedy":
        r = decode.greedy(encoder, step, batch, None, s["bos_id"], s["eos_id"], s["max_len"], s["pad_id"])
        return [(r["tokens"][i, : int(r["lengths"][i])], r["attention"][i, : int(r["lengths"][i]) + 1])
                for i in range(len(singles))]
    return [(b["tokens"], b["attention"]) for b in (
        decode.beam_search(encoder, step, feeds, None, s["bos_id"], s["eos_id"], s["max_len"], beam=beam,
                           length_penalty=s.get("length_penalty", 1.0)) for feeds in singles)]


class TextImageModel(ServedModel):
    """encoder + decoder_step of an attention OCR model: text-line images in, the text and each
    letter's attention over the image's feature grid out.

    ``image`` [N, H, W] holds grey-scale pixels in [0, 1] at the model's height; ``width`` [N]
    (optional) the pixel width of each image in a right-padded batch (default: W for all).
    ``attention`` [N, T, h, w'] is α of every letter and the EOS step over h × w' cells, each
    ``width_step`` pixels wide (zero after); ``letters`` [N, T] the matching letters.
    """

    platform = "attnzoo_text_image"

    def __init__(self, name: str, version: int, meta: dict, graphs: dict[str, OrtGraph]):
        self.encoder, self.step = graphs["encoder"], graphs["decoder_step"]
        self.serving = meta["serving"]
        self.height = _specs(self.encoder.session.get_inputs())[0].shape[1]
        super().__init__(name, version, [TensorSpec("image", "FP32", (-1, self.height, -1)),
                                         TensorSpec("width", "INT64", (-1,), optional=True)], [
            TensorSpec("text", "BYTES", (-1,)), TensorSpec("letters", "BYTES", (-1, -1)),
            TensorSpec("attention", "FP32", (-1, -1, -1, -1))])

    def infer(self, feeds, params):
        mode, beam = decode_params(params, "beam", self.serving.get("beam", 3))
        images = feeds["image"].astype(np.float32)
        n, _, full = images.shape
        if not np.isfinite(images).all() or images.min(initial=0) < 0 or images.max(initial=0) > 1:
            raise RequestError("input 'image' must hold pixel values from 0 to 1")
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
        found = _transcribe(self.encoder, self.step, self.serving, {"image": batch, "width": size}, singles, mode, beam)
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


class SpeechModel(ServedModel):
    """encoder + decoder_step of an attention speech recogniser: raw audio in, the transcript and
    its alignment out. The server computes the log-mel features (``serving/features.py``, the
    function the training data was made with).

    ``audio`` [N, S] holds 16 kHz samples in [-1, 1]; ``samples`` [N] (optional) the length of each
    clip in a right-padded batch (default: S for all). ``alignment`` [N, T, F'] is α of every
    character and the EOS step over encoder steps of ``stack`` feature frames (10 ms each).
    """

    platform = "attnzoo_speech"
    MAX_SECONDS = 60

    def __init__(self, name: str, version: int, meta: dict, graphs: dict[str, OrtGraph]):
        self.encoder, self.step = graphs["encoder"], graphs["decoder_step"]
        self.serving = meta["serving"]
        self.n_mels = _specs(self.encoder.session.get_inputs())[0].shape[2] // STACK
        super().__init__(name, version, [TensorSpec("audio", "FP32", (-1, -1)),
                                         TensorSpec("samples", "INT64", (-1,), optional=True)], [
            TensorSpec("text", "BYTES", (-1,)), TensorSpec("alignment", "FP32", (-1, -1, -1))])

    def infer(self, feeds, params):
        mode, beam = decode_params(params, "beam", self.serving.get("beam", 3))
        audio = feeds["audio"].astype(np.float32)
        n, full = audio.shape
        rate = int(self.serving.get("sample_rate", 16000))
        if full > self.MAX_SECONDS * rate:
            raise RequestError(f"audio longer than {self.MAX_SECONDS} s ({self.MAX_SECONDS * rate} samples)")
        if not np.isfinite(audio).all() or np.abs(audio).max(initial=0) > 1:
            raise RequestError("input 'audio' must hold samples from -1 to 1")
        samples = feeds.get("samples", np.full(n, full, dtype=np.int64))
        if samples.shape != (n,) or (n and (samples.min() < 1 or samples.max() > full)):
            raise RequestError(f"input 'samples' must hold one length from 1 to {full} per clip")
        if n == 0:
            return {"text": (np.array([], dtype=object), "BYTES"),
                    "alignment": (np.zeros((0, 0, 0), dtype=np.float32), "FP32")}
        # [S, 3·M] per clip: the features and stacking the training data went through
        feats = [stack_frames(log_mel(audio[i, :k], self.n_mels)) for i, k in enumerate(samples.tolist())]
        steps = np.array([f.shape[0] for f in feats], dtype=np.int64)
        batch = np.zeros((n, steps.max(), feats[0].shape[1]), dtype=np.float32)
        for i, f in enumerate(feats):
            batch[i, : f.shape[0]] = f
        singles = [{"features": f[None], "steps": steps[i : i + 1]} for i, f in enumerate(feats)]
        found = _transcribe(self.encoder, self.step, self.serving, {"features": batch, "steps": steps}, singles,
                            mode, beam)
        steps = max(a.shape[0] for _, a in found)
        alignment = np.zeros((n, steps, max(a.shape[1] for _, a in found)), dtype=np.float32)
        for i, (_, alpha) in enumerate(found):
            alignment[i, : alpha.shape[0], : alpha.shape[1]] = alpha
        texts = np.array(["".join(self.serving["vocabulary"][t] for t in tokens) for tokens, _ in found], dtype=object)
        return {"text": (texts, "BYTES"), "alignment": (alignment, "FP32")}


class GlimpseModel(ServedModel):
    """start + glimpse graphs of a recurrent attention classifier (RAM): images in; the class, its
    logits and the glimpse path out.

    ``image`` [N, H, W] holds grey-scale pixels in [0, 1]; ``locations`` [N, G, 2] are the glimpse
    centres as (x, y) in [-1, 1] over the image.
    """

    platform = "attnzoo_glimpse"

    def __init__(self, name: str, version: int, meta: dict, graphs: dict[str, OrtGraph]):
        self.start, self.step = graphs["start"], graphs["glimpse"]
        self.count = int(meta["serving"]["glimpses"])
        image = _specs(self.start.session.get_inputs())[0]
        classes = {s.name: s for s in _specs(self.step.session.get_outputs())}["logits"].shape[1]
        super().__init__(name, version, [TensorSpec("image", "FP32", (-1, *image.shape[1:]))], [
            TensorSpec("logits", "FP32", (-1, classes)), TensorSpec("pred", "INT64", (-1,)),
            TensorSpec("locations", "FP32", (-1, self.count, 2))])

    def infer(self, feeds, params):
        images = feeds["image"].astype(np.float32)
        if not np.isfinite(images).all() or images.min(initial=0) < 0 or images.max(initial=0) > 1:
            raise RequestError("input 'image' must hold pixel values from 0 to 1")
        if images.shape[0] == 0:
            raise RequestError("input 'image' needs at least one image")
        r = decode.glimpses(self.start, self.step, images, self.count)
        return {"logits": (r["logits"], "FP32"), "pred": (r["pred"], "INT64"), "locations": (r["locations"], "FP32")}


class TableQuestionModel(ServedModel):
    """A one-graph table QA model (Neural Programmer) on raw input: the question as text, the
    column names as text, the table as numbers; answers with the executed program's soft choices.

    Numbers in a question become the number token and their value the pivot (one per question).
    """

    platform = "attnzoo_table_qa"

    def __init__(self, name: str, version: int, meta: dict, graph: OrtGraph):
        self.graph, self.serving = graph, meta["serving"]
        self.vocab = {w: i for i, w in enumerate(self.serving["vocabulary"])}
        super().__init__(name, version, [
            TensorSpec("question", "BYTES", (-1,)), TensorSpec("columns", "BYTES", (-1, -1)),
            TensorSpec("table", "FP32", (-1, -1, -1))], [
            TensorSpec("answer", "FP32", (-1,)), TensorSpec("is_lookup", "BOOL", (-1,)),
            TensorSpec("cells", "BOOL", (-1, -1, -1)), TensorSpec("op_weights", "FP32", (-1, -1, -1)),
            TensorSpec("col_weights", "FP32", (-1, -1, -1))])

    def _ids(self, words: list[str], what: str) -> list[int]:
        unknown = sorted({w for w in words if w not in self.vocab})
        if unknown:
            raise RequestError(f"{what}: unknown word(s) {unknown}; known: {sorted(self.vocab)[:40]}")
        return [self.vocab[w] for w in words]

    def infer(self, feeds, params):
        questions, columns, table = feeds["question"].reshape(-1), feeds["columns"], feeds["table"].astype(np.float32)
        n = len(questions)
        if columns.shape[0] != n or table.shape[0] != n or table.shape[2] != columns.shape[1]:
            raise RequestError("question [N], columns [N,C] and table [N,rows,C] must agree on N and C")
        if n == 0 or table.shape[1] == 0 or not np.isfinite(table).all():
            raise RequestError("each table needs at least one row of finite numbers")
        ids, pivots = [], []
        for q in questions:
            words, nums = [], []
            for w in str(q).lower().replace("?", " ").split():
                try:
                    nums.append(float(w))
                    words.append(self.serving["number_token"])
                except ValueError:
                    words.append(w)
            if len(nums) > 1:
                raise RequestError(f"question '{q}': at most one number is supported")
            if not words or len(words) > 64:
                raise RequestError(f"question '{q}' must have 1 to 64 words")
            ids.append(self._ids(words, f"question '{q}'"))
            pivots.append(nums[0] if nums else 0.0)
        question = np.zeros((n, max(map(len, ids))), np.int64)  # [N,L] right-padded
        for i, row in enumerate(ids):
            question[i, : len(row)] = row
        cols = np.array([self._ids([str(c).lower() for c in row], "columns") for row in columns], np.int64)
        out = self.graph({"question": question, "q_len": np.array([len(r) for r in ids], np.int64), "columns": cols,
                          "table": table, "row_mask": np.ones(table.shape[:2], np.float32),
                          "pivot": np.array(pivots, np.float32)})
        lookup = out["is_lookup"].astype(bool)
        # A lookup answer is the selected cells; its scalar is 0 (JSON has no NaN).
        return {"answer": (np.where(lookup, 0.0, out["scalar"]).astype(np.float32), "FP32"),
                "is_lookup": (lookup, "BOOL"), "cells": (out["lookup"] > 0.5, "BOOL"),
                "op_weights": (out["op_weights"], "FP32"), "col_weights": (out["col_weights"], "FP32")}


def load_version(name: str, version: int, folder: Path, provider: str = "auto", threads: int = 0
                 ) -> tuple[ServedModel | None, dict[str, OrtGraph]]:
    """One published version folder -> (the whole model on raw input, or None; its graphs).

    A model with one graph and no input decoding of its own (``loop: single``) is that graph.
    """
    meta = json.loads((Path(folder) / "metadata.json").read_text())
    graphs = {g: OrtGraph(Path(folder) / f"{g}.onnx", provider, threads) for g in meta["graphs"]}
    loop = meta.get("serving", {}).get("loop")
    if loop == "seq2seq" and "source_tokenizer" in meta["serving"]:
        return TranslationModel(name, version, Path(folder), meta, graphs), graphs
    if loop == "seq2seq" and meta["serving"].get("input") == "points":
        return PointerModel(name, version, meta, graphs), graphs
    if loop == "seq2seq" and meta["serving"].get("input") == "text_image":
        return TextImageModel(name, version, meta, graphs), graphs
    if loop == "seq2seq" and meta["serving"].get("input") == "audio":
        return SpeechModel(name, version, meta, graphs), graphs
    if loop == "seq2seq" and meta["serving"].get("input") == "image":
        return CaptionModel(name, version, meta, graphs), graphs
    if loop == "glimpse":
        return GlimpseModel(name, version, meta, graphs), graphs
    if loop == "recurrent":
        return RecurrentModel(name, version, meta, graphs), graphs
    if loop == "single" and meta["serving"].get("input") == "table_question":
        return TableQuestionModel(name, version, meta, graphs["model"]), graphs
    if loop == "single" and len(graphs) == 1:
        return GraphModel(name, version, next(iter(graphs.values()))), graphs
    return None, graphs


class Repository:
    """Every version of every model under ``root``, loaded once at start-up."""

    def __init__(self, root: Path | str, provider: str = "auto", threads: int = 0):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"no model repository at {self.root}: run `dvc repro` (publish) first")
        self.models: dict[str, dict[int, ServedModel]] = {}
        self.errors: dict[str, str] = {}
        self.providers: set[str] = set()
        for model_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and NAME_RE.match(p.name)):
            for version_dir in sorted((p for p in model_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
                try:
                    self._load(model_dir.name, int(version_dir.name), version_dir, provider, threads)
                except Exception as err:  # one broken version must not take the others down
                    self.errors[f"{model_dir.name}/{version_dir.name}"] = f"{type(err).__name__}: {err}"
                    log.error("could not load %s version %s: %s", model_dir.name, version_dir.name, err)

    def _add(self, model: ServedModel) -> None:
        self.models.setdefault(model.name, {})[model.version] = model

    def _load(self, name: str, version: int, folder: Path, provider: str, threads: int) -> None:
        whole, graphs = load_version(name, version, folder, provider, threads)
        self.providers.update(g.provider for g in graphs.values())
        if whole is not None:
            self._add(whole)
        else:
            log.warning("%s version %d has no serving loop in its metadata (published before serving "
                        "existed, or a single graph): only its graphs are served, as %s.<graph>", name, version, name)
        for graph_name, graph in graphs.items():
            self._add(GraphModel(f"{name}.{graph_name}", version, graph))

    def get(self, name: str, version: str | None = None) -> ServedModel:
        versions = self.models.get(name)
        if not versions:
            raise RequestError(f"unknown model '{name}'; served: {sorted(self.models)}", status=404)
        if version is None:
            return versions[max(versions)]  # version policy: latest by default
        if not version.isdigit() or int(version) not in versions:
            raise RequestError(f"model '{name}' has no version '{version}'; versions: {sorted(versions)}",
                               status=404)
        return versions[int(version)]

    def versions(self, name: str) -> list[int]:
        return sorted(self.models.get(name, {}))
