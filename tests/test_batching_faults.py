"""A fault in a batching thread fails the requests it held at once, and the thread goes on serving;
no caller waits without bound (before: the runner thread died and its callers waited for ever)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from serving import admission, batching
from serving.protocol import RequestError
from tests.conftest import wait_for


class _Graph:
    """A graph as the batchers see one: its session's declared inputs/outputs and a call."""

    def __init__(self, inputs: dict, outputs: dict, fn, path: str = "g/step.onnx"):
        self.session = SimpleNamespace(
            get_inputs=lambda: [SimpleNamespace(name=n, shape=s) for n, s in inputs.items()],
            get_outputs=lambda: [SimpleNamespace(name=n, shape=s) for n, s in outputs.items()])
        self.input_names, self.output_names = list(inputs), list(outputs)
        self.provider, self.path, self.fn = "CPUExecutionProvider", path, fn

    def __call__(self, feeds):
        return self.fn(feeds)


def _in_thread(fn) -> dict:
    """Run ``fn`` in a request thread (a 5 s deadline); its result or error, waited for 10 s at most."""
    out: dict = {}

    def body():
        with admission.deadline_scope(5.0):
            try:
                out["result"] = fn()
            except BaseException as err:  # noqa: BLE001 - handed to the test
                out["error"] = err

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the caller is still waiting"
    return out


def _via_runner(batcher: batching.StepBatcher, feeds: dict) -> dict:
    """A call handed to the batcher's runner thread (as when another call is in flight): its result
    or error, from a request thread."""
    with batcher.cond:
        batcher.busy = True  # a call in flight: the next one is queued for the runner
    answer: dict = {}
    waiting = threading.Thread(target=lambda: answer.update(_in_thread(lambda: batcher(feeds))))
    waiting.start()

    def queued() -> bool:
        with batcher.cond:
            return bool(batcher.pending)

    assert wait_for(queued, 10, every_s=0.005), "the call was never queued behind the one in flight"
    with batcher.cond:
        batcher.busy = False
        batcher.cond.notify_all()
    waiting.join(10)
    return answer


def test_a_step_batcher_whose_runner_fails_answers_its_callers_and_goes_on(monkeypatch):
    graph = _Graph({"x": ["batch", 2]}, {"y": ["batch", 2]}, lambda f: {"y": f["x"] * 2})
    batcher = batching.StepBatcher(graph, max_delay_s=0.0)
    real = batcher._groups
    monkeypatch.setattr(batcher, "_groups", lambda calls: (_ for _ in ()).throw(RuntimeError("bug in grouping")))
    answer = _via_runner(batcher, {"x": np.ones((1, 2))})
    assert isinstance(answer.get("error"), RuntimeError) and "bug in grouping" in str(answer["error"])
    monkeypatch.setattr(batcher, "_groups", real)
    later = _via_runner(batcher, {"x": np.ones((1, 2))})
    assert np.array_equal(later["result"]["y"], [[2.0, 2.0]]), later  # the runner survived


def _greedy(step_fn):
    encoder = _Graph({"src": ["batch", "src_len"]}, {"memory": ["batch", "src_len", 3]},
                     lambda f: {"memory": np.ones((*f["src"].shape, 3), np.float32)}, "g/encoder.onnx")
    step = _Graph({"memory": ["batch", "src_len", 3], "y_prev": ["batch"]},
                  {"log_probs": ["batch", 5], "attention": ["batch", "src_len"]}, step_fn)
    scheduler = batching.GreedyScheduler(encoder, step)
    scheduler.lone = True  # as if a request were decoding alone: the next ones go to the shared batch
    return scheduler


def _eos_at_once(feeds):
    rows, width = feeds["memory"].shape[:2]
    log_probs = np.zeros((rows, 5), np.float32)
    log_probs[:, 2] = 1.0  # token 2 is EOS
    return {"log_probs": log_probs, "attention": np.ones((rows, width), np.float32) / width}


def test_greedy_decoding_whose_bookkeeping_fails_fails_its_batch_and_goes_on():
    calls = {"n": 0}

    def step(feeds):
        calls["n"] += 1
        if calls["n"] == 1:  # an answer the bookkeeping cannot use (before: outside any try)
            return {"log_probs": np.zeros((1, 5), np.float32)}
        return _eos_at_once(feeds)

    scheduler = _greedy(step)
    decode = lambda: scheduler({"src": np.ones((1, 4), np.int64)}, bos=1, eos=2, max_len=5, pad=0)  # noqa: E731
    first = _in_thread(decode)
    assert isinstance(first.get("error"), KeyError), first
    second = _in_thread(decode)
    assert second["result"]["tokens"].tolist() == [[2]] and second["result"]["lengths"].tolist() == [0]


def test_no_wait_is_unbounded(monkeypatch):
    """A runner that never answers: the caller gets its deadline's 504 (a grace later), not a thread
    pinned for ever; outside a request, MAX_WAIT_S bounds the wait."""
    monkeypatch.setattr(admission, "WAIT_GRACE_S", 0.1)
    monkeypatch.setattr(admission, "MAX_WAIT_S", 0.3)
    scheduler = _greedy(lambda feeds: time.sleep(3600))
    started = time.monotonic()
    out: dict = {}

    def body():
        with admission.deadline_scope(0.2):
            try:
                scheduler({"src": np.ones((1, 4), np.int64)}, bos=1, eos=2, max_len=5, pad=0)
            except RequestError as err:
                out["error"] = err

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(5)
    assert out["error"].status == 504 and time.monotonic() - started < 2.0, out
    with pytest.raises(RequestError, match="no answer from the decoding thread within 0.3 s"):
        admission.wait_for(threading.Event())
