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
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

import numpy as np

from serving.admission import DeadlineExceeded, check_deadline, current_deadline, wait_for
from serving.protocol import RequestError

log = logging.getLogger("attnzoo.serving")

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
PAD_AXES = ("src_len", "points", "positions", "time", "annotations")


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
                 on_batch: Callable[[int], None] | None = None, thread: bool = True):
        """``thread=False``: no runner; ``run_all`` merges calls in the caller's thread."""
        self.graph, self.max_rows, self.max_delay_s, self.on_batch = graph, max_rows, max_delay_s, on_batch
        self.session, self.provider = graph.session, graph.provider  # what kinds read from a graph
        self.path, self.input_names, self.output_names = graph.path, graph.input_names, graph.output_names
        self.greedy: GreedyScheduler | None = None  # set when greedy decoding with this step is batched whole
        # {input: axis} that may be zero-padded, and each padded output's {axis: label}
        self.pad, self.out_axes = _padded_axes(graph.session)
        self.labels = {i.name: i.shape for i in graph.session.get_inputs()}
        self.cond = threading.Condition()
        self.pending: list[_Call] = []
        self.busy = False  # a graph call is running (the runner's, or a lone caller's own)
        self.last = 0  # calls in the previous batch
        self.closed = False  # its version was unloaded: the runner ends once idle, later calls run alone
        if thread:
            threading.Thread(target=self._serve, daemon=True, name=f"steps-{Path(graph.path).stem}").start()

    def run_all(self, feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray] | BaseException]:
        """Several callers' feeds at once, merged where they can be: each one's outputs, or its error."""
        calls = [_Call({n: np.asarray(f[n]) for n in self.graph.input_names if n in f}) for f in feeds]
        for group in self._groups(calls):
            self._run(group)
        return [c.error if c.error is not None else c.result for c in calls]

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_deadline()  # a request past its deadline stops here, at its next step
        call = _Call({n: np.asarray(feeds[n]) for n in self.graph.input_names if n in feeds})
        with self.cond:
            direct = self.closed
            alone = not direct and not self.pending and not self.busy
            if alone:
                self.busy = True
            elif not direct:
                self.pending.append(call)
                self.cond.notify_all()
        if direct:  # closed: the runner may be gone; sessions take concurrent calls
            return self.graph(call.feeds)
        if alone:  # nothing to share with: run it in this thread, without a hand-over to the runner
            try:
                return self.graph(call.feeds)
            finally:
                with self.cond:
                    self.busy, self.last = False, 1
                    self.cond.notify_all()
        wait_for(call.done)
        if call.error is not None:
            raise call.error
        return call.result

    def close(self) -> None:
        """Its version is unloaded: calls queued are still answered, then the runner thread ends;
        a request still decoding calls the graph in its own thread from then on."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.greedy is not None:
            self.greedy.close()

    def _serve(self) -> None:
        while True:
            with self.cond:
                while not self.pending or self.busy:
                    if self.closed and not self.pending:
                        return
                    self.cond.wait()
                until = time.monotonic() + self.max_delay_s
                while len(self.pending) < self.last and (left := until - time.monotonic()) > 0:
                    self.cond.wait(left)
                calls, self.pending, self.busy = self.pending, [], True
            try:
                for group in self._groups(calls):
                    self._run(group)
            except BaseException as err:  # noqa: BLE001 - a fault here must not leave its callers waiting
                log.exception("step batcher of %s failed; its calls fail, it goes on", self.path)
                _fail(calls, err)
            finally:
                with self.cond:
                    self.busy, self.last = False, len(calls)
                    self.cond.notify_all()

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


def _fail(waiting: list, err: BaseException) -> None:
    """Wake every caller of ``waiting`` (calls or jobs) not answered yet with ``err``."""
    for item in waiting:
        if not item.done.is_set():
            item.error = err
            item.done.set()


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


# ---- continuous batching of greedy decoding -------------------------------------------------------
class _Job:
    """One request's greedy decoding: its rows join the running batch and leave when finished."""

    def __init__(self, feeds: dict[str, np.ndarray], bos: int, eos: int, max_len: int, pad: int):
        self.feeds, self.bos, self.eos, self.max_len, self.pad = feeds, bos, eos, max_len, pad
        self.rows = _rows(feeds)
        self.deadline = current_deadline()
        self.tokens: list[list[int]] = [[] for _ in range(self.rows)]
        self.attention: list[list[np.ndarray]] = [[] for _ in range(self.rows)]
        self.lengths = np.full(self.rows, max_len, dtype=np.int64)
        self.left = self.rows  # rows still decoding
        self.width = 0  # this request's own source width (attention columns)
        self.result: dict[str, np.ndarray] | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class GreedyScheduler:
    """Continuous batching of greedy decoding over an ``encoder`` + ``decoder_step`` pair.

    One thread keeps every concurrent request's sequences in one batch: a new request is encoded
    and its rows join (its source zero-padded to the batch's width, or the batch to its), each step
    is one decoder call for all rows, and a row leaves when it emits EOS or reaches its request's
    ``max_len``; a request is answered when its last row leaves. The per-step bookkeeping is
    vectorised over the batch, so a step costs about the same for 1 or 64 sequences. Results equal
    :func:`serving.decode.greedy` on the request alone (tokens exactly, floats to rounding).

    Only for step graphs whose every free non-batch axis is a padded source axis (``PAD_AXES``);
    e.g. the Transformer's growing key/value cache is not, and its loops use :class:`StepBatcher`.
    """

    def __init__(self, encoder, step, max_rows: int = 256, on_batch: Callable[[int], None] | None = None):
        self.encoder, self.step, self.max_rows, self.on_batch = encoder, step, max_rows, on_batch
        self.pad, _ = _padded_axes(step.session)
        self.labels = {i.name: i.shape for i in step.session.get_inputs()}
        # joiners that arrive together are encoded in one call (padded, cut back per request)
        self.encoders = StepBatcher(encoder, max_rows, thread=False)
        self.cond = threading.Condition()
        self.queue: list[_Job] = []
        self.active = 0  # rows in the running batch
        self.lone = False  # a request decoding in its own thread (nothing else was running)
        self.closed = False  # its version was unloaded: the thread ends once its batch is done
        threading.Thread(target=self._serve, daemon=True, name=f"greedy-{Path(step.path).parent.name}").start()

    def close(self) -> None:
        """Its version is unloaded: the rows queued and decoding finish, then the thread ends."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    @staticmethod
    def eligible(step) -> bool:
        pad, _ = _padded_axes(step.session)
        for i in step.session.get_inputs():
            for axis, d in enumerate(i.shape):
                if axis > 0 and isinstance(d, str) and pad.get(i.name) != axis:
                    return False
        return "attention" in step.output_names and "log_probs" in step.output_names

    def __call__(self, feeds: dict[str, np.ndarray], bos: int, eos: int, max_len: int, pad: int) -> dict:
        check_deadline()
        with self.cond:
            direct = self.closed  # the decoding thread may be gone: decode here
            alone = not direct and not self.queue and not self.active and not self.lone
            if alone:
                self.lone = True
            elif not direct:  # made here, in the request's thread: the job keeps that thread's deadline
                job = _Job(feeds, bos, eos, max_len, pad)
                self.queue.append(job)
                self.cond.notify()
        if alone or direct:  # nothing to share with: the plain loop in this thread, without a hand-over
            from serving.decode import greedy

            try:
                return greedy(self.encoder, self.step, feeds, None, bos, eos, max_len, pad)
            finally:
                if alone:
                    with self.cond:
                        self.lone = False
        wait_for(job.done)
        if job.error is not None:
            raise job.error
        return job.result

    # -- the decoding thread --------------------------------------------------------------------
    def _serve(self) -> None:
        batch = _Batch()
        while True:
            with self.cond:
                while not self.queue and not batch.owners:
                    if self.closed:
                        return
                    self.cond.wait()
                room = self.max_rows - len(batch.owners)
                joiners = []
                while self.queue and (self.queue[0].rows <= room or not batch.owners):
                    job = self.queue.pop(0)
                    room -= job.rows
                    joiners.append(job)
                self.active = len(batch.owners) + sum(job.rows for job in joiners)
            try:
                self._join_batch(batch, joiners)
                if batch.owners:
                    self._step(batch)
            except BaseException as err:  # noqa: BLE001 - every request in the batch fails, the thread goes on
                log.warning("greedy decoding of %s failed, and with it the %d request(s) in its batch: %s",
                            self.step.path, len({id(j) for j, _ in batch.owners} | {id(j) for j in joiners}), err)
                _fail([j for j, _ in batch.owners] + joiners, err)
                batch = _Batch()
            with self.cond:
                self.active = len(batch.owners)

    def _join_batch(self, batch: _Batch, joiners: list[_Job]) -> None:
        """Encode the requests that arrived and add their rows to the running batch."""
        encoded = self.encoders.run_all([job.feeds for job in joiners]) if joiners else []
        for job, enc in zip(joiners, encoded):
            if isinstance(enc, BaseException):  # the request fails alone
                _fail([job], enc)
                continue
            rows = {n: v for n, v in enc.items() if n in self.labels}
            job.width = max((rows[n].shape[a] for n, a in self.pad.items() if n in rows), default=0)
            batch.state = _join(batch.state, rows, self.pad) if batch.owners else dict(rows)
            batch.owners += [(job, r) for r in range(job.rows)]
            batch.y = np.concatenate([batch.y, np.full(job.rows, job.bos, dtype=np.int64)])
            batch.t = np.concatenate([batch.t, np.zeros(job.rows, dtype=np.int64)])

    def _step(self, batch: _Batch) -> None:
        """One decoder call for every row; rows that end leave, requests whose rows all ended are answered."""
        if self.on_batch:
            self.on_batch(len(batch.owners))
        out = self.step({**batch.state, "y_prev": batch.y})
        y = out["log_probs"].argmax(-1).astype(np.int64)  # first index of the max, as torch.argmax
        attention = out["attention"]
        finished = np.zeros(len(batch.owners), dtype=bool)
        now = time.monotonic()
        for i, (job, r) in enumerate(batch.owners):
            if job.done.is_set():  # failed (its deadline, a fault) while other rows of it were decoding
                finished[i] = True
                continue
            if job.deadline is not None and now > job.deadline[0]:
                _fail([job], DeadlineExceeded(job.deadline[1]))
                finished[i] = True
                continue
            job.attention[r].append(attention[i, : job.width] if job.width else attention[i])
            if y[i] == job.eos or batch.t[i] + 1 >= job.max_len:
                if y[i] == job.eos:
                    job.lengths[r] = batch.t[i]
                else:
                    job.tokens[r].append(int(y[i]))
                finished[i] = True
                job.left -= 1
                if job.left == 0:
                    job.result = _greedy_result(job)
                    job.done.set()
            else:
                job.tokens[r].append(int(y[i]))
        batch.y, batch.t = y, batch.t + 1
        batch.state.update({k[4:]: v for k, v in out.items() if k.startswith("new_")})
        if finished.any():
            keep = ~finished
            batch.owners = [o for o, k in zip(batch.owners, keep) if k]
            batch.state = {n: v[keep] for n, v in batch.state.items()}
            batch.y, batch.t = batch.y[keep], batch.t[keep]


class _Batch:
    """The running batch of greedy decoding: per row its owner (job, row of the job), the last
    token ``y`` and the steps ``t`` taken, and the decoder's state."""

    def __init__(self):
        self.state: dict[str, np.ndarray] = {}
        self.owners: list[tuple[_Job, int]] = []
        self.y = np.zeros(0, dtype=np.int64)
        self.t = np.zeros(0, dtype=np.int64)


def _join(state: dict[str, np.ndarray], rows: dict[str, np.ndarray], pad: dict[str, int]) -> dict[str, np.ndarray]:
    """The batch's arrays with a request's rows appended, padding the source axis to the wider."""
    out = {}
    for name, value in state.items():
        new = rows[name]
        axis = pad.get(name)
        if axis is not None and value.shape[axis] != new.shape[axis]:
            width = max(value.shape[axis], new.shape[axis])
            value, new = _pad_to(value, axis, width), _pad_to(new, axis, width)
        out[name] = np.concatenate([value, new])
    return out


def _greedy_result(job: _Job) -> dict[str, np.ndarray]:
    """The shapes :func:`serving.decode.greedy` returns: tokens [N,T] (EOS, then pad), lengths [N],
    attention [N,T,S] (zero after a row's end)."""
    steps = max(len(a) for a in job.attention)
    tokens = np.full((job.rows, steps), job.pad, dtype=np.int64)
    width = max(a[0].shape[-1] for a in job.attention)
    attention = np.zeros((job.rows, steps, width), dtype=np.float32)
    for r in range(job.rows):
        seq = job.tokens[r] + ([job.eos] if job.lengths[r] < job.max_len else [])
        tokens[r, : len(seq)] = seq
        stacked = np.stack(job.attention[r])  # [T_r, S_r]
        attention[r, : stacked.shape[0], : stacked.shape[1]] = stacked
    return {"tokens": tokens, "lengths": job.lengths, "attention": attention}
