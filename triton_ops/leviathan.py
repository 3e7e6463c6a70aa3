"""Leviathan generator kernels: the spline chain (LayerNorm → sigmoid → basis → φ →
log-product) fused, with B and φ kept on chip.

torch      distinct ids (sync-free, bounded), digits, codebook gather-sum, the per-mode
           projection y0ᵀ = W·zᵀ ([h, d, U], so a seed dimension is a contiguous row of
           tokens), the output matmul [U, h·r]·[h·r, D], every weight-gradient matmul,
           and dM·M once for the backward.
products   every basis × coefficient product runs on the tensor cores with fp32
           accuracy: each fp32 operand is split into three bf16 pieces (24 significant
           bits; _split3) and six bf16 products are summed in fp32 (bf16x6; _dot6). The
           pieces multiply exactly, so the interpreter computes what the GPU does (bar
           the order of the fp32 sums). φ = Σ_g B_g + B·wd: the products see only the
           small wd part. bf16 and fp16 wd need one and two pieces.
forward    _fwd_kernel, grid (U/64, h, r/BLOCK_R): LayerNorm statistics in two passes,
           then a loop over the d seed dimensions: z̃ for 64 tokens, the dense normalised
           basis [64, κ] (3 non-zeros a row), φ for the rank tile (wgmma, M = 64
           tokens), running Σ log|φ| and sign parity. Writes M [U, h·r] (fp32) and the
           row statistics (mean, rstd) [h, U].
backward   _bwd_spline_kernel, grid (d/DIMS, h, r/BLOCK_R): a program owns DIMS seed
           dims (1 or 2) of one mode and one rank tile (≤ 64) and walks every token
           block, reading that tile of dM·M once for its dims. It recomputes z̃, B and φ,
           forms dφ, and reduces d wd[l, j]ᵀ = Σ_n dφᵀ·B (wgmma, M = rank), dγ and dβ in
           registers in a fixed order: deterministic, no atomics. dB = dφ·(1 + wd)ᵀ runs
           through the basis and LayerNorm chain to dx̂; past dφ that chain is linear, so
           each rank tile writes its own partial dx̂ [tiles, h, d, U], dγ, dβ.
           _bwd_norm_kernel, grid (U/32, h): sums the partials in tile order and applies
           the LayerNorm backward over d → dy0.
"""
from __future__ import annotations

from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import ConfigError, DTypeError
from laminae.primitives._token_ids import ids_in_range, nan_rows, safe_ids
from laminae.primitives.leviathan import TRITON_MAX_KNOTS, TRITON_MAX_RANK, leviathan_digits, leviathan_id_bound

from ._common import StaticCase, empty, empty_like, triton_dtype

__all__ = ["leviathan", "leviathan_spline"]

BLOCK_N = 64        # tokens per spline tile: the M of the tensor-core products (one wgmma warpgroup)
NORM_BLOCK_N = 32   # tokens per LayerNorm-backward program
BLOCK_D = 64        # seed dims per chunk of the LayerNorm passes
NUM_WARPS = 4


@triton.jit
def _basis(zt, grid, knot_ok, scale):
    """Normalised quadratic B-spline basis [BLOCK_N, BLOCK_K] and what its backward needs."""
    diff = zt[:, None] - grid[None, :]
    delta = tl.abs(diff) * scale
    w = tl.where(delta < 0.5, 0.75 - delta * delta, tl.where(delta < 1.5, 0.5 * (1.5 - delta) * (1.5 - delta), 0.0))
    w = tl.where(knot_ok[None, :], w, 0.0)
    z = tl.maximum(tl.sum(w, axis=1), 1e-12)
    return w, z, diff, delta


@triton.jit
def _z_tilde(y, mean, rstd, gam, bet):
    xhat = (y - mean) * rstd
    zt = tl.sigmoid((xhat * gam + bet) * 0.5)
    return xhat, tl.minimum(tl.maximum(zt, 0.0), 1.0)


@triton.jit
def _split3(x):
    """x = h + m + l in three bf16 pieces, each rounded from the exact remainder of the
    previous: 24 significant bits, |x − h − m − l| ≤ 2⁻²⁶·|x| (fp32 rounds at 2⁻²⁴)."""
    h = x.to(tl.bfloat16)
    rest = x - h.to(tl.float32)
    m = rest.to(tl.bfloat16)
    l = (rest - m.to(tl.float32)).to(tl.bfloat16)
    return h, m, l


@triton.jit
def _dot6(ah, am, al, bh, bm, bl, acc, B_PIECES: tl.constexpr):
    """acc + a·b with fp32 accuracy from bf16 tensor-core products of the pieces (bf16x6:
    the six products down to order 2⁻¹⁶, small ones first; the dropped ones are ≤ 2⁻²⁴·|a|·|b|).
    ``B_PIECES`` 1 (b is bf16) or 2 (b is fp16: h + m is exact) skips products of zero pieces."""
    if B_PIECES == 3:
        acc = tl.dot(ah, bl, acc)
    acc = tl.dot(al, bh, acc)
    if B_PIECES >= 2:
        acc = tl.dot(am, bm, acc)
        acc = tl.dot(ah, bm, acc)
    acc = tl.dot(am, bh, acc)
    return tl.dot(ah, bh, acc)


@triton.jit
def _coefficients(wd_ptr, md, KNOTS, R, knots, knot_ok, qq, q_ok):
    """The [κ, r] tile wd[l, j] of one (mode, seed dim) in bf16 pieces (exact for bf16/fp16 wd)."""
    wd = tl.load(wd_ptr + (md * KNOTS + knots[:, None]) * R + qq[None, :], mask=knot_ok[:, None] & q_ok[None, :],
                 other=0.0).to(tl.float32)
    return _split3(wd)


@triton.jit
def _fwd_kernel(y0t_ptr, gamma_ptr, beta_ptr, wd_ptr, grid_ptr, count_ptr, m_ptr, mean_ptr, rstd_ptr,
                N, D, KNOTS, R, H, scale,
                BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_D: tl.constexpr, WD_PIECES: tl.constexpr):
    pid_n = tl.program_id(0)
    mode = tl.program_id(1)
    pid_r = tl.program_id(2)
    n_valid = tl.load(count_ptr).to(tl.int32)
    start = pid_n * BLOCK_N
    rows = start + tl.arange(0, BLOCK_N)
    row_ok = rows < n_valid
    y_base = y0t_ptr + mode.to(tl.int64) * D * N
    # LayerNorm statistics, two passes over d in chunks (population variance, as the reference)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j0 in range(0, D, BLOCK_D):
        jj = j0 + tl.arange(0, BLOCK_D)
        m2 = (jj < D)[:, None] & row_ok[None, :]
        y = tl.load(y_base + jj[:, None].to(tl.int64) * N + rows[None, :], mask=m2, other=0.0).to(tl.float32)
        acc += tl.sum(y, axis=0)
    mean = acc / D
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j0 in range(0, D, BLOCK_D):
        jj = j0 + tl.arange(0, BLOCK_D)
        m2 = (jj < D)[:, None] & row_ok[None, :]
        y = tl.load(y_base + jj[:, None].to(tl.int64) * N + rows[None, :], mask=m2, other=0.0).to(tl.float32)
        c = tl.where(m2, y - mean[None, :], 0.0)
        acc += tl.sum(c * c, axis=0)
    rstd = 1.0 / tl.sqrt(acc / D + 1e-5)

    knots = tl.arange(0, BLOCK_K)
    knot_ok = knots < KNOTS
    grid = tl.load(grid_ptr + knots, mask=knot_ok, other=0.0)
    qq = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    q_ok = qq < R
    log_mag = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    negatives = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.int32)
    # blocks past the distinct-id count skip the spline loop and store zeros
    d_end = tl.where(start < n_valid, D, 0)
    for j in range(0, d_end):
        md = (mode * D + j).to(tl.int64)
        y = tl.load(y_base + j * N + rows, mask=row_ok, other=0.0).to(tl.float32)
        gam = tl.load(gamma_ptr + md).to(tl.float32)
        bet = tl.load(beta_ptr + md).to(tl.float32)
        _, zt = _z_tilde(y, mean, rstd, gam, bet)
        w, z, _, _ = _basis(zt, grid, knot_ok, scale)
        basis = w / z[:, None]
        c_h, c_m, c_l = _coefficients(wd_ptr, md, KNOTS, R, knots, knot_ok, qq, q_ok)
        b_h, b_m, b_l = _split3(basis)
        # φ = Σ_g B_g·(1 + wd_g) = Σ_g B_g + B·wd: the tensor cores multiply only the small
        # wd part, so their rounding is relative to |B·wd|, not to φ ≈ 1
        phi = tl.broadcast_to(tl.sum(basis, axis=1)[:, None], (BLOCK_N, BLOCK_R))
        phi = _dot6(b_h, b_m, b_l, c_h, c_m, c_l, phi, WD_PIECES)
        log_mag += tl.log(tl.abs(phi) + 1e-9)
        negatives += (phi < 0).to(tl.int32)
    m = tl.where((negatives % 2) == 1, -1.0, 1.0) * tl.exp(log_mag)
    m = tl.where(row_ok[:, None], m, 0.0)
    rows64 = rows.to(tl.int64)
    tl.store(m_ptr + rows64[:, None] * (H * R) + mode * R + qq[None, :], m,
             mask=(rows < N)[:, None] & q_ok[None, :])
    if pid_r == 0:
        stat = mode.to(tl.int64) * N + rows
        tl.store(mean_ptr + stat, tl.where(row_ok, mean, 0.0), mask=rows < N)
        tl.store(rstd_ptr + stat, tl.where(row_ok, rstd, 0.0), mask=rows < N)


@triton.jit
def _bwd_dim_step(y0t_ptr, dxhat_ptr, md, dim_ok, N, rows, row_ok, mean, rstd, a, gam, bet, c_h, c_m, c_l,
                  grid, knot_ok, scale, d_coeff_t, d_gam, d_bet, WD_PIECES: tl.constexpr):
    """One seed dimension of one token block: recompute z̃, B and φ; accumulate d wdᵀ, dγ,
    dβ; store dx̂. ``a`` = dM·M of the block's tokens [BLOCK_N, r]."""
    y = tl.load(y0t_ptr + md * N + rows, mask=row_ok, other=0.0).to(tl.float32)
    xhat, zt = _z_tilde(y, mean, rstd, gam, bet)
    w, z, _, _ = _basis(zt, grid, knot_ok, scale)
    basis = w / z[:, None]
    b_h, b_m, b_l = _split3(basis)
    phi = tl.broadcast_to(tl.sum(basis, axis=1)[:, None], a.shape)
    phi = _dot6(b_h, b_m, b_l, c_h, c_m, c_l, phi, WD_PIECES)
    # d/dφ of log(|φ| + eps), times dM·M; the parity is a constant (sign(0) = 0 as in autograd)
    d_phi = tl.where(phi > 0, a, tl.where(phi < 0, -a, 0.0)) / (tl.abs(phi) + 1e-9)
    p_h, p_m, p_l = _split3(d_phi)
    # dB_g = Σ_q dφ_q·(1 + wd[g, q])
    d_basis = tl.broadcast_to(tl.sum(d_phi, axis=1)[:, None], basis.shape)
    d_basis = _dot6(p_h, p_m, p_l, tl.trans(c_h), tl.trans(c_m), tl.trans(c_l), d_basis, WD_PIECES)
    # d wd[l, j]ᵀ += dφᵀ·B: the rank is the M side of the product (64 or 128 rows: wgmma)
    d_coeff_t = _dot6(tl.trans(p_h), tl.trans(p_m), tl.trans(p_l), b_h, b_m, b_l, d_coeff_t, 3)
    # through B = w / Z; the basis' distances are recomputed here rather than kept live
    # across the products (registers)
    d_w = (d_basis - tl.sum(basis * d_basis, axis=1)[:, None]) / z[:, None]
    diff = zt[:, None] - grid[None, :]
    delta = tl.abs(diff) * scale
    dw_ddelta = tl.where(delta < 0.5, -2.0 * delta, tl.where(delta < 1.5, delta - 1.5, 0.0))
    sgn = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
    d_zt = tl.sum(tl.where(knot_ok[None, :], d_w * dw_ddelta * sgn, 0.0), axis=1) * scale
    d_y = tl.where(row_ok, d_zt * 0.5 * zt * (1.0 - zt), 0.0)
    tl.store(dxhat_ptr + md * N + rows, d_y * gam, mask=row_ok & dim_ok)
    return d_coeff_t, d_gam + d_y * xhat, d_bet + d_y


@triton.jit
def _bwd_store(dwd_ptr, dgamma_ptr, dbeta_ptr, md, dim_ok, KNOTS, R, knots, knot_ok, qq, q_ok, d_coeff_t,
               d_gam, d_bet):
    tl.store(dwd_ptr + (md * KNOTS + knots[None, :]) * R + qq[:, None], d_coeff_t,
             mask=q_ok[:, None] & knot_ok[None, :] & dim_ok)
    tl.store(dgamma_ptr + md, tl.sum(d_gam, axis=0), mask=dim_ok)
    tl.store(dbeta_ptr + md, tl.sum(d_bet, axis=0), mask=dim_ok)


@triton.jit
def _bwd_dim_start(wd_ptr, gamma_ptr, beta_ptr, md, KNOTS, R, knots, knot_ok, qq, q_ok, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """What the spline backward holds for one (mode, seed dim): its wd tile in bf16
    pieces, γ and β, and zeroed dwd, dγ and dβ accumulators."""
    c_h, c_m, c_l = _coefficients(wd_ptr, md, KNOTS, R, knots, knot_ok, qq, q_ok)
    gam = tl.load(gamma_ptr + md).to(tl.float32)
    bet = tl.load(beta_ptr + md).to(tl.float32)
    return (c_h, c_m, c_l, gam, bet, tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32),
            tl.zeros([BLOCK_N], dtype=tl.float32), tl.zeros([BLOCK_N], dtype=tl.float32))


@triton.jit
def _bwd_spline_kernel(y0t_ptr, gamma_ptr, beta_ptr, wd_ptr, grid_ptr, count_ptr, a_ptr, mean_ptr, rstd_ptr,
                       dxhat_ptr, dwd_ptr, dgamma_ptr, dbeta_ptr,
                       N, D, KNOTS, R, H, scale,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                       DIMS: tl.constexpr, WD_PIECES: tl.constexpr):
    # program_id(0) walks the seed dims of one mode and rank tile, so the programs running
    # together share that slice of dM·M in L2; with DIMS = 2 each reads it once for two dims.
    # Past dφ the backward is linear, so a rank tile's share of dx̂, dγ, dβ is a partial of
    # its own ([rank tiles, ...], summed after), and d wd of its columns is complete.
    j0 = tl.program_id(0) * DIMS
    mode = tl.program_id(1)
    pid_r = tl.program_id(2)
    n_valid = tl.load(count_ptr).to(tl.int32)
    knots = tl.arange(0, BLOCK_K)
    knot_ok = knots < KNOTS
    grid = tl.load(grid_ptr + knots, mask=knot_ok, other=0.0)
    qq = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    q_ok = qq < R
    part = pid_r.to(tl.int64) * H * D                   # this rank tile's partials
    md0 = (mode * D + j0).to(tl.int64)
    c0_h, c0_m, c0_l, gam0, bet0, dc0, dg0, db0 = _bwd_dim_start(wd_ptr, gamma_ptr, beta_ptr, md0, KNOTS, R, knots,
                                                                 knot_ok, qq, q_ok, BLOCK_R, BLOCK_K, BLOCK_N)
    if DIMS == 2:
        # a last group past d repeats dim d-1 and stores nothing for it
        ok1 = j0 + 1 < D
        md1 = (mode * D + tl.minimum(j0 + 1, D - 1)).to(tl.int64)
        c1_h, c1_m, c1_l, gam1, bet1, dc1, dg1, db1 = _bwd_dim_start(wd_ptr, gamma_ptr, beta_ptr, md1, KNOTS, R,
                                                                     knots, knot_ok, qq, q_ok, BLOCK_R, BLOCK_K,
                                                                     BLOCK_N)
    dx_ptr = dxhat_ptr + part * N
    for start in range(0, n_valid, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        row_ok = rows < n_valid
        stat = mode.to(tl.int64) * N + rows
        mean = tl.load(mean_ptr + stat, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + stat, mask=row_ok, other=0.0)
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * (H * R) + mode * R + qq[None, :],
                    mask=row_ok[:, None] & q_ok[None, :], other=0.0)
        dc0, dg0, db0 = _bwd_dim_step(y0t_ptr, dx_ptr, md0, True, N, rows, row_ok, mean, rstd, a, gam0, bet0,
                                      c0_h, c0_m, c0_l, grid, knot_ok, scale, dc0, dg0, db0, WD_PIECES)
        if DIMS == 2:
            dc1, dg1, db1 = _bwd_dim_step(y0t_ptr, dx_ptr, md1, ok1, N, rows, row_ok, mean, rstd, a, gam1,
                                          bet1, c1_h, c1_m, c1_l, grid, knot_ok, scale, dc1, dg1, db1, WD_PIECES)
    _bwd_store(dwd_ptr, dgamma_ptr + part, dbeta_ptr + part, md0, True, KNOTS, R, knots, knot_ok, qq, q_ok, dc0,
               dg0, db0)
    if DIMS == 2:
        _bwd_store(dwd_ptr, dgamma_ptr + part, dbeta_ptr + part, md1, ok1, KNOTS, R, knots, knot_ok, qq, q_ok,
                   dc1, dg1, db1)


@triton.jit
def _dxhat(dxhat_ptr, off, m2, tiles, tile_stride):
    """dx̂ summed over the rank tiles' partials, in tile order."""
    dx = tl.load(dxhat_ptr + off, mask=m2, other=0.0)
    for t in range(1, tiles):
        dx += tl.load(dxhat_ptr + t * tile_stride + off, mask=m2, other=0.0)
    return dx


@triton.jit
def _norm_tile(y0t_ptr, dxhat_ptr, base, j0, D, N, rows, row_ok, mean, rstd, tiles, tile_stride,
               BLOCK_D: tl.constexpr):
    """Seed dims j0.. of the norm backward's rows: their indices, mask and offsets, x̂
    and dx̂ (both passes over the dims read the same)."""
    jj = j0 + tl.arange(0, BLOCK_D)
    m2 = (jj < D)[:, None] & row_ok[None, :]
    off = base + jj[:, None].to(tl.int64) * N + rows[None, :]
    xhat = (tl.load(y0t_ptr + off, mask=m2, other=0.0).to(tl.float32) - mean[None, :]) * rstd[None, :]
    return jj, m2, off, xhat, _dxhat(dxhat_ptr, off, m2, tiles, tile_stride)


@triton.jit
def _bwd_norm_kernel(y0t_ptr, dxhat_ptr, mean_ptr, rstd_ptr, count_ptr, dy0t_ptr, N, D, tiles, tile_stride,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    mode = tl.program_id(1)
    n_valid = tl.load(count_ptr).to(tl.int32)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_valid
    stat = mode.to(tl.int64) * N + rows
    mean = tl.load(mean_ptr + stat, mask=row_ok, other=0.0)
    rstd = tl.load(rstd_ptr + stat, mask=row_ok, other=0.0)
    base = mode.to(tl.int64) * D * N
    s1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j0 in range(0, D, BLOCK_D):
        jj, m2, off, xhat, dx = _norm_tile(y0t_ptr, dxhat_ptr, base, j0, D, N, rows, row_ok, mean, rstd, tiles,
                                           tile_stride, BLOCK_D)
        s1 += tl.sum(dx, axis=0)
        s2 += tl.sum(tl.where(m2, dx * xhat, 0.0), axis=0)
    s1 = s1 / D
    s2 = s2 / D
    for j0 in range(0, D, BLOCK_D):
        jj, m2, off, xhat, dx = _norm_tile(y0t_ptr, dxhat_ptr, base, j0, D, N, rows, row_ok, mean, rstd, tiles,
                                           tile_stride, BLOCK_D)
        dy0 = tl.where(m2, rstd[None, :] * (dx - s1[None, :] - xhat * s2[None, :]), 0.0)
        tl.store(dy0t_ptr + off, dy0.to(dy0t_ptr.dtype.element_ty), mask=(jj < D)[:, None] & (rows < N)[None, :])


def _block_k(num_knots: int) -> int:
    return max(16, triton.next_power_of_2(num_knots))


# bf16 pieces of wd: exact for bf16 (1) and fp16 (2: 11 significant bits), 24 bits for fp32
_WD_PIECES = {"fp32": 3, "fp16": 2, "bf16": 1}
# backward (BLOCK_N, DIMS, num_warps) per (κ-tile, r-tile[, dtype]): the largest token tile
# and most seed dims per program that ptxas builds without spilling (sm_90 static check; it
# sits at 255 registers for several, so the dtype matters at κ 16 × r 32). BLOCK_N 64 puts
# φ and dB on wgmma; 16 (κ 32 × r 64) leaves them on mma.sync.
_BWD_TILES = {(16, 16): (64, 2, 8), (16, 32): (64, 2, 4), (16, 64): (64, 1, 4),
              (32, 16): (64, 2, 4), (32, 32): (64, 1, 8), (32, 64): (16, 1, 8),
              (16, 32, "bf16"): (64, 2, 8), (16, 32, "fp16"): (64, 1, 4)}


def fwd_config(num_knots: int, rank: int, dtype: str) -> tuple[dict, int, int]:
    """(constexprs, num_warps, num_stages) of ``_fwd_kernel`` for κ knots, rank r and the
    parameters' dtype ("fp32", "bf16", "fp16"): the launch, the static cases and the
    tests all select through this function."""
    block_k, block_r = _block_k(num_knots), min(64, max(16, triton.next_power_of_2(rank)))
    const = dict(BLOCK_N=BLOCK_N, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_D=BLOCK_D, WD_PIECES=_WD_PIECES[dtype])
    return const, (8 if block_k * block_r >= 2048 else NUM_WARPS), 2


def bwd_config(num_knots: int, rank: int, dtype: str) -> tuple[dict, int, int]:
    """(constexprs, num_warps, num_stages) of ``_bwd_spline_kernel``: rank tiles of at most
    64 (a rank of 128 takes two programs per seed dim); two seed dims per program while
    their tiles fit the registers, one above (measured with the sm_90 check)."""
    block_k, block_r = _block_k(num_knots), min(64, max(16, triton.next_power_of_2(rank)))
    block_n, dims, warps = _BWD_TILES.get((block_k, block_r, dtype), _BWD_TILES[(block_k, block_r)])
    const = dict(BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_K=block_k, DIMS=dims, WD_PIECES=_WD_PIECES[dtype])
    return const, warps, 2


@triton_op("laminae::leviathan_spline", mutates_args=())
def leviathan_spline(
    y0t: torch.Tensor, head_norm_weight: torch.Tensor, head_norm_bias: torch.Tensor,
    head_spline_delta: torch.Tensor, knot_grid: torch.Tensor, count: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Spline chain of every mode for the first ``count`` columns of ``y0t``.

    y0t ``[h, d, U]`` (projection output, fp32); head_norm_* ``[h, d]``;
    head_spline_delta ``[h, d, κ, r]``; knot_grid ``[κ]`` fp32; count ``[1]`` int (valid
    columns, read on the device). Returns M ``[U, h·r]`` fp32 (zero past ``count``) and
    the LayerNorm mean and rstd ``[h, U]`` fp32.
    """
    h, d, n = y0t.shape
    knots, rank = head_spline_delta.shape[2], head_spline_delta.shape[3]
    m = empty((n, h * rank), dtype=torch.float32, device=y0t.device)
    mean = empty((h, n), dtype=torch.float32, device=y0t.device)
    rstd = empty((h, n), dtype=torch.float32, device=y0t.device)
    const, warps, stages = fwd_config(knots, rank, triton_dtype(head_spline_delta.dtype))
    if n:
        wrap_triton(_fwd_kernel)[(triton.cdiv(n, BLOCK_N), h, triton.cdiv(rank, const["BLOCK_R"]))](
            y0t, head_norm_weight, head_norm_bias, head_spline_delta, knot_grid, count, m, mean, rstd,
            n, d, knots, rank, h, float(knots - 1), **const, num_warps=warps, num_stages=stages,
        )
    return m, mean, rstd


@triton_op("laminae::leviathan_spline_bwd", mutates_args=())
def _leviathan_spline_bwd(
    a: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, y0t: torch.Tensor,
    head_norm_weight: torch.Tensor, head_norm_bias: torch.Tensor, head_spline_delta: torch.Tensor,
    knot_grid: torch.Tensor, count: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the spline chain from ``a`` = dM·M [U, h·r] (fp32)."""
    h, d, n = y0t.shape
    knots, rank = head_spline_delta.shape[2], head_spline_delta.shape[3]
    dev = y0t.device
    const, warps, stages = bwd_config(knots, rank, triton_dtype(head_spline_delta.dtype))
    tiles = triton.cdiv(rank, const["BLOCK_R"])
    # per rank tile: partial dx̂ (summed by the LayerNorm backward), dγ and dβ (summed here)
    dxhat = empty((tiles, h, d, n), dtype=torch.float32, device=dev)
    dwd = empty((h, d, knots, rank), dtype=torch.float32, device=dev)
    dgamma = empty((tiles, h, d), dtype=torch.float32, device=dev)
    dbeta = empty((tiles, h, d), dtype=torch.float32, device=dev)
    dy0t = empty_like(y0t)
    wrap_triton(_bwd_spline_kernel)[(triton.cdiv(d, const["DIMS"]), h, tiles)](
        y0t, head_norm_weight, head_norm_bias, head_spline_delta, knot_grid, count, a, mean, rstd,
        dxhat, dwd, dgamma, dbeta, n, d, knots, rank, h, float(knots - 1), **const,
        num_warps=warps, num_stages=stages,
    )
    if n:
        wrap_triton(_bwd_norm_kernel)[(triton.cdiv(n, NORM_BLOCK_N), h)](
            y0t, dxhat, mean, rstd, count, dy0t, n, d, tiles, h * d * n, BLOCK_N=NORM_BLOCK_N, BLOCK_D=BLOCK_D,
            num_warps=NUM_WARPS,
        )
    dtype = head_spline_delta.dtype
    return dy0t, dgamma.sum(0).to(dtype), dbeta.sum(0).to(dtype), dwd.to(dtype)


def _setup_context(ctx, inputs, output):
    y0t, gamma, beta, wd, grid, count = inputs
    m, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(y0t, gamma, beta, wd, grid, count, m, mean, rstd)


def _backward(ctx, dm, _dmean, _drstd):
    y0t, gamma, beta, wd, grid, count, m, mean, rstd = ctx.saved_tensors
    # dM·M once (each seed dim's program would otherwise read both)
    a = torch.zeros_like(m) if dm is None else (dm.float() * m).contiguous()
    dy0t, dgamma, dbeta, dwd = _leviathan_spline_bwd(a, mean, rstd, y0t, gamma, beta, wd, grid, count)
    return dy0t, dgamma, dbeta, dwd, None, None


leviathan_spline.register_autograd(_backward, setup_context=_setup_context)


def distinct_ids(flat_ids: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct ids without a host sync: a buffer of static size ``bound`` (≥ the number
    of distinct ids), the slot of every token, and the distinct count as a device tensor.

    Slots past the count hold id 0 (a valid id, so every row stays finite); the kernels
    read the count on the device and skip those slots.
    """
    sorted_ids, order = torch.sort(flat_ids)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot_sorted = torch.cumsum(first, 0) - 1
    slot = torch.empty_like(slot_sorted).scatter_(0, order, slot_sorted)
    # every token of a slot writes the same id, so the duplicate writes agree
    uniq = torch.zeros(bound, dtype=flat_ids.dtype, device=flat_ids.device).scatter_(0, slot_sorted, sorted_ids)
    return uniq, slot, (slot_sorted[-1:] + 1).to(torch.int32)


def leviathan(
    input_ids: torch.Tensor,
    codebooks: torch.Tensor,
    head_proj_weight: torch.Tensor,
    head_norm_weight: torch.Tensor,
    head_norm_bias: torch.Tensor,
    head_spline_delta: torch.Tensor,
    head_out_weight: torch.Tensor,
    knot_grid: torch.Tensor | None = None,
    *,
    vocab_size: int | None = None,
    unique_ids: bool = True,
) -> torch.Tensor:
    """Triton Leviathan generator with the signature of
    :func:`laminae.primitives.leviathan.leviathan_reference`: an id outside
    ``[0, vocab_size)`` (default b^k) gives a NaN row, without reading the ids on the host.

    ``unique_ids=True`` evaluates each distinct id of the call once (sync-free; see
    :func:`distinct_ids`), ``False`` evaluates every token. Parameters fp32/bf16/fp16;
    returns ``[*input_ids.shape, D]`` in their dtype.
    """
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise DTypeError(f"`input_ids` must have an integer dtype, got {input_ids.dtype}")
    dtype = codebooks.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise DTypeError(f"Triton Leviathan supports fp32/bf16/fp16 parameters, got {dtype}")
    num_coords, base, seed_dim = codebooks.shape
    num_modes, _, num_knots, rank = head_spline_delta.shape
    hidden = head_out_weight.shape[-1]
    if num_knots > TRITON_MAX_KNOTS or rank > TRITON_MAX_RANK:
        raise ConfigError(f"Triton Leviathan supports num_knots <= {TRITON_MAX_KNOTS} and rank <= "
                          f"{TRITON_MAX_RANK}, got num_knots={num_knots}, rank={rank}")
    shape = input_ids.shape
    flat = input_ids.reshape(-1).long()
    n = flat.numel()
    vocab_size = leviathan_id_bound(vocab_size, base, num_coords)
    # out-of-range ids are evaluated as id 0 (keeping the distinct-id bound) and their rows set to NaN
    valid = ids_in_range(flat, vocab_size)
    flat = safe_ids(flat, valid)
    if knot_grid is None:
        knot_grid = torch.linspace(0.0, 1.0, num_knots, device=codebooks.device)
    grid = knot_grid.to(torch.float32).contiguous()
    if unique_ids and n > 1:
        rows, slot, count = distinct_ids(flat, min(n, vocab_size))
    else:
        rows, slot, count = flat, None, torch.full((1,), n, dtype=torch.int32, device=flat.device)
    coords = leviathan_digits(rows, base, num_coords)
    # The seed and its projection stay fp32 (the spec's allowed deviation, and what NeoLLM's
    # own kernel does): rounding y0 to bf16 moves M by 0.3 % at init (measured), an error
    # the product over d factors accumulates. The d×d projection is small next to the spline.
    z = codebooks[0, coords[:, 0]].float()
    for i in range(1, num_coords):
        z = z + codebooks[i, coords[:, i]].float()
    y0t = torch.matmul(head_proj_weight.float(), z.t()).contiguous()                   # [h, d, U] fp32
    m, _, _ = leviathan_spline(y0t, head_norm_weight.contiguous(), head_norm_bias.contiguous(),
                               head_spline_delta.contiguous(), grid, count)
    table = m.to(dtype) @ head_out_weight.reshape(num_modes * rank, hidden)          # [U, D], fp32 accumulation
    out = table if slot is None else table[slot]
    return nan_rows(out, valid).reshape(*shape, hidden)


# one (κ, r) per tile size the launch can pick: κ-tile 16/32 × r-tile 16/32/64/128
CONFIG_SHAPES = [(knots, rank) for knots in (16, 32) for rank in (16, 32, 64, 128)]


# Every pointer is 16-byte aligned at launch, which Triton specialises as 16-divisible:
# y0t is a fresh projection, the parameters and the knot grid arrive contiguous (a copy
# where they were not), count, a = dM·M and the outputs are fresh allocations. KNOTS,
# R and D vary within a configuration, so no integer is declared.
def _pointers(signature: dict) -> tuple[str, ...]:
    return tuple(k for k, v in signature.items() if v.startswith("*"))


def static_cases() -> Iterator[StaticCase]:
    seen = set()
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        fwd = dict(y0t_ptr="*fp32", gamma_ptr=p, beta_ptr=p, wd_ptr=p, grid_ptr="*fp32", count_ptr="*i32",
                   m_ptr="*fp32", mean_ptr="*fp32", rstd_ptr="*fp32", N="i32", D="i32", KNOTS="i32", R="i32", H="i32",
                   scale="fp32")
        bwd = dict(y0t_ptr="*fp32", gamma_ptr=p, beta_ptr=p, wd_ptr=p, grid_ptr="*fp32", count_ptr="*i32",
                   a_ptr="*fp32", mean_ptr="*fp32", rstd_ptr="*fp32", dxhat_ptr="*fp32", dwd_ptr="*fp32",
                   dgamma_ptr="*fp32", dbeta_ptr="*fp32", N="i32", D="i32", KNOTS="i32", R="i32", H="i32",
                   scale="fp32")
        for knots, rank in CONFIG_SHAPES:
            const, warps, stages = fwd_config(knots, rank, dt)
            if ("fwd", dt, *const.values()) not in seen:
                seen.add(("fwd", dt, *const.values()))
                yield StaticCase("leviathan_fwd", _fwd_kernel, fwd, const, warps, stages,
                                 tags={"dtype": dt, "knots": knots, "rank": rank}, expect=_expect(const["BLOCK_N"]),
                                 divisible=_pointers(fwd))
            const, warps, stages = bwd_config(knots, rank, dt)
            if ("bwd", dt, *const.values()) in seen:
                continue
            seen.add(("bwd", dt, *const.values()))
            yield StaticCase("leviathan_bwd_spline", _bwd_spline_kernel, bwd, const, warps, stages,
                             tags={"dtype": dt, "knots": knots, "rank": rank},
                             expect=_expect(max(const["BLOCK_N"], const["BLOCK_R"])), divisible=_pointers(bwd))
    norm = dict(y0t_ptr="*fp32", dxhat_ptr="*fp32", mean_ptr="*fp32", rstd_ptr="*fp32", count_ptr="*i32",
                dy0t_ptr="*fp32", N="i32", D="i32", tiles="i32", tile_stride="i32")
    yield StaticCase("leviathan_bwd_norm", _bwd_norm_kernel, norm, dict(BLOCK_N=NORM_BLOCK_N, BLOCK_D=BLOCK_D),
                     NUM_WARPS, tags={"dtype": "fp32"}, divisible=_pointers(norm))


def _expect(rows: int) -> str:
    """The tensor-core kind of a spline kernel: wgmma where a product's M side (the token
    tile; in backward also the rank tile of d wdᵀ) is a full 64-row warpgroup tile, else
    mma.sync."""
    return "HGMMA" if rows >= 64 else "HMMA"


def tour_case(device: torch.device):
    from laminae.primitives.leviathan import LeviathanGenerator, leviathan_reference

    from .tour import TourCase

    torch.manual_seed(0)
    gen = LeviathanGenerator(vocab_size=1000, hidden_size=96, seed_dim=40, num_modes=3, num_knots=16, rank=24)
    with torch.no_grad():
        gen.head_norm_bias.normal_(0.0, 0.5)
    params = dict(zip(["codebooks", "head_proj_weight", "head_norm_weight", "head_norm_bias", "head_spline_delta",
                       "head_out_weight"], [p.detach().to(device) for p in gen._params()]))
    ids = torch.randint(0, 1000, (2, 37), generator=torch.Generator().manual_seed(1)).to(device)
    inputs = {"input_ids": ids, **params, "knot_grid": gen.knot_grid.to(device)}
    return TourCase("leviathan (V=1000, d=40, h=3, κ=16, r=24)", leviathan, leviathan_reference, inputs, list(params))
