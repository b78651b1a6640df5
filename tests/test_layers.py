"""Attention mechanisms in models/layers.py against hand-computed values."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from models.layers import (
    AdditiveAttention,
    LuongAttention,
    MultiHeadAttention,
    act_halting,
    circular_shift,
    cosine_content_weights,
    dot_scores,
    local_window,
    ntm_address,
)


def test_additive_attention_matches_formula():
    torch.manual_seed(0)
    attn = AdditiveAttention(query_dim=3, key_dim=4, attn_dim=5)
    query, keys = torch.randn(2, 3), torch.randn(2, 6, 4)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.float)
    context, weights = attn(query, attn.project_keys(keys), keys, mask)
    # e_ij = v^T tanh(W s + U h_j), softmax over the real positions only.
    scores = (torch.tanh(query.unsqueeze(1) @ attn.query.weight.T + keys @ attn.key.weight.T + attn.key.bias)
              @ attn.v.weight.T).squeeze(-1)
    expected = torch.softmax(scores.masked_fill(mask == 0, float("-inf")), -1)
    assert_close(weights, expected)
    assert_close(weights[1, 3:], torch.zeros(3))
    assert_close(context, (expected.unsqueeze(-1) * keys).sum(1))
    # The pointer logits are the same energies, masked.
    logits = attn.score(query, attn.project_keys(keys), mask)
    assert_close(logits[0], scores[0])
    assert bool((logits[1, 3:] <= -1e8).all())


def test_content_weights_prefer_the_matching_row():
    memory = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]])
    key = torch.tensor([[[0.0, 2.0]]])
    w = cosine_content_weights(memory, key, beta=torch.tensor([[[10.0]]]))
    # cos = [0, 1, 0] -> softmax(10 * cos)
    expected = torch.softmax(torch.tensor([0.0, 10.0, 0.0]), -1)
    assert_close(w[0, 0], expected)


def test_content_weights_are_finite_on_zero_memory():
    memory = torch.zeros(1, 4, 3, requires_grad=True)
    key = torch.randn(1, 1, 3, requires_grad=True)
    w = cosine_content_weights(memory, key, torch.ones(1, 1, 1))
    w.sum().backward()
    assert_close(w[0, 0], torch.full((4,), 0.25))
    assert torch.isfinite(memory.grad).all() and torch.isfinite(key.grad).all()


def test_circular_shift_moves_and_wraps():
    w = torch.tensor([[[0.0, 0.0, 0.0, 1.0]]])
    forward = torch.tensor([[[0.0, 0.0, 1.0]]])  # all mass on a +1 move
    assert_close(circular_shift(w, forward), torch.tensor([[[1.0, 0.0, 0.0, 0.0]]]))
    back = torch.tensor([[[1.0, 0.0, 0.0]]])
    assert_close(circular_shift(w, back), torch.tensor([[[0.0, 0.0, 1.0, 0.0]]]))
    split = torch.tensor([[[0.25, 0.5, 0.25]]])
    assert_close(circular_shift(w, split), torch.tensor([[[0.25, 0.0, 0.25, 0.5]]]))


def test_ntm_address_location_mode_and_sharpening():
    memory = torch.randn(1, 5, 3)
    prev = torch.tensor([[[0.0, 1.0, 0.0, 0.0, 0.0]]])
    # g = 0 ignores content: the previous weighting is shifted by +1 and stays one-hot.
    w = ntm_address(memory, prev, torch.randn(1, 1, 3), torch.ones(1, 1, 1), torch.zeros(1, 1, 1),
                    torch.tensor([[[0.0, 0.0, 1.0]]]), torch.ones(1, 1, 1))
    assert_close(w, torch.tensor([[[0.0, 0.0, 1.0, 0.0, 0.0]]]), atol=1e-6, rtol=0)
    # Sharpening with γ = 2 squares and renormalises a blurred weighting.
    blurred = ntm_address(memory, prev, torch.randn(1, 1, 3), torch.ones(1, 1, 1), torch.zeros(1, 1, 1),
                          torch.tensor([[[0.25, 0.5, 0.25]]]), torch.full((1, 1, 1), 2.0))
    expected = torch.tensor([0.25, 0.5, 0.25]) ** 2
    assert_close(blurred[0, 0, :3], expected / expected.sum(), atol=1e-6, rtol=1e-5)
    assert_close(blurred.sum(-1), torch.ones(1, 1))


def test_sharpening_gradient_is_finite_at_zero_weights():
    gamma = torch.full((1, 1, 1), 3.0, requires_grad=True)
    prev = torch.tensor([[[1.0, 0.0, 0.0]]])
    w = ntm_address(torch.randn(1, 3, 2), prev, torch.randn(1, 1, 2), torch.ones(1, 1, 1),
                    torch.zeros(1, 1, 1), torch.tensor([[[0.0, 1.0, 0.0]]]), gamma)
    (w * torch.arange(3.0)).sum().backward()
    assert torch.isfinite(gamma.grad).all()


def test_act_halting_distribution_and_remainder():
    # Row 0 halts at step 3 (0.3+0.5+0.4 >= 0.99), row 1 at once (0.995 >= 1-eps),
    # row 2 never reaches the threshold and is stopped by the step limit.
    halt = torch.tensor([[0.3, 0.5, 0.4, 0.9], [0.995, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1]])
    p, steps, remainder = act_halting(halt, eps=0.01, force_last=True)
    assert_close(p, torch.tensor([[0.3, 0.5, 0.2, 0.0], [1.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.7]]))
    assert_close(steps, torch.tensor([3.0, 1.0, 4.0]))
    assert_close(remainder, torch.tensor([0.2, 1.0, 0.7]))
    # Without the limit, a row that has not halted keeps all its mass on the steps run so far.
    p, steps, _ = act_halting(halt[2:, :2], eps=0.01, force_last=False)
    assert_close(p, torch.tensor([[0.1, 0.1]]))
    assert_close(steps, torch.tensor([2.0]))
    # The ponder cost's gradient flows through R only: d(N + R)/dh_n = -1 for n < N, 0 after.
    h = halt[:1].clone().requires_grad_(True)
    _, n, r = act_halting(h, eps=0.01, force_last=True)
    (n + r).sum().backward()
    assert_close(h.grad, torch.tensor([[-1.0, -1.0, 0.0, 0.0]]))


def test_luong_scores_match_eq_8():
    torch.manual_seed(0)
    h, keys = torch.randn(2, 4), torch.randn(2, 5, 4)  # h_t [B,D], h̄_s [B,S,D]
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float)
    dot = LuongAttention("dot", 4, 3)
    assert_close(dot.score(h, dot.project_keys(keys), mask)[0], (keys[0] @ h[0]))
    general = LuongAttention("general", 4, 3)
    expected = torch.einsum("bd,de,bse->bs", h, general.weight.weight, keys)  # h_tᵀ W_a h̄_s
    got = general.score(h, general.project_keys(keys), mask)
    assert_close(got[0], expected[0])
    assert_close(got[1, :2], expected[1, :2])
    assert bool((got[1, 2:] <= -1e8).all())
    concat = LuongAttention("concat", 4, 3)  # v_aᵀ tanh(W_a[h_t; h̄_s]), W_a = [W_1 W_2]
    a = concat.additive
    expected = (torch.tanh(h.unsqueeze(1) @ a.query.weight.T + keys @ a.key.weight.T + a.key.bias)
                @ a.v.weight.T).squeeze(-1)
    assert_close(concat.score(h, concat.project_keys(keys), mask)[0], expected[0])
    with pytest.raises(ValueError, match="score must be one of"):
        LuongAttention("cosine", 4, 3)
    # scaled: dot/general energies divided by √D (√4 = 2); masked positions stay NEG_INF
    for kind in ("dot", "general"):
        plain, scaled = LuongAttention(kind, 4, 3), LuongAttention(kind, 4, 3, scaled=True)
        scaled.load_state_dict(plain.state_dict())
        e_plain = plain.score(h, plain.project_keys(keys), mask)
        e_scaled = scaled.score(h, scaled.project_keys(keys), mask)
        assert_close(e_scaled[0], e_plain[0] / 2)
        assert bool((e_scaled[1, 2:] <= -1e8).all())


def test_local_window_is_a_windowed_softmax_times_a_gaussian():
    scores = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, -1e9]])  # last position is padding
    center, width = torch.tensor([2.0]), 2
    w = local_window(scores, center, width)
    inside = torch.softmax(torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0]), -1)  # positions 0..4
    gauss = torch.exp(-torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0]) ** 2 / (2 * 1.0**2))  # σ = D/2 = 1
    assert_close(w[0, :5], inside * gauss)
    assert_close(w[0, 5:], torch.zeros(2))  # beyond p_t + D, and padding
    assert_close(w[0, 2], inside[2])  # the Gaussian is 1 at p_t


def test_dot_scores_scale_and_mask():
    q, k = torch.tensor([[[1.0, 2.0]]]), torch.tensor([[[3.0, 4.0], [1.0, 0.0]]])
    out = dot_scores(q, k, torch.tensor([[[1, 0]]]), scale=0.5)
    assert_close(out[0, 0, 0], torch.tensor(5.5))
    assert float(out[0, 0, 1]) == -1e9


def test_multi_head_attention_weights_path_equals_fused_path():
    """need_weights computes softmax(QKᵀ/√d)V by hand; it must equal scaled_dot_product_attention,
    with a padding mask, causally, and both."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(dim=8, heads=2).eval()
    x, mem = torch.randn(2, 5, 8), torch.randn(2, 6, 8)
    pad = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)[:, None, None, :]
    k, v = mha.project_kv(mem)
    fused, none = mha.attend(x, k, v, pad)
    explicit, weights = mha.attend(x, k, v, pad, need_weights=True)
    assert none is None and weights.shape == (2, 2, 5, 6)
    assert_close(fused, explicit)
    assert_close(weights.sum(-1), torch.ones(2, 2, 5))
    assert float(weights[1, :, :, 3:].abs().max()) == 0.0
    k, v = mha.project_kv(x)
    fused, _ = mha.attend(x, k, v, causal=True)
    explicit, weights = mha.attend(x, k, v, causal=True, need_weights=True)
    assert_close(fused, explicit)
    assert float(weights.triu(1).abs().max()) == 0.0  # nothing attends to the future
    self_pad = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)[:, None, None, :]
    both, _ = mha.attend(x, k, v, self_pad, causal=True)
    both_w, weights = mha.attend(x, k, v, self_pad, causal=True, need_weights=True)
    assert_close(both, both_w)
    assert float(weights[1, :, :, 4].abs().max()) == 0.0
    # The first position attends only to itself: its output is W_o v_0.
    assert_close(explicit[:, 0], mha.out(v[:, :, 0].reshape(2, -1)))  # [B,H,K] -> [B,D], heads in order


def test_token_accuracy_counts_the_first_of_tied_maxima_as_argmax_does():
    from models.layers import token_loss

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randint(-2, 3, (4, 7, 11), generator=g).to(dtype)  # small integers: ties everywhere
        target = torch.randint(0, 11, (4, 7), generator=g)
        target[0, 5:] = 0  # padding
        real = target != 0
        expected = ((logits.argmax(-1) == target) & real).sum() / real.sum()
        assert token_loss(logits, target, 0, 0.0)[1] == expected


@pytest.mark.parametrize("autocast", [False, True])
def test_loop_gradients_sum_once_what_autograd_sums_step_by_step(autocast):
    """A recurrent loop whose weight and memory are used at every step (and the memory once outside the held
    products): LoopGradients' gradients are autograd's own, float32 rounding aside, and within bf16 rounding
    under autocast (there its sums are the more exact: one rounding instead of one per step)."""
    from models.layers import LoopGradients

    torch.manual_seed(0)
    weight = torch.randn(6, 4, requires_grad=True)  # [N=6, K=4]
    memory = torch.randn(3, 5, 4, requires_grad=True)  # [B,S,D]
    h0 = torch.randn(3, 4, requires_grad=True)

    def run(held: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loop = LoopGradients("cpu")
            w, m = (loop.weight(weight), loop.memory(memory)) if held else (None, None)
            h, total = h0, memory.sum() * 0.5  # a use outside the held products
            for _ in range(7):
                z = w.linear(h) if held else h @ weight.t()  # [B,6]
                h = torch.tanh(z[:, :4] + z[:, 4:].sum(-1, keepdim=True))  # [B,4]
                scores = m.scores(h) if held else torch.bmm(memory, h.unsqueeze(-1)).squeeze(-1)  # [B,S]
                align = torch.softmax(scores.float(), -1)
                h = m.context(align) if held else torch.bmm(align.unsqueeze(1), memory).squeeze(1)  # [B,D]
                total = total + (h.float() ** 2).sum()
        return total, torch.autograd.grad(total, [weight, memory, h0])

    want_total, want = run(False)
    got_total, got = run(True)
    assert float(want_total.detach()) > 1.0
    tol = {"rtol": 4e-2, "atol": 4e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got_total, want_total, **tol)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.abs().sum() > 0
        torch.testing.assert_close(g, w, **tol)
