import copy

import pytest
import torch
import torch.nn.functional as F

from laminae.primitives import ConfigError, DeviceError, DTypeError, ShapeError
from laminae.primitives.memory_caching import MemoryCacheBranch, MemoryCachingCache, memory_caching_reference

from .._decoding import prefill_then_decode


def seed_mc_forward(m: MemoryCacheBranch, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The seed's _mc_forward, step by step (same einsums, same index writes)."""
    B, S, _ = x.shape
    h, d, L = m.num_heads, m.head_dim, m.segment_len
    L = min(L, S)
    valid = x.new_ones(B, S) if valid is None else valid.to(x.dtype)
    pad = (L - S % L) % L
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
        valid = F.pad(valid, (0, pad))
    N = (S + pad) // L

    def heads(proj):
        return proj(x).view(B, N, L, h, d).permute(0, 3, 1, 2, 4)

    phi = lambda t: F.elu(t) + 1.0  # noqa: E731
    q = phi(heads(m.q_proj))
    k = phi(heads(m.k_proj))
    vm = valid.view(B, N, L)
    k = k * vm[:, None, :, :, None]
    v = heads(m.v_proj)
    A = torch.einsum("bhnld,bhnmd->bhnlm", q, k)
    A = A * torch.tril(torch.ones(L, L, dtype=A.dtype))
    num_intra = torch.einsum("bhnlm,bhnmd->bhnld", A, v)
    den_intra = A.sum(-1)
    M = torch.einsum("bhnmd,bhnme->bhnde", k, v)
    z = k.sum(3)
    num = torch.einsum("bhqld,bhide->bhqile", q, M)
    den = torch.einsum("bhqld,bhid->bhqil", q, z)
    idx = torch.arange(N)
    num = num.clone()
    den = den.clone()
    num[:, :, idx, idx] = num_intra
    den[:, :, idx, idx] = den_intra
    u = m.u_proj(x).view(B, N, L, m.gate_dim)
    pp = m.p_proj(x).view(B, N, L, m.gate_dim) * vm.unsqueeze(-1)
    pool_full = pp.sum(2) / vm.sum(2).clamp_min(1).unsqueeze(-1)
    score = torch.einsum("bqlg,big->bqil", u, pool_full)
    cpool = pp.cumsum(2) / vm.cumsum(2).clamp_min(1).unsqueeze(-1)
    score = score.clone()
    score[:, idx, idx] = torch.einsum("bqlg,bqlg->bql", u, cpool)
    seg_ok = idx[None, :] <= idx[:, None]
    score = score.masked_fill(~seg_ok[None, :, :, None], float("-inf"))
    gamma = torch.softmax(score, dim=2)
    g = gamma[:, None]
    y = (num * g.unsqueeze(-1)).sum(3) / ((den * g).sum(3).unsqueeze(-1) + m.eps)
    y = y.permute(0, 2, 3, 1, 4).reshape(B, S + pad, h * d)
    return m.o_proj(y)[:, :S]


def _branch(hidden=12, heads=2, head_dim=4, L=4, gate=6, dtype=torch.float32):
    torch.manual_seed(0)
    return MemoryCacheBranch(hidden, num_heads=heads, head_dim=head_dim, segment_len=L, gate_dim=gate,
                             backend="reference").to(dtype)


def _ragged(B, S, seed=1):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, S, generator=gen) > 0.3).long()   # 0/1 integers, as a tokenizer returns
    mask[0, :2] = 0  # left padding on row 0
    return mask


@pytest.mark.parametrize("S", [1, 3, 4, 10, 16])
@pytest.mark.parametrize("masked", [False, True])
def test_reference_equals_seed_math(S, masked):
    m = _branch()
    x = torch.randn(2, S, 12)
    mask = _ragged(2, S) if masked else None
    y, cache = m(x, mask)
    assert cache is None                      # cache=None: no decoding, no cache built
    kept = slice(None) if mask is None else mask.bool()   # the module zeroes padded tokens first
    torch.testing.assert_close(y[kept], seed_mc_forward(m, x, mask)[kept], atol=1e-5, rtol=1e-5)


def test_state_dict_of_seed_loads_strictly():
    m = _branch(hidden=20, heads=3, head_dim=5, gate=7)
    inner, H, G = 15, 20, 7
    seed_keys = {"q_proj.weight": (inner, H), "k_proj.weight": (inner, H), "v_proj.weight": (inner, H),
                 "o_proj.weight": (H, inner), "u_proj.weight": (G, H), "p_proj.weight": (G, H)}
    sd = {k: torch.randn(s) for k, s in seed_keys.items()}
    m.load_state_dict(sd, strict=True)
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == seed_keys
    for k, v in sd.items():
        assert torch.equal(m.state_dict()[k], v)


def test_causality():
    m = _branch()
    x = torch.randn(1, 13, 12)
    y, _ = m(x)
    for t in (0, 3, 4, 7, 12):
        x2 = x.clone()
        x2[:, t] += torch.randn(12)
        y2, _ = m(x2)
        torch.testing.assert_close(y2[:, :t], y[:, :t], atol=0, rtol=0)
        assert not torch.allclose(y2[:, t], y[:, t])


def test_padding_tokens_do_not_reach_valid_outputs():
    m = _branch()
    x = torch.randn(2, 11, 12)
    mask = _ragged(2, 11)
    y, _ = m(x, mask)
    x2 = x + (1 - mask)[..., None] * torch.randn(2, 11, 12)  # change only padded tokens
    y2, _ = m(x2, mask)
    keep = mask.bool()
    torch.testing.assert_close(y2[keep], y[keep])


def test_single_segment_without_earlier_memory_is_causal_linear_attention():
    q, k, v = torch.randn(3, 1, 5, 2, 4).unbind(0)
    u, p = torch.randn(2, 1, 5, 3).unbind(0)
    y = memory_caching_reference(q, k, v, u, p, segment_len=8)
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    a = torch.einsum("bthd,bshd->bhts", fq, fk).tril()
    want = torch.einsum("bhts,bshd->bthd", a, v) / (a.sum(-1).transpose(1, 2)[..., None] + 1e-6)
    torch.testing.assert_close(y, want)


@pytest.mark.parametrize("S, prefix", [(13, 5), (13, 8), (3, 1), (3, 3), (9, 2), (12, 12)])
@pytest.mark.parametrize("masked", [False, True])
def test_prefill_then_steps_equals_full_forward(S, prefix, masked):
    m = _branch()
    x = torch.randn(2, S, 12)
    mask = _ragged(2, S) if masked else None
    full, _ = m(x, mask)
    with torch.no_grad():
        dec, cache = prefill_then_decode(m, x, cache=m.empty_cache(2), prefill=prefix, attention_mask=mask)
    assert isinstance(cache, MemoryCachingCache) and cache.length == S
    L = m.segment_len
    assert cache.segment_memories.shape == (2, S // L, 2, 4, 4) and cache.open_length == S % L
    assert (dec - full).abs().max() < 1e-5


def test_multi_token_continuation_equals_full_forward():
    m = _branch()
    x = torch.randn(2, 15, 12)
    full, _ = m(x)
    with torch.no_grad():
        a, cache = m(x[:, :6], cache=m.empty_cache(2))
        b, cache = m(x[:, 6:15], cache=cache)
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-5, rtol=1e-5)


def test_two_call_sites_keep_separate_caches():
    """A looped stack: one module called twice per token with different activations,
    one cache per call site."""
    m = _branch()
    x1, x2 = torch.randn(2, 10, 12), torch.randn(2, 10, 12)
    full1, _ = m(x1)
    full2, _ = m(x2)
    with torch.no_grad():
        caches = {}
        o1, caches[0, 0] = m(x1[:, :3], cache=m.empty_cache(2))
        o2, caches[0, 1] = m(x2[:, :3], cache=m.empty_cache(2))
        outs1, outs2 = [o1], [o2]
        for t in range(3, 10):
            o1, caches[0, 0] = m(x1[:, t:t + 1], cache=caches[0, 0])
            o2, caches[0, 1] = m(x2[:, t:t + 1], cache=caches[0, 1])
            outs1.append(o1)
            outs2.append(o2)
    torch.testing.assert_close(torch.cat(outs1, 1), full1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(outs2, 1), full2, atol=1e-5, rtol=1e-5)
    caches[0, 0].reset()
    assert caches[0, 0].length == 0


def test_bf16_module_runs_in_fp32_and_returns_bf16():
    m = _branch()
    x = torch.randn(2, 9, 12)
    m16 = _branch(dtype=torch.bfloat16)
    y16, _ = m16(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    want = seed_mc_forward(copy.deepcopy(m16).float(), x.bfloat16().float(), None)
    torch.testing.assert_close(y16.float(), want, atol=2e-2, rtol=2e-2)
    with pytest.raises(DTypeError, match="parameters"):     # the cast policy: outside autocast, the weights' dtype
        m(x.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(x.bfloat16())[0].dtype == torch.bfloat16
    cache = m16.empty_cache(2, dtype=torch.bfloat16)
    assert cache.dtype == torch.float32                     # the state is fp32 whatever the activations


@pytest.mark.parametrize("masked", [False, True])
def test_gradcheck_reference_float64(masked):
    gen = torch.Generator().manual_seed(0)
    B, S, H, D, G, L = 2, 7, 2, 2, 3, 3
    q, k, v = (torch.randn(3, B, S, H, D, generator=gen, dtype=torch.float64)).unbind(0)
    u, p = (torch.randn(2, B, S, G, generator=gen, dtype=torch.float64)).unbind(0)
    mask = _ragged(B, S) if masked else None
    args = [t.requires_grad_() for t in (q, k, v, u, p)]
    assert torch.autograd.gradcheck(lambda *a: memory_caching_reference(*a, L, mask), args, fast_mode=True)


def test_errors():
    m = _branch()
    with pytest.raises(ShapeError):
        m(torch.randn(2, 5, 11))
    with pytest.raises(ShapeError):
        m(torch.randn(2, 0, 12))
    with pytest.raises(ShapeError):
        m(torch.randn(2, 5, 12), torch.ones(2, 4))
    with pytest.raises(DTypeError):
        m(torch.randn(2, 5, 12), torch.full((2, 5), 0.5))
    with pytest.raises(DTypeError):
        m(torch.randn(2, 5, 12).to(torch.int32))
    with pytest.raises(ConfigError):
        MemoryCacheBranch(12, segment_len=0)
    with pytest.raises(ConfigError):
        MemoryCacheBranch(12, backend="cuda")
    with pytest.raises(ConfigError):
        MemoryCacheBranch(12, eps=0.0)
    with pytest.raises(TypeError):
        m(torch.randn(2, 5, 12), cache={})
    with torch.no_grad():
        _, cache = m(torch.randn(2, 5, 12), cache=m.empty_cache(2))
        with pytest.raises(ShapeError):
            m(torch.randn(3, 1, 12), cache=cache)
        with pytest.raises(ConfigError, match="segment_len"):
            MemoryCacheBranch(12, num_heads=2, head_dim=4, segment_len=5, gate_dim=3)(torch.randn(2, 1, 12),
                                                                                       cache=cache)
    q = torch.randn(1, 4, 2, 3)
    u = torch.randn(1, 4, 5)
    with pytest.raises(ShapeError):
        memory_caching_reference(q, q, q[:, :3], u, u, 2)
    with pytest.raises(ShapeError):
        memory_caching_reference(q, q, q, u, u[..., :4], 2)
    with pytest.raises(DTypeError):
        memory_caching_reference(q, q, q.double(), u, u, 2)
    with pytest.raises(ConfigError):
        memory_caching_reference(q, q, q, u, u, 0)
    if torch.cuda.is_available():
        with pytest.raises(DeviceError):
            memory_caching_reference(q, q, q.cuda(), u, u, 2)
    with pytest.raises(DeviceError):
        memory_caching_reference(q, q, q.to("meta"), u, u, 2)
