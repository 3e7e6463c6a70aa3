import math

import pytest
import torch
from torch import nn

from laminae.primitives import ConfigError, DeviceError, DTypeError, ShapeError
from laminae.primitives.engram import (
    EngramLayerFusion,
    EngramCache,
    EngramModule,
    MultiHeadHashLookup,
    TokenCompressor,
    engram_bucket_ids,
    engram_fusion_gate_reference,
    engram_fusion_reference,
    engram_hash_bits,
    engram_lookup_reference,
    engram_next_prefix,
    engram_orders_that_fit,
    ngram_slots,
)


def _unit(*shape, gen=None):
    c = torch.randn(*shape, generator=gen)
    return c / c.norm(dim=-1, keepdim=True)


# ----------------------------------------------------------------------------
# A literal transcription of the seed's hashing and read (MultiHeadHashLookup
# ._bucket_ids / forward), kept deliberately close to the original.
# ----------------------------------------------------------------------------


def _seed_bucket_ids(buffers, num_heads, hash_bits, table_size, legacy_trunc, compressed, n, valid_len):
    if legacy_trunc:
        h = None
        for k in range(n):
            proj = buffers[f"hash_proj_n{n}_p{k}"]
            term = torch.matmul(compressed[:, k:k + valid_len, :].float(), proj.t())
            h = term if h is None else h + term
        return h.abs().long() % table_size
    h = None
    for k in range(n):
        proj = buffers[f"hash_proj_n{n}_p{k}"]
        term = torch.matmul(
            compressed[:, k:k + valid_len, :].float(),
            proj.reshape(num_heads * hash_bits, -1).t(),
        ).view(-1, valid_len, num_heads, hash_bits)
        h = term if h is None else h + term
    bits = (h > 0).float()
    bit_weights = 2.0 ** torch.arange(hash_bits, dtype=torch.float32)
    idx = (bits * bit_weights).sum(dim=-1).long()
    return idx % table_size


def _seed_forward(lookup: MultiHeadHashLookup, compressed, prefix=None):
    buffers = dict(lookup.named_buffers())
    if prefix is not None and prefix.shape[1] > 0:
        P = prefix.shape[1]
        compressed = torch.cat([prefix.to(compressed.dtype), compressed], dim=1)
    else:
        P = 0
    B, S, _ = compressed.shape
    out = torch.zeros(B, S, lookup.out_dim, dtype=compressed.dtype)
    norm = torch.zeros(S)
    for n in range(1, lookup.max_ngram + 1):
        if S < n:
            continue
        valid_len = S - n + 1
        start = n - 1
        idx = _seed_bucket_ids(buffers, lookup.num_heads, lookup.hash_bits, lookup.table_size,
                               lookup.legacy_trunc, compressed, n, valid_len)
        for head_idx, table in enumerate(lookup.tables):
            out[:, start:, :] = out[:, start:, :] + table(idx[:, :, head_idx]).to(out.dtype)
        norm[start:] += lookup.num_heads
    out = out / norm.view(1, -1, 1).clamp(min=1)
    return out[:, P:, :].to(compressed.dtype)


def _seed_lookup_state(num_heads, table_size, compress_dim, out_dim, max_ngram, legacy_trunc):
    """The seed's constructor, RNG call for RNG call, as a dict of tensors."""
    hash_bits = min(24, max(1, math.ceil(math.log2(max(table_size, 2))) + 8))
    tables = [nn.Embedding(table_size, out_dim) for _ in range(num_heads)]
    for t in tables:
        nn.init.normal_(t.weight, std=0.01)
    state = {f"tables.{h}.weight": t.weight.detach() for h, t in enumerate(tables)}
    for n in range(1, max_ngram + 1):
        for k in range(n):
            if legacy_trunc:
                proj = torch.randn(num_heads, compress_dim)
                proj = proj / (proj.norm(dim=1, keepdim=True) + 1e-8)
            else:
                proj = torch.randn(num_heads, hash_bits, compress_dim)
                proj = proj / (proj.norm(dim=-1, keepdim=True) + 1e-8)
            state[f"hash_proj_n{n}_p{k}"] = proj
    return state


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("table_size", [7, 300, 4096])
def test_bucket_ids_equal_the_seed_hash(legacy, table_size):
    torch.manual_seed(1)
    lookup = MultiHeadHashLookup(3, table_size, 16, 8, max_ngram=3, legacy_trunc=legacy)
    # the legacy hash truncates |a|: give it magnitudes above 1 so buckets vary
    compressed = _unit(2, 11, 16) * (7.0 if legacy else 1.0)
    ids = lookup.bucket_ids(compressed)
    buffers = dict(lookup.named_buffers())
    for n in range(1, 4):
        expected = _seed_bucket_ids(buffers, 3, lookup.hash_bits, table_size, legacy, compressed, n, 11 - n + 1)
        assert torch.equal(ids[:, n - 1:, n - 1, :], expected)
        assert bool((ids[:, :n - 1, n - 1, :] == -1).all())
    if legacy:
        assert ids[..., 0, :].unique().numel() > 1


@pytest.mark.parametrize("legacy", [False, True])
def test_read_equals_the_seed_forward_with_and_without_prefix(legacy):
    torch.manual_seed(2)
    lookup = MultiHeadHashLookup(2, 13, 8, 6, max_ngram=3, legacy_trunc=legacy, backend="reference")
    compressed = _unit(2, 7, 8) * (5.0 if legacy else 1.0)
    torch.testing.assert_close(lookup(compressed), _seed_forward(lookup, compressed), atol=0, rtol=0)
    prefix = _unit(2, 2, 8)
    torch.testing.assert_close(lookup(compressed, prefix=prefix), _seed_forward(lookup, compressed, prefix),
                               atol=0, rtol=0)


@pytest.mark.parametrize("legacy", [False, True])
def test_initialisation_draws_the_same_random_numbers_as_the_seed(legacy):
    torch.manual_seed(3)
    expected = _seed_lookup_state(2, 300, 12, 10, 3, legacy)
    torch.manual_seed(3)
    lookup = MultiHeadHashLookup(2, 300, 12, 10, 3, legacy_trunc=legacy)
    got = lookup.state_dict()
    assert set(got) == set(expected)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    torch.testing.assert_close(lookup.bit_weights, 2.0 ** torch.arange(17, dtype=torch.float32))


def test_hash_bits_formula():
    assert engram_hash_bits(300) == 9 + 8
    assert engram_hash_bits(1) == 9
    assert engram_hash_bits(1 << 14) == 22
    assert engram_hash_bits(1 << 20) == 24  # capped: packed through fp32
    assert ngram_slots(3) == [(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]


def test_hash_is_order_sensitive():
    torch.manual_seed(4)
    lookup = MultiHeadHashLookup(4, 4096, 16, 8, max_ngram=2)
    a, b = _unit(1, 1, 16), _unit(1, 1, 16)
    ab = lookup.bucket_ids(torch.cat([a, b], dim=1))
    ba = lookup.bucket_ids(torch.cat([b, a], dim=1))
    # same unigrams (swapped positions), different bigram buckets on every head
    assert torch.equal(ab[0, 0, 0], ba[0, 1, 0]) and torch.equal(ab[0, 1, 0], ba[0, 0, 0])
    assert bool((ab[0, 1, 1] != ba[0, 1, 1]).all())


def test_hash_is_scale_invariant():
    torch.manual_seed(5)
    lookup = MultiHeadHashLookup(2, 97, 16, 8)
    c = torch.randn(2, 9, 16)
    assert torch.equal(lookup.bucket_ids(c), lookup.bucket_ids(c * 1e-3))
    assert torch.equal(lookup.bucket_ids(c), lookup.bucket_ids(c * 50.0))


def _expected_occupancy(lookups: int, table_size: int) -> float:
    """E[distinct buckets] / min(lookups, T) for lookups hashed uniformly at random."""
    distinct = table_size * (1.0 - (1.0 - 1.0 / table_size) ** lookups)
    return distinct / min(lookups, table_size)


@pytest.mark.parametrize("table_size, seq", [(64, 64), (300, 200), (1024, 100)])
def test_bucket_occupancy_is_near_uniform_hashing(table_size, seq):
    torch.manual_seed(6)
    engram = EngramModule(64, 64, num_heads=2, table_size=table_size, max_ngram=3)
    x = torch.randn(2, seq, 64) * 0.02  # embedding-scale inputs: the scale that collapsed the old hash
    stats = engram.lookup.bucket_occupancy(engram.compress(x))
    for n in (1, 2, 3):
        lookups = 2 * (seq - n + 1) * 2
        expected = _expected_occupancy(lookups, table_size)
        collapsed = 1.0 / min(lookups, table_size)
        occ = stats[f"n{n}"]["occupancy"]
        # Sign-LSH cells have unequal volumes (for a power-of-two table only the low
        # log2(T) hyperplanes pick the bucket), so it sits a little below uniform
        # hashing: measured 0.97-1.0 (T=64), 0.92-0.94 (T=300), 0.78-0.82 (T=1024)
        # against 0.98, 0.93, 0.83. A collapsed hash scores 1/min(lookups, T).
        assert occ >= 0.8 * expected, (n, occ, expected)
        assert occ > 20 * collapsed
    legacy = EngramModule(64, 64, num_heads=2, table_size=table_size, legacy_trunc=True)
    legacy_stats = legacy.lookup.bucket_occupancy(legacy.compress(x))
    # the truncation hash of unit vectors reaches at most buckets 0..n
    assert all(legacy_stats[f"n{n}"]["distinct_buckets"] <= n + 1 for n in (1, 2, 3))


def test_short_sequences_average_only_the_orders_that_fit():
    torch.manual_seed(7)
    lookup = MultiHeadHashLookup(2, 11, 8, 5, max_ngram=3, backend="reference")
    c = _unit(1, 2, 8)
    ids = lookup.bucket_ids(c)
    out = lookup(c)
    w = [t.weight for t in lookup.tables]
    expect0 = (w[0][ids[0, 0, 0, 0]] + w[1][ids[0, 0, 0, 1]]) / 2
    expect1 = sum(w[h][ids[0, 1, n, h]] for n in range(2) for h in range(2)) / 4
    torch.testing.assert_close(out[0, 0], expect0)
    torch.testing.assert_close(out[0, 1], expect1)
    assert lookup.bucket_occupancy(c).keys() == {"n1", "n2"}


@pytest.mark.parametrize("max_ngram, prefill", [(3, 5), (3, 1), (3, 0), (1, 3), (4, 2)])
def test_prefill_then_single_token_steps_equal_the_full_forward(max_ngram, prefill):
    torch.manual_seed(8)
    engram = EngramModule(24, 8, num_heads=2, table_size=29, max_ngram=max_ngram, gate_init_bias=0.5,
                          backend="reference")
    x = torch.randn(2, 9, 24)
    full = engram(x)
    assert full.cache is None                      # cache=None: no decoding
    outs, reads = [], []
    state = engram.empty_cache(2)
    if prefill:
        res = engram(x[:, :prefill], cache=state)
        outs.append(res.output), reads.append(res.retrieved)
        state = res.cache
    for t in range(prefill, 9):
        res = engram(x[:, t:t + 1], cache=state)
        outs.append(res.output), reads.append(res.retrieved)
        state = res.cache
        assert state.length == t + 1 and state.prefix.shape[1] == min(max_ngram - 1, t + 1)
    # bit-identical: the boundary n-grams are hashed from the same cached vectors
    assert torch.equal(torch.cat(reads, 1), full.retrieved)
    torch.testing.assert_close(torch.cat(outs, 1), full.output, atol=1e-6, rtol=1e-6)


def test_next_prefix_keeps_the_last_window_and_detaches():
    c = torch.randn(2, 5, 4, requires_grad=True)
    p = engram_next_prefix(None, c, 3)
    assert torch.equal(p, c[:, 3:]) and not p.requires_grad
    p2 = engram_next_prefix(p, c[:, :1], 3)
    assert torch.equal(p2, torch.cat([c[:, 4:], c[:, :1]], 1))
    assert engram_next_prefix(None, c, 1) is None
    assert EngramCache(torch.zeros(2, 0, 4)).advance(c[:, :1], 3).prefix.shape == (2, 1, 4)


def test_gradcheck_lookup_tables_float64():
    torch.manual_seed(9)
    lookup = MultiHeadHashLookup(2, 5, 6, 3, max_ngram=3)
    c = _unit(2, 4, 6).double()
    tables = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    prefix = _unit(2, 1, 6).double()

    def fn(t):
        return engram_lookup_reference(c, lookup.hash_projs(), lookup.bit_weights, t, prefix=prefix)

    assert torch.autograd.gradcheck(fn, (tables,))


def test_gradcheck_lookup_tables_with_padding_float64():
    torch.manual_seed(9)
    lookup = MultiHeadHashLookup(2, 5, 6, 3, max_ngram=3)
    c = _unit(2, 5, 6).double()
    tables = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)
    prefix = _unit(2, 2, 6).double()

    def fn(t):
        return engram_lookup_reference(c, lookup.hash_projs(), lookup.bit_weights, t, attention_mask=mask,
                                       prefix=prefix, prefix_mask=torch.tensor([[1, 0], [1, 1]]))

    assert torch.autograd.gradcheck(fn, (tables,))


def test_orders_that_fit_restart_after_every_dropped_position():
    keep = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 0, 1, 1], [1, 0, 0, 0, 1]])
    assert engram_orders_that_fit(keep, 3).tolist() == [[1, 2, 3, 3, 3], [0, 0, 1, 2, 3], [1, 2, 0, 1, 2],
                                                         [1, 0, 0, 0, 1]]


@pytest.mark.parametrize("pad", [1, 2, 4])
def test_reference_left_padding_equals_the_unpadded_read(pad):
    """Padding (NaN here) before a sequence: the ids of the kept positions, the read and
    the table gradient equal the unpadded sequence's; pads read 0 and address nothing."""
    torch.manual_seed(11)
    lookup = MultiHeadHashLookup(3, 11, 8, 5, max_ngram=3, backend="reference")
    c = _unit(1, 6, 8)
    padded = torch.cat([torch.full((1, pad, 8), float("nan")), c], 1)
    mask = torch.arange(pad + 6)[None] >= pad
    ids = lookup.bucket_ids(padded, attention_mask=mask)
    assert torch.equal(ids[:, pad:], lookup.bucket_ids(c)) and bool((ids[:, :pad] == -1).all())
    g = torch.randn(1, 6, 5)
    out = lookup(padded, attention_mask=mask)
    (gp,) = torch.autograd.grad((out[:, pad:] * g).sum() + out[:, :pad].sum(), [lookup.tables[0].weight])
    ref = lookup(c)
    (gr,) = torch.autograd.grad((ref * g).sum(), [lookup.tables[0].weight])
    assert torch.equal(out[:, pad:], ref) and bool((out[:, :pad] == 0).all())
    torch.testing.assert_close(gp, gr)


def test_decoding_cache_remembers_padding_inside_the_window():
    """A step whose n-gram window holds a cached pad reads only the orders after it;
    branching from a padded cache leaves it unchanged."""
    torch.manual_seed(12)
    engram = EngramModule(16, 8, num_heads=2, table_size=13, max_ngram=3, backend="reference")
    x = torch.randn(1, 4, 16)
    keep = torch.tensor([[0, 0, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        prefill = engram(x[:, :3], keep[:, :3], engram.empty_cache(1))
        assert prefill.cache.keep.tolist() == [[False, True]]
        step = engram(x[:, 3:], cache=prefill.cache)
        other = engram(torch.randn(1, 1, 16), cache=prefill.cache)
        assert prefill.cache.keep.tolist() == [[False, True]] and other.cache.keep.tolist() == [[True, True]]
        alone = engram(x[:, 2:])
    torch.testing.assert_close(step.retrieved, alone.retrieved[:, 1:], atol=0, rtol=0)
    assert step.cache.keep.tolist() == [[True, True]]


def test_gradcheck_fusion_float64():
    torch.manual_seed(10)
    H, Fd = 6, 4
    args = [torch.randn(2, 3, H), torch.randn(2, 3, H), torch.randn(Fd, H), torch.randn(Fd, H),
            torch.randn(Fd, H), torch.randn(H, Fd), 1 + 0.1 * torch.randn(Fd), 1 + 0.1 * torch.randn(Fd)]
    args = [a.double().requires_grad_() for a in args]
    assert torch.autograd.gradcheck(lambda *a: engram_fusion_reference(*a, 1e-6), args)
    gate_args = [torch.randn(5, Fd), torch.randn(5, Fd), torch.randn(5, Fd), 1 + 0.1 * torch.randn(Fd),
                 1 + 0.1 * torch.randn(Fd)]
    gate_args = [a.double().requires_grad_() for a in gate_args]
    assert torch.autograd.gradcheck(lambda *a: engram_fusion_gate_reference(*a, 1e-6), gate_args)


def test_fusion_gate_formula_and_identity_at_init():
    torch.manual_seed(11)
    fusion = EngramLayerFusion(12, 8, backend="reference")
    hidden, ngram = torch.randn(2, 5, 12), torch.randn(2, 5, 12)
    assert torch.equal(fusion(hidden, ngram=ngram), hidden)  # zero-init out_proj
    hl, kl, v = torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8)
    w1, w2 = torch.ones(8), torch.ones(8)
    h = hl * torch.rsqrt(hl.pow(2).mean(-1, keepdim=True) + 1e-6)
    k = kl * torch.rsqrt(kl.pow(2).mean(-1, keepdim=True) + 1e-6)
    a = (h * k).sum(-1, keepdim=True) / math.sqrt(8)
    expected = torch.sigmoid(torch.sign(a) * a.abs().clamp_min(1e-6).sqrt()) * v
    torch.testing.assert_close(engram_fusion_gate_reference(hl, kl, v, w1, w2), expected)
    # a == 0 → gate 1/2
    zero = engram_fusion_gate_reference(torch.zeros(1, 8), kl[:1], v[:1], w1, w2)
    torch.testing.assert_close(zero, 0.5 * v[:1])


def test_module_parameters_follow_the_seed():
    torch.manual_seed(12)
    engram = EngramModule(64, 16, num_heads=2, table_size=512)
    assert not engram.compressor.proj.weight.requires_grad
    assert abs(engram.compressor.proj.weight.std().item() - 64 ** -0.5) < 0.02
    assert abs(engram.lookup.tables[0].weight.std().item() - 0.01) < 0.002
    torch.testing.assert_close(engram.lookup.hash_proj_n2_p1.norm(dim=-1), torch.ones(2, 17))
    torch.testing.assert_close(engram.gate.bias, torch.full((64,), -4.0))
    c = engram.compress(torch.randn(2, 3, 64))
    torch.testing.assert_close(c.norm(dim=-1), torch.ones(2, 3), atol=1e-5, rtol=0)
    fusion = EngramLayerFusion(64)
    assert fusion.fusion_dim == 256 and fusion.eps == 1e-6
    assert abs(fusion.key_proj.weight.std().item() - 0.02) < 0.002
    assert bool((fusion.out_proj.weight == 0).all())


def _seed_engram_keys(hidden, compress_dim, heads, table_size, max_ngram, legacy):
    """Key → shape of the seed's EngramModule state dict, read off its constructors."""
    bits = min(24, max(1, math.ceil(math.log2(max(table_size, 2))) + 8))
    keys = {"compressor.proj.weight": (compress_dim, hidden)}
    keys |= {f"lookup.tables.{h}.weight": (table_size, hidden) for h in range(heads)}
    for n in range(1, max_ngram + 1):
        for k in range(n):
            keys[f"lookup.hash_proj_n{n}_p{k}"] = (heads, compress_dim) if legacy else (heads, bits, compress_dim)
    # bit_weights is a non-persistent buffer: not in the checkpoint
    keys |= {"gate.proj.weight": (hidden, 2 * hidden), "gate.proj.bias": (hidden,), "gate.alpha": (hidden,),
             "gate.bias": (hidden,), "gate.gamma": (hidden,)}
    return keys


@pytest.mark.parametrize("legacy", [False, True])
def test_seed_engram_state_dict_loads_strictly(legacy):
    torch.manual_seed(13)
    expected = _seed_engram_keys(20, 8, 3, 50, 3, legacy)
    engram = EngramModule(20, 8, num_heads=3, table_size=50, max_ngram=3, legacy_trunc=legacy, backend="reference")
    assert {k: tuple(v.shape) for k, v in engram.state_dict().items()} == expected
    seed_sd = {k: torch.randn(shape) for k, shape in expected.items()}
    engram.load_state_dict(seed_sd, strict=True)
    for k, v in seed_sd.items():
        assert torch.equal(engram.state_dict()[k], v)
    # the loaded hyperplanes are the ones used
    c = _unit(1, 4, 8) * (4.0 if legacy else 1.0)
    n1 = _seed_bucket_ids({"hash_proj_n1_p0": seed_sd["lookup.hash_proj_n1_p0"]}, 3, engram.lookup.hash_bits,
                          50, legacy, c, 1, 4)
    assert torch.equal(engram.lookup.bucket_ids(c)[:, :, 0, :], n1)


def test_seed_fusion_state_dict_loads_strictly():
    hidden, fusion_dim = 12, 6
    expected = {"hidden_down.weight": (fusion_dim, hidden), "key_proj.weight": (fusion_dim, hidden),
                "value_proj.weight": (fusion_dim, hidden), "out_proj.weight": (hidden, fusion_dim),
                "hidden_norm.weight": (fusion_dim,), "ngram_norm.weight": (fusion_dim,)}
    fusion = EngramLayerFusion(hidden, fusion_dim)
    assert {k: tuple(v.shape) for k, v in fusion.state_dict().items()} == expected
    fusion.load_state_dict({k: torch.randn(s) for k, s in expected.items()}, strict=True)


def test_only_the_tables_get_gradients():
    torch.manual_seed(14)
    engram = EngramModule(16, 8, num_heads=2, table_size=23, gate_init_bias=0.0, backend="reference")
    x = torch.randn(2, 6, 16, requires_grad=True)
    engram.lookup(engram.compress(x)).sum().backward()
    assert x.grad is None
    assert engram.compressor.proj.weight.grad is None
    assert all(t.weight.grad is not None and t.weight.grad.abs().sum() > 0 for t in engram.lookup.tables)


def test_named_errors():
    lookup = MultiHeadHashLookup(2, 11, 8, 5)
    c = torch.randn(2, 4, 8)
    with pytest.raises(ShapeError, match="compress_dim=8"):
        lookup(torch.randn(2, 4, 7))
    with pytest.raises(ShapeError, match="3 dimensions"):
        lookup(torch.randn(4, 8))
    with pytest.raises(ShapeError, match="empty sequence"):
        lookup(torch.randn(2, 0, 8))
    with pytest.raises(ShapeError, match="prefix"):
        lookup(c, prefix=torch.randn(3, 2, 8))
    with pytest.raises(DTypeError):
        lookup(c.to(torch.int64))
    with pytest.raises(DeviceError):
        lookup(c, prefix=torch.randn(2, 2, 8, device="meta"))
    projs = lookup.hash_projs()
    with pytest.raises(ShapeError, match="1, 3, 6"):
        engram_lookup_reference(c, projs[:4], lookup.bit_weights, torch.randn(2, 11, 5))
    with pytest.raises(ShapeError, match="one table per head"):
        engram_lookup_reference(c, projs, lookup.bit_weights, torch.randn(3, 11, 5))
    with pytest.raises(DTypeError, match="share one dtype"):
        engram_lookup_reference(c, projs, lookup.bit_weights, [torch.randn(11, 5), torch.randn(11, 5).double()])
    with pytest.raises(ShapeError, match="4 dimensions"):
        engram_lookup_reference(c, projs[:, :, 0], lookup.bit_weights, torch.randn(2, 11, 5))
    for bad in (dict(num_heads=0), dict(table_size=-1), dict(max_ngram=0)):
        kwargs = dict(num_heads=2, table_size=11, compress_dim=8, out_dim=5) | bad
        with pytest.raises(ConfigError):
            MultiHeadHashLookup(**kwargs)
    with pytest.raises(ConfigError):
        MultiHeadHashLookup(2, 11, 8, 5, backend="cuda")
    with pytest.raises(ConfigError):
        TokenCompressor(0, 4)
    with pytest.raises(ShapeError):
        TokenCompressor(8, 4)(torch.randn(3, 7))
    engram = EngramModule(8, 4, num_heads=2, table_size=11)
    with pytest.raises(DTypeError, match="cache"):
        engram(torch.randn(2, 3, 8), cache=engram.empty_cache(2, dtype=torch.float64))
    with pytest.raises(ConfigError, match="max_ngram"):
        engram(torch.randn(2, 3, 8), cache=EngramModule(8, 4, 2, 11, max_ngram=2).empty_cache(2))
    assert engram.empty_cache(2, dtype=torch.bfloat16).dtype == torch.float32   # where hashing runs
    fusion = EngramLayerFusion(8, 4)
    with pytest.raises(ConfigError):
        EngramLayerFusion(8, 4, eps=0.0)
    with pytest.raises(ShapeError):
        fusion(torch.randn(2, 8), ngram=torch.randn(3, 8))
    with pytest.raises(ShapeError, match="hidden_size=8"):
        fusion(torch.randn(2, 7), ngram=torch.randn(2, 7))
    with pytest.raises(DTypeError):
        fusion(torch.randn(2, 8), ngram=torch.randn(2, 8).double())
    with pytest.raises(DTypeError, match="parameters"):
        fusion(torch.randn(2, 8).double(), ngram=torch.randn(2, 8).double())
    with pytest.raises(DeviceError):
        fusion(torch.randn(2, 8, device="meta"), ngram=torch.randn(2, 8, device="meta"))
