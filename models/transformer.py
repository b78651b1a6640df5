"""Transformer: Vaswani et al. 2017, "Attention Is All You Need" (arXiv:1706.03762).

Encoder-decoder of multi-head scaled dot-product attention (eq. 1; ``models.layers.
MultiHeadAttention``, which calls ``F.scaled_dot_product_attention``), position-wise
feed-forward layers (eq. 2), sinusoidal positions (§3.5), embeddings scaled by √d_model and
residual + LayerNorm sub-layers, post-norm as in the paper or pre-norm (``norm: pre``, more
stable on small data). Label smoothing in the loss (§5.4); the warm-up schedule is the shared
training loop's (``train.warmup_steps``).

Incremental decoding (as Hugging Face Optimum's ``decoder_with_past``): the encoder graph also
returns every decoder layer's cross-attention keys/values, computed once per sentence, and an
empty self-attention cache; each decoder step attends with the cache and returns it grown by one
position. :meth:`decode_uncached` re-runs the whole prefix instead, to check the cache.

Dimension legend
    B batch, S source length, T target length (P cached positions), D model dim, H heads,
    K = D/H head dim, F feed-forward dim, L decoder layers, V target vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import register
from models.decode import greedy
from models.export import ExportSpec, graph, picked
from models.layers import MultiHeadAttention, token_loss


@dataclass
class TransformerConfig:
    src_vocab: int = 4000
    tgt_vocab: int = 4000
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    dim: int = 256
    heads: int = 4
    ff_dim: int = 1024
    enc_layers: int = 3
    dec_layers: int = 3
    dropout: float = 0.1
    label_smoothing: float = 0.1
    norm: str = "pre"  # pre | post (the paper's)
    tie_output: bool = True  # decoder input and output embeddings shared (§3.4)
    max_len: int = 60  # decoding limit in target tokens


def sinusoid(positions: Tensor, dim: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^{2i/d}), PE(pos, 2i+1) = cos(...): positions [T] -> [T,D]."""
    freq = torch.exp(torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32)
                     * (-math.log(10000.0) / dim))  # [D/2]
    angles = positions.float().unsqueeze(1) * freq.unsqueeze(0)  # [T,1]*[1,D/2] -> [T,D/2]
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # [T,D/2,2] -> [T,D]


class _Block(nn.Module):
    """One encoder (self-attention + FFN) or decoder (+ cross-attention) layer."""

    def __init__(self, cfg: TransformerConfig, cross: bool):
        super().__init__()
        self.pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.dim, cfg.heads, cfg.dropout)
        self.cross_attn = MultiHeadAttention(cfg.dim, cfg.heads, cfg.dropout) if cross else None
        self.ff = nn.Sequential(nn.Linear(cfg.dim, cfg.ff_dim), nn.ReLU(), nn.Dropout(cfg.dropout),
                                nn.Linear(cfg.ff_dim, cfg.dim))
        self.norms = nn.ModuleList(nn.LayerNorm(cfg.dim) for _ in range(3 if cross else 2))
        self.drop = nn.Dropout(cfg.dropout)

    def sublayer(self, x: Tensor, i: int, fn) -> tuple[Tensor, Tensor | None]:
        """x + Dropout(fn(LN(x))) (pre-norm) or LN(x + Dropout(fn(x))) (post-norm)."""
        out, weights = fn(self.norms[i](x) if self.pre else x)
        x = x + self.drop(out)
        return (x if self.pre else self.norms[i](x)), weights

    def forward(self, x: Tensor, self_kv: tuple[Tensor, Tensor] | None, self_mask: Tensor | None,
                causal: bool, cross_kv: tuple[Tensor, Tensor] | None = None, cross_mask: Tensor | None = None,
                need_weights: bool = False) -> tuple[Tensor, Tensor | None, tuple[Tensor, Tensor]]:
        """x [B,T,D]; ``self_kv``: cached keys/values [B,H,P,K] of earlier positions (None: none).

        Returns: x [B,T,D], cross-attention weights [B,H,T,S] (or None), self keys/values
        [B,H,P+T,K] (the grown cache).
        """
        kv = {}

        def self_attention(h):
            k, v = self.self_attn.project_kv(h)  # [B,H,T,K]
            if self_kv is not None:
                k, v = torch.cat([self_kv[0], k], dim=2), torch.cat([self_kv[1], v], dim=2)  # [B,H,P+T,K]
            kv["k"], kv["v"] = k, v
            return self.self_attn.attend(h, k, v, self_mask, causal=causal)

        x, _ = self.sublayer(x, 0, self_attention)
        weights = None
        if self.cross_attn is not None:
            x, weights = self.sublayer(x, 1, lambda h: self.cross_attn.attend(
                h, *cross_kv, cross_mask, need_weights=need_weights))
        x, _ = self.sublayer(x, len(self.norms) - 1, lambda h: (self.ff(h), None))
        return x, weights, (kv["k"], kv["v"])


@register("transformer", TransformerConfig)
class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        if cfg.norm not in ("pre", "post"):
            raise ValueError(f"norm must be 'pre' or 'post', got '{cfg.norm}'")
        self.cfg = cfg
        self.src_embed = nn.Embedding(cfg.src_vocab, cfg.dim, padding_idx=cfg.pad_id)
        self.tgt_embed = nn.Embedding(cfg.tgt_vocab, cfg.dim, padding_idx=cfg.pad_id)
        self.encoder = nn.ModuleList(_Block(cfg, cross=False) for _ in range(cfg.enc_layers))
        self.decoder = nn.ModuleList(_Block(cfg, cross=True) for _ in range(cfg.dec_layers))
        # Pre-norm stacks end with a LayerNorm; post-norm layers already end normalised.
        self.enc_norm = nn.LayerNorm(cfg.dim) if cfg.norm == "pre" else nn.Identity()
        self.dec_norm = nn.LayerNorm(cfg.dim) if cfg.norm == "pre" else nn.Identity()
        for emb in (self.src_embed, self.tgt_embed):
            # N(0, 1/D): scaled by √D at the input they are unit-variance, and as (tied) output
            # weights they start with logits of unit scale (fairseq's init).
            nn.init.normal_(emb.weight, std=cfg.dim**-0.5)
            nn.init.zeros_(emb.weight[cfg.pad_id])
        if cfg.tie_output:
            # Logits reuse the embedding matrix through F.linear rather than a shared Parameter,
            # so the state dict holds no aliased tensors (safetensors refuses those).
            self.out_bias = nn.Parameter(torch.zeros(cfg.tgt_vocab))
        else:
            self.out_proj = nn.Linear(cfg.dim, cfg.tgt_vocab)
        self.drop = nn.Dropout(cfg.dropout)

    def embed(self, embedding: nn.Embedding, tokens: Tensor, start: Tensor | int = 0) -> Tensor:
        """tokens [B,T] at positions start.. -> √D·E + PE, [B,T,D]."""
        positions = torch.arange(tokens.shape[1], device=tokens.device) + start  # [T]
        x = embedding(tokens) * math.sqrt(self.cfg.dim) + sinusoid(positions, self.cfg.dim)
        return self.drop(x)

    # ---- encoder ---------------------------------------------------------------------------
    def encode(self, src: Tensor, src_len: Tensor) -> dict[str, Tensor]:
        """src [B,S], src_len [B] -> memory [B,S,D], mask [B,S] (1 = real), cross keys/values
        [B,L,H,S,K] of every decoder layer, and the empty self-attention cache [B,L,H,0,K]."""
        steps = torch.arange(src.shape[1], device=src.device).unsqueeze(0)  # [1,S]
        mask = (steps < src_len.unsqueeze(1)).float()  # [B,S]
        key_mask = mask.bool()[:, None, None, :]  # [B,1,1,S]: padding is never a key
        x = self.embed(self.src_embed, src)
        for block in self.encoder:
            x, _, _ = block(x, None, key_mask, causal=False)
        memory = self.enc_norm(x)
        kvs = [block.cross_attn.project_kv(memory) for block in self.decoder]  # L x ([B,H,S,K], ...)
        cross_k = torch.stack([k for k, _ in kvs], dim=1)  # [B,L,H,S,K]
        cross_v = torch.stack([v for _, v in kvs], dim=1)
        empty = cross_k[:, :, :, :0]  # [B,L,H,0,K]
        return {"memory": memory, "mask": mask, "cross_k": cross_k, "cross_v": cross_v,
                "self_k": empty, "self_v": empty}

    # ---- decoder ---------------------------------------------------------------------------
    def decode(self, tokens: Tensor, enc: dict[str, Tensor], self_k: Tensor | None = None,
               self_v: Tensor | None = None, need_weights: bool = False):
        """Decoder over tokens [B,T] after P cached positions (self_k/v [B,L,H,P,K], or None).

        Returns: logits [B,T,V], cross-attention [B,L,H,T,S] (or None), cache [B,L,H,P+T,K] ×2.
        """
        past = 0 if self_k is None else self_k.shape[3]
        x = self.embed(self.tgt_embed, tokens, past)
        cross_mask = enc["mask"].bool()[:, None, None, :]  # [B,1,1,S]
        # One new position attends to every cached one; a teacher-forced block is causal.
        causal = tokens.shape[1] > 1
        weights, ks, vs = [], [], []
        for i, block in enumerate(self.decoder):
            cache = None if self_k is None else (self_k[:, i], self_v[:, i])  # [B,H,P,K] each
            x, w, (k, v) = block(x, cache, None, causal, (enc["cross_k"][:, i], enc["cross_v"][:, i]),
                                 cross_mask, need_weights)
            weights.append(w)
            ks.append(k)
            vs.append(v)
        x = self.dec_norm(x)
        logits = F.linear(x, self.tgt_embed.weight, self.out_bias) if self.cfg.tie_output else self.out_proj(x)
        attn = torch.stack(weights, dim=1) if need_weights else None  # L x [B,H,T,S] -> [B,L,H,T,S]
        return logits, attn, torch.stack(ks, dim=1), torch.stack(vs, dim=1)  # L x [B,H,P+T,K] -> [B,L,...]

    def step(self, y_prev: Tensor, self_k: Tensor, self_v: Tensor, cross_k: Tensor, cross_v: Tensor,
             mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One cached step: y_prev [B] -> (logits [B,V], cross-attention [B,L,H,S], new self_k/v)."""
        enc = {"cross_k": cross_k, "cross_v": cross_v, "mask": mask}
        logits, attn, k, v = self.decode(y_prev.unsqueeze(1), enc, self_k, self_v, need_weights=True)
        return logits[:, 0], attn[:, :, :, 0], k, v  # [B,1,V] -> [B,V]; [B,L,H,1,S] -> [B,L,H,S]

    # ---- model contract --------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Teacher-forced, label-smoothed cross-entropy over target tokens (padding ignored)."""
        enc = self.encode(batch["src"], batch["src_len"])
        logits, _, _, _ = self.decode(batch["tgt_in"], enc)  # [B,T,V]
        smoothing = self.cfg.label_smoothing if self.training else 0.0
        loss, acc = token_loss(logits, batch["tgt_out"], self.cfg.pad_id, smoothing)
        return loss, {"token_acc": acc}

    def _greedy(self, batch: dict[str, Tensor], cached: bool) -> dict[str, Tensor]:
        enc = self.encode(batch["src"], batch["src_len"])
        self_k, self_v = enc["self_k"], enc["self_v"]
        prefix = batch["src"][:, :0]  # the tokens fed so far: [B,0]

        def step(y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            nonlocal prefix, self_k, self_v
            if cached:
                logits, attn, self_k, self_v = self.step(y, self_k, self_v, enc["cross_k"], enc["cross_v"],
                                                         enc["mask"])
            else:
                prefix = torch.cat([prefix, y.unsqueeze(1)], dim=1)  # [B,t] -> [B,t+1]
                logits, attn, _, _ = self.decode(prefix, enc, need_weights=True)
                logits, attn = logits[:, -1], attn[:, :, :, -1]  # the last position: [B,V], [B,L,H,S]
            log_probs = torch.log_softmax(logits, dim=-1)
            return log_probs, {"attention_heads": attn, "log_probs": log_probs}

        out = greedy(step, batch["src"].shape[0], enc["memory"].device, self.cfg)
        out["attention"] = out["attention_heads"].mean(dim=(2, 3))  # averaged over layers and heads: [B,T,S]
        return out

    @torch.no_grad()
    def predict(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Greedy decoding with the key/value cache.

        Returns: tokens [B,T] (EOS-terminated, pad after), lengths [B] (without EOS), attention
            [B,T,S] (encoder-decoder attention averaged over layers and heads), attention_heads
            [B,T,L,H,S], log_probs [B,T,V].
        """
        return self._greedy(batch, cached=True)

    @torch.no_grad()
    def decode_uncached(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """:meth:`predict` without the cache: every step re-runs the decoder on the whole prefix."""
        return self._greedy(batch, cached=False)

    def export_graphs(self) -> dict[str, ExportSpec]:
        """``encoder`` + ``decoder_step`` with the cache as carried inputs/outputs (``self_k`` ->
        ``new_self_k``); the decoding loop lives in ``serving.decode``."""
        src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, 0, 0]])
        src_len = torch.tensor([5, 3])
        enc = self.encode(src, src_len)
        # Three cached positions in the example, so the exporter keeps the cache length symbolic.
        _, _, self_k, self_v = self.decode(torch.tensor([[1, 5, 6], [1, 7, 2]]), enc)
        bs = {0: "batch", 1: "src_len"}
        cross, cache = {0: "batch", 3: "src_len"}, {0: "batch", 3: "past"}
        names = ["memory", "mask", "cross_k", "cross_v", "self_k", "self_v"]
        return {
            "encoder": graph(self, picked(names), {"src": src, "src_len": src_len}, names,
                             {"src": bs, "src_len": {0: "batch"}, "memory": bs, "mask": bs, "cross_k": cross,
                              "cross_v": cross, "self_k": {0: "batch"}, "self_v": {0: "batch"}}),
            "decoder_step": graph(
                self, _decoder_step,
                {"y_prev": torch.tensor([1, 1]), "self_k": self_k, "self_v": self_v, "cross_k": enc["cross_k"],
                 "cross_v": enc["cross_v"], "mask": enc["mask"]},
                ["log_probs", "attention", "new_self_k", "new_self_v"],
                {"y_prev": {0: "batch"}, "self_k": cache, "self_v": cache, "cross_k": cross,
                 "cross_v": cross, "mask": bs, "log_probs": {0: "batch"}, "attention": bs,
                 "new_self_k": {0: "batch", 3: "past_plus_1"}, "new_self_v": {0: "batch", 3: "past_plus_1"}}),
        }


def _decoder_step(model: Transformer, *inputs: Tensor) -> tuple[Tensor, ...]:
    """The served step: log-probabilities (what greedy and beam search consume), the attention averaged
    over layers and heads (the one alignment the seq2seq loop and the server return), the cache."""
    logits, attn, k, v = model.step(*inputs)
    return torch.log_softmax(logits, dim=-1), attn.mean(dim=(1, 2)), k, v
