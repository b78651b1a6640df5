"""Shared fixtures: tiny configs and deterministic synthetic batches for every registered model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent

# Tiny configs per registered model, the smoke profile's (profiles/smoke.yaml `archs`): a new model is
# covered by adding one entry there.
TINY = yaml.safe_load((ROOT / "profiles" / "smoke.yaml").read_text())["archs"]


# `make test-fast` (ATTNZOO_TEST_FAST=1) runs the tests not marked slow or integration, and holds them
# to that: a test there that starts a process or listens on a socket fails, naming the marker it lacks.
FAST = os.environ.get("ATTNZOO_TEST_FAST") == "1"
# What libraries run to describe the machine (MLflow records the commit; platform.uname asks `uname -p`):
# milliseconds each, and allowed there.
PROBES = {"git", "uname", "ldconfig"}


RUNNING: dict[str, str] = {"test": "a fixture"}


def pytest_runtest_setup(item):
    RUNNING["test"] = item.nodeid


@pytest.fixture(autouse=True, scope="session")
def _fast_lane_starts_nothing():
    """Session-wide, so a module's or the session's fixtures (a server, a published repository) are held
    to it too."""
    if not FAST:
        yield
        return
    import socket

    def refuse(what):
        raise RuntimeError(f"{RUNNING['test']} {what} in the fast lane: mark it pytest.mark.integration "
                           "(make test runs it)")

    popen = subprocess.Popen.__init__

    def probes_only(self, args, *rest, **kwargs):
        program = (args.split()[0] if isinstance(args, str) else os.fspath(args[0])) if args else ""
        if os.path.basename(program) not in PROBES:
            refuse(f"starts a process ({os.path.basename(program)})")
        popen(self, args, *rest, **kwargs)

    def no_listen(self, *args):
        refuse("listens on a socket")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", probes_only)
        patch.setattr(socket.socket, "listen", no_listen)
        yield


SEQ2SEQ = ("bahdanau", "luong", "transformer")  # translation batches: src, src_len, tgt_in, tgt_out


def tiny_batch(arch: str, seed: int = 0, batch: int = 3) -> dict[str, torch.Tensor]:
    """A deterministic batch in the format the model's task produces."""
    g = torch.Generator().manual_seed(seed)
    if arch in SEQ2SEQ:
        cfg = TINY[arch]
        src_len = torch.tensor([6, 4, 2][:batch])
        src = torch.randint(4, cfg["src_vocab"], (batch, 6), generator=g)
        src[:, -1] = 2
        for b, n in enumerate(src_len):
            src[b, n - 1] = 2
            src[b, n:] = 0
        tgt = torch.randint(4, cfg["tgt_vocab"], (batch, 5), generator=g)
        tgt_in = torch.cat([torch.ones(batch, 1, dtype=torch.long), tgt], 1)
        tgt_out = torch.cat([tgt, torch.full((batch, 1), 2)], 1)
        return {"src": src, "src_len": src_len, "tgt_in": tgt_in, "tgt_out": tgt_out}
    if arch == "ntm":
        from pipeline.tasks.copy import CopyTask

        seqs = [torch.randint(0, 2, (n, 4), generator=g, dtype=torch.uint8) for n in (3, 5, 2)[:batch]]
        return CopyTask().collate(seqs)
    if arch == "pointer_net":  # convex hulls of 7, 5 and 4 points (right-padded)
        import numpy as np

        from pipeline.tasks.convex_hull import ConvexHullTask

        task, rng = ConvexHullTask(), np.random.default_rng(seed)
        items = []
        for n in (7, 5, 4)[:batch]:
            points, target = task.generate(rng, n)
            items.append({"points": torch.from_numpy(points), "target": torch.tensor(target + [0])})
        return task.collate(items)
    if arch == "act":
        import numpy as np

        from pipeline.tasks.parity import ParityTask, make_split

        split = make_split(np.random.default_rng(seed), batch, TINY[arch]["input_size"])
        return ParityTask().collate(list(zip(split["x"], split["y"].tolist())))
    if arch == "neural_programmer":
        import numpy as np

        from pipeline.tasks.table_qa import TableQATask

        task = TableQATask()
        split = task.make_split(np.random.default_rng(seed), batch, {"min_rows": 3, "max_rows": 5})
        return task.collate([{k: v[i] for k, v in split.items()} for i in range(batch)])
    if arch == "show_attend_tell":  # 84×84 canvases of random "digits" with real captions
        import numpy as np

        from pipeline.tasks.mnist_captions import WORD_ID, MnistCaptionsTask, caption, make_layouts, render

        rng = np.random.default_rng(seed)
        digits = rng.integers(0, 256, (20, 28, 28)).astype(np.uint8)
        labels = np.arange(20) % 10
        layout = make_layouts(rng, labels, batch, 3, 2, 2, 3)
        items = []
        for i in range(batch):
            slots = np.flatnonzero(layout["index"][i] >= 0)
            words = caption([int(labels[layout["index"][i, k]]) for k in slots],
                            [(int(layout["row"][i, k]), int(layout["col"][i, k])) for k in slots])
            items.append({"image": render(digits, layout, i, 84), "tgt": [WORD_ID[w] for w in words]})
        return MnistCaptionsTask().collate(items)
    if arch == "ram":  # a bright 4×4 square somewhere on a dark canvas; the label is its quadrant
        size = TINY[arch]["image_size"]
        image = torch.zeros(batch, size, size)
        corner = torch.randint(0, size - 4, (batch, 2), generator=g)
        for b, (y, x) in enumerate(corner.tolist()):
            image[b, y : y + 4, x : x + 4] = 1.0
        label = (corner[:, 0] >= size // 2 - 2).long() * 2 + (corner[:, 1] >= size // 2 - 2).long()
        return {"image": image, "label": label}
    if arch == "draw":  # binary images (a filled box each) plus fixed prior (x) and posterior (noise) draws
        cfg = TINY[arch]
        size = cfg["image_size"]
        image = torch.zeros(batch, size, size)
        for b, (y, x, h, w) in enumerate(torch.randint(1, size // 2, (batch, 4), generator=g).tolist()):
            image[b, y : y + h + 1, x : x + w + 1] = 1.0
        shape = (batch, cfg["steps"], cfg["latent"])
        return {"image": image, "x": torch.randn(shape, generator=g), "noise": torch.randn(shape, generator=g)}
    if arch == "attention_ocr":  # real words rendered in a real font at height 16, three widths
        import numpy as np

        from pipeline.tasks.ocr_words import VOCAB, OcrWordsTask, load_fonts, render

        rng = np.random.default_rng(seed)
        font = load_fonts(["dejavu/DejaVuSans.ttf"], range(12, 13))["dejavu/DejaVuSans.ttf"][12]
        style = {"slant": 0.1, "blur": 0.0, "noise": 2, "margin": 2, "background": [200, 255], "inverted": 0.0}
        items = [{"image": render(w, font, rng, TINY[arch]["height"], 64, style), "tgt": [VOCAB.index(c) for c in w]}
                 for w in ("attention", "zoo", "model")[:batch]]
        return OcrWordsTask().collate(items)
    if arch == "speech_attention":  # random "stacked log-mel" steps: 10, 7 and 8 of them, 4 digits each
        steps = torch.tensor([10, 7, 8][:batch])
        feats = torch.randn(batch, 10, TINY[arch]["input_size"], generator=g)
        feats = feats * (torch.arange(10) < steps[:, None]).unsqueeze(-1)  # zero padding, as collate pads
        tgt = torch.randint(3, 13, (batch, 4), generator=g)
        return {"features": feats, "steps": steps,
                "tgt_in": torch.cat([torch.ones(batch, 1, dtype=torch.long), tgt], 1),
                "tgt_out": torch.cat([tgt, torch.full((batch, 1), 2)], 1)}
    raise KeyError(f"add a tiny batch for '{arch}' to tests/conftest.py")


@pytest.fixture(params=sorted(TINY))
def arch(request):
    return request.param


def copy_repo(dest: Path) -> Path:
    """Copy the repository's tracked and untracked-not-ignored files (no venv, data, runs)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM a server the test started, and SIGKILL it if it has not exited ``timeout`` s later."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def venv_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'mlflow.db'}"
    env["PYTHONPATH"] = str(tmp)
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture(scope="session")
def smoke_translation(tmp_path_factory) -> Path:
    """The smoke profile's German-English pairs, prepared as the translation task prepares a user's
    corpus (SentencePiece models, splits, manifest): a data/prepared/translation_de_en folder."""
    from pipeline.stages.prepare import prepare

    out = tmp_path_factory.mktemp("translation") / "data"
    prepare("translation_de_en", {"seed": 3, "vocab_size": 400, "corpus": str(ROOT / "profiles" / "smoke_de_en.tsv"),
                                  "val_size": 40, "test_size": 40, "max_doc_share": 0.2,
                                  "clean": {"min_words": 3, "max_words": 40}}, out)
    return out


def trained_looking_transformer(data: Path, seed: int = 5, scale: float = 0.2):
    """A tiny Transformer over ``data``'s vocabularies whose weights are perturbed away from the
    initialisation, so that its answers vary with the input (an untrained one emits one token)."""
    import sentencepiece as spm

    import models

    size = {s: spm.SentencePieceProcessor(model_file=str(data / f"spm.{s}.model")).get_piece_size()
            for s in ("de", "en")}
    torch.manual_seed(seed)
    model = models.build("transformer", {"src_vocab": size["de"], "tgt_vocab": size["en"], "dim": 32, "heads": 4,
                                         "ff_dim": 64, "enc_layers": 2, "dec_layers": 2, "max_len": 20}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


@pytest.fixture(scope="session")
def published(tmp_path_factory):
    """A tiny model repository with every kind of served model (tests/serving_repo.py), built once
    per session and shared by the serving test modules (none of them writes to it)."""
    from tests.serving_repo import build_published

    return build_published(tmp_path_factory.mktemp("publish"))


class Planted:
    """A pickle that runs code when it is unpickled: it writes the file named at planting time. What a
    hostile checkpoint, packed case or MLflow model could hold; the tests show it is never loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))
