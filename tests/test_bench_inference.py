"""scripts/bench_inference.py measures a real exported model in a process of its own: a checkout with a
prepared task, a checkpoint and its ONNX graphs, as `attnzoo repro export@<model>` leaves them."""

from __future__ import annotations

import time
from itertools import groupby
from pathlib import Path

import bench_inference
import numpy as np
import pytest
import torch

import models
from pipeline.checkpoint import save
from pipeline.config import load_params, resolve
from pipeline.stages.export import export_onnx
from pipeline.stages.prepare import prepare
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A checkout holding act_parity as export@ leaves it: a seeded (untrained) model of params.yaml's
    config, its checkpoint and graphs, over a small prepared parity task."""
    root = tmp_path_factory.mktemp("checkout")
    (root / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    small = {**load_params(ROOT)["tasks"]["parity"], "train_size": 64, "val_size": 64, "test_size": 64}
    prepare("parity", small, root / "data" / "prepared" / "parity")
    run = resolve("act_parity", root=root)
    torch.manual_seed(0)
    model = models.build(run.arch, run.model).eval()
    save(run.run_dir / "checkpoint" / "best", model, run)
    export_onnx(model, run.run_dir / "onnx")
    return root


@pytest.mark.integration  # each model's benchmark is a process of its own
def test_bench_apart_measures_every_engine_at_each_thread_count_and_batch(checkout):
    row = bench_inference.bench_apart("act_parity", checkout, [1, 2], 2)
    graphs = {p.stem for p in (checkout / "runs" / "act_parity" / "onnx").glob("*.onnx")}
    assert row["model"] == "act_parity" and sorted(row["by_threads"]) == [1, 2]  # ints again, as the bars look them up
    for at in row["by_threads"].values():
        assert sorted(at["loop_ms"]) == [1, 32] and set(at["graphs"]) == graphs
        for size, by_engine in at["loop_ms"].items():
            assert set(by_engine) == {"eager", "fp32", "int8"}
            assert all(0 < ms < 10_000 for ms in by_engine.values()), (size, by_engine)
            assert 0.0 <= at["int8_same"][size] <= 1.0


def test_same_rows_compares_what_a_user_sees_of_each_row():
    """int8_same's share: tokens up to each row's length, else argmax or answer, else the logits' sign,
    else (no decision output) every value to 1e-3."""
    same = bench_inference.same_rows
    a = {"tokens": np.array([[4, 5, 0], [6, 7, 8], [1, 2, 3], [9, 9, 9]]), "lengths": np.array([2, 3, 3, 1])}
    b = {"tokens": np.array([[4, 5, 9], [6, 7, 1], [1, 2, 3], [9, 9, 9]]), "lengths": np.array([2, 3, 3, 2])}
    # Row 0 differs past its length only (same), row 1 inside it, row 3 in its length: 2 of 4.
    assert same(a, b) == 0.5
    assert same({"pred": np.array([[1, 2], [3, 4], [5, 6]])}, {"pred": np.array([[1, 2], [3, 0], [5, 6]])}) == 2 / 3
    assert same({"logits": np.array([0.3, -1.0, 2.0])}, {"logits": np.array([0.1, 0.2, 5.0])}) == 2 / 3
    values = {"scalar": np.array([1.0, 2.0]), "lookup": np.array([[0.5, 0.5], [0.1, 0.9]])}
    close = {"scalar": np.array([1.0005, 2.0]), "lookup": np.array([[0.5, 0.5], [0.1, 0.8]])}
    assert same(values, close) == 0.5  # row 0 within 1e-3, row 1's lookup 0.1 off


def test_batch_groups_are_the_single_cases_and_the_largest_case_tiled_to_32_rows():
    three = torch.arange(6.0).reshape(3, 2)  # the largest case: 3 rows
    cases = [("a", {"x": torch.zeros(1, 3)}), ("b", {"x": three}), ("c", {"x": torch.ones(1, 5)})]
    groups = bench_inference.batch_groups(cases)
    assert [b["x"].shape for b in groups[1]] == [(1, 3), (1, 5)]
    (tiled,) = groups[32]
    assert tiled["x"].shape == (32, 2)
    assert torch.equal(tiled["x"], three[torch.arange(32) % 3])  # rows 0, 1, 2, 0, ...


@pytest.mark.integration
def test_bench_apart_names_the_model_whose_process_failed(checkout, capfd):
    """The child names what is wrong in one line (exit 2, scripts/cli_errors.py); the parent names the model."""
    weights = checkout / "runs" / "act_parity" / "checkpoint" / "best" / "model.safetensors"
    kept = weights.read_bytes()
    try:
        weights.write_bytes(b"not a safetensors file")
        with pytest.raises(SystemExit, match=r"^error: act_parity: its benchmark process exited with 2 "):
            bench_inference.bench_apart("act_parity", checkout, [1], 1)
    finally:
        weights.write_bytes(kept)
    err = capfd.readouterr().err
    assert f"error: checkpoint {weights.parent} is corrupt (" in err and "Traceback" not in err, err


def test_timed_warms_each_engine_up_for_the_settle_time_before_timing_it(monkeypatch):
    monkeypatch.setattr(bench_inference, "SETTLE_S", 0.05)
    calls: list[tuple[str, float]] = []

    def engine(key: str, ms: float):
        def call():
            calls.append((key, time.perf_counter()))
            time.sleep(ms / 1000)
        return call

    # Medians of 5 rounds: the 30-60 ms stalls a loaded VM gives a call now and then would have to hit
    # 3 of an engine's 5 timed calls to move its median.
    got = bench_inference.timed({"a": engine("a", 2), "b": engine("b", 6)}, 5)
    assert 2 <= got["a"] < 20 and 6 <= got["b"] < 25 and got["b"] > got["a"]
    stints = [[t for _, t in run] for _, run in groupby(calls, key=lambda c: c[0])]
    assert len(stints) == 2 + 2 * 5  # the first calls, then each engine in turn in each round
    # each stint: untimed calls for at least the settle time, then the timed one
    assert all(len(s) >= 3 and s[-1] - s[0] >= 0.05 for s in stints[2:]), [len(s) for s in stints]
