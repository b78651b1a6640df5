"""Shared fixtures: tiny configs and deterministic synthetic batches for every registered model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent

# Every `dvc` command line starts a detached process that posts usage analytics (0.65 CPU seconds each,
# 30 of them in one `make test` on 2 cores); the tests' own DVC runs send none. Set before any test
# starts a process, so that every process inherits it.
os.environ.setdefault("DVC_NO_ANALYTICS", "1")

# Tiny configs per registered model, the smoke profile's (profiles/smoke.yaml `archs`): a new model is
# covered by adding one entry there and naming the task whose example batch it takes (`examples`).
TINY = yaml.safe_load((ROOT / "profiles" / "smoke.yaml").read_text())["archs"]


# `make test-fast` (ATTNZOO_TEST_FAST=1) runs the tests not marked slow or integration, and holds them
# to that: a test there that starts a process or listens on a socket fails, naming the marker it lacks.
FAST = os.environ.get("ATTNZOO_TEST_FAST") == "1"
# What libraries run to describe the machine (MLflow records the commit; platform.uname asks `uname -p`):
# milliseconds each, and allowed there.
PROBES = {"git", "uname", "ldconfig"}


RUNNING: dict[str, str] = {"test": "a fixture"}


def pytest_runtest_setup(item):
    RUNNING["test"] = item.nodeid


# ATTNZOO_TEST_CPU_LOG=FILE: one JSON line per test with its worker, start time, wall seconds and the CPU
# seconds of this process and of the child processes it waited for (servers, stages), to see where the
# suite's time goes, how much of it waits rather than computes, and when a worker sat idle.
CPU_LOG = os.environ.get("ATTNZOO_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not CPU_LOG:
        yield
        return
    import json
    import resource

    def cpu() -> tuple[float, float]:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime

    started, wall, (own, kids) = time.time(), time.perf_counter(), cpu()
    yield
    own_after, kids_after = cpu()
    with open(CPU_LOG, "a") as log:
        log.write(json.dumps({"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                              "start": round(started, 2), "wall_s": round(time.perf_counter() - wall, 2),
                              "cpu_s": round(own_after - own, 2), "children_cpu_s": round(kids_after - kids, 2)})
                  + "\n")


# `make test` runs the tests that start processes on two pytest-xdist workers (--dist loadgroup
# --no-loadscope-reorder): each module is one unit of work, so its module fixtures are built once; the
# tests that start Ray on this machine without a cluster address are one unit, so two local Ray
# instances never share the machine's default ports. That unit goes first, the end-to-end run (the
# longest test) at its head: it then runs beside everything else rather than after it, and its worker
# is handed no other unit to hold behind it (xdist hands one out when a worker has two tests left).
LOCAL_RAY = "local-ray"
LONGEST = "tests/test_pipeline_smoke.py"


# The unit tests (`make test-fast`, also --dist loadgroup) are handed out one at a time, except those that
# read a module fixture that exports or converts a model once (`BUILDS_ONCE`): those of one module (and
# one architecture, where the fixture takes it) go to one worker, which builds it once (handed out freely,
# a test and the one beside it that reads the same graphs landed on two workers and both exported).
BUILDS_ONCE = {"exported", "converted", "ntm_graphs"}


def _group(item) -> str | None:
    if not FAST:
        return item.module.__name__
    if not BUILDS_ONCE & set(item.fixturenames):
        return None
    arch = getattr(getattr(item, "callspec", None), "params", {}).get("arch")
    return item.module.__name__ if arch is None else f"{item.module.__name__}:{arch}"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.iter_markers("xdist_group")) and (group := _group(item)):
            item.add_marker(pytest.mark.xdist_group(group))
    if FAST:
        return
    items.sort(key=lambda item: (item.get_closest_marker("xdist_group").args[0] != LOCAL_RAY,
                                 not item.nodeid.startswith(LONGEST)))  # stable: the rest keep their order


@pytest.fixture(scope="module")
def numbers_only():
    """For a module whose tests compare a task's metrics and nothing it draws: the figures the task's
    evaluation builds are not rendered to PNG (most of a tiny evaluation's time). tests/test_plots.py
    and the end-to-end run check the plots themselves."""
    from matplotlib.figure import Figure

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "savefig", lambda self, *args, **kwargs: None)
        yield


def one_torchlib_registry(patch: pytest.MonkeyPatch) -> None:
    """torch.onnx.export builds its table of ONNX translations from torchlib on every call (about half
    a second, once per exported graph) and only reads it: one table per test process serves every
    export, with the same bytes written. Stages export a model once per process and keep torch's own."""
    from torch.onnx._internal.exporter import _registration

    build = _registration.ONNXRegistry.from_torchlib.__func__
    built: dict = {}

    def once(cls, *args, **kwargs):
        key = (cls, args, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = build(cls, *args, **kwargs)
        return built[key]

    patch.setattr(_registration.ONNXRegistry, "from_torchlib", classmethod(once))


@pytest.fixture(autouse=True, scope="session")
def _one_torchlib_registry():
    with pytest.MonkeyPatch.context() as patch:
        one_torchlib_registry(patch)
        yield


@pytest.fixture(autouse=True)
def _no_tracking_uri_left_behind():
    """``mlflow.set_tracking_uri`` (``pipeline.tracking.setup`` calls it) is process-global and outranks
    MLFLOW_TRACKING_URI: left set, it sends a later test on the same worker to an earlier test's store, e.g. a
    module's server that has since stopped ("connection refused" for the minutes of MLflow's retries). Each test
    ends with none set and the variable as it found it (clearing the URI unsets the variable)."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return
    mlflow.set_tracking_uri(None)
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture(autouse=True, scope="session")
def _fast_lane_starts_nothing():
    """Session-wide, so a module's or the session's fixtures (a server, a published repository) are held
    to it too."""
    if not FAST:
        yield
        return
    import socket

    def refuse(what):
        raise RuntimeError(f"{RUNNING['test']} {what} in the fast lane: mark it pytest.mark.integration "
                           "(make test runs it)")

    popen = subprocess.Popen.__init__

    def probes_only(self, args, *rest, **kwargs):
        program = (args.split()[0] if isinstance(args, str) else os.fspath(args[0])) if args else ""
        if os.path.basename(program) not in PROBES:
            refuse(f"starts a process ({os.path.basename(program)})")
        popen(self, args, *rest, **kwargs)

    def no_listen(self, *args):
        refuse("listens on a socket")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", probes_only)
        patch.setattr(socket.socket, "listen", no_listen)
        yield


SEQ2SEQ = ("bahdanau", "luong", "transformer")  # translation batches: src, src_len, tgt_in, tgt_out
# The task each architecture's tiny configuration fits (profiles/smoke.yaml `examples`).
EXAMPLES = yaml.safe_load((ROOT / "profiles" / "smoke.yaml").read_text())["examples"]


def tiny_batch(arch: str, seed: int = 0, batch: int = 3) -> dict[str, torch.Tensor]:
    """A deterministic batch in the format the model's task produces: the task's own example."""
    from pipeline.tasks import get_task

    return get_task(EXAMPLES[arch]).example_batch(TINY[arch], seed, batch)


@pytest.fixture(params=sorted(TINY))
def arch(request):
    return request.param


@pytest.fixture
def save_last(tmp_path):
    """``save_last(state)`` writes tmp_path/last as a training's ``save_last`` does (a tiny NTM, an optimizer
    that has taken a step so it has state to save, numpy's RNG state among ``state``, as in a real run) and
    returns (model, optimizer, scheduler)."""
    def write(state: dict):
        from models import build
        from pipeline.checkpoint import save
        from pipeline.config import RunConfig, TrainConfig
        from pipeline.training.resume import rng_state

        torch.manual_seed(0)
        model = build("ntm", TINY["ntm"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        run = RunConfig(name="t", arch="ntm", task="copy", model=TINY["ntm"], train=TrainConfig(),
                        data_dir=tmp_path, run_dir=tmp_path)
        save(tmp_path / "last", model, run, optimizer, scheduler, {**state, "rng": [rng_state()]})
        return model, optimizer, scheduler

    return write


# The tiny copy task the tests prepare for a tiny NTM (ntm_copy_root, a repository copy's CLI and Ray runs).
TINY_COPY_TASK = {"seed": 1, "bits": 4, "min_len": 1, "max_len": 4, "train_size": 96, "val_size": 16, "test_size": 4,
                  "test_lengths": [4]}


@pytest.fixture
def ntm_copy_root(tmp_path, monkeypatch):
    """A repository root for a tiny NTM on a tiny copy task: 8 steps of 8, validated every 4, lr 0.01."""
    from pipeline.stages.prepare import prepare

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    prepare("copy", TINY_COPY_TASK, tmp_path / "data" / "prepared" / "copy")
    model = {k: v for k, v in TINY["ntm"].items() if k not in ("input_size", "output_size")}
    params = {"train": {}, "models": {"ntm": {"arch": "ntm", "task": "copy", "model": model, "train": {
        "max_steps": 8, "eval_every": 4, "log_every": 2, "batch_size": 8, "warmup_steps": 1, "lr": 0.01}}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp_path


def copy_repo(dest: Path) -> Path:
    """Copy the repository's tracked and untracked-not-ignored files (no venv, data, runs)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def wait_for(check, timeout_s: float, every_s: float = 0.05):
    """``check()`` every ``every_s`` until it is truthy (returned) or ``timeout_s`` passes (None).

    ``check`` runs at least once and once more after the last sleep, so a timeout of 0 still looks
    (the fuzz log's ``exception_after`` asks for that) and what became true during the last sleep counts."""
    end = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= end:
            return None
        time.sleep(every_s)


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM a server the test started, and SIGKILL it if it has not exited ``timeout`` s later."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def venv_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'mlflow.db'}"
    env["PYTHONPATH"] = str(tmp)
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture(scope="session")
def smoke_translation(tmp_path_factory) -> Path:
    """The smoke profile's German-English pairs, prepared as the translation task prepares a user's
    corpus (SentencePiece models, splits, manifest): a data/prepared/translation_de_en folder."""
    from pipeline.stages.prepare import prepare

    out = tmp_path_factory.mktemp("translation") / "data"
    prepare("translation_de_en", {"seed": 3, "vocab_size": 400, "corpus": str(ROOT / "profiles" / "smoke_de_en.tsv"),
                                  "val_size": 40, "test_size": 40, "max_doc_share": 0.2,
                                  "clean": {"min_words": 3, "max_words": 40}}, out)
    return out


def trained_looking_transformer(data: Path, seed: int = 5, scale: float = 0.2):
    """A tiny Transformer over ``data``'s vocabularies whose weights are perturbed away from the
    initialisation, so that its answers vary with the input (an untrained one emits one token)."""
    import sentencepiece as spm

    import models

    size = {s: spm.SentencePieceProcessor(model_file=str(data / f"spm.{s}.model")).get_piece_size()
            for s in ("de", "en")}
    torch.manual_seed(seed)
    model = models.build("transformer", {"src_vocab": size["de"], "tgt_vocab": size["en"], "dim": 32, "heads": 4,
                                         "ff_dim": 64, "enc_layers": 2, "dec_layers": 2, "max_len": 20}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def shared_dir(tmp_path_factory) -> Path | None:
    """A folder every test process of this run sees: `make test` names one per run (ATTNZOO_TEST_SHARED,
    removed after it); pytest-xdist's workers share their session's; a lone pytest shares nothing."""
    if os.environ.get("ATTNZOO_TEST_SHARED"):
        return Path(os.environ["ATTNZOO_TEST_SHARED"])
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.getbasetemp().parent
    return None


@pytest.fixture(scope="session")
def published(tmp_path_factory):
    """A tiny model repository with every kind of served model (tests/serving_repo.py), built once
    per run by the first test process that asks (the others wait for it, then rebuild only the seeded
    models) and shared by the serving test modules (none of them writes to it)."""
    from filelock import FileLock  # a dependency of torch

    from tests.serving_repo import build_published

    shared = shared_dir(tmp_path_factory)
    if shared is None:
        return build_published(tmp_path_factory.mktemp("publish"))
    folder = shared / "published"
    with FileLock(str(shared / "published.lock")):
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that did not finish
            folder.mkdir(parents=True)
            build_published(folder)
            (folder / ".built").touch()
    return build_published(folder, build=False)


class Planted:
    """A pickle that runs code when it is unpickled: it writes the file named at planting time. What a
    hostile checkpoint, packed case or MLflow model could hold; the tests show it is never loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))
