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
from pipeline.export import export_onnx
from pipeline.publish import serving_meta, write_version
from pipeline.tasks.translation_de_en import TranslationTask
from serving.client import LocalClient
from serving.repository import check_version
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
    """The same model published twice: ``onnx`` (its graphs) and ``ct2`` (served by CTranslate2)."""
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
