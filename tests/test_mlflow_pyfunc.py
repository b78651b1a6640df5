"""Each registered model version is an MLflow model: ``mlflow.pyfunc.load_model("models:/<name>@
production").predict(...)`` gives the server's answer, with a signature from the served metadata."""

from __future__ import annotations

import json

import mlflow
import numpy as np
import pytest

from pipeline.stages.publish import register
from tests.conftest import TINY, Planted, tiny_batch
from tests.test_serving import TEXTS, server  # noqa: F401
from tests.test_serving_production import _same

pytestmark = pytest.mark.integration  # a server of its own (tests.test_serving)


def test_registered_versions_load_as_pyfunc_and_answer_as_the_server(server, tmp_path, monkeypatch):  # noqa: F811
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.create_experiment("pyfunc", artifact_location=(tmp_path / "artifacts").as_uri())
    images = tiny_batch("show_attend_tell", seed=7, batch=2)["image"].numpy()
    rng = np.random.default_rng(1)
    cases = {"bahdanau": [({"text": np.array(TEXTS, dtype=object)}, {"decode": "greedy"}),
                          ({"text": np.array(TEXTS[:1], dtype=object)}, {"decode": "beam", "beam": 2})],
             "ntm": [({"x": np.random.default_rng(0).integers(0, 2, (2, 4, 5)).astype(np.float32)}, {})],
             "captioner": [({"image": images}, {"decode": "beam"})],
             # single-graph models: one ONNX graph, no loop (ACT: bits in; the Neural Programmer: text and a table)
             "act": [({"x": rng.integers(-1, 2, (3, TINY["act"]["input_size"])).astype(np.float32)}, {})],
             "programmer": [({"question": np.array(["sum of price where age greater than 40", "How many rows?"],
                                                   dtype=object),
                              "columns": np.array([["price", "age", "rank"]] * 2, dtype=object),
                              "table": rng.integers(0, 100, (2, 6, 3)).astype(np.float32)}, {})]}
    # an example request where one can be made without the task's data: a sentence, an image, a bit vector
    with_example = {"bahdanau", "captioner", "act"}
    with_search = {"bahdanau", "captioner"}  # decode / beam parameters only where there is a search
    for name, requests in cases.items():
        folder = server.published.repo / name / "1"
        meta = json.loads((folder / "metadata.json").read_text())
        with mlflow.start_run(experiment_id=experiment):
            version = register(name, folder, meta, True, f"{name} (test)")
        model = mlflow.pyfunc.load_model(f"models:/{name}@production")
        served = server.client.model_metadata(name, 1)
        assert model.metadata.get_input_schema().input_names() == [i["name"] for i in served["inputs"]]
        assert model.metadata.get_output_schema().input_names() == [o["name"] for o in served["outputs"]]
        assert (model.metadata.saved_input_example_info is not None) == (name in with_example), name
        assert (model.metadata.get_params_schema() is not None) == (name in with_search), name
        client = mlflow.MlflowClient()
        mv = client.get_model_version(name, version)
        assert mv.tags["repository_version"] == "1" and "mlflow.source.git.commit" in mv.tags
        for feeds, p in requests:
            got = model.predict(feeds, params=p or None)
            want = server.client.infer(name, feeds, version=1, parameters=p or None)
            _same({k: np.asarray(v) for k, v in got.items()}, want)


def test_a_registered_version_is_code_and_never_unpickled(server, tmp_path, monkeypatch):  # noqa: F811
    """The logged model is serving/pyfunc_model.py (models-from-code) and carries no pickle; a
    python_model.pkl planted into it is never read when the model loads (the payload would write a
    file), and the model still answers as the server."""
    import cloudpickle
    import yaml

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.create_experiment("code", artifact_location=(tmp_path / "artifacts").as_uri())
    folder = server.published.repo / "ntm" / "1"
    with mlflow.start_run(experiment_id=experiment):
        register("ntm", folder, json.loads((folder / "metadata.json").read_text()), True, "ntm (test)")
    local = tmp_path / "model"
    mlflow.artifacts.download_artifacts("models:/ntm@production", dst_path=str(local))
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]
    assert flavor["model_code_path"].endswith("pyfunc_model.py") and "python_model" not in flavor
    assert not list(local.rglob("*.pkl"))
    marker = tmp_path / "pwned"
    (local / "python_model.pkl").write_bytes(cloudpickle.dumps(Planted(marker)))
    model = mlflow.pyfunc.load_model(str(local))
    x = np.random.default_rng(0).integers(0, 2, (2, 4, 5)).astype(np.float32)
    got = model.predict({"x": x})
    _same({k: np.asarray(v) for k, v in got.items()}, server.client.infer("ntm", {"x": x}, version=1))
    assert not marker.exists()
    cloudpickle.loads((local / "python_model.pkl").read_bytes())  # the planted file, were it read
    assert marker.exists()
