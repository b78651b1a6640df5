"""config.resolve: one merge, in the documented order, with clear errors."""

from __future__ import annotations

import json

import pytest
import yaml

from pipeline.config import UserError, resolve


@pytest.fixture
def root(tmp_path):
    data = tmp_path / "data" / "prepared" / "copy"
    data.mkdir(parents=True)
    (data / "manifest.json").write_text(json.dumps({"model_defaults": {"input_size": 5, "output_size": 4}}))
    params = {
        "train": {"lr": 0.1, "batch_size": 8, "epochs": 3},
        "models": {"m": {"arch": "ntm", "task": "copy", "model": {"memory_size": 16, "output_size": 7},
                         "train": {"lr": 0.2}}},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp_path


def test_priority_order(root):
    run = resolve("m", root=root)
    assert run.model["input_size"] == 5  # task fact
    assert run.model["output_size"] == 7  # params model section beats the task fact
    assert run.model["memory_size"] == 16
    assert run.train.lr == 0.2 and run.train.batch_size == 8 and run.train.epochs == 3
    assert run.train.grad_clip == 1.0  # dataclass default
    (root / "runs" / "m").mkdir(parents=True)
    (root / "runs" / "m" / "tuned.yaml").write_text(yaml.safe_dump({"lr": 0.3, "memory_size": 32}))
    run = resolve("m", root=root)
    assert run.train.lr == 0.3 and run.model["memory_size"] == 32
    run = resolve("m", root=root, overrides={"lr": 0.4, "model.word_size": 3})
    assert run.train.lr == 0.4 and run.model["word_size"] == 3
    assert resolve("m", root=root, use_tuned=False).train.lr == 0.2


def test_unknown_keys_and_entries_are_clear_errors(root):
    with pytest.raises(UserError, match=r"unknown config key\(s\) \['memroy'\]"):
        resolve("m", root=root, overrides={"memroy": 3})
    with pytest.raises(UserError, match="unknown model entry 'x'"):
        resolve("x", root=root)
    with pytest.raises(UserError, match="bad train config"):
        resolve("m", root=root, overrides={"train.lr_typo": 1})


def test_missing_prepared_data(root):
    (root / "data" / "prepared" / "copy" / "manifest.json").unlink()
    with pytest.raises(UserError, match="dvc repro prepare"):
        resolve("m", root=root)


def test_later_stages_take_what_training_decided_from_the_checkpoint(root):
    """``train m --set model.memory_size=24 lr=0.5 --out DIR``, then ``evaluate m --run DIR``: the stage
    sees the trained config (the checkpoint's ``config.json``), and params.yaml's own blocks for the rest."""
    from pipeline.config import as_dict, trained

    params = yaml.safe_load((root / "params.yaml").read_text())
    params["models"]["m"]["bar"] = [{"metric": "bit_errors_20", "op": "<=", "value": 0.5}]
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    done = resolve("m", root=root, overrides={"model.memory_size": 24, "lr": 0.5})
    best = root / "adhoc" / "checkpoint" / "best"
    best.mkdir(parents=True)
    (best / "config.json").write_text(json.dumps(as_dict(done)))
    run = trained("m", root / "adhoc", root=root)
    assert (run.model["memory_size"], run.train.lr, run.run_dir) == (24, 0.5, root / "adhoc")
    assert run.bar == done.bar == [{"metric": "bit_errors_20", "op": "<=", "value": 0.5}]
    # Neither the task's facts nor tuned.yaml are read again: the checkpoint holds what they gave.
    manifest = root / "data" / "prepared" / "copy" / "manifest.json"
    manifest.write_text(json.dumps({"model_defaults": {"input_size": 99}}))
    (root / "runs" / "m").mkdir(parents=True)
    (root / "runs" / "m" / "tuned.yaml").write_text(yaml.safe_dump({"lr": 0.9, "memory_size": 8}))
    again = trained("m", root / "adhoc", root=root)
    assert (again.model, again.train) == (done.model, done.train) and done.model["input_size"] == 5
    manifest.unlink()  # but the data must be there
    with pytest.raises(UserError, match=r"manifest.json is missing: run `dvc repro prepare@copy` first"):
        trained("m", root / "adhoc", root=root)
    # No checkpoint (yet): nothing to evaluate, said in one sentence.
    with pytest.raises(UserError, match=r"holds no trained model \(checkpoint/best\); run `dvc repro train@m` first"):
        trained("m", root=root)
    saved = json.loads((best / "config.json").read_text())
    saved["train"]["lr_typo"] = 1
    (best / "config.json").write_text(json.dumps(saved))
    with pytest.raises(UserError, match=r"trained by other code \(train keys lr_typo"):
        trained("m", root / "adhoc", root=root)


def test_params_yaml_holds_only_what_differs_from_the_defaults():
    """A key of params.yaml's train blocks equal to TrainConfig's default, or of a model block equal to its
    config dataclass's default, is a second home of that value: an edit of the dataclass would leave params.yaml
    silently restating the old one (docs/architecture.md §4). Every key is one the loop or the model knows."""
    import dataclasses

    import models
    from pipeline.config import ROOT, TrainConfig, load_params

    params = load_params(ROOT)
    loop = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    restated = [f"train.{k}" for k, v in (params.get("train") or {}).items() if loop[k] == v]
    for name, entry in params["models"].items():
        model = {f.name: f.default for f in dataclasses.fields(models.REGISTRY[entry["arch"]].config_cls)}
        for block, defaults in (("train", loop), ("model", model)):
            values = entry.get(block) or {}
            assert set(values) <= set(defaults), f"{name}.{block}: unknown {sorted(set(values) - set(defaults))}"
            restated += [f"{name}.{block}.{k}" for k, v in values.items() if defaults[k] == v]
    assert not restated, f"these params.yaml keys restate their defaults; remove them: {restated}"
    # every entry keeps its blocks, empty or not: dvc.yaml lists models.<name>.model and .train as params
    assert all(isinstance(entry.get(b), dict) for entry in params["models"].values() for b in ("model", "train"))
