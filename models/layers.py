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
