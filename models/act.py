"""Adaptive Computation Time for an RNN: Graves 2016, arXiv:1603.08983.

At each input the RNN takes up to ``max_steps`` internal "ponder" steps s^n = tanh(W [x; δ_n1] +
U s^{n-1}) (eq. 4: a flag marks the first step), each with a halting unit h^n = σ(W_h s^n + b_h)
(eq. 5). It stops at N = min{n : Σ h ≥ 1 - ε}; the halting distribution p^n (h^n before N, the
remainder R = 1 - Σ_{n<N} h^n at N, 0 after) mixes the steps' outputs (mean field, eq. 10) and the
loss adds the ponder cost τ·(N + R) (eq. 11-12). ``act: false`` is the same network run for exactly
one step, the paper's baseline, with the same parameters.

The loop stops early once every row has halted (later steps would get p = 0). The exported graph
keeps that exit: an ONNX ``Loop`` (``torch.while_loop``) runs the steps the batch needs, not
``max_steps`` (a trained model halts after about 5 of 20), so ONNX Runtime does no work PyTorch skips.

Dimension legend
    B batch, I input size, H hidden units, O outputs, S ponder steps run (≤ max_steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import ExportSpec, register
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

    def _heads(self) -> tuple[Tensor, Tensor, Tensor]:
        """The input weights without the first-step flag column, and the halting unit and the output
        layer as one matrix: one product per step gives h^n's logit and the step's output."""
        w_x = self.cell.weight_ih[:, :-1]  # [H,I]; the last column multiplies the flag δ_n1
        heads_w = torch.cat([self.halt.weight, self.out.weight])  # [1+O,H]
        heads_b = torch.cat([self.halt.bias, self.out.bias])  # [1+O]
        return w_x, heads_w, heads_b

    def _first(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x is the same at every ponder step, so its projection is computed once. Returns the drive
        W x + b [B,H], the first state s^1 (flag set, s^0 = 0) and its heads [B,1+O]."""
        w_x, heads_w, heads_b = self._heads()
        drive = F.linear(x, w_x, self.cell.bias_ih + self.cell.bias_hh)  # [B,I] -> [B,H]
        s = torch.tanh(drive + self.cell.weight_ih[:, -1])  # U s^0 = 0
        return drive, s, F.linear(s, heads_w, heads_b)

    def _step(self, drive: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        """s^n = tanh(W x + b + U s^{n-1}) (flag 0) and its heads [B,1+O]."""
        _, heads_w, heads_b = self._heads()
        s = torch.tanh(drive + F.linear(s, self.cell.weight_hh))  # [B,H]
        return s, F.linear(s, heads_w, heads_b)

    def _finish(self, heads: Tensor, limit: int) -> dict[str, Tensor]:
        """heads [B,S,1+O] of the S steps run (zero after them) -> the outputs of :meth:`run`."""
        cfg = self.cfg
        halt = torch.sigmoid(heads[..., 0])  # [B,S]
        if cfg.act:
            # A batch stops early only once every row has halted, so forcing a halt at the last
            # column changes nothing then; at the step limit it is the paper's rule.
            p, steps, remainder = act_halting(halt, cfg.eps, force_last=True)
        else:
            # one step: p = 1 there (the exported graph's buffer has max_steps columns)
            p = torch.cat([torch.ones_like(halt[:, :1]), torch.zeros_like(halt[:, 1:])], 1)
            steps, remainder = torch.ones_like(halt[:, 0]), torch.zeros_like(halt[:, 0])
        logits = (p.unsqueeze(-1) * heads[..., 1:]).sum(1)  # [B,S,1]*[B,S,O] -> [B,O]
        p = F.pad(p, (0, cfg.max_steps - p.shape[1]))  # [B,max_steps]
        return {"logits": logits, "halting": p, "ponder": steps + remainder, "steps": steps}

    def run(self, x: Tensor) -> dict[str, Tensor]:
        """x [B,I] -> logits [B,O], halting distribution p [B,max_steps] (zero-padded), ponder
        N + R [B] and steps N [B]. Stops once every row has halted."""
        cfg = self.cfg
        limit = cfg.max_steps if cfg.act else 1
        drive, s, head = self._first(x)
        heads = [head]
        total = torch.sigmoid(head[:, 0])  # Σ h so far [B], added in step order as act_halting's cumsum
        for _ in range(1, limit):
            if bool((total >= 1 - cfg.eps).all()):
                break
            s, head = self._step(drive, s)
            heads.append(head)
            total = total + torch.sigmoid(head[:, 0])
        return self._finish(torch.stack(heads, 1), limit)  # S x [B,1+O] -> [B,S,1+O]

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
        return {"model": ExportSpec(_Full(self), (torch.zeros(2, self.cfg.input_size),), ["x"], names,
                                    {n: b for n in ["x"] + names})}


class _Full(nn.Module):
    """:meth:`ACT.run` with the ponder loop as ``torch.while_loop`` (exported as an ONNX ``Loop``):
    each step's heads go into column n of a [B,max_steps,1+O] buffer, zero beyond the steps run."""

    def __init__(self, model: ACT):
        super().__init__()
        self.model = model

    def forward(self, x: Tensor):
        model, cfg = self.model, self.model.cfg
        limit = cfg.max_steps if cfg.act else 1
        drive, s, head = model._first(x)
        column = torch.arange(cfg.max_steps, device=x.device).view(1, -1, 1)  # [1,S,1]
        heads = torch.where(column == 0, head.unsqueeze(1), torch.zeros_like(head).unsqueeze(1))  # [B,S,1+O]
        total = torch.sigmoid(head[:, 0])  # Σ h so far [B], summed in step order as cumsum does
        n = torch.ones((), dtype=torch.long, device=x.device)

        def more(n, s, total, heads):
            return (n < limit) & ~(total >= 1 - cfg.eps).all()

        def step(n, s, total, heads):
            s, head = model._step(drive, s)
            heads = torch.where(column == n, head.unsqueeze(1), heads)  # [B,1,1+O] into column n
            return n + 1, s, total + torch.sigmoid(head[:, 0]), heads

        _, _, _, heads = torch.while_loop(more, step, (n, s, total, heads))
        out = model._finish(heads, limit)
        return out["logits"], out["halting"], out["ponder"], out["steps"], (out["logits"] > 0).long()
