"""Quality bars and the task report."""

from __future__ import annotations

import json

import pytest

from pipeline.bars import check_bar
from pipeline.stages.report import report


def test_check_bar_all_conditions_must_hold():
    bar = [{"metric": "bit_errors_20", "op": "<=", "value": 0.1}, {"metric": "bit_errors_40", "op": "<=", "value": 1}]
    ok = check_bar({"bit_errors_20": 0.05, "bit_errors_40": 1.0}, bar)
    assert ok["passed"] and [c["measured"] for c in ok["conditions"]] == [0.05, 1.0]
    bad = check_bar({"bit_errors_20": 0.05, "bit_errors_40": 1.5}, bar)
    assert not bad["passed"] and [c["passed"] for c in bad["conditions"]] == [True, False]
    missing = check_bar({}, [{"metric": "bleu_beam", "op": ">=", "value": 12}])
    assert not missing["passed"] and missing["conditions"][0]["measured"] is None
    assert check_bar({"x": 1}, [])["passed"]


def write_rows(tmp_path, task: str = "t") -> None:
    rows = tmp_path / "results" / task
    rows.mkdir(parents=True)
    for name, values, passed in (("a", [20.0, 15.0], True), ("b", [18.0, 8.0], None)):
        (rows / f"{name}.json").write_text(json.dumps({
            "model": name, "arch": "bahdanau", "headline": {"bleu_beam": values[0]}, "parameters": 1234,
            "train_seconds": 5.0, "bar_passed": passed,
            "by_length": {"metric": "BLEU", "xlabel": "length", "labels": ["1-5", "6+"], "values": values}}))
    # export@a timed its inference loop; b's export predates the timing
    (rows / "a.latency.json").write_text(json.dumps({"cases": [], "total": {"pytorch_ms": 30.0,
                                                                          "onnxruntime_ms": 12.5}}))


def test_report_tables_and_plot(tmp_path):
    write_rows(tmp_path)
    text = report("t", root=tmp_path)
    assert "| a | bahdanau | 20.0 | 1,234 | 5.0 | 12.5 | 30.0 | met |" in text
    assert "| b | bahdanau | 18.0 | 1,234 | 5.0 | — | — | none set |" in text
    assert text.count("| bahdanau |") == 2  # the latency file is no row of its own
    assert "| b | 18.0 | 8.0 |" in text
    assert (tmp_path / "reports" / "t_by_length.png").stat().st_size > 1000


def test_report_shows_each_model_minus_its_attention_none_ablation_by_length(tmp_path):
    """Bahdanau's Fig. 2 as numbers: ``<model>_none`` is ``<model>``'s ablation; a model of another
    architecture with that name is not."""
    write_rows(tmp_path)
    rows = tmp_path / "results" / "t"
    (rows / "b.json").rename(rows / "a_none.json")
    row = json.loads((rows / "a_none.json").read_text())
    (rows / "a_none.json").write_text(json.dumps({**row, "model": "a_none"}))
    assert "| *a − a_none* | 2.0 | 7.0 |" in report("t", root=tmp_path)
    (rows / "a_none.json").write_text(json.dumps({**row, "model": "a_none", "arch": "luong"}))
    assert "a − a_none" not in report("t", root=tmp_path)


def test_the_report_stage_logs_its_table_and_plot_to_mlflow(tmp_path, monkeypatch, capsys):
    import mlflow

    from pipeline.stages import report as stage

    write_rows(tmp_path, "copy")  # a task params.yaml lists
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr(stage, "ROOT", tmp_path)
    stage.main(["copy"])
    assert "| a | bahdanau | 20.0 |" in capsys.readouterr().out
    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.stage = 'report'")
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["copy.md", "copy_by_length.png"]
    # a misspelled task: one sentence naming the known ones, exit 2, and no report or run written for it
    with pytest.raises(SystemExit) as stopped:
        stage.main(["cpoy"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.startswith("error: unknown task 'cpoy'; params.yaml lists: translation_de_en, copy")
    assert not (tmp_path / "reports" / "cpoy.md").exists()
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()])) == 1


def test_report_groups_table_with_its_floor(tmp_path):
    write_rows(tmp_path)
    rows = tmp_path / "results" / "t"
    for name, values in (("a", [12.0, 30.5]), ("b", [9.0, 20.0])):
        row = json.loads((rows / f"{name}.json").read_text())
        row["by_group"] = {"metric": "BLEU", "title": "corpus source", "note": "n", "labels": ["kde", "man"],
                           "values": values, "floor": [3.0, 16.2], "counts": [150, 300]}
        (rows / f"{name}.json").write_text(json.dumps(row))
    text = report("t", root=tmp_path)
    assert "## BLEU by corpus source" in text
    assert "| a | 12.0 | 30.5 |" in text and "| b | 9.0 | 20.0 |" in text
    assert "| *copy the source* | 3.0 | 16.2 |" in text and "| *test items* | 150 | 300 |" in text


def test_translation_evaluation_scores_per_source_against_the_copy_floor(tmp_path):
    """An untrained tiny Bahdanau on a prepared user corpus: the metrics carry sacrebleu's signature,
    BLEU per source beside copying the source, and the out-of-domain set's scores."""
    import shutil
    from types import SimpleNamespace

    import sacrebleu
    import torch

    import models
    from pipeline.stages.prepare import prepare
    from pipeline.tasks.translation_de_en import evaluate_translation
    from tests.conftest import TINY
    from tests.test_pipeline_smoke import SMOKE_CORPUS

    params = {"seed": 3, "vocab_size": 400, "corpus": SMOKE_CORPUS, "val_size": 30, "test_size": 60,
              "max_doc_share": 0.2}
    data = tmp_path / "data"
    prepare("translation_de_en", params, data)
    shutil.copy(data / "test.pt", data / "test_dict.pt")  # stands in for the dictionary sentences
    torch.manual_seed(0)
    model = models.build("bahdanau", {**TINY["bahdanau"], "src_vocab": 400, "tgt_vocab": 400}).eval()
    run = SimpleNamespace(name="tiny", data_dir=data, evaluate={"beam": 2, "min_source": 1,
                                                                 "length_buckets": [10, 20]})
    (tmp_path / "plots").mkdir()
    metrics, row = evaluate_translation(model, run, tmp_path / "plots")
    assert metrics["signature"]["bleu"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    items = torch.load(data / "test.pt")
    refs = items["tgt_text"]
    assert metrics["bleu_copy_source"] == round(sacrebleu.corpus_bleu(items["src_text"], [refs]).score, 2)
    assert metrics["bleu_copy_source"] > 0  # commands and names pass through even in German
    assert [g["source"] for g in metrics["by_source"]] == ["file"]  # one source name for a user's file
    assert metrics["by_source"][0]["sentences"] == len(refs) == metrics["test_sentences"]
    assert metrics["dict_test"]["sentences"] == len(refs)
    assert metrics["dict_test"]["bleu_copy_source"] == metrics["bleu_copy_source"]
    assert row["by_length"]["counts"] == [b["sentences"] for b in metrics["bleu_by_length"]]
    assert sum(row["by_length"]["counts"]) == len(refs)
    assert row["by_group"]["floor"] == [metrics["bleu_copy_source"]]
