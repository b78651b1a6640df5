"""Attention OCR: a CNN reads a text-line image into annotation vectors, an attention GRU decoder
spells the word (the seed's CNN + attention decoder; Lee & Osindero 2016, "Recursive Recurrent
Nets with Attention Modeling for OCR in the Wild", arXiv:1603.03101, for the recursive CNN).

Encoder: four conv blocks (conv, batch norm, ReLU, max-pool) take the [H=32, W] image to a
feature map of H/8 rows and W/4 columns. With ``recursions: k`` blocks 3 and 4 apply one extra
convolution k times with shared weights (and a batch norm per iteration, as recurrent conv nets
do): a deeper receptive field at the parameters of one layer (Lee & Osindero §3.1). Departure:
the paper makes every block recursive; here the two full-resolution blocks stay plain, which
would double the step time on 2 CPU cores.
``annotation: columns`` folds the rows into the channels and runs a BiLSTM over the columns
(L = W/4 annotations); ``annotation: grid`` keeps every cell and runs a BiLSTM along each row and
then one down each column (the seed's 2-D row + column BiRNN annotation, L = H/8 · W/4).

Decoder: GRU state s_0 = tanh(W_init · mean of the valid annotations); at step t additive attention
(``models.layers.AdditiveAttention``) of s_{t-1} over the annotations gives α_t and the context
c_t, the GRU reads [E y_{t-1}; c_t], and a deep output layer tanh(W_o [s_t; c_t; E y_{t-1}])
gives p(y_t).

Padding: images in a batch are right-padded with zeros; every conv block's output is zeroed past
the image's own width, so a padded image gets exactly the features it gets alone (the widths are
multiples of the 4-pixel stride; ``serving`` pads a request to one by repeating the last column).

Dimension legend
    B batch, H×W image, h×w feature map (h = H/8, w = W/4), C channels, L annotations,
    D annotation size (2·enc_hidden), A attention size, E embedding, N decoder hidden, T letters, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models import register
from models.decode import greedy
from models.export import ExportSpec, decoder_step, encoder, graph
from models.layers import AdditiveAttention, PaddedBiRNN, token_loss

STRIDE = 4  # horizontal down-sampling of the CNN


@dataclass
class AttentionOcrConfig:
    height: int = 32
    vocab: int = 29
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    channels: int = 16  # block 1; blocks 2, 3, 4 have 2×, 4×, 4×
    recursions: int = 0  # shared-weight iterations in blocks 3 and 4 (0: plain CNN)
    annotation: str = "columns"  # columns | grid
    enc_hidden: int = 128
    emb_dim: int = 32
    hidden: int = 256
    attn_dim: int = 128
    dropout: float = 0.2
    max_len: int = 11  # decoding limit in letters (EOS included)


class _Block(nn.Module):
    """conv-BN-ReLU, then (recursive CNN) one shared conv applied ``recursions`` times, then pool."""

    def __init__(self, ch_in: int, ch: int, recursions: int, pool: tuple[int, int]):
        super().__init__()
        self.conv = nn.Conv2d(ch_in, ch, 3, padding=1)
        self.norm = nn.BatchNorm2d(ch)
        self.shared = nn.Conv2d(ch, ch, 3, padding=1) if recursions else None
        self.norms = nn.ModuleList(nn.BatchNorm2d(ch) for _ in range(recursions))
        self.pool = nn.MaxPool2d(pool) if pool != (1, 1) else nn.Identity()

    def forward(self, x: Tensor, cols: Tensor) -> Tensor:
        """x [B,C,h,w], cols [B,1,1,w] (1 on the image's own columns) -> pooled [B,C',h',w']."""
        x = torch.relu(self.norm(self.conv(x))) * cols
        for norm in self.norms:
            x = torch.relu(norm(self.shared(x))) * cols  # same weights every iteration
        return self.pool(x)


@register("attention_ocr", AttentionOcrConfig)
class AttentionOcr(nn.Module):
    def __init__(self, cfg: AttentionOcrConfig):
        super().__init__()
        if cfg.annotation not in ("columns", "grid"):
            raise ValueError(f"annotation must be 'columns' or 'grid', got '{cfg.annotation}'")
        if cfg.height % 16:
            raise ValueError(f"height must be a multiple of 16, got {cfg.height}")
        self.cfg = cfg
        c = cfg.channels
        rec = cfg.recursions
        self.blocks = nn.ModuleList([
            _Block(1, c, 0, (2, 2)),  # H/2, W/2
            _Block(c, 2 * c, 0, (2, 2)),  # H/4, W/4
            _Block(2 * c, 4 * c, rec, (2, 1)),  # H/8
            _Block(4 * c, 4 * c, rec, (1, 1)),
        ])
        rows = cfg.height // 8
        self.annotation_rows = rows if cfg.annotation == "grid" else 1
        feat = 4 * c * (1 if cfg.annotation == "grid" else rows)
        self.rnn = PaddedBiRNN("lstm", feat, cfg.enc_hidden)  # along the columns
        d = 2 * cfg.enc_hidden
        # grid: then down each column (every row is real, so a plain BiLSTM)
        self.col_rnn = (nn.LSTM(d, cfg.enc_hidden, batch_first=True, bidirectional=True)
                        if cfg.annotation == "grid" else None)
        self.init = nn.Linear(d, cfg.hidden)
        self.attention = AdditiveAttention(cfg.hidden, d, cfg.attn_dim)
        self.embed = nn.Embedding(cfg.vocab, cfg.emb_dim, padding_idx=cfg.pad_id)
        self.cell = nn.GRUCell(cfg.emb_dim + d, cfg.hidden)
        self.deep = nn.Linear(cfg.hidden + d + cfg.emb_dim, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.vocab)
        self.drop = nn.Dropout(cfg.dropout)

    # ---- encoder ---------------------------------------------------------------------------
    def encode(self, image: Tensor, width: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """image [B,H,W] in [0,1] (right-padded), width [B] pixels ->
        (annotations [B,L,D], projected keys [B,L,A], s_0 [B,N], mask [B,L])."""
        x = image.unsqueeze(1)  # [B,1,H,W]
        scale = 1
        for i, block in enumerate(self.blocks):
            cols = torch.arange(x.shape[3], device=x.device) * scale < width.unsqueeze(1)  # [B,w]
            x = block(x, cols.float()[:, None, None, :])  # [B,1,1,w] broadcast over channels, rows
            scale *= 2 if i < 2 else 1
        bsz, ch, rows, w = x.shape
        cols = (width + STRIDE - 1) // STRIDE  # feature columns of each image, [B]
        valid = (torch.arange(w, device=x.device).unsqueeze(0) < cols.unsqueeze(1)).float()  # [B,w]
        if self.col_rnn is None:
            seq = x.permute(0, 3, 1, 2).reshape(bsz, w, ch * rows)  # [B,C,h,w] -> [B,w,C·h]
            memory = self.rnn(seq, cols)  # [B,w,D]
            mask = valid
        else:
            seq = x.permute(0, 2, 3, 1).reshape(bsz * rows, w, ch)  # [B,C,h,w] -> [B·h,w,C]
            along = self.rnn(seq, cols.repeat_interleave(rows))  # [B·h,w,D]
            d = along.shape[2]  # explicit sizes: a -1 here was baked as the example's width by the ONNX export
            along = along.reshape(bsz, rows, w, d).transpose(1, 2).reshape(bsz * w, rows, d)  # -> [B·w,h,D]
            down = self.col_rnn(along)[0]  # every row is real: [B·w,h,D]
            memory = down.reshape(bsz, w, rows, d).transpose(1, 2).reshape(bsz, rows * w, d)  # -> [B,h·w,D]
            mask = valid.repeat(1, rows)  # [B,w] -> [B,h·w], row-major like memory
        memory = memory * mask.unsqueeze(-1)
        mean = memory.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)  # [B,D]
        return memory, self.attention.project_keys(memory), torch.tanh(self.init(mean)), mask

    # ---- one decoder step ------------------------------------------------------------------
    def step(self, y_prev: Tensor, state: Tensor, memory: Tensor, keys: Tensor, mask: Tensor
             ) -> tuple[Tensor, Tensor, Tensor]:
        """-> (logits [B,V], new state [B,N], α [B,L])."""
        context, alpha = self.attention(state, keys, memory, mask)  # [B,D], [B,L]
        emb = self.drop(self.embed(y_prev))  # [B,E]
        state = self.cell(torch.cat([emb, context], dim=-1), state)
        logits = self.out(self.drop(torch.tanh(self.deep(torch.cat([state, context, emb], dim=-1)))))
        return logits, state, alpha

    # ---- model contract --------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        memory, keys, state, mask = self.encode(batch["image"], batch["width"])
        logits = []
        for t in range(batch["tgt_in"].shape[1]):
            step_logits, state, _ = self.step(batch["tgt_in"][:, t], state, memory, keys, mask)
            logits.append(step_logits)
        logits = torch.stack(logits, dim=1)  # T x [B,V] -> [B,T,V]
        nll, acc = token_loss(logits, batch["tgt_out"], self.cfg.pad_id, 0.0)
        return nll, {"token_acc": acc}

    @torch.no_grad()
    def predict(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Greedy reading. Returns tokens [B,T] (EOS then pad), lengths [B] (letters before EOS),
        attention [B,T,L] (α over the annotations, row-major over the h×w grid for ``grid``)."""
        memory, keys, state, mask = self.encode(batch["image"], batch["width"])

        def step(y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            nonlocal state
            logits, state, alpha = self.step(y, state, memory, keys, mask)
            return logits, {"attention": alpha}

        return greedy(step, memory.shape[0], memory.device, self.cfg)

    def export_graphs(self) -> dict[str, ExportSpec]:
        """``encoder`` (image, width -> annotations, keys, state, mask) + ``decoder_step``."""
        gen = torch.Generator().manual_seed(0)
        image = torch.rand(2, self.cfg.height, 48, generator=gen)
        width = torch.tensor([48, 32])
        memory, keys, state, mask = self.encode(image, width)
        b, bl = {0: "batch"}, {0: "batch", 1: "annotations"}
        return {
            "encoder": graph(self, encoder, {"image": image, "width": width}, ["memory", "keys", "state", "mask"],
                             {"image": {0: "batch", 2: "width_px"}, "width": b, "memory": bl, "keys": bl,
                              "state": b, "mask": bl}),
            "decoder_step": graph(
                self, decoder_step,
                {"y_prev": torch.tensor([1, 1]), "state": state, "memory": memory, "keys": keys, "mask": mask},
                ["log_probs", "new_state", "attention"],
                {"y_prev": b, "state": b, "memory": bl, "keys": bl, "mask": bl, "log_probs": b,
                 "new_state": b, "attention": bl}),
        }
