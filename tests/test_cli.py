"""User-facing failures end in one sentence and exit code 2, and never touch earlier outputs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import models
from pipeline.checkpoint import load_model, save
from pipeline.config import RunConfig, TrainConfig, UserError
from tests.conftest import ROOT, TINY


def cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, capture_output=True, text=True)


def test_unknown_model_entry_is_one_line():
    proc = cli("train", "no_such_model")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: unknown model entry 'no_such_model'")
    assert "Traceback" not in proc.stderr


def test_bad_override_key_is_one_line():
    proc = cli("train", "ntm", "--set", "memroy_size=3")
    assert proc.returncode == 2
    if "prepare" in proc.stderr:  # data not prepared in this checkout: that error is also one line
        assert "dvc repro prepare" in proc.stderr
    else:
        assert "unknown config key(s) ['memroy_size']" in proc.stderr
    assert "Traceback" not in proc.stderr


def _run(tmp_path):
    return RunConfig(name="t", arch="ntm", task="copy", model=TINY["ntm"], train=TrainConfig(),
                     data_dir=tmp_path, run_dir=tmp_path)


def test_checkpoint_roundtrip_and_corruption(tmp_path):
    torch.manual_seed(0)
    model = models.build("ntm", TINY["ntm"])
    save(tmp_path / "best", model, _run(tmp_path))
    loaded, config = load_model(tmp_path / "best")
    assert config["arch"] == "ntm"
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    (tmp_path / "best" / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="is corrupt"):
        load_model(tmp_path / "best")
    assert (tmp_path / "best" / "config.json").exists()  # nothing deleted
    with pytest.raises(UserError, match="no checkpoint"):
        load_model(tmp_path / "missing")


def test_usage_without_stage():
    proc = cli()
    assert proc.returncode == 2 and "usage: attnzoo" in proc.stdout
