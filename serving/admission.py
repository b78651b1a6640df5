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
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, fields

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
