"""CTranslate2 as the serving engine of a Transformer entry (``engine: ctranslate2`` in params.yaml).

``publish`` converts the trained checkpoint with ``ctranslate2.specs`` into the version's
``ctranslate2/`` folder (beside the ONNX graphs, which Triton and the ``<model>.<graph>`` models
keep serving), checks it against PyTorch (:func:`parity`) and scores the test set on what the server
then answers; ``serving/kinds/translation.py`` decodes with ``ctranslate2.Translator``. ``quantize``
converts it once more with int8 weights (:func:`build_int8`) for the entry's int8 variant, which its
quality gate judges as it judges the int8 graphs.

The mapping: CTranslate2's pre-norm ``TransformerSpec`` holding the same weights, the three attention
projections fused as CTranslate2 stores them (query/key/value for self-attention, key/value for
cross-attention), attnzoo's sinusoidal table (sin and cos interleaved) as the position encodings,
embeddings scaled by √D, the tied output projection with its bias, PyTorch's LayerNorm epsilon, and
the SentencePiece pieces as vocabularies (ids 0-3 under CTranslate2's special names). The alignment
CTranslate2 returns is the last decoder layer's cross-attention averaged over its heads (one layer is
all it keeps; the ONNX loop averages every layer's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

ENGINE_DIR = "ctranslate2"  # the folder inside a published version
MAX_POSITIONS = 1024  # CTranslate2 reads positions from this table: far beyond the 100-token limit
SPECIAL = ["<blank>", "<s>", "</s>", "<unk>"]  # attnzoo's pad, bos, eos, unk ids 0-3 in CTranslate2's words


def _array(tensor: torch.Tensor) -> np.ndarray:
    """A copy: ``spec.optimize`` quantises the spec's arrays in place, which must not reach the model."""
    return tensor.detach().cpu().numpy().copy()


def _linear(spec, layer) -> None:
    spec.weight, spec.bias = _array(layer.weight), _array(layer.bias)


def _fused(spec, layers) -> None:
    spec.weight = np.concatenate([_array(lin.weight) for lin in layers])
    spec.bias = np.concatenate([_array(lin.bias) for lin in layers])


def _norm(spec, norm) -> None:
    spec.gamma, spec.beta = _array(norm.weight), _array(norm.bias)


def _layer(layer, block) -> None:
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
    _norm(layer.ffn.layer_norm, block.norms[-1])
    _linear(layer.ffn.linear_0, block.ff[0])
    _linear(layer.ffn.linear_1, block.ff[3])


def build_spec(model, source: list[str], target: list[str]):
    """A ``ctranslate2.specs.TransformerSpec`` holding ``model``'s weights (a pre-norm Transformer with
    a tied output), with ``source`` / ``target`` pieces by id as its vocabularies."""
    from ctranslate2.specs import transformer_spec

    from models.transformer import sinusoid

    cfg = model.cfg
    if cfg.norm != "pre" or not cfg.tie_output:
        raise ValueError("the CTranslate2 engine maps the pre-norm Transformer with a tied output "
                         "(model: {norm: pre, tie_output: true})")
    # alignment_heads 0: the alignment averages every head of the last layer
    spec = transformer_spec.TransformerSpec.from_config((cfg.enc_layers, cfg.dec_layers), cfg.heads, pre_norm=True,
                                                        alignment_layer=-1, alignment_heads=0)
    spec.config.layer_norm_epsilon = model.enc_norm.eps
    table = sinusoid(torch.arange(MAX_POSITIONS), cfg.dim).numpy()  # [P,D], the model's own positions
    for side, embed, blocks, final in (("encoder", model.src_embed, model.encoder, model.enc_norm),
                                      ("decoder", model.tgt_embed, model.decoder, model.dec_norm)):
        s = getattr(spec, side)
        emb = s.embeddings[0] if isinstance(s.embeddings, list) else s.embeddings
        emb.weight = _array(embed.weight)
        s.scale_embeddings = True  # √D·E + PE, as Transformer.embed
        s.position_encodings.encodings = table
        _norm(s.layer_norm, final)
        for layer, block in zip(s.layer, blocks):
            _layer(layer, block)
    spec.decoder.projection.weight = _array(model.tgt_embed.weight)
    spec.decoder.projection.bias = _array(model.out_bias)
    spec.register_source_vocabulary(source)
    spec.register_target_vocabulary(target)
    return spec


def pieces(model_file: Path) -> list[str]:
    """A SentencePiece model's pieces by id, ids 0-3 under CTranslate2's special names."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    return SPECIAL + [sp.id_to_piece(i) for i in range(len(SPECIAL), sp.get_piece_size())]


def convert(model, source_model: Path, target_model: Path, out: Path, quantization: str | None = None) -> Path:
    """Write ``model`` as a CTranslate2 model folder ``out`` (fp32 unless ``quantization``)."""
    spec = build_spec(model, pieces(source_model), pieces(target_model))
    spec.validate()
    spec.optimize(quantization=quantization)
    out.mkdir(parents=True, exist_ok=True)
    spec.save(str(out))
    return out


def _teacher_forced(model, items: list[dict]) -> list[np.ndarray]:
    """PyTorch's log-probability of each reference piece and of the final EOS, per item."""
    out = []
    with torch.no_grad():
        for it in items:
            src = torch.tensor([it["src"]])
            enc = model.encode(src, torch.tensor([len(it["src"])]))
            tgt_in = torch.tensor([[model.cfg.bos_id] + it["tgt"]])  # [1,T+1]
            logits, _, _, _ = model.decode(tgt_in, enc)
            logp = torch.log_softmax(logits[0], dim=-1)  # [T+1,V]
            out.append(logp[torch.arange(len(it["tgt"]) + 1), torch.tensor(it["tgt"] + [model.cfg.eos_id])].numpy())
    return out


def parity(model, folder: Path, items: list[dict], atol: float) -> dict:
    """CTranslate2 (``folder``) against PyTorch on ``items`` (the task's id lists, sources ending with
    EOS): every reference piece's log-probability (teacher forced) within ``atol``, and greedy
    decoding's tokens identical with its alignment (the last layer's heads averaged) within ``atol``."""
    import ctranslate2

    src_vocab, tgt_vocab = pieces_of(folder, "source"), pieces_of(folder, "target")
    translator = ctranslate2.Translator(str(folder), device="cpu", compute_type="float32")
    sources = [[src_vocab[t] for t in it["src"]] for it in items]
    scored = translator.score_batch(sources, [[tgt_vocab[t] for t in it["tgt"]] for it in items])
    logp_diff = max(float(np.abs(np.array(s.log_probs) - ref).max())
                    for s, ref in zip(scored, _teacher_forced(model, items)))
    found = translator.translate_batch(sources, beam_size=1, max_decoding_length=model.cfg.max_len,
                                       min_decoding_length=0, return_attention=True, return_end_token=True)
    index = {p: i for i, p in enumerate(tgt_vocab)}
    same, attn_diff = 0, 0.0
    for it, r in zip(items, found):
        ours = model.predict({"src": torch.tensor([it["src"]]), "src_len": torch.tensor([len(it["src"])])})
        steps = int(ours["lengths"][0]) + 1  # the emitted pieces and the EOS step
        tokens = [index[p] for p in r.hypotheses[0]]
        if tokens == ours["tokens"][0, :steps].tolist():
            same += 1
            heads = ours["attention_heads"][0, :steps, -1].mean(dim=1).numpy()  # [T,L,H,S] -> last layer [T,S]
            attn_diff = max(attn_diff, float(np.abs(np.array(r.attention[0]) - heads).max()))
    passed = same == len(items) and logp_diff <= atol and attn_diff <= atol
    return {"passed": passed, "items": len(items), "greedy_identical": same, "max_logp_diff": logp_diff,
            "max_attention_diff": attn_diff, "atol": atol}


def pieces_of(folder: Path, side: str) -> list[str]:
    """The vocabulary a converted model holds (``source`` or ``target``), pieces by id."""
    import json

    return json.loads((Path(folder) / f"{side}_vocabulary.json").read_text())


PARITY_ITEMS = 64  # test sentences whose log-probabilities and greedy decoding are checked
# CTranslate2 4.8's int8 on the CPU runs fastest on one thread: the test set at 157.4 sentences/s at batch
# 1 against 12.0 on two (2-core EPYC, AVX512-BF16; docs/benchmarks.md, Peers): the int8 version caps them.
INT8_CPU_THREADS = 1


def build(run, serving: dict, artifacts: list[Path], out: Path) -> tuple[dict, dict]:
    """The engine's part of ``run``'s version, written into ``out``: the converted model
    (``out/ctranslate2``), checked against PyTorch, and the test set scored on what the server answers.

    Returns (the version's serving block, with the engine; the engine's record: parity, metrics, bar).
    Raises UserError when CTranslate2 and PyTorch disagree (nothing is published then).
    """
    from pipeline.bars import check_bar
    from pipeline.checkpoint import load_model
    from pipeline.config import UserError
    from pipeline.tasks import get_task

    model, _ = load_model(run.run_dir / "checkpoint" / "best")
    convert(model, run.data_dir / serving["source_tokenizer"], run.data_dir / serving["target_tokenizer"],
            out / ENGINE_DIR)
    items = get_task(run.task).load(run.data_dir, "test")
    check = parity(model, out / ENGINE_DIR, items[:PARITY_ITEMS], float(run.parity.get("atol", 1e-4)))
    if not check["passed"]:
        raise UserError(f"{run.name}: CTranslate2 and PyTorch disagree ({check}); nothing was published. "
                        "Serve it with ONNX Runtime (remove `engine: ctranslate2` from params.yaml) or fix "
                        "pipeline/ctranslate2_engine.py")
    served = {**serving, "engine": "ctranslate2", "ctranslate2": {"folder": ENGINE_DIR, "compute_type": "float32"}}
    metrics = score(run, served, artifacts, out, items)
    return served, {"name": "ctranslate2", "parity": check, "metrics": metrics,
                    "bar": check_bar(metrics, run.bar or [])}


def build_int8(model, run, serving: dict, artifacts: list[Path], out: Path) -> dict:
    """The int8 variant of an entry this engine serves (``quantize@``): ``model`` converted with int8
    weights into ``out/ctranslate2`` and the test set scored on what the server answers with it.
    There is no parity to check (int8 computes other numbers): the quality gate judges it.

    Returns the engine's record: its name, the serving block's part (folder, compute type, the most
    CPU threads it runs on), metrics.
    """
    import shutil
    import tempfile

    import ctranslate2

    from pipeline.tasks import get_task

    block = {"folder": ENGINE_DIR, "compute_type": "int8", "cpu_threads": INT8_CPU_THREADS}
    with tempfile.TemporaryDirectory() as scratch:
        convert(model, run.data_dir / serving["source_tokenizer"], run.data_dir / serving["target_tokenizer"],
                Path(scratch) / ENGINE_DIR, quantization="int8")
        served = {**serving, "engine": "ctranslate2", "ctranslate2": block}
        metrics = score(run, served, artifacts, Path(scratch), get_task(run.task).load(run.data_dir, "test"))
        shutil.rmtree(out / ENGINE_DIR, ignore_errors=True)
        shutil.copytree(Path(scratch) / ENGINE_DIR, out / ENGINE_DIR)
    return {"name": "ctranslate2", "version": ctranslate2.__version__, "serving": block, "metrics": metrics}


def score(run, served: dict, artifacts: list[Path], out: Path, items: list[dict]) -> dict:
    """The task's beam metrics of the server's model on ``out`` (the engine and the tokenizers): every
    test text in, the translation out, in requests of the version's row limit."""
    import shutil
    import time

    from tqdm.auto import tqdm

    from pipeline.tasks.translation_de_en import score_beam
    from serving.admission import Limits
    from serving.kinds import KINDS

    for artifact in artifacts:
        shutil.copy2(artifact, out / artifact.name)
    # the engine answers every text: the ONNX loop's graphs are never called, so none is opened
    graphs = dict.fromkeys(("encoder", "decoder_step"))
    model = KINDS[served["kind"]](run.name, 0, out, {"serving": served}, graphs, Limits.of(served["limits"]))
    model.open_engine("cpu", 0)
    rows, hyps, began = model.limits.rows, [], time.perf_counter()
    for at in tqdm(range(0, len(items), rows), desc=f"ctranslate2 beam {served['beam']} {run.name}", mininterval=5):
        texts = np.array([it["src_text"] for it in items[at : at + rows]], dtype=object)
        hyps += [str(t) for t in model.infer({"text": texts}, {})["translation"][0]]
    seconds = time.perf_counter() - began  # printed, not recorded: the version's files stay deterministic
    print(f"{run.name}: CTranslate2 ({served['ctranslate2']['compute_type']}) translated {len(items)} "
          f"test sentences in {seconds:.1f} s")
    metrics = score_beam(items, hyps, served["beam"], run.evaluate.get("min_source", 100))
    return {k: v for k, v in metrics.items() if k not in ("signature", "by_source")}
