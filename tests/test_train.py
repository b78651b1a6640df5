"""The shared training loop: it learns, checkpoints, and resumes exactly after a kill."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.config import TrainConfig, UserError, resolve
from pipeline.stages.prepare import prepare
from pipeline.training.batches import bucket_batches, shard, token_batches
from pipeline.training.loop import lr_lambda, train
from pipeline.training.validation import mean_weights
from tests.conftest import TINY


@pytest.fixture
def root(ntm_copy_root):
    return ntm_copy_root


def test_bucket_batches_cover_every_item_once_and_group_lengths():
    lengths = [i % 7 for i in range(100)]
    batches = bucket_batches(lengths, 10, seed=0, shuffle=True)
    assert sorted(i for b in batches for i in b) == list(range(100))
    assert bucket_batches(lengths, 10, seed=0, shuffle=True) == batches
    assert bucket_batches(lengths, 10, seed=1, shuffle=True) != batches
    assert max(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) <= 1


def test_token_batches_hold_at_most_max_tokens_and_the_same_sizes_every_epoch():
    lengths = [3 + (i * 37) % 29 for i in range(500)]  # 3..31
    epochs = [token_batches(lengths, 120, seed=s, shuffle=True) for s in (0, 1)]
    for batches in epochs:
        assert sorted(i for b in batches for i in b) == list(range(500))
        assert all(len(b) * max(lengths[i] for i in b) <= 120 for b in batches)
        # Cut from the sorted lengths: a batch spans at most two adjacent lengths.
        assert max(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) <= 1
    # Same cuts every epoch (the schedule's step count), other contents and order.
    assert sorted(map(len, epochs[0])) == sorted(map(len, epochs[1])) and epochs[0] != epochs[1]
    assert token_batches(lengths, 120, seed=0, shuffle=True) == epochs[0]
    # 120 tokens hold 3 items of length 31 (the last batch of them takes the rest); the first batch
    # holds the 18 items of length 3 and 12 of length 4 (30 x 4 = 120).
    assert max(len(b) for b in epochs[0] if lengths[b[-1]] == 31) == 3 and max(map(len, epochs[0])) == 30
    assert token_batches([50, 2], 10, 0, False) == [[1], [0]]  # an item above max_tokens is a batch alone
    # Global batches: two processes split each one, together seeing exactly its items.
    halves = [shard(epochs[0], r, 2) for r in (0, 1)]
    assert all(sorted(a + b) == sorted(g) for a, b, g in zip(*halves, epochs[0]) if len(g) >= 2)


def test_schedules_warm_up_then_decay():
    cosine = lr_lambda(TrainConfig(warmup_steps=10, min_lr_ratio=0.1), total_steps=110)
    assert cosine(0) == pytest.approx(0.1) and cosine(9) == pytest.approx(1.0)
    assert cosine(60) == pytest.approx(0.55) and cosine(110) == pytest.approx(0.1)
    inv = lr_lambda(TrainConfig(warmup_steps=10, schedule="inverse_sqrt"), total_steps=110)
    assert inv(9) == pytest.approx(1.0) and inv(39) == pytest.approx(0.5) and inv(999) == pytest.approx(0.1)
    assert inv(10_000) == lr_lambda(TrainConfig(warmup_steps=10, schedule="inverse_sqrt"), 50)(10_000)
    with pytest.raises(UserError, match="inverse_sqrt"):
        lr_lambda(TrainConfig(schedule="noam"), 10)


def test_mean_weights_averages_floats(tmp_path):
    from safetensors.torch import save_file

    for n, x in enumerate((1.0, 2.0, 6.0)):
        (tmp_path / str(n)).mkdir()
        save_file({"w": torch.full((2,), x), "count": torch.tensor([n])}, str(tmp_path / str(n) / "m.safetensors"))
    got = mean_weights(sorted(tmp_path.glob("*/m.safetensors")))
    assert got["w"].tolist() == [3.0, 3.0] and got["count"].tolist() == [2]


def test_average_of_the_last_validations_becomes_best_when_lower_and_survives_a_kill(root):
    run = resolve("ntm", root=root, overrides={"max_steps": 12, "eval_every": 2, "average_last": 3})
    seen = []
    summary = train(run, root / "full", report=seen.append, progress=False)
    avg = summary["averaged"]
    assert avg["checkpoints"] == 3 and avg["steps"] == [8, 10, 12]
    assert not (root / "full" / "checkpoint" / "average").exists()  # spent: recorded in last
    best = load_file(str(root / "full" / "checkpoint" / "best" / "model.safetensors"))
    if avg["kept"]:
        assert summary["best_val_loss"] == avg["val_loss"] < min(m["val_loss"] for m in seen)
    else:
        assert avg["val_loss"] >= min(m["val_loss"] for m in seen) == summary["best_val_loss"]
    # Killed after the first snapshot: the resumed run averages the same three and ends the same.
    def kill(metrics):
        if metrics["step"] == 8:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(run, root / "resumed", report=kill, progress=False)
    again = train(run, root / "resumed", progress=False)
    assert again["averaged"]["steps"] == [8, 10, 12]
    assert again["averaged"]["val_loss"] == pytest.approx(avg["val_loss"], abs=1e-5)
    other = load_file(str(root / "resumed" / "checkpoint" / "best" / "model.safetensors"))
    for key in best:
        torch.testing.assert_close(best[key], other[key], rtol=0, atol=1e-5)
    # A finished run re-run changes nothing (the outcome is in last, the snapshots are gone).
    assert train(run, root / "resumed", progress=False)["averaged"] == again["averaged"]


def test_training_lowers_validation_loss_and_keeps_best(root):
    run = resolve("ntm", root=root)
    seen = []
    summary = train(run, root / "out", report=seen.append, progress=False)
    assert [m["step"] for m in seen] == [4, 8]
    assert summary["steps"] == 8 and summary["best_val_loss"] == min(m["val_loss"] for m in seen)
    best = root / "out" / "checkpoint" / "best"
    assert json.loads((best / "config.json").read_text())["model"]["memory_size"] == TINY["ntm"]["memory_size"]
    first = resolve("ntm", root=root, overrides={"max_steps": 1, "eval_every": 1})
    untrained = train(first, root / "one", progress=False)["best_val_loss"]
    assert summary["best_val_loss"] < untrained
    # The learning curves (DVC plots of the train stage): every validation, and the loss every log_every steps.
    curves = root / "out" / "learning_curves"
    val = list(csv.DictReader(open(curves / "val_loss.csv")))
    assert list(val[0])[0] == "step" and list(val[0])[-1] == "val_loss"  # x first, the plotted y last
    assert [(int(r["step"]), float(r["val_loss"])) for r in val] == [
        (m["step"], float(f"{m['val_loss']:.6g}")) for m in seen]
    train_rows = list(csv.DictReader(open(curves / "train_loss.csv")))
    assert [int(r["step"]) for r in train_rows] == [2, 4, 6, 8] and all(float(r["train_loss"]) > 0 for r in train_rows)


def test_resume_after_kill_matches_uninterrupted_run(root):
    run = resolve("ntm", root=root)
    train(run, root / "full", progress=False)

    def kill(metrics):
        if metrics["step"] == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(run, root / "resumed", report=kill, progress=False)
    trainer = torch.load(root / "resumed" / "checkpoint" / "last" / "trainer.pt", weights_only=False)
    assert trainer["state"]["step"] == 4
    summary = train(run, root / "resumed", progress=False)
    assert summary["steps"] == 8
    a = load_file(str(root / "full" / "checkpoint" / "last" / "model.safetensors"))
    b = load_file(str(root / "resumed" / "checkpoint" / "last" / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)
    for name in ("train_loss.csv", "val_loss.csv"):  # the curve carries over the kill, row for row
        full, resumed = (root / d / "learning_curves" / name for d in ("full", "resumed"))
        assert resumed.read_text() == full.read_text() and full.read_text().count("\n") > 2


def test_a_resumed_run_counts_the_time_of_every_process(root):
    """train_seconds of a run resumed after a kill includes the time the first process spent up to its
    checkpoint (it counted the last process only: 2026-11-25's resumed trainings under-reported)."""
    import time

    run = resolve("ntm", root=root, overrides={"eval_every": 2})

    def slow_then_kill(metrics):
        if metrics["step"] == 2:
            time.sleep(2.0)  # inside the first process's training time, before its step-4 checkpoint
        if metrics["step"] == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(run, root / "resumed", report=slow_then_kill, progress=False)
    first = torch.load(root / "resumed" / "checkpoint" / "last" / "trainer.pt", weights_only=False)["state"]
    assert first["step"] == 4 and first["seconds"] >= 2.0
    summary = train(run, root / "resumed", progress=False)  # 4 more tiny steps: well under a second
    assert summary["steps"] == 8
    assert summary["train_seconds"] >= round(first["seconds"], 1)


def test_changed_config_does_not_resume(root):
    train(resolve("ntm", root=root), root / "o", progress=False)
    other = resolve("ntm", root=root, overrides={"lr": 0.02})
    seen = []
    train(other, root / "o", report=seen.append, progress=False)
    # started fresh (validated at 4 and 8) rather than reusing the other config's finished state
    assert [m["step"] for m in seen] == [4, 8]


def test_changed_data_does_not_resume(root):
    train(resolve("ntm", root=root), root / "d", progress=False)
    manifest = root / "data" / "prepared" / "copy" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"]["train.pt"] = "0" * 64  # as if the training data had been regenerated
    manifest.write_text(json.dumps(data))
    seen = []
    train(resolve("ntm", root=root), root / "d", report=seen.append, progress=False)
    assert [m["step"] for m in seen] == [4, 8]


def test_run_identity_covers_exactly_the_code_dvc_retrains_for():
    """A code dep of train@ that the checkpoint identity missed would re-run the stage only to
    resume the finished checkpoint of the old code; one the identity has but DVC lacks would never
    re-run the stage."""
    from pipeline.config import ROOT
    from pipeline.training.resume import TRAIN_CODE

    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]["do"]
    code = {d.replace("${item.arch}", "{arch}") for d in stage["deps"]
            if not d.startswith(("data/", "runs/"))}
    assert code == set(TRAIN_CODE)


def test_code_change_gives_a_new_run_identity(root, monkeypatch, tmp_path):
    import shutil

    import pipeline.training.resume as train_mod

    run = resolve("ntm", root=root)
    before = train_mod.config_hash(run)
    code = tmp_path / "code"
    for package in ("models", "pipeline", "serving"):
        shutil.copytree(train_mod.ROOT / package, code / package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(train_mod, "ROOT", code)
    assert train_mod.config_hash(run) == before  # same bytes, same identity
    # ntm's task (copy) module, a file its evaluation imports, a training-code dep
    for edited in ("pipeline/tasks/copy.py", "pipeline/plots.py", "pipeline/checkpoint.py"):
        path = code / edited
        original = path.read_text()
        path.write_text(original + "\n# a comment\n")
        assert train_mod.config_hash(run) != before, edited
        path.write_text(original)
    (code / "serving/features.py").write_text("# spoken_digits' features: not the copy task's code\n")
    assert train_mod.config_hash(run) == before


@pytest.mark.slow  # trains, evaluates, exports, quantises and publishes a model
def test_every_stage_takes_an_ad_hoc_run_folder(root):
    """`attnzoo train MODEL --out DIR`, then `evaluate`/`export`/`quantize`/`publish --run DIR`: every
    output goes to DIR (results rows under DIR/results/<task>/, versions under DIR/model_repository/),
    none to the pipeline's runs/, results/, model_repository/ or MLflow registry."""
    import sqlite3

    from pipeline.config import UserError, load_params, trained
    from pipeline.stages.evaluate import evaluate
    from pipeline.stages.export import export
    from pipeline.stages.publish import publish
    from pipeline.stages.quantize import quantize, settings

    # the parity gate reads real test sequences of lengths 10, 20 and 40
    prepare("copy", {"seed": 1, "bits": 4, "min_len": 1, "max_len": 4, "train_size": 96, "val_size": 16,
                     "test_size": 16, "test_lengths": [10, 20, 40]}, root / "data" / "prepared" / "copy")
    adhoc = root / "adhoc"
    train(resolve("ntm", root=root), adhoc, progress=False)
    run = trained("ntm", adhoc, root=root)
    metrics = evaluate(run)
    assert json.loads((adhoc / "metrics.json").read_text())["bar"] == metrics["bar"]
    assert json.loads((adhoc / "results" / "copy" / "ntm.json").read_text())["model"] == "ntm"
    assert export(run)["passed"] and json.loads((adhoc / "parity.json").read_text())["passed"]
    assert (adhoc / "onnx").is_dir() and (adhoc / "results" / "copy" / "ntm.latency.json").exists()
    gate = quantize(run, settings("ntm", load_params()))["gate"]  # the shipped params.yaml quantize block
    meta = publish(run, root=root, repository=adhoc / "model_repository")
    version = adhoc / "model_repository" / "ntm" / "1"
    assert meta["version"] == 1 and json.loads((version / "metadata.json").read_text())["run_dir"] == str(adhoc)
    assert sorted(p.name for p in version.glob("*.onnx")) == sorted(p.name for p in (adhoc / "onnx").glob("*.onnx"))
    assert meta["int8"]["published"] == gate["passed"]
    assert (adhoc / "model_repository" / "ntm-int8").is_dir()
    for pipeline_output in ("results", "runs", "model_repository"):
        assert not (root / pipeline_output).exists(), pipeline_output
    db = sqlite3.connect(root / "mlflow.db")
    assert db.execute("select count(*) from registered_models").fetchone() == (0,)
    with pytest.raises(UserError, match="holds no trained model"):
        trained("ntm", root / "empty", root=root)


def test_bf16_autocast_trains_an_lstm_model_on_this_cpu():
    """The translation entries train with precision bf16 (params.yaml); Luong's encoder is an
    ``nn.LSTM``, which oneDNN cannot run under bf16 autocast on CPUs without native bf16. The loop
    keeps such layers in fp32 there: loss and gradients as ``pipeline/stages/train.py`` computes them are
    finite on any CPU and the model learns, and on a CPU with bf16 nothing is kept back."""
    import models
    from pipeline.training.precision import cpu_runs_bf16, keep_rnns_fp32
    from tests.conftest import tiny_batch

    torch.manual_seed(0)
    model = models.build("luong", TINY["luong"])
    lstms = [name for name, m in model.named_modules() if isinstance(m, torch.nn.LSTM)]  # the encoder's
    kept = keep_rnns_fp32(model)
    assert lstms and kept == ([] if cpu_runs_bf16(torch.nn.LSTM) else lstms), (kept, lstms)
    optimizer, batch, losses = torch.optim.AdamW(model.parameters(), lr=1e-2), tiny_batch("luong"), []
    for _ in range(40):  # and it learns: 40 steps on one batch take the loss below 0.6 of its start
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = model.loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_a_recurrent_layer_kept_in_fp32_computes_exactly_what_it_computes_without_autocast(monkeypatch):
    """The fallback on a CPU without bf16 (forced here): the LSTM's output under autocast is its
    fp32 output bit for bit, plain and packed, while the layers around it still run in bf16; the
    probe leaves the global RNG where it was."""
    import copy

    from torch import nn
    from torch.nn.utils.rnn import pack_padded_sequence

    import pipeline.training.precision as train_module

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.lstm, self.gru = nn.Linear(3, 4), nn.LSTM(4, 5, batch_first=True), nn.GRU(4, 5)

        def forward(self, x):
            h = self.proj(x)  # [B, T, 4], bf16 under autocast
            return h, self.lstm(h)[0], self.lstm(pack_padded_sequence(h, [3, 2], batch_first=True))[0].data

    monkeypatch.setattr(train_module, "_BF16_RNN", {nn.LSTM: False, nn.GRU: True, nn.RNN: True})
    torch.manual_seed(0)
    net = Net()
    plain = copy.deepcopy(net)
    assert train_module.keep_rnns_fp32(net) == ["lstm"]
    x = torch.randn(2, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, out, packed = net(x)
    assert h.dtype == torch.bfloat16 and out.dtype == packed.dtype == torch.float32
    assert torch.equal(out, plain.lstm(h.float())[0])
    assert torch.equal(packed, plain.lstm(pack_padded_sequence(h.float(), [3, 2], batch_first=True))[0].data)

    monkeypatch.setattr(train_module, "_BF16_RNN", {})
    torch.manual_seed(1)
    train_module.cpu_runs_bf16(nn.LSTM)
    after_probe = torch.rand(4)
    torch.manual_seed(1)
    assert torch.equal(after_probe, torch.rand(4))


def test_bf16_precision_autocasts_the_step_and_still_learns(root, monkeypatch):
    """train.precision bf16 on a CPU with native bf16 (declared here, so the test runs on any CPU):
    the loss is computed under CPU autocast (matmuls in bfloat16), weights stay fp32, and training
    still lowers the validation loss; a typo names the two choices."""
    import torch

    import models.ntm as ntm
    import pipeline.training.precision as train_module

    monkeypatch.setattr(train_module, "cpu_has_native_bf16", lambda: True)

    dtypes = []
    original = ntm.NTM.loss

    def spying(self, batch):
        dtypes.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return original(self, batch)

    monkeypatch.setattr(ntm.NTM, "loss", spying)
    run = resolve("ntm", root=root, overrides={"precision": "bf16"})
    seen = []
    train(run, root / "bf16", report=seen.append, progress=False)
    assert dtypes and all(d == (True, torch.bfloat16) for d in dtypes[:8])  # the 8 training steps
    untrained = train(resolve("ntm", root=root, overrides={"precision": "bf16", "max_steps": 1, "eval_every": 1}),
                      root / "one", progress=False)["best_val_loss"]
    assert seen[-1]["val_loss"] < untrained
    from safetensors.torch import load_file

    weights = load_file(root / "bf16" / "checkpoint" / "best" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    dtypes.clear()  # a later fp32 training in the same process does not keep bf16
    train(resolve("ntm", root=root, overrides={"max_steps": 2, "eval_every": 2}), root / "fp32", progress=False)
    assert dtypes and not any(enabled for enabled, _ in dtypes)
    with pytest.raises(Exception, match="use fp32 or bf16"):
        train(resolve("ntm", root=root, overrides={"precision": "fp16"}), root / "x", progress=False)


def test_bf16_on_a_cpu_without_native_bf16_trains_exactly_as_fp32(root, monkeypatch, capsys):
    """Where the CPU only emulates bf16 (declared here), a bf16 entry trains in fp32, which is 10-20x
    faster there: no step runs under autocast, the weights are bit for bit the fp32 run's, the log
    says why, and train_summary.json records the precision used. An fp32 run records nothing."""
    import models.ntm as ntm
    import pipeline.training.precision as train_module

    monkeypatch.setattr(train_module, "cpu_has_native_bf16", lambda: False)
    autocast = []
    original = ntm.NTM.loss

    def spying(self, batch):
        autocast.append(torch.is_autocast_enabled("cpu"))
        return original(self, batch)

    monkeypatch.setattr(ntm.NTM, "loss", spying)
    short = {"max_steps": 6, "eval_every": 3}
    asked_bf16 = train(resolve("ntm", root=root, overrides={**short, "precision": "bf16"}), root / "b", progress=False)
    assert autocast and not any(autocast)
    assert "precision bf16 runs as fp32 here: this CPU has no native bf16" in capsys.readouterr().out
    plain = train(resolve("ntm", root=root, overrides=short), root / "f", progress=False)
    assert asked_bf16["best_val_loss"] == plain["best_val_loss"]
    weights = [load_file(root / d / "checkpoint" / "best" / "model.safetensors") for d in ("b", "f")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    summaries = [json.loads((root / d / "train_summary.json").read_text()) for d in ("b", "f")]
    assert summaries[0]["precision"] == "fp32" and "precision" not in summaries[1]
