import math

import pytest
import torch
from hypothesis import given, strategies as st

from laminae.primitives import ConfigError, DeviceError, DTypeError, ShapeError
from laminae.primitives.blocks.rotary import rotary_embedding, yarn_rope
from laminae.primitives.mosrah import (MoSRAH, bea_packed_reference, load_balance_loss, mosrah_reference,
                                       mosrah_route, pack_experts, pack_rows, unpack_experts)

from . import _shram_tiny
from .._decoding import prefill_then_decode
from .._fixtures import load_fixture
from .._helpers import host_reads


def _module(d=24, L=5, K=2, u=16, **kw):
    torch.manual_seed(1)
    m = MoSRAH(d, L, K, u, training_sequence_length=64, **kw)
    with torch.no_grad():   # a non-zero bias, so selection and weighting differ
        m.router.expert_bias.normal_(0, 0.3)
        m.router.routing_projection.weight.normal_(0, 0.5)
    return m


def _ref(m, x, pos=None, mask=None, upcast=True, **over):
    B, N, _ = x.shape
    pos = torch.arange(N).expand(B, N) if pos is None else pos
    kw = dict(top_k=m.top_k, inv_freq=m.bea.inv_freq, attention_scale=m.bea.attention_scale, rope_mode=m.rope_mode)
    kw.update(over)
    return mosrah_reference(x, *m._params(), pos, mask, upcast=upcast, **kw)


# ----------------------------------------------------------------------------
# Seed parity (fixtures from the public SHRAM implementation)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["shram_tiny", "shram_tiny_yarn"])
def test_matches_public_implementation_fixture(name):
    cfg, w, inputs, expected = load_fixture(name)
    layers = _shram_tiny.build_layers(cfg, w)
    logits, loss, lb, vio = _shram_tiny.forward(cfg, w, layers, inputs["input_ids"], inputs["labels"])
    torch.testing.assert_close(logits, expected["logits"], atol=1e-4, rtol=0)
    torch.testing.assert_close(loss.reshape(1), expected["loss"], atol=1e-4, rtol=0)
    torch.testing.assert_close(lb.reshape(1), expected["load_balance_loss"], atol=1e-6, rtol=0)
    torch.testing.assert_close(vio.reshape(1), expected["max_vio"], atol=1e-6, rtol=0)
    loss.backward()
    for i, layer in enumerate(layers):
        for pname, p in layer.named_parameters():
            want = expected[f"grad.model.layers.{i}.{_shram_tiny.SPARSE}{pname}"]
            torch.testing.assert_close(p.grad, want, atol=1e-4, rtol=1e-3, msg=pname)


def test_state_dict_names_and_shapes():
    m = MoSRAH(64, 4, 2, 16)
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes == {"router.routing_projection.weight": (4, 64), "router.expert_bias": (4,),
                      "bea.q_proj": (4, 64, 16), "bea.k_proj": (4, 64, 16), "bea.v_proj": (4, 64, 16),
                      "bea.o_proj": (4, 16, 64)}


def test_initialisation():
    m = MoSRAH(64, 8, 2, 16)
    assert m.router.expert_bias.abs().max() == 0
    assert m.bea.q_proj.abs().max() <= math.sqrt(6 / (64 + 16))
    bank = MoSRAH(64, 8, 2, 16, init="whole_bank")
    assert bank.bea.q_proj.abs().max() <= math.sqrt(6 / (16 * (64 + 8)))
    assert bank.bea.o_proj.abs().max() <= math.sqrt(6 / (64 * (16 + 8)))


# ----------------------------------------------------------------------------
# Router and load balance (spec §9, items 1–5)
# ----------------------------------------------------------------------------


def test_routing_weights_are_a_distribution_over_distinct_heads():
    m = _module(L=7, K=3)
    r = m.router(torch.randn(3, 11, 24))
    assert (r.weights >= 0).all()
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(3, 11), atol=1e-6, rtol=0)
    assert r.indices.min() >= 0 and r.indices.max() < 7
    assert (r.indices.sort(-1).values.diff(dim=-1) > 0).all()


def test_bias_chooses_but_does_not_weigh():
    m = _module(L=6, K=2)
    x = torch.randn(2, 9, 24)
    r0 = m.router(x)
    with torch.no_grad():
        m.router.expert_bias.add_(1e-4)          # uniform shift: selection unchanged
    r1 = m.router(x)
    assert torch.equal(r0.indices, r1.indices) and torch.equal(r0.weights, r1.weights)
    with torch.no_grad():
        m.router.expert_bias[4] = 100.0
    assert (m.router(x).indices == 4).any(-1).all()


def test_load_balance_loss_and_max_vio_by_hand():
    # L = 4, K = 1: heads 0,0,1,2 for the 4 live tokens → f = [.5, .25, .25, 0]
    x = torch.eye(4)[[0, 0, 1, 2]][None]
    w = torch.eye(4) * 10
    r = mosrah_route(x, w, torch.zeros(4), 1)
    assert r.indices[0, :, 0].tolist() == [0, 0, 1, 2]
    torch.testing.assert_close(r.load_balance_loss, torch.tensor(0.25 + 0 + 0 + 0.25))
    torch.testing.assert_close(r.max_vio, torch.tensor(1.0))         # head 0 has twice its share
    balanced = mosrah_route(torch.eye(4)[None], w, torch.zeros(4), 1)
    assert balanced.load_balance_loss == 0 and balanced.max_vio == 0


def test_float64_routing_statistics_stay_float64():
    """f, LB and MaxVio in the input precision: L = 3, K = 1, heads 0,0,0,1,1,2,2 →
    f = [3, 2, 2] / 7, LB = 4/21, MaxVio = 2/7 (fp32 rounds each at ~1e-8)."""
    x = torch.eye(3, dtype=torch.float64)[[0, 0, 0, 1, 1, 2, 2]][None]
    r = mosrah_route(x, torch.eye(3, dtype=torch.float64) * 10, torch.zeros(3, dtype=torch.float64), 1)
    assert r.load_balance_loss.dtype == r.max_vio.dtype == torch.float64
    assert abs(r.load_balance_loss.item() - 4 / 21) < 1e-15 and abs(r.max_vio.item() - 2 / 7) < 1e-15
    out = _module(L=4, K=1).double()(torch.randn(2, 5, 24, dtype=torch.float64))
    assert out.output.dtype == out.load_balance_loss.dtype == out.max_vio.dtype == torch.float64


def test_load_balance_gradient_drives_only_the_bias():
    m = _module(L=4, K=1)
    x = torch.randn(2, 7, 24, requires_grad=True)
    r = m.router(x)
    (3.0 * r.load_balance_loss).backward(retain_graph=True)
    with torch.no_grad():
        assigned = torch.zeros(2, 7, 4).scatter_(-1, r.indices, 1.0).sum((0, 1)) / 14
    assert torch.equal(m.router.expert_bias.grad, 3.0 * torch.sign(assigned - 0.25))
    assert m.router.routing_projection.weight.grad is None and x.grad is None
    m.zero_grad()
    out = m(x.detach())
    out.output.square().sum().backward()
    assert m.router.expert_bias.grad is None or m.router.expert_bias.grad.abs().max() == 0
    assert m.router.routing_projection.weight.grad.abs().max() > 0


def test_dead_tokens_do_not_count_and_all_dead_gives_zero():
    m = _module(L=5, K=2)
    x = torch.randn(2, 8, 24)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False
    r = m.router(x, mask)
    live_only = m.router(torch.cat([x[0], x[1, :5]])[None])     # the 13 live tokens, no padding
    torch.testing.assert_close(r.load_balance_loss, live_only.load_balance_loss)
    torch.testing.assert_close(r.max_vio, live_only.max_vio)
    assert torch.equal(m.router(x, torch.ones(2, 8)).load_balance_loss, m.router(x).load_balance_loss)
    dead = m.router(x, torch.zeros(2, 8, dtype=torch.bool))
    assert dead.load_balance_loss == 0 and dead.max_vio == 0
    dead.load_balance_loss.backward()
    assert m.router.expert_bias.grad.abs().max() == 0


# ----------------------------------------------------------------------------
# Packing (item 6)
# ----------------------------------------------------------------------------


@given(st.integers(1, 3), st.integers(1, 12), st.integers(1, 6), st.data())
def test_pack_round_trip(B, N, L, data):
    K = data.draw(st.integers(1, L))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    indices = torch.rand(B, N, L, generator=gen).topk(K, -1).indices
    p = pack_experts(indices, L)
    assert int(p.occupied.sum()) == B * N * K
    assert torch.equal(p.occupied.sum(-1), p.counts)
    tokens = torch.arange(N).expand(B, N)
    packed = pack_rows(tokens, p, fill=-1)
    assert ((packed >= 0) == p.occupied).all()                       # left-justified
    for b in range(B):
        for l in range(L):
            row = packed[b, l][p.occupied[b, l]]
            assert (row.diff() > 0).all()                            # stable: increasing token order
            assert set(row.tolist()) == set(torch.nonzero((indices[b] == l).any(-1)).flatten().tolist())
    values = torch.randn(B, N, 3, generator=gen)
    copies = unpack_experts(pack_rows(values, p), p, K)
    assert torch.equal(copies, values[:, :, None].expand(B, N, K, 3))


# ----------------------------------------------------------------------------
# BEA / sparse path (items 7–11)
# ----------------------------------------------------------------------------


def test_tiny_hand_case():
    d, u = 4, 2
    m = MoSRAH(d, 1, 1, u, training_sequence_length=8)
    x = torch.randn(1, 3, d)
    out = m(x).output
    wq, wk, wv, wo = (p[0] for p in (m.bea.q_proj, m.bea.k_proj, m.bea.v_proj, m.bea.o_proj))
    theta = m.bea.inv_freq[0]

    def rot(vec, p):
        c, s = torch.cos(p * theta), torch.sin(p * theta)
        return torch.stack([vec[0] * c - vec[1] * s, vec[1] * c + vec[0] * s])

    for n in range(3):
        q = rot(x[0, n] @ wq, n)
        scores = torch.stack([q @ rot(x[0, j] @ wk, j) for j in range(n + 1)]) / math.sqrt(u)
        z = (torch.softmax(scores, 0)[:, None] * torch.stack([x[0, j] @ wv for j in range(n + 1)])).sum(0)
        torch.testing.assert_close(out[0, n], z @ wo, atol=1e-6, rtol=1e-5)


def test_head_parameters_reach_only_their_tokens():
    m = _module(L=5, K=2)
    x = torch.randn(2, 10, 24)
    before = m(x).output
    routed = (m.router(x).indices == 3).any(-1)
    with torch.no_grad():
        m.bea.v_proj[3].add_(torch.randn(24, 16))
    changed = (m(x).output - before).abs().amax(-1) > 0
    assert torch.equal(changed, routed) and routed.any() and (~routed).any()


@pytest.mark.parametrize("rope_mode", ["main_sequence", "semantic_sequence"])
def test_causality(rope_mode):
    m = _module(L=5, K=2, rope_mode=rope_mode)
    x = torch.randn(2, 11, 24)
    base = m(x).output
    for n in (0, 4, 9):
        y = x.clone()
        y[:, n + 1:] = torch.randn_like(y[:, n + 1:])
        assert (m(y).output[:, :n + 1] - base[:, :n + 1]).abs().max() <= 1e-6


def test_padding_never_reaches_live_tokens():
    m = _module(L=5, K=2)
    x = torch.randn(2, 9, 24)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :3] = False
    mask[1, 4] = False
    poisoned = x.clone()
    poisoned[~mask] = float("nan")
    out_clean = m(x, attention_mask=mask).output
    p = poisoned.clone().requires_grad_(True)
    out = m(p, attention_mask=mask)
    live = mask[..., None].expand_as(out_clean)
    torch.testing.assert_close(out.output[live], out_clean[live], atol=1e-6, rtol=0)
    assert (out.output[~live] == 0).all()
    (out.output.sum() + out.load_balance_loss).backward()
    assert torch.isfinite(p.grad).all() and all(torch.isfinite(q.grad).all() for q in m.parameters())


def test_all_heads_reduces_to_mha_mixed_by_router_probabilities():
    m = _module(L=3, K=3)
    x = torch.randn(2, 6, 24)
    out = m(x).output
    probs = torch.softmax(x @ m.router.routing_projection.weight.t(), -1)
    N, u = 6, 16
    pos = torch.arange(N)
    total = torch.zeros_like(out)
    for l in range(3):
        q = rotary_embedding(x @ m.bea.q_proj[l], pos.expand(2, N), m.bea.inv_freq)
        k = rotary_embedding(x @ m.bea.k_proj[l], pos.expand(2, N), m.bea.inv_freq)
        s = (q @ k.transpose(1, 2)) * m.bea.attention_scale
        s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
        z = torch.softmax(s, -1) @ (x @ m.bea.v_proj[l])
        total += probs[..., l:l + 1] * (z @ m.bea.o_proj[l])
    torch.testing.assert_close(out, total, atol=1e-5, rtol=1e-5)


def test_reference_gradcheck_float64():
    m = _module(d=6, L=3, K=2, u=4).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 0, 1]], dtype=torch.bool)
    params = [p.detach().clone().requires_grad_(True) for p in m._params()]
    pos = torch.arange(5).expand(2, 5)

    def f(x, wr, b, wq, wk, wv, wo):
        return mosrah_reference(x, wr, b, wq, wk, wv, wo, pos, mask, top_k=2, inv_freq=m.bea.inv_freq,
                                attention_scale=m.bea.attention_scale, upcast=False)[0]

    inputs = (x, params[0], params[2], params[3], params[4], params[5])
    assert torch.autograd.gradcheck(lambda x, wr, wq, wk, wv, wo: f(x, wr, params[1], wq, wk, wv, wo), inputs,
                                    fast_mode=True)


# ----------------------------------------------------------------------------
# RoPE / YaRN (items 12–14)
# ----------------------------------------------------------------------------


def test_yarn_identity_at_scale_one():
    rope = yarn_rope(16, 10000.0, 1024, 1024)
    theta = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    torch.testing.assert_close(rope.inv_freq, theta, atol=0, rtol=2e-7)
    assert rope.attention_scale == 1 / 4


def test_yarn_bands_at_scale_four():
    s, base, C = 4.0, 10000.0, 64
    rope = yarn_rope(16, base, C, int(C * s), alpha=1.0, beta=8.0)
    theta = 1.0 / (base ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    r = C * theta / (2 * math.pi)
    low, high = r < 1.0, r > 8.0
    assert low.any() and high.any() and (~low & ~high).any()
    torch.testing.assert_close(rope.inv_freq[low], theta[low] / s)
    torch.testing.assert_close(rope.inv_freq[high], theta[high])
    gamma = ((r - 1) / 7).clamp(0, 1)
    torch.testing.assert_close(rope.inv_freq, (1 - gamma) * theta / s + gamma * theta)
    assert rope.attention_scale == pytest.approx((0.1 * math.log(s) + 1) ** 2 / 4)


def test_main_sequence_is_relative():
    m = _module(L=4, K=2)
    x = torch.randn(2, 7, 24)
    pos = torch.arange(7).expand(2, 7)
    a = _ref(m, x, pos)[0]
    b = _ref(m, x, pos + 5)[0]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------
# Decoding (items 16–17) and the cache protocol
# ----------------------------------------------------------------------------


def _decode(m, x, prefill, mask=None):
    return prefill_then_decode(m, x, cache=m.empty_cache(x.shape[0]), prefill=prefill, attention_mask=mask)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("rope_mode", ["main_sequence", "semantic_sequence"])
@pytest.mark.parametrize("prefill", [1, 5])
def test_prefill_then_decode_equals_forward(rope_mode, prefill, backend):
    """Both backends; without gradients the Triton backend's cached steps run the
    cached attention kernel, judged against that backend's uncached forward."""
    m = _module(L=5, K=2, rope_mode=rope_mode, backend=backend)
    x = torch.randn(2, 12, 24)
    with torch.no_grad():
        full = m(x).output
        dec, cache = _decode(m, x, prefill)
    assert (dec - full).abs().max() <= 1e-5
    routed = torch.zeros(2, 5, dtype=torch.long).scatter_add_(
        1, m.router(x).indices.reshape(2, -1), torch.ones(2, 24, dtype=torch.long))
    assert torch.equal(cache.counts, routed) and cache.length == 12


def test_steps_over_a_long_cache_run_the_split_k_cached_kernel(monkeypatch):
    """Steps after a 36-token prefill (every token on both heads: 37 and 38 rows, more
    than one 32-row key block) split the rows over programs and equal the forward."""
    import importlib

    kernels = importlib.import_module("laminae.triton_ops.mosrah")
    plans = []
    real = kernels.cached_splits
    monkeypatch.setattr(kernels, "cached_splits", lambda *a: plans.append(real(*a)) or plans[-1])
    m = _module(L=2, K=2, backend="triton")
    ref = _module(L=2, K=2, backend="reference")
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 38, 24)
    with torch.no_grad():
        full = ref(x).output                                # the forward, on the cheaper backend
        dec, _ = _decode(m, x, 36)
    assert [n for n, _ in plans] == [1, 2, 2]               # the prefill unsplit, each step in two
    assert (dec - full).abs().max() <= 1e-5


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_padded_prefill_decodes_like_the_forward_with_live_rank_horizon(backend):
    m = _module(L=4, K=2, backend=backend)
    x = torch.randn(2, 10, 24)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :3] = False
    mask[1, 2] = False
    with torch.no_grad():
        full = m(x, attention_mask=mask).output
        dec, _ = _decode(m, x, 6, mask)
        assert (dec - full).abs().max() <= 1e-5
        raw = _module(L=4, K=2, cache_horizon="raw_slot", backend=backend)
        raw.load_state_dict(m.state_dict())
        # the public implementation's rule lets live queries see later tokens of a padded chunk (errata E1)
        assert (_decode(raw, x, 6, mask)[0] - full).abs().max() > 1e-2
        all_live = torch.randn(2, 10, 24)
        torch.testing.assert_close(_decode(raw, all_live, 6)[0], m(all_live).output, atol=1e-5, rtol=0)


def test_semantic_positions_after_a_padded_prefill_follow_the_live_count():
    """semantic_sequence: a slot's position is its index in the head's packed sequence,
    dead copies included, plus the head's cached count, which counts live copies only
    (the spec's rule, docs/mechanisms/mosrah.md). After a padded prefill the steps sit
    at smaller positions than in the uncached forward, so they differ from it; the
    prefill matches, and so does everything without padding or in main_sequence."""
    x = torch.randn(2, 10, 24)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :3] = False
    for rope_mode, steps_match in (("main_sequence", True), ("semantic_sequence", False)):
        m = _module(L=4, K=2, rope_mode=rope_mode)
        full = m(x, attention_mask=mask).output
        dec, cache = _decode(m, x, 6, mask)
        assert (dec[:, :6] - full[:, :6]).abs().max() <= 1e-5
        assert ((dec[:, 6:] - full[:, 6:]).abs().max() <= 1e-5) == steps_match, rope_mode
        assert cache.counts.sum().item() == 2 * int(mask.sum())     # K = 2 live copies per live token


def test_cache_is_not_mutated_and_beams_branch():
    m = _module(L=4, K=2)
    x = torch.randn(2, 8, 24)
    cache = m(x[:, :6], cache=m.empty_cache(2)).cache
    counts = cache.counts.clone()
    a = m(x[:, 6:7], cache=cache)
    other = torch.randn(2, 1, 24)
    b = m(other, cache=cache)                       # a second beam from the same cache
    assert torch.equal(cache.counts, counts) and cache.length == 6
    again = m(x[:, 6:7], cache=cache)
    torch.testing.assert_close(again.output, a.output, atol=0, rtol=0)
    torch.testing.assert_close(b.output, m(torch.cat([x[:, :6], other], 1)).output[:, 6:], atol=1e-5, rtol=0)
    a2 = m(x[:, 7:8], cache=a.cache)
    torch.testing.assert_close(a2.output, m(x).output[:, 7:], atol=1e-5, rtol=0)
    swapped = cache.select(torch.tensor([1, 0]))
    torch.testing.assert_close(m(x[[1, 0], 6:7], cache=swapped).output, a.output[[1, 0]], atol=1e-6, rtol=0)
    a.cache.reset()
    assert a.cache.length == 0 and int(a.cache.counts.sum()) == 0


def test_cache_grows_by_doubling():
    m = _module(L=2, K=2)
    x = torch.randn(1, 20, 24)
    dec, cache = _decode(m, x, 1)
    assert cache.length == 20 and cache.capacity == 32              # 16 preallocated, doubled once
    torch.testing.assert_close(dec, m(x).output, atol=1e-5, rtol=0)


def test_cache_rows_of_one_chunk_never_collide():
    """A chunk's live copies land at each head's count in slot order, its other slots
    right after them: every slot has its own row, so the scatter has one writer per
    row (with duplicates a GPU scatter picks a writer at random)."""
    cache = _module(L=2, K=1).empty_cache(1)
    keys = torch.arange(2 * 4 * 16, dtype=torch.float32).reshape(1, 2, 4, 16)         # [B, L, N, u]
    write = torch.tensor([[[False, True, False, True], [True, True, False, False]]])
    new = cache.append(keys, -keys, write, torch.ones(1, 4, dtype=torch.bool))
    assert new.counts.tolist() == [[2, 2]] and new.length == 4
    for head in range(2):
        order = torch.cat([write[0, head].nonzero().flatten(), (~write[0, head]).nonzero().flatten()])
        torch.testing.assert_close(new.keys[0, :, head], keys[0, head, order], atol=0, rtol=0)
        torch.testing.assert_close(new.values[0, :, head], -keys[0, head, order], atol=0, rtol=0)


def test_empty_cache_takes_dtype_and_device_by_keyword():
    m = _module()
    cache = m.empty_cache(2)
    assert (cache.length, cache.batch, cache.dtype, cache.device) == (0, 2, torch.float32, torch.device("cpu"))
    assert cache.keys.shape == (2, 0, 5, 16) and cache.config == {"num_mosrah_heads": 5, "head_dim": 16}
    low = m.empty_cache(2, dtype=torch.bfloat16, device="cpu")
    out = m(torch.randn(2, 3, 24), cache=low)
    assert out.cache.dtype == torch.bfloat16 and out.cache.keys.shape == (2, 3, 5, 16)
    with pytest.raises(TypeError):
        m.empty_cache(2, torch.float32)                             # dtype is keyword-only
    with pytest.raises(DTypeError, match="dtype"):
        m.empty_cache(2, dtype=torch.int64)
    with pytest.raises(ConfigError, match="batch"):
        m.empty_cache(0)


def test_bea_module_runs_the_packed_reference():
    m = _module(L=3, K=2)
    x = torch.randn(2, 3, 4, 24)
    pos = torch.randint(0, 8, (2, 3, 4))
    keep = torch.rand(2, 3, 4) > 0.3
    want = bea_packed_reference(x, pos, keep, m.bea.q_proj, m.bea.k_proj, m.bea.v_proj, m.bea.o_proj,
                                m.bea.inv_freq, m.bea.attention_scale)
    torch.testing.assert_close(m.bea(x, keep, position_ids=pos), want, atol=0, rtol=0)
    torch.testing.assert_close(m.bea(x, position_ids=pos), m.bea(x, torch.ones_like(keep), position_ids=pos))


# ----------------------------------------------------------------------------
# dtype, autocast, backend
# ----------------------------------------------------------------------------


def test_autocast_cpu_bfloat16():
    """MoSRAH's own math runs with autocast off (the cast policy): an fp32 input gives
    the fp32 result under autocast too (fp32 routing logits), a bf16 one is computed
    in fp32 and returned in bf16."""
    m = _module()
    x = torch.randn(2, 5, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
        low = m(x.bfloat16())
    torch.testing.assert_close(out.output, m(x).output, atol=0, rtol=0)
    assert low.output.dtype == torch.bfloat16 and torch.isfinite(low.output).all()
    torch.testing.assert_close(low.output.float(), m(x).output, atol=5e-2, rtol=5e-2)


def test_upcast_false_keeps_the_dtype():
    m = _module().double()
    x = torch.randn(1, 4, 24, dtype=torch.float64)
    assert _ref(m, x, upcast=False)[0].dtype == torch.float64


# ----------------------------------------------------------------------------
# Named errors
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_selected_heads=5, num_mosrah_heads=4), "num_selected_heads"),
    (dict(head_dim=15), "head_dim"),
    (dict(rope_mode="absolute"), "rope_mode"),
    (dict(training_sequence_length=0), "training_sequence_length"),
    (dict(inference_sequence_length=-1), "inference_sequence_length"),
    (dict(alpha=2.0, beta=2.0), "beta"),
    (dict(num_mosrah_heads=0), "num_mosrah_heads"),
    (dict(cache_horizon="all"), "cache_horizon"),
    (dict(backend="cuda"), "backend"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MoSRAH(**{"embedding_width": 16, **kwargs})


def test_input_errors(monkeypatch):
    monkeypatch.setenv("LAMINAE_DEBUG", "1")     # the position values are read back only then
    m = MoSRAH(16, 4, 2, 16, training_sequence_length=32)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ShapeError, match="x"):
        m(torch.randn(5, 16))
    with pytest.raises(ShapeError, match="embedding_width"):
        m(torch.randn(2, 5, 8))
    with pytest.raises(ShapeError, match="at least one token"):
        m(torch.randn(2, 0, 16))
    with pytest.raises(DTypeError, match="x"):
        m(x.double())
    with pytest.raises(ShapeError, match="position_ids"):
        m(x, position_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(DTypeError, match="position_ids"):
        m(x, position_ids=torch.zeros(2, 5))
    with pytest.raises(ConfigError, match="≥ 0"):
        m(x, position_ids=torch.tensor([[0, 1, -1, 2, 3]] * 2))
    with pytest.raises(ConfigError, match=r"position_ids\[:, 0\]"):
        m(x, position_ids=torch.arange(1, 6).expand(2, 5))
    with pytest.raises(ConfigError, match="YaRN limit"):
        m(torch.randn(2, 40, 16))
    with pytest.raises(DTypeError, match="additive"):
        m(x, attention_mask=torch.zeros(2, 5).masked_fill(torch.eye(2, 5).bool(), float("-inf")))
    with pytest.raises(ShapeError, match="attention_mask"):
        m(x, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    if torch.cuda.is_available():
        with pytest.raises(DeviceError):
            m(x.cuda())


@pytest.mark.parametrize("backend, reads", [("triton", 0), ("reference", 1)])
def test_eager_forward_reads_no_positions_back(backend, reads, monkeypatch):
    """Reading positions back is a device sync per call, so their value checks run only
    with ``LAMINAE_DEBUG=1``: a Triton forward reads nothing back, the reference one
    value (its padded layout's largest head load). Default positions are bounded on
    the host (positions seen + N; exactly 0 … N−1 without a cache and a mask)."""
    monkeypatch.delenv("LAMINAE_DEBUG", raising=False)
    m = _module(backend=backend)
    x, keep = torch.randn(2, 7, 24), torch.ones(2, 7, dtype=torch.bool)
    keep[0, :3] = False
    assert host_reads(lambda: m(x, attention_mask=keep)) == reads
    assert host_reads(lambda: m(x, position_ids=torch.arange(7).expand(2, 7))) == reads
    with pytest.raises(ConfigError, match="YaRN limit"):       # 0 … 69 past the limit, known on the host
        m(torch.randn(1, 70, 24))
    padded = torch.ones(1, 70, dtype=torch.bool)
    padded[:, :10] = False
    monkeypatch.setenv("LAMINAE_DEBUG", "1")
    m(torch.randn(1, 70, 24), attention_mask=padded)            # 60 live tokens fit in 64 positions
    padded[:, 5:10] = True
    with pytest.raises(ConfigError, match="YaRN limit"):       # 65 do not: read back in debug mode
        m(torch.randn(1, 70, 24), attention_mask=padded)
    with pytest.raises(ConfigError, match="≥ 0"):
        m(x, position_ids=torch.tensor([[0, 1, -1, 2, 3, 4, 5]] * 2))


def test_cache_errors():
    m = MoSRAH(16, 4, 2, 16, training_sequence_length=32)
    other = MoSRAH(16, 4, 2, 16, training_sequence_length=32)
    x = torch.randn(2, 3, 16)
    with pytest.raises(ConfigError, match="another MoSRAH layer"):
        m(x, cache=other.empty_cache(2))
    with pytest.raises(ShapeError, match="batch"):
        m(x, cache=m.empty_cache(3))
    foreign = MoSRAH(16, 3, 2, 16, training_sequence_length=32).empty_cache(2)
    with pytest.raises(ConfigError, match="num_mosrah_heads"):   # the protocol: a cache of another configuration
        m(x, cache=foreign)
    with pytest.raises(TypeError, match="MoSRAHCache"):
        m(x, cache=object())


def test_load_balance_function_is_exposed():
    bias = torch.zeros(3, requires_grad=True)
    lb = load_balance_loss(bias, torch.tensor([0.5, 0.5, 0.0]), torch.tensor(True))
    lb.backward()
    assert lb.item() == pytest.approx(1 / 6 + 1 / 6 + 1 / 3)
    assert bias.grad.tolist() == [1.0, 1.0, -1.0]
