"""Show, Attend and Tell and its task: caption grammar, rendering, attention scoring, the
soft/hard objectives and the hard variant's deterministic export."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import models
from pipeline.stages.export import export_onnx, parity_check
from pipeline.tasks.common.mnist import CELL
from pipeline.tasks.mnist_captions import caption, make_layouts, peak_on_digit, relation, render
from tests.conftest import TINY, tiny_batch


def test_caption_names_digits_in_value_order_and_relates_each_to_the_next():
    # 7 top-left, 2 top-middle, 4 middle: "two above four", then 4 vs 7 ties (1 row, 1 column): columns win
    assert caption([7, 2, 4], [(0, 0), (0, 1), (1, 1)]) == "two above four right of seven".split()
    assert relation((2, 0), (0, 0)) == ["below"]
    assert relation((1, 0), (1, 2)) == ["left", "of"]
    assert caption([5, 3], [(2, 2), (2, 0)]) == "three left of five".split()


def test_layouts_and_rendering():
    rng = np.random.default_rng(0)
    labels = np.arange(30) % 10
    layout = make_layouts(rng, labels, 50, grid=3, jitter=3, min_digits=2, max_digits=3)
    used = layout["index"] >= 0
    assert set(used.sum(1).tolist()) == {2, 3}
    for i in range(50):
        slots = np.flatnonzero(used[i])
        assert len({int(labels[layout["index"][i, k]]) for k in slots}) == len(slots)  # distinct digits
        assert len({(int(layout["row"][i, k]), int(layout["col"][i, k])) for k in slots}) == len(slots)
        assert np.all(np.abs(layout["top"][i, slots] - layout["row"][i, slots] * CELL) <= 3)
        order = slots[np.argsort(labels[layout["index"][i, slots]])]  # caption order
        drow, dcol = np.diff(layout["row"][i, order]), np.diff(layout["col"][i, order])
        assert np.all(np.abs(drow) != np.abs(dcol))  # never diagonal to the next digit
    digits = np.zeros((30, CELL, CELL), dtype=np.uint8)
    digits[:, 10:18, 10:18] = 200
    canvas = render(digits, layout, 0, 84)
    assert canvas.shape == (84, 84) and canvas.sum() == 200 * 64 * used[0].sum()
    for k in np.flatnonzero(used[0]):
        y, x = layout["top"][0, k], layout["left"][0, k]
        assert canvas[y + 10 : y + 18, x + 10 : x + 18].min() == 200


def test_peak_on_digit():
    amap = np.zeros((10, 10))
    amap[1, 8] = 1.0  # centre (12.6, 71.4) px on an 84-px canvas
    assert peak_on_digit(amap, (0, 56, 28, 84), 84)
    assert not peak_on_digit(amap, (28, 56, 56, 84), 84)
    assert not peak_on_digit(amap, None, 84)  # the named digit is not on the canvas


def test_doubly_stochastic_term_matches_eq_14():
    torch.manual_seed(0)
    cfg = {**TINY["show_attend_tell"], "doubly_stochastic": 1.0}
    model = models.build("show_attend_tell", cfg).eval()
    batch = tiny_batch("show_attend_tell")
    loss, logs = model.loss(batch)
    # recompute Σ_i (1 - Σ_t α_ti)² over the real steps with the inference steps (teacher forced)
    memory, keys, h, c = model.encode(batch["image"])
    alphas = []
    for t in range(batch["tgt_in"].shape[1]):
        alpha = model.attend(h, keys)
        _, h, c = model.advance(batch["tgt_in"][:, t], h, c, model.context(alpha, memory))
        alphas.append(alpha)
    real = (batch["tgt_out"] != 0).float().unsqueeze(-1)
    expected = ((1 - (torch.stack(alphas, 1) * real).sum(1)) ** 2).sum(1).mean()
    assert torch.allclose(logs["doubly_stochastic"], expected, atol=1e-5)
    assert torch.allclose(loss, logs["nll"] + expected, atol=1e-5)


def test_hard_attention_objective():
    torch.manual_seed(0)
    cfg = {**TINY["show_attend_tell"], "attention": "hard", "expected_fraction": 0.0, "hard_inference": "argmax"}
    model = models.build("show_attend_tell", cfg).train()
    batch = tiny_batch("show_attend_tell")
    loss, logs = model.loss(batch)
    assert bool(model.baseline_set)
    first = float(model.baseline)
    loss.backward()
    # REINFORCE reaches f_att although sampled locations are not differentiable
    assert float(model.attention.v.weight.grad.abs().sum()) > 0
    _, logs = model.loss(batch)
    assert float(model.baseline) != first  # b <- 0.9 b + 0.1 log p(y|s)
    assert logs["entropy"] > 0
    # inference: the most probable region, deterministically
    model.eval()
    memory, keys, h, _ = model.encode(batch["image"])
    alpha = model.attend(h, keys)
    ctx = model.context(alpha, memory)
    assert torch.equal(ctx, memory[torch.arange(3), alpha.argmax(-1)])
    a, b = model.predict(batch), model.predict(batch)
    assert torch.equal(a["tokens"], b["tokens"])
    model.cfg.hard_inference = "expectation"  # the authors' sampler: Σ α a, as soft attention
    assert torch.allclose(model.context(alpha, memory), torch.bmm(alpha.unsqueeze(1), memory).squeeze(1))


@pytest.mark.parametrize("attention,inference", [("soft", "expectation"), ("hard", "argmax")])
def test_both_variants_export_with_parity(attention, inference, tmp_path):
    torch.manual_seed(0)
    model = models.build("show_attend_tell", {**TINY["show_attend_tell"], "attention": attention,
                                              "hard_inference": inference}).eval()
    export_onnx(model, tmp_path)
    cases = [(f"batch {b}", tiny_batch("show_attend_tell", seed=b, batch=b)) for b in (1, 3)]
    report = parity_check(model, tmp_path, cases, {"atol": 1e-4, "rtol": 1e-3}, "cpu")
    assert report["passed"], report
    assert all("tokens" in c["e2e"] and "attention" in c["e2e"] for c in report["cases"])


def test_reinforce_trains_attention_but_not_the_cnn():
    """The policy terms reach f_att only; the CNN and the decoder learn from the likelihood."""
    batch = tiny_batch("show_attend_tell")
    grads = {}
    for weight in (0.0, 1.0):
        torch.manual_seed(0)
        cfg = {**TINY["show_attend_tell"], "attention": "hard", "expected_fraction": 0.0,
               "reinforce_weight": weight, "entropy_weight": weight}
        model = models.build("show_attend_tell", cfg).train()
        model.loss(batch)  # sets the baseline, so the second call has nonzero advantages
        torch.manual_seed(1)
        model.loss(batch)[0].backward()
        grads[weight] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name, grad in grads[0.0].items():
        if not name.startswith("attention."):
            assert torch.allclose(grad, grads[1.0][name], atol=1e-7), name
    for name in ("attention.v.weight", "attention.query.weight", "attention.key.weight"):
        assert not torch.allclose(grads[0.0][name], grads[1.0][name]), name
