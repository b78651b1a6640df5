"""``spoken_digits``: digit strings spoken by espeak-ng, as log-mel features.

Each utterance is a random string of ``min_digits``-``max_digits`` digits read as words ("three
one four"), synthesised offline by the Debian ``espeak-ng`` synthesiser with a random English
voice (``voices``) and voice variant (``variants``: male, female, klatt...), speaking rate and
pitch, resampled from 22.05 to 16 kHz, with white noise added at a random SNR, and turned into
the 40 log-mel features per 10 ms of ``serving.features.log_mel`` (the server computes the same
from raw audio), read three frames per encoder step (``stack_frames``). ``test_long`` holds
strings ``long_factor`` times longer (the location-aware attention claim of Chorowski 2015 §4:
content-only attention loses its place on long input).

Features are kept ragged as float16 (all frames in one [Σ frames, n_mels] array plus lengths).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from pipeline.tasks import Task, TaskError, register_task
from serving.features import SAMPLE_RATE, STACK, log_mel, stack_frames

PAD, BOS, EOS = 0, 1, 2
DIGITS = "0123456789"
VOCAB = ["<pad>", "<s>", "</s>", *DIGITS]
NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SPLITS = ("train", "val", "test", "test_long")


def synthesise(text: str, voice: str, rate: int, pitch: int) -> np.ndarray:
    """espeak-ng speech as float32 [S] in [-1, 1] at 16 kHz."""
    from scipy.signal import resample_poly

    cmd = ["espeak-ng", "-v", voice, "-s", str(rate), "-p", str(pitch), "--stdout", text]
    try:
        out = subprocess.run(cmd, capture_output=True, check=True, timeout=60).stdout
    except subprocess.CalledProcessError as err:
        raise TaskError(f"espeak-ng failed for voice {voice}: {err.stderr.decode(errors='replace').strip()}") from err
    with wave.open(io.BytesIO(out)) as w:
        rate_in = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0
    if rate_in != 22050:
        raise TaskError(f"espeak-ng gave {rate_in} Hz audio; 22050 Hz expected")
    return resample_poly(pcm, 320, 441).astype(np.float32)  # 22050 * 320 / 441 = 16000


def add_noise(x: np.ndarray, snr_db: float, rng: np.random.Generator) -> np.ndarray:
    power = float(np.mean(x**2)) + 1e-12
    return (x + rng.normal(0, np.sqrt(power / 10 ** (snr_db / 10)), size=x.shape)).astype(np.float32)


class SpokenDigitsTask(Task):
    name = "spoken_digits"
    card = {"data": "spoken digit strings synthesised offline with espeak-ng (many voices, rates and pitches), as "
                    "log-mel features",
            "licence": "generated with espeak-ng (Debian espeak-ng, GPL-3+)",
            "paper": "Chorowski et al. 2015"}
    serving = {"input": "audio", "vocabulary": VOCAB, "sample_rate": SAMPLE_RATE}

    def prepare(self, params: dict, out: Path) -> dict:
        from tqdm.auto import tqdm

        if shutil.which("espeak-ng") is None:
            raise TaskError("espeak-ng is missing: install the Debian package `espeak-ng` (`make setup` does)")
        rng = np.random.default_rng(params["seed"])
        voices = [f"{v}+{var}" for v in params["voices"] for var in params["variants"]]
        lo, hi = params["min_digits"], params["max_digits"]
        counts, frames_total = {}, {}
        for split in SPLITS:
            scale = params["long_factor"] if split == "test_long" else 1
            count = params[f"{split}_size"]
            # every random draw happens here, in order, before the (threaded) synthesis
            plans = []
            for _ in range(count):
                digits = "".join(rng.choice(list(DIGITS), size=int(rng.integers(lo * scale, hi * scale + 1))))
                plans.append((digits, voices[int(rng.integers(len(voices)))], int(rng.integers(*params["rate"])),
                              int(rng.integers(*params["pitch"])), float(rng.uniform(*params["snr_db"])),
                              int(rng.integers(2**31))))

            def make(plan):
                digits, voice, rate, pitch, snr, seed = plan
                audio = synthesise(" ".join(NAMES[int(d)] for d in digits), voice, rate, pitch)
                return log_mel(add_noise(audio, snr, np.random.default_rng(seed)), params["n_mels"])

            with ThreadPoolExecutor(max_workers=params["workers"]) as pool:
                feats = list(tqdm(pool.map(make, plans), total=count, desc=f"synthesise {split}", mininterval=5))
            lengths = np.array([f.shape[0] for f in feats], dtype=np.int64)
            torch.save({"features": torch.from_numpy(np.concatenate(feats).astype(np.float16)),  # N x [T_i,M] -> [ΣT,M]
                        "frames": torch.from_numpy(lengths), "digits": [p[0] for p in plans],
                        "voices": [p[1] for p in plans]}, out / f"{split}.pt")
            counts[split] = count
            frames_total[split] = {"mean": round(float(lengths.mean()), 1), "max": int(lengths.max())}
        return {"counts": counts, "frames": frames_total, "voices": len(voices), "sample_rate": SAMPLE_RATE,
                "model_defaults": {"input_size": params["n_mels"] * STACK, "vocab": len(VOCAB), "pad_id": PAD,
                                   "bos_id": BOS, "eos_id": EOS,
                                   "max_len": params["max_digits"] * params["long_factor"] + 1}}

    def load(self, data_dir: Path, split: str) -> list:
        path = data_dir / f"{split}.pt"
        if not path.exists():
            raise TaskError(f"{path} is missing: run `dvc repro prepare@spoken_digits`")
        d = torch.load(path)
        feats = d["features"].numpy()
        ends = np.cumsum(d["frames"].numpy())
        return [{"features": stack_frames(feats[(ends[i - 1] if i else 0) : ends[i]]), "text": text,  # [S,3·M]
                 "tgt": [VOCAB.index(c) for c in text], "voice": d["voices"][i].split("+")[0]}
                for i, text in enumerate(d["digits"])]

    def length(self, item: dict) -> int:
        return item["features"].shape[0]

    def collate(self, items: list[dict]) -> dict:
        """features [B,S,I] float32 (stacked frames, zero-padded), steps [B]; tgt_in = BOS + digits,
        tgt_out = digits + EOS."""
        bsz = len(items)
        steps_of = [it["features"].shape[0] for it in items]
        features = torch.zeros(bsz, max(steps_of), items[0]["features"].shape[1])
        steps = max(len(it["tgt"]) for it in items) + 1
        tgt_in = torch.full((bsz, steps), PAD, dtype=torch.long)
        tgt_out = torch.full((bsz, steps), PAD, dtype=torch.long)
        for b, it in enumerate(items):
            features[b, : steps_of[b]] = torch.from_numpy(it["features"].astype(np.float32))
            y = torch.tensor(it["tgt"], dtype=torch.long)
            tgt_in[b, 0] = BOS
            tgt_in[b, 1 : len(y) + 1] = y
            tgt_out[b, : len(y)] = y
            tgt_out[b, len(y)] = EOS
        return {"features": features, "steps": torch.tensor(steps_of, dtype=torch.long), "tgt_in": tgt_in,
                "tgt_out": tgt_out}

    def example_batch(self, cfg: dict, seed: int = 0, batch: int = 3) -> dict:
        """Random "stacked log-mel" steps (10, 7 and 8 of them, zero-padded as collate pads), 4 digits each."""
        g = torch.Generator().manual_seed(seed)
        steps = torch.tensor([10, 7, 8][:batch])
        feats = torch.randn(batch, 10, cfg["input_size"], generator=g)
        feats = feats * (torch.arange(10) < steps[:, None]).unsqueeze(-1)  # [B,10,F]*[B,10,1]
        tgt = torch.randint(3, 13, (batch, 4), generator=g)
        return {"features": feats, "steps": steps,
                "tgt_in": torch.cat([torch.ones(batch, 1, dtype=torch.long), tgt], 1),  # [B,1]+[B,4] -> [B,5]
                "tgt_out": torch.cat([tgt, torch.full((batch, 1), 2)], 1)}

    def evaluate(self, model, run, plots: Path) -> tuple[dict, dict]:
        """CER and string accuracy (greedy and beam) on normal-length and ``long_factor``× longer
        strings, CER per voice and by length, and alignment plots of both."""
        from pipeline import plots as P
        from pipeline.tasks.common.recognition import score_set
        from serving.decode import BEAM

        beam = run.evaluate.get("beam", BEAM)
        limit = run.evaluate.get("max_utterances")
        metrics, by_length = {}, {}
        for split in ("test", "test_long"):
            items = self.load(run.data_dir, split)
            items = items[:limit] if limit else items
            m, greedy, maps = score_set(model, run, self, items, VOCAB, "voice", beam, split)
            metrics[split] = m
            by_length.update({f"{k} ({split})": v for k, v in m["cer_by_length"].items()})
            for n in range(min(3, len(items))):
                frames = items[n]["features"].reshape(-1, items[n]["features"].shape[1] // STACK)  # [S,3·M] -> [3S,M]
                letters = (list(greedy[n]) + ["</s>"])[: maps[n].shape[0]]  # no EOS step when max_len ran out
                P.speech_alignment(frames, maps[n], letters, STACK,
                                   plots / f"alignment_{split}_{n}.png",
                                   f"{run.name}: '{greedy[n]}' (true '{items[n]['text']}')")
        metrics.update(cer=metrics["test"]["cer_beam"], cer_long=metrics["test_long"]["cer_beam"],
                       seq_acc=metrics["test"]["seq_acc_beam"], seq_acc_long=metrics["test_long"]["seq_acc_beam"])
        lengths = sorted({int(k.split()[0]) for k in by_length})
        row = {"headline": {"cer": metrics["cer"], "cer_long": metrics["cer_long"], "seq_acc": metrics["seq_acc"],
                            "seq_acc_long": metrics["seq_acc_long"]},
               "by_length": {"metric": "CER % (beam)", "xlabel": "digits in the string",
                             "labels": [str(n) for n in lengths],
                             "values": [by_length.get(f"{n} (test)", by_length.get(f"{n} (test_long)"))
                                        for n in lengths]}}
        return metrics, row

    def parity_batches(self, data_dir: Path) -> list[tuple[str, dict]]:
        """Real test utterances at batch 1, 4 and 8, and long ones at batch 2 (padding exercised)."""
        items, long_items = self.load(data_dir, "test"), self.load(data_dir, "test_long")
        cases = [(f"test utterances × batch {n}", self.collate(items[at : at + n]))
                 for n, at in ((1, 0), (4, 1), (8, 5))]
        return cases + [("long utterances × batch 2", self.collate(long_items[:2]))]


register_task(SpokenDigitsTask())
