"""This machine's sustained matrix-multiply throughput: the limit training efficiency is measured against.

Large square GEMMs through torch (``torch.mm``, oneDNN/MKL on x86) in fp32 and in bf16, on 1 and on 2
threads, each timed for ``--seconds`` after a warm-up; the figure is the median GFLOP/s of the timed
calls (2·n³ floating-point operations per n×n product). It prints the CPU's model, family, model number
and the flags that decide which kernels run (AVX-512, AVX512-BF16, AMX), and writes them with the
figures as JSON (``--out``), which ``scripts/train_efficiency.py`` reads as the peak.

    python scripts/bench_peak.py --out docs/peak.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import cli_errors

KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")


def cpu_info() -> dict:
    """The CPU as /proc/cpuinfo names it: model name, vendor, family, model number, and the kernel flags."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: what platform knows
        return {"model_name": platform.processor() or platform.machine(), "flags": []}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return {"model_name": fields.get("model name", ""), "vendor": fields.get("vendor_id", ""),
            "family": int(fields.get("cpu family", "0") or 0), "model": int(fields.get("model", "0") or 0),
            "flags": [f for f in KERNEL_FLAGS if f in flags]}


def gemm_gflops(n: int, dtype, threads: int, seconds: float) -> dict:
    """Median and best GFLOP/s of n×n @ n×n products in ``dtype`` on ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    for _ in range(3):  # warm-up: oneDNN primitive creation, page faults, clock ramp
        torch.mm(a, b, out=out)
    rates, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(rates) < 5:
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        rates.append(2 * n**3 / (time.perf_counter() - t) / 1e9)
    return {"gflops": round(statistics.median(rates), 1), "best_gflops": round(max(rates), 1), "calls": len(rates)}


def measure(n: int, seconds: float, threads: list[int]) -> dict:
    """{dtype: {threads: figures}} for fp32 and bf16, with the CPU it ran on and torch's version."""
    import torch

    result = {"cpu": cpu_info(), "torch": torch.__version__, "n": n, "seconds_each": seconds, "peak": {}}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        result["peak"][name] = {str(t): gemm_gflops(n, dtype, t, seconds) for t in threads}
    torch.set_num_threads(max(threads))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2048, help="matrix side (default 2048: 17 GFLOP a product)")
    parser.add_argument("--seconds", type=float, default=5.0, help="timed seconds per dtype and thread count")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    result = measure(args.n, args.seconds, args.threads)
    cpu = result["cpu"]
    print(f"{cpu['model_name']} (family {cpu.get('family')}, model {cpu.get('model')}); "
          f"flags: {' '.join(cpu['flags']) or 'none of ' + ', '.join(KERNEL_FLAGS)}; torch {result['torch']}")
    for dtype, by_threads in result["peak"].items():
        for threads, fig in by_threads.items():
            print(f"  {dtype} {threads} thread(s): {fig['gflops']:8.1f} GFLOP/s median, {fig['best_gflops']:8.1f} best "
                  f"({fig['calls']} products of {args.n}x{args.n})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    cli_errors.run(main)
