"""Hostile requests answered by the protocol layer alone (no server, no model): every field of a
request body tried with every JSON type, and compressed bodies built to cost the server time."""

from __future__ import annotations

import copy
import json
import time
import zlib

import pytest

from serving.protocol import RequestError, TensorSpec, parse_request, read_request

INPUTS = [TensorSpec("x", "FP32", (-1, 3))]
OUTPUTS = [TensorSpec("y", "FP32", (-1,)), TensorSpec("z", "INT64", (-1,))]
JSON_TYPES = {"null": None, "true": True, "int": 3, "float": 1.5, "string": "FP32", "list": ["FP32"],
              "object": {"FP32": 1}, "empty list": [], "empty object": {}}
GOOD = {"id": "req-1", "parameters": {"binary_data_output": False},
        "inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "parameters": {}, "data": [1.0, 2.0, 3.0]}],
        "outputs": [{"name": "y", "parameters": {"binary_data": False}}]}
# Each field of the request schema (REST JSON and the binary extension's JSON header) and the word
# its 400 must name (one of them, split by |: a valid object without binary_data_size is its size's error).
FIELDS = [
    (("id",), "id"), (("parameters",), "parameters"), (("parameters", "binary_data_output"), "binary_data_output"),
    (("inputs",), "input"), (("inputs", 0), "input"), (("inputs", 0, "name"), "input"),
    (("inputs", 0, "shape"), "shape"), (("inputs", 0, "shape", 0), "shape"), (("inputs", 0, "datatype"), "datatype"),
    (("inputs", 0, "parameters"), "parameters|binary_data_size"), (("inputs", 0, "data"), "data"),
    (("inputs", 0, "data", 0), "data"),
    (("inputs", 0, "parameters", "binary_data_size"), "binary_data_size"), (("outputs",), "outputs"),
    (("outputs", 0), "output"), (("outputs", 0, "name"), "output"), (("outputs", 0, "parameters"), "parameters"),
    (("outputs", 0, "parameters", "binary_data"), "binary_data"),
]


def _with(path: tuple, value, binary: bool = False) -> dict:
    body = copy.deepcopy(GOOD)
    if binary:  # the input's data as binary tensor data after the JSON
        body["inputs"][0].pop("data")
        body["inputs"][0]["parameters"] = {"binary_data_size": 12}
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


def _parse(body: dict, binary: bool) -> None:
    """What the server does with a body: split off the binary data, then check it all."""
    head = json.dumps(body).encode()
    raw, header = (head, None) if not binary else (head + b"\x00" * 12, str(len(head)))
    doc, blobs = read_request(raw, header, INPUTS)
    parse_request(doc, INPUTS, OUTPUTS, blobs)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary-header"])
def test_every_field_with_every_json_type_is_accepted_or_a_400_naming_the_field(binary):
    """A field of an unexpected JSON type (e.g. an input whose datatype is a list) must not raise
    TypeError (a 500): every field of the request schema, tried with every JSON type, is either
    valid or a RequestError (4xx) whose one sentence names the field."""
    wrong = []
    for path, word in FIELDS:
        for kind, value in JSON_TYPES.items():
            if binary and path[:3] == ("inputs", 0, "data") and len(path) > 3:
                continue  # no JSON data to change
            body = _with(path, value, binary)
            try:
                _parse(body, binary)
            except RequestError as err:
                if not (400 <= err.status < 500 and any(w in str(err) for w in word.split("|"))):
                    wrong.append(f"{'.'.join(map(str, path))}={kind}: {err.status} {err}")
            except Exception as err:  # noqa: BLE001 (anything else is the server's 500)
                wrong.append(f"{'.'.join(map(str, path))}={kind}: {type(err).__name__}: {err}")
    assert not wrong, "\n".join(wrong)


def _many_members(size: int) -> bytes:
    member = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    empty = member.compress(b"") + member.flush()  # a 20-byte gzip member of nothing
    return empty * (size // len(empty))


@pytest.mark.parametrize("mib", [1, 8])
def test_a_body_of_many_gzip_members_is_refused_or_decoded_in_well_under_a_second(mib):
    """A gzip body of many empty members would decode in quadratic time if each member copied the
    rest of the body (1.17 s at 1 MiB, about 40 s at 8 MiB). It is refused (4xx naming the member
    cap) or decoded in linear time, well under a second."""
    from serving.protocol import decode_body

    body = _many_members(mib * 2**20)
    began = time.perf_counter()
    try:
        decode_body(body, "gzip", 8 * 2**20)
    except RequestError as err:
        assert 400 <= err.status < 500 and "member" in str(err), err
    took = time.perf_counter() - began
    assert took < 0.5, f"{took:.2f} s for {len(body)} bytes of empty gzip members"


def test_a_few_gzip_members_still_decode_and_the_inflated_size_is_capped():
    """Capping gzip members keeps ordinary bodies working: concatenated members within the cap
    decode to their concatenation, in one pass; a member that inflates past the limit is 413 however
    it is split."""
    import gzip

    from serving.protocol import decode_body

    parts = [json.dumps({"part": i}).encode() for i in range(5)]
    assert decode_body(b"".join(gzip.compress(p) for p in parts), "gzip", 1000) == b"".join(parts)
    bomb = gzip.compress(b" " * 3000) * 2
    with pytest.raises(RequestError) as err:
        decode_body(bomb, "gzip", 5000)
    assert err.value.status == 413
    with pytest.raises(RequestError, match="after the end"):
        decode_body(zlib.compress(b"{}") + b"x", "deflate", 1000)


class _Repo:
    """A repository of one model for a Service in process (no graph is ever run here)."""

    models = {"m": {1: "model"}}
    providers: set = set()
    errors: dict = {}

    @staticmethod
    def get(name, version=None):
        return "model"


class _Request:
    headers: dict = {}

    @staticmethod
    async def body() -> bytes:
        return b"{}"


def test_the_codec_queue_is_bounded_and_its_jobs_keep_the_request_deadline():
    """Parsing runs on two codec threads; an unbounded queue in front of them, outside the request's
    deadline, would let slow bodies pile up work without limit. With both threads busy and
    --max-queue jobs waiting, one more request is 503 with Retry-After at once; a job that waited
    past its deadline is 504 and never starts, and a running one is answered 504 at its deadline."""
    import asyncio
    import threading

    from serving.server import ServeConfig, Service

    service = Service(ServeConfig(max_queue=3, timeout_s=0.6, running=2), _Repo())
    release, started = threading.Event(), []

    def parse(*_):
        started.append(1)
        release.wait(10)
        raise RequestError("released")

    service.parse = parse

    async def scenario():
        first = [asyncio.create_task(service.infer("m", None, _Request())) for _ in range(3)]
        await asyncio.sleep(0.1)  # two running, one queued behind them: the queue is full
        began = time.monotonic()
        with pytest.raises(RequestError) as busy:
            await service.infer("m", None, _Request())
        assert busy.value.status == 503 and busy.value.headers.get("Retry-After") == "1"
        assert time.monotonic() - began < 0.1
        results = await asyncio.gather(*first, return_exceptions=True)
        took = time.monotonic() - began
        release.set()
        return results, took

    results, took = asyncio.run(scenario())
    assert [getattr(r, "status", None) for r in results] == [504, 504, 504], results
    assert took < 1.0 and len(started) == 2, (took, started)  # the queued one never ran
    service.codec.shutdown(wait=True)
    assert service.codec_jobs == 0


class _OneModelRepo(_Repo):
    @staticmethod
    def get(name, version=None):
        raise RequestError(f"unknown model '{name}'", status=404)


def _guarded_app(**cfg):
    from serving.server import ServeConfig, create_app

    return create_app(ServeConfig(**{"host": "127.0.0.1", "port": 8000, **cfg}), _OneModelRepo())


def test_a_web_page_cannot_reach_the_server_by_origin_host_or_a_simple_post():
    """A page the developer visits must not be able to POST text/plain to 127.0.0.1:8000/.../infer
    nor, through DNS rebinding (Host: the attacker's name), read the answers. Playing the browser: a
    foreign Origin is 403, a Host not in the allow-list (default: the bound address and localhost)
    is 400, and infer with a form or text Content-Type is 415, all before any work; the server's own
    origin, localhost, tritonclient (no Content-Type, no Origin) and the JSON and binary types pass."""
    from starlette.testclient import TestClient

    client = TestClient(_guarded_app(), base_url="http://127.0.0.1:8000")
    infer, body = "/v2/models/m/infer", b'{"inputs": []}'
    json_type = {"Content-Type": "application/json"}
    refused = [
        ("POST", infer, {**json_type, "Origin": "http://evil.example"}, 403, "Origin"),
        ("POST", infer, {**json_type, "Origin": "null"}, 403, "Origin"),
        ("POST", infer, {**json_type, "Origin": "http://127.0.0.1:9999"}, 403, "Origin"),
        ("GET", "/v2/health/ready", {"Origin": "http://evil.example"}, 403, "Origin"),
        ("POST", infer, {**json_type, "Host": "evil.example:8000", "Origin": "http://evil.example:8000"}, 400,
         "Host"),
        ("GET", "/v2/models/m", {"Host": "rebound.attacker.example"}, 400, "Host"),
        ("POST", infer, {"Content-Type": "text/plain;charset=UTF-8"}, 415, "Content-Type"),
        ("POST", infer, {"Content-Type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
        ("POST", infer, {"Content-Type": "multipart/form-data; boundary=x"}, 415, "Content-Type"),
    ]
    for method, path, headers, status, word in refused:
        got = client.request(method, path, content=body if method == "POST" else None, headers=headers)
        assert got.status_code == status and word in got.json()["error"], (method, path, headers, got.text)
    passed = [
        ("POST", infer, {**json_type, "Origin": "http://127.0.0.1:8000"}),
        ("POST", infer, {**json_type, "Host": "localhost:8000", "Origin": "http://localhost:8000"}),
        ("POST", infer, {}),  # tritonclient's JSON requests carry no Content-Type
        ("POST", infer, {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": "14"}),
        ("POST", infer, {"Content-Type": "Application/JSON; charset=utf-8", "Host": "[::1]:8000"}),
    ]
    for method, path, headers in passed:
        got = client.request(method, path, content=body, headers=headers)
        assert got.status_code == 404 and "unknown model" in got.json()["error"], (headers, got.text)
    assert client.get("/v2/health/live", headers={"Host": "127.0.0.1"}).status_code == 200
    anywhere = TestClient(_guarded_app(host="0.0.0.0"), base_url="http://10.1.2.3:8000")  # a pod: any Host
    assert anywhere.get("/v2/health/live", headers={"Host": "model.ns.svc.cluster.local"}).status_code == 200
    listed = TestClient(_guarded_app(allowed_hosts="api.example.org"), base_url="http://api.example.org")
    assert listed.get("/v2/health/live").status_code == 200


def test_no_page_loads_anything_from_outside_the_server():
    """FastAPI's /docs and /redoc would load Swagger UI and ReDoc from a CDN at a floating version,
    with no integrity hash and no CSP, even in production. They are not served (the schema stays at
    /openapi.json), and every page the server does serve carries the CSP and names no other host."""
    import re

    from starlette.testclient import TestClient

    for playground in (True, False):
        client = TestClient(_guarded_app(playground=playground), base_url="http://127.0.0.1:8000")
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert client.get(path).status_code == 404, path
        assert client.get("/openapi.json").json()["paths"]
    client = TestClient(_guarded_app(playground=True), base_url="http://127.0.0.1:8000")
    page = client.get("/")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    for asset in assets:
        assert not re.match(r"(?i)^(https?:)?//", asset), asset
        if asset.startswith("/"):
            got = client.get(asset)
            assert got.status_code == 200 and "default-src 'self'" in got.headers["content-security-policy"], asset


def _version(root, files_sha256: bool, tamper: bool = False):
    """A published-looking version folder ``root/m/1`` (a graph that is never reached: the check
    comes first)."""
    import hashlib

    folder = root / "m" / "1"
    folder.mkdir(parents=True)
    (folder / "g.onnx").write_bytes(b"graph")
    meta = {"graphs": ["g"], "production": True, "serving": {"kind": "graph"}}
    if files_sha256:
        meta["files_sha256"] = {"g.onnx": hashlib.sha256(b"graph").hexdigest()}
    (folder / "metadata.json").write_text(json.dumps(meta))
    if tamper:
        (folder / "g.onnx").write_bytes(b"graph, changed")
    return folder


def _loaders(root):
    """Each way a version gets loaded: the server's repository, LocalClient (attnzoo predict
    --local), the MLflow pyfunc and the Triton python backend; each returns the error it met."""
    import sys
    import types

    from serving.client import LocalClient
    from serving.repository import Repository

    def server():
        return " ".join(Repository(root, "cpu").errors.values())

    def local():
        LocalClient(root).model_metadata("m", 1)

    def pyfunc():
        from serving.pyfunc import PublishedModel

        context = types.SimpleNamespace(model_config={"name": "m", "version": "1"}, artifacts={"repository": str(root)})
        PublishedModel().load_context(context)

    def triton():
        stub = types.ModuleType("triton_python_backend_utils")
        stub.TritonModelException = RuntimeError
        sys.modules.setdefault("triton_python_backend_utils", stub)
        from serving.triton_model import TritonPythonModel

        TritonPythonModel().initialize({"model_repository": str(root / "m"), "model_version": "1", "model_name": "m"})

    return {"server": server, "LocalClient": local, "pyfunc": pyfunc, "triton": triton}


@pytest.mark.parametrize("case", ["no files_sha256", "a file changed"])
def test_no_loader_serves_an_unverified_version(tmp_path, case):
    """No loader serves a version it cannot verify: one without files_sha256 is not served, not even
    with a warning or as the default, and the server, LocalClient, the MLflow pyfunc and the Triton
    backend all check. Every loader refuses such a version, and one whose file differs, with one
    sentence naming the version and what to do (republish)."""
    _version(tmp_path, files_sha256=case != "no files_sha256", tamper=case == "a file changed")
    for loader, load in _loaders(tmp_path).items():
        try:
            message = load() or ""
        except Exception as err:  # noqa: BLE001 (each loader has its own error type)
            message = str(err)
        assert "m version 1" in message and "republish" in message, (loader, message)


# ---- memory that grows with the square of a length, admitted against a budget --------------------
def test_the_memory_estimate_grows_with_rows_length_and_length_squared():
    """64 rows of 2,000 steps to the Transformer's encoder need, for the attention scores alone,
    [64, 4, 2000, 2000] fp32 (4.1 GB) against a 4 GiB pod. So each version declares its peak
    memory as rows x (per_row + per_step x length + per_step2 x length²): the Transformer's from
    its config (six [heads, L, L] fp32 tensors a row, measured at most 5.7), and versions published
    before memory was recorded carry none and get a default at least as large."""
    from serving.admission import Memory

    m = Memory.transformer(dim=256, heads=4, ff_dim=1024, enc_layers=3, dec_layers=3)
    assert m.per_step2 == 4 * 4 * 6
    assert m.per_step == 4 * (1024 + 256 * (8 + 2 * 3))
    assert m.per_hypothesis_step == 4 * 2 * 3 * 256
    assert m.bytes(1, 10) == m.per_row + 10 * m.per_step + 100 * m.per_step2
    assert m.bytes(2, 10, hypotheses=5) == 2 * m.bytes(1, 10) + 5 * 10 * m.per_hypothesis_step
    assert m.bytes(64, 2000) > 4 * 2**30  # 64 rows of 2,000 steps: over a 4 GiB pod
    steps = m.largest_steps(64, 3 * 2**30)
    assert m.bytes(64, steps) <= 3 * 2**30 < m.bytes(64, steps + 1)
    assert Memory.of(m.as_json()) == m
    old = Memory.of(None)  # a version published before memory was recorded
    assert old.per_step2 >= m.per_step2 and old.per_step >= m.per_step
    assert Memory.of(None, "transformer") == old
    # ... of an architecture without self-attention (its metadata's arch): linear in the length
    assert Memory.of(None, "ntm").per_step2 == 0 and Memory.of(None, "ntm").per_step >= Memory.linear(512).per_step


def test_publish_records_each_models_memory_from_its_config():
    """The serving block a version is published with carries its memory estimate, which requests are
    admitted against: the Transformer's from its width, heads and layers; a model without
    self-attention has no length² term."""
    from types import SimpleNamespace

    import models
    from pipeline.serving_meta import serving_block
    from serving.admission import Memory
    from tests.conftest import TINY

    run = SimpleNamespace(task="translation_de_en", evaluate={"beam": 3}, limits={}, name="t")
    cfg = models.make_config("transformer", TINY["transformer"])
    block = serving_block(cfg, ["decoder_step", "encoder"], run)
    assert Memory.of(block["memory"]) == Memory.transformer(cfg.dim, cfg.heads, cfg.ff_dim, cfg.enc_layers,
                                                            cfg.dec_layers)
    ntm = serving_block(models.make_config("ntm", TINY["ntm"]), ["step"], SimpleNamespace(
        task="copy", evaluate={}, limits={}, name="n"))
    assert Memory.of(ntm["memory"]).per_step2 == 0


@pytest.mark.parametrize("content, mib", [("max\n", 4096), ("2147483648\n", 2048), ("9223372036854771712\n", 4096)])
def test_the_memory_budget_defaults_to_the_cgroup_limit_else_the_pod_limit(tmp_path, content, mib):
    """--memory-budget-mb 0 (the default) takes the container's memory limit (cgroup v2 memory.max
    or v1 memory.limit_in_bytes), or the KServe pod's 4 GiB where none is set, so requests are
    admitted against the memory the server may use."""
    from serving.admission import memory_limit

    (tmp_path / "memory.max").write_text(content)
    assert memory_limit([tmp_path / "memory.max"]) == mib * 2**20
    assert memory_limit([tmp_path / "absent"]) == 4096 * 2**20


def test_a_request_over_the_memory_budget_is_413_naming_the_estimate_and_the_fix():
    """A request whose memory estimate exceeds the budget is refused with 413 from its shapes alone,
    before the model runs, in one sentence naming the estimate, the budget and what to send instead."""
    from serving.admission import Memory
    from serving.base import ServedModel
    from serving.protocol import TensorSpec

    class Model(ServedModel):
        limit_axes = {"x": {0: ("rows", "rows"), 1: ("steps", "steps")}}

        def infer(self, feeds, params):
            raise AssertionError("never run")

    model = Model("m", 1, [TensorSpec("x", "INT64", (-1, -1))], [TensorSpec("y", "FP32", (-1,))])
    model.memory = Memory(per_row=0, per_step=0, per_step2=100)
    assert model.check_memory({"x": (64, 100)}, None, {}, 2**30) == 64 * 100 * 100 * 100
    with pytest.raises(RequestError) as over:
        model.check_memory({"x": (64, 2000)}, None, {}, 2**30)
    message = str(over.value)
    assert over.value.status == 413
    assert "24,414 MiB" in message and "1,024 MiB" in message and "--memory-budget-mb" in message
    assert "fewer rows or shorter inputs" in message and message.count(". ") == 0
