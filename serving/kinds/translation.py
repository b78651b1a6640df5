"""Translation: ``text`` (BYTES) in, the translation with its alignment out (SentencePiece
tokenizers bundled with the version).

Two engines, chosen per version by its serving block: the ONNX graphs run by ``serving.decode``'s
loops (every version), or CTranslate2 (``"engine": "ctranslate2"``: the version carries the model
converted by ``publish``, ``pipeline/ctranslate2_engine.py``, with the ``serve`` extra's
``ctranslate2``). Both answer the same tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from serving import decode
from serving.admission import COMPUTE, check_deadline, over_limit
from serving.base import ServedModel, decode_params
from serving.kinds import register
from serving.protocol import RequestError, TensorSpec

# Hypotheses of one beam step call: 32 texts at beam 5. Their self-attention caches and encoder keys
# grow with it (rows x layers x width x length), so a request of many texts at a wide beam runs in turns.
BEAM_ROWS = 160


def padded(srcs: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Id lists -> src [N,S] right-padded, src_len [N]."""
    src = np.full((len(srcs), max(len(x) for x in srcs)), pad, dtype=np.int64)
    for i, ids in enumerate(srcs):
        src[i, : len(ids)] = ids
    return src, np.array([len(x) for x in srcs], dtype=np.int64)


@register("translation")
class TranslationModel(ServedModel):
    """encoder + decoder_step + SentencePiece tokenizers: text in, translation and alignment out."""

    platform = "attnzoo_seq2seq"
    limit_axes = {"text": {0: ("texts", "rows")}}

    def __init__(self, name: str, version: int, folder: Path, meta: dict, graphs: dict, limits=None):
        import sentencepiece as spm

        super().__init__(name, version, [TensorSpec("text", "BYTES", (-1,))], [
            TensorSpec("translation", "BYTES", (-1,)),
            TensorSpec("attention", "FP32", (-1, -1, -1)),  # [N, target pieces (+EOS), source pieces]
            TensorSpec("source_pieces", "BYTES", (-1, -1)),
            TensorSpec("target_pieces", "BYTES", (-1, -1)),
            # The `nbest` best beam hypotheses of each text, best first, and their scores (log p over
            # length**length_penalty, as beam search ranks them); NaN scores for greedy decoding.
            TensorSpec("nbest", "BYTES", (-1, -1)),
            TensorSpec("nbest_scores", "FP32", (-1, -1)),
        ], limits)
        self.serving = meta["serving"]
        self.encoder, self.step = graphs["encoder"], graphs["decoder_step"]
        self.src_sp = spm.SentencePieceProcessor(model_file=str(folder / self.serving["source_tokenizer"]))
        self.tgt_sp = spm.SentencePieceProcessor(model_file=str(folder / self.serving["target_tokenizer"]))
        self.folder, self.engine = folder, None  # CTranslate2's translator, made by open_engine()

    def open_engine(self, provider: str = "auto", threads: int = 0) -> None:
        engine = self.serving.get("engine", "onnxruntime")
        if engine == "ctranslate2":
            ct2 = self.serving["ctranslate2"]
            self.engine = CT2Engine(self.folder / ct2["folder"], provider, threads, ct2.get("compute_type", "float32"),
                                    ct2.get("cpu_threads"))
        elif engine != "onnxruntime":
            raise ValueError(f"engine {engine!r} is not known to this server (known: onnxruntime, ctranslate2); "
                             "upgrade the server")

    def memory_size(self, shapes, feeds, params) -> tuple[int, int, int]:
        """(texts encoded at once, their longest length, beam hypotheses decoded at once). A text's
        pieces are at most its characters, one for a leading word boundary and EOS: before the data
        is read (``feeds`` None) nothing is known of its length."""
        texts = (shapes.get("text") or (1,))[0]
        if feeds is None or "text" not in feeds:
            return texts, 1, 0
        steps = max((len(str(t)) for t in feeds["text"].reshape(-1)), default=0) + 2
        mode, beam = decode_params(params, "beam", self.serving)
        if mode == "beam":
            texts = min(texts, max(1, BEAM_ROWS // beam))  # the texts of one chunk run at once
            return texts, steps, texts * beam
        return texts, steps, texts

    def encode(self, text: str) -> list[int]:
        over_limit("the length of a text in characters", len(text), "text_chars", self.limits.text_chars)
        ids = self.src_sp.encode(text)
        return ids + [self.serving["eos_id"]] if self.serving.get("append_eos") else ids

    def translate(self, texts: list[str], mode: str, beam: int, nbest: int = 1) -> list[dict]:
        """Each text -> {"tokens": target ids without EOS, "attention": [T(+1), S'], "src": ids,
        "nbest": at least ``nbest`` (ids, score) best first}."""
        s = self.serving
        srcs = [self.encode(t) for t in texts]
        if self.engine is not None:
            return self.engine.translate(srcs, beam if mode == "beam" else 1, nbest, s)
        if mode == "beam":
            out = []
            # The texts' searches share each step call (beam_search_batch), at most BEAM_ROWS hypotheses
            # at once: memory grows with texts x beam x their length, as the request's limits allow.
            size = max(1, BEAM_ROWS // beam)
            for at in range(0, len(srcs), size):
                chunk = srcs[at : at + size]
                src, lens = padded(chunk, s["pad_id"])
                found = decode.beam_search_batch(self.encoder, self.step, src, lens, s["bos_id"], s["eos_id"],
                                                 s["max_len"], beam=beam, **decode.search_options(s))
                out += [{"tokens": r["tokens"].tolist(), "attention": r["attention"], "src": ids,
                         "nbest": [(t.tolist(), score) for t, score in r["nbest"]]} for ids, r in zip(chunk, found)]
            return out
        src, lens = padded(srcs, s["pad_id"])
        r = decode.greedy(self.encoder, self.step, src, lens, s["bos_id"], s["eos_id"], s["max_len"], s["pad_id"])
        out = []
        for i in range(len(srcs)):
            n = int(r["lengths"][i])
            rows = min(n + 1, r["attention"].shape[1])  # the emitted pieces and the EOS step
            tokens = r["tokens"][i, :n].tolist()
            out.append({"tokens": tokens, "attention": r["attention"][i, :rows], "src": srcs[i],
                        "nbest": [(tokens, float("nan"))]})
        return out

    def infer(self, feeds, params):
        mode, beam = decode_params(params, "beam", self.serving)
        nbest = params.get("nbest", 1)
        if not isinstance(nbest, int) or isinstance(nbest, bool) or not 1 <= nbest <= beam:
            raise RequestError(f"parameter 'nbest' must be an integer from 1 to the beam size ({beam})")
        if nbest > 1 and mode != "beam":
            raise RequestError("parameter 'nbest' above 1 needs decode 'beam' (greedy decoding has one hypothesis)")
        texts = [str(t) for t in feeds["text"].reshape(-1)]
        if not texts:
            return {"translation": (np.array([], dtype=object), "BYTES"),
                    "attention": (np.zeros((0, 0, 0), np.float32), "FP32"),
                    "source_pieces": (np.zeros((0, 0), dtype=object), "BYTES"),
                    "target_pieces": (np.zeros((0, 0), dtype=object), "BYTES"),
                    "nbest": (np.zeros((0, nbest), dtype=object), "BYTES"),
                    "nbest_scores": (np.zeros((0, nbest), np.float32), "FP32")}
        results = self.translate(texts, mode, beam, nbest)
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
        # [N, nbest]: a text with fewer finished hypotheses than asked for gets "" and NaN after them
        hyps = np.full((len(results), nbest), "", dtype=object)
        scores = np.full((len(results), nbest), np.nan, dtype=np.float32)
        for i, r in enumerate(results):
            for k, (tokens, score) in enumerate(r["nbest"][:nbest]):
                hyps[i, k], scores[i, k] = self.tgt_sp.decode(tokens), score
        return {"translation": (translations, "BYTES"), "attention": (attention, "FP32"),
                "source_pieces": (src_pieces, "BYTES"), "target_pieces": (tgt_pieces, "BYTES"),
                "nbest": (hyps, "BYTES"), "nbest_scores": (scores, "FP32")}


class CT2Engine:
    """``ctranslate2.Translator`` over a version's converted model: the search of
    :func:`serving.decode.beam_search_batch` (its ranking, stopping rule and n-best scores), greedy
    decoding as beam 1 (no scores, as the ONNX loop), in chunks of :data:`BEAM_ROWS` hypotheses.
    ``compute_type`` as the version was converted: ``float32``, or ``int8`` (int8 weights, an int8
    variant's); ``cpu_threads``: the most intra-op threads the version runs on the CPU (int8: one,
    measured fastest), below the server's ``threads``."""

    def __init__(self, folder: Path, provider: str, threads: int, compute_type: str = "float32",
                 cpu_threads: int | None = None):
        try:
            import ctranslate2
        except ImportError as err:
            raise RuntimeError(f"{folder} is served by CTranslate2, which is not installed: "
                               "pip install 'attnzoo[serve]' (or ctranslate2)") from err
        cuda = provider != "cpu" and ctranslate2.get_cuda_device_count() > 0
        if provider == "cuda" and not cuda:
            raise RuntimeError("CUDA requested but CTranslate2 sees no CUDA device here")
        # the precision it was converted to; intra_threads: the server's --ort-threads (0: one per core),
        # at most the version's cpu_threads on the CPU; one translation at a time
        self.threads = threads or os.cpu_count() or 1
        if not cuda and cpu_threads:
            self.threads = min(self.threads, cpu_threads)
        self.translator = ctranslate2.Translator(str(folder), device="cuda" if cuda else "cpu",
                                                 compute_type=compute_type, inter_threads=1,
                                                 intra_threads=self.threads)
        self.device = "cuda" if cuda else "cpu"
        self.source = json.loads((folder / "source_vocabulary.json").read_text())  # pieces by id
        self.index = {p: i for i, p in enumerate(json.loads((folder / "target_vocabulary.json").read_text()))}

    def translate(self, srcs: list[list[int]], beam: int, nbest: int, s: dict) -> list[dict]:
        eos, out, size = self.index["</s>"], [], max(1, BEAM_ROWS // beam)
        options = decode.search_options(s)
        for at in range(0, len(srcs), size):
            chunk = srcs[at : at + size]
            check_deadline()  # a request past its deadline stops before its next chunk (HTTP 504)
            with COMPUTE:
                found = self.translator.translate_batch(
                    [[self.source[t] for t in ids] for ids in chunk], beam_size=beam, num_hypotheses=min(nbest, beam),
                    length_penalty=options["length_penalty"], no_repeat_ngram_size=options["no_repeat_ngram"],
                    max_decoding_length=s["max_len"], min_decoding_length=0, return_scores=True,
                    return_attention=True, return_end_token=True)
            first = self._first_rows(chunk) if beam > 1 and len({len(x) for x in chunk}) > 1 else None
            for i, (ids, r) in enumerate(zip(chunk, found)):
                ranked = [self._hypothesis(h, score, beam, eos, options["length_penalty"])
                          for h, score in zip(r.hypotheses, r.scores)]
                attention = np.asarray(r.attention[0], dtype=np.float32)  # [T(+1), S]
                if first is not None:
                    attention[0] = first[i]
                out.append({"tokens": ranked[0][0], "attention": attention, "src": ids, "nbest": ranked})
        return out

    def _hypothesis(self, pieces: list[str], score: float, beam: int, eos: int, length_penalty: float):
        """(ids without EOS, score as the ONNX loop gives it): NaN for greedy decoding; for a hypothesis
        that reached max_len without EOS, log p itself (CTranslate2 normalises it by its length too)."""
        ids = [self.index[p] for p in pieces]
        if beam == 1:
            return ids[:-1] if ids and ids[-1] == eos else ids, float("nan")
        if ids and ids[-1] == eos:
            return ids[:-1], score  # the EOS step's row of the attention stays
        return ids, score * max(len(ids), 1) ** length_penalty

    def _first_rows(self, chunk: list[list[int]]) -> list[np.ndarray]:
        """The first step's alignment of each source. CTranslate2 4.8's beam search returns it wrong
        for a source shorter than others in its batch (weight on the padding: rows summing to 0.94-0.99,
        measured); every hypothesis starts from BOS alone, so one greedy step gives it."""
        with COMPUTE:
            found = self.translator.translate_batch([[self.source[t] for t in ids] for ids in chunk], beam_size=1,
                                                    max_decoding_length=1, min_decoding_length=0,
                                                    return_attention=True, return_end_token=True)
        return [np.asarray(r.attention[0][0], dtype=np.float32) for r in found]
