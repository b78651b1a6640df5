"""Decoder-step calls of the fp32 and int8 serving loops on each batch-1 parity case (an analysis, not
a stage): a whole-loop time ratio in docs/benchmarks.md compares loops of different lengths when the
int8 variant decodes other tokens than fp32 (``int8 same`` < 100 %), and this counts them.

    python scripts/loop_steps.py bahdanau bahdanau_none

The cases, graphs and int8 recipe are ``scripts/bench_inference.py``'s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


class Counted:
    """A graph that counts its calls."""

    def __init__(self, graph):
        self.graph, self.calls = graph, 0

    def __getattr__(self, attr):
        return getattr(self.graph, attr)

    def __call__(self, feeds):
        self.calls += 1
        return self.graph(feeds)


def step_calls(name: str, root: Path = ROOT) -> dict[str, list[int]]:
    """{"fp32": [decoder-step calls per batch-1 case], "int8": [...]} for a looping model."""
    from bench_inference import batch_groups, latest_graphs

    from pipeline.checkpoint import load_model
    from pipeline.config import load_params, resolve
    from pipeline.graphs import run_loop
    from pipeline.quantize import quantize_graphs, settings
    from pipeline.tasks import get_task
    from serving.runtime import OrtGraph

    run = resolve(name, root=root)
    folder = latest_graphs(name, root)
    model, _ = load_model(run.run_dir / "checkpoint" / "best")
    specs = model.export_graphs()
    meta = {**model.cfg.__dict__, "collect": getattr(model, "parity_collect", ())}
    group = batch_groups(get_task(run.task).model_parity_batches(model, run.data_dir))[1]
    step = next(g for g in specs if g != "encoder")  # the graph the loop calls once per token
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        quantize_graphs(folder, list(specs), Path(tmp), settings(name, load_params(root))["op_types"])
        for kind, graphs_dir in (("fp32", folder), ("int8", Path(tmp))):
            graphs = {g: OrtGraph(graphs_dir / f"{g}.onnx", provider="cpu", threads=1) for g in specs}
            calls = []
            for batch in group:
                counted = Counted(graphs[step])
                run_loop({**graphs, step: counted}, {k: v.numpy() for k, v in batch.items()}, meta)
                calls.append(counted.calls)
            out[kind] = calls
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    args = ap.parse_args(argv)
    for name in args.models:
        for kind, calls in step_calls(name).items():
            print(f"{name} {kind}: decoder-step calls per batch-1 case {calls}, {sum(calls)} in all")


if __name__ == "__main__":
    main()
