"""CTranslate2 as a version's serving engine: the converted model against PyTorch, a version served by it
against the same model's ONNX loop (locally and through the server with the KServe client), and the
checks a server runs on such a version."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline import ctranslate2_engine as engine
from pipeline.config import UserError, resolve
from pipeline.serving_meta import serving_meta
from pipeline.stages.export import export_onnx
from pipeline.stages.publish import write_version
from pipeline.tasks.translation_de_en import TranslationTask
from serving.client import LocalClient
from serving.version import check_version
from tests.conftest import ROOT, trained_looking_transformer


@pytest.fixture(scope="module")
def converted(smoke_translation, tmp_path_factory):
    model = trained_looking_transformer(smoke_translation)
    out = engine.convert(model, smoke_translation / "spm.de.model", smoke_translation / "spm.en.model",
                         tmp_path_factory.mktemp("ct2") / engine.ENGINE_DIR)
    return SimpleNamespace(model=model, folder=out, items=TranslationTask().load(smoke_translation, "test"))


def test_the_converted_model_computes_what_pytorch_computes(converted):
    check = engine.parity(converted.model, converted.folder, converted.items, atol=1e-4)
    assert check["passed"] and check["items"] == len(converted.items) == 42
    assert check["greedy_identical"] == 42 and check["max_logp_diff"] < 1e-4 and check["max_attention_diff"] < 1e-4
    predict = converted.model.predict
    answers = {tuple(predict({"src": torch.tensor([it["src"]]), "src_len": torch.tensor([len(it["src"])])}
                             )["tokens"][0].tolist()) for it in converted.items}
    assert len(answers) >= 5  # the answers follow the inputs: the identity is not one repeated answer


def test_other_weights_fail_the_parity_check(converted, smoke_translation):
    other = trained_looking_transformer(smoke_translation)  # the same seed: the same weights, then one layer moved
    with torch.no_grad():
        other.decoder[0].ff[0].weight.add_(0.05)
    check = engine.parity(other, converted.folder, converted.items[:8], atol=1e-4)
    assert not check["passed"] and check["max_logp_diff"] > 1e-3


def test_an_entry_names_a_known_engine(smoke_translation, tmp_path):
    import yaml

    (tmp_path / "data" / "prepared").mkdir(parents=True)
    shutil.copytree(smoke_translation, tmp_path / "data" / "prepared" / "translation_de_en")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert resolve("transformer", params=params, root=tmp_path).engine == params["models"]["transformer"].get(
        "engine", "onnxruntime")
    params["models"]["transformer"]["engine"] = "tensorrt"
    with pytest.raises(UserError, match="engine 'tensorrt' is not one of onnxruntime, ctranslate2"):
        resolve("transformer", params=params, root=tmp_path)


@pytest.fixture(scope="module")
def repository(converted, smoke_translation, tmp_path_factory):
    """The same model published twice: ``onnx`` (its graphs) and ``ct2`` (served by CTranslate2). An export
    and two versions: the tests that read it are marked slow (make test's second lane)."""
    tmp = tmp_path_factory.mktemp("repo")
    export_onnx(converted.model, tmp / "onnx")
    run = SimpleNamespace(task="translation_de_en", evaluate={"beam": 4})
    serving = {**serving_meta(converted.model.cfg, ["decoder_step", "encoder"], run), "limits": {}}
    artifacts = [smoke_translation / "spm.de.model", smoke_translation / "spm.en.model"]
    meta = {"arch": "transformer", "task": "translation_de_en", "parity_passed": True, "production": True}
    write_version(tmp / "model_repository" / "onnx", "onnx", tmp / "onnx", serving, meta, artifacts)
    served = {**serving, "engine": "ctranslate2", "ctranslate2": {"folder": engine.ENGINE_DIR,
                                                                   "compute_type": "float32"}}
    write_version(tmp / "model_repository" / "ct2", "ct2", tmp / "onnx", served, meta, artifacts, converted.folder)
    return tmp / "model_repository"


@pytest.mark.slow
def test_ctranslate2_answers_as_the_onnx_loop(repository, converted):
    client = LocalClient(repository, threads=1)
    texts = [it["src_text"] for it in converted.items]
    greedy = {m: client.infer(m, {"text": texts}, parameters={"decode": "greedy"}) for m in ("onnx", "ct2")}
    assert greedy["ct2"]["translation"].tolist() == greedy["onnx"]["translation"].tolist()
    np.testing.assert_array_equal(greedy["ct2"]["target_pieces"], greedy["onnx"]["target_pieces"])
    assert greedy["ct2"]["attention"].shape == greedy["onnx"]["attention"].shape
    assert np.isnan(greedy["ct2"]["nbest_scores"]).all()
    beam = {m: client.infer(m, {"text": texts}, parameters={"nbest": 3}) for m in ("onnx", "ct2")}
    same = [i for i in range(len(texts)) if beam["ct2"]["nbest"][i].tolist() == beam["onnx"]["nbest"][i].tolist()]
    assert len(same) >= 38, f"{len(same)} of {len(texts)} texts have the same 3-best list"
    # the same ranking scores: log p over length**length_penalty
    np.testing.assert_allclose(beam["ct2"]["nbest_scores"][same], beam["onnx"]["nbest_scores"][same], atol=1e-4)
    # each row of the alignment is a distribution over the text's own source pieces (the EOS step's
    # row included), also for texts shorter than others in the request
    for i in range(len(texts)):
        rows = beam["ct2"]["attention"][i, : len([p for p in beam["ct2"]["target_pieces"][i] if p])]
        np.testing.assert_allclose(rows.sum(-1), 1.0, atol=1e-4)
    for i in (0, 7, 21):  # and as each text alone gets it
        alone = client.infer("ct2", {"text": [texts[i]]})["attention"][0]
        np.testing.assert_allclose(beam["ct2"]["attention"][i, : alone.shape[0], : alone.shape[1]], alone, atol=1e-5)


@pytest.mark.integration
def test_the_server_answers_a_kserve_client_with_ctranslate2(repository, converted):
    import tritonclient.http as httpclient

    from tests.test_serving_production import start_server, stop

    srv = start_server(repository, "--no-playground")
    try:
        client = httpclient.InferenceServerClient(url=srv.url.removeprefix("http://"), network_timeout=60)
        texts = np.array([[it["src_text"] for it in converted.items[:5]]], dtype=object).reshape(-1)
        given = httpclient.InferInput("text", [len(texts)], "BYTES")
        given.set_data_from_numpy(texts)
        got = client.infer("ct2", [given], outputs=[httpclient.InferRequestedOutput("translation")])
        local = LocalClient(repository, threads=1).infer("ct2", {"text": texts.tolist()})
        assert [t.decode() for t in got.as_numpy("translation")] == local["translation"].tolist()
    finally:
        stop(srv)


@pytest.mark.slow
def test_a_server_refuses_an_engine_folder_outside_the_version_or_changed(repository, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(repository / "ct2" / "1", bad)
    check_version(bad)
    meta = json.loads((bad / "metadata.json").read_text())
    meta["serving"]["ctranslate2"]["folder"] = "../onnx"
    (bad / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a file name in the version"):
        check_version(bad)
    shutil.copytree(repository / "ct2" / "1", bad, dirs_exist_ok=True)
    with (bad / engine.ENGINE_DIR / "model.bin").open("ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="model.bin is missing or differs"):
        check_version(bad)


@pytest.mark.slow
def test_the_int8_variant_is_served_by_ctranslate2_when_its_gate_passed(converted, repository, smoke_translation,
                                                                        tmp_path):
    """quantize@'s int8 conversion (int8 weights), scored on what the server answers, and publish's
    `<name>-int8` served by it; with its gate failed the variant is the int8 graphs' alone."""
    from pipeline.stages.publish import publish_int8
    from pipeline.stages.quantize import gate
    from pipeline.tasks.translation_de_en import score_beam

    bar = [{"metric": "bleu_beam", "op": ">=", "value": 0.0}]
    run = SimpleNamespace(name="t", task="translation_de_en", data_dir=smoke_translation, evaluate={"beam": 4},
                          run_dir=tmp_path / "runs" / "t", bar=bar)
    serving = {**serving_meta(converted.model.cfg, ["decoder_step", "encoder"], run), "limits": {}}
    artifacts = [smoke_translation / "spm.de.model", smoke_translation / "spm.en.model"]
    before = {k: v.clone() for k, v in converted.model.state_dict().items()}
    record = engine.build_int8(converted.model, run, serving, artifacts, run.run_dir / "int8")
    # the conversion quantises its own copies: the model's weights are untouched
    assert all(torch.equal(v, before[k]) for k, v in converted.model.state_dict().items())
    assert record["serving"] == {"folder": engine.ENGINE_DIR, "compute_type": "int8", "cpu_threads": 1}
    folder = run.run_dir / "int8" / engine.ENGINE_DIR
    # int8 weights: the matrices take a byte each instead of four; the two position tables (1,024 x 32
    # floats each, 64% of this tiny fp32 model) stay float
    assert (folder / "model.bin").stat().st_size < 0.6 * (converted.folder / "model.bin").stat().st_size
    export_onnx(converted.model, run.run_dir / "int8")  # stands for the int8 graphs: publish copies what is there
    fp32 = {"bleu_beam": record["metrics"]["bleu_beam"]}

    def publish_with(engine_passed: bool, name: str, promote: bool = True) -> dict:
        report = {"quantization": {"method": "dynamic", "weights": "int8"}, "metrics": fp32,
                  "gate": gate(fp32, fp32, bar, 0.5),
                  "engine": {**record, "gate": {**gate(fp32, record["metrics"], bar, 0.5), "passed": engine_passed}}}
        (run.run_dir / "int8_metrics.json").write_text(json.dumps(report))
        run.name = name
        return publish_int8(run, tmp_path, serving, {"arch": "transformer", "task": run.task}, artifacts,
                            fp32_version=2, promote=promote, repository=tmp_path / "model_repository",
                            register=False)

    assert publish_with(True, "t")["published"]
    meta = json.loads((tmp_path / "model_repository" / "t-int8" / "1" / "metadata.json").read_text())
    assert meta["serving"]["engine"] == "ctranslate2" and meta["serving"]["ctranslate2"]["compute_type"] == "int8"
    assert meta["engine"]["bar"]["passed"] and meta["production"]
    card = (tmp_path / "model_repository" / "t-int8" / "1" / "MODEL_CARD.md").read_text()
    assert "Served by ctranslate2" in card and "int8 weights (int8), gate against fp32 passed" in card
    assert "int8 gate of ctranslate2's variant" in card
    # its bar met, but the fp32 version it was made beside not promoted: published, not promoted either
    assert publish_with(True, "n", promote=False)["published"]
    assert not json.loads((tmp_path / "model_repository" / "n-int8" / "1" / "metadata.json").read_text())["production"]
    check_version(tmp_path / "model_repository" / "t-int8" / "1")
    client = LocalClient(tmp_path / "model_repository", threads=2)
    texts = [it["src_text"] for it in converted.items]
    served = client.infer("t-int8", {"text": texts})["translation"].tolist()
    assert client.loaded[("t-int8", 1)][0].engine.threads == 1  # the version's cpu_threads below the client's 2
    # the metrics quantize@ records are those of what the published variant answers: CTranslate2's own
    # int8 decoding of the converted folder, in the server's chunks
    rescored = score_beam(converted.items, served, 4, 100)
    assert {k: rescored[k] for k in record["metrics"]} == record["metrics"] and len(set(served)) > 5
    import ctranslate2
    import sentencepiece as spm

    from serving.decode import search_options
    from serving.kinds.translation import BEAM_ROWS

    options, size = search_options(serving), BEAM_ROWS // 4
    de, en = (spm.SentencePieceProcessor(model_file=str(smoke_translation / f"spm.{s}.model")) for s in ("de", "en"))
    translator = ctranslate2.Translator(str(folder), compute_type="int8", intra_threads=1)
    own = [r for at in range(0, len(texts), size) for r in translator.translate_batch(
        [de.encode(text, out_type=str) + ["</s>"] for text in texts[at : at + size]], beam_size=4,
        length_penalty=options["length_penalty"], no_repeat_ngram_size=options["no_repeat_ngram"],
        max_decoding_length=serving["max_len"], min_decoding_length=0)]
    assert served == [en.decode_pieces(r.hypotheses[0]) for r in own]
    assert publish_with(False, "u")["published"]
    meta = json.loads((tmp_path / "model_repository" / "u-int8" / "1" / "metadata.json").read_text())
    assert "engine" not in meta["serving"] and "engine" not in meta
    assert not (tmp_path / "model_repository" / "u-int8" / "1" / engine.ENGINE_DIR).exists()
    # the int8 graphs answer it (here the fp32 graphs stand in for them: the ONNX loop's answers)
    alone = LocalClient(tmp_path / "model_repository", threads=1).infer("u-int8", {"text": texts})
    assert alone["translation"].tolist() == LocalClient(repository, threads=1).infer(
        "onnx", {"text": texts})["translation"].tolist()
