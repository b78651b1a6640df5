"""Show, Attend and Tell: Xu et al. 2015, "Neural Image Caption Generation with Visual Attention"
(arXiv:1502.03044).

A CNN turns the image into L annotation vectors a_i (one per cell of its last feature map). An
LSTM decoder starts from c_0, h_0 = f_init(mean_i a_i) (§3.1.2); at step t the attention MLP
f_att (additive, ``models.layers.AdditiveAttention``) gives α_t over the L regions from h_{t-1},
the gating scalar β_t = σ(f_β(h_{t-1})) scales the context ẑ_t (§4.2.1), the LSTM reads
[E y_{t-1}; ẑ_t], and the deep output layer gives p(y_t) ∝ exp(L_o(E y_{t-1} + L_h h_t + L_z ẑ_t))
(eq. 7).

``attention: soft`` — ẑ_t = Σ_i α_ti a_i, trained by likelihood plus the doubly stochastic
regulariser λ Σ_i (1 − Σ_t α_ti)² (eq. 14).
``attention: hard`` — ẑ_t = a_{s_t} with s_t ~ Multinoulli(α_t), trained with the sampling
objective of eq. 12: the caption's log-likelihood under sampled locations, REINFORCE on the
locations with reward log p(y|s) (per word) minus a moving-average baseline b ← 0.9 b + 0.1 log p(y|s),
an entropy bonus λ_e H(α), and, for half of the images, s̃ set to its expectation α (§4.1).
At inference a hard-attention model uses the expected context (the authors' released sampler
does the same) or, with ``hard_inference: argmax``, the most probable location; either way
decoding is deterministic and the ONNX graph gives exactly the PyTorch result.

Departures: the annotations carry the (x, y) centre of their cell (two extra channels): the task
captions spatial relations ("left of") and a convolutional feature alone does not say where it
is. The CNN is trained with the decoder, so the hard variant's REINFORCE and entropy terms are
kept to f_att (decoder state and annotations detached there); the authors' CNN was fixed.

Dimension legend
    B batch, H×W image, h×w feature grid, L = h·w regions, C CNN channels, D = C + 2 annotation
    size, A attention size, E embedding, N decoder hidden, T caption length, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import register
from models.decode import greedy
from models.export import ExportSpec, decoder_step, encoder, graph
from models.layers import AdditiveAttention, token_loss


@dataclass
class ShowAttendTellConfig:
    image_size: int = 84
    vocab: int = 20
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    channels: int = 16  # first conv layer; doubled per layer
    conv_layers: int = 4  # all but the last halve the resolution (84 -> 10×10 regions)
    emb_dim: int = 64
    hidden: int = 256
    attn_dim: int = 128
    dropout: float = 0.2
    attention: str = "soft"  # soft | hard
    doubly_stochastic: float = 0.01  # λ of eq. 14
    reinforce_weight: float = 1.0  # λ_r of eq. 12 (hard)
    entropy_weight: float = 0.01  # λ_e (hard)
    baseline_decay: float = 0.9  # b ← decay·b + (1 − decay)·log p(y|s) (hard)
    expected_fraction: float = 0.5  # images whose s̃ is set to its expectation α (hard)
    # Hard attention at inference (and validation): the expected context Σ α a, as the authors'
    # released sampler does (arctic-captions: sampling off), or the single most probable region.
    hard_inference: str = "expectation"  # expectation | argmax
    max_len: int = 8  # decoding limit in words (EOS included)


@register("show_attend_tell", ShowAttendTellConfig)
class ShowAttendTell(nn.Module):
    def __init__(self, cfg: ShowAttendTellConfig):
        super().__init__()
        if cfg.attention not in ("soft", "hard"):
            raise ValueError(f"attention must be 'soft' or 'hard', got '{cfg.attention}'")
        if cfg.hard_inference not in ("expectation", "argmax"):
            raise ValueError(f"hard_inference must be 'expectation' or 'argmax', got '{cfg.hard_inference}'")
        self.cfg = cfg
        layers, ch_in, size = [], 1, cfg.image_size
        for i in range(cfg.conv_layers):
            ch = cfg.channels * 2**i
            layers += [nn.Conv2d(ch_in, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU()]
            if i < cfg.conv_layers - 1:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            ch_in = ch
        self.cnn = nn.Sequential(*layers)
        self.grid = (size, size)
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
        self.register_buffer("coords", torch.stack([xs, ys], -1).reshape(-1, 2), persistent=False)  # [h,w,2] -> [L,2]
        d = ch_in + 2
        self.init_h = nn.Linear(d, cfg.hidden)
        self.init_c = nn.Linear(d, cfg.hidden)
        self.attention = AdditiveAttention(cfg.hidden, d, cfg.attn_dim)
        self.gate = nn.Linear(cfg.hidden, 1)  # f_β
        self.embed = nn.Embedding(cfg.vocab, cfg.emb_dim, padding_idx=cfg.pad_id)
        self.cell = nn.LSTMCell(cfg.emb_dim + d, cfg.hidden)
        self.out_h = nn.Linear(cfg.hidden, cfg.emb_dim)  # L_h
        self.out_z = nn.Linear(d, cfg.emb_dim, bias=False)  # L_z
        self.out = nn.Linear(cfg.emb_dim, cfg.vocab)  # L_o
        self.drop = nn.Dropout(cfg.dropout)
        self.register_buffer("baseline", torch.zeros(()))  # b of the hard-attention objective
        self.register_buffer("baseline_set", torch.zeros((), dtype=torch.bool))

    # ---- encoder ---------------------------------------------------------------------------
    def encode(self, image: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """image [B,H,W] in [0,1] -> (annotations [B,L,D], projected keys [B,L,A], h0, c0 [B,N])."""
        feats = self.cnn(image.unsqueeze(1))  # [B,1,H,W] -> [B,C,h,w]
        feats = feats.flatten(2).transpose(1, 2)  # [B,C,L] -> [B,L,C]
        coords = self.coords.unsqueeze(0).expand(feats.shape[0], -1, -1)  # [B,L,2]
        memory = torch.cat([feats, coords], dim=-1)  # [B,L,D]
        mean = memory.mean(dim=1)  # [B,D]
        h0, c0 = torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))  # f_init
        return memory, self.attention.project_keys(memory), h0, c0

    # ---- one decoder step, split where hard attention samples -------------------------------
    def attend(self, h: Tensor, keys: Tensor) -> Tensor:
        """α_t [B,L] from h_{t-1} [B,N] (f_att; every region is real, so the mask is all ones)."""
        return torch.softmax(self.attention.score(h, keys, torch.ones_like(keys[..., 0])), dim=-1)

    def advance(self, y_prev: Tensor, h: Tensor, c: Tensor, context: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Gate the context, update the LSTM, deep output: -> (logits [B,V], h_t, c_t)."""
        z = torch.sigmoid(self.gate(h)) * context  # β_t ẑ_t, [B,1] * [B,D]
        emb = self.drop(self.embed(y_prev))  # [B,E]
        h, c = self.cell(torch.cat([emb, z], dim=-1), (h, c))
        logits = self.out(self.drop(emb + self.out_h(h) + self.out_z(z)))  # eq. 7, [B,V]
        return logits, h, c

    def context(self, alpha: Tensor, memory: Tensor) -> Tensor:
        """Inference context [B,D]: the expectation (soft; hard by default) or the most probable
        region (hard, ``hard_inference: argmax``)."""
        if self.cfg.attention == "soft" or self.cfg.hard_inference == "expectation":
            return torch.bmm(alpha.unsqueeze(1), memory).squeeze(1)  # [B,1,L] @ [B,L,D] -> [B,D]
        idx = alpha.argmax(dim=-1)  # [B]
        return memory.gather(1, idx.view(-1, 1, 1).expand(-1, 1, memory.shape[2])).squeeze(1)  # [B,1,D] -> [B,D]

    def step(self, y_prev, h, c, memory, keys) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Inference step: -> (logits [B,V], h, c, α [B,L])."""
        alpha = self.attend(h, keys)
        logits, h, c = self.advance(y_prev, h, c, self.context(alpha, memory))
        return logits, h, c, alpha

    # ---- model contract --------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        memory, keys, h, c = self.encode(batch["image"])
        tgt_in, tgt_out = batch["tgt_in"], batch["tgt_out"]
        hard = self.cfg.attention == "hard" and self.training
        if hard:  # per image: sample locations, or use their expectation (§4.1)
            sampled = torch.rand(memory.shape[0], device=memory.device) >= self.cfg.expected_fraction  # [B]
            # The policy terms see the decoder state and the annotations detached: the noisy
            # REINFORCE signal trains f_att only, not the CNN and LSTM that the likelihood trains
            # (the authors' CNN features were fixed). With it reaching them, validation NLL rose
            # after the first epoch (docs/results.md).
            policy_keys = self.attention.project_keys(memory.detach())  # [B,L,A]
        logits, alphas, log_pi, entropy = [], [], [], []
        for t in range(tgt_in.shape[1]):
            alpha = self.attend(h, keys)
            if hard:
                s = torch.multinomial(alpha.detach(), 1)  # [B,1]
                one_hot = torch.zeros_like(alpha).scatter_(1, s, 1.0)  # [B,L]
                weights = torch.where(sampled.unsqueeze(1), one_hot, alpha)
                context = torch.bmm(weights.unsqueeze(1), memory).squeeze(1)  # [B,1,D] -> [B,D]
                policy = self.attend(h.detach(), policy_keys)  # = alpha in value
                log_pi.append(torch.log(policy.gather(1, s).squeeze(1) + 1e-12))  # log p(s_t | a), [B]
                entropy.append(-(policy * torch.log(policy + 1e-12)).sum(-1))  # H(α_t), [B]
            else:  # soft, or hard at validation: the inference context
                context = self.context(alpha, memory)
            step_logits, h, c = self.advance(tgt_in[:, t], h, c, context)
            logits.append(step_logits)
            alphas.append(alpha)
        logits = torch.stack(logits, dim=1)  # T x [B,V] -> [B,T,V]
        alphas = torch.stack(alphas, dim=1)  # T x [B,L] -> [B,T,L]
        real = (tgt_out != self.cfg.pad_id).float()  # [B,T]
        nll, acc = token_loss(logits, tgt_out, self.cfg.pad_id, 0.0)
        coverage = (alphas * real.unsqueeze(-1)).sum(dim=1)  # Σ_t α_ti, [B,L]
        doubly = ((1.0 - coverage) ** 2).sum(dim=1).mean()  # eq. 14
        loss = nll + self.cfg.doubly_stochastic * doubly
        logs = {"token_acc": acc, "nll": nll.detach(), "doubly_stochastic": doubly.detach()}
        if hard:
            tokens = real.sum()
            token_ll = -F.cross_entropy(logits.transpose(1, 2), tgt_out, reduction="none")  # [B,T]
            # Reward: the caption's mean token log-likelihood (arctic-captions' RL_sumCost), so
            # long captions do not get larger updates than short ones.
            reward = ((token_ll * real).sum(1) / real.sum(1)).detach()  # [B]
            if not bool(self.baseline_set) and bool(sampled.any()):  # start b at the first rewards, not 0
                self.baseline.fill_(float(reward[sampled].mean()))
                self.baseline_set.fill_(True)
            advantage = torch.where(sampled, reward - self.baseline, torch.zeros_like(reward))
            log_pi = (torch.stack(log_pi, dim=1) * real).sum(1)  # T x [B] -> [B,T] -> Σ_t log p(s_t), [B]
            entropy = (torch.stack(entropy, dim=1) * real).sum()  # T x [B] -> [B,T] -> Σ H(α_t)
            # eq. 12: Σ_t log p(s_t) weighted by the caption's advantage, over the same token count as the likelihood
            loss = loss - (self.cfg.reinforce_weight * (advantage * log_pi).sum()
                           + self.cfg.entropy_weight * entropy) / tokens
            with torch.no_grad():
                if bool(sampled.any()):
                    decay = self.cfg.baseline_decay
                    self.baseline.mul_(decay).add_((1 - decay) * reward[sampled].mean())
            logs.update(baseline=self.baseline.clone(), entropy=(entropy / tokens).detach())
        return loss, logs

    @torch.no_grad()
    def predict(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Greedy captioning.

        Returns: tokens [B,T] (EOS-terminated, pad after), lengths [B] (words before EOS),
            attention [B,T,L] (α of every step over the h×w regions, row-major; ``self.grid``).
        """
        memory, keys, h, c = self.encode(batch["image"])

        def step(y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            nonlocal h, c
            logits, h, c, alpha = self.step(y, h, c, memory, keys)
            return logits, {"attention": alpha}

        return greedy(step, memory.shape[0], memory.device, self.cfg)

    def export_graphs(self) -> dict[str, ExportSpec]:
        """``encoder`` (image -> annotations, initial state) + ``decoder_step``, as seq2seq models."""
        gen = torch.Generator().manual_seed(0)
        image = torch.rand(2, self.cfg.image_size, self.cfg.image_size, generator=gen)
        memory, keys, h, c = self.encode(image)
        b = {0: "batch"}
        return {
            "encoder": graph(self, encoder, {"image": image}, ["memory", "keys", "h", "c"],
                             {"image": b, "memory": b, "keys": b, "h": b, "c": b}),
            "decoder_step": graph(
                self, decoder_step, {"y_prev": torch.tensor([1, 1]), "h": h, "c": c, "memory": memory, "keys": keys},
                ["log_probs", "new_h", "new_c", "attention"],
                {"y_prev": b, "h": b, "c": b, "memory": b, "keys": b, "log_probs": b, "new_h": b,
                 "new_c": b, "attention": b}),
        }
