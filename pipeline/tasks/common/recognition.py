"""Metrics shared by the recognition tasks (``ocr_words``, ``spoken_digits``): a signal in,
characters out by an attention decoder. Registers no task of its own."""

from __future__ import annotations

from collections import defaultdict

import numpy as np


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def cer(hyps: list[str], refs: list[str]) -> float:
    """Character error rate in %: total edit distance over total reference characters."""
    return 100.0 * sum(edit_distance(h, r) for h, r in zip(hyps, refs)) / max(sum(len(r) for r in refs), 1)


def greedy_texts(model, task, items: list[dict], vocab: list[str], batch: int = 128
                 ) -> tuple[list[str], list[np.ndarray]]:
    """Greedy transcripts and each one's attention [T+1, S'] (the EOS step included)."""
    texts, maps = [], []
    for start in range(0, len(items), batch):
        out = model.predict(task.collate(items[start : start + batch]))
        for row in range(out["tokens"].shape[0]):
            n = int(out["lengths"][row])
            texts.append("".join(vocab[t] for t in out["tokens"][row, :n].tolist()))
            maps.append(out["attention"][row, : n + 1].numpy())
    return texts, maps


def beam_texts(model, task, items: list[dict], vocab: list[str], beam: int, desc: str,
               options: dict | None = None) -> list[str]:
    """Beam-search transcripts through the export graphs' PyTorch twins (the serving loop), with the
    ranking ``options`` of ``serving.decode.search_options``, as the server ranks them."""
    from tqdm.auto import tqdm

    from pipeline.graphs import TorchGraph
    from serving.decode import beam_search

    specs = model.export_graphs()
    enc, step = TorchGraph(specs["encoder"]), TorchGraph(specs["decoder_step"])
    names = specs["encoder"].input_names
    cfg = model.cfg
    texts = []
    for it in tqdm(items, desc=desc, mininterval=5):
        feeds = {k: v.numpy() for k, v in task.collate([it]).items() if k in names}
        r = beam_search(enc, step, feeds, None, cfg.bos_id, cfg.eos_id, cfg.max_len, beam=beam,
                        **(options or {}))
        texts.append("".join(vocab[t] for t in r["tokens"].tolist()))
    return texts


def score_set(model, run, task, items: list[dict], vocab: list[str], group: str, beam: int, label: str
              ) -> tuple[dict, list[str], list[np.ndarray]]:
    """Sequence accuracy and CER (greedy and beam) of one test set, CER per ``group`` value and by
    reference length. Returns (metrics, greedy texts, greedy attention maps)."""
    refs = [it["text"] for it in items]
    greedy, maps = greedy_texts(model, task, items, vocab)
    from serving.decode import search_options

    beamed = (beam_texts(model, task, items, vocab, beam, f"beam {beam} {run.name} {label}",
                         search_options(run.evaluate))
              if beam > 1 else greedy)
    metrics = {
        "seq_acc_greedy": round(100 * float(np.mean([h == r for h, r in zip(greedy, refs)])), 2),
        "seq_acc_beam": round(100 * float(np.mean([h == r for h, r in zip(beamed, refs)])), 2),
        "cer_greedy": round(cer(greedy, refs), 3),
        "cer_beam": round(cer(beamed, refs), 3),
        "items": len(items),
    }
    groups = defaultdict(list)
    for i, it in enumerate(items):
        groups[it[group]].append(i)
    metrics[f"cer_by_{group}"] = {g: round(cer([beamed[i] for i in idx], [refs[i] for i in idx]), 3)
                                  for g, idx in sorted(groups.items())}
    metrics[f"seq_acc_by_{group}"] = {
        g: round(100 * float(np.mean([beamed[i] == refs[i] for i in idx])), 2) for g, idx in sorted(groups.items())}
    lengths = defaultdict(list)
    for i, r in enumerate(refs):
        lengths[len(r)].append(i)
    metrics["cer_by_length"] = {str(n): round(cer([beamed[i] for i in idx], [refs[i] for i in idx]), 3)
                                for n, idx in sorted(lengths.items())}
    metrics["examples"] = [{"ref": refs[i], "beam": beamed[i], "greedy": greedy[i]} for i in range(min(8, len(items)))]
    return metrics, greedy, maps
