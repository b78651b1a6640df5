"""GPU readiness check (run by scripts/gpu_check.sh on a machine with a CUDA device).

1. Parity of every model trained and published in this checkout on the CUDA execution provider: the
   export stage's own gate (``pipeline.stages.export.parity_check``), twice: as the server runs it (TF32 off,
   ``serving.runtime.CUDA_OPTIONS``: fp32 arithmetic, what the gate's fp32 tolerances are for) and
   with TF32 on (onnxruntime's own default, about 1e-3 relative error on Ampere and later GPUs). Each
   row keeps the largest graph-output error and whether the end-to-end outputs (tokens, decisions)
   still agree.
2. Whole-loop inference time, ONNX Runtime on CUDA (both settings) vs PyTorch on CUDA, batch 1 and
   batch 32 (the cases of ``scripts/bench_inference.py``).
3. The Transformer trained for ``--steps`` steps with bf16 autocast through ``accelerate launch``:
   tokens/s and model FLOPs utilisation, MFU = 6 · parameters · (source + target tokens)/s over the
   device's dense bf16 peak (an upper estimate of the work: each parameter sees one side only). The
   tokens are those of the batches the steps took (the recipe's ``max_tokens`` batches or its
   ``batch_size``); the rate is the steady state, read from the MLflow timestamps of the logged
   training steps (start-up, first-step kernel selection and the final validation excluded); the
   whole run's rate is kept too. ``--recount`` counts a written report's tokens again.

A checkout holds trained models only for what its DVC cache holds (the cache does not travel, and
training every entry takes hours of CPU). ``--seeded`` adds every other ``params.yaml`` entry, built
from its configuration with weights drawn at a fixed seed and exported by the export stage's own
function: its rows check that architecture's graphs on the device (every op placed and run, fp32 and
TF32 numerics at initial-weight scale, the loop's tokens against PyTorch's), not a published
model's weights, and say so (``weights: seeded``). A seeded row never replaces a published one in a
device's report.

``--device cpu`` runs the same checks on the CPU (CPU execution provider, fp32 training): a rehearsal
of the code path on a machine without a GPU, not a GPU figure.
Writes ``docs/gpu_check/<device>.json`` with ``--write`` (one file per device, so a run on another GPU
keeps the last one's figures; a run for other models on the same device adds its rows); prints a
Markdown summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cli_errors

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


def report_path(root: Path, device_name: str) -> Path:
    """Where ``--write`` puts the report of a run on ``device_name``: 'NVIDIA H100 80GB HBM3' ->
    docs/gpu_check/nvidia-h100-80gb-hbm3.json."""
    slug = "-".join("".join(c if c.isalnum() else " " for c in device_name.lower()).split())
    return root / "docs" / "gpu_check" / f"{slug or 'device'}.json"


def merged(old: dict | None, new: dict) -> dict:
    """``new`` added to an earlier report of the same device: a checkout seldom holds every model (its
    DVC cache holds what it trained), so runs for other models add their rows; a model's rows and the
    training are replaced only by a run that measured them."""
    if not old or old.get("device") != new["device"]:
        return new
    # Reports made before --seeded existed hold trained models only.
    old_weights = old.get("weights") or dict.fromkeys(old["models"], "published")
    new_weights = new.get("weights") or dict.fromkeys(new["models"], "published")
    # A run that had only seeded weights for a model keeps that model's published rows.
    fresh = {m for m in new["models"] if not (new_weights[m] == "seeded" and old_weights.get(m) == "published")}
    out = {**old, "onnxruntime": new["onnxruntime"], "torch": new["torch"]}
    out["models"] = list(dict.fromkeys(old["models"] + new["models"]))
    out["weights"] = {**old_weights, **{m: new_weights[m] for m in fresh}}
    out["parity"] = {s: {**old["parity"].get(s, {}), **{m: r for m, r in rows.items() if m in fresh}}
                     for s, rows in new["parity"].items()}
    out["timing"] = {**old["timing"], **{m: r for m, r in new["timing"].items() if m in fresh}}
    # Graphs exported where they were packed (--with-graphs) name that torch; a re-measured model's entry
    # is the new run's.
    exported_by = {m: v for m, v in old.get("exported_by", {}).items() if m not in fresh}
    exported_by.update({m: v for m, v in new.get("exported_by", {}).items() if m in fresh})
    out.pop("exported_by", None)
    if exported_by:
        out["exported_by"] = exported_by
    if new.get("train") is not None:
        out["train"] = new["train"]
    return out


def entries(root: Path) -> list[str]:
    from pipeline.config import load_params

    return list(load_params(root)["models"])


def trained_models(root: Path) -> list[str]:
    from bench_inference import latest_graphs

    return [n for n in entries(root) if (root / "runs" / n / "checkpoint" / "best").is_dir() and latest_graphs(n, root)]


SEED = 0  # the seeded models' weights: the same graphs on every machine


def entry_cases(name: str, root: Path) -> dict:
    """What the check needs of entry ``name`` besides code, graphs and weights: its architecture and
    resolved model configuration (the prepared data's vocabulary sizes included), its parity
    tolerances and its task's parity cases (test items over a grid of batch sizes and lengths)."""
    from pipeline.config import resolve
    from pipeline.tasks import get_task

    run = resolve(name, root=root)
    spec = {"arch": run.arch, "model": run.model, "parity": run.parity}
    spec["cases"] = get_task(run.task).model_parity_batches(build(spec), run.data_dir)
    return spec


def pack(names: list[str], root: Path, out: Path, graphs: bool = False, jobs: int = 1) -> None:
    """``--pack``: :func:`entry_cases` of each of ``names`` into ``out/<name>.pt``, for ``--cases`` on a
    machine that has the code but not the prepared data (1.4 GB, some of it made from Debian
    packages a GPU machine may lack). With ``graphs``, also each entry's seeded graphs into
    ``out/<name>/`` (:func:`export_seeded`), exported by this checkout's torch: an older torch on the GPU
    machine may not export them (torch 2.11 refuses the recurrent encoders' dynamic lengths)."""
    import torch
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    specs = {}
    for name in tqdm(names, desc="packing cases", unit="model", disable=None):
        specs[name] = entry_cases(name, root)
        torch.save(specs[name], out / f"{name}.pt")
    if graphs:
        export_seeded(specs, out, jobs)
        for name in names:
            (out / name / PACKED_EXPORT).write_text(json.dumps({"torch": torch.__version__}) + "\n")


PACKED_EXPORT = "exported_by.json"  # beside graphs --pack --with-graphs exported: the torch that made them


def packed_graphs(cases: Path | None, names: list[str]) -> dict[str, str]:
    """{name: torch version} of the entries whose seeded graphs a ``--pack --with-graphs`` folder holds."""
    if cases is None:
        return {}
    return {n: json.loads((cases / n / PACKED_EXPORT).read_text())["torch"]
            for n in names if (cases / n / PACKED_EXPORT).is_file()}


def load_cases(path: Path) -> dict:
    """One entry's packed cases (``--pack``): tensors and plain values only. ``torch.load`` with
    ``weights_only`` refuses anything else, so a planted pickle in ``--cases`` never runs code."""
    import pickle

    import torch

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0]
        raise cli_errors.ScriptError(f"{path} holds more than tensors and plain values ({first}); pack the cases "
                                     "again with --pack on a machine you trust") from None


def build(spec: dict):
    """The model of ``spec`` (see :func:`entry_cases`) with weights drawn at :data:`SEED`, in eval mode."""
    import torch

    import models

    torch.manual_seed(SEED)
    return models.build(spec["arch"], spec["model"]).eval()


def published(name: str, root: Path):
    """(model, graph folder) of a model trained here: ``runs/<name>/checkpoint/best`` and the graphs a
    server answers with (``bench_inference.latest_graphs``)."""
    from bench_inference import latest_graphs

    from pipeline.checkpoint import load_model

    model, _ = load_model(root / "runs" / name / "checkpoint" / "best")  # as trained_models finds it
    return model, latest_graphs(name, root)


def _export_seeded(spec: dict, out: Path) -> float:
    """Export :func:`build` of ``spec`` into ``out`` with the export stage's own
    ``pipeline.stages.export.export_onnx`` (the graphs the pipeline would publish for that architecture);
    returns the seconds it took."""
    import torch

    from pipeline.rnn_export import clear_rnn_dispatch
    from pipeline.stages.export import export_onnx

    torch.set_num_threads(1)  # one core per export: the pool runs one per core
    clear_rnn_dispatch()  # a pool process exports several models
    start = time.perf_counter()
    export_onnx(build(spec), out)
    return time.perf_counter() - start


def export_seeded(specs: dict[str, dict], out: Path, jobs: int) -> None:
    """:func:`_export_seeded` each of ``specs`` ({name: :func:`entry_cases`}) into ``out/<name>``.
    Exporting is mostly single-threaded Python (torch.onnx's tracing and rewriting: 3-85 s a model on
    the 2-core development machine), so ``jobs`` processes export at once; each builds the model at
    the same seed, and the parity check that follows compares the graphs against this process's
    copy (:func:`build`), so weights that differed would fail it."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from tqdm import tqdm

    if not specs:
        return
    # The pool is given the configurations only: the cases stay in this process.
    bare = {n: {k: v for k, v in spec.items() if k != "cases"} for n, spec in specs.items()}
    with ProcessPoolExecutor(max(1, min(jobs, len(specs))), mp_context=multiprocessing.get_context("spawn")) as pool:
        todo = {pool.submit(_export_seeded, spec, out / n): n for n, spec in bare.items()}
        for done in tqdm(as_completed(todo), total=len(todo), desc="seeded exports", unit="model", disable=None):
            print(f"exported {todo[done]} (seeded) in {done.result():.1f} s", file=sys.stderr, flush=True)


# The CUDA EP options per setting checked; None: the server's own (serving.runtime.CUDA_OPTIONS, fp32).
CUDA_SETTINGS = {"fp32": None, "tf32": {"use_tf32": "1"}}


@contextlib.contextmanager
def cuda_options(options: dict | None):
    """Every session ``serving.runtime`` opens in this block asks for the CUDA EP with ``options``
    instead of the server's own. ``providers()`` is the one place the list is made, so it is wrapped,
    not copied."""
    import serving.runtime as rt

    plain = rt.providers

    def name(p):
        return p[0] if isinstance(p, tuple) else p

    if options is not None:
        rt.providers = lambda requested="auto": [(name(p), options) if name(p) == "CUDAExecutionProvider" else p
                                                 for p in plain(requested)]
    try:
        yield
    finally:
        rt.providers = plain


def summarise(rep: dict) -> dict:
    """A parity report folded to a row: passed, the largest graph-output error, and whether the
    end-to-end comparisons (tokens, decisions, values) all passed."""
    graph_errors = [r.get("max_abs", 0.0) for case in rep["cases"] for g in case["graphs"].values()
                    for r in g["outputs"].values()]
    return {"provider": rep["provider"], "passed": rep["passed"], "cases": len(rep["cases"]),
            "max_abs": max(graph_errors, default=0.0),
            "e2e_passed": all(r["passed"] for case in rep["cases"] for r in case["e2e"].values())}


def parity(subjects: dict, specs: dict, provider: str, settings: dict) -> dict[str, dict[str, dict]]:
    """The export gate on ``provider`` for each of ``subjects`` ({name: (model, graph folder)}), on
    the cases and tolerances of its ``specs`` entry (:func:`entry_cases`), under each of
    ``settings`` (CUDA EP options): {setting: {model: row}} (see :func:`summarise`)."""
    from pipeline.stages.export import parity_check

    out: dict[str, dict[str, dict]] = {setting: {} for setting in settings}
    for name, (model, graphs) in subjects.items():
        for setting, options in settings.items():
            start = time.perf_counter()
            try:
                with cuda_options(options):
                    row = summarise(parity_check(model, graphs, specs[name]["cases"], specs[name]["parity"], provider))
            except Exception as err:  # noqa: BLE001 -- one model's failure is a row, not the end of the check
                row = {"provider": provider, "passed": False, "error": f"{type(err).__name__}: {err}"[:300]}
            out[setting][name] = row
            print(f"parity {name} ({setting}, {time.perf_counter() - start:.1f} s): {row}", file=sys.stderr, flush=True)
    return out


def timing(subjects: dict, specs: dict, device: str, repeats: int, settings: dict) -> dict[str, dict]:
    """Whole-loop ms (median of ``repeats``) of each of ``subjects`` ({name: (model, graph folder)}),
    ORT on ``device``'s provider under each of ``settings`` (CUDA EP options) vs PyTorch on ``device``,
    on the batches ``scripts/bench_inference.py`` makes of its ``specs`` entry's cases."""
    from functools import partial

    import torch
    from bench_inference import loop_inputs, median_ms

    from pipeline.graphs import run_loop
    from serving.runtime import OrtGraph

    out = {}
    for name, (model, graph_dir) in subjects.items():
        began = time.perf_counter()
        graphs, meta, groups = loop_inputs(model, specs[name]["cases"])
        graph_sets = {}
        for setting, options in settings.items():
            with cuda_options(options):
                graph_sets[setting] = {g: OrtGraph(graph_dir / f"{g}.onnx", provider=device) for g in graphs}
        model = model.to(device)
        row = {}
        for size, group in groups.items():
            on_device = [{k: v.to(device) for k, v in b.items()} for b in group]
            np_group = [{k: v.numpy() for k, v in b.items()} for b in group]

            def torch_loop(batches=on_device, model=model):
                with torch.no_grad():
                    outs = [model.predict(b) for b in batches]
                if device == "cuda":
                    torch.cuda.synchronize()
                return outs

            def ort_loop(graphs, batches=np_group, meta=meta):
                return [run_loop(graphs, b, meta) for b in batches]

            loops = {"pytorch": torch_loop}
            for setting, graphs in graph_sets.items():
                loops[f"onnxruntime_{setting}"] = partial(ort_loop, graphs)
            times: dict[str, list[float]] = {k: [] for k in loops}
            for fn in loops.values():
                fn()  # warm-up: kernels, allocator, cuDNN autotuning
            for _ in range(repeats):
                for key, fn in loops.items():
                    start = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - start)
            row[size] = {k: median_ms(v) for k, v in times.items()}
        first = next(iter(graph_sets.values()))
        out[name] = {"provider": first[next(iter(graphs))].provider, **row}
        print(f"timing {name} ({time.perf_counter() - began:.1f} s): {out[name]}", file=sys.stderr, flush=True)
    return out


def logged_steps(tracking_uri: str) -> tuple[int, int, float] | None:
    """(first step, last step, seconds between them) of the ``train_loss`` logged by the one training run
    in ``tracking_uri``: the steady state, without start-up and the final validation."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = sorted(client.get_metric_history(runs[0].info.run_id, "train_loss"), key=lambda m: m.step)
    if len(history) < 2:
        return None
    return history[0].step, history[-1].step, (history[-1].timestamp - history[0].timestamp) / 1000


def step_tokens(run, items: list[dict], steps: int) -> list[int]:
    """The tokens (source + target + end of sentence) of each of the first ``steps`` global batches the
    training loop takes, cut as it cuts them (``pipeline.training.batches``: by items, or by ``max_tokens``
    padded tokens), epoch after epoch."""
    from pipeline.tasks import get_task
    from pipeline.training.batches import epoch_batches

    task = get_task(run.task)
    lengths = [task.length(it) for it in items]
    sizes = [len(it["src"]) + len(it["tgt"]) + 1 for it in items]
    out: list[int] = []
    epoch = 0
    while len(out) < steps:
        out += [sum(sizes[i] for i in batch) for batch in epoch_batches(run.train, lengths, epoch)]
        epoch += 1
    return out[:steps]


def train_transformer(root: Path, device: str, steps: int, peak: float | None) -> dict:
    """``accelerate launch`` one process, bf16 autocast on CUDA: tokens/s and MFU of the Transformer."""
    import torch

    from pipeline.config import resolve
    from pipeline.tasks import get_task

    run = resolve("transformer", root=root)  # main() checked that its data is prepared
    out_dir = Path(tempfile.mkdtemp(prefix="gpu_check_transformer_"))
    precision = "bf16" if device == "cuda" else "no"  # accelerate's names; "no" is fp32
    log_every = max(1, steps // 10)  # ten logged steps: the steady-state window
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", precision, "--dynamo_backend", "no", *([] if device == "cuda" else ["--cpu"]),
           "-m", "pipeline.stages.train", "transformer", "--out", str(out_dir),
           "--set", f"max_steps={steps}", f"eval_every={steps}", f"log_every={log_every}", "epochs=1000"]
    print(" ".join(cmd), file=sys.stderr, flush=True)
    # The checkout first, then whatever PYTHONPATH already holds (packages carried to the machine).
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    # A store of its own: the check's run stays out of the project's MLflow, and is the only run there.
    tracking_uri = f"sqlite:///{out_dir / 'mlflow.db'}"
    subprocess.run(cmd, cwd=root, check=True,
                   env={**os.environ, "PYTHONPATH": path, "MLFLOW_TRACKING_URI": tracking_uri})
    summary = json.loads((out_dir / "train_summary.json").read_text())
    from pipeline.checkpoint import load_model

    model, _ = load_model(out_dir / "checkpoint" / "last")
    steady = logged_steps(tracking_uri)
    row = {"steps": summary["steps"], "seconds": summary["train_seconds"],
           "precision": {"no": "fp32"}.get(precision, precision), "params": sum(p.numel() for p in model.parameters()),
           **batching(run), "steady_window": ({"from_step": steady[0], "steps": steady[1] - steady[0],
                                               "seconds": steady[2]} if steady else None),
           "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}
    return {**row, **rates(row, step_tokens(run, get_task(run.task).load(run.data_dir, "train"), row["steps"]), peak)}


def recount(path: Path, root: Path) -> dict:
    """The report at ``path`` with its Transformer row's tokens counted from the batches its steps took in
    this checkout's prepared data (``step_tokens``), its measured steps and seconds kept: for a row of this
    checkout's recipe only (another configuration stops with one line)."""
    import models
    from pipeline.config import resolve
    from pipeline.tasks import get_task

    report = json.loads(path.read_text())
    tr, run = dict(report["train"] or {}), resolve("transformer", root=root)
    params = sum(p.numel() for p in models.build(run.arch, run.model).parameters())
    if tr.get("params") != params:
        raise cli_errors.ScriptError(f"{path} holds no training row of this checkout's Transformer ({params:,} "
                                     f"parameters); recount it in a checkout of the recipe it ran")
    window = tr["steady_window"]
    if window and "from_step" not in window:  # a report without the window's start: the first of ten logged steps
        tr["steady_window"] = {"from_step": max(1, tr["steps"] // 10), **window}
    for key in ("batch_size", "max_tokens"):
        tr.pop(key, None)
    tokens = step_tokens(run, get_task(run.task).load(run.data_dir, "train"), tr["steps"])
    report["train"] = {**tr, **batching(run), **rates(tr, tokens, peak_flops(report["device"], None))}
    return report


def batching(run) -> dict:
    """How the run cut its training batches: ``{"max_tokens": N}`` (padded tokens) or ``{"batch_size": N}``."""
    return {"max_tokens": run.train.max_tokens} if run.train.max_tokens else {"batch_size": run.train.batch_size}


def rates(row: dict, tokens: list[int], peak: float | None) -> dict:
    """tokens/s in the steady window (the steps after its first logged one up to its last) and over the
    whole run, from each step's tokens; MFU where the device's peak is known."""
    whole = sum(tokens) / row["seconds"]
    window = row["steady_window"]
    rate = (sum(tokens[window["from_step"]:window["from_step"] + window["steps"]]) / window["seconds"]
            if window and window["seconds"] > 0 else whole)
    return {"tokens_per_s": round(rate), "tokens_per_s_whole_run": round(whole),
            **({"mfu": round(6 * row["params"] * rate / peak, 5)} if peak else {})}


def recount_report(path: Path) -> None:
    """``--recount REPORT``: :func:`recount`, written back, its training line printed."""
    from pipeline.config import UserError

    if not path.is_file():
        raise cli_errors.ScriptError(f"--recount {path}: no such report (docs/gpu_check/*.json are)")
    try:
        report = recount(path, ROOT)
    except UserError as err:
        raise cli_errors.ScriptError(f"--recount needs the Transformer's prepared data here ({err})") from None
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(train_line(report["train"]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=300, help="Transformer training steps (0: no training)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, if not known")
    ap.add_argument("--write", action="store_true", help="write docs/gpu_check/<device>.json")
    ap.add_argument("--models", nargs="+", metavar="MODEL", help="these params.yaml entries only (default: all)")
    ap.add_argument("--seeded", action="store_true",
                    help="also check entries not trained in this checkout, with seeded weights (see above)")
    ap.add_argument("--pack", type=Path, metavar="DIR",
                    help="write each entry's configuration and parity cases into DIR (no device needed) and stop")
    ap.add_argument("--with-graphs", action="store_true",
                    help="with --pack: also export each entry's seeded graphs there, for a GPU machine whose torch "
                         "cannot export them")
    ap.add_argument("--cases", type=Path, metavar="DIR",
                    help="read configurations and parity cases from a --pack DIR instead of data/prepared")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="seeded exports at once (default: one a core)")
    ap.add_argument("--recount", type=Path, metavar="REPORT",
                    help="count the tokens of REPORT's Transformer row (docs/gpu_check/<device>.json) again from the "
                         "batches its steps took in this checkout's prepared data, keep its measured steps and "
                         "seconds, rewrite it and stop")
    args = ap.parse_args(argv)
    if args.recount:
        return recount_report(args.recount)
    import onnxruntime as ort
    import torch

    asked = cli_errors.entries(args.models or entries(ROOT))  # default: every params.yaml entry
    if args.pack:  # no device needed: the cases of every asked-for entry, for --cases elsewhere
        pack(asked, ROOT, args.pack, graphs=args.with_graphs, jobs=args.jobs)
        print(f"gpu_check: packed the cases of {len(asked)} entries into {args.pack}")
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to PyTorch here; nothing to check")
        return
    if args.steps > 0:  # before the parity and timing minutes, whose figures a late failure would lose
        from pipeline.config import UserError, resolve

        try:
            resolve("transformer", root=ROOT)
        except UserError as err:
            raise cli_errors.ScriptError(f"the Transformer training (--steps) needs its data ({err}), "
                                         f"or pass --steps 0") from None
    trained = trained_models(ROOT)
    names = [m for m in asked if m in trained or args.seeded]
    if not names:
        raise cli_errors.ScriptError("no model asked for is trained and published in this checkout; "
                                     "--seeded checks the entries with seeded weights")
    if args.cases:
        if missing := [m for m in names if not (args.cases / f"{m}.pt").exists()]:
            raise cli_errors.ScriptError(f"{args.cases} has no cases for {', '.join(missing)}; pack them with "
                                         f"`python scripts/gpu_check.py --pack {args.cases}` where the data is")
    weights = {m: "published" if m in trained else "seeded" for m in names}
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    report = {"device": name, "onnxruntime": ort.__version__, "torch": torch.__version__, "models": names,
              "weights": weights}
    settings = CUDA_SETTINGS if args.device == "cuda" else {"fp32": None}
    specs = {m: load_cases(args.cases / f"{m}.pt") if args.cases else entry_cases(m, ROOT) for m in names}
    with tempfile.TemporaryDirectory(prefix="gpu_check_seeded_") as tmp:
        subjects = {m: published(m, ROOT) for m in names if weights[m] == "published"}
        seeded_ones = [m for m in names if weights[m] == "seeded"]
        exported = packed_graphs(args.cases, seeded_ones)  # graphs --pack --with-graphs exported: not again
        if exported:
            report["exported_by"] = {m: f"torch {v}" for m, v in exported.items()}
        export_seeded({m: specs[m] for m in seeded_ones if m not in exported}, Path(tmp), args.jobs)
        subjects.update({m: (build(specs[m]), args.cases / m if m in exported else Path(tmp) / m) for m in seeded_ones})
        subjects = {m: subjects[m] for m in names}  # the report's order: params.yaml's
        report["parity"] = parity(subjects, specs, args.device, settings)
        if "TensorrtExecutionProvider" in ort.get_available_providers() and args.device == "cuda":
            report["tensorrt"] = "TensorRT EP present: not checked (serving.runtime asks for CUDA or CPU)"
        report["timing"] = timing(subjects, specs, args.device, args.repeats, settings)
    # --steps 0: parity and timing only (a second run for more models need not train again)
    report["train"] = (train_transformer(ROOT, args.device, args.steps, peak_flops(name, args.peak_tflops))
                       if args.steps > 0 else None)
    print("\n".join(summary_lines(report, list(settings))))
    if args.write:
        path = report_path(ROOT, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        earlier = json.loads(path.read_text()) if path.exists() else None
        path.write_text(json.dumps(merged(earlier, report), indent=1) + "\n")
        print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    # The gate is the fp32 one (its tolerances are fp32's, and the server runs fp32); the TF32 rows
    # show what onnxruntime's own default would answer, reported beside it.
    if not all(report["parity"]["fp32"][m]["passed"] for m in names):
        raise SystemExit(1)


def summary_lines(report: dict, settings: list[str]) -> list[str]:
    """The Markdown summary: parity per setting, whole-loop times, the training rate."""
    lines = [f"# gpu_check on {report['device']} (onnxruntime {report['onnxruntime']}, torch {report['torch']})", "",
             "| model | " + " | ".join(f"parity {s}: passed, largest graph error, end to end" for s in settings) + " |",
             "|---|" + "---|" * len(settings)]
    seeded_ones = {m for m, w in report.get("weights", {}).items() if w == "seeded"}

    def label(model: str) -> str:
        return f"{model} (seeded weights)" if model in seeded_ones else model

    for model in report["models"]:
        cells = []
        for s in settings:
            r = report["parity"][s][model]
            cells.append(r["error"] if "error" in r else
                         f"{'passed' if r['passed'] else 'FAILED'}, {r['max_abs']:.1e}, "
                         f"{'same' if r['e2e_passed'] else 'differs'}")
        lines.append(f"| {label(model)} | " + " | ".join(cells) + " |")
    head = " | ".join(f"batch {b}: PyTorch ms | " + " | ".join(f"ORT {s} ms | ×" for s in settings) for b in (1, 32))
    lines += ["", f"| model | {head} |", "|---|" + "---|" * (2 * (1 + 2 * len(settings)))]
    for model in report["models"]:
        t = report["timing"][model]
        cells = []
        for b in (1, 32):
            torch_ms = t[b]["pytorch"]
            cells.append(f"{torch_ms:.2f} | " + " | ".join(
                f"{t[b][f'onnxruntime_{s}']:.2f} | {torch_ms / t[b][f'onnxruntime_{s}']:.2f}" for s in settings))
        lines.append(f"| {label(model)} | " + " | ".join(cells) + " |")
    return [*lines, "", train_line(report["train"])]


def train_line(tr: dict | None) -> str:
    """The summary's training rate."""
    if tr is None:
        return "Transformer training: not run (--steps 0)"
    batch = (f"batches of ≤ {tr['max_tokens']:,} padded tokens a side" if "max_tokens" in tr
             else f"batch {tr['batch_size']}")
    return (f"Transformer ({tr['params']:,} parameters), {tr['steps']} steps, {tr['precision']}, {batch}: "
            f"{tr['tokens_per_s']:,} tokens/s in the steady state "
            f"({tr['tokens_per_s_whole_run']:,} over the whole run of {tr['seconds']} s)"
            + (f", MFU {tr['mfu']:.2%}" if "mfu" in tr else ", MFU: peak unknown"))


if __name__ == "__main__":
    cli_errors.run(main)
