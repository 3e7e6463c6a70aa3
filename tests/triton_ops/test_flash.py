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

from laminae.triton_ops.testing import FLOAT64_ABS_RMS

from .._helpers import DEVICE, FLOAT64_REL_RMSE, assert_matches_float64, keep_mask, scales, seeds

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
        # against float64, the absolute terms at the size of the scores: an fp32 reference is
        # itself a few 1e-5 off where a sharp softmax (scale 4) averages large values
        assert_matches_float64(flash_attention, flash_attention_reference, inputs, ["q", "k", "v"],
                               magnitude=max(1.0, scale) ** 2)


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
# Every launchable configuration, in its own dtype, against float64
# ----------------------------------------------------------------------------


_KINDS = ("fwd", "dq", "dkdv")
_KIND_OF = {"flash_fwd": "fwd", "flash_bwd_dq": "dq", "flash_bwd_dkdv": "dkdv"}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _launchable() -> dict[tuple, dict[str, dict[tuple[int, int], tuple[int, int]]]]:
    """``(dtype, BLOCK_D, EVEN_D, HAS_MASK, HAS_WINDOW, div16)`` -> each kernel's distinct
    ``(BLOCK_M, BLOCK_N)`` (with the warps and stages of its first static case): every
    forward/backward configuration the CUDA path can launch for any caller (an fp32
    forward output, a window), read from ``static_cases`` so that a configuration added
    there is run here. Other warps and stages of the same tile are left out: the
    interpreter computes the same with any."""
    groups: dict = {}
    for c in _flash.static_cases(out_dtypes=("fp32",), windows=(False, True)):
        if c.name in _KIND_OF:
            k = c.constexprs
            key = (c.tags["dtype"], k["BLOCK_D"], k["EVEN_D"], k["HAS_MASK"], k["HAS_WINDOW"],
                   bool(c.tags.get("div16")))
            tiles = groups.setdefault(key, {kind: {} for kind in _KINDS})[_KIND_OF[c.name]]
            tiles.setdefault((k["BLOCK_M"], k["BLOCK_N"]), (c.num_warps, c.num_stages))
    return groups


def _runs(per_kind: dict[str, dict[tuple[int, int], tuple[int, int]]]) -> list[FlashTiles]:
    """The fewest tile sets that launch every kernel's tiles of one group: run i takes
    each kernel's i-th tile, so one run checks three kernels' tiles at once."""
    runs = []
    for i in range(max(len(v) for v in per_kind.values())):
        pick = {kind: list(v.items())[i % len(v)] for kind, v in per_kind.items()}
        (f, (fw, fs)), (q, (qw, qs)), (d, (dw, ds)) = (pick[kind] for kind in _KINDS)
        runs.append(FlashTiles(*f, fw, *q, qw, *d, dw, stages=fs, dq_stages=qs, dkdv_stages=ds))
    return runs


def _head_dim(bd: int, even: bool, div16: bool) -> int:
    """A head dim that launches with this tile and these flags: the tile itself
    (``EVEN_D``), a multiple of 16 below it (the vector-load tiles), else one that is
    no multiple of 16 (a per-element head-dim mask)."""
    return bd if even else bd - 16 if div16 else bd - 8


_LAUNCHABLE = _launchable()


def _label(key) -> str:
    dt, bd, even, masked, window, div16 = key
    return (f"{dt}-d{_head_dim(bd, even, div16)}of{bd}-{'mask' if masked else 'nomask'}"
            f"-{'window' if window else 'causal'}")


def _close_to_float64(name: str, got: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> str | None:
    """``assert_matches_float64``'s bound: relative RMSE per dtype, with its absolute floor."""
    err = float(torch.linalg.vector_norm(got.double() - truth))
    ref = float(torch.linalg.vector_norm(truth))
    bound = FLOAT64_REL_RMSE[dtype] * ref + FLOAT64_ABS_RMS * max(1, truth.numel()) ** 0.5
    return None if err <= bound else f"{name}: relative RMSE {err / max(ref, 1e-30):.3e} > {FLOAT64_REL_RMSE[dtype]}"


@pytest.mark.parametrize("key", list(_LAUNCHABLE), ids=[_label(k) for k in _LAUNCHABLE])
def test_every_launch_configuration_matches_float64_in_its_own_dtype(key):
    """Each (dtype, head-dim tile, EVEN_D, keep mask, window) configuration the CUDA
    path can launch runs every tile its autotuner may pick (through ``candidates``,
    the list its pruner keeps) against the float64 truth, in its own dtype: queries
    and keys span two of the run's largest tiles plus a ragged one, with a cached
    prefix of 3 keys, GQA 2:1, left padding and holes in the keep mask, a window
    wider than a tile. The head dim is chosen so that the launcher's own
    ``block_d``/``even_d`` pick the group's flags. Where a caller stores the forward
    in fp32 (affine-scaled attention), the smallest tiles also run that store."""
    dt, bd, even, masked, window, div16 = key
    dtype, fp32 = _DTYPES[dt], dt == "fp32"
    per_kind = _LAUNCHABLE[key]
    D = _head_dim(bd, even, div16)
    assert (_flash.block_d(D), _flash.even_d(D, dtype)) == (bd, even)
    pruned = _flash.candidates(bd, fp32, window, D % 16 == 0, masked)
    for kind in _KINDS:
        assert {(*tile, *ws) for tile, ws in per_kind[kind].items()} <= {t.of(kind) for t in pruned}, kind
    big = max(max(t) for v in per_kind.values() for t in v)
    S, N = 2 * big + 5, 2 * big + 8
    gen = torch.Generator().manual_seed(list(_LAUNCHABLE).index(key))
    q = torch.randn(1, S, 2, D, generator=gen).to(DEVICE, dtype)
    k, v = (torch.randn(1, N, 1, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    do = torch.randn(1, S, 2, D, generator=gen).to(DEVICE, dtype)
    keep = None
    if masked:
        keep = keep_mask(1, N, gen)
        keep[0, :4] = False
    w = big + 21 if window else 0
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    truth = flash_attention_reference(*leaves, keep, w or None)
    truth.backward(do.double())
    mask = _flash.mask_arg(keep)
    failures = []
    for i, t in enumerate(_runs(per_kind)):
        with forced_tiles(t):
            if window:                                    # the launcher's window tiles leave them as named
                assert _flash.window_tiles(t, bd, fp32) == t
            if i < len(per_kind["fwd"]):
                o, lse = _flash.flash_forward(q, k, v, mask, window=w)
                failures.append(_close_to_float64(f"run {i} out", o, truth.detach(), dtype))
                if not fp32 and not window and bd == max(_flash._TILES_16BIT):
                    o32, _ = _flash.flash_forward(q, k, v, mask, out_dtype=torch.float32, window=w)
                    # the same accumulator, stored with the bits a 16-bit output rounds away
                    exact = torch.equal(o32.to(dtype), o) and not torch.equal(o32.to(dtype).float(), o32)
                    failures.append(None if exact else f"run {i}: the fp32 store is not the unrounded output")
            grads = _flash.flash_backward(q, k, v, mask, do, lse, None, w, o=o)
        failures += [_close_to_float64(f"run {i} d{n}", g, leaf.grad, dtype)
                     for n, g, leaf in zip("qkv", grads, leaves)]
    failures = [f for f in failures if f]
    assert not failures, failures


# ----------------------------------------------------------------------------
# Split-K decoding
# ----------------------------------------------------------------------------


_DECODES = [(c.tags["dtype"], c.constexprs["BLOCK_D"], c.constexprs["EVEN_D"], c.constexprs["HAS_MASK"],
             c.constexprs["BLOCK_N"]) for c in _flash.static_cases() if c.name == "flash_decode"]


@pytest.mark.parametrize("case", _DECODES, ids=[f"{dt}-d{_head_dim(bd, e, False)}of{bd}-{'mask' if m else 'nomask'}"
                                                for dt, bd, e, m, _ in _DECODES])
def test_split_k_decoding_matches_float64(case):
    """``flash_decode`` (keys split over programs, partials merged by a second kernel)
    at every configuration it launches with (read from ``static_cases``) equals the
    float64 truth for the newest 1 or 3 queries over a cache: three splits, the last
    ragged, GQA 2:1, padding and holes in the keep mask and a batch row whose keys are
    all masked (output 0)."""
    dt, bd, even, masked, block_n = case
    dtype, fp32 = _DTYPES[dt], dt == "fp32"
    D = _head_dim(bd, even, False)
    assert (_flash.block_d(D), _flash.even_d(D, dtype)) == (bd, even)
    assert _flash.decode_block_n(bd, fp32) == block_n
    B, S, N = 2, 1 + 2 * (_DECODES.index(case) % 2), 2 * block_n + 5
    gen = torch.Generator().manual_seed(_DECODES.index(case))
    q = torch.randn(B, S, 2, D, generator=gen).to(DEVICE, dtype)
    k, v = (torch.randn(B, N, 1, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    mask = keep_mask(B, N, gen) if masked else None
    if masked:
        mask[1] = False                                   # batch row 1 sees nothing: output 0
    splits, per = _flash.decode_splits(B * 2, N, block_n)
    assert splits == 3 and (splits - 1) * per < N < splits * per
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
