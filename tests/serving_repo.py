"""The tiny published repository every serving test uses: every kind of served model, seeded.

Built once per `make test` by the ``published`` fixture (tests/conftest.py), whichever test process
needs it first: exporting the models to ONNX is most of a serving test module's set-up time.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import models
from pipeline.serving_meta import memory, serving_meta
from pipeline.stages.export import export_onnx
from pipeline.stages.publish import write_version
from tests.conftest import TINY, one_torchlib_registry

GERMAN = ["Wo ist der Bahnhof?", "Ich habe keine Zeit.", "Das Wetter ist heute schön.", "Er kommt morgen.",
          "Wir gehen nach Hause.", "Sie liest ein Buch.", "Der Hund schläft.", "Kannst du mir helfen?"]
ENGLISH = ["Where is the station?", "I have no time.", "The weather is nice today.", "He comes tomorrow.",
           "We are going home.", "She reads a book.", "The dog is sleeping.", "Can you help me?"]
TEXTS = ["Wo ist der Hund?", "Ich habe heute keine Zeit.", "Das Buch ist schön."]


def _tokenizer(path: Path, lines: list[str]) -> None:
    import sentencepiece as spm

    corpus = path.with_suffix(".txt")
    corpus.write_text("\n".join(lines * 4) + "\n")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(path.with_suffix("")), vocab_size=48,
                                   model_type="unigram", character_coverage=1.0, pad_id=0, bos_id=1, eos_id=2,
                                   unk_id=3, hard_vocab_limit=False, minloglevel=2)


def _publish(repo: Path, name: str, arch: str, task: str, model, tmp: Path, artifacts: list[Path],
             promoted: bool = True) -> dict:
    """One version, exported here (``_Publisher`` for many)."""
    onnx_dir = tmp / f"{name}-{len(list(tmp.iterdir()))}"
    export_onnx(model, onnx_dir)
    return _write(repo, name, arch, task, model, artifacts, promoted, onnx_dir)


def _write(repo: Path, name: str, arch: str, task: str, model, artifacts: list[Path], promoted: bool,
           onnx_dir: Path) -> dict:
    run = SimpleNamespace(task=task, evaluate={"beam": 3})
    graphs = sorted(p.stem for p in onnx_dir.glob("*.onnx"))
    serving = {**serving_meta(model.cfg, graphs, run), "memory": memory(model.cfg)}  # as publish writes it
    meta, created, _ = write_version(repo / name, name, onnx_dir, serving,
                                  {"arch": arch, "task": task, "parity_passed": True, "production": promoted},
                                  artifacts)
    assert created
    return meta


class _Publisher:
    """Versions published as ``publish`` writes them, the ONNX exports done two at a time.

    Exporting is most of this repository's build time, and each export is one Python thread that
    leaves the second core idle: the models are exported in two worker processes, then their
    versions written here in the order they were asked for (so ntm's first model is version 1)."""

    def __init__(self, repo: Path, work: Path):
        self.repo, self.work, self.todo = repo, work, []

    def __call__(self, name: str, arch: str, task: str, model, artifacts: list[Path], promoted: bool = True) -> None:
        onnx_dir = self.work / f"{name}-{len(self.todo)}"
        self.todo.append((name, arch, task, model, artifacts, promoted, onnx_dir))

    def finish(self) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn, not fork: a forked child of a process whose OpenMP pool has run can hang in it
        with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"), initializer=_exporter) as pool:
            done = [pool.submit(export_onnx, job[3], job[6]) for job in self.todo]
            for future in done:
                future.result()
        for name, arch, task, model, artifacts, promoted, onnx_dir in self.todo:
            _write(self.repo, name, arch, task, model, artifacts, promoted, onnx_dir)


def _exporter() -> None:
    """A spawned exporting process: one thread, one table of ONNX translations for all its exports, and
    each export as the process's first."""
    torch.set_num_threads(1)
    patch = pytest.MonkeyPatch()  # for the process's lifetime
    one_torchlib_registry(patch)


def build_published(tmp: Path, build: bool = True) -> SimpleNamespace:
    """model_repository with bahdanau (v1) and ntm (v1, v2: different weights), tiny and seeded.
    ``build=False``: the same seeded models over the repository an earlier call built in ``tmp``
    (another test process's), without exporting or writing anything."""
    repo, work = tmp / "model_repository", tmp / "work"
    publish = _Publisher(repo, work)
    if build:
        work.mkdir()
        _tokenizer(work / "spm.de.model", GERMAN)
        _tokenizer(work / "spm.en.model", ENGLISH)
    import sentencepiece as spm

    sizes = {s: spm.SentencePieceProcessor(model_file=str(work / f"spm.{s}.model")).get_piece_size()
             for s in ("de", "en")}
    torch.manual_seed(0)
    seq = models.build("bahdanau", {**TINY["bahdanau"], "src_vocab": sizes["de"], "tgt_vocab": sizes["en"]}).eval()
    publish("bahdanau", "bahdanau", "translation_de_en", seq,
            [work / "spm.de.model", work / "spm.en.model"])
    # The other seq2seq models run through the same server loop: Luong's carried LSTM state and
    # input feeding (local-p), the Transformer's growing key/value cache (empty at the start).
    seq2seq = {"bahdanau": seq}
    for seed, (name, extra) in enumerate([("luong", {"score": "general", "attention": "local_p"}),
                                          ("transformer", {})], start=10):
        torch.manual_seed(seed)
        seq2seq[name] = models.build(name, {**TINY[name], **extra, "src_vocab": sizes["de"],
                                            "tgt_vocab": sizes["en"]}).eval()
        publish(name, name, "translation_de_en", seq2seq[name],
                [work / "spm.de.model", work / "spm.en.model"])
    ntms = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        ntms.append(models.build("ntm", TINY["ntm"]).eval())
        publish("ntm", "ntm", "copy", ntms[-1], [])
    torch.manual_seed(3)
    pointer = models.build("pointer_net", TINY["pointer_net"]).eval()
    publish("pointer", "pointer_net", "convex_hull", pointer, [])
    torch.manual_seed(4)
    act = models.build("act", TINY["act"]).eval()
    publish("act", "act", "parity", act, [])
    torch.manual_seed(5)
    programmer = models.build("neural_programmer", TINY["neural_programmer"]).eval()
    publish("programmer", "neural_programmer", "table_qa", programmer, [])
    torch.manual_seed(6)
    captioner = models.build("show_attend_tell", TINY["show_attend_tell"]).eval()
    publish("captioner", "show_attend_tell", "mnist_captions", captioner, [])
    torch.manual_seed(7)
    ram = models.build("ram", TINY["ram"]).eval()
    publish("ram", "ram", "mnist_translated60", ram, [])
    torch.manual_seed(8)
    draw = models.build("draw", TINY["draw"]).eval()
    publish("draw", "draw", "mnist_binarized", draw, [])
    torch.manual_seed(9)
    ocr = models.build("attention_ocr", {**TINY["attention_ocr"], "annotation": "grid"}).eval()
    publish("ocr", "attention_ocr", "ocr_words", ocr, [])
    torch.manual_seed(10)
    speech = models.build("speech_attention", TINY["speech_attention"]).eval()
    publish("speech", "speech_attention", "spoken_digits", speech, [])
    if build:
        publish.finish()
    return SimpleNamespace(repo=repo, seq=seq, seq2seq=seq2seq, ntm_v1=ntms[0], ntm_v2=ntms[1], pointer=pointer,
                           act=act, programmer=programmer, captioner=captioner, ram=ram, draw=draw, ocr=ocr,
                           speech=speech, work=work)


