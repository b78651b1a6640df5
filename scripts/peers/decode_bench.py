"""Whole-test-set beam decoding: CTranslate2 against attnzoo's ONNX Runtime loop and its server.

Every engine translates the same German test sentences (text in, text out: SentencePiece
encoding and decoding are timed too, as the server does them) with beam 5, at batch 1 and batch 32,
fp32 and int8, on 1 and 2 threads:

* ``ctranslate2``: ``ctranslate2.Translator`` on attnzoo's weights converted by
  ``scripts/peers/ctranslate2_convert.py`` (int8: CTranslate2's own int8 quantisation);
* ``onnx``: ``serving.client.LocalClient`` on the newest published version (``transformer``, int8:
  ``transformer-int8``) with ONNX Runtime: the server's decoding loop over its graphs, in this process;
* ``attnzoo-ct2``: the same version as published, served by CTranslate2 (``engine: ctranslate2``),
  where it is;
* ``server`` / ``server-ct2``: those versions through ``attnzoo serve`` on loopback, one request of
  ``batch`` texts at a time.

Run ``ctranslate2`` and ``attnzoo-ct2`` in separate invocations (``--engines``): two CTranslate2
models that have both translated in one process halve each other's speed (measured: 153 against 74
sentences/s; OpenMP thread teams), so one process holds one of them.

Reports sentences/s per cell, each figure the median of ``--repeats`` runs taken in turn after each
engine translated two sentences (loading), and the share of sentences whose output equals the ONNX
loop's at the same precision.

    python scripts/peers/decode_bench.py [--ct2 CT2_DIR] [--ct2-int8 CT2_INT8_DIR] [--sentences N] [--json OUT]
    python scripts/peers/decode_bench.py --all --json docs/peers_decode.json   # the docs' eight runs
    python scripts/peers/decode_bench.py --table docs/peers_decode.json        # their table
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import bench_peak  # noqa: E402  (the CPU's name, family and model)
import cli_errors  # noqa: E402

DATA = ROOT / "data" / "prepared" / "translation_de_en"
MODEL = "transformer"


def test_texts(limit: int | None) -> list[str]:
    from pipeline.tasks.translation_de_en import TranslationTask

    texts = [it["src_text"] for it in TranslationTask().load(DATA, "test")]
    return texts[:limit] if limit else texts


def batches(texts: list[str], size: int) -> list[list[str]]:
    return [texts[i : i + size] for i in range(0, len(texts), size)]


class CT2:
    """A CTranslate2 model folder, text in and out (SentencePiece on both sides); ``source_eos``: its
    sources end with ``</s>``, as attnzoo's do (OpenNMT-py's do not)."""

    def __init__(self, folder: Path, threads: int, compute_type: str, beam: int, max_len: int,
                 source_eos: bool = True):
        import ctranslate2
        import sentencepiece as spm

        self.tr = ctranslate2.Translator(str(folder), device="cpu", intra_threads=threads, inter_threads=1,
                                         compute_type=compute_type)
        self.src = spm.SentencePieceProcessor(model_file=str(DATA / "spm.de.model"))
        self.tgt = spm.SentencePieceProcessor(model_file=str(DATA / "spm.en.model"))
        self.beam, self.max_len, self.eos = beam, max_len, ["</s>"] if source_eos else []

    def __call__(self, texts: list[str]) -> list[str]:
        pieces = [p + self.eos for p in self.src.encode(texts, out_type=str)]
        out = self.tr.translate_batch(pieces, beam_size=self.beam, max_decoding_length=self.max_len,
                                      length_penalty=1.0)
        return [self.tgt.decode_pieces(r.hypotheses[0]) for r in out]


class Local:
    """A published version through ``LocalClient`` (the server's model in this process)."""

    def __init__(self, repository: Path, name: str, threads: int, version: int | None):
        from serving.client import LocalClient

        self.client, self.name, self.version = LocalClient(repository, threads=threads), name, version

    def __call__(self, texts: list[str]) -> list[str]:
        return [r["translation"] for r in self.client.translate(self.name, texts, version=self.version)]


class Served(Local):
    """A published version through ``attnzoo serve`` on loopback."""

    def __init__(self, url: str, name: str, version: int | None):
        from serving.client import Client

        self.client, self.name, self.version = Client(url), name, version


def newest(repository: Path, name: str) -> Path:
    """The newest published version of ``name``."""
    found = sorted((repository / name).glob("*/metadata.json"), key=lambda p: int(p.parent.name))
    if not found:
        raise cli_errors.ScriptError(f"{repository / name} holds no version: run `dvc repro publish@{MODEL}` "
                                     "first")
    return found[-1].parent


def side_by_side(repository: Path, name: str, out: Path) -> dict[str, int]:
    """A repository in ``out`` holding the newest version of ``name`` twice, so that both engines decode
    the same weights: as published (version 2, its engine) and with the engine left out of its serving
    block (version 1: the ONNX Runtime loop over the same version's graphs). {engine: version}."""
    import shutil

    source = newest(repository, name)
    meta = json.loads((source / "metadata.json").read_text())
    engine = meta["serving"].get("engine", "onnxruntime")
    shutil.copytree(source, out / name / "1")
    if engine == "onnxruntime":
        return {"onnxruntime": 1}
    shutil.copytree(source, out / name / "2")
    meta["serving"] = {k: v for k, v in meta["serving"].items() if k not in ("engine", engine)}
    (out / name / "1" / "metadata.json").write_text(json.dumps(meta))  # not among the files a server verifies
    return {"onnxruntime": 1, engine: 2}


def machine() -> str:
    """The CPU the rows were measured on (model name, family and model, as scripts/bench_peak.py reads them: a
    Zen 4 and a Zen 5 EPYC differ 1.6x on the same work) and its core count."""
    info = bench_peak.cpu_info()
    family = f", family {info['family']} model {info['model']}" if info.get("family") else ""
    return f"{info['model_name'] or platform.machine()}{family}, {os.cpu_count()} cores"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(repository: Path, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "serving.server", "--repository", str(repository), "--host",
                             "127.0.0.1", "--port", str(port), "--loop-ort-threads", str(threads),
                             "--ort-threads", str(threads), "--no-playground"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    for _ in range(600):
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready in 120 s")


def run(engine, texts: list[str], size: int) -> tuple[float, list[str]]:
    start, out = time.perf_counter(), []
    for chunk in batches(texts, size):
        out += engine(chunk)
    return time.perf_counter() - start, out


def bench(args, scratch: Path) -> list[dict]:
    rows = []
    texts = test_texts(args.sentences)
    for threads in args.threads:
        for precision in args.precisions:
            ct2_dir = args.ct2 if precision == "fp32" else args.ct2_int8
            name = MODEL if precision == "fp32" else f"{MODEL}-int8"
            repository = scratch / f"{name}-{threads}"
            versions = side_by_side(args.repository, name, repository)
            engines = {"ctranslate2": CT2(ct2_dir, threads, "float32" if precision == "fp32" else "int8",
                                          args.beam, args.max_len),
                       "onnx": Local(repository, name, threads, versions["onnxruntime"])}
            if "ctranslate2" in versions:  # served by CTranslate2 as published (`engine: ctranslate2`)
                engines["attnzoo-ct2"] = Local(repository, name, threads, versions["ctranslate2"])
            server = None
            if {"server", "server-ct2"} & set(args.engines):
                server, url = start_server(repository, threads)
                engines["server"] = Served(url, name, versions["onnxruntime"])
                if "ctranslate2" in versions:
                    engines["server-ct2"] = Served(url, name, versions["ctranslate2"])
            engines = {k: v for k, v in engines.items() if k in args.engines}
            try:
                for size in args.batch:
                    times: dict[str, list[float]] = {k: [] for k in engines}
                    outputs: dict[str, list[str]] = {}
                    for engine in engines.values():  # loaded (a client loads a version on first use), not timed
                        engine(texts[:2])
                    for _ in range(args.repeats):  # engines in turn: drift hits them alike
                        for key, engine in engines.items():
                            seconds, outputs[key] = run(engine, texts, size)
                            times[key].append(seconds)
                    ref = outputs.get("onnx")
                    for key in engines:
                        sec = statistics.median(times[key])
                        row = {"engine": key, "precision": precision, "threads": threads, "batch": size,
                               "sentences": len(texts), "seconds": round(sec, 2),
                               "sentences_per_s": round(len(texts) / sec, 1),
                               "same_as_onnx": None if ref is None else
                               round(sum(a == b for a, b in zip(outputs[key], ref)) / len(texts), 4)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            finally:
                if server is not None:
                    server.terminate()
                    server.wait(timeout=30)
    return rows


# docs/benchmarks.md's runs, in order: (threads, precision, engines). One CTranslate2 model a process, so
# CTranslate2 and attnzoo's CTranslate2 engine never share one; the ONNX loop runs beside either.
PLAN = [(1, "fp32", ["ctranslate2", "onnx"]), (1, "fp32", ["attnzoo-ct2"]),
        (1, "int8", ["ctranslate2", "onnx"]), (1, "int8", ["attnzoo-ct2"]),
        (2, "int8", ["onnx", "attnzoo-ct2", "server-ct2"]), (2, "int8", ["ctranslate2", "onnx"]),
        (2, "fp32", ["ctranslate2", "onnx", "server"]), (2, "fp32", ["onnx", "attnzoo-ct2", "server-ct2"])]


def run_plan(argv: list[str]) -> None:
    """``--all``: each of :data:`PLAN`'s runs as a process of its own, with the caller's other arguments."""
    for i, (threads, precision, engines) in enumerate(PLAN, 1):
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--threads", str(threads),
               "--precisions", precision, "--engines", *engines]
        print(f"run {i} of {len(PLAN)}: {' '.join(cmd[2:])}", flush=True)
        if subprocess.run(cmd).returncode:
            raise SystemExit(f"decode_bench: run {i} failed; the runs before it are in the --json file")


def add_run(path: Path, rows: list[dict]) -> None:
    """Add ``rows`` to ``path`` as its next run, with the machine and library versions they were measured with
    (one machine a file: the table compares its runs)."""
    import ctranslate2
    import onnxruntime

    runs = json.loads(path.read_text()) if path.exists() else {"rows": []}
    run = max((r["run"] for r in runs["rows"]), default=0) + 1
    runs.update(machine=machine(), ctranslate2=ctranslate2.__version__, onnxruntime=onnxruntime.__version__)
    runs["rows"] += [{**row, "run": run} for row in rows]
    path.write_text(json.dumps(runs, indent=1) + "\n")


ENGINES = {"ctranslate2": "CTranslate2 {ctranslate2}", "attnzoo-ct2": "attnzoo, CTranslate2 engine (`LocalClient`)",
           "server-ct2": "attnzoo server, CTranslate2 engine", "onnx": "attnzoo, ONNX Runtime loop (`LocalClient`)",
           "server": "attnzoo server, ONNX Runtime loop"}
CELLS = [("fp32", 32), ("fp32", 1), ("int8", 32), ("int8", 1)]


def table(runs: dict) -> str:
    """docs/benchmarks.md's decode table from the runs of a ``--json`` file (``{"ctranslate2": version, "rows":
    [...]}``, each row with its ``run``): sentences/s at the highest / lowest thread count measured, the fastest engine
    of each column in bold, and the share of sentences translated as by the ONNX loop (batch 32). Where two runs
    measured one cell (the ONNX loop runs beside each engine), the later run's row is shown."""
    ordered = sorted(runs["rows"], key=lambda r: r["run"])
    cell = {(r["engine"], r["precision"], r["batch"], r["threads"]): r for r in ordered}
    threads = sorted({t for *_, t in cell}, reverse=True)
    best = {(p, b, t): max(r["sentences_per_s"] for (_, p2, b2, t2), r in cell.items() if (p2, b2, t2) == (p, b, t))
            for _, p, b, t in cell}

    def speed(engine: str, p: str, b: int) -> str:
        out = []
        for t in threads:
            r = cell.get((engine, p, b, t))
            out.append("—" if r is None else f"**{r['sentences_per_s']}**" if r["sentences_per_s"] == best[p, b, t]
                       else str(r["sentences_per_s"]))
        return " / ".join(out)

    def same(engine: str) -> str:
        shares = []
        for p in ("fp32", "int8"):
            r = next((cell[k] for t in threads if (k := (engine, p, 32, t)) in cell), None)
            shares.append("—" if r is None or r["same_as_onnx"] is None or engine == "onnx"
                          else f"{100 * r['same_as_onnx']:.1f} %")
        return " / ".join(shares)

    per = " / ".join(f"{t} thread{'s' if t > 1 else ''}" for t in threads)
    lines = [f"| engine (sentences/s at {per}) | " + " | ".join(f"{p}, batch {b}" for p, b in CELLS)
             + " | same as the ONNX loop (fp32 / int8) |", "|---" * (len(CELLS) + 2) + "|"]
    for engine, label in ENGINES.items():
        if any(k[0] == engine for k in cell):
            lines.append(f"| {label.format(**runs)} | " + " | ".join(speed(engine, p, b) for p, b in CELLS)
                         + f" | {same(engine)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ct2", type=Path, help="CTranslate2 model of the fp32 weights (default: the newest "
                                              f"{MODEL} version's ctranslate2/ folder)")
    ap.add_argument("--ct2-int8", type=Path, help="CTranslate2 model with int8 weights (default: the newest "
                                                   f"{MODEL}-int8 version's ctranslate2/ folder)")
    ap.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    ap.add_argument("--engines", nargs="+", default=["ctranslate2", "onnx", "server", "server-ct2"])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "int8"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--sentences", type=int, default=None, help="the first N test sentences (default: all)")
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", type=Path, help="add the rows to this file as its next run (a new file: run 1)")
    ap.add_argument("--table", type=Path, metavar="JSON", help="print docs/benchmarks.md's table from the runs "
                    "in JSON (docs/peers_decode.json) and measure nothing")
    ap.add_argument("--all", action="store_true", help="the docs' eight runs, each in its own process (needs --json)")
    args = ap.parse_args(argv)
    if args.all:
        if not args.json:
            ap.error("--all adds its eight runs to a file: give it --json FILE")
        run_plan([a for a in (sys.argv[1:] if argv is None else argv) if a != "--all"])
        return
    if args.json and args.json.exists():
        with contextlib.suppress(ValueError, KeyError):
            if json.loads(args.json.read_text())["machine"] != machine():
                ap.error(f"{args.json} holds runs of another machine; write these to a new file")
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    args.ct2 = args.ct2 or newest(args.repository, MODEL) / "ctranslate2"
    args.ct2_int8 = args.ct2_int8 or newest(args.repository, f"{MODEL}-int8") / "ctranslate2"
    for folder in {args.ct2, args.ct2_int8}:
        if not (folder / "model.bin").exists():
            ap.error(f"{folder} is no CTranslate2 model: convert one with scripts/peers/ctranslate2_convert.py "
                     "and pass it with --ct2 / --ct2-int8")
    if {"ctranslate2", "attnzoo-ct2"} <= set(args.engines):
        ap.error("run --engines ctranslate2 and attnzoo-ct2 in separate invocations (one CTranslate2 model a process)")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(args.threads)))
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        rows = bench(args, Path(scratch))
    if args.json:
        add_run(args.json, rows)


if __name__ == "__main__":
    cli_errors.run(main)
