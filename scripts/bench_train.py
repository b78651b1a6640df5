"""Training-loop benchmarks for docs/benchmarks.md, measured side by side in one run.

1. ``overhead``: the shared loop (``pipeline.training.loop.train``: Accelerate, bucketing, MLflow
   logging, checkpoints) against a plain PyTorch loop doing the same optimizer steps on the same
   model, batches and schedule. Goal: the shared loop costs ≤ 5 % more wall time.
2. ``scaling``: samples/s of the shared loop at the same *global* batch with 1 process × 1 thread,
   1 process × 2 threads and 2 processes × 1 thread (torchrun, gloo, loopback). Goal: 2 × 1
   reaches ≥ 1.7 × the 1 × 1 figure.

Every configuration runs twice per repeat, with ``--steps`` and with 3 × ``--steps`` optimizer
steps; the difference over 2 × ``--steps`` steps is the time of a training step, free of fixed costs
(importing MLflow and Accelerate, forming the process group, creating the MLflow run, the final
validation and checkpoint), which a real training amortises over hours. The whole-run times are
printed too. Each figure is the median of ``--repeats`` repeats, the configurations taken in turn
(A B C A B C …) so that drift of a shared machine's speed hits them alike. The model is a real
entry of params.yaml with its own sizes; only the data is a smaller prepared split (written once
under ``--work``).

    python scripts/bench_train.py --model sat_soft --steps 15 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import cli_errors
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CEILING = "2 independent processes x 1 thread, half the batch each, no communication"
SPLIT = {"train_size": 4000, "val_size": 64, "test_size": 8}  # enough batches for --steps at batch 64


def make_root(work: Path, model: str) -> Path:
    """A params.yaml with the one entry (its own sizes) and its task's data, prepared once."""
    from pipeline.config import load_params
    from pipeline.stages.prepare import prepare

    params = load_params(ROOT)
    entry = dict(params["models"][model])
    task = entry["task"]
    data = work / "data" / "prepared" / task
    if not (data / "manifest.json").exists():
        task_params = {**params["tasks"][task], **{k: v for k, v in SPLIT.items() if k in params["tasks"][task]}}
        prepare(task, task_params, data)
    entry["train"] = {**entry.get("train", {}), "log_every": 10}
    (work / "params.yaml").write_text(yaml.safe_dump({"train": params["train"], "models": {model: entry}}))
    return work


def budget(steps: int) -> dict:
    out = {"max_steps": steps, "eval_every": steps}  # one validation, at the end
    if os.environ.get("BENCH_BATCH"):
        out["batch_size"] = int(os.environ["BENCH_BATCH"])  # the global batch (--batch)
    return out


def plain_loop(root: Path, model_name: str, steps: int) -> float:
    """The same optimizer steps with nothing but PyTorch: returns wall seconds."""
    import math

    import torch
    from torch.utils.data import DataLoader

    import models
    from pipeline.config import resolve
    from pipeline.tasks import get_task
    from pipeline.training.batches import bucket_batches
    from pipeline.training.loop import lr_lambda

    run = resolve(model_name, root=root, use_tuned=False, overrides=budget(steps))
    cfg = run.train
    torch.manual_seed(cfg.seed)
    started = time.perf_counter()  # like train(): loading the data, building the model, the steps
    task = get_task(run.task)
    items = task.load(run.data_dir, "train")
    lengths = [task.length(it) for it in items]
    model = models.build(run.arch, run.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, cfg.max_steps))
    step, epoch = 0, 0
    while step < cfg.max_steps:
        loader = DataLoader(items, batch_sampler=bucket_batches(lengths, cfg.batch_size, cfg.seed + epoch, True),
                            collate_fn=task.collate)
        for batch in loader:
            loss, _ = model.loss(batch)
            if not math.isfinite(loss.item()):
                raise FloatingPointError("non-finite loss")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            if step >= cfg.max_steps:
                break
        epoch += 1
    return time.perf_counter() - started


def shared_loop(root: Path, model_name: str, out: Path, steps: int) -> float:
    from pipeline.config import resolve
    from pipeline.training.loop import train

    run = resolve(model_name, root=root, use_tuned=False, overrides=budget(steps))
    started = time.perf_counter()
    train(run, out, progress=False)
    return time.perf_counter() - started


def child(args) -> None:
    """One measured run in a fresh process (so no run inherits another's warm caches)."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    db = os.environ.get("BENCH_DB", "mlflow.db")  # runs at once ("apart") each get their own store
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{args.work / db}"
    out = args.work / f"out-{os.getpid()}"
    if args.mode == "plain":
        seconds = plain_loop(args.work, args.model, args.steps)
    else:
        seconds = shared_loop(args.work, args.model, out, args.steps)
    if int(os.environ.get("RANK", "0")) == 0:
        summary = json.loads((out / "train_summary.json").read_text()) if args.mode == "shared" else {}
        print(json.dumps({"seconds": seconds, "loop_seconds": summary.get("train_seconds"),
                          "processes": summary.get("processes", 1)}))


def measure(work: Path, model: str, mode: str, processes: int, threads: int, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    me = [str(Path(__file__).resolve()), "--child", mode, "--model", model, "--work", str(work), "--steps", str(steps)]
    if mode == "apart":  # `processes` plain 1-process runs at once, each on its share of the batch
        from pipeline.config import resolve

        batch = resolve(model, root=work, use_tuned=False, overrides=budget(1)).train.batch_size
        env["BENCH_BATCH"] = str(batch // processes)
        me[me.index("apart")] = "shared"
        procs = [subprocess.Popen([sys.executable, *me], env={**env, "BENCH_DB": f"mlflow-{i}.db"},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(processes)]
        outs = [p.communicate(timeout=1800) for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"benchmark run failed: {outs}")
        runs = [json.loads([line for line in o.splitlines() if line.startswith("{")][-1]) for o, _ in outs]
        return {"seconds": max(r["seconds"] for r in runs)}
    if processes == 1:
        cmd = [sys.executable, *me]
    else:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(processes),
               "--master_addr", "127.0.0.1", "--master_port", str(port), *me]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark run failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="sat_soft", help="a params.yaml entry (default sat_soft)")
    ap.add_argument("--steps", type=int, default=15, help="optimizer steps of the short run (the long one: 3x)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/attnzoo-bench-train"))
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: the entry's batch_size)")
    ap.add_argument("--only", choices=["overhead", "scaling"], default=None)
    ap.add_argument("--child", dest="mode", choices=["plain", "shared"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        return child(args)
    cli_errors.entries([args.model])
    if args.batch:
        os.environ["BENCH_BATCH"] = str(args.batch)  # children inherit it
    args.work.mkdir(parents=True, exist_ok=True)
    make_root(args.work, args.model)
    from pipeline.config import resolve

    batch = resolve(args.model, root=args.work, use_tuned=False, overrides=budget(1)).train.batch_size
    configs = [("shared loop, 1 process x 1 thread", "shared", 1, 1)]
    if args.only in (None, "overhead"):
        configs.insert(0, ("plain loop, 1 process x 1 thread", "plain", 1, 1))
    if args.only in (None, "scaling"):
        configs += [("shared loop, 1 process x 2 threads", "shared", 1, 2),
                    ("shared loop, 2 processes x 1 thread", "shared", 2, 1),
                    # The machine's own ceiling: the same two half-batch processes with nothing
                    # shared (no all-reduce, no process group), run at once.
                    (CEILING, "apart", 2, 1)]
    short, long = args.steps, 3 * args.steps
    step_s: dict[str, list[float]] = {c[0]: [] for c in configs}
    whole: dict[str, list[float]] = {c[0]: [] for c in configs}
    for r in range(args.repeats):
        for label, mode, processes, threads in configs:
            a = measure(args.work, args.model, mode, processes, threads, short)["seconds"]
            b = measure(args.work, args.model, mode, processes, threads, long)["seconds"]
            step_s[label].append((b - a) / (long - short))
            whole[label].append(b)
            print(f"repeat {r + 1}/{args.repeats}  {label}: {short} steps {a:.1f} s, {long} steps {b:.1f} s, "
                  f"{1000 * step_s[label][-1]:.0f} ms a step", flush=True)
    med = {k: statistics.median(v) for k, v in step_s.items()}
    print(f"\nmodel {args.model} ({args.model} params.yaml sizes), global batch {batch}, median of {args.repeats} "
          f"repeats; a step = (time of {long} steps - time of {short} steps) / {long - short}")
    print(f"| configuration | ms a step (min / median / max) | samples/s | whole {long}-step run, s (median) |")
    print("|---|---|---|---|")
    for label, values in step_s.items():
        print(f"| {label} | {1000 * min(values):.0f} / {1000 * med[label]:.0f} / {1000 * max(values):.0f} | "
              f"{batch / med[label]:.1f} | {statistics.median(whole[label]):.1f} |")
    one = med["shared loop, 1 process x 1 thread"]
    if "plain loop, 1 process x 1 thread" in med:
        print(f"\nshared loop / plain loop, time a step: {one / med['plain loop, 1 process x 1 thread']:.3f} "
              "(goal <= 1.05)")
    if "shared loop, 2 processes x 1 thread" in med:
        print(f"2 x 1 vs 1 x 1, samples/s: {one / med['shared loop, 2 processes x 1 thread']:.2f}x (goal >= 1.7x); "
              f"1 x 2 vs 1 x 1: {one / med['shared loop, 1 process x 2 threads']:.2f}x; "
              f"ceiling (2 independent half-batch processes) vs 1 x 1: {one / med[CEILING]:.2f}x")


if __name__ == "__main__":
    cli_errors.run(main)
