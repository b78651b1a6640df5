"""attnzoo's Transformer beside OpenNMT-py: the peer's configuration, checkpoint picking and scoring.

Subcommands (attnzoo's own environment):

    onmt-config WORK          print OpenNMT-py's config.yaml: models.transformer's recipe in its words
                              (--dropout P: another dropout, e.g. 0.1, OpenNMT-py's own default)
    onmt-pick WORK MINUTES    the last OpenNMT-py checkpoint saved within MINUTES of training, and its
                              training throughput (target tokens/s, the log's own figure)
    score HYP                 test BLEU and chrF of a file of pieces or text, by the evaluate stage's code
    attnzoo-bleu CHECKPOINT   test BLEU / chrF of an attnzoo checkpoint folder (beam, as evaluate@transformer)
    attnzoo-speed RUN_DIR     attnzoo's training throughput: target tokens of the steps taken / train_seconds
    attnzoo-progress CKPT     the step and training seconds an attnzoo checkpoint (a run's `last`) was saved at
    ct2-bleu CT2_DIR          test BLEU / chrF of a CTranslate2 model (either toolkit's, converted), beam 5;
                              --source-eos for attnzoo's (its sources end with </s>)

scripts/peers/opennmt.sh runs the peer, scripts/peers/attnzoo.sh attnzoo's run with its budget point;
docs/benchmarks.md ("Peers") has the commands and figures.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # the pipeline; cli_errors

import cli_errors  # noqa: E402

DATA = ROOT / "data" / "prepared" / "translation_de_en"
MODEL = "transformer"


def onmt_config(work: Path, root: Path = ROOT, dropout: float | None = None) -> str:
    """models.transformer's architecture, batching, optimiser and regularisation as OpenNMT-py 3.5 options.

    The schedule is OpenNMT-py's own (noam: the same warm-up, then inverse square root; noam's
    ``learning_rate`` is scaled so that its peak equals attnzoo's ``lr``). Checkpoint averaging is
    left out: OpenNMT-py averages offline (tools/average_models.py), outside a wall-clock budget.
    ``dropout``: in place of the recipe's (on the embeddings, the residuals and the attention weights).
    """
    import yaml

    from pipeline.config import resolve

    run = resolve(MODEL, root=root)
    m, t = run.model, run.train
    drop = m.get("dropout", 0.1) if dropout is None else dropout
    dim = m.get("dim", 256)
    d = work / "data"
    config = {
        "src_vocab": str(d / "vocab.de"), "tgt_vocab": str(d / "vocab.en"), "share_vocab": False,
        "src_vocab_size": 100000, "tgt_vocab_size": 100000,  # every piece of the SentencePiece models
        "data": {"corpus_1": {"path_src": str(d / "train.de"), "path_tgt": str(d / "train.en")},
                 "valid": {"path_src": str(d / "valid.de"), "path_tgt": str(d / "valid.en")}},
        "save_model": str(work / "model"), "save_checkpoint_steps": 100, "keep_checkpoint": -1,
        "seed": t.seed, "train_steps": 10**6, "valid_steps": t.eval_every, "report_every": 50,
        "encoder_type": "transformer", "decoder_type": "transformer", "position_encoding": True,
        "enc_layers": m.get("enc_layers", 3), "dec_layers": m.get("dec_layers", 3), "heads": m.get("heads", 4),
        "hidden_size": dim, "word_vec_size": dim, "transformer_ff": m.get("ff_dim", 1024),
        "dropout": [drop], "attention_dropout": [drop],
        "label_smoothing": m.get("label_smoothing", 0.1), "share_decoder_embeddings": m.get("tie_output", True),
        "param_init": 0.0, "param_init_glorot": True,
        "batch_type": "tokens", "batch_size": t.max_tokens or 2048, "valid_batch_size": t.max_tokens or 2048,
        "batch_size_multiple": 1, "accum_count": [1], "normalization": "tokens",
        "optim": "adam", "adam_beta1": 0.9, "adam_beta2": 0.999, "max_grad_norm": t.grad_clip,
        "decay_method": "noam", "warmup_steps": t.warmup_steps,
        # noam: lr(s) = learning_rate * dim^-0.5 * min(s^-0.5, s * warmup^-1.5), at its peak (s = warmup)
        # learning_rate * (dim * warmup)^-0.5: equal to attnzoo's lr
        "learning_rate": round(t.lr * math.sqrt(dim * t.warmup_steps), 6),
        "num_workers": 0,  # no loader processes: the two threads train, as attnzoo's do
        "world_size": 1, "gpu_ranks": [],
    }
    return yaml.safe_dump(config, sort_keys=False)


STEP_RE = re.compile(r"Step\s+(\d+)/.*?(\d+)/\s*(\d+) tok/s;\s+(\d+) sec")


def onmt_pick(work: Path, minutes: float) -> dict:
    """The last checkpoint saved with at most ``minutes`` of training (the log's elapsed seconds at its
    step), and the median target tokens/s of the log's reports up to then."""
    log = (work / "train.log").read_text()
    reports = [(int(s), int(src), int(tgt), int(sec)) for s, src, tgt, sec in STEP_RE.findall(log)]
    if not reports:
        raise cli_errors.ScriptError(f"no training steps in {work / 'train.log'}: run scripts/peers/opennmt.sh "
                                     "first")
    saved = sorted(int(p.stem.rsplit("_", 1)[1]) for p in work.glob("model_step_*.pt"))
    elapsed = {s: sec for s, _, _, sec in reports}
    # A checkpoint is saved at a multiple of report_every, so the report of its step gives its time.
    within = [s for s in saved if s in elapsed and elapsed[s] <= minutes * 60]
    if not within:
        raise cli_errors.ScriptError(f"no checkpoint saved within {minutes} min in {work}")
    step = within[-1]
    rates = [tgt for s, _, tgt, _ in reports if s <= step]
    return {"checkpoint": str(work / f"model_step_{step}.pt"), "step": step, "seconds": elapsed[step],
            "target_tokens_per_s": statistics.median(rates)}


def score(hyps: list[str], refs: list[str]) -> dict:
    """BLEU and chrF as evaluate@ computes them (sacrebleu's defaults, corpus level)."""
    import sacrebleu

    bleu, chrf = sacrebleu.BLEU(), sacrebleu.CHRF()
    return {"bleu": round(bleu.corpus_score(hyps, [refs]).score, 2),
            "chrf": round(chrf.corpus_score(hyps, [refs]).score, 2), "sentences": len(hyps)}


def test_refs() -> list[str]:
    from pipeline.tasks.translation_de_en import TranslationTask

    return [it["tgt_text"] for it in TranslationTask().load(DATA, "test")]


def detok(lines: list[str]) -> list[str]:
    """Pieces (``▁Die ▁Date i``) back to text with attnzoo's English SentencePiece model; text unchanged."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(DATA / "spm.en.model"))
    return [sp.decode_pieces(x.split()) if "▁" in x else x for x in lines]


def attnzoo_bleu(checkpoint_dir: Path, beam: int, split: str = "test") -> dict:
    import sentencepiece as spm

    from pipeline.checkpoint import load_model
    from pipeline.config import resolve
    from pipeline.tasks.translation_de_en import TranslationTask, beam_translate

    model, _ = load_model(checkpoint_dir)
    items = TranslationTask().load(DATA, split)
    options = {**resolve(MODEL).evaluate, "beam": beam}
    out = beam_translate(model, items, options, desc=f"beam {beam}")
    sp = spm.SentencePieceProcessor(model_file=str(DATA / "spm.en.model"))
    return score([sp.decode(o["tokens"].tolist()) for o in out], [it["tgt_text"] for it in items])


def attnzoo_speed(run_dir: Path) -> dict:
    """Target tokens (with EOS, as OpenNMT-py counts them) of the batches the run's steps took, per
    second of its train_seconds."""
    from pipeline.config import resolve
    from pipeline.tasks.translation_de_en import TranslationTask
    from pipeline.training.batches import epoch_batches

    run = resolve(MODEL)
    summary = json.loads((run_dir / "train_summary.json").read_text())
    task = TranslationTask()
    items = task.load(DATA, "train")
    lengths = [task.length(it) for it in items]
    steps, tokens, epoch = summary["steps"], 0, 0
    while steps > 0:
        batches = epoch_batches(run.train, lengths, epoch)[:steps]
        tokens += sum(len(items[i]["tgt"]) + 1 for b in batches for i in b)
        steps, epoch = steps - len(batches), epoch + 1
    return {"steps": summary["steps"], "seconds": summary["train_seconds"], "target_tokens": tokens,
            "target_tokens_per_s": round(tokens / summary["train_seconds"])}


def attnzoo_progress(checkpoint_dir: Path) -> dict:
    """Where a saved ``last`` checkpoint stood: its step and the training seconds up to it (``train_seconds``
    as the run's summary counts them)."""
    import torch

    from pipeline.checkpoint import TRAINER_GLOBALS

    with torch.serialization.safe_globals(TRAINER_GLOBALS):
        state = torch.load(checkpoint_dir / "trainer.pt", weights_only=True)["state"]
    return {"checkpoint": str(checkpoint_dir), "step": state["step"], "train_seconds": round(state["seconds"], 1)}


def ct2_bleu(folder: Path, beam: int, source_eos: bool, threads: int) -> dict:
    """Both toolkits' models decoded by one engine: the same beam search, length normalisation
    (log p / length) and 100-piece limit as attnzoo's loop, 32 sentences a call."""
    from decode_bench import CT2, batches, test_texts

    engine = CT2(folder, threads, "float32", beam, 100, source_eos)
    hyps = [h for chunk in batches(test_texts(None), 32) for h in engine(chunk)]
    return score(hyps, test_refs())


# The file each subcommand reads: (its argument, the file inside it or None for the argument itself, the fix).
INPUTS = {
    "onmt-pick": ("work", "train.log", "run scripts/peers/opennmt.sh first"),
    "score": ("hyp", None, "give a file of translations, a line each"),
    "attnzoo-speed": ("run_dir", "train_summary.json", "give a finished run (scripts/peers/attnzoo.sh's WORKDIR/run)"),
    "attnzoo-progress": ("checkpoint", "trainer.pt",
                         "give a run's checkpoint/last (scripts/peers/attnzoo.sh's WORKDIR/at_<MINUTES>min)"),
    "ct2-bleu": ("folder", "model.bin",
                 "convert a model first (scripts/peers/ctranslate2_convert.py or onmt_to_ct2.py)"),
}


def inputs_there(args: argparse.Namespace) -> None:
    """The file a subcommand reads is there, or one sentence naming what makes it."""
    if args.cmd not in INPUTS:
        return
    arg, name, fix = INPUTS[args.cmd]
    path = getattr(args, arg) / name if name else getattr(args, arg)
    if not path.is_file():
        raise cli_errors.ScriptError(f"{path} is not there: {fix}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("onmt-config")
    p.add_argument("work", type=Path)
    p.add_argument("--dropout", type=float, help="another dropout than models.transformer's")
    p = sub.add_parser("onmt-pick")
    p.add_argument("work", type=Path)
    p.add_argument("minutes", type=float)
    sub.add_parser("score").add_argument("hyp", type=Path)
    p = sub.add_parser("attnzoo-bleu")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--beam", type=int, default=5)
    sub.add_parser("attnzoo-speed").add_argument("run_dir", type=Path)
    sub.add_parser("attnzoo-progress").add_argument("checkpoint", type=Path)
    p = sub.add_parser("ct2-bleu")
    p.add_argument("folder", type=Path)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--source-eos", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    inputs_there(args)
    if args.cmd == "onmt-config":
        print(onmt_config(args.work, dropout=args.dropout), end="")
    elif args.cmd == "onmt-pick":
        print(json.dumps(onmt_pick(args.work, args.minutes)))
    elif args.cmd == "score":
        print(json.dumps(score(detok(args.hyp.read_text().splitlines()), test_refs())))
    elif args.cmd == "attnzoo-bleu":
        print(json.dumps(attnzoo_bleu(args.checkpoint, args.beam)))
    elif args.cmd == "attnzoo-progress":
        print(json.dumps(attnzoo_progress(args.checkpoint)))
    elif args.cmd == "ct2-bleu":
        print(json.dumps(ct2_bleu(args.folder, args.beam, args.source_eos, args.threads)))
    else:
        print(json.dumps(attnzoo_speed(args.run_dir)))


if __name__ == "__main__":
    cli_errors.run(main)
