"""One ``attnzoo repro`` per repository at a time: a second one started beside it stops at once with
one sentence and runs nothing, and a run killed with SIGKILL leaves no lock behind. Real runs of the
runner (``python -m pipeline.runner.cli repro``) in a smoke-profile copy of the repository."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pipeline import profiles
from tests.conftest import wait_for

pytestmark = pytest.mark.slow
TARGET = "train@rnn_parity"


def _runner(work, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.runner.cli", "repro", "--jobs", "1", *args], cwd=work,
                            env=profiles.env_for(work), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)


def _holding(work, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until ``proc`` holds the runner lock (its pid is written in it)."""
    lock = work / ".dvc" / "tmp" / "repro.lock"

    def held() -> bool:
        if lock.exists() and lock.read_text().startswith(f"pid {proc.pid},"):
            return True
        assert proc.poll() is None, proc.communicate()
        return False

    assert wait_for(held, timeout), "the first run never took the lock"


def test_a_second_repro_stops_with_one_sentence_and_a_killed_one_leaves_no_lock(tmp_path):
    work = profiles.lay_out(profiles.ROOT, tmp_path / "work", "smoke", keep=["rnn_parity"])
    first = _runner(work, TARGET)
    try:
        _holding(work, first)
        os.killpg(first.pid, signal.SIGSTOP)  # frozen while holding the lock: it cannot finish first
        second = subprocess.run([sys.executable, "-m", "pipeline.runner.cli", "repro", "--jobs", "1", TARGET], cwd=work,
                                env=profiles.env_for(work), capture_output=True, text=True, timeout=300)
        os.killpg(first.pid, signal.SIGCONT)
        assert second.returncode == 2, second.stdout + second.stderr
        assert second.stderr.startswith(f"error: another attnzoo repro (pid {first.pid}, started "), second.stderr
        assert len(second.stderr.strip().splitlines()) == 1 and "Traceback" not in second.stderr
        assert "Running" not in second.stdout and "started" not in second.stdout, second.stdout  # it ran nothing
        out, err = first.communicate(timeout=600)
        assert first.returncode == 0, out[-3000:] + err[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()

    # Killed with SIGKILL while holding the lock (stages and all): the next run takes it and runs.
    (work / "params.yaml").write_text((work / "params.yaml").read_text().replace("max_steps: 12", "max_steps: 13"))
    killed = _runner(work, TARGET)
    _holding(work, killed)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    after = subprocess.run([sys.executable, "-m", "pipeline.runner.cli", "repro", "--jobs", "1", TARGET], cwd=work,
                           env=profiles.env_for(work), capture_output=True, text=True, timeout=600)
    assert after.returncode == 0, after.stdout[-3000:] + after.stderr[-3000:]
    assert "another attnzoo repro" not in after.stderr
