"""A profile's work folder: the checkout's code and the profile's params.yaml, never the checkout's outputs.

``pipeline.profiles.lay_out`` copies what git tracks; the outputs ``dvc.yaml`` declares are the work folder's
own (its pipeline makes them), so a committed output copied over a profile's would make DVC re-run the stage
that wrote it. These tests lay out a small git checkout whose ``dvc.yaml`` has a templated and a plain output.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from pipeline import profiles

DVC_YAML = {"stages": {
    "make": {"foreach": "${tasks}", "do": {
        "cmd": "python make.py ${key}",
        "deps": ["code/make.py"],
        "outs": [{"made/${key}.json": {"cache": False}}, "cached/${key}"],
        "metrics": [{"scores/${key}/metrics.json": {"cache": False}}],
    }},
    "summary": {"cmd": "python summary.py", "plots": [{"summary.png": {"cache": False}}]},
}}


def _checkout(root: Path) -> Path:
    files = {
        "dvc.yaml": yaml.safe_dump(DVC_YAML),
        "dvc.lock": "schema: '2.0'\n",
        "params.yaml": yaml.safe_dump({"tasks": {"copy": {}}, "tune": {}, "models": {}}),
        "code/make.py": "print('made')\n",
        "made/copy.json": '{"full": true}\n',
        "scores/copy/metrics.json": '{"acc": 1.0}\n',
        "summary.png": "png",
        "madeup.txt": "not an output: only its name starts like one\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "."], cwd=root, check=True)
    return root


def test_own_outputs_are_read_from_dvc_yaml(tmp_path):
    root = _checkout(tmp_path / "checkout")
    assert profiles.own_outputs(root) == ("cached", "dvc.lock", "made", "scores", "summary.png")


def test_the_repository_outputs_are_all_own_outputs():
    own = profiles.own_outputs(profiles.ROOT)
    for folder in ("runs", "results", "reports", "model_repository", "data/prepared", "data/task_code",
                   "data/provenance", "dvc.lock"):
        assert folder in own
    assert not {"pipeline", "models", "serving", "params.yaml", "dvc.yaml", "data/corpora"} & set(own)


def test_lay_out_copies_code_and_leaves_every_declared_output_out(tmp_path, monkeypatch):
    root = _checkout(tmp_path / "checkout")
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "tiny.yaml").write_text(yaml.safe_dump({"tune": {"num_samples": 1}}))
    monkeypatch.setattr(profiles, "PROFILES", tmp_path / "profiles")
    work = profiles.lay_out(root, tmp_path / "work", "tiny")
    copied = sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file() and ".git" not in p.parts)
    assert copied == ["code/make.py", "dvc.yaml", "madeup.txt", "params.yaml"]
    assert yaml.safe_load((work / "params.yaml").read_text())["tune"] == {"num_samples": 1}
    # Laid out again after the work folder's own pipeline wrote its outputs: they are kept as they are.
    (work / "made").mkdir()
    (work / "made" / "copy.json").write_text('{"smoke": true}\n')
    profiles.lay_out(root, work, "tiny")
    assert (work / "made" / "copy.json").read_text() == '{"smoke": true}\n'
