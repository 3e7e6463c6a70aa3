import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from laminae.primitives import ConfigError, DTypeError, ShapeError
from laminae.primitives.affine_scaled_attention import (
    AffineScaledAttention,
    AffineScaledAttentionCache,
    affine_alpha,
    affine_scaled_attention_reference,
)

from .._decoding import prefill_then_decode


def _qkv(B=2, S=6, H=4, Hkv=2, D=8, N=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N = S if N is None else N
    q = torch.randn(B, S, H, D, generator=gen, dtype=dtype)
    k = torch.randn(B, N, Hkv, D, generator=gen, dtype=dtype)
    v = torch.randn(B, N, Hkv, D, generator=gen, dtype=dtype)
    return q, k, v


def _sdpa(q, k, v):
    """Causal softmax attention through torch SDPA (S == N)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


def _weights(q, k, alpha, alpha_ma, attention_mask=None):
    """A recovered from the reference by feeding one-hot values (D = N, one kv head per query head)."""
    B, N, Hkv = k.shape[0], k.shape[1], k.shape[2]
    eye = torch.eye(N, dtype=q.dtype).expand(B, Hkv, N, N).permute(0, 2, 1, 3)
    # values need head_dim D; pad the identity to D columns when N < D
    D = q.shape[-1]
    v = torch.zeros(B, N, Hkv, D, dtype=q.dtype)
    v[..., :N] = eye
    return affine_scaled_attention_reference(q, k, v, alpha, alpha_ma, attention_mask)[..., :N]  # [B, S, H, N]


# ----------------------------------------------------------------------------
# Worked example and invariants
# ----------------------------------------------------------------------------


def test_spec_worked_example():
    # P for query 1 = (0.1, 0.9): scores (0, ln 9) with D = 1 (no 1/√d change)
    q = torch.tensor([[[[0.0]], [[1.0]]]])                      # [1, 2, 1, 1]
    k = torch.tensor([[[[0.0]], [[math.log(9.0)]]]])
    v = torch.tensor([[[[1.0]], [[3.0]]]])
    alpha = torch.tensor([[[0.3], [0.8]]])                     # α_0 is irrelevant
    alpha_ma = torch.tensor([0.4])
    out = affine_scaled_attention_reference(q, k, v, alpha, alpha_ma)
    torch.testing.assert_close(out.flatten(), torch.tensor([0.4, 1.44]), atol=1e-6, rtol=0)
    # the weights themselves: A_1 = (−0.12, 0.52), row sum 0.4
    a = affine_scaled_attention_reference(q, k, torch.tensor([[[[1.0]], [[0.0]]]]), alpha, alpha_ma)
    b = affine_scaled_attention_reference(q, k, torch.tensor([[[[0.0]], [[1.0]]]]), alpha, alpha_ma)
    torch.testing.assert_close(torch.stack([a[0, 1, 0, 0], b[0, 1, 0, 0]]), torch.tensor([-0.12, 0.52]),
                               atol=1e-6, rtol=0)


def test_alpha_one_and_alpha_ma_one_is_softmax_attention():
    q, k, v = _qkv()
    out = affine_scaled_attention_reference(q, k, v, torch.ones(2, 6, 4), torch.ones(4))
    torch.testing.assert_close(out, _sdpa(q, k, v), atol=1e-5, rtol=1e-5)


def test_zero_projection_and_half_alpha_ma_is_half_softmax_attention():
    m = AffineScaledAttention(12, 4, 2, 8, initializer_range=0.0, alpha_ma_init=0.5, backend="reference").eval()
    q, k, v = _qkv()
    x = torch.randn(2, 6, 12)
    assert torch.equal(affine_alpha(x, m.alpha_proj.weight), torch.full((2, 6, 4), 0.5))
    out, cache = m(q, k, v, x=x)
    assert cache is None                                      # no cache given: no decoding
    torch.testing.assert_close(out, 0.5 * _sdpa(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_mask", [False, True])
def test_rows_of_A_sum_to_alpha_ma_and_vanish_on_invisible_keys(with_mask):
    B, S, H, N = 2, 5, 3, 8
    q, k, _ = _qkv(B, S, H, H, D=8, N=N)
    alpha = torch.rand(B, S, H)
    alpha_ma = torch.tensor([0.2, 0.7, 1.0])
    mask = torch.rand(B, N) > 0.3 if with_mask else None
    if with_mask:
        mask[:, N - S:] = True      # every query sees at least itself
        mask[0, : N - S] = False    # plus a fully masked cache prefix
    A = _weights(q, k, alpha, alpha_ma, mask)
    torch.testing.assert_close(A.sum(-1), alpha_ma.expand(B, S, H), atol=1e-6, rtol=0)
    visible = torch.arange(N)[None, :] <= torch.arange(S)[:, None] + (N - S)
    visible = visible[None].expand(B, S, N)
    if with_mask:
        visible = visible & mask[:, None, :]
    assert torch.all(A.permute(0, 1, 3, 2)[~visible[:, :, :, None].expand(B, S, N, H)] == 0)


def test_first_token_is_alpha_ma_times_v0_and_masked_rows_are_zero():
    q, k, v = _qkv(B=1, S=3, H=2, Hkv=1)
    alpha, alpha_ma = torch.rand(1, 3, 2), torch.tensor([0.3, 0.9])
    out = affine_scaled_attention_reference(q, k, v, alpha, alpha_ma)
    torch.testing.assert_close(out[0, 0], alpha_ma[:, None] * v[0, 0, 0][None, :])
    keep = torch.tensor([[False, False, True]])
    out = affine_scaled_attention_reference(q, k, v, alpha, alpha_ma, keep)
    assert torch.all(out[0, :2] == 0) and torch.isfinite(out).all()


def test_causality_perturbing_the_last_token():
    q, k, v = _qkv(B=1, S=7)
    alpha, alpha_ma = torch.rand(1, 7, 4), torch.rand(4)
    base = affine_scaled_attention_reference(q, k, v, alpha, alpha_ma)
    q2, k2, v2, a2 = q.clone(), k.clone(), v.clone(), alpha.clone()
    q2[:, -1] += 3.0
    k2[:, -1] -= 2.0
    v2[:, -1] *= 5.0
    a2[:, -1] = 1 - a2[:, -1]
    out = affine_scaled_attention_reference(q2, k2, v2, a2, alpha_ma)
    assert torch.equal(out[:, :-1], base[:, :-1])
    assert not torch.allclose(out[:, -1], base[:, -1])


def test_linear_clip_and_sigmoid_activations():
    w = torch.eye(3)
    x = torch.tensor([[-6.0, 0.0, 5.0], [5.0, -5.0, 2.0]])
    torch.testing.assert_close(affine_alpha(x, w), torch.tensor([[0.0, 0.5, 1.0], [1.0, 0.0, 0.7]]))
    torch.testing.assert_close(affine_alpha(x, w, "sigmoid"), torch.sigmoid(x))
    # φ′ = 0.1 on the closed interval [−5, 5], 0 outside
    u = torch.tensor([[-5.0, 5.0, -5.01, 4.0]], requires_grad=True)
    affine_alpha(u, torch.eye(4)).sum().backward()
    torch.testing.assert_close(u.grad, torch.tensor([[0.1, 0.1, 0.0, 0.1]]))
    with pytest.raises(ConfigError):
        affine_alpha(x, w, "relu")


# ----------------------------------------------------------------------------
# EMA
# ----------------------------------------------------------------------------


def _zero_module(**kw):
    return AffineScaledAttention(12, 4, 2, 8, initializer_range=0.0, backend="reference", **kw)


def test_ema_schedule_and_frozen_in_eval():
    m = _zero_module()
    q, k, v = _qkv()
    x = torch.randn(2, 6, 12)
    assert torch.equal(m.alpha_ma, torch.zeros(4))
    for n in range(1, 5):
        m(q, k, v, x=x)
        torch.testing.assert_close(m.alpha_ma, torch.full((4,), 0.5 * (1 - 0.9**n)))
    torch.testing.assert_close(m.alpha_ma, torch.full((4,), 0.5 * (1 - 0.9**4)))
    m.eval()
    before = m.alpha_ma.clone()
    m(q, k, v, x=x)
    assert torch.equal(m.alpha_ma, before)


def test_ema_updates_before_use():
    m = _zero_module()
    q, k, v = _qkv()
    out, _ = m(q, k, v, x=torch.randn(2, 6, 12))
    expected = affine_scaled_attention_reference(q, k, v, torch.full((2, 6, 4), 0.5), torch.full((4,), 0.05))
    torch.testing.assert_close(out, expected)


def test_ema_averages_over_valid_query_positions_per_head():
    m = AffineScaledAttention(4, 2, 1, 8, affine_momentum=0.0, backend="reference")
    with torch.no_grad():
        m.alpha_proj.weight.copy_(torch.tensor([[10.0, 0, 0, 0], [0, 10.0, 0, 0]]))
    x = torch.zeros(2, 3, 4)
    x[0, 0, 0] = 0.5            # α head 0 = 1.0 at (0, 0)
    x[1, 2, 1] = -0.5           # α head 1 = 0.0 at (1, 2), a masked query
    keep = torch.tensor([[1, 1, 1], [1, 1, 0]])
    q, k, v = _qkv(B=2, S=3, H=2, Hkv=1)
    m(q, k, v, attention_mask=keep, x=x)
    torch.testing.assert_close(m.alpha_ma, torch.tensor([(1.0 + 4 * 0.5) / 5, 0.5]))


def test_ema_not_updated_twice_under_activation_checkpointing():
    for use_reentrant in (False, True):
        m = _zero_module()
        q, k, v = _qkv()
        x = torch.randn(2, 6, 12, requires_grad=True)
        q.requires_grad_(True)

        def run(x, q):
            return m(q, k, v, x=x)[0]

        out = checkpoint(run, x, q, use_reentrant=use_reentrant)
        torch.testing.assert_close(m.alpha_ma, torch.full((4,), 0.05))
        out.sum().backward()
        torch.testing.assert_close(m.alpha_ma, torch.full((4,), 0.05))
        assert q.grad is not None and torch.isfinite(q.grad).all()


def test_training_gradients_survive_a_second_forward_before_backward():
    m = _zero_module()
    q, k, v = _qkv()
    q.requires_grad_(True)
    x = torch.randn(2, 6, 12)
    out1, _ = m(q, k, v, x=x)
    out2, _ = m(q, k, v, x=x)
    (out1.sum() + out2.sum()).backward()
    assert torch.isfinite(q.grad).all()


def test_state_dict_holds_projection_and_buffer():
    m = AffineScaledAttention(16, 4, 2, 8)
    sd = m.state_dict()
    assert set(sd) == {"alpha_proj.weight", "alpha_ma"}
    assert sd["alpha_proj.weight"].shape == (4, 16) and sd["alpha_ma"].dtype == torch.float32
    assert 0.015 < float(m.alpha_proj.weight.detach().std()) < 0.025
    assert sum(p.numel() for p in m.parameters()) == 4 * 16
    m2 = AffineScaledAttention(16, 4, 2, 8)
    m2.load_state_dict(sd, strict=True)


# ----------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------


def test_prefill_then_single_steps_equals_full_forward():
    torch.manual_seed(0)
    B, T, H, Hkv, D, hidden = 2, 9, 4, 2, 8, 12
    m = AffineScaledAttention(hidden, H, Hkv, D, alpha_ma_init=0.3, initializer_range=0.5,
                              backend="reference").eval()
    q, k, v = _qkv(B, T, H, Hkv, D)
    x = torch.randn(B, T, hidden)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, :2] = False  # left padding
    full, _ = m(q, k, v, attention_mask=keep, x=x)
    with torch.no_grad():
        decoded, cache = prefill_then_decode(m, q, k, v, cache=m.empty_cache(B), prefill=4, attention_mask=keep,
                                             sliced={"x": x})
    assert cache.length == T
    torch.testing.assert_close(decoded, full, atol=1e-6, rtol=1e-6)


def test_cache_errors():
    m = AffineScaledAttention(12, 4, 2, 8)
    q, k, v = _qkv(S=2)
    x = torch.randn(2, 2, 12)
    _, grown = m(q, k, v, cache=m.empty_cache(2), x=x)
    assert isinstance(grown, AffineScaledAttentionCache) and grown.length == 2
    with pytest.raises(TypeError, match="cache"):
        m(q, k, v, cache={}, x=x)
    with pytest.raises(ConfigError, match="num_kv_heads"):
        m(q, k, v, cache=AffineScaledAttention(12, 4, 1, 8).empty_cache(2), x=x)
    with pytest.raises(DTypeError):
        m(q, k, v, cache=m.empty_cache(2, dtype=torch.float64), x=x)


# ----------------------------------------------------------------------------
# Gradients and errors
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("with_mask", [False, True])
def test_gradcheck_reference_float64(with_mask):
    torch.manual_seed(1)
    B, T, H, Hkv, D = 2, 4, 4, 2, 3
    q, k, v = (t.requires_grad_(True) for t in _qkv(B, T, H, Hkv, D, dtype=torch.float64))
    alpha = torch.rand(B, T, H, dtype=torch.float64, requires_grad=True)
    alpha_ma = torch.rand(H, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 1]]) if with_mask else None

    def fn(q, k, v, alpha, alpha_ma):
        return affine_scaled_attention_reference(q, k, v, alpha, alpha_ma, mask, upcast=False)

    assert torch.autograd.gradcheck(fn, (q, k, v, alpha, alpha_ma))


def test_gradcheck_alpha_projection_float64():
    torch.manual_seed(2)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    for act in ("linear_clip", "sigmoid"):
        assert torch.autograd.gradcheck(lambda x, w: affine_alpha(x, w, act), (x, w))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(affine_momentum=1.5), "affine_momentum"),
        (dict(affine_momentum=-0.1), "affine_momentum"),
        (dict(affine_momentum=float("nan")), "affine_momentum"),
        (dict(num_kv_heads=3), "num_kv_heads"),
        (dict(activation="tanh"), "activation"),
        (dict(alpha_ma_init=float("inf")), "alpha_ma_init"),
        (dict(backend="cuda"), "backend"),
        (dict(head_dim=0), "head_dim"),
    ],
)
def test_bad_config_raises(kwargs, match):
    args = dict(hidden_size=12, num_heads=4, num_kv_heads=2, head_dim=8) | kwargs
    with pytest.raises(ConfigError, match=match):
        AffineScaledAttention(**args)


def test_momentum_bounds_are_allowed():
    for rho in (0.0, 1.0):
        AffineScaledAttention(12, 4, 2, 8, affine_momentum=rho)


def test_bad_inputs_raise():
    m = AffineScaledAttention(12, 4, 2, 8)
    q, k, v = _qkv(S=5)
    x = torch.randn(2, 5, 12)
    with pytest.raises(ShapeError, match="hidden_size"):
        m(q, k, v, x=torch.randn(2, 5, 10))
    with pytest.raises(ShapeError, match="`q`"):
        m(q[:, :, :3], k, v, x=x)
    with pytest.raises(ShapeError, match="`k`"):
        m(q, k[..., :4], v, x=x)
    with pytest.raises(ShapeError, match="`v`"):
        m(q, k, v[:, :4], x=x)
    with pytest.raises(ShapeError, match="N >= S"):
        m(q, k[:, :3], v[:, :3], x=x)
    with pytest.raises(ShapeError, match="attention_mask"):
        m(q, k, v, attention_mask=torch.ones(2, 4), x=x)
    with pytest.raises(DTypeError, match="mask == 0"):
        m(q, k, v, attention_mask=torch.full((2, 5), 2.0), x=x)
    with pytest.raises(DTypeError):
        m(q, k.double(), v, x=x)
    with pytest.raises(DTypeError, match="parameters"):
        m(q, k, v, x=x.double())                       # x meets alpha_proj's weight in a matmul
    with pytest.raises(ShapeError, match="at least one token"):
        m(q[:, :0], k, v, x=x[:, :0])
    with pytest.raises(TypeError):
        m(q.tolist(), k, v, x=x)
