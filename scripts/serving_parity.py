"""The served default models vs PyTorch on real test data (needs `dvc repro` outputs).

    python scripts/serving_parity.py --sentences 200

Starts `attnzoo serve` on model_repository/, sends raw German test sentences (the server tokenizes)
NTM sequences (copy, associative recall) and caption canvases, and compares with the checkpoints in runs/ run by
PyTorch: greedy (`model.predict`) and beam search translations, NTM bits and logits, greedy
captions and their attention. Models not in model_repository/ are skipped. Exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

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
from serving.client import Client  # noqa: E402
from serving.decode import BEAM, beam_search, search_options  # noqa: E402


def translation(client: Client, name: str, n: int) -> bool:
    import sentencepiece as spm

    run = resolve(name)
    model, _ = load_model(run.run_dir / "checkpoint" / "best")
    task = TranslationTask()
    items = task.load(run.data_dir, "test")[:n]
    en = spm.SentencePieceProcessor(model_file=str(run.data_dir / "spm.en.model"))
    texts = [it["src_text"] for it in items]
    served = []
    for start in range(0, n, 16):
        served += client.translate(name, texts[start : start + 16], "greedy")
    greedy_same = 0
    for start in range(0, n, 16):
        chunk = items[start : start + 16]
        out = model.predict(task.collate(chunk))
        for row, res in enumerate(served[start : start + 16]):
            greedy_same += res["translation"] == en.decode(out["tokens"][row, : out["lengths"][row]].tolist())
    specs = model.export_graphs()
    enc, step = TorchGraph(specs["encoder"]), TorchGraph(specs["decoder_step"])
    beam = run.evaluate.get("beam", BEAM)
    beam_same, worst = 0, 0.0
    for it in items:
        (res,) = client.translate(name, [it["src_text"]], "beam")
        src = np.array([it["src"]], dtype=np.int64)
        ref = beam_search(enc, step, src, np.array([src.shape[1]]), model.cfg.bos_id, model.cfg.eos_id,
                          model.cfg.max_len, beam=beam, **search_options(run.evaluate))
        same = res["translation"] == en.decode(ref["tokens"].tolist())
        beam_same += same
        if same:
            worst = max(worst, float(np.abs(res["attention"] - ref["attention"][:, : res["attention"].shape[1]]).max()))
    print(f"{name}: greedy identical {greedy_same}/{n}, beam {beam} identical {beam_same}/{n}, "
          f"largest alignment difference {worst:.2e}")
    return greedy_same == n and beam_same == n


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=200)
    ap.add_argument("--canvases", type=int, default=2000)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "serving.server", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = Client(f"http://127.0.0.1:{port}", timeout=120)
    try:
        if not client.wait_ready(30, alive=lambda: proc.poll() is None):
            raise SystemExit("error: the server did not become ready in 30 s")
        translators = ["bahdanau", "bahdanau_none", "luong_dot", "luong_general", "luong_concat",
                       "luong_local_p", "transformer"]
        checks = {**{name: (lambda name=name: translation(client, name, args.sentences)) for name in translators},
                  "ntm": lambda: ntm(client, "ntm", ("test_20", "test_40"), 32),
                  "ntm_recall": lambda: ntm(client, "ntm_recall", ("test_3", "test_6", "test_10"), 64),
                  "sat_soft": lambda: captions(client, "sat_soft", args.canvases),
                  "sat_hard": lambda: captions(client, "sat_hard", args.canvases)}
        ok = True
        for name, check in checks.items():
            if not (ROOT / "model_repository" / name).is_dir():
                print(f"{name}: skipped (not in model_repository/)")
                continue
            ok &= check()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
