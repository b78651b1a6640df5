"""Decoding loops over exported step graphs, in numpy (docs/architecture.md §3: the server runs the loop).

A *graph* here is any callable ``feeds -> outputs`` over named numpy arrays: an onnxruntime
session (serving, parity) or a PyTorch module behind the same names (evaluation), so one loop
serves both and parity compares like with like.

Seq2seq naming contract (``encoder`` + ``decoder_step``): the decoder step takes ``y_prev``
[B], *carried* inputs X whose next value it returns as ``new_X`` (first value: the encoder's
output X), and *static* inputs copied from the encoder outputs; it returns ``log_probs`` [B,V]
and ``attention`` [B,S].

Recurrent naming contract (``init`` + ``step``): ``init`` maps the input sequence to the
initial state; ``step`` takes ``x`` [B,I] and the state X, returns ``logits`` and ``new_X``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from serving.admission import current_deadline, deadline_carried

# Beam search's width where a model's params.yaml evaluate block sets none: the one default of evaluation
# (pipeline/config.py), of the published serving block and of the server.
BEAM = 5

Graph = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
Loop = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _helpers(count: int) -> ThreadPoolExecutor:
    """A process-wide pool with at least ``count`` threads (grown, never shrunk)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < count:
            _pool = ThreadPoolExecutor(count, thread_name_prefix="attnzoo-rows")
        return _pool


def split_rows(loop: Loop, feeds: dict[str, np.ndarray], workers: int, fill: dict[str, float] | None = None,
               min_rows: int = 4) -> dict[str, np.ndarray]:
    """``loop(feeds)`` over ``workers`` contiguous row ranges of the batch at once, outputs joined back.

    Why: a decoding loop makes many small graph calls (RAM: 8 glimpses, a decoder: one per token). At
    batch 32 one ONNX Runtime session gains little from a second intra-op thread on such small ops,
    while two single-thread loops over half the rows each use both cores (onnxruntime releases the
    GIL inside ``run``; sessions may be run from several threads at once). Rows never interact, so
    each row's result is the one the whole batch gives; a loop whose per-row outputs run for a
    different number of steps in two ranges (greedy tokens [B,T]) is padded along its later axes
    with ``fill[name]`` (default 0), as the whole batch pads rows that ended early.

    Args: feeds {name: [B,...]}; workers: how many ranges at most (each at least ``min_rows`` rows).
    Returns: the loop's outputs over all B rows, in order.
    """
    rows = next(iter(feeds.values())).shape[0]
    count = min(workers, rows // max(1, min_rows))
    if count <= 1:
        return loop(feeds)
    edges = np.linspace(0, rows, count + 1).astype(int)
    # Per-row inputs are cut; anything else (no batch axis of this size) goes whole to every range.
    parts = [{k: v[a:b] if np.ndim(v) and np.shape(v)[0] == rows else v for k, v in feeds.items()}
             for a, b in zip(edges[:-1], edges[1:])]
    deadline = current_deadline()  # the request's: helper threads stop with it

    def run(part):
        with deadline_carried(deadline):
            return loop(part)

    pending = [_helpers(count - 1).submit(run, part) for part in parts[1:]]
    outs = [loop(parts[0])] + [p.result() for p in pending]  # the first range in this thread
    fill = fill or {}
    joined = {}
    for name in outs[0]:
        arrays = [np.asarray(o[name]) for o in outs]
        shape = np.max([a.shape for a in arrays], axis=0)  # [ndim]: the widest range per axis
        padded = [np.pad(a, [(0, 0)] + [(0, int(m) - n) for m, n in zip(shape[1:], a.shape[1:])],
                         constant_values=fill.get(name, 0)) for a in arrays]
        joined[name] = np.concatenate(padded, 0)
    return joined


def _carried(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k[4:]: v for k, v in outputs.items() if k.startswith("new_")}


def _encoder_feeds(src, src_len) -> dict[str, np.ndarray]:
    """The encoder's named inputs: ``src`` + ``src_len``, or ``src`` itself when it is already a
    dict of named inputs (e.g. ``{"image": ...}`` for captioning, whose encoder has no lengths)."""
    return dict(src) if isinstance(src, dict) else {"src": src, "src_len": src_len}


def greedy(encoder: Graph, step: Graph, src: np.ndarray | dict, src_len: np.ndarray | None, bos: int,
           eos: int, max_len: int, pad: int = 0) -> dict[str, np.ndarray]:
    """Batched greedy decoding.

    Args: src [B,S] int64 and src_len [B] int64, or src a dict of the encoder's inputs (batch first).
    Returns: tokens [B,T] (EOS then pad), lengths [B] (tokens before EOS), attention [B,T,S'].
    """
    feeds = _encoder_feeds(src, src_len)
    scheduler = getattr(step, "greedy", None)
    if scheduler is not None:  # the server's continuous batching: the same loop, shared across requests
        return scheduler(feeds, bos, eos, max_len, pad)
    enc = encoder(feeds)
    state = dict(enc)
    bsz = next(iter(feeds.values())).shape[0]
    y = np.full((bsz,), bos, dtype=np.int64)
    done = np.zeros(bsz, dtype=bool)
    lengths = np.full((bsz,), max_len, dtype=np.int64)
    tokens, aligns = [], []
    for t in range(max_len):
        out = step({**state, "y_prev": y})
        # First index of the max, as torch.argmax, so ties break the same way.
        y = out["log_probs"].argmax(-1).astype(np.int64)
        y = np.where(done, pad, y)
        tokens.append(y)
        aligns.append(out["attention"])
        newly = (y == eos) & ~done
        lengths = np.where(newly, t, lengths)
        done |= newly
        state.update(_carried(out))
        if done.all():
            break
    return {"tokens": np.stack(tokens, 1), "lengths": lengths, "attention": np.stack(aligns, 1)}


def _block_repeats(logp: np.ndarray, hyps: list[list[int]], n: int) -> None:
    """Set logp[k, tok] to -inf where appending tok would repeat an n-gram hyps[k] already holds."""
    for k, h in enumerate(hyps):
        tail = h[len(h) - n + 1:] if n > 1 else []  # the n-1 tokens a new n-gram would start with
        for i in range(len(h) - n + 1):
            if h[i : i + n - 1] == tail:
                logp[k, h[i + n - 1]] = -np.inf


def search_options(settings: Mapping) -> dict:
    """:func:`beam_search`'s ranking options from an entry's ``evaluate`` params or from a version's
    serving block, which ``pipeline/serving_meta.py`` copies from them: read in this one place, so
    a task's evaluation, the scripts and the server search with the same settings."""
    return {"length_penalty": float(settings.get("length_penalty", 1.0)),
            "no_repeat_ngram": int(settings.get("no_repeat_ngram", 0))}


def beam_search(encoder: Graph, step: Graph, src: np.ndarray | dict, src_len: np.ndarray | None, bos: int,
                eos: int, max_len: int, beam: int = BEAM, length_penalty: float = 1.0, no_repeat_ngram: int = 0
                ) -> dict[str, np.ndarray]:
    """Beam search for one input (src [1,S], or a dict of the encoder's inputs with batch 1, as in
    :func:`greedy`); hypotheses are ranked by
    log p / length**length_penalty (``length_penalty`` 0: by log p, with an exact stopping rule).
    ``no_repeat_ngram`` n > 0 forbids a hypothesis to repeat any token n-gram it already holds
    (fairseq's and Hugging Face's no_repeat_ngram_size, OpenNMT's block_ngram_repeat): 0, off.

    Returns: tokens [T] (without EOS), attention [T+1,S'] (incl. the EOS step), score float, and
    nbest: up to ``beam`` hypotheses as (tokens, score), best first (the first is tokens, score).
    """
    return beam_search_batch(encoder, step, src, src_len, bos, eos, max_len, beam, length_penalty,
                             no_repeat_ngram)[0]


def beam_search_batch(encoder: Graph, step: Graph, src: np.ndarray | dict, src_len: np.ndarray | None, bos: int,
                      eos: int, max_len: int, beam: int = BEAM, length_penalty: float = 1.0, no_repeat_ngram: int = 0
                      ) -> list[dict[str, np.ndarray]]:
    """:func:`beam_search` of N inputs at once (src [N,S] right-padded with src_len [N], or a dict of
    the encoder's inputs with batch N): one encoder call, then one step call per position for the
    K hypotheses of every input still searching ([N·K] rows), where a search per input makes N.

    Each input's search is :func:`beam_search`'s (the same ranking, stopping rule and n-best); an
    input that has finished leaves the batch. Inputs differ from a search of each alone only by the
    padding the encoder masks (float rounding). Returns beam_search's answer per input, attention
    cut to the input's own length.
    """
    enc = encoder(_encoder_feeds(src, src_len))
    count = next(iter(enc.values())).shape[0]
    searches = [_Search(beam, bos, eos, length_penalty, no_repeat_ngram) for _ in range(count)]
    state = {k: np.repeat(v, beam, axis=0) for k, v in enc.items()}  # [N*K,...]: input i at rows iK..iK+K-1
    alive = list(range(count))
    for _ in range(max_len):
        out = step({**state, "y_prev": np.concatenate([searches[i].y for i in alive])})
        logp = out["log_probs"].astype(np.float64)  # [A*K,V]
        kept, rows = [], []
        for j, i in enumerate(alive):
            block = slice(j * beam, (j + 1) * beam)
            chosen = searches[i].advance(logp[block], out["attention"][block])
            if chosen is not None:
                kept.append(j)
                rows.append(chosen + j * beam)
        if not kept:
            break
        carried = _carried(out)
        if len(kept) < len(alive):  # inputs that finished leave every static input too
            blocks = np.concatenate([np.arange(j * beam, (j + 1) * beam) for j in kept])
            state = {k: v[blocks] for k, v in state.items() if k not in carried}
        gather = np.concatenate(rows)  # each kept hypothesis's parent row
        state.update({name: value[gather] for name, value in carried.items()})
        alive = [alive[j] for j in kept]
    results = [s.result() for s in searches]
    if src_len is not None and not isinstance(src, dict):
        width = src.shape[1]
        for r, n in zip(results, np.asarray(src_len).tolist()):
            # Drop the columns of the input's padding (weight 0), which come last; columns beyond the
            # source positions (a pointer network's END) stay.
            r["attention"] = r["attention"][:, : r["attention"].shape[1] - (width - int(n))]
    return results


class _Search:
    """One input's beam: K hypotheses with their scores and alignments, and the ended ones."""

    def __init__(self, beam: int, bos: int, eos: int, length_penalty: float, no_repeat_ngram: int):
        self.beam, self.eos, self.length_penalty, self.no_repeat_ngram = beam, eos, length_penalty, no_repeat_ngram
        self.scores = np.full(beam, -np.inf)
        self.scores[0] = 0.0  # all beams start identical: keep one alive so they don't duplicate
        self.hyps: list[list[int]] = [[] for _ in range(beam)]
        self.aligns: list[list[np.ndarray]] = [[] for _ in range(beam)]
        self.y = np.full(beam, bos, dtype=np.int64)  # the next step's input tokens
        self.finished: list[tuple[float, list[int], list[np.ndarray]]] = []

    def advance(self, logp: np.ndarray, attention: np.ndarray) -> np.ndarray | None:
        """One step from log-probabilities [K,V] and attention [K,S']: the K rows the next step continues
        (their parents), or None once the search is over."""
        beam = self.beam
        if self.no_repeat_ngram:
            _block_repeats(logp, self.hyps, self.no_repeat_ngram)
        vocab = logp.shape[1]
        total = (self.scores[:, None] + logp).reshape(-1)  # [K*V]
        next_beams, next_scores, next_tokens = [], [], []
        # At most K candidates end (one EOS per hypothesis), so the best 2K hold the next K live ones.
        for flat in top_order(total, 2 * beam):
            if len(next_beams) == beam or not np.isfinite(total[flat]):
                break
            k, tok = divmod(int(flat), vocab)
            if tok == self.eos:
                norm = total[flat] / (len(self.hyps[k]) + 1) ** self.length_penalty
                self.finished.append((norm, self.hyps[k], self.aligns[k] + [attention[k]]))
            else:
                next_beams.append(k)
                next_scores.append(total[flat])
                next_tokens.append(tok)
        if not next_beams:
            return None
        if len(self.finished) >= beam:
            # Without length normalisation scores only fall as hypotheses grow, so stop only once
            # no live hypothesis can beat the best finished one (pointer networks, whose
            # low-ranked beams end early). With it there is no such bound: stop at `beam` finished.
            if self.length_penalty != 0 or max(f[0] for f in self.finished) >= max(next_scores):
                return None
        pad = beam - len(next_beams)
        self.hyps = [self.hyps[k] + [tok] for k, tok in zip(next_beams, next_tokens)]
        self.aligns = [self.aligns[k] + [attention[k]] for k in next_beams]
        self.hyps += [list(self.hyps[0])] * pad
        self.aligns += [list(self.aligns[0])] * pad
        self.scores = np.array(next_scores + [-np.inf] * pad)
        self.y = np.array(next_tokens + [next_tokens[0]] * pad, dtype=np.int64)
        return np.array(next_beams + [next_beams[0]] * pad)

    def result(self) -> dict:
        scores, hyps, aligns, finished = self.scores, self.hyps, self.aligns, list(self.finished)
        live = sorted((k for k in range(len(hyps)) if np.isfinite(scores[k])), key=lambda k: -scores[k])
        if not finished:  # no hypothesis ended within max_len: take the best unfinished one
            k = int(np.argmax(scores))
            finished.append((scores[k], hyps[k], aligns[k]))
            live = [j for j in live if j != k]
        ranked = sorted(finished, key=lambda f: -f[0])[: self.beam]  # stable: ties keep the order they finished in
        # n-best: with fewer than `beam` ended, the live hypotheses follow (by log p, as the fallback above),
        # never ahead of an ended one, so the best hypothesis is the one beam search returns.
        ranked += [(scores[k], hyps[k], aligns[k]) for k in live][: self.beam - len(ranked)]
        norm, tokens, align = ranked[0]
        return {"tokens": np.array(tokens, dtype=np.int64), "attention": np.stack(align), "score": float(norm),
                "nbest": [(np.array(t, dtype=np.int64), float(n)) for n, t, _ in ranked]}


def top_order(values: np.ndarray, count: int) -> np.ndarray:
    """The indices of at least the ``count`` largest ``values``, largest first, ties by index: the start
    of ``np.argsort(-values, kind="stable")``, found with a partition instead of sorting all K·V
    candidates of a beam step (40,000 for a beam of 5 over 8,000 pieces)."""
    if count >= values.size:
        return np.argsort(-values, kind="stable")
    cut = values.size - count
    threshold = np.partition(values, cut)[cut]  # the count-th largest
    idx = np.flatnonzero(values >= threshold)  # every tie of the threshold too, so the order is exact
    return idx[np.lexsort((idx, -values[idx]))]


def transcribe(encoder, step, serving: dict, batch: dict[str, np.ndarray], singles: list[dict[str, np.ndarray]],
                mode: str, beam: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Greedy decoding of the padded ``batch`` or beam search of each item of ``singles`` ->
    per item (token ids without EOS, attention [T+1, S'] incl. the EOS step)."""
    s = serving
    if mode == "greedy":
        r = greedy(encoder, step, batch, None, s["bos_id"], s["eos_id"], s["max_len"], s["pad_id"])
        return [(r["tokens"][i, : int(r["lengths"][i])], r["attention"][i, : int(r["lengths"][i]) + 1])
                for i in range(len(singles))]
    return [(b["tokens"], b["attention"]) for b in (
        beam_search(encoder, step, feeds, None, s["bos_id"], s["eos_id"], s["max_len"], beam=beam,
                    **search_options(s)) for feeds in singles)]


def glimpses(start: Graph, step: Graph, image: np.ndarray, count: int) -> dict[str, np.ndarray]:
    """Recurrent visual attention on a fixed image [B,H,W]: ``start`` gives the state (with the
    first glimpse location ``loc``); each ``step`` takes one glimpse and proposes the next.

    Returns: logits [B,C] after the last glimpse, pred [B], locations [B,count,2] (the glimpse
    centres, (x, y) in [-1, 1]).
    """
    state = start({"image": image})
    locations = []
    for _ in range(count):
        locations.append(state["loc"])
        out = step({**state, "image": image})
        state = _carried(out)
    logits = out["logits"]
    return {"logits": logits, "pred": logits.argmax(-1).astype(np.int64), "locations": np.stack(locations, 1)}


def unroll(init: Graph, step: Graph, x: np.ndarray, collect: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Run a recurrent step graph over x [B,T,I].

    Returns: logits [B,T,O] and each ``collect``-ed step output stacked over time [B,T,...].
    """
    state = init({"x": x})
    logits, kept = [], {name: [] for name in collect}
    for t in range(x.shape[1]):
        out = step({**state, "x": np.ascontiguousarray(x[:, t])})
        logits.append(out["logits"])
        for name in collect:
            kept[name].append(out[name])
        state = _carried(out)
    return {"logits": np.stack(logits, 1), **{k: np.stack(v, 1) for k, v in kept.items()}}
