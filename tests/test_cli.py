"""User-facing failures end in one sentence and exit code 2, and never touch earlier outputs."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

import models
from pipeline.checkpoint import load_model, save
from pipeline.config import RunConfig, TrainConfig, UserError
from pipeline.runner.cli import DESCRIPTIONS
from tests.conftest import ROOT, TINY, TINY_COPY_TASK, Planted, copy_repo


def cli(*args, cwd=ROOT, timeout=300):
    """``attnzoo ARGS...`` as a user runs it, in a fresh process."""
    return subprocess.run([sys.executable, "-m", "pipeline.runner.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.integration
def test_unknown_model_entry_is_one_line():
    proc = cli("train", "no_such_model")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: unknown model entry 'no_such_model'")
    assert "Traceback" not in proc.stderr


@pytest.mark.integration
def test_bad_override_key_is_one_line(tmp_path, monkeypatch):
    """In a checkout whose task data is prepared (the configuration merges the prepared data's facts before it
    checks the keys; without data the sentence names `dvc repro prepare@...`: tests/test_config.py)."""
    from pipeline.stages.prepare import prepare

    repo = copy_repo(tmp_path / "repo")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    prepare("copy", TINY_COPY_TASK, repo / "data" / "prepared" / "copy")
    proc = cli("train", "ntm", "--set", "memroy_size=3", cwd=repo)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and "unknown config key(s) ['memroy_size']" in line, line


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


@pytest.mark.integration
def test_usage_without_stage():
    proc = cli()
    assert proc.returncode == 2 and "usage: attnzoo" in proc.stdout


@pytest.mark.integration
def test_help_lists_every_command_with_a_description_and_version_is_pyprojects():
    import tomllib

    from pipeline.runner.cli import DESCRIPTIONS

    proc = cli("--help")
    assert proc.returncode == 0
    for name, text in DESCRIPTIONS.items():
        assert f"  {name}" in proc.stdout and text in proc.stdout, name
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert cli("--version").stdout.strip() == f"attnzoo {want}"


@pytest.mark.integration
def test_unknown_command_suggests_the_nearest_and_sub_help_names_the_command():
    proc = cli("trian", "ntm")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: unknown command 'trian'; did you mean 'train'? (`attnzoo --help` lists them)"
    proc = cli("train", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: attnzoo train ")


def _parser_of(command: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser ``attnzoo COMMAND`` builds, caught at its ``parse_args`` (nothing runs)."""
    from pipeline.runner.cli import _dispatch

    class Caught(Exception):
        pass

    def catch(parser, *args, **kwargs):
        raise Caught(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    monkeypatch.setattr(sys, "argv", ["attnzoo"])
    with pytest.raises(Caught) as caught:
        _dispatch(command, ["x"])
    return caught.value.args[0]


@pytest.mark.parametrize("command", sorted(DESCRIPTIONS))
def test_every_argument_of_every_command_has_help(command, monkeypatch):
    parser = _parser_of(command, monkeypatch)
    assert parser.prog == f"attnzoo {command}"
    bare = [a.option_strings[-1] if a.option_strings else a.dest for a in parser._actions if not a.help]
    assert not bare, f"attnzoo {command} --help: no help for {bare}"


@pytest.mark.integration
@pytest.mark.parametrize("setting, message", [
    ("lr=abc", "--set lr='abc': lr takes float (e.g. lr=0.001)"),
    ("epochs=2.5", "--set epochs=2.5: epochs takes int (e.g. epochs=10)"),
    ("train.seed=yes", "--set seed=True: seed takes int (e.g. seed=0)"),
])
def test_set_values_are_checked_against_the_config_types(setting, message):
    proc = cli("train", "ntm", "--set", setting)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {message}"


def test_set_reads_scientific_notation_as_a_float():
    # YAML 1.1 (PyYAML) reads 3e-4 without a dot as a string; a user means the float.
    from pipeline.entry import parse_overrides

    assert parse_overrides(["lr=3e-4", "lr_min=1E-6", "attention=none", "hidden=1e3x"]) == {
        "lr": 3e-4, "lr_min": 1e-6, "attention": "none", "hidden": "1e3x"}


def test_set_values_of_the_model_config_are_checked_too():
    from pipeline.entry import check_override_types

    check_override_types("ntm", {"lr": 3, "memory_size": 16, "epochs": 1})  # ints fit float fields
    with pytest.raises(UserError, match="memory_size takes int"):
        check_override_types("ntm", {"memory_size": "big"})


@pytest.mark.integration
def test_list_shows_entries_bar_status_and_published_versions(tmp_path):
    import json

    import yaml

    from pipeline.runner.cli import entries

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"models": {
        "a": {"arch": "ntm", "task": "copy", "bar": [{"metric": "acc", "op": ">=", "value": 1}]},
        "b": {"arch": "act", "task": "parity", "bar": [{"metric": "acc", "op": ">=", "value": 1}]},
        "c": {"arch": "act", "task": "parity", "bar": [{"metric": "acc", "op": ">=", "value": 1}]},
        "d": {"arch": "act", "task": "parity", "bar": []}}}))
    (tmp_path / "results" / "copy").mkdir(parents=True)
    (tmp_path / "results" / "copy" / "a.json").write_text(json.dumps({"bar_passed": True}))
    (tmp_path / "results" / "parity").mkdir(parents=True)
    (tmp_path / "results" / "parity" / "b.json").write_text(json.dumps({"bar_passed": False}))
    for v in ("1", "2", "10", "tmp", "²"):
        (tmp_path / "model_repository" / "a" / v).mkdir(parents=True)
    rows = {r["name"]: r for r in entries(tmp_path)}
    assert rows["a"] == {"name": "a", "arch": "ntm", "task": "copy", "bar": "met", "published": [10, 2, 1]}
    assert rows["d"]["bar"] == "no bar"
    assert (rows["b"]["bar"], rows["b"]["published"]) == ("not met", [])
    assert rows["c"]["bar"] == "not evaluated"
    proc = cli("list", "--json")
    assert proc.returncode == 0
    names = [json.loads(line)["name"] for line in proc.stdout.splitlines()]
    assert names == list(yaml.safe_load((ROOT / "params.yaml").read_text())["models"])


# A serving host's install (pip install "attnzoo[serve]") has no training stack: modules blocked here as
# they are missing there. A finder that refuses them, installed before pipeline.runner.cli runs.
WITHOUT = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
from pipeline.runner.cli import main
main(sys.argv[1:])
"""


def _without(blocked: set[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT.format(blocked=blocked), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.integration
@pytest.mark.parametrize("blocked, args, extra", [
    ({"torch"}, ["train", "ntm"], "train,cpu"),
    ({"torch"}, ["list"], "train,cpu"),
    ({"dvc"}, ["repro", "--dry"], "train,cpu"),
    ({"onnxruntime"}, ["predict", "tiny", '{"x": [[1, 2, 3]]}', "--local"], "serve"),
])
def test_a_command_without_its_extra_names_the_extra_to_install(blocked, args, extra, tmp_path):
    from tests.test_deploy import publish_tiny

    publish_tiny(tmp_path / "repo", tmp_path / "work")
    if args[0] == "predict":
        args = [*args, "--repository", str(tmp_path / "repo")]
    proc = _without(blocked, *args)
    (module,) = blocked
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (f"error: `attnzoo {args[0]}` needs {module}, which is not installed here; install "
                                   f'it with pip install "attnzoo[{extra}]" (in a checkout: make setup)')


@pytest.mark.integration
def test_serving_commands_run_without_the_training_stack(tmp_path):
    """What a serving host runs works with torch, Ray, MLflow and DVC all absent."""
    from tests.test_deploy import TRAINING_STACK, publish_tiny

    publish_tiny(tmp_path / "repo", tmp_path / "work")
    proc = _without(TRAINING_STACK, "predict", "tiny", '{"x": [[1, 2, 3]]}', "--local",
                    "--repository", str(tmp_path / "repo"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == '{"y": [[1.600000023841858, 2.200000047683716]]}'  # [1, 2, 3] @ w, w = arange(6)/10
    helped = _without(TRAINING_STACK, "serve", "--help")
    assert helped.returncode == 0 and "usage: attnzoo serve" in helped.stdout, helped.stderr


def test_a_pulled_trainer_state_is_data_never_code(tmp_path, capsys, save_last):
    """``load_last`` resumes from what ``save`` writes (optimizer, schedule, every RNG state) with
    ``torch.load(weights_only=True)``; a planted ``trainer.pt`` that would run code is refused and the
    run starts fresh (the same file under ``weights_only=False`` does run: the plant is real)."""
    from pipeline.checkpoint import load_last

    model, optimizer, scheduler = save_last({"hash": "h", "step": 7})
    resumed = load_last(tmp_path, "h", models.build("ntm", TINY["ntm"]), optimizer, scheduler)
    assert resumed["step"] == 7 and set(resumed["rng"][0]) == {"torch", "numpy", "python"}
    assert resumed["rng"][0]["numpy"][1].dtype.name == "uint32"  # numpy's state came back as an array

    marker = tmp_path / "pwned"
    torch.save({"optimizer": {}, "scheduler": {}, "state": {"hash": "h", "payload": Planted(marker)}},
               tmp_path / "last" / "trainer.pt")
    assert load_last(tmp_path, "h", model, optimizer, scheduler) is None
    assert not marker.exists()
    out = capsys.readouterr().out
    assert "ignoring checkpoint" in out and "io.open" in out and "starting fresh" in out
    torch.load(tmp_path / "last" / "trainer.pt", weights_only=False)  # what the old loader did
    assert marker.exists()
