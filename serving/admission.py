"""What a request may ask for and when the server says no: limits, admission, deadlines.

* :class:`Limits` — per-model caps written by ``publish`` into a version's ``metadata.json``
  (the defaults below, overridden by ``serving.limits`` and ``models.<name>.limits`` in
  ``params.yaml``). A request over a cap is answered 413 naming the cap, before any work; an
  answer over ``output_elements`` is refused (413) before it is encoded.
* :class:`Admission` — at most ``running`` requests work at once, at most ``queued`` wait for a
  turn; one more is answered 503 with ``Retry-After`` at once (nothing waits in an unbounded queue).
* Deadlines — each request's work runs under :func:`deadline_scope`; every graph call of a decode
  loop goes through :func:`check_deadline`, so a request past its deadline stops at its next step
  (HTTP 504) instead of finishing in the background.
* :data:`COMPUTE` — ONNX Runtime calls in flight at once (``--infer-threads``): many decode loops may
  be alive, but only this many graph calls compete for the cores.
* :class:`Memory` — how a version's peak memory grows with a request's rows and length (written by
  ``publish``); a request whose estimate exceeds the server's budget (``--memory-budget-mb``) is
  refused with 413 before it runs, and :class:`MemoryPool` keeps the requests running at once within it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from serving.protocol import RequestError


@dataclass(frozen=True)
class Limits:
    rows: int = 64  # rows per request: texts, images, sequences, point sets
    steps: int = 2000  # time steps / sequence length of one input (NTM x, a point set, encoder frames)
    text_chars: int = 2000  # characters of one text
    beam: int = 16  # beam width
    image_pixels: int = 1 << 20  # pixels of one image (text-line images have a free width)
    audio_seconds: float = 60.0  # seconds of one clip
    # values in one answer, all outputs together: 64 answers this size at once fit the 4 GiB pod of
    # deploy/kserve/ (docs/security.md has the measurement)
    output_elements: int = 1 << 21

    @classmethod
    def of(cls, values: dict | None) -> Limits:
        """From a version's metadata (older versions have none: the defaults)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (values or {}).items() if k in known})

    def as_json(self) -> dict:
        return asdict(self)


def over_limit(what: str, value: float, limit: str, cap: float) -> None:
    """413 naming the cap, e.g. "input 'x' has 20000 time steps; this model's limit (limits.steps) is 2000"."""
    if value > cap:
        raise RequestError(f"{what} is {value:g}, over this model's limit limits.{limit} = {cap:g} "
                           "(set in params.yaml, published with the model)", status=413)


FP32 = 4  # bytes
SELF_ATTENTION = ("transformer",)  # the architectures whose memory grows with the square of a length


@dataclass(frozen=True)
class Memory:
    """Peak bytes one request takes while it runs: ``rows x (per_row + per_step L + per_step2 L²)``
    plus ``hypotheses x per_hypothesis_step x L`` for a beam search's hypotheses, with L the longest
    input's length (time steps, points, source pieces). ``publish`` writes it into a version's serving
    block from the model's config (``pipeline/serving_meta.py``); it bounds the whole model and each
    of its graphs. The defaults are for versions published before it was recorded: a Transformer-base
    (width 512, 8 heads, 6 + 6 layers), at least as large as any model this project publishes."""

    per_row: float = 1 << 20
    per_step: float = FP32 * (2048 + 512 * (8 + 2 * 6))
    per_step2: float = FP32 * 8 * 6
    per_hypothesis_step: float = FP32 * 2 * 6 * 512

    @classmethod
    def transformer(cls, dim: int, heads: int, ff_dim: int, enc_layers: int, dec_layers: int) -> Memory:
        """A Transformer encoder-decoder's. length²: ONNX Runtime holds up to six fp32 [heads, L, L]
        tensors a row at once in an encoder layer (scores, mask, softmax and their copies; measured at
        most 5.7 on the committed shape, 1 to 64 rows, 100 to 2,000 steps). length: the feed-forward
        layer's hidden values, eight of the width for a layer's activations, and the keys and values
        every encoder layer hands the decoder. A beam hypothesis holds the decoder layers' cross-attention
        keys and values over the source."""
        return cls(per_row=1 << 20, per_step=FP32 * (ff_dim + dim * (8 + 2 * enc_layers)),
                   per_step2=FP32 * heads * 6, per_hypothesis_step=FP32 * 2 * dec_layers * dim)

    @classmethod
    def linear(cls, width: int) -> Memory:
        """A model without self-attention (recurrent encoders, one query over the steps at a time): eight
        values of its widest layer a row and step (a recurrent encoder's outputs both ways, its
        attention keys and their copies)."""
        return cls(per_row=1 << 20, per_step=FP32 * 8 * width, per_step2=0.0, per_hypothesis_step=FP32 * 4 * width)

    @classmethod
    def of(cls, values: dict | None, arch: str | None = None) -> Memory:
        """From a version's metadata. Older versions have none: a Transformer-base's (the defaults)
        for a Transformer or a version that names no architecture, one linear in the length (a
        512-wide model's) for the architectures without self-attention (``arch``: the metadata's)."""
        if values is None and isinstance(arch, str) and arch not in SELF_ATTENTION:
            return cls.linear(512)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v if isinstance(v, int) else float(v) for k, v in (values or {}).items() if k in known})

    @classmethod
    def of_version(cls, meta: dict) -> Memory:
        """A version's, from its metadata.json (its serving block's memory, else by its arch)."""
        return cls.of(meta.get("serving", {}).get("memory"), meta.get("arch"))

    def as_json(self) -> dict:
        return asdict(self)

    def bytes(self, rows: int, steps: int, hypotheses: int = 0) -> float:
        return (rows * (self.per_row + self.per_step * steps + self.per_step2 * steps * steps)
                + hypotheses * self.per_hypothesis_step * steps)

    def largest_steps(self, rows: int, budget: float, hypotheses: int = 0) -> int:
        """The longest input ``rows`` rows may have within ``budget`` bytes (0: none fits)."""
        low, high = 0, 1
        while self.bytes(rows, high, hypotheses) <= budget and high < 1 << 40:
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.bytes(rows, mid, hypotheses) <= budget else (low, mid)
        return low


POD_MEMORY = 4 << 30  # deploy/kserve/serving-runtime.yaml: the runtime pod's memory limit
CGROUP_FILES = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def memory_limit(files=CGROUP_FILES) -> int:
    """This container's memory limit in bytes: cgroup v2's memory.max or v1's memory.limit_in_bytes,
    or the KServe pod's 4 GiB where neither sets one ("max", or v1's near-2^63 for none)."""
    for path in files:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
        if text == "max" or text.isdigit():
            return POD_MEMORY
    return POD_MEMORY


def over_budget(need: float, budget: float, rows: int, steps: int) -> None:
    """413 when a request's estimated memory exceeds the server's budget, naming both and the fix."""
    if need > budget:
        raise RequestError(f"this request needs an estimated {need / 2**20:,.0f} MiB to run ({rows} rows of up to "
                           f"{steps} steps), over this server's memory budget of {budget / 2**20:,.0f} MiB "
                           "(--memory-budget-mb, less what the server holds); send fewer rows or shorter inputs",
                           status=413)


class MemoryPool:
    """The estimated memory of the requests running at once (asyncio side), at most ``budget``
    bytes: a request that does not fit while others run waits for them, until its deadline (504)."""

    def __init__(self, budget: float):
        self.budget, self.held = budget, 0.0
        self.freed = asyncio.Condition()

    @asynccontextmanager
    async def hold(self, need: float, deadline: tuple[float, float]):
        async with self.freed:
            try:
                await asyncio.wait_for(self.freed.wait_for(lambda: self.held + need <= self.budget),
                                       max(deadline[0] - time.monotonic(), 0.0))
            except TimeoutError:
                raise DeadlineExceeded(deadline[1]) from None
            self.held += need
        try:
            yield
        finally:
            async with self.freed:
                self.held -= need
                self.freed.notify_all()


class DeadlineExceeded(RequestError):
    def __init__(self, seconds: float):
        super().__init__(f"inference took longer than the deadline of {seconds:g} s and was stopped", status=504)


_local = threading.local()


@contextmanager
def deadline_scope(seconds: float):
    """Run the body (one request's work, in a worker thread) under a deadline ``seconds`` from now."""
    previous = getattr(_local, "deadline", None)
    _local.deadline = (time.monotonic() + seconds, seconds)
    try:
        yield
    finally:
        _local.deadline = previous


@contextmanager
def deadline_carried(deadline: tuple[float, float] | None):
    """Run the body (in a helper thread) under another thread's :func:`current_deadline`, so work a
    request hands to other threads stops at the same moment as the request."""
    previous = getattr(_local, "deadline", None)
    _local.deadline = deadline
    try:
        yield
    finally:
        _local.deadline = previous


def current_deadline() -> tuple[float, float] | None:
    """(monotonic time, seconds) of this thread's request deadline, or None outside a request."""
    return getattr(_local, "deadline", None)


WAIT_GRACE_S = 5.0  # past a deadline, how long a request still waits for the step in flight
MAX_WAIT_S = 600.0  # how long work outside any request (LocalClient, MLflow) waits for another thread


def wait_for(done: threading.Event) -> None:
    """Wait for work handed to another thread (a shared step, a batched decode): until this thread's
    request deadline plus a grace, or :data:`MAX_WAIT_S` outside a request. No wait is unbounded: a
    runner that never answers costs its callers a 504, not a thread each for ever."""
    deadline = current_deadline()
    timeout = deadline[0] - time.monotonic() + WAIT_GRACE_S if deadline else MAX_WAIT_S
    if not done.wait(max(timeout, 0.0)):
        if deadline:
            raise DeadlineExceeded(deadline[1])
        raise RequestError(f"no answer from the decoding thread within {MAX_WAIT_S:g} s", status=504)


def check_deadline() -> None:
    """Raise :class:`DeadlineExceeded` when this thread's request is past its deadline."""
    deadline = getattr(_local, "deadline", None)
    if deadline is not None and time.monotonic() > deadline[0]:
        raise DeadlineExceeded(deadline[1])


class _Gate:
    """A resizable semaphore over ONNX Runtime calls (the server sets its size at start-up)."""

    def __init__(self, size: int = 2):
        self.resize(size)

    def resize(self, size: int) -> None:
        self.size = max(1, size)
        self.semaphore = threading.BoundedSemaphore(self.size)

    def __enter__(self):
        self.semaphore.acquire()

    def __exit__(self, *exc):
        self.semaphore.release()


COMPUTE = _Gate()


class Admission:
    """A bounded waiting room in front of the worker threads (asyncio side)."""

    def __init__(self, running: int, queued: int, retry_after_s: int = 1):
        self.slots = asyncio.Semaphore(running)
        self.queued, self.retry_after_s = queued, retry_after_s
        self.waiting = 0

    @asynccontextmanager
    async def turn(self):
        if self.slots.locked() and self.waiting >= self.queued:
            raise RequestError("the server is busy (admission queue full); retry shortly", status=503,
                               headers={"Retry-After": str(self.retry_after_s)})
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self.slots.release()
