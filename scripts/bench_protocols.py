"""What each protocol's answer costs (not a test): the same request to one `attnzoo serve` as REST
JSON, as REST with the binary tensor data extension, and as gRPC with raw tensors, requests/s and
p50/p99 at concurrency 1 and 32, the three protocols in turn round by round.

    python scripts/bench_protocols.py --repository model_repository --models pointer_sort,bahdanau

A model's request: its task's sample input in examples/ (``examples/<task>.json``, the task named
in the version's metadata.json; the server's default decoding), or for a text model one German
sentence, decoded greedily. Each
load generator sends prebuilt request bytes and reads answers without parsing them (a minimal
keep-alive HTTP/1.1 client per connection; gRPC: one HTTP/2 channel, calls multiplexed), so more of
what is measured is the server; it shares the machine's cores with the server, so beside
requests/s the table gives the server process's CPU time per request (its own cost of a protocol,
whatever the client costs). Prints a Markdown
table for docs/benchmarks.md and the gRPC / REST-binary throughput ratio of each round.
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
sys.path.insert(0, str(ROOT))
from scripts.bench_serving import load_raw, percentiles  # noqa: E402
from serving.client import as_tensor, encode  # noqa: E402
from serving.protocol import HEADER_LENGTH, tensor_to_bytes  # noqa: E402

SENTENCE = "Ich habe heute keine Zeit."
PROTOCOLS = ("REST JSON", "REST binary", "gRPC raw")


def sample(repo: Path, client, model: str, version: int | None = None) -> tuple[dict[str, np.ndarray], dict] | None:
    """(inputs, parameters) of one request to ``model`` (its newest version's task), typed as the server
    declares them; None for a graph name or a task without a sample in examples/."""
    from serving.protocol import DATATYPES

    declared = {i["name"]: i["datatype"] for i in client.model_metadata(model, version)["inputs"]}
    if list(declared) == ["text"]:
        return {"text": np.array([SENTENCE], dtype=object)}, {"decode": "greedy"}
    versions = [p for p in (repo / model).iterdir() if p.name.isdigit()] if (repo / model).is_dir() else []
    if "." in model or not versions:
        return None
    task = json.loads((max(versions, key=lambda p: int(p.name)) / "metadata.json").read_text())["task"]
    example = ROOT / "examples" / f"{task}.json"
    if not example.exists():
        return None
    return {k: np.asarray(v, dtype=DATATYPES[declared[k]]) for k, v in json.loads(example.read_text()).items()}, {}


def rest_bodies(inputs: dict, params: dict) -> dict[str, tuple[bytes, dict]]:
    """The JSON request, and the binary one (its header, then each input's bytes; outputs binary)."""
    tensors = {n: as_tensor(v) for n, v in inputs.items()}
    plain = {"inputs": [encode(n, *t) for n, t in tensors.items()], **({"parameters": params} if params else {})}
    blobs = {n: tensor_to_bytes(*t) for n, t in tensors.items()}
    head = json.dumps({"inputs": [encode(n, *t, len(blobs[n])) for n, t in tensors.items()],
                       "parameters": {**params, "binary_data_output": True}}).encode()
    return {"REST JSON": (json.dumps(plain).encode(), {"Content-Type": "application/json"}),
            "REST binary": (head + b"".join(blobs.values()), {"Content-Type": "application/octet-stream",
                                                              HEADER_LENGTH: str(len(head))})}


def grpc_request(model: str, inputs: dict, params: dict) -> bytes:
    from serving.grpc import grpc_service_pb2 as pb
    from serving.grpc_client import _param

    request = pb.ModelInferRequest(model_name=model)
    for key, value in params.items():
        request.parameters[key].CopyFrom(_param(value))
    for name, value in inputs.items():
        array, datatype = as_tensor(value)
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        request.raw_input_contents.append(tensor_to_bytes(array, datatype))
    return request.SerializeToString()


async def load_grpc(target: str, message: bytes, requests: int, concurrency: int) -> dict:
    """``concurrency`` callers on one channel, each sending the prebuilt ModelInferRequest bytes."""
    import grpc
    from grpc import aio

    async with aio.insecure_channel(target) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out
        for _ in range(2 * concurrency):  # warm-up
            await call(message, timeout=60)
        lat, errors, left = [], 0, requests

        async def worker():
            nonlocal errors, left
            while left > 0:
                left -= 1
                t0 = time.perf_counter()
                try:
                    await call(message, timeout=60)
                except grpc.RpcError:
                    errors += 1
                lat.append(time.perf_counter() - t0)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    p50, p99 = percentiles(lat)
    return {"rps": requests / wall, "p50_ms": p50, "p99_ms": p99, "errors": errors}


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(repo: Path, extra: str) -> tuple[subprocess.Popen, str, str]:
    from serving.client import Client

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-m", "serving.server", "--repository", str(repo), "--port", str(ports[0]),
                             "--grpc-port", str(ports[1]), *extra.split()], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{ports[0]}"
    if not Client(url).wait_ready(120, alive=lambda: proc.poll() is None):
        proc.terminate()
        raise SystemExit(f"error: the server on {url} did not become ready in 120 s")
    return proc, url, f"127.0.0.1:{ports[1]}"


def run_model(args, server: int, url: str, target: str, model: str) -> tuple[list[str], str]:
    """``server``: the server's process id (its CPU time per request is the protocol's cost to it)."""
    from serving.client import Client

    found = sample(args.repository, Client(url), model)
    if found is None:
        raise cli_errors.ScriptError(f"this script has sample inputs for text models and for the tasks of "
                                     f"examples/*.json, not for {model}'s")
    inputs, params = found
    bodies, message = rest_bodies(inputs, params), grpc_request(model, inputs, params)
    runs: dict[tuple[str, int], list[dict]] = {(p, c): [] for p in PROTOCOLS for c in (1, 32)}
    for _ in range(args.rounds):  # protocols and concurrencies in turn: a drift of the machine hits them all
        for conc in (1, 32):
            for protocol in PROTOCOLS:
                used = cpu_seconds(server)  # includes the warm-up calls: a few of thousands
                if protocol == "gRPC raw":
                    r = asyncio.run(load_grpc(target, message, args.requests, conc))
                else:
                    body, headers = bodies[protocol]
                    r = asyncio.run(load_raw(f"{url}/v2/models/{model}/infer", body, args.requests, conc, headers))
                r["cpu_ms"] = (cpu_seconds(server) - used) * 1000 / args.requests
                runs[protocol, conc].append(r)
                print(f"  {model} {protocol} c{conc}: {r['rps']:.0f} req/s, p50 {r['p50_ms']:.1f} ms, "
                      f"p99 {r['p99_ms']:.1f} ms, server CPU {r['cpu_ms']:.2f} ms/request, {r['errors']} errors",
                      flush=True)
    rows = []
    for (protocol, conc), got in runs.items():
        rps = sorted(r["rps"] for r in got)
        med = got[[r["rps"] for r in got].index(rps[len(rps) // 2])]
        spread = f" ({rps[0]:.0f}–{rps[-1]:.0f})" if len(rps) > 1 else ""
        cpu = sorted(r["cpu_ms"] for r in got)[len(got) // 2]
        rows.append(f"| `{model}` | {protocol} | {conc} | {med['rps']:.0f}{spread} | {med['p50_ms']:.2f} | "
                    f"{med['p99_ms']:.2f} | {cpu:.2f} | {sum(r['errors'] for r in got)} |")
    ratios = sorted(g["rps"] / b["rps"] for g, b in zip(runs["gRPC raw", 32], runs["REST binary", 32]))
    return rows, (f"`{model}`: gRPC raw / REST binary at concurrency 32, round by round: "
                  f"{', '.join(f'{v:.2f}' for v in ratios)} (median {ratios[len(ratios) // 2]:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    ap.add_argument("--models", default="pointer_sort,bahdanau", help="comma-separated served models")
    ap.add_argument("--requests", type=int, default=2000, help="requests per protocol, concurrency and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (medians and ranges over them)")
    ap.add_argument("--server-args", default="", help="extra `attnzoo serve` options")
    args = ap.parse_args()
    missing = [m for m in args.models.split(",") if not (args.repository / m).is_dir()]
    if missing:
        raise cli_errors.ScriptError(f"{args.repository} has no {', '.join(missing)}; publish them (`dvc repro "
                                     f"publish@{missing[0]}`) or pass --repository and --models")
    proc, url, target = start(args.repository, args.server_args)
    try:
        results = [run_model(args, proc.pid, url, target, m) for m in args.models.split(",")]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    cpu = platform.processor() or platform.machine()
    print(f"\nmachine: {cpu}, {os.cpu_count()} CPU cores, Python {platform.python_version()}; one server process; "
          f"load generator on the same machine; {args.requests} requests per cell, {args.rounds} rounds (median, "
          "range of req/s)\n")
    print("| model | protocol | concurrency | req/s | p50 ms | p99 ms | server CPU ms/request | errors |\n"
          "|---|---|---|---|---|---|---|---|")
    print("\n".join(row for rows, _ in results for row in rows))
    print("\n" + "\n".join(line for _, line in results))


if __name__ == "__main__":
    cli_errors.run(main)
