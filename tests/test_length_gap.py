"""scripts/length_gap.py's paired bootstrap of the length gap, on hand-made translations (no decoding)."""

from __future__ import annotations

import length_gap
import sacrebleu

SHORT = ["the file is saved now", "press the key to quit", "open the menu again", "close all open windows"]
LONG = [" ".join(f"word{j} of sentence {k} in the long bucket" for j in range(4)) for k in range(4)]  # 32 words


def items() -> list[dict]:
    # The German side only sets the bucket (its word count); the reference is the English.
    return [{"src_text": " ".join(["x"] * (5 if i < 4 else 30)), "tgt_text": text}
            for i, text in enumerate(SHORT + LONG)]


def test_the_gap_difference_is_corpus_bleu_per_bucket_and_its_interval_holds_it():
    its = items()
    refs = {i: it["tgt_text"] for i, it in enumerate(its)}
    # A: right everywhere but one short sentence; B: right on short sentences, half of each long one lost.
    a = {**refs, 0: "the file was saved"}
    b = {i: (t if i < 4 else " ".join(t.split()[:16])) for i, t in refs.items()}
    got = length_gap.gap_bootstrap(its, a, b, resamples=200)

    def bleu(hyps, ids):
        return sacrebleu.corpus_bleu([hyps[i] for i in ids], [[refs[i] for i in ids]]).score

    short, long_ = range(4), range(4, 8)
    expected = (bleu(a, long_) - bleu(b, long_)) - (bleu(a, short) - bleu(b, short))
    assert (got["short"], got["long"], got["sentences"]) == ("1-10", "25+", [4, 4])
    assert abs(got["difference"] - expected) < 0.01 and got["difference"] > 0
    low, high = got["interval95"]
    assert low <= got["difference"] <= high and 0 <= got["share_above_0"] <= 1
    assert got == length_gap.gap_bootstrap(its, a, b, resamples=200)  # seeded: the same interval again


def test_the_slope_is_least_squares_over_every_bucket_against_its_mean_length():
    # Three buckets (5, 13 and 30 words): B loses more of each reference the longer the source, A none.
    mid = [" ".join(f"mid{j} part {k} of it" for j in range(3)) for k in range(4)]  # 15 words
    its = items()[:4] + [{"src_text": " ".join(["x"] * 13), "tgt_text": t} for t in mid] + items()[4:]
    refs = {i: it["tgt_text"] for i, it in enumerate(its)}
    b = {i: (t if i < 4 else " ".join(t.split()[: 10 if i < 8 else 12])) for i, t in refs.items()}
    got = length_gap.gap_bootstrap(its, refs, b, resamples=200)

    def gap(ids):
        return (sacrebleu.corpus_bleu([refs[i] for i in ids], [[refs[i] for i in ids]]).score
                - sacrebleu.corpus_bleu([b[i] for i in ids], [[refs[i] for i in ids]]).score)

    x = [5.0, 13.0, 30.0]
    y = [gap(range(0, 4)), gap(range(4, 8)), gap(range(8, 12))]
    mx, my = sum(x) / 3, sum(y) / 3
    expected = sum((u - mx) * (v - my) for u, v in zip(x, y)) / sum((u - mx) ** 2 for u in x)
    assert got["sentences"] == [4, 4, 4] and got["mean_words"] == x
    slope = got["slope_per_word"]
    assert expected > 0 and abs(slope["value"] - expected) < 0.001
    assert slope["interval95"][0] <= slope["value"] <= slope["interval95"][1]
    assert slope["share_above_0"] == 1.0  # B is never better than A: every resample's gap grows
