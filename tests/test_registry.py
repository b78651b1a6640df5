"""Walks the whole registry: every model builds from a tiny config, has the right shapes,
back-propagates, overfits one batch, exports to ONNX and passes parity."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import onnxruntime as ort
import pytest
import torch
from torch.testing import assert_close

import models
from models.export import ExportSpec
from pipeline.stages.export import compare_decisions, export_onnx, parity_check
from tests.conftest import EXAMPLES, TINY, tiny_batch


def test_every_registered_model_has_a_tiny_config():
    assert set(models.REGISTRY) == set(TINY), "add the new model's tiny config to profiles/smoke.yaml archs"


def test_each_tiny_model_takes_the_example_of_a_task_it_is_trained_on():
    """profiles/smoke.yaml ``examples``: one of the architecture's params.yaml entries runs that task."""
    from pipeline.config import load_params

    trained_on: dict[str, set] = {}
    for entry in load_params()["models"].values():
        trained_on.setdefault(entry["arch"], set()).add(entry["task"])
    assert set(EXAMPLES) == set(TINY)
    assert {arch: EXAMPLES[arch] in trained_on.get(arch, ()) for arch in TINY} == {arch: True for arch in TINY}


def test_unknown_config_key_is_rejected():
    with pytest.raises(models.ConfigError, match="unknown config key"):
        models.build("ntm", {"memroy_size": 3})
    with pytest.raises(models.ConfigError, match="unknown model"):
        models.build("nope", {})


def test_forward_backward_and_shapes(arch):
    torch.manual_seed(0)
    model = models.build(arch, TINY[arch])
    batch = tiny_batch(arch)
    loss, logs = model.loss(batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    out = model.eval().predict(batch)
    if arch == "bahdanau":
        bsz, steps = out["tokens"].shape
        assert bsz == 3 and out["attention"].shape == (3, steps, batch["src"].shape[1])
        # each emitted token's alignment is a distribution over the real source positions
        assert torch.allclose(out["attention"].sum(-1), torch.ones(3, steps), atol=1e-5)
        assert float(out["attention"][2, :, 2:].abs().max()) == 0.0  # padding never attended
    if arch in ("luong", "transformer"):
        bsz, steps = out["tokens"].shape
        assert out["attention"].shape == (3, steps, batch["src"].shape[1])
        assert float(out["attention"][2, :, 2:].abs().max()) == 0.0  # padding never attended
        assert torch.allclose(out["attention"].sum(-1), torch.ones(3, steps), atol=1e-5)  # global / averaged
    if arch == "transformer":
        heads = out["attention_heads"]  # [B,T,L,H,S]: every layer and head, each a distribution
        assert heads.shape == (3, steps, 2, 2, batch["src"].shape[1])
        assert torch.allclose(heads.sum(-1), torch.ones(heads.shape[:-1]), atol=1e-5)
        assert torch.allclose(heads.mean(dim=(2, 3)), out["attention"])
        uncached = model.decode_uncached(batch)
        assert torch.equal(uncached["tokens"], out["tokens"])
        assert torch.allclose(uncached["log_probs"], out["log_probs"], atol=1e-5)
    if arch == "show_attend_tell":
        bsz, steps = out["tokens"].shape
        regions = model.grid[0] * model.grid[1]  # 84 px after two 2× poolings: 21 × 21
        assert model.grid == (21, 21) and out["attention"].shape == (3, steps, regions)
        assert torch.allclose(out["attention"].sum(-1), torch.ones(3, steps), atol=1e-5)
    if arch == "ntm":
        steps = batch["x"].shape[1]
        assert out["bits"].shape == batch["y"].shape
        assert out["read_weights"].shape == (3, steps, 1, TINY[arch]["memory_size"])
        assert torch.allclose(out["write_weights"].sum(-1), torch.ones(3, steps, 1), atol=1e-5)
    if arch == "pointer_net":
        n = batch["src_len"]
        assert torch.allclose(out["attention"].sum(-1), torch.ones(out["attention"].shape[:2]), atol=1e-5)
        for b in range(3):
            pointed = out["tokens"][b, : out["lengths"][b]].tolist()
            assert len(set(pointed)) == len(pointed) and all(1 <= p <= n[b] for p in pointed)  # each point once
            assert float(out["attention"][b, :, n[b] + 1 :].abs().sum()) == 0.0  # padding never pointed to
    if arch == "neural_programmer":
        steps = TINY[arch]["steps"]
        assert out["op_weights"].shape == (3, steps, 8) and out["col_weights"].shape == (3, steps, 3)
        assert torch.allclose(out["op_weights"].sum(-1), torch.ones(3, steps), atol=1e-5)
        assert out["lookup"].shape == batch["table"].shape
        assert set(out["lookup"].unique().tolist()) <= {0.0, 1.0}  # the executed program selects whole cells
    if arch == "ram":
        glimpses = TINY[arch]["glimpses"]
        assert out["logits"].shape == (3, 10) and torch.equal(out["pred"], out["logits"].argmax(-1))
        assert out["locations"].shape == (3, glimpses, 2)
        assert float(out["locations"][:, 0].abs().max()) == 0.0  # the first glimpse is at the centre
        assert float(out["locations"].abs().max()) <= 1.0  # tanh keeps the policy mean on the canvas
        assert torch.equal(model.predict(batch)["locations"], out["locations"])  # deterministic at inference
    if arch == "draw":
        cfg = TINY[arch]
        pixels = cfg["image_size"] ** 2
        assert out["logits"].shape == (3, cfg["steps"], pixels) and out["write_window"].shape == (3, cfg["steps"], 3)
        assert out["kl"].shape == (3, cfg["steps"]) and bool((out["kl"] >= 0).all())
        assert torch.allclose(out["bound"], out["recon_nll"] + out["kl"].sum(1))
        # the same posterior noise gives the same bound; other noise another one
        again = model.infer(batch["image"], batch["noise"])["bound"]
        assert torch.equal(again, out["bound"])
        assert not torch.equal(model.infer(batch["image"], batch["noise"] + 1)["bound"], out["bound"])
    if arch == "act":
        halting = out["halting"]
        assert halting.shape == (3, TINY[arch]["max_steps"])
        assert torch.allclose(halting.sum(-1), torch.ones(3), atol=1e-6)
        assert torch.equal((halting > 0).sum(-1).float(), out["steps"])  # p is zero after N
        assert bool(((out["ponder"] > out["steps"]) & (out["ponder"] <= out["steps"] + 1)).all())  # N + R, R in (0,1]


def test_overfits_one_batch(arch):
    torch.manual_seed(0)
    model = models.build(arch, TINY[arch])
    batch = tiny_batch(arch)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = float(model.loss(batch)[0].detach())
    for _ in range(150):
        loss, _ = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = float(loss.detach())
    # DRAW: 100 -> 22 nats here, the bound of the three boxes' pixel marginals: on three images at
    # lr 1e-2 the posterior collapses (KL 0) before the latent pays for itself. The full run does
    # use it (KL 26.06 of 90.82 nats, runs/draw/metrics.json); tests/test_ram_draw.py checks the terms.
    assert last < {"draw": 0.25}.get(arch, 0.2) * first, (first, last)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(arch)`` -> (the seed-0 TINY model, its ONNX folder, the graphs' I/O names), exported
    once per module: the parity test and the perturbed-weights test check the same graphs, and
    the export is most of either test's time."""
    done = {}

    def get(arch: str):
        torch.manual_seed(0)
        model = models.build(arch, TINY[arch]).eval()  # a fresh copy each time: a test may change it
        if arch not in done:
            folder = tmp_path_factory.mktemp(f"onnx-{arch}")
            done[arch] = (folder, export_onnx(model, folder))
        return model, *done[arch]

    return get


def test_export_and_parity(arch, exported):
    model, onnx_dir, graphs = exported(arch)
    assert set(graphs) == set(model.export_graphs())
    cases = [(f"batch {b}", tiny_batch(arch, seed=b, batch=b)) for b in (1, 2, 3)]
    report = parity_check(model, onnx_dir, cases, {"atol": 1e-4, "rtol": 1e-3}, "cpu")
    assert report["passed"], report
    for case in report["cases"]:
        if hasattr(model, "decode_uncached"):  # the cached decoder step is checked against no cache
            assert case["e2e"]["uncached_tokens"] == {"passed": True, "mismatches": 0}
        for graph in case["graphs"].values():
            assert graph["checked"] >= 1
            for result in graph["outputs"].values():
                assert result.get("max_abs", 0) < 1e-4 and result.get("mismatches", 0) == 0


def test_parity_catches_a_changed_model(arch, exported):
    """The gate is real: perturbing the weights after export must fail it."""
    model, onnx_dir, _ = exported(arch)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    report = parity_check(model, onnx_dir, [("b3", tiny_batch(arch))], {"atol": 1e-4, "rtol": 1e-3}, "cpu")
    assert not report["passed"]


def test_decisions_fail_on_a_clear_flip_and_count_flips_at_rounding_level():
    import numpy as np

    ref = np.array([[6.9e-6, 2.0, -1.5], [0.3, -4e-3, 1e-2]], dtype=np.float32)
    # A sign flip of a logit within the band (5e-3) of 0 is rounding: counted, not failed.
    ort = ref.copy()
    ort[0, 0], ort[1, 1] = -1.9e-5, 1e-4
    assert compare_decisions(ref, ort, 5e-3) == {"passed": True, "mismatches": 0, "flips_within_tolerance_of_zero": 2}
    # Beyond it, one flipped bit fails the gate.
    ort[1, 2] = -1e-2
    assert compare_decisions(ref, ort, 5e-3) == {"passed": False, "mismatches": 1, "flips_within_tolerance_of_zero": 2}
    # No flips: the report is the one written before the band existed (committed parity.json stay valid).
    assert compare_decisions(ref, ref.copy(), 5e-3) == {"passed": True, "mismatches": 0}


def test_config_dataclasses_are_typed():
    """Every field's annotation resolves to a type (what a `--set` value is checked against)."""
    import typing

    for entry in models.REGISTRY.values():
        assert dataclasses.is_dataclass(entry.config_cls)
        hints = typing.get_type_hints(entry.config_cls)
        for f in dataclasses.fields(entry.config_cls):
            hint = hints[f.name]
            assert isinstance(hint, type) or typing.get_origin(hint) is not None, (entry.config_cls, f.name, hint)


@pytest.mark.parametrize("teacher_forced", ["per_step", "hoisted", "deferred"])
@pytest.mark.parametrize("attention", ["additive", "none"])
def test_bahdanau_trains_on_the_step_it_exports(attention, teacher_forced):
    """``loss`` projects onto the vocabulary once after the loop (and, hoisted, runs every product that does
    not need the previous state over all steps at once; deferred, also sums the gradients of what every step
    reuses once after it, and projects only real target tokens); it must still be the loss of the exported
    ``step`` run step by step, dropout included: the same seed draws the same masks."""
    from models.layers import token_loss
    torch.manual_seed(0)
    model = models.build("bahdanau", {**TINY["bahdanau"], "attention": attention, "dropout": 0.3,
                                      "teacher_forced": teacher_forced}).train()
    batch = tiny_batch("bahdanau")
    torch.manual_seed(7)
    loss, _ = model.loss(batch)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    torch.manual_seed(7)
    memory, keys, state, mask = model.encode(batch["src"], batch["src_len"])
    logits = []
    for t in range(batch["tgt_in"].shape[1]):
        step_logits, state, _ = model.step(batch["tgt_in"][:, t], state, memory, keys, mask)
        logits.append(step_logits)
    ref, _ = token_loss(torch.stack(logits, 1), batch["tgt_out"], model.cfg.pad_id,  # T x [B,V] -> [B,T,V]
                        model.cfg.label_smoothing)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
    assert loss.item() > 1.0  # an untrained model: far from zero, so the comparison means something
    assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        assert (got is None) == (want is None)
        if got is not None:
            assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_rnnencdec_ablation_is_a_forward_encoder_and_one_fixed_context(tmp_path):
    """``attention: none`` is Cho et al.'s encoder-decoder, the paper's Fig. 2 baseline: a forward
    GRU, c = tanh(V h→_S) at the last real token, s_0 = tanh(V' c), and no backward encoder."""
    torch.manual_seed(0)
    model = models.build("bahdanau", {**TINY["bahdanau"], "attention": "none"}).eval()
    assert not hasattr(model, "enc_bwd")
    batch = tiny_batch("bahdanau", batch=3)
    src, src_len = batch["src"], batch["src_len"]
    memory, keys, s0, mask = model.encode(src, src_len)
    fwd, _ = model.enc_fwd(model.src_embed(src))  # [B,S,H]
    h_last = fwd[torch.arange(src.shape[0]), src_len - 1]  # [B,H]
    c = torch.tanh(model.summary(h_last))  # [B,C]
    assert memory.shape == (3, 1, c.shape[1]) and torch.equal(memory, keys)
    assert_close(memory[:, 0], c)
    assert_close(s0, torch.tanh(model.init_state(c)))
    # Padding after the sentence changes nothing: the summary is read at the last real token.
    padded = torch.cat([src, torch.full((3, 4), model.cfg.pad_id)], dim=1)  # [B,S+4]
    assert_close(model.encode(padded, src_len)[0], memory)
    export_onnx(model, tmp_path)
    cases = [(f"batch {b}", tiny_batch("bahdanau", seed=b, batch=b)) for b in (1, 3)]
    report = parity_check(model, tmp_path, cases, {"atol": 1e-4, "rtol": 1e-3}, "cpu")
    assert report["passed"], report


class _Outputs(torch.nn.Module):
    def __init__(self, rnn: torch.nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0]  # [B,S,H]: the outputs, not the final states


@pytest.mark.parametrize("rnn", ["gru", "lstm"])
def test_an_rnn_exported_after_an_earlier_trace_keeps_its_dynamic_length(rnn, tmp_path):
    """A process that traced a GRU or LSTM before (here torch.export at a fixed length) caches the op's
    kernel; export_onnx clears it (pipeline/rnn_export.py), or this export would fix the source length
    to the example's and fail."""
    torch.manual_seed(0)
    model = _Outputs({"gru": torch.nn.GRU, "lstm": torch.nn.LSTM}[rnn](4, 3, batch_first=True)).eval()
    torch.export.export(model, (torch.randn(2, 5, 4),))
    assert getattr(torch.ops.aten, rnn).input._dispatch_cache  # the state the clearing is for
    spec = ExportSpec(model, (torch.randn(2, 5, 4),), ["x"], ["y"], {"x": {0: "batch", 1: "steps"}})
    export_onnx(SimpleNamespace(export_graphs=lambda: {"rnn": spec}), tmp_path)
    path = tmp_path / "rnn.onnx"
    x = torch.randn(3, 9, 4)  # another batch and length than the example's
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    assert_close(torch.from_numpy(got), model(x).detach(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("score,attention,layers", [
    ("general", "global", 2), ("general", "local_p", 2), ("dot", "global", 1), ("concat", "local_m", 1)])
def test_luong_hoisted_and_deferred_losses_are_the_per_step_loss(score, attention, layers):
    """``teacher_forced: hoisted`` projects the dropped h̃_t of every step onto the vocabulary after the loop;
    ``deferred`` also runs the embedding's share of the first LSTM's gates once and sums the loop's weight and
    memory gradients after it (LoopGradients): the same loss and gradients as the step the model exports, run
    step by step, dropout masks included."""
    losses, grads = {}, {}
    for mode in ("per_step", "hoisted", "deferred"):
        torch.manual_seed(0)
        model = models.build("luong", {**TINY["luong"], "score": score, "attention": attention, "layers": layers,
                                       "dropout": 0.3, "teacher_forced": mode}).train()
        torch.manual_seed(7)
        losses[mode], _ = model.loss(tiny_batch("luong"))
        grads[mode] = torch.autograd.grad(losses[mode], list(model.parameters()), allow_unused=True)
    assert losses["per_step"].item() > 1.0  # untrained: far from zero, so the comparison means something
    for mode in ("hoisted", "deferred"):
        assert_close(losses[mode], losses["per_step"], rtol=1e-6, atol=1e-6)
        for got, want in zip(grads[mode], grads["per_step"]):
            assert (got is None) == (want is None)
            if got is not None:
                assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"teacher_forced must be one of \('per_step', 'hoisted', 'deferred'\), "
                                         "got 'sideways'"):
        models.build("luong", {**TINY["luong"], "teacher_forced": "sideways"})


@pytest.mark.parametrize("score,attention,encoder", [
    ("dot", "local_p", "reverse_source"), ("concat", "local_m", "bidirectional")])
def test_luong_variants_export_with_parity(score, attention, encoder, tmp_path):
    """Every score, position mode and encoder is a configuration of one model; each exports. These two
    and the default (general, global, forward: test_export_and_parity) hold every value once."""
    torch.manual_seed(0)
    model = models.build("luong", {**TINY["luong"], "score": score, "attention": attention,
                                   "bidirectional": encoder == "bidirectional",
                                   "reverse_source": encoder == "reverse_source"}).eval()
    export_onnx(model, tmp_path)
    cases = [(f"batch {b}", tiny_batch("luong", seed=b, batch=b)) for b in (1, 3)]
    report = parity_check(model, tmp_path, cases, {"atol": 1e-4, "rtol": 1e-3}, "cpu")
    assert report["passed"], report
    out = model.predict(tiny_batch("luong"))
    # Local: the window's softmax times a Gaussian (σ = D/2) around p_t; nothing beyond D.
    pos = out["positions"]  # [B,T]
    offset = torch.arange(out["attention"].shape[2]).view(1, 1, -1) - pos.unsqueeze(-1)  # [B,T,S]
    assert float(out["attention"][offset.abs() > TINY["luong"]["window"]].abs().max()) == 0.0
    assert bool((out["attention"].sum(-1) <= 1 + 1e-6).all())
    lengths = tiny_batch("luong")["src_len"].view(-1, 1).float()
    assert bool(((pos >= 0) & (pos <= lengths)).all())  # p_t in [0, S]


def test_luong_global_attention_is_a_distribution_over_the_source():
    torch.manual_seed(0)
    model = models.build("luong", TINY["luong"]).eval()
    assert (model.cfg.score, model.cfg.attention, model.cfg.bidirectional) == ("general", "global", False)
    out = model.predict(tiny_batch("luong"))
    assert torch.allclose(out["attention"].sum(-1), torch.ones(out["attention"].shape[:2]), atol=1e-5)


def test_checkpoint_round_trip(arch, tmp_path):
    """Every model saves as safetensors (no aliased tensors) and loads back to the same outputs."""
    from pathlib import Path

    from pipeline.checkpoint import load_model, save
    from pipeline.config import RunConfig, TrainConfig

    torch.manual_seed(0)
    model = models.build(arch, TINY[arch]).eval()
    run = RunConfig(name=arch, arch=arch, task="t", model=TINY[arch], train=TrainConfig(),
                    data_dir=Path(tmp_path), run_dir=Path(tmp_path))
    save(tmp_path / "best", model, run)
    loaded, config = load_model(tmp_path / "best")
    assert config["model"] == TINY[arch]
    batch = tiny_batch(arch)
    assert_close(loaded.loss(batch)[0], model.loss(batch)[0])


@pytest.mark.parametrize("encoder", ["bidirectional", "reverse_source"])
def test_backward_reading_encoders_ignore_padding(encoder):
    """A backward LSTM reads each sentence within its own length: a sentence encodes the same
    alone and padded inside a batch."""
    torch.manual_seed(0)
    model = models.build("luong", {**TINY["luong"], encoder: True}).eval()
    batch = tiny_batch("luong")
    alone = model.encode(batch["src"][2:, :2], batch["src_len"][2:])  # length 2, no padding
    padded = model.encode(batch["src"], batch["src_len"])
    assert_close(padded["memory"][2, :2], alone["memory"][0])
    assert_close(padded["h"][2], alone["h"][0])


def test_ntm_write_walk_starts_one_slot_per_step():
    """write_walk biases only the initial write head: untrained, it writes step t to slot t + 1
    (the initial weighting sits on slot 0), nearly one-hot; without it the head does not walk."""
    torch.manual_seed(0)
    x = torch.randint(0, 2, (3, 9, TINY["ntm"]["input_size"])).float()
    walking = models.build("ntm", {**TINY["ntm"], "write_walk": True}).eval()
    weights = walking.predict({"x": x})["write_weights"][:, :, 0]  # [B,T,W,N] -> [B,T,N]
    assert weights.argmax(-1).tolist() == [list(range(1, 10))] * 3
    assert weights.max(-1).values.min() > 0.99
    torch.manual_seed(0)
    plain = models.build("ntm", TINY["ntm"]).eval()
    peaks = plain.predict({"x": x})["write_weights"][:, :, 0].argmax(-1)  # [B,T]
    assert len(peaks.unique()) <= 2  # it stays near slot 0
    # Same parameter shapes either way, so checkpoints and exports are unchanged.
    assert [p.shape for p in walking.parameters()] == [p.shape for p in plain.parameters()]


def test_ntm_write_walk_exports_with_parity(tmp_path):
    """The walking write head makes read addressing far more sensitive to rounding (untrained:
    read weights differ by ~1.5e-4 between ORT and PyTorch, against ~1e-7 without the walk), so
    its export gets its own check: copy sequences up to 20 vectors, 12 and 32 slots."""
    g = torch.Generator().manual_seed(1)
    from pipeline.tasks.copy import CopyTask

    long = CopyTask().collate([torch.randint(0, 2, (n, 4), generator=g, dtype=torch.uint8) for n in (20, 15, 9)])
    for slots in (12, 32):
        torch.manual_seed(0)
        model = models.build("ntm", {**TINY["ntm"], "memory_size": slots, "write_walk": True}).eval()
        export_onnx(model, tmp_path / str(slots))
        cases = [("b3", tiny_batch("ntm", seed=3, batch=3)), ("long", long)]
        report = parity_check(model, tmp_path / str(slots), cases, {"atol": 1e-4, "rtol": 1e-3}, "cpu")
        assert report["passed"], report
        assert all(c["e2e"]["decisions"]["mismatches"] == 0 for c in report["cases"])


def test_speech_attention_content_variant_exports_with_parity(tmp_path):
    """Content-only attention is a configuration of the location-aware speech model (the default, which
    test_export_and_parity exports); it exports with parity too (the smoke pipeline runs only the
    location-aware entry)."""
    assert models.build("speech_attention", TINY["speech_attention"]).cfg.attention == "location"
    torch.manual_seed(0)
    model = models.build("speech_attention", {**TINY["speech_attention"], "attention": "content"}).eval()
    export_onnx(model, tmp_path)
    cases = [(f"batch {b}", tiny_batch("speech_attention", seed=b, batch=b)) for b in (1, 3)]
    report = parity_check(model, tmp_path, cases, {"atol": 1e-4, "rtol": 1e-3}, "cpu")
    assert report["passed"], report
