"""Attention mechanisms shared across models.

Dimension legend
    B batch, S source positions / memory slots (N), Q query dim, K key dim, A attention dim,
    M memory word size, R shift radius.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Finite stand-in for -inf: keeps masked softmax NaN-free on fully padded rows and matches
# bit-for-bit between PyTorch and ONNX Runtime.
NEG_INF = -1e9


class AdditiveAttention(nn.Module):
    """Bahdanau et al. 2015, eq. (6): e_ij = vᵀ tanh(W s_{i-1} + U h_j).

    ``U h_j`` does not depend on the decoder step, so it is computed once per sentence by
    :meth:`project_keys` and passed to every step (also across the ONNX encoder/decoder split).
    """

    def __init__(self, query_dim: int, key_dim: int, attn_dim: int):
        super().__init__()
        self.query = nn.Linear(query_dim, attn_dim, bias=False)
        self.key = nn.Linear(key_dim, attn_dim)
        self.v = nn.Linear(attn_dim, 1, bias=False)

    def project_keys(self, keys: Tensor) -> Tensor:
        """keys [B,S,K] -> U h [B,S,A]."""
        return self.key(keys)

    def score(self, query: Tensor, projected_keys: Tensor, mask: Tensor) -> Tensor:
        """Masked energies e [B,S] (masked positions NEG_INF), before the softmax.

        Pointer networks (Vinyals et al. 2015, eq. 3) use these directly as the output
        distribution's logits, so a log-softmax keeps their full precision.
        """
        energy = torch.tanh(self.query(query).unsqueeze(1) + projected_keys)  # [B,S,A]
        scores = self.v(energy).squeeze(-1)  # [B,S,1] -> [B,S]
        return scores.masked_fill(mask <= 0, NEG_INF)

    def forward(
        self, query: Tensor, projected_keys: Tensor, values: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Args: query [B,Q], projected_keys [B,S,A], values [B,S,K], mask [B,S] (1 = real).

        Returns: context [B,K], weights [B,S].
        """
        weights = torch.softmax(self.score(query, projected_keys, mask), dim=-1)  # [B,S]
        context = torch.bmm(weights.unsqueeze(1), values).squeeze(1)  # [B,1,K] -> [B,K]
        return context, weights


def reverse_padded(x: Tensor, lengths: Tensor) -> Tensor:
    """Reverse each sequence of x [B,S,F] within its own length; padding stays at the end.

    Lets a plain forward GRU play the backward direction without packed sequences, which keeps
    the encoder exportable with dynamic lengths. The permutation is its own inverse.
    """
    steps = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # [1,S]
    last = (lengths - 1).unsqueeze(1)  # [B,1]
    index = torch.where(steps <= last, last - steps, steps)  # [B,S]
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[2]))


class PaddedBiRNN(nn.Module):
    """Bidirectional GRU/LSTM over right-padded sequences: the backward direction starts at each
    sequence's own last step (:func:`reverse_padded`), so padding never reaches a real position and
    a padded batch gives each sequence what it gets alone. Exportable with dynamic lengths."""

    def __init__(self, kind: str, input_size: int, hidden: int):
        super().__init__()
        rnn = {"gru": nn.GRU, "lstm": nn.LSTM}[kind]
        self.fwd = rnn(input_size, hidden, batch_first=True)
        self.bwd = rnn(input_size, hidden, batch_first=True)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        """x [B,S,F], lengths [B] -> [B,S,2H] (forward then backward states; zeros past a length)."""
        fwd = self.fwd(x)[0]  # [B,S,H]
        bwd = reverse_padded(self.bwd(reverse_padded(x, lengths))[0], lengths)  # [B,S,H], position j holds h←_j
        valid = torch.arange(x.shape[1], device=x.device).unsqueeze(0) < lengths.unsqueeze(1)  # [B,S]
        return torch.cat([fwd, bwd], dim=-1) * valid.unsqueeze(-1)


def cosine_content_weights(memory: Tensor, key: Tensor, beta: Tensor, eps: float = 1e-8) -> Tensor:
    """NTM content addressing (Graves 2014, eqs. 5-6): softmax_i(β · cos(k, M_i)).

    Args: memory [B,N,M], key [B,H,M] (H heads), beta [B,H,1].
    Returns: weights [B,H,N].
    """
    dot = torch.bmm(key, memory.transpose(1, 2))  # [B,H,M]x[B,M,N] -> [B,H,N]
    norms = key.norm(dim=-1, keepdim=True) * memory.norm(dim=-1).unsqueeze(1)  # [B,H,1]*[B,1,N]
    # eps keeps the gradient finite when memory rows are (near) zero at the start of a sequence.
    return torch.softmax(beta * dot / (norms + eps), dim=-1)


def circular_shift(weights: Tensor, shift: Tensor) -> Tensor:
    """Circular convolution of weights [B,H,N] with a shift distribution [B,H,2R+1] (eq. 8).

    Index j of ``shift`` means a move of j - R slots. Written with ``torch.roll`` so the ONNX
    graph holds a few slices rather than an N×N matrix.
    """
    radius = shift.shape[-1] // 2
    out = torch.zeros_like(weights)
    for j in range(shift.shape[-1]):
        out = out + torch.roll(weights, shifts=j - radius, dims=-1) * shift[..., j : j + 1]
    return out


def ntm_address(
    memory: Tensor,
    prev_weights: Tensor,
    key: Tensor,
    beta: Tensor,
    gate: Tensor,
    shift: Tensor,
    gamma: Tensor,
    eps: float = 1e-8,
) -> Tensor:
    """Full NTM addressing: content → interpolation → circular shift → sharpening (eqs. 5-9).

    Args: memory [B,N,M]; prev_weights [B,H,N]; key [B,H,M]; beta, gate, gamma [B,H,1]
        (β > 0, g in (0,1), γ ≥ 1); shift [B,H,2R+1], a distribution.
    Returns: weights [B,H,N], each row a distribution.
    """
    content = cosine_content_weights(memory, key, beta, eps)
    gated = gate * content + (1 - gate) * prev_weights
    shifted = circular_shift(gated, shift)
    # Sharpening w^γ / Σ w^γ computed as softmax(γ log w): a trained head has γ in the tens,
    # where w^γ underflows to zero (and denormal handling differs between PyTorch and ONNX
    # Runtime); in log space the softmax subtracts the maximum first. eps keeps log w finite.
    return torch.softmax(gamma * torch.log(shifted + eps), dim=-1)


def token_loss(logits: Tensor, target: Tensor, pad_id: int, label_smoothing: float) -> tuple[Tensor, Tensor]:
    """Teacher-forced sequence objective: cross-entropy over the real target tokens (padding
    ignored), label-smoothed as given, and token accuracy for the logs; inside ``ChunkedLoss()``
    the same by ``chunked_token_loss``. Args: logits [B,T,V], target [B,T]. Returns: loss
    (scalar), accuracy (scalar, detached)."""
    flat, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)  # [B*T,V], [B*T]
    if _LOSS_ROWS[0]:
        return chunked_token_loss(flat, flat_target, pad_id, label_smoothing, _LOSS_ROWS[0])
    loss = F.cross_entropy(flat, flat_target, ignore_index=pad_id, label_smoothing=label_smoothing)
    # PyTorch's kernel by default. ChunkedLoss (train.cpu_loss: chunked) computes the same objective a
    # cache-sized block of rows at a time, where this one's [B*T,V] float32 passes take a sixth of a CPU
    # translation step (_ChunkedTokenLoss, at the end of this file: below the modules exported graphs cite).
    real = target != pad_id
    # max(-1).indices is argmax(-1) to the index (the first of tied maxima), computed 3-4x faster on a CPU
    # over a [B,T,V] of bf16 logits: argmax took 6 % of a luong training step.
    acc = ((logits.max(-1).indices == target) & real).sum() / real.sum().clamp(min=1)
    return loss, acc.detach()


def split_sizes(tensor: Tensor, sizes: list[int]) -> list[Tensor]:
    """Split the last dim of ``tensor`` into consecutive chunks of ``sizes``."""
    return list(torch.split(tensor, sizes, dim=-1))


def positive(x: Tensor) -> Tensor:
    """Softplus, the usual map to strictly positive head parameters (β, γ - 1)."""
    return F.softplus(x)


def act_halting(halt: Tensor, eps: float, force_last: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Adaptive Computation Time halting distribution (Graves 2016, eqs. 5-7 and 11).

    N = min{n : Σ_{m≤n} h_m ≥ 1 - ε}; p_n = h_n for n < N, p_N = R = 1 - Σ_{n<N} h_n, 0 after N.
    Computed with masks over all steps given, so a fixed-length unroll (ONNX) and a loop that
    stops once every row has halted give the same result.

    Args: halt [B,S] halting-unit outputs h_n in (0,1) for the S steps run; ``force_last``: the
        last step is the step limit, so every row still running halts there.
    Returns: p [B,S] (rows sum to 1 for rows that halted), steps N [B] (float), remainder R [B].
    """
    cum = torch.cumsum(halt, dim=-1)  # [B,S]
    reached = cum >= 1 - eps
    if force_last:
        last = torch.zeros_like(reached)
        last[:, -1] = True
        reached = reached | last
    reached_f = reached.to(halt.dtype)
    # Steps 1..N: no earlier step reached the threshold.
    active = (torch.cumsum(reached_f, dim=-1) - reached_f) == 0  # [B,S]
    final = active & reached  # one-hot at N for halted rows
    remainder = ((1 - (cum - halt)) * final).sum(-1)  # [B]: 1 - Σ_{n<N} h_n
    p = torch.where(final, 1 - (cum - halt), torch.where(active, halt, torch.zeros_like(halt)))
    return p, active.to(halt.dtype).sum(-1), remainder


def dot_scores(query: Tensor, keys: Tensor, mask: Tensor, scale: float = 1.0) -> Tensor:
    """Dot-product energies scale · qᵀk, masked (Luong 2015 eq. 8 "dot"/"general" with scale 1;
    Vaswani 2017 eq. 1 with scale 1/√d_k).

    Args: query [..., T, K], keys [..., S, K], mask broadcastable to [..., T, S] (1/True = real).
    Returns: energies [..., T, S], masked positions NEG_INF.
    """
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale  # [...,T,K]x[...,K,S] -> [...,T,S]
    return scores.masked_fill(mask <= 0, NEG_INF)


class LuongAttention(nn.Module):
    """Luong, Pham & Manning 2015, eq. (8): score(h_t, h̄_s) ∈ {dot hᵀh̄, general hᵀW_a h̄,
    concat v_aᵀ tanh(W_a[h_t; h̄_s])}.

    ``concat`` is the additive score of :class:`AdditiveAttention` (W_a[h; h̄] = W₁h + W₂h̄), so it
    reuses it. As there, everything that depends only on the source (W_a h̄ for ``general``) is
    computed once per sentence by :meth:`project_keys`.
    """

    SCORES = ("dot", "general", "concat")

    def __init__(self, score: str, dim: int, attn_dim: int, scaled: bool = False):
        super().__init__()
        if score not in self.SCORES:
            raise ValueError(f"score must be one of {self.SCORES}, got '{score}'")
        self.kind = score
        # ``scaled``: dot/general energies divided by √D, as Vaswani et al. 2017 (§3.2.1) do
        # because large dot products push the softmax into saturation, where it gets no gradient.
        self.scale = dim**-0.5 if scaled else 1.0
        if score == "general":
            self.weight = nn.Linear(dim, dim, bias=False)
        elif score == "concat":
            self.additive = AdditiveAttention(dim, dim, attn_dim)

    def project_keys(self, keys: Tensor) -> Tensor:
        """keys h̄ [B,S,D] -> [B,S,D] (dot: h̄; general: W_a h̄) or [B,S,A] (concat)."""
        if self.kind == "general":
            return self.weight(keys)
        if self.kind == "concat":
            return self.additive.project_keys(keys)
        return keys

    def score(self, query: Tensor, projected_keys: Tensor, mask: Tensor) -> Tensor:
        """query h_t [B,D], projected keys, mask [B,S] -> masked energies [B,S]."""
        if self.kind == "concat":
            return self.additive.score(query, projected_keys, mask)
        # [B,1,D] x [B,S,D] -> [B,1,S] -> [B,S]
        return dot_scores(query.unsqueeze(1), projected_keys, mask.unsqueeze(1), self.scale).squeeze(1)


def local_window(scores: Tensor, center: Tensor, half_width: int) -> Tensor:
    """Local attention (Luong 2015 §3.2, eq. 10): align over the window [p_t - D, p_t + D], times
    a Gaussian exp(-(s - p_t)² / 2σ²) with σ = D/2 centred on the (real-valued) position p_t.

    The softmax runs over the window only; as in the paper, the Gaussian-weighted result is not
    renormalised. Written with masks over all S positions, so it exports with dynamic lengths.

    Args: scores [B,S] (already NEG_INF at padding), center p_t [B], half_width D.
    Returns: weights a_t [B,S].
    """
    positions = torch.arange(scores.shape[1], device=scores.device, dtype=scores.dtype)  # [S]
    offset = positions.unsqueeze(0) - center.unsqueeze(1)  # [1,S]-[B,1] -> [B,S]
    inside = offset.abs() <= half_width
    align = torch.softmax(scores.masked_fill(~inside, NEG_INF), dim=-1)  # [B,S]
    sigma = half_width / 2
    return align * torch.exp(-(offset**2) / (2 * sigma**2))


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention (Vaswani et al. 2017, §3.2.2).

    The usual path calls ``F.scaled_dot_product_attention``, so GPUs get fused (flash /
    memory-efficient) kernels; ``need_weights=True`` computes the same softmax(QKᵀ/√d_k)V
    explicitly, because the fused kernels do not return the attention map that evaluation plots
    and the server returns.
    """

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"model dim {dim} is not divisible by {heads} heads")
        self.heads, self.head_dim, self.dropout = heads, dim // heads, dropout
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def split(self, x: Tensor) -> Tensor:
        """[B,T,D] -> [B,H,T,D/H]."""
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of x [B,S,D] as [B,H,S,D/H] each (cacheable across decoder steps)."""
        return self.split(self.key(x)), self.split(self.value(x))

    def attend(self, query: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
               causal: bool = False, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Args: query [B,T,D] (not yet projected), k/v [B,H,S,D/H], mask bool broadcastable to
        [B,H,T,S] (True = may attend) or None; ``causal`` masks future positions (T == S).

        Returns: output [B,T,D], weights [B,H,T,S] (None unless ``need_weights``).
        """
        q = self.split(self.query(query))  # [B,H,T,D/H]
        drop = self.dropout if self.training else 0.0
        if causal and (need_weights or mask is not None):
            # SDPA takes either a mask or is_causal; fold the causal mask in. Alone, is_causal
            # keeps the fused causal kernels.
            future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
            mask, causal = (future if mask is None else mask & future), False
        if need_weights:
            allowed = torch.ones_like(q[..., :1], dtype=torch.bool) if mask is None else mask  # no mask: all
            weights = torch.softmax(dot_scores(q, k, allowed, self.head_dim**-0.5), dim=-1)  # [B,H,T,S]
            ctx = torch.matmul(F.dropout(weights, drop, self.training), v)  # [B,H,T,D/H]
        else:
            weights = None
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop, is_causal=causal)
        ctx = ctx.transpose(1, 2).reshape(ctx.shape[0], ctx.shape[2], -1)  # [B,H,T,D/H] -> [B,T,D]
        return self.out(ctx), weights


def glimpse_pyramid(image: Tensor, scales: int) -> list[Tensor]:
    """image [B,1,H,W] -> ``scales`` copies, copy k average-pooled by 2^k ([B,1,H/2^k,W/2^k]).

    Retina scale k samples copy k at its own pixel spacing, so each retina pixel is the mean of a
    2^k × 2^k block (Mnih 2014's "resized" patches) and the pooling runs once per image, not once
    per glimpse."""
    return [image if k == 0 else F.avg_pool2d(image, 2**k) for k in range(scales)]


def glimpse(pyramid: list[Tensor], centre: Tensor, patch: int) -> Tensor:
    """Retina of Mnih et al. 2014: ``patch`` × ``patch`` samples around ``centre`` from every scale.

    Args:
        pyramid: :func:`glimpse_pyramid` output; copy k is 2^k times coarser.
        centre: [B,2] glimpse centre (x, y) in [-1, 1] over the image (-1: its left/top edge).
        patch: retina width in samples at every scale (scale k covers patch·2^k input pixels).

    Returns: [B, scales·patch²], zeros where the retina leaves the image.
    """
    out = []
    for level in pyramid:
        w = level.shape[-1]
        # sample offsets in normalised units: one pooled pixel is 2/w wide; centred on ``centre``
        step = (torch.arange(patch, dtype=centre.dtype, device=centre.device) - (patch - 1) / 2) * (2.0 / w)
        gy, gx = torch.meshgrid(step, step, indexing="ij")  # [P,P] each
        offsets = torch.stack([gx, gy], dim=-1)  # [P,P,2] as (x, y), grid_sample's order
        grid = centre[:, None, None, :] + offsets  # [B,1,1,2] + [P,P,2] -> [B,P,P,2]
        sample = F.grid_sample(level, grid, mode="bilinear", padding_mode="zeros", align_corners=False)  # [B,1,P,P]
        out.append(sample.flatten(1))  # [B,1,P,P] -> [B,P²]
    return torch.cat(out, dim=-1)  # [B, scales·P²]


def filterbank_window(params: Tensor, height: int, width: int, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """DRAW's attention window from the five linear outputs of the decoder state (Gregor 2015 eq. 21-24).

    Args:
        params: [B,5] = (g̃X, g̃Y, log σ², log δ̃, log γ).
    Returns: grid centre gX, gY (pixels), stride δ (pixels), variance σ², intensity γ; each [B].
    """
    gx_, gy_, log_var, log_delta, log_gamma = params.unbind(-1)
    gx = (width + 1) / 2 * (gx_ + 1)
    gy = (height + 1) / 2 * (gy_ + 1)
    delta = (max(height, width) - 1) / (n - 1) * torch.exp(log_delta)
    return gx, gy, delta, torch.exp(log_var), torch.exp(log_gamma)


def gaussian_filterbank(centre: Tensor, delta: Tensor, var: Tensor, n: int, size: int) -> Tensor:
    """N 1-D Gaussian filters over ``size`` pixels (Gregor 2015 eq. 19-20, 25-26).

    Filter i is centred at centre + (i − N/2 − 0.5)·δ (i = 1..N) with variance σ², normalised to
    sum to 1 over the pixels. The normalisation is a softmax over pixels (max-subtracted) rather
    than the paper's division by Σ + ε: for a filter far outside the image Σ falls below ε, the
    result is then proportional to exp of large negative numbers, and ONNX Runtime and PyTorch
    disagreed there (KL off by 25 % in a 3-step model); the softmax form matched to 1e-7.

    Args: centre, delta, var: [B]. Returns: F [B,N,size].
    """
    i = torch.arange(1, n + 1, dtype=centre.dtype, device=centre.device)  # [N]
    mu = centre.unsqueeze(-1) + (i - n / 2 - 0.5) * delta.unsqueeze(-1)  # [B,N]
    a = torch.arange(1, size + 1, dtype=centre.dtype, device=centre.device)  # pixels 1..size, as eq. 22
    logits = -((a - mu.unsqueeze(-1)) ** 2) / (2 * var[:, None, None])  # [B,N,1] vs [size] -> [B,N,size]
    return torch.softmax(logits, dim=-1)


# ---- training-only code: the chunked token loss and the gradients summed after a loop -----------------------

_LOSS_ROWS = [0]  # rows per chunk while a ChunkedLoss context is open (token_loss then chunks); 0: off


class ChunkedLoss:
    """A context inside which token_loss computes its objective by ``chunked_token_loss`` (the training
    loop's ``train.cpu_loss: chunked``)."""

    def __init__(self, rows: int = 64):
        self.rows, self.before = rows, 0

    def __enter__(self):
        self.before, _LOSS_ROWS[0] = _LOSS_ROWS[0], self.rows

    def __exit__(self, *exc):
        _LOSS_ROWS[0] = self.before


class _ChunkedTokenLoss(torch.autograd.Function):
    """Label-smoothed cross-entropy (ignore_index) and token accuracy, ``rows`` rows of logits at a time.

    F.cross_entropy on a CPU writes and re-reads [N,V] float32 tensors several times (the bf16 logits cast
    up, their log-softmax, its gradient, the zero-filled NLL gradient, the cast back): at N = 2,000 target
    tokens and V = 8,000 pieces each pass is 64 MB, beyond any cache. Here each chunk of rows (64: 2 MB in
    float32) is cast into one reused buffer and goes through PyTorch's fused log-softmax (forward) or
    softmax (backward) while it stays in cache; the backward writes the logits' gradient once. The same
    objective as F.cross_entropy: per real row −(1 − ε) log p_t − ε mean_v log p_v, averaged over real rows;
    computed in float32 from the logits as given (exact for bf16), rounding aside. The maximum is taken by
    ``amax`` (a 64 x 8,000 ``max(-1)`` with its indices took 30x as long on a Zen 4 core), the accuracy's
    arg-max then only for the rare rows whose target ties with another maximum.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, pad_id: int, smoothing: float, rows: int):
        real = target != pad_id  # [N]
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        hits = torch.zeros((), dtype=torch.long, device=logits.device)
        buf = logits.new_empty((rows, logits.shape[1]), dtype=torch.float32)  # [rows,V]
        with torch.autocast(logits.device.type, enabled=False):
            for i in range(0, logits.shape[0], rows):
                x = buf[: min(rows, logits.shape[0] - i)].copy_(logits[i : i + rows])  # [n,V]
                t, r = target[i : i + rows, None], real[i : i + rows]  # [n,1], [n]
                log_p = torch.log_softmax(x, -1)  # [n,V]
                per_row = -(1 - smoothing) * log_p.gather(1, t).squeeze(1) - smoothing * log_p.mean(-1)  # [n]
                total += (per_row * r).sum()
                hits += _first_maximum_hits(x, t.squeeze(1), r)
        count = real.sum()
        ctx.save_for_backward(logits, target, real)
        ctx.smoothing, ctx.rows, ctx.count = smoothing, rows, count
        acc = hits / count.clamp(min=1)
        ctx.mark_non_differentiable(acc)
        return total / count, acc

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_acc: Tensor):
        logits, target, real = ctx.saved_tensors
        eps, rows, vocab = ctx.smoothing, ctx.rows, logits.shape[1]
        grad = torch.empty_like(logits)  # [N,V]
        scale = real.float() * (grad_loss / ctx.count)  # [N]: padding rows get no gradient
        buf = logits.new_empty((rows, vocab), dtype=torch.float32)  # [rows,V]
        with torch.autocast(logits.device.type, enabled=False):
            for i in range(0, logits.shape[0], rows):
                p = torch.softmax(buf[: min(rows, logits.shape[0] - i)].copy_(logits[i : i + rows]), -1)  # [n,V]
                p.sub_(eps / vocab).scatter_add_(1, target[i : i + rows, None], p.new_full((p.shape[0], 1), eps - 1))
                grad[i : i + rows] = p.mul_(scale[i : i + rows, None])
        return grad, None, None, None, None


def _first_maximum_hits(x: Tensor, target: Tensor, real: Tensor) -> Tensor:
    """How many real rows of x [n,V] have their first maximum at target [n] (argmax's index, without
    its cost: a row whose target is a maximum counts unless another maximum comes before it). x is scratch:
    the target's entries are set to -inf to find a tie by a second ``amax`` (comparing every entry with the
    maximum and counting took 17x as long as ``amax``)."""
    t = target[:, None]  # [n,1]
    top, at = x.amax(-1), x.gather(1, t).squeeze(1)  # [n], [n]
    hit = (at == top) & real  # [n]
    tied = hit & (x.scatter_(1, t, float("-inf")).amax(-1) == top)  # [n]: another index shares the maximum
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)  # [k]
        hit[rows] = (x[rows] == top[rows, None]).to(torch.uint8).argmax(-1) > target[rows]  # the first other one
    return hit.sum()


def chunked_token_loss(logits: Tensor, target: Tensor, pad_id: int, label_smoothing: float,
                       rows: int = 64) -> tuple[Tensor, Tensor]:
    """token_loss's objective and accuracy by ``_ChunkedTokenLoss``. Args: logits [N,V], target [N]."""
    return _ChunkedTokenLoss.apply(logits, target, pad_id, label_smoothing, rows)



def real_rows_loss(project, hidden: Tensor, target: Tensor, pad_id: int,
                   label_smoothing: float) -> tuple[Tensor, Tensor]:
    """token_loss with only the real target tokens' rows projected: hidden [B,T,D] -> its N real rows [N,D] ->
    ``project`` -> [1,N,V] against target's N real tokens [1,N]. Padding's rows take no part in the loss, so
    leaving them out changes nothing but the products' rounding."""
    real = target != pad_id  # [B,T]
    return token_loss(project(hidden[real]).unsqueeze(0), target[real].unsqueeze(0), pad_id, label_smoothing)

# ---- gradients of what a time loop reuses, summed once after its backward ----------------------------

class LoopGradients:
    """Tensors a time loop uses at every step (a recurrent weight, the attention's memory), each gradient
    summed once, after the loop's backward, as one product.

    Autograd sums such a tensor's gradient use by use: T additions of the whole tensor (Luong's memory
    [B,S,D]: an eighth of a CPU training step) and, for a weight, T thin weight-gradient products. Here a
    use's backward returns only what flows back through the loop and records its two factors; the held
    tensor's own backward, which autograd runs after every use's, sums them as one product (a weight:
    Σ_t g_tᵀ x_t = Gᵀ X; a memory: Σ_t l_t r_tᵀ per batch row, one bmm). Under autocast the products run
    in its dtype, each held tensor cast once. The same gradients, rounding aside: one rounding of a sum
    accumulated in float32 instead of T additions in the autocast dtype.
    """

    def __init__(self, device_type: str):
        on = torch.is_autocast_enabled(device_type)
        self.device_type, self.dtype = device_type, torch.get_autocast_dtype(device_type) if on else None

    def weight(self, value: Tensor) -> _Held:
        """value [N,K], used as ``held.linear(x)`` = x Wᵀ (no bias)."""
        return _Held(self, value, "weight")

    def memory(self, value: Tensor) -> _Held:
        """value [B,S,D], used as ``held.scores(q)`` and ``held.context(a)``."""
        return _Held(self, value, "memory")


class _Held:
    def __init__(self, loop: LoopGradients, value: Tensor, kind: str):
        self.kind, self.records, self.device_type = kind, [], loop.device_type
        self.tensor = _Hold.apply(value, loop.dtype or value.dtype, self)

    def linear(self, x: Tensor) -> Tensor:
        """x [B,K] -> x Wᵀ [B,N]."""
        return _HeldProduct.apply(x, self.tensor, self, "linear")

    def scores(self, query: Tensor, mask: Tensor | None = None, scale: float = 1.0) -> Tensor:
        """query [B,D] -> [B,S]: each memory row's dot product with the query, times ``scale``; with a mask [B,S]
        (1 = real) NEG_INF where it is 0, as dot_scores."""
        scores = _HeldProduct.apply(query, self.tensor, self, "scores") * scale
        return scores if mask is None else scores.masked_fill(mask <= 0, NEG_INF)

    def context(self, weights: Tensor) -> Tensor:
        """weights [B,S] -> [B,D]: the weighted sum of the memory rows."""
        return _HeldProduct.apply(weights, self.tensor, self, "context")

    def gradient(self) -> Tensor | None:
        if not self.records:
            return None
        left, right = zip(*self.records)
        self.records = []
        if self.kind == "weight":  # [N,T·B] x [T·B,K] -> [N,K]
            return torch.cat(left).t() @ torch.cat(right)
        return torch.bmm(torch.stack(left, 2), torch.stack(right, 1))  # [B,S,T] x [B,T,D] -> [B,S,D]


class _Hold(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value: Tensor, dtype: torch.dtype, held: _Held):
        ctx.held = held
        ctx.set_materialize_grads(False)
        return value.to(dtype) if value.dtype != dtype else value.view_as(value)

    @staticmethod
    def backward(ctx, grad: Tensor | None):
        total = ctx.held.gradient()  # autograd runs this after the backward of every use
        if grad is not None:  # a use outside the held products
            total = grad if total is None else total + grad
        return total, None, None


class _HeldProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, held_tensor: Tensor, held: _Held, kind: str):
        x = x.to(held_tensor.dtype)
        ctx.save_for_backward(x, held_tensor)
        ctx.held, ctx.kind = held, kind
        with torch.autocast(held.device_type, enabled=False):
            if kind == "linear":
                return x @ held_tensor.t()  # [B,K] x [K,N] -> [B,N]
            if kind == "scores":
                return torch.bmm(held_tensor, x.unsqueeze(-1)).squeeze(-1)  # [B,S,D] x [B,D,1] -> [B,S]
            return torch.bmm(x.unsqueeze(1), held_tensor).squeeze(1)  # [B,1,S] x [B,S,D] -> [B,D]

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, held_tensor = ctx.saved_tensors
        grad = grad.to(held_tensor.dtype)
        if ctx.kind == "linear":
            ctx.held.records.append((grad, x))  # dW = Σ gᵀ x
            return grad @ held_tensor, None, None, None  # [B,N] x [N,K] -> [B,K]
        if ctx.kind == "scores":
            ctx.held.records.append((grad, x))  # dM = Σ g qᵀ per row
            return torch.bmm(grad.unsqueeze(1), held_tensor).squeeze(1), None, None, None  # [B,1,S]x[B,S,D]
        ctx.held.records.append((x, grad))  # dM = Σ a gᵀ per row
        return torch.bmm(held_tensor, grad.unsqueeze(-1)).squeeze(-1), None, None, None  # [B,S,D]x[B,D,1]
