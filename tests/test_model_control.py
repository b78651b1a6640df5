"""``attnzoo serve --model-control explicit|poll``: versions loaded and unloaded while the server
answers. Each test serves a copy of the tiny repository's ``ntm`` (tests/serving_repo.py) from its
own folder, on 127.0.0.1, and adds or removes versions there as publish does: a whole folder
written under a scratch name, then renamed into place."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from serving.client import Client
from tests.conftest import ROOT, wait_for
from tests.ports import free_port, wait_serving

pytestmark = pytest.mark.integration  # starts servers

POLL_S = 1.0  # --repository-poll-s of the polled servers here


def call(url: str, path: str, body=None, method: str = "POST", **headers: str) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **{k.replace("_", "-"): v for k, v in headers.items()}}
    req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def ntm_body(rows: int = 1, steps: int = 3) -> dict:
    x = np.random.default_rng(0).random((rows, steps, 5)).round(2)
    return {"inputs": [{"name": "x", "shape": [rows, steps, 5], "datatype": "FP32", "data": x.ravel().tolist()}]}


def index(url: str) -> dict[tuple[str, str], dict]:
    return {(e["name"], e["version"]): e for e in call(url, "/v2/repository/index", {})[1]}


@contextmanager
def serve(published, tmp_path: Path, *flags: str):
    """A server over a copy of the tiny repository's ntm (versions 1 and 2) in ``tmp_path/repo``."""
    repo = tmp_path / "repo"
    shutil.copytree(published.repo / "ntm", repo / "ntm")
    port, log_path = free_port(), tmp_path / "server.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "serving.server", "--repository", str(repo), "--port", str(port),
                                 *flags], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log_file,
                                stderr=subprocess.STDOUT)
    client = Client(f"http://127.0.0.1:{port}", timeout=30)
    try:
        if not wait_serving(proc, port, client.ready, 30):
            raise RuntimeError(f"server not ready in 30 s:\n{log_path.read_text()[-3000:]}")
        yield client.url, repo
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]


def publish_copy(repo: Path, source: int, version: int, tamper: bool = False) -> None:
    """Version ``source`` of ntm published again as ``version`` the way publish writes a version (a
    scratch folder renamed into place); ``tamper``: a graph changed after its files_sha256 was recorded."""
    scratch = repo / "ntm" / f".scratch-{version}"
    shutil.copytree(repo / "ntm" / str(source), scratch)
    if tamper:
        with (scratch / "step.onnx").open("ab") as f:
            f.write(b"\0")
    scratch.rename(repo / "ntm" / str(version))


def publish_again(repo: Path, source: int) -> int:
    """Version ``source`` of ntm published again by publish's own writer (``write_version``: a scratch
    folder renamed into place, then promoted); its graphs differ from the newest version's, so it
    becomes a new version. Returns the version's number."""
    from pipeline.stages.publish import write_version

    folder = repo / "ntm" / str(source)
    meta = json.loads((folder / "metadata.json").read_text())
    facts = {k: meta[k] for k in ("arch", "task", "parity_passed", "production")}
    written, created, _ = write_version(repo / "ntm", "ntm", folder, meta["serving"], facts, [])
    assert created
    return written["version"]


def test_unload_drains_in_flight_requests_then_load_serves_again(published, tmp_path):
    """Explicit control: a long NTM request (32 rows x 2000 steps) admitted before its model is
    unloaded finishes 200 after the unload returned; new requests on the model and on its graphs
    are 404 at once; the index shows every one of its names UNAVAILABLE ("unloaded"); load brings
    them back READY and answering. Load on a graph name is 404 naming the model, with Triton's "config"
parameter 400; a foreign Origin is 403 and a form's Content-Type 415, as for infer."""
    with serve(published, tmp_path, "--model-control", "explicit", "--load-model", "ntm") as (url, _):
        long, sent = {}, threading.Event()
        body = json.dumps(ntm_body(32, 2000)).encode()  # 1.9 MB, encoded before the clock below starts

        def long_request():
            conn = http.client.HTTPConnection(urllib.parse.urlsplit(url).netloc, timeout=30)
            conn.request("POST", "/v2/models/ntm/versions/1/infer", body, {"Content-Type": "application/json"})
            sent.set()  # the whole body is written: the server parses it and takes its model next
            resp = conn.getresponse()
            long["status"], answer = resp.status, json.loads(resp.read())
            conn.close()
            long["done"], long["shape"] = time.monotonic(), answer.get("outputs", [{}])[0].get("shape")

        # what a web page could send: a foreign Origin (403), a form's Content-Type (415); nothing unloaded
        assert call(url, "/v2/repository/models/ntm/unload", {}, Origin="http://elsewhere.example")[0] == 403
        assert call(url, "/v2/repository/models/ntm/unload", {}, Content_Type="text/plain")[0] == 415
        thread = threading.Thread(target=long_request)
        thread.start()
        assert sent.wait(30)
        # Admitted by then (orjson parses the body into an array in ~20 ms), and still decoding: the
        # answer comes ~1.2 s after the body is written (2 idle cores, AMD EPYC family 25 model 17).
        time.sleep(0.3)
        assert call(url, "/v2/repository/models/ntm/unload", {}) == (200, {})
        unloaded = time.monotonic()
        status, answer = call(url, "/v2/models/ntm/versions/1/infer", ntm_body())
        assert status == 404 and "unloaded" in answer["error"], answer
        assert call(url, "/v2/models/ntm.step/versions/1/infer", {})[0] == 404
        states = index(url)
        assert {k[0] for k in states} == {"ntm", "ntm.init", "ntm.step"} and len(states) == 6, states
        assert all(e["state"] == "UNAVAILABLE" and e["reason"] == "unloaded" for e in states.values()), states
        thread.join(30)
        assert long["status"] == 200 and long["shape"][:2] == [32, 2000], long
        assert long["done"] > unloaded, "the long request ended before the unload: it proved no drain"
        status, answer = call(url, "/v2/repository/models/ntm.step/load", {})
        assert status == 404 and "load 'ntm'" in answer["error"], answer
        status, answer = call(url, "/v2/repository/models/ntm/load", {"parameters": {"config": "{}"}})
        assert status == 400 and "['config'] are not taken" in answer["error"], answer
        assert call(url, "/v2/repository/models/ntm/load", {}) == (200, {})
        assert {e["state"] for e in index(url).values()} == {"READY"} and len(index(url)) == 6
        status, answer = call(url, "/v2/models/ntm/versions/1/infer", ntm_body())
        assert status == 200 and answer["model_version"] == "1", answer


def test_poll_refuses_a_tampered_version_and_keeps_serving(published, tmp_path):
    """Poll control: a version whose graph changed after publish recorded its files_sha256 is refused
    (index UNAVAILABLE, the reason naming the version and files_sha256) while versions 1 and 2 keep
    answering and the server stays ready; the same version folder republished intact replaces it
    and is served. Explicit load and unload are 409 naming --model-control."""
    with serve(published, tmp_path, "--model-control", "poll", "--repository-poll-s", str(POLL_S)) as (url, repo):
        publish_copy(repo, 2, 3, tamper=True)
        entry = wait_for(lambda: index(url).get(("ntm", "3"), {}).get("state") == "UNAVAILABLE" and
                         index(url)[("ntm", "3")], 3 * POLL_S)
        assert entry and "ntm version 3" in entry["reason"] and "files_sha256" in entry["reason"], index(url)
        assert call(url, "/v2/models/ntm/versions/3/infer", ntm_body())[0] == 404
        for path in ("/v2/models/ntm/infer", "/v2/models/ntm/versions/1/infer"):
            status, answer = call(url, path, ntm_body())
            assert status == 200 and answer["model_version"] in ("1", "2"), answer
        assert call(url, "/v2/health/ready", method="GET") == (200, {"ready": True})
        status, answer = call(url, "/v2/repository/models/ntm/unload", {})
        assert status == 409 and "--model-control poll" in answer["error"], answer
        # put right: the tampered folder taken away, the intact one published under the same number
        (repo / "ntm" / "3").rename(repo / "ntm" / ".tampered")
        publish_copy(repo, 2, 3)
        assert wait_for(lambda: index(url).get(("ntm", "3"), {}).get("state") == "READY", 3 * POLL_S), index(url)
        assert call(url, "/v2/models/ntm/versions/3/infer", ntm_body())[0] == 200


# The load before the new version appears and after it went again; ATTNZOO_MODEL_CONTROL_LOAD_S=30 makes
# it the 60 s of a soak (every request across both swaps is checked whatever the length).
LOAD_S = float(os.environ.get("ATTNZOO_MODEL_CONTROL_LOAD_S", "1"))


@pytest.mark.timing
def test_poll_serves_a_new_version_within_two_periods_losing_no_request(published, tmp_path):
    """Poll control: a version published (by publish's own writer) while two clients keep asking
    version 1 answers within two poll periods (and becomes the default, as publish promoted it), then
    is unloaded within two periods once its folder is taken away; not one of the clients' requests
    fails, each is counted in /metrics, and the memory budget shrinks by the version's files while it
    is served. The load runs LOAD_S before the publish, through the load and unload, and LOAD_S after."""
    with serve(published, tmp_path, "--model-control", "poll", "--repository-poll-s", str(POLL_S)) as (url, repo):
        stop, statuses = threading.Event(), []

        def client():
            for _ in range(int(500 * (2 * LOAD_S + 10 * POLL_S))):  # bounded; stop comes after 2 LOAD_S + 4 periods
                if stop.is_set():
                    return
                statuses.append(call(url, "/v2/models/ntm/versions/1/infer", ntm_body())[0])

        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        budget = call(url, "/v2/models/ntm", method="GET")[1]["parameters"]["memory_budget_bytes"]
        try:
            time.sleep(LOAD_S)
            published_at = time.monotonic()
            assert publish_again(repo, 1) == 3
            assert wait_for(lambda: call(url, "/v2/models/ntm/versions/3/ready", method="GET")[0] == 200, 2 * POLL_S)
            took = time.monotonic() - published_at
            status, answer = call(url, "/v2/models/ntm/infer", ntm_body())
            assert status == 200 and answer["model_version"] == "3", answer
            size = sum(p.stat().st_size for p in (repo / "ntm" / "3").rglob("*") if p.is_file())

            def after() -> int:
                return call(url, "/v2/models/ntm/versions/3", method="GET")[1]["parameters"]["memory_budget_bytes"]

            # The budget makes room for the version (set just after the version answers ready: waited for).
            assert wait_for(lambda: abs(budget - size - after()) <= 1, POLL_S), (budget, size, after())
            (repo / "ntm" / "3").rename(repo / "ntm" / ".removed")
            assert wait_for(lambda: call(url, "/v2/models/ntm/versions/3/ready", method="GET")[0] == 404,
                            2 * POLL_S)
            assert wait_for(lambda: ("ntm", "3") not in index(url), POLL_S)  # its state entry goes just after
            time.sleep(LOAD_S)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
        assert call(url, "/v2/models/ntm", method="GET")[1]["parameters"]["memory_budget_bytes"] == budget
        with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
        counted = [line for line in metrics.splitlines()
                   if line.startswith('attnzoo_requests_total{model="ntm",protocol="rest",status="200"}')]
        assert counted and float(counted[0].split()[-1]) >= len(statuses), counted
        print(f"version 3 answered {took:.2f} s after its folder appeared; {len(statuses)} requests, all 200")


def test_grpc_load_unload_and_index_states_through_tritonclient(published, tmp_path):
    """gRPC (tritonclient.grpc, as Triton's users call it): unload_model takes ntm and its graphs out
    (ModelReady NOT_FOUND, the index UNAVAILABLE "unloaded", as over REST), load_model brings them
    back READY; a graph's name is NOT_FOUND, Triton's load "config" parameter INVALID_ARGUMENT."""
    import tritonclient.grpc as grpcclient  # the dev extra
    from tritonclient.utils import InferenceServerException

    grpc_port = free_port()
    with serve(published, tmp_path, "--model-control", "explicit", "--load-model", "ntm",
               "--grpc-port", str(grpc_port)) as (url, _):
        client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{grpc_port}")
        try:
            client.unload_model("ntm")
            models = client.get_model_repository_index(as_json=True)["models"]
            assert len(models) == 6 and {(m["state"], m["reason"]) for m in models} == {("UNAVAILABLE", "unloaded")}
            assert {(m["name"], m["version"]) for m in models} == set(index(url)), (models, index(url))
            with pytest.raises(InferenceServerException, match="not served") as err:
                client.is_model_ready("ntm")
            assert err.value.status() == "StatusCode.NOT_FOUND"
            for bad, code in ((lambda: client.load_model("ntm.step"), "NOT_FOUND"),
                              (lambda: client.load_model("ntm", config="{}"), "INVALID_ARGUMENT")):
                with pytest.raises(InferenceServerException) as err:
                    bad()
                assert err.value.status() == f"StatusCode.{code}", err.value
            client.load_model("ntm")
            models = client.get_model_repository_index(as_json=True)["models"]
            assert len(models) == 6 and {m["state"] for m in models} == {"READY"}, models
            assert client.is_model_ready("ntm", "2") and client.is_model_ready("ntm.step", "1")
        finally:
            client.close()


def test_unload_ends_the_versions_step_batcher_threads_and_held_models_still_answer(published, tmp_path):
    """In process: a version's step batchers (one runner thread per looping graph) end when it is
    unloaded, and its graphs' request batchers (``ntm.step``) are dropped and their tasks end, so
    loading and unloading leaks no thread, task nor session; a model taken before the unload (a
    request in flight) still answers, its graph calls made in its own thread."""
    import asyncio

    from serving.protocol import DATATYPES
    from serving.server import ServeConfig, Service

    shutil.copytree(published.repo / "ntm", tmp_path / "ntm")

    def runners() -> int:
        return sum(t.name.startswith(("steps-", "greedy-")) and t.is_alive() for t in threading.enumerate())

    before = runners()
    service = Service(ServeConfig(repository=str(tmp_path), model_control="explicit", load_model=["ntm"]))
    try:
        assert runners() - before == 4, threading.enumerate()  # ntm's init and step graphs, versions 1 and 2
        held = service.repo.get("ntm", "2")
        x = np.random.default_rng(0).random((2, 4, 5)).astype(np.float32)
        expected = held.infer({"x": x}, {})["logits"][0]
        step = service.repo.get("ntm.step", "2")
        feeds = {i.name: np.zeros([1 if d == -1 else d for d in i.shape], DATATYPES[i.datatype]) for i in step.inputs}

        async def unload_after_a_batched_call():
            await service.run_model(step, feeds, {})  # makes ntm.step's DynamicBatcher
            batcher = service.batchers[("ntm.step", 2)]
            service.after_change(await asyncio.to_thread(service.repo.unload, "ntm"))
            assert ("ntm.step", 2) not in service.batchers
            await asyncio.wait_for(asyncio.gather(*service.retiring), 5)
            return batcher

        assert asyncio.run(unload_after_a_batched_call()).worker.cancelled()
        assert wait_for(lambda: runners() == before, 5.0), threading.enumerate()
        np.testing.assert_array_equal(held.infer({"x": x}, {})["logits"][0], expected)
    finally:
        service.executor.shutdown()
        service.codec.shutdown()
