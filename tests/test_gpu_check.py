"""scripts/gpu_check.py's pieces that run without a GPU: the one-line exit on a CPU machine, the CUDA
EP options wrapper, the folding of a parity report, the steady-state window read from MLflow, the tokens
of the batches the training steps took, and the summary it prints (the GPU figures themselves are in
docs/benchmarks.md), and the whole check run on the CPU for entries with seeded weights."""

from __future__ import annotations

import json
import subprocess
import sys

import gpu_check
import pytest

from tests.conftest import ROOT, Planted, copy_repo, venv_env


@pytest.mark.integration
def test_without_cuda_it_says_so_in_one_line_and_exits_0():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the check itself runs here")
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert done.stdout.strip().splitlines() == [
        "gpu_check: no CUDA device visible to PyTorch on this machine; nothing to check"]


def test_the_server_asks_for_cuda_in_fp32_and_the_check_can_switch_tf32_on(monkeypatch):
    import onnxruntime as ort

    import serving.runtime as rt

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(rt, "_cuda_device_visible", lambda: True)
    served = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    assert rt.providers("auto") == served and rt.uses_cuda()
    assert rt.providers("cpu") == ["CPUExecutionProvider"] and not rt.uses_cuda("cpu")
    plain = rt.providers
    with gpu_check.cuda_options({"use_tf32": "1"}):
        assert rt.providers("cuda") == [("CUDAExecutionProvider", {"use_tf32": "1"}), "CPUExecutionProvider"]
    assert rt.providers is plain
    with gpu_check.cuda_options(None):  # the server's own options
        assert rt.providers("cuda") == served


def test_summarise_keeps_the_largest_graph_error_and_the_end_to_end_verdict():
    rep = {"provider": "CUDAExecutionProvider", "passed": False, "cases": [
        {"graphs": {"encoder": {"outputs": {"memory": {"passed": True, "max_abs": 2e-5}}},
                    "decoder_step": {"outputs": {"log_probs": {"passed": False, "max_abs": 4.2e-3},
                                                 "tokens": {"passed": True, "mismatches": 0}}}},
         "e2e": {"tokens": {"passed": True, "mismatches": 0}}},
        {"graphs": {"encoder": {"outputs": {"memory": {"passed": True, "max_abs": 3e-5}}}},
         "e2e": {"tokens": {"passed": False, "mismatches": 2}}},
    ]}
    assert gpu_check.summarise(rep) == {"provider": "CUDAExecutionProvider", "passed": False, "cases": 2,
                                        "max_abs": 4.2e-3, "e2e_passed": False}


def test_logged_steps_is_the_window_between_the_first_and_last_logged_step(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("gpu_check"))
    # Logged out of order and with a validation metric between: only train_loss's steps count.
    for step, ms in ((40, 1_000_000), (400, 1_013_384), (200, 1_006_000)):
        client.log_metric(run.info.run_id, "train_loss", 1.0 / step, timestamp=ms, step=step)
    client.log_metric(run.info.run_id, "val_loss", 0.5, timestamp=1_020_000, step=400)
    assert gpu_check.logged_steps(uri) == (40, 400, 13.384)


def test_the_tokens_are_those_of_the_batches_the_steps_took():
    """Each step's tokens (source + target + 1) from the global batch the loop cuts for it: by padded
    tokens (every batch within max_tokens, however many items) or by items, epoch after epoch, each
    epoch taking every item once; the rates count the steady window's own steps."""
    from types import SimpleNamespace

    from pipeline.config import TrainConfig
    from pipeline.training.batches import epoch_batches

    items = [{"src": [5] * (i % 7 + 1), "tgt": [6] * (i % 5 + 2)} for i in range(40)]
    total = sum(len(it["src"]) + len(it["tgt"]) + 1 for it in items)  # 155 source + 160 target + 40
    lengths = [max(len(it["src"]), len(it["tgt"])) for it in items]
    assert total == 355
    by_tokens = SimpleNamespace(task="translation_de_en", train=TrainConfig(max_tokens=24, seed=3))
    cut = epoch_batches(by_tokens.train, lengths, 0)
    assert all(len(b) * max(lengths[i] for i in b) <= 24 for b in cut) and len({len(b) for b in cut}) > 1
    tokens = gpu_check.step_tokens(by_tokens, items, 2 * len(cut) + 1)
    assert sum(tokens[:len(cut)]) == sum(tokens[len(cut):2 * len(cut)]) == total
    assert tokens[:len(cut)] == [sum(len(items[i]["src"]) + len(items[i]["tgt"]) + 1 for i in b) for b in cut]
    assert tokens[-1] == sum(len(items[i]["src"]) + len(items[i]["tgt"]) + 1
                             for i in epoch_batches(by_tokens.train, lengths, 2)[0])
    by_items = SimpleNamespace(task="translation_de_en", train=TrainConfig(batch_size=16, seed=3))
    tokens = gpu_check.step_tokens(by_items, items, 6)  # 16 + 16 + 8 items an epoch
    assert len(tokens) == 6 and sum(tokens[:3]) == sum(tokens[3:]) == total
    row = {"seconds": 10.0, "params": 1000, "steady_window": {"from_step": 2, "steps": 3, "seconds": 4.0}}
    assert gpu_check.rates(row, [50, 60, 70, 80, 90, 100], 1e9) == {
        "tokens_per_s": 60, "tokens_per_s_whole_run": 45, "mfu": 0.00036}  # (70+80+90)/4; 450/10; 6*1000*60/1e9


def test_summary_lines_show_both_settings_and_the_ratios():
    report = {"device": "NVIDIA H100 80GB HBM3", "onnxruntime": "1.31.1", "torch": "2.11.0", "models": ["m"],
              "parity": {"fp32": {"m": {"passed": True, "max_abs": 7.8e-5, "e2e_passed": True}},
                         "tf32": {"m": {"passed": False, "max_abs": 4.2e-3, "e2e_passed": False}}},
              "timing": {"m": {1: {"pytorch": 7.0, "onnxruntime_fp32": 3.5, "onnxruntime_tf32": 2.0},
                               32: {"pytorch": 8.0, "onnxruntime_fp32": 16.0, "onnxruntime_tf32": 10.0}}},
              "train": {"params": 7582624, "steps": 400, "precision": "bf16", "batch_size": 64,
                        "tokens_per_s": 43899, "tokens_per_s_whole_run": 17837, "seconds": 36.6, "mfu": 0.00202}}
    lines = gpu_check.summary_lines(report, ["fp32", "tf32"])
    assert "| m | passed, 7.8e-05, same | FAILED, 4.2e-03, differs |" in lines
    assert "| m | 7.00 | 3.50 | 2.00 | 2.00 | 3.50 | 8.00 | 16.00 | 0.50 | 10.00 | 0.80 |" in lines
    assert lines[-1] == ("Transformer (7,582,624 parameters), 400 steps, bf16, batch 64: 43,899 tokens/s in the "
                         "steady state (17,837 over the whole run of 36.6 s), MFU 0.20%")
    report["train"] = {**report["train"], "max_tokens": 2048}
    report["train"].pop("batch_size")
    line = gpu_check.summary_lines(report, ["fp32"])[-1]
    assert ", 400 steps, bf16, batches of ≤ 2,048 padded tokens a side: 43,899 tokens/s" in line, line
    report["train"] = None  # --steps 0
    assert gpu_check.summary_lines(report, ["fp32", "tf32"])[-1] == "Transformer training: not run (--steps 0)"


def test_each_device_writes_a_report_of_its_own():
    assert gpu_check.report_path(ROOT, "NVIDIA H100 80GB HBM3") == ROOT / "docs/gpu_check/nvidia-h100-80gb-hbm3.json"
    assert gpu_check.report_path(ROOT, "NVIDIA H200") == ROOT / "docs/gpu_check/nvidia-h200.json"
    assert gpu_check.report_path(ROOT, "cpu") == ROOT / "docs/gpu_check/cpu.json"


def test_a_run_for_other_models_on_the_same_device_adds_its_rows():
    def report(device, models, train):
        return {"device": device, "onnxruntime": "1.31.1", "torch": "2.11.0", "models": models,
                "parity": {"fp32": {m: {"passed": True, "max_abs": i * 1e-5} for i, m in enumerate(models, 1)}},
                "timing": {m: {"1": {"pytorch": 2.0 * i}} for i, m in enumerate(models, 1)}, "train": train}

    first = report("NVIDIA H200", ["luong_concat", "transformer"], {"tokens_per_s": 32412})
    second = report("NVIDIA H200", ["bahdanau", "transformer"], None)  # --steps 0
    out = gpu_check.merged(first, second)
    assert out["models"] == ["luong_concat", "transformer", "bahdanau"]
    assert out["parity"]["fp32"] == {"luong_concat": {"passed": True, "max_abs": 1e-5},
                                     "transformer": {"passed": True, "max_abs": 2e-5},  # the second run's row
                                     "bahdanau": {"passed": True, "max_abs": 1e-5}}
    assert out["timing"]["transformer"] == {"1": {"pytorch": 4.0}} and out["train"] == {"tokens_per_s": 32412}
    assert gpu_check.merged(first, report("NVIDIA H100", ["bahdanau"], None))["models"] == ["bahdanau"]


def test_a_seeded_run_never_replaces_published_rows_but_adds_the_models_it_lacked():
    def report(weights, pytorch_ms):
        return {"device": "NVIDIA H200", "onnxruntime": "1.31.1", "torch": "2.11.0", "models": list(weights),
                "weights": weights, "parity": {"fp32": {m: {"passed": True, "max_abs": ms / 1e6}
                                                        for m, ms in zip(weights, pytorch_ms)}},
                "timing": {m: {"1": {"pytorch": ms}} for m, ms in zip(weights, pytorch_ms)}, "train": None}

    earlier = report({"luong_concat": "published"}, [5.0])
    earlier.pop("weights")  # a report written before --seeded: every row is a trained model's
    later = report({"luong_concat": "seeded", "ntm": "seeded"}, [7.0, 3.0])
    out = gpu_check.merged(earlier, later)
    assert out["weights"] == {"luong_concat": "published", "ntm": "seeded"}
    assert out["parity"]["fp32"] == {"luong_concat": {"passed": True, "max_abs": 5e-6},
                                     "ntm": {"passed": True, "max_abs": 3e-6}}
    assert out["timing"] == {"luong_concat": {"1": {"pytorch": 5.0}}, "ntm": {"1": {"pytorch": 3.0}}}
    # A published row replaces a seeded one.
    again = gpu_check.merged(out, report({"ntm": "published"}, [4.0]))
    assert again["weights"]["ntm"] == "published" and again["timing"]["ntm"] == {"1": {"pytorch": 4.0}}
    # Graphs exported where the cases were packed name that torch, until a run re-measures the model.
    packed = {**report({"ntm": "seeded", "draw": "seeded"}, [3.0, 2.0]),
              "exported_by": {"ntm": "torch 2.13.0", "draw": "torch 2.13.0"}}
    assert gpu_check.merged(out, packed)["exported_by"] == {"ntm": "torch 2.13.0", "draw": "torch 2.13.0"}
    assert gpu_check.merged(gpu_check.merged(out, packed), report({"ntm": "seeded"}, [3.0]))["exported_by"] == {
        "draw": "torch 2.13.0"}


@pytest.mark.slow
def test_entries_not_trained_here_are_checked_with_seeded_weights_from_packed_cases(tmp_path):
    """The whole check on the CPU in a copy of the repository with no trained model, as on a GPU machine
    without the prepared data: the cases are packed where the data is, the data is removed, and two
    entries are built at the seed, exported by two processes at once, checked against this process's
    copy of the weights (identical, or the graph errors would be of the weights' own size) and timed;
    the report says which weights each row had."""
    import shutil

    import yaml

    repo = copy_repo(tmp_path / "repo")
    env = venv_env(repo)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["tasks"]["parity"].update(train_size=64, val_size=16, test_size=64)
    params["tasks"]["sort"].update(train_size=64, val_size=16, test_size=16)
    # The Transformer stays listed, without its (large) data: what --steps would train.
    params["models"] = {m: params["models"][m] for m in ("pointer_sort", "act_parity", "transformer")}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for task in ("parity", "sort"):
        subprocess.run([sys.executable, "-m", "pipeline.stages.prepare", task], cwd=repo, env=env, check=True,
                       capture_output=True, timeout=300)

    def check(*args: str, models=("pointer_sort", "act_parity"), timeout: int = 600) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "scripts/gpu_check.py", *args, "--models", *models],
                              cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)

    packed = check("--pack", str(tmp_path / "cases"), timeout=300)
    assert packed.returncode == 0, packed.stderr[-3000:]
    assert packed.stdout.strip() == f"gpu_check: packed the cases of 2 entries into {tmp_path / 'cases'}"
    # The recurrent one with its graphs exported here, for a GPU machine whose torch cannot export them.
    with_graphs = check("--pack", str(tmp_path / "graphs"), "--with-graphs", models=("pointer_sort",), timeout=300)
    assert with_graphs.returncode == 0, with_graphs.stderr[-3000:]
    shutil.rmtree(repo / "data" / "prepared")
    done = check("--device", "cpu", "--steps", "0", "--repeats", "1", "--seeded", "--jobs", "2", "--write",
                 "--cases", str(tmp_path / "cases"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if "(seeded weights) | passed" in line]
    assert [r.split(" |")[0] for r in rows] == ["| pointer_sort (seeded weights)", "| act_parity (seeded weights)"]
    report = json.loads((repo / "docs" / "gpu_check" / "cpu.json").read_text())
    assert report["weights"] == {"pointer_sort": "seeded", "act_parity": "seeded"}
    for row in report["parity"]["fp32"].values():
        assert row["passed"] and row["e2e_passed"] and 0 < row["max_abs"] < 1e-4
    for times in report["timing"].values():
        assert set(times["1"]) == set(times["32"]) == {"pytorch", "onnxruntime_fp32"}
    # Packed graphs are checked as they are, not exported again, and the report names the torch that made them.
    import torch

    done = check("--device", "cpu", "--steps", "0", "--repeats", "1", "--seeded", "--write",
                 "--cases", str(tmp_path / "graphs"), models=("pointer_sort",))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exported pointer_sort" not in done.stderr and "| pointer_sort (seeded weights) | passed" in done.stdout
    report = json.loads((repo / "docs" / "gpu_check" / "cpu.json").read_text())
    assert report["exported_by"] == {"pointer_sort": f"torch {torch.__version__}"}
    assert 0 < report["parity"]["fp32"]["pointer_sort"]["max_abs"] < 1e-4
    # Bad input: one sentence naming the fix.
    bad = check("--device", "cpu", models=("nope", "act_parity"), timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == "error: not params.yaml entries: nope (`attnzoo list` shows them)"
    bare = check("--device", "cpu", "--seeded", "--steps", "0", "--cases", str(tmp_path / "elsewhere"), timeout=120)
    assert bare.returncode == 2
    assert bare.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'elsewhere'} has no cases for pointer_sort, act_parity; pack them with "
        f"`python scripts/gpu_check.py --pack {tmp_path / 'elsewhere'}` where the data is")
    no_data = check("--device", "cpu", "--seeded", "--cases", str(tmp_path / "cases"), timeout=120)
    assert no_data.returncode == 2  # at once, before the parity and timing minutes
    assert no_data.stderr.strip().splitlines()[-1] == (
        f"error: the Transformer training (--steps) needs its data ({repo}/data/prepared/translation_de_en/"
        f"manifest.json is missing: run `dvc repro prepare` first), or pass --steps 0")
    untrained = check("--device", "cpu", "--steps", "0", timeout=120)
    assert untrained.returncode == 2
    assert untrained.stderr.strip().splitlines()[-1] == (
        "error: no model asked for is trained and published in this checkout; "
        "--seeded checks the entries with seeded weights")


def test_packed_cases_are_loaded_without_running_a_planted_pickle(tmp_path):
    import torch

    marker = tmp_path / "ran"
    torch.save({"model": Planted(marker)}, tmp_path / "ntm.pt")
    planted = r"holds more than tensors and plain values .*pack the cases again"
    with pytest.raises(gpu_check.cli_errors.ScriptError, match=planted):
        gpu_check.load_cases(tmp_path / "ntm.pt")
    assert not marker.exists()
    # What --pack writes loads as it was saved.
    torch.save({"config": {"hidden": 8}, "cases": [torch.arange(3)]}, tmp_path / "ok.pt")
    loaded = gpu_check.load_cases(tmp_path / "ok.pt")
    assert loaded["config"] == {"hidden": 8} and torch.equal(loaded["cases"][0], torch.arange(3))
