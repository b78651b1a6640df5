"""Write the prepared translation data as SentencePiece piece files for a peer toolkit.

Reads ``data/prepared/translation_de_en`` (the ids attnzoo trains on, from its own SentencePiece
models) and writes ``{train,valid,test}.{de,en}`` (one sentence per line, pieces separated by
spaces), ``test.ref.en`` (the raw reference text the BLEU is computed against), and
``vocab.{de,en}`` (every piece of each model but the four specials, with its training count), so
a peer trains on exactly the same split, pieces and vocabulary.

    python scripts/peers/export_data.py OUT_DIR
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # the pipeline; cli_errors

import cli_errors  # noqa: E402

from pipeline.tasks.translation_de_en import EOS, TranslationTask  # noqa: E402

SPECIALS = 4  # pad, bos, eos, unk: ids 0-3 (pipeline/tasks/translation_de_en/__init__.py); a peer adds its own
SPLITS = {"train": "train", "val": "valid", "test": "test"}


def export(data_dir: Path, out: Path) -> dict:
    import sentencepiece as spm

    out.mkdir(parents=True, exist_ok=True)
    sp = {s: spm.SentencePieceProcessor(model_file=str(data_dir / f"spm.{s}.model")) for s in ("de", "en")}
    task, counts = TranslationTask(), {"de": Counter(), "en": Counter()}
    for split, name in SPLITS.items():
        items = task.load(data_dir, split)
        for side, key in (("de", "src"), ("en", "tgt")):
            # attnzoo appends EOS to every source; a peer's encoder adds its own markers, if any.
            rows = [[t for t in it[key] if t != EOS] if side == "de" else it[key] for it in items]
            if split == "train":
                for r in rows:
                    counts[side].update(r)
            lines = (" ".join(sp[side].id_to_piece(t) for t in r) for r in rows)
            (out / f"{name}.{side}").write_text("".join(f"{x}\n" for x in lines))
        if split == "test":
            (out / "test.ref.en").write_text("".join(f"{it['tgt_text']}\n" for it in items))
    for side in ("de", "en"):
        model = sp[side]
        rows = sorted(range(SPECIALS, model.get_piece_size()), key=lambda i: (-counts[side][i], i))
        (out / f"vocab.{side}").write_text("".join(f"{model.id_to_piece(i)}\t{counts[side][i]}\n" for i in rows))
    return {name: sum(1 for _ in open(out / f"{name}.de")) for name in SPLITS.values()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "prepared" / "translation_de_en")
    args = ap.parse_args(argv)
    if not (args.data / "train.pt").exists():
        raise cli_errors.ScriptError(f"no prepared data in {args.data}: run `dvc repro prepare@translation_de_en` "
                                     "first")
    print(export(args.data, args.out))


if __name__ == "__main__":
    cli_errors.run(main)
