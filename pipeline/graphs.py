"""Run a model's exported graphs the same way for PyTorch and onnxruntime.

``TorchGraph`` puts a PyTorch ``ExportSpec`` module behind the name-based call that
``serving.decode`` loops use, so evaluation (torch) and serving/parity (onnxruntime) share one
decoding loop. ``run_loop`` picks the loop from the graph names.
"""

from __future__ import annotations

import numpy as np
import torch

from serving import decode

SEQ2SEQ = {"encoder", "decoder_step"}
RECURRENT = {"init", "step"}
GLIMPSE = {"start", "glimpse"}


class TorchGraph:
    """Call a PyTorch graph module with named numpy feeds; optionally record the feeds."""

    def __init__(self, spec, record: list | None = None):
        self.spec = spec
        self.record = record
        self.input_names = list(spec.input_names)  # as ``serving.runtime.OrtGraph``

    @torch.no_grad()
    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.record is not None:
            self.record.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        args = [torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in self.spec.input_names]
        outs = self.spec.module(*args)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        return {n: o.numpy() for n, o in zip(self.spec.output_names, outs)}


def loop_kind(graph_names) -> str:
    names = set(graph_names)
    if SEQ2SEQ <= names:
        return "seq2seq"
    if RECURRENT <= names:
        return "recurrent"
    if GLIMPSE <= names:
        return "glimpse"
    return "single"


def run_loop(graphs: dict, batch: dict[str, np.ndarray], meta: dict, workers: int = 1) -> dict[str, np.ndarray]:
    """Run the model's inference loop over named graphs for one numpy batch.

    ``meta`` carries the model config (special token ids, decoding limit, collected outputs);
    ``workers`` > 1 runs a looping model over that many row ranges at once (``decode.split_rows``).
    """
    if workers > 1 and loop_kind(graphs) != "single":
        return decode.split_rows(lambda part: run_loop(graphs, part, meta), batch, workers,
                                 fill={"tokens": meta.get("pad_id", 0)})
    kind = loop_kind(graphs)
    if kind == "seq2seq":
        feeds = {n: batch[n] for n in graphs["encoder"].input_names}  # src + src_len, or an image
        return decode.greedy(graphs["encoder"], graphs["decoder_step"], feeds, None,
                             meta["bos_id"], meta["eos_id"], meta["max_len"], meta.get("pad_id", 0))
    if kind == "glimpse":
        return decode.glimpses(graphs["start"], graphs["glimpse"], batch["image"], meta["glimpses"])
    if kind == "recurrent":
        out = decode.unroll(graphs["init"], graphs["step"], batch["x"], tuple(meta.get("collect", ())))
        # Graphs outside the loop (DRAW's ``infer``) run once on the batch's inputs of their names.
        for name in sorted(set(graphs) - RECURRENT):
            out.update(graphs[name]({n: batch[n] for n in graphs[name].input_names}))
        return out
    (name,) = graphs
    return graphs[name](batch)
