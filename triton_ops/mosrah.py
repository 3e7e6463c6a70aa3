"""MoSRAH kernels: varlen causal flash attention over the expert-packed copies, after
one pass that gathers the copies and applies the YaRN rotation.

Layout. Every token has ``K`` copies, one per selected head. Sorting the copies of
each batch row by head (stably, so token order is kept inside a head) gives the
expert-major varlen layout: segment ``s = b·L + l`` holds the copies of batch ``b``
routed to head ``l``, rows ``cu_seqlens[s] .. cu_seqlens[s+1]`` of ``B·N·K`` copy
rows. Per copy the setup (torch, no host sync) stores its source token row
(``b·N + n``), its BEA position and its liveness. Nothing d-wide is packed.

Projections. ``q, k, v = x·W[l]`` for every (token, head) pair as one cuBLAS GEMM
``[B·N, d] × [d, L·u]`` into dense ``[B, N, L, u]`` tensors; the attention kernel
reads the selected pairs from them by (token row, head). This spends ``L/K`` times
the FLOPs of a grouped GEMM over the selected pairs (1× at the seed default K = L;
up to 4× at the paper's L = 64, K = 16) in exchange for tensor-core GEMMs with no
gather of d-wide rows; the output side is the same: ``h_s = (P ⊙ Z)·W_O`` with the
P-weighted attention outputs scattered (each (token, head) pair at most once) into a
dense ``[B·N, L·u]`` operand. Autograd of those torch ops gives dx, dW_*, dP.

Kernels (grid ``(cdiv(N, BLOCK), B·L)``; a program whose tile starts past its
segment's length returns at once, so empty segments cost one branch and the grid
needs no host-side count):

- pack: one pass gathers q, k, v of every copy from its (token, head) pair, rotates
  q and k by ``pos·θ′`` once (fp32, stored in the input dtype) and writes contiguous
  copy rows ``[B·N·K, u]``; the attention loops never see an angle.
- forward: plain varlen causal flash over the copy rows: per query tile, loop over
  key tiles up to the causal bound (slot order), mask dead keys and dead queries,
  fp32 online softmax (base 2) with the score scale A/√u; write Z at the (token,
  head) pair and the natural LSE per copy.
- backward: a row kernel packs dZ and δ = rowsum(dZ·Z); dq over query tiles,
  dk/dv over key tiles (dS = P ⊙ (dP − δ), P recomputed from the LSE); dq̃, dk̃ stay
  fp32 copy rows until a row kernel rotates them back by −angle into their pairs.
  No atomics: every output row has one writer, so results are run-to-run
  deterministic.
- cached: a chunk's rotated queries over a decoding cache's rows (inference); a
  chunk of one query tile over a long cache splits the rows over programs and the
  flash-decoding merge of ``_flash`` combines the partials.

Nothing S×S is stored: the backward saves the packed q̃, k̃, v, Z (dense, u-wide) and the LSE per copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import DTypeError, ShapeError
from laminae.primitives._validation import dense_keep_mask
from laminae.primitives.mosrah import mosrah_route, sanitize_padding

from ._common import StaticCase, dot_precision, empty

__all__ = ["mosrah", "mosrah_attention", "mosrah_cached_attention", "packed_layout", "static_cases", "tour_case"]

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 128


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _sincos(x):
    """sin and cos of fp32 angles x ≥ 0, to about 1e-6 absolute for x < 3·10⁴.

    libdevice's sinf/cosf keep a Payne–Hanek slow path whose local array costs a
    stack frame in every kernel; a Cody–Waite reduction to [−π/4, π/4] (three-part
    π/2, exact products up to 2¹⁶ quadrants) and minimax polynomials need none."""
    q = tl.floor(x * 0.6366197723675814 + 0.5)
    r = ((x - q * 1.5703125) - q * 4.837512969970703125e-4) - q * 7.54978995489188216e-8
    r2 = r * r
    sin_r = r + r * r2 * (-1.6666654611e-1 + r2 * (8.3321608736e-3 + r2 * -1.9515295891e-4))
    cos_r = 1.0 - 0.5 * r2 + r2 * r2 * (4.166664568298827e-2 + r2 * (-1.388731625493765e-3
                                                                   + r2 * 2.443315711809948e-5))
    quadrant = q.to(tl.int32) & 3
    sin = tl.where((quadrant & 1) == 1, cos_r, sin_r)
    cos = tl.where((quadrant & 1) == 1, sin_r, cos_r)
    sin = tl.where(quadrant >= 2, -sin, sin)
    cos = tl.where((quadrant == 1) | (quadrant == 2), -cos, cos)
    return sin, cos


@triton.jit
def _segment(cu_ptr, pid_s, L):
    start = tl.load(cu_ptr + pid_s)
    length = tl.load(cu_ptr + pid_s + 1) - start
    return start, length, pid_s % L


@triton.jit
def _rotate(src, dst, HALF, mask, sin, cos):
    """Store the halves ``(a, b)`` at ``src`` rotated by the angle whose sine and cosine
    are given (fp32) at ``dst``; −sin is the rotation's transpose, its backward."""
    a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (a * cos - b * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (b * cos + a * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _pack_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, tok_ptr, pos_ptr, live_ptr, freq_ptr, qr_ptr, kr_ptr, vr_ptr,
                 L, HALF, U, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Copy rows of a segment: q̃, k̃ = RoPE(q, k; pos) and v (0 at dead copies),
    gathered from their (token, head) pairs into contiguous copy rows. The angles
    are computed once per copy here, never in the attention loops."""
    start, length, head = _segment(cu_ptr, tl.program_id(1), L)
    if tl.program_id(0) * BLOCK_R >= length:
        return
    local = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = local < length
    rows = start.to(tl.int64) + local
    tok = tl.load(tok_ptr + rows, mask=ok, other=0)
    pos = tl.load(pos_ptr + rows, mask=ok, other=0)
    live = tl.load(live_ptr + rows, mask=ok, other=0) != 0
    offs_h = tl.arange(0, BLOCK_H)
    mask = ok[:, None] & (offs_h < HALF)[None, :]
    src = ((tok.to(tl.int64) * L + head) * (2 * HALF))[:, None] + offs_h[None, :]
    dst = (rows * U)[:, None] + offs_h[None, :]
    freq = tl.load(freq_ptr + offs_h, mask=offs_h < HALF, other=0.0)
    sin, cos = _sincos(pos.to(tl.float32)[:, None] * freq[None, :])
    _rotate(q_ptr + src, qr_ptr + dst, HALF, mask, sin, cos)
    _rotate(k_ptr + src, kr_ptr + dst, HALF, mask, sin, cos)
    # dead keys may hold anything finite; p is 0 there, but keep them out of p·v exactly
    live_mask = mask & live[:, None]
    tl.store(vr_ptr + dst, tl.load(v_ptr + src, mask=live_mask, other=0.0), mask=mask)
    tl.store(vr_ptr + dst + HALF, tl.load(v_ptr + src + HALF, mask=live_mask, other=0.0), mask=mask)


@triton.jit
def _unpack_grad_kernel(dqr_ptr, dkr_ptr, cu_ptr, tok_ptr, pos_ptr, freq_ptr, dq_ptr, dk_ptr,
                        L, HALF, U, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """The rotation's backward: dq̃, dk̃ of each copy row rotated by −angle and
    written at its (token, head) pair (each pair has at most one copy)."""
    start, length, head = _segment(cu_ptr, tl.program_id(1), L)
    if tl.program_id(0) * BLOCK_R >= length:
        return
    local = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = local < length
    rows = start.to(tl.int64) + local
    tok = tl.load(tok_ptr + rows, mask=ok, other=0)
    pos = tl.load(pos_ptr + rows, mask=ok, other=0)
    offs_h = tl.arange(0, BLOCK_H)
    mask = ok[:, None] & (offs_h < HALF)[None, :]
    src = (rows * U)[:, None] + offs_h[None, :]
    dst = ((tok.to(tl.int64) * L + head) * (2 * HALF))[:, None] + offs_h[None, :]
    freq = tl.load(freq_ptr + offs_h, mask=offs_h < HALF, other=0.0)
    sin, cos = _sincos(pos.to(tl.float32)[:, None] * freq[None, :])
    _rotate(dqr_ptr + src, dq_ptr + dst, HALF, mask, -sin, cos)
    _rotate(dkr_ptr + src, dk_ptr + dst, HALF, mask, -sin, cos)


@triton.jit
def _bwd_prep_kernel(dz_ptr, z_ptr, cu_ptr, tok_ptr, dzr_ptr, delta_ptr, L, U,
                     BLOCK_R: tl.constexpr, BLOCK_U: tl.constexpr):
    """dZ of each copy row, packed as q̃ is, and δ = rowsum(dZ·Z) in fp32."""
    start, length, head = _segment(cu_ptr, tl.program_id(1), L)
    if tl.program_id(0) * BLOCK_R >= length:
        return
    local = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = local < length
    rows = start.to(tl.int64) + local
    tok = tl.load(tok_ptr + rows, mask=ok, other=0)
    offs_u = tl.arange(0, BLOCK_U)
    mask = ok[:, None] & (offs_u < U)[None, :]
    src = ((tok.to(tl.int64) * L + head) * U)[:, None] + offs_u[None, :]
    dz = tl.load(dz_ptr + src, mask=mask, other=0.0)
    z = tl.load(z_ptr + src, mask=mask, other=0.0)
    tl.store(dzr_ptr + (rows * U)[:, None] + offs_u[None, :], dz, mask=mask)
    tl.store(delta_ptr + rows, tl.sum(dz.to(tl.float32) * z.to(tl.float32), 1), mask=ok)


@triton.jit
def _tile(ptr, base, local, ok, U, BLOCK_U: tl.constexpr):
    """Rows ``local`` of a packed ``[copies, U]`` tensor from the segment's int64 base."""
    offs_u = tl.arange(0, BLOCK_U)
    return tl.load(ptr + base + local[:, None] * U + offs_u[None, :], mask=ok[:, None] & (offs_u < U)[None, :],
                   other=0.0)


@triton.jit
def _mosrah_fwd_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, tok_ptr, live_ptr, z_ptr, lse_ptr,
                       L, U, qk_scale,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
                       PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    start, length, head = _segment(cu_ptr, tl.program_id(1), L)
    if pid_m * BLOCK_M >= length:
        return
    base = start.to(tl.int64) * U
    local_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = local_m < length
    q_live = (tl.load(live_ptr + start + local_m, mask=row_ok, other=0) != 0) & row_ok
    q = _tile(q_ptr, base, local_m, row_ok, U, BLOCK_U)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_U), dtype=tl.float32)
    hi = tl.minimum(length, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        local_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = local_n < length
        k_live = (tl.load(live_ptr + start + local_n, mask=col_ok, other=0) != 0) & col_ok
        k = _tile(k_ptr, base, local_n, col_ok, U, BLOCK_U)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        vis = (local_n[None, :] <= local_m[:, None]) & k_live[None, :] & q_live[:, None]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        corr = tl.exp2(m_i - m_shift)
        l_i = l_i * corr + tl.sum(p, 1)
        v = _tile(v_ptr, base, local_n, col_ok, U, BLOCK_U)
        acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    empty_row = l_i == 0.0
    l_safe = tl.where(empty_row, 1.0, l_i)
    z = acc / l_safe[:, None]
    lse = tl.where(empty_row, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tok = tl.load(tok_ptr + start + local_m, mask=row_ok, other=0)
    offs_u = tl.arange(0, BLOCK_U)
    zbase = (tok.to(tl.int64) * L + head) * U
    tl.store(z_ptr + zbase[:, None] + offs_u[None, :], z.to(z_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_u < U)[None, :])
    tl.store(lse_ptr + start + local_m, lse, mask=row_ok)


@triton.jit
def _mosrah_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, live_ptr, dz_ptr, lse_ptr, delta_ptr, dq_ptr,
                          L, U, qk_scale, sm_scale,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
                          PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    start, length, head = _segment(cu_ptr, tl.program_id(1), L)
    if pid_m * BLOCK_M >= length:
        return
    base = start.to(tl.int64) * U
    local_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = local_m < length
    q_live = (tl.load(live_ptr + start + local_m, mask=row_ok, other=0) != 0) & row_ok
    q = _tile(q_ptr, base, local_m, row_ok, U, BLOCK_U)
    do = _tile(dz_ptr, base, local_m, row_ok, U, BLOCK_U)
    lse = tl.load(lse_ptr + start + local_m, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + start + local_m, mask=row_ok, other=0.0)

    dq = tl.zeros((BLOCK_M, BLOCK_U), dtype=tl.float32)
    hi = tl.minimum(length, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        local_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = local_n < length
        k_live = (tl.load(live_ptr + start + local_n, mask=col_ok, other=0) != 0) & col_ok
        k = _tile(k_ptr, base, local_n, col_ok, U, BLOCK_U)
        v = _tile(v_ptr, base, local_n, col_ok, U, BLOCK_U)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        vis = (local_n[None, :] <= local_m[:, None]) & k_live[None, :] & q_live[:, None]
        p = tl.exp2(tl.where(vis, s, float("-inf")) - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = tl.where(vis, p * (dp - delta[:, None]), 0.0)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    offs_u = tl.arange(0, BLOCK_U)
    tl.store(dq_ptr + base + local_m[:, None] * U + offs_u[None, :], dq * sm_scale,
             mask=row_ok[:, None] & (offs_u < U)[None, :])


@triton.jit
def _mosrah_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, tok_ptr, live_ptr, dz_ptr, lse_ptr, delta_ptr,
                            dk_ptr, dv_ptr, L, U, qk_scale, sm_scale,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
                            PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    start, length, head = _segment(cu_ptr, tl.program_id(1), L)
    if pid_n * BLOCK_N >= length:
        return
    base = start.to(tl.int64) * U
    local_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = local_n < length
    k_live = (tl.load(live_ptr + start + local_n, mask=col_ok, other=0) != 0) & col_ok
    k = _tile(k_ptr, base, local_n, col_ok, U, BLOCK_U)
    v = _tile(v_ptr, base, local_n, col_ok, U, BLOCK_U)
    dk = tl.zeros((BLOCK_N, BLOCK_U), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_U), dtype=tl.float32)
    lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M     # the first query tile that can see this key tile
    for start_m in range(lo, length, BLOCK_M):
        local_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = local_m < length
        q_live = (tl.load(live_ptr + start + local_m, mask=row_ok, other=0) != 0) & row_ok
        q = _tile(q_ptr, base, local_m, row_ok, U, BLOCK_U)
        do = _tile(dz_ptr, base, local_m, row_ok, U, BLOCK_U)
        lse = tl.load(lse_ptr + start + local_m, mask=row_ok, other=0.0)
        lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
        delta = tl.load(delta_ptr + start + local_m, mask=row_ok, other=0.0)
        # transposed scores [BLOCK_N keys, BLOCK_M queries]: keys are the wgmma M dimension
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
        vis = (local_n[:, None] <= local_m[None, :]) & k_live[:, None] & q_live[None, :]
        pt = tl.exp2(tl.where(vis, st, float("-inf")) - lse2[None, :])
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = tl.where(vis, pt * (dpt - delta[None, :]), 0.0)
        dk += tl.dot(dst.to(q.dtype), q, input_precision=PRECISION)
    offs_u = tl.arange(0, BLOCK_U)
    u_ok = (offs_u < U)[None, :]
    tl.store(dk_ptr + base + local_n[:, None] * U + offs_u[None, :], dk * sm_scale, mask=col_ok[:, None] & u_ok)
    ktok = tl.load(tok_ptr + start + local_n, mask=col_ok, other=0)
    vbase = (ktok.to(tl.int64) * L + head) * U
    tl.store(dv_ptr + vbase[:, None] + offs_u[None, :], dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None] & u_ok)


@triton.jit
def _mosrah_cached_kernel(q_ptr, k_ptr, v_ptr, limit_ptr, z_ptr, part_ptr, ml_ptr, L, T, U,
                          stride_kb, stride_kj, qk_scale, SPLIT_N,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
                          PRECISION: tl.constexpr, SPLIT: tl.constexpr):
    """A chunk's packed queries ``[B, L, T, U]`` (rotated) over the cache rows of their
    head: query t sees rows ``j < limit[b, l, t]`` (0 for dead queries). The key loop
    stops at the tile's largest limit, so a decode step reads only the head's rows.

    SPLIT (one query tile, T ≤ BLOCK_M): program ``split`` (axis 2) takes the rows
    ``[split·SPLIT_N, (split+1)·SPLIT_N)`` and writes its unnormalised partial and
    (running max, sum) in base 2, in the layout ``_flash._flash_decode_combine`` merges
    (a head's ``(b, l)`` as its ``(b, h)``)."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_s // L
    head = pid_s % L
    local_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = local_m < T
    qbase = pid_s.to(tl.int64) * T * U
    q = _tile(q_ptr, qbase, local_m, row_ok, U, BLOCK_U)
    limit = tl.load(limit_ptr + pid_s.to(tl.int64) * T + local_m, mask=row_ok, other=0)
    kbase = b.to(tl.int64) * stride_kb + head * U
    offs_u = tl.arange(0, BLOCK_U)
    u_ok = (offs_u < U)[None, :]

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_U), dtype=tl.float32)
    hi = tl.max(limit, 0)
    lo = 0
    if SPLIT:
        lo = tl.program_id(2) * SPLIT_N
        hi = tl.minimum(hi, lo + SPLIT_N)
    for start_n in range(lo, hi, BLOCK_N):
        local_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = local_n < hi
        offs = kbase + local_n[:, None] * stride_kj + offs_u[None, :]
        k = tl.load(k_ptr + offs, mask=col_ok[:, None] & u_ok, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        vis = local_n[None, :] < limit[:, None]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        corr = tl.exp2(m_i - m_shift)
        l_i = l_i * corr + tl.sum(p, 1)
        v = tl.load(v_ptr + offs, mask=col_ok[:, None] & u_ok, other=0.0).to(q.dtype)
        acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLIT:
        part = (pid_s * tl.num_programs(2) + tl.program_id(2)).to(tl.int64) * BLOCK_M
        tl.store(part_ptr + (part + local_m[:, None]) * BLOCK_U + offs_u[None, :], acc)
        tl.store(ml_ptr + (part + local_m) * 2, m_i)
        tl.store(ml_ptr + (part + local_m) * 2 + 1, l_i)
    else:
        z = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(z_ptr + qbase + local_m[:, None] * U + offs_u[None, :], z.to(z_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & u_ok)


# ----------------------------------------------------------------------------
# Tiles
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Tiles:
    fwd_m: int
    fwd_n: int
    dq_m: int
    dq_n: int
    dkdv_m: int
    dkdv_n: int
    warps: int = 4
    stages: int = 2


# Keyed by the padded head dim BLOCK_U; checked for spills by the static sm_90 check.
# The loops are a plain varlen flash over pre-rotated rows, so 16-bit tiles are the
# flash core's: 128 queries per forward/dq program at head dims 64 and 128 (two
# warpgroups, each on 64-row wgmma), 128 keys per dk/dv program (keys are the M
# dimension of its products). fp32 takes exact ("ieee") products on the FMA units,
# hence smaller tiles.
_TILES_16BIT = {16: Tiles(64, 64, 64, 64, 32, 64), 32: Tiles(64, 64, 64, 64, 32, 64),
                64: Tiles(128, 64, 128, 64, 32, 128, 8), 128: Tiles(128, 64, 128, 64, 32, 128, 8)}
# A head dim padded to 128 that is not a multiple of 16 loads rows with per-element
# masks (no 16-byte vectors): its dk/dv tile of 128 keys spills, 64 keys do not.
_TILES_16BIT_ODD = {128: Tiles(128, 64, 128, 64, 32, 64, 8)}
_TILES_FP32 = {16: Tiles(64, 32, 32, 32, 32, 32), 32: Tiles(64, 32, 32, 32, 32, 32),
               64: Tiles(32, 32, 32, 32, 32, 32, 8), 128: Tiles(16, 32, 16, 16, 16, 16, 8)}
# the row kernels (pack, δ, the rotation's backward)
ROWS, ROW_WARPS = 32, 4
# Cached attention: fp32 queries (the cached path computes in fp32), a chunk of a few
# rows (one per decode step), so 16 queries per program; (BLOCK_M, BLOCK_N, warps).
_TILES_CACHED = {16: (16, 32, 4), 32: (16, 32, 4), 64: (16, 32, 4), 128: (16, 32, 8)}


def _blocks(head_dim: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_U): each rotation half and the full head dim, padded to ≥ 16."""
    return max(16, triton.next_power_of_2(head_dim // 2)), max(16, triton.next_power_of_2(head_dim))


def tiles(head_dim: int, dtype: torch.dtype) -> Tiles:
    """Launch tiles (tests monkeypatch this to force several tiles per segment)."""
    block_u = _blocks(head_dim)[1]
    if dtype == torch.float32:
        return _TILES_FP32[block_u]
    if head_dim % 16 and block_u in _TILES_16BIT_ODD:
        return _TILES_16BIT_ODD[block_u]
    return _TILES_16BIT[block_u]


def cached_tiles(head_dim: int, split: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the cached attention kernel; its split-K form
    takes 8 warps from head dim 64 on (at 4 warps the fp32-cache u = 64 split kernel
    spills, 255 registers; at 8 it holds 80 and 3 CTAs/SM)."""
    block_m, block_n, warps = _TILES_CACHED[_blocks(head_dim)[1]]
    return block_m, block_n, 8 if split and _blocks(head_dim)[1] >= 64 else warps


def cached_splits(heads: int, queries: int, rows: int, head_dim: int) -> tuple[int, int]:
    """``(splits, rows per split)`` of the cached attention over ``rows`` cache rows: a
    chunk of one query tile (a decoding step) splits the rows over programs as
    flash-decoding does (enough to give every SM work, whole key blocks each); a
    longer chunk has a program per query tile already and does not split."""
    from . import _flash

    block_m, block_n, _ = cached_tiles(head_dim)
    if queries > block_m or rows <= block_n:
        return 1, max(rows, 1)
    return _flash.decode_splits(heads, rows, block_n)


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


@triton_op("laminae::mosrah_attention_fwd", mutates_args=())
def _mosrah_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          token: torch.Tensor, position: torch.Tensor, live: torch.Tensor,
                          inv_freq: torch.Tensor, scale: float, max_len: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Z, LSE, q̃, k̃, v)``: the last three are the packed copy rows the backward reuses."""
    B, N, L, U = q.shape
    t = tiles(U, q.dtype)
    block_h, block_u = _blocks(U)
    segments = cu_seqlens.shape[0] - 1
    rows = (token.shape[0], U)
    qr, kr, vr = (empty(rows, dtype=q.dtype, device=q.device) for _ in range(3))
    wrap_triton(_pack_kernel)[(triton.cdiv(max_len, ROWS), segments)](
        q, k, v, cu_seqlens, token, position, live, inv_freq, qr, kr, vr, L, U // 2, U,
        BLOCK_R=ROWS, BLOCK_H=block_h, num_warps=ROW_WARPS)
    # pairs no copy selects stay 0: Z there is structurally zero, not unwritten memory
    z = torch.zeros_like(q)
    lse = empty(token.shape, dtype=torch.float32, device=q.device)
    wrap_triton(_mosrah_fwd_kernel)[(triton.cdiv(max_len, t.fwd_m), segments)](
        qr, kr, vr, cu_seqlens, token, live, z, lse, L, U, scale * LOG2E,
        BLOCK_M=t.fwd_m, BLOCK_N=t.fwd_n, BLOCK_U=block_u, PRECISION=dot_precision(q.dtype),
        num_warps=t.warps, num_stages=t.stages)
    return z, lse, qr, kr, vr


@triton_op("laminae::mosrah_attention_bwd", mutates_args=())
def _mosrah_attention_bwd(qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, cu_seqlens: torch.Tensor,
                          token: torch.Tensor, position: torch.Tensor, live: torch.Tensor,
                          inv_freq: torch.Tensor, scale: float, max_len: int, z: torch.Tensor, dz: torch.Tensor,
                          lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N, L, U = z.shape
    t = tiles(U, z.dtype)
    block_h, block_u = _blocks(U)
    segments = cu_seqlens.shape[0] - 1
    dzr = empty(qr.shape, dtype=qr.dtype, device=qr.device)
    delta = empty(token.shape, dtype=torch.float32, device=qr.device)
    row_grid = (triton.cdiv(max_len, ROWS), segments)
    wrap_triton(_bwd_prep_kernel)[row_grid](dz, z, cu_seqlens, token, dzr, delta, L, U,
                                            BLOCK_R=ROWS, BLOCK_U=block_u, num_warps=ROW_WARPS)
    # the rotated-frame gradients stay fp32 until the rotation back
    dqr, dkr = (empty(qr.shape, dtype=torch.float32, device=qr.device) for _ in range(2))
    dv = torch.zeros_like(z)
    common = dict(BLOCK_U=block_u, PRECISION=dot_precision(z.dtype), num_warps=t.warps, num_stages=t.stages)
    wrap_triton(_mosrah_bwd_dq_kernel)[(triton.cdiv(max_len, t.dq_m), segments)](
        qr, kr, vr, cu_seqlens, live, dzr, lse, delta, dqr, L, U, scale * LOG2E, scale,
        BLOCK_M=t.dq_m, BLOCK_N=t.dq_n, **common)
    wrap_triton(_mosrah_bwd_dkdv_kernel)[(triton.cdiv(max_len, t.dkdv_n), segments)](
        qr, kr, vr, cu_seqlens, token, live, dzr, lse, delta, dkr, dv, L, U, scale * LOG2E, scale,
        BLOCK_M=t.dkdv_m, BLOCK_N=t.dkdv_n, **common)
    dq, dk = torch.zeros_like(z), torch.zeros_like(z)
    wrap_triton(_unpack_grad_kernel)[row_grid](dqr, dkr, cu_seqlens, token, position, inv_freq, dq, dk,
                                               L, U // 2, U, BLOCK_R=ROWS, BLOCK_H=block_h, num_warps=ROW_WARPS)
    return dq, dk, dv


def _setup_context(ctx, inputs, output):
    _, _, _, cu_seqlens, token, position, live, inv_freq, scale, max_len = inputs
    z, lse, qr, kr, vr = output
    ctx.save_for_backward(qr, kr, vr, cu_seqlens, token, position, live, inv_freq, z, lse)
    ctx.scale, ctx.max_len = scale, max_len


def _backward(ctx, dz, *_unused):
    qr, kr, vr, cu_seqlens, token, position, live, inv_freq, z, lse = ctx.saved_tensors
    dq, dk, dv = _mosrah_attention_bwd(qr, kr, vr, cu_seqlens, token, position, live, inv_freq, ctx.scale,
                                       ctx.max_len, z, dz.contiguous(), lse)
    return dq, dk, dv, None, None, None, None, None, None, None


_mosrah_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


@triton_op("laminae::mosrah_cached_attention", mutates_args=())
def _mosrah_cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, limit: torch.Tensor,
                             scale: float) -> torch.Tensor:
    from . import _flash

    B, L, T, U = q.shape
    block_u = _blocks(U)[1]
    z = empty(q.shape, dtype=q.dtype, device=q.device)
    splits, per = cached_splits(B * L, T, keys.shape[1], U)
    block_m, block_n, warps = cached_tiles(U, splits > 1)
    part = ml = None
    if splits > 1:
        part = empty((B * L * splits * block_m, block_u), dtype=torch.float32, device=q.device)
        ml = empty((B * L * splits * block_m, 2), dtype=torch.float32, device=q.device)
    wrap_triton(_mosrah_cached_kernel)[(triton.cdiv(T, block_m), B * L, splits)](
        q, keys, values, limit, z, part, ml, L, T, U, keys.stride(0), keys.stride(1), scale * LOG2E, per,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_U=block_u, PRECISION=dot_precision(q.dtype),
        SPLIT=splits > 1, num_warps=warps, num_stages=2)
    if splits > 1:
        # the flash decoding merge, each head (b, l) as one (b, h) of a single-head [B·L, T, 1, U]
        wrap_triton(_flash._flash_decode_combine)[(B * L, T)](
            part, ml, z, T, 1, U, splits, BLOCK_M=block_m, BLOCK_SPLIT=_flash.DECODE_MAX_SPLITS,
            BLOCK_D=block_u, num_warps=_flash.decode_warps(block_u))
    return z


def mosrah_cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, limit: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Attention of a chunk's rotated queries over a MoSRAH cache (inference: no backward).

    Args:
        q: ``[B, L, T, u]`` rotated queries, packed per head (slot order).
        keys, values: ``[B, length, L, u]`` the cache's rows (rotated keys), any
            float dtype (cast to q's in the kernel); the last two dims contiguous.
        limit: ``[B, L, T]`` int32: query ``t`` sees rows ``j < limit`` (0: none).
        scale: the score factor A/√u.
    Returns:
        ``[B, L, T, u]`` in q's dtype (0 where ``limit`` is 0).
    """
    keys, values = (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()
                    for t in (keys, values))
    return _mosrah_cached_attention(q.contiguous(), keys, values, limit.to(torch.int32).contiguous(), float(scale))


def mosrah_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     token: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                     inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention inside each varlen segment of copies (differentiable in q, k, v).

    Args:
        q, k, v: ``[B, N, L, u]`` projections of every (token, head) pair (pre-RoPE).
        cu_seqlens: ``[B·L + 1]`` int32 segment offsets into the copy rows.
        token: ``[B·N·K]`` int32 source row ``b·N + n`` of each copy (expert-major).
        position_ids: ``[B·N·K]`` int32 BEA position of each copy;  attention_mask:
            ``[B·N·K]`` int8 keep mask of the copies (1 = live).
        inv_freq: ``[u/2]`` fp32 θ′;  scale: the score factor A/√u.
    Returns:
        ``Z`` ``[B, N, L, u]`` in q's dtype: each selected pair's attention output
        (0 for pairs no copy selects and for dead copies).
    """
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"Triton MoSRAH supports fp32/bf16/fp16 activations, got {q.dtype}")
    head_dim = q.shape[-1]
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise ShapeError(f"Triton MoSRAH needs an even head_dim ≤ {MAX_HEAD_DIM}, got {head_dim}")
    z = _mosrah_attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, token, position_ids,
                              attention_mask, inv_freq.to(torch.float32).contiguous(), float(scale), q.shape[1])[0]
    return z


def packed_layout(indices: torch.Tensor, num_heads: int, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                  rope_mode: str):
    """Expert-major varlen layout of the copies (torch, no host sync) for the head
    choices ``indices`` ``[B, N, K]``, ``position_ids`` and the bool keep mask
    ``attention_mask`` ``[B, N]``.

    Returns ``(cu_seqlens [B·L+1] int32, token [B·N·K] int32, position_ids [B·N·K] int32,
    attention_mask [B·N·K] int8)``; see :func:`mosrah_attention`."""
    B, N, K = indices.shape
    flat = indices.reshape(B, N * K)
    order = torch.argsort(flat, dim=-1, stable=True)
    heads = flat.gather(-1, order)
    token = torch.div(order, K, rounding_mode="floor")
    counts = torch.zeros(B, num_heads, dtype=torch.long, device=indices.device)
    counts.scatter_add_(1, flat, torch.ones_like(flat))
    starts = counts.cumsum(-1) - counts
    row0 = torch.arange(B, device=indices.device)[:, None] * (N * K)
    cu = torch.cat([(starts + row0).flatten(), torch.full((1,), B * N * K, device=indices.device)])
    if rope_mode == "main_sequence":
        position = position_ids.gather(-1, token)
    else:
        position = torch.arange(N * K, device=indices.device) - starts.gather(-1, heads)
    copy_live = attention_mask.gather(-1, token)
    token = token + torch.arange(B, device=indices.device)[:, None] * N
    return (cu.to(torch.int32), token.flatten().to(torch.int32), position.flatten().to(torch.int32),
            copy_live.flatten().to(torch.int8))


def mosrah(x: torch.Tensor, routing_weight: torch.Tensor, expert_bias: torch.Tensor, q_proj: torch.Tensor,
           k_proj: torch.Tensor, v_proj: torch.Tensor, o_proj: torch.Tensor, position_ids: torch.Tensor,
           attention_mask: torch.Tensor | None = None, *, top_k: int, inv_freq: torch.Tensor,
           attention_scale: float, rope_mode: str = "main_sequence",
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton MoSRAH with the signature of :func:`laminae.primitives.mosrah.mosrah_reference`:
    ``(h_s [B, N, d], load_balance_loss, max_vio)``. Activations fp32/bf16/fp16; the
    output has x's dtype."""
    B, N, d = x.shape
    L, _, u = q_proj.shape
    dtype = x.dtype
    live = dense_keep_mask(attention_mask, B, N, x.device)
    x = sanitize_padding(x, live)
    routing = mosrah_route(x, routing_weight, expert_bias, top_k, live)
    cu, token, position, copy_live = packed_layout(routing.indices, L, position_ids, live, rope_mode)
    flat = x.reshape(B * N, d)

    def project(w):   # every (token, head) pair: [B·N, d] × [d, L·u]
        return (flat @ w.to(dtype).permute(1, 0, 2).reshape(d, L * u)).view(B, N, L, u)

    z = mosrah_attention(project(q_proj), project(k_proj), project(v_proj), cu, token, position, copy_live,
                         inv_freq, attention_scale)
    dense_p = torch.zeros(B, N, L, dtype=routing.weights.dtype, device=x.device).scatter(
        -1, routing.indices, routing.weights)
    weighted = (z.float() * dense_p[..., None]).to(dtype).reshape(B * N, L * u)
    out = (weighted @ o_proj.to(dtype).reshape(L * u, d)).view(B, N, d)
    # under autocast the GEMMs run in the autocast dtype; the output keeps x's dtype
    out = torch.where(live[..., None], out, torch.zeros((), dtype=out.dtype, device=x.device)).to(dtype)
    return out, routing.load_balance_loss, routing.max_vio


# ----------------------------------------------------------------------------
# Static configurations and the tour
# ----------------------------------------------------------------------------


def _attention_cases(p: str, t: Tiles, const: dict, tags: dict, hgmma: dict,
                     even: tuple[str, ...]) -> Iterator[StaticCase]:
    """The forward, dq and dk/dv kernels at tiles ``t``; ``even``: the integer
    arguments compiled as multiples of 16 (the packed rows' width U)."""
    layout = dict(cu_ptr="*i32", tok_ptr="*i32")
    # besides the packed rows: the copy layout (cu, token, live) and the fp32 row
    # statistics (lse, delta), fresh allocations at every launch
    packed = ("q_ptr", "k_ptr", "v_ptr", "cu_ptr", "live_ptr", "lse_ptr") + even
    yield StaticCase("mosrah_fwd", _mosrah_fwd_kernel,
                     dict(q_ptr=p, k_ptr=p, v_ptr=p) | layout | dict(live_ptr="*i8", z_ptr=p,
                     lse_ptr="*fp32", L="i32", U="i32", qk_scale="fp32"),
                     const | dict(BLOCK_M=t.fwd_m, BLOCK_N=t.fwd_n), t.warps, t.stages, tags=tags,
                     divisible=packed + ("tok_ptr", "z_ptr"), **hgmma)
    bwd = dict(q_ptr=p, k_ptr=p, v_ptr=p, cu_ptr="*i32")
    grads = dict(dz_ptr=p, lse_ptr="*fp32", delta_ptr="*fp32")
    yield StaticCase("mosrah_bwd_dq", _mosrah_bwd_dq_kernel,
                     bwd | dict(live_ptr="*i8") | grads | dict(dq_ptr="*fp32", L="i32", U="i32",
                     qk_scale="fp32", sm_scale="fp32"),
                     const | dict(BLOCK_M=t.dq_m, BLOCK_N=t.dq_n), t.warps, t.stages, tags=tags,
                     divisible=packed + ("dz_ptr", "delta_ptr", "dq_ptr"), **hgmma)
    yield StaticCase("mosrah_bwd_dkdv", _mosrah_bwd_dkdv_kernel,
                     bwd | dict(tok_ptr="*i32", live_ptr="*i8") | grads | dict(dk_ptr="*fp32", dv_ptr=p,
                     L="i32", U="i32", qk_scale="fp32", sm_scale="fp32"),
                     const | dict(BLOCK_M=t.dkdv_m, BLOCK_N=t.dkdv_n), t.warps, t.stages, tags=tags,
                     divisible=packed + ("tok_ptr", "dz_ptr", "delta_ptr", "dk_ptr", "dv_ptr"), **hgmma)


def static_cases() -> Iterator[StaticCase]:
    """Every kernel at every (dtype, head dim) tile configuration it launches with.
    Head dims that are multiples of 16 (16–128) compile as launched with 16-byte
    aligned rows (``divisible``); 16-bit ones at 64 and 128 must build on wgmma. Every
    pointer is declared aligned: the projections are fresh matmul outputs, the copy
    layout (cu_seqlens, token, position, live) and θ′ fresh int32/int8/fp32 tensors."""
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        precision = dot_precision(torch.float32 if dt == "fp32" else torch.bfloat16)
        for head_dim in (16, 32, 64, 128):
            block_h, block_u = _blocks(head_dim)
            tags = {"dtype": dt, "head_dim": head_dim}
            hgmma = dict(expect="HGMMA") if dt != "fp32" and head_dim >= 64 else {}
            layout = dict(cu_ptr="*i32", tok_ptr="*i32")
            rows = dict(BLOCK_R=ROWS, BLOCK_H=block_h)
            yield StaticCase("mosrah_pack", _pack_kernel,
                             dict(q_ptr=p, k_ptr=p, v_ptr=p) | layout | dict(pos_ptr="*i32", live_ptr="*i8",
                             freq_ptr="*fp32", qr_ptr=p, kr_ptr=p, vr_ptr=p, L="i32", HALF="i32", U="i32"),
                             rows, ROW_WARPS, tags=tags,
                             divisible=("q_ptr", "k_ptr", "v_ptr", "cu_ptr", "tok_ptr", "pos_ptr", "live_ptr",
                                        "freq_ptr", "qr_ptr", "kr_ptr", "vr_ptr", "U"))
            yield StaticCase("mosrah_bwd_prep", _bwd_prep_kernel,
                             dict(dz_ptr=p, z_ptr=p) | layout | dict(dzr_ptr=p, delta_ptr="*fp32", L="i32", U="i32"),
                             dict(BLOCK_R=ROWS, BLOCK_U=block_u), ROW_WARPS, tags=tags,
                             divisible=("dz_ptr", "z_ptr", "cu_ptr", "tok_ptr", "dzr_ptr", "delta_ptr", "U"))
            yield StaticCase("mosrah_unpack_grad", _unpack_grad_kernel,
                             dict(dqr_ptr="*fp32", dkr_ptr="*fp32") | layout | dict(pos_ptr="*i32", freq_ptr="*fp32",
                             dq_ptr=p, dk_ptr=p, L="i32", HALF="i32", U="i32"),
                             rows, ROW_WARPS, tags=tags,
                             divisible=("dqr_ptr", "dkr_ptr", "cu_ptr", "tok_ptr", "pos_ptr", "freq_ptr", "dq_ptr",
                                        "dk_ptr", "U"))
            const = dict(BLOCK_U=block_u, PRECISION=precision)
            dtype = torch.float32 if dt == "fp32" else torch.bfloat16
            yield from _attention_cases(p, tiles(head_dim, dtype), const, tags, hgmma, ("U",))
            # a head dim that is not a multiple of 16 (u − 2) launches with U unspecialised, with its own tiles
            yield from _attention_cases(p, tiles(head_dim - 2, dtype), const, tags | {"head_dim": head_dim - 2},
                                        {}, ())
            for split in (False, True):
                c_m, c_n, c_warps = cached_tiles(head_dim, split)
                yield StaticCase("mosrah_cached", _mosrah_cached_kernel,
                                 dict(q_ptr="*fp32", k_ptr=p, v_ptr=p, limit_ptr="*i32", z_ptr="*fp32",
                                      part_ptr="*fp32", ml_ptr="*fp32", L="i32", T="i32", U="i32", stride_kb="i32",
                                      stride_kj="i32", qk_scale="fp32", SPLIT_N="i32"),
                                 dict(BLOCK_M=c_m, BLOCK_N=c_n, BLOCK_U=block_u, PRECISION="ieee", SPLIT=split),
                                 c_warps, 2, tags=tags | {"cache": dt},
                                 divisible=("q_ptr", "k_ptr", "v_ptr", "limit_ptr", "z_ptr", "U", "stride_kj")
                                 + (("part_ptr", "ml_ptr") if split else ()))
    # the local sliding-window path of SHRAM: the shared flash core with a window
    from . import _flash

    yield from _flash.static_cases(windows=(True,))


def tour_case(device: torch.device):
    from laminae.primitives.blocks.rotary import yarn_rope
    from laminae.primitives.mosrah import mosrah_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    B, N, d, L, K, u = 2, 48, 64, 8, 3, 16
    rope = yarn_rope(u, 10000.0, 64, 256, 1.0, 8.0)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, :5] = False
    inputs = {
        "x": torch.randn(B, N, d, generator=gen).to(device),
        "routing_weight": (torch.randn(L, d, generator=gen) * 0.3).to(device),
        "expert_bias": (torch.randn(L, generator=gen) * 0.1).to(device),
        "q_proj": (torch.randn(L, d, u, generator=gen) / d**0.5).to(device),
        "k_proj": (torch.randn(L, d, u, generator=gen) / d**0.5).to(device),
        "v_proj": (torch.randn(L, d, u, generator=gen) / d**0.5).to(device),
        "o_proj": (torch.randn(L, u, d, generator=gen) / u**0.5).to(device),
        "position_ids": (torch.cumsum(mask.long(), 1) - 1).clamp_min(0).to(device),
        "attention_mask": mask.to(device),
        "top_k": K, "inv_freq": rope.inv_freq.to(device), "attention_scale": rope.attention_scale,
    }
    grads = ["x", "routing_weight", "expert_bias", "q_proj", "k_proj", "v_proj", "o_proj"]
    return TourCase("mosrah (L=8, K=3, u=16, YaRN s=4, padded)", mosrah, mosrah_reference, inputs, grads)
