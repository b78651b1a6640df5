"""Translation: ``text`` (BYTES) in, the translation with its alignment out (SentencePiece
tokenizers bundled with the version)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from serving import decode
from serving.admission import over_limit
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

    def encode(self, text: str) -> list[int]:
        over_limit("the length of a text in characters", len(text), "text_chars", self.limits.text_chars)
        ids = self.src_sp.encode(text)
        return ids + [self.serving["eos_id"]] if self.serving.get("append_eos") else ids

    def translate(self, texts: list[str], mode: str, beam: int) -> list[dict]:
        """Each text -> {"tokens": target ids without EOS, "attention": [T(+1), S'], "src": ids}."""
        s = self.serving
        srcs = [self.encode(t) for t in texts]
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
        mode, beam = decode_params(params, "beam", self.serving.get("beam", 5))
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
        # [N, nbest]: a text with fewer finished hypotheses than asked for gets "" and NaN after them
        hyps = np.full((len(results), nbest), "", dtype=object)
        scores = np.full((len(results), nbest), np.nan, dtype=np.float32)
        for i, r in enumerate(results):
            for k, (tokens, score) in enumerate(r["nbest"][:nbest]):
                hyps[i, k], scores[i, k] = self.tgt_sp.decode(tokens), score
        return {"translation": (translations, "BYTES"), "attention": (attention, "FP32"),
                "source_pieces": (src_pieces, "BYTES"), "target_pieces": (tgt_pieces, "BYTES"),
                "nbest": (hyps, "BYTES"), "nbest_scores": (scores, "FP32")}
