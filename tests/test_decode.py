"""serving.decode loops on hand-built step functions with known answers."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

import models
from pipeline.graphs import TorchGraph
from serving.decode import beam_search, beam_search_batch, greedy, top_order, unroll
from tests.conftest import TINY, tiny_batch

BOS, EOS = 1, 2
# Transition table log p(next | prev) over a 4-token vocabulary {0 pad, 1 bos, 2 eos, 3 x}.
# Greedy takes 3 (p=.6) then must pay for a poor continuation; beam finds "eos" directly better.
TABLE = np.log(np.array([
    [0.25, 0.25, 0.25, 0.25],
    [0.01, 0.01, 0.39, 0.59],   # after BOS: x (0.59) beats eos (0.39)
    [0.25, 0.25, 0.25, 0.25],
    [0.01, 0.01, 0.30, 0.68],   # after x: x again, or eos at 0.30
]))


def encoder(feeds):
    bsz = feeds["src"].shape[0]
    return {"state": np.zeros((bsz, 1), dtype=np.float32), "memory": np.ones((bsz, 3, 1), dtype=np.float32)}


def step(feeds):
    y = feeds["y_prev"]
    return {"log_probs": TABLE[y], "new_state": feeds["state"] + 1,
            "attention": np.tile(np.array([[1.0, 0.0, 0.0]]), (len(y), 1))}


def test_greedy_follows_argmax_and_stops_at_max_len():
    out = greedy(encoder, step, np.zeros((2, 3), np.int64), np.array([3, 3]), BOS, EOS, max_len=4)
    assert out["tokens"].tolist() == [[3, 3, 3, 3]] * 2
    assert out["lengths"].tolist() == [4, 4]
    assert out["attention"].shape == (2, 4, 3)


def test_beam_finds_the_higher_probability_sequence():
    out = beam_search(encoder, step, np.zeros((1, 3), np.int64), np.array([3]), BOS, EOS,
                      max_len=6, beam=3, length_penalty=0.0)
    # p(eos) = .39 beats p(x, eos) = .59*.30 = .177 and every longer one.
    assert out["tokens"].tolist() == []
    assert np.isclose(out["score"], np.log(0.39))
    assert out["attention"].shape == (1, 3)


def test_beam_with_length_normalisation_prefers_longer_hypotheses():
    out = beam_search(encoder, step, np.zeros((1, 3), np.int64), np.array([3]), BOS, EOS,
                      max_len=6, beam=3, length_penalty=1.0)
    # average log-prob: [eos] log(.39)/1 = -.94; [x, eos] (log .59 + log .30)/2 = -.87; [x, x, eos] -.66 ...
    assert len(out["tokens"]) >= 2 and set(out["tokens"].tolist()) == {3}


def test_beam_blocks_repeated_ngrams_only_when_asked():
    # {0 pad, 1 bos, 2 eos, 3 x, 4 y}: x follows bos or x at .97 and never ends; y ends at .97.
    loop = np.log(np.array([[.2] * 5, [1e-4, 1e-4, 1e-6, .97, .0298], [.2] * 5, [1e-4, 1e-4, 1e-6, .97, .0298],
                            [.0099, .0099, .97, .0001, .0101]]))

    def looping_step(feeds):
        return {"log_probs": loop[feeds["y_prev"]], "new_state": feeds["state"],
                "attention": np.ones((len(feeds["y_prev"]), 3))}

    def best(n):
        return beam_search(encoder, looping_step, np.zeros((1, 3), np.int64), np.array([3]), BOS, EOS,
                           max_len=6, beam=1, length_penalty=0.0, no_repeat_ngram=n)

    assert best(0)["tokens"].tolist() == [3] * 6  # off: x until max_len
    # Barred from repeating an n-gram, x gives way to y (.0298), which ends.
    assert best(3)["tokens"].tolist() == [3, 3, 3, 4]
    assert best(2)["tokens"].tolist() == [3, 3, 4]
    assert best(1)["tokens"].tolist() == [3, 4]
    assert np.isclose(best(2)["score"], 3 * np.log(.97) + np.log(.0298))


def test_beam_of_one_equals_greedy_on_a_real_model():
    torch.manual_seed(0)
    model = models.build("bahdanau", TINY["bahdanau"]).eval()
    specs = model.export_graphs()
    enc, dec = TorchGraph(specs["encoder"]), TorchGraph(specs["decoder_step"])
    batch = tiny_batch("bahdanau")
    for b in range(3):
        n = int(batch["src_len"][b])
        src = batch["src"][b : b + 1, :n].numpy()
        g = greedy(enc, dec, src, np.array([n]), BOS, EOS, max_len=12)
        k1 = beam_search(enc, dec, src, np.array([n]), BOS, EOS, max_len=12, beam=1, length_penalty=0.0)
        assert k1["tokens"].tolist() == g["tokens"][0, : g["lengths"][0]].tolist()


def test_unroll_matches_ntm_predict():
    torch.manual_seed(0)
    model = models.build("ntm", TINY["ntm"]).eval()
    specs = model.export_graphs()
    batch = tiny_batch("ntm")
    out = unroll(TorchGraph(specs["init"]), TorchGraph(specs["step"]), batch["x"].numpy(),
                 collect=("new_write_w",))
    expected = model.predict(batch)
    np.testing.assert_allclose(out["logits"], expected["logits"].numpy(), atol=1e-6)
    np.testing.assert_allclose(out["new_write_w"], expected["write_weights"].numpy(), atol=1e-6)


def test_beam_without_normalisation_does_not_stop_before_the_best_hypothesis_ends():
    # Step t, previous token -> log-probabilities over [END, a, b] (token 0 is END and the start).
    table = {0: {0: [-0.5, -0.1, -0.6]}, 1: {1: [-1.0, -0.2, -3.0], 2: [-1e-4, -5.0, -5.0]},
             2: {1: [-0.01, -5.0, -5.0], 2: [-5.0, -5.0, -5.0]}, 3: {1: [-5.0] * 3, 2: [-5.0] * 3}}

    def encoder(feeds):
        return {"t": np.zeros((feeds["src"].shape[0], 1), np.int64)}

    def step(feeds):
        t = feeds["t"][:, 0]
        rows = [table[int(ti)].get(int(y), [-5.0] * 3) for ti, y in zip(t, feeds["y_prev"])]
        return {"log_probs": np.array(rows), "attention": np.ones((len(t), 1)), "new_t": feeds["t"] + 1}

    src, n = np.zeros((1, 1), np.int64), np.array([1])
    # Two early ENDs ([END] -0.5, [b END] -0.6) fill the beam while "a a" (-0.3) is still alive;
    # only after it ends (-0.31) is the best finished hypothesis known.
    best = beam_search(encoder, step, src, n, 0, 0, 4, beam=2, length_penalty=0.0)
    assert best["tokens"].tolist() == [1, 1] and abs(best["score"] + 0.31) < 1e-9


def test_split_rows_gives_each_row_the_whole_batch_result():
    """Greedy decoding of 8 sentences over two row ranges at once (``run_loop(workers=2)``): every
    row's tokens, length and attention up to its end are the whole batch's; the tokens of the range
    that stopped earlier are padded as the batch pads rows that ended; both ranges really ran in
    threads of their own."""
    from pipeline.graphs import run_loop

    torch.manual_seed(0)
    model = models.build("bahdanau", TINY["bahdanau"]).eval()
    specs = model.export_graphs()
    seen = set()

    class Recording(TorchGraph):
        def __call__(self, feeds):
            import threading

            seen.add(threading.get_ident())
            return super().__call__(feeds)

    graphs = {g: Recording(s) for g, s in specs.items()}
    rng = np.random.default_rng(0)
    src_len = rng.integers(2, 7, 8)  # [8]: sentences of 2..6 tokens, EOS last
    src = rng.integers(4, TINY["bahdanau"]["src_vocab"], (8, 6))  # [8,6]
    src[np.arange(8), src_len - 1] = EOS
    src[np.arange(6)[None, :] >= src_len[:, None]] = 0
    batch = {"src": src.astype(np.int64), "src_len": src_len.astype(np.int64)}
    meta = {**model.cfg.__dict__}
    whole = run_loop(graphs, batch, meta)
    seen.clear()
    split = run_loop(graphs, batch, meta, workers=2)
    assert len(seen) == 2
    np.testing.assert_array_equal(split["lengths"], whole["lengths"])
    for i, n in enumerate(whole["lengths"]):
        np.testing.assert_array_equal(split["tokens"][i, :n + 1], whole["tokens"][i, :n + 1])
        np.testing.assert_allclose(split["attention"][i, :n + 1], whole["attention"][i, :n + 1], atol=1e-6)
    assert split["tokens"].shape == whole["tokens"].shape
    np.testing.assert_array_equal(split["tokens"], whole["tokens"])  # pads beyond EOS included


def test_split_rows_glimpses_equal_and_small_batches_stay_whole():
    from pipeline.graphs import run_loop
    from serving.decode import split_rows

    torch.manual_seed(0)
    model = models.build("ram", TINY["ram"]).eval()
    graphs = {g: TorchGraph(s) for g, s in model.export_graphs().items()}
    batch = {k: v.numpy() for k, v in tiny_batch("ram", batch=9).items()}
    meta = {**model.cfg.__dict__}
    whole, split = run_loop(graphs, batch, meta), run_loop(graphs, batch, meta, workers=2)
    assert set(split) == set(whole)
    for k in whole:
        np.testing.assert_allclose(split[k], whole[k], atol=1e-6)
    calls = []
    split_rows(lambda f: calls.append(len(f["x"])) or {"y": f["x"]}, {"x": np.zeros(7)}, workers=2)
    assert calls == [7]  # under 2 x min_rows (4): one range


def test_split_rows_helper_threads_keep_the_request_deadline():
    import time

    import pytest

    from serving.admission import DeadlineExceeded, check_deadline, deadline_scope
    from serving.decode import split_rows

    def slow(feeds):
        time.sleep(0.05)
        check_deadline()
        return {"y": feeds["x"]}

    with deadline_scope(0.01), pytest.raises(DeadlineExceeded):
        split_rows(slow, {"x": np.zeros(8)}, workers=2)
    assert split_rows(slow, {"x": np.arange(8)}, workers=2)["y"].tolist() == list(range(8))


def test_split_rows_pads_the_range_that_ended_earlier_as_the_batch_does():
    """Row i says EOS after src_len[i] tokens: the first range (lengths 1..2) stops at step 3 while
    the second (5..6) runs to 7; joined, every array equals the whole batch's up to the pads."""
    from serving.decode import split_rows

    def enc(feeds):
        return {"count": np.zeros(len(feeds["src"]), np.int64), "limit": feeds["src_len"]}

    def counting(feeds):
        count = feeds["count"] + 1
        logp = np.full((len(count), 4), -5.0)
        logp[np.arange(len(count)), np.where(count > feeds["limit"], EOS, 3)] = 0.0
        return {"log_probs": logp, "new_count": count, "attention": np.ones((len(count), 2)) * count[:, None]}

    lens = np.array([1, 2, 1, 2, 5, 6, 5, 6])
    src = np.zeros((8, 3), np.int64)

    def loop(feeds):
        return greedy(enc, counting, feeds["src"], feeds["src_len"], BOS, EOS, max_len=10)

    whole = loop({"src": src, "src_len": lens})
    split = split_rows(loop, {"src": src, "src_len": lens}, workers=2, fill={"tokens": 0})
    np.testing.assert_array_equal(split["lengths"], lens)
    np.testing.assert_array_equal(split["tokens"], whole["tokens"])  # [8,7]: 3s, EOS, then pad 0
    assert split["attention"].shape == whole["attention"].shape == (8, 7, 2)
    for i, n in enumerate(lens):
        np.testing.assert_array_equal(split["attention"][i, : n + 1], whole["attention"][i, : n + 1])


def test_a_served_translation_bars_repeated_ngrams_exactly_where_its_serving_block_says(tmp_path):
    import sentencepiece as spm

    from pipeline.serving_meta import serving_meta
    from serving.kinds.translation import TranslationModel
    from tests.serving_repo import ENGLISH, GERMAN, TEXTS, _tokenizer

    for side, lines in (("de", GERMAN), ("en", ENGLISH)):
        _tokenizer(tmp_path / f"spm.{side}.model", lines)
    sizes = {s: spm.SentencePieceProcessor(model_file=str(tmp_path / f"spm.{s}.model")).get_piece_size()
             for s in ("de", "en")}
    torch.manual_seed(0)
    model = models.build("bahdanau", {**TINY["bahdanau"], "src_vocab": sizes["de"], "tgt_vocab": sizes["en"]}).eval()
    specs = model.export_graphs()
    graphs = {name: TorchGraph(specs[name]) for name in ("encoder", "decoder_step")}

    def served(evaluate):
        meta = serving_meta(model.cfg, sorted(graphs), SimpleNamespace(task="translation_de_en", evaluate=evaluate))
        return meta, TranslationModel("bahdanau", 1, tmp_path, {"serving": meta}, graphs).translate(TEXTS, "beam", 3)

    plain_meta, plain = served({"beam": 3})
    assert "no_repeat_ngram" not in plain_meta  # other models' published serving blocks stay as they were
    meta, barred = served({"beam": 3, "no_repeat_ngram": 2})
    assert meta["no_repeat_ngram"] == 2
    for b in barred:
        src = np.array([b["src"]], dtype=np.int64)  # [1,S]
        expect = beam_search(graphs["encoder"], graphs["decoder_step"], src, np.array([src.shape[1]]), meta["bos_id"],
                             meta["eos_id"], meta["max_len"], beam=3, no_repeat_ngram=2)
        assert b["tokens"] == expect["tokens"].tolist()
        grams = list(zip(b["tokens"], b["tokens"][1:]))
        assert len(grams) == len(set(grams))
    # The untrained model loops: the block changes what is served.
    assert any(p["tokens"] != b["tokens"] for p, b in zip(plain, barred))


def test_evaluation_and_the_server_read_one_set_of_search_options():
    """``evaluate@`` reads an entry's ``evaluate`` params, the server the serving block that
    ``serving_meta`` writes from them: ``search_options`` must read both alike."""
    from pipeline.serving_meta import serving_meta
    from serving.decode import search_options

    cfg = models.build("bahdanau", TINY["bahdanau"]).cfg
    cases = [({}, {"length_penalty": 1.0, "no_repeat_ngram": 0}),
             ({"beam": 3, "length_penalty": 0}, {"length_penalty": 0.0, "no_repeat_ngram": 0}),
             ({"beam": 5, "length_penalty": 0.5, "no_repeat_ngram": 3}, {"length_penalty": 0.5, "no_repeat_ngram": 3})]
    for evaluate, expected in cases:
        run = SimpleNamespace(task="translation_de_en", evaluate=evaluate)
        block = serving_meta(cfg, ["decoder_step", "encoder"], run)
        assert search_options(evaluate) == expected
        assert search_options(block) == expected


def test_top_order_is_the_start_of_a_stable_descending_sort():
    rng = np.random.default_rng(0)
    for trial in range(300):
        size = int(rng.integers(1, 400))
        # few distinct values (many ties), -inf entries (finished or blocked hypotheses) and plain floats
        values = rng.integers(-5, 5, size).astype(np.float64) if trial % 2 else rng.normal(size=size)
        values[rng.random(size) < 0.3] = -np.inf
        count = int(rng.integers(1, size + 3))
        full = np.argsort(-values, kind="stable")
        got = top_order(values, count)
        assert len(got) >= min(count, size)
        assert got[: min(count, size)].tolist() == full[: min(count, size)].tolist()


def test_a_batched_beam_search_gives_each_input_its_own_search():
    """N padded inputs in one search per step: each one's tokens, n-best and attention are those of
    its search alone (float rounding apart), also when the inputs end at different steps."""
    torch.manual_seed(3)
    model = models.build("transformer", TINY["transformer"]).eval()
    with torch.no_grad():  # an untrained model emits one token forever: make its answers differ
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    specs = model.export_graphs()
    enc, dec = TorchGraph(specs["encoder"]), TorchGraph(specs["decoder_step"])
    rng = np.random.default_rng(0)
    lengths = [3, 7, 5, 2, 6]
    src = np.zeros((len(lengths), max(lengths)), np.int64)
    for i, n in enumerate(lengths):
        src[i, :n] = rng.integers(4, TINY["transformer"]["src_vocab"], n)
    for length_penalty in (1.0, 0.0):
        both = beam_search_batch(enc, dec, src, np.array(lengths), BOS, EOS, max_len=9, beam=3,
                                 length_penalty=length_penalty)
        ends = set()
        for i, n in enumerate(lengths):
            alone = beam_search(enc, dec, src[i : i + 1, :n], np.array([n]), BOS, EOS, max_len=9, beam=3,
                                length_penalty=length_penalty)
            assert both[i]["tokens"].tolist() == alone["tokens"].tolist()
            assert [t.tolist() for t, _ in both[i]["nbest"]] == [t.tolist() for t, _ in alone["nbest"]]
            np.testing.assert_allclose([sc for _, sc in both[i]["nbest"]], [sc for _, sc in alone["nbest"]],
                                       rtol=1e-5, atol=1e-5)
            # [T+1, n] (T without an EOS within max_len): the input's own columns, not the batch's
            assert both[i]["attention"].shape == alone["attention"].shape and alone["attention"].shape[1] == n
            np.testing.assert_allclose(both[i]["attention"], alone["attention"], atol=1e-5)
            ends.add(len(alone["tokens"]))
        assert len(ends) > 1  # inputs left the batch at different steps
