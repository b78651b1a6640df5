"""Convert an attnzoo Transformer checkpoint to a CTranslate2 model with ``ctranslate2.specs``.

The same weights, mapped onto CTranslate2's pre-norm ``TransformerSpec``: the three attention
projections fused as CTranslate2 stores them (query/key/value for self-attention, key/value for
cross-attention), attnzoo's sinusoidal table (sin and cos interleaved) as the position encodings,
embeddings scaled by √D, the tied output projection with its bias, PyTorch's LayerNorm epsilon, and
the SentencePiece pieces as vocabularies. Sources end with ``</s>`` as attnzoo encodes them.

    python scripts/peers/ctranslate2_convert.py runs/transformer/checkpoint/best OUT [--quantization int8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MAX_POSITIONS = 1024  # CTranslate2 reads positions from this table: far beyond the 100-token limit


def _linear(spec, layer) -> None:
    spec.weight = layer.weight.detach().numpy()
    spec.bias = layer.bias.detach().numpy()


def _fused(spec, layers) -> None:
    spec.weight = np.concatenate([lin.weight.detach().numpy() for lin in layers])
    spec.bias = np.concatenate([lin.bias.detach().numpy() for lin in layers])


def _norm(spec, norm) -> None:
    spec.gamma, spec.beta = norm.weight.detach().numpy(), norm.bias.detach().numpy()


def _ffn(spec, block) -> None:
    _norm(spec.layer_norm, block.norms[-1])
    _linear(spec.linear_0, block.ff[0])
    _linear(spec.linear_1, block.ff[3])


def build_spec(model, pieces: dict[str, list[str]]):
    """A ``ctranslate2.specs.TransformerSpec`` holding ``model``'s weights (a pre-norm, tied Transformer)."""
    import torch
    from ctranslate2.specs import transformer_spec

    from models.transformer import sinusoid

    cfg = model.cfg
    if cfg.norm != "pre" or not cfg.tie_output:
        raise SystemExit("this converter maps the pre-norm Transformer with a tied output (norm: pre, tie_output)")
    spec = transformer_spec.TransformerSpec.from_config((cfg.enc_layers, cfg.dec_layers), cfg.heads, pre_norm=True)
    spec.config.layer_norm_epsilon = model.enc_norm.eps
    table = sinusoid(torch.arange(MAX_POSITIONS), cfg.dim).numpy()  # [P,D], the model's own positions
    for side, embed, blocks, final in (("encoder", model.src_embed, model.encoder, model.enc_norm),
                                      ("decoder", model.tgt_embed, model.decoder, model.dec_norm)):
        s = getattr(spec, side)
        emb = s.embeddings[0] if isinstance(s.embeddings, list) else s.embeddings
        emb.weight = embed.weight.detach().numpy()
        s.scale_embeddings = True  # √D·E + PE, as Transformer.embed
        s.position_encodings.encodings = table
        _norm(s.layer_norm, final)
        for layer, block in zip(s.layer, blocks):
            att = block.self_attn
            _norm(layer.self_attention.layer_norm, block.norms[0])
            _fused(layer.self_attention.linear[0], [att.query, att.key, att.value])
            _linear(layer.self_attention.linear[1], att.out)
            if block.cross_attn is not None:
                cross = block.cross_attn
                _norm(layer.attention.layer_norm, block.norms[1])
                _linear(layer.attention.linear[0], cross.query)
                _fused(layer.attention.linear[1], [cross.key, cross.value])
                _linear(layer.attention.linear[2], cross.out)
            _ffn(layer.ffn, block)
    spec.decoder.projection.weight = model.tgt_embed.weight.detach().numpy()
    spec.decoder.projection.bias = model.out_bias.detach().numpy()
    spec.register_source_vocabulary(pieces["de"])
    spec.register_target_vocabulary(pieces["en"])
    return spec


def vocab(model_file: Path) -> list[str]:
    """Pieces by id; attnzoo's ids 0-3 are pad, bos, eos, unk under CTranslate2's special names."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    names = ["<blank>", "<s>", "</s>", "<unk>"]
    return names + [sp.id_to_piece(i) for i in range(len(names), sp.get_piece_size())]


def convert(checkpoint: Path, out: Path, data: Path, quantization: str | None = None) -> Path:
    from pipeline.checkpoint import load_model

    model, _ = load_model(checkpoint)
    spec = build_spec(model, {s: vocab(data / f"spm.{s}.model") for s in ("de", "en")})
    spec.validate()
    spec.optimize(quantization=quantization)
    out.mkdir(parents=True, exist_ok=True)
    spec.save(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "prepared" / "translation_de_en")
    ap.add_argument("--quantization", choices=["int8", "int8_float32"], default=None)
    args = ap.parse_args(argv)
    print(convert(args.checkpoint, args.out, args.data, args.quantization))


if __name__ == "__main__":
    main()
