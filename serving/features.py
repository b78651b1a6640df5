"""Log-mel features of a waveform, in numpy only: ``prepare`` (training data) and the server
(raw audio requests) call this one function, so a served model sees exactly the features it was
trained on.

25 ms Hann windows every 10 ms at 16 kHz, 512-point FFT, power spectrum, ``n_mels`` triangular
filters on the HTK mel scale from 0 to 8 kHz, log(· + 1e-6), then per-utterance mean and variance
normalisation per bin (no corpus statistics to ship with a model); :func:`stack_frames` then puts
``STACK`` frames side by side per encoder step.
"""

from __future__ import annotations

import numpy as np

SAMPLE_RATE = 16000
WINDOW = 400  # 25 ms
HOP = 160  # 10 ms
N_FFT = 512
# Frames per encoder step (30 ms): the speech models read STACK consecutive frames side by side.
# Part of the feature definition, so the server stacks exactly as training did.
STACK = 3


def mel_filterbank(n_mels: int, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """Triangular filters [n_mels, n_fft/2+1] on the HTK mel scale, 0 Hz to Nyquist."""
    mel = lambda f: 2595.0 * np.log10(1.0 + f / 700.0)  # noqa: E731
    hz = lambda m: 700.0 * (10.0 ** (m / 2595.0) - 1.0)  # noqa: E731
    edges = hz(np.linspace(mel(0.0), mel(sample_rate / 2), n_mels + 2))  # [n_mels+2] Hz
    bins = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)  # [F]
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]  # [n_mels,1] each
    rising = (bins[None] - lower) / (centre - lower)
    falling = (upper - bins[None]) / (upper - centre)
    return np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)


def frames_of(samples: int) -> int:
    """Feature frames of a waveform of ``samples`` samples (at least one window)."""
    return 1 + max(samples - WINDOW, 0) // HOP


def log_mel(wave: np.ndarray, n_mels: int = 40, normalise: bool = True) -> np.ndarray:
    """wave [S] float in [-1, 1] at 16 kHz -> log-mel features float32 [frames_of(S), n_mels],
    normalised per utterance and bin unless ``normalise`` is False."""
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim != 1:
        raise ValueError(f"a waveform is one-dimensional, got shape {wave.shape}")
    if wave.shape[0] < WINDOW:
        wave = np.pad(wave, (0, WINDOW - wave.shape[0]))
    count = frames_of(wave.shape[0])
    starts = np.arange(count)[:, None] * HOP  # [F,1]
    frames = wave[starts + np.arange(WINDOW)[None]]  # [F,WINDOW]
    spectrum = np.abs(np.fft.rfft(frames * np.hanning(WINDOW).astype(np.float32), n=N_FFT)) ** 2  # [F,N_FFT/2+1]
    feats = np.log(spectrum @ mel_filterbank(n_mels).T + 1e-6)  # [F,n_mels]
    if normalise:
        feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-5)
    return feats.astype(np.float32)


def stack_frames(feats: np.ndarray, k: int = STACK) -> np.ndarray:
    """features [F, M] -> [ceil(F / k), k·M]: k consecutive frames side by side, the last group
    zero-padded (stacked per utterance, before any batch padding)."""
    steps = -(-feats.shape[0] // k)
    padded = np.zeros((steps * k, feats.shape[1]), dtype=feats.dtype)
    padded[: feats.shape[0]] = feats
    return padded.reshape(steps, k * feats.shape[1])  # [S·k,M] -> [S,k·M]
