"""fp32 or bf16 on this machine: an ``Accelerator`` that trains in bf16 only where the hardware computes it,
and recurrent layers kept in fp32 where a CPU has no bf16 kernel for them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pipeline.config import RunConfig, UserError


def make_accelerator(run: RunConfig):
    """The run's ``Accelerator`` and the precision it trains in (``train.precision``, or fp32 where this
    CPU would only emulate bf16)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    cfg = run.train
    if cfg.precision not in ("fp32", "bf16"):
        raise UserError(f"{run.name}: train.precision is '{cfg.precision}'; use fp32 or bf16")
    # Accelerate keeps its state per process: a second training in one process (tests, a Ray worker
    # reused by another tune trial) would silently keep the first one's precision. The distributed
    # state (PartialState) stays. Only an explicit bf16 is passed: with fp32 the launcher's choice
    # stands (gpu_check launches with --mixed_precision bf16).
    AcceleratorState._reset_state(reset_partial_state=False)
    on_cpu = not has_accelerator()
    # bf16 is a speed setting, not part of the recipe: where the CPU would only emulate it, fp32 is
    # an order of magnitude faster (cpu_has_native_bf16), so the run takes fp32 and says so.
    emulated_bf16 = on_cpu and not cpu_has_native_bf16()
    precision = "fp32" if cfg.precision == "bf16" and emulated_bf16 else cfg.precision
    accelerator = Accelerator(cpu=on_cpu, mixed_precision="bf16" if precision == "bf16" else None)
    if precision != cfg.precision:
        accelerator.print(f"{run.name}: precision bf16 runs as fp32 here: this CPU has no native bf16, and emulating "
                          "it makes each step 10-20x slower (train_summary.json: precision)")
    elif accelerator.mixed_precision == "bf16" and emulated_bf16:
        accelerator.print(f"{run.name}: the launcher asked for bf16, which this CPU only emulates (10-20x slower "
                          "than fp32); launch without --mixed_precision bf16 to train in fp32")
    return accelerator, precision


RNNS = (nn.LSTM, nn.GRU, nn.RNN)  # the recurrent layers PyTorch runs as one fused (oneDNN on CPU) kernel
_BF16_RNN: dict[type, bool] = {}


def cpu_runs_bf16(rnn: type) -> bool:
    """Whether this CPU runs ``rnn`` (one of RNNS) under bf16 autocast. On x86 CPUs without native
    bf16 (AVX2 only, e.g. AMD Zen 3) PyTorch 2.13 hands a bf16 ``nn.LSTM`` to oneDNN all the same,
    which fails with "could not create a primitive descriptor for the LSTM forward propagation
    primitive". Probed once per type and process on a 4-unit layer, whose initialisation draws from
    a forked RNG: the training's random stream is the same with or without the probe."""
    if rnn not in _BF16_RNN:
        try:
            with torch.random.fork_rng(devices=[]), torch.autocast("cpu", dtype=torch.bfloat16):
                rnn(4, 4, batch_first=True)(torch.zeros(1, 2, 4))
            _BF16_RNN[rnn] = True
        except RuntimeError:
            _BF16_RNN[rnn] = False
    return _BF16_RNN[rnn]


def _fp32_forward(forward: Callable) -> Callable:
    def run(input, hx=None):
        # Autocast off inside, inputs cast up (a PackedSequence has .float() too): the layer runs
        # exactly as in an fp32 model; what consumes its output is autocast again.
        with torch.autocast("cpu", enabled=False):
            if hx is not None:
                hx = tuple(h.float() for h in hx) if isinstance(hx, tuple) else hx.float()
            return forward(input.float(), hx)
    return run


def keep_rnns_fp32(model: nn.Module) -> list[str]:
    """bf16 on a CPU that cannot run a recurrent layer under autocast: those layers of ``model``
    run in fp32, everything else stays bf16 (instead of the training stopping in oneDNN). Returns
    their names, empty on a CPU that runs them all (there nothing changes). Since a CPU without
    native bf16 trains wholly in fp32 (cpu_has_native_bf16), this guards CPUs that have bf16 but
    lack a bf16 kernel for one layer type."""
    names = []
    for name, module in model.named_modules():
        kind = next((t for t in RNNS if isinstance(module, t)), None)
        if kind is not None and not cpu_runs_bf16(kind):
            module.forward = _fp32_forward(module.forward)
            names.append(name)
    return names


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware, by oneDNN's own test (AVX-512 BW/VL/DQ on x86,
    bf16 instructions on ARM). Without it PyTorch emulates bf16 autocast, which is correct but far
    slower than fp32: on an AVX2-only AMD EPYC a ``bahdanau`` training step took 13.9 s against
    1.0 s in fp32, a ``transformer`` step 23 s against 1.2 s (docs/results.md, "bf16 on a CPU
    without bf16")."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no bf16 kernels to run natively
        return False


def has_accelerator() -> bool:
    """Whether a GPU-class device is visible. Accelerate only forms a CPU process group (gloo)
    under torchrun when told it runs on the CPU, so CPU-only machines must say so."""
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return (torch.cuda.is_available() or bool(mps and mps.is_available())
            or bool(xpu and xpu.is_available()))
