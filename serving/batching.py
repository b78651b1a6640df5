"""Batching across requests, in two forms.

:class:`DynamicBatcher` — concurrent requests to one single-graph model run as one ONNX Runtime call.
:class:`StepBatcher` — the decode loops of concurrent requests share each step's graph call.

Dynamic batching:
A request waits at most ``max_delay_s`` for companions; requests whose inputs agree on every axis
but the first are concatenated along axis 0 (up to ``max_batch`` rows), run once, and the outputs
split back in order. The queue is bounded: when it is full the caller gets HTTP 503 at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

import numpy as np

from serving.admission import check_deadline
from serving.protocol import RequestError

Infer = Callable[[dict[str, np.ndarray], dict], dict[str, tuple[np.ndarray, str]]]


class DynamicBatcher:
    def __init__(self, infer: Infer, executor: Executor, max_batch: int = 64, max_delay_s: float = 0.002,
                 max_queue: int = 1024, on_batch: Callable[[int], None] | None = None):
        self.infer_fn, self.executor = infer, executor
        self.max_batch, self.max_delay_s = max_batch, max_delay_s
        self.queue: asyncio.Queue = asyncio.Queue(max_queue)
        self.on_batch = on_batch
        self.worker: asyncio.Task | None = None
        self.pending = 0  # requests queued or running

    async def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, str]]:
        if self.worker is None or self.worker.done():
            self.worker = asyncio.create_task(self._collect())
        future = asyncio.get_running_loop().create_future()
        try:
            self.queue.put_nowait((feeds, future))
        except asyncio.QueueFull:
            raise RequestError("the server is busy (request queue full); retry shortly", status=503) from None
        self.pending += 1
        try:
            return await future
        finally:
            self.pending -= 1

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self.queue.get()
            batch, rows = [first], _rows(first[0])
            # Alone (nothing else queued or running): waiting for companions would only add latency.
            deadline = loop.time() + (self.max_delay_s if self.pending > 1 else 0.0)
            while rows < self.max_batch:
                if not self.queue.empty():
                    item = self.queue.get_nowait()
                else:
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(self.queue.get(), left)
                    except TimeoutError:
                        break
                batch.append(item)
                rows += _rows(item[0])
            groups: dict[tuple, list] = {}
            for feeds, future in batch:
                key = tuple((k, v.dtype.str, v.shape[1:]) for k, v in sorted(feeds.items()))
                groups.setdefault(key, []).append((feeds, future))
            for group in groups.values():
                asyncio.create_task(self._run(group))  # keep collecting while this batch runs

    async def _run(self, group: list) -> None:
        names = list(group[0][0])
        feeds = {n: np.concatenate([f[n] for f, _ in group]) for n in names}  # [sum B_i, ...]
        sizes = [_rows(f) for f, _ in group]
        if self.on_batch:
            self.on_batch(sum(sizes))
        try:
            outs = await asyncio.get_running_loop().run_in_executor(self.executor, self.infer_fn, feeds, {})
        except Exception as err:
            if len(group) > 1:  # one bad request must not fail its companions: run them alone
                for item in group:
                    asyncio.create_task(self._run([item]))
                return
            if not group[0][1].done():
                group[0][1].set_exception(err)
            return
        offsets = np.cumsum([0] + sizes)
        for i, (_, future) in enumerate(group):
            if not future.done():  # the caller may have timed out
                future.set_result({k: (v[offsets[i] : offsets[i + 1]], dt) for k, (v, dt) in outs.items()})


def _rows(feeds: dict[str, np.ndarray]) -> int:
    return int(next(iter(feeds.values())).shape[0])


# ---- step batching: the decode loops of concurrent requests share their graph calls -------------
# Axes a step batcher may pad to merge calls of different lengths: the source axis the models mask
# (their masks are 1/True on real positions and 0/False on padding, as in training batches).
PAD_AXES = ("src_len", "points", "time", "annotations")


class _Call:
    __slots__ = ("feeds", "rows", "result", "error", "done")

    def __init__(self, feeds: dict[str, np.ndarray]):
        self.feeds = feeds
        self.rows = _rows(feeds)
        self.result: dict[str, np.ndarray] | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class StepBatcher:
    """Continuous batching of one graph's calls across concurrent requests' decode loops.

    Wraps a graph (``feeds -> outputs``) and is called like it, from each request's worker thread:
    the call waits while one runner thread concatenates every call queued meanwhile along axis 0
    (zero-padding the ``PAD_AXES`` the graph declares, e.g. source lengths, and cutting each
    caller's outputs back to its own length), runs the graph once and hands each caller its rows.
    Sequences join and leave between steps: a loop that finished simply stops calling. The runner
    waits up to ``max_delay_s`` for as many calls as its previous batch had (the loops it just
    answered are computing their next step), so a steady set of loops moves in lock-step.
    """

    def __init__(self, graph, max_rows: int = 256, max_delay_s: float = 0.002,
                 on_batch: Callable[[int], None] | None = None):
        self.graph, self.max_rows, self.max_delay_s, self.on_batch = graph, max_rows, max_delay_s, on_batch
        self.session, self.provider = graph.session, graph.provider  # what kinds read from a graph
        # {input: axis} that may be zero-padded, and each padded output's {axis: label}
        self.pad, self.out_axes = _padded_axes(graph.session)
        self.labels = {i.name: i.shape for i in graph.session.get_inputs()}
        self.cond = threading.Condition()
        self.pending: list[_Call] = []
        self.last = 0  # calls in the previous batch
        threading.Thread(target=self._serve, daemon=True, name=f"steps-{Path(graph.path).stem}").start()

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_deadline()  # a request past its deadline stops here, at its next step
        call = _Call({n: np.asarray(feeds[n]) for n in self.graph.input_names if n in feeds})
        with self.cond:
            self.pending.append(call)
            self.cond.notify()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def _serve(self) -> None:
        while True:
            with self.cond:
                while not self.pending:
                    self.cond.wait()
                until = time.monotonic() + self.max_delay_s
                while len(self.pending) < self.last and (left := until - time.monotonic()) > 0:
                    self.cond.wait(left)
                calls, self.pending = self.pending, []
            self.last = len(calls)
            for group in self._groups(calls):
                self._run(group)

    def _groups(self, calls: list[_Call]) -> list[list[_Call]]:
        """Calls that can share one graph call (same dtypes, same sizes on every unpadded axis),
        cut into runs of at most ``max_rows`` rows."""
        groups: dict[tuple, list[_Call]] = {}
        for call in calls:
            key = tuple((n, v.dtype.str, tuple(None if self.pad.get(n) == a else d for a, d in enumerate(v.shape)))
                        for n, v in sorted(call.feeds.items()))
            groups.setdefault(key, []).append(call)
        out = []
        for group in groups.values():
            run, rows = [], 0
            for call in group:
                if run and rows + call.rows > self.max_rows:
                    out.append(run)
                    run, rows = [], 0
                run.append(call)
                rows += call.rows
            out.append(run)
        return out

    def _run(self, group: list[_Call]) -> None:
        try:
            if len(group) == 1:
                outs = [self.graph(group[0].feeds)]
            else:
                outs = self._merged(group)
        except BaseException as err:  # noqa: BLE001 - handed to the callers, whose requests fail alone
            if len(group) > 1:  # one bad call must not fail its companions: run them alone
                for call in group:
                    self._run([call])
                return
            outs, group[0].error = [None], err
        for call, result in zip(group, outs):
            call.result = result
            call.done.set()

    def _merged(self, group: list[_Call]) -> list[dict[str, np.ndarray]]:
        if self.on_batch:
            self.on_batch(sum(c.rows for c in group))
        feeds = {}
        for name in group[0].feeds:
            parts = [c.feeds[name] for c in group]
            axis = self.pad.get(name)
            if axis is not None:
                width = max(p.shape[axis] for p in parts)
                parts = [_pad_to(p, axis, width) for p in parts]
            feeds[name] = np.concatenate(parts)  # [sum B_i, ...]
        outs = self.graph(feeds)
        # each caller's own size of every padded axis, by its symbolic name (e.g. "src_len": 7)
        lengths = [{self.labels[n][a]: c.feeds[n].shape[a] for n, a in self.pad.items() if n in c.feeds}
                   for c in group]
        offsets = np.cumsum([0] + [c.rows for c in group])
        results = []
        for i, _ in enumerate(group):
            mine = {}
            for name, value in outs.items():
                part = value[offsets[i] : offsets[i + 1]]
                for axis, label in self.out_axes.get(name, {}).items():
                    if label in lengths[i]:
                        part = part[(slice(None),) * axis + (slice(0, lengths[i][label]),)]
                mine[name] = np.ascontiguousarray(part)
            results.append(mine)
        return results


def _padded_axes(session) -> tuple[dict[str, int], dict[str, dict[int, str]]]:
    """({input name: axis} a step batcher may zero-pad, {output name: {axis: label}} to cut back),
    or nothing to pad when an output's free axis is named by no input (e.g. an encoder's
    annotations from a padded image width: each caller's part could not be told back)."""
    ins = {i.name: i.shape for i in session.get_inputs()}
    labels = {d for shape in ins.values() for d in shape if isinstance(d, str)}
    pad = {n: a for n, shape in ins.items() for a, d in enumerate(shape) if a > 0 and d in PAD_AXES}
    padded = {ins[n][a] for n, a in pad.items()}
    out_axes: dict[str, dict[int, str]] = {}
    for out in session.get_outputs():
        for a, d in enumerate(out.shape):
            if a > 0 and isinstance(d, str) and d not in labels:
                return {}, {}
            if a > 0 and d in padded:
                out_axes.setdefault(out.name, {})[a] = d
    return pad, out_axes


def _pad_to(array: np.ndarray, axis: int, width: int) -> np.ndarray:
    if array.shape[axis] == width:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, width - array.shape[axis])
    return np.pad(array, widths)
