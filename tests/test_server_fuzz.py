"""Property-based fuzzing (hypothesis) of every endpoint of a real server process on loopback.

The endpoints come from the running server's own ``/openapi.json`` (every path and method in it,
plus /metrics, the health endpoints, FastAPI's docs pages and a few paths that do not exist), their
path parameters from the served models (read from the repository) and from hostile strings. The
inference bodies are built from the protocol's ``InferenceRequest`` schema in that document and from
each model's declared inputs, then mutated: impossible shapes, deeply nested data, wrong datatypes
and values, missing and extra fields, binary tensor data with lying lengths, corrupt compression,
bodies that are not JSON at all. Several thousand requests, deterministic (derandomized hypothesis),
every loop bounded in count and in time.

Whatever the request, the answer must not be a 5xx (or no answer), the log must hold no traceback,
the server must still be live afterwards and its memory must not have grown without bound. Every
offending request is collected (not just the first): the assertion message lists the distinct ones,
the smallest of each kind, with the exception line the server logged for it.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import subprocess
import threading
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote, urlsplit

import numpy as np
import pytest
import requests
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT, wait_for
from tests.ports import assert_loopback_only
from tests.test_serving_production import start_server, stop

pytestmark = pytest.mark.integration  # starts servers or processes

MIN_REQUESTS = 5000
TIMEOUT = (5, 30)  # connect, read: per request, seconds
FUZZ_BUDGET_S = 85.0  # all phases together; each phase also has its own cap below
RSS_GROWTH_LIMIT = 300 * 2**20
MAX_BODY_MB = 1  # the server's --max-body-mb: oversized bodies stay cheap to send

DATATYPES = ["BOOL", "BYTES", "FP16", "FP32", "FP64", "INT8", "INT16", "INT32", "INT64",
             "UINT8", "UINT16", "UINT32", "UINT64"]
NUMPY = {"BOOL": "?", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8", "INT8": "i1", "INT16": "<i2", "INT32": "<i4",
         "INT64": "<i8", "UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8"}
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]

# Model folders that serve nothing: no version folder at all, only stray files, or a name the
# repository never loads (a leading underscore or dot).
HOLLOW = {"hollow": [], "hollow_files": ["README.md", "notes/"], "_hidden": [], ".hidden": []}
HOSTILE_NAMES = [
    "nope", "hollow", "hollow_files", "_hidden", ".hidden", "bahdanau.nope", "bahdanau.", ".encoder",
    "bahdanau..encoder", "BAHDANAU", "bahdanau ", " bahdanau", "bahdanau\n", "bahdanau\x00", "x" * 300,
    "y" * 9000, "é" * 60, "模型", "🙂", "\u202e", "\ufeff", "\x00", "\t", "null", "None", "undefined", "true",
    "-1", "0", "1", "NaN", "__init__", "__proto__", "constructor", "{name}", "%s%s%n", "${jndi:ldap://x}",
    "<script>", "';--", "a/b", "../bahdanau", "..", ".", "%2e%2e", "bahdanau/../ntm", "ntm/versions/1",
    "config.pbtxt", "ntm/1", "model_repository", "*", "?", "#",
]
# Path segments sent exactly as written (not percent-encoded again).
RAW_SEGMENTS = [
    "..", ".", "%2e%2e", "%2E%2E%2F", "%2f", "a%2Fb", "%00", "%ff", "%C3%A9", "%25", "%", "%zz", "",
    "bahdanau%2F..%2Fntm", "..%2F..%2Fetc%2Fpasswd", ";", "bahdanau;v=1", "bahdanau%3Bx", "ntm%2Fversions%2F1",
    "%u0041", "%%32%65", "bahdanau%00", "bahdanau%0a", "~", "%7E", "ntm.init%20",
]
HOSTILE_VERSIONS = [
    "-1", "0", "99999999999999999999", "abc", "1.0", "01", "001", "1e3", "+1", " 1", "1 ", "0x1", "²", "٣", "１",
    "999999999", "9999999999", str(2**31), str(2**63 - 1), str(2**63), str(2**64), "-0", "", "1/..", "..", "%2e%2e",
    "NaN", "Infinity", "true", "null", "1" * 5000, "v1", "latest", "*",
]
TEXTS = ["Wo ist der Hund?", "Ich habe keine Zeit.", "", " ", "🙂" * 10, "\x00", "a" * 2001, "ü" * 500, "\u202e",
         "<unk>", "</s>", "x " * 1000, "Der Hund schläft. " * 20, "\n\t\r", "1 2 3", "wie viele Zeilen?"]
HOSTILE_SHAPES = [
    [], [0], [-1], [-1, 6], [1, -6], [2**31], [2**31, 6], [2**32, 2**32], [2**63], [2**63 - 1], [2**64], [2**64 + 1],
    [2**65], [0, 2**63, 5], [0, 2**64], [0, 2**63], [2**63, 0], [0, 2**31, 2**31, 2**31], [2**62, 4], [2**62, 2**62],
    [3037000500, 3037000500], [-(2**63)], [-(2**64)], [1] * 32, [1] * 33, [1] * 64, [1] * 65, [1] * 100, [0] * 65,
    [0] * 100, [1, 2**63 - 1], [1, 0, 2**63], [2**63 - 1, 2], [0, -1], [1, 1, 1, 2**40],
]
KEY_DEPTHS = [1, 2, 10, 32, 33, 64, 65, 100, 500, 900, 960, 970, 975, 980, 985, 990, 995, 1000, 1010, 1020, 1022,
              1023, 1024, 1025, 1100, 2000, 4999, 5000]


class Raw(str):
    """JSON text written into a body verbatim (NaN, Infinity, overlong numbers, lone surrogates)."""


@dataclass(frozen=True)
class Deep:
    """``inner`` wrapped in ``depth`` JSON arrays, written without recursion."""

    depth: int
    inner: Any


HOSTILE_VALUES = [1e300, -1e300, Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw("-1e999"),
                  Raw("1E400"), Raw("1e-400"), 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, -(2**64), 10**100,
                  Raw("1" * 5000), "1.0", "", "abc", None, True, False, {}, [], [[]], 1.5, -0.0, 0, -1, 255, 256,
                  65536, Raw('"\\ud800"'), "\x00", Raw("-"), Raw("0x10"), Raw("01")]


BROWSER_HEADERS = {
    "Origin": ["null", "http://evil.example", "http://127.0.0.1:{port}", "http://localhost:{port}", "file://",
               "http://127.0.0.1", "https://127.0.0.1:{port}", "", "http://[::1]:{port}", "://", "x" * 300],
    "Host": ["evil.example", "127.0.0.1:{port}", "localhost", "[::1]:{port}", "[::1", "", ":", "127.0.0.1:x",
             "LOCALHOST:{port}", "a" * 300, "127.0.0.1:{port}:1"],
    "Content-Type": ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                     "multipart/form-data; boundary=x", "application/json", "APPLICATION/JSON; charset=utf-8",
                     "application/octet-stream", "", ";", "application/json;", "*/*"],
}
# Every field of an inference request (REST JSON and the binary extension's JSON header), each sent
# with every JSON type.
FIELD_PATHS = [("id",), ("parameters",), ("parameters", "binary_data_output"), ("inputs",), ("inputs", 0),
               ("inputs", 0, "name"), ("inputs", 0, "shape"), ("inputs", 0, "shape", 0), ("inputs", 0, "datatype"),
               ("inputs", 0, "parameters"), ("inputs", 0, "parameters", "binary_data_size"), ("inputs", 0, "data"),
               ("inputs", 0, "data", 0), ("outputs",), ("outputs", 0), ("outputs", 0, "name"),
               ("outputs", 0, "parameters"), ("outputs", 0, "parameters", "binary_data"),
               ("parameters", "decode"), ("parameters", "beam")]
JSON_TYPES = [None, True, False, 0, 3, -1, 1.5, "", "FP32", [], ["x"], [1], {}, {"name": "x"}]


def set_field(body: dict, path: tuple, value: Any) -> None:
    """``body`` with the field at ``path`` set to ``value`` (containers on the way made as needed)."""
    target: Any = body
    for key in path[:-1]:
        if isinstance(target, dict):
            target = target.setdefault(key, {} if isinstance(key, str) else [])
        elif isinstance(target, list) and isinstance(key, int) and key < len(target):
            target = target[key]
        else:
            return
    if isinstance(target, dict):
        target[path[-1]] = value
    elif isinstance(target, list) and isinstance(path[-1], int) and path[-1] < len(target):
        target[path[-1]] = value


def dumps(obj: Any) -> str:
    """JSON text of ``obj`` (ASCII), with :class:`Raw` and :class:`Deep` as they say."""
    if isinstance(obj, Raw):
        return str(obj)
    if isinstance(obj, Deep):
        return "[" * obj.depth + dumps(obj.inner) + "]" * obj.depth
    if isinstance(obj, dict):
        return "{" + ",".join(json.dumps(str(k)) + ":" + dumps(v) for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in obj) + "]"
    return json.dumps(obj)


def describe(obj: Any, width: int = 40) -> str:
    """A short, readable repr of a request body for the failure report."""
    if isinstance(obj, Raw):
        return str(obj) if len(obj) <= width else f"{str(obj)[:12]}…({len(obj)} chars)"
    if isinstance(obj, Deep):
        return f"[×{obj.depth} {describe(obj.inner)} ]×{obj.depth}"
    if isinstance(obj, str):
        return repr(obj) if len(obj) <= width else f"{obj[:12]!r}…({len(obj)} chars)"
    if isinstance(obj, bool) or obj is None:
        return repr(obj)
    if isinstance(obj, int):
        if abs(obj) < 10**22:
            return str(obj)
        return f"<{len(str(abs(obj)))}-digit int>"
    if isinstance(obj, float):
        return repr(obj)
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        head = ", ".join(describe(v) for v in obj[:6])
        return f"[{head}, …{len(obj)} items]" if len(obj) > 6 else f"[{head}]"
    if isinstance(obj, (bytes, bytearray)):
        text = bytes(obj[:60])
        return f"{text!r}" + (f"…({len(obj)} bytes)" if len(obj) > 60 else "")
    return repr(obj)[:width]


def segment(text: str) -> str:
    return quote(text, safe="")


def prod(shape: Any) -> int | None:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        return None
    return math.prod(shape)


def nest(flat: list, shape: list[int]) -> Any:
    """``flat`` laid out in nested lists of ``shape`` (row-major)."""
    if not shape:
        return flat[0] if flat else []
    if len(shape) == 1:
        return list(flat)
    step = math.prod(shape[1:])
    if step == 0:
        return [nest([], shape[1:]) for _ in range(shape[0])]
    return [nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def to_bytes(datatype: str, flat: list) -> bytes:
    """Binary tensor data as the extension lays it out (little-endian; BYTES: 4-byte length + UTF-8)."""
    if datatype == "BYTES":
        parts = []
        for value in flat:
            raw = str(value).encode("utf-8", "surrogatepass")
            parts += [len(raw).to_bytes(4, "little"), raw]
        return b"".join(parts)
    try:
        with np.errstate(all="ignore"):
            return np.asarray(flat, dtype=NUMPY.get(datatype, "<f4")).tobytes()
    except (ValueError, TypeError, OverflowError):
        return bytes(len(flat) * np.dtype(NUMPY.get(datatype, "<f4")).itemsize)


def vm_rss(pid: int) -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024


# ---- the server's log -----------------------------------------------------------------------------
FRAME = re.compile(r'\s*File "([^"]+)", line (\d+), in (\S+)')
FATAL = re.compile(r"Fatal Python error[^\n]*|terminate called[^\n]*|Segmentation fault|core dumped|double free"
                   r"|AddressSanitizer|std::bad_alloc|Killed")


def exceptions_in(lines: list[str]) -> list[tuple[str, str]]:
    """(exception line, innermost frame in this repository's code) of each traceback in ``lines``."""
    found, inside, where = [], False, ""
    for line in lines:
        text = line.rstrip("\n")
        if "Traceback (most recent call last)" in text:
            inside, where = True, ""
            continue
        if not inside:
            continue
        frame = FRAME.match(text)
        if frame:
            path = frame.group(1)
            if path.startswith(str(ROOT)) and "/.venv/" not in path and "site-packages" not in path:
                where = f"{Path(path).relative_to(ROOT)}:{frame.group(2)} in {frame.group(3)}"
            continue
        if text and not text[0].isspace():
            if text.startswith(("During handling", "The above exception")):
                continue
            found.append((text[:300], where))
            inside = False
    return found


class LogTail:
    """Reads the server's combined stdout/stderr as it comes, so the pipe never fills up."""

    def __init__(self, stream, copy: Path):
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.copy = copy  # the whole log, also on disk, for a look after a failure
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        with open(self.copy, "w") as out:
            for line in stream:
                out.write(line)
                with self.lock:
                    self.lines.append(line)

    def size(self) -> int:
        with self.lock:
            return len(self.lines)

    def since(self, mark: int) -> list[str]:
        with self.lock:
            return self.lines[mark:]

    def text(self) -> str:
        with self.lock:
            return "".join(self.lines)

    def exception_after(self, mark: int, wait_s: float) -> tuple[str, str] | None:
        """The last exception logged after line ``mark``, waiting up to ``wait_s`` for it (the
        server writes the traceback just after it sends the 500)."""
        found = wait_for(lambda: exceptions_in(self.since(mark)), wait_s, every_s=0.005)
        return found[-1] if found else None


MAX_RESTARTS = 10  # a request that kills the server is recorded, the server started again (this often)


class Servers:
    """Server processes over one repository, one at a time: a fresh one replaces one that died."""

    def __init__(self, repo: Path):
        self.repo, self.runs = repo, []

    def start(self) -> SimpleNamespace:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PYTHONUNBUFFERED", "1")  # log lines arrive as written: tracebacks match requests
            srv = start_server(self.repo, "--host", "127.0.0.1", "--max-body-mb", str(MAX_BODY_MB),
                               "--timeout-s", "10")
        srv.log = LogTail(srv.proc.stdout, self.repo.parent / f"server-{len(self.runs)}.log")
        srv.rss_start, srv.checked = vm_rss(srv.proc.pid), 0
        self.runs.append(srv)
        return srv

    @property
    def current(self) -> SimpleNamespace:
        return self.runs[-1]

    def log_text(self) -> str:
        return "".join(srv.log.text() for srv in self.runs)

    def close(self) -> str:
        """Stop them all; what the current one logged while it shut down."""
        for srv in self.runs:
            srv.proc.terminate()
            try:
                srv.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                srv.proc.kill()
                srv.proc.wait()
            srv.log.thread.join(timeout=10)
            stop(srv)  # the pipe is drained already: this only closes it
        return "".join(self.current.log.since(self.current.checked)) if self.runs else ""


@pytest.fixture(scope="module")
def fuzz_server(published, tmp_path_factory):
    """The published models (linked: the shared repository is left as it is) plus model folders that
    serve nothing, served by a real server process on 127.0.0.1 whose output is read as it comes."""
    repo = tmp_path_factory.mktemp("fuzz") / "model_repository"
    repo.mkdir()
    for model in sorted(p for p in published.repo.iterdir() if p.is_dir()):
        (repo / model.name).symlink_to(model, target_is_directory=True)
    for name, contents in HOLLOW.items():
        (repo / name).mkdir()
        for item in contents:
            if item.endswith("/"):
                (repo / name / item).mkdir()
            else:
                (repo / name / item).write_text("not a model\n")
    (repo / "stray.txt").write_text("not a model folder\n")
    servers = Servers(repo)
    servers.start()
    try:
        yield servers
    finally:
        shutdown = servers.close()
        assert "Traceback" not in shutdown, shutdown[-3000:]


# ---- sending and recording ------------------------------------------------------------------------
class PhaseOver(Exception):
    """A phase's time is up: raised out of the hypothesis loop, which ends it."""


class ServerDied(Exception):
    """The server process exited more often than it may be restarted: fuzzing stops."""


@dataclass
class Failure:
    endpoint: str  # "METHOD /template"
    path: str
    body: str
    headers: dict
    status: int  # 0: no response at all
    error: str  # the server's exception line, or why no response came
    where: str


INTERESTING_HEADERS = ("inference-header-content-length", "content-encoding", "content-type", "accept-encoding",
                       "transfer-encoding")


def crash_keys(method: str, path: str, body: Any, doc: Any) -> list[tuple]:
    """What identifies a request that killed the server, so that its like is not sent again: the
    request itself, and (for JSON requests) the model with the number of rows of each input."""
    keys: list[tuple] = []
    if isinstance(body, (bytes, bytearray)):
        keys.append((method, path, hash(bytes(body))))
    model = re.match(r"/v2/models/([^/]+)", path)
    if isinstance(doc, dict) and isinstance(doc.get("inputs"), list):
        rows = []
        for tensor in doc["inputs"]:
            if isinstance(tensor, dict):
                shape = tensor.get("shape")
                rows.append((str(tensor.get("name"))[:50], str(shape[0] if isinstance(shape, list) and shape
                                                               else shape)[:50]))
        keys.append((method, model.group(1) if model else path, tuple(sorted(rows))))
    return keys


class Fuzzer:
    def __init__(self, servers: Servers, budget_end: float):
        self.servers = servers
        self.restart_lock = threading.Lock()
        self.session = requests.Session()
        self.lock = threading.Lock()
        self.sent = self.skipped = self.resent = 0
        self.by_endpoint: Counter = Counter()
        self.statuses: Counter = Counter()
        self.failures: list[Failure] = []
        self.deadline, self.budget_end = math.inf, budget_end
        self.dead = False
        self.silent: Counter = Counter()  # 5xx per endpoint that came without a traceback
        self.killers: set[tuple] = set()  # crash_keys of the requests that killed the server
        self.phases: dict[str, str] = {}  # phase -> "requests in seconds"

    def send(self, endpoint: str, method: str, path: str, body: Any = None, headers: dict | None = None,
             shown: str | None = None, doc: Any = None, session: requests.Session | None = None,
             correlate: bool = True) -> int | None:
        """One request; a 5xx or no answer is recorded with what the server logged for it. ``doc``:
        the JSON (as built) of a JSON or binary request, for the report and :func:`crash_keys`."""
        if self.dead:
            raise ServerDied
        if time.monotonic() > self.deadline:
            raise PhaseOver
        keys = crash_keys(method, path, body, doc)
        if self.killers.intersection(keys):  # the same crash again would only cost a restart
            with self.lock:
                self.skipped += 1
            return None
        session = session or self.session
        srv = self.servers.current
        mark = srv.log.size()
        request = session.prepare_request(requests.Request(method, srv.url + "/", data=body, headers=headers or {}))
        request.url = srv.url + path  # exactly this path: no dot-segment removal, no re-quoting
        status, error = self.exchange(session, request)
        if status == 0 and not self.exited(srv) and isinstance(body, (bytes, bytearray, type(None))):
            # Maybe a kept-alive connection the server had just closed: once more, on a fresh one.
            session.close()
            status, again = self.exchange(session, request)
            if status:
                with self.lock:
                    self.resent += 1
            else:
                error = f"{error}; again on a fresh connection: {again}"
        with self.lock:
            self.sent += 1
            self.by_endpoint[endpoint] += 1
            self.statuses[status] += 1
        if status >= 500 or status == 0:
            session.close()  # the server may close the connection after this: never reuse it
            wait = 1.0 if correlate and self.silent[endpoint] < 3 else 0.0
            found = srv.log.exception_after(mark, wait) if correlate else None
            if found is None and status:
                self.silent[endpoint] += 1
            exc, where = found or ("", "")
            if shown is None:
                shown = (describe(doc) if doc is not None else describe(body)
                         if isinstance(body, (bytes, bytearray)) else "(iterator body)" if body is not None else "")
            shown_headers = {k: v for k, v in (request.headers or {}).items() if k.lower() in INTERESTING_HEADERS}
            died = status == 0 and self.exited(srv)
            if died:
                last = [line.strip() for line in srv.log.since(mark) if line.strip()][-1:] or [""]
                error = (f"the server process exited ({srv.proc.returncode}) on this request, its last words "
                         f"{last[0][:200]!r}; {error}" if correlate else
                         f"the server process exited ({srv.proc.returncode}) while this request was in flight "
                         "with others (not necessarily the one that killed it)")
            with self.lock:
                self.failures.append(Failure(endpoint, path[:200], shown[:400], shown_headers, status,
                                             error or exc or "(no traceback in the log)", where))
                if died and correlate:
                    self.killers.update(keys)
            if died:
                self.restart(srv)
        return status

    @staticmethod
    def exchange(session: requests.Session, request: requests.PreparedRequest) -> tuple[int, str]:
        """(status, "") or (0, why no response came)."""
        try:
            response = session.send(request, timeout=TIMEOUT, allow_redirects=False)
            _ = response.content
            return response.status_code, ""
        except requests.RequestException as err:
            return 0, f"no response: {type(err).__name__}: {str(err)[:160]}"

    @staticmethod
    def exited(srv: SimpleNamespace) -> bool:
        try:
            srv.proc.wait(timeout=0.5)  # a process that is dying takes a moment to be gone
        except subprocess.TimeoutExpired:
            pass
        return srv.proc.poll() is not None

    def restart(self, dead: SimpleNamespace) -> None:
        """A fresh server for the one that died (the time it takes is not the phase's)."""
        with self.restart_lock:
            if self.servers.current is not dead:  # another thread restarted it already
                return
            if len(self.servers.runs) > MAX_RESTARTS:
                self.dead = True
                raise ServerDied
            began = time.monotonic()
            self.servers.start()
            took = time.monotonic() - began
            self.deadline += took
            self.budget_end += took

    def run(self, phase, seconds: float) -> None:
        """Run one hypothesis-driven phase until it is done or its time is up (or the server died)."""
        if self.dead:
            return
        began, sent = time.monotonic(), self.sent
        self.deadline = min(began + seconds, self.budget_end)
        try:
            phase()
        except (PhaseOver, ServerDied):
            pass
        finally:
            self.deadline = math.inf
            name = getattr(phase, "__name__", "phase")
            self.phases[name] = f"{self.sent - sent} in {time.monotonic() - began:.1f} s"


def fuzz_settings(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck),
                    verbosity=Verbosity.quiet, report_multiple_bugs=False, print_blob=False)


# ---- bodies ---------------------------------------------------------------------------------------
def from_schema(schema: dict, components: dict, overrides: dict, owner: str = "") -> st.SearchStrategy:
    """A hypothesis strategy for the JSON a JSON schema (as FastAPI writes it) describes.
    ``overrides[(owner title, property)]`` replaces the strategy of one property."""
    if "$ref" in schema:
        target = components[schema["$ref"].rsplit("/", 1)[-1]]
        return from_schema(target, components, overrides, target.get("title", ""))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components, overrides, owner) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        title = schema.get("title", owner)

        def prop(key, sub):
            override = overrides.get((title, key))
            return override if override is not None else from_schema(sub, components, overrides, title)

        fixed = st.fixed_dictionaries({k: prop(k, v) for k, v in props.items() if k in required},
                                      optional={k: prop(k, v) for k, v in props.items() if k not in required})
        if schema.get("additionalProperties"):
            extra = st.dictionaries(st.text(max_size=12), json_leaves(), max_size=3)
            return st.tuples(extra, fixed).map(lambda pair: {**pair[0], **pair[1]})
        return fixed
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components, overrides, owner), max_size=4)
    if kind == "string":
        return st.text(max_size=24)
    if kind == "integer":
        return st.integers()
    if kind == "number":
        return st.floats(allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return json_values()


def json_leaves() -> st.SearchStrategy:
    return st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                     st.text(max_size=16), st.sampled_from(HOSTILE_VALUES))


def json_values() -> st.SearchStrategy:
    return st.recursive(json_leaves(), lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                               st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                        max_leaves=12)


def palette(datatype: str) -> st.SearchStrategy:
    """A few plausible values of ``datatype`` that the data cycles through."""
    if datatype == "BYTES":
        value = st.one_of(st.sampled_from(TEXTS), st.text(max_size=24))
    elif datatype == "BOOL":
        value = st.booleans()
    elif datatype.startswith(("INT", "UINT")):
        value = st.one_of(st.integers(0, 6), st.integers(0, 2**7 - 1))
    else:
        value = st.one_of(st.sampled_from([0.0, 0.5, 1.0, -0.5, 0.25, 1e-6]), st.floats(-1, 1, width=32))
    return st.lists(value, min_size=1, max_size=4)


def draw_inputs(data, meta: dict) -> list[dict]:
    """Inputs as the model declares them: its names and datatypes, small shapes with the same
    number of rows (axis 0) and the same length (other free axes) across inputs."""
    rows = data.draw(st.sampled_from([1, 1, 1, 2, 3, 0]))
    length = data.draw(st.sampled_from([1, 2, 3, 4, 5, 8, 0, 17]))
    inputs = []
    for spec in meta["inputs"]:
        if spec.get("optional") and data.draw(st.booleans()):
            continue
        shape = [rows if i == 0 and d == -1 else (length if d == -1 else d) for i, d in enumerate(spec["shape"])]
        if meta.get("kind") == "audio" and spec["name"] == "audio" and len(shape) == 2:
            shape[1] = data.draw(st.sampled_from([0, 1, 400, 1600, 3200]))
        if meta.get("kind") == "text_image" and spec["name"] == "image" and len(shape) == 3:
            shape[2] = data.draw(st.sampled_from([0, 1, 8, 32, 64]))
        while math.prod(shape) > 20000 and shape and shape[0] > 1:
            shape[0] -= 1
        values = data.draw(palette(spec["datatype"]))
        flat = [values[i % len(values)] for i in range(math.prod(shape))]
        inputs.append({"name": spec["name"], "shape": shape, "datatype": spec["datatype"],
                       "data": nest(flat, shape) if data.draw(st.booleans()) else flat})
    return inputs


def flat_of(tensor: dict) -> list:
    out: list = []

    def walk(x):
        if isinstance(x, list):
            for item in x:
                walk(item)
        elif isinstance(x, Deep):
            walk(x.inner)
        else:
            out.append(x)

    walk(tensor.get("data", []))
    return out


def mutate(data, body: dict, meta: dict) -> None:
    """One hostile change to ``body`` (in place)."""
    inputs = body.get("inputs") if isinstance(body.get("inputs"), list) else []
    tensors = [t for t in inputs if isinstance(t, dict)]
    tensor = data.draw(st.sampled_from(tensors)) if tensors else None
    outputs = [o["name"] for o in meta.get("outputs", [])] or ["out"]
    kind = data.draw(st.sampled_from(["shape", "shape", "nest", "nest", "datatype", "value", "value", "drop",
                                      "extra", "id", "parameters", "parameters", "outputs", "outputs",
                                      "input_parameters", "inputs_container", "rename"]))
    if kind == "shape" and tensor is not None:
        shape = data.draw(st.one_of(
            st.sampled_from(HOSTILE_SHAPES),
            st.lists(st.sampled_from([0, 1, 2, 3, -1, 2**31, 2**63, 2**64]), max_size=100),
            st.integers(0, 100).map(lambda k: [1] * k),
            st.integers(0, 100).map(lambda k: [0] * k),
            st.sampled_from(["3", 3, None, [1.5], [True], ["2"], [[2]], {"0": 1}, [1e300], [Raw("NaN")]])))
        tensor["shape"] = shape
        how = data.draw(st.sampled_from(["keep", "empty", "fit"]))
        n = prod(shape)
        if how == "empty":
            tensor["data"] = []
        elif how == "fit" and n is not None and 0 <= n <= 64:
            values = flat_of(tensor) or [0]
            tensor["data"] = [values[i % len(values)] for i in range(n)]
    elif kind == "nest" and tensor is not None:
        depth = data.draw(st.one_of(st.sampled_from(KEY_DEPTHS), st.integers(1, 5000)))
        where = data.draw(st.sampled_from(["data", "data", "data", "flat", "parameters", "id", "outputs", "shape"]))
        if where == "data":
            tensor["data"] = Deep(depth, tensor.get("data", []))
        elif where == "flat":
            tensor["data"] = Deep(depth, flat_of(tensor))
        elif where == "parameters":
            body["parameters"] = {"decode": Deep(depth, "beam")}
        elif where == "id":
            body["id"] = Deep(depth, "x")
        elif where == "outputs":
            body["outputs"] = Deep(depth, {"name": outputs[0]})
        else:
            tensor["shape"] = Deep(depth, tensor.get("shape", [1]))
    elif kind == "datatype" and tensor is not None:
        tensor["datatype"] = data.draw(st.sampled_from(DATATYPES + ["FOO", "fp32", "", "FP32 ", "BF16", "STRING",
                                                                    "INT128", None, 5, [], {}]))
    elif kind == "value" and tensor is not None:
        flat = flat_of(tensor)
        value = data.draw(st.sampled_from(HOSTILE_VALUES))
        if flat and data.draw(st.booleans()):
            flat[data.draw(st.integers(0, len(flat) - 1))] = value
            tensor["data"] = flat
        else:
            tensor["data"] = data.draw(st.sampled_from([value, [value], flat + [value], [[value]]]))
    elif kind == "drop":
        if tensor is not None and data.draw(st.booleans()):
            tensor.pop(data.draw(st.sampled_from(["name", "shape", "datatype", "data"])), None)
        else:
            body.pop(data.draw(st.sampled_from(["inputs", "parameters", "outputs", "id"])), None)
    elif kind == "extra":
        what = data.draw(st.sampled_from(["top", "tensor", "duplicate", "unknown_input", "many_inputs"]))
        if what == "top":
            body[data.draw(st.sampled_from(["foo", "inputs ", "Inputs", "model_name", "__proto__"]))] = \
                data.draw(json_values())
        elif what == "tensor" and tensor is not None:
            tensor[data.draw(st.sampled_from(["foo", "Data", "contents", "raw_input_contents"]))] = \
                data.draw(json_values())
        elif what == "duplicate" and tensor is not None:
            inputs.append(dict(tensor))
        elif what == "unknown_input":
            inputs.append({"name": "nonexistent", "shape": [1], "datatype": "FP32", "data": [0.5]})
        elif tensor is not None:
            inputs.extend(dict(tensor, name=f"x{i}") for i in range(data.draw(st.integers(2, 200))))
    elif kind == "id":
        body["id"] = data.draw(st.sampled_from([5, 1.5, True, [], {}, None, "", "x" * 10000, "é🙂\x00", Raw("NaN"),
                                                "req-1", 2**64]))
    elif kind == "parameters":
        body["parameters"] = data.draw(st.one_of(
            st.sampled_from([[], "x", 5, None, True, {}, {"shared_memory_region": "r"}, {"classification": 2}]),
            st.fixed_dictionaries({}, optional={
                "decode": st.sampled_from(["beam", "greedy", "foo", None, 5, "", "BEAM"]),
                "beam": st.sampled_from([0, -1, 1, 2, 3, 16, 17, 100, 2**31, 2**63, 2**64, 1.5, "3", None, True,
                                         1e300]),
                "nbest": st.sampled_from([0, 1, 2, 3, 17, -1, 2**63, "2", None, True]),
                "binary_data_output": st.sampled_from([True, False, "true", 1, None]),
                "max_len": st.sampled_from([-1, 0, 1, 2**63, "5"]),
                "timeout": st.sampled_from([0, -1, 1e300, "x"]),
            })))
    elif kind == "outputs":
        name = data.draw(st.sampled_from(outputs))
        body["outputs"] = data.draw(st.sampled_from([
            {}, "x", [1], [None], [{}], [{"name": 5}], [{"name": "nonexistent"}], [{"name": name}],
            [{"name": name, "parameters": {"binary_data": True}}],
            [{"name": name, "parameters": {"binary_data": "yes"}}],
            [{"name": name, "parameters": {"classification": 3}}], [{"name": name, "parameters": []}],
            [{"name": name, "parameters": {"shared_memory_region": "r"}}], [{"name": name}, {"name": name}],
            [{"name": o, "parameters": {"binary_data": True}} for o in outputs], [{"name": o} for o in outputs],
            [{"name": name, "parameters": {"binary_data": True}}, {"name": "nonexistent"}], []]))
        if data.draw(st.booleans()):
            body.setdefault("parameters", {})
            if isinstance(body["parameters"], dict):
                body["parameters"]["binary_data_output"] = data.draw(st.booleans())
    elif kind == "input_parameters" and tensor is not None:
        tensor["parameters"] = data.draw(st.sampled_from([
            [], "x", 5, None, {}, {"binary_data_size": 0}, {"binary_data_size": -1}, {"binary_data_size": 10**30},
            {"binary_data_size": "4"}, {"binary_data_size": 4.0}, {"shared_memory_region": "r"},
            {"shared_memory_byte_size": 4}, {"content_type": "str"}]))
    elif kind == "inputs_container":
        body["inputs"] = data.draw(st.sampled_from([[], {}, "x", None, 5, [1], [[]], [None], [{}], [[{}]],
                                                    {"name": "x"}, [{"name": None}]]))
    elif kind == "rename" and tensor is not None:
        names = [s["name"] for s in meta.get("inputs", [])] or ["x"]
        tensor["name"] = data.draw(st.sampled_from(["", "X", " x", "x ", "\x00", "n" * 5000, "名前", 5, None, [],
                                                    *names]))


# ---- the test -------------------------------------------------------------------------------------
def test_fuzz_every_endpoint(fuzz_server):
    servers = fuzz_server
    srv = servers.current
    started = time.monotonic()
    budget_end = started + FUZZ_BUDGET_S
    port = urlsplit(srv.url).port
    assert_loopback_only(port)
    fz = Fuzzer(servers, budget_end)

    # -- what the server says it serves: the endpoints (its OpenAPI document), the models (the repository)
    doc = requests.get(srv.url + "/openapi.json", timeout=TIMEOUT).json()
    fz.sent += 1
    routes = sorted((method.upper(), path) for path, ops in doc["paths"].items() for method in ops)
    assert {("GET", "/v2/models/{name}"), ("POST", "/v2/models/{name}/versions/{version}/infer")} <= set(routes)
    components = doc["components"]["schemas"]
    request_schema = components["InferenceRequest"]
    versions: dict[str, list[str]] = {}
    for model in sorted(p for p in servers.repo.iterdir() if p.is_dir()):
        for version in sorted(p for p in model.iterdir() if p.is_dir() and p.name.isdigit()):
            if (version / "metadata.json").is_file():
                versions.setdefault(model.name, []).append(version.name)
                for graph in sorted(version.glob("*.onnx")):
                    versions.setdefault(f"{model.name}.{graph.stem}", []).append(version.name)
    metas = {}
    for name in versions:
        response = requests.get(f"{srv.url}/v2/models/{segment(name)}", timeout=TIMEOUT)
        fz.sent += 1
        if response.status_code == 200:
            metas[name] = {**response.json(), "kind": response.json().get("parameters", {}).get("kind")}
    assert len(metas) >= 20, sorted(metas)  # every kind of model, and their graphs
    served = sorted(metas)
    extra_routes = [("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"),
                    ("GET", "/docs/oauth2-redirect"), ("GET", "/"), ("GET", "/v2/"), ("GET", "/v2/models"),
                    ("GET", "/v2/models/"), ("GET", "/v2/health"), ("GET", "/v2/health/live/"),
                    ("GET", "/v2/repository/index"), ("POST", "/v2/repository/index"),
                    ("POST", "/v2/repository/models/{name}/load"), ("GET", "/v2/models/{name}/stats"),
                    ("GET", "/v2/models/{name}/config"), ("POST", "/v2/models/{name}/generate"),
                    ("POST", "/v1/models/{name}:predict"), ("GET", "/v2/models/{name}/versions"),
                    ("GET", "/v2/models/{name}/versions/{version}/infer"), ("GET", "/metrics/"),
                    ("GET", "/v2/models/{name}/ready/"), ("GET", "//v2"), ("GET", "/v2/../v2"), ("GET", "/%2e%2e/v2")]
    all_routes = routes + extra_routes

    def good_body(name: str) -> bytes:
        """A plausible request for ``name`` (small, deterministic): real inference on the fuzz path."""
        inputs = []
        for spec in metas[name]["inputs"]:
            if spec.get("optional"):
                continue
            shape = [1 if i == 0 and d == -1 else (4 if d == -1 else d) for i, d in enumerate(spec["shape"])]
            if metas[name]["kind"] == "audio" and spec["name"] == "audio":
                shape = [1, 3200]
            if metas[name]["kind"] == "text_image" and spec["name"] == "image":
                shape[2] = 32
            value = {"BYTES": "Wo ist der Hund?", "BOOL": False}.get(spec["datatype"], 1 if "INT" in spec["datatype"]
                                                                    else 0.5)
            inputs.append({"name": spec["name"], "shape": shape, "datatype": spec["datatype"],
                           "data": [value] * math.prod(shape)})
        return dumps({"inputs": inputs}).encode()

    goods = {name: good_body(name) for name in served}
    name_segments = st.one_of(st.sampled_from(served).map(segment), st.sampled_from(served).map(segment),
                              st.sampled_from(list(HOLLOW) + HOSTILE_NAMES).map(segment),
                              st.sampled_from(RAW_SEGMENTS), st.text(max_size=30).map(segment))
    version_segments = st.one_of(st.sampled_from(["1", "2"]), st.sampled_from(HOSTILE_VERSIONS).map(segment),
                                 st.sampled_from(HOSTILE_VERSIONS), st.integers(-(2**70), 2**70).map(str),
                                 st.text(max_size=12).map(segment))

    def fill(template: str, data, name: str | None = None) -> str:
        """``template``'s path parameters: ``name`` (percent-encoded) or a drawn name; a drawn version."""
        path = template
        if "{name}" in path:
            path = path.replace("{name}", segment(name) if name is not None else data.draw(name_segments))
        if "{version}" in path:
            path = path.replace("{version}", data.draw(version_segments))
        return path

    def infer_path(data, name: str) -> tuple[str, str]:
        """An infer endpoint of ``name``: without a version, with a real one or with a hostile one."""
        how = data.draw(st.sampled_from(["latest", "real", "real", "hostile"]))
        if how == "latest":
            return "POST /v2/models/{name}/infer", f"/v2/models/{segment(name)}/infer"
        version = (data.draw(st.sampled_from(versions.get(name, ["1"]))) if how == "real"
                   else data.draw(version_segments))
        return ("POST /v2/models/{name}/versions/{version}/infer",
                f"/v2/models/{segment(name)}/versions/{version}/infer")

    # -- 0. every route once for every served and hollow name, and the fixed endpoints --------------------
    def sweep():
        for method, template in all_routes:
            names = served + list(HOLLOW) if "{name}" in template else [None]
            for name in names:
                for version in (versions.get(name, ["1"]) + ["0"] if "{version}" in template else [None]):
                    path = template.replace("{name}", segment(name or "")).replace("{version}", version or "")
                    body = goods.get(name, b"{}") if method == "POST" else None
                    fz.send(f"{method} {template}", method, path, body)
        for _ in range(20):
            for path in ("/metrics", "/v2", "/v2/health/live", "/v2/health/ready"):
                fz.send(f"GET {path}", "GET", path)

    fz.run(sweep, 15)

    # -- the listed extremes, each surely sent once (hypothesis below explores around them) ---------------
    def post_changed(name: str, change, binary: bytes | None = None, header: str | None = None) -> None:
        """``name``'s plausible request with ``change`` made to its first input; binary data after
        the JSON when ``binary`` is given (the header says the JSON's length unless ``header``)."""
        body = json.loads(goods[name])
        change(body["inputs"][0])
        head = dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if binary is not None or header is not None:
            headers = {"Content-Type": "application/octet-stream",
                       "Inference-Header-Content-Length": header if header is not None else str(len(head))}
        fz.send("POST /v2/models/{name}/infer", "POST", f"/v2/models/{segment(name)}/infer",
                head + (binary or b""), headers, doc=body)

    def edges():
        for name in [n for n in ("act", "ntm", "bahdanau", "ocr", "draw.step", "programmer") if n in metas]:
            first = json.loads(goods[name])["inputs"][0]
            flat, blob = first["data"], to_bytes(first["datatype"], first["data"])
            size = len(blob)
            for shape in HOSTILE_SHAPES:
                n = prod(shape)
                post_changed(name, lambda t, shape=shape: t.update(shape=shape, data=[]))
                if n is not None and 0 < n <= 64:
                    post_changed(name, lambda t, shape=shape, data=(flat * n)[:n]: t.update(shape=shape, data=data))
                post_changed(name, lambda t, shape=shape: (t.update(shape=shape, parameters={"binary_data_size": 0}),
                                                           t.pop("data")), binary=b"")
            for depth in sorted(set(KEY_DEPTHS) | set(range(950, 1030, 4))):
                post_changed(name, lambda t, depth=depth: t.update(data=Deep(depth, t["data"])))
            for datatype in DATATYPES + ["FOO", "", None, 5]:
                post_changed(name, lambda t, datatype=datatype: t.update(datatype=datatype))
            for value in HOSTILE_VALUES:
                post_changed(name, lambda t, value=value: t.update(data=[value] + t["data"][1:]))
            for lie in (size, size + 1, size - 1, 0, -1, 2**64, "4", 1.5, None):
                post_changed(name, lambda t, lie=lie: (t.update(parameters={"binary_data_size": lie}), t.pop("data")),
                             binary=blob)
            for header in ("-1", "abc", str(10**20), "", "1e3", "0x10", "+5", "²", "99999999999999999999"):
                post_changed(name, lambda t, size=size: (t.update(parameters={"binary_data_size": size}),
                                                         t.pop("data")), binary=blob, header=header)

    fz.run(edges, 15)

    # -- every field of the request schema with every JSON type (JSON body and binary header) ------------
    def fields():
        for name in [n for n in ("act", "ntm", "bahdanau", "programmer", "draw.step") if n in metas]:
            for binary in (False, True):
                for path in FIELD_PATHS:
                    if binary and path[:3] == ("inputs", 0, "data"):
                        continue
                    for value in JSON_TYPES:
                        body = json.loads(goods[name])
                        body.setdefault("outputs", [{"name": metas[name]["outputs"][0]["name"]}])
                        body.setdefault("parameters", {})
                        blob = b""
                        if binary:
                            first = body["inputs"][0]
                            blob = to_bytes(first["datatype"], first.pop("data"))
                            first["parameters"] = {"binary_data_size": len(blob)}
                        set_field(body, path, value)
                        head = dumps(body).encode()
                        headers = {"Content-Type": "application/json"}
                        if binary:
                            headers = {"Content-Type": "application/octet-stream",
                                       "Inference-Header-Content-Length": str(len(head))}
                        fz.send("POST /v2/models/{name}/infer", "POST", f"/v2/models/{segment(name)}/infer",
                                head + blob, headers, doc=body)

    fz.run(fields, 12)

    # -- 1. the endpoints, path parameters and methods fuzzed ---------------------------------------------
    @fuzz_settings(1400)
    @given(st.data())
    def endpoints(data):
        method, template = data.draw(st.sampled_from(all_routes))
        if data.draw(st.integers(0, 7)) == 0:
            method = data.draw(st.sampled_from(METHODS))
        name = data.draw(st.sampled_from(served)) if data.draw(st.integers(0, 3)) == 0 else None
        path = fill(template, data, name)
        body = None
        if method in ("POST", "PUT", "PATCH"):
            body = data.draw(st.sampled_from([None, b"", b"{}", goods.get(name, b'{"inputs": []}'),
                                              goods[data.draw(st.sampled_from(served))]]))
        headers = {"Accept-Encoding": data.draw(st.sampled_from(["gzip", "deflate", "identity", "br", "gzip;q=abc",
                                                                 "deflate;q=1e999, gzip;q=0.5", "*", ""]))}
        for header, values in BROWSER_HEADERS.items():  # what a web page (or DNS rebinding) would send
            if data.draw(st.integers(0, 3)) == 0:
                printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20)
                value = data.draw(st.one_of(st.sampled_from(values), printable))
                headers[header] = value.replace("{port}", str(port)).strip()  # no leading space: requests refuses
        fz.send(f"{method} {template}", method, path, body, headers)

    fz.run(endpoints, 16)

    # -- 2. inference bodies generated from the protocol's InferenceRequest schema ------------------------
    input_names = sorted({s["name"] for m in metas.values() for s in m["inputs"]})
    output_names = sorted({s["name"] for m in metas.values() for s in m["outputs"]})
    overrides = {
        ("TensorInput", "name"): st.one_of(st.sampled_from(input_names), st.text(max_size=12)),
        ("TensorInput", "datatype"): st.one_of(st.sampled_from(DATATYPES + ["FOO", "", "fp32"]), st.text(max_size=8)),
        ("TensorInput", "shape"): st.one_of(st.lists(st.integers(0, 4), max_size=4), st.sampled_from(HOSTILE_SHAPES),
                                            st.lists(st.integers(), max_size=6)),
        ("TensorInput", "data"): st.lists(st.one_of(json_leaves(), st.lists(json_leaves(), max_size=4)), max_size=12),
        ("RequestedOutput", "name"): st.one_of(st.sampled_from(output_names), st.text(max_size=12)),
    }
    schema_bodies = from_schema(request_schema, components, overrides, "InferenceRequest")

    @fuzz_settings(800)
    @given(st.data())
    def schema(data):
        name = data.draw(st.one_of(st.sampled_from(served), st.sampled_from(list(HOLLOW) + ["nope"])))
        body = data.draw(schema_bodies)
        if data.draw(st.booleans()) and name in metas:  # shapes that agree with the data, for the model's inputs
            for tensor in body["inputs"]:
                flat = flat_of(tensor)
                spec = next((s for s in metas[name]["inputs"] if s["name"] == tensor["name"]), None)
                tensor["shape"] = [len(flat)] if spec is None or len(spec["shape"]) <= 1 else [1, len(flat)]
        endpoint, path = infer_path(data, name)
        fz.send(endpoint, "POST", path, dumps(body).encode(), {"Content-Type": "application/json"}, doc=body)

    fz.run(schema, 9)

    # -- 3. each model's declared inputs, mutated ---------------------------------------------------------
    @fuzz_settings(1500)
    @given(st.data())
    def mutated(data):
        name = data.draw(st.sampled_from(served))
        body: dict = {"inputs": draw_inputs(data, metas[name])}
        for _ in range(data.draw(st.sampled_from([0, 1, 1, 1, 2, 2, 3]))):
            mutate(data, body, metas[name])
        endpoint, path = infer_path(data, name)
        fz.send(endpoint, "POST", path, dumps(body).encode(), {"Content-Type": "application/json"}, doc=body)

    fz.run(mutated, 24)

    # -- 4. binary tensor data: the header length, binary_data_size and the bytes disagreeing --------------
    @fuzz_settings(750)
    @given(st.data())
    def binary(data):
        name = data.draw(st.sampled_from(served))
        endpoint, path = infer_path(data, name)
        if data.draw(st.integers(0, 4)) == 0:  # a raw request: the whole body is the one input's data
            payload = data.draw(st.one_of(st.binary(max_size=300), st.sampled_from([b"", b"\x00" * 24, b"\xff" * 7])))
            header = data.draw(st.sampled_from(["0", "00", "0", "-0"]))
            fz.send(endpoint, "POST", path, payload, {"Inference-Header-Content-Length": header,
                                                      "Content-Type": "application/octet-stream"})
            return
        body: dict = {"inputs": draw_inputs(data, metas[name])}
        if not body["inputs"]:
            return
        if data.draw(st.integers(0, 3)) == 0:
            mutate(data, body, metas[name])
        blobs = []
        for tensor in body["inputs"] if isinstance(body.get("inputs"), list) else []:
            if not isinstance(tensor, dict) or not data.draw(st.integers(0, 3)):
                continue
            blob = to_bytes(str(tensor.get("datatype")), flat_of(tensor))
            tensor.pop("data", None)
            size: Any = len(blob)
            lie = data.draw(st.sampled_from(["none"] * 6 + ["+1", "-1", "zero", "huge", "2**64", "str", "float",
                                                           "neg", "null", "bool", "list"]))
            size = {"+1": size + 1, "-1": size - 1, "zero": 0, "huge": 10**12, "2**64": 2**64, "str": str(size),
                    "float": float(size), "neg": -size - 1, "null": None, "bool": True, "list": [size]}.get(lie, size)
            if data.draw(st.integers(0, 5)) == 0:
                tensor["shape"] = data.draw(st.sampled_from(HOSTILE_SHAPES))
                size, blob = (0, b"") if data.draw(st.booleans()) else (size, blob)
            tensor["parameters"] = {"binary_data_size": size}
            if data.draw(st.integers(0, 9)) == 0:
                tensor["data"] = [0]  # both data and binary data
            blobs.append(blob)
        if data.draw(st.booleans()):
            body["parameters"] = {"binary_data_output": True}
        head = dumps(body).encode()
        payload = head + b"".join(blobs)
        tail = data.draw(st.sampled_from(["as is"] * 5 + ["cut", "junk"]))
        payload = payload[:-3] if tail == "cut" else payload + b"junk" if tail == "junk" else payload
        header = data.draw(st.sampled_from(["valid"] * 6 + ["+1", "-1", "neg", "whole+1", "huge", "abc", "", "1e3",
                                                           "0x10", "+5", "5 ", "²", "absent", "0", "2**64"]))
        n = len(head)
        value = {"valid": str(n), "+1": str(n + 1), "-1": str(n - 1), "neg": str(-n), "whole+1": str(len(payload) + 1),
                 "huge": str(10**20), "2**64": str(2**64), "absent": None}.get(header, header)
        headers = {"Content-Type": data.draw(st.sampled_from(["application/octet-stream", "application/json", None]))}
        if value is not None:
            headers["Inference-Header-Content-Length"] = value
        fz.send(endpoint, "POST", path, payload, headers, shown=f"{describe(body)} + {len(payload) - n} bytes",
                doc=body)

    fz.run(binary, 9)

    # -- 5. compressed bodies: valid, corrupt, truncated, bombs, unknown codings ------------------------
    bomb = gzip.compress(b'{"inputs": [], "pad": "' + b" " * (MAX_BODY_MB * 2**20 + 4096) + b'"}', 9)

    @fuzz_settings(550)
    @given(st.data())
    def compressed(data):
        name = data.draw(st.sampled_from(served))
        endpoint, path = infer_path(data, name)
        if data.draw(st.booleans()):
            plain, body = goods[name], json.loads(goods[name])
        else:
            body = {"inputs": draw_inputs(data, metas[name])}
            if data.draw(st.booleans()):
                mutate(data, body, metas[name])
            plain = dumps(body).encode()
        coding = data.draw(st.sampled_from(["gzip"] * 4 + ["deflate"] * 4 + [
            "GZIP", "x-gzip", "br", "compress", "zstd", "identity", "gzip, gzip", "gzip, deflate", "identity, gzip",
            "gzip;q=1", "*", "", "deflate, identity"]))
        zipped = gzip.compress(plain) if "deflate" not in coding.lower() else zlib.compress(plain)
        how = data.draw(st.sampled_from(["valid"] * 4 + ["truncated", "flipped", "junk tail", "random", "empty",
                                                         "bomb", "double", "raw deflate", "two members", "plain",
                                                         "header only"]))
        if how == "truncated":
            zipped = zipped[: data.draw(st.integers(0, max(0, len(zipped) - 1)))]
        elif how == "flipped":
            at = data.draw(st.integers(0, len(zipped) - 1))
            zipped = zipped[:at] + bytes([zipped[at] ^ 0xFF]) + zipped[at + 1 :]
        elif how == "junk tail":
            zipped += data.draw(st.binary(min_size=1, max_size=32))
        elif how == "random":
            zipped = data.draw(st.binary(max_size=200))
        elif how == "empty":
            zipped = b""
        elif how == "bomb":
            zipped = bomb
        elif how == "double":
            zipped = gzip.compress(zipped)
        elif how == "raw deflate":
            packer = zlib.compressobj(6, zlib.DEFLATED, -15)
            zipped = packer.compress(plain) + packer.flush()
        elif how == "two members":
            zipped = gzip.compress(plain[: len(plain) // 2]) + gzip.compress(plain[len(plain) // 2 :])
        elif how == "plain":
            zipped = plain
        elif how == "header only":
            zipped = zipped[:10]
        headers = {"Content-Encoding": coding, "Content-Type": "application/json",
                   "Accept-Encoding": data.draw(st.sampled_from(["gzip", "deflate", "identity", "br", "gzip;q=0",
                                                                 "gzip;q=abc", "*", ""]))}
        if data.draw(st.integers(0, 5)) == 0:
            headers["Inference-Header-Content-Length"] = data.draw(st.sampled_from([str(len(plain)), "0", "-1", "x"]))
        fz.send(endpoint, "POST", path, zipped, headers, shown=f"{how} {coding!r} of {describe(body)}", doc=body)

    fz.run(compressed, 7)

    # -- 6. bodies that are not JSON, empty, chunked, oversized; odd content types --------------------
    raw_bodies = [b"", b" ", b"\n", b"null", b"true", b"1", b"-1", b"1e999", b'"x"', b"[]", b"[{}]", b"{}", b"{",
                  b"}", b"{]", b'{"inputs"', b'{"inputs":}', b"\xef\xbb\xbf{}", '{"inputs":[]}'.encode("utf-16"),
                  b"\x00" * 16, b"\xff" * 16, b"<?xml version='1.0'?><a/>", b"a=1&b=2",
                  b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--x--", b'{"inputs":[]}{"inputs":[]}',
                  b'{"inputs":[]} trailing', b'{"a":1,"a":2}', b"[" * 1030, b"{" * 1030, b'{"x":' * 1100,
                  b"NaN", b"Infinity", b'{"inputs": NaN}', b'{"inputs": [{"name": "x", "shape": [1], '
                  b'"datatype": "FP32", "data": [NaN]}]}', b'{"inputs": "\\ud800"}', b"\xc3\x28"]

    @fuzz_settings(450)
    @given(st.data())
    def raw(data):
        name = data.draw(st.sampled_from(served + ["nope"]))
        endpoint, path = infer_path(data, name)
        if data.draw(st.integers(0, 9)) == 0:  # a GET endpoint posted to
            endpoint, path = "POST /v2/models/{name}", f"/v2/models/{segment(name)}"
        payload = data.draw(st.one_of(st.sampled_from(raw_bodies), st.binary(max_size=400),
                                      st.text(max_size=200).map(lambda t: t.encode()),
                                      st.sampled_from([goods.get(name, b"{}") + b"\x00", goods.get(name, b"{}")[:-1]])))
        content_type = data.draw(st.sampled_from([
            None, "application/json", "application/octet-stream", "text/plain", "multipart/form-data; boundary=x",
            "application/x-www-form-urlencoded", "application/json; charset=utf-16", "garbage", "*/*"]))
        body: Any = payload
        if data.draw(st.integers(0, 5)) == 0:  # Transfer-Encoding: chunked
            body = iter([payload[i : i + 7] for i in range(0, len(payload), 7)] or [b""])
        fz.send(endpoint, "POST", path, body, {"Content-Type": content_type}, shown=describe(payload))

    fz.run(raw, 6)

    # A few deterministic extremes: oversized bodies (plain, chunked, gzipped), a gzip bomb, a GET with a body.
    big = b'{"inputs": [], "pad": "' + b"x" * (MAX_BODY_MB * 2**20 + 1) + b'"}'

    def extremes():
        for name in ("act", "ntm", "bahdanau"):
            path = f"/v2/models/{name}/infer"
            fz.send("POST /v2/models/{name}/infer", "POST", path, big, shown=f"{len(big)}-byte JSON")
            fz.send("POST /v2/models/{name}/infer", "POST", path, iter([big[i : i + 65536]
                                                                       for i in range(0, len(big), 65536)]),
                    shown=f"{len(big)}-byte chunked JSON")
            fz.send("POST /v2/models/{name}/infer", "POST", path, bomb, {"Content-Encoding": "gzip"},
                    shown="gzip bomb")
            fz.send("GET /v2/models/{name}", "GET", f"/v2/models/{name}", goods.get(name, b"{}"), shown="GET + body")

    fz.run(extremes, 10)

    # -- 7. concurrent mixed traffic: the dynamic and step batchers with hostile companions ---------------
    plan: list[tuple[str, str, bytes, dict]] = []

    @fuzz_settings(420)
    @given(st.data())
    def concurrent_plan(data):
        name = data.draw(st.sampled_from(served))
        endpoint, path = infer_path(data, name)
        body: dict = {"inputs": draw_inputs(data, metas[name])}
        if data.draw(st.booleans()):
            mutate(data, body, metas[name])
        plan.append((endpoint, path, dumps(body).encode(), body))

    concurrent_plan()

    lost: list[tuple[str, str, bytes, dict]] = []  # in flight when the server died

    def concurrent():
        sessions = threading.local()

        def one(item):
            if not hasattr(sessions, "s"):
                sessions.s = requests.Session()
            endpoint, path, payload, body = item
            try:
                if fz.send(endpoint, "POST", path, payload, {"Content-Type": "application/json"}, doc=body,
                           session=sessions.s, correlate=False) == 0:
                    lost.append(item)
            except PhaseOver:
                pass

        with ThreadPoolExecutor(6) as pool:
            list(pool.map(one, plan))

    fz.run(concurrent, 12)

    def replay():
        """The requests in flight when the server died, one at a time: which one kills it alone?"""
        for endpoint, path, payload, body in lost[:12]:
            fz.send(endpoint, "POST", path, payload, {"Content-Type": "application/json"}, doc=body)

    fz.run(replay, 15)

    # -- after the run: alive, bounded memory, enough requests, no 5xx, no traceback ---------------------
    elapsed = time.monotonic() - started
    srv = servers.current  # a fresh one if a request killed the first
    alive = srv.proc.poll() is None
    live = None
    if alive:
        live = requests.get(srv.url + "/v2/health/live", timeout=TIMEOUT)
        fz.sent += 1
    rss_after = vm_rss(srv.proc.pid) if alive else 0
    time.sleep(0.3)  # the last tracebacks reach the log
    srv.checked = srv.log.size()
    text = servers.log_text()
    crashes = len(servers.runs) - 1 + (not alive)
    summary = (f"{fz.sent} requests in {elapsed:.1f} s ({fz.skipped} skipped: like one that killed the server; "
               f"{fz.resent} answered only when sent again on a fresh connection); "
               f"statuses {dict(sorted(fz.statuses.items()))}; "
               f"server RSS {srv.rss_start / 2**20:.1f} MB before, {rss_after / 2**20:.1f} MB after "
               f"(+{(rss_after - srv.rss_start) / 2**20:.1f} MB); server processes {len(servers.runs)} "
               f"({crashes} died); logs: {', '.join(str(s.log.copy) for s in servers.runs)}\n"
               f"requests per phase: {fz.phases}")
    groups: dict[tuple, list[Failure]] = {}
    for failure in fz.failures:
        kind = re.sub(r"\d+", "N", failure.error)  # "found 65" and "found 100 dimensions" are one bug
        if failure.status == 0 and "on this request" in failure.error:  # killed the server: which model, too
            kind += failure.path.split("/")[3] if failure.path.startswith("/v2/models/") else ""
        groups.setdefault((failure.status, failure.endpoint, kind, failure.where), []).append(failure)
    lines = []
    for (status, endpoint, _, where), items in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:20]:
        smallest = min(items, key=lambda f: len(f.path) + len(f.body))
        lines.append(f"- {len(items)}x {status} {endpoint}: {smallest.error}" + (f" [{where}]" if where else "")
                     + f"\n    e.g. {smallest.path} body={smallest.body or '(none)'}"
                     + (f" headers={smallest.headers}" if smallest.headers else ""))
    logged = Counter((re.sub(r"\d+", "N", exc), where) for exc, where in exceptions_in(text.splitlines()))
    tracebacks = [f"- {n}x {exc}" + (f" [{where}]" if where else "") for (exc, where), n in logged.most_common(20)]
    fatal = sorted(set(FATAL.findall(text)))
    message = (f"{summary}\n{len(fz.failures)} request(s) answered 5xx or not at all, "
               f"{len(groups)} distinct (up to 20, the smallest request of each):\n" + "\n".join(lines)
               + f"\n{text.count('Traceback')} traceback(s) in the server log, distinct exceptions:\n"
               + "\n".join(tracebacks) + (f"\nfatal errors in the log: {fatal}" if fatal else ""))
    print(message)
    print("requests per endpoint:", dict(sorted(fz.by_endpoint.items(), key=lambda kv: -kv[1])))
    assert alive, f"the server exited ({srv.proc.returncode}):\n{message}"
    assert live.status_code == 200 and live.json() == {"live": True}, (live.status_code, live.text, message)
    assert rss_after - srv.rss_start < RSS_GROWTH_LIMIT, message
    assert fz.sent >= MIN_REQUESTS, message
    assert not fz.failures and not crashes and not fatal and "Traceback" not in text, message
