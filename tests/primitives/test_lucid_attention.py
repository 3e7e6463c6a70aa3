import math

import pytest
import torch

from laminae.primitives import ConfigError, DERFAttention, DeviceError, DTypeError, ShapeError
from laminae.primitives.lucid_attention import (
    LucidAttention,
    LucidCache,
    lucid_attention_reference,
    lucid_matrix,
    lucid_precondition_reference,
)

from .._decoding import prefill_then_decode

F64 = torch.float64


def _qkv(B, S, N, H, HKV, D, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=gen, dtype=dtype)
    k = torch.randn(B, N, HKV, D, generator=gen, dtype=dtype)
    v = torch.randn(B, N, HKV, D, generator=gen, dtype=dtype)
    return q, k, v


def _ragged(B, N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, N, generator=gen) > 0.3
    keep[0, :2] = False  # left padding
    keep[:, -1] = True
    return keep


# ---------------------------------------------------------------- worked examples


def test_identical_keys_erase_the_duplicated_value():
    k = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=F64).view(1, 2, 1, 2)
    v = torch.tensor([[1.0, 2.0], [3.0, 5.0]], dtype=F64).view(1, 2, 1, 2)
    L = lucid_matrix(k, eps=0.0)[0, 0]
    torch.testing.assert_close(L, torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=F64))
    v_prime = lucid_precondition_reference(k, v, eps=0.0)[0, :, 0]
    torch.testing.assert_close(v_prime, torch.tensor([[1.0, 2.0], [2.0, 3.0]], dtype=F64))
    q = torch.randn(1, 2, 1, 2, dtype=F64)
    out = lucid_attention_reference(q, k, v, eps=0.0)[0, :, 0]
    torch.testing.assert_close(out[1], torch.tensor([1.5, 2.5], dtype=F64))
    torch.testing.assert_close(out[1], 0.5 * v[0, 1, 0])
    # plain softmax attention would average the raw values: (2, 3.5)
    torch.testing.assert_close(v[0, :, 0].mean(0), torch.tensor([2.0, 3.5], dtype=F64))


def test_orthogonal_keys_decorrelate_partially():
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=F64).view(1, 2, 1, 2)
    v = torch.tensor([[1.0, 2.0], [3.0, 5.0]], dtype=F64).view(1, 2, 1, 2)
    L = lucid_matrix(k, eps=0.0)[0, 0]
    assert abs(L[1, 0].item() - math.exp(-math.sqrt(2))) < 1e-12
    assert abs(L[1, 0].item() - 0.243117) < 1e-6
    v_prime = lucid_precondition_reference(k, v, eps=0.0)[0, 1, 0]
    torch.testing.assert_close(v_prime, torch.tensor([2.756883, 4.513767], dtype=F64), atol=2e-6, rtol=0)


def test_matrix_entries_lie_in_range_and_diagonal_is_one_up_to_eps():
    _, k, _ = _qkv(2, 1, 9, 1, 3, 16)
    L = lucid_matrix(k, eps=1e-6)
    d = 16
    tril = torch.tril(torch.ones(9, 9, dtype=torch.bool))
    assert bool((L[..., ~tril] == 0).all())
    assert bool((L[..., tril] >= math.exp(-2 * math.sqrt(d)) * (1 - 1e-9)).all())
    assert bool((L[..., tril] <= 1 + 1e-12).all())
    diag = L.diagonal(dim1=-2, dim2=-1)
    assert bool(((diag - 1).abs() < 1e-4).all())
    assert bool((diag <= 1).all())  # eps > 0 puts the computed diagonal slightly below 1


def test_solve_satisfies_L_times_v_prime_equals_v():
    _, k, v = _qkv(2, 1, 13, 1, 2, 8)
    keep = _ragged(2, 13)
    for mask in (None, keep):
        L = lucid_matrix(k, mask)
        v_prime = lucid_precondition_reference(k, v, mask)
        lhs = L @ v_prime.transpose(1, 2)
        torch.testing.assert_close(lhs, v.transpose(1, 2), atol=1e-10, rtol=1e-10)


def test_single_token_returns_v_over_its_diagonal():
    q, k, v = _qkv(1, 1, 1, 2, 1, 8)
    out = lucid_attention_reference(q, k, v)
    L11 = lucid_matrix(k)[0, 0, 0, 0]
    torch.testing.assert_close(out, (v / L11).expand(1, 1, 2, 8))
    torch.testing.assert_close(out, v.expand(1, 1, 2, 8), atol=1e-4, rtol=0)


def test_empty_sequence_empty_reference_output_and_a_refusing_module():
    q, k, v = _qkv(2, 0, 0, 2, 1, 8)
    out = lucid_attention_reference(q, k, v)
    assert out.shape == (2, 0, 2, 8)
    with pytest.raises(ShapeError, match="at least one token"):   # the module: the empty-input rule
        LucidAttention(2, 1, 8)(q, k, v)


# ---------------------------------------------------------------- padding rule


def test_padding_keys_are_never_mixed_and_keep_their_value():
    _, k, v = _qkv(2, 1, 11, 1, 2, 8)
    keep = _ragged(2, 11)
    L = lucid_matrix(k, keep)
    pad = ~keep
    eye = torch.eye(11, dtype=F64)
    for b in range(2):
        rows = L[b][:, pad[b]]  # padded rows
        torch.testing.assert_close(rows, eye[pad[b]].expand_as(rows))
        cols = L[b][:, :, pad[b]]  # padded columns
        torch.testing.assert_close(cols, eye[:, pad[b]].expand_as(cols))
    v_prime = lucid_precondition_reference(k, v, keep)
    torch.testing.assert_close(v_prime[pad], v[pad])


def test_padding_key_contents_do_not_matter_even_zero_keys():
    q, k, v = _qkv(2, 11, 11, 2, 2, 8)
    keep = _ragged(2, 11)
    out = lucid_attention_reference(q, k, v, keep)
    k2, v2 = k.clone(), v.clone()
    k2[~keep] = 0.0  # the zero-key hazard: k̂ = 0 would put exp(−√d) on the diagonal
    v2[~keep] = 1e6
    out2 = lucid_attention_reference(q, k2, v2, keep)
    torch.testing.assert_close(out2[keep], out[keep], atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------- causality


def test_changing_the_last_token_leaves_earlier_outputs_bitwise_unchanged():
    q, k, v = _qkv(2, 9, 9, 4, 2, 8, dtype=torch.float32)
    out = lucid_attention_reference(q, k, v)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, -1] += 1.0
    k2[:, -1] += 3.0
    v2[:, -1] -= 2.0
    out2 = lucid_attention_reference(q2, k2, v2)
    assert torch.equal(out[:, :-1], out2[:, :-1])
    assert not torch.equal(out[:, -1], out2[:, -1])


def test_perturbing_token_t_never_changes_outputs_before_t():
    q, k, v = _qkv(1, 10, 10, 2, 1, 8)
    k.requires_grad_(True)
    v.requires_grad_(True)
    out = lucid_attention_reference(q, k, v)
    for t in range(10):
        gk, gv = torch.autograd.grad(out[:, t].sum(), [k, v], retain_graph=True)
        assert bool((gk[:, t + 1:] == 0).all()) and bool((gv[:, t + 1:] == 0).all())


# ---------------------------------------------------------------- gradients


def test_gradcheck_preconditioner_T6_d4():
    _, k, v = _qkv(1, 1, 6, 1, 1, 4)
    k.requires_grad_(True)
    v.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda k, v: lucid_precondition_reference(k, v), (k, v))


def test_gradcheck_attention_gqa_mask_and_query_offset():
    q, k, v = _qkv(2, 3, 5, 4, 2, 4)
    keep = _ragged(2, 5)
    for t in (q, k, v):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda q, k, v: lucid_attention_reference(q, k, v, keep), (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: lucid_attention_reference(q, k, v), (q, k, v))


def test_backward_formulas_of_the_spec():
    """dV = L⁻ᵀdV′, dS = −(dV V′ᵀ ⊙ L), dk̂ = s(dS + dSᵀ)k̂, dk = ρ(dk̂ − k̂(k̂·dk̂)/d)."""
    _, k, v = _qkv(1, 1, 7, 1, 1, 4)
    k.requires_grad_(True)
    v.requires_grad_(True)
    vp = lucid_precondition_reference(k, v)
    g = torch.randn_like(vp)
    dk_auto, dv_auto = torch.autograd.grad(vp, [k, v], g)
    d = 4
    kk = k.detach()[0, :, 0]
    rho = torch.rsqrt(kk.square().mean(-1, keepdim=True) + 1e-6)
    kh = kk * rho
    L = lucid_matrix(k.detach())[0, 0]
    Vp = vp.detach()[0, :, 0]
    dV = torch.linalg.solve_triangular(L.T, g[0, :, 0], upper=True)
    dS = -(dV @ Vp.T) * L
    dkh = (dS + dS.T) @ kh / math.sqrt(d)
    dk = rho * (dkh - kh * (kh * dkh).sum(-1, keepdim=True) / d)
    torch.testing.assert_close(dv_auto[0, :, 0], dV)
    torch.testing.assert_close(dk_auto[0, :, 0], dk)


# ---------------------------------------------------------------- module and decoding


def test_module_matches_functional_reference():
    q, k, v = _qkv(2, 9, 9, 4, 2, 8, dtype=torch.float32)
    keep = _ragged(2, 9)
    m = LucidAttention(4, 2, 8, backend="reference")
    assert m(q, k, v, keep).cache is None                  # no cache given: no decoding
    out, cache = m(q, k, v, keep, m.empty_cache(2))
    torch.testing.assert_close(out, lucid_attention_reference(q, k, v, keep), atol=0, rtol=0)
    assert isinstance(cache, LucidCache) and cache.length == 9 and cache.values.dtype == torch.float32
    kept = keep.bool()
    torch.testing.assert_close(cache.values[kept], lucid_precondition_reference(k, v, keep)[kept])
    assert not cache.values[~kept].any()   # the module zeroes padded values before anything reads them
    assert list(m.parameters()) == []
    assert "lucid_attention_eps=1e-06" in repr(m)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_prefill_then_one_token_steps_equals_full_forward(masked, dtype):
    B, T, P, H, HKV, D = 2, 16, 5, 4, 2, 16
    q, k, v = _qkv(B, T, T, H, HKV, D, dtype=dtype, seed=3)
    keep = torch.ones(B, T, dtype=torch.bool)
    if masked:
        keep[1, :3] = False  # left padding of the second row, inside the prefill
        keep[0, 9] = False   # a hole decoded later
    mask = keep if masked else None
    m = LucidAttention(H, HKV, D, backend="reference")
    empty = m.empty_cache(B, dtype=dtype)
    full, full_cache = m(q, k, v, mask, empty)
    decoded, cache = prefill_then_decode(m, q, k, v, cache=empty, prefill=P, attention_mask=mask)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    kept = keep[:, :, None, None].expand_as(full)
    assert float((decoded - full)[kept].abs().max()) < tol
    torch.testing.assert_close(cache.values, full_cache.values, atol=tol, rtol=0)
    torch.testing.assert_close(cache.key_hat, full_cache.key_hat, atol=0, rtol=0)
    torch.testing.assert_close(cache.keys, full_cache.keys, atol=0, rtol=0)


def test_chunked_decode_equals_full_forward():
    q, k, v = _qkv(1, 12, 12, 2, 2, 8, seed=5)
    m = LucidAttention(2, 2, 8, backend="reference")
    full, _ = m(q, k, v)
    out_a, cache = m(q[:, :4], k[:, :4], v[:, :4], cache=m.empty_cache(1, dtype=F64))
    out_b, cache = m(q[:, 4:9], k[:, 4:9], v[:, 4:9], cache=cache)
    out_c, cache = m(q[:, 9:], k[:, 9:], v[:, 9:], cache=cache)
    torch.testing.assert_close(torch.cat([out_a, out_b, out_c], 1), full, atol=1e-12, rtol=0)


def test_decode_divides_by_the_computed_diagonal():
    """With a large eps the diagonal is far from 1; dropping the division would show."""
    q, k, v = _qkv(1, 6, 6, 1, 1, 4, seed=7)
    k = k * 1e-2  # mean(k²) ≈ 1e-4, so eps = 1e-4 halves it
    m = LucidAttention(1, 1, 4, lucid_attention_eps=1e-4, backend="reference")
    full, _ = m(q, k, v)
    _, cache = m(q[:, :3], k[:, :3], v[:, :3], cache=m.empty_cache(1, dtype=F64))
    steps = []
    for t in range(3, 6):
        o, cache = m(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache=cache)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 3:], atol=1e-12, rtol=0)
    assert float(lucid_matrix(k, eps=1e-4).diagonal(dim1=-2, dim2=-1).min()) < 0.5


class _PlainKVCache:
    """Stands in for an ordinary attention cache (it holds v, not v′)."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values


def test_decode_refuses_a_cache_without_preconditioned_values():
    q, k, v = _qkv(1, 4, 4, 2, 1, 8)
    m = LucidAttention(2, 1, 8)
    with pytest.raises(TypeError, match="LucidCache"):
        m(q[:, 3:], k[:, 3:], v[:, 3:], cache=_PlainKVCache(k[:, :3], v[:, :3]))
    with pytest.raises(TypeError):
        m(q[:, 3:], k[:, 3:], v[:, 3:], cache=(k[:, :3], v[:, :3]))
    with pytest.raises(TypeError, match="LucidCache"):   # a KVCache of another core holds v, not v′
        m(q[:, 3:], k[:, 3:], v[:, 3:], cache=DERFAttention(2, 1, 8).empty_cache(1, dtype=F64))
    _, cache = m(q[:, :3], k[:, :3], v[:, :3], cache=m.empty_cache(1, dtype=F64))
    with pytest.raises(ConfigError, match="lucid_attention_eps"):
        LucidAttention(2, 1, 8, lucid_attention_eps=1e-3)(q[:, 3:], k[:, 3:], v[:, 3:], cache=cache)
    with pytest.raises(ShapeError):
        m(q[:, 3:].expand(2, -1, -1, -1), k[:, 3:].expand(2, -1, -1, -1), v[:, 3:].expand(2, -1, -1, -1),
          cache=cache)
    with pytest.raises(DTypeError):
        m(q[:, 3:].float(), k[:, 3:].float(), v[:, 3:].float(), cache=cache)


# ---------------------------------------------------------------- named errors


def test_constructor_errors():
    with pytest.raises(ConfigError, match="num_kv_heads"):
        LucidAttention(4, 3, 8)
    with pytest.raises(ConfigError, match="head_dim"):
        LucidAttention(4, 2, 0)
    for bad in (-1e-6, float("nan"), float("inf"), "1e-6"):
        with pytest.raises(ConfigError, match="lucid_attention_eps"):
            LucidAttention(4, 2, 8, lucid_attention_eps=bad)
    with pytest.raises(ConfigError, match="backend"):
        LucidAttention(4, 2, 8, backend="cuda")


def test_forward_errors_name_the_argument(monkeypatch):
    m = LucidAttention(4, 2, 8)
    q, k, v = _qkv(2, 5, 5, 4, 2, 8, dtype=torch.float32)
    with pytest.raises(ShapeError, match="`q`"):
        m(q[0], k, v)
    with pytest.raises(ShapeError, match="`q`"):
        m(torch.randn(2, 5, 3, 8), k, v)
    with pytest.raises(ShapeError, match="`k`"):
        m(q, k[:, :4], v)
    with pytest.raises(ShapeError, match="`v`"):
        m(q, k, v[..., :7])
    with pytest.raises(ShapeError, match="`attention_mask`"):
        m(q, k, v, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(DTypeError, match="attention_mask"):
        m(q, k, v, torch.ones(2, 5))
    monkeypatch.setenv("LAMINAE_DEBUG", "1")   # integer masks' values are read only in debug mode
    with pytest.raises(ConfigError, match="0 and 1"):
        m(q, k, v, torch.full((2, 5), 2))
    monkeypatch.delenv("LAMINAE_DEBUG")
    with pytest.raises(DTypeError):
        m(q, k.double(), v)
    with pytest.raises(DTypeError):
        m(q.to(torch.int32), k.to(torch.int32), v.to(torch.int32))
    with pytest.raises(DeviceError):
        m(q, k, v, torch.ones(2, 5, dtype=torch.bool, device="meta"))


def test_functional_shape_errors():
    from laminae.primitives.lucid_attention import check_lucid_inputs

    q, k, v = _qkv(1, 6, 5, 4, 2, 8)
    with pytest.raises(ShapeError, match="N >= S"):
        check_lucid_inputs(q, k, v, None, 1e-6)
    q, k, v = _qkv(1, 5, 5, 4, 3, 8)
    with pytest.raises(ShapeError, match="divide"):
        check_lucid_inputs(q, k, v, None, 1e-6)
    q, k, v = _qkv(1, 5, 5, 4, 2, 8)
    with pytest.raises(ConfigError):
        check_lucid_inputs(q, k, v, None, -1.0)


# ---------------------------------------------------------------- open point 1: unit diagonal


def test_unit_diagonal_alternative():
    q, k, v = _qkv(2, 8, 8, 2, 1, 4, seed=9)
    k = k * 1e-2
    keep = _ragged(2, 8)
    L = lucid_matrix(k, keep, eps=1e-4, unit_diagonal=True)
    torch.testing.assert_close(L.diagonal(dim1=-2, dim2=-1), torch.ones(2, 1, 8, dtype=F64))
    L_computed = lucid_matrix(k, keep, eps=1e-4)
    off = ~torch.eye(8, dtype=torch.bool)
    torch.testing.assert_close(L[..., off], L_computed[..., off])
    v_prime = lucid_precondition_reference(k, v, keep, 1e-4, unit_diagonal=True)
    torch.testing.assert_close(L @ v_prime.transpose(1, 2), v.transpose(1, 2))
    # decoding with the same choice reproduces the forward
    m = LucidAttention(2, 1, 4, lucid_attention_eps=1e-4, backend="reference", unit_diagonal=True)
    full, _ = m(q, k, v, keep)
    torch.testing.assert_close(full, lucid_attention_reference(q, k, v, keep, 1e-4, unit_diagonal=True))
    _, cache = m(q[:, :5], k[:, :5], v[:, :5], keep[:, :5], m.empty_cache(2, dtype=F64))
    steps = []
    for t in range(5, 8):
        o, cache = m(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], keep[:, t:t + 1], cache=cache)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 5:], atol=1e-12, rtol=0)
    with pytest.raises(ConfigError, match="unit_diagonal"):
        LucidAttention(2, 1, 4, lucid_attention_eps=1e-4)(q[:, 5:6], k[:, 5:6], v[:, 5:6], cache=cache)
    with pytest.raises(ConfigError, match="unit_diagonal"):
        LucidAttention(2, 1, 4, unit_diagonal=1)
    k.requires_grad_(True)
    v.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda k, v: lucid_precondition_reference(k, v, keep, 1e-4, unit_diagonal=True), (k, v))
