import math

import pytest
import torch
from hypothesis import given, strategies as st

from laminae.primitives import (AffineScaledAttention, ConfigError, DERFAttention, DTypeError, EloAttention,
                                LucidAttention, ShapeError)
from laminae.primitives.blocks.gqa import GroupedQueryAttention, depth_mix_values, sdpa_core
from laminae.primitives.blocks.rotary import RotaryEmbedding

from ..._decoding import prefill_then_decode


def explicit_attention(q, k, v, keep=None):
    B, S, H, D = q.shape
    N, g = k.shape[1], H // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bshd,bnhd->bhsn", q, k) / math.sqrt(D)
    vis = torch.ones(S, N, dtype=torch.bool).tril(N - S)[None, None]
    if keep is not None:
        vis = vis & keep[:, None, None, :]
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhsn,bnhd->bshd", p, v)


@given(s=st.integers(1, 7), extra=st.integers(0, 3), kv=st.sampled_from([1, 2, 4]), pad=st.booleans())
def test_sdpa_core_is_causal_softmax_attention(s, extra, kv, pad):
    q, k, v = torch.randn(2, s, 4, 8), torch.randn(2, s + extra, kv, 8), torch.randn(2, s + extra, kv, 8)
    keep = (torch.rand(2, s + extra) > 0.3) if pad else None
    torch.testing.assert_close(sdpa_core(q, k, v, keep), explicit_attention(q, k, v, keep), atol=1e-5, rtol=1e-5)


def make(core="sdpa", **kw):
    torch.manual_seed(0)
    if core == "derf":
        core = DERFAttention(4, 2, 8, backend="reference")
    elif core == "affine":
        core = AffineScaledAttention(16, 4, 2, 8, backend="reference")
    elif core == "lucid":
        core = LucidAttention(4, 2, 8, backend="reference")
    elif core == "elo":
        core = EloAttention(4, 2, 8, backend="reference")
        with torch.no_grad():
            core.elo_gain.fill_(0.7)
    return GroupedQueryAttention(16, 4, 2, 8, core=core, rope=RotaryEmbedding(4), **kw).eval()


@pytest.mark.parametrize("core", ["sdpa", "derf", "elo", "affine", "lucid"])
@pytest.mark.parametrize("options", [{}, {"q_lora_rank": 6, "o_lora_rank": 5, "qk_norm": True, "xsa": True}])
def test_prefill_then_steps_equals_full_forward(core, options):
    attn = make(core, **options)
    x = torch.randn(2, 9, 16)
    pos = torch.arange(9)[None]
    with torch.no_grad():
        full = attn(x, position_ids=pos)
        assert full.cache is None                                 # no cache given: no decoding
        decoded, _ = prefill_then_decode(attn, x, cache=attn.empty_cache(2), prefill=4, sliced={"position_ids": pos})
    torch.testing.assert_close(decoded, full.output, atol=1e-5, rtol=1e-5)


def test_cache_is_not_mutated_and_forks_are_independent():
    attn = make()
    x = torch.randn(1, 6, 16)
    pos = torch.arange(6)[None]
    with torch.no_grad():
        _, root, _ = attn(x[:, :4], cache=attn.empty_cache(1), position_ids=pos[:, :4])
        a, cache_a, _ = attn(x[:, 4:5], cache=root, position_ids=pos[:, 4:5])
        b, cache_b, _ = attn(x[:, 5:6], cache=root, position_ids=pos[:, 4:5])   # another token at that position
        a2, _, _ = attn(x[:, 4:5], cache=root, position_ids=pos[:, 4:5])
    assert root.length == 4 and cache_a.length == cache_b.length == 5
    torch.testing.assert_close(a2, a, atol=0, rtol=0)
    torch.testing.assert_close(cache_a.keys[:, :4], root.keys)
    assert not torch.equal(cache_a.keys[:, 4], cache_b.keys[:, 4])


def test_appends_reuse_the_buffer_and_grow_by_doubling():
    attn = make()
    cache, buffers = attn.empty_cache(1), set()
    with torch.no_grad():
        for t in range(40):
            _, cache, _ = attn(torch.randn(1, 1, 16), cache=cache, position_ids=torch.tensor([[t]]))
            buffers.add(cache.keys.data_ptr())
    assert cache.length == 40 and cache.buffers.capacity == 64
    assert len(buffers) == 3          # capacities 16 (the empty cache's), 32, 64


def test_padding_contents_never_reach_kept_positions():
    attn = make(xsa=True, qk_norm=True)
    x = torch.randn(2, 6, 16)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, :2] = False                 # left padding
    poisoned = x.clone()
    poisoned[0, :2] = float("nan")
    a = attn(x, keep, position_ids=torch.arange(6)[None]).output
    b = attn(poisoned, keep, position_ids=torch.arange(6)[None]).output
    torch.testing.assert_close(b[keep], a[keep])


def test_depth_mix_is_identity_at_zero_gate_and_mixes_otherwise():
    q, k, v = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)
    sources = [(torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8))]
    torch.testing.assert_close(depth_mix_values(q, k, v, sources, torch.zeros(1)), v)
    assert not torch.allclose(depth_mix_values(q, k, v, sources, torch.ones(1)), v)
    torch.testing.assert_close(depth_mix_values(q, k, v, [], torch.ones(1)), v)


def test_named_errors():
    attn = make()
    x, pos = torch.randn(1, 3, 16), torch.arange(3)[None]
    with pytest.raises(DTypeError, match="attention_mask=\\(mask == 0\\)"):
        attn(x, torch.tensor([[0.0, float("-inf"), 0.0]]), position_ids=pos)   # additive masks are rejected
    with pytest.raises(DTypeError, match="dtype"):
        attn(x.double(), position_ids=pos)
    with pytest.raises(ShapeError):
        attn(torch.randn(1, 3, 15), position_ids=pos)
    with pytest.raises(ShapeError, match="position_ids"):
        attn(x, position_ids=pos[:, :2])
    with pytest.raises(TypeError, match="positional"):
        attn(x, None, None, pos)                                   # side inputs are keyword-only
    with pytest.raises(ConfigError, match="divide"):
        GroupedQueryAttention(16, 4, 3, 8)
    with pytest.raises(TypeError, match="KVCache"):
        attn(x, cache=make("derf").empty_cache(1), position_ids=pos)
    with pytest.raises(ConfigError, match="configuration"):
        GroupedQueryAttention(16, 4, 4, 4)(x, cache=attn.empty_cache(1), position_ids=pos)
    with pytest.raises(DTypeError, match="cache"):
        attn(x, cache=attn.empty_cache(1, dtype=torch.float64), position_ids=pos)


def test_runs_under_autocast():
    attn = make(qk_norm=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attn(torch.randn(1, 5, 16), position_ids=torch.arange(5)[None]).output
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("core", ["sdpa", "derf"])
def test_empty_cache_made_under_autocast_holds_the_keys_autocast_makes(core):
    attn = make(core, qk_norm=True)
    x, pos = torch.randn(1, 5, 16), torch.arange(5)[None]
    assert attn.empty_cache(1).dtype == torch.float32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = attn.empty_cache(1)
        _, cache, _ = attn(x[:, :4], cache=cache, position_ids=pos[:, :4])
        _, cache, _ = attn(x[:, 4:], cache=cache, position_ids=pos[:, 4:])
    assert cache.dtype == torch.bfloat16 and cache.length == 5
