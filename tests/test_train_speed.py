"""The training loop's speed settings (TrainConfig's OPT_IN_KEYS, on where params.yaml sets them): off by
default and then recorded nowhere, so a run without them trains and checkpoints exactly as before them; when
on, they keep what the run learns (fused AdamW, a compiled step) or stop it as documented (patience)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import OPT_IN_KEYS, UserError, as_dict, resolve
from pipeline.training.loop import train


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "checkpoint" / "last" / "model.safetensors"))


def test_opt_in_settings_are_recorded_only_when_on(ntm_copy_root):
    root = ntm_copy_root
    run = resolve("ntm", root=root)
    assert not set(OPT_IN_KEYS) & set(as_dict(run)["train"])
    train(run, root / "plain", progress=False)
    saved = json.loads((root / "plain" / "checkpoint" / "best" / "config.json").read_text())
    assert not set(OPT_IN_KEYS) & set(saved["train"])  # the config.json a run wrote before these existed
    on = resolve("ntm", root=root, overrides={"fused_adamw": True, "patience": 3, "compile": "step",
                                              "cpu_sdpa": "math", "cpu_loss": "chunked", "cpu_heap": "keep",
                                              "memory_format": "channels_last"})
    assert {k: as_dict(on)["train"][k] for k in OPT_IN_KEYS} == {"compile": "step", "fused_adamw": True,
                                                                 "patience": 3, "cpu_sdpa": "math",
                                                                 "cpu_loss": "chunked", "cpu_heap": "keep",
                                                                 "memory_format": "channels_last"}


def test_patience_stops_after_validations_without_a_lower_loss_and_a_resume_stays_stopped(ntm_copy_root):
    root = ntm_copy_root
    # lr 0: the weights never move, so the first validation (step 4) stays the best
    run = resolve("ntm", root=root, overrides={"lr": 0.0, "max_steps": 40, "patience": 2})
    seen = []
    summary = train(run, root / "out", report=seen.append, progress=False)
    assert [m["step"] for m in seen] == [4, 8, 12]
    assert summary["steps"] == 12 and summary["best_step"] == 4 and summary["stopped_early"] is True
    again = []
    assert train(run, root / "out", report=again.append, progress=False)["steps"] == 12 and again == []
    curve = (root / "out" / "learning_curves" / "val_loss.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in curve[1:]] == ["4", "8", "12"]
    # without patience the same run takes its whole budget
    full = resolve("ntm", root=root, overrides={"lr": 0.0, "max_steps": 8})
    assert "stopped_early" not in train(full, root / "full", progress=False)


def test_fused_adamw_learns_what_the_per_tensor_loop_learns(ntm_copy_root):
    root = ntm_copy_root
    plain = train(resolve("ntm", root=root), root / "loop", progress=False)
    fused = train(resolve("ntm", root=root, overrides={"fused_adamw": True}), root / "fused", progress=False)
    assert fused["best_val_loss"] == pytest.approx(plain["best_val_loss"], rel=1e-5)
    a, b = weights(root / "loop"), weights(root / "fused")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_a_compiled_step_trains_like_the_eager_one(ntm_copy_root, monkeypatch):
    """Dynamo traces the model's per-time-step method inside the loop (its eager backend: the graph capture
    is what the loop relies on; inductor's kernels are timed by scripts/train_efficiency.py)."""
    root = ntm_copy_root
    calls = []
    real = torch.compile

    def eager_compile(fn, **kwargs):
        calls.append(getattr(fn, "__name__", fn))
        return real(fn, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", eager_compile)
    torch._dynamo.reset()
    compiled = train(resolve("ntm", root=root, overrides={"compile": "step"}), root / "compiled", progress=False)
    assert calls == ["step"]
    eager = train(resolve("ntm", root=root), root / "eager", progress=False)
    assert compiled["best_val_loss"] == pytest.approx(eager["best_val_loss"], rel=1e-6)
    a, b = weights(root / "eager"), weights(root / "compiled")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)


def _backward_nodes(loss: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [next_fn for next_fn, _ in node.next_functions]
    return names


def test_cpu_sdpa_math_runs_the_explicit_attention_and_computes_the_same_gradients():
    """The Transformer's step under ``cpu_sdpa: math``: no fused flash kernel in its backward graph, and the
    same loss and gradients as PyTorch's own choice up to fp32 rounding."""
    import models
    from pipeline.config import TrainConfig
    from pipeline.training.loop import step_kernels
    from tests.conftest import TINY, tiny_batch

    grads, nodes = {}, {}
    for setting in ("", "math"):
        torch.manual_seed(0)
        model = models.build("transformer", TINY["transformer"]).train()
        with step_kernels(TrainConfig(cpu_sdpa=setting), torch.device("cpu"))():
            torch.manual_seed(1)  # the same dropout masks
            loss, _ = model.loss(tiny_batch("transformer", seed=0))
        loss.backward()
        nodes[setting] = _backward_nodes(loss)
        grads[setting] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    flash = {n for n in nodes[""] if "FlashAttention" in n}
    assert flash and not {n for n in nodes["math"] if "FlashAttention" in n}
    assert set(grads[""]) == set(grads["math"])
    for name in grads[""]:
        torch.testing.assert_close(grads["math"][name], grads[""][name], rtol=1e-4, atol=1e-5)
    with pytest.raises(UserError, match="train.cpu_sdpa is 'flash'; use '' .* or 'math'"):
        step_kernels(TrainConfig(cpu_sdpa="flash"), torch.device("cpu"))


@pytest.mark.parametrize("autocast", [False, True])
def test_the_chunked_token_loss_is_pytorchs_cross_entropy_in_row_blocks(autocast):
    """``ChunkedLoss`` (train.cpu_loss: chunked): label smoothing, padding rows ignored, a last block shorter
    than the others; the loss, accuracy and logits' gradient of F.cross_entropy within float32 rounding (bf16
    gradients equal), and with no open context token_loss is PyTorch's kernel again."""
    from models.layers import ChunkedLoss, token_loss
    from pipeline.config import TrainConfig
    from pipeline.training.loop import step_kernels

    torch.manual_seed(0)
    logits = torch.randn(5, 11, 37) * 4  # [B,T,V]: 55 rows, blocks of 8
    target = torch.randint(0, 37, (5, 11))
    target[:, 8:] = 0  # padding
    target[0, 0] = 0
    results = []
    for chunked in (False, True):
        x = logits.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with ChunkedLoss(rows=8) if chunked else contextlib.nullcontext():
                loss, acc = token_loss(x @ torch.eye(37), target, 0, 0.1)  # bf16 logits under autocast
        (3 * loss).backward()
        results.append((loss, acc, x.grad, _backward_nodes(loss)))
    (want, want_acc, want_grad, plain), (got, got_acc, got_grad, nodes) = results
    assert "_ChunkedTokenLossBackward" in nodes and "_ChunkedTokenLossBackward" not in plain
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got_acc == want_acc and 0 < float(want_acc) < 1
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)
    again, _ = token_loss(logits.clone().requires_grad_(), target, 0, 0.1)  # the context closed
    assert "_ChunkedTokenLossBackward" not in _backward_nodes(again)
    with pytest.raises(UserError, match="train.cpu_loss is 'fused'; use '' .* or 'chunked'"):
        step_kernels(TrainConfig(cpu_loss="fused"), torch.device("cpu"))


def test_the_chunked_accuracy_counts_argmax_hits_when_maxima_tie():
    """The chunked loss's accuracy is argmax's: where the target shares the maximum with another index, the row
    counts only when the target comes first (integer logits in a small range: most rows tie)."""
    from models.layers import _first_maximum_hits

    torch.manual_seed(3)
    x = torch.randint(0, 4, (600, 9)).float()  # [n,V]
    target, real = torch.randint(0, 9, (600,)), torch.rand(600) > 0.1
    want = ((x.argmax(-1) == target) & real).sum()
    top = x.amax(-1, keepdim=True)
    ties = ((x == top).sum(-1) > 1) & (x.gather(1, target[:, None]).squeeze(1) == top.squeeze(1))  # [n]
    first = ties & (x.argmax(-1) == target)  # [n]: tied, the target first
    assert int(first.sum()) == 49 and int(ties.sum()) == 152 and int(want) == 61  # both kinds of tie, many
    assert _first_maximum_hits(x.clone(), target, real) == want


@pytest.mark.parametrize("arch", ["show_attend_tell", "attention_ocr"])
def test_channels_last_lays_out_the_convolutions_and_rounds_less_than_bf16(arch):
    """train.memory_format: channels_last: the convolution weights and the feature maps are channel-minor, the
    Parameters the optimizer holds are the same objects, the loss is the default layout's, and every gradient is
    the float64 one to within less than bf16 autocast's rounding (the precision these entries train at: the
    entries set both in params.yaml). A different summation order only: bias gradients ahead of a batch norm, zero in
    exact arithmetic, are left out."""
    import models
    from pipeline.training.memory import lay_out
    from pipeline.training.precision import keep_rnns_fp32
    from tests.conftest import TINY, tiny_batch

    batch, results = tiny_batch(arch, seed=5, batch=4), {}
    for setting, dtype, autocast in (("", torch.float64, False), ("", torch.float32, True),
                                     ("channels_last", torch.float32, False)):
        torch.manual_seed(0)
        model = models.build(arch, TINY[arch]).train().to(dtype)
        before = list(model.parameters())
        lay_out(model, setting)
        if autocast:  # as training does: an LSTM this CPU has no bf16 kernel for (AVX2 only) runs in fp32
            keep_rnns_fp32(model)
        assert [id(p) for p in model.parameters()] == [id(p) for p in before]
        convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
        assert convs and all(c.weight.is_contiguous(memory_format=torch.channels_last) == bool(setting)
                             for c in convs if c.weight.shape[1] > 1)
        maps = []
        hook = convs[-1].register_forward_hook(lambda _m, _i, out, seen=maps: seen.append(out))
        torch.manual_seed(1)  # the same dropout masks and samples
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = model.loss({k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()})
        loss.backward()
        hook.remove()
        assert maps[0].is_contiguous(memory_format=torch.channels_last) == bool(setting)
        results[setting or str(dtype)] = (loss.detach().double(), {n: p.grad.double() for n, p in
                                                                    model.named_parameters() if p.grad is not None})
    (exact, truth), (_, bf16) = results["torch.float64"], results["torch.float32"]
    loss, got = results["channels_last"]
    torch.testing.assert_close(loss, exact, rtol=1e-6, atol=0)
    assert set(got) == set(truth)
    for name, want in truth.items():
        if float(want.norm()) > 1e-12:
            assert float((got[name] - want).norm()) < float((bf16[name] - want).norm()), name
    with pytest.raises(UserError, match="train.memory_format is 'nhwc'; use '' .* or 'channels_last'"):
        lay_out(model, "nhwc")


@pytest.mark.integration  # it starts processes
def test_cpu_heap_keep_reuses_freed_memory_instead_of_faulting_it_in_again():
    """train.cpu_heap: keep, in a process of its own (it is process-wide): a 40 MB tensor allocated, touched and
    freed again and again faults its pages in anew every time under glibc's defaults (a fresh mapping each time)
    and, once the heap holds a block that fits, hardly ever: only while Python's own small allocations still split
    the freed block (run to run here: the 1st and 2nd of 16, or the 1st and 3rd)."""
    import subprocess
    import sys

    probe = """
import resource, sys, torch
from pipeline.training.memory import keep_freed_memory
took = keep_freed_memory(sys.argv[1], "cpu")
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(10 * 2**20, dtype=torch.float32).fill_(1.0)  # 40 MB: allocated, touched, freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(took, *[faults() for _ in range(16)])
"""
    seen = {}
    for setting in ("", "keep"):
        out = subprocess.run([sys.executable, "-c", probe, setting], capture_output=True, text=True, check=True)
        took, *faults = out.stdout.split()
        seen[setting] = (took == "True", [int(f) for f in faults])
    default, keep = seen[""], seen["keep"]
    assert default[0] is False and min(default[1]) > 10_000  # all 10,240 pages of 4 kB, every time
    assert keep[0] is True and keep[1][0] > 10_000  # the first one grows the heap
    assert sum(f > 1_000 for f in keep[1]) <= 4 and keep[1][-8:] == [0] * 8, keep[1]
    from pipeline.training.memory import keep_freed_memory

    assert keep_freed_memory("keep", "cuda") is False  # CPU runs only
    with pytest.raises(UserError, match="train.cpu_heap is 'big'; use '' .* or 'keep'"):
        keep_freed_memory("big", "cpu")


def test_compile_names_a_method_of_the_model(ntm_copy_root):
    root = ntm_copy_root
    run = resolve("ntm", root=root, overrides={"compile": "forwardd"})
    with pytest.raises(UserError, match="train.compile is 'forwardd', which this model does not have"):
        train(run, root / "bad", progress=False)



def test_the_gemm_ceiling_counts_each_computed_product_once_and_times_it_in_its_layout():
    """scripts/gemm_ceiling.py: under bf16 autocast a product is recorded as called and again on its cast
    operands; summed over the computed ones, the FLOPs are the flop counter's, and a product is timed alone
    with its recorded layout (a transposed operand, a broadcast one of stride 0)."""
    import gemm_ceiling
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 8))
    x, keys = torch.randn(5, 7, 24), torch.randn(5, 7, 24)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores = torch.bmm(x, keys.transpose(1, 2))  # [5,7,7]
            loss = net(scores @ x).float().sum() + scores.float().sum()  # [5,7,24] -> [5,7,8]
        loss.backward()

    with FlopCounterMode(display=False) as counter:
        step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    found = gemm_ceiling.recorded_products(prof.events())
    counted = sum(gemm_ceiling.gemm_flops(k[0], [list(s) for s in k[1]]) * n for k, n in found.items())
    assert counted == counter.get_total_flops() > 0
    assert all(set(k[3]) == {"c10::BFloat16"} for k in found)  # only the computing calls, on cast operands
    operand = gemm_ceiling._operand((3, 4), (1, 3), "float")  # a transposed [4,3]
    assert operand.stride() == (1, 3) and operand.dtype == torch.float32
    assert gemm_ceiling._operand((2, 3, 4), (0, 4, 1), "c10::BFloat16").stride() == (0, 4, 1)
    key = ("aten::bmm", ((2, 3, 4), (2, 4, 5)), ((0, 4, 1), (20, 5, 1)), ("float", "float"))
    assert 0 < gemm_ceiling.time_alone(key) < 0.01
