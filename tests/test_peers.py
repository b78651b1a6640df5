"""scripts/peers: the data a peer toolkit trains on, OpenNMT-py's config and checkpoint choice."""

from __future__ import annotations

import json
import math
from pathlib import Path

import export_data
import peers
import pytest
import yaml

from pipeline.tasks.translation_de_en import EOS, TranslationTask

ROOT = Path(__file__).resolve().parent.parent


def test_a_peer_gets_the_same_pieces_split_and_vocabulary(smoke_translation, tmp_path):
    import sentencepiece as spm

    counts = export_data.export(smoke_translation, tmp_path)
    task = TranslationTask()
    assert counts == {name: len(task.load(smoke_translation, split)) for split, name in export_data.SPLITS.items()}
    sp = {s: spm.SentencePieceProcessor(model_file=str(smoke_translation / f"spm.{s}.model")) for s in ("de", "en")}
    test = task.load(smoke_translation, "test")
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


def test_opennmt_gets_the_entrys_recipe(smoke_translation, tmp_path):
    import shutil

    from pipeline.config import resolve

    root = tmp_path / "repo"  # params.yaml beside prepared data, as in a clone after `dvc repro prepare`
    (root / "data" / "prepared").mkdir(parents=True)
    shutil.copy(ROOT / "params.yaml", root / "params.yaml")
    shutil.copytree(smoke_translation, root / "data" / "prepared" / "translation_de_en")
    config = yaml.safe_load(peers.onmt_config(tmp_path, root))
    run = resolve("transformer", root=root)
    m, t = run.model, run.train
    assert (config["enc_layers"], config["dec_layers"], config["heads"], config["hidden_size"],
            config["transformer_ff"]) == (m.get("enc_layers", 3), m.get("dec_layers", 3), m.get("heads", 4),
                                          m.get("dim", 256), m.get("ff_dim", 1024))
    assert config["batch_type"] == "tokens" and config["batch_size"] == t.max_tokens
    assert config["dropout"] == [m.get("dropout", 0.1)] and config["label_smoothing"] == m.get("label_smoothing", 0.1)
    assert config["share_decoder_embeddings"] is True and config["max_grad_norm"] == t.grad_clip
    # docs/benchmarks.md's OpenNMT-py column trained with dropout 0.1 whatever the recipe's: --dropout
    other = yaml.safe_load(peers.onmt_config(tmp_path, root, dropout=0.1))
    assert other["dropout"] == other["attention_dropout"] == [0.1]
    def rest(c: dict) -> dict:
        return {k: v for k, v in c.items() if "dropout" not in k}

    assert rest(other) == rest(config)
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
    with pytest.raises(peers.cli_errors.ScriptError, match="no checkpoint saved within"):
        peers.onmt_pick(tmp_path, 0.5)


def test_the_recipe_comparisons_are_kept_one_per_budget(tmp_path):
    import transformer_recipe

    path = tmp_path / "recipe.json"
    a, b = ({"val_loss": 2.5, "bleu": 24.0, "chrf": 49.0, "val_token_acc": 0.53, "train_seconds": 972.8},
            {"val_loss": 1.8, "bleu": 36.0, "chrf": 60.0, "val_token_acc": 0.65, "train_seconds": 2949.7})
    transformer_recipe.keep(path, 6000, 5, {"recipe": a})
    transformer_recipe.keep(path, 2000, 5, {"recipe": a, "dropout 0.1": b})
    transformer_recipe.keep(path, 6000, 5, {"recipe": b})  # a budget measured again replaces its comparison
    kept = json.loads(path.read_text())
    assert [c["steps"] for c in kept["comparisons"]] == [2000, 6000]
    assert kept["comparisons"][1]["rows"] == {"recipe": b}
    lines = transformer_recipe.table(kept["comparisons"][0]["rows"]).splitlines()
    assert lines[2] == "| recipe | 2.500 | 53.0 % | 24.00 | — | 49.00 | 16 min 13 s |"
    assert lines[3] == "| dropout 0.1 | 1.800 | 65.0 % | 36.00 | +12.00 | 60.00 | 49 min 10 s |"
    # a comparison measured on an earlier recipe names how that recipe differed
    lines = transformer_recipe.table({"recipe": a, "dropout 0": b}, {"dropout": 0.1}).splitlines()
    assert lines[2].startswith("| recipe with dropout 0.1 | 2.500 |") and lines[3].startswith("| dropout 0 |")
    # a finished recipe run of another budget is refused, not compared
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_summary.json").write_text(json.dumps({"steps": 6000}))
    with pytest.raises(transformer_recipe.cli_errors.ScriptError, match="did not train 2000 steps"):
        transformer_recipe.main(["--work", str(tmp_path / "w"), "--only", "recipe", "--recipe-run", str(run)])


def test_attnzoo_progress_reads_where_a_last_checkpoint_stood(tmp_path, save_last):
    save_last({"step": 2500, "seconds": 1165.54, "best": 2.1, "hash": "h"})
    assert peers.attnzoo_progress(tmp_path / "last") == {"checkpoint": str(tmp_path / "last"), "step": 2500,
                                                          "train_seconds": 1165.5}


def test_the_decode_table_is_the_runs_later_rows_fastest_in_bold():
    import decode_bench

    def row(run, engine, precision, threads, batch, speed, same):
        return {"run": run, "engine": engine, "precision": precision, "threads": threads, "batch": batch,
                "sentences_per_s": speed, "same_as_onnx": same}

    runs = {"ctranslate2": "9.9", "rows": [
        row(1, "ctranslate2", "fp32", 1, 32, 60.0, 0.95), row(1, "onnx", "fp32", 1, 32, 25.0, 1.0),
        row(2, "ctranslate2", "fp32", 2, 32, 80.0, 0.95), row(2, "onnx", "fp32", 2, 32, 30.0, 1.0),
        row(3, "onnx", "fp32", 2, 32, 90.0, 1.0),  # measured again in a later run: its row is shown
        row(3, "server", "fp32", 2, 32, 28.5, 1.0), row(3, "ctranslate2", "int8", 2, 1, 12.5, 0.784)]}
    lines = decode_bench.table(runs).splitlines()
    assert lines[0].startswith("| engine (sentences/s at 2 threads / 1 thread) | fp32, batch 32 | fp32, batch 1 |")
    assert lines[1] == "|---|---|---|---|---|---|"
    assert lines[2] == "| CTranslate2 9.9 | 80.0 / **60.0** | — / — | — / — | **12.5** / — | 95.0 % / — |"
    loop = "| attnzoo, ONNX Runtime loop (`LocalClient`) |"
    assert lines[3] == loop + " **90.0** / 25.0 | — / — | — / — | — / — | — / — |"
    assert lines[4] == "| attnzoo server, ONNX Runtime loop | 28.5 / — | — / — | — / — | — / — | 100.0 % / — |"
    assert len(lines) == 5  # engines never measured get no row


def test_each_decode_run_is_added_to_its_file_with_the_machine(tmp_path):
    import decode_bench

    path = tmp_path / "decode.json"
    decode_bench.add_run(path, [{"engine": "onnx", "sentences_per_s": 1.0}])
    decode_bench.add_run(path, [{"engine": "ctranslate2", "sentences_per_s": 2.0}, {"engine": "onnx"}])
    runs = json.loads(path.read_text())
    assert [(r["engine"], r["run"]) for r in runs["rows"]] == [("onnx", 1), ("ctranslate2", 2), ("onnx", 2)]
    assert runs["machine"] == decode_bench.machine() and "cores" in runs["machine"]
    assert set(runs) == {"machine", "ctranslate2", "onnxruntime", "rows"}
