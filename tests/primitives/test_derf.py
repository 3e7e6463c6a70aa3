import math

import pytest
import torch
from torch import nn

from laminae.primitives import ConfigError, DeviceError, DTypeError, ShapeError
from laminae.primitives.derf import (
    DERFAttention,
    DERFCache,
    DERFContextGate,
    derf_attention_reference,
    derf_context_gate_reference,
)

from .._decoding import prefill_then_decode

F64 = torch.float64


def _attn_inputs(B=2, S=5, N=5, H=4, Hkv=2, D=6, *, dtype=F64, mask=True, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    inp = {
        "q": (torch.randn(B, S, H, D, generator=gen) * scale).to(dtype),
        "k": (torch.randn(B, N, Hkv, D, generator=gen) * scale).to(dtype),
        "v": torch.randn(B, N, Hkv, D, generator=gen).to(dtype),
        "derf_alpha": (1.0 + 0.5 * torch.randn(H, generator=gen)).to(dtype),
        "derf_bias": (0.5 * torch.randn(H, generator=gen)).to(dtype),
        "derf_gamma": (1.0 + 0.3 * torch.randn(H, generator=gen)).to(dtype),
    }
    if mask:
        keep = torch.rand(B, N, generator=gen) > 0.3
        keep[0, 0] = False  # query 0 of row 0 (when S == N) sees nothing
        inp["attention_mask"] = keep
    return inp


def _seed_formula(q, k, v, alpha, bias, gamma, attention_mask=None):
    """The seed's DERF branch, transcribed: heads-first layout, a materialised
    [S, N] causal mask (triu above the diagonal N - S), a 2-D keep mask, the
    -10000 fill, masked_fill of the weights and the 1e-8 in the denominator."""
    B, S, H, D = q.shape
    N, Hkv = k.shape[1], k.shape[2]
    groups = H // Hkv
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if groups > 1:
        k = k.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(B, H, N, D)
        v = v.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(B, H, N, D)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D)
    is_masked = torch.triu(torch.ones(S, N, dtype=torch.bool), diagonal=N - S + 1)[None, None]
    if attention_mask is not None:
        is_masked = is_masked | ~attention_mask.bool()[:, None, None, :]
    safe_scores = scores.masked_fill(is_masked, -10000.0)
    a, b, g = alpha.view(1, -1, 1, 1), bias.view(1, -1, 1, 1), gamma.view(1, -1, 1, 1)
    w = g * torch.erf(a * safe_scores + b)
    w = (w + g) / 2.0
    w = w.masked_fill(is_masked, 0.0)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-8)
    return torch.matmul(w, v).transpose(1, 2)


class _SeedContextGate(nn.Module):
    """The seed's DERFContextGate, transcribed (checkpoint-compatibility oracle)."""

    def __init__(self, obs_size, init_bias=-4.0):
        super().__init__()
        self.proj = nn.Linear(obs_size * 2, obs_size)
        self.alpha = nn.Parameter(torch.ones(obs_size))
        self.bias = nn.Parameter(torch.full((obs_size,), init_bias))
        self.gamma = nn.Parameter(torch.ones(obs_size))

    def forward(self, retrieved, x):
        logits = self.proj(torch.cat([retrieved, x], dim=-1))
        gate = self.gamma * ((torch.erf(self.alpha * logits + self.bias) + 1.0) / 2.0)
        return retrieved * gate


# ----------------------------------------------------------------------------
# Reference correctness
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("B,S,N,H,Hkv,mask", [(2, 4, 4, 4, 2, True), (1, 2, 5, 2, 1, True), (2, 3, 3, 3, 3, False)])
def test_attention_reference_gradcheck_float64(B, S, N, H, Hkv, mask):
    inp = _attn_inputs(B, S, N, H, Hkv, 3, mask=mask, seed=1)
    mask = inp.pop("attention_mask", None)
    leaves = {k: v.requires_grad_(True) for k, v in inp.items()}

    def fn(q, k, v, a, b, g):
        return derf_attention_reference(q, k, v, a, b, g, mask, upcast=False)

    assert torch.autograd.gradcheck(fn, tuple(leaves.values()))


def test_context_gate_reference_gradcheck_float64():
    gen = torch.Generator().manual_seed(2)
    args = [torch.randn(3, 2, 5, generator=gen, dtype=F64), 2 * torch.randn(3, 2, 5, generator=gen, dtype=F64),
            torch.randn(5, generator=gen, dtype=F64), torch.randn(5, generator=gen, dtype=F64) - 1,
            torch.randn(5, generator=gen, dtype=F64)]
    args = [a.requires_grad_(True) for a in args]
    assert torch.autograd.gradcheck(lambda *a: derf_context_gate_reference(*a, upcast=False), tuple(args))


@pytest.mark.parametrize("S,N,mask", [(6, 6, False), (6, 6, True), (3, 7, False), (1, 7, True)])
def test_attention_reference_equals_seed_formula(S, N, mask):
    inp = _attn_inputs(2, S, N, 4, 2, 8, mask=mask, seed=3)
    leaves = {k: (v.requires_grad_(True) if v.is_floating_point() else v) for k, v in inp.items()}
    ours = derf_attention_reference(**leaves, upcast=False)
    seed = _seed_formula(*leaves.values())
    torch.testing.assert_close(ours, seed, atol=1e-12, rtol=1e-10)
    params = [v for v in leaves.values() if v.requires_grad]
    g = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, params, g), torch.autograd.grad(seed, params, g)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_attention_reference_fp32_is_accurate_in_the_erf_tail():
    # All of a row's weights in the far negative erf tail: the seed's erf(z) + 1
    # rounds there in fp32, the reference stays within fp32 rounding of fp64.
    inp = _attn_inputs(1, 4, 4, 2, 2, 8, mask=False, seed=4)
    inp["derf_bias"] = torch.full((2,), -4.0, dtype=F64)
    inp["derf_alpha"] = torch.full((2,), 0.05, dtype=F64)
    truth = derf_attention_reference(**inp, upcast=False)
    fp32 = derf_attention_reference(**{k: v.float() for k, v in inp.items()})
    torch.testing.assert_close(fp32.double(), truth, atol=1e-5, rtol=1e-4)


def test_context_gate_reference_equals_seed_formula():
    gen = torch.Generator().manual_seed(5)
    r, lg = torch.randn(4, 7, generator=gen, dtype=F64), torch.randn(4, 7, generator=gen, dtype=F64)
    a, b = torch.randn(7, generator=gen, dtype=F64), torch.randn(7, generator=gen, dtype=F64)
    g = torch.rand(7, generator=gen, dtype=F64)
    seed = r * (g * ((torch.erf(a * lg + b) + 1.0) / 2.0))
    torch.testing.assert_close(derf_context_gate_reference(r, lg, a, b, g, upcast=False), seed)


# ----------------------------------------------------------------------------
# Invariants
# ----------------------------------------------------------------------------


def test_causality_perturbing_token_t_leaves_earlier_outputs_unchanged():
    inp = _attn_inputs(2, 9, 9, 4, 2, 6, mask=False, seed=6)
    base = derf_attention_reference(**inp)
    for t in (0, 4, 8):
        moved = dict(inp)
        for name in ("q", "k", "v"):
            x = moved[name].clone()
            x[:, t] += 3.0
            moved[name] = x
        out = derf_attention_reference(**moved)
        assert torch.equal(out[:, :t], base[:, :t])
        assert not torch.equal(out[:, t:], base[:, t:])


def test_fully_masked_row_outputs_zero():
    inp = _attn_inputs(2, 5, 5, 4, 2, 6, mask=True, seed=7)
    inp["attention_mask"][1] = False
    out = derf_attention_reference(**inp)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))  # key 0 masked, query 0 sees only key 0
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_grouped_query_equals_repeated_kv_heads():
    inp = _attn_inputs(2, 6, 8, 6, 2, 5, mask=True, seed=8)
    full = dict(inp, k=inp["k"].repeat_interleave(3, dim=2), v=inp["v"].repeat_interleave(3, dim=2))
    torch.testing.assert_close(derf_attention_reference(**inp), derf_attention_reference(**full))


def test_queries_after_a_prefix_equal_the_tail_of_the_full_forward():
    inp = _attn_inputs(2, 7, 7, 4, 2, 6, mask=True, seed=9)
    full = derf_attention_reference(**inp)
    tail = derf_attention_reference(**dict(inp, q=inp["q"][:, 4:]))
    torch.testing.assert_close(tail, full[:, 4:])


def test_zero_slope_gives_the_causal_mean_of_visible_values():
    inp = _attn_inputs(1, 6, 6, 2, 2, 4, mask=False, seed=10)
    inp["derf_alpha"] = torch.zeros(2, dtype=F64)
    out = derf_attention_reference(**inp)
    mean = torch.cumsum(inp["v"], dim=1) / torch.arange(1, 7, dtype=F64).view(1, 6, 1, 1)
    torch.testing.assert_close(out, mean, atol=1e-7, rtol=1e-7)  # up to the 1e-8 in the denominator


def test_context_gate_init_is_nearly_closed():
    gate = DERFContextGate(8, backend="reference")
    with torch.no_grad():
        gate.proj.weight.zero_()
        gate.proj.bias.zero_()
    r = torch.randn(3, 8)
    expected = r * (torch.special.erfc(torch.tensor(4.0)) / 2)
    torch.testing.assert_close(gate(torch.randn(3, 8), retrieved=r), expected)


# ----------------------------------------------------------------------------
# Modules, state dicts and decoding
# ----------------------------------------------------------------------------


def test_attention_module_parameters_follow_seed():
    m = DERFAttention(8, 2, 16)
    assert set(m.state_dict()) == {"derf_alpha", "derf_bias", "derf_gamma"}
    assert torch.equal(m.derf_alpha, torch.ones(8))
    assert torch.equal(m.derf_bias, torch.zeros(8))
    assert torch.equal(m.derf_gamma, torch.ones(8))


def test_context_gate_state_dict_matches_seed_and_loads_strictly():
    ours = DERFContextGate(12, init_bias=-3.0, backend="reference").double()
    assert set(ours.state_dict()) == {"proj.weight", "proj.bias", "alpha", "bias", "gamma"}
    assert torch.equal(ours.bias, torch.full((12,), -3.0, dtype=F64))
    seed = _SeedContextGate(12).double()
    with torch.no_grad():
        for p in seed.parameters():
            p.normal_()
    ours.load_state_dict(seed.state_dict(), strict=True)
    r, x = torch.randn(2, 5, 12, dtype=F64), torch.randn(2, 5, 12, dtype=F64)
    torch.testing.assert_close(ours(x, retrieved=r), seed(r, x))
    seed.load_state_dict(ours.state_dict(), strict=True)


@pytest.mark.parametrize("with_mask", [False, True])
def test_prefill_then_steps_equals_full_forward(with_mask):
    torch.manual_seed(0)
    B, T, H, Hkv, D = 2, 11, 4, 2, 8
    m = DERFAttention(H, Hkv, D, backend="reference")
    with torch.no_grad():
        m.derf_alpha.uniform_(-2, 2)
        m.derf_bias.normal_()
        m.derf_gamma.uniform_(0.5, 1.5)
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D)
    mask = None
    if with_mask:
        mask = torch.rand(B, T) > 0.3
        mask[1, :3] = False  # left padding
    full, cache = m(q, k, v, mask)
    assert cache is None                                          # no cache given: no decoding
    with torch.no_grad():
        steps, cache = prefill_then_decode(m, q, k, v, cache=m.empty_cache(B), chunks=[5, 3] + [1] * 3,
                                           attention_mask=mask)
    assert cache.length == T
    torch.testing.assert_close(steps, full, atol=1e-6, rtol=1e-5)


def test_cache_reset_and_properties():
    m = DERFAttention(2, 1, 4, backend="reference")
    cache = m.empty_cache(2)
    assert (cache.length, cache.batch, cache.dtype, cache.keys.shape) == (0, 2, torch.float32, (2, 0, 1, 4))
    _, grown = m(torch.randn(2, 3, 2, 4), torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4),
                 torch.tensor([[0, 1, 1], [1, 1, 1]]), cache=cache)
    assert (cache.length, cache.has_mask) == (0, False)          # the cache passed in is unchanged
    assert (grown.batch, grown.length, grown.has_mask) == (2, 3, True)
    assert grown.buffers._storage is cache.buffers._storage       # the prefill wrote into the empty storage
    grown.reset()
    assert grown.length == 0 and not grown.has_mask and grown.keep is None


def test_empty_cache_follows_the_parameters_unless_told():
    m = DERFAttention(2, 1, 4, backend="reference").double()
    assert m.empty_cache(1).dtype == F64 and m.empty_cache(1, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert m.empty_cache(1, device="meta").device.type == "meta"


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, err",
    [
        (dict(num_heads=4, num_kv_heads=3, head_dim=8), ConfigError),
        (dict(num_heads=0, num_kv_heads=1, head_dim=8), ConfigError),
        (dict(num_heads=4, num_kv_heads=2, head_dim=-1), ConfigError),
        (dict(num_heads=4, num_kv_heads=2, head_dim=8, backend="cuda"), ConfigError),
    ],
)
def test_attention_bad_config_raises(kwargs, err):
    with pytest.raises(err):
        DERFAttention(**kwargs)


def _good(B=2, S=4, N=6, H=4, Hkv=2, D=8):
    return torch.randn(B, S, H, D), torch.randn(B, N, Hkv, D), torch.randn(B, N, Hkv, D)


@pytest.mark.parametrize(
    "case, err, match",
    [
        ("q_rank", ShapeError, "`q`"),
        ("q_heads", ShapeError, "`q`"),
        ("q_head_dim", ShapeError, "`q`"),
        ("k_heads", ShapeError, "`k`"),
        ("k_batch", ShapeError, "`k`"),
        ("v_shape", ShapeError, "`v`"),
        ("s_gt_n", ShapeError, "N >= S"),
        ("empty", ShapeError, "at least one"),
        ("dtype_mix", DTypeError, "one dtype"),
        ("int_q", DTypeError, "`q`"),
        ("mask_shape", ShapeError, "attention_mask"),
        ("mask_float", DTypeError, r"mask\.bool\(\)"),
        ("mask_dtype", DTypeError, "attention_mask"),
        ("not_tensor", TypeError, "`q`"),
        ("device", DeviceError, "one device"),
    ],
)
def test_attention_bad_inputs_raise(case, err, match):
    m = DERFAttention(4, 2, 8, backend="reference")
    q, k, v = _good()
    mask = None
    if case == "q_rank":
        q = q[0]
    elif case == "q_heads":
        q = torch.randn(2, 4, 3, 8)
    elif case == "q_head_dim":
        q = torch.randn(2, 4, 4, 7)
    elif case == "k_heads":
        k = torch.randn(2, 6, 4, 8)
    elif case == "k_batch":
        k, v = torch.randn(3, 6, 2, 8), torch.randn(3, 6, 2, 8)
    elif case == "v_shape":
        v = torch.randn(2, 5, 2, 8)
    elif case == "s_gt_n":
        k, v = k[:, :3], v[:, :3]
    elif case == "empty":
        q = q[:, :0]
    elif case == "dtype_mix":
        v = v.double()
    elif case == "int_q":
        q = torch.ones(2, 4, 4, 8, dtype=torch.int32)
    elif case == "mask_shape":
        mask = torch.ones(2, 4)
    elif case == "mask_float":
        mask = torch.ones(2, 6)
    elif case == "mask_dtype":
        mask = torch.ones(2, 6, dtype=torch.complex64)
    elif case == "not_tensor":
        q = q.tolist()
    elif case == "device":
        mask = torch.ones(2, 6, device="meta")
    with pytest.raises(err, match=match):
        m(q, k, v, mask)


@pytest.mark.parametrize(
    "case, err, match",
    [
        ("batch", ShapeError, "batch size"),
        ("heads", ConfigError, "num_kv_heads"),
        ("dtype", DTypeError, "cache"),
        ("kv_len", ShapeError, "N >= S"),
        ("mask_len", ShapeError, "attention_mask"),
        ("not_cache", TypeError, "DERFCache"),
    ],
)
def test_cache_misuse_raises(case, err, match):
    m = DERFAttention(4, 2, 8, backend="reference")
    q, k, v = _good(S=3, N=3)
    mask = None
    cache = m.empty_cache(2)
    if case == "batch":
        cache = m.empty_cache(1)
    elif case == "heads":
        cache = DERFAttention(4, 1, 8).empty_cache(2)
    elif case == "dtype":
        cache = m.empty_cache(2, dtype=torch.float16)
    elif case == "kv_len":
        k, v = torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8)
    elif case == "mask_len":
        mask = torch.ones(2, 8)
    elif case == "not_cache":
        cache = (k, v)
    with pytest.raises(err, match=match):
        m(q, k, v, mask, cache=cache)


def test_empty_cache_rejects_bad_arguments():
    m = DERFAttention(4, 2, 8)
    with pytest.raises(ConfigError):
        m.empty_cache(0)
    with pytest.raises(DTypeError):
        m.empty_cache(1, dtype=torch.int32)


def test_context_gate_bad_inputs_raise():
    with pytest.raises(ConfigError):
        DERFContextGate(0)
    with pytest.raises(ConfigError):
        DERFContextGate(4, init_bias=float("nan"))
    gate = DERFContextGate(4, backend="reference")
    with pytest.raises(ShapeError, match="obs_size=4"):
        gate(torch.randn(2, 5), retrieved=torch.randn(2, 5))
    with pytest.raises(ShapeError, match="`x`"):
        gate(torch.randn(3, 4), retrieved=torch.randn(2, 4))
    with pytest.raises(DTypeError):
        gate(torch.randn(2, 4, dtype=F64), retrieved=torch.randn(2, 4))
    with pytest.raises(DTypeError, match="parameters"):
        gate(torch.randn(2, 4, dtype=F64), retrieved=torch.randn(2, 4, dtype=F64))
    with pytest.raises(DeviceError):
        gate(torch.randn(2, 4, device="meta"), retrieved=torch.randn(2, 4, device="meta"))
