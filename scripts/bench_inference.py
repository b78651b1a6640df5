"""Inference benchmark (not a test): ONNX Runtime fp32, ONNX Runtime int8 and PyTorch eager, per graph
and for the whole inference loop, at batch 1 and batch 32, for every model trained in this checkout.

    python scripts/bench_inference.py                          # every entry with a checkpoint
    python scripts/bench_inference.py bahdanau ntm --repeats 9 --threads 1 2
    python scripts/bench_inference.py --write-docs             # also replace docs/bench_inference.json and its table
    python scripts/bench_inference.py --render-docs            # that table again from docs/bench_inference.json
    python scripts/bench_inference.py --check-docs             # exit 1 if the table differs from that render

Inputs: a model's graphs come from the version a server answers by default (``model_repository/<name>/<v>/``,
``serving.repository.default_version``), else ``runs/<name>/onnx``, PyTorch from ``runs/<name>/checkpoint/best``, the
batches from the task's parity cases on the prepared test data: *batch 1* sums the batch-1 cases, *batch 32* is the
largest case repeated to 32 rows. The int8 graphs are remade here into a temporary folder with the
recipe of ``quantize@<model>`` (``pipeline.stages.quantize.quantize_graphs``: onnxruntime's dynamic
quantisation, int8 weights, the op types of ``params.yaml`` ``quantize``), whose quality gate is in
``runs/<name>/int8_metrics.json``; ``int8 same`` is the share of rows whose tokens (or argmax) equal
the fp32 graphs'. Each model is measured in a process of its own; each repeat times eager, fp32 and
int8 in turn, each after 30 ms of its own untimed calls (the machine is noisy: compare within one
row); the figure is the median of the repeats, in ms. At t threads PyTorch runs with t intra-op threads;
ONNX Runtime as the server does: a single graph with t intra-op threads, a looping model's graphs with
one each and a batch's rows split over t loops at once (``serving.decode.split_rows``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import cli_errors
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DOCS = ROOT / "docs" / "benchmarks.md"
JSON_OUT = ROOT / "docs" / "bench_inference.json"
START, END = "<!-- bench_inference: start -->", "<!-- bench_inference: end -->"


def machine() -> str:
    """The CPU's model name, cores and widest vector unit: two "AMD EPYC" VMs differ by the last."""
    name, isa = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not isa:
                flags = set(line.split(":", 1)[1].split())
                isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores" + (f", {isa}" if isa else "")


def latest_graphs(name: str, root: Path) -> Path | None:
    """The graphs a server would answer with: the model's default version (the server's own rule,
    ``serving.repository.default_version``), else the export stage's ``runs/<name>/onnx``."""
    from serving.client import LocalClient, LocalError
    from serving.repository import default_version

    local = LocalClient(root / "model_repository")
    try:
        metas = local._versions(name)  # each published version's metadata.json, as --local reads them
    except LocalError:  # nothing published under that name
        metas = {}
    chosen, _ = default_version(metas) if metas else (None, "")
    if chosen is not None:
        return local.root / name / str(chosen)
    onnx = root / "runs" / name / "onnx"
    return onnx if onnx.is_dir() else None


def tile(batch: dict, rows: int) -> dict:
    """``batch`` repeated along its first axis to exactly ``rows`` rows."""
    import torch

    size = next(iter(batch.values())).shape[0]
    reps = -(-rows // size)
    return {k: torch.cat([v] * reps)[:rows] for k, v in batch.items()}


def batch_groups(cases: list[tuple[str, dict]]) -> dict[int, list[dict]]:
    """{1: the parity cases of batch 1, 32: the largest case repeated to 32 rows}."""
    sized = [(int(next(iter(b.values())).shape[0]), b) for _, b in cases]
    return {1: [b for n, b in sized if n == 1], 32: [tile(max(sized, key=lambda x: x[0])[1], 32)]}


def decisions(out: dict) -> list[np.ndarray] | None:
    """What a user sees of a loop's result, per row: tokens (up to the row's length), else the
    argmax, else the sign of logits."""
    for key in ("tokens", "pred", "answer"):
        if key in out:
            rows = np.asarray(out[key]).reshape(len(out[key]), -1)
            if key == "tokens" and "lengths" in out:
                return [row[: int(n)] for row, n in zip(rows, out["lengths"])]
            return list(rows)
    if "logits" in out:
        logits = np.asarray(out["logits"])
        return list((logits > 0).reshape(len(logits), -1))
    return None  # no decision output (neural_programmer's scalar/lookup answer): compare values


def same_rows(a: dict, b: dict) -> float:
    """Share of rows whose decisions are identical (a differing length is a different row); for a
    model without a decision output, rows whose every output agrees to 1e-3."""
    if decisions(a) is None:
        keys = sorted(set(a) & set(b))
        rows = len(np.asarray(a[keys[0]]))
        return float(np.mean([all(np.allclose(np.asarray(a[k])[i], np.asarray(b[k])[i], atol=1e-3) for k in keys)
                              for i in range(rows)]))
    pairs = list(zip(decisions(a), decisions(b)))
    return float(np.mean([x.shape == y.shape and bool((x == y).all()) for x, y in pairs]))


def median_ms(samples: list[float]) -> float:
    return round(1000 * float(np.median(samples)), 3)


# Untimed calls of the engine about to be timed, for at least this long after switching to it: the
# previous engine's pool threads keep spinning for a while after its run (PyTorch's OpenMP workers,
# ONNX Runtime's pool), longer than one call of a small batch takes, and would be charged to this one.
SETTLE_S = 0.03


def timed(fns: dict, repeats: int) -> dict[str, float]:
    """Median ms of each callable over ``repeats`` rounds; each round calls every callable in turn,
    untimed for at least ``SETTLE_S`` and then once timed. A single untimed call was not enough: at 2
    threads PyTorch's workers, still spinning after its eager loop, slowed ``ram_cluttered``'s ONNX
    Runtime loop at batch 32 to 5.3-7.0 ms a call in four runs; after 30 ms of its own calls, 4.1-5.5
    ms in four runs alternated with those; 4.0-4.3 ms with PyTorch's workers never spinning
    (``OMP_WAIT_POLICY=PASSIVE``) or no eager loop run at all."""
    for fn in fns.values():
        fn()  # first-call allocations, lazy initialisation
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            settled = time.perf_counter() + SETTLE_S
            fn()
            while time.perf_counter() < settled:
                fn()
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return {k: median_ms(v) for k, v in times.items()}


def bench_batches(model, specs, meta, group: list, engines: dict, repeats: int, workers: int = 1) -> dict:
    """Whole loop and per graph, for one list of batches: eager (PyTorch's own ``predict``, as
    ``evaluate`` runs it; per graph the eager module) vs the serving loop over each ORT engine."""
    from functools import partial

    from pipeline.graphs import TorchGraph, run_loop

    np_group = [{k: v.numpy() for k, v in b.items()} for b in group]
    records = {g: [] for g in specs}  # the feeds each graph sees while the model decodes
    for b in np_group:
        run_loop({g: TorchGraph(s, records[g]) for g, s in specs.items()}, b, meta)

    def loop(graphs):
        return [run_loop(graphs, b, meta, workers) for b in np_group]

    def replay(graph, feeds):
        return [graph(f) for f in feeds]

    fns = {"eager": partial(lambda batches: [model.predict(b) for b in batches], group),
           **{k: partial(loop, graphs) for k, graphs in engines.items()}}
    eager = {g: TorchGraph(s) for g, s in specs.items()}
    for g in specs:
        fns[f"{g}/eager"] = partial(replay, eager[g], records[g])
        for k, graphs in engines.items():
            fns[f"{g}/{k}"] = partial(replay, graphs[g], records[g])
    ms = timed(fns, repeats)
    same = [same_rows(a, b) for a, b in zip(loop(engines["fp32"]), loop(engines["int8"]))]
    return {"loop_ms": {k: ms[k] for k in ("eager", *engines)},
            "graphs": {g: {"calls": len(records[g]), **{k: ms[f"{g}/{k}"] for k in ("eager", *engines)}}
                       for g in specs},
            "int8_same": round(float(np.mean(same)), 3)}


def loop_inputs(model, cases: list[tuple[str, dict]]) -> tuple[dict, dict, dict[int, list[dict]]]:
    """What a loop of ``model`` runs on: (the graph specs, the loop's meta, ``cases`` (a task's parity
    cases) by batch size)."""
    meta = {**model.cfg.__dict__, "collect": getattr(model, "parity_collect", ())}
    return model.export_graphs(), meta, batch_groups(cases)


def benched(name: str, root: Path) -> tuple[Path, object, dict, dict, dict[int, list[dict]]]:
    """What the benchmark runs for ``name``: (its served graph folder, the PyTorch model of
    ``runs/<name>/checkpoint/best``, the graph specs, the loop's meta, the parity cases by batch size)."""
    from pipeline.checkpoint import load_model
    from pipeline.config import resolve
    from pipeline.tasks import get_task

    run = resolve(name, root=root)
    folder = latest_graphs(name, root)
    if folder is None:
        raise cli_errors.ScriptError(f"{name} has no exported graphs in {root}: run `attnzoo repro export@{name}`")
    model, _ = load_model(run.run_dir / "checkpoint" / "best")
    return (folder, model,
            *loop_inputs(model, get_task(run.task).model_parity_batches(model, run.data_dir)))


def int8_graphs(name: str, root: Path, folder: Path, specs: dict, out: Path) -> None:
    """The int8 variant quantize@<name> makes (runs/<name>/int8), remade into ``out`` from ``folder``."""
    from pipeline.config import load_params
    from pipeline.stages.quantize import quantize_graphs, settings

    quantize_graphs(folder, list(specs), out, settings(name, load_params(root))["op_types"])


def bench_model(name: str, root: Path, threads: list[int], repeats: int) -> dict:
    """One entry at each thread count: ``{"model", "loop", "by_threads": {t: {"loop_ms", "graphs",
    "int8_same"}}}`` (t threads each: see the module docstring)."""
    import torch

    from pipeline.graphs import loop_kind
    from serving.runtime import OrtGraph

    folder, model, specs, meta, batches = benched(name, root)
    row = {"model": name, "loop": loop_kind(specs), "by_threads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        int8_graphs(name, root, folder, specs, Path(tmp))
        for t in threads:
            torch.set_num_threads(t)
            # As the server runs them: a looping model's sessions with one intra-op thread each and
            # its batch's rows over t loops at once (``--loop-ort-threads 1 --infer-threads t``); a
            # single graph with t intra-op threads.
            looping = row["loop"] != "single"
            per_session, workers = (1, t) if looping else (t, 1)
            engines = {"fp32": {g: OrtGraph(folder / f"{g}.onnx", provider="cpu", threads=per_session) for g in specs},
                       "int8": {g: OrtGraph(Path(tmp) / f"{g}.onnx", provider="cpu", threads=per_session)
                                for g in specs}}
            at = row["by_threads"][t] = {"graphs": {}, "loop_ms": {}, "int8_same": {}}
            for size, group in batches.items():
                got = bench_batches(model, specs, meta, group, engines, repeats, workers)
                at["loop_ms"][size] = got["loop_ms"]
                at["int8_same"][size] = got["int8_same"]
                for g, by in got["graphs"].items():
                    at["graphs"].setdefault(g, {})[size] = by
    return row


# The bars on the whole-loop speed-up of ONNX Runtime fp32 over PyTorch eager.
def bar(loop: str, size: int) -> float:
    return {1: 1.5 if loop != "single" else 1.3}.get(size, 1.0)


def best(row: dict, size: int, engine: str) -> tuple[float, int]:
    """An engine's fastest whole-loop median over the thread counts run, and that thread count."""
    return min((at["loop_ms"][size][engine], t) for t, at in row["by_threads"].items())


def from_json(row: dict) -> dict:
    """A row as ``bench_model`` returns it from its JSON copy, whose keys are strings: thread counts
    and batch sizes are ints again (the bars are looked up by batch size)."""
    sizes = ("loop_ms", "int8_same")
    return {**row, "by_threads": {int(t): {**at, **{k: {int(b): v for b, v in at[k].items()} for k in sizes},
                                           "graphs": {g: {int(b): v for b, v in by.items()}
                                                      for g, by in at["graphs"].items()}}
                                  for t, at in row["by_threads"].items()}}


def run_of(r: dict) -> tuple[str, str]:
    """(machine, date) of a row; rows of the first full run carry no date."""
    return r.get("machine", ""), r.get("date", "")


def runs_of(rows: list[dict]) -> list[tuple[str, str]]:
    """The runs the rows come from, the one most rows come from (the full one) first, whichever model
    it is listed under first; ties keep the rows' order."""
    counts = Counter(map(run_of, rows))
    return sorted(counts, key=lambda run: -counts[run])


def ratio(eager: float, ort: float) -> str:
    return f"{eager / ort:.2f}"


def command(run: tuple[str, str], rows: list[dict], spelled: str, repeats: int) -> str:
    """The command that measured ``run``'s rows: a dated run that measured only some of the table's models names
    them (--write-docs with names), one that measured all of them names none; the undated one is the first full
    run."""
    mine = [r["model"] for r in rows if run_of(r) == run]
    names = " ".join(mine) + " " if run[1] and len(mine) < len(rows) else ""
    return (f"python scripts/bench_inference.py {names}--threads {spelled} --repeats {repeats}"
            + (" --write-docs" if run[1] else ""))


def no_flags(machine: str) -> str:
    return "" if re.search(r"AVX|SSE|NEON|SVE", machine) else " (the run recorded no CPU flags)"


def markdown(rows: list[dict], threads: list[int], repeats: int) -> str:
    """The block of docs/benchmarks.md: one line per model and ONNX Runtime variant, the whole loop's
    speed-up over PyTorch eager at batch 1 and 32 for each thread count, each engine's fastest and the
    bar; the per-graph and per-thread milliseconds stay in docs/bench_inference.json."""
    spelled = " ".join(map(str, threads))
    # Rows re-measured later (--write-docs with model names) may come from another machine: each row's
    # ratios are from one run on one machine, and a mark names the command and machine of the others.
    first, *later = runs_of(rows)
    marks = {run: "†‡§¶"[i] for i, run in enumerate(later)}
    lines = [START, "",
             f"`{command(first, rows, spelled, repeats)}` on {first[0]}" + (f" ({first[1]})" if first[1] else "")
             + f"; median of {repeats} repeats{no_flags(first[0])}. "
             "× = PyTorch eager ms / ONNX Runtime ms for the whole inference loop (> 1: ONNX Runtime faster), "
             "both engines at the thread count of the column; *fastest* compares each engine at its fastest "
             "thread count, as a user would run either, and is what the bar applies to (fp32: ≥ 1.5× for a "
             "looping model and ≥ 1.3× for a single graph at batch 1, ≥ 1× at batch 32). int8: dynamic "
             "quantisation with the quantize@ stage's recipe, remade by the script; *same* = rows whose tokens "
             "/ argmax equal fp32's.", ""]
    for run, mark in marks.items():
        lines.append(f"- {mark} These rows: `{command(run, rows, spelled, repeats)}` on {run[0]}{no_flags(run[0])}.")
    lines += [""] if marks else []

    sizes = sorted({int(s) for r in rows for at in r["by_threads"].values() for s in at["loop_ms"]})
    per = [f"×, batch {s}, {t} thread{'s' if t > 1 else ''}" for s in sizes for t in threads]
    spelled_sizes = " / ".join(map(str, sizes))
    lines += ["| model | loop | ORT | eager ms at fastest, batch " + spelled_sizes + " | ORT ms at fastest, batch "
              + spelled_sizes + " | "
              + " | ".join(per) + f" | × fastest, batch {spelled_sizes} | bar | int8 same |",
              "|---|---|---|---|---|" + "---|" * len(per) + "---|---|---|"]
    for r in rows:
        name = r["model"] + marks.get(run_of(r), "")
        eager = [best(r, s, "eager")[0] for s in sizes]
        for engine in ("fp32", "int8"):
            ort = [best(r, s, engine)[0] for s in sizes]
            cells = [name, r["loop"], engine,
                     " / ".join(f"{ms:.2f}" for ms in eager) if engine == "fp32" else "",
                     " / ".join(f"{ms:.2f}" for ms in ort)]
            cells += [ratio(r["by_threads"][t]["loop_ms"][s]["eager"], r["by_threads"][t]["loop_ms"][s][engine])
                      for s in sizes for t in threads]
            cells.append(" / ".join(ratio(e, o) for e, o in zip(eager, ort)))
            if engine == "fp32":
                bars = [bar(r["loop"], s) for s in sizes]
                met = all(e / o >= b for e, o, b in zip(eager, ort, bars))
                cells += [" / ".join(f"≥ {b}" for b in bars) + (" met" if met else " **not met**"), ""]
            else:
                same = [sorted({at["int8_same"][s] for at in r["by_threads"].values()}) for s in sizes]
                cells += ["", " / ".join(f"{vs[0]:.0%}" if len(vs) == 1 else f"{vs[0]:.0%}–{vs[-1]:.0%}"
                                         for vs in same)]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", END]
    return "\n".join(lines)


def kept_rows(kept: dict) -> list[dict]:
    """The rows of a docs/bench_inference.json as ``bench_model`` returns them, each naming its machine
    (rows of the first full run take the file's)."""
    return [{"machine": kept["machine"], **from_json(r)} for r in kept["rows"]]


def rendered(path: Path = JSON_OUT) -> str:
    """The block of docs/benchmarks.md for the measurements in ``path``, measuring nothing."""
    kept = json.loads(path.read_text())
    return markdown(kept_rows(kept), kept["threads"], kept["repeats"])


def with_table(text: str, table: str) -> str:
    """``text`` (docs/benchmarks.md) with its generated block replaced by ``table``."""
    if START in text:
        return re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: table, text, flags=re.S)
    return text.rstrip() + "\n\n## Inference: ONNX Runtime vs PyTorch, fp32 and int8\n\n" + table + "\n"


def bench_apart(name: str, root: Path, threads: list[int], repeats: int) -> dict:
    """``bench_model`` in a process of its own. One model's run leaves PyTorch's threads in a state that can slow
    the next model's eager loop a hundredfold (``rnn_parity``'s, batch 32 on 2 threads: ~20 ms after
    ``pointer_hull`` in the same process, 0.15 ms in a fresh one), so each row starts from a fresh interpreter, as
    a server or a user's script does."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        proc = subprocess.run([sys.executable, __file__, name, "--root", str(root), "--threads", *map(str, threads),
                               "--repeats", str(repeats), "--row-json", str(out)])
        if proc.returncode:
            raise SystemExit(f"error: {name}: its benchmark process exited with {proc.returncode} (its output above)")
        return from_json(json.loads(out.read_text()))


def measure(names: list[str], args: argparse.Namespace) -> list[dict]:
    """The rows of the ``names`` trained and published in ``args.root``, each measured in its own process."""
    rows, missing = [], []
    run = {"machine": machine(), "date": time.strftime("%Y-%m-%d")}  # one run: the table keys its rows by these
    for name in names:
        if not (args.root / "runs" / name / "checkpoint" / "best").is_dir() or latest_graphs(name, args.root) is None:
            missing.append(name)
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.append({**bench_apart(name, args.root, args.threads, args.repeats), **run})
    if missing:
        print(f"not trained and exported in this checkout (run `attnzoo repro publish@NAME`): {', '.join(missing)}",
              file=sys.stderr)
    if not rows:
        raise cli_errors.ScriptError("no model to benchmark: train and export one first")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="params.yaml entries (default: every entry trained in this checkout)")
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}),
                    help="intra-op thread counts to run, each for PyTorch and ORT alike (default: 1 and all "
                         "cores; with several, a first table compares each engine at its fastest)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this one)")
    ap.add_argument("--write-docs", action="store_true",
                    help=f"replace the generated table in {DOCS.name}; with model names, only their rows (the "
                         f"others are kept from {JSON_OUT.name}, marked with where they ran)")
    ap.add_argument("--render-docs", action="store_true",
                    help=f"measure nothing: rewrite the generated block of {DOCS.name} from {JSON_OUT.name}")
    ap.add_argument("--check-docs", action="store_true",
                    help=f"measure nothing: exit 1 when the generated block of {DOCS.name} differs from a fresh "
                         f"render of {JSON_OUT.name}")
    ap.add_argument("--row-json", type=Path, help=argparse.SUPPRESS)  # one model, its row to this file
    args = ap.parse_args(argv)
    if args.render_docs or args.check_docs:
        if args.models or args.write_docs:
            raise cli_errors.ScriptError("--render-docs / --check-docs measure nothing: no model names, "
                                         "no --write-docs")
        text = DOCS.read_text()
        fresh = with_table(text, rendered())
        if args.check_docs:
            if fresh != text:
                raise SystemExit(f"{DOCS}: the generated block differs from {JSON_OUT.name}; "
                                 "run python scripts/bench_inference.py --render-docs")
            return
        DOCS.write_text(fresh)
        return

    import yaml

    entries = list(yaml.safe_load((args.root / "params.yaml").read_text())["models"])
    cli_errors.entries(args.models, args.root)
    if args.row_json:  # one model's row, for bench_apart
        (name,) = args.models
        args.row_json.write_text(json.dumps(bench_model(name, args.root, args.threads, args.repeats)))
        return
    rows = measure(args.models or entries, args)
    if args.write_docs and args.models and JSON_OUT.exists():
        kept = json.loads(JSON_OUT.read_text())
        if kept["threads"] != args.threads or kept["repeats"] != args.repeats:
            threads = " ".join(map(str, kept["threads"]))
            raise cli_errors.ScriptError(f"{JSON_OUT.name} was run with --threads {threads} --repeats "
                                         f"{kept['repeats']}; re-measure its rows with the same, or every model")
        fresh = {r["model"]: r for r in rows}
        old = {r["model"]: r for r in kept_rows(kept)}
        rows = [fresh.get(name) or old[name] for name in entries if name in fresh or name in old]
    table = markdown(rows, args.threads, args.repeats)
    print(table)
    if args.write_docs:
        JSON_OUT.write_text(json.dumps({"machine": runs_of(rows)[0][0] or machine(), "threads": args.threads,
                                        "repeats": args.repeats, "rows": rows}, indent=1))
        DOCS.write_text(with_table(DOCS.read_text(), table))


if __name__ == "__main__":
    cli_errors.run(main)
