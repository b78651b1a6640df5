"""Convert an attnzoo Transformer checkpoint to a CTranslate2 model folder, as ``publish`` does for an
entry served by CTranslate2 (``pipeline/ctranslate2_engine.py``: the mapping), optionally int8.

    python scripts/peers/ctranslate2_convert.py runs/transformer/checkpoint/best OUT [--quantization int8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # the pipeline; cli_errors

import cli_errors  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    from pipeline.checkpoint import load_model
    from pipeline.ctranslate2_engine import convert

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "prepared" / "translation_de_en")
    ap.add_argument("--quantization", choices=["int8", "int8_float32"], default=None)
    args = ap.parse_args(argv)
    model, _ = load_model(args.checkpoint)
    print(convert(model, args.data / "spm.de.model", args.data / "spm.en.model", args.out, args.quantization))


if __name__ == "__main__":
    cli_errors.run(main)
