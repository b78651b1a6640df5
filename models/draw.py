"""DRAW: Gregor et al. 2015, "DRAW: A Recurrent Neural Network For Image Generation"
(arXiv:1502.04623).

A variational auto-encoder that draws in T steps. At step t (eq. 3-8): x̂_t = x − σ(c_{t−1});
r_t = read(x, x̂_t, h^dec_{t−1}); h^enc_t = LSTM_enc([r_t, h^dec_{t−1}]); z_t ~ Q(z | h^enc_t) =
N(μ_t, σ_t) by reparameterisation; h^dec_t = LSTM_dec(z_t); c_t = c_{t−1} + write(h^dec_t). The
image distribution is Bernoulli(σ(c_T)). The loss is the variational bound on the negative
log-likelihood in nats: L^x = −log D(x | c_T) plus L^z = Σ_t KL(Q(z_t | h^enc_t) ‖ N(0, I)) (eq. 9-12).

``attention: filterbank`` — read takes an N_r × N_r grid of 2-D Gaussian filters from x and x̂
and write adds an N_w × N_w patch through the transposed filters of a second window; each window's
centre, stride, variance and intensity are linear in h^dec (eq. 19-29, ``models.layers``).
``attention: none`` — read is [x, x̂] and write a linear map of h^dec to the whole canvas (§3.1).

Generation runs the decoder alone on z_t ~ N(0, I). Sampling happens outside the exported graphs:
the generation ``init`` + ``step`` graphs and the whole-pass ``infer`` graph take their noise as
inputs, so ONNX Runtime and PyTorch compute the same thing from the same noise.

Dimension legend
    B batch, H×W image (A = W, B = H in the paper), T steps, Z latent size, N hidden, R / Q read
    and write grid sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import register
from models.export import ExportSpec, graph
from models.layers import filterbank_window, gaussian_filterbank


@dataclass
class DRAWConfig:
    image_size: int = 28
    steps: int = 16  # T (paper: 64; see params.yaml for the budget)
    hidden: int = 256  # both LSTMs
    latent: int = 100  # Z
    attention: str = "filterbank"  # filterbank | none
    read_n: int = 2  # paper's MNIST model: 2×2 read, 5×5 write
    write_n: int = 5


STATE_NAMES = ["h", "c", "canvas"]  # the generation step's carried state


@register("draw", DRAWConfig)
class DRAW(nn.Module):
    def __init__(self, cfg: DRAWConfig):
        super().__init__()
        if cfg.attention not in ("filterbank", "none"):
            raise ValueError(f"attention must be 'filterbank' or 'none', got '{cfg.attention}'")
        if cfg.attention == "filterbank" and min(cfg.read_n, cfg.write_n) < 2:
            raise ValueError("read_n and write_n must be at least 2 (the stride divides by N - 1)")
        self.cfg = cfg
        pixels = cfg.image_size**2
        attend = cfg.attention == "filterbank"
        read_size = 2 * (cfg.read_n**2 if attend else pixels)
        self.encoder = nn.LSTMCell(read_size + cfg.hidden, cfg.hidden)
        self.posterior = nn.Linear(cfg.hidden, 2 * cfg.latent)  # μ, log σ
        self.decoder = nn.LSTMCell(cfg.latent, cfg.hidden)
        self.write_patch = nn.Linear(cfg.hidden, cfg.write_n**2 if attend else pixels)
        if attend:
            self.read_window = nn.Linear(cfg.hidden, 5)
            self.write_window = nn.Linear(cfg.hidden, 5)

    # ---- attention -------------------------------------------------------------------------
    def _filters(self, h_dec: Tensor, layer: nn.Linear, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """F_X [B,n,W], F_Y [B,n,H], γ [B] and the window (gX, gY, N·δ) [B,3] for plots."""
        size = self.cfg.image_size
        gx, gy, delta, var, gamma = filterbank_window(layer(h_dec), size, size, n)
        fx = gaussian_filterbank(gx, delta, var, n, size)
        fy = gaussian_filterbank(gy, delta, var, n, size)
        return fx, fy, gamma, torch.stack([gx, gy, n * delta], -1)

    def read(self, x: Tensor, x_hat: Tensor, h_dec: Tensor) -> tuple[Tensor, Tensor]:
        """r_t [B, 2·R² or 2·H·W] and the read window [B,3] (zeros without attention)."""
        if self.cfg.attention == "none":
            return torch.cat([x.flatten(1), x_hat.flatten(1)], -1), x.new_zeros(x.shape[0], 3)  # [B,H,W] -> [B,H·W]
        fx, fy, gamma, window = self._filters(h_dec, self.read_window, self.cfg.read_n)

        def glimpse(img: Tensor) -> Tensor:  # γ F_Y img F_X^T: [B,R,H] @ [B,H,W] @ [B,W,R] -> [B,R,R] -> [B,R²]
            return (gamma[:, None, None] * (fy @ img @ fx.transpose(1, 2))).flatten(1)

        return torch.cat([glimpse(x), glimpse(x_hat)], -1), window

    def write(self, h_dec: Tensor) -> tuple[Tensor, Tensor]:
        """The canvas update [B,H,W] and the write window [B,3] (zeros without attention)."""
        size = self.cfg.image_size
        patch = self.write_patch(h_dec)
        if self.cfg.attention == "none":
            return patch.view(-1, size, size), h_dec.new_zeros(h_dec.shape[0], 3)  # [B,H·W] -> [B,H,W]
        n = self.cfg.write_n
        fx, fy, gamma, window = self._filters(h_dec, self.write_window, n)
        w = patch.view(-1, n, n)  # [B,Q²] -> [B,Q,Q]
        # (1/γ) F_Y^T w F_X: [B,H,Q] @ [B,Q,Q] @ [B,Q,W] -> [B,H,W]
        return (fy.transpose(1, 2) @ w @ fx) / gamma[:, None, None], window

    # ---- generation: one decoder step --------------------------------------------------------
    def initial_state(self, batch: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # Three separate tensors: the exporter traces one tensor passed as two inputs as one input.
        size = self.cfg.image_size
        return (like.new_zeros(batch, self.cfg.hidden), like.new_zeros(batch, self.cfg.hidden),
                like.new_zeros(batch, size, size))

    def generate_step(self, z: Tensor, h: Tensor, c: Tensor, canvas: Tensor) -> tuple[Tensor, ...]:
        """z_t [B,Z] -> (canvas logits c_t [B,H·W], new h, c, canvas, write window [B,3])."""
        h, c = self.decoder(z, (h, c))
        update, window = self.write(h)
        canvas = canvas + update
        return canvas.flatten(1), h, c, canvas, window  # [B,H,W] -> [B,H·W]

    def generate(self, noise: Tensor) -> dict[str, Tensor]:
        """Draw from the prior with z_t = noise[:, t] (noise [B,T',Z], any T'): canvas logits
        [B,T',H·W] after every step and write windows [B,T',3]."""
        h, c, canvas = self.initial_state(noise.shape[0], noise)
        logits, windows = [], []
        for t in range(noise.shape[1]):
            step_logits, h, c, canvas, window = self.generate_step(noise[:, t], h, c, canvas)
            logits.append(step_logits)
            windows.append(window)
        return {"logits": torch.stack(logits, 1), "write_window": torch.stack(windows, 1)}  # T x [B,..] -> [B,T,..]

    # ---- inference: the whole encode/decode pass ------------------------------------------
    def infer(self, image: Tensor, noise: Tensor | None = None) -> dict[str, Tensor]:
        """One pass over binary images [B,H,W]; z_t = μ_t + σ_t·noise[:, t] (noise [B,T,Z];
        drawn here when None).

        Returns: bound = recon_nll + Σ_t kl [B] (nats), recon_nll [B], kl [B,T], canvases
        [B,T,H,W] (σ(c_t)), read_window / write_window [B,T,3].
        """
        cfg = self.cfg
        bsz = image.shape[0]
        h_dec, c_dec, canvas = self.initial_state(bsz, image)
        h_enc, c_enc = h_dec, c_dec
        kls, canvases, reads, writes = [], [], [], []
        for t in range(cfg.steps):
            x_hat = image - torch.sigmoid(canvas)  # eq. 3
            r, read_window = self.read(image, x_hat, h_dec)
            h_enc, c_enc = self.encoder(torch.cat([r, h_dec], -1), (h_enc, c_enc))
            mu, log_sigma = self.posterior(h_enc).chunk(2, -1)  # [B,Z] each
            eps = torch.randn_like(mu) if noise is None else noise[:, t]
            z = mu + torch.exp(log_sigma) * eps
            kls.append(0.5 * (mu**2 + torch.exp(2 * log_sigma) - 2 * log_sigma - 1).sum(-1))  # eq. 11, [B]
            h_dec, c_dec = self.decoder(z, (h_dec, c_dec))
            update, write_window = self.write(h_dec)
            canvas = canvas + update
            canvases.append(torch.sigmoid(canvas))
            reads.append(read_window)
            writes.append(write_window)
        # −log D(x | c_T) for a Bernoulli image, summed over pixels (eq. 9), in the overflow-free
        # form max(c, 0) − c·x + log(1 + e^−|c|): the exporter writes binary_cross_entropy_with_logits
        # as log σ(c), which is −inf in ONNX Runtime once a canvas logit passes about −100.
        recon = (F.relu(canvas) - canvas * image + torch.log1p(torch.exp(-canvas.abs()))).flatten(1).sum(-1)  # [B]
        kl = torch.stack(kls, 1)  # T x [B] -> [B,T]
        return {"bound": recon + kl.sum(1), "recon_nll": recon, "kl": kl,
                "canvases": torch.stack(canvases, 1),  # T x [B,H,W] -> [B,T,H,W]
                "read_window": torch.stack(reads, 1), "write_window": torch.stack(writes, 1)}

    # ---- model contract --------------------------------------------------------------------
    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        image, noise = batch["image"], None
        if not self.training:  # validation: the same posterior noise every time, so checkpoints compare on equal terms
            gen = torch.Generator().manual_seed(0)
            noise = torch.randn(image.shape[0], self.cfg.steps, self.cfg.latent, generator=gen).to(image)
        out = self.infer(image, noise)
        bound = out["bound"].mean()
        return bound, {"nll_bound": bound.detach(), "recon_nll": out["recon_nll"].mean().detach(),
                       "kl": out["kl"].sum(1).mean().detach()}

    @torch.no_grad()
    def predict(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Generation from ``x`` (prior noise [B,T',Z]) and, when the batch has ``image`` and
        ``noise`` (posterior noise [B,T,Z]), the bound on those images.

        Returns: logits [B,T',H·W] and write_window [B,T',3] of generation; bound, recon_nll, kl,
        read_window of inference (``infer`` graph's outputs)."""
        out = self.generate(batch["x"])
        if "image" in batch:
            inf = self.infer(batch["image"], batch["noise"])
            out.update({k: inf[k] for k in ("bound", "recon_nll", "kl", "read_window")})
        return out

    def export_graphs(self) -> dict[str, ExportSpec]:
        """Generation as ``init`` + ``step`` (run over the prior noise ``x`` [B,T',Z] by the
        recurrent loop in ``serving/``); ``infer``: images + posterior noise -> the bound."""
        gen = torch.Generator().manual_seed(0)
        cfg = self.cfg
        noise = torch.randn(2, cfg.steps, cfg.latent, generator=gen)
        image = (torch.rand(2, cfg.image_size, cfg.image_size, generator=gen) > 0.5).float()
        state = self.initial_state(2, noise)
        b = {0: "batch"}
        return {
            "init": graph(self, _init, {"x": noise}, STATE_NAMES,
                          {"x": {0: "batch", 1: "time"}, **{n: b for n in STATE_NAMES}}),
            "step": graph(self, DRAW.generate_step, {"x": noise[:, 0], **dict(zip(STATE_NAMES, state))},
                          ["logits"] + [f"new_{n}" for n in STATE_NAMES] + ["write_window"],
                          {n: b for n in ["x", "logits", "write_window"] + STATE_NAMES
                           + [f"new_{n}" for n in STATE_NAMES]}),
            "infer": graph(self, _infer, {"image": image, "noise": noise}, INFER_NAMES,
                           {n: b for n in ["image", "noise", *INFER_NAMES]}),
        }

    parity_collect = ("write_window",)  # step outputs the recurrent loop stacks over time


def _init(model: DRAW, x: Tensor) -> tuple[Tensor, ...]:
    # Only the batch size of x matters; reading it from a tensor keeps the graph dynamic.
    return model.initial_state(x.shape[0], x)


INFER_NAMES = ["bound", "recon_nll", "kl", "read_window"]


def _infer(model: DRAW, image: Tensor, noise: Tensor) -> tuple[Tensor, ...]:
    out = model.infer(image, noise)
    return tuple(out[n] for n in INFER_NAMES)
