"""The serving block of a published version: everything ``serving/`` needs to run a model's loop
on raw input (loop kind, special ids, tokenizers, attention outputs, limits), so a server never
reads params or checkpoints.

``publish`` writes it into each version's ``metadata.json``; ``quantize`` builds the server's own
model with it to score an int8 variant on what the server answers. Kept apart from ``publish.py``
so that the quantize stages depend on this block, not on the model card's wording.
"""

from __future__ import annotations

import dataclasses

from pipeline.config import RunConfig, UserError
from pipeline.graphs import loop_kind
from serving.admission import Limits, Memory
from serving.decode import BEAM


def serving_meta(cfg, graphs: list[str], run: RunConfig) -> dict:
    """Everything ``serving/`` needs to run the loop on raw input, so it never reads params or
    checkpoints: loop kind, special ids and limits, attention outputs, the task's tokenizers.

    ``cfg`` is the model's typed config, ``graphs`` the exported graph names.
    """
    meta: dict = {"loop": loop_kind(graphs)}
    if meta["loop"] == "glimpse":
        meta["glimpses"] = cfg.glimpses
    if meta["loop"] == "seq2seq":
        meta.update({k: getattr(cfg, k) for k in ("bos_id", "eos_id", "pad_id", "max_len")},
                    beam=run.evaluate.get("beam", BEAM), length_penalty=run.evaluate.get("length_penalty", 1.0))
        if run.evaluate.get("no_repeat_ngram"):  # only where set: other models' serving blocks stay byte-identical
            meta["no_repeat_ngram"] = int(run.evaluate["no_repeat_ngram"])
    import models
    from pipeline.tasks import get_task
    from serving.kinds import kind_of

    # What the server needs from the task (tokenizers, vocabularies) and from the model (its own names)
    model_cls = next(e.model_cls for e in models.REGISTRY.values() if type(cfg) is e.config_cls)
    model = getattr(model_cls, "serving", {})
    meta = {**meta, **get_task(run.task).serving, **model}
    return {"kind": kind_of(meta, graphs), **meta}  # which serving/kinds module runs it


def limits(run: RunConfig) -> dict:
    """The serving limits published with the model (part of its serving block: a changed limit is
    a new version)."""
    known = {f.name for f in dataclasses.fields(Limits)}
    unknown = sorted(set(run.limits) - known)
    if unknown:
        raise UserError(f"{run.name}: unknown serving limit(s) {unknown} in params.yaml; known: {sorted(known)}")
    return Limits.of(run.limits).as_json()


WIDTH_WORDS = ("hidden", "dim", "controller_size", "memory_size", "glimpse_out")  # a config's layer widths


def memory(cfg) -> dict:
    """How the model's peak memory grows with a request's rows and length (serving/admission.py
    Memory): a Transformer's from its width, heads and layers (its self-attention grows with the
    square of the length), every other model's from its widest layer."""
    if all(hasattr(cfg, k) for k in ("dim", "heads", "ff_dim", "enc_layers", "dec_layers")):
        return Memory.transformer(cfg.dim, cfg.heads, cfg.ff_dim, cfg.enc_layers, cfg.dec_layers).as_json()
    widths = [getattr(cfg, f.name) for f in dataclasses.fields(cfg) if any(w in f.name for w in WIDTH_WORDS)
              and isinstance(getattr(cfg, f.name), int)]
    return Memory.linear(max(widths, default=256)).as_json()


def serving_block(cfg, graphs: list[str], run: RunConfig) -> dict:
    """The whole serving block a version carries: how its graphs are run, its limits and its memory."""
    return {**serving_meta(cfg, graphs, run), "limits": limits(run), "memory": memory(cfg)}
