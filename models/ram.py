"""Recurrent Attention Model: Mnih et al. 2014, "Recurrent Models of Visual Attention"
(arXiv:1406.6247).

The model never sees the whole image. At step t the glimpse sensor cuts a retina of ``scales``
patches of ``patch`` × ``patch`` samples around l_{t-1}, scale k covering patch·2^k pixels
(``models.layers.glimpse``); the glimpse network g_t = ReLU(Linear(h_g) + Linear(h_l)) with
h_g = ReLU(Linear(ρ)), h_l = ReLU(Linear(l)) (§4 "Glimpse network"); the core network (an LSTM, or
the paper's rectifier RNN) updates h_t; the location network emits the mean μ_t = tanh(Linear(h_t))
of a Gaussian policy l_t ~ N(μ_t, σ²) with fixed σ; after the last glimpse the action network
classifies from h_T.

Training uses the hybrid loss of §3.1: cross-entropy for the classifier, core and glimpse
networks, and REINFORCE for the location network, with reward R = 1 for a correct class and a
learned baseline b_t = Linear(h_t) fitted to R by squared error. The baseline and the location
network read h_t detached, and the sampled l_t is detached on its way into the next glimpse, so the
noisy policy gradient trains only the location network and the classifier's gradient never passes
through a sample. Inference uses l_t = μ_t: deterministic, and exported as a ``start`` graph and a one-glimpse
``glimpse`` graph that ``serving/`` runs ``glimpses`` times.

Departures: the first glimpse is at the image centre (l_0 = 0) rather than at a random location,
so its coarsest scale sees most of the canvas; the core is an LSTM by default (``core: rnn`` is the
paper's), which trained faster here.

Dimension legend
    B batch, S image side, G glimpses, P patch, K scales, R = K·P² retina size, H core hidden,
    C classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import register
from models.export import ExportSpec, graph
from models.layers import glimpse, glimpse_pyramid


@dataclass
class RAMConfig:
    image_size: int = 60
    classes: int = 10
    glimpses: int = 8  # Table 2: 8 glimpses of 12×12 at 3 scales, 1.84 % on translated 60×60
    patch: int = 12
    scales: int = 3
    glimpse_hidden: int = 128  # h_g and h_l
    glimpse_out: int = 256  # g_t
    hidden: int = 256  # core state h_t
    core: str = "lstm"  # lstm | rnn (the paper's rectifier RNN)
    location_std: float = 0.15  # σ of the Gaussian policy, in units of the half canvas
    reinforce_weight: float = 1.0
    baseline_weight: float = 1.0
    # Inference glimpse centres are rounded to this grid (in pixels; 0: not rounded). The policy
    # amplifies any tiny difference in a location from glimpse to glimpse, so with the continuous
    # mean ONNX Runtime and PyTorch parted ways (11 of 10,000 test classes differed); on a grid,
    # float rounding only matters where μ sits on a rounding boundary.
    location_grid: float = 0.25


@register("ram", RAMConfig)
class RAM(nn.Module):
    def __init__(self, cfg: RAMConfig):
        super().__init__()
        if cfg.core not in ("lstm", "rnn"):
            raise ValueError(f"core must be 'lstm' or 'rnn', got '{cfg.core}'")
        if cfg.image_size % 2 ** (cfg.scales - 1):
            raise ValueError(f"image_size {cfg.image_size} must be divisible by 2^(scales-1) = "
                             f"{2 ** (cfg.scales - 1)}: the coarser scales pool it by that much")
        self.cfg = cfg
        self.retina = nn.Linear(cfg.scales * cfg.patch**2, cfg.glimpse_hidden)  # θ_g^0
        self.where = nn.Linear(2, cfg.glimpse_hidden)  # θ_g^1
        self.what_out = nn.Linear(cfg.glimpse_hidden, cfg.glimpse_out)  # θ_g^2, "what" half of g_t
        self.where_out = nn.Linear(cfg.glimpse_hidden, cfg.glimpse_out)  # "where" half of g_t
        if cfg.core == "lstm":
            self.core = nn.LSTMCell(cfg.glimpse_out, cfg.hidden)
        else:
            self.core_in = nn.Linear(cfg.glimpse_out, cfg.hidden)
            self.core_rec = nn.Linear(cfg.hidden, cfg.hidden)
        self.locate = nn.Linear(cfg.hidden, 2)  # μ_t
        self.baseline = nn.Linear(cfg.hidden, 1)  # b_t
        self.classify = nn.Linear(cfg.hidden, cfg.classes)  # action network

    def glimpse_net(self, pyramid: list[Tensor], loc: Tensor) -> Tensor:
        """g_t [B,glimpse_out] from the retina at ``loc`` [B,2]."""
        what = F.relu(self.retina(glimpse(pyramid, loc, self.cfg.patch)))
        where = F.relu(self.where(loc))
        return F.relu(self.what_out(what) + self.where_out(where))

    def core_step(self, g: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        h, c = state
        if self.cfg.core == "lstm":
            return self.core(g, (h, c))
        return F.relu(self.core_in(g) + self.core_rec(h)), c  # rectifier RNN; c unused

    def glimpse_step(self, pyramid: list[Tensor], h: Tensor, c: Tensor, loc: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor]:
        """One glimpse at ``loc`` [B,2]: -> new core state h, c and the policy mean μ_t [B,2] of
        the next location (read from h detached: only REINFORCE trains the location network)."""
        h, c = self.core_step(self.glimpse_net(pyramid, loc), (h, c))
        return h, c, torch.tanh(self.locate(h.detach()))

    def unroll(self, image: Tensor, sample: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Run all glimpses over image [B,S,S].

        Returns: logits [B,C], glimpse centres [B,G,2], log π(l_t) [B,G-1] of the sampled moves
        (zeros when not sampling), baselines b_t [B,G-1] for them.
        """
        bsz = image.shape[0]
        pyramid = glimpse_pyramid(image.unsqueeze(1), self.cfg.scales)  # [B,1,S,S] at K scales
        h, c, loc = self.initial_state(image)
        locs, log_pi, baselines = [loc], [], []
        for t in range(self.cfg.glimpses):
            h, c, mean = self.glimpse_step(pyramid, h, c, loc)
            if t == self.cfg.glimpses - 1:
                break
            if sample:
                loc = (mean + self.cfg.location_std * torch.randn_like(mean)).detach()
                # log N(l; μ, σ²) summed over (x, y), up to a constant that REINFORCE ignores
                log_pi.append((-((loc - mean) ** 2) / (2 * self.cfg.location_std**2)).sum(-1))
                baselines.append(self.baseline(h.detach()).squeeze(-1))
                loc = loc.clamp(-1.0, 1.0)
            else:
                loc = self.inference_location(mean)
            locs.append(loc)
        logits = self.classify(h)
        if not sample:
            return logits, torch.stack(locs, 1), logits.new_zeros(bsz, 0), logits.new_zeros(bsz, 0)
        return logits, torch.stack(locs, 1), torch.stack(log_pi, 1), torch.stack(baselines, 1)  # G x [B,2] -> [B,G,2]

    def inference_location(self, mean: Tensor) -> Tensor:
        """The next glimpse centre at inference: μ_t rounded to ``location_grid`` pixels (one
        pixel is 2 / S in [-1, 1] units)."""
        if not self.cfg.location_grid:
            return mean
        steps = self.cfg.image_size / 2 / self.cfg.location_grid  # grid points per unit
        return torch.round(mean * steps) / steps

    def initial_state(self, image: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h, c [B,H] zeros and l_0 [B,2] = the centre (separate tensors: the exporter would trace
        one tensor passed twice as one input)."""
        bsz = image.shape[0]
        return image.new_zeros(bsz, self.cfg.hidden), image.new_zeros(bsz, self.cfg.hidden), image.new_zeros(bsz, 2)

    # ---- model contract --------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        logits, _, log_pi, baselines = self.unroll(batch["image"], sample=self.training)
        ce = F.cross_entropy(logits, batch["label"])
        correct = (logits.argmax(-1) == batch["label"]).float()  # R [B]
        logs = {"accuracy": correct.mean(), "nll": ce.detach()}
        loss = ce
        if self.training:
            advantage = (correct.unsqueeze(1) - baselines).detach()  # [B,G-1]
            reinforce = -(log_pi * advantage).sum(1).mean()
            baseline = F.mse_loss(baselines, correct.unsqueeze(1).expand_as(baselines))
            loss = ce + self.cfg.reinforce_weight * reinforce + self.cfg.baseline_weight * baseline
            logs.update(reinforce=reinforce.detach(), baseline_mse=baseline.detach())
        return loss, logs

    @torch.no_grad()
    def predict(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Deterministic glimpses at the policy mean.

        Returns: logits [B,C], pred [B], locations [B,G,2] (glimpse centres, (x, y) in [-1, 1])."""
        logits, locs, _, _ = self.unroll(batch["image"], sample=False)
        return {"logits": logits, "pred": logits.argmax(-1), "locations": locs}

    def export_graphs(self) -> dict[str, ExportSpec]:
        """``start`` (image -> h, c, l_0 and the pyramid's coarser levels) + ``glimpse`` (one glimpse:
        image, h, c, loc, pyramid -> the class logits so far, new h, c, loc and the pyramid passed on
        unchanged), run ``glimpses`` times by ``serving.decode.glimpses``.

        One step per graph, not the whole loop: a trained policy amplifies float rounding from
        glimpse to glimpse (an untrained one does not), so the whole unrolled graph could not be
        held to 1e-4 against PyTorch while each step can. The pyramid is built once, in ``start``, and
        carried through the loop as state, as ``unroll`` builds it once: rebuilt inside every
        glimpse, its average pools were 29 % of that graph's ONNX Runtime time at batch 32. It
        travels as one flat tensor (the levels differ in size; the glimpse graph has fixed inputs).
        """
        image = torch.rand(2, self.cfg.image_size, self.cfg.image_size, generator=torch.Generator().manual_seed(0))
        h, c, loc, *pyramid = _start(self, image)  # pyramid: [] with one scale, else [[B,N]]
        b = {0: "batch"}
        state = ["h", "c", "loc"] + (["pyramid"] if pyramid else [])
        new = [f"new_{n}" for n in state]
        return {
            "start": graph(self, _start, {"image": image}, state, {n: b for n in ["image", *state]}),
            "glimpse": graph(self, _glimpse, {"image": image, **dict(zip(state, (h, c, loc, *pyramid)))},
                             ["logits", *new], {n: b for n in ["image", *state, "logits", *new]}),
        }


def _start(model: RAM, image: Tensor) -> tuple[Tensor, ...]:
    state = model.initial_state(image)
    levels = glimpse_pyramid(image.unsqueeze(1), model.cfg.scales)[1:]  # K-1 x [B,1,S/2^k,S/2^k]
    if not levels:
        return state
    return (*state, torch.cat([level.flatten(1) for level in levels], 1))  # -> [B, Σ_k (S/2^k)²]


def _glimpse(model: RAM, image: Tensor, h: Tensor, c: Tensor, loc: Tensor, pyramid: Tensor | None = None
             ) -> tuple[Tensor, ...]:
    levels, offset = [image.unsqueeze(1)], 0  # [B,S,S] -> [B,1,S,S], then the carried coarser levels
    for k in range(1, model.cfg.scales):
        side = model.cfg.image_size // 2**k
        level = pyramid[:, offset:offset + side * side]  # [B,side²]
        levels.append(level.reshape(-1, 1, side, side))  # [B,side²] -> [B,1,side,side]
        offset += side * side
    h, c, mean = model.glimpse_step(levels, h, c, loc)
    out = (model.classify(h), h, c, model.inference_location(mean))
    return out if pyramid is None else (*out, pyramid)
