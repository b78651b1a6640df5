"""The served default models vs PyTorch on real test data (needs `dvc repro` outputs).

    python scripts/serving_parity.py --sentences 200

Starts `attnzoo serve` on model_repository/, sends raw German test sentences (the server tokenizes)
NTM sequences (copy, associative recall) and caption canvases, and compares with the checkpoints in runs/ run by
PyTorch: greedy (`model.predict`) and beam search translations, NTM bits and logits, greedy
captions and their attention. Models not in model_repository/ are skipped (named with --models, they are an
error, as is none published at all). Exits 1 on any difference, except
a beam search that parted from PyTorch's at a near-tie (its cut within the entry's parity atol).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
from pathlib import Path

import cli_errors
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.checkpoint import load_model  # noqa: E402
from pipeline.config import resolve  # noqa: E402
from pipeline.graphs import TorchGraph  # noqa: E402
from pipeline.tasks import get_task  # noqa: E402
from pipeline.tasks.mnist_captions import WORDS, MnistCaptionsTask  # noqa: E402
from pipeline.tasks.translation_de_en import TranslationTask  # noqa: E402
from serving import decode  # noqa: E402
from serving.client import Client, LocalClient  # noqa: E402
from serving.decode import BEAM, beam_search, search_options  # noqa: E402
from serving.repository import default_version  # noqa: E402


@contextlib.contextmanager
def recorded_cuts(cuts: list[float]):
    """Inside, every beam search records at each step the score gap at its beam's cut: between the last
    live candidate it keeps and the first it drops. Two engines whose log-probabilities differ by float
    rounding (1e-6 here) can keep different hypotheses where that gap is as small, and end apart."""
    base = decode._Search

    class Recording(base):
        def advance(self, logp: np.ndarray, attention: np.ndarray):
            if self.no_repeat_ngram:  # as advance blocks them (idempotent: the entries become -inf)
                decode._block_repeats(logp, self.hyps, self.no_repeat_ngram)
            total = (self.scores[:, None] + logp).reshape(-1)  # [K*V], as advance ranks them
            live = [total[f] for f in decode.top_order(total, 2 * self.beam + 1)
                    if f % logp.shape[1] != self.eos and np.isfinite(total[f])]
            if len(live) > self.beam:
                cuts.append(float(live[self.beam - 1] - live[self.beam]))
            return super().advance(logp, attention)

    decode._Search = Recording
    try:
        yield
    finally:
        decode._Search = base


def served_engine(name: str) -> str:
    """The engine of the version the server answers without one in the URL (its default version)."""
    metas = LocalClient(ROOT / "model_repository")._versions(name)  # each version's metadata.json, as --local reads
    version, _ = default_version(metas)
    return ((metas.get(version) or {}).get("engine") or {}).get("name", "onnxruntime")


def translation(client: Client, name: str, n: int) -> bool:
    """Greedy: tokens identical to ``model.predict``'s. Beam: tokens identical to the same search over
    the PyTorch graphs, or the reference search met a near-tie at its cut (within the entry's parity
    atol), where either engine's choice is as good; a version served by CTranslate2 runs that library's
    own beam search, whose agreement is reported, not required (publish gates it on the whole test set).
    Alignments within 1e-4 where tokens agree: the beam's, or under CTranslate2 (its alignment is the
    last decoder layer's heads averaged) the greedy one's against that average of PyTorch's."""
    import sentencepiece as spm

    run = resolve(name)
    model, _ = load_model(run.run_dir / "checkpoint" / "best")
    task, ct2 = TranslationTask(), served_engine(name) == "ctranslate2"
    items = task.load(run.data_dir, "test")[:n]
    en = spm.SentencePieceProcessor(model_file=str(run.data_dir / "spm.en.model"))
    texts = [it["src_text"] for it in items]
    served = []
    for start in range(0, n, 16):
        served += client.translate(name, texts[start : start + 16], "greedy")
    greedy_same, worst = 0, 0.0
    for start in range(0, n, 16):
        out = model.predict(task.collate(items[start : start + 16]))
        for row, res in enumerate(served[start : start + 16]):
            same = res["translation"] == en.decode(out["tokens"][row, : out["lengths"][row]].tolist())
            greedy_same += same
            if same and ct2:
                t, s = res["attention"].shape
                last = out["attention_heads"][row, :t, -1].mean(dim=1)[:, :s].numpy()  # [T,L,H,S] -> [T,S]
                worst = max(worst, float(np.abs(res["attention"] - last).max()))
    specs = model.export_graphs()
    enc, step = TorchGraph(specs["encoder"]), TorchGraph(specs["decoder_step"])
    beam, tie = run.evaluate.get("beam", BEAM), run.parity.get("atol", 1e-4)
    beam_same, ties = 0, 0
    for it in items:
        (res,) = client.translate(name, [it["src_text"]], "beam")
        src, cuts = np.array([it["src"]], dtype=np.int64), []
        with recorded_cuts(cuts):
            ref = beam_search(enc, step, src, np.array([src.shape[1]]), model.cfg.bos_id, model.cfg.eos_id,
                              model.cfg.max_len, beam=beam, **search_options(run.evaluate))
        same = res["translation"] == en.decode(ref["tokens"].tolist())
        beam_same += same
        ties += not same and min(cuts, default=np.inf) <= tie
        if same and not ct2:
            worst = max(worst, float(np.abs(res["attention"] - ref["attention"][:, : res["attention"].shape[1]]).max()))
    print(f"{name}{' (CTranslate2)' if ct2 else ''}: greedy identical {greedy_same}/{n}, beam {beam} identical "
          f"{beam_same}/{n} ({n - beam_same - ties} apart without a near-tie at the reference's cut"
          f"{': its own search, reported, not required' if ct2 else ''}), largest alignment difference {worst:.2e}")
    return greedy_same == n and (ct2 or beam_same + ties == n) and worst <= 1e-4


def ntm(client: Client, name: str, splits: tuple[str, ...], n: int) -> bool:
    """Bits identical on the first ``n`` sequences of each test split of the model's task."""
    run = resolve(name)
    model, _ = load_model(run.run_dir / "checkpoint" / "best")
    task = get_task(run.task)
    ok = True
    for split in splits:
        batch = task.collate(task.load(run.data_dir, split)[:n])
        with torch.no_grad():
            ref = model.predict(batch)
        got = client.infer(name, {"x": batch["x"].numpy()})
        bits = np.array_equal(got["bits"], ref["bits"].numpy().astype(np.uint8))
        diff = float(np.abs(got["logits"] - ref["logits"].numpy()).max())
        print(f"{name} {split} × {n}: bits identical {bits}, largest logit difference {diff:.2e}")
        ok &= bits
    return ok


def captions(client: Client, name: str, n: int) -> bool:
    run = resolve(name)
    model, _ = load_model(run.run_dir / "checkpoint" / "best")
    task = MnistCaptionsTask()
    items = task.load(run.data_dir, "test")[:n]
    same, worst = 0, 0.0
    for at in range(0, len(items), 25):  # 25 canvases of 84x84 numbers per request: well under the body limit
        batch = task.collate(items[at : at + 25])
        with torch.no_grad():
            ref = model.predict(batch)
        got = client.infer(name, {"image": batch["image"].numpy()}, parameters={"decode": "greedy"})
        for b in range(batch["image"].shape[0]):
            k = int(ref["lengths"][b])
            if " ".join(WORDS[t] for t in ref["tokens"][b, :k].tolist()) == str(got["caption"][b]):
                same += 1
                served = got["attention"][b, : k + 1]  # [T,h,w]: words and EOS
                expected = ref["attention"][b, : k + 1].reshape(served.shape).numpy()  # [T,L] -> [T,h,w]
                worst = max(worst, float(np.abs(served - expected).max()))
    print(f"{name}: greedy captions identical {same}/{len(items)}, largest attention difference {worst:.2e}")
    return same == len(items)


TRANSLATORS = ["bahdanau", "bahdanau_none", "luong_dot", "luong_general", "luong_concat", "luong_local_p",
               "transformer"]
# Each model this script checks, and its check of a served model against PyTorch (client, the command line).
CHECKS = {**{name: (lambda client, args, name=name: translation(client, name, args.sentences)) for name in TRANSLATORS},
          "ntm": lambda client, args: ntm(client, "ntm", ("test_20", "test_40"), 32),
          "ntm_recall": lambda client, args: ntm(client, "ntm_recall", ("test_3", "test_6", "test_10"), 64),
          "sat_soft": lambda client, args: captions(client, "sat_soft", args.canvases),
          "sat_hard": lambda client, args: captions(client, "sat_hard", args.canvases)}
CHECKED = list(CHECKS)


def chosen(models: list[str] | None) -> list[str]:
    """The models to check: ``--models`` (each one this script checks, and published), else every published
    one it checks; none at all is an error, not a pass."""
    published = [n for n in CHECKED if (ROOT / "model_repository" / n).is_dir()]
    if models:
        if unknown := [m for m in models if m not in CHECKED]:
            raise cli_errors.ScriptError(f"--models {' '.join(unknown)}: this script checks {', '.join(CHECKED)}")
        if missing := [m for m in models if m not in published]:
            raise cli_errors.ScriptError(f"not in model_repository/: {', '.join(missing)}; publish them first "
                                         f"(`attnzoo repro publish@{missing[0]}`)")
        return models
    for name in CHECKED:
        if name not in published:
            print(f"{name}: skipped (not in model_repository/)")
    if not published:
        raise cli_errors.ScriptError(f"none of {', '.join(CHECKED)} is in model_repository/: publish one first")
    return published


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=200)
    ap.add_argument("--canvases", type=int, default=2000)
    ap.add_argument("--models", nargs="+", help="check only these (default: every published one it knows)")
    args = ap.parse_args()
    names = chosen(args.models)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "serving.server", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = Client(f"http://127.0.0.1:{port}", timeout=120)
    try:
        if not client.wait_ready(30, alive=lambda: proc.poll() is None):
            raise SystemExit("error: the server did not become ready in 30 s")
        ok = True
        for name in names:
            ok &= CHECKS[name](client, args)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    cli_errors.run(main)
