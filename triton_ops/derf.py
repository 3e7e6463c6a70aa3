"""DERF attention and DERF context gate kernels.

Attention (flash-style: no [S, N] matrix is ever stored; extra memory is O(S)):

Forward   grid (query blocks, B·H). Each program walks the key blocks up to its
          causal limit: s = q·kᵀ·scale, w = γ·(erf(α·s + b) + 1)/2 where visible,
          acc += w·v, den += Σw; writes out = acc/(den + 1e-8) and den (fp32).
          16-bit inputs: the P·V operand is w over the row's running max |w|, rounded,
          and den sums the same rounded weights (a lone key's out is exactly its v);
          the fp32 out is written as well, for δ.
Backward  with rden = 1/(den + 1e-8) and delta_i = dout_i·out_i (fp32 out):
            dw_ij = (dout_i·v_j − delta_i)·rden_i
            dz_ij = dw_ij·γ/√π·exp(−z_ij²)          z = α·s + b, zero where masked
          dK/dV kernel, grid (key blocks, B·H_kv): for every query head of the kv
          group and every query block at or after the key block, accumulates
            dv_j += Σ_i w_ij·rden_i·dout_i,   dk_j += Σ_i α·dz_ij·q_i·scale.
          delta_i by a row kernel (one read of dout and out); rden in the kernels.
          dQ kernel, grid (query blocks, B·H): dq_i = Σ_j α·dz_ij·k_j·scale, plus
          per-program partial sums Σ dz·s, Σ dz for dα, db and Σ_i δ_i·rden_i·1e-8/γ
          for dγ (reduced in torch; they sit here rather than in the dK/dV kernel,
          whose two [BLOCK_N, D] accumulators already fill the registers).
          Both recompute s and w through the same tile helpers; nothing is
          written twice, so no atomics.
The kernels walk the blocks every query sees whole first (no causal test, only the
key mask), then the diagonal ones with the per-pair causal test (except the
configurations in UNSPLIT, which test every block in one loop).

(erf(z) + 1)/2 is evaluated as erfc(−z)/2 = exp(−z²)·t·P(t) (t = 1/(1 + |z|/2), P a
degree-10 fit of erfcx; relative error ≲ 4e-6 in fp32 out to underflow), so the
backward's exp(−z²) serves the weight and its slope alike (one exponential per pair).
Written as erf(z) + 1 it cancels catastrophically for
z ≲ −3 in fp32 (erf(−4) rounds to −1), and attention rows whose weights all lie
there would then depend on the last bit of erf.

Context gate: out = r·g, g = γ·(erf(α·ℓ + b) + 1)/2, one elementwise pass over
[rows, F]; the backward pass writes dr, dℓ and per-program column partial sums for
dα, db, dγ. The projection ℓ = proj([r, x]) stays in torch (cuBLAS).
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import DTypeError, ShapeError
from laminae.primitives.derf import check_derf_attention_inputs

from ._common import StaticCase, dot_precision, empty, empty_like, num_programs_for_rows, triton_dtype

__all__ = ["derf_attention", "derf_context_gate", "derf_attention_op", "derf_context_gate_op"]

MAX_HEAD_DIM = 256
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)

# Tiles, per kernel and input precision, for each padded head dim:
# BLOCK_D -> (BLOCK_M, BLOCK_N, num_warps, num_stages). fp32 dots run on FMA units
# (exact products), which hold their operands in registers: smaller tiles. 16-bit
# tiles up to head dim 128 put ≥ 64 rows per warpgroup on the M side of every dot
# (BLOCK_M for the forward and dQ, BLOCK_N for dK/dV), so ptxas emits wgmma (HGMMA);
# dK/dV at 128 takes 8 warps (two warpgroups split the [64, 128] dk/dv accumulators)
# to stay spill-free. At head dim 256 every wgmma tiling tried spills (the fp32
# accumulators alone fill the registers), so those tiles stay on mma.sync; the 16-bit
# forward there walks keys 16 at a time (32 spills next to the running-max rescale).
# Every entry is compiled for sm_90 by the static check (no spills, shared <= 227 KB).
TILES = {
    ("fwd", "fp32"): {16: (32, 32, 4, 2), 32: (32, 32, 4, 2), 64: (32, 32, 4, 2), 128: (32, 32, 4, 2),
                      256: (32, 16, 4, 2)},
    ("fwd", "16bit"): {16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (64, 64, 4, 2), 128: (64, 32, 4, 2),
                       256: (64, 16, 8, 2)},
    ("dkdv", "fp32"): {16: (32, 32, 4, 2), 32: (32, 32, 8, 2), 64: (32, 32, 8, 2), 128: (32, 16, 8, 2),
                       256: (16, 16, 8, 2)},
    ("dkdv", "16bit"): {16: (32, 64, 4, 2), 32: (32, 64, 4, 2), 64: (32, 64, 4, 2), 128: (32, 64, 8, 2),
                        256: (32, 16, 8, 2)},
    ("dq", "fp32"): {16: (32, 32, 4, 2), 32: (32, 32, 4, 2), 64: (32, 32, 4, 2), 128: (32, 32, 4, 2),
                     256: (16, 16, 4, 2)},
    ("dq", "16bit"): {16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (64, 64, 4, 2), 128: (64, 32, 4, 2),
                      256: (32, 16, 4, 2)},
}


def _tiles(kind: str, dtype: torch.dtype, block_d: int) -> tuple[int, int, int, int]:
    return TILES[(kind, "fp32" if dtype == torch.float32 else "16bit")][block_d]


# Configurations that walk their blocks in one loop with the causal test on every
# block: the second loop of the full/diagonal split (its own pipelined loads, its own
# copy of the body) spills there on sm_90 (static check: 12–2,000 B), while the single
# loop does not.
UNSPLIT = {("fwd", "fp32", 64), ("fwd", "fp32", 256), ("fwd", "16bit", 256), ("dq", "fp32", 128),
           ("dq", "16bit", 128), ("dkdv", "fp32", 128), ("dkdv", "fp32", 256)}


def _split(kind: str, dtype: torch.dtype, block_d: int) -> bool:
    """Whether this configuration walks full blocks and diagonal blocks in separate loops."""
    return (kind, "fp32" if dtype == torch.float32 else "16bit", block_d) not in UNSPLIT


DELTA_BLOCK_M = 16
DELTA_WARPS = 4

GATE_BLOCK_R = 16
GATE_BLOCK_F = 128
GATE_WARPS = 4


# ----------------------------------------------------------------------------
# Shared device helpers
# ----------------------------------------------------------------------------


@triton.jit
def _erf_plus_one_half(z, gauss):
    """(erf(z) + 1)/2 = erfc(−z)/2, accurate in relative terms for every z, given
    ``gauss`` = exp(−z²), which the derivative needs too: one exponential serves both.

    erfc(x)/2 = exp(−x²)·t·P(t) for x = |z|, t = 1/(1 + 0.5·x), P of degree 10 fitted
    to erfcx(x)/(2t) on t ∈ (0, 1] (relative error 1.1e-8 in float64; in fp32 the
    rounding of x² inside the exponential dominates: ≲ 4e-6 out to underflow)."""
    x = tl.abs(z)
    t = 1.0 / (1.0 + 0.5 * x)
    p = 0.021195816822681804
    p = -0.11551384755328534 + t * p
    p = 0.2432450224449441 + t * p
    p = -0.22364439550415813 + t * p
    p = 0.06363758316377867 + t * p
    p = -0.02865002739612948 + t * p
    p = 0.04650766898943596 + t * p
    p = 0.08768750267797801 + t * p
    p = 0.12344034990668673 + t * p
    p = 0.14104692496759885 + t * p
    p = 0.14104739740432265 + t * p
    half_erfc = t * p * gauss
    return tl.where(z < 0, half_erfc, 1.0 - half_erfc)


@triton.jit
def _erf_parts(z):
    """((erf(z) + 1)/2, exp(−z²)): the DERF weight shape and, up to 1/√π, its slope."""
    gauss = tl.exp(-z * z)
    return _erf_plus_one_half(z, gauss), gauss


# ----------------------------------------------------------------------------
# Attention tile pieces (shared by the forward, dK/dV and dQ kernels)
# ----------------------------------------------------------------------------


@triton.jit
def _load_rows(base, rows, stride, cols, row_ok, col_ok):
    """A [rows, cols] tile of a row-major view (unit last stride), 0 outside."""
    return tl.load(base + rows[:, None] * stride + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _store_rows(base, rows, stride, cols, row_ok, col_ok, value):
    tl.store(base + rows[:, None] * stride + cols[None, :], value.to(base.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _keys_kept(mask_ptr, b, stride_mb, offs_n, n_ok, HAS_MASK: tl.constexpr):
    """[BLOCK_N] bool: key exists and is not padding."""
    kept = n_ok
    if HAS_MASK:
        kept = kept & (tl.load(mask_ptr + b * stride_mb + offs_n, mask=n_ok, other=0) != 0)
    return kept


@triton.jit
def _rden(den_ptr, rows, row_ok):
    """1/(den + 1e-8) for the given rows of one (batch, head), 0 past the end."""
    return tl.where(row_ok, 1.0 / (tl.load(den_ptr + rows, mask=row_ok, other=0.0) + 1e-8), 0.0)


@triton.jit
def _derf_grad_tile(s, dp, delta, rden, visible, alpha, bias, gamma):
    """The backward's per-pair terms on a tile of scores, in either orientation
    (``delta``/``rden`` arrive broadcast along the query axis of ``s``):

        half = (erf(z) + 1)/2 with z = α·s + b,
        dw   = (dout_i·v_j − δ_i)·rden_i        on visible pairs, 0 elsewhere,
        dz   = dw·γ/√π·exp(−z²)                 (dLoss/dz)."""
    z = alpha * s + bias
    half, gauss = _erf_parts(z)
    dw = tl.where(visible, (dp - delta) * rden, 0.0)
    dz = dw * (gamma * 0.5641895835477563) * gauss
    return half, dw, dz


# ----------------------------------------------------------------------------
# Attention kernels
# ----------------------------------------------------------------------------


@triton.jit
def _full_keys(first_qpos, BLOCK_N: tl.constexpr):
    """End of the key blocks from 0 that a query at ``first_qpos`` and every later one
    sees whole (the causal bound needs no test there): a multiple of BLOCK_N."""
    return ((first_qpos + 1) // BLOCK_N) * BLOCK_N


@triton.jit
def _visible(offs_n, qpos, kept, CAUSAL: tl.constexpr):
    """[BLOCK_M, BLOCK_N] (or [1, BLOCK_N] off the diagonal): the pairs that count."""
    if CAUSAL:
        return (offs_n[None, :] <= qpos[:, None]) & kept[None, :]
    else:
        return kept[None, :]


@triton.jit
def _fwd_keys(acc, den, w_max, q, k_base, v_base, mask_ptr, b, stride_mb, stride_kn, stride_vn,
              offs_d, d_ok, qpos, lo, hi, N, alpha, bias, gamma, scale,
              CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
              LOW_PRECISION: tl.constexpr):
    """The forward over key blocks [lo, hi); CAUSAL: test the causal bound per pair."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        k = _load_rows(k_base, offs_n, stride_kn, offs_d, n_ok, d_ok)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        kept = _keys_kept(mask_ptr, b, stride_mb, offs_n, n_ok, HAS_MASK)
        visible = _visible(offs_n, qpos, kept, CAUSAL)
        half, _ = _erf_parts(alpha * s + bias)
        v = _load_rows(v_base, offs_n, stride_vn, offs_d, n_ok, d_ok)
        w = tl.where(visible, gamma * half, 0.0)
        if LOW_PRECISION:
            # 16-bit weights for the tensor cores, relative to the row's running max |w|
            # (fp16 would flush the erf tail, w < 6e-5, to subnormals and 0), and the
            # same rounded weights summed into den: out stays a weighted mean of the
            # values, exactly v_j in a row that sees one key (whose other gradients
            # the truth makes 0).
            w_new = tl.maximum(w_max, tl.max(tl.abs(w), axis=1))
            ref = tl.where(w_new > 0, w_new, 1.0)
            corr = w_max / ref   # 0 until a key is visible, when acc and den are still 0
            w = (w / ref[:, None]).to(v.dtype)
            den = den * corr + tl.sum(w.to(tl.float32), axis=1)
            acc = acc * corr[:, None] + tl.dot(w, v, input_precision=PRECISION)
            w_max = w_new
        else:
            den += tl.sum(w, axis=1)
            acc += tl.dot(w, v, input_precision=PRECISION)

    return acc, den, w_max


@triton.jit
def _derf_fwd_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, alpha_ptr, bias_ptr, gamma_ptr, out_ptr, out32_ptr, den_ptr,
    S, N, H, GROUP, D, scale,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_mb,
    HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, LOW_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = (h // GROUP).to(tl.int64)
    past = N - S

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < S
    d_ok = offs_d < D
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    q = _load_rows(q_ptr + b * stride_qb + h.to(tl.int64) * stride_qh, offs_m, stride_qs, offs_d, m_ok, d_ok)
    alpha = tl.load(alpha_ptr + h)
    bias = tl.load(bias_ptr + h)
    gamma = tl.load(gamma_ptr + h)

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    den = tl.zeros((BLOCK_M,), dtype=tl.float32)
    w_max = tl.zeros((BLOCK_M,), dtype=tl.float32)
    qpos = offs_m + past
    hi = tl.minimum(N, past + (pid_m + 1) * BLOCK_M)  # last key any query of this block sees, + 1
    # key blocks every query of the block sees in full, then the diagonal ones
    full = 0
    if SPLIT:
        full = _full_keys(pid_m * BLOCK_M + past, BLOCK_N)
        acc, den, w_max = _fwd_keys(acc, den, w_max, q, k_base, v_base, mask_ptr, b, stride_mb, stride_kn,
                                    stride_vn, offs_d, d_ok, qpos, 0, full, N, alpha, bias, gamma, scale,
                                    False, HAS_MASK, BLOCK_N, PRECISION, LOW_PRECISION)
    acc, den, w_max = _fwd_keys(acc, den, w_max, q, k_base, v_base, mask_ptr, b, stride_mb, stride_kn, stride_vn,
                                offs_d, d_ok, qpos, full, hi, N, alpha, bias, gamma, scale,
                                True, HAS_MASK, BLOCK_N, PRECISION, LOW_PRECISION)

    if LOW_PRECISION:
        acc = acc * w_max[:, None]
        den = den * w_max
    out = acc / (den + 1e-8)[:, None]
    out_offset = b * stride_ob + h.to(tl.int64) * stride_oh
    _store_rows(out_ptr + out_offset, offs_m, stride_os, offs_d, m_ok, d_ok, out)
    if LOW_PRECISION:
        # through a block pointer: a second [BLOCK_M, BLOCK_D] tile of 64-bit addresses
        # does not fit next to the accumulator at head dim 128
        out32 = tl.make_block_ptr(out32_ptr + out_offset, (S, D), (stride_os, 1), (pid_m * BLOCK_M, 0),
                                  (BLOCK_M, BLOCK_D), (1, 0))
        tl.store(out32, out, boundary_check=(0, 1))
    tl.store(den_ptr + pid_bh.to(tl.int64) * S + offs_m, den, mask=m_ok)


@triton.jit
def _derf_bwd_delta_kernel(do_ptr, out_ptr, delta_ptr, S, H, D,
                           stride_dob, stride_dos, stride_doh, stride_ob, stride_os, stride_oh,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta_i = dout_i·out_i in fp32, [B, H, S], from the forward's fp32 output: one
    read of dout and out (rather than torch upcasts, a product and a sum over
    [B, S, H, D]); kept out of the dQ kernel, whose registers are full."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < S
    d_ok = offs_d < D
    do = _load_rows(do_ptr + b * stride_dob + h * stride_doh, offs_m, stride_dos, offs_d, m_ok, d_ok)
    out = _load_rows(out_ptr + b * stride_ob + h * stride_oh, offs_m, stride_os, offs_d, m_ok, d_ok)
    delta = tl.sum(do.to(tl.float32) * out.to(tl.float32), axis=1)
    tl.store(delta_ptr + pid_bh.to(tl.int64) * S + offs_m, delta, mask=m_ok)


@triton.jit
def _dkdv_queries(dk, dv, k, v, kept, offs_n, offs_d, d_ok, q_base, do_base, delta_ptr, den_ptr, row_base,
                  stride_qs, stride_dos, lo, hi, S, past, alpha, bias, gamma, scale,
                  CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    """dK, dV of one key block from the query blocks [lo, hi) of one head; CAUSAL: the
    blocks on the diagonal, where a pair's causal bound is tested."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < S
        q = _load_rows(q_base, offs_m, stride_qs, offs_d, m_ok, d_ok)
        do = _load_rows(do_base, offs_m, stride_dos, offs_d, m_ok, d_ok)
        delta = tl.load(delta_ptr + row_base + offs_m, mask=m_ok, other=0.0)
        rden = _rden(den_ptr + row_base, offs_m, m_ok)

        s = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale                   # [N, M]
        dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)                         # dout_i·v_j
        if CAUSAL:
            visible = kept[:, None] & m_ok[None, :] & (offs_n[:, None] <= offs_m[None, :] + past)
        else:
            visible = kept[:, None] & m_ok[None, :]
        half, _, dz = _derf_grad_tile(s, dp, delta[None, :], rden[None, :], visible, alpha, bias, gamma)
        w_r = tl.where(visible, gamma * half * rden[None, :], 0.0)
        dv += tl.dot(w_r.to(do.dtype), do, input_precision=PRECISION)
        dk += tl.dot((dz * alpha).to(q.dtype), q, input_precision=PRECISION)

    return dk, dv


@triton.jit
def _derf_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, alpha_ptr, bias_ptr, gamma_ptr,
    do_ptr, delta_ptr, den_ptr, dk_ptr, dv_ptr,
    S, N, H, GROUP, D, scale,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_mb,
    HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    # Works in the transposed orientation [keys, queries] so that the key block's
    # k, v, dk, dv stay put while the query blocks stream past; the key block is the
    # M side of every dot (BLOCK_N ≥ 64 per warpgroup for wgmma).
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    kv_heads = H // GROUP
    b = (pid_bk // kv_heads).to(tl.int64)
    hk = (pid_bk % kv_heads).to(tl.int64)
    past = N - S

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < N
    d_ok = offs_d < D
    k = _load_rows(k_ptr + b * stride_kb + hk * stride_kh, offs_n, stride_kn, offs_d, n_ok, d_ok)
    v = _load_rows(v_ptr + b * stride_vb + hk * stride_vh, offs_n, stride_vn, offs_d, n_ok, d_ok)
    kept = _keys_kept(mask_ptr, b, stride_mb, offs_n, n_ok, HAS_MASK)

    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # first query that can see this key block: position past + i >= first key
    lo = tl.maximum(pid_n * BLOCK_N - past, 0)
    lo = (lo // BLOCK_M) * BLOCK_M
    # query blocks from diag_hi on see every key of this block: no causal test there
    diag_hi = tl.minimum(tl.cdiv(tl.maximum(pid_n * BLOCK_N + BLOCK_N - 1 - past, 0), BLOCK_M) * BLOCK_M, S)
    diag_hi = tl.maximum(diag_hi, lo)
    if not SPLIT:
        diag_hi = S
    for g in range(0, GROUP):
        h = hk * GROUP + g
        alpha = tl.load(alpha_ptr + h)
        bias = tl.load(bias_ptr + h)
        gamma = tl.load(gamma_ptr + h)
        q_base = q_ptr + b * stride_qb + h * stride_qh
        do_base = do_ptr + b * stride_dob + h * stride_doh
        row_base = (b * H + h) * S
        dk, dv = _dkdv_queries(dk, dv, k, v, kept, offs_n, offs_d, d_ok, q_base, do_base, delta_ptr, den_ptr,
                               row_base, stride_qs, stride_dos, lo, diag_hi, S, past, alpha, bias, gamma, scale,
                               True, BLOCK_M, PRECISION)
        if SPLIT:
            dk, dv = _dkdv_queries(dk, dv, k, v, kept, offs_n, offs_d, d_ok, q_base, do_base, delta_ptr, den_ptr,
                                   row_base, stride_qs, stride_dos, diag_hi, S, S, past, alpha, bias, gamma, scale,
                                   False, BLOCK_M, PRECISION)

    _store_rows(dk_ptr + b * stride_dkb + hk * stride_dkh, offs_n, stride_dkn, offs_d, n_ok, d_ok, dk * scale)
    _store_rows(dv_ptr + b * stride_dvb + hk * stride_dvh, offs_n, stride_dvn, offs_d, n_ok, d_ok, dv)


@triton.jit
def _dq_keys(dq, sum_dz_s, sum_dz, sum_dw_e, q, do, delta, rden, k_base, v_base, mask_ptr, b, stride_mb, stride_kn,
             stride_vn, offs_d, d_ok, qpos, lo, hi, N, alpha, bias, gamma, scale,
             CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """dQ and the parameter sums over key blocks [lo, hi); CAUSAL as in :func:`_fwd_keys`."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        k = _load_rows(k_base, offs_n, stride_kn, offs_d, n_ok, d_ok)
        v = _load_rows(v_base, offs_n, stride_vn, offs_d, n_ok, d_ok)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale                    # [M, N]
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        kept = _keys_kept(mask_ptr, b, stride_mb, offs_n, n_ok, HAS_MASK)
        visible = _visible(offs_n, qpos, kept, CAUSAL)
        half, dw, dz = _derf_grad_tile(s, dp, delta[:, None], rden[:, None], visible, alpha, bias, gamma)
        dq += tl.dot((dz * alpha).to(k.dtype), k, input_precision=PRECISION)
        sum_dz_s += tl.sum(dz * s, axis=1)
        sum_dz += tl.sum(dz, axis=1)
        sum_dw_e += tl.sum(dw * half, axis=1)

    return dq, sum_dz_s, sum_dz, sum_dw_e


@triton.jit
def _derf_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, alpha_ptr, bias_ptr, gamma_ptr,
    do_ptr, delta_ptr, den_ptr, dq_ptr, part_ptr,
    S, N, H, GROUP, D, scale,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_mb,
    HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    past = N - S

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < S
    d_ok = offs_d < D
    q = _load_rows(q_ptr + b * stride_qb + h * stride_qh, offs_m, stride_qs, offs_d, m_ok, d_ok)
    do = _load_rows(do_ptr + b * stride_dob + h * stride_doh, offs_m, stride_dos, offs_d, m_ok, d_ok)
    delta = tl.load(delta_ptr + pid_bh.to(tl.int64) * S + offs_m, mask=m_ok, other=0.0)
    rden = _rden(den_ptr + pid_bh.to(tl.int64) * S, offs_m, m_ok)
    alpha = tl.load(alpha_ptr + h)
    bias = tl.load(bias_ptr + h)
    gamma = tl.load(gamma_ptr + h)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    sum_dz_s = tl.zeros((BLOCK_M,), dtype=tl.float32)
    sum_dz = tl.zeros((BLOCK_M,), dtype=tl.float32)
    sum_dw_e = tl.zeros((BLOCK_M,), dtype=tl.float32)
    qpos = offs_m + past
    hi = tl.minimum(N, past + (pid_m + 1) * BLOCK_M)
    full = 0
    if SPLIT:
        full = _full_keys(pid_m * BLOCK_M + past, BLOCK_N)
        dq, sum_dz_s, sum_dz, sum_dw_e = _dq_keys(
            dq, sum_dz_s, sum_dz, sum_dw_e, q, do, delta, rden, k_base, v_base, mask_ptr, b, stride_mb, stride_kn,
            stride_vn, offs_d, d_ok, qpos, 0, full, N, alpha, bias, gamma, scale, False, HAS_MASK, BLOCK_N, PRECISION)
    dq, sum_dz_s, sum_dz, sum_dw_e = _dq_keys(
        dq, sum_dz_s, sum_dz, sum_dw_e, q, do, delta, rden, k_base, v_base, mask_ptr, b, stride_mb, stride_kn,
        stride_vn, offs_d, d_ok, qpos, full, hi, N, alpha, bias, gamma, scale, True, HAS_MASK, BLOCK_N, PRECISION)

    part = part_ptr + (pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m) * 3
    tl.store(part, tl.sum(sum_dz_s, axis=0))
    tl.store(part + 1, tl.sum(sum_dz, axis=0))
    # out_i = γ·A_i/(γ·H_i + 1e-8) depends on γ only through the 1e-8: Σ_j dw_ij·(erf+1)/2
    # equals δ_i·rden_i·1e-8/γ, taken so rather than as the difference of two sums
    # ~1e8 times larger (whose rounding, bf16 for rounded weights, is all that is left).
    # The pairwise sum serves γ = 0, where it has no cancellation.
    gamma_safe = tl.where(gamma != 0, gamma, 1.0)
    d_gamma = tl.where(gamma != 0, tl.sum(delta * rden, axis=0) * 1e-8 / gamma_safe, tl.sum(sum_dw_e, axis=0))
    tl.store(part + 2, d_gamma)
    _store_rows(dq_ptr + b * stride_dqb + h * stride_dqh, offs_m, stride_dqs, offs_d, m_ok, d_ok, dq * scale)


# ----------------------------------------------------------------------------
# Attention launch glue
# ----------------------------------------------------------------------------


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """Kernels take every stride but the last; make the last one 1."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _mask_args(key_mask: torch.Tensor | None):
    if key_mask is None:
        return None, 0
    return key_mask, key_mask.stride(0)


@triton_op("laminae::derf_attention", mutates_args=())
def derf_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    derf_alpha: torch.Tensor, derf_bias: torch.Tensor, derf_gamma: torch.Tensor,
    key_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DERF attention forward: ``(out [B, S, H, D], den [B, H, S] fp32, out32)``;
    ``out32`` is ``out`` before its rounding to a 16-bit input dtype (fp32
    ``[B, S, H, D]``), the backward's δ = dout·out, and empty for fp32 inputs.

    Inputs as :func:`derf_attention`, except that the parameters are fp32 and
    ``key_mask`` is a uint8 ``(B, N)`` tensor (or None)."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, S, H, D = q.shape
    N, kv_heads = k.shape[1], k.shape[2]
    block_d = _block_d(D)
    block_m, block_n, warps, stages = _tiles("fwd", q.dtype, block_d)
    out = empty((B, S, H, D), dtype=q.dtype, device=q.device)
    den = empty((B, H, S), dtype=torch.float32, device=q.device)
    # δ_i = dout_i·out_i from the rounded output is off by a 16-bit ulp of out, the
    # whole of the truth in rows that (nearly) see one key: keep the fp32 output.
    low = q.dtype != torch.float32
    out32 = empty((B, S, H, D) if low else (0,), dtype=torch.float32, device=q.device)
    mask, stride_mb = _mask_args(key_mask)
    grid = (triton.cdiv(S, block_m), B * H)
    wrap_triton(_derf_fwd_kernel)[grid](
        q, k, v, mask, derf_alpha, derf_bias, derf_gamma, out, out32, den,
        S, N, H, H // kv_heads, D, 1.0 / math.sqrt(D),
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(out), stride_mb,
        HAS_MASK=mask is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION=dot_precision(q.dtype), LOW_PRECISION=low, SPLIT=_split("fwd", q.dtype, block_d),
        num_warps=warps, num_stages=stages,
    )
    return out, den, out32


@triton_op("laminae::derf_attention_bwd", mutates_args=())
def _derf_attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    den: torch.Tensor, derf_alpha: torch.Tensor, derf_bias: torch.Tensor, derf_gamma: torch.Tensor,
    key_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, dout, out = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(dout), _unit_last(out)
    B, S, H, D = q.shape
    N, kv_heads = k.shape[1], k.shape[2]
    group = H // kv_heads
    scale = 1.0 / math.sqrt(D)
    block_d = _block_d(D)
    precision = dot_precision(q.dtype)
    mask, stride_mb = _mask_args(key_mask)
    delta = empty((B, H, S), dtype=torch.float32, device=q.device)
    wrap_triton(_derf_bwd_delta_kernel)[(triton.cdiv(S, DELTA_BLOCK_M), B * H)](
        dout, out, delta, S, H, D, *_strides3(dout), *_strides3(out),
        BLOCK_M=DELTA_BLOCK_M, BLOCK_D=block_d, num_warps=DELTA_WARPS,
    )

    dq = empty((B, S, H, D), dtype=q.dtype, device=q.device)
    block_m, block_n, warps, stages = _tiles("dq", q.dtype, block_d)
    split = _split("dq", q.dtype, block_d)
    query_blocks = triton.cdiv(S, block_m)
    partials = empty((B, H, query_blocks, 3), dtype=torch.float32, device=q.device)
    wrap_triton(_derf_bwd_dq_kernel)[(query_blocks, B * H)](
        q, k, v, mask, derf_alpha, derf_bias, derf_gamma, dout, delta, den, dq, partials,
        S, N, H, group, D, scale,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(dout), *_strides3(dq), stride_mb,
        HAS_MASK=mask is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION=precision, SPLIT=split, num_warps=warps, num_stages=stages,
    )

    dk = empty((B, N, kv_heads, D), dtype=k.dtype, device=k.device)
    dv = empty((B, N, kv_heads, D), dtype=v.dtype, device=v.device)
    block_m, block_n, warps, stages = _tiles("dkdv", q.dtype, block_d)
    split = _split("dkdv", q.dtype, block_d)
    wrap_triton(_derf_bwd_dkdv_kernel)[(triton.cdiv(N, block_n), B * kv_heads)](
        q, k, v, mask, derf_alpha, derf_bias, derf_gamma, dout, delta, den, dk, dv,
        S, N, H, group, D, scale,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(dout), *_strides3(dk), *_strides3(dv), stride_mb,
        HAS_MASK=mask is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION=precision, SPLIT=split, num_warps=warps, num_stages=stages,
    )
    # [B, H, query_blocks, 3] -> [H, 3]: columns dα, db, dγ
    dparams = partials.sum(dim=(0, 2))
    return dq, dk, dv, dparams


def _attn_setup_context(ctx, inputs, output):
    q, k, v, alpha, bias, gamma, key_mask = inputs
    out, den, out32 = output
    ctx.mark_non_differentiable(den, out32)
    ctx.save_for_backward(q, k, v, out if out32.numel() == 0 else out32, den, alpha, bias, gamma, key_mask)


def _attn_backward(ctx, dout, _dden, _dout32):
    q, k, v, out, den, alpha, bias, gamma, key_mask = ctx.saved_tensors
    dq, dk, dv, dparams = _derf_attention_bwd(dout, q, k, v, out, den, alpha, bias, gamma, key_mask)
    return dq, dk, dv, dparams[:, 0], dparams[:, 1], dparams[:, 2], None


derf_attention_op.register_autograd(_attn_backward, setup_context=_attn_setup_context)


def derf_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    derf_alpha: torch.Tensor,
    derf_bias: torch.Tensor,
    derf_gamma: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton DERF attention, the signature of
    :func:`laminae.primitives.derf.derf_attention_reference` (without ``upcast``).

    ``q`` ``[B, S, H, D]``, ``k``/``v`` ``[B, N, H_kv, D]`` (N ≥ S, H % H_kv == 0,
    D ≤ 256), fp32/bf16/fp16, one dtype; ``derf_*`` ``[H]`` (any float dtype; the
    kernel computes in fp32); ``attention_mask`` optional ``(B, N)`` 0/1 or bool keep mask.
    Returns ``[B, S, H, D]`` in the dtype of ``q``. Strided views (e.g. a slice of a
    preallocated cache) are read in place as long as the last dim is contiguous.

    Example::

        out = derf_attention(q, k, v, attn.derf_alpha, attn.derf_bias, attn.derf_gamma, attention_mask=keep)
    """
    check_derf_attention_inputs(q, k, v, derf_alpha, derf_bias, derf_gamma, attention_mask)
    return launch_derf_attention(q, k, v, derf_alpha, derf_bias, derf_gamma, attention_mask)


def launch_derf_attention(q, k, v, derf_alpha, derf_bias, derf_gamma, attention_mask=None) -> torch.Tensor:
    """:func:`derf_attention` for inputs already validated (``DERFAttention`` checks them)."""
    if q.dtype not in _SUPPORTED:
        raise DTypeError(f"Triton DERF attention supports fp32/bf16/fp16 inputs, got {q.dtype}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ShapeError(f"Triton DERF attention supports head_dim <= {MAX_HEAD_DIM}, got {q.shape[-1]}; "
                         "use backend='reference' for wider heads")
    mask = None if attention_mask is None else attention_mask.ne(0).to(torch.uint8)
    out, _, _ = derf_attention_op(q, k, v, derf_alpha.float(), derf_bias.float(), derf_gamma.float(), mask)
    return out


# ----------------------------------------------------------------------------
# Context gate kernels
# ----------------------------------------------------------------------------


@triton.jit
def _gate_fwd_kernel(r_ptr, l_ptr, alpha_ptr, bias_ptr, gamma_ptr, out_ptr, R, F,
                     BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_f = tl.program_id(1)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < F
    mask = (rows < R)[:, None] & col_ok[None, :]
    offs = rows[:, None] * F + cols[None, :]
    alpha = tl.load(alpha_ptr + cols, mask=col_ok, other=0.0)
    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
    gamma = tl.load(gamma_ptr + cols, mask=col_ok, other=0.0)
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    logit = tl.load(l_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    half, _ = _erf_parts(alpha[None, :] * logit + bias[None, :])
    gate = gamma[None, :] * half
    tl.store(out_ptr + offs, (r * gate).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_bwd_kernel(g_ptr, r_ptr, l_ptr, alpha_ptr, bias_ptr, gamma_ptr, dr_ptr, dl_ptr, part_ptr, R, F,
                     BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    # persistent over row blocks (stride = number of programs on axis 0), so each
    # program leaves one partial column sum per parameter
    pid_p = tl.program_id(0)
    pid_f = tl.program_id(1)
    num_p = tl.num_programs(0)
    cols = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < F
    alpha = tl.load(alpha_ptr + cols, mask=col_ok, other=0.0)[None, :]
    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    gamma = tl.load(gamma_ptr + cols, mask=col_ok, other=0.0)[None, :]
    sum_alpha = tl.zeros((BLOCK_F,), dtype=tl.float32)
    sum_bias = tl.zeros((BLOCK_F,), dtype=tl.float32)
    sum_gamma = tl.zeros((BLOCK_F,), dtype=tl.float32)
    for rb in range(pid_p, tl.cdiv(R, BLOCK_R), num_p):
        rows = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask = (rows < R)[:, None] & col_ok[None, :]
        offs = rows[:, None] * F + cols[None, :]
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        logit = tl.load(l_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        z = alpha * logit + bias
        e_half, gauss = _erf_parts(z)
        gr = g * r
        dz = gr * gamma * 0.5641895835477563 * gauss
        tl.store(dr_ptr + offs, (g * gamma * e_half).to(dr_ptr.dtype.element_ty), mask=mask)
        tl.store(dl_ptr + offs, (dz * alpha).to(dl_ptr.dtype.element_ty), mask=mask)
        sum_alpha += tl.sum(dz * logit, axis=0)
        sum_bias += tl.sum(dz, axis=0)
        sum_gamma += tl.sum(gr * e_half, axis=0)
    part = part_ptr + pid_p.to(tl.int64) * 3 * F + cols
    tl.store(part, sum_alpha, mask=col_ok)
    tl.store(part + F, sum_bias, mask=col_ok)
    tl.store(part + 2 * F, sum_gamma, mask=col_ok)


@triton_op("laminae::derf_context_gate", mutates_args=())
def derf_context_gate_op(retrieved: torch.Tensor, logits: torch.Tensor, alpha: torch.Tensor,
                         bias: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """Gate over contiguous ``[rows, F]`` ``retrieved``/``logits`` (one dtype), fp32 ``[F]`` parameters."""
    rows, feats = retrieved.shape
    out = empty_like(retrieved)
    grid = (triton.cdiv(rows, GATE_BLOCK_R), triton.cdiv(feats, GATE_BLOCK_F))
    wrap_triton(_gate_fwd_kernel)[grid](retrieved, logits, alpha, bias, gamma, out, rows, feats,
                                        BLOCK_R=GATE_BLOCK_R, BLOCK_F=GATE_BLOCK_F, num_warps=GATE_WARPS)
    return out


@triton_op("laminae::derf_context_gate_bwd", mutates_args=())
def _derf_context_gate_bwd(g: torch.Tensor, retrieved: torch.Tensor, logits: torch.Tensor, alpha: torch.Tensor,
                           bias: torch.Tensor, gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, feats = retrieved.shape
    programs = num_programs_for_rows(triton.cdiv(rows, GATE_BLOCK_R), retrieved.device)
    dr = empty_like(retrieved)
    dl = empty_like(logits)
    partials = empty((programs, 3, feats), dtype=torch.float32, device=retrieved.device)
    wrap_triton(_gate_bwd_kernel)[(programs, triton.cdiv(feats, GATE_BLOCK_F))](
        g, retrieved, logits, alpha, bias, gamma, dr, dl, partials, rows, feats,
        BLOCK_R=GATE_BLOCK_R, BLOCK_F=GATE_BLOCK_F, num_warps=GATE_WARPS)
    return dr, dl, partials.sum(0)


def _gate_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gate_backward(ctx, g):
    retrieved, logits, alpha, bias, gamma = ctx.saved_tensors
    dr, dl, dparams = _derf_context_gate_bwd(g.contiguous(), retrieved, logits, alpha, bias, gamma)
    return dr, dl, dparams[0], dparams[1], dparams[2]


derf_context_gate_op.register_autograd(_gate_backward, setup_context=_gate_setup_context)


def derf_context_gate(retrieved: torch.Tensor, logits: torch.Tensor, alpha: torch.Tensor,
                      bias: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """Triton DERF context gate, the signature of
    :func:`laminae.primitives.derf.derf_context_gate_reference` (without ``upcast``).

    ``retrieved``, ``logits``: ``[..., F]`` fp32/bf16/fp16 (``logits`` is cast to the
    dtype of ``retrieved``); ``alpha``, ``bias``, ``gamma``: ``[F]``. Returns
    ``retrieved · γ·(erf(α·logits + b) + 1)/2`` in the dtype of ``retrieved``.
    """
    if retrieved.dtype not in _SUPPORTED:
        raise DTypeError(f"Triton DERF context gate supports fp32/bf16/fp16 inputs, got {retrieved.dtype}")
    if logits.shape != retrieved.shape or retrieved.dim() == 0:
        raise ShapeError(f"`logits` must have the shape of `retrieved` {tuple(retrieved.shape)}, "
                         f"got {tuple(logits.shape)}")
    feats = retrieved.shape[-1]
    for name, p in (("alpha", alpha), ("bias", bias), ("gamma", gamma)):
        if p.shape != (feats,):
            raise ShapeError(f"`{name}` must have shape ({feats},), got {tuple(p.shape)}")
    shape = retrieved.shape
    r2 = retrieved.reshape(-1, feats).contiguous()
    l2 = logits.to(retrieved.dtype).reshape(-1, feats).contiguous()
    out = derf_context_gate_op(r2, l2, alpha.float().contiguous(), bias.float().contiguous(),
                               gamma.float().contiguous())
    return out.reshape(shape)


# ----------------------------------------------------------------------------
# Launch configurations, for the static sm_90 check
# ----------------------------------------------------------------------------


def _attn_signature(kernel_kind: str, dt: str) -> dict[str, str]:
    p = f"*{dt}"
    f32 = "*fp32"
    ptrs = dict(q_ptr=p, k_ptr=p, v_ptr=p, mask_ptr="*u8", alpha_ptr=f32, bias_ptr=f32, gamma_ptr=f32)
    if kernel_kind == "fwd":
        ptrs.update(out_ptr=p, out32_ptr=f32, den_ptr=f32)
        tensors = ("q", "k", "v", "o")
    elif kernel_kind == "dkdv":
        ptrs.update(do_ptr=p, delta_ptr=f32, den_ptr=f32, dk_ptr=p, dv_ptr=p)
        tensors = ("q", "k", "v", "do", "dk", "dv")
    else:
        ptrs.update(do_ptr=p, delta_ptr=f32, den_ptr=f32, dq_ptr=p, part_ptr=f32)
        tensors = ("q", "k", "v", "do", "dq")
    sig = dict(ptrs, S="i32", N="i32", H="i32", GROUP="i32", D="i32", scale="fp32")
    for t in tensors:
        axes = ("b", "n", "h") if t in ("k", "v", "dk", "dv") else ("b", "s", "h")
        for ax in axes:
            sig[f"stride_{t}{ax}"] = "i32"
    sig["stride_mb"] = "i32"
    return sig


def _expected_mma(dtype: torch.dtype, block_d: int) -> str:
    return "HGMMA" if dtype != torch.float32 and block_d <= 128 else ""


# Pointers every launch passes 16-byte aligned, which Triton specialises as 16-divisible:
# fresh outputs and scratch, the fp32 parameters and the uint8 key mask built per call.
# q, k, v and dout are taken with any strides (a slice of a fused projection is an
# offset view), so they are not declared.
_ALIGNED = {
    "fwd": ("mask_ptr", "alpha_ptr", "bias_ptr", "gamma_ptr", "out_ptr", "out32_ptr", "den_ptr"),
    "dq": ("mask_ptr", "alpha_ptr", "bias_ptr", "gamma_ptr", "delta_ptr", "den_ptr", "dq_ptr", "part_ptr"),
    "dkdv": ("mask_ptr", "alpha_ptr", "bias_ptr", "gamma_ptr", "delta_ptr", "den_ptr", "dk_ptr", "dv_ptr"),
}


def static_cases() -> Iterator[StaticCase]:
    kernels = (("derf_fwd", _derf_fwd_kernel, "fwd"), ("derf_bwd_dkdv", _derf_bwd_dkdv_kernel, "dkdv"),
               ("derf_bwd_dq", _derf_bwd_dq_kernel, "dq"))
    for dtype in _SUPPORTED:
        dt = triton_dtype(dtype)
        for name, kernel, kind in kernels:
            for block_d in TILES[(kind, "fp32")]:
                block_m, block_n, warps, stages = _tiles(kind, dtype, block_d)
                for has_mask in (False, True):
                    const = dict(HAS_MASK=has_mask, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                                 PRECISION=dot_precision(dtype))
                    if kind == "fwd":
                        const["LOW_PRECISION"] = dtype != torch.float32
                    const["SPLIT"] = _split(kind, dtype, block_d)
                    yield StaticCase(name, kernel, _attn_signature(kind, dt), const, warps, stages,
                                     tags={"dtype": dt}, expect=_expected_mma(dtype, block_d),
                                     divisible=_ALIGNED[kind])
        p = f"*{dt}"
        for block_d in TILES[("dq", "fp32")]:
            yield StaticCase("derf_bwd_delta", _derf_bwd_delta_kernel,
                             dict(do_ptr=p, out_ptr="*fp32", delta_ptr="*fp32", S="i32", H="i32", D="i32",
                                  stride_dob="i32", stride_dos="i32", stride_doh="i32",
                                  stride_ob="i32", stride_os="i32", stride_oh="i32"),
                             dict(BLOCK_M=DELTA_BLOCK_M, BLOCK_D=block_d), DELTA_WARPS, tags={"dtype": dt},
                             divisible=("out_ptr", "delta_ptr"))
        const = dict(BLOCK_R=GATE_BLOCK_R, BLOCK_F=GATE_BLOCK_F)
        yield StaticCase("derf_gate_fwd", _gate_fwd_kernel,
                         dict(r_ptr=p, l_ptr=p, alpha_ptr="*fp32", bias_ptr="*fp32", gamma_ptr="*fp32", out_ptr=p,
                              R="i32", F="i32"), const, GATE_WARPS, tags={"dtype": dt},
                         divisible=("r_ptr", "l_ptr", "alpha_ptr", "bias_ptr", "gamma_ptr", "out_ptr"))
        yield StaticCase("derf_gate_bwd", _gate_bwd_kernel,
                         dict(g_ptr=p, r_ptr=p, l_ptr=p, alpha_ptr="*fp32", bias_ptr="*fp32", gamma_ptr="*fp32",
                              dr_ptr=p, dl_ptr=p, part_ptr="*fp32", R="i32", F="i32"),
                         const, GATE_WARPS, tags={"dtype": dt},
                         divisible=("g_ptr", "r_ptr", "l_ptr", "alpha_ptr", "bias_ptr", "gamma_ptr", "dr_ptr", "dl_ptr",
                                    "part_ptr"))


# ----------------------------------------------------------------------------
# Tour
# ----------------------------------------------------------------------------


def tour_case(device: torch.device):
    from laminae.primitives.derf import derf_attention_reference, derf_context_gate_reference

    from .tour import TourCase, attention_inputs

    gen = torch.Generator().manual_seed(0)
    B, S, H, kv_heads, D = 2, 64, 4, 2, 32
    attn = attention_inputs(device, gen, B, S, H, kv_heads, D)
    attn.update(derf_alpha=(1.0 + 0.5 * torch.randn(H, generator=gen)).to(device),
                derf_bias=(0.3 * torch.randn(H, generator=gen)).to(device),
                derf_gamma=(1.0 + 0.2 * torch.randn(H, generator=gen)).to(device))
    rows, feats = 2 * 64, 256
    gate = {
        "retrieved": torch.randn(rows, feats, generator=gen).to(device),
        "logits": (2.0 * torch.randn(rows, feats, generator=gen)).to(device),
        "alpha": (1.0 + 0.3 * torch.randn(feats, generator=gen)).to(device),
        "bias": (-1.0 + torch.randn(feats, generator=gen)).to(device),
        "gamma": (1.0 + 0.2 * torch.randn(feats, generator=gen)).to(device),
    }
    return [
        TourCase(f"derf attention (B={B}, S=N={S}, H={H}/{kv_heads}, D={D}, ragged mask)", derf_attention,
                 derf_attention_reference, attn, [n for n in attn if n != "attention_mask"]),
        TourCase(f"derf context gate ({rows}x{feats})", derf_context_gate, derf_context_gate_reference, gate,
                 list(gate)),
    ]
