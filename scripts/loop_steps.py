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

import cli_errors

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
    from bench_inference import benched, int8_graphs

    from pipeline.graphs import run_loop
    from serving.runtime import OrtGraph

    folder, _, specs, meta, batches = benched(name, root)
    step = next(g for g in specs if g != "encoder")  # the graph the loop calls once per token
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        int8_graphs(name, root, folder, specs, Path(tmp))
        for kind, graphs_dir in (("fp32", folder), ("int8", Path(tmp))):
            graphs = {g: OrtGraph(graphs_dir / f"{g}.onnx", provider="cpu", threads=1) for g in specs}
            calls = []
            for batch in batches[1]:
                counted = Counted(graphs[step])
                run_loop({**graphs, step: counted}, {k: v.numpy() for k, v in batch.items()}, meta)
                calls.append(counted.calls)
            out[kind] = calls
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    args = ap.parse_args(argv)
    for name in cli_errors.entries(args.models):
        for kind, calls in step_calls(name).items():
            print(f"{name} {kind}: decoder-step calls per batch-1 case {calls}, {sum(calls)} in all")


if __name__ == "__main__":
    cli_errors.run(main)
