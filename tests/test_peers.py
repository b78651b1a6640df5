"""scripts/peers: the data a peer toolkit trains on, the CTranslate2 converter, OpenNMT-py's config."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import models
from pipeline.graphs import TorchGraph
from pipeline.prepare import prepare
from pipeline.tasks.translation_de_en import BOS, EOS, TranslationTask
from serving.decode import beam_search

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

import ctranslate2_convert  # noqa: E402
import export_data  # noqa: E402
import peers  # noqa: E402


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The smoke profile's German-English pairs, prepared as the translation task prepares a user's corpus."""
    out = tmp_path_factory.mktemp("peers") / "data"
    prepare("translation_de_en", {"seed": 3, "vocab_size": 400, "corpus": str(ROOT / "profiles" / "smoke_de_en.tsv"),
                                  "val_size": 40, "test_size": 40, "max_doc_share": 0.2,
                                  "clean": {"min_words": 3, "max_words": 40}}, out)
    return out


def test_a_peer_gets_the_same_pieces_split_and_vocabulary(prepared, tmp_path):
    import sentencepiece as spm

    counts = export_data.export(prepared, tmp_path)
    task = TranslationTask()
    assert counts == {name: len(task.load(prepared, split)) for split, name in export_data.SPLITS.items()}
    sp = {s: spm.SentencePieceProcessor(model_file=str(prepared / f"spm.{s}.model")) for s in ("de", "en")}
    test = task.load(prepared, "test")
    for side, key in (("de", "src"), ("en", "tgt")):
        lines = (tmp_path / f"test.{side}").read_text().splitlines()
        ids = [[sp[side].piece_to_id(p) for p in line.split()] for line in lines]
        # attnzoo's sources end with EOS; the peer's encoder adds its own markers
        assert [x + [EOS] if side == "de" else x for x in ids] == [it[key] for it in test]
        vocab = [line.split("\t") for line in (tmp_path / f"vocab.{side}").read_text().splitlines()]
        every = sorted(sp[side].id_to_piece(i) for i in range(4, sp[side].get_piece_size()))
        assert sorted(p for p, _ in vocab) == every
        assert [int(c) for _, c in vocab] == sorted((int(c) for _, c in vocab), reverse=True)
    assert (tmp_path / "test.ref.en").read_text().splitlines() == [it["tgt_text"] for it in test]


def _trained_looking(prepared) -> models.Transformer:
    """A tiny Transformer over the prepared vocabularies whose weights are perturbed away from the
    initialisation, so that its answers vary with the input (an untrained one emits one token)."""
    import sentencepiece as spm

    size = {s: spm.SentencePieceProcessor(model_file=str(prepared / f"spm.{s}.model")).get_piece_size()
            for s in ("de", "en")}
    torch.manual_seed(5)
    model = models.build("transformer", {"src_vocab": size["de"], "tgt_vocab": size["en"], "dim": 32, "heads": 4,
                                         "ff_dim": 64, "enc_layers": 2, "dec_layers": 2, "max_len": 20}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def test_ctranslate2_holds_the_same_model(prepared, tmp_path):
    """The converted model gives PyTorch's log-probabilities on every test sentence, and its beam
    search attnzoo's tokens."""
    import ctranslate2

    model = _trained_looking(prepared)
    pieces = {s: ctranslate2_convert.vocab(prepared / f"spm.{s}.model") for s in ("de", "en")}
    spec = ctranslate2_convert.build_spec(model, pieces)
    spec.validate()
    spec.optimize()
    (tmp_path / "ct2").mkdir()
    spec.save(str(tmp_path / "ct2"))
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    task = TranslationTask()
    items = task.load(prepared, "test")
    src = [[pieces["de"][t] for t in it["src"]] for it in items]
    scored = translator.score_batch(src, [[pieces["en"][t] for t in it["tgt"]] for it in items])
    batch = task.collate(items)
    with torch.no_grad():
        logits, *_ = model.decode(batch["tgt_in"], model.encode(batch["src"], batch["src_len"]))
    logp = torch.log_softmax(logits, -1)
    for i, it in enumerate(items):
        ours = [logp[i, t, y].item() for t, y in enumerate(it["tgt"] + [EOS])]
        np.testing.assert_allclose(scored[i].log_probs, ours, atol=1e-4)
    specs = model.export_graphs()
    enc, step = TorchGraph(specs["encoder"]), TorchGraph(specs["decoder_step"])
    found = translator.translate_batch(src, beam_size=4, max_decoding_length=20, length_penalty=1.0)
    answers = set()
    for it, r in zip(items, found):
        ours = beam_search(enc, step, np.array([it["src"]]), np.array([len(it["src"])]), BOS, EOS, 20, beam=4)
        assert [pieces["en"].index(p) for p in r.hypotheses[0]] == ours["tokens"].tolist()
        answers.add(tuple(ours["tokens"].tolist()))
    assert len(answers) >= 5  # the answers follow the inputs (9 distinct of 42): not one repeated answer


def test_opennmt_gets_the_entrys_recipe(prepared, tmp_path):
    import shutil

    from pipeline.config import resolve

    root = tmp_path / "repo"  # params.yaml beside prepared data, as in a clone after `dvc repro prepare`
    (root / "data" / "prepared").mkdir(parents=True)
    shutil.copy(ROOT / "params.yaml", root / "params.yaml")
    shutil.copytree(prepared, root / "data" / "prepared" / "translation_de_en")
    config = yaml.safe_load(peers.onmt_config(tmp_path, root))
    run = resolve("transformer", root=root)
    m, t = run.model, run.train
    assert (config["enc_layers"], config["dec_layers"], config["heads"], config["hidden_size"],
            config["transformer_ff"]) == (m.get("enc_layers", 3), m.get("dec_layers", 3), m.get("heads", 4),
                                          m.get("dim", 256), m.get("ff_dim", 1024))
    assert config["batch_type"] == "tokens" and config["batch_size"] == t.max_tokens
    assert config["dropout"] == [m.get("dropout", 0.1)] and config["label_smoothing"] == m.get("label_smoothing", 0.1)
    assert config["share_decoder_embeddings"] is True and config["max_grad_norm"] == t.grad_clip
    # noam's peak, at step = warmup: learning_rate * dim^-0.5 * warmup^-0.5, attnzoo's lr
    peak = config["learning_rate"] * config["hidden_size"] ** -0.5 * config["warmup_steps"] ** -0.5
    assert math.isclose(peak, t.lr, rel_tol=1e-5) and config["warmup_steps"] == t.warmup_steps
    assert config["data"]["corpus_1"]["path_src"] == str(tmp_path / "data" / "train.de")


def test_the_opennmt_checkpoint_within_the_budget(tmp_path):
    log = [f"[2026-11-29 07:00:00,000 INFO] Step {s:>5}/1000000; acc: 40.0; ppl: 20.1; xent: 3.0; lr: 0.00100; "
           f"sents: 3000; bsz: 1500/1400/90; {r}/{r - 100} tok/s; {sec:>6} sec;" for s, r, sec in
           [(50, 4000, 40), (100, 4200, 70), (150, 4400, 100), (200, 4300, 130)]]
    (tmp_path / "train.log").write_text("\n".join(["[2026-11-29 07:00:00,000 INFO] Starting training"] + log) + "\n")
    for step in (100, 200):
        (tmp_path / f"model_step_{step}.pt").write_bytes(b"")
    got = peers.onmt_pick(tmp_path, 2.0)  # 120 s: step 200 (130 s) is over it
    assert got["step"] == 100 and got["seconds"] == 70 and got["checkpoint"].endswith("model_step_100.pt")
    assert got["target_tokens_per_s"] == 4000  # the median of the target rates up to step 100: 3900, 4100
    with pytest.raises(SystemExit, match="no checkpoint saved within"):
        peers.onmt_pick(tmp_path, 0.5)
