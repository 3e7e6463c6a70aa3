"""The shared causal flash core (``triton_ops/_flash.py``): the split of the key and
query loops into unmasked and masked blocks, parity with small tiles of unequal
sides, the fused ``delta`` kernel and the Hopper tile tables."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given
from hypothesis import strategies as st

from laminae.primitives import ConfigError
from laminae.triton_ops import _flash
from laminae.triton_ops._flash import FlashTiles, flash_attention, flash_attention_reference

from .._helpers import DEVICE, assert_matches_float64, assert_parity, keep_mask, scales, seeds

# Unequal tile sides both ways, so the diagonal blocks of the forward/dq loops and of
# the dk/dv loop are cut by the causal bound in the middle of a tile.
TALL = FlashTiles(32, 16, 4, 32, 16, 4, 16, 32, 4)
WIDE = FlashTiles(16, 32, 4, 16, 32, 4, 32, 16, 4)


@contextmanager
def forced_tiles(t: FlashTiles):
    original = _flash.tiles
    _flash.tiles = lambda head_dim, dtype: t
    try:
        yield
    finally:
        _flash.tiles = original


# ----------------------------------------------------------------------------
# The loop split
# ----------------------------------------------------------------------------


@triton.jit
def _ranges_probe(out_ptr, S, N, WINDOW, HAS_WINDOW: tl.constexpr, KEYS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    if KEYS:
        lo, full_lo, full_hi, hi = _flash._key_blocks(pid, S, N, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N)
    else:
        lo, full_lo, full_hi, hi = _flash._query_blocks(pid, S, N, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N)
    tl.store(out_ptr + pid * 4, lo)
    tl.store(out_ptr + pid * 4 + 1, full_lo)
    tl.store(out_ptr + pid * 4 + 2, full_hi)
    tl.store(out_ptr + pid * 4 + 3, hi)


def _visibility(S: int, N: int, window: int | None) -> torch.Tensor:
    d = torch.arange(S)[:, None] + (N - S) - torch.arange(N)[None, :]
    return (d >= 0) & (d < (window or N + 1))


def _ranges(keys: bool, S, N, window, bm, bn) -> list[tuple[int, int, int, int]]:
    tiles = triton.cdiv(S, bm) if keys else triton.cdiv(N, bn)
    out = torch.full((tiles, 4), -99, dtype=torch.int32, device=DEVICE)
    _ranges_probe[(tiles,)](out, S, N, window or 0, HAS_WINDOW=bool(window), KEYS=keys, BLOCK_M=bm, BLOCK_N=bn)
    return [tuple(r) for r in out.cpu().tolist()]


@given(S=st.integers(1, 70), extra=st.integers(0, 40), bm=st.sampled_from([16, 32, 64]),
       bn=st.sampled_from([16, 32, 64]), window=st.one_of(st.none(), st.integers(1, 50)))
def test_loop_split_covers_every_visible_pair_and_its_full_blocks_need_no_mask(S, extra, bm, bn, window):
    """Forward/dq tiles walk key blocks, dk/dv tiles query blocks, in three ranges:
    masked, unmasked, masked. Every visible (query, key) pair is walked exactly once,
    nothing outside ``[lo, hi)`` is visible, and in the unmasked range every real
    row of the tile sees every key of the block."""
    N = S + extra
    vis = _visibility(S, N, window)
    for keys, tile, step in ((True, bm, bn), (False, bn, bm)):
        for pid, (lo, full_lo, full_hi, hi) in enumerate(_ranges(keys, S, N, window, bm, bn)):
            assert lo % step == 0 and full_lo % step == 0 and full_hi % step == 0, (lo, full_lo, full_hi)
            assert lo <= full_lo <= full_hi
            tile_vis = vis[pid * tile:(pid + 1) * tile] if keys else vis[:, pid * tile:(pid + 1) * tile].t()
            walked = torch.zeros(tile_vis.shape[1] + step, dtype=torch.int64)
            parts = [(lo, min(full_lo, hi), True), (full_lo, full_hi, False), (full_hi, hi, True)]
            for start, end, masked in parts:
                for b in range(start, end, step):
                    walked[b:b + step] += 1
                    if not masked:
                        block = tile_vis[:, b:b + step]
                        assert block.shape[1] == step and block.all(), (pid, b, keys)
            seen = tile_vis.any(0)
            assert (walked[:len(seen)][seen] == 1).all(), (pid, keys, lo, full_lo, full_hi, hi)
            assert (walked <= 1).all()


# ----------------------------------------------------------------------------
# Parity
# ----------------------------------------------------------------------------


@given(B=st.integers(1, 2), S=st.integers(1, 50), extra=st.integers(0, 20),
       hh=st.sampled_from([(1, 1), (2, 1), (4, 2)]), D=st.sampled_from([8, 16, 24]), masked=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 40)), t=st.sampled_from([TALL, WIDE]), scale=scales, seed=seeds)
# long enough for whole query blocks below every key tile: the dk/dv loop's unmasked range
@example(B=1, S=70, extra=5, hh=(2, 1), D=16, masked=True, window=None, t=TALL, scale=1.0, seed=3)
@example(B=1, S=70, extra=5, hh=(2, 1), D=16, masked=True, window=60, t=WIDE, scale=1.0, seed=4)
def test_kernels_match_reference_with_unequal_tiles(B, S, extra, hh, D, masked, window, t, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    H, HKV = hh
    N = S + extra
    inputs = {"q": (torch.randn(B, S, H, D, generator=gen) * scale).to(DEVICE),
              "k": (torch.randn(B, N, HKV, D, generator=gen) * scale).to(DEVICE),
              "v": (torch.randn(B, N, HKV, D, generator=gen) * scale).to(DEVICE),
              "attention_mask": keep_mask(B, N, gen) if masked else None, "window": window}
    with forced_tiles(t):
        assert_parity(flash_attention, flash_attention_reference, inputs, ["q", "k", "v"])


# ----------------------------------------------------------------------------
# The delta kernel and the backward launcher
# ----------------------------------------------------------------------------


@given(B=st.integers(1, 2), S=st.integers(1, 40), H=st.integers(1, 3), D=st.sampled_from([1, 8, 24, 64, 200]),
       seed=seeds)
def test_delta_kernel_is_rowsum_of_do_times_o(B, S, H, D, seed):
    gen = torch.Generator().manual_seed(seed)
    o, do = (torch.randn(B, S, H, D, generator=gen).to(DEVICE) for _ in range(2))
    expected = (o.double() * do.double()).sum(-1).permute(0, 2, 1)
    torch.testing.assert_close(_flash.flash_delta(o, do).double(), expected, atol=1e-5, rtol=1e-5)


def test_backward_with_fused_delta_equals_backward_with_given_delta():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 21, 4, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(2, 25, 2, 16, generator=gen).to(DEVICE) for _ in range(2))
    do = torch.randn(2, 21, 4, 16, generator=gen).to(DEVICE)
    mask = _flash.mask_arg(keep_mask(2, 25, gen))
    with forced_tiles(TALL):
        o, lse = _flash.flash_forward(q, k, v, mask)
        delta = (do * o).sum(-1).permute(0, 2, 1).contiguous()
        given_delta = _flash.flash_backward(q, k, v, mask, do, lse, delta)
        fused = _flash.flash_backward(q, k, v, mask, do, lse, None, o=o)
    for a, b in zip(fused, given_delta):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with pytest.raises(ConfigError, match="delta"):
        _flash.flash_backward(q, k, v, mask, do, lse, None)


# ----------------------------------------------------------------------------
# Tiles for Hopper
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("bd", [64, 128])
@pytest.mark.parametrize("window", [False, True])
def test_16bit_tiles_fill_warpgroups_and_every_candidate_is_a_static_case(bd, window):
    """wgmma needs ≥ 64 rows of a dot's M dimension per warpgroup (4 warps): queries in
    the forward and dq kernels, keys in dk/dv. Each autotune candidate the pruner can
    keep is a static case of that head dim, dtype and window, expected on HGMMA."""
    options = _flash.candidates(bd, False, window)
    assert len(options) > 1
    for t in options:
        for kind, rows in (("fwd", t.fwd_m), ("dq", t.dq_m), ("dkdv", t.dkdv_n)):
            m, n, warps, stages = t.of(kind)
            assert warps % 4 == 0 and rows >= 64, (kind, t)
            assert stages >= 2, (kind, t)  # every loop holding a tl.dot is software-pipelined
    for masked in (True, False):
        cases = [c for c in _flash.static_cases(windows=(window,))
                 if c.constexprs.get("BLOCK_D") == bd and c.tags["dtype"] == "bf16" and c.tags.get("div16")
                 and c.constexprs["HAS_MASK"] == masked]
        for kind, name in (("fwd", "flash_fwd"), ("dq", "flash_bwd_dq"), ("dkdv", "flash_bwd_dkdv")):
            kept = _flash._prune(kind)(_flash._TUNED[kind].configs,
                                       {"q_ptr": torch.empty(0, dtype=torch.bfloat16), "D": bd},
                                       BLOCK_D=bd, HAS_WINDOW=window, HAS_MASK=masked)
            kept = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept}
            for even_d in (True, False):                     # D == BLOCK_D, and a multiple of 16 below it
                launched = {(c.constexprs["BLOCK_M"], c.constexprs["BLOCK_N"], c.num_warps, c.num_stages)
                            for c in cases if c.name == name and c.constexprs["EVEN_D"] == even_d}
                assert kept == launched, (kind, masked, even_d)
            assert all(c.expect == "HGMMA" and "D" in c.divisible for c in cases if c.name == name)


# ----------------------------------------------------------------------------
# Every launchable 16-bit configuration, in its own dtype, against float64
# ----------------------------------------------------------------------------


_KINDS = ("fwd", "dq", "dkdv")


def _runs(options: tuple[FlashTiles, ...], seen: set) -> list[FlashTiles]:
    """Few tile sets that launch, between them, every (kernel, BLOCK_M, BLOCK_N) of
    ``options`` not in ``seen`` (warps and stages do not change what the interpreter
    computes): run i takes each kernel's i-th distinct tile, so one run checks three
    kernels' candidates at once."""
    per_kind = {kind: list(dict.fromkeys(t.of(kind) for t in options)) for kind in _KINDS}
    runs = []
    for i in range(max(len(v) for v in per_kind.values())):
        pick = {kind: v[i % len(v)] for kind, v in per_kind.items()}
        if {(kind, *pick[kind][:2]) for kind in _KINDS} <= seen:
            continue
        seen |= {(kind, *pick[kind][:2]) for kind in _KINDS}
        f, q, d = pick["fwd"], pick["dq"], pick["dkdv"]
        runs.append(FlashTiles(f[0], f[1], f[2], q[0], q[1], q[2], d[0], d[1], d[2], stages=f[3], dq_stages=q[3],
                               dkdv_stages=d[3]))
    return runs


def _autotuned() -> list[tuple[int, bool, bool, FlashTiles]]:
    """(head dim tile, window, keep mask, tiles) covering every candidate the CUDA
    autotuner's pruner can keep at head dims 64 and 128: masked causal launches,
    then unmasked windowed ones for what only those add (the unmasked 128×128
    forward, the window's dk/dv tiles)."""
    out = []
    for bd in (64, 128):
        seen: set = set()
        for window, masked in ((False, True), (True, False)):
            out += [(bd, window, masked, t) for t in _runs(_flash.candidates(bd, False, window, masked=masked), seen)]
    return out


_AUTOTUNED = _autotuned()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("run", range(len(_AUTOTUNED)),
                         ids=[f"d{bd}-{'win-nomask' if w else 'causal-mask'}-{i}"
                              for i, (bd, w, _, _) in enumerate(_AUTOTUNED)])
def test_every_autotune_candidate_matches_float64_in_its_own_dtype(run, dtype):
    """Each tile set the CUDA autotuner may pick at head dims 64 and 128 (through
    ``candidates``, the list its pruner keeps) runs in bf16 and in fp16 against the
    float64 truth: queries and keys span two of the largest tiles plus a ragged
    one, with a cached prefix of 3 keys, GQA 2:1, left padding and holes in the
    keep mask (or a window wider than a tile). The head dim fills the tile
    (``EVEN_D``) in one dtype and is 16 short of it in the other, alternating by run."""
    bd, window, masked, t = _AUTOTUNED[run]
    big = max(t.fwd_m, t.dq_m, t.dkdv_m, t.fwd_n, t.dq_n, t.dkdv_n)
    S, N = 2 * big + 5, 2 * big + 8
    D = bd if (dtype == torch.bfloat16) == (run % 2 == 0) else bd - 16
    gen = torch.Generator().manual_seed(run)
    mask = keep_mask(1, N, gen)
    mask[0, :4] = False
    inputs = {"q": torch.randn(1, S, 2, D, generator=gen).to(DEVICE, dtype),
              "k": torch.randn(1, N, 1, D, generator=gen).to(DEVICE, dtype),
              "v": torch.randn(1, N, 1, D, generator=gen).to(DEVICE, dtype),
              "attention_mask": mask.to(DEVICE) if masked else None, "window": big + 21 if window else None}
    with forced_tiles(t):
        assert_matches_float64(flash_attention, flash_attention_reference, inputs, ["q", "k", "v"])


# ----------------------------------------------------------------------------
# Split-K decoding
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,D,S,N,hh,masked", [
    (torch.bfloat16, 64, 1, 301, (4, 2), True),       # 5 splits of one 64-key block, the last ragged
    (torch.float16, 48, 3, 200, (2, 1), True),        # masked head dim, three new queries
    (torch.float32, 24, 1, 150, (2, 2), False),       # fp32: 64-key blocks at BLOCK_D 32
], ids=["bf16-d64", "fp16-d48", "fp32-d24"])
def test_split_k_decoding_matches_float64(dtype, D, S, N, hh, masked):
    """``flash_decode`` (keys split over programs, partials merged by a second
    kernel) equals the float64 truth for the newest S queries over a cache, with
    GQA, padding and holes in the keep mask and a row whose keys are all masked."""
    gen = torch.Generator().manual_seed(N)
    H, HKV = hh
    B = 2
    q = torch.randn(B, S, H, D, generator=gen).to(DEVICE, dtype)
    k, v = (torch.randn(B, N, HKV, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    mask = keep_mask(B, N, gen) if masked else None
    if masked:
        mask[1] = False                                   # batch row 1 sees nothing: output 0
    splits, per = _flash.decode_splits(B * H, N, _flash.decode_block_n(_flash.block_d(D), dtype == torch.float32))
    assert splits > 1 and (splits - 1) * per < N <= splits * per
    out = _flash.flash_decode(q, k, v, _flash.mask_arg(mask))
    ref = flash_attention_reference(q.double(), k.double(), v.double(), mask)
    err = torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)
    assert err <= {torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}[dtype], err
    if masked:
        assert (out[1] == 0).all()


def test_split_k_decoding_reads_cache_views_in_place_through_their_strides(monkeypatch):
    """``flash_decode`` over k/v that are the first N rows and HKV heads of larger
    NaN-filled storage (batch strides unlike N·HKV·D and unlike each other, a padded
    row stride) equals the float64 truth, and the kernel receives the views' own
    memory (no copy); a k whose head dim is strided is copied (and then v, whose row
    stride no longer matches k's), still right."""
    launched = []
    real = _flash.wrap_triton

    def recording(kernel):
        def launch(grid):
            def run(*args, **kwargs):
                launched.append(args)
                return real(kernel)[grid](*args, **kwargs)
            return run
        return type("Launch", (), {"__getitem__": lambda _, grid: launch(grid)})()

    monkeypatch.setattr(_flash, "wrap_triton", recording)
    gen = torch.Generator().manual_seed(7)
    B, S, H, HKV, D, N = 3, 2, 4, 2, 32, 150
    q = torch.randn(B, S, H, D, generator=gen).to(DEVICE, torch.bfloat16)
    k_store = torch.full((B, N + 37, HKV + 1, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    v_store = torch.full((B, N + 5, HKV + 1, D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    k, v = k_store[:, :N, :HKV], v_store[:, :N, :HKV]
    k.copy_(torch.randn(B, N, HKV, D, generator=gen))
    v.copy_(torch.randn(B, N, HKV, D, generator=gen))
    assert len({k.stride(0), v.stride(0), N * HKV * D}) == 3 and k.stride(1) == v.stride(1) != HKV * D
    mask = keep_mask(B, N, gen)
    ref = flash_attention_reference(q.double(), k.double(), v.double(), mask)
    assert _flash.decode_splits(B * H, N, _flash.decode_block_n(32, False))[0] > 1
    # heads interleaved within a row (head dim strided), its row stride equal to v's: copied
    k_cols = torch.full((B, N, D, HKV + 1), float("nan"), dtype=torch.bfloat16, device=DEVICE)[..., :HKV]
    k_cols = k_cols.transpose(2, 3)
    k_cols.copy_(k)
    assert k_cols.stride(1) == v.stride(1) and k_cols.stride(3) != 1
    for kk, in_place in ((k, True), (k_cols, False)):
        launched.clear()
        out = _flash.flash_decode(q, kk, v, _flash.mask_arg(mask))
        err = torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)
        assert err <= 4e-3, err
        assert (launched[0][1].data_ptr() == kk.data_ptr() and launched[0][2].data_ptr() == v.data_ptr()) == in_place


def test_fp32_head_dims_past_the_spill_free_tiles_are_refused():
    """fp32 stops at head dim 128 (no spill-free fp32 dk/dv tile at 256); 16-bit goes to 256."""
    from laminae.primitives import ShapeError
    from laminae.triton_ops._flash import FP32_MAX_HEAD_DIM

    q = torch.randn(1, 4, 2, FP32_MAX_HEAD_DIM + 8, device=DEVICE)
    with pytest.raises(ShapeError, match="fp32 supports head_dim <= 128"):
        flash_attention(q, q[:, :, :1], q[:, :, :1])
