"""RAM and DRAW, and their MNIST tasks: rendering, binarisation, the glimpse sensor, the filterbank,
and the objectives' pieces, with numbers checked by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import models
from models.layers import filterbank_window, gaussian_filterbank, glimpse, glimpse_pyramid
from pipeline.tasks.common.mnist import CELL
from pipeline.tasks.common.placed_digits import make_layout, render
from tests.conftest import TINY, tiny_batch


def test_translated_canvases_hold_the_digit_at_its_corner_and_nothing_else():
    rng = np.random.default_rng(0)
    digits = rng.integers(1, 256, (5, CELL, CELL)).astype(np.uint8)
    layout = make_layout(rng, 5, 12, 60, clutter=0, piece=8)
    assert sorted(layout["index"][:5].tolist()) == list(range(5))  # each digit once before any repeats
    canvases = render(digits, layout, 60, 8)
    for i in range(12):
        y, x = layout["corner"][i]
        assert 0 <= y <= 60 - CELL and 0 <= x <= 60 - CELL
        assert np.array_equal(canvases[i, y : y + CELL, x : x + CELL], digits[layout["index"][i]])
        assert int(canvases[i].astype(np.int64).sum()) == int(digits[layout["index"][i]].astype(np.int64).sum())


def test_clutter_pieces_come_from_digits_and_land_where_the_layout_says():
    rng = np.random.default_rng(1)
    digits = np.zeros((4, CELL, CELL), dtype=np.uint8)
    layout = make_layout(rng, 4, 3, 60, clutter=4, piece=8)
    clean = render(digits, layout, 60, 8)
    assert int(clean.sum()) == 0  # blank digits: blank canvases, clutter included
    digits[:] = 100  # every piece of every digit is 100: clutter shows exactly where placed
    canvases = render(digits, layout, 60, 8)
    for i in range(3):
        expect = np.zeros((60, 60), dtype=bool)
        for (ty, tx) in layout["clutter_to"][i]:
            expect[ty : ty + 8, tx : tx + 8] = True
        y, x = layout["corner"][i]
        expect[y : y + CELL, x : x + CELL] = True
        assert np.array_equal(canvases[i] > 0, expect)


def test_glimpse_pyramid_scales_average_blocks_and_zero_outside():
    image = torch.arange(64, dtype=torch.float32).view(1, 1, 8, 8)
    pyramid = glimpse_pyramid(image, 2)
    assert [p.shape[-1] for p in pyramid] == [8, 4]
    # a 2-sample retina centred on the image centre reads pixels (3,3),(3,4),(4,3),(4,4) at scale 0
    # and the 2×2 block means around them at scale 1
    out = glimpse(pyramid, torch.zeros(1, 2), 2)
    fine = image[0, 0, 3:5, 3:5].flatten()
    coarse = image[0, 0].view(4, 2, 4, 2).mean((1, 3))[1:3, 1:3].flatten()
    assert torch.allclose(out[0, :4], fine) and torch.allclose(out[0, 4:], coarse)
    corner = glimpse(pyramid, torch.tensor([[-1.0, -1.0]]), 2)  # centred on the top-left corner
    assert float(corner[0, 0]) == 0.0 and float(corner[0, 3]) == float(image[0, 0, 0, 0])  # outside reads zero
    moved = glimpse(pyramid, torch.tensor([[0.25, 0.0]]), 2)  # one pixel is 0.25 wide: x moves by 1
    assert torch.allclose(moved[0, :4], image[0, 0, 3:5, 4:6].flatten())


def test_filterbank_centres_strides_and_normalises():
    # g̃ = 0, log δ̃ = 0, σ² = 1, γ = 1 on a 28-pixel image with N = 5: centre 14.5, stride 27/4
    params = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0]])
    gx, gy, delta, var, gamma = filterbank_window(params, 28, 28, 5)
    assert float(gx) == pytest.approx(14.5) and float(delta) == pytest.approx(6.75)
    assert float(var) == 1.0 and float(gamma) == 1.0
    f = gaussian_filterbank(gx, delta, var, 5, 28)  # [1,5,28]
    assert torch.allclose(f.sum(-1), torch.ones(1, 5))
    centres = (f * torch.arange(1, 29.0)).sum(-1)[0]  # each filter's mean pixel
    expect = 14.5 + (torch.arange(1, 6.0) - 2.5 - 0.5) * 6.75
    assert torch.allclose(centres[1:4], expect[1:4], atol=1e-3)  # inner filters are symmetric: exact means


def test_draw_write_puts_a_patch_where_the_window_is():
    torch.manual_seed(0)
    model = models.build("draw", TINY["draw"]).eval()
    n, size = TINY["draw"]["write_n"], TINY["draw"]["image_size"]
    with torch.no_grad():
        model.write_window.weight.zero_()
        # window: centre (g̃X, g̃Y) = (-0.5, 0.5), small stride, σ² = e^-2 (wide enough that no
        # filter falls between pixels, where the normalising ε would swallow it), γ = 1
        model.write_window.bias.copy_(torch.tensor([-0.5, 0.5, -2.0, -4.0, 0.0]))
        model.write_patch.weight.zero_()
        model.write_patch.bias.fill_(1.0)
    with torch.no_grad():
        update, window = model.write(torch.zeros(1, TINY["draw"]["hidden"]))
    gx, gy = (size + 1) / 2 * 0.5, (size + 1) / 2 * 1.5
    assert torch.allclose(window[0, :2], torch.tensor([gx, gy]))
    assert float(update.sum()) == pytest.approx(n * n, rel=1e-4)  # each filter row sums to 1: the mass is kept
    peak = divmod(int(update[0].argmax()), size)
    assert abs(peak[0] + 1 - gy) <= 1 and abs(peak[1] + 1 - gx) <= 1  # 1-based pixel of the peak


def test_draw_kl_is_zero_for_the_prior_and_bound_adds_up():
    torch.manual_seed(0)
    model = models.build("draw", TINY["draw"]).eval()
    with torch.no_grad():
        model.posterior.weight.zero_()
        model.posterior.bias.zero_()  # μ = 0, log σ = 0: Q is the prior
    batch = tiny_batch("draw")
    out = model.infer(batch["image"], batch["noise"])
    assert float(out["kl"].abs().max()) < 1e-6
    logits = torch.logit(out["canvases"][:, -1].clamp(1e-6, 1 - 1e-6))
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["image"], reduction="none").sum((1, 2))
    assert torch.allclose(out["recon_nll"], bce, atol=1e-2)


def test_draw_generation_from_the_same_noise_matches_the_step_graph_loop():
    torch.manual_seed(0)
    model = models.build("draw", TINY["draw"]).eval()
    batch = tiny_batch("draw")
    whole = model.generate(batch["x"])
    h, c, canvas = model.initial_state(3, batch["x"])
    for t in range(batch["x"].shape[1]):
        logits, h, c, canvas, window = model.generate_step(batch["x"][:, t], h, c, canvas)
        assert torch.equal(logits, whole["logits"][:, t]) and torch.equal(window, whole["write_window"][:, t])


def test_ram_policy_gradient_reaches_only_the_location_network():
    torch.manual_seed(0)
    model = models.build("ram", TINY["ram"])
    batch = tiny_batch("ram", batch=3)
    logits, locs, log_pi, baselines = model.unroll(batch["image"], sample=True)
    assert log_pi.shape == baselines.shape == (3, TINY["ram"]["glimpses"] - 1)
    (-log_pi.sum()).backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and float(p.grad.abs().sum()) > 0}
    assert grads == {"locate.weight", "locate.bias"}  # core, glimpse and classifier untouched
    model.zero_grad()
    torch.nn.functional.cross_entropy(logits, batch["label"]).backward()
    assert model.locate.weight.grad is None or float(model.locate.weight.grad.abs().sum()) == 0.0


def test_ram_samples_while_training_and_is_deterministic_in_eval():
    torch.manual_seed(0)
    model = models.build("ram", TINY["ram"])
    image = tiny_batch("ram")["image"]
    a = model.unroll(image, sample=True)[1]
    b = model.unroll(image, sample=True)[1]
    assert not torch.equal(a[:, 1:], b[:, 1:])  # sampled moves differ
    model.eval()
    assert torch.equal(model.predict({"image": image})["locations"], model.predict({"image": image})["locations"])


def test_ram_rejects_a_canvas_the_pyramid_cannot_pool():
    with pytest.raises(ValueError, match="divisible"):
        models.build("ram", {**TINY["ram"], "image_size": 18, "scales": 3})


def test_ram_inference_glimpses_sit_on_the_location_grid():
    torch.manual_seed(0)
    image = tiny_batch("ram", batch=3)["image"]
    on_grid = models.build("ram", TINY["ram"]).eval()
    per_unit = TINY["ram"]["image_size"] / 2 / 0.25  # quarter-pixel grid points per [-1, 1] unit
    locs = on_grid.predict({"image": image})["locations"] * per_unit
    assert torch.allclose(locs, torch.round(locs), atol=1e-4)
    torch.manual_seed(0)
    free = models.build("ram", {**TINY["ram"], "location_grid": 0.0}).eval()
    free_locs = free.predict({"image": image})["locations"][:, 1:] * per_unit
    assert not torch.allclose(free_locs, torch.round(free_locs), atol=1e-4)


def test_draw_bound_stays_finite_in_onnx_for_saturated_canvases(tmp_path):
    """A trained canvas holds logits far below -100 on the background; the exported bound must not
    turn them into log(0) (the exporter's binary_cross_entropy_with_logits did)."""
    from pipeline.stages.export import export_onnx
    from serving.runtime import OrtGraph

    torch.manual_seed(0)
    model = models.build("draw", {**TINY["draw"], "attention": "none"}).eval()
    with torch.no_grad():
        model.write_patch.bias.fill_(-150.0)  # every step pushes every pixel's logit 150 lower
    export_onnx(model, tmp_path)
    batch = tiny_batch("draw")
    with torch.no_grad():
        expected = model.infer(batch["image"], batch["noise"])
    got = OrtGraph(tmp_path / "infer.onnx", provider="cpu")({"image": batch["image"].numpy(),
                                                              "noise": batch["noise"].numpy()})
    assert np.isfinite(got["bound"]).all() and torch.isfinite(expected["bound"]).all()
    # pixels that are on cost about 450 nats each (3 steps × 150): the bound is large and exact
    on = batch["image"].sum((1, 2))
    assert torch.allclose(expected["recon_nll"], on * 450, rtol=0.05)
    np.testing.assert_allclose(got["bound"], expected["bound"].numpy(), rtol=1e-5)


def test_draw_evaluation_splits_the_bound_by_ink_and_plots_canvases_only_for_pytorch(tmp_path):
    """The report's by-size row: the test digits by pixels on, each digit in one bucket, and the
    buckets' count-weighted bounds give the test bound; KL per step is a plot of its own. The int8
    twin (no ``infer`` of its own) gets the same figures with no canvases to draw."""
    from types import SimpleNamespace

    from pipeline.tasks import get_task
    from pipeline.tasks.mnist_binarized import INK_BUCKETS

    task = get_task("mnist_binarized")
    data = tmp_path / "data"
    data.mkdir()
    task.prepare({"seed": 0, "train_size": 4, "val_size": 4, "test_size": 700}, data)
    torch.manual_seed(0)
    model = models.build("draw", {**TINY["draw"], "image_size": CELL}).eval()
    run = SimpleNamespace(data_dir=data, evaluate={}, name="draw")
    plots = tmp_path / "plots"
    plots.mkdir()
    metrics, row = task.evaluate(model, run, plots)
    by = row["by_length"]
    ink = task.images(data, "test").reshape(700, -1).sum(1)
    assert by["labels"][0] == f"≤{INK_BUCKETS[0]}" and by["labels"][-1] == f"{INK_BUCKETS[-1] + 1}+"
    assert by["counts"][0] == int((ink <= INK_BUCKETS[0]).sum()) and sum(by["counts"]) == 700
    mean = sum(v * n for v, n in zip(by["values"], by["counts"])) / 700
    assert abs(mean - metrics["test_nll_bound"]) <= 0.0101  # each side rounded to 0.01
    assert len(metrics["kl_by_step"]) == TINY["draw"]["steps"]
    assert {p.name for p in plots.iterdir()} == {"kl_by_step.png", "reconstruction_steps.png", "samples_steps.png"}

    class Twin:  # what quantize's OnnxTwin offers: predict and attributes, no infer/generate
        cfg = model.cfg

        def predict(self, batch):
            return model.predict(batch)

    twin_plots = tmp_path / "twin"
    twin_plots.mkdir()
    assert task.evaluate(Twin(), run, twin_plots) == (metrics, row)
    assert [p.name for p in twin_plots.iterdir()] == ["kl_by_step.png"]
