"""Attention-based speech recognition: Chorowski et al. 2015, "Attention-Based Models for Speech
Recognition" (arXiv:1506.07503).

Encoder: log-mel frames, stacked three at a time by the features (``serving/features.py``: a
30 ms step, a rate the decoder can afford on a CPU), then ``layers`` bidirectional GRUs →
annotations h_j. (The stacking is not in the graph: torch.onnx's GRU decomposition fails on a
sequence length derived from the input's, e.g. frames / 3.)
Decoder: GRU state s_{i-1}; attention energies (eq. 2 and §2.1)
    content:   e_ij = wᵀ tanh(W s_{i-1} + V h_j + b)
    location:  e_ij = wᵀ tanh(W s_{i-1} + V h_j + U f_ij + b),  f_i = F * α_{i-1}
(F: ``loc_filters`` convolution filters of width ``loc_width`` over the previous alignment);
α_i = softmax(β e_i) with sharpening β, or with ``smoothing`` σ(e_ij) / Σ_j σ(e_ij) (§2.3);
with ``window_before``/``window_after`` > 0 only the annotations from the median of α_{i-1} minus
``window_before`` to plus ``window_after`` are considered (the paper's windowing, §2.3).
Then g_i = Σ_j α_ij h_j, s_i = GRU([E y_{i-1}; g_i], s_{i-1}) and y_i from a deep output layer
tanh(W_o [s_i; g_i; E y_{i-1}]). α_0 is a one-hot at the first annotation: "start at the start".

The energies reuse ``models.layers.AdditiveAttention``: U f_ij enters as a per-step addition
to its precomputed V h_j + b.

Dimension legend
    B batch, S encoder steps (stacked frames), I input size per step, D = 2·enc_hidden annotation size,
    A attention size, K location filters, E embedding, N decoder hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models import register
from models.decode import greedy
from models.export import ExportSpec, encoder, graph, log_probs_first
from models.layers import AdditiveAttention, PaddedBiRNN, token_loss


@dataclass
class SpeechAttentionConfig:
    input_size: int = 120  # 3 stacked frames of 40 log-mel bins
    vocab: int = 13
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    layers: int = 2
    enc_hidden: int = 128
    emb_dim: int = 32
    hidden: int = 256
    attn_dim: int = 128
    attention: str = "location"  # content | location
    loc_filters: int = 10  # F = 10, as in the paper's TIMIT model
    loc_width: int = 21  # annotations each filter spans (odd)
    sharpening: float = 1.0  # β
    smoothing: bool = False
    window_before: int = 0  # windowing around the previous alignment's median (0: off)
    window_after: int = 0
    dropout: float = 0.2
    max_len: int = 24  # decoding limit in characters (EOS included)


@register("speech_attention", SpeechAttentionConfig)
class SpeechAttention(nn.Module):
    def __init__(self, cfg: SpeechAttentionConfig):
        super().__init__()
        if cfg.attention not in ("content", "location"):
            raise ValueError(f"attention must be 'content' or 'location', got '{cfg.attention}'")
        if cfg.loc_width % 2 == 0:
            raise ValueError(f"loc_width must be odd, got {cfg.loc_width}")
        self.cfg = cfg
        sizes = [cfg.input_size] + [2 * cfg.enc_hidden] * (cfg.layers - 1)
        self.encoder = nn.ModuleList(PaddedBiRNN("gru", n, cfg.enc_hidden) for n in sizes)
        d = 2 * cfg.enc_hidden
        self.init = nn.Linear(d, cfg.hidden)
        self.attention = AdditiveAttention(cfg.hidden, d, cfg.attn_dim)
        if cfg.attention == "location":
            self.loc_conv = nn.Conv1d(1, cfg.loc_filters, cfg.loc_width, padding=cfg.loc_width // 2, bias=False)
            self.loc_proj = nn.Linear(cfg.loc_filters, cfg.attn_dim, bias=False)  # U
        self.embed = nn.Embedding(cfg.vocab, cfg.emb_dim, padding_idx=cfg.pad_id)
        self.cell = nn.GRUCell(cfg.emb_dim + d, cfg.hidden)
        self.deep = nn.Linear(cfg.hidden + d + cfg.emb_dim, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.vocab)
        self.drop = nn.Dropout(cfg.dropout)

    # ---- encoder ---------------------------------------------------------------------------
    def encode(self, features: Tensor, steps: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """features [B,S,I] (stacked frames, right-padded), steps [B] ->
        (annotations [B,S,D], keys V h + b [B,S,A], s_0 [B,N], α_0 [B,S], mask [B,S])."""
        lengths = steps
        pos = torch.arange(features.shape[1], device=features.device).unsqueeze(0)  # [1,S]
        mask = (pos < lengths.unsqueeze(1)).float()  # [B,S]
        x = features * mask.unsqueeze(-1)
        for i, rnn in enumerate(self.encoder):
            x = rnn(self.drop(x) if i else x, lengths)  # [B,S,D], zero past each length
        mean = x.sum(1) / lengths.unsqueeze(1).float()  # [B,D]
        align = (pos == 0).float() * mask  # α_0: all weight on the first annotation, [B,S]
        return x, self.attention.project_keys(x), torch.tanh(self.init(mean)), align, mask

    # ---- one decoder step ------------------------------------------------------------------
    def attend(self, state: Tensor, align: Tensor, keys: Tensor, mask: Tensor) -> Tensor:
        """α_i [B,S] from s_{i-1} [B,N] and α_{i-1} [B,S]."""
        cfg = self.cfg
        if cfg.attention == "location":
            f = self.loc_conv(align.unsqueeze(1)).transpose(1, 2)  # [B,1,S] -> [B,K,S] -> [B,S,K]
            keys = keys + self.loc_proj(f)  # V h_j + b + U f_ij, [B,S,A]
        if cfg.window_before > 0 or cfg.window_after > 0:
            median = (torch.cumsum(align, dim=1) < 0.5).sum(1, keepdim=True)  # first j with Σ α ≥ ½, [B,1]
            pos = torch.arange(align.shape[1], device=align.device).unsqueeze(0)  # [1,S]
            inside = (pos >= median - cfg.window_before) & (pos <= median + cfg.window_after)
            mask = mask * inside.float()
        energy = self.attention.score(state, keys, mask)  # [B,S], NEG_INF where masked
        if cfg.smoothing:
            weights = torch.sigmoid(energy) * mask  # σ(e_ij), masked positions exactly 0
            return weights / weights.sum(1, keepdim=True).clamp(min=1e-12)
        return torch.softmax(cfg.sharpening * energy, dim=-1)

    def step(self, y_prev: Tensor, state: Tensor, align: Tensor, memory: Tensor, keys: Tensor, mask: Tensor
             ) -> tuple[Tensor, Tensor, Tensor]:
        """-> (logits [B,V], s_i [B,N], α_i [B,S])."""
        alpha = self.attend(state, align, keys, mask)
        glimpse = torch.bmm(alpha.unsqueeze(1), memory).squeeze(1)  # [B,1,S] @ [B,S,D] -> [B,D]
        emb = self.drop(self.embed(y_prev))  # [B,E]
        state = self.cell(torch.cat([emb, glimpse], dim=-1), state)
        logits = self.out(self.drop(torch.tanh(self.deep(torch.cat([state, glimpse, emb], dim=-1)))))
        return logits, state, alpha

    # ---- model contract --------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        memory, keys, state, align, mask = self.encode(batch["features"], batch["steps"])
        logits = []
        for t in range(batch["tgt_in"].shape[1]):
            step_logits, state, align = self.step(batch["tgt_in"][:, t], state, align, memory, keys, mask)
            logits.append(step_logits)
        logits = torch.stack(logits, dim=1)  # T x [B,V] -> [B,T,V]
        nll, acc = token_loss(logits, batch["tgt_out"], self.cfg.pad_id, 0.0)
        return nll, {"token_acc": acc}

    @torch.no_grad()
    def predict(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Greedy transcription. Returns tokens [B,T] (EOS then pad), lengths [B] (characters
        before EOS), attention [B,T,S] (α_i over the annotations, 30 ms each)."""
        memory, keys, state, align, mask = self.encode(batch["features"], batch["steps"])

        def step(y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            nonlocal state, align
            logits, state, align = self.step(y, state, align, memory, keys, mask)
            return logits, {"attention": align}

        return greedy(step, memory.shape[0], memory.device, self.cfg)

    def export_graphs(self) -> dict[str, ExportSpec]:
        """``encoder`` (features, steps -> annotations, keys, state, α_0, mask) + ``decoder_step``
        (carries the state and the previous alignment)."""
        gen = torch.Generator().manual_seed(0)
        features = torch.randn(2, 14, self.cfg.input_size, generator=gen)
        steps = torch.tensor([14, 11])
        memory, keys, state, align, mask = self.encode(features, steps)
        b, bs = {0: "batch"}, {0: "batch", 1: "annotations"}
        return {
            "encoder": graph(self, encoder, {"features": features, "steps": steps},
                             ["memory", "keys", "state", "align", "mask"],
                             {"features": {0: "batch", 1: "annotations"}, "steps": b, "memory": bs, "keys": bs,
                              "state": b, "align": bs, "mask": bs}),
            "decoder_step": graph(
                self, _decoder_step,
                {"y_prev": torch.tensor([1, 1]), "state": state, "align": align, "memory": memory, "keys": keys,
                 "mask": mask},
                ["log_probs", "new_state", "new_align", "attention"],
                {"y_prev": b, "state": b, "align": bs, "memory": bs, "keys": bs, "mask": bs, "log_probs": b,
                 "new_state": b, "new_align": bs, "attention": bs}),
        }


def _decoder_step(model: SpeechAttention, *inputs: Tensor) -> tuple[Tensor, ...]:
    """The served step; the alignment is both the carried α_{i-1} of the next step and the attention output."""
    log_probs, new_state, alpha = log_probs_first(model.step(*inputs))
    return log_probs, new_state, alpha, alpha.clone()
