"""Pointer Networks: Vinyals, Fortunato & Jaitly 2015 (arXiv:1506.03134), with the glimpses of
Vinyals, Bengio & Kudlur 2016 ("Order Matters", arXiv:1511.06391) and Bello et al. 2016.

An LSTM encoder reads the input points; an LSTM decoder emits, at each step, a distribution over
the input positions: p(C_i | C_<i, P) = softmax(u^i) with u^i_j = vᵀ tanh(W1 e_j + W2 d_i)
(eq. 3), the additive score of ``layers.AdditiveAttention`` used as logits. Before pointing, each
glimpse attends over the encoder states and replaces the query with their weighted sum. Position
0 of the memory is a learned END slot: pointing to it ends the output (variable-length outputs
such as convex hulls), and its input embedding is the decoder's start symbol. Positions already
pointed to are masked, so outputs are permutations / subsets, as in the papers' constrained
decoding. This is the seq2seq contract of ``serving/decode.py``: ``bos_id = eos_id = 0`` and the
mask is carried from step to step.

Dimension legend
    B batch, N input points, S = N + 1 positions (END + points), I point size, E embedding,
    H hidden size, A attention size, T output steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import register
from models.decode import greedy
from models.export import ExportSpec, graph, picked
from models.layers import AdditiveAttention

STATE = ["h", "c", "mask", "inputs", "memory", "pointer_keys", "glimpse_keys"]  # carried, then static


@dataclass
class PointerNetConfig:
    input_size: int = 2
    emb_dim: int = 128
    hidden: int = 256
    attn_dim: int = 256
    glimpses: int = 1  # 0: Vinyals 2015; 1: one glimpse (Order Matters / Bello 2016)
    logit_clip: float = 0.0  # Bello 2016: C·tanh(u) on the pointer logits; 0 disables
    max_len: int = 101  # decoding limit (points + END); the mask ends a set of N points in N+1 steps
    bos_id: int = 0  # the END slot doubles as the start symbol
    eos_id: int = 0
    pad_id: int = 0


@register("pointer_net", PointerNetConfig)
class PointerNet(nn.Module):
    def __init__(self, cfg: PointerNetConfig):
        super().__init__()
        if not (cfg.bos_id == cfg.eos_id == cfg.pad_id == 0):
            raise ValueError("pointer_net: position 0 is the END slot, so bos_id = eos_id = pad_id = 0")
        self.cfg = cfg
        self.embed = nn.Linear(cfg.input_size, cfg.emb_dim)
        self.start = nn.Parameter(torch.randn(cfg.emb_dim) * 0.1)  # decoder input at step 1
        self.end = nn.Parameter(torch.randn(cfg.hidden) * 0.1)  # memory row of the END slot
        self.encoder = nn.LSTM(cfg.emb_dim, cfg.hidden, batch_first=True)
        self.cell = nn.LSTMCell(cfg.emb_dim, cfg.hidden)
        self.glimpse = nn.ModuleList(AdditiveAttention(cfg.hidden, cfg.hidden, cfg.attn_dim)
                                     for _ in range(cfg.glimpses))
        self.pointer = AdditiveAttention(cfg.hidden, cfg.hidden, cfg.attn_dim)

    # ---- encoder ---------------------------------------------------------------------------
    def encode(self, src: Tensor, src_len: Tensor) -> dict[str, Tensor]:
        """src [B,N,I] float points (right-padded), src_len [B] int64.

        Returns the decoder's first state h, c [B,H], mask [B,S] (1 = may be pointed to) and the
        static tensors: inputs [B,S,E] (what the decoder reads after pointing to j),
        memory [B,S,H], projected keys for the pointer [B,S,A] and for the glimpses [B,S,G*A].
        """
        bsz = src.shape[0]
        emb = self.embed(src)  # [B,N,E]
        enc, _ = self.encoder(emb)  # [B,N,H]; padding is at the end, so real states ignore it
        last = (src_len - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, enc.shape[2])  # [B,1,H]
        h = enc.gather(1, last).squeeze(1)  # [B,H] state after the last real point
        c = torch.zeros_like(h)
        memory = torch.cat([self.end.expand(bsz, 1, -1), enc], dim=1)  # [B,S,H]
        inputs = torch.cat([self.start.expand(bsz, 1, -1), emb], dim=1)  # [B,S,E]
        steps = torch.arange(memory.shape[1], device=src.device).unsqueeze(0)  # [1,S]
        mask = (steps <= src_len.unsqueeze(1)).float()  # [B,S]: END and the real points
        # Every glimpse's projected keys side by side: one tensor whatever the glimpse count,
        # so the step graph has a fixed signature.
        glimpse_keys = torch.cat([att.project_keys(memory) for att in self.glimpse]
                                 or [memory.new_zeros(bsz, memory.shape[1], 0)], dim=-1)  # [B,S,G*A]
        return {"h": h, "c": c, "mask": mask, "inputs": inputs, "memory": memory,
                "pointer_keys": self.pointer.project_keys(memory), "glimpse_keys": glimpse_keys}

    # ---- one decoder step ------------------------------------------------------------------
    def step(self, y_prev: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Point once. y_prev [B] int64 (the position pointed to last; 0 at the start).

        Returns log-probabilities over positions [B,S] and the carried state (h, c, mask).
        """
        idx = y_prev.view(-1, 1, 1).expand(-1, 1, state["inputs"].shape[2])  # [B,1,E]
        x = state["inputs"].gather(1, idx).squeeze(1)  # [B,E]
        h, c = self.cell(x, (state["h"], state["c"]))  # [B,H] each
        # A point pointed to is not pointed to again; the END slot always stays available.
        steps = torch.arange(state["mask"].shape[1], device=x.device).unsqueeze(0)  # [1,S]
        used = ((steps == y_prev.unsqueeze(1)) & (steps > 0)).float()  # [B,S]
        mask = state["mask"] * (1 - used)
        query = h
        glimpse_keys = state["glimpse_keys"].split(self.cfg.attn_dim, dim=-1)  # G x [B,S,A]
        for att, keys in zip(self.glimpse, glimpse_keys):
            query, _ = att(query, keys, state["memory"], mask)  # [B,H]
        scores = self.pointer.score(query, state["pointer_keys"], mask)  # [B,S]
        if self.cfg.logit_clip:
            scores = torch.where(mask > 0, self.cfg.logit_clip * torch.tanh(scores), scores)
        return torch.log_softmax(scores, dim=-1), {"h": h, "c": c, "mask": mask}

    # ---- model contract --------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Teacher-forced cross-entropy over pointers (targets ``tgt`` [B,T], -100 = padding)."""
        state = self.encode(batch["src"], batch["src_len"])
        target = batch["tgt"]  # [B,T]
        y = torch.zeros_like(target[:, 0])
        logps = []
        for t in range(target.shape[1]):
            logp, carried = self.step(y, state)
            state.update(carried)
            logps.append(logp)
            y = target[:, t].clamp(min=0)  # teacher forcing; padding feeds END, ignored below
        logps = torch.stack(logps, dim=1)  # T x [B,S] -> [B,T,S]
        loss = F.nll_loss(logps.reshape(-1, logps.shape[-1]), target.reshape(-1), ignore_index=-100)
        real = target != -100
        right = (logps.argmax(-1) == target) | ~real
        return loss, {"pointer_acc": ((logps.argmax(-1) == target) & real).sum() / real.sum(),
                      "seq_acc": right.all(dim=1).float().mean()}

    @torch.no_grad()
    def predict(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Greedy decoding.

        Returns: tokens [B,T] (positions 1..N, then END = 0, then 0), lengths [B] (pointers
            before END), attention [B,T,S] (the pointer distribution of every step).
        """
        state = self.encode(batch["src"], batch["src_len"])

        def step(y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            logp, carried = self.step(y, state)
            state.update(carried)
            return logp, {"attention": logp.exp()}

        return greedy(step, batch["src"].shape[0], state["h"].device, self.cfg)

    def export_graphs(self) -> dict[str, ExportSpec]:
        """``encoder`` + ``decoder_step`` (h, c and the mask carried); ``serving.decode`` loops."""
        src = torch.rand(2, 5, self.cfg.input_size)
        src_len = torch.tensor([5, 3])
        enc = self.encode(src, src_len)
        static = STATE[3:]
        bs = {0: "batch", 1: "positions"}
        b = {0: "batch"}
        enc_axes = {"src": {0: "batch", 1: "points"}, "src_len": b, "h": b, "c": b,
                    **{n: bs for n in ["mask"] + static}}
        step_axes = {"y_prev": b, "h": b, "c": b, "new_h": b, "new_c": b, "log_probs": bs,
                     "attention": bs, "new_mask": bs, **{n: bs for n in ["mask"] + static}}
        return {
            "encoder": graph(self, picked(STATE), {"src": src, "src_len": src_len}, STATE, enc_axes),
            "decoder_step": graph(self, _decoder_step, {"y_prev": torch.tensor([0, 0]), **{n: enc[n] for n in STATE}},
                                  ["log_probs", "new_h", "new_c", "new_mask", "attention"], step_axes),
        }


def _decoder_step(model: PointerNet, y_prev: Tensor, *state: Tensor) -> tuple[Tensor, ...]:
    """The served step: log-probabilities, the carried h, c and mask, and the pointer distribution,
    the model's attention (returned for plots and clients)."""
    logp, carried = model.step(y_prev, dict(zip(STATE, state)))
    return logp, carried["h"], carried["c"], carried["mask"], logp.exp()
