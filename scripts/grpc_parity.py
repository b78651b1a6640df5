"""NVIDIA's tritonclient.grpc against `attnzoo serve --grpc-port` on a published repository (not a
test: a check of real models): the newest version of every served whole model whose task has a sample input in
examples/ (``examples/<task>.json``; text models: one German sentence) is asked over gRPC and over
REST, and the answers must be equal, integers and text exactly, floats within 1e-6.

    python scripts/grpc_parity.py --repository model_repository

This process imports tritonclient's generated gRPC messages and never serving/grpc's (protobuf
refuses the same messages twice); the server runs in its own process. Exit status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import cli_errors
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from scripts.bench_protocols import sample as sample_request  # noqa: E402
from serving.client import Client, ServerError  # noqa: E402


def _ports() -> list[int]:
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


def same(got: np.ndarray, want: np.ndarray) -> bool:
    got = np.array([v.decode() for v in got.ravel()], dtype=object).reshape(got.shape) if got.dtype == object else got
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.dtype.kind in "fc":
        return bool(np.allclose(got, want, rtol=0, atol=1e-6, equal_nan=True))
    return bool(np.array_equal(got, want))


def check(repo: Path, rest: Client, target: str) -> int:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    triton, bad = grpcclient.InferenceServerClient(url=target), 0
    newest: dict[str, int] = {}  # each model's newest version, asked for by number (promoted or not)
    for entry in rest.call("POST", "/v2/repository/index", {}):
        newest[entry["name"]] = max(newest.get(entry["name"], 0), int(entry["version"]))
    for name, version in sorted(newest.items()):
        sample = sample_request(repo, rest, name, version)
        if sample is None:
            if "." not in name:  # a graph of a model: asked through its model
                print(f"{name}: no sample input in examples/ for its task; skipped")
            continue
        inputs, params = sample
        tensors = []
        for key, array in inputs.items():
            tensors.append(grpcclient.InferInput(key, list(array.shape), np_to_triton_dtype(array.dtype)))
            tensors[-1].set_data_from_numpy(array)
        try:
            result = triton.infer(name, tensors, str(version), parameters=params or None, client_timeout=120)
        except InferenceServerException as err:
            result = err
        try:
            want = rest.infer(name, inputs, version, parameters=params or None)
        except ServerError as err:  # the sample does not fit this model: both must refuse it alike
            refused = isinstance(result, InferenceServerException) and result.message() == str(err).split(": ", 1)[1]
            bad += not refused
            print(f"{name}: {'refused alike' if refused else 'DIFFER'} over both ({err})")
            continue
        differ = list(want) if isinstance(result, InferenceServerException) else \
            [o for o in want if not same(result.as_numpy(o), want[o])]
        bad += bool(differ)
        print(f"{name} version {version}: {len(want)} outputs, "
              f"{'equal' if not differ else 'DIFFER: ' + ', '.join(differ)}")
    triton.close()
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    args = ap.parse_args()
    cli_errors.need_module("tritonclient.grpc", "tritonclient[grpc]")
    if not args.repository.is_dir():
        raise cli_errors.ScriptError(f"--repository {args.repository}: no such folder; publish first "
                                     "(`attnzoo repro publish@NAME`)")
    port, grpc_port = _ports()
    proc = subprocess.Popen([sys.executable, "-m", "serving.server", "--repository", str(args.repository), "--port",
                             str(port), "--grpc-port", str(grpc_port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        rest = Client(f"http://127.0.0.1:{port}", timeout=120)
        if not rest.wait_ready(120, alive=lambda: proc.poll() is None):
            raise SystemExit(f"error: the server on {args.repository} did not become ready in 120 s")
        bad = check(args.repository, rest, f"127.0.0.1:{grpc_port}")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    print("every answer equal over gRPC and REST" if not bad else f"{bad} model(s) answered differently")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    cli_errors.run(main)
