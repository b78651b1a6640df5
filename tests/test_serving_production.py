"""Serving in production: step batching across requests, the version policy, limits, deadlines
and admission — each against a real server process on loopback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import models
from serving.client import Client
from tests.conftest import ROOT, TINY, tiny_batch
from tests.ports import free_port, listens, wait_serving
from tests.test_serving import TEXTS, _metric, raw, server  # noqa: F401

pytestmark = pytest.mark.integration  # starts servers or processes


def start_server(repo: Path, *flags: str) -> SimpleNamespace:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "serving.server", "--repository", str(repo), "--port", str(port),
                             *flags], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = Client(f"http://127.0.0.1:{port}", timeout=60)
    # A server that is never ready (a repository with errors) may still serve: live, and on its own port,
    # not a server of another worker's that was handed the same port first.
    if not wait_serving(proc, port, client.ready, 60) and not (
            proc.poll() is None and listens(proc.pid, port) and client.call("GET", "/v2/health/live")):
        proc.kill()
        raise RuntimeError(f"server did not start:\n{proc.communicate()[0]}")
    return SimpleNamespace(url=client.url, client=client, proc=proc)


def stop(srv: SimpleNamespace) -> str:
    srv.proc.terminate()
    log = srv.proc.communicate(timeout=30)[0]
    assert "Traceback" not in log, log[-3000:]
    return log


# ---- step batching: concurrent decode loops share their graph calls --------------------------------
def _requests() -> list[tuple[str, dict, dict]]:
    """Requests to every looping kind, greedy and beam, of different lengths (the step batcher
    pads the source axis where the graphs declare one and groups equal shapes elsewhere)."""
    rng = np.random.default_rng(0)
    reqs = []
    for name in ("bahdanau", "luong", "transformer"):
        for mode in ("greedy", "beam"):
            for text in TEXTS:
                reqs.append((name, {"text": [text]}, {"decode": mode}))
    for t in (3, 5, 8):
        reqs.append(("ntm", {"x": rng.integers(0, 2, (1, t, 5)).astype(np.float32)}, {}))
    ram = tiny_batch("ram", seed=4, batch=2)["image"].numpy()
    ocr = tiny_batch("attention_ocr", seed=3)
    images = tiny_batch("show_attend_tell", seed=7, batch=2)["image"].numpy()
    for i in range(2):
        reqs.append(("ram", {"image": ram[i : i + 1]}, {}))
        reqs.append(("draw", {"x": tiny_batch("draw", seed=5 + i, batch=1)["x"].numpy()}, {}))
    for mode in ("greedy", "beam"):
        for n in (4, 6):
            reqs.append(("pointer", {"points": rng.random((1, n, 2), dtype=np.float32)}, {"decode": mode}))
        for i in range(2):
            reqs.append(("captioner", {"image": images[i : i + 1]}, {"decode": mode}))
            w = int(ocr["width"][i])
            reqs.append(("ocr", {"image": ocr["image"][i : i + 1, :, :w].numpy()}, {"decode": mode}))
        for k in (3200, 2000):
            reqs.append(("speech", {"audio": rng.uniform(-0.5, 0.5, (1, k)).astype(np.float32)}, {"decode": mode}))
    return reqs


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.shape == y.shape, k
        if x.dtype.kind in "fc":
            np.testing.assert_allclose(x, y, atol=1e-5, err_msg=k)
        else:
            assert np.array_equal(x, y), k


def test_concurrent_decode_loops_share_steps_and_answer_as_alone(server):  # noqa: F811
    """Over HTTP: every looping kind answers the same whether its requests come alone or all at
    once (which calls end up shared depends on timing; the test below forces sharing)."""
    reqs = _requests()
    alone = [server.client.infer(n, f, parameters=p) for n, f, p in reqs]
    with ThreadPoolExecutor(len(reqs)) as pool:
        together = list(pool.map(lambda r: server.client.infer(r[0], r[1], parameters=r[2]), reqs))
    for a, b in zip(alone, together):
        _same(a, b)


class Slow:
    """A graph that takes ``seconds`` longer per call, and whose calls wait (10 s at most) until
    ``ready()``: so concurrent decode loops surely overlap, however the threads are scheduled."""

    def __init__(self, graph, seconds: float, ready=lambda: True):
        self.graph, self.seconds, self.ready = graph, seconds, ready
        self.session, self.provider, self.path = graph.session, graph.provider, graph.path
        self.input_names, self.output_names = graph.input_names, graph.output_names

    def __call__(self, feeds):
        deadline = time.monotonic() + 10
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(self.seconds)
        return self.graph(feeds)


class Arrivals:
    """Wraps a batcher or scheduler and records in ``threads`` which threads (requests) called it."""

    def __init__(self, inner, threads: set[int]):
        self.inner, self.threads = inner, threads

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args):
        self.threads.add(threading.get_ident())
        return self.inner(*args)


@pytest.mark.parametrize("name", ["bahdanau", "luong", "pointer", "transformer", "captioner"])
def test_shared_steps_give_each_request_what_it_gets_alone(published, name):
    """In process, with each graph call slowed down so that 6 concurrent requests overlap: greedy
    decoding through the continuous batch (GreedyScheduler, where the step graph allows it) and
    beam search through the step batcher return exactly what decoding each request alone returns
    (tokens equal, attention to 1e-5), and the graph calls really were shared (rows per call > 1)."""
    from serving.batching import GreedyScheduler, StepBatcher
    from serving.decode import beam_search, greedy
    from serving.runtime import OrtGraph

    folder = published.repo / name / "1"
    enc, step = (OrtGraph(folder / f"{g}.onnx", "cpu") for g in ("encoder", "decoder_step"))
    meta = json.loads((folder / "metadata.json").read_text())["serving"]
    rng = np.random.default_rng(1)
    if name == "captioner":  # fixed-size images: nothing to pad
        images = tiny_batch("show_attend_tell", seed=7, batch=6)["image"].numpy()
        srcs = [{"image": images[i : i + 1]} for i in range(6)]
        lens = [None] * 6
        max_lens = [meta["max_len"]] * 6
    elif name == "pointer":
        srcs = [rng.random((1, n, 2), dtype=np.float32) for n in (3, 5, 4, 6, 5, 3)]
        lens = [np.array([s.shape[1]]) for s in srcs]
        max_lens = [s.shape[1] + 1 for s in srcs]
    else:
        srcs = [rng.integers(4, 40, (1, n)).astype(np.int64) for n in (3, 7, 5, 9, 4, 6)]
        lens = [np.array([s.shape[1]]) for s in srcs]
        max_lens = [meta["max_len"]] * len(srcs)
    rows: list[int] = []
    # Step calls wait until all 6 requests have reached the step batcher (or the scheduler): the
    # first one decodes alone, in its own thread, and tiny models' loops end in 2 or 3 steps, so
    # without the hold a loaded machine can finish it before the others arrive.
    arrived: set[int] = set()
    ready = lambda: len(arrived) >= len(srcs)  # noqa: E731
    batched_enc = StepBatcher(Slow(enc, 0.01), on_batch=rows.append)
    batched_step = Arrivals(StepBatcher(Slow(step, 0.01, ready), on_batch=rows.append), arrived)
    scheduled = GreedyScheduler.eligible(step)
    assert scheduled == (name != "transformer")  # its key/value cache grows with each step
    if scheduled:
        batched_step.inner.greedy = Arrivals(GreedyScheduler(enc, Slow(step, 0.01, ready), on_batch=rows.append),
                                             arrived)
    bos, eos, pad = meta["bos_id"], meta["eos_id"], meta["pad_id"]

    def alone(i, mode):
        if mode == "greedy":
            return greedy(enc, step, srcs[i], lens[i], bos, eos, max_lens[i], pad)
        return beam_search(enc, step, srcs[i], lens[i], bos, eos, max_lens[i], beam=3)

    start = threading.Barrier(len(srcs))

    def shared(i, mode):
        start.wait()  # every request submits at once: the overlap does not hang on thread start-up
        if mode == "greedy":
            return greedy(batched_enc, batched_step, srcs[i], lens[i], bos, eos, max_lens[i], pad)
        return beam_search(batched_enc, batched_step, srcs[i], lens[i], bos, eos, max_lens[i], beam=3)

    for mode in ("greedy", "beam"):
        rows.clear()
        arrived.clear()
        with ThreadPoolExecutor(len(srcs)) as pool:
            together = list(pool.map(shared, range(len(srcs)), [mode] * len(srcs)))
        for i, got in enumerate(together):
            want = alone(i, mode)
            assert np.array_equal(got["tokens"], want["tokens"]), (mode, i)
            if mode == "greedy":
                assert np.array_equal(got["lengths"], want["lengths"]), (mode, i)
                n = int(want["lengths"][0]) + 1  # the emitted tokens and the EOS step
                np.testing.assert_allclose(got["attention"][:, :n], want["attention"][:, :n], atol=1e-5)
            else:
                np.testing.assert_allclose(got["attention"], want["attention"], atol=1e-5)
        per_request = 1 if mode == "greedy" else 3  # rows a request brings: 1 sequence, or its beam
        assert rows and max(rows) > per_request, (mode, rows)  # calls carried several requests' rows


# ---- a small repository with limits, promoted and unpromoted versions ---------------------------------
@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """ntm v1 (promoted), v2 (not promoted), v3 (an older publish: parity and bar recorded, no
    production flag); `unpromoted` with one version that failed its bar; `capped`, whose answers may
    have 2,000 values; a stray '²' folder; `ntm-int8` with no version (publish leaves the folder of an
    int8 variant whose gate failed)."""
    from pipeline.serving_meta import serving_meta
    from pipeline.stages.export import export_onnx
    from pipeline.stages.publish import write_version

    tmp = tmp_path_factory.mktemp("production")
    root = tmp / "model_repository"
    limits = {"rows": 4, "steps": 4000, "beam": 4}

    def put(name: str, seed: int, meta: dict, caps: dict | None = None) -> None:
        torch.manual_seed(seed)
        model = models.build("ntm", TINY["ntm"]).eval()
        onnx_dir = tmp / f"onnx-{name}-{seed}"
        export_onnx(model, onnx_dir)
        graphs = sorted(p.stem for p in onnx_dir.glob("*.onnx"))
        run = SimpleNamespace(task="copy", evaluate={})
        write_version(root / name, name, onnx_dir, {**serving_meta(model.cfg, graphs, run),
                                                    "limits": {**limits, **(caps or {})}},
                      {"arch": "ntm", "task": "copy", **meta}, [])

    put("ntm", 1, {"parity_passed": True, "bar": {"passed": True}, "production": True})
    put("ntm", 2, {"parity_passed": True, "bar": {"passed": False}, "production": False})
    put("unpromoted", 3, {"parity_passed": True, "bar": {"passed": False}, "production": False})
    put("capped", 4, {"parity_passed": True, "bar": {"passed": True}, "production": True},
        {"output_elements": 2000})
    (root / "ntm-int8").mkdir()
    (root / "ntm" / "²").mkdir()  # not a version: must be ignored, not crash start-up
    shutil.copy2(root / "ntm" / "1" / "metadata.json", root / "ntm" / "²" / "metadata.json")
    return root


def test_default_version_is_the_promoted_one_and_explicit_versions_stay_reachable(repo):
    srv = start_server(repo)
    try:
        status, meta = raw(srv.url, "GET", "/v2/models/ntm")
        assert status == 200 and meta["versions"] == ["1", "2"]
        p = meta["parameters"]
        assert p["default_version"] == "1" and p["version"] == "1"
        assert "promoted to production" in p["default_version_reason"]
        assert p["kind"] == "recurrent" and p["limits"]["steps"] == 4000 and p["limits"]["rows"] == 4
        x = np.zeros((1, 3, 5), np.float32)
        v1 = srv.client.infer("ntm", {"x": x}, version=1)
        assert np.array_equal(srv.client.infer("ntm", {"x": x})["logits"], v1["logits"])
        v2 = srv.client.infer("ntm", {"x": x}, version=2)  # not promoted, still reachable by number
        assert not np.allclose(v2["logits"], v1["logits"])
        status, body = raw(srv.url, "POST", "/v2/models/unpromoted/infer",
                           json.dumps({"inputs": [{"name": "x", "shape": [1, 3, 5], "datatype": "FP32",
                                                   "data": [0.0] * 15}]}).encode())
        assert status == 409 and "no version was promoted to production" in body["error"], body
        assert "/v2/models/unpromoted/versions/" in body["error"]
        status, meta = raw(srv.url, "GET", "/v2/models/unpromoted")
        assert status == 200 and meta["parameters"]["default_version"] is None
        for path in ("/v2/models/ntm/versions/%C2%B2", "/v2/models/ntm/versions/%C2%B2/infer",
                     "/v2/models/ntm/versions/01x"):
            post = path.endswith("infer")
            status, body = raw(srv.url, "POST" if post else "GET", path, b"{}" if post else None)
            assert status == 404 and "has no version" in body["error"], (path, status, body)
    finally:
        stop(srv)


def _x(t: int, n: int = 1) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "shape": [n, t, 5], "datatype": "FP32",
                                   "data": [0.5] * (n * t * 5)}]}).encode()


def test_requests_over_a_limit_get_413_naming_it(repo):
    srv = start_server(repo)
    try:
        status, body = raw(srv.url, "POST", "/v2/models/ntm/infer", _x(4001))
        assert status == 413 and "limits.steps = 4000" in body["error"] and "time steps" in body["error"], body
        status, body = raw(srv.url, "POST", "/v2/models/ntm/infer", _x(2, n=5))
        assert status == 413 and "limits.rows = 4" in body["error"], body
        # the declared shape is checked before the data is read: 20,000 rows of no data is a 413
        status, body = raw(srv.url, "POST", "/v2/models/ntm/infer", json.dumps({"inputs": [
            {"name": "x", "shape": [20000, 2, 5], "datatype": "FP32", "data": [0.0]}]}).encode())
        assert status == 413 and "limits.rows = 4" in body["error"], body
        status, body = raw(srv.url, "POST", "/v2/models/ntm.step/infer", json.dumps({"inputs": []}).encode())
        assert status == 400
        assert raw(srv.url, "POST", "/v2/models/ntm/infer", _x(4000))[0] == 200  # at the limit: served
    finally:
        stop(srv)


@pytest.mark.timing
def test_an_answer_over_the_output_limit_is_413_before_any_work(repo):
    """The NTM's outputs have the input's rows and time steps: 2 x 100 steps of it are more values
    than `capped` may answer, known before a step runs."""
    srv = start_server(repo)
    try:
        status, meta = raw(srv.url, "GET", "/v2/models/capped")
        assert status == 200 and meta["parameters"]["limits"]["output_elements"] == 2000
        assert raw(srv.url, "GET", "/v2/models/ntm")[1]["parameters"]["limits"]["output_elements"] == 1 << 21
        started = time.monotonic()
        status, body = raw(srv.url, "POST", "/v2/models/capped/infer", _x(100, n=2))
        assert status == 413 and "limits.output_elements = 2000" in body["error"], body
        assert time.monotonic() - started < 1.0
        assert raw(srv.url, "POST", "/v2/models/capped/infer", _x(3))[0] == 200
    finally:
        stop(srv)


def test_unknown_and_empty_models_are_404_and_metrics_keep_to_served_names(repo):
    srv = start_server(repo)
    try:
        for name in ("no_such_model", "ntm-int8", "x" * 300):
            for method, path in (("GET", ""), ("GET", "/ready"), ("GET", "/versions/1"), ("POST", "/infer")):
                status, body = raw(srv.url, method, f"/v2/models/{name}{path}", _x(1) if method == "POST" else None)
                assert status == 404 and "unknown model" in body["error"], (name, path, status, body)
                assert len(body["error"]) <= 500
        text = urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode()
        labels = {line.split('model="')[1].split('"')[0] for line in text.splitlines()
                  if line.startswith("attnzoo_requests_total{")}
        assert labels == {"_unknown"}, labels
    finally:
        stop(srv)


@pytest.mark.timing
def test_a_deadline_stops_the_decode_loop_and_frees_the_worker(repo):
    # One ONNX Runtime call at a time: were the timed-out loop still running, the next request
    # would wait for it.
    srv = start_server(repo, "--timeout-s", "0.3", "--infer-threads", "1")
    try:
        started = time.monotonic()
        status, body = raw(srv.url, "POST", "/v2/models/ntm/infer", _x(4000, n=4))  # several seconds of steps
        took = time.monotonic() - started
        assert status == 504 and "deadline of 0.3 s" in body["error"], body
        assert took < 2.0, took
        started = time.monotonic()
        assert raw(srv.url, "POST", "/v2/models/ntm/infer", _x(3))[0] == 200
        assert time.monotonic() - started < 1.0
    finally:
        stop(srv)


def test_a_full_admission_queue_answers_503_with_retry_after(repo):
    srv = start_server(repo, "--running", "1", "--max-queue", "1")
    try:
        def call(_):
            req = urllib.request.Request(srv.url + "/v2/models/ntm/infer", data=_x(1500, n=2), method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    return resp.status, None
            except urllib.error.HTTPError as err:
                return err.code, err.headers.get("Retry-After")

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(call, range(8)))
        statuses = [s for s, _ in answers]
        assert set(statuses) <= {200, 503} and statuses.count(200) >= 2 and 503 in statuses, answers
        assert all(retry == "1" for s, retry in answers if s == 503)
        assert raw(srv.url, "GET", "/v2/health/ready")[0] == 200
    finally:
        stop(srv)


POD_MEMORY = 4 * 2**30  # deploy/kserve/serving-runtime.yaml: the runtime pod's memory limit


def _vm(pid: int, key: str) -> int:
    """A /proc/<pid>/status size (VmRSS, VmHWM) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_64_of_the_largest_allowed_answers_at_once_fit_the_pod(published):
    """64 concurrent NTM requests whose answers are each just under limits.output_elements (64 rows
    of as many time steps as fit): every one answered, and the server's peak RSS stays under the
    deploy/kserve/ pod's memory limit. One step more per row is refused with 413 before any work."""
    srv = start_server(published.repo, "--timeout-s", "600")
    try:
        meta = raw(srv.url, "GET", "/v2/models/ntm")[1]
        cap, rows = meta["parameters"]["limits"]["output_elements"], 64
        per_step = sum(int(np.prod(o["shape"][2:])) for o in meta["outputs"])  # values per row and time step
        steps = cap // (rows * per_step)
        features = meta["inputs"][0]["shape"][2]
        body = json.dumps({"inputs": [{"name": "x", "shape": [rows, steps, features], "datatype": "FP32",
                                       "data": [0.5] * (rows * steps * features)}]}).encode()
        over = json.dumps({"inputs": [{"name": "x", "shape": [rows, steps + 1, features], "datatype": "FP32",
                                       "data": [0.5] * (rows * (steps + 1) * features)}]}).encode()
        status, answer = raw(srv.url, "POST", "/v2/models/ntm/infer", over)
        assert status == 413 and "limits.output_elements" in answer["error"], answer
        before = _vm(srv.proc.pid, "VmRSS")

        def call(_):
            req = urllib.request.Request(srv.url + "/v2/models/ntm/infer", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as resp:
                return resp.status, len(resp.read())

        started = time.monotonic()
        with ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(call, range(64)))
        took = time.monotonic() - started
        peak = _vm(srv.proc.pid, "VmHWM")
        print(f"64 answers of {rows * steps * per_step:,} values ({answers[0][1] / 2**20:.1f} MiB of JSON each) "
              f"in {took:.1f} s; server RSS {before / 2**20:.0f} MiB before, peak {peak / 2**20:.0f} MiB "
              f"(pod limit {POD_MEMORY / 2**20:.0f} MiB)")
        assert all(status == 200 for status, _ in answers), answers
        assert rows * steps * per_step <= cap < rows * (steps + 1) * per_step
        assert peak < POD_MEMORY
    finally:
        stop(srv)


def test_a_long_source_leaves_no_memory_behind(published):
    """One Transformer request with a 1,000-word source (within the limits): answered, and the server's
    memory returns to about where it was; ONNX Runtime's CPU arena kept the request's peak (+440 MB)."""
    srv = start_server(published.repo)
    try:
        short = json.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                        "data": ["Wo ist der Hund?"]}]}).encode()
        assert raw(srv.url, "POST", "/v2/models/transformer/infer", short)[0] == 200  # the graphs are loaded
        before = _vm(srv.proc.pid, "VmRSS")
        long = json.dumps({"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES",
                                       "data": ["<unk>", " ".join(["x"] * 1000), "x"]}]}).encode()
        status, answer = raw(srv.url, "POST", "/v2/models/transformer/infer", long)
        after, peak = _vm(srv.proc.pid, "VmRSS"), _vm(srv.proc.pid, "VmHWM")
        print(f"server RSS {before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after, peak {peak / 2**20:.0f} MiB")
        assert status == 200, answer
        assert after - before < 100 * 2**20 < peak - before  # the request did take memory, and gave it back
    finally:
        stop(srv)


def test_a_version_changed_after_publishing_is_not_served(published, tmp_path):
    """publish records every file's SHA-256 (files_sha256); a version whose graph was replaced, or
    whose metadata names a file outside its folder, is refused at load (logged, listed in
    Repository.errors), and the others are served."""
    from serving.repository import Repository

    root = tmp_path / "model_repository"
    shutil.copytree(published.repo / "ntm", root / "ntm")
    shutil.copytree(published.repo / "bahdanau", root / "bahdanau")
    meta = json.loads((root / "ntm" / "1" / "metadata.json").read_text())
    assert set(meta["files_sha256"]) >= {f"{g}.onnx" for g in meta["graphs"]}
    graph = root / "ntm" / "1" / f"{meta['graphs'][0]}.onnx"
    graph.write_bytes(graph.read_bytes()[:-1] + b"\0")  # one byte changed
    meta2 = json.loads((root / "ntm" / "2" / "metadata.json").read_text())
    meta2["graphs"] = ["../../bahdanau/1/encoder"]
    (root / "ntm" / "2" / "metadata.json").write_text(json.dumps(meta2))
    repo = Repository(root)
    assert "differs from what publish recorded" in repo.errors["ntm/1"], repo.errors
    assert "not a file name in the version" in repo.errors["ntm/2"], repo.errors
    assert "ntm" not in repo.models and repo.versions("bahdanau") == [1]


def test_an_input_with_an_empty_axis_is_400_and_the_server_lives_on(published):
    """ONNX Runtime aborts the whole process on some encoders given an axis of size 0 (found by
    tests/test_server_fuzz.py): such inputs are refused before they reach it."""
    srv = start_server(published.repo)
    try:
        for shape, lengths in (([0, 4], [0]), ([2, 0], [4, 4])):
            body = json.dumps({"inputs": [
                {"name": "src", "shape": shape, "datatype": "INT64", "data": [0] * int(np.prod(shape))},
                {"name": "src_len", "shape": [len(lengths)], "datatype": "INT64", "data": lengths}]}).encode()
            status, answer = raw(srv.url, "POST", "/v2/models/bahdanau.encoder/infer", body)
            assert status == 400 and "has an empty axis" in answer["error"], answer
        assert raw(srv.url, "GET", "/v2/health/live")[0] == 200 and srv.proc.poll() is None
    finally:
        stop(srv)


@pytest.mark.timing
def test_a_body_that_does_not_arrive_in_time_is_408(repo):
    """A client that declares 100 bytes and sends 10 holds its buffer only until --body-timeout-s,
    not for as long as it likes, then gets 408. Same server: --max-connections sockets held open,
    half silent and half in the middle of their headers, must not lock every client out (503,
    /v2/health/live too): live answers 200 at once, inference too, and the server closes each of
    those sockets once --header-timeout-s has passed without complete headers."""
    import socket

    srv = start_server(repo, "--body-timeout-s", "0.5", "--max-connections", "16", "--header-timeout-s", "2")
    try:
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v2/models/ntm/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n" + b'{"inputs":')
            started = time.monotonic()
            answer = b""
            while b"}" not in answer and time.monotonic() - started < 10:  # headers and body may come apart
                chunk = sock.recv(4096)
                if not chunk:
                    break
                answer += chunk
            answer = answer.decode()
        assert answer.startswith("HTTP/1.1 408") and "did not arrive within 0.5 s" in answer, answer
        assert time.monotonic() - started < 5
        assert raw(srv.url, "GET", "/v2/health/live")[0] == 200
        _held_sockets_lock_no_one_out(srv, host, int(port), 16)
    finally:
        stop(srv)


def _held_sockets_lock_no_one_out(srv, host: str, port: int, count: int) -> None:
    import socket

    held = [socket.create_connection((host, port), timeout=10) for _ in range(count)]
    try:
        for sock in held[count // 2 :]:  # half of them: a request line and part of the headers, never finished
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        time.sleep(0.3)
        began = time.monotonic()
        assert raw(srv.url, "GET", "/v2/health/live")[0] == 200
        assert time.monotonic() - began < 10
        body = {"inputs": [{"name": "x", "shape": [1, 2, 5], "datatype": "FP32", "data": [0.5] * 10}]}
        assert srv.client.call("POST", "/v2/models/ntm/infer", body)["outputs"]
        for sock in held:  # the server closes each once --header-timeout-s (2 s) has passed
            sock.settimeout(10)
            answer = sock.recv(4096)  # closed (b""), perhaps after a 408; a timeout here fails the test
            assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer
        closed_by = time.monotonic() - began
        assert closed_by < 6, closed_by
    finally:
        for sock in held:
            sock.close()


def _infer(url: str, name: str, body: dict, timeout: float = 600) -> tuple[int, dict, float]:
    """(status, answer, seconds) of one inference request."""
    req = urllib.request.Request(f"{url}/v2/models/{name}/infer", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), time.monotonic() - started
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), time.monotonic() - started


def _source(rows: int, steps: int, vocab: int) -> dict:
    """An encoder request: ``rows`` sources of ``steps`` piece ids each, answered with the source
    mask alone (all its outputs would be over limits.output_elements, which counts only what is asked for)."""
    ids = np.random.default_rng(0).integers(3, vocab, rows * steps).tolist()
    return {"inputs": [{"name": "src", "shape": [rows, steps], "datatype": "INT64", "data": ids},
                       {"name": "src_len", "shape": [rows], "datatype": "INT64", "data": [steps] * rows}],
            "outputs": [{"name": "mask"}]}


def _largest_and_one_beyond(srv, name: str, rows: int) -> tuple[int, int]:
    """The longest source the server admits at ``rows`` rows, and the memory budget, from the model's metadata."""
    from serving.admission import Memory

    params = raw(srv.url, "GET", f"/v2/models/{name}")[1]["parameters"]
    budget = params["memory_budget_bytes"]
    return Memory.of(params["memory"]).largest_steps(rows, budget), budget


@pytest.mark.timing
def test_a_request_over_the_memory_budget_is_413_before_it_runs(published):
    """The Transformer's encoder must not run whatever rows x steps the limits allow, however much
    memory its length² attention takes. The longest source the budget admits at 64 rows
    is answered, one step longer is 413 at once (no graph run: the server's peak RSS is unchanged),
    and so are 64 texts of 2,000 characters to the whole model (their pieces are bounded by their
    characters), while a short text is answered."""
    srv = start_server(published.repo, "--memory-budget-mb", "1024")
    try:
        steps, budget = _largest_and_one_beyond(srv, "transformer.encoder", 64)
        assert 1 < steps < 2000 and budget < 1024 * 2**20  # the server's own memory is taken off the limit
        vocab = raw(srv.url, "GET", "/v2/models/transformer.decoder_step")[1]["outputs"][0]["shape"][-1]
        peak = _vm(srv.proc.pid, "VmHWM")
        status, answer, took = _infer(srv.url, "transformer.encoder", _source(64, steps + 1, vocab))
        assert status == 413 and "memory budget" in answer["error"] and "fewer rows" in answer["error"], answer
        assert took < 5 and _vm(srv.proc.pid, "VmHWM") - peak < 32 * 2**20
        status, answer, _ = _infer(srv.url, "transformer.encoder", _source(64, steps, vocab))
        assert status == 200, answer
        texts = {"inputs": [{"name": "text", "shape": [64], "datatype": "BYTES", "data": ["Hund " * 400] * 64}]}
        status, answer, _ = _infer(srv.url, "transformer", texts)
        assert status == 413 and "memory budget" in answer["error"], answer
        short = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["Wo ist der Hund?"]}]}
        assert _infer(srv.url, "transformer", short)[0] == 200
    finally:
        stop(srv)


def test_the_transformers_largest_admitted_request_fits_the_pod(published, tmp_path):
    """The memory budget, measured: what it admits must fit the pod. A Transformer of the committed
    params' shape (random weights: no trained weights are on this machine) is served with the pod's
    limit as its memory budget. The longest source admitted at 64 rows runs with the server's peak
    RSS under the pod's 4 GiB; one step longer is 413 before running."""
    import yaml

    from tests.serving_repo import _publish

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    vocab = params["tasks"]["translation_de_en"]["vocab_size"]
    torch.manual_seed(0)
    model = models.build("transformer", {**params["models"]["transformer"]["model"], "src_vocab": vocab,
                                         "tgt_vocab": vocab}).eval()
    repo = tmp_path / "model_repository"
    _publish(repo, "transformer", "transformer", "translation_de_en", model, tmp_path,
             [published.work / "spm.de.model", published.work / "spm.en.model"])
    srv = start_server(repo, "--memory-budget-mb", str(POD_MEMORY // 2**20), "--timeout-s", "600")
    try:
        rows = 64
        steps, budget = _largest_and_one_beyond(srv, "transformer.encoder", rows)
        refused, answer, took = _infer(srv.url, "transformer.encoder", _source(rows, steps + 1, vocab))
        assert refused == 413 and "memory budget" in answer["error"], answer
        before = _vm(srv.proc.pid, "VmRSS")
        status, answer, ran = _infer(srv.url, "transformer.encoder", _source(rows, steps, vocab))
        peak = _vm(srv.proc.pid, "VmHWM")
        print(f"transformer.encoder ({model.cfg.dim} wide, {model.cfg.heads} heads, {model.cfg.enc_layers} layers): "
              f"budget {budget / 2**20:,.0f} MiB; {rows} x {steps} admitted, answered in {ran:.1f} s; server RSS "
              f"{before / 2**20:,.0f} MiB before, peak {peak / 2**20:,.0f} MiB (pod limit {POD_MEMORY / 2**20:,.0f} "
              f"MiB); {rows} x {steps + 1}: {refused} in {took * 1000:.0f} ms")
        assert status == 200, answer
        assert peak < POD_MEMORY
    finally:
        stop(srv)
