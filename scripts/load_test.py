"""Load and fault test of the inference server (not a benchmark of its speed): many concurrent
clients for a bounded time and count, over loopback, mixing valid requests to three model kinds
with oversized, malformed and over-limit ones.

    python scripts/load_test.py --repository model_repository            # starts a server, stops it after
    python scripts/load_test.py --url http://127.0.0.1:8000 --pid 1234   # a running server (pid: for RSS)
    python scripts/load_test.py --repository model_repository --clients 64 --seconds 60 \
        --server-args "--running 16 --max-queue 32"

Expectations (exit status 1 when one fails): no response with status 500; every valid request answered 200 or 503 (503
with Retry-After); every bad request answered with its 4xx, or 503 with Retry-After while the parsing queue is full
(oversized and over-limit: 413, malformed body or framing and wrong datatype/shape: 400, unknown model or version:
404); no broken connection or timed-out request; the server live afterwards; its RSS after the load at most
``--rss-growth-mib`` above the RSS before it. Prints Markdown rows for
docs/benchmarks.md and a JSON summary.

The load generator is asyncio over raw keep-alive HTTP/1.1 connections, one per client (a new one
when the server closes it), every request's bytes built once before the run: it stays light on
the CPU it shares with the server on a small machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import cli_errors
import numpy as np

ROOT = Path(__file__).resolve().parent.parent

# Which model serves each valid kind: the first of these the server has (or --models).
KIND_CANDIDATES = {
    "translation": ["bahdanau", "luong", "transformer"],  # `text` (BYTES) in, a decode loop
    "recurrent": ["ntm", "draw"],  # `x` [N, T, F], unrolled over T
    "other": ["act", "pointer", "ram"],  # a single graph (dynamically batched) or another loop
}
SENTENCES = ["Wo ist der Bahnhof?", "Ich habe heute keine Zeit.", "Das Buch ist schön.", "Der Hund schläft."]

# The bad categories and the one status each must get. Every one is refused before admission (parsing, declared
# tensors, limits, routing); a 503 with Retry-After (the parsing queue full) is the only other answer allowed.
BAD_EXPECTED = {
    "oversized": 413,  # body over --max-body-mb
    "malformed_json": 400,
    "bad_framing": 400,  # binary tensor data: Inference-Header-Content-Length / binary_data_size wrong
    "wrong_type": 400,  # datatype, shape, element count or input name not as declared
    "over_limit": 413,  # over the model's published limits (steps, rows, beam)
    "unknown_model": 404,
    "bad_version": 404,
}
VALID_EXPECTED = (200, 503)
# Share of the requests per category: 60 % valid (20 % per kind), 40 % bad.
WEIGHTS = {"valid:translation": 20, "valid:recurrent": 20, "valid:other": 20, "oversized": 1,
           "malformed_json": 7, "bad_framing": 6, "wrong_type": 8, "over_limit": 8, "unknown_model": 5,
           "bad_version": 5}


# ---- the requests ---------------------------------------------------------------------------------
def _http(host: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if method == "POST":
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _get_json(url: str, timeout: float = 10.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read())
        except ValueError:
            return err.code, {}


def _numeric_inputs(meta: dict, rng: np.random.Generator, free: int, rows: int = 1) -> list[dict] | None:
    """One valid JSON input list for a model whose required inputs are all FP32: axis 0 ``rows``,
    other free axes ``free``; 0/1 values (bits, pixels, points, noise: valid for every kind served)."""
    tensors = []
    for spec in meta["inputs"]:
        if spec.get("optional"):
            continue
        if spec["datatype"] != "FP32" or not spec["shape"]:
            return None
        shape = [rows if i == 0 and d == -1 else (free if d == -1 else d) for i, d in enumerate(spec["shape"])]
        data = rng.integers(0, 2, int(np.prod(shape))).astype(float).tolist()
        tensors.append({"name": spec["name"], "shape": shape, "datatype": "FP32", "data": data})
    return tensors or None


def _infer_path(name: str, meta: dict, explicit: bool = False) -> str:
    params = meta.get("parameters") or {}
    if explicit or params.get("default_version") is None:  # none promoted: ask for the served version
        return f"/v2/models/{name}/versions/{params.get('version', meta['versions'][-1])}/infer"
    return f"/v2/models/{name}/infer"


def discover(url: str, models: dict[str, str] | None = None) -> dict[str, tuple[str, dict]]:
    """kind -> (model name, its metadata) for the three valid kinds, from GET /v2/models/{name}."""
    chosen = {}
    for kind, candidates in KIND_CANDIDATES.items():
        for name in [models[kind]] if models and kind in models else candidates:
            status, meta = _get_json(f"{url}/v2/models/{name}")
            if status != 200:
                continue
            names = [i["name"] for i in meta.get("inputs", []) if not i.get("optional")]
            if kind == "translation" and names != ["text"]:
                continue
            if kind != "translation" and _numeric_inputs(meta, np.random.default_rng(0), 2) is None:
                continue
            chosen[kind] = (name, meta)
            break
        if kind not in chosen:
            tried = [models[kind]] if models and kind in models else candidates
            raise cli_errors.ScriptError(f"the server at {url} serves none of {tried} (for the {kind} kind) with "
                                         "inputs this script can build")
    return chosen


def build_requests(url: str, chosen: dict[str, tuple[str, dict]], max_body_mb: float, seed: int = 0
                   ) -> dict[str, list[bytes]]:
    """category -> the HTTP request messages (bytes, built once) it picks from."""
    host = urlsplit(url).netloc
    rng = np.random.default_rng(seed)
    js = {"Content-Type": "application/json"}

    def post(path: str, body, headers: dict[str, str] | None = None) -> bytes:
        return _http(host, "POST", path, body if isinstance(body, bytes) else _json(body), headers or js)

    out: dict[str, list[bytes]] = {}
    tname, tmeta = chosen["translation"]
    out["valid:translation"] = [
        post(_infer_path(tname, tmeta, explicit=i == 0),
             {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}],
              "parameters": {"decode": "greedy"} if i % 2 == 0 else {}})  # beam (the model's default) or greedy
        for i, text in enumerate(SENTENCES)]
    rname, rmeta = chosen["recurrent"]
    out["valid:recurrent"] = [post(_infer_path(rname, rmeta, explicit=t == 8),
                                   {"inputs": _numeric_inputs(rmeta, rng, t)}) for t in (3, 5, 8, 4)]
    oname, ometa = chosen["other"]
    out["valid:other"] = [post(_infer_path(oname, ometa, explicit=i == 0), {"inputs": _numeric_inputs(ometa, rng, 6)})
                          for i in range(4)]

    x_spec = next(i for i in rmeta["inputs"] if not i.get("optional"))
    x_name, x_shape = x_spec["name"], x_spec["shape"]
    r_path = _infer_path(rname, rmeta)
    good = {"inputs": _numeric_inputs(rmeta, rng, 3)}
    limit = int(max_body_mb * 2**20)
    out["oversized"] = [post(r_path, b"{" + b" " * (limit + 1024 - 2) + b"}")]
    out["malformed_json"] = [post(r_path, b'{"inputs": [{"name": "x", "shape": [1, 2'), post(r_path, b"{not json"),
                             post(r_path, b""), post(r_path, b"[1, 2]"), post(r_path, b'{"inputs": []}')]
    header = _json(good)
    xb = np.zeros((1, 3, *[d for d in x_shape[2:]]), np.float32)
    bin_header = _json({"inputs": [{"name": x_name, "shape": list(xb.shape), "datatype": "FP32",
                                    "parameters": {"binary_data_size": xb.nbytes}}]})
    octet = {"Content-Type": "application/octet-stream"}
    out["bad_framing"] = [
        post(r_path, header, {**octet, "Inference-Header-Content-Length": str(len(header) + 100)}),  # past the end
        post(r_path, bin_header + xb.tobytes()[:-4],  # binary_data_size says 4 bytes more than follow
             {**octet, "Inference-Header-Content-Length": str(len(bin_header))}),
        post(r_path, bin_header + xb.tobytes(), {**octet, "Inference-Header-Content-Length": "twelve"}),
        post(r_path, bin_header + xb.tobytes(), octet),  # binary_data_size without the header
    ]
    t0 = good["inputs"][0]
    wrong_last = list(t0["shape"][:-1]) + [t0["shape"][-1] + 1]
    out["wrong_type"] = [
        post(r_path, {"inputs": [{**t0, "datatype": "INT64", "data": [int(v) for v in t0["data"]]}]}),
        post(r_path, {"inputs": [{**t0, "shape": wrong_last, "data": [0.0] * int(np.prod(wrong_last))}]}),
        post(r_path, {"inputs": [{**t0, "data": t0["data"][:-1]}]}),
        post(r_path, {"inputs": [{**t0, "name": "no_such_input"}]}),
        post(_infer_path(tname, tmeta),
             {"inputs": [{"name": "text", "shape": [1], "datatype": "FP32", "data": [1.0]}]}),
    ]
    r_limits = (rmeta.get("parameters") or {}).get("limits") or {}
    t_limits = (tmeta.get("parameters") or {}).get("limits") or {}
    o_limits = (ometa.get("parameters") or {}).get("limits") or {}
    over = []
    if "steps" in r_limits and len(x_shape) >= 2 and x_shape[1] == -1:  # time steps: binary FP32, compact
        xs = np.zeros((1, r_limits["steps"] + 1, *x_shape[2:]), np.float32)
        if xs.nbytes < limit // 2:
            h = _json({"inputs": [{"name": x_name, "shape": list(xs.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": xs.nbytes}}]})
            over.append(post(r_path, h + xs.tobytes(), {**octet, "Inference-Header-Content-Length": str(len(h))}))
    if "rows" in r_limits:
        over.append(post(r_path, {"inputs": _numeric_inputs(rmeta, rng, 2, rows=r_limits["rows"] + 1)}))
    if "rows" in o_limits:
        over.append(post(_infer_path(oname, ometa),
                         {"inputs": _numeric_inputs(ometa, rng, 2, rows=o_limits["rows"] + 1)}))
    if "beam" in t_limits:
        over.append(post(_infer_path(tname, tmeta), {
            "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [SENTENCES[0]]}],
            "parameters": {"decode": "beam", "beam": t_limits["beam"] + 1}}))
    if not over:
        raise cli_errors.ScriptError(f"no limits in the metadata of {rname}, {tname} or {oname}: "
                                     "cannot build over-limit requests")
    out["over_limit"] = over
    out["unknown_model"] = [post("/v2/models/no-such-model/infer", good),
                            post("/v2/models/zz_missing-7/versions/1/infer", good)]
    out["bad_version"] = [post(f"/v2/models/{rname}/versions/999999/infer", good),
                          post(f"/v2/models/{rname}/versions/abc/infer", good),
                          post(f"/v2/models/{tname}/versions/0/infer", good)]
    return out


# ---- the load -------------------------------------------------------------------------------------
class _Closed(Exception):
    """The server closed the connection before answering."""


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, message: bytes
                    ) -> tuple[int, bytes, bool, bool]:
    """One request -> (status, body, the server closes the connection, Retry-After given)."""
    writer.write(message)
    await writer.drain()
    line = await reader.readline()
    if not line:
        raise _Closed
    status = int(line.split(b" ", 2)[1])
    length, close, chunked, retry = None, False, False, False
    while True:
        h = await reader.readline()
        if h == b"\r\n":
            break
        if not h:
            raise asyncio.IncompleteReadError(b"", None)
        key, _, value = h.partition(b":")
        key = key.strip().lower()
        if key == b"content-length":
            length = int(value)
        elif key == b"connection":
            close = b"close" in value.lower()
        elif key == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif key == b"retry-after":
            retry = True
    if chunked:
        parts = []
        while size := int((await reader.readline()).split(b";")[0], 16):
            parts.append(await reader.readexactly(size + 2))
        while await reader.readline() not in (b"\r\n", b""):  # trailers
            pass
        body = b"".join(p[:-2] for p in parts)
    elif length is not None:
        body = await reader.readexactly(length)
    else:  # no length: the body runs to the end of the connection
        body, close = await reader.read(), True
    return status, body, close, retry


def _rss_mib(pid: int | None) -> float | None:
    """Resident memory of the server process and its children (uvicorn workers), MiB."""
    if pid is None:
        return None
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def _server_500s(url: str) -> float | None:
    """attnzoo_requests_total with status 500, summed over models (None: no /metrics)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except (OSError, urllib.error.URLError):
        return None
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("attnzoo_requests_total{") and 'status="500"' in line)


def _pct(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    a = np.asarray(values) * 1000
    return round(float(np.percentile(a, 50)), 2), round(float(np.percentile(a, 99)), 2)


class _Clients:
    """The clients of one load run: what is left to send, and a tally of what came back."""

    def __init__(self, pool: dict[str, list[bytes]], max_requests: int, soft_end: float, hard_end: float,
                 host: str, port: int):
        self.entries = [(cat, msg) for cat in WEIGHTS for msg in pool[cat]]
        self.cum, total_w = [], 0.0
        for cat, _ in self.entries:  # a category's weight shared by its variants
            total_w += WEIGHTS[cat] / len(pool[cat])
            self.cum.append(total_w)
        self.left, self.soft_end, self.hard_end, self.host, self.port = max_requests, soft_end, hard_end, host, port
        self.statuses = {cat: Counter() for cat in WEIGHTS}
        self.latency = {cat: [] for cat in WEIGHTS if cat.startswith("valid:")}
        self.odd_bodies = Counter()  # answers whose body is not what the status promises
        self.no_retry_after = Counter()  # 503 without Retry-After
        self.reconnects = 0  # connections the server closed (after answering, or a stale keep-alive one)

    async def client(self, rng: random.Random) -> None:
        loop, conn = asyncio.get_running_loop(), None
        while self.left > 0 and loop.time() < self.soft_end:
            self.left -= 1
            cat, message = rng.choices(self.entries, cum_weights=self.cum)[0]
            t0 = time.perf_counter()
            status: int | str
            body, retry = b"", None
            try:
                async with asyncio.timeout_at(self.hard_end):
                    conn, (status, body, close, retry) = await self._send(conn, message)
            except TimeoutError:
                status, close = "timeout", True
            except (_Closed, OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                status, close = "broken", True
            self._record(cat, status, body, retry, time.perf_counter() - t0)
            if close and conn is not None:  # the server closes it (or the exchange broke): a new one next
                conn[1].close()
                conn = None
                self.reconnects += 1
        if conn is not None:
            conn[1].close()

    async def _send(self, conn, message: bytes) -> tuple:
        """One exchange on ``conn`` (a new connection when None), once more on a new one when the server
        had closed a kept-alive connection; returns the connection and (status, body, close, retry)."""
        for attempt in (0, 1):
            reused = conn is not None
            if conn is None:
                conn = await asyncio.open_connection(self.host, self.port)
            try:
                return conn, await _exchange(*conn, message)
            except (_Closed, ConnectionResetError, BrokenPipeError):
                conn[1].close()
                conn = None
                self.reconnects += 1
                if not reused or attempt:
                    raise
        raise _Closed

    def _record(self, cat: str, status: int | str, body: bytes, retry, seconds: float) -> None:
        self.statuses[cat][status] += 1
        if not isinstance(status, int):
            return
        if status == 200 and cat in self.latency:
            self.latency[cat].append(seconds)
            if b'"outputs"' not in body:
                self.odd_bodies[cat] += 1
        elif status != 200 and not body.startswith(b'{"error":'):
            self.odd_bodies[cat] += 1
        if status == 503 and not retry:
            self.no_retry_after[cat] += 1


async def _load(url: str, pool: dict[str, list[bytes]], clients: int, seconds: float, max_requests: int,
                seed: int, hard_cap_s: float, pid: int | None, sample_s: float) -> dict:
    parts = urlsplit(url)
    loop = asyncio.get_running_loop()
    started = loop.time()
    run = _Clients(pool, max_requests, started + seconds, started + hard_cap_s, parts.hostname, parts.port or 80)
    rss = {"peak": _rss_mib(pid)}
    done = asyncio.Event()

    async def sampler():
        while not done.is_set():
            value = await asyncio.to_thread(_rss_mib, pid)
            if value is not None:
                rss["peak"] = max(rss["peak"] or 0.0, value)
            try:
                await asyncio.wait_for(done.wait(), sample_s)
            except TimeoutError:
                pass

    sampling = asyncio.create_task(sampler()) if pid is not None else None
    try:
        await asyncio.wait_for(asyncio.gather(*(run.client(random.Random(f"{seed}-{i}")) for i in range(clients))),
                               hard_cap_s + 10)
    finally:
        done.set()
        if sampling is not None:
            await sampling
    return {"statuses": run.statuses, "latency": run.latency, "odd_bodies": run.odd_bodies,
            "no_retry_after": run.no_retry_after, "reconnects": run.reconnects, "duration_s": loop.time() - started,
            "rss_peak": rss["peak"]}


def run_load(url: str, clients: int = 64, seconds: float = 60.0, max_requests: int = 200_000, seed: int = 0,
             pid: int | None = None, max_body_mb: float = 8.0, grace_s: float = 60.0,
             models: dict[str, str] | None = None, rss_growth_mib: float = 256.0, sample_s: float = 0.5) -> dict:
    """Run the load against the server at ``url`` and return its summary (see the module docstring).

    Bounds: each client stops at ``seconds`` or once ``max_requests`` requests were sent in all; a
    request still unanswered ``seconds + grace_s`` after the start counts as timed out (the hard
    cap of the run). ``pid``: the server's process, for its RSS (psutil; children included).
    ``max_body_mb``: the server's --max-body-mb (the oversized bodies go 1 KiB over it).
    ``models``: kind (translation, recurrent, other) -> model name, instead of the first served of
    KIND_CANDIDATES. ``summary["failures"]`` lists the expectations not met (empty: all met).
    """
    url = url.rstrip("/")
    chosen = discover(url, models)
    pool = build_requests(url, chosen, max_body_mb, seed)
    rss_start = _rss_mib(pid)
    for cat, messages in pool.items():  # warm-up, not counted: each valid request once
        if cat.startswith("valid:"):
            asyncio.run(_warm(url, messages))
    rss_before = _rss_mib(pid)
    errors_before = _server_500s(url)
    cpu = time.process_time()
    raw = asyncio.run(_load(url, pool, clients, seconds, max_requests, seed, seconds + grace_s, pid, sample_s))
    cpu = time.process_time() - cpu  # the load generator's own CPU time (it shares the machine with the server)
    try:
        status, live = _get_json(f"{url}/v2/health/live")
    except OSError:  # gone: reported as not live after the load
        status, live = 0, {}
    live_after = status == 200 and live.get("live") is True
    time.sleep(1.0)  # let the server drop what the last requests held
    rss_after = _rss_mib(pid)
    errors_after = _server_500s(url)

    categories = {}
    for cat, counts in raw["statuses"].items():
        valid = cat.startswith("valid:")
        kind = cat.split(":", 1)[1] if valid else None
        entry = {"kind": "valid" if valid else "bad", "model": chosen[kind][0] if valid else None,
                 # A bad body waits for the codec threads like any other: with their queue full it is 503 with
                 # Retry-After before anything reads it.
                 "expected": list(VALID_EXPECTED) if valid else [BAD_EXPECTED[cat], 503],
                 "requests": sum(counts.values()),
                 "statuses": {str(k): v for k, v in sorted(counts.items(), key=lambda kv: str(kv[0]))},
                 "odd_bodies": raw["odd_bodies"][cat], "503_without_retry_after": raw["no_retry_after"][cat]}
        if valid:
            entry["p50_ms"], entry["p99_ms"] = _pct(raw["latency"][cat])
        categories[cat] = entry
    accepted = [t for lat in raw["latency"].values() for t in lat]
    p50, p99 = _pct(accepted)
    total = sum(c["requests"] for c in categories.values())
    all_statuses = Counter()
    for c in categories.values():
        all_statuses.update(c["statuses"])
    summary = {
        "url": url, "clients": clients, "seconds": seconds, "max_requests": max_requests, "seed": seed,
        "models": {kind: name for kind, (name, _) in chosen.items()},
        "duration_s": round(raw["duration_s"], 2), "requests": total,
        "rps": round(total / raw["duration_s"], 1) if raw["duration_s"] else 0.0,
        "statuses": dict(sorted(all_statuses.items())),
        "accepted": {"count": len(accepted), "p50_ms": p50, "p99_ms": p99},
        "categories": categories, "reconnects": raw["reconnects"], "client_cpu_s": round(cpu, 2),
        "rss_mib": {k: None if v is None else round(v, 1) for k, v in {
            "start": rss_start, "before": rss_before, "after": rss_after,
            "peak": max((x for x in (raw["rss_peak"], rss_before, rss_after) if x), default=None)}.items()},
        "live_after": live_after,
        "server_500s": None if errors_before is None or errors_after is None else errors_after - errors_before,
        "rss_growth_bound_mib": rss_growth_mib,
    }
    summary["failures"] = expectations(summary)
    return summary


async def _warm(url: str, messages: list[bytes]) -> None:
    parts = urlsplit(url)
    conn = await asyncio.open_connection(parts.hostname, parts.port or 80)
    try:
        for m in messages:
            async with asyncio.timeout(120):
                await _exchange(*conn, m)
    finally:
        conn[1].close()


def expectations(summary: dict) -> list[str]:
    """The expectations a summary fails, one line each (empty: all met)."""
    failures = []
    for cat, c in summary["categories"].items():
        allowed = {str(s) for s in c["expected"]}
        wrong = {s: n for s, n in c["statuses"].items() if s not in allowed}
        if wrong:
            failures.append(f"{cat}: statuses {wrong} (expected only {sorted(allowed)})")
        if c["odd_bodies"]:
            failures.append(f"{cat}: {c['odd_bodies']} answer(s) without outputs (200) or {{\"error\": ...}} (else)")
        if c["503_without_retry_after"]:
            failures.append(f"{cat}: {c['503_without_retry_after']} 503 answer(s) without Retry-After")
        if c["requests"] == 0:
            failures.append(f"{cat}: no request was sent")
    if summary["statuses"].get("500"):
        failures.append(f"{summary['statuses']['500']} response(s) with status 500")
    if summary["server_500s"]:
        failures.append(f"the server counted {summary['server_500s']:g} status-500 answer(s) in /metrics")
    if not summary["live_after"]:
        failures.append("the server is not live after the load (GET /v2/health/live)")
    rss = summary["rss_mib"]
    if rss["before"] is not None and rss["after"] is not None and \
            rss["after"] - rss["before"] > summary["rss_growth_bound_mib"]:
        failures.append(f"RSS grew {rss['after'] - rss['before']:.0f} MiB under load "
                        f"(bound {summary['rss_growth_bound_mib']:g} MiB)")
    return failures


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _mib(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def markdown(summary: dict) -> str:
    """The tables for docs/benchmarks.md."""
    rss = summary["rss_mib"]
    lines = [
        "| clients | duration s | requests | req/s | status 500 | accepted (200) valid | p50 ms | p99 ms "
        "| RSS before / peak / after MiB | live after | load generator CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {summary['clients']} | {summary['duration_s']:.1f} | {summary['requests']} | {summary['rps']:.0f} "
        f"| {summary['statuses'].get('500', 0)} | {summary['accepted']['count']} "
        f"| {_ms(summary['accepted']['p50_ms'])} | {_ms(summary['accepted']['p99_ms'])} "
        f"| {_mib(rss['before'])} / {_mib(rss['peak'])} / {_mib(rss['after'])} "
        f"| {'yes' if summary['live_after'] else '**no**'} | {summary['client_cpu_s']:.1f} |",
        "",
        "| category | model | expected | requests | answers (status: count) | accepted p50 ms | accepted p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for cat, c in summary["categories"].items():
        answers = ", ".join(f"{s}: {n}" for s, n in c["statuses"].items())
        expected = "/".join(str(s) for s in c["expected"])
        model = f"`{c['model']}`" if c["model"] else ""
        lines.append(f"| {cat} | {model} | {expected} | {c['requests']} | {answers} "
                     f"| {_ms(c.get('p50_ms'))} | {_ms(c.get('p99_ms'))} |")
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_models(text: str) -> dict[str, str]:
    """``--models``: kind=model,... with kinds of KIND_CANDIDATES, or one sentence saying the form."""
    items = [item.split("=", 1) for item in text.split(",")]
    if any(len(item) != 2 or item[0] not in KIND_CANDIDATES for item in items):
        raise cli_errors.ScriptError(f"--models {text!r}: give kind=model,... with kinds {', '.join(KIND_CANDIDATES)}")
    return dict(items)


def reachable(url: str) -> None:
    """``--url``: a server answers there, or one sentence saying none does."""
    try:
        _get_json(f"{url}/v2/health/live", timeout=10)
    except OSError as err:
        why = getattr(err, "reason", err)
        raise cli_errors.ScriptError(f"no server answers at {url} ({why}): start one (`attnzoo serve`), "
                                     "or pass --repository DIR for this script to start it") from None


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if _get_json(url + "/v2/health/ready", timeout=5)[0] == 200:
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--repository", type=Path, help="start a server on this repository (127.0.0.1, a free port)")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the server's process id, for its RSS")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--max-requests", type=int, default=200_000, help="requests in all (the count bound)")
    ap.add_argument("--grace-s", type=float, default=60.0,
                    help="a request unanswered this long after --seconds counts as timed out (hard cap)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-body-mb", type=float, default=8.0,
                    help="the server's --max-body-mb (passed to the server this script starts)")
    ap.add_argument("--models", default=None,
                    help="kind=model,... overriding the models picked, e.g. translation=luong,other=pointer")
    ap.add_argument("--server-args", default="", help="extra options for the server started, e.g. '--running 16'")
    ap.add_argument("--rss-growth-mib", type=float, default=256.0, help="largest RSS growth accepted (after - before)")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON summary here")
    args = ap.parse_args(argv)
    models = parse_models(args.models) if args.models else None
    if args.repository is not None or args.pid is not None:  # the server's RSS, read with psutil
        cli_errors.need_module("psutil")
    if args.url:
        reachable(args.url)

    proc, log_file, url, pid = None, None, args.url, args.pid
    server_cmd = None
    if args.repository is not None:
        port = _free_port()
        server_cmd = [sys.executable, "-m", "serving.server", "--repository", str(args.repository),
                      "--host", "127.0.0.1", "--port", str(port), "--max-body-mb", str(args.max_body_mb),
                      *args.server_args.split()]
        log_file = tempfile.NamedTemporaryFile("w+", prefix="attnzoo-load-server-", suffix=".log", delete=False)
        proc = subprocess.Popen(server_cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=log_file, stderr=subprocess.STDOUT)
        url, pid = f"http://127.0.0.1:{port}", proc.pid
        if not _wait_ready(url, proc, 300):
            proc.kill()
            proc.wait()
            log_file.seek(0)
            raise SystemExit(f"error: the server did not become ready:\n{log_file.read()[-3000:]}")
    try:
        summary = run_load(url, args.clients, args.seconds, args.max_requests, args.seed, pid, args.max_body_mb,
                           args.grace_s, models, args.rss_growth_mib)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if proc is not None:
        log_file.seek(0)
        log = log_file.read()
        log_file.close()
        summary["server_log"] = log_file.name
        if "Traceback" in log:
            summary["failures"].append(f"the server log has a Traceback (see {log_file.name})")
        else:
            os.unlink(log_file.name)
            summary["server_log"] = None
    summary["machine"] = f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"
    summary["server"] = " ".join(server_cmd[2:]) if server_cmd else url
    print(f"load test: {summary['clients']} clients, {summary['seconds']:g} s or {summary['max_requests']} requests "
          f"(seed {summary['seed']}); server: {summary['server']}; machine: {summary['machine']}; models: "
          + ", ".join(f"{k}={v}" for k, v in summary["models"].items()) + "\n")
    print(markdown(summary))
    print()
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if summary["failures"]:
        print("\nFAILED:\n  " + "\n  ".join(summary["failures"]), file=sys.stderr)
        return 1
    print("\nall expectations met", file=sys.stderr)
    return 0


if __name__ == "__main__":
    cli_errors.run(main)
