"""GPU readiness check (run by scripts/gpu_check.sh on a machine with a CUDA device).

1. Parity of every model trained and published in this checkout on the CUDA execution provider (and
   TensorRT's, when onnxruntime has it): the export stage's own gate (``pipeline.export.parity_check``).
2. Whole-loop inference time, ONNX Runtime on CUDA vs PyTorch on CUDA, batch 1 and batch 32
   (the cases of ``scripts/bench_inference.py``).
3. The Transformer trained for ``--steps`` steps with bf16 autocast through ``accelerate launch``:
   tokens/s and model FLOPs utilisation, MFU = 6 · parameters · (source + target tokens)/s over the
   device's dense bf16 peak (an upper estimate of the work: each parameter sees one side only).

``--device cpu`` runs the same three checks on the CPU (CPU execution provider, fp32 training):
a rehearsal of the code path on a machine without a GPU, not a GPU figure.
Writes ``docs/gpu_check.json`` with ``--write``; prints a Markdown summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# Dense bf16 peak FLOP/s by device name (vendor data sheets; without sparsity).
PEAK_BF16 = {"H200": 989.4e12, "H100 PCIe": 756.0e12, "H100": 989.4e12, "A100": 312.0e12, "L40S": 362.1e12,
             "A10G": 70.0e12, "L4": 121.0e12}


def peak_flops(device_name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    for key, value in PEAK_BF16.items():  # "H100 PCIe" before "H100": dict order
        if key in device_name:
            return value
    return None


def trained_models(root: Path) -> list[str]:
    import yaml
    from bench_inference import latest_graphs

    names = list(yaml.safe_load((root / "params.yaml").read_text())["models"])
    return [n for n in names if (root / "runs" / n / "checkpoint" / "best").is_dir() and latest_graphs(n, root)]


def parity(names: list[str], root: Path, provider: str) -> dict[str, dict]:
    """The export gate on ``provider`` for each model: passed, cases, the worst output."""
    from bench_inference import latest_graphs

    from pipeline.checkpoint import load_model
    from pipeline.config import resolve
    from pipeline.export import parity_check
    from pipeline.tasks import get_task

    out = {}
    for name in names:
        run = resolve(name, root=root)
        model, _ = load_model(run.run_dir / "checkpoint" / "best")
        cases = get_task(run.task).model_parity_batches(model, run.data_dir)
        try:
            rep = parity_check(model, latest_graphs(name, root), cases, run.parity, provider)
            out[name] = {"provider": rep["provider"], "passed": rep["passed"], "cases": len(rep["cases"])}
        except Exception as err:  # noqa: BLE001 -- one model's failure is a row, not the end of the check
            out[name] = {"provider": provider, "passed": False, "error": f"{type(err).__name__}: {err}"[:300]}
        print(f"parity {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def timing(names: list[str], root: Path, device: str, repeats: int) -> dict[str, dict]:
    """Whole-loop ms (median of ``repeats``), ORT on ``device``'s provider vs PyTorch on ``device``."""
    import torch
    from bench_inference import batch_groups, latest_graphs, median_ms

    from pipeline.checkpoint import load_model
    from pipeline.config import resolve
    from pipeline.graphs import run_loop
    from pipeline.tasks import get_task
    from serving.runtime import OrtGraph

    out = {}
    for name in names:
        run = resolve(name, root=root)
        model, _ = load_model(run.run_dir / "checkpoint" / "best")
        specs = model.export_graphs()
        meta = {**model.cfg.__dict__, "collect": getattr(model, "parity_collect", ())}
        cases = get_task(run.task).model_parity_batches(model, run.data_dir)
        graphs = {g: OrtGraph(latest_graphs(name, root) / f"{g}.onnx", provider=device) for g in specs}
        model = model.to(device)
        row = {}
        for size, group in batch_groups(cases).items():
            on_device = [{k: v.to(device) for k, v in b.items()} for b in group]
            np_group = [{k: v.numpy() for k, v in b.items()} for b in group]

            def torch_loop(batches=on_device, model=model):
                with torch.no_grad():
                    outs = [model.predict(b) for b in batches]
                if device == "cuda":
                    torch.cuda.synchronize()
                return outs

            def ort_loop(batches=np_group, graphs=graphs, meta=meta):
                return [run_loop(graphs, b, meta) for b in batches]

            times: dict[str, list[float]] = {"pytorch": [], "onnxruntime": []}
            torch_loop(), ort_loop()  # warm-up: kernels, allocator, cuDNN autotuning
            for _ in range(repeats):
                for key, fn in (("pytorch", torch_loop), ("onnxruntime", ort_loop)):
                    start = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - start)
            row[size] = {k: median_ms(v) for k, v in times.items()}
        out[name] = {"provider": graphs[next(iter(specs))].provider, **row}
        print(f"timing {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def train_transformer(root: Path, device: str, steps: int, peak: float | None) -> dict:
    """``accelerate launch`` one process, bf16 autocast on CUDA: tokens/s and MFU of the Transformer."""
    import torch

    from pipeline.config import resolve
    from pipeline.tasks import get_task

    run = resolve("transformer", root=root)
    if not (run.data_dir / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "pipeline.prepare", run.task], cwd=root, check=True)
        run = resolve("transformer", root=root)
    out_dir = Path(tempfile.mkdtemp(prefix="gpu_check_transformer_"))
    precision = "bf16" if device == "cuda" else "no"  # accelerate's names; "no" is fp32
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", precision, "--dynamo_backend", "no", *([] if device == "cuda" else ["--cpu"]),
           "-m", "pipeline.train", "transformer", "--out", str(out_dir),
           "--set", f"max_steps={steps}", f"eval_every={steps}", "epochs=1000"]
    print(" ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=root, check=True, env={**os.environ, "PYTHONPATH": str(root)})
    summary = json.loads((out_dir / "train_summary.json").read_text())
    task = get_task(run.task)
    items = task.load(run.data_dir, "train")
    tokens_per_item = float(np.mean([len(it["src"]) + len(it["tgt"]) + 1 for it in items]))
    tokens = tokens_per_item * run.train.batch_size * summary["steps"]
    seconds = summary["train_seconds"]
    from pipeline.checkpoint import load_model

    model, _ = load_model(out_dir / "checkpoint" / "last")
    params = sum(p.numel() for p in model.parameters())
    rate = tokens / seconds
    row = {"steps": summary["steps"], "seconds": seconds, "precision": {"no": "fp32"}.get(precision, precision),
           "params": params,
           "tokens_per_s": round(rate), "batch_size": run.train.batch_size,
           "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}
    if peak:
        row["mfu"] = round(6 * params * rate / peak, 4)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=300, help="Transformer training steps")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, if not known")
    ap.add_argument("--write", action="store_true", help="write docs/gpu_check.json")
    args = ap.parse_args(argv)
    import onnxruntime as ort
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to PyTorch here; nothing to check")
        return
    names = trained_models(ROOT)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    report = {"device": name, "onnxruntime": ort.__version__, "torch": torch.__version__, "models": names}
    providers = ["cuda"] if args.device == "cuda" else ["cpu"]
    report["parity"] = {p: parity(names, ROOT, p) for p in providers}
    if "TensorrtExecutionProvider" in ort.get_available_providers() and args.device == "cuda":
        report["parity"]["tensorrt"] = "TensorRT EP present: not checked (serving.runtime asks for CUDA or CPU)"
    report["timing"] = timing(names, ROOT, args.device, args.repeats)
    report["train"] = train_transformer(ROOT, args.device, args.steps, peak_flops(name, args.peak_tflops))
    lines = [f"# gpu_check on {name} (onnxruntime {ort.__version__}, torch {torch.__version__})", "",
             "| model | parity | batch 1: PyTorch ms | ORT ms | × | batch 32: PyTorch ms | ORT ms | × |",
             "|---|---|---|---|---|---|---|---|"]
    for model in names:
        par = all(report["parity"][p][model]["passed"] for p in providers)
        t = report["timing"][model]
        cells = [f"{t[s]['pytorch']:.2f} | {t[s]['onnxruntime']:.2f} | {t[s]['pytorch'] / t[s]['onnxruntime']:.2f}"
                 for s in (1, 32)]
        lines.append(f"| {model} | {'passed' if par else 'FAILED'} | " + " | ".join(cells) + " |")
    tr = report["train"]
    lines += ["", f"Transformer, {tr['steps']} steps, {tr['precision']}, batch {tr['batch_size']}: "
              f"{tr['tokens_per_s']:,} tokens/s" + (f", MFU {tr['mfu']:.1%}" if "mfu" in tr else ", MFU: peak unknown")]
    print("\n".join(lines))
    if args.write:
        (ROOT / "docs" / "gpu_check.json").write_text(json.dumps(report, indent=1))
    if not all(report["parity"][p][m]["passed"] for p in providers for m in names):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
