"""What a training step's own matrix products allow: the ceiling on its share of the machine's peak.

For each entry (default: the translation entries), ``--steps`` real training steps with its speed settings
(this tree's params.yaml recipe: ``train_efficiency.fast_settings``), on 1 thread after a warm-up, run under
``torch.profiler``, which records every matrix product (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``) with its
shapes, strides and dtypes. Each distinct product is then timed alone: fresh inputs of the same shapes, strides
and dtypes, the fastest of repeated blocks. Per entry, written as its ``ceiling`` in ``docs/train_efficiency.json``:

- ``gemm_gflop``: the products' FLOPs a step (2·M·N·K each), and ``flop_share``, their share of the
  fast step's counted FLOPs (``fast_gflop_per_step``, else ``gflop_per_step``);
- ``gemm_gflops_alone``: those FLOPs over the products' time alone, the rate the step's GEMMs reach at
  their own shapes: what the step would reach if everything else took no time. ``ceiling_pct`` is that
  rate as a share of ``peak_gflops``, the table's peak (``docs/peak.json``, 1 thread, the precision the
  entry trains in). ``peak_gflops_now`` is ``scripts/bench_peak.py``'s 2048² product timed again right
  after the products: on this VM the bf16 rate of one thread moves between about 420 and 1,000 GFLOP/s
  from one minute to the next, so the products' rates are compared with it too;
- ``gemm_gflops_in_step``: the same FLOPs over the products' self time inside the profiled steps, and
  ``gemm_time_share``: that time's share of the profiled steps' wall time (the profiler's own cost, a few
  per cent, counts as time outside the products);
- ``bound_pct``: the share of the peak the step would reach with its products at the peak and everything
  else taking the time it takes now (the step's FLOPs over: the time outside the products + the products'
  FLOPs at the peak). Above 50 % only if the work outside the products shrinks. Against the lower of the
  two peaks the products' share is the larger, so this is the larger bound;
- ``top``: the products that take most time alone, each with its count a step and its rate; ``outside``:
  the operators that take most of the time outside the products, with their share of the step.

    python scripts/gemm_ceiling.py                      # the seven translation entries, ~3 min on 1 core
    python scripts/gemm_ceiling.py --entries transformer --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import cli_errors

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peak  # noqa: E402
import train_efficiency as te  # noqa: E402  (the same work folder, trainer and batches as the speed table)

GEMMS = {"aten::mm": 2, "aten::addmm": 3, "aten::bmm": 2, "aten::baddbmm": 3}  # op: operands (an out= after)
TRANSLATION = ["bahdanau", "bahdanau_none", "luong_dot", "luong_general", "luong_concat", "luong_local_p",
               "transformer"]
DTYPES = {"float": "float32", "c10::BFloat16": "bfloat16", "c10::Half": "float16", "double": "float64"}
BLOCK_S = 0.02  # each timed block of one product alone lasts at least this long


def gemm_flops(name: str, shapes) -> int:
    """2·M·N·K (times the batch for bmm/baddbmm) of one product, from its recorded input shapes."""
    a, b = shapes[-2], shapes[-1]  # addmm/baddbmm: (bias, a, b); mm/bmm: (a, b)
    if name in ("aten::bmm", "aten::baddbmm"):
        return 2 * a[0] * a[1] * a[2] * b[2]  # [batch, M, K] @ [batch, K, N]
    return 2 * a[0] * a[1] * b[1]  # [M, K] @ [K, N]


def recorded_products(events) -> Counter:
    """Every matrix product in profiler ``events``, counted by (op, shapes, strides, dtypes). A product
    called under autocast is recorded twice, as called and again on its cast operands: only the inner
    call, the one that computes, counts."""
    found: Counter = Counter()
    for e in events:
        if e.name in GEMMS and not any(c.name in GEMMS for c in e.cpu_children):
            n = GEMMS[e.name]
            key = (e.name, tuple(map(tuple, e.input_shapes[:n])),
                   tuple(tuple(s) for s in e.structured_input_strides[:n]), tuple(e.input_dtypes[:n]))
            found[key] += 1
    return found


def _operand(shape: tuple, stride: tuple, dtype: str):
    """A tensor of ``shape`` laid out with ``stride`` (broadcast strides of 0 included), random values."""
    import torch

    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride) if n > 0)
    return torch.randn(span, dtype=getattr(torch, DTYPES.get(dtype, "float32"))).as_strided(shape, stride)


def time_alone(key: tuple) -> float:
    """Seconds of one call of the product ``key`` on its own: the fastest of 7 blocks of at least BLOCK_S
    (a ceiling: the best the product does at its shapes)."""
    import torch

    name, shapes, strides, dtypes = key
    args = [_operand(s, st, d) for s, st, d in zip(shapes, strides, dtypes)]
    fn = {"aten::mm": torch.mm, "aten::addmm": torch.addmm, "aten::bmm": torch.bmm,
          "aten::baddbmm": torch.baddbmm}[name]
    fn(*args)  # the primitive created once, as in the step
    started = time.perf_counter()
    fn(*args)
    once = max(time.perf_counter() - started, 1e-7)
    reps = max(1, round(BLOCK_S / once))
    blocks = []
    for _ in range(7):
        started = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        blocks.append((time.perf_counter() - started) / reps)
    return min(blocks)


def entry_ceiling(work: Path, name: str, steps: int, peak: dict, gflop_per_step: float | None) -> dict:
    """Profile ``steps`` fast-settings training steps of ``name`` on 1 thread, then time their products alone."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from tqdm import tqdm

    with tempfile.TemporaryDirectory(dir=work) as out:
        trainer, precision = te._trainer(work, name, te.fast_settings(name), Path(out))
        warm = te.warm_up_steps(steps)
        batches, bar = te._batches(trainer, warm + steps), tqdm(disable=True)
        for batch in batches[:warm]:
            trainer._step(batch, None, bar)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            started = time.perf_counter()
            for batch in batches[warm:]:
                trainer._step(batch, None, bar)
            wall = time.perf_counter() - started
    events = prof.events()
    found = recorded_products(events)
    in_step = sum(e.self_cpu_time_total for e in events if e.name in GEMMS) / 1e6
    others = sorted((e for e in prof.key_averages() if e.key.startswith("aten::") and e.key not in GEMMS),
                    key=lambda e: -e.self_cpu_time_total)[:4]
    alone = {key: time_alone(key) for key in found}
    limit = peak[precision]["1"]["gflops"]
    now = bench_peak.gemm_gflops(2048, torch.bfloat16 if precision == "bf16" else torch.float32, 1,
                                 2.0)["gflops"]  # beside the products: this VM's bf16 rate moves (see above)
    flops = {k: gemm_flops(k[0], k[1]) for k in found}
    flop = sum(flops[k] * n for k, n in found.items())
    total_alone = sum(alone[k] * n for k, n in found.items())
    rate = flop / total_alone / 1e9
    top = sorted(found, key=lambda k: -alone[k] * found[k])[:4]
    result = {
        "steps": steps, "precision": precision, "gemm_gflop": round(flop / steps / 1e9, 3),
        "gemm_gflops_alone": round(rate, 1), "ceiling_pct": round(100 * rate / limit, 1),
        "gemm_gflops_in_step": round(flop / in_step / 1e9, 1), "gemm_time_share": round(in_step / wall, 3),
        "bound_pct": round(100 * flop / (wall - in_step + flop / (limit * 1e9)) / (limit * 1e9), 1),
        "peak_gflops": limit, "peak_gflops_now": now, "step_s": round(wall / steps, 4), "distinct_products": len(found),
        "top": [{"op": k[0].removeprefix("aten::"), "shapes": [list(s) for s in k[1]], "dtype": DTYPES.get(k[3][-1]),
                 "per_step": round(found[k] / steps, 1),
                 "gflops_alone": round(flops[k] / alone[k] / 1e9, 1)} for k in top],
        "outside": [{"op": e.key.removeprefix("aten::"), "share": round(e.self_cpu_time_total / 1e6 / wall, 3)}
                    for e in others],
    }
    if gflop_per_step:
        result["flop_share"] = round(result["gemm_gflop"] / gflop_per_step, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", nargs="+", default=TRANSLATION, help="params.yaml entries (default: translation)")
    ap.add_argument("--steps", type=int, default=5, help="profiled training steps per entry (after a warm-up)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/attnzoo-train-efficiency"))
    ap.add_argument("--out", type=Path, default=te.JSON_OUT, help="scripts/train_efficiency.py's figures to add to")
    args = ap.parse_args(argv)
    kept = te.measured(args.out, args.entries)
    os.environ.update({v: "1" for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
    import torch

    torch.set_num_threads(1)  # the zoo's placement: a core per stage, as the table's % of peak
    args.work.mkdir(parents=True, exist_ok=True)
    te.make_work(args.work, args.entries)
    for name in args.entries:
        entry = kept["entries"][name]
        flops = entry.get("fast_gflop_per_step", entry.get("gflop_per_step"))  # what the profiled fast steps do
        entry["ceiling"] = c = entry_ceiling(args.work, name, args.steps, kept["peak"], flops)
        print(f"{name}: GEMMs {c['gemm_gflop']} GFLOP a step at {c['gemm_gflops_alone']} GFLOP/s alone "
              f"({c['ceiling_pct']}% of the {c['precision']} peak), {c['gemm_gflops_in_step']} in the step, "
              f"{c['gemm_time_share']:.0%} of its time; bound {c['bound_pct']}%; outside: "
              + ", ".join(f"{o['op']} {o['share']:.0%}" for o in c["outside"]), flush=True)
        args.out.write_text(json.dumps(kept, indent=2) + "\n")  # each entry kept as it finishes
    return 0


if __name__ == "__main__":
    cli_errors.run(main)
