"""RNNsearch: Bahdanau, Cho & Bengio 2015, "Neural Machine Translation by Jointly Learning to
Align and Translate" (arXiv:1409.0473).

Bidirectional GRU encoder (annotations h_j = [h→_j; h←_j]), GRU decoder whose state follows
s_i = f(s_{i-1}, y_{i-1}, c_i) with context c_i = Σ_j α_ij h_j from additive attention
(eqs. 5-6), initial state s_0 = tanh(W_s h←_1) and a deep maxout output layer (appendix A.2.2).
``attention: none`` is the paper's RNNencdec ablation (Cho et al. 2014, the paper's Fig. 2 baseline): a forward
GRU reads the source, c = tanh(V h_S) is one fixed context for every step and s_0 = tanh(V' c). It has no backward
encoder: that half of RNNsearch exists to give the attention annotations of both directions, and with it the summary
would hold the sentence's start as fresh as its end, which is what the fixed-vector baseline is meant to lack.

Dimension legend
    B batch, S source length, T target length, E embedding, H encoder hidden (per direction),
    D decoder hidden, C = 2H annotation size, A attention size, V target vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models import register
from models.decode import greedy
from models.export import ExportSpec, decoder_step, encoder, graph
from models.layers import NEG_INF, AdditiveAttention, LoopGradients, real_rows_loss, reverse_padded, token_loss


@dataclass
class BahdanauConfig:
    src_vocab: int = 4000
    tgt_vocab: int = 4000
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    emb_dim: int = 256
    enc_hidden: int = 256
    dec_hidden: int = 256
    attn_dim: int = 256
    maxout_dim: int = 256
    dropout: float = 0.2
    label_smoothing: float = 0.1
    attention: str = "additive"  # additive | none (RNNencdec ablation)
    max_len: int = 60  # decoding limit in target tokens
    teacher_forced: str = "per_step"  # or "hoisted", "deferred": how loss() runs the decoder (hoisted_loss)


@register("bahdanau", BahdanauConfig)
class Bahdanau(nn.Module):
    def __init__(self, cfg: BahdanauConfig):
        super().__init__()
        if cfg.attention not in ("additive", "none"):
            raise ValueError(f"attention must be 'additive' or 'none', got '{cfg.attention}'")
        self.cfg = cfg
        ctx = 2 * cfg.enc_hidden
        self.src_embed = nn.Embedding(cfg.src_vocab, cfg.emb_dim, padding_idx=cfg.pad_id)
        self.tgt_embed = nn.Embedding(cfg.tgt_vocab, cfg.emb_dim, padding_idx=cfg.pad_id)
        self.enc_fwd = nn.GRU(cfg.emb_dim, cfg.enc_hidden, batch_first=True)
        if cfg.attention == "additive":
            self.enc_bwd = nn.GRU(cfg.emb_dim, cfg.enc_hidden, batch_first=True)
            self.init_state = nn.Linear(cfg.enc_hidden, cfg.dec_hidden)  # s_0 = tanh(W_s h←_1)
            self.attention = AdditiveAttention(cfg.dec_hidden, ctx, cfg.attn_dim)
        else:
            # RNNencdec: c = tanh(V h→_S) sized like an annotation, so both variants share the
            # decoder; s_0 = tanh(V' c).
            self.summary = nn.Linear(cfg.enc_hidden, ctx)
            self.init_state = nn.Linear(ctx, cfg.dec_hidden)
        self.cell = nn.GRUCell(cfg.emb_dim + ctx, cfg.dec_hidden)
        # Deep output t̃_i = U_o s_i + V_o E y_{i-1} + C_o c_i, then maxout over pairs (A.2.2).
        self.out_state = nn.Linear(cfg.dec_hidden, 2 * cfg.maxout_dim)
        self.out_embed = nn.Linear(cfg.emb_dim, 2 * cfg.maxout_dim, bias=False)
        self.out_context = nn.Linear(ctx, 2 * cfg.maxout_dim, bias=False)
        self.out_proj = nn.Linear(cfg.maxout_dim, cfg.tgt_vocab)
        self.drop = nn.Dropout(cfg.dropout)

    # ---- encoder ---------------------------------------------------------------------------
    def encode(self, src: Tensor, src_len: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """src [B,S] int64, src_len [B] -> (memory [B,S',C], keys [B,S',A'], s0 [B,D], mask [B,S']).

        With attention the memory is the annotation sequence (S' = S); without it, the single
        summary vector (S' = 1), so both variants share one decoder-step signature.
        """
        steps = torch.arange(src.shape[1], device=src.device).unsqueeze(0)  # [1,S]
        mask = (steps < src_len.unsqueeze(1)).float()  # [B,S]
        emb = self.drop(self.src_embed(src))  # [B,S,E]
        fwd, _ = self.enc_fwd(emb)  # [B,S,H]
        if self.cfg.attention == "none":
            last = (src_len - 1).view(-1, 1, 1).expand(-1, 1, fwd.shape[2])  # [B,1,H]
            fwd_last = fwd.gather(1, last).squeeze(1)  # [B,S,H] -> [B,H], h→ at the last real token
            summary = torch.tanh(self.summary(fwd_last))  # [B,C]
            s0 = torch.tanh(self.init_state(summary))  # [B,D]
            memory = summary.unsqueeze(1)  # [B,C] -> [B,1,C]
            return memory, memory, s0, mask[:, :1]
        bwd_rev, _ = self.enc_bwd(reverse_padded(emb, src_len))  # [B,S,H]
        bwd = reverse_padded(bwd_rev, src_len)  # [B,S,H], position j holds h←_j
        annotations = torch.cat([fwd, bwd], dim=-1)  # [B,S,C]
        s0 = torch.tanh(self.init_state(bwd[:, 0]))  # [B,D]
        return annotations, self.attention.project_keys(annotations), s0, mask

    # ---- one decoder step ------------------------------------------------------------------
    def step(
        self, y_prev: Tensor, state: Tensor, memory: Tensor, keys: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """y_prev [B] int64, state [B,D] -> (logits [B,V], new state [B,D], alignment [B,S'])."""
        readout, new_state, align = self._readout(y_prev, state, memory, keys, mask)
        return self.out_proj(readout), new_state, align

    def _readout(
        self, y_prev: Tensor, state: Tensor, memory: Tensor, keys: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The step up to the vocabulary projection: (dropped maxout t_i [B,O], new state, alignment)."""
        emb = self.drop(self.tgt_embed(y_prev))  # [B,E]
        if self.cfg.attention == "additive":
            context, align = self.attention(state, keys, memory, mask)  # [B,C], [B,S]
        else:
            context, align = memory[:, 0], mask  # [B,C], [B,1] of ones
        new_state = self.cell(torch.cat([emb, context], dim=-1), state)  # [B,D]
        t = self.out_state(new_state) + self.out_embed(emb) + self.out_context(context)  # [B,2O]
        t = t.view(t.shape[0], -1, 2).max(dim=-1).values  # [B,O,2] -> [B,O] maxout
        return self.drop(t), new_state, align

    # ---- model contract --------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Teacher-forced cross-entropy over target tokens (padding ignored)."""
        if self.cfg.teacher_forced != "per_step":
            return hoisted_loss(self, batch)
        memory, keys, state, mask = self.encode(batch["src"], batch["src_len"])
        readouts = []
        for t in range(batch["tgt_in"].shape[1]):
            readout, state, _ = self._readout(batch["tgt_in"][:, t], state, memory, keys, mask)
            readouts.append(readout)
        # The vocabulary projection, most of a step's work, once over all steps: one product, one weight gradient
        logits = self.out_proj(torch.stack(readouts, dim=1))  # T x [B,O] -> [B,T,O] -> [B,T,V]
        smoothing = self.cfg.label_smoothing if self.training else 0.0
        loss, acc = token_loss(logits, batch["tgt_out"], self.cfg.pad_id, smoothing)
        return loss, {"token_acc": acc}

    @torch.no_grad()
    def predict(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Greedy decoding.

        Returns: tokens [B,T] (EOS-terminated, pad after), lengths [B] (without EOS),
            attention [B,T,S'] (alignment of each emitted token).
        """
        memory, keys, state, mask = self.encode(batch["src"], batch["src_len"])

        def step(y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            nonlocal state
            logits, state, align = self.step(y, state, memory, keys, mask)
            return logits, {"attention": align}

        return greedy(step, batch["src"].shape[0], memory.device, self.cfg)

    def export_graphs(self) -> dict[str, ExportSpec]:
        """``encoder`` + ``decoder_step``; the decoding loop lives in ``serving.decode``."""
        src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, 0, 0]])
        src_len = torch.tensor([5, 3])
        memory, keys, s0, mask = self.encode(src, src_len)
        batch_seq = {0: "batch", 1: "src_len"}
        return {
            "encoder": graph(self, encoder, {"src": src, "src_len": src_len}, ["memory", "keys", "state", "mask"],
                             {"src": batch_seq, "src_len": {0: "batch"}, "memory": batch_seq,
                              "keys": batch_seq, "state": {0: "batch"}, "mask": batch_seq}),
            "decoder_step": graph(
                self, decoder_step,
                {"y_prev": torch.tensor([1, 1]), "state": s0, "memory": memory, "keys": keys, "mask": mask},
                ["log_probs", "new_state", "attention"],
                {"y_prev": {0: "batch"}, "state": {0: "batch"}, "memory": batch_seq,
                 "keys": batch_seq, "mask": batch_seq, "log_probs": {0: "batch"},
                 "new_state": {0: "batch"}, "attention": batch_seq}),
        }


# ---- the teacher-forced loss with the step-independent work out of the time loop ----------------------------
def hoisted_loss(model: Bahdanau, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """``model.loss`` with ``teacher_forced: hoisted`` or ``deferred``: the same function and the same dropout
    masks, only rounding differs (tests/test_registry.py). The time loop keeps what needs the previous state (the
    attention and the GRU's recurrent product); the embedding's share of the GRU input, the deep-output
    layers and the dropout run over all steps at once (a few large matrix products instead of many small
    ones), and a step's context share of the GRU input is its alignment times the annotations projected
    once (W Σ_j α_j h_j = Σ_j α_j W h_j). ``deferred`` also sums the gradients of what every step reuses (W_hh,
    the attention's W and v, the projected annotations) once after the loop (models.layers.LoopGradients) and
    projects only the rows of real target tokens onto the vocabulary (padding's take no part in the loss)."""
    if model.cfg.teacher_forced not in ("hoisted", "deferred"):
        raise ValueError("teacher_forced must be 'per_step', 'hoisted' or 'deferred', "
                         f"got '{model.cfg.teacher_forced}'")
    memory, keys, state, mask = model.encode(batch["src"], batch["src_len"])
    tgt_in, cell, split = batch["tgt_in"], model.cell, model.cfg.emb_dim
    bsz, steps = tgt_in.shape
    emb_noise, out_noise = _dropout_noise(model, bsz, steps, memory.device)
    emb = model.tgt_embed(tgt_in)  # [B,T,E]
    if emb_noise is not None:
        emb = emb * emb_noise  # as nn.Dropout scales: input * (mask / (1 - p))
    linear = nn.functional.linear
    gi_steps = linear(emb, cell.weight_ih[:, :split], cell.bias_ih).unbind(dim=1)  # [B,T,3D] -> T x [B,3D]
    additive = model.cfg.attention == "additive"
    # [B,S,3D]: W h_j of every annotation; [B,3D]: the one fixed context's
    ctx_gi = linear(memory if additive else memory[:, 0], cell.weight_ih[:, split:])
    step = _HeldStep(model, ctx_gi) if model.cfg.teacher_forced == "deferred" else None
    states, aligns = [], []
    for t in range(steps):
        if additive:
            align = torch.softmax(step.scores(state, keys, mask) if step else model.attention.score(state, keys, mask),
                                  dim=-1)  # [B,S]
            aligns.append(align)
            gi = gi_steps[t] + (step.context(align) if step else  # [B,1,3D] -> [B,3D]
                                torch.bmm(align.unsqueeze(1), ctx_gi).squeeze(1))
        else:
            gi = gi_steps[t] + ctx_gi
        state = _gru_cell(gi, state, cell, step.recurrent if step else None)  # [B,D]
        states.append(state)
    # [B,T,S] x [B,S,C] -> [B,T,C], or the fixed context [B,1,C] broadcast over the steps
    context = torch.bmm(torch.stack(aligns, dim=1), memory) if additive else memory[:, :1]
    t = (model.out_state(torch.stack(states, dim=1)) + model.out_embed(emb)
         + model.out_context(context))  # T x [B,D] -> [B,T,D]; [B,T,2O]
    t = t.view(bsz, steps, -1, 2).max(dim=-1).values  # [B,T,O,2] -> [B,T,O] maxout
    readouts = t if out_noise is None else t * out_noise.to(t.dtype)
    smoothing = model.cfg.label_smoothing if model.training else 0.0
    if step is None:
        loss, acc = token_loss(model.out_proj(readouts), batch["tgt_out"], model.cfg.pad_id, smoothing)
    else:
        loss, acc = real_rows_loss(model.out_proj, readouts, batch["tgt_out"], model.cfg.pad_id, smoothing)
    return loss, {"token_acc": acc}


class _HeldStep:
    """The loop's reused tensors for ``deferred``: W_hh, the attention's W and v, the projected annotations."""

    def __init__(self, model: Bahdanau, ctx_gi: Tensor):
        loop = LoopGradients(ctx_gi.device.type)
        self.cell, self.whh = model.cell, loop.weight(model.cell.weight_hh)  # [3D,D]
        if model.cfg.attention == "additive":
            self.ctx_gi, self.query = loop.memory(ctx_gi), loop.weight(model.attention.query.weight)  # [A,D]
            self.v = loop.weight(model.attention.v.weight)  # [1,A]

    def recurrent(self, h: Tensor) -> Tensor:
        return self.whh.linear(h) + self.cell.bias_hh  # [B,D] -> [B,3D]

    def scores(self, state: Tensor, keys: Tensor, mask: Tensor) -> Tensor:
        """AdditiveAttention.score: state [B,D], keys [B,S,A], mask [B,S] -> [B,S]."""
        energy = torch.tanh(self.query.linear(state).unsqueeze(1) + keys)  # [B,1,A] + [B,S,A] -> [B,S,A]
        scores = self.v.linear(energy.flatten(0, 1)).view(keys.shape[:2])  # [B*S,A] -> [B*S,1] -> [B,S]
        return scores.masked_fill(mask <= 0, NEG_INF)

    def context(self, align: Tensor) -> Tensor:
        return self.ctx_gi.context(align)  # [B,S] -> [B,3D]


def _dropout_noise(model: Bahdanau, bsz: int, steps: int, device: torch.device) -> tuple[Tensor | None, ...]:
    """The dropout masks the per-step loss draws, in its order (the embedding's, then the readout's, at each
    step) and dtypes, scaled by 1 / (1 - p): (embedding [B,T,E], readout [B,T,O]), or Nones."""
    p = model.drop.p
    if not model.training or p == 0:
        return None, None
    autocast = torch.is_autocast_enabled(device.type)
    out_dtype = torch.get_autocast_dtype(device.type) if autocast else torch.float32
    emb, out = [], []
    for _ in range(steps):
        emb.append(torch.empty(bsz, model.cfg.emb_dim, device=device).bernoulli_(1 - p).div_(1 - p))
        out.append(torch.empty(bsz, model.cfg.maxout_dim, device=device, dtype=out_dtype)
                   .bernoulli_(1 - p).div_(1 - p))
    return torch.stack(emb, dim=1), torch.stack(out, dim=1)  # T x [B,F] -> [B,T,F]


def _gru_cell(gi: Tensor, h: Tensor, cell: nn.GRUCell, recurrent=None) -> Tensor:
    """``cell`` on an input whose projection W_ih x + b_ih is ``gi`` [B,3D]; h [B,D] -> h' [B,D] (PyTorch's
    GRUCell: gates r, z, n in that order, h' = (h - n) z + n). ``recurrent``: W_hh h + b_hh computed by it."""
    i_r, i_z, i_n = gi.chunk(3, dim=-1)  # [B,3D] -> 3 x [B,D]
    hh = recurrent(h) if recurrent else nn.functional.linear(h, cell.weight_hh, cell.bias_hh)  # [B,3D]
    h_r, h_z, h_n = hh.chunk(3, dim=-1)  # 3 x [B,D]
    reset = torch.sigmoid(h_r + i_r)
    update = torch.sigmoid(h_z + i_z)
    new = torch.tanh(i_n + h_n * reset)
    return (h - new) * update + new
