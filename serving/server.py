"""Open Inference Protocol (KServe v2) REST server over the published model repository.

``attnzoo serve --repository model_repository --port 8000`` (see ``--help``). ONNX Runtime only:
CUDA execution provider when a GPU is visible, CPU otherwise; the choice is logged at start-up.
Endpoints: ``GET /v2``, ``/v2/health/{live,ready}``, ``/v2/models/{name}[/versions/{v}][/ready]``,
``POST /v2/models/{name}[/versions/{v}]/infer``, ``POST /v2/repository/index`` (Triton's model
repository extension: every version's state) and ``POST /v2/repository/models/{name}/load|unload``
(``--model-control explicit``), Prometheus ``/metrics``, ``/openapi.json``; the
playground page at ``/`` (``serving/playground/``, off with ``--no-playground``), which calls only
these endpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, StrictBool, ValidationError
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from serving import __version__
from serving.admission import (
    COMPUTE,
    Admission,
    DeadlineExceeded,
    MemoryPool,
    check_deadline,
    deadline_carried,
    deadline_scope,
    memory_limit,
    over_limit,
)
from serving.base import GraphModel, ServedModel
from serving.batching import DynamicBatcher, GreedyScheduler, StepBatcher
from serving.protocol import (
    HEADER_LENGTH,
    RequestError,
    binary_outputs,
    declared_shapes,
    decode_body,
    encode_response,
    parse_request,
    read_request,
)
from serving.repository import Repository

log = logging.getLogger("attnzoo.serving")
ENV_CONFIG = "ATTNZOO_SERVE_CONFIG"  # how `--workers N` hands the config to each worker process


@dataclass
class ServeConfig:
    repository: str = "model_repository"
    host: str = "127.0.0.1"
    port: int = 8000
    # The gRPC port of the same protocol (0: none). Both protocols share one admission, one set of
    # batchers and one set of metrics: a gRPC and a REST request can share a step batch.
    grpc_port: int = 0
    workers: int = 1
    provider: str = "auto"  # auto | cpu | cuda
    ort_threads: int = 0  # ONNX Runtime intra-op threads per session of a one-graph model (0: its default)
    # ... and of a looping model's graphs: many small calls, run concurrently by --infer-threads;
    # ORT's spinning pool would compete with the loop (docs/benchmarks.md: 1 measured best on 2 cores)
    loop_ort_threads: int = 1
    infer_threads: int = 2  # ONNX Runtime calls in flight at once per worker process
    max_batch: int = 64  # rows per dynamically batched call
    # The longest a request waits for companions. 0: batch only what queued up while the previous
    # call ran, which measured best on 2 cores (docs/benchmarks.md); raise it on big GPUs.
    batch_delay_ms: float = 0.0
    running: int = 64  # requests worked on at once (decode loops alive) per worker process
    max_queue: int = 256  # requests waiting for a turn before HTTP 503 + Retry-After
    step_batching: bool = True  # concurrent decode loops share each step's graph call
    step_delay_ms: float = 2.0  # the longest a step waits for the other loops' steps
    max_step_rows: int = 256  # rows of one shared step call
    max_body_mb: float = 8.0
    body_timeout_s: float = 30.0  # the longest a request body may take to arrive (HTTP 408): slow senders
    max_connections: int = 1024  # requests in flight per worker; beyond: 503 (never the health endpoints)
    header_timeout_s: float = 5.0  # a connection's time to send complete headers (and an idle keep-alive's)
    timeout_s: float = 30.0  # a request's deadline: its decode loop stops there (HTTP 504)
    # Python's GIL switch interval in a server process. A decode loop takes the GIL back after each
    # graph call; at Python's 5 ms it waited behind an event loop busy reading other bodies (a
    # 25 ms loop took 2-3x as long while hostile uploads arrived; docs/security.md).
    switch_interval_ms: float = 1.0
    playground: bool = True  # the page at / (a production server behind a gateway turns it off)
    # Host names a request may be addressed to, comma-separated ("*": any). Empty: the bound address
    # and localhost, or any when bound to every address (a pod behind its gateway).
    allowed_hosts: str = ""
    # The memory this process may use, in MiB; 0: the container's limit (cgroup) over --workers, else
    # the KServe pod's 4 GiB. Requests get it less what the server holds once its models are loaded
    # (measured then, not guessed): a request whose estimate exceeds that is 413 before it runs.
    memory_budget_mb: float = 0.0
    # none: every version loaded at start-up, nothing changes while serving; poll: the repository is
    # re-scanned every --repository-poll-s (versions added and removed follow); explicit: only
    # --load-model at start, then POST /v2/repository/models/{name}/load and /unload (Triton's modes).
    model_control: str = "none"
    repository_poll_s: float = 5.0
    load_model: list[str] = field(default_factory=list)


PROVIDERS = ("auto", "cpu", "cuda")  # --provider: auto takes CUDA where a device is visible
MODEL_CONTROL = ("none", "poll", "explicit")


# `attnzoo serve --help`, one line per ServeConfig field (the defaults are appended from the dataclass).
HELP = {
    "repository": "the model repository to serve (what publish writes; Triton's layout)",
    "host": "the address to bind; 0.0.0.0 to serve beyond this machine",
    "port": "the HTTP port",
    "grpc_port": "the gRPC port of the Open Inference Protocol (GRPCInferenceService), beside REST (0: off)",
    "workers": "server processes (uvicorn workers), each with its own ONNX Runtime sessions",
    "provider": "ONNX Runtime execution provider: auto takes CUDA when onnxruntime-gpu sees a GPU",
    "ort_threads": "intra-op threads of a one-graph model's session (0: ONNX Runtime's default)",
    "loop_ort_threads": "intra-op threads of a looping model's graphs (many small calls; 1 measured best on 2 cores)",
    "infer_threads": "ONNX Runtime calls in flight at once per worker",
    "max_batch": "rows of one dynamically batched call",
    "batch_delay_ms": "the longest a request waits for others to batch with (0: only what queued meanwhile)",
    "running": "requests worked on at once per worker (decode loops alive)",
    "max_queue": "requests waiting for a turn before the server answers 503 with Retry-After",
    "step_batching": "concurrent decode loops share each step's graph call",
    "step_delay_ms": "the longest a decode step waits for the other loops' steps",
    "max_step_rows": "rows of one shared step call",
    "max_body_mb": "the largest request body accepted, in MB (larger: 413)",
    "body_timeout_s": "the longest a request body may take to arrive, in seconds (slower: 408)",
    "max_connections": "requests in flight per worker (more: 503 at once; /v2/health/* always answer)",
    "header_timeout_s": "seconds a connection has to send complete request headers, from its start or from the end "
                        "of its previous answer (slower or silent: closed)",
    "timeout_s": "a request's deadline in seconds: its decode loop stops there (504)",
    "switch_interval_ms": "Python's GIL switch interval in each server process, in ms (inference threads wait "
                          "at most this long for the event loop between graph calls)",
    "playground": "the playground page at /: every served model's input and attention, drawn from this API's answers",
    "allowed_hosts": "Host names requests may use, comma-separated, * for any (empty: the bound address and "
                     "localhost; any when bound to 0.0.0.0 or ::)",
    "memory_budget_mb": "memory this process may use, in MiB (0: the container's cgroup limit over --workers, else "
                        "4096); a request whose estimated peak exceeds it, less what the server holds, is 413",
    "model_control": "none: load every version at start-up, then never change; poll: re-scan the repository every "
                     "--repository-poll-s, loading new versions and unloading removed ones; explicit: load only "
                     "--load-model at start-up, then load and unload on POST /v2/repository/models/{name}/load|unload",
    "repository_poll_s": "seconds between re-scans of the repository under --model-control poll",
    "load_model": "under --model-control explicit, a model (folder name) to load at start-up; repeat it for more, "
                  "* for every model (none given: none loaded)",
}


# ---- OpenAPI schema of the protocol (requests are parsed by serving.protocol) --------------------
class TensorInput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any]


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferenceRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[TensorInput]
    outputs: list[RequestedOutput] | None = None


class TensorOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[Any]


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[TensorOutput]


class ErrorResponse(BaseModel):
    error: str


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    optional: bool | None = None  # present (true) only on inputs a request may leave out


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    parameters: dict[str, Any] | None = None  # version, default_version (+ reason), kind, limits


class RepositoryIndexRequest(BaseModel):
    ready: StrictBool | None = None  # true: only models ready to answer (every listed one is)


class RepositoryControlRequest(BaseModel):
    """A load or unload body (its parameters: :data:`CONTROL_PARAMETERS`)."""
    model_config = {"extra": "forbid"}
    parameters: dict[str, Any] | None = None


# The parameters a load or unload takes: Triton's unload_dependents (tritonclient sends it; no model
# here depends on another). Triton's config and file parameters are refused: a model loads as
# publish wrote it.
CONTROL_PARAMETERS = ("unload_dependents",)


class RepositoryIndexEntry(BaseModel):
    name: str
    version: str
    state: str  # READY, LOADING or UNAVAILABLE
    reason: str | None = None  # why a version is not READY (absent when it is)


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class Live(BaseModel):
    live: bool


class Ready(BaseModel):
    ready: bool


class ModelReady(BaseModel):
    name: str
    ready: bool


ERRORS = {400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}, 408: {"model": ErrorResponse},
          409: {"model": ErrorResponse}, 413: {"model": ErrorResponse}, 503: {"model": ErrorResponse},
          504: {"model": ErrorResponse}}
MAX_MESSAGE = 500  # characters of an error message: one never echoes a long input back
UNKNOWN = "_unknown"  # the metrics label of a request for no served model (no model name starts with _)


def error(status: int, message: str) -> JSONResponse:
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    return JSONResponse({"error": message}, status_code=status)


class BodyLimit:
    """ASGI middleware: reject bodies over ``limit`` bytes with 413 before the app parses them, and
    bodies that take longer than ``timeout_s`` to arrive with 408 (a slow sender would otherwise
    hold its buffer for as long as it likes).

    The rest of an oversized body is read and dropped (up to ``drain`` bytes) before the 413 goes
    out: a server that answers and closes while the client is still sending leaves the client with
    a broken pipe instead of the error message.
    """

    def __init__(self, app, limit: int, drain: int = 64 * 2**20, timeout_s: float = 30.0):
        self.app, self.limit, self.drain, self.timeout_s = app, limit, drain, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._read(scope, receive)
        except TimeoutError:
            body = error(408, f"the request body did not arrive within {self.timeout_s:g} s")
        if body is None:  # the client went away
            return None
        if isinstance(body, Response):
            return await body(scope, receive, send)

        async def replay():
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def _read(self, scope, receive) -> bytes | Response | None:
        """The whole body, or the 413 to answer, or None when the client disconnected."""
        declared = dict(scope["headers"]).get(b"content-length")
        declared_size = int(declared) if declared is not None and declared.isdigit() else None
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            more = message.get("more_body", False)
            size += len(message.get("body", b""))
            if size > self.limit or (declared_size or 0) > self.limit:
                while more and size <= self.drain and (declared_size or 0) <= self.drain:
                    message = await receive()
                    if message["type"] != "http.request":
                        return None
                    more = message.get("more_body", False)
                    size += len(message.get("body", b""))
                return error(413, f"request body larger than {self.limit} bytes")
            chunks.append(message.get("body", b""))
        return b"".join(chunks)


LOOPBACK = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
INFER_TYPES = ("application/json", "application/octet-stream")  # what infer reads (or no Content-Type)


def allowed_hosts(cfg: ServeConfig) -> frozenset[str] | None:
    """The Host names this server answers (lower case, no port), or None for any."""
    names = [n.strip().lower().strip("[]") for n in cfg.allowed_hosts.split(",") if n.strip()]
    if "*" in names or (not names and cfg.host in WILDCARDS):
        return None
    return frozenset(names or (cfg.host.lower().strip("[]"), *LOOPBACK))


def _host_name(value: str) -> str:
    """``Host`` without its port: ``[::1]:8000`` -> ``::1``, ``localhost:8000`` -> ``localhost``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    """ASGI middleware: what a web page in the user's browser must not do, refused before any work.
    A Host outside the allow-list is 400 (DNS rebinding: a page whose name now points at this
    server), an ``Origin`` that is not the server's own is 403 (a page elsewhere posting here; the
    server's own playground and command-line clients pass), and infer, load or unload with a
    Content-Type a page may send without asking (text/plain, forms) is 415."""

    def __init__(self, app, hosts: frozenset[str] | None):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)

    def refusal(self, scope) -> Response | None:
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        if self.hosts is not None and _host_name(host) not in self.hosts:
            return error(400, f"Host {host[:80]!r} is not one this server answers ({', '.join(sorted(self.hosts))}); "
                              "use one of those, or start the server with --allowed-hosts")
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1")
            netloc = text.split("://", 1)[1] if "://" in text else None
            if netloc is None or netloc.lower() != host.lower():
                return error(403, f"cross-origin requests are refused: Origin {text[:80]!r} is not this server's "
                                  "own; call the API from a server-side client or from this server's pages")
        action = scope["path"].rsplit("/", 1)[-1]
        if scope["method"] == "POST" and action in ("infer", "load", "unload"):  # what changes or costs something
            kind = headers.get(b"content-type")
            media = kind.decode("latin-1").split(";", 1)[0].strip().lower() if kind is not None else None
            if media is not None and media not in INFER_TYPES:
                return error(415, f"{action} takes Content-Type application/json or application/octet-stream, got "
                                  f"{media[:60]!r}")
        return None


HEALTH = ("/v2/health/live", "/v2/health/ready")


class InFlight:
    """ASGI middleware: at most ``limit`` requests in flight (--max-connections), one more is 503 with
    Retry-After at once; the health endpoints are never counted nor refused, so a flood cannot fail
    a liveness probe. Connections that have not sent a request count for nothing (uvicorn's
    limit_concurrency counted them): :class:`HeaderDeadline` closes them."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.count = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in HEALTH:
            return await self.app(scope, receive, send)
        if self.count >= self.limit:
            response = error(503, f"the server is busy ({self.limit} requests in flight); retry shortly")
            response.headers["Retry-After"] = "1"
            return await response(scope, receive, send)
        self.count += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.count -= 1


class HeaderDeadline(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools) with a deadline on each request's headers: from the
    connection's start, and from the end of each answer on a kept-alive connection, a client has
    ``timeout_keep_alive`` seconds (--header-timeout-s) to complete its headers, or the connection
    is closed. uvicorn's own keep-alive timer stops at the first byte received, so a client that
    sends nothing after connecting, or one header byte now and then, would hold its socket forever."""

    header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # the next request's headers are in already
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self.header_timer = self.loop.call_later(self.timeout_keep_alive, self._expire)

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _expire(self) -> None:
        self.header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def _rss() -> float:
    """This process's resident memory in bytes (0 where /proc is not there)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return 0.0


def check_model_control(cfg: ServeConfig) -> None:
    """RuntimeError (one sentence) for a --model-control combination that cannot work."""
    if cfg.model_control not in MODEL_CONTROL:
        raise RuntimeError(f"--model-control {cfg.model_control!r} is not one of {', '.join(MODEL_CONTROL)}")
    if cfg.model_control == "explicit" and cfg.workers > 1:
        raise RuntimeError("--model-control explicit needs --workers 1: a load or unload request reaches one "
                           "worker process only (use --model-control poll with several workers)")
    if cfg.load_model and cfg.model_control != "explicit":
        raise RuntimeError("--load-model is for --model-control explicit (the other modes load every version)")
    if cfg.model_control == "poll" and not cfg.repository_poll_s > 0:
        raise RuntimeError(f"--repository-poll-s must be above 0, got {cfg.repository_poll_s}")


async def retire(batcher: DynamicBatcher) -> None:
    """Stop an unloaded version's batcher once the requests it holds are answered (each within its deadline)."""
    while batcher.pending:
        await asyncio.sleep(0.05)
    if batcher.worker is not None:
        batcher.worker.cancel()


def lifespan_of(service: Service):
    """What runs beside the app while it serves: gRPC (--grpc-port) and the repository poll."""
    @asynccontextmanager
    async def lifespan(app):
        async with AsyncExitStack() as stack:
            if service.cfg.grpc_port:  # imported only then: grpcio is needed only to serve gRPC
                from serving.grpc_server import grpc_lifespan

                await stack.enter_async_context(grpc_lifespan(service)(app))
            poll = None
            if service.cfg.model_control == "poll":
                poll = asyncio.create_task(service.poll_repository())
                log.info("polling %s for new and removed versions every %g s", service.cfg.repository,
                         service.cfg.repository_poll_s)
            try:
                yield
            finally:
                if poll is not None:
                    poll.cancel()

    return lifespan


def create_app(cfg: ServeConfig | None = None, repository: Repository | None = None) -> FastAPI:
    cfg = cfg or ServeConfig()
    service = Service(cfg, repository)
    # No /docs or /redoc: FastAPI's pages load Swagger UI and ReDoc from a CDN (nothing a served page
    # loads may come from elsewhere); the schema is at /openapi.json for any viewer.
    lifespan = lifespan_of(service) if cfg.grpc_port or cfg.model_control == "poll" else None
    app = FastAPI(title="attnzoo inference server", version=__version__, docs_url=None, redoc_url=None,
                  description="Open Inference Protocol (KServe v2) REST API over attnzoo's ONNX model repository.",
                  lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=int(cfg.max_body_mb * 2**20), timeout_s=cfg.body_timeout_s)
    _add_error_handlers(app)
    _add_server_routes(app, service)
    _add_model_routes(app, service)
    app.openapi = lambda: _openapi(app)
    _add_metrics(app, service.registry)
    if cfg.playground:
        add_playground(app)
    app.add_middleware(InFlight, limit=cfg.max_connections)
    app.add_middleware(Guard, hosts=allowed_hosts(cfg))  # added last: runs first
    return app


class Service:
    """What the routes answer with: the model repository, the threads and admission that run requests,
    the batchers shared across requests, and the Prometheus metrics."""

    def __init__(self, cfg: ServeConfig, repository: Repository | None = None):
        self.cfg = cfg
        self.registry = CollectorRegistry()
        self.batch_rows = Histogram("attnzoo_batch_rows",
                                    "Rows per batched ONNX Runtime call (requests or decode steps)", ["model"],
                                    registry=self.registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        COMPUTE.resize(cfg.infer_threads)
        check_model_control(cfg)
        self.repo = repository or Repository(cfg.repository, cfg.provider, cfg.ort_threads,
                                             wrap=self.step_batching if cfg.step_batching else None,
                                             loop_threads=cfg.loop_ort_threads,
                                             load_all=cfg.model_control != "explicit")
        if repository is None and cfg.model_control == "explicit":
            self.load_at_start(cfg.load_model)
        log.info("serving %d model(s) from %s with %s", len(self.repo.models), cfg.repository,
                 ", ".join(sorted(self.repo.providers)) or "no execution provider (empty repository)")
        for key, why in self.repo.errors.items():
            log.error("not served: %s (%s)", key, why)
        # One thread per admitted request: a decode loop mostly waits for its shared step calls; the
        # CPU-bound work is bounded by COMPUTE, the number of requests by the admission queue.
        self.executor = ThreadPoolExecutor(cfg.running, thread_name_prefix="infer")
        # Request parsing and answer encoding, off the event loop; two at a time bounds the memory of
        # answers being encoded (each is held as arrays and as bytes meanwhile).
        self.codec = ThreadPoolExecutor(2, thread_name_prefix="codec")
        # Jobs queued for or running on those threads: at most --max-queue, beyond that 503 at once.
        self.codec_jobs, self.codec_lock = 0, threading.Lock()
        self.admission = Admission(cfg.running, cfg.max_queue)
        # status: the HTTP status, or for gRPC the HTTP status its code maps from (499: cancelled)
        self.requests = Counter("attnzoo_requests", "Inference requests by model, protocol (rest, grpc) and status",
                                ["model", "protocol", "status"], registry=self.registry)
        self.latency = Histogram("attnzoo_request_seconds", "Inference request latency", ["model", "protocol"],
                                 registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.batchers: dict[tuple[str, int], DynamicBatcher] = {}
        self.retiring: set[asyncio.Task] = set()  # batchers of unloaded versions, waiting for their requests
        # Requests share what this process may use less what it holds now, its models loaded: the
        # largest admitted request fits beside the server itself (docs/security.md has the measurement).
        limit, held = cfg.memory_budget_mb * 2**20 or memory_limit() / max(cfg.workers, 1), _rss()
        self.memory = MemoryPool(max(limit - held, 0.0))
        # Versions loaded or unloaded later move the budget by their files' size (what their sessions
        # hold, about): measuring the process again would count the requests running then too.
        self.memory_base = self.memory.budget
        self.loaded_at_start = self.repo.loaded_bytes() if isinstance(self.repo, Repository) else 0  # else a stand-in
        log.info("memory budget for requests: %.0f MiB (limit %.0f MiB less %.0f MiB held)",
                 self.memory.budget / 2**20, limit / 2**20, held / 2**20)

    def load_at_start(self, names: list[str]) -> None:
        """--model-control explicit: the --load-model models (``*``: every model folder)."""
        repo = self.repo
        if "*" in names:
            names = sorted({name for name, _ in repo.on_disk()})
        for name in names:
            try:
                repo.load(name)
            except RequestError as err:
                raise RuntimeError(f"--load-model {name}: {err}") from None
        for (name, version), (state, why) in repo.states.items():
            if state == "UNAVAILABLE":
                repo.errors[f"{name}/{version}"] = why

    async def control(self, action: str, name: str, parameters: dict | None = None) -> None:
        """POST /v2/repository/models/{name}/load|unload (and gRPC's RepositoryModelLoad|Unload): the
        work runs in a thread, the event loop answering other requests meanwhile."""
        unknown = sorted(set(parameters or {}) - set(CONTROL_PARAMETERS))
        if unknown:
            raise RequestError(f"parameters {unknown[:5]} are not taken (only {', '.join(CONTROL_PARAMETERS)}): a "
                               "model loads as publish wrote it")
        mode = self.cfg.model_control
        if mode != "explicit":
            raise RequestError(f"explicit model {action} is not allowed under --model-control {mode}; start the "
                               "server with --model-control explicit", status=409)
        model, dot, _ = name.partition(".")
        if dot:
            raise RequestError(f"'{name[:80]}' is a graph of model '{model[:80]}': {action} '{model[:80]}' (its "
                               "graphs go with it)", status=404)
        if action == "load":
            refused = await asyncio.to_thread(self.repo.load, name)
            self.after_change([])
            if refused:
                raise RequestError(f"model '{name}': {len(refused)} version(s) not loaded: {refused[0]}")
        else:
            self.after_change(await asyncio.to_thread(self.repo.unload, name))

    async def poll_repository(self) -> None:
        """--model-control poll: re-scan the repository every --repository-poll-s, in a thread."""
        while True:
            await asyncio.sleep(self.cfg.repository_poll_s)
            try:
                removed = await asyncio.to_thread(self.repo.poll)
            except Exception as err:  # a folder removed while being read: try again next period
                log.error("polling the model repository %s failed (retried in %g s): %s: %s", self.cfg.repository,
                          self.cfg.repository_poll_s, type(err).__name__, err)
                continue
            self.after_change(removed)

    def after_change(self, removed: list[ServedModel]) -> None:
        """On the event loop, after versions were loaded or unloaded: the unloaded versions' batchers
        are retired once their queued requests are answered (a version loaded again gets new ones),
        and the memory budget follows what the loaded versions hold."""
        for model in removed:
            batcher = self.batchers.pop((model.name, model.version), None)
            if batcher is not None:  # the loop keeps only a weak reference to a task: hold it until done
                task = asyncio.get_running_loop().create_task(retire(batcher))
                self.retiring.add(task)
                task.add_done_callback(self.retiring.discard)
        self.memory.budget = max(self.memory_base - (self.repo.loaded_bytes() - self.loaded_at_start), 0.0)

    def step_batching(self, model: str, graphs: dict) -> dict:
        """A looping model's graphs, shared across requests: greedy seq2seq decoding runs in one
        continuously batched loop where the step graph allows it, every other loop's graph calls
        are step-batched."""
        cfg, observe = self.cfg, self.batch_rows.labels(model).observe
        wrapped = {g: StepBatcher(graph, cfg.max_step_rows, cfg.step_delay_ms / 1000, observe)
                   for g, graph in graphs.items()}
        if {"encoder", "decoder_step"} <= graphs.keys() and GreedyScheduler.eligible(graphs["decoder_step"]):
            wrapped["decoder_step"].greedy = GreedyScheduler(graphs["encoder"], graphs["decoder_step"],
                                                             cfg.max_step_rows, observe)
        return wrapped

    def metadata(self, name: str, version: str | None):
        repo = self.repo
        if not repo.versions(name):  # 404 naming the served models (an empty model folder too)
            repo.get(name)
        model = repo.get(name, version) if version is not None else None
        default, why = repo.default(name)
        if model is None:
            model = repo.get(name, str(default) if default is not None else str(max(repo.versions(name))))
        # Beyond the protocol's fields: which version a request without one gets and why, the kind
        # of input the model takes and its limits (over a limit: HTTP 413), and the model's own
        # (the names along an output's axis: ServedModel.labels).
        described = model.metadata(repo.versions(name))
        return {**described, "parameters": {
            **described.get("parameters", {}), "version": str(model.version),
            "default_version": None if default is None else str(default),
            "default_version_reason": why.format(name=name, version=max(repo.versions(name))),
            "kind": model.kind, "limits": model.limits.as_json(), "memory": model.memory.as_json(),
            "memory_budget_bytes": int(self.memory.budget)}}

    def label(self, name: str) -> str:
        """The metrics label of a request: its model, or one label for every name not served (a
        label per name a client invents would grow /metrics and memory without limit)."""
        return name if name in self.repo.models else UNKNOWN

    def model_ready(self, name: str, version: str | None):
        self.repo.get(name, version)
        return {"name": name, "ready": True}

    async def infer(self, name: str, version: str | None, request: Request) -> Response:
        """One REST inference request."""
        raw, headers = await request.body(), request.headers

        def parse(model: ServedModel) -> tuple:
            feeds, wanted, params, as_binary, request_id = self.parse(model, raw, headers)
            return feeds, wanted, params, (as_binary, request_id)

        def encode(model: ServedModel, outputs: list, extra: tuple):
            as_binary, request_id = extra
            header = {"model_name": model.name, "model_version": str(model.version)}
            if request_id is not None:
                header["id"] = request_id
            return self.encode(model, header, outputs, as_binary, headers.get("accept-encoding"))

        content, out_headers = await self.handle(name, version, "rest", self.cfg.timeout_s, parse, encode)
        return Response(content, headers=out_headers)

    async def handle(self, name: str, version: str | None, protocol: str, timeout_s: float, parse, encode):
        """One inference request of either protocol: ``parse(model)`` -> (feeds, wanted outputs,
        parameters, extra) and ``encode(model, [(name, array, datatype)], extra)`` -> the answer run on
        codec threads, the model between them after the same admission and batchers, all within
        ``timeout_s`` (parsing and encoding count too); counted in the metrics under ``protocol``."""
        started, status, label = time.perf_counter(), 500, self.label(name)  # before the version may be unloaded
        deadline = (time.monotonic() + timeout_s, timeout_s)
        try:
            model = self.repo.get(name, version)
            # Parsing and encoding run in their own threads: the event loop keeps answering others.
            feeds, wanted, params, extra = await self.in_codec(deadline, parse, model)
            # 413 when its estimated memory exceeds the budget (its lengths now known), before it runs
            need = model.check_memory({k: np.shape(v) for k, v in feeds.items()}, feeds, params, self.memory.budget)
            # 503 + Retry-After when the waiting room is full; the memory held waits within the deadline
            async with self.admission.turn(), self.memory.hold(need, deadline):
                # the loop itself stops at its deadline (504); the grace covers the last step
                outs = await asyncio.wait_for(self.run_model(model, feeds, params, timeout_s), timeout_s + 5)
            outputs = [(n, *outs[n]) for n in wanted]
            # the answer's size, known now, within the model's limit before either protocol encodes it
            over_limit("the answer's size in values", sum(int(np.size(a)) for _, a, _ in outputs), "output_elements",
                       model.limits.output_elements)
            answer = await self.in_codec(deadline, encode, model, outputs, extra)
            status = 200
            return answer
        except RequestError as err:
            status = err.status
            raise
        except TimeoutError:
            status = 504
            raise RequestError(f"inference took longer than {timeout_s} s", status=504) from None
        except asyncio.CancelledError:  # the client went away (a cancelled gRPC call)
            status = 499
            raise
        finally:
            self.requests.labels(label, protocol, str(status)).inc()
            self.latency.labels(label, protocol).observe(time.perf_counter() - started)

    async def in_codec(self, deadline: tuple[float, float], work, *args):
        """``work(*args)`` on a codec thread under the request's deadline: a job that waited past it
        is not started (504), one running stops at its next check, and at most ``--max-queue`` jobs
        wait or run at once (503 with Retry-After beyond, at once)."""
        with self.codec_lock:
            if self.codec_jobs >= self.cfg.max_queue:
                raise RequestError("the server is busy (request parsing queue full); retry shortly", status=503,
                                   headers={"Retry-After": "1"})
            self.codec_jobs += 1

        def run():
            with deadline_carried(deadline):
                check_deadline()
                return work(*args)

        def done(_):
            with self.codec_lock:
                self.codec_jobs -= 1

        job = self.codec.submit(run)
        job.add_done_callback(done)  # also when cancelled before it started
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job), max(deadline[0] - time.monotonic(), 0.0))
        except TimeoutError:
            raise DeadlineExceeded(deadline[1]) from None

    def parse(self, model: ServedModel, raw: bytes, http_headers) -> tuple:
        """A request body -> (feeds, wanted outputs, parameters, binary outputs, id), checked: against
        the model's limits on the shapes it declares (413 before its data is read), then by
        serving.protocol, not by pydantic (one pass over possibly large data, JSON or JSON + binary
        tensor data, maybe gzipped)."""
        raw = decode_body(raw, http_headers.get("content-encoding"), int(self.cfg.max_body_mb * 2**20),
                          check_deadline)
        body, binary = read_request(raw, http_headers.get(HEADER_LENGTH), model.inputs)
        params = body.get("parameters") if isinstance(body, dict) else None
        shapes = declared_shapes(body, model.inputs)
        model.check_limits(shapes, params if isinstance(params, dict) else {})
        model.check_memory(shapes, None, params if isinstance(params, dict) else {}, self.memory.budget)
        feeds, wanted, params = parse_request(body, model.inputs, model.outputs, binary)
        return feeds, wanted, params, binary_outputs(body, wanted), body.get("id")  # a string (check_fields)

    @staticmethod
    def encode(model: ServedModel, header: dict, outputs: list, as_binary: set, accept: str | None):
        """The answer's bytes (its size already checked against the model's limit by :meth:`handle`)."""
        return encode_response(header, outputs, as_binary, accept)

    @staticmethod
    def _infer(model: ServedModel, feeds: dict, params: dict, timeout_s: float) -> dict:
        with deadline_scope(timeout_s):
            return model.infer(feeds, params)

    async def run_model(self, model: ServedModel, feeds: dict, params: dict, timeout_s: float | None = None) -> dict:
        cfg = self.cfg
        try:
            if isinstance(model, GraphModel) and model.batchable:
                if len({a.shape[0] for a in feeds.values()}) != 1:
                    raise RequestError("all inputs must have the same size on axis 0 (the batch)")
                key = (model.name, model.version)
                if key not in self.batchers:
                    self.batchers[key] = DynamicBatcher(model.infer, self.executor, cfg.max_batch,
                                                        cfg.batch_delay_ms / 1000, cfg.max_queue,
                                                        self.batch_rows.labels(model.name).observe)
                return await self.batchers[key].infer(feeds)
            return await asyncio.get_running_loop().run_in_executor(
                self.executor, self._infer, model, feeds, params, cfg.timeout_s if timeout_s is None else timeout_s)
        except RequestError:
            raise
        except Exception as err:  # ONNX Runtime rejects what the declared shapes cannot (e.g. ids out of range)
            log.warning("%s rejected a request: %s", model.name, err)
            raise RequestError(f"the model could not run on this input: {str(err).splitlines()[0][:300]}") from None


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(_, err: RequestError):
        response = error(err.status, str(err))
        response.headers.update(err.headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"invalid request: {first.get('msg', 'malformed body')}" + (f" at {where}" if where else ""))

    @app.exception_handler(HTTPException)
    async def _http(_, err: HTTPException):
        return error(err.status_code, str(err.detail))


INDEX_DOC = {"requestBody": {"required": False, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/RepositoryIndexRequest"}}}}}


def _add_server_routes(app: FastAPI, service: Service) -> None:
    """The server's own endpoints: its metadata, health, and the repository index and control."""
    @app.get("/v2", response_model=ServerMetadata)
    async def server_metadata():
        return {"name": "attnzoo", "version": __version__, "extensions": ["binary_tensor_data", "model_repository"]}

    @app.post("/v2/repository/index", response_model=list[RepositoryIndexEntry], response_model_exclude_none=True,
              responses=ERRORS, openapi_extra=INDEX_DOC)
    async def repository_index(request: Request):
        """Triton's model repository index: the protocol has no other way to list what is served.
        Every served version is READY; a version being loaded is LOADING, one refused, unloaded or
        removed is UNAVAILABLE with its reason ("ready": true lists the READY ones only). The body is
        read whatever its Content-Type, as for infer (a command-line client's ``-d '{}'`` says form data)."""
        body = _control_body(await request.body(), RepositoryIndexRequest, "repository index")
        return service.repo.index(ready_only=bool(body.ready))

    @app.post("/v2/repository/models/{name}/load", responses=ERRORS)
    async def load_model(name: str, request: Request):
        """Triton's model load (--model-control explicit): every version of the model folder not
        served yet is loaded; answers when done."""
        body = _control_body(await request.body(), RepositoryControlRequest, "model load")
        await service.control("load", name, body.parameters)
        return {}

    @app.post("/v2/repository/models/{name}/unload", responses=ERRORS)
    async def unload_model(name: str, request: Request):
        """Triton's model unload (--model-control explicit): new requests get 404 at once; those
        already admitted finish on the version."""
        body = _control_body(await request.body(), RepositoryControlRequest, "model unload")
        await service.control("unload", name, body.parameters)
        return {}

    @app.get("/v2/health/live", response_model=Live)
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready", response_model=Ready, responses={503: {"model": Ready}})
    async def ready():
        ok = bool(service.repo.models) and not service.repo.errors
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


def _control_body(raw: bytes, schema: type[BaseModel], what: str):
    """A repository request's optional JSON body, checked (400 naming the field at fault)."""
    try:
        return schema.model_validate_json(raw or b"{}")
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise RequestError(f"invalid {what} request: {first['msg']}" + (f" at {where}" if where else "")) from None


BINARY_DOC = ("the binary tensor data extension (application/octet-stream): the JSON, its length in bytes in "
              "Inference-Header-Content-Length, then the raw bytes of each tensor that has "
              "parameters.binary_data_size, in order (little-endian, row-major; BOOL 1 byte; BYTES elements "
              "a 4-byte little-endian length, then the bytes).")
HEADER_DOC = [
    {"name": "Inference-Header-Content-Length", "in": "header", "required": False, "schema": {"type": "integer"},
     "description": "Length of the JSON at the start of an application/octet-stream body; 0: the whole body "
                    "is the raw data of the model's one input."},
    {"name": "Content-Encoding", "in": "header", "required": False,
     "schema": {"type": "string", "enum": ["gzip", "deflate", "identity"]}},
    {"name": "Accept-Encoding", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "gzip or deflate: the response comes compressed."}]
BODY_DOC = {"requestBody": {"required": True, "description": "JSON, or " + BINARY_DOC, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/InferenceRequest"}},
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
    "parameters": HEADER_DOC,
    "responses": {"200": {"description": "JSON unless binary outputs were asked for (parameters.binary_data "
                                         "per output, binary_data_output per request): then " + BINARY_DOC,
                          "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                              "format": "binary"}}}}}}


def _add_model_routes(app: FastAPI, service: Service) -> None:
    """Per model (and version): metadata, readiness, inference."""
    @app.get("/v2/models/{name}", response_model=ModelMetadata, response_model_exclude_none=True, responses=ERRORS)
    async def model_metadata(name: str):
        return service.metadata(name, None)

    @app.get("/v2/models/{name}/versions/{version}", response_model=ModelMetadata, response_model_exclude_none=True,
             responses=ERRORS)
    async def model_version_metadata(name: str, version: str):
        return service.metadata(name, version)

    @app.get("/v2/models/{name}/ready", response_model=ModelReady, responses=ERRORS)
    async def ready_model(name: str):
        return service.model_ready(name, None)

    @app.get("/v2/models/{name}/versions/{version}/ready", response_model=ModelReady, responses=ERRORS)
    async def ready_model_version(name: str, version: str):
        return service.model_ready(name, version)

    @app.post("/v2/models/{name}/infer", response_model=InferenceResponse, responses=ERRORS, openapi_extra=BODY_DOC)
    async def infer_latest(name: str, request: Request):
        return await service.infer(name, None, request)

    @app.post("/v2/models/{name}/versions/{version}/infer", response_model=InferenceResponse, responses=ERRORS,
              openapi_extra=BODY_DOC)
    async def infer_version(name: str, version: str, request: Request):
        return await service.infer(name, version, request)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document plus the request schema, which it cannot see (the body is read raw)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schema = InferenceRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        components.update(schema.pop("$defs", {}))
        components["InferenceRequest"] = schema
        components["RepositoryIndexRequest"] = RepositoryIndexRequest.model_json_schema()
        app.openapi_schema = doc
    return app.openapi_schema


def _add_metrics(app: FastAPI, registry: CollectorRegistry) -> None:
    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # --workers N: add up every worker's counts
            from prometheus_client import multiprocess

            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)
            return Response(generate_latest(merged), media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


PLAYGROUND = Path(__file__).resolve().with_name("playground")
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8"}
# The browser itself keeps the page to this server: no script, style, image or request elsewhere
# (the page works offline and a tampered input cannot make it call out).
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; object-src 'none'; "
                                           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def add_playground(app: FastAPI) -> None:
    """``GET /`` (the page) and ``GET /playground/{file}`` (its script and style sheet). The files
    are read once, here; a request names one of them by its bare name, never a path, so nothing
    outside serving/playground/ can be served."""
    found = sorted(PLAYGROUND.iterdir()) if PLAYGROUND.is_dir() else []  # an install without the page's files
    files = {p.name: (p.read_bytes(), MEDIA_TYPES[p.suffix]) for p in found if p.is_file() and p.suffix in MEDIA_TYPES}
    if "index.html" not in files:
        log.warning("no playground page in %s: / is not served", PLAYGROUND)
        return

    def page(name: str) -> Response:
        if name not in files:
            return error(404, f"no playground file '{name[:80]}'; files: {sorted(files)}")
        content, media_type = files[name]
        return Response(content, media_type=media_type, headers=PAGE_HEADERS)

    @app.get("/", include_in_schema=False)
    async def index():
        return page("index.html")

    @app.get("/playground/{name}", include_in_schema=False)
    async def playground_file(name: str):
        return page(name)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def app_from_env() -> FastAPI:
    """uvicorn factory for ``--workers N``: each worker process builds its own app and sessions."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # a fresh process: configure its logging too
    cfg = ServeConfig(**json.loads(os.environ.get(ENV_CONFIG, "{}")))
    sys.setswitchinterval(cfg.switch_interval_ms / 1000)
    return create_app(cfg)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    defaults = ServeConfig()
    ap = argparse.ArgumentParser(description="Serve the published models over the Open Inference Protocol.")
    for key, value in asdict(defaults).items():
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, bool):  # --step-batching / --no-step-batching (type=bool would take "False" as true)
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=value,
                            help=f"{HELP[key]} (default: on)" if value else f"{HELP[key]} (default: off)")
            continue
        if isinstance(value, list):  # --load-model, repeated
            ap.add_argument(flag, action="append", default=[], metavar=key.split("_")[-1].upper(), help=HELP[key])
            continue
        ap.add_argument(flag, type=type(value), default=value, help=f"{HELP[key]} (default %(default)s)",
                        choices={"provider": PROVIDERS, "model_control": MODEL_CONTROL}.get(key))
    cfg = ServeConfig(**vars(ap.parse_args(argv)))
    sys.setswitchinterval(cfg.switch_interval_ms / 1000)  # the server's process (workers: app_from_env)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        check_model_control(cfg)
        if cfg.workers == 1:
            app = create_app(cfg)
        else:
            os.environ[ENV_CONFIG] = json.dumps(asdict(cfg))
            # Workers write their metrics to files here (set before they import prometheus_client),
            # so whichever worker answers /metrics reports the whole server.
            os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="attnzoo-metrics-"))
            if not os.path.isdir(cfg.repository):  # fail here, once, rather than in every worker
                raise FileNotFoundError(f"no model repository at {cfg.repository}: run `dvc repro` (publish) first")
            app = "serving.server:app_from_env"
    except (FileNotFoundError, RuntimeError) as err:
        raise SystemExit(f"error: {err}") from None
    # No limit_concurrency: it counts idle and half-open connections too (InFlight counts requests);
    # HeaderDeadline closes connections that do not send their headers in time.
    uvicorn.run(app, host=cfg.host, port=cfg.port, workers=cfg.workers, factory=cfg.workers > 1,
                http=HeaderDeadline, timeout_keep_alive=cfg.header_timeout_s, log_level="info")


if __name__ == "__main__":
    main()
