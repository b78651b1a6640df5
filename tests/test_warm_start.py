"""The warm starter (pipeline/runner/warm.py): a forked stage sees what a shell-started one sees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import ROOT
from pipeline.runner.warm import Forked, Starter, forkable
from tests.conftest import wait_for

pytestmark = pytest.mark.integration  # starts processes


def stage_env(threads: int) -> dict[str, str]:
    """What LocalExecutor gives a stage of ``threads`` threads, less its name (executors._stage_env)."""
    env = {**os.environ, **{v: str(threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env.pop("DVC_STAGE", None)
    return env


@pytest.mark.parametrize("threads", [1, 2])
def test_a_forked_stage_sees_its_own_argv_env_session_and_exit_code(tmp_path, threads):
    env = stage_env(threads)
    starter = Starter(ROOT, env, tmp_path / "starter.log")
    try:
        log = tmp_path / "probe.log"
        log.write_text("# header\n")
        child = starter.spawn(["tests.warm_probe", "3"], {**env, "DVC_STAGE": "probe@x"}, log)
        assert child.wait(timeout=120) == 3
    finally:
        starter.close()
    lines = log.read_text().splitlines()
    assert lines[0] == "# header"  # the runner's header line is kept: the child appends
    got = json.loads(lines[1])
    fresh = json.loads(subprocess.run([sys.executable, "-m", "tests.warm_probe", "0"], cwd=ROOT, capture_output=True,
                                      text=True, env={**env, "DVC_STAGE": "probe@x"}).stdout)
    assert got["argv"] == [str(ROOT / "tests" / "warm_probe.py"), "3"] == [fresh["argv"][0], "3"]
    assert got["cwd"] == fresh["cwd"] == str(ROOT)
    assert got["stage"] == "probe@x" and got["main"] == fresh["main"] == "__main__"
    assert got["threads"] == fresh["threads"] == threads
    assert got["session_leader"] and got["stdin"] == ""
    assert got["sum"] == fresh["sum"]


def test_a_stage_error_is_a_traceback_in_its_log_and_a_stop_signal_reaches_its_group(tmp_path):
    env = stage_env(1)
    starter = Starter(ROOT, env, tmp_path / "starter.log")
    try:
        failed_log, sleeping_log = tmp_path / "raise.log", tmp_path / "sleep.log"
        failed = starter.spawn(["tests.warm_probe", "raise"], {**env, "DVC_STAGE": "probe@raise"}, failed_log)
        sleeping = starter.spawn(["tests.warm_probe", "sleep"], {**env, "DVC_STAGE": "train@a_long_name"}, sleeping_log)
        assert failed.wait(timeout=120) == 1
        assert "ValueError: the probe's own error" in failed_log.read_text()

        def printed() -> str:
            assert sleeping.poll() is None
            sleeping.starter.pump(0.1)
            return sleeping_log.read_text()

        assert wait_for(printed, 120), "the sleeping stage wrote nothing to its log in 120 s"
        assert open(f"/proc/{sleeping.pid}/comm").read().strip() == "train@a_long_na"  # its first 15 bytes: ps and top
        with pytest.raises(subprocess.TimeoutExpired):
            sleeping.wait(timeout=0.5)
        os.killpg(sleeping.pid, signal.SIGTERM)  # what LocalExecutor.stop sends
        assert sleeping.wait(timeout=30) == -signal.SIGTERM
    finally:
        starter.close()
    assert starter.proc.returncode == 0  # it left when its stdin closed


@pytest.fixture(scope="module")
def one_thread_starter(tmp_path_factory):
    """A starter for one-thread stages, shared by tests whose children leave it as it was."""
    starter = Starter(ROOT, stage_env(1), tmp_path_factory.mktemp("starter") / "starter.log")
    yield starter
    starter.close()


@pytest.mark.parametrize(("mode", "status"), [("exit-work", 1), ("interrupt", -signal.SIGINT), ("raise", 1), ("0", 0)])
def test_a_forked_stage_exits_as_python_m_does(tmp_path, mode, status, one_thread_starter):
    """The child skips the interpreter's teardown (seconds a stage) but not what a stage can see: its
    exit status, a message or traceback, its threads joined, its atexit handlers, its buffered output;
    the log after the probe's first line is what a fresh ``python -m`` writes (a traceback's frames aside)."""
    env = stage_env(1)
    log = tmp_path / "forked.log"
    assert one_thread_starter.spawn(["tests.warm_probe", mode], env, log).wait(timeout=120) == status
    with (tmp_path / "fresh.log").open("w") as fresh:
        assert subprocess.run([sys.executable, "-m", "tests.warm_probe", mode], cwd=ROOT, env=env, stdout=fresh,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode == status
    def told(text: str) -> list[str]:  # after the probe's first line; a traceback's frames differ (the starter's)
        return [line for line in text.splitlines()[1:] if not line.startswith(" ")]

    forked, fresh = told(log.read_text()), told((tmp_path / "fresh.log").read_text())
    assert forked == fresh
    if mode == "exit-work":
        text = "\n".join(forked)
        assert "the probe's exit message" in text and "buffered, not flushed" in text
        assert text.index("the thread's last line") < text.index("an atexit handler ran")


def test_the_starter_gone_its_running_stage_is_reported_failed_once_it_has_exited(tmp_path):
    env = stage_env(1)
    starter = Starter(ROOT, env, tmp_path / "starter.log")
    log = tmp_path / "sleep.log"
    child = starter.spawn(["tests.warm_probe", "sleep"], env, log)
    starter.proc.kill()
    starter.proc.wait()
    assert child.poll() is None  # still running, as an orphan
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == 1
    assert "the warm starter died; this stage's exit status is unknown" in log.read_text()


@pytest.mark.parametrize(("cmd", "argv"), [
    ("python -m pipeline.stages.train bahdanau", ["pipeline.stages.train", "bahdanau"]),
    ("python -m pipeline.stages.report  translation_de_en", ["pipeline.stages.report", "translation_de_en"]),
    ("python -m pipeline.stages.train a && rm -rf b", None),  # shell syntax: the shell's
    ("python -m pipeline.stages.train $HOME", None),
    ("python3 -m pipeline.stages.train a", None),  # another interpreter than the stage env's `python`
    ("python -m other.module a", None),
    ("torchrun -m pipeline.stages.train a", None),
])
def test_only_plain_stage_commands_are_forked(cmd, argv):
    assert forkable(cmd) == argv


def test_the_executor_forks_stage_commands_and_runs_the_rest_through_the_shell(tmp_path):
    """``LocalExecutor``: a ``python -m pipeline.stages.*`` command is forked by a starter, a shell
    command is not; and once the starter is gone (killed here, as the kernel's OOM killer would),
    the next stage runs through the shell as before."""
    from pipeline.runner.executors import LocalExecutor
    from pipeline.runner.plan import Node

    def run(executor: LocalExecutor, cmd: str, name: str) -> tuple[int, str, str]:
        log = tmp_path / f"{name}.log"
        executor.start(Node(name=name, cmd=cmd, upstream=set(), kind=name.split("@")[0], changed=True), log)
        how = "forked" if isinstance(executor.procs[name][0], Forked) else "shell"
        deadline = time.monotonic() + 120
        while not (done := executor.finished(0.5)):
            assert time.monotonic() < deadline
        ((_, rc, _),) = done
        return rc, log.read_text(), how

    probe = "python -m pipeline.stages.task_code --help"
    executor = LocalExecutor(ROOT, jobs=1)
    try:
        assert run(executor, probe, "task_code@forked")[::2] == (0, "forked")
        rc, log, how = run(executor, "echo $DVC_STAGE", "report@shell")
        assert (rc, how, log.splitlines()[-1]) == (0, "shell", "report@shell")

        (starter,) = executor.starters.values()
        starter.proc.kill()
        starter.proc.wait()
        rc, log, how = run(executor, probe, "task_code@after")
        assert (rc, how) == (0, "shell") and "usage:" in log
        assert list(executor.starters.values()) == [None]  # the shell's, from now on
    finally:
        executor.stop()
    assert not executor.starters
