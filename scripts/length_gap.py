"""BLEU by source length for several translation runs side by side, and the gap between the first
two (an analysis, not a stage): whether the `bahdanau` vs `bahdanau_none` gap grows with sentence
length, as in Bahdanau et al.'s Fig. 2.

    python scripts/length_gap.py bahdanau bahdanau_none                       # the pipeline's runs/<name>
    python scripts/length_gap.py bahdanau=/tmp/lr/bahdanau bahdanau_none=/tmp/lr/bahdanau_none
    python scripts/length_gap.py bahdanau=/tmp/lr/bahdanau --length-penalty 0.5
    python scripts/length_gap.py bahdanau=/tmp/lr/bahdanau --coverage 0.2 0.4 1.0
    python scripts/length_gap.py bahdanau bahdanau_none --sample all --no-repeat-ngram 3 --bootstrap 1000 --jobs 2

Each run's ``checkpoint/best`` decodes with its entry's beam width through ``serving.decode.beam_search``, as
``evaluate@`` does; its other decoding settings are flags here, off by default (the bahdanau entries' ``evaluate:``
block blocks repeated 3-grams: pass ``--no-repeat-ngram 3`` to decode as ``evaluate@`` does), over
``--sample long`` (default: every test sentence of 21+ words and every fourth of the rest, 880 of the 2,501: the
long buckets whole at about a third of the cost) or ``all``.
Per length bucket it prints BLEU (sacrebleu), the brevity penalty, and the share of outputs that
repeat a word 3-gram (looping). ``--coverage BETA...`` re-ranks each beam's n-best list with GNMT's
coverage penalty (Wu et al. 2016, eq. 14), ``BETA * sum_j log(min(sum_i a_ij, 1))`` added to the
length-normalised score, the attention of each hypothesis read by feeding it back through the
decoder step (a model without attention has a constant alignment: no penalty).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import cli_errors
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EDGES = [10, 15, 20, 24]  # the buckets of params.yaml models.bahdanau.evaluate.length_buckets


def sample(items: list[dict], kind: str) -> list[int]:
    """Indices of the test items to decode: ``long`` keeps every sentence of 21+ words and every fourth other one."""
    if kind == "all":
        return list(range(len(items)))
    return [i for i, it in enumerate(items) if len(it["src_text"].split()) > EDGES[2] or i % 4 == 0]


def repeats_a_trigram(text: str) -> bool:
    words = text.split()
    grams = [tuple(words[j : j + 3]) for j in range(len(words) - 2)]
    return len(grams) != len(set(grams))


def coverage_scores(step, enc: dict, nbest: list, bos: int, eos: int, beta: float) -> list[float]:
    """Each n-best hypothesis's score plus GNMT's coverage penalty, its alignments read by forced decoding."""
    from serving.decode import _carried

    k = len(nbest)
    steps = max(len(tokens) for tokens, _ in nbest) + 1  # every token, then EOS
    state = {name: np.repeat(value, k, axis=0) for name, value in enc.items()}  # [K,...]
    inputs = np.full((k, steps), eos, dtype=np.int64)  # y_prev per step: BOS, then the hypothesis
    inputs[:, 0] = bos
    for row, (tokens, _) in enumerate(nbest):
        inputs[row, 1 : len(tokens) + 1] = tokens
    coverage = 0.0
    for t in range(steps):
        out = step({**state, "y_prev": inputs[:, t]})
        alive = np.array([t <= len(tokens) for tokens, _ in nbest])[:, None]  # [K,1]: up to its EOS step
        coverage = coverage + out["attention"] * alive  # [K,S]
        state.update(_carried(out))
    penalty = beta * np.log(np.minimum(coverage, 1.0) + 1e-9).sum(-1)  # [K]
    return [score + float(p) for (_, score), p in zip(nbest, penalty)]


def decode(name: str, run_dir: Path, ids: list[int], items: list[dict], length_penalty: float,
           betas: list[float], no_repeat: int = 0) -> dict[float, dict[int, str]]:
    """Beam translations (the entry's beam width) of items[ids] per coverage weight (0: the beam's own choice)."""
    import sentencepiece as spm
    import torch
    from tqdm import tqdm

    from pipeline.checkpoint import load_model
    from pipeline.config import resolve
    from pipeline.graphs import TorchGraph
    from serving.decode import BEAM, beam_search

    torch.set_num_threads(1)
    run = resolve(name)
    data_dir, beam = run.data_dir, run.evaluate.get("beam", BEAM)
    model, _ = load_model(run_dir / "checkpoint" / "best")
    model.eval()
    sp = spm.SentencePieceProcessor(model_file=str(data_dir / "spm.en.model"))
    specs = model.export_graphs()
    enc, step = TorchGraph(specs["encoder"]), TorchGraph(specs["decoder_step"])
    cfg = model.cfg
    out: dict[float, dict[int, str]] = {beta: {} for beta in [0.0, *betas]}
    for i in tqdm(ids, desc=f"beam {beam} {name}", mininterval=10):
        src = np.array([items[i]["src"]], dtype=np.int64)  # [1,S]
        lengths = np.array([src.shape[1]])
        r = beam_search(enc, step, src, lengths, cfg.bos_id, cfg.eos_id, cfg.max_len, beam=beam,
                        length_penalty=length_penalty, no_repeat_ngram=no_repeat)
        out[0.0][i] = sp.decode(r["tokens"].tolist())
        if betas:
            memory = enc({"src": src, "src_len": lengths})
            for beta in betas:
                scores = coverage_scores(step, memory, r["nbest"], cfg.bos_id, cfg.eos_id, beta)
                best = r["nbest"][int(np.argmax(scores))][0]  # first of equals: the beam's own order
                out[beta][i] = sp.decode(best.tolist())
    return out


def spans(ids, items: list[dict]) -> list[tuple[str, list[int]]]:
    """(bucket label, the ids whose German source falls in it) for each length bucket."""
    from pipeline.tasks.translation_de_en import _buckets

    return [(label, [i for i in ids if low <= len(items[i]["src_text"].split()) <= high])
            for label, low, high in _buckets(EDGES)]


def buckets(ids: list[int], items: list[dict], hyps: dict[int, str]) -> list[dict]:
    import sacrebleu

    rows = []
    for label, sel in spans(ids, items):
        if not sel:  # a --limit sample may miss a bucket
            continue
        bleu = sacrebleu.corpus_bleu([hyps[i] for i in sel], [[items[i]["tgt_text"] for i in sel]])
        rows.append({"bucket": label, "sentences": len(sel), "bleu": round(bleu.score, 2), "bp": round(bleu.bp, 3),
                     "repeat3": round(float(np.mean([repeats_a_trigram(hyps[i]) for i in sel])), 2)})
    return rows


def gap_bootstrap(items: list[dict], hyps_a: dict[int, str], hyps_b: dict[int, str], resamples: int,
                  seed: int = 0) -> dict:
    """Paired bootstrap (Koehn 2004) of how the gap A - B grows with source length: each resample draws
    every bucket's sentences with replacement, the same ones for A and B, and scores them with
    sacrebleu's corpus BLEU from summed sentence statistics. Two readings of "grows": the gap on the
    longest bucket minus the gap on the shortest, and the least-squares slope of the gap over all
    buckets against their mean source length (BLEU per word). For each, the measured value, its 95 %
    interval and the share of resamples where it is > 0."""
    from sacrebleu.metrics import BLEU

    bleu = BLEU()  # corpus_bleu's defaults: 13a, exp smoothing

    def stats(hyps: dict[int, str], sel: list[int]) -> np.ndarray:  # [N,10]: lengths, matches, totals
        return np.array(bleu._extract_corpus_statistics([hyps[i] for i in sel], [[items[i]["tgt_text"] for i in sel]]))

    def score(summed: np.ndarray) -> float:
        return bleu._compute_score_from_stats(summed.tolist()).score

    by_bucket = [(label, sel) for label, sel in spans(hyps_a, items) if sel]  # a small sample may miss one
    per = [(stats(hyps_a, sel), stats(hyps_b, sel)) for _, sel in by_bucket]
    words = np.array([np.mean([len(items[i]["src_text"].split()) for i in sel]) for _, sel in by_bucket])
    centred = words - words.mean()

    def gaps(rows: list[np.ndarray]) -> np.ndarray:  # [buckets] gap A - B on the drawn sentences
        return np.array([score(a[r].sum(0)) - score(b[r].sum(0)) for (a, b), r in zip(per, rows)])

    def readings(g: np.ndarray) -> tuple[float, float]:
        return float(g[-1] - g[0]), float(centred @ (g - g.mean()) / (centred @ centred))

    rng = np.random.default_rng(seed)
    draws = np.array([readings(gaps([rng.integers(0, len(a), len(a)) for a, _ in per])) for _ in range(resamples)])
    measured = readings(gaps([np.arange(len(a)) for a, _ in per]))

    def summary(k: int, digits: int) -> dict:
        low, high = np.percentile(draws[:, k], [2.5, 97.5])
        return {"value": round(measured[k], digits),
                "interval95": [round(float(low), digits), round(float(high), digits)],
                "share_above_0": round(float(np.mean(draws[:, k] > 0)), 3)}

    ends, slope = summary(0, 2), summary(1, 3)  # BLEU to 2 places; BLEU per word to 3
    return {"short": by_bucket[0][0], "long": by_bucket[-1][0], "sentences": [len(sel) for _, sel in by_bucket],
            "mean_words": [round(float(w), 1) for w in words],
            "difference": ends["value"], "interval95": ends["interval95"], "share_above_0": ends["share_above_0"],
            "slope_per_word": slope, "resamples": resamples}


def markdown(results: dict[str, list[dict]], gap: tuple[str, str] | None) -> str:
    """One row per bucket: each run's BLEU (brevity penalty, share repeating a 3-gram), then gap[0] - gap[1]."""
    names = list(results)
    head = "| bucket | sentences | " + " | ".join(f"`{n}` BLEU (BP, repeats)" for n in names)
    head += f" | gap `{gap[0]}` - `{gap[1]}` |" if gap else " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for b, row in enumerate(results[names[0]]):
        cells = [f"{results[n][b]['bleu']} ({results[n][b]['bp']}, {results[n][b]['repeat3']:.0%})" for n in names]
        diff = f" | {results[gap[0]][b]['bleu'] - results[gap[1]][b]['bleu']:.2f}" if gap else ""
        lines.append(f"| {row['bucket']} | {row['sentences']} | " + " | ".join(cells) + diff + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+",
                    help="MODEL or MODEL=RUN_DIR (default runs/MODEL); the gap is the first minus the second")
    ap.add_argument("--sample", choices=["long", "all"], default="long",
                    help="long: every test sentence of 21+ words and every fourth other one; all: the whole test set")
    ap.add_argument("--length-penalty", type=float, default=1.0,
                    help="beam score = log p / length**this (evaluate@'s default 1)")
    ap.add_argument("--no-repeat-ngram", type=int, default=0, metavar="N",
                    help="forbid each hypothesis to repeat a token N-gram (0: off; bahdanau's entries evaluate with 3)")
    ap.add_argument("--coverage", type=float, nargs="*", default=[], metavar="BETA",
                    help="also re-rank the n-best with GNMT's coverage penalty at these weights")
    ap.add_argument("--limit", type=int, default=0, help="only the first N sentences of the sample (a quick look)")
    ap.add_argument("--out", type=Path, help="write every bucket and translation here as JSON")
    ap.add_argument("--bootstrap", type=int, default=0, metavar="N",
                    help="N paired bootstrap resamples of (gap on the longest bucket) - (gap on the shortest) "
                         "and of the gap's slope over all buckets")
    ap.add_argument("--jobs", type=int, default=1, help="decode this many runs at once (one thread each)")
    args = ap.parse_args(argv)

    from pipeline.config import resolve
    from pipeline.tasks.translation_de_en import TranslationTask

    runs = [(spec.split("=", 1)[0], Path(spec.split("=", 1)[1]) if "=" in spec else ROOT / "runs" / spec)
            for spec in args.runs]
    cli_errors.entries([name for name, _ in runs])
    for name, run_dir in runs:
        if not (run_dir / "checkpoint" / "best").is_dir():
            raise cli_errors.ScriptError(f"no checkpoint in {run_dir}/checkpoint/best; "
                                         f"train it first (attnzoo train {name} --out DIR)")
    items = TranslationTask().load(resolve(runs[0][0]).data_dir, "test")
    ids = sample(items, args.sample)[: args.limit or None]
    results, texts, started = {}, {}, time.monotonic()
    with ProcessPoolExecutor(max_workers=max(1, min(args.jobs, len(runs)))) as pool:
        decoded = pool.map(decode, *zip(*[(name, run_dir, ids, items, args.length_penalty, args.coverage,
                                            args.no_repeat_ngram) for name, run_dir in runs]))
    for (name, _), hyps in zip(runs, decoded):
        for beta, by_item in hyps.items():
            label = name if beta == 0 else f"{name} coverage {beta:g}"
            results[label], texts[label] = buckets(ids, items, by_item), by_item
    print(markdown(results, (runs[0][0], runs[1][0]) if len(runs) > 1 else None))
    print(f"\n{len(ids)} test sentences, each entry's beam width, length penalty {args.length_penalty:g}, "
          f"no repeated {args.no_repeat_ngram or '-'}-gram, "
          f"{time.monotonic() - started:.0f} s")
    boot = None
    if args.bootstrap and len(runs) > 1:
        boot = gap_bootstrap(items, texts[runs[0][0]], texts[runs[1][0]], args.bootstrap)
        print(f"\ngap on {boot['long']} words minus gap on {boot['short']} words: {boot['difference']:.2f} BLEU, "
              f"95 % interval {boot['interval95'][0]:.2f} to {boot['interval95'][1]:.2f}, > 0 in "
              f"{boot['share_above_0']:.1%} of {boot['resamples']} paired resamples")
        slope = boot["slope_per_word"]
        print(f"least-squares slope of the gap over all {len(boot['sentences'])} buckets (mean source length "
              f"{', '.join(f'{w:g}' for w in boot['mean_words'])} words): {slope['value']:+.3f} BLEU per word, "
              f"95 % interval {slope['interval95'][0]:+.3f} to {slope['interval95'][1]:+.3f}, > 0 in "
              f"{slope['share_above_0']:.1%}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"runs": {n: str(d) for n, d in runs}, "sample": args.sample,
                                        "length_penalty": args.length_penalty,
                                        "no_repeat_ngram": args.no_repeat_ngram, "buckets": results,
                                        "bootstrap": boot,
                                        "translations": texts}, indent=1))


if __name__ == "__main__":
    cli_errors.run(main)
