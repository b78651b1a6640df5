"""Speech recognisers: raw audio in, the transcript and its alignment out."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from serving import decode
from serving.admission import over_limit
from serving.base import ServedModel, decode_params, specs
from serving.features import STACK, log_mel, stack_frames
from serving.kinds import register
from serving.protocol import RequestError, TensorSpec


@register("audio")
class SpeechModel(ServedModel):
    """encoder + decoder_step of an attention speech recogniser: raw audio in, the transcript and
    its alignment out. The server computes the log-mel features (``serving/features.py``, the
    function the training data was made with).

    ``audio`` [N, S] holds 16 kHz samples in [-1, 1]; ``samples`` [N] (optional) the length of each
    clip in a right-padded batch (default: S for all). ``alignment`` [N, T, F'] is α of every
    character and the EOS step over encoder steps of ``stack`` feature frames (10 ms each).
    """

    platform = "attnzoo_speech"
    limit_axes = {"audio": {0: ("clips", "rows")}}

    def __init__(self, name: str, version: int, folder: Path, meta: dict, graphs: dict, limits=None):
        self.encoder, self.step = graphs["encoder"], graphs["decoder_step"]
        self.serving = meta["serving"]
        self.n_mels = specs(self.encoder.session.get_inputs())[0].shape[2] // STACK
        super().__init__(name, version, [TensorSpec("audio", "FP32", (-1, -1)),
                                         TensorSpec("samples", "INT64", (-1,), optional=True)], [
            TensorSpec("text", "BYTES", (-1,)), TensorSpec("alignment", "FP32", (-1, -1, -1))], limits)

    def infer(self, feeds, params):
        mode, beam = decode_params(params, "beam", self.serving)
        audio = feeds["audio"].astype(np.float32)
        n, full = audio.shape
        rate = int(self.serving.get("sample_rate", 16000))
        over_limit("the length of a clip in seconds", full / rate, "audio_seconds", self.limits.audio_seconds)
        if not np.isfinite(audio).all() or np.abs(audio).max(initial=0) > 1:
            raise RequestError("input 'audio' must hold samples from -1 to 1")
        samples = feeds.get("samples", np.full(n, full, dtype=np.int64))
        if samples.shape != (n,) or (n and (samples.min() < 1 or samples.max() > full)):
            raise RequestError(f"input 'samples' must hold one length from 1 to {full} per clip")
        if n == 0:
            return {"text": (np.array([], dtype=object), "BYTES"),
                    "alignment": (np.zeros((0, 0, 0), dtype=np.float32), "FP32")}
        # [S, 3·M] per clip: the features and stacking the training data went through
        feats = [stack_frames(log_mel(audio[i, :k], self.n_mels)) for i, k in enumerate(samples.tolist())]
        steps = np.array([f.shape[0] for f in feats], dtype=np.int64)
        batch = np.zeros((n, steps.max(), feats[0].shape[1]), dtype=np.float32)
        for i, f in enumerate(feats):
            batch[i, : f.shape[0]] = f
        singles = [{"features": f[None], "steps": steps[i : i + 1]} for i, f in enumerate(feats)]
        found = decode.transcribe(self.encoder, self.step, self.serving, {"features": batch, "steps": steps}, singles,
                            mode, beam)
        steps = max(a.shape[0] for _, a in found)
        alignment = np.zeros((n, steps, max(a.shape[1] for _, a in found)), dtype=np.float32)
        for i, (_, alpha) in enumerate(found):
            alignment[i, : alpha.shape[0], : alpha.shape[1]] = alpha
        texts = np.array(["".join(self.serving["vocabulary"][t] for t in tokens) for tokens, _ in found], dtype=object)
        return {"text": (texts, "BYTES"), "alignment": (alignment, "FP32")}
