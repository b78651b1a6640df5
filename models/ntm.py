"""Neural Turing Machine: Graves, Wayne & Danihelka 2014 (arXiv:1410.5401).

An LSTM controller reads from and writes to an N×M memory through heads whose weightings come
from content addressing (key k, strength β), interpolation with the previous weighting (gate g),
a circular shift (distribution s over ±R) and sharpening (γ ≥ 1); eqs. (2)-(9). Writes are
erase-then-add (eqs. 3-4). Initialisation follows Collier & Beel 2018 ("Implementing Neural
Turing Machines"): constant small memory, learned initial read vectors and weightings, which
they found to converge fastest and most reliably.

Dimension legend
    B batch, T time steps, I input width, O output width, C controller size, N memory slots,
    M word size, R read heads, W write heads, Z = 2·shift_range + 1 shift kernel size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import register
from models.export import ExportSpec, graph
from models.layers import ntm_address, positive, split_sizes

STATE_NAMES = ["h", "c", "memory", "reads", "read_w", "write_w"]


@dataclass
class NTMConfig:
    input_size: int = 9
    output_size: int = 8
    controller_size: int = 100
    memory_size: int = 128
    word_size: int = 20
    read_heads: int = 1
    write_heads: int = 1
    shift_range: int = 1
    memory_init: float = 1e-6
    # Start the write heads walking forward one slot per step (location mode, shift +1), so that
    # from the first update every input lands in a slot of its own, as the trained NTM of the
    # paper writes (its Figs. 6 and 13). Only the initial biases change; the heads stay free to
    # learn any addressing. Off: plain initialisation, which copy and repeat copy learn from.
    write_walk: bool = False


@register("ntm", NTMConfig)
class NTM(nn.Module):
    def __init__(self, cfg: NTMConfig):
        super().__init__()
        self.cfg = cfg
        n, m, z = cfg.memory_size, cfg.word_size, 2 * cfg.shift_range + 1
        self.controller = nn.LSTMCell(cfg.input_size + cfg.read_heads * m, cfg.controller_size)
        # Per head: key M, β 1, g 1, shift Z, γ 1; write heads add erase M and add M.
        self.addr_sizes = [m, 1, 1, z, 1]
        self.read_params = nn.Linear(cfg.controller_size, cfg.read_heads * sum(self.addr_sizes))
        self.write_params = nn.Linear(
            cfg.controller_size, cfg.write_heads * (sum(self.addr_sizes) + 2 * m)
        )
        self.output = nn.Linear(cfg.controller_size + cfg.read_heads * m, cfg.output_size)
        self.init_reads = nn.Parameter(torch.randn(cfg.read_heads, m) * 0.01)
        # Initial weightings start focused on slot 0 so that location-based shifting has an
        # anchor from the first step; they stay learnable.
        focus = torch.zeros(n)
        focus[0] = 5.0
        self.init_read_logits = nn.Parameter(focus.repeat(cfg.read_heads, 1))
        self.init_write_logits = nn.Parameter(focus.repeat(cfg.write_heads, 1))
        if cfg.write_walk:
            self._bias_write_heads_to_walk()

    @torch.no_grad()
    def _bias_write_heads_to_walk(self) -> None:
        """Write-head biases: g ≈ 0.02 (keep the previous weighting), shift +1 with p ≈ 0.96,
        γ = 1 + softplus(2) ≈ 3.1 (re-sharpen). Weights stay as initialised: their contribution
        (|W h| well below 1 at the start) does not outweigh a bias of ±4."""
        m, r = self.cfg.word_size, self.cfg.shift_range
        bias = self.write_params.bias.view(self.cfg.write_heads, -1)  # [W*P] -> [W,P]
        gate = m + 1  # per-head layout: key M, β 1, g 1, shift Z, γ 1, erase M, add M
        shift = gate + 1
        bias[:, gate] = -4.0
        bias[:, shift : shift + 2 * r + 1] = 0.0
        bias[:, shift + r + 1] = 4.0  # index j moves by j - R slots (layers.circular_shift)
        bias[:, shift + 2 * r + 1] = 2.0

    def initial_state(self, batch: int) -> list[Tensor]:
        """Returns [h, c, memory, reads, read_w, write_w] for ``batch`` sequences."""
        cfg = self.cfg
        dev = self.init_reads.device
        h = torch.zeros(batch, cfg.controller_size, device=dev)
        memory = torch.full((batch, cfg.memory_size, cfg.word_size), cfg.memory_init, device=dev)
        reads = self.init_reads.unsqueeze(0).expand(batch, -1, -1)  # [B,R,M]
        read_w = torch.softmax(self.init_read_logits, -1).unsqueeze(0).expand(batch, -1, -1)
        write_w = torch.softmax(self.init_write_logits, -1).unsqueeze(0).expand(batch, -1, -1)
        return [h, h.clone(), memory, reads, read_w, write_w]

    def _head_params(self, raw: Tensor, heads: int, extra: int) -> list[Tensor]:
        """raw [B, heads*(P+extra)] -> key, β, g, shift, γ (+ erase, add) each [B,heads,·]."""
        raw = raw.view(raw.shape[0], heads, -1)  # [B,heads,P+extra]
        parts = split_sizes(raw, self.addr_sizes + ([self.cfg.word_size] * 2 if extra else []))
        key, beta, gate, shift, gamma = parts[:5]
        out = [torch.tanh(key), positive(beta), torch.sigmoid(gate),
               torch.softmax(shift, -1), 1 + positive(gamma)]
        if extra:
            out += [torch.sigmoid(parts[5]), torch.tanh(parts[6])]
        return out

    @staticmethod
    def _address(memory: Tensor, prev: Tensor, *head: Tensor) -> Tensor:
        """Addressing in float64. A trained head is very sharp (β in the hundreds, γ in the
        tens), so float32 rounding inside cos/softmax/sharpening differs visibly between
        PyTorch and ONNX Runtime kernels; in float64 both agree to float32 precision."""
        weights = ntm_address(memory.double(), prev.double(), *(t.double() for t in head))
        return weights.to(memory.dtype)

    def step(self, x: Tensor, state: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """One time step. x [B,I]; state as :meth:`initial_state`. Returns logits [B,O], state."""
        h, c, memory, reads, read_w, write_w = state
        ctrl_in = torch.cat([x, reads.flatten(1)], dim=-1)  # [B,I+R*M]
        h, c = self.controller(ctrl_in, (h, c))  # [B,C] each
        # Write first, then read, so a value can be read back in the step it is written.
        k, beta, g, s, gamma, erase, add = self._head_params(
            self.write_params(h), self.cfg.write_heads, 2
        )
        write_w = self._address(memory, write_w, k, beta, g, s, gamma)  # [B,W,N]
        for i in range(self.cfg.write_heads):
            w = write_w[:, i].unsqueeze(-1)  # [B,N,1]
            memory = memory * (1 - w * erase[:, i].unsqueeze(1)) + w * add[:, i].unsqueeze(1)
        k, beta, g, s, gamma = self._head_params(self.read_params(h), self.cfg.read_heads, 0)
        read_w = self._address(memory, read_w, k, beta, g, s, gamma)  # [B,R,N]
        reads = torch.bmm(read_w, memory)  # [B,R,N]x[B,N,M] -> [B,R,M]
        logits = self.output(torch.cat([h, reads.flatten(1)], dim=-1))  # [B,O]
        return logits, [h, c, memory, reads, read_w, write_w]

    def run(self, x: Tensor) -> dict[str, Tensor]:
        """Unroll over x [B,T,I]; returns logits [B,T,O] and weightings [B,T,heads,N]."""
        state = self.initial_state(x.shape[0])
        logits, read_ws, write_ws = [], [], []
        for t in range(x.shape[1]):
            y, state = self.step(x[:, t], state)
            logits.append(y)
            read_ws.append(state[4])
            write_ws.append(state[5])
        return {
            "logits": torch.stack(logits, 1),  # T x [B,O] -> [B,T,O]
            "read_weights": torch.stack(read_ws, 1),  # T x [B,R,N] -> [B,T,R,N]
            "write_weights": torch.stack(write_ws, 1),  # T x [B,W,N] -> [B,T,W,N]
        }

    # ---- model contract --------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Binary cross-entropy on the output phase (``mask``), in bits per sequence for logs."""
        out = self.run(batch["x"])
        mask = batch["mask"].unsqueeze(-1)  # [B,T,1]
        bce = F.binary_cross_entropy_with_logits(out["logits"], batch["y"], reduction="none")
        loss = (bce * mask).sum() / mask.sum().clamp(min=1) / self.cfg.output_size
        wrong = ((out["logits"] > 0).float() != batch["y"]).float() * mask
        return loss, {"bit_errors": wrong.sum().detach() / batch["x"].shape[0]}

    @torch.no_grad()
    def predict(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Returns bits [B,T,O] (0/1), logits and probs [B,T,O], read/write weightings
        [B,T,heads,N]."""
        out = self.run(batch["x"])
        return {"bits": (out["logits"] > 0).float(), "logits": out["logits"],
                "probs": torch.sigmoid(out["logits"]),
                "read_weights": out["read_weights"], "write_weights": out["write_weights"]}

    def export_graphs(self) -> dict[str, ExportSpec]:
        """``init`` (state for a batch) + ``step`` (one time step carrying all state), so the
        exported model runs sequences of any length."""
        x = torch.rand(2, 3, self.cfg.input_size)
        state = self.initial_state(2)
        b = {0: "batch"}
        return {
            "init": graph(self, _init, {"x": x}, STATE_NAMES,
                          {"x": {0: "batch", 1: "time"}, **{n: b for n in STATE_NAMES}}),
            "step": graph(self, _step, {"x": x[:, 0], **dict(zip(STATE_NAMES, state))},
                          ["logits"] + [f"new_{n}" for n in STATE_NAMES],
                          {n: b for n in ["x", "logits"] + STATE_NAMES + [f"new_{n}" for n in STATE_NAMES]}),
        }


def _init(model: NTM, x: Tensor) -> tuple[Tensor, ...]:
    # Only the batch size of x matters; reading it from a tensor keeps the graph dynamic.
    return tuple(s.expand(x.shape[0], *s.shape[1:]) for s in model.initial_state(1))


def _step(model: NTM, x: Tensor, *state: Tensor) -> tuple[Tensor, ...]:
    logits, state = model.step(x, list(state))
    return (logits, *state)
