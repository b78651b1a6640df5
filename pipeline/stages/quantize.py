"""Stage ``quantize@<model>``: an int8 variant of the exported graphs and its quality gate.

The export stage's fp32 graphs (``runs/<model>/onnx``) are quantised with onnxruntime's own tooling
(``quant_pre_process``, then dynamic quantisation: int8 weights, activations quantised per call) into
``runs/<model>/int8/``. The variant is then scored on the task's **full test set** by the task's own
``evaluate``, with every graph of the model answered by onnxruntime instead of PyTorch
(:class:`OnnxTwin`), and compared with the fp32 metrics of ``evaluate@<model>``
(``runs/<model>/metrics.json``) on each metric of the model's quality bar: int8 may be worse by at
most ``quantize.tolerance`` (BLEU points, accuracy / CER points, nats, bits per sequence;
``quantize.tolerance_by_model`` for bars on a 0-1 scale). The result, ``runs/<model>/int8_metrics.json``,
sits beside the fp32 metrics; a variant that misses the gate is reported there and is not to be
published. Timings go to MLflow only (tracked outputs stay deterministic).

The variant is scored on what a server answers: an output the loop does not return (the NTMs'
``bits``) comes from the server's own model (``serving/kinds``) over the same graphs. A task whose
evaluation needs what neither computes (a PyTorch-only method) cannot score the variant; the stage
then records why in ``int8_metrics.json`` (gate not passed) instead of failing the pipeline.

An entry served by another engine (``engine: ctranslate2``) also gets that engine's own int8
conversion (``runs/<model>/int8/ctranslate2``), scored the same way and gated on its own
(``engine`` in ``int8_metrics.json``): the int8 variant is served by it when both gates pass.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime
import torch

from pipeline import tracking
from pipeline.bars import gate
from pipeline.checkpoint import load_model
from pipeline.config import RunConfig, UserError, load_params, quantize_settings, read_manifest, trained
from pipeline.entry import RUN_HELP, exit_after, model_parser, run_cli
from pipeline.graphs import run_loop
from pipeline.tasks import get_task
from serving.runtime import OrtGraph


class NotFromGraphs(AttributeError):
    """The task's evaluation asked for something the exported graphs do not compute. An
    ``AttributeError``, so ``hasattr(model, "decode_uncached")`` is False for the twin and a task
    skips its PyTorch-only self-checks."""


def quantize_graphs(src: Path, graphs: list[str], out: Path, op_types: list[str]) -> dict[str, int]:
    """Dynamically quantise ``src/<graph>.onnx`` for each graph into ``out/<graph>.onnx``.

    onnxruntime's recipe: shape inference and graph optimisation (``quant_pre_process``), then
    ``quantize_dynamic`` with int8 weights on ``op_types``. Tensors it cannot quantise (float64 ones,
    say) stay float: ORT logs each on the root logger, which is quietened here.

    Returns: ``{graph: size in bytes of the int8 file}``.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    out.mkdir(parents=True, exist_ok=True)
    root_logger = logging.getLogger()
    level, root_logger.level = root_logger.level, logging.ERROR
    sizes = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for graph in graphs:
                pre = Path(tmp) / f"{graph}.pre.onnx"
                quant_pre_process(str(src / f"{graph}.onnx"), str(pre), skip_symbolic_shape=True)
                quantize_dynamic(str(pre), str(out / f"{graph}.onnx"), weight_type=QuantType.QInt8,
                                 op_types_to_quantize=list(op_types))
                sizes[graph] = (out / f"{graph}.onnx").stat().st_size
    finally:
        root_logger.level = level
    return sizes


class _Outputs(dict):
    """A loop's outputs as a ``predict`` result. A key the loop does not return is looked up in what
    the server answers for the same inputs (``served``, called once, only then: the NTMs' ``bits``
    are the server's threshold of the loop's logits); a key neither has is a clear error."""

    def __init__(self, outputs: dict, served=None):
        super().__init__(outputs)
        self._served = served

    def __missing__(self, key):
        if self._served is not None:
            served, self._served = self._served(), None
            for name, value in served.items():
                self.setdefault(name, value)
            if key in self:
                return self[key]
        raise NotFromGraphs(f"the evaluation reads '{key}' of predict(), which neither the exported loop nor "
                            f"the served model returns (they return {', '.join(sorted(self))})")


class _OrtModule:
    """An onnxruntime graph behind an ``ExportSpec.module``'s call: torch tensors in
    ``input_names`` order in, torch tensors in ``output_names`` order out."""

    def __init__(self, graph: OrtGraph, input_names: list[str], output_names: list[str]):
        self.graph, self.input_names, self.output_names = graph, list(input_names), list(output_names)

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = self.graph({n: a.numpy() for n, a in zip(self.input_names, args)})
        return tuple(torch.from_numpy(np.asarray(outs[n])) for n in self.output_names)


class OnnxTwin:
    """What a task's ``evaluate`` uses of a model — ``predict``, ``export_graphs`` and plain
    attributes such as ``cfg`` — answered by the ONNX graphs in a folder instead of PyTorch.

    ``predict`` runs the serving loop (:func:`pipeline.graphs.run_loop`) over the graphs, and the
    export specs' modules call the graphs, so greedy and beam decoding both run on onnxruntime.
    Any other method of the model (DRAW's ``infer``, a decoder's ``decode_uncached``) would silently
    score PyTorch instead: asking for one raises :class:`NotFromGraphs`.
    """

    def __init__(self, model, onnx_dir: Path, threads: int = 0, run: RunConfig | None = None):
        self._model = model
        self._specs = model.export_graphs()
        self._graphs = {n: OrtGraph(Path(onnx_dir) / f"{n}.onnx", provider="cpu", threads=threads)
                        for n in self._specs}
        self._meta = {**model.cfg.__dict__, "collect": getattr(model, "parity_collect", ())}
        self._run = run

    @functools.cached_property
    def _served_model(self):
        """The server's model (``serving/kinds``) over these graphs with the serving block ``publish``
        writes, built on first use; None without a run or for a kind that serves only the graphs."""
        if self._run is None:
            return None
        from pipeline.serving_meta import serving_block
        from serving.admission import Limits
        from serving.kinds import KINDS

        meta = serving_block(self._model.cfg, list(self._specs), self._run)
        kind = KINDS.get(meta["kind"])
        return kind(self._run.name, 0, self._run.run_dir, {"serving": meta}, self._graphs,
                    Limits.of(meta["limits"])) if kind else None

    def __getattr__(self, name: str):
        value = getattr(self._model, name)
        if callable(value):
            raise NotFromGraphs(f"the evaluation calls model.{name}(), which the exported graphs do not answer")
        return value

    def predict(self, batch: dict) -> dict:
        feeds = {k: v.numpy() for k, v in batch.items() if isinstance(v, torch.Tensor)}
        out = run_loop(self._graphs, feeds, self._meta)
        return _Outputs({k: torch.from_numpy(np.asarray(v)) for k, v in out.items()},
                        lambda: self._serve(feeds))

    def _serve(self, feeds: dict) -> dict:
        """What the server answers for these feeds; empty where it takes other inputs (raw text)."""
        served = self._served_model
        inputs = [spec.name for spec in served.inputs] if served else []
        if not served or not set(inputs) <= set(feeds):
            return {}
        answer = served.infer({n: feeds[n] for n in inputs}, {})
        return {k: torch.from_numpy(np.asarray(v)) for k, (v, _dtype) in answer.items()}

    def export_graphs(self) -> dict:
        return {n: dataclasses.replace(s, module=_OrtModule(self._graphs[n], s.input_names, s.output_names))
                for n, s in self._specs.items()}


def evaluate_graphs(model, run, onnx_dir: Path, threads: int = 0) -> dict:
    """The task's test metrics (numbers only) with every graph of ``model`` run from ``onnx_dir``."""
    with tempfile.TemporaryDirectory() as plots:  # the task draws its plots; the variant keeps none
        metrics, _ = get_task(run.task).evaluate(OnnxTwin(model, onnx_dir, threads, run), run, Path(plots))
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def engine_int8(run: RunConfig, model, graphs: list[str], out_dir: Path, fp32: dict, tolerance: float) -> dict:
    """For an entry served by another engine than the graphs (``engine:`` in params.yaml): that engine's
    own int8 conversion in ``out_dir``, scored on the test set as the server answers and gated against
    fp32 like the graphs. ``publish`` serves the int8 variant on it when both gates pass."""
    from pipeline import ctranslate2_engine
    from pipeline.serving_meta import serving_block

    serving = serving_block(model.cfg, graphs, run)
    artifacts = [run.data_dir / a for a in read_manifest(run.data_dir).get("artifacts", [])]
    record = ctranslate2_engine.build_int8(model, run, serving, artifacts, out_dir)
    return {**record, "gate": gate(fp32, record["metrics"], run.bar or [], tolerance)}


def settings(name: str, params: dict | None = None) -> dict:
    """``params.yaml`` ``quantize`` for one model entry: its op types and its tolerance."""
    return dataclasses.asdict(quantize_settings(name, params if params is not None else load_params()))


def quantize(run: RunConfig, conf: dict) -> dict:
    """Quantise ``run``'s exported graphs, score the variant and gate it; returns int8_metrics.json."""
    onnx_dir, out_dir = run.run_dir / "onnx", run.run_dir / "int8"
    fp32_path = run.run_dir / "metrics.json"
    if not onnx_dir.is_dir() or not fp32_path.exists():
        raise UserError(f"{run.name}: quantize needs {onnx_dir} and {fp32_path}; run "
                        f"`attnzoo repro export@{run.name} evaluate@{run.name}` first")
    model, _ = load_model(run.run_dir / "checkpoint" / "best")
    graphs = list(model.export_graphs())
    shutil.rmtree(out_dir, ignore_errors=True)
    sizes = quantize_graphs(onnx_dir, graphs, out_dir, conf["op_types"])
    fp32 = json.loads(fp32_path.read_text())
    started = time.time()
    threads = torch.get_num_threads()
    try:
        int8 = evaluate_graphs(model, run, out_dir, threads)
        result_gate = gate(fp32, int8, run.bar or [], conf["tolerance"])
    except NotFromGraphs as err:
        int8 = {}
        result_gate = {"tolerance": conf["tolerance"], "passed": False, "conditions": [],
                       "note": f"not measured: {err}"}
    seconds = round(time.time() - started, 1)
    report = {
        "quantization": {"method": "dynamic", "weights": "int8", "op_types": conf["op_types"],
                         "onnxruntime": onnxruntime.__version__},
        "bytes": {"fp32": sum((onnx_dir / f"{g}.onnx").stat().st_size for g in graphs), "int8": sum(sizes.values())},
        "gate": result_gate,
        "metrics": int8,
    }
    if run.engine != "onnxruntime":
        report["engine"] = engine_int8(run, model, graphs, out_dir, fp32, conf["tolerance"])
    (run.run_dir / "int8_metrics.json").write_text(json.dumps(report, indent=1))
    engine = {f"int8_engine_{k}": v for k, v in report.get("engine", {}).get("metrics", {}).items()
              if isinstance(v, (int, float))}
    with tracking.run(run.name, "quantize") as mlflow:
        mlflow.log_metrics({"int8_gate_passed": float(result_gate["passed"]), "int8_eval_seconds": seconds,
                            **{f"int8_{k}": v for k, v in int8.items()}, **engine})
        mlflow.log_artifact(str(run.run_dir / "int8_metrics.json"))
    return report


def main(argv: list[str] | None = None) -> None:
    ap = model_parser("Quantise a model's exported graphs to int8 and gate the variant's test metrics against "
                      "fp32's.", RUN_HELP)
    args = ap.parse_args(argv)

    def body():
        report = quantize(trained(args.model, args.run), settings(args.model))
        g = report["gate"]
        rows = ", ".join(f"{c['metric']} {c['fp32']} -> {c['int8']}" for c in g["conditions"]) or g.get("note", "")
        print(f"{args.model}: int8 gate {'passed' if g['passed'] else 'NOT passed'} "
              f"(worse by at most {g['tolerance']}): {rows}; "
              f"{report['bytes']['fp32']:,} -> {report['bytes']['int8']:,} bytes")

    run_cli(body)


if __name__ == "__main__":
    exit_after(main)
