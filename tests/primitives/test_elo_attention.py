import math

import pytest
import torch
import torch.nn.functional as F

from laminae.primitives._errors import ConfigError, DeviceError, DTypeError, ShapeError
from laminae.primitives.elo_attention import (
    EloAttention,
    EloAttentionCache,
    elo_attention_reference,
    elo_log_k_init,
)

from .._decoding import prefill_then_decode


def _inputs(B=2, S=6, extra=3, H=4, HKV=2, D=8, dtype=torch.float64, seed=0, prior=True, mask=True):
    gen = torch.Generator().manual_seed(seed)
    N = S + extra
    inp = {
        "q": torch.randn(B, S, H, D, generator=gen, dtype=dtype),
        "k": torch.randn(B, N, HKV, D, generator=gen, dtype=dtype),
        "v": torch.randn(B, N, HKV, D, generator=gen, dtype=dtype),
        "elo_log_k": torch.randn(H, generator=gen, dtype=dtype),
        "elo_gain": torch.randn(H, generator=gen, dtype=dtype),
        "prior_rating": torch.randn(B, H, extra, generator=gen, dtype=dtype) if prior and extra else None,
        "attention_mask": None,
    }
    if mask:
        keep = torch.rand(B, N, generator=gen) > 0.3
        keep[:, 0] = True  # every query sees at least one key
        inp["attention_mask"] = keep
    return inp


def _seed_formula(q, k, v, elo_log_k, elo_gain, prior_rating, attention_mask):
    """The seed's `_elo_attention` math on head-first tensors: fill masked scores with
    the dtype's minimum, softmax, n clamped at 1, dR via keep, intra = cumsum − dR."""
    B, S, H, D = q.shape
    N, group = k.shape[1], H // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(group, dim=2).transpose(1, 2)
    scores = qh @ kh.transpose(-2, -1) * (1.0 / math.sqrt(D))
    is_masked = torch.triu(torch.ones(S, N, dtype=torch.bool), diagonal=N - S + 1)[None, None]
    if attention_mask is not None:
        is_masked = is_masked | ~attention_mask.bool()[:, None, None, :]
    keepf = (~is_masked).to(scores.dtype)
    K = F.softplus(elo_log_k).view(1, H, 1, 1)
    gain = torch.tanh(elo_gain).view(1, H, 1, 1)
    if prior_rating is not None:
        prior = torch.cat([prior_rating, prior_rating.new_zeros(B, H, N - prior_rating.shape[2])], dim=-1)
    else:
        prior = scores.new_zeros(B, H, N)
    masked = scores.masked_fill(is_masked, torch.finfo(scores.dtype).min)
    a_base = torch.softmax(masked, dim=-1)
    n_i = keepf.sum(-1, keepdim=True).clamp(min=1.0)
    dR = (K * (a_base - 1.0 / n_i)) * keepf
    intra = torch.cumsum(dR, dim=2) - dR
    a = torch.softmax(masked + gain * prior.unsqueeze(2) + gain * intra, dim=-1)
    y = (a @ vh).transpose(1, 2)
    return y, prior + dR.sum(2)


@pytest.mark.parametrize("extra,mask", [(0, False), (3, True), (5, False)])
def test_reference_equals_seed_formula(extra, mask):
    inp = _inputs(extra=extra, mask=mask)
    out, rating = elo_attention_reference(**inp)
    y, r = _seed_formula(**inp)
    torch.testing.assert_close(out, y, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(rating, r, atol=1e-12, rtol=1e-10)


def test_zero_gain_is_softmax_attention_and_rating_still_computed():
    inp = _inputs(dtype=torch.float32, mask=False)
    inp["elo_gain"] = torch.zeros(4)
    out, rating = elo_attention_reference(**inp)
    q, k, v = inp["q"], inp["k"], inp["v"]
    S, N = q.shape[1], k.shape[1]
    allowed = torch.arange(N)[None, :] <= torch.arange(S)[:, None] + (N - S)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=allowed, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, sdpa, atol=1e-6, rtol=1e-5)
    # rating = prior + K·Σ_i (softmax − 1/n) over visible keys, independent of the gain
    scores = torch.einsum("bshd,bnhd->bhsn", q, k.repeat_interleave(2, dim=2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    n = allowed.sum(-1, keepdim=True).float()
    K = F.softplus(inp["elo_log_k"]).view(1, -1, 1, 1)
    expected = F.pad(inp["prior_rating"], (0, S)) + (K * (p - 1 / n) * allowed).sum(2)
    torch.testing.assert_close(rating, expected, atol=1e-5, rtol=1e-5)
    assert rating.abs().max() > 0


def test_module_starts_as_softmax_attention_with_seed_parameters():
    m = EloAttention(4, 2, 8, elo_k_init=2.5)
    assert set(m.state_dict()) == {"elo_log_k", "elo_gain"}
    torch.testing.assert_close(F.softplus(m.elo_log_k), torch.full((4,), 2.5))
    assert float(m.elo_log_k[0].detach()) == pytest.approx(math.log(math.expm1(2.5)))
    assert torch.equal(m.elo_gain, torch.zeros(4))
    assert elo_log_k_init(1.0) == pytest.approx(math.log(math.e - 1))


def _decode_vs_full(backend, dtype=torch.float64, B=2, S=9, prefill=4, H=4, HKV=2, D=8):
    gen = torch.Generator().manual_seed(1)
    m = EloAttention(H, HKV, D, backend=backend).to(dtype)
    with torch.no_grad():
        m.elo_gain.copy_(torch.randn(H, generator=gen))
        m.elo_log_k.copy_(torch.randn(H, generator=gen))
    q = torch.randn(B, S, H, D, generator=gen, dtype=dtype)
    k = torch.randn(B, S, HKV, D, generator=gen, dtype=dtype)
    v = torch.randn(B, S, HKV, D, generator=gen, dtype=dtype)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, :2] = False  # left padding
    keep[0, 5] = False
    with torch.no_grad():
        empty = m.empty_cache(B, dtype=dtype)
        full, full_cache = m(q, k, v, attention_mask=keep, cache=empty)
        stepped, cache = prefill_then_decode(m, q, k, v, cache=empty, prefill=prefill, attention_mask=keep)
    return full, full_cache, stepped, cache


def test_prefill_then_one_token_steps_equal_full_forward():
    full, full_cache, stepped, cache = _decode_vs_full("reference")
    assert isinstance(cache, EloAttentionCache) and cache.length == full.shape[1]
    out_diff = float((full - stepped).abs().max())
    rating_diff = float((full_cache.rating - cache.rating).abs().max())
    assert out_diff < 1e-12, out_diff
    assert rating_diff < 1e-12, rating_diff
    assert torch.equal(cache.keep, full_cache.keep)


def test_causality_perturbing_token_t_leaves_earlier_outputs():
    inp = _inputs(extra=0, mask=True, prior=False)
    out, _ = elo_attention_reference(**inp)
    t = 3
    for name in ("q", "k", "v"):
        pert = dict(inp)
        pert[name] = inp[name].clone()
        pert[name][:, t] += 5.0
        out2, _ = elo_attention_reference(**pert)
        torch.testing.assert_close(out2[:, :t], out[:, :t], atol=0, rtol=0)
        assert not torch.allclose(out2[:, t:], out[:, t:])


def test_fully_masked_query_outputs_zero_and_adds_no_rating():
    inp = _inputs(B=1, S=5, extra=0, H=2, HKV=1, mask=False, prior=False)
    keep = torch.ones(1, 5, dtype=torch.bool)
    keep[0, :2] = False  # queries 0 and 1 see no key
    inp["attention_mask"] = keep
    out, rating = elo_attention_reference(**inp)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))
    assert torch.isfinite(out).all() and torch.isfinite(rating).all()
    # the rating of masked keys never moves
    assert torch.equal(rating[0, :, :2], torch.zeros(2, 2, dtype=rating.dtype))
    # and the visible queries match the same call without the padded rows' queries
    sub = dict(inp, q=inp["q"][:, 2:], k=inp["k"][:, 2:], v=inp["v"][:, 2:], attention_mask=None)
    out_sub, rating_sub = elo_attention_reference(**sub)
    torch.testing.assert_close(out[:, 2:], out_sub)
    torch.testing.assert_close(rating[:, :, 2:], rating_sub)


@pytest.mark.parametrize("extra,full_prior", [(2, False), (2, True)])
def test_gradcheck_float64(extra, full_prior):
    """GQA, ragged mask (one key dropped), cached keys with a prior of the cached
    keys only or of every key."""
    B, S, H, HKV, D = 1, 4, 2, 1, 2
    inp = _inputs(B=B, S=S, extra=extra, H=H, HKV=HKV, D=D, seed=3)
    keep = inp["attention_mask"]
    keep[0, 3] = False
    if full_prior:
        inp["prior_rating"] = torch.randn(B, H, S + extra, dtype=torch.float64)
    names = [n for n in ("q", "k", "v", "elo_log_k", "elo_gain", "prior_rating") if inp[n] is not None]
    leaves = {n: inp[n].clone().requires_grad_(True) for n in names}

    def fn(*args):
        kw = dict(inp, **dict(zip(names, args)))
        return elo_attention_reference(**kw)

    assert torch.autograd.gradcheck(fn, tuple(leaves[n] for n in names))


def test_upcast_false_keeps_dtype():
    inp = _inputs(dtype=torch.bfloat16, mask=True)
    out, rating = elo_attention_reference(**inp, upcast=False)
    assert out.dtype == torch.bfloat16 and rating.dtype == torch.float32
    out32, rating32 = elo_attention_reference(**inp)
    assert out32.dtype == torch.bfloat16
    assert float((out.float() - out32.float()).abs().max()) < 0.1


def test_named_errors():
    inp = _inputs(dtype=torch.float32)
    with pytest.raises(ShapeError, match="q"):
        elo_attention_reference(**dict(inp, q=inp["q"][0]))
    from laminae.primitives.elo_attention import check_elo_attention_inputs as check

    def call(**over):
        kw = dict(inp, **over)
        check(kw["q"], kw["k"], kw["v"], kw["elo_log_k"], kw["elo_gain"], kw["prior_rating"], kw["attention_mask"])

    with pytest.raises(ShapeError, match="N >= S"):
        call(k=inp["k"][:, :2], v=inp["v"][:, :2], prior_rating=None, attention_mask=None)
    with pytest.raises(ShapeError, match="num_kv_heads"):
        call(k=torch.randn(2, 9, 3, 8), v=torch.randn(2, 9, 3, 8))
    with pytest.raises(ShapeError, match="`v`"):
        call(v=inp["v"][..., :4])
    with pytest.raises(ShapeError, match="elo_gain"):
        call(elo_gain=torch.zeros(3))
    with pytest.raises(ShapeError, match="prior_rating"):
        call(prior_rating=torch.zeros(2, 4, 10))
    with pytest.raises(DTypeError):
        call(k=inp["k"].double())
    with pytest.raises(DTypeError, match="elo_log_k"):
        call(elo_log_k=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ShapeError, match="attention_mask"):
        call(attention_mask=torch.ones(2, 8, dtype=torch.bool))
    with pytest.raises(DTypeError, match="attention_mask"):
        call(attention_mask=torch.full((2, 9), 2.0))
    with pytest.raises(DeviceError):
        call(elo_gain=torch.zeros(4, device="meta"))
    with pytest.raises(ConfigError):
        EloAttention(4, 3, 8)
    with pytest.raises(ConfigError):
        EloAttention(4, 2, 8, elo_k_init=0.0)
    with pytest.raises(ConfigError):
        EloAttention(4, 2, 8, backend="cuda")
    m = EloAttention(4, 2, 8)
    with pytest.raises(ShapeError, match="q"):
        m(torch.randn(2, 3, 5, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8))
    with pytest.raises(ShapeError, match="k"):
        m(torch.randn(2, 3, 4, 8), torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8))
    with pytest.raises(ShapeError, match="attention_mask"):
        m(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8), attention_mask=torch.ones(2, 4))
    with pytest.raises(TypeError, match="cache"):
        m(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8), cache=(1, 2))
