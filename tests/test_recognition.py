"""The recognition family: OCR rendering and model, speech features, synthesis and model."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import models
from pipeline.tasks.common.recognition import cer, edit_distance
from serving.features import HOP, SAMPLE_RATE, WINDOW, frames_of, log_mel, mel_filterbank, stack_frames
from tests.conftest import TINY, tiny_batch

SPEECH = TINY["speech_attention"]


def test_edit_distance_and_cer():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3 and edit_distance("abc", "abc") == 0
    assert cer(["abd", "xyz"], ["abc", "xy"]) == pytest.approx(100 * 2 / 5)


# ---- speech features ------------------------------------------------------------------------
def test_mel_filters_are_triangles_peaking_at_one():
    fb = mel_filterbank(40)
    assert fb.shape == (40, 257) and fb.min() >= 0
    assert np.all(fb.max(1) > 0.5) and np.all(fb.max(1) <= 1.0)
    peaks = fb.argmax(1)
    assert np.all(np.diff(peaks) >= 0)  # centres rise with the filter index


def test_a_tone_lights_the_mel_bin_of_its_frequency():
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE  # 1 s
    raw = log_mel(0.5 * np.sin(2 * np.pi * 1000 * t), 40, normalise=False)
    assert raw.shape == (frames_of(SAMPLE_RATE), 40) == (1 + (SAMPLE_RATE - WINDOW) // HOP, 40)
    fb = mel_filterbank(40)
    bin_1k = int(np.argmax(fb[:, round(1000 * 512 / SAMPLE_RATE)]))
    assert set(raw.argmax(1).tolist()) == {bin_1k}
    # peak power (0.5 / 2 · Σ Hann = 0.25 · 200)² = 2500 at 1 kHz: log about 7.8 (measured 7.9 with the side bins)
    assert 6.0 < float(raw[:, bin_1k].mean()) < 9.0 and float(raw[:, 0].mean()) < 0.0
    noisy = log_mel(np.random.default_rng(0).normal(0, 0.1, SAMPLE_RATE), 40)  # per-utterance normalisation
    np.testing.assert_allclose(noisy.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(noisy.std(0), 1, atol=1e-3)
    assert log_mel(np.zeros(100), 40).shape == (1, 40)  # shorter than a window: one frame


def test_stacking_puts_three_frames_side_by_side_and_pads_the_last_group():
    feats = np.arange(7 * 2, dtype=np.float32).reshape(7, 2)  # 7 frames of 2 bins
    stacked = stack_frames(feats, 3)
    assert stacked.shape == (3, 6)
    np.testing.assert_array_equal(stacked[1], feats[3:6].reshape(-1))
    np.testing.assert_array_equal(stacked[2], [12, 13, 0, 0, 0, 0])


@pytest.mark.integration
def test_espeak_synthesis_is_16khz_speech_and_noise_follows_the_snr():
    from pipeline.tasks.spoken_digits import add_noise, synthesise

    audio = synthesise("three one four", "en-us+m3", 160, 50)
    assert audio.dtype == np.float32 and 0.6 * SAMPLE_RATE < audio.shape[0] < 3 * SAMPLE_RATE
    assert 0.05 < np.abs(audio).max() <= 1.0
    noisy = add_noise(audio, 10.0, np.random.default_rng(0))
    snr = 10 * np.log10(np.mean(audio**2) / np.mean((noisy - audio) ** 2))
    assert snr == pytest.approx(10.0, abs=0.3)


# ---- OCR rendering ---------------------------------------------------------------------------
def test_rendering_is_deterministic_and_stride_aligned():
    from pipeline.tasks.ocr_words import WIDTH_STEP, load_fonts, render

    style = {"slant": 0.3, "blur": 1.0, "noise": 12, "margin": 4, "background": [140, 255], "inverted": 0.2}
    font = load_fonts(["fifthhorseman/dkg.ttf"], range(24, 25))["fifthhorseman/dkg.ttf"][24]
    a = render("zebra", font, np.random.default_rng(3), 32, 160, style)
    b = render("zebra", font, np.random.default_rng(3), 32, 160, style)
    assert np.array_equal(a, b) and a.dtype == np.uint8 and a.shape[0] == 32 and a.shape[1] % WIDTH_STEP == 0
    long = render("characteristically", font, np.random.default_rng(3), 32, 64, style)
    assert long.shape == (32, 64)  # squeezed to the maximum width
    assert a.std() > 20  # ink on a background, not a blank


def test_word_split_keeps_test_words_out_of_training():
    from pipeline.tasks.ocr_words import split_words

    words = [f"w{i}" for i in range(5000)]
    split = split_words(words, np.random.default_rng(0), 300, 700)
    assert (len(split["val"]), len(split["test"])) == (300, 700)
    assert not set(split["train"]) & (set(split["val"]) | set(split["test"]))
    assert sorted(split["train"] + split["val"] + split["test"]) == sorted(words)


# ---- OCR model -------------------------------------------------------------------------------
@pytest.mark.parametrize("annotation", ["columns", "grid"])
def test_ocr_padded_batch_reads_each_image_as_alone(annotation):
    torch.manual_seed(0)
    model = models.build("attention_ocr", {**TINY["attention_ocr"], "annotation": annotation, "recursions": 1}).eval()
    batch = tiny_batch("attention_ocr")
    out = model.predict(batch)
    rows = model.annotation_rows
    assert rows == (2 if annotation == "grid" else 1)
    cols = batch["image"].shape[2] // 4
    for i in range(3):
        w = int(batch["width"][i])
        alone = model.predict({"image": batch["image"][i : i + 1, :, :w], "width": batch["width"][i : i + 1]})
        steps = alone["tokens"].shape[1]
        assert torch.equal(alone["tokens"][0], out["tokens"][i, :steps])
        padded = out["attention"][i, :steps].reshape(steps, rows, cols)  # [T,L] -> [T,h,w']
        assert float(padded[:, :, w // 4 :].abs().sum()) == 0.0  # padding columns never attended
        torch.testing.assert_close(padded[:, :, : w // 4].reshape(steps, -1), alone["attention"][0], atol=1e-6,
                                   rtol=0)


def test_recursive_cnn_shares_one_convolution_across_iterations():
    plain = models.build("attention_ocr", {**TINY["attention_ocr"], "recursions": 0})
    one = models.build("attention_ocr", {**TINY["attention_ocr"], "recursions": 1})
    three = models.build("attention_ocr", {**TINY["attention_ocr"], "recursions": 3})
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    norms = 2 * 2 * (4 * TINY["attention_ocr"]["channels"])  # per extra iteration: a BatchNorm in blocks 3 and 4
    assert count(three) - count(one) == 2 * norms  # iterations add batch norms only, not convolutions
    assert count(one) > count(plain)  # the shared convolution itself


# ---- speech model ----------------------------------------------------------------------------
def _speech_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    return tiny_batch("speech_attention", seed=seed)


def test_location_aware_attention_reads_the_previous_alignment_and_content_does_not():
    batch = _speech_batch()
    for kind, depends in (("location", True), ("content", False)):
        torch.manual_seed(0)
        model = models.build("speech_attention", {**SPEECH, "attention": kind}).eval()
        memory, keys, state, align, mask = model.encode(batch["features"], batch["steps"])
        assert torch.equal(align[:, 0], torch.ones(3)) and float(align[:, 1:].sum()) == 0  # α_0 at the start
        moved = torch.roll(align, 3, dims=1)
        a, b = model.attend(state, align, keys, mask), model.attend(state, moved, keys, mask)
        assert (not torch.allclose(a, b)) == depends
        torch.testing.assert_close(a.sum(1), torch.ones(3))
        assert float(a[1, 7:].abs().sum()) == 0.0  # past the 7 real steps of utterance 1


def test_windowing_smoothing_and_sharpening():
    batch = _speech_batch(1)
    torch.manual_seed(0)
    base = models.build("speech_attention", SPEECH).eval()
    memory, keys, state, align, mask = base.encode(batch["features"], batch["steps"])
    prev = torch.zeros_like(align)
    prev[:, 4] = 1.0  # previous alignment's median at step 4
    windowed = models.build("speech_attention", {**SPEECH, "window_before": 1, "window_after": 2}).eval()
    windowed.load_state_dict(base.state_dict())
    a = windowed.attend(state, prev, keys, mask)
    assert float(a[:, :3].abs().max()) == 0.0 and float(a[:, 7:].abs().max()) == 0.0
    torch.testing.assert_close(a.sum(1), torch.ones(3))
    smooth = models.build("speech_attention", {**SPEECH, "smoothing": True}).eval()
    smooth.load_state_dict(base.state_dict())
    s = smooth.attend(state, prev, keys, mask)
    torch.testing.assert_close(s.sum(1), torch.ones(3))
    assert float(s.max()) < float(base.attend(state, prev, keys, mask).max())  # σ flattens the peak
    sharp = models.build("speech_attention", {**SPEECH, "sharpening": 4.0}).eval()
    sharp.load_state_dict(base.state_dict())
    entropy = lambda p: float(-(p * torch.log(p + 1e-12)).sum())  # noqa: E731
    assert entropy(sharp.attend(state, prev, keys, mask)) < entropy(base.attend(state, prev, keys, mask))


@pytest.mark.parametrize("attention", ["content", "location"])
def test_speech_padded_batch_decodes_each_utterance_as_alone_and_learns(attention):
    torch.manual_seed(0)
    model = models.build("speech_attention", {**SPEECH, "attention": attention})
    batch = _speech_batch(2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = float(model.loss(batch)[0])
    for _ in range(120):
        loss, _ = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.1 * first
    model.eval()
    out = model.predict(batch)
    assert torch.equal(out["tokens"][:, :5], batch["tgt_out"])  # memorised
    for i in range(3):
        n = int(batch["steps"][i])
        alone = model.predict({"features": batch["features"][i : i + 1, :n], "steps": batch["steps"][i : i + 1]})
        assert torch.equal(alone["tokens"][0], out["tokens"][i, : alone["tokens"].shape[1]])
        steps = alone["attention"].shape[2]
        torch.testing.assert_close(out["attention"][i, : alone["attention"].shape[1], :steps], alone["attention"][0],
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("task_name,arch,extra", [
    ("ocr_words", "attention_ocr", {"height": 32}),
    pytest.param("spoken_digits", "speech_attention", {"input_size": 120},
                 marks=pytest.mark.integration)])  # espeak-ng synthesises its speech: a process
def test_evaluation_on_tiny_prepared_data_survives_decodes_without_eos(task_name, arch, extra, tmp_path):
    """prepare → evaluate with a model that runs out of max_len (no EOS step: the plots must cope)."""
    import json

    import yaml

    from pipeline.tasks import get_task
    from tests.conftest import ROOT

    task = get_task(task_name)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())["tasks"][task_name]
    params.update(train_size=12, val_size=4, test_size=6, test_long_size=3)
    data = tmp_path / "data"
    data.mkdir()
    manifest = task.prepare(params, data)
    (data / "manifest.json").write_text(json.dumps(manifest))
    torch.manual_seed(0)
    model = models.build(arch, {**TINY[arch], **extra, "vocab": manifest["model_defaults"]["vocab"], "max_len": 2})
    run = SimpleNamespace(data_dir=data, evaluate={"beam": 2, "length_penalty": 0}, name=arch)
    (tmp_path / "plots").mkdir()
    metrics, row = task.evaluate(model.eval(), run, tmp_path / "plots")
    assert len(list((tmp_path / "plots").glob("*.png"))) >= 3
    cer_key = "cer_beam" if task_name == "ocr_words" else "cer"
    assert metrics[cer_key] >= 50.0  # two characters at most for words of 3+ letters
