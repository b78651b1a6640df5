"""Serving benchmark (not a test): requests/s and p50/p99 latency over loopback HTTP, and the same
graph called in-process with ONNX Runtime vs PyTorch eager.

    python scripts/bench_serving.py                       # starts `attnzoo serve` on model_repository
    python scripts/bench_serving.py --url http://host:8000 --skip-inprocess

Needs a published repository and, for the in-process PyTorch column, the checkpoints in runs/.
Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import cli_errors
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SENTENCE = "Ich habe heute keine Zeit."


def percentiles(lat: list[float]) -> tuple[float, float]:
    return float(np.percentile(lat, 50) * 1000), float(np.percentile(lat, 99) * 1000)


async def load_raw(url: str, body: bytes, requests: int, concurrency: int, headers: dict | None = None) -> dict:
    """The same load from a minimal HTTP/1.1 client: one keep-alive connection per concurrent caller,
    the request bytes built once, responses read by Content-Length (what `wrk` does, in Python).
    ``headers``: the request's (default: JSON's Content-Type).

    On a 2-core box the load generator shares the CPU with the server; this one spends a fraction
    of aiohttp's time per request, so more of what is measured is the server.
    """
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    fields = "".join(f"{k}: {v}\r\n" for k, v in (headers or {"Content-Type": "application/json"}).items())
    head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{fields}"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    message = head + body
    lat: list[float] = []
    errors = 0
    left = requests

    async def call(reader, writer) -> bool:
        writer.write(message)
        status_line = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await reader.readexactly(length)
        return status_line.split(b" ", 2)[1] == b"200"

    async def worker(warm: int):
        nonlocal errors, left
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        for _ in range(warm):
            await call(reader, writer)
        await start.wait()
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            ok = await call(reader, writer)  # not `errors += await ...`: that reads errors before the await
            lat.append(time.perf_counter() - t0)
            errors += not ok
        writer.close()

    start = asyncio.Event()
    tasks = [asyncio.create_task(worker(2)) for _ in range(concurrency)]
    await asyncio.sleep(0.5)  # connections open and warmed up
    started = time.perf_counter()
    start.set()
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - started
    p50, p99 = percentiles(lat)
    return {"rps": requests / wall, "p50_ms": p50, "p99_ms": p99, "errors": errors}


async def load_wrk(url: str, body: bytes, requests: int, concurrency: int) -> dict:
    """The same load from `wrk` (C, one thread; Debian package `wrk`). wrk runs for a time, not a
    number of requests: ``requests`` / 1,000 seconds, at least 3."""
    import re
    import shutil
    import tempfile

    if shutil.which("wrk") is None:
        raise cli_errors.ScriptError("--client wrk needs the `wrk` program: sudo apt-get install wrk")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                f"wrk.body = {json.dumps(body.decode())}\n")
    seconds = max(3, requests // 1000)
    out = await asyncio.to_thread(subprocess.run, ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "--latency",
                                                   "-s", f.name, url], capture_output=True, text=True, check=True)
    os.unlink(f.name)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}

    def pct(label: str) -> float:
        value, unit = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", out.stdout, re.M).groups()
        return float(value) * scale[unit]

    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out.stdout).group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out.stdout)
    return {"rps": rps, "p50_ms": pct("50"), "p99_ms": pct("99"), "errors": int(bad.group(1)) if bad else 0}


async def load(url: str, body: bytes, requests: int, concurrency: int) -> dict:
    import aiohttp

    lat: list[float] = []
    errors = 0
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(requests):
        queue.put_nowait(None)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers={"Content-Type": "application/json"}) as session:

        async def worker():
            nonlocal errors
            while not queue.empty():
                queue.get_nowait()
                t0 = time.perf_counter()
                async with session.post(url, data=body) as resp:
                    await resp.read()
                    errors += resp.status != 200
                lat.append(time.perf_counter() - t0)

        for _ in range(min(20, requests)):  # warm-up
            async with session.post(url, data=body) as resp:
                await resp.read()
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    p50, p99 = percentiles(lat)
    return {"rps": requests / wall, "p50_ms": p50, "p99_ms": p99, "errors": errors}


def served_folder(repo: Path, model: str) -> Path:
    """The version folder a server of ``repo`` answers ``model`` with (its default version, else the newest:
    what :func:`served_path` asks for), so that requests are built with, and the in-process column runs,
    the graphs and tokenizer that are benchmarked."""
    from serving.client import LocalClient, LocalError
    from serving.repository import default_version

    try:
        metas = LocalClient(repo)._versions(model)  # each version's metadata.json, as --local reads them
    except LocalError as e:
        raise cli_errors.ScriptError(str(e)) from None
    if not metas:
        raise cli_errors.ScriptError(f"{repo / model} holds no published version: run `dvc repro publish@{model}` "
                                     "first")
    version, _ = default_version(metas)
    return repo / model / str(max(metas) if version is None else version)


def bodies(repo: Path) -> dict[str, tuple[str, bytes]]:
    """A realistic single request per benchmarked model (one row)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(served_folder(repo, "bahdanau") / "spm.de.model"))
    src = sp.encode(SENTENCE) + [2]
    enc = {"inputs": [{"name": "src", "shape": [1, len(src)], "datatype": "INT64", "data": src},
                      {"name": "src_len", "shape": [1], "datatype": "INT64", "data": [len(src)]}],
           "outputs": [{"name": "state"}]}
    text = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [SENTENCE]}],
            "parameters": {"decode": "greedy"}}
    return {"bahdanau.encoder": ("encoder, 1 sentence (8 pieces) → decoder state", json.dumps(enc).encode()),
            "bahdanau": ("whole model: German text → English, greedy loop", json.dumps(text).encode())}


def inprocess(repo: Path, batch: int, iters: int) -> dict[str, dict]:
    """The encoder graph called directly: ONNX Runtime session vs the PyTorch module it came from."""
    import torch

    from pipeline.checkpoint import load_model
    from serving.runtime import OrtGraph

    torch.set_num_threads(os.cpu_count() or 1)
    ort_graph = OrtGraph(served_folder(repo, "bahdanau") / "encoder.onnx", "cpu")
    model, _ = load_model(ROOT / "runs" / "bahdanau" / "checkpoint" / "best")
    module = model.export_graphs()["encoder"].module.eval()
    rng = np.random.default_rng(0)
    src = rng.integers(4, 4000, (batch, 8)).astype(np.int64)  # [B,8]
    src_len = np.full(batch, 8, dtype=np.int64)
    out = {}
    for name, call in (("ONNX Runtime", lambda: ort_graph({"src": src, "src_len": src_len})),
                       ("PyTorch eager", lambda: module(torch.from_numpy(src), torch.from_numpy(src_len)))):
        with torch.no_grad():
            for _ in range(20):
                call()
            lat = []
            for _ in range(iters):
                t0 = time.perf_counter()
                call()
                lat.append(time.perf_counter() - t0)
        p50, p99 = percentiles(lat)
        out[name] = {"rows_per_s": batch / np.mean(lat), "p50_ms": p50, "p99_ms": p99}
    return out


def served_path(url: str, model: str) -> str:
    """The model's default version, or (none promoted: the server answers 409 without a version)
    its newest version, named explicitly."""
    from serving.client import Client, ServerError

    try:
        meta = Client(url).model_metadata(model)
    except ServerError as err:
        raise cli_errors.ScriptError(f"{model} at {url}: {err}") from None
    if (meta.get("parameters") or {}).get("default_version") is None:
        version = max(meta["versions"], key=int)
        print(f"{model}: no promoted version; benchmarking version {version} explicitly", flush=True)
        return f"/v2/models/{model}/versions/{version}"
    return f"/v2/models/{model}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    ap.add_argument("--url", default=None, help="benchmark a running server instead of starting one (the requests "
                    "are still built from --repository's bahdanau)")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--skip-inprocess", action="store_true")
    ap.add_argument("--client", choices=("aiohttp", "raw", "wrk"), default="aiohttp",
                    help="load generator: aiohttp; a minimal keep-alive HTTP/1.1 client; or wrk (both use less CPU)")
    ap.add_argument("--models", default="bahdanau.encoder,bahdanau", help="comma-separated rows to run, of "
                    "bahdanau.encoder and bahdanau")
    ap.add_argument("--rounds", type=int, default=1, help="c1 and c32 measured in turn this many times (medians)")
    ap.add_argument("--compare-args", default=None,
                    help="start a second server with these options; both are measured in turn ([A] vs [B])")
    ap.add_argument("--server-args", default="", help="extra `attnzoo serve` options, e.g. '--batch-delay-ms 1'")
    args = ap.parse_args()
    check_arguments(args)
    configs = [("A", args.server_args)] + ([("B", args.compare_args)] if args.compare_args is not None else [])
    procs, urls = ([], {"A": args.url}) if args.url is not None else start_servers(args.repository, args.workers,
                                                                                      configs)
    try:
        rows, ratio_lines = measure(args, urls)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=20)
    for label, extra in configs:
        print(f"[{label}] server options: {extra or '(defaults)'}")
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}; "
          f"server workers: {args.workers}; load generator ({args.client}) on the same machine\n")
    print("| model | request | concurrency | req/s | p50 ms | p99 ms | errors |\n|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n" + "\n".join(ratio_lines))
    if not args.skip_inprocess:
        print("\n| encoder graph, in-process | batch | rows/s | p50 ms | p99 ms |\n|---|---|---|---|---|")
        for batch in (1, 32):
            for name, r in inprocess(args.repository, batch, 2000 if batch == 1 else 300).items():
                print(f"| {name} | {batch} | {r['rows_per_s']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")


def check_arguments(args) -> None:
    """What the run needs, checked before any server starts: rows it has, and the in-process column's
    checkpoint (the requests themselves are built from ``--repository``'s bahdanau, with --url too)."""
    rows = ("bahdanau.encoder", "bahdanau")
    if unknown := [m for m in args.models.split(",") if m not in rows]:
        raise cli_errors.ScriptError(f"--models {','.join(unknown)}: the rows are {', '.join(rows)}")
    if not args.skip_inprocess and not (ROOT / "runs" / "bahdanau" / "checkpoint" / "best").is_dir():
        raise cli_errors.ScriptError("the in-process column needs runs/bahdanau/checkpoint/best: run "
                                     "`attnzoo repro train@bahdanau`, or pass --skip-inprocess")


def start_servers(repository: Path, workers: int, configs: list[tuple[str, str]]) -> tuple[list, dict[str, str]]:
    """One server per (label, extra options), all up at once: their runs alternate in measure()."""
    from serving.client import Client

    procs, urls = [], {}
    for label, extra in configs:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "serving.server", "--repository", str(repository), "--port", str(port),
               "--workers", str(workers), *extra.split()]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls[label] = f"http://127.0.0.1:{port}"
        if not Client(urls[label]).wait_ready(60, alive=lambda: procs[-1].poll() is None):
            for proc in procs:
                proc.terminate()
            raise SystemExit(f"error: the server on {urls[label]} did not become ready in 60 s")
    return procs, urls


def measure(args, urls: dict[str, str]) -> tuple[list[str], list[str]]:
    """The table's rows and the throughput ratios, every model row of ``--models`` on every server."""
    rows, ratio_lines = [], []
    generator = {"aiohttp": load, "raw": load_raw, "wrk": load_wrk}[args.client]
    for model, (what, body) in bodies(args.repository).items():
        if model not in args.models.split(","):
            continue
        n = args.requests if model != "bahdanau" else max(100, args.requests // 10)
        paths = {label: served_path(url, model) for label, url in urls.items()}
        runs = {(label, conc): [] for label in urls for conc in (1, 32)}
        # c1 and c32 (and each server) in turn: a drift of the machine's speed hits them all
        for _ in range(args.rounds):
            for conc in (1, 32):
                for label, url in urls.items():
                    r = asyncio.run(generator(f"{url}{paths[label]}/infer", body, n, conc))
                    runs[label, conc].append(r)
                    print(f"  [{label}] {model} c{conc}: {r['rps']:.0f} req/s, p50 {r['p50_ms']:.1f} ms, "
                          f"p99 {r['p99_ms']:.1f} ms, {r['errors']} errors", flush=True)
        for (label, conc), got in runs.items():
            rps = sorted(r["rps"] for r in got)
            med = got[[r["rps"] for r in got].index(rps[len(rps) // 2])]
            spread = f" ({rps[0]:.0f}–{rps[-1]:.0f})" if len(rps) > 1 else ""
            tag = f" [{label}]" if len(urls) > 1 else ""
            rows.append(f"| `{model}`{tag} | {what} | {conc} | {med['rps']:.0f}{spread} | {med['p50_ms']:.1f} | "
                        f"{med['p99_ms']:.1f} | {sum(r['errors'] for r in got)} |")
        ratio_lines += _ratios(model, runs, urls)
    return rows, ratio_lines


def _ratios(model: str, runs: dict, urls: dict[str, str]) -> list[str]:
    def ratio(a, b):
        values = sorted(y["rps"] / x["rps"] for x, y in zip(runs[a], runs[b]))
        return f"{', '.join(f'{v:.2f}' for v in values)} (median {values[len(values) // 2]:.2f}x)"

    lines = [f"`{model}` [{label}]: c32 / c1 throughput, round by round: {ratio((label, 1), (label, 32))}"
             for label in urls]
    if len(urls) > 1:
        lines.append(f"`{model}`: [A] c32 / [B] c1, round by round: {ratio(('B', 1), ('A', 32))}; "
                     f"[A] c1 / [B] c1: {ratio(('B', 1), ('A', 1))}")
    return lines


if __name__ == "__main__":
    cli_errors.run(main)
