"""Convert an OpenNMT-py checkpoint with CTranslate2's own converter (run with the peers' venv).

OpenNMT-py 3.5 trains with ``self_attn_type: scaled-dot-flash`` (PyTorch's fused attention), which
CTranslate2 4.8's converter refuses by name although the weights and the arithmetic are those of
``scaled-dot``; the option is renamed in a copy of the checkpoint before converting.

    ~/.cache/attnzoo/peers/venv/bin/python scripts/peers/onmt_to_ct2.py CHECKPOINT OUT [--quantization int8]

OpenNMT-py checkpoints are pickles: convert only ones you trained (this script loads them in full).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from ctranslate2.converters import OpenNMTPyConverter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: cli_errors
import cli_errors  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--quantization", choices=["int8"], default=None)
    args = ap.parse_args(argv)
    if not args.checkpoint.is_file():
        raise cli_errors.ScriptError(f"{args.checkpoint} is no OpenNMT-py checkpoint file: give one "
                                     "scripts/peers/opennmt.sh saved (its WORKDIR/model_step_*.pt)")
    saved = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
    if getattr(saved["opt"], "self_attn_type", "scaled-dot") == "scaled-dot-flash":
        saved["opt"].self_attn_type = "scaled-dot"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.pt"
        torch.save(saved, path)
        OpenNMTPyConverter(str(path), unsafe_deserialization=True).convert(
            str(args.out), quantization=args.quantization, force=True)
    print(args.out)


if __name__ == "__main__":
    cli_errors.run(main)
