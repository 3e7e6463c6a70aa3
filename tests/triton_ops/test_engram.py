import contextlib
import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from laminae.primitives import ConfigError, DTypeError, ShapeError
from laminae.primitives.engram import (
    EngramLayerFusion,
    EngramModule,
    MultiHeadHashLookup,
    engram_bucket_ids,
    engram_fusion_gate_reference,
    engram_fusion_reference,
    engram_lookup_reference,
)
from laminae.triton_ops.engram import (
    BLOCK_C,
    BLOCK_D,
    BLOCK_M,
    BWD_TILES,
    GROUP_HEADS,
    HEADS_PER_LAUNCH,
    engram_bucket_ids_triton,
    engram_fusion,
    engram_fusion_gate,
    engram_fusion_gate_fused,
    engram_lookup,
    engram_lookup_fused,
)

from .._decoding import prefill_then_decode
from .._helpers import DEVICE, assert_matches_float64, assert_parity, scales, seeds


engram_mod = importlib.import_module("laminae.triton_ops.engram")


@contextlib.contextmanager
def bwd_chunk(block_e):
    """Set the table-gradient chunk (16 is the GPU's and the smallest a tl.dot takes):
    busy buckets cross chunk edges (head, middle and carry pieces, the fix-up walk)."""
    saved = BWD_TILES["BLOCK_E"]
    BWD_TILES["BLOCK_E"] = block_e
    try:
        yield
    finally:
        BWD_TILES["BLOCK_E"] = saved


def _padding(kind, batch, length, gen):
    """None, left padding (ragged), or random holes: a (batch, length) bool keep mask."""
    if kind == "none" or length == 0:
        return None
    if kind == "left":
        pads = torch.randint(0, length + 1, (batch,), generator=gen)
        return (torch.arange(length)[None, :] >= pads[:, None]).to(DEVICE)
    return (torch.rand(batch, length, generator=gen) > 0.3).to(DEVICE)


def _lookup_inputs(batch, seq, heads, max_ngram, table_size, dc, d, prefix_len, legacy, scale, seed,
                   dtype=torch.float32, table_dtype=torch.float32, padding="none"):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    lookup = MultiHeadHashLookup(heads, table_size, dc, d, max_ngram, legacy_trunc=legacy)
    # scale sweeps the input magnitude (the sign hash ignores it; the legacy hash does not)
    compressed = torch.randn(batch, seq, dc, generator=gen) * scale
    inp = {
        "compressed": compressed.to(DEVICE, dtype),
        "hash_projs": lookup.hash_projs().to(DEVICE),
        "bit_weights": lookup.bit_weights.to(DEVICE),
        "tables": (torch.randn(heads, table_size, d, generator=gen) * scale).to(DEVICE, table_dtype),
        "legacy_trunc": legacy,
    }
    if prefix_len:
        inp["prefix"] = (torch.randn(batch, prefix_len, dc, generator=gen) * scale).to(DEVICE, dtype)
    mask = _padding(padding, batch, seq, gen)
    if mask is not None:
        # padded contents are NaN: they must never reach a kept position's read
        inp["compressed"] = torch.where(mask[..., None], inp["compressed"], float("nan"))
        inp["attention_mask"] = mask
        if prefix_len:
            inp["prefix_mask"] = _padding("holes", batch, prefix_len, gen)
    return inp


lookup_shapes = dict(
    batch=st.integers(1, 2), seq=st.integers(1, 24), heads=st.integers(1, 3), max_ngram=st.integers(1, 3),
    # tiny tables: many rows share a bucket, so the gradient accumulation is exercised
    table_size=st.integers(1, 17), dc=st.integers(1, 40), d=st.integers(1, 70), prefix_len=st.integers(0, 2),
    legacy=st.booleans(), scale=scales, seed=seeds,
)


@given(padding=st.sampled_from(["none", "left", "holes"]), block_e=st.sampled_from([16, 32]), **lookup_shapes)
def test_lookup_matches_reference_fp32(batch, seq, heads, max_ngram, table_size, dc, d, prefix_len, legacy,
                                       scale, seed, padding, block_e):
    inp = _lookup_inputs(batch, seq, heads, max_ngram, table_size, dc, d, prefix_len, legacy, scale * 3, seed,
                         padding=padding)
    with bwd_chunk(block_e):
        assert_parity(engram_lookup, engram_lookup_reference, inp, ["tables"])
    # the kernel addressed exactly the reference's buckets
    got = engram_bucket_ids_triton(**inp)
    full = inp["compressed"] if not prefix_len else torch.cat([inp["prefix"], inp["compressed"]], 1)
    keep = inp.get("attention_mask")
    if keep is not None and prefix_len:
        keep = torch.cat([inp["prefix_mask"], keep], 1)
    expected = engram_bucket_ids(full, inp["hash_projs"], inp["bit_weights"], table_size,
                                 legacy_trunc=legacy, attention_mask=keep)[:, prefix_len:]
    assert torch.equal(got, expected)


@given(**(lookup_shapes | dict(seq=st.integers(1, 12), d=st.integers(1, 40))))
def test_table_gradient_is_reproducible_and_independent_of_chunking(batch, seq, heads, max_ngram, table_size, dc, d,
                                                                   prefix_len, legacy, scale, seed):
    inp = _lookup_inputs(batch, seq, heads, max_ngram, table_size, dc, d, prefix_len, legacy, scale, seed)
    tables = inp["tables"].clone().requires_grad_()
    out = engram_lookup(**(inp | {"tables": tables}))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    grads = []
    for block_e in (32, 16, 16):  # the chunk is chosen when the backward runs
        with bwd_chunk(block_e):
            grads.append(torch.autograd.grad(out, tables, g, retain_graph=True)[0])
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(grads[1], grads[2])  # no atomics: reproducible bit for bit


@pytest.mark.parametrize("block_e", [16, 64])
def test_lookup_with_many_collisions_and_hot_buckets(block_e):
    # one bucket: every (row, order, head) lands on row 0 of each table; with 16-entry
    # chunks each table's bucket spans several chunks (head, middle and carry pieces)
    inp = _lookup_inputs(2, 10, 2, 3, 1, 8, 33, 2, False, 1.0, 5)
    with bwd_chunk(block_e):
        assert_parity(engram_lookup, engram_lookup_reference, inp, ["tables"])


def _expected_ids(inp):
    prefix_len = inp["prefix"].shape[1] if "prefix" in inp else 0
    full = inp["compressed"] if not prefix_len else torch.cat([inp["prefix"], inp["compressed"]], 1)
    keep = inp.get("attention_mask")
    if keep is not None and prefix_len:
        keep = torch.cat([inp["prefix_mask"], keep], 1)
    return engram_bucket_ids(full, inp["hash_projs"], inp["bit_weights"], inp["tables"].shape[1],
                             legacy_trunc=inp["legacy_trunc"], attention_mask=keep)[:, prefix_len:]


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _lookup_launches(heads, legacy):
    """(BLOCK_H, FIRST, LAST) of each launch ``engram_lookup_fused`` makes for ``heads``
    heads: one launch of up to HEADS_PER_LAUNCH heads, else launches of GROUP_HEADS
    through the fp32 scratch."""
    per_launch = heads if heads <= HEADS_PER_LAUNCH else GROUP_HEADS
    groups = -(-heads // per_launch)
    block_h = engram_mod.lookup_tiles(heads, legacy)[0]
    return {(block_h, g == 0, g == groups - 1) for g in range(groups)}


def _lookup_runs():
    """(dtype, table dtype, legacy hash, head counts): the fewest heads that make each
    static lookup case's launch; one call of a head count runs its forward launches
    and the table-gradient kernels in that dtype."""
    runs = {}
    for case in engram_mod.static_cases():
        if case.name != "engram_fwd":
            continue
        k = case.constexprs
        heads = min(h for h in range(1, 3 * HEADS_PER_LAUNCH)
                    if (k["BLOCK_H"], k["FIRST"], k["LAST"]) in _lookup_launches(h, k["LEGACY"]))
        tiles = (k["BLOCK_H"], k["BLOCK_C"], k["BLOCK_BITS"])
        runs.setdefault((case.tags["dtype"], case.tags["table"], k["LEGACY"]), {})[heads] = tiles
    return [(*key, tuple(sorted(h.items()))) for key, h in sorted(runs.items())]


LOOKUP_RUNS = _lookup_runs()


# Every lookup launch the CUDA path picks (engram.static_cases()), in its own dtypes,
# output and table gradient against the float64 truth by relative RMSE at the dtype's
# fixed bound (the same-dtype reference would hash 16-bit hyperplanes into other
# buckets, so it is no yardstick here). 1, 2, 3 and 5 heads are one launch of BLOCK_H
# 1, 2, 4 and 8; 9 heads are three launches of 4 (first, middle, last) through the
# fp32 scratch. Rows span a full BLOCK_M tile and a ragged second, compress_dim a full
# BLOCK_C chunk and a ragged second, out_dim two BLOCK_D chunks of the forward and of
# the table gradient, ragged; a cached prefix is read and a dropped position restarts
# the n-grams. The sorted gradient entries span several BLOCK_E chunks.
@pytest.mark.parametrize("dtype, table_dtype, legacy, heads", LOOKUP_RUNS,
                         ids=[f"{r[0]}-{r[1]}-{'legacy' if r[2] else 'sign'}" for r in LOOKUP_RUNS])
def test_every_lookup_launch_matches_float64(dtype, table_dtype, legacy, heads):
    assert (HEADS_PER_LAUNCH, GROUP_HEADS) == (8, 4)
    dtype, table_dtype = _DTYPES[dtype], _DTYPES[table_dtype]
    ids = {}

    def lookup(**kw):
        out, ids["got"] = engram_lookup_fused(*engram_mod._prepare_lookup(
            kw["compressed"], kw["hash_projs"], kw["bit_weights"], kw["tables"], kw["prefix"], kw["legacy_trunc"],
            kw["attention_mask"], kw["prefix_mask"]), legacy)
        return out

    seq, d = BLOCK_M + 3, max(BLOCK_D, BWD_TILES["BLOCK_D"]) + 6
    for h, tiles in heads:
        assert engram_mod.lookup_tiles(h, legacy)[:3] == tiles
        inp = _lookup_inputs(1, seq, h, 2, 29, tiles[1] + 5, d, 1, legacy, 1.0, h, dtype=dtype,
                             table_dtype=table_dtype)
        keep = torch.ones(1, seq, dtype=torch.bool, device=DEVICE)
        keep[0, 7] = False
        inp["compressed"] = torch.where(keep[..., None], inp["compressed"], float("nan"))
        inp |= {"attention_mask": keep, "prefix_mask": torch.ones(1, 1, dtype=torch.bool, device=DEVICE)}
        # the table gradient's kernels do not depend on the forward's launches: one run of
        # them per dtype pair, at the most heads (the most sorted entries)
        grads = ["tables"] if h == heads[-1][0] else []
        assert_matches_float64(lookup, engram_lookup_reference, inp, grads, dtype=dtype)
        assert torch.equal(ids["got"].view(1, seq, 2, h), _expected_ids(inp)), h


def _gate_runs():
    """(dtype, BLOCK_F, forward BLOCK_M, backward BLOCK_M) of every static gate case."""
    runs = {}
    for case in engram_mod.static_cases():
        if case.name.startswith("fusion_gate"):
            key = (case.tags["dtype"], case.constexprs["BLOCK_F"])
            runs.setdefault(key, {})[case.name] = case.constexprs["BLOCK_M"]
    return [(*key, m["fusion_gate_fwd"], m["fusion_gate_bwd"]) for key, m in sorted(runs.items())]


GATE_RUNS = _gate_runs()


@pytest.mark.parametrize("dtype, block_f, block_m, block_m_bwd", GATE_RUNS, ids=[f"{r[0]}-{r[1]}" for r in GATE_RUNS])
def test_every_fusion_gate_launch_matches_float64(dtype, block_f, block_m, block_m_bwd):
    """Forward and backward at each row width the CUDA path picks, in its own dtype:
    a ragged row (F = BLOCK_F - 3) and two row tiles of each kernel, the last ragged
    where a tile holds more than one row. Relative RMSE to the float64 truth at the
    dtype's fixed bound (measured: bf16 ≤ 1.8e-3, fp16 ≤ 2.5e-4, fp32 ≤ 3.6e-6)."""
    f = block_f - 3
    assert engram_mod._gate_blocks(f)[:2] == (block_m, block_f)
    assert engram_mod._gate_blocks(f, backward=True)[:2] == (block_m_bwd, block_f)
    rows = max(block_m, block_m_bwd) + 1
    gen = torch.Generator().manual_seed(block_f)
    inp = {k: torch.randn(rows, f, generator=gen).to(DEVICE, _DTYPES[dtype])
           for k in ("hidden_low", "key_low", "value")}
    inp |= {k: (1 + 0.3 * torch.randn(f, generator=gen)).to(DEVICE)
            for k in ("hidden_norm_weight", "ngram_norm_weight")}
    assert_matches_float64(engram_fusion_gate, engram_fusion_gate_reference, inp, list(inp), dtype=_DTYPES[dtype])


def test_legacy_hash_truncates_to_int64_like_the_reference():
    """|a| between 2^31 and 2^40: truncated to int32 it saturates (GPU) or wraps (CPU)
    and picks another bucket than the reference's int64 truncation. One nonzero
    coordinate per position makes every hash product a single rounding, so the
    kernel's and the reference's |a| agree bit for bit even where the fp32 spacing
    exceeds 1."""
    inp = _lookup_inputs(1, 9, 2, 3, 1009, 16, 8, 0, True, 1.0, 3)
    gen = torch.Generator().manual_seed(4)
    big = torch.zeros(1, 9, 16)
    big[0, torch.arange(9), torch.randint(0, 16, (9,), generator=gen)] = 2.0**37 * (1 + torch.rand(9, generator=gen))
    inp["compressed"] = big.to(DEVICE)
    a = torch.einsum("bsc,hc->bsh", big.double(), inp["hash_projs"][0].double().cpu()).abs()
    assert (a > 2**31).sum() > 9 and (a < 2**40).all()
    assert torch.equal(engram_bucket_ids_triton(**inp), _expected_ids(inp))
    assert_parity(engram_lookup, engram_lookup_reference, inp, ["tables"])


def test_lookup_accepts_a_list_of_tables_and_long_rows():
    inp = _lookup_inputs(1, 5, 2, 3, 9, 70, 130, 0, False, 1.0, 6)
    tables = [t.clone().requires_grad_() for t in inp["tables"].unbind(0)]
    out = engram_lookup(inp["compressed"], inp["hash_projs"], inp["bit_weights"], tables)
    ref_tables = [t.detach().clone().requires_grad_() for t in tables]
    ref = engram_lookup_reference(inp["compressed"], inp["hash_projs"], inp["bit_weights"], ref_tables)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, tables, g), torch.autograd.grad(ref, ref_tables, g)):
        torch.testing.assert_close(a, b)


def _gate_inputs(rows, fusion_dim, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        "hidden_low": (torch.randn(rows, fusion_dim, generator=gen) * scale).to(DEVICE),
        "key_low": (torch.randn(rows, fusion_dim, generator=gen) * scale).to(DEVICE),
        "value": (torch.randn(rows, fusion_dim, generator=gen) * scale).to(DEVICE),
        "hidden_norm_weight": (1 + 0.3 * torch.randn(fusion_dim, generator=gen)).to(DEVICE),
        "ngram_norm_weight": (1 + 0.3 * torch.randn(fusion_dim, generator=gen)).to(DEVICE),
    }


def _agreement_slack(inp, units=2.0):
    """What the rounding of the agreement may cost each compared tensor of the gate.

    ``a = Σ h·k / √F`` is a sum of F rounded products: fp32 orders of summation
    leave it up to about ``u·Σ|h·k|/√F`` from the truth (``units`` = 2 of those is 2.4× the
    worst of 200 random orders on the case below), and the gate's gradient scales as
    ``1/√|a|``, so a row whose ``a`` is small next to ``Σ|h·k|`` changes by
    ``δa·(1/(2|a|) + 1/√|a|)`` relative. Each such row's share of every output and
    gradient (the float64 reference with the upstream gradient of that row alone) gets
    that relative slack; well-conditioned rows add nothing, so they stay under the fixed
    bound."""
    import math

    from laminae.primitives.engram import GATE_FLOOR
    from laminae.triton_ops._parity import _run

    x = {k: v.detach().double().cpu() for k, v in inp.items()}
    rows, f = x["value"].shape
    h = torch.nn.functional.rms_norm(x["hidden_low"], (f,), x["hidden_norm_weight"], 1e-6)
    k = torch.nn.functional.rms_norm(x["key_low"], (f,), x["ngram_norm_weight"], 1e-6)
    a = ((h * k).sum(-1) / math.sqrt(f)).abs().clamp_min(GATE_FLOOR)
    delta = units * torch.finfo(torch.float32).eps / 2 * (h * k).abs().sum(-1) / math.sqrt(f)
    # past 2 the sign of a itself is rounding noise: the row may be anything up to twice its size
    rel = (delta * (0.5 / a + a.rsqrt())).clamp_max(2.0)
    up = _run(engram_fusion_gate_reference, x, list(x), None, 0, None)[2][0]  # the upstream the check draws
    slack = dict.fromkeys(["out0"] + [f"d{n}" for n in x], 0.0)
    for r in torch.nonzero(rel > 1e-6).flatten().tolist():
        up_r = torch.zeros_like(up)
        up_r[r] = up[r]
        outs, grads, _ = _run(engram_fusion_gate_reference, x, list(x), [up_r], 0, None)
        slack["out0"] += float(rel[r] * outs[0][r].detach().norm())
        for n, g in grads.items():
            slack[f"d{n}"] += float(rel[r] * g.norm())
    return slack


@given(rows=st.integers(1, 40), fusion_dim=st.integers(1, 70), scale=scales, seed=seeds)
def test_fusion_gate_matches_float64(rows, fusion_dim, scale, seed):
    """Judged against float64: a row whose agreement is small next to the products it
    sums is as far from the truth in any fp32 order (the fp32 reference too), so that
    row's share is bounded by what its rounding may cost (:func:`_agreement_slack`)."""
    inp = _gate_inputs(rows, fusion_dim, scale, seed)
    assert_matches_float64(engram_fusion_gate, engram_fusion_gate_reference, inp, list(inp),
                           slack=_agreement_slack(inp))


def test_fusion_gate_row_with_a_small_agreement():
    """The thorough profile's case: row 11's agreement is 6.5e-4 against Σ|h·k|/√F = 4.2,
    so the kernel's order of summation (as typical as any: 1.9 σ of random fp32 orders)
    puts its gradients 8e-5 from float64, where the fp32 reference happened to land
    within 1e-6. The slack covers that row; without it the check fails, and a ×1.001
    error of a norm weight's gradient fails with it."""
    inp = _gate_inputs(32, 66, 4.0, 3562)
    slack = _agreement_slack(inp)
    assert_matches_float64(engram_fusion_gate, engram_fusion_gate_reference, inp, list(inp), slack=slack)
    with pytest.raises(AssertionError, match="dhidden_norm_weight"):
        assert_matches_float64(engram_fusion_gate, engram_fusion_gate_reference, inp, list(inp))

    def off(hidden_low, key_low, value, hidden_norm_weight, ngram_norm_weight):
        w = hidden_norm_weight + (hidden_norm_weight - hidden_norm_weight.detach()) * 1e-3  # same value, ∂ ×1.001
        return engram_fusion_gate(hidden_low, key_low, value, w, ngram_norm_weight)

    with pytest.raises(AssertionError, match="dhidden_norm_weight"):
        assert_matches_float64(off, engram_fusion_gate_reference, inp, list(inp), slack=slack)


def test_fusion_gate_below_the_clamp_floor():
    """|a| < 1e-6 takes the clamp branch of the signed square root, whose gradient is
    0: key rows are made orthogonal (under the norm weights) to their hidden rows, so
    a is rounding-sized there; other rows stay ordinary. A backward that forgets the
    clamp gives d(hidden_low) of order 1/√|a| on those rows."""
    gen = torch.Generator().manual_seed(3)
    rows, f = 6, 24
    hidden = torch.randn(rows, f, generator=gen)
    w_h, w_k = 1 + 0.3 * torch.randn(f, generator=gen), 1 + 0.3 * torch.randn(f, generator=gen)
    key = torch.randn(rows, f, generator=gen)
    c = hidden * w_h * w_k
    orthogonal = key - (key * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True) * c
    # rows 0-3: |a| = 4e-7, below the floor, but far above rounding so sign(a) is
    # the same in every implementation (sign(a) at a ≈ 1e-9 would be rounding noise)
    rms = lambda t, w: (t.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()  # noqa: E731
    target = 4e-7 * torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    shift = target * rms(hidden[:4], w_h) * rms(orthogonal[:4], w_k) * f ** 0.5
    key[:4] = orthogonal[:4] + shift * c[:4] / (c[:4] * c[:4]).sum(-1, keepdim=True)
    inp = {"hidden_low": hidden.to(DEVICE), "key_low": key.to(DEVICE),
           "value": torch.randn(rows, f, generator=gen).to(DEVICE),
           "hidden_norm_weight": w_h.to(DEVICE), "ngram_norm_weight": w_k.to(DEVICE)}
    h = torch.nn.functional.rms_norm(hidden, (f,), w_h, 1e-6)
    k = torch.nn.functional.rms_norm(key, (f,), w_k, 1e-6)
    a = (h * k).sum(-1) / f ** 0.5
    assert (a[:4].abs() < 1e-6).all() and (a[:4].abs() > 1e-7).all() and (a[4:].abs() > 1e-3).all()
    assert_parity(engram_fusion_gate, engram_fusion_gate_reference, inp, list(inp))


def test_fusion_gate_wide_rows_and_leading_dims():
    gen = torch.Generator().manual_seed(1)
    f = 300
    inp = {k: torch.randn(2, 3, f, generator=gen).to(DEVICE) for k in ("hidden_low", "key_low", "value")}
    inp |= {k: (1 + 0.3 * torch.randn(f, generator=gen)).to(DEVICE) for k in ("hidden_norm_weight", "ngram_norm_weight")}
    assert_parity(engram_fusion_gate, engram_fusion_gate_reference, inp, list(inp))


def test_fusion_matches_reference_with_all_parameter_grads():
    gen = torch.Generator().manual_seed(2)
    h, f = 40, 24
    inp = {
        "hidden": torch.randn(2, 7, h, generator=gen).to(DEVICE),
        "ngram": torch.randn(2, 7, h, generator=gen).to(DEVICE),
        "hidden_down_weight": (torch.randn(f, h, generator=gen) * 0.2).to(DEVICE),
        "key_proj_weight": (torch.randn(f, h, generator=gen) * 0.2).to(DEVICE),
        "value_proj_weight": (torch.randn(f, h, generator=gen) * 0.2).to(DEVICE),
        "out_proj_weight": (torch.randn(h, f, generator=gen) * 0.2).to(DEVICE),
        "hidden_norm_weight": (1 + 0.1 * torch.randn(f, generator=gen)).to(DEVICE),
        "ngram_norm_weight": (1 + 0.1 * torch.randn(f, generator=gen)).to(DEVICE),
    }
    assert_parity(engram_fusion, engram_fusion_reference, inp, list(inp))


def test_modules_backends_agree_and_decode_equals_forward():
    torch.manual_seed(3)
    engram = EngramModule(24, 8, num_heads=2, table_size=13, max_ngram=3, gate_init_bias=0.5).to(DEVICE)
    engram.gate.backend = "reference"  # the DERF gate kernel is tested with DERF
    fusion = EngramLayerFusion(24, 16).to(DEVICE)
    with torch.no_grad():
        fusion.out_proj.weight.normal_()
    x = torch.randn(2, 9, 24, device=DEVICE)
    upstream = torch.randn_like(x)
    results = []
    for backend in ("reference", "triton"):
        engram.lookup.backend = fusion.backend = backend
        res = engram(x)
        y = fusion(x, ngram=res.retrieved)
        loss = (res.output * upstream).sum() + (y * y).sum()
        params = [t.weight for t in engram.lookup.tables] + list(fusion.parameters())
        results.append((res.retrieved, y, torch.autograd.grad(loss, params)))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])
    for a, b in zip(results[1][2], results[0][2]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # prefill 4 tokens, then one token at a time (n-grams straddle every boundary)
    engram.lookup.backend = "triton"
    full = engram(x).retrieved
    res = engram(x[:, :4], cache=engram.empty_cache(x.shape[0]))
    reads, state = [res.retrieved], res.cache
    for t in range(4, 9):
        res = engram(x[:, t:t + 1], cache=state)
        reads.append(res.retrieved)
        state = res.cache
    assert torch.equal(torch.cat(reads, 1), full)


def test_triton_rejects_float64_and_unsupported_sizes():
    inp = _lookup_inputs(1, 4, 2, 2, 5, 8, 6, 0, False, 1.0, 0)
    with pytest.raises(DTypeError):
        engram_lookup(**(inp | {"compressed": inp["compressed"].double()}))
    with pytest.raises(DTypeError):
        engram_lookup(**(inp | {"tables": inp["tables"].double()}))
    with pytest.raises(DTypeError, match="fp32 or in compressed's dtype"):
        engram_lookup(**(inp | {"tables": inp["tables"].half()}))
    x = torch.randn(3, 8, dtype=torch.float64, device=DEVICE)
    w = torch.ones(8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(DTypeError):
        engram_fusion_gate(x, x, x, w, w)
    big = torch.randn(1, 4097, device=DEVICE)
    with pytest.raises(ConfigError, match="4096"):
        engram_fusion_gate(big, big, big, torch.ones(4097, device=DEVICE), torch.ones(4097, device=DEVICE))
    nine = MultiHeadHashLookup(1, 5, 4, 3, max_ngram=9)
    with pytest.raises(ConfigError, match="max_ngram"):
        engram_lookup(torch.randn(1, 3, 4, device=DEVICE), nine.hash_projs().to(DEVICE), nine.bit_weights.to(DEVICE),
                      torch.randn(1, 5, 3, device=DEVICE))


def test_opcheck_schema_and_autograd_registration():
    inp = _lookup_inputs(2, 5, 2, 3, 7, 8, 6, 0, False, 1.0, 1)
    tables = [t.clone().requires_grad_() for t in inp["tables"].unbind(0)]
    fit = torch.tensor([1, 2, 3, 0, 1] * 2, dtype=torch.int32, device=DEVICE)
    args = (inp["compressed"], inp["hash_projs"], inp["bit_weights"], tables, fit, 0, False)
    torch.library.opcheck(engram_lookup_fused, args, test_utils=("test_schema", "test_autograd_registration"))
    gate_args = tuple(torch.randn(5, 12, device=DEVICE, requires_grad=True) for _ in range(3))
    gate_args += tuple(torch.ones(12, device=DEVICE, requires_grad=True) for _ in range(2)) + (1e-6,)
    torch.library.opcheck(engram_fusion_gate_fused, gate_args,
                          test_utils=("test_schema", "test_autograd_registration"))


@pytest.mark.gpu
def test_opcheck_full_gpu():
    inp = _lookup_inputs(2, 64, 2, 3, 97, 32, 128, 0, False, 1.0, 1)
    tables = [t.clone().requires_grad_() for t in inp["tables"].unbind(0)]
    fit = torch.full((2 * 62,), 3, dtype=torch.int32, device="cuda")
    torch.library.opcheck(engram_lookup_fused, (inp["compressed"], inp["hash_projs"], inp["bit_weights"], tables, fit,
                                                2, False))
    gate_args = tuple(torch.randn(64, 256, device="cuda", requires_grad=True) for _ in range(3))
    gate_args += tuple(torch.ones(256, device="cuda", requires_grad=True) for _ in range(2)) + (1e-6,)
    torch.library.opcheck(engram_fusion_gate_fused, gate_args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, table_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                (torch.bfloat16, torch.float32)])
def test_lookup_low_precision(dtype, table_dtype):
    inp = _lookup_inputs(2, 200, 4, 3, 4096, 64, 512, 2, False, 1.0, 0, dtype=dtype, table_dtype=table_dtype)
    assert_parity(engram_lookup, engram_lookup_reference, inp, ["tables"], dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fusion_gate_low_precision(dtype):
    gen = torch.Generator().manual_seed(0)
    inp = {k: torch.randn(513, 256, generator=gen).to("cuda", dtype) for k in ("hidden_low", "key_low", "value")}
    inp |= {k: (1 + 0.1 * torch.randn(256, generator=gen)).to("cuda", dtype)
            for k in ("hidden_norm_weight", "ngram_norm_weight")}
    assert_parity(engram_fusion_gate, engram_fusion_gate_reference, inp, list(inp), dtype=dtype)


@pytest.mark.gpu
def test_compile_fullgraph_smoke():
    engram = EngramModule(256, 64, num_heads=4, table_size=4096).cuda()
    engram.gate.backend = "reference"
    fusion = EngramLayerFusion(256, 128).cuda()
    x = torch.randn(2, 64, 256, device="cuda")

    def step(x):
        read = engram.retrieve(x)
        return fusion(x, ngram=read) + engram(x, retrieved=read).output

    y = torch.compile(step, fullgraph=True)(x)
    y.sum().backward()
    torch.testing.assert_close(y, step(x))


def test_fusion_gate_backward_programs_stride_over_row_blocks():
    # 300 rows of F=16: 5 blocks of 64 rows for at most 4 programs here, so one program
    # accumulates the norm-weight gradients of two blocks (the persistent loop)
    gen = torch.Generator().manual_seed(7)
    f = 16
    inp = {k: torch.randn(300, f, generator=gen).to(DEVICE) for k in ("hidden_low", "key_low", "value")}
    inp |= {k: (1 + 0.3 * torch.randn(f, generator=gen)).to(DEVICE) for k in ("hidden_norm_weight", "ngram_norm_weight")}
    assert_parity(engram_fusion_gate, engram_fusion_gate_reference, inp, list(inp))


# ----------------------------------------------------------------------------
# Padding (attention_mask) through the module, both backends
# ----------------------------------------------------------------------------


def _masked_engram(backend):
    torch.manual_seed(4)
    engram = EngramModule(24, 8, num_heads=2, table_size=13, max_ngram=3, gate_init_bias=0.5, backend=backend)
    engram.gate.backend = "reference"  # the DERF gate kernel is tested with DERF
    return engram.to(DEVICE)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_left_padded_row_equals_the_unpadded_row(backend):
    """Row 0 is ``a`` (7 tokens) after 3 NaN pads, row 1 is ``b`` (10 tokens): each kept
    read equals the sequence run alone, pads output exactly zero, and the gradients
    (tables and x) equal the two unpadded runs' with none at the pads."""
    engram = _masked_engram(backend)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, 7, 24, generator=gen).to(DEVICE), torch.randn(1, 10, 24, generator=gen).to(DEVICE)
    x = torch.cat([torch.cat([torch.full((1, 3, 24), float("nan"), device=DEVICE), a], 1), b], 0).requires_grad_()
    mask = torch.ones(2, 10, dtype=torch.bool, device=DEVICE)
    mask[0, :3] = False
    upstream = torch.randn(2, 10, 24, generator=gen).to(DEVICE)
    tables = [t.weight for t in engram.lookup.tables]
    res = engram(x, attention_mask=mask)
    loss = (res.output * upstream).sum() + (res.retrieved * upstream).sum()
    grads = torch.autograd.grad(loss, [x, *tables])
    assert (res.output[0, :3] == 0).all() and (res.retrieved[0, :3] == 0).all()
    assert (grads[0][0, :3] == 0).all() and torch.isfinite(grads[0]).all()
    expected_tables = [torch.zeros_like(t) for t in tables]
    for row, seq, start in ((0, a, 3), (1, b, 0)):
        seq = seq.clone().requires_grad_()
        alone = engram(seq)
        torch.testing.assert_close(res.output[row:row + 1, start:], alone.output)
        torch.testing.assert_close(res.retrieved[row:row + 1, start:], alone.retrieved)
        g = upstream[row:row + 1, start:]
        parts = torch.autograd.grad((alone.output * g).sum() + (alone.retrieved * g).sum(), [seq, *tables])
        torch.testing.assert_close(grads[0][row:row + 1, start:], parts[0])
        expected_tables = [e + p for e, p in zip(expected_tables, parts[1:])]
    for got, want in zip(grads[1:], expected_tables):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_hole_restarts_the_ngrams(backend):
    """A dropped position in the middle splits the row: the tokens after it read as
    the start of a new sequence, the hole reads zero, NaN in it reaches nothing."""
    engram = _masked_engram(backend)
    x = torch.randn(2, 9, 24, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones(2, 9, dtype=torch.bool, device=DEVICE)
    mask[:, 4] = False
    poisoned = torch.where(mask[..., None], x, float("nan"))
    with torch.no_grad():
        out = engram(poisoned, attention_mask=mask)
        before, after = engram(x[:, :4]), engram(x[:, 5:])
    assert (out.output[:, 4] == 0).all() and (out.retrieved[:, 4] == 0).all()
    torch.testing.assert_close(out.retrieved[:, :4], before.retrieved)
    torch.testing.assert_close(out.retrieved[:, 5:], after.retrieved)
    torch.testing.assert_close(out.output[:, 5:], after.output)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("prefill", [1, 4])
def test_left_padded_prefill_then_steps_equals_the_unpadded_run(backend, prefill):
    """Row 0 has 3 pads: a prefill of 1 or 4 positions leaves padding inside the
    cached n-gram window, which the steps after it must not read across."""
    engram = _masked_engram(backend)
    x = torch.randn(2, 9, 24, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = torch.ones(2, 9, dtype=torch.bool, device=DEVICE)
    mask[0, :3] = False
    x = torch.where(mask[..., None], x, float("nan"))
    with torch.no_grad():
        full = engram(x, attention_mask=mask)
        (reads, outs), cache = prefill_then_decode(engram, x, cache=engram.empty_cache(2), prefill=prefill,
                                                   attention_mask=mask, field=("retrieved", "output"))
        alone = engram(x[:1, 3:])
    torch.testing.assert_close(reads, full.retrieved, atol=0, rtol=0)
    torch.testing.assert_close(outs, full.output)
    torch.testing.assert_close(full.retrieved[:1, 3:], alone.retrieved)


def test_mask_errors():
    engram = _masked_engram("triton")
    x = torch.randn(2, 5, 24, device=DEVICE)
    with pytest.raises(DTypeError, match="additive"):
        engram(x, attention_mask=torch.where(torch.rand(2, 5) > 0.5, 0.0, float("-inf")).to(DEVICE))
    with pytest.raises(ShapeError, match="attention_mask"):
        engram(x, attention_mask=torch.ones(2, 4, dtype=torch.bool, device=DEVICE))
    inp = _lookup_inputs(1, 4, 2, 2, 5, 8, 6, 0, False, 1.0, 0)
    with pytest.raises(ShapeError, match="prefix_mask"):
        engram_lookup(**inp, prefix_mask=torch.ones(1, 2, dtype=torch.bool, device=DEVICE))
