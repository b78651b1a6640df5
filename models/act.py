"""Adaptive Computation Time for an RNN: Graves 2016, arXiv:1603.08983.

At each input the RNN takes up to ``max_steps`` internal "ponder" steps s^n = tanh(W [x; δ_n1] +
U s^{n-1}) (eq. 4: a flag marks the first step), each with a halting unit h^n = σ(W_h s^n + b_h)
(eq. 5). It stops at N = min{n : Σ h ≥ 1 - ε}; the halting distribution p^n (h^n before N, the
remainder R = 1 - Σ_{n<N} h^n at N, 0 after) mixes the steps' outputs (mean field, eq. 10) and the
loss adds the ponder cost τ·(N + R) (eq. 11-12). ``act: false`` is the same network run for exactly
one step, the paper's baseline, with the same parameters.

The loop stops early once every row has halted (later steps would get p = 0). The exported graph
keeps that exit: an ONNX ``Loop`` (``torch.while_loop``) runs the steps the batch needs, not
``max_steps`` (the trained model halts within 5 of 20), so ONNX Runtime does no work PyTorch skips.

Dimension legend
    B batch, I input size, H hidden units, O outputs, S ponder steps run (≤ max_steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import register
from models.export import ExportSpec, graph
from models.layers import act_halting


@dataclass
class ACTConfig:
    input_size: int = 16
    output_size: int = 1
    hidden: int = 128
    act: bool = True  # False: one step per input, no halting (baseline)
    max_steps: int = 20
    eps: float = 0.01
    ponder_cost: float = 1e-3  # τ
    halt_bias: float = 1.0  # initial b_h (Graves §3: a positive bias makes early steps halt)


@register("act", ACTConfig)
class ACT(nn.Module):
    def __init__(self, cfg: ACTConfig):
        super().__init__()
        self.cfg = cfg
        self.cell = nn.RNNCell(cfg.input_size + 1, cfg.hidden, nonlinearity="tanh")
        self.halt = nn.Linear(cfg.hidden, 1)
        nn.init.constant_(self.halt.bias, cfg.halt_bias)
        self.out = nn.Linear(cfg.hidden, cfg.output_size)

    def run(self, x: Tensor) -> dict[str, Tensor]:
        """x [B,I] -> logits [B,O], halting distribution p [B,max_steps] (zero-padded), ponder
        N + R [B] and steps N [B]. Stops once every row has halted."""
        cfg = self.cfg
        limit = cfg.max_steps if cfg.act else 1
        first = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
        s = x.new_zeros(x.shape[0], cfg.hidden)
        halts, outs = [], []
        for n in range(limit):
            s = self.cell(torch.cat([x, first if n == 0 else torch.zeros_like(first)], dim=-1), s)  # [B,H]
            halts.append(torch.sigmoid(self.halt(s)).squeeze(-1))  # [B]
            outs.append(self.out(s))  # [B,O]
            if n + 1 < limit and bool((torch.stack(halts, 1).sum(1) >= 1 - cfg.eps).all()):
                break
        halt = torch.stack(halts, dim=1)  # S x [B] -> [B,S]
        if cfg.act:
            p, steps, remainder = act_halting(halt, cfg.eps, force_last=halt.shape[1] == limit)
        else:
            p, steps, remainder = torch.ones_like(halt), torch.ones_like(halt[:, 0]), torch.zeros_like(halt[:, 0])
        logits = (p.unsqueeze(-1) * torch.stack(outs, dim=1)).sum(1)  # [B,S,1]*[B,S,O] -> [B,O]
        p = F.pad(p, (0, cfg.max_steps - p.shape[1]))  # [B,max_steps]
        return {"logits": logits, "halting": p, "ponder": steps + remainder, "steps": steps}

    # ---- model contract --------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Cross-entropy of the mixed output + τ·mean(N + R); logs accuracy and ponder time."""
        out = self.run(batch["x"])
        target = batch["y"].view(-1, self.cfg.output_size).float()  # [B] -> [B,O]
        task = F.binary_cross_entropy_with_logits(out["logits"], target)
        loss = task + (self.cfg.ponder_cost * out["ponder"].mean() if self.cfg.act else 0.0)
        acc = ((out["logits"] > 0).float() == target).float().mean()
        return loss, {"task_loss": task.detach(), "accuracy": acc.detach(), "ponder": out["ponder"].mean().detach()}

    @torch.no_grad()
    def predict(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Returns logits [B,O], bits [B,O] (int64 0/1), halting [B,max_steps], ponder, steps [B]."""
        out = self.run(batch["x"])
        return {**out, "bits": (out["logits"] > 0).long()}

    def export_graphs(self) -> dict[str, ExportSpec]:
        """One graph, ``model``: the ponder loop as an ONNX ``Loop`` that exits as :meth:`run` does."""
        b = {0: "batch"}
        names = ["logits", "halting", "ponder", "steps", "bits"]
        return {"model": graph(self, _ponder, {"x": torch.zeros(2, self.cfg.input_size)}, names,
                               {n: b for n in ["x"] + names})}


def _ponder(model: ACT, x: Tensor) -> tuple[Tensor, ...]:
    """:meth:`ACT.run` with its ponder loop as ``torch.while_loop`` (an ONNX ``Loop``): the same
    step, each step's halting value and output written to column n of [B,max_steps] buffers that
    stay zero beyond the steps run (where p is 0 anyway)."""
    cfg = model.cfg
    limit = cfg.max_steps if cfg.act else 1
    flag = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)  # δ_n1 [B,1]
    s = model.cell(torch.cat([x, flag], dim=-1), x.new_zeros(x.shape[0], cfg.hidden))  # [B,H]
    h = torch.sigmoid(model.halt(s)).squeeze(-1)  # [B]
    column = torch.arange(cfg.max_steps, device=x.device).view(1, -1)  # [1,S]
    halts = torch.where(column == 0, h.unsqueeze(1), torch.zeros_like(h).unsqueeze(1))  # [B,S]
    o = model.out(s).unsqueeze(1)  # [B,O] -> [B,1,O]
    outs = torch.where(column.unsqueeze(-1) == 0, o, torch.zeros_like(o))  # [B,S,O]
    n = torch.ones((), dtype=torch.long, device=x.device)

    def more(n, s, total, halts, outs):
        return (n < limit) & ~(total >= 1 - cfg.eps).all()

    def step(n, s, total, halts, outs):
        s = model.cell(torch.cat([x, torch.zeros_like(flag)], dim=-1), s)  # [B,H]
        h = torch.sigmoid(model.halt(s)).squeeze(-1)  # [B]
        halts = torch.where(column == n, h.unsqueeze(1), halts)  # into column n
        outs = torch.where((column == n).unsqueeze(-1), model.out(s).unsqueeze(1), outs)
        return n + 1, s, total + h, halts, outs

    _, _, _, halts, outs = torch.while_loop(more, step, (n, s, h, halts, outs))
    if cfg.act:
        # The loop ends early only once every row has halted, so a halt forced at the last
        # column changes nothing then; at the step limit it is run()'s rule.
        p, steps, remainder = act_halting(halts, cfg.eps, force_last=True)
    else:  # one step: p = 1 there
        p = torch.where(column == 0, torch.ones_like(halts), torch.zeros_like(halts))
        steps, remainder = torch.ones_like(halts[:, 0]), torch.zeros_like(halts[:, 0])
    logits = (p.unsqueeze(-1) * outs).sum(1)  # [B,S,1]*[B,S,O] -> [B,O]
    return logits, p, steps + remainder, steps, (logits > 0).long()
