"""The Open Inference Protocol over gRPC (``attnzoo serve --grpc-port``): NVIDIA's tritonclient.grpc
against a real server of every model kind, answering as REST does; hostile messages answered by
their gRPC status, never INTERNAL or UNKNOWN.

This process imports tritonclient's generated protocol (package ``inference``) and never the
server's serving/grpc/grpc_service_pb2.py: both define the same messages, which protobuf's one
descriptor pool refuses twice. The server runs in its own process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from serving.client import Client
from tests.conftest import ROOT
from tests.ports import free_port, wait_serving

GRPC_DIR = ROOT / "serving" / "grpc"


def test_the_shipped_message_classes_are_what_protoc_generates_from_the_shipped_proto(tmp_path):
    from grpc_tools import protoc  # the dev extra: a missing or broken install fails here
    assert protoc.main(["protoc", f"-I{GRPC_DIR}", f"--python_out={tmp_path}",
                        str(GRPC_DIR / "grpc_service.proto")]) == 0
    shipped = (GRPC_DIR / "grpc_service_pb2.py").read_text()
    assert (tmp_path / "grpc_service_pb2.py").read_text() == shipped, "run `make grpc-stubs` and commit the result"
    assert "# Protobuf Python Version: " in shipped  # the generator's version, in the file


def _start(repo: Path, log_path: Path, *flags: str) -> SimpleNamespace:
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log_path.open("w") as log_file:  # a file, not a pipe nobody reads (it would fill and block the server)
        proc = subprocess.Popen([sys.executable, "-m", "serving.server", "--repository", str(repo), "--port", str(port),
                                 "--grpc-port", str(grpc_port), *flags],
                                cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    client = Client(f"http://127.0.0.1:{port}", timeout=30)
    if not wait_serving(proc, port, client.ready, 60):
        proc.kill()
        raise RuntimeError(f"server did not become ready:\n{log_path.read_text()[-3000:]}")
    return SimpleNamespace(proc=proc, client=client, url=client.url, grpc=f"127.0.0.1:{grpc_port}", log=log_path)


def _stop(srv: SimpleNamespace) -> str:
    srv.proc.terminate()
    srv.proc.wait(timeout=20)
    return srv.log.read_text()


@pytest.fixture(scope="module")
def served(published, tmp_path_factory):
    srv = _start(published.repo, tmp_path_factory.mktemp("grpc") / "server.log", "--max-body-mb", "0.5",
                 "--batch-delay-ms", "20")
    yield srv
    log = _stop(srv)
    assert "Traceback" not in log, log[-3000:]


@pytest.fixture(scope="module")
def grpcclient():
    import tritonclient.grpc  # the dev extra: a missing or broken install fails here

    return tritonclient.grpc


@pytest.fixture(scope="module")
def triton(served, grpcclient):
    client = grpcclient.InferenceServerClient(url=served.grpc)
    yield client
    client.close()


def _plain(array) -> np.ndarray:
    """BYTES as str (tritonclient.grpc gives bytes, our REST client str)."""
    array = np.asarray(array)
    if array.dtype == object or array.dtype.kind in "SU":
        return np.array([v.decode() if isinstance(v, bytes) else str(v) for v in array.reshape(-1)],
                        dtype=object).reshape(array.shape)
    return array


def _assert_same(got, want, what) -> None:
    """Integers, booleans and text exactly; floats within 1e-6 (NaN equals NaN: greedy has no score)."""
    got, want = _plain(got), _plain(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype.kind in "fc":
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, equal_nan=True, err_msg=what)
    else:
        assert np.array_equal(got, want), (what, got, want)


def _tensors(grpcclient, inputs: dict[str, np.ndarray]) -> list:
    from tritonclient.utils import np_to_triton_dtype

    out = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


@pytest.mark.integration
def test_health_metadata_readiness_and_the_repository_index(triton, served):
    assert triton.is_server_live() and triton.is_server_ready()
    meta = triton.get_server_metadata(as_json=True)
    assert meta["name"] == "attnzoo" and meta["extensions"] == ["binary_tensor_data", "model_repository"]
    assert meta["version"] == served.client.server_metadata()["version"]
    index = triton.get_model_repository_index(as_json=True)["models"]
    rest = {(m["name"], m["version"]) for m in served.client.call("POST", "/v2/repository/index", {})}
    assert {(m["name"], m["version"]) for m in index} == rest and {m["state"] for m in index} == {"READY"}
    assert triton.is_model_ready("ntm") and triton.is_model_ready("ntm", "2")
    meta = triton.get_model_metadata("ntm", "2", as_json=True)
    rest = served.client.model_metadata("ntm", "2")
    assert meta["versions"] == rest["versions"] and meta["platform"] == rest["platform"]
    for key in ("inputs", "outputs"):
        assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in meta[key]] == \
               [(t["name"], t["datatype"], t["shape"]) for t in rest[key]]


@pytest.mark.integration
def test_unknown_models_and_versions_are_not_found_with_the_rest_sentence(triton, grpcclient, served):
    from tritonclient.utils import InferenceServerException

    for call in (lambda: triton.get_model_metadata("no_such_model"), lambda: triton.is_model_ready("ntm", "9"),
                 lambda: triton.infer("no_such_model", _tensors(grpcclient, {"x": np.zeros((1, 2, 5), np.float32)})),
                 lambda: triton.infer("ntm", _tensors(grpcclient, {"x": np.zeros((1, 2, 5), np.float32)}),
                                      model_version="abc")):
        with pytest.raises(InferenceServerException) as err:
            call()
        assert err.value.status() == "StatusCode.NOT_FOUND", err.value
    status, body = _rest_error(served.url, "/v2/models/no_such_model")
    with pytest.raises(InferenceServerException) as err:
        triton.get_model_metadata("no_such_model")
    assert status == 404 and err.value.message() == body["error"]


def _rest_error(url: str, path: str) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + path, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def cases():
    from tests.test_binary_protocol import CASES

    return CASES


@pytest.mark.integration
def test_tritonclient_grpc_answers_every_served_model_as_rest_does(triton, grpcclient, served, cases):
    served_names = {m["name"] for m in served.client.call("POST", "/v2/repository/index", {})}
    assert set(cases) <= served_names
    for name, (inputs, params) in sorted(cases.items()):
        rest_meta = served.client.model_metadata(name)
        names = [o["name"] for o in rest_meta["outputs"]]
        result = triton.infer(name, _tensors(grpcclient, inputs), parameters=params or None, request_id="r-1",
                              client_timeout=60)
        response = result.get_response()
        assert response.model_name == name and response.id == "r-1"
        assert [o.name for o in response.outputs] == names
        rest = served.client.infer(name, inputs, parameters=params)
        for n in names:
            _assert_same(result.as_numpy(n), rest[n], f"{name}.{n}")


def _raw_channel(served):
    import grpc

    return grpc.insecure_channel(served.grpc, options=[("grpc.max_send_message_length", -1),
                                                      ("grpc.max_receive_message_length", -1)])


def _message_bytes(request) -> bytes:
    return request.SerializeToString()


@pytest.mark.integration
def test_typed_contents_answer_as_raw_contents_do(served, cases):
    """tritonclient sends raw_input_contents; KServe's clients may send typed contents instead."""
    from tritonclient.grpc import service_pb2 as pb

    with _raw_channel(served) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for name in ("ntm", "bahdanau", "ocr"):  # FP32, BYTES, and FP32 + INT64 typed contents
            inputs, params = cases[name]
            request = pb.ModelInferRequest(model_name=name)
            for key, value in params.items():
                request.parameters[key].string_param = value
            for n, array in inputs.items():
                tensor = request.inputs.add(name=n, shape=list(array.shape),
                                            datatype={"f": "FP32", "i": "INT64", "O": "BYTES"}[array.dtype.kind])
                flat = array.reshape(-1).tolist()
                if array.dtype == object:
                    tensor.contents.bytes_contents.extend(v.encode() for v in flat)
                elif array.dtype.kind == "i":
                    tensor.contents.int64_contents.extend(flat)
                else:
                    tensor.contents.fp32_contents.extend(flat)
            response = pb.ModelInferResponse.FromString(infer(_message_bytes(request), timeout=60))
            rest = served.client.infer(name, inputs, parameters=params)
            assert len(response.raw_output_contents) == len(response.outputs) == len(rest)
            for out, raw in zip(response.outputs, response.raw_output_contents):
                if out.datatype == "BYTES":
                    from tritonclient.utils import deserialize_bytes_tensor

                    got = deserialize_bytes_tensor(raw).reshape(list(out.shape))
                else:
                    from tritonclient.utils import triton_to_np_dtype

                    got = np.frombuffer(raw, triton_to_np_dtype(out.datatype)).reshape(list(out.shape))
                _assert_same(got, rest[out.name], f"{name}.{out.name}")


def _hostile(rng: np.random.Generator, pb, i: int) -> tuple[str, bytes, set[str]]:
    """One hostile (or, now and then, valid) gRPC request: (method, its bytes, the codes it may get)."""
    bad, missing = {"INVALID_ARGUMENT"}, {"NOT_FOUND"}
    kind = i % 14
    x = rng.integers(0, 2, (1, int(rng.integers(1, 4)), 5)).astype(np.float32)

    def ntm(shape=None, datatype="FP32", raw=None, model="ntm", version="", **extra) -> bytes:
        request = pb.ModelInferRequest(model_name=model, model_version=version, **extra)
        request.inputs.add(name="x", datatype=datatype, shape=list(x.shape) if shape is None else shape)
        request.raw_input_contents.append(x.tobytes() if raw is None else raw)
        return request.SerializeToString()

    if kind == 0:  # bytes that are no message (or, by chance, one with unknown fields: no model named)
        return "ModelInfer", rng.bytes(int(rng.integers(1, 200))), bad | missing
    if kind == 1:  # a datatype the model does not take, or none at all
        return "ModelInfer", ntm(datatype=str(rng.choice(["INT64", "FP16", "BYTES", "", "FP33", "x" * 300]))), bad
    if kind == 2:  # raw contents lying about their size (a few bytes short or long of it)
        size = x.nbytes + int(rng.choice([-1, 1])) * int(rng.integers(1, 9))
        return "ModelInfer", ntm(raw=(x.tobytes() + rng.bytes(8))[: max(size, 0)]), bad
    if kind == 3:  # shapes beyond any limit: 2**63 - 1, negative, 100 dimensions, an empty axis
        shape = [[2**63 - 1], [1, 2**63 - 1, 5], [-1, 3, 5], [1] * 100, [1, 0, 5], [2**40, 2**40, 5]][i // 14 % 6]
        return "ModelInfer", ntm(shape=shape), bad
    if kind == 4:  # unknown models and versions
        model, version = [("no_such_model", ""), ("ntm", "9"), ("ntm", "abc"), ("ntm", "-1"), ("", ""),
                          ("x" * 300, "1")][i // 14 % 6]
        return "ModelInfer", ntm(model=model, version=version), missing
    if kind == 5:  # typed contents in the wrong field, or too few of them
        request = pb.ModelInferRequest(model_name="ntm")
        tensor = request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
        if rng.random() < 0.5:
            tensor.contents.int64_contents.extend(range(x.size))
        else:
            tensor.contents.fp32_contents.extend([0.5] * (x.size - 1))
        return "ModelInfer", request.SerializeToString(), bad
    if kind == 6:  # raw contents for some inputs only, and typed contents beside raw ones
        request = pb.ModelInferRequest(model_name="ocr")
        request.inputs.add(name="image", datatype="FP32", shape=[1, 1, 8, 8])
        request.inputs.add(name="width", datatype="INT64", shape=[1]).contents.int64_contents.append(8)
        request.raw_input_contents.append(np.zeros(64, np.float32).tobytes())
        return "ModelInfer", request.SerializeToString(), bad
    if kind == 7:  # BYTES whose length prefixes lie, or are not UTF-8
        request = pb.ModelInferRequest(model_name="bahdanau")
        request.inputs.add(name="text", datatype="BYTES", shape=[1])
        request.raw_input_contents.append([b"\xff\xff\xff\x7fabc", b"\x03\0\0\0\xff\xfe\xfd", b"\x01\0"][i // 14 % 3])
        return "ModelInfer", request.SerializeToString(), bad
    if kind == 8:  # unknown inputs and outputs, an input twice, classification
        extra = {"outputs": [pb.ModelInferRequest.InferRequestedOutputTensor(name="nope")]}
        if i // 14 % 2:
            extra["outputs"][0].name = "logits"
            extra["outputs"][0].parameters["classification"].int64_param = 3
        return "ModelInfer", ntm(**extra), bad
    if kind == 9:  # values the datatype cannot hold: NaN and inf as FP32
        return "ModelInfer", ntm(raw=np.full(x.shape, [np.nan, np.inf][i // 14 % 2], np.float32).tobytes()), bad
    if kind == 10:  # metadata and readiness of what is not served
        request = pb.ModelMetadataRequest(name=["no_such", "ntm", ""][i // 14 % 3], version=["", "7", "z"][i // 14 % 3])
        method = "ModelMetadata" if i // 14 % 2 else "ModelReady"
        return method, request.SerializeToString(), missing
    if kind == 11:  # garbage to the other methods: their requests have few fields, most bytes still fail
        return str(rng.choice(["ServerLive", "ServerReady", "ServerMetadata", "RepositoryIndex"])), \
            rng.bytes(int(rng.integers(1, 50))), bad | {"OK"}
    return "ModelInfer", ntm(id=f"ok-{i}"), {"OK"}  # valid: the server keeps answering between the rest


ALLOWED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED",
           "FAILED_PRECONDITION", "CANCELLED"}


@pytest.mark.integration
def test_hostile_grpc_requests_get_their_status_never_internal_and_the_server_lives(served):
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    rng, count = np.random.default_rng(0), 2100
    requests = [_hostile(rng, pb, i) for i in range(count)]
    with _raw_channel(served) as channel:
        methods = {m: channel.unary_unary(f"/inference.GRPCInferenceService/{m}")
                   for m in {method for method, _, _ in requests}}

        def call(job) -> tuple[str, str, set[str]]:
            method, raw, expected = job
            try:
                methods[method](raw, timeout=30)
                return "OK", "", expected
            except grpc.RpcError as err:
                return err.code().name, err.details() or "", expected

        started = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(call, requests))
        assert time.monotonic() - started < 240
        # messages over --max-body-mb (0.5 MB): grpcio refuses them before any parsing
        big = pb.ModelInferRequest(model_name="ntm")
        big.inputs.add(name="x", datatype="FP32", shape=[1, 40000, 5])
        big.raw_input_contents.append(b"\0" * 800_000)
        for _ in range(5):
            answers.append(call(("ModelInfer", big.SerializeToString(), {"RESOURCE_EXHAUSTED"})))
    wrong = [(code, details[:200], sorted(expected)) for code, details, expected in answers if code not in expected]
    assert not wrong, wrong[:10]
    assert all(len(details) <= 500 for _, details, _ in answers)
    assert {code for code, _, _ in answers} <= ALLOWED
    assert served.proc.poll() is None and served.client.ready()


@pytest.mark.integration
def test_cancelled_and_expired_calls_leave_the_server_answering_and_are_counted(served, cases):
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    inputs, params = cases["bahdanau"]
    request = pb.ModelInferRequest(model_name="bahdanau")
    request.parameters["decode"].string_param = "beam"
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[len(inputs["text"])])
    request.raw_input_contents.append(b"".join(len(t.encode()).to_bytes(4, "little") + t.encode()
                                               for t in inputs["text"]))
    raw = request.SerializeToString()
    with _raw_channel(served) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        calls = [infer.future(raw, timeout=30) for _ in range(10)]
        for call in calls:
            call.cancel()
        for timeout in (0.001,):  # shorter than any answer: the call ends DEADLINE_EXCEEDED
            with pytest.raises(grpc.RpcError) as err:
                infer(raw, timeout=timeout)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert all(c.cancelled() or c.done() for c in calls)
        # and the next call is answered as REST answers it
        response = pb.ModelInferResponse.FromString(infer(raw, timeout=60))
    assert tensor.name == "text" and [o.name for o in response.outputs] == [
        o["name"] for o in served.client.model_metadata("bahdanau")["outputs"]]
    metrics = served.client.send("GET", "/metrics", None, {})[0].decode()
    counted = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
               if line.startswith('attnzoo_requests_total{model="bahdanau",protocol="grpc"')}
    assert counted.get('attnzoo_requests_total{model="bahdanau",protocol="grpc",status="200"}', 0) >= 1, counted
    assert 'attnzoo_request_seconds_count{model="bahdanau",protocol="grpc"}' in metrics


def _series(metrics: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text -> {(name, {(label, value)}): value}, whatever order the labels come in."""
    out = {}
    for line in metrics.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            pairs = [p.split("=", 1) for p in labels.rstrip("}").split(",") if p]
            out[name, frozenset((k, v.strip('"')) for k, v in pairs)] = float(value)
    return out


@pytest.mark.integration
def test_grpc_and_rest_requests_share_batched_calls(published, tmp_path, grpcclient, cases):
    """One scheduler for both protocols: 8 REST and 8 gRPC requests for a batched graph, sent at once
    to a server that waits up to 2 s for companions. A call of more than 8 requests' rows holds both."""
    import threading

    srv = _start(published.repo, tmp_path / "server.log", "--batch-delay-ms", "2000")
    try:
        client = grpcclient.InferenceServerClient(url=srv.grpc)
        name, (inputs, _) = "bahdanau.encoder", cases["bahdanau.encoder"]
        answers, start = {}, threading.Barrier(16)

        def rest(i):
            start.wait(30)
            answers[i] = srv.client.infer(name, inputs)

        def grpc_call(i):
            tensors = _tensors(grpcclient, inputs)
            start.wait(30)
            result = client.infer(name, tensors, client_timeout=60)
            answers[i] = {n: result.as_numpy(n) for n in answers_names}

        answers_names = [o["name"] for o in srv.client.model_metadata(name)["outputs"]]
        threads = [threading.Thread(target=rest if i < 8 else grpc_call, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(answers) == 16
        for i in range(8, 16):
            for output in answers_names:
                _assert_same(answers[i][output], answers[0][output], output)
        value = _series(srv.client.send("GET", "/metrics", None, {})[0].decode())
        model = frozenset({("model", name)})
        rows = len(next(iter(inputs.values())))
        calls = value["attnzoo_batch_rows_count", model]
        assert value["attnzoo_batch_rows_sum", model] == 16 * rows
        assert calls > value["attnzoo_batch_rows_bucket", model | {("le", f"{8.0 * rows}")}], \
            "no call held requests of both protocols"
        for protocol in ("rest", "grpc"):
            assert value["attnzoo_requests_total", model | {("protocol", protocol), ("status", "200")}] == 8
        client.close()
    finally:
        log = _stop(srv)
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.integration
def test_predict_and_translate_answer_over_grpc_as_over_rest(served, tmp_path):
    """``attnzoo predict --grpc`` and ``attnzoo translate --grpc`` (serving/grpc_client.py, raw tensors)
    print what the same commands print over REST: a translation with its attention, an NTM's JSON
    answer, a file's n-best list. Errors are one line naming the protocol's status, never a trace."""
    import json

    from tests.serving_repo import TEXTS

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "pipeline.runner.cli"]

    def both(*args: str) -> tuple[str, str]:
        outs = [subprocess.run(cli + [args[0], *where, *args[1:]], capture_output=True, text=True, env=env, timeout=120)
                for where in (("--grpc", served.grpc), ("--url", served.url))]
        assert all(o.returncode == 0 for o in outs), [o.stderr[-2000:] for o in outs]
        return outs[0].stdout, outs[1].stdout

    grpc_out, rest_out = both("predict", "bahdanau", *TEXTS[:2], "--decode", "greedy", "--attention")
    assert grpc_out == rest_out and grpc_out.count("\t") == 2
    grpc_out, rest_out = both("predict", "ntm", json.dumps({"x": [[[0, 1, 0, 1, 0], [1, 1, 0, 0, 1]]]}))
    assert grpc_out == rest_out and np.array(json.loads(grpc_out)["bits"]).shape == (1, 2, 4)
    source = tmp_path / "de.txt"
    source.write_text(f"{TEXTS[0]}\n\n{TEXTS[1]}\n", encoding="utf-8")
    out = {where: subprocess.run(cli + ["translate", *flag, "-i", str(source), "-o", str(tmp_path / f"{where}.txt"),
                                        "--model", "bahdanau", "--nbest", "2"],
                                 capture_output=True, text=True, env=env, timeout=120)
           for where, flag in (("grpc", ("--grpc", served.grpc)), ("rest", ("--url", served.url)))}
    assert all(o.returncode == 0 for o in out.values()), {k: o.stderr[-2000:] for k, o in out.items()}
    lines = (tmp_path / "grpc.txt").read_text(encoding="utf-8")
    assert lines == (tmp_path / "rest.txt").read_text(encoding="utf-8") and lines.startswith("0 ||| ")
    for args, status, sentence in ((["--grpc", "127.0.0.1:9", "ntm", "{}"], "UNAVAILABLE", "cannot reach"),
                                   (["--grpc", served.grpc, "nope", "{}"], "NOT_FOUND", "unknown model 'nope'"),
                                   (["--grpc", served.grpc, "--local", "ntm", "{}"], None, "give one of them")):
        out = subprocess.run(cli + ["predict", *args], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode != 0 and sentence in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert status is None or f"gRPC {status}" in out.stderr, out.stderr
