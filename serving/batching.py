"""Dynamic batching: concurrent requests to one single-graph model run as one ONNX Runtime call.

A request waits at most ``max_delay_s`` for companions; requests whose inputs agree on every axis
but the first are concatenated along axis 0 (up to ``max_batch`` rows), run once, and the outputs
split back in order. The queue is bounded: when it is full the caller gets HTTP 503 at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

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
