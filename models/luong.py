"""Luong, Pham & Manning 2015, "Effective Approaches to Attention-based Neural Machine Translation" (arXiv:1508.04025).

LSTM encoder and decoder (stacked when ``layers`` > 1). At step t the top decoder state h_t attends over the encoder
states h̄_s (global: all of them; local: a window around p_t), giving the context c_t and the attentional hidden state
h̃_t = tanh(W_c[c_t; h_t]) (eq. 5), from which p(y_t) = softmax(W_s h̃_t) (eq. 6). Input feeding (§3.3): h̃_{t-1} is
concatenated with the input embedding at step t. Scores (eq. 8, ``models.layers.LuongAttention``): dot | general |
concat. Positions: ``global``; ``local_m`` (p_t = t); ``local_p`` (p_t = S·σ(v_pᵀ tanh(W_p h_t)), eq. 9, S the source
length), both with a Gaussian window of σ = D/2 (eq. 10).

Departures: dot/general energies are divided by √D (``scaled``; unscaled, the softmax saturated on the sentence-final
states in training and the model ignored the source). The decoder starts from the encoder's top-to-bottom hidden
states at the last real source token with zero cells (the padded batch runs through ``nn.LSTM``, which does not expose
per-position cell states; packed sequences do not export with dynamic lengths).

Dimension legend
    B batch, S source length, T target length, E embedding, D hidden (encoder = decoder),
    L layers, A concat-score attention size, V target vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models import register
from models.decode import greedy
from models.export import ExportSpec, graph, log_probs_first, picked
from models.layers import LoopGradients, LuongAttention, local_window, real_rows_loss, reverse_padded, token_loss


@dataclass
class LuongConfig:
    src_vocab: int = 4000
    tgt_vocab: int = 4000
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    emb_dim: int = 256
    hidden: int = 256
    # One layer (the paper stacks 4 on WMT): on these 14k pairs a second layer learned slower,
    # validation loss 4.437 vs 4.269 after 669 steps (docs/results.md).
    layers: int = 1
    # Paper: unidirectional. True: each encoder layer runs a forward and a backward LSTM of D/2
    # units over the sentence and concatenates them (OpenNMT's "brnn"), so every h̄_s sees the
    # whole sentence, not only the last one.
    bidirectional: bool = False
    # Luong et al. Table 1 "+reverse" (after Sutskever et al. 2014): the encoder reads each
    # sentence backwards. Its states are put back in source order, so alignments and p_t keep
    # source positions; the decoder starts from the state that read the first word last.
    reverse_source: bool = False
    attn_dim: int = 256  # concat score only
    score: str = "general"  # dot | general | concat
    # dot/general energies divided by √D (not in the paper). Unscaled, they grew until the softmax
    # saturated on the sentence-final states and no alignment was learned: luong_general reached
    # test BLEU 1.14, below the no-attention ablation (docs/results.md).
    scaled: bool = True
    attention: str = "global"  # global | local_m | local_p
    window: int = 10  # D: the local window is [p_t - D, p_t + D], σ = D/2
    dropout: float = 0.2
    label_smoothing: float = 0.1
    max_len: int = 60  # decoding limit in target tokens
    teacher_forced: str = "per_step"  # or "hoisted" (one vocabulary projection after its loop), "deferred"


@register("luong", LuongConfig)
class Luong(nn.Module):
    def __init__(self, cfg: LuongConfig):
        super().__init__()
        if cfg.attention not in ("global", "local_m", "local_p"):
            raise ValueError(f"attention must be global, local_m or local_p, got '{cfg.attention}'")
        if cfg.teacher_forced not in TEACHER_FORCED:
            raise ValueError(f"teacher_forced must be one of {TEACHER_FORCED}, got '{cfg.teacher_forced}'")
        self.cfg = cfg
        d = cfg.hidden
        self.src_embed = nn.Embedding(cfg.src_vocab, cfg.emb_dim, padding_idx=cfg.pad_id)
        self.tgt_embed = nn.Embedding(cfg.tgt_vocab, cfg.emb_dim, padding_idx=cfg.pad_id)
        # One LSTM per layer: each layer's state at the last real token seeds that decoder layer.
        directions = 2 if cfg.bidirectional else 1
        if cfg.bidirectional and cfg.reverse_source:
            raise ValueError("reverse_source is for the unidirectional encoder (bidirectional reads both ways)")
        if d % directions:
            raise ValueError(f"a bidirectional encoder needs an even hidden size, got {d}")
        self.encoder = nn.ModuleList(
            nn.ModuleList(nn.LSTM(cfg.emb_dim if i == 0 else d, d // directions, batch_first=True)
                          for _ in range(directions))
            for i in range(cfg.layers))
        self.decoder = nn.ModuleList(nn.LSTMCell(cfg.emb_dim + d if i == 0 else d, d)
                                     for i in range(cfg.layers))
        self.attention = LuongAttention(cfg.score, d, cfg.attn_dim, cfg.scaled)
        if cfg.attention == "local_p":
            self.position = nn.Sequential(nn.Linear(d, d, bias=False), nn.Tanh(), nn.Linear(d, 1, bias=False))
        self.combine = nn.Linear(2 * d, d, bias=False)  # W_c
        self.out_proj = nn.Linear(d, cfg.tgt_vocab)  # W_s
        self.drop = nn.Dropout(cfg.dropout)

    # ---- encoder ---------------------------------------------------------------------------
    def encode(self, src: Tensor, src_len: Tensor) -> dict[str, Tensor]:
        """src [B,S] int64, src_len [B] -> memory h̄ [B,S,D], keys [B,S,D|A], mask [B,S], and the
        decoder's initial carried state: h, c [B,L,D], feed h̃_0 [B,D], pos t [B]."""
        steps = torch.arange(src.shape[1], device=src.device).unsqueeze(0)  # [1,S]
        mask = (steps < src_len.unsqueeze(1)).float()  # [B,S]
        x = self.drop(self.src_embed(src))  # [B,S,E]
        width = self.cfg.hidden // len(self.encoder[0])  # D' = D per direction
        last = (src_len - 1).view(-1, 1, 1).expand(-1, 1, width)  # [B,1,D']
        finals = []
        for i, directions in enumerate(self.encoder):
            if self.cfg.reverse_source:
                fwd = reverse_padded(directions[0](reverse_padded(x, src_len))[0], src_len)  # [B,S,D']
                final = fwd[:, 0]  # [B,D']: read last, the first word's state has seen the sentence
            else:
                fwd, _ = directions[0](x)  # [B,S,D']
                final = fwd.gather(1, last).squeeze(1)  # [B,D']: the state after the last real token
            if self.cfg.bidirectional:
                # The backward LSTM reads each sentence reversed within its own length.
                bwd = reverse_padded(directions[1](reverse_padded(x, src_len))[0], src_len)  # [B,S,D']
                fwd, final = torch.cat([fwd, bwd], -1), torch.cat([final, bwd[:, 0]], -1)  # [B,S,D], [B,D]
            x = fwd
            finals.append(final)
            if i + 1 < len(self.encoder):
                x = self.drop(x)
        h = torch.stack(finals, dim=1)  # L x [B,D] -> [B,L,D]
        zeros = torch.zeros_like(finals[0])  # [B,D]
        return {"memory": x, "keys": self.attention.project_keys(x), "mask": mask,
                "h": h, "c": torch.zeros_like(h), "feed": zeros, "pos": zeros[:, 0]}

    # ---- one decoder step ------------------------------------------------------------------
    def step(self, y_prev: Tensor, h: Tensor, c: Tensor, feed: Tensor, pos: Tensor, memory: Tensor, keys: Tensor,
             mask: Tensor, project: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """y_prev [B], carried h/c [B,L,D], feed [B,D], pos [B] -> (logits [B,V] (without ``project``: the dropped
        h̃_t [B,D]), alignment a_t [B,S], new h, c, feed h̃_t, pos t+1, position p_t [B])."""
        x = torch.cat([self.drop(self.tgt_embed(y_prev)), feed], dim=-1)  # [B,E+D] input feeding
        hs, cs = [], []
        for i, cell in enumerate(self.decoder):
            hi, ci = cell(x, (h[:, i], c[:, i]))  # [B,D] each
            hs.append(hi)
            cs.append(ci)
            x = self.drop(hi)
        top = hs[-1]  # h_t [B,D]
        scores = self.attention.score(top, keys, mask)  # [B,S]
        src_len = mask.sum(-1)  # [B]
        if self.cfg.attention == "global":
            center = pos  # unused
            align = torch.softmax(scores, dim=-1)
        else:
            if self.cfg.attention == "local_m":  # monotonic: p_t = t, kept inside the sentence
                center = torch.minimum(pos, src_len - 1)
            else:
                center = src_len * torch.sigmoid(self.position(top)).squeeze(-1)  # [B,1] -> [B]
            align = local_window(scores, center, self.cfg.window)
        context = torch.bmm(align.unsqueeze(1), memory).squeeze(1)  # [B,1,S]x[B,S,D] -> [B,D]
        attentional = torch.tanh(self.combine(torch.cat([context, top], dim=-1)))  # h̃_t [B,D]
        logits = self.out_proj(self.drop(attentional)) if project else self.drop(attentional)
        return (logits, align, torch.stack(hs, 1), torch.stack(cs, 1),  # L x [B,D] -> [B,L,D]
                attentional, pos + 1, center)

    # ---- model contract --------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Teacher-forced cross-entropy over target tokens (padding ignored)."""
        if self.cfg.teacher_forced == "deferred":
            return deferred_loss(self, batch)
        enc, hoisted, logits = self.encode(batch["src"], batch["src_len"]), self.cfg.teacher_forced == "hoisted", []
        h, c, feed, pos = enc["h"], enc["c"], enc["feed"], enc["pos"]
        for t in range(batch["tgt_in"].shape[1]):  # hoisted: one vocabulary projection (and weight gradient)
            step_logits, _, h, c, feed, pos, _ = self.step(batch["tgt_in"][:, t], h, c, feed, pos, enc["memory"],
                                                           enc["keys"], enc["mask"], project=not hoisted)
            logits.append(step_logits)  # [B,V], hoisted [B,D]
        logits = torch.stack(logits, dim=1) if not hoisted else self.out_proj(torch.stack(logits, dim=1))  # [B,T,V]
        loss, acc = token_loss(logits, batch["tgt_out"], self.cfg.pad_id, self.training * self.cfg.label_smoothing)
        return loss, {"token_acc": acc}

    @torch.no_grad()
    def predict(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Greedy decoding.

        Returns: tokens [B,T] (EOS-terminated, pad after), lengths [B] (without EOS),
            attention [B,T,S] (a_t of each emitted token), positions [B,T] (p_t; local only).
        """
        enc = self.encode(batch["src"], batch["src_len"])
        carried = [enc["h"], enc["c"], enc["feed"], enc["pos"]]
        local = self.cfg.attention != "global"

        def step(y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            logits, align, h, c, feed, pos, center = self.step(y, *carried, enc["memory"], enc["keys"], enc["mask"])
            carried[:] = [h, c, feed, pos]
            return logits, {"attention": align, **({"positions": center} if local else {})}

        return greedy(step, batch["src"].shape[0], enc["memory"].device, self.cfg)

    def export_graphs(self) -> dict[str, ExportSpec]:
        """``encoder`` + ``decoder_step`` (seq2seq contract of ``serving.decode``)."""
        src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, 0, 0]])
        src_len = torch.tensor([5, 3])
        enc = self.encode(src, src_len)
        bs, b = {0: "batch", 1: "src_len"}, {0: "batch"}
        enc_names = ["memory", "keys", "mask", "h", "c", "feed", "pos"]
        carried = ["h", "c", "feed", "pos"]
        return {
            "encoder": graph(self, picked(enc_names), {"src": src, "src_len": src_len}, enc_names,
                             {"src": bs, "src_len": b, "memory": bs, "keys": bs, "mask": bs,
                              **{n: b for n in carried}}),
            "decoder_step": graph(
                self, _decoder_step,
                {"y_prev": torch.tensor([1, 1]), **{n: enc[n] for n in carried + ["memory", "keys", "mask"]}},
                ["log_probs", "attention", *(f"new_{n}" for n in carried)],
                {"y_prev": b, **{n: b for n in carried}, "memory": bs, "keys": bs, "mask": bs,
                 "log_probs": b, "attention": bs, **{f"new_{n}": b for n in carried}}),
        }


def _decoder_step(model: Luong, *inputs: Tensor) -> tuple[Tensor, ...]:
    """The served step: log-probabilities, the alignment and the carried h, c, feed, pos (not p_t)."""
    return log_probs_first(model.step(*inputs)[:-1])


TEACHER_FORCED = ("per_step", "hoisted", "deferred")  # how loss() runs the decoder over a teacher-forced target


def deferred_loss(model: Luong, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """``model.loss`` with ``teacher_forced: deferred``: the same function and dropout masks as the per-step loss,
    only rounding differs (tests/test_registry.py). The embedding's share of the first LSTM's gates runs over all
    steps at once; the loop keeps one product a layer (its input feed and state against both weights side by
    side), and the recurrent weights, W_c, the memory and the keys get their gradients summed once after the
    loop (models.layers.LoopGradients) instead of step by step."""
    cfg, tgt_in = model.cfg, batch["tgt_in"]
    enc = model.encode(batch["src"], batch["src_len"])
    bsz, steps = tgt_in.shape
    loop = LoopGradients(tgt_in.device.type)
    first, split = model.decoder[0], cfg.emb_dim
    noise = _dropout_noise(model, bsz, steps)
    emb = model.tgt_embed(tgt_in) if noise is None else model.tgt_embed(tgt_in) * noise[0]  # [B,T,E]
    # [B,T,4D] -> T x [B,4D]: W_ih's embedding columns and both biases, every step at once
    pre = nn.functional.linear(emb, first.weight_ih[:, :split], first.bias_ih + first.bias_hh).unbind(1)
    weights = [loop.weight(torch.cat([first.weight_ih[:, split:], first.weight_hh], 1))]  # [4D,2D]: feed, h
    weights += [loop.weight(torch.cat([c.weight_ih, c.weight_hh], 1)) for c in model.decoder[1:]]  # [4D,2D]
    memory, combine = loop.memory(enc["memory"]), loop.weight(model.combine.weight)
    dot = cfg.score != "concat"
    keys = (memory if cfg.score == "dot" else loop.memory(enc["keys"])) if dot else enc["keys"]
    mask, src_len = enc["mask"], enc["mask"].sum(-1)  # [B,S], [B]
    h, c, feed = list(enc["h"].unbind(1)), list(enc["c"].unbind(1)), enc["feed"]  # L x [B,D]
    outputs = []
    for t in range(steps):
        x = feed
        for i, cell in enumerate(model.decoder):
            gates = weights[i].linear(torch.cat([x, h[i]], -1))  # [B,2D] -> [B,4D]
            gates = gates + pre[t] if i == 0 else gates + (cell.bias_ih + cell.bias_hh)
            h[i], c[i] = _lstm(gates, c[i])
            x = h[i] if noise is None else h[i] * noise[1][t][i]
        top = h[-1]  # h_t [B,D]
        if dot:
            scores = keys.scores(top, mask, model.attention.scale)  # [B,S]
        else:
            scores = model.attention.score(top, keys, mask)
        if cfg.attention == "global":
            align = torch.softmax(scores, dim=-1)
        else:
            center = (torch.minimum(torch.full_like(src_len, t), src_len - 1) if cfg.attention == "local_m"
                      else src_len * torch.sigmoid(model.position(top)).squeeze(-1))  # [B,1] -> [B]
            align = local_window(scores, center, cfg.window)
        feed = torch.tanh(combine.linear(torch.cat([memory.context(align), top], dim=-1)))  # h̃_t [B,D]
        outputs.append(feed if noise is None else feed * noise[2][t])
    smoothing = cfg.label_smoothing if model.training else 0.0
    loss, acc = real_rows_loss(model.out_proj, torch.stack(outputs, dim=1), batch["tgt_out"], cfg.pad_id,
                               smoothing)  # T x [B,D] -> [B,T,D]
    return loss, {"token_acc": acc}


def _lstm(gates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """PyTorch's LSTMCell after its two products: gates [B,4D] (i, f, g, o), c [B,D] -> h', c' [B,D]."""
    i, f, g, o = gates.chunk(4, dim=-1)  # [B,4D] -> 4 x [B,D]
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _dropout_noise(model: Luong, bsz: int, steps: int) -> tuple | None:
    """The dropout masks the per-step loss draws, in its order and dtypes (at each step the embedding's, each
    layer output's, h̃_t's), scaled by 1 / (1 - p): (embedding [B,T,E], T x L x [B,D], T x [B,D]), or None."""
    p, device = model.drop.p, model.out_proj.weight.device
    if not model.training or p == 0:
        return None
    autocast = torch.is_autocast_enabled(device.type)
    out_dtype = torch.get_autocast_dtype(device.type) if autocast else torch.float32

    def draw(width: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.empty(bsz, width, device=device, dtype=dtype).bernoulli_(1 - p).div_(1 - p)

    emb, layers, out = [], [], []
    for _ in range(steps):
        emb.append(draw(model.cfg.emb_dim))
        layers.append([draw(model.cfg.hidden) for _ in model.decoder])
        out.append(draw(model.cfg.hidden, out_dtype))
    return torch.stack(emb, dim=1), layers, out  # T x [B,E] -> [B,T,E]
