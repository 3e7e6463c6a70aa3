"""MoSRAH kernels: varlen causal flash attention over the expert-packed copies, with
the copy gather and the YaRN rotation fused in.

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

- forward: per query tile, rotate q̃ = RoPE(q, pos) in registers (half-split: the
  two halves are separate ``tl.dot`` operands, padded to ≥ 16 columns), loop over
  key tiles up to the causal bound (slot order) rotating k̃ likewise, mask dead
  keys and dead queries, fp32 online softmax (base 2) with the score scale A/√u;
  write Z at the (token, head) pair and the natural LSE per copy.
- backward dq: recompute P from the LSE; dS = P ⊙ (dP − δ) with δ = rowsum(dZ·Z);
  dq̃ = scale·dS·k̃, rotated back by −angle and written at the pair.
- backward dk/dv: per key tile, loop over the query tiles at or after it; dv = Pᵀ·dZ,
  dk̃ = scale·dSᵀ·q̃ rotated back. No atomics: every output row has one writer, so
  results are run-to-run deterministic.

Nothing S×S is stored: the backward saves Z (dense, u-wide) and the LSE per copy.
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

__all__ = ["mosrah", "mosrah_attention", "packed_layout", "static_cases", "tour_case"]

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
def _load_rotated(ptr, rows, row_ok, tok, head, L, HALF, pos, freq_ptr, BLOCK_H: tl.constexpr):
    """The two halves ``[rows, BLOCK_H]`` of q (or k) of the (token, head) pairs,
    rotated by ``pos·θ′`` (fp32, in registers)."""
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < HALF
    base = (tok.to(tl.int64) * L + head) * (2 * HALF)
    mask = row_ok[:, None] & h_ok[None, :]
    a = tl.load(ptr + base[:, None] + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(ptr + base[:, None] + HALF + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
    freq = tl.load(freq_ptr + offs_h, mask=h_ok, other=0.0)
    sin, cos = _sincos(pos.to(tl.float32)[:, None] * freq[None, :])
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def _unrotate(da, db, pos, freq_ptr, HALF, BLOCK_H: tl.constexpr):
    """Gradient of the rotation: rotate ``(da, db)`` by −angle."""
    offs_h = tl.arange(0, BLOCK_H)
    freq = tl.load(freq_ptr + offs_h, mask=offs_h < HALF, other=0.0)
    sin, cos = _sincos(pos.to(tl.float32)[:, None] * freq[None, :])
    return da * cos + db * sin, db * cos - da * sin


@triton.jit
def _store_pair(ptr, rows_ok, tok, head, L, HALF, a, b, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    base = (tok.to(tl.int64) * L + head) * (2 * HALF)
    mask = rows_ok[:, None] & (offs_h < HALF)[None, :]
    tl.store(ptr + base[:, None] + offs_h[None, :], a.to(ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + base[:, None] + HALF + offs_h[None, :], b.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _segment(cu_ptr, pid_s, L):
    start = tl.load(cu_ptr + pid_s)
    length = tl.load(cu_ptr + pid_s + 1) - start
    return start, length, pid_s % L


@triton.jit
def _copies(tok_ptr, pos_ptr, live_ptr, start, local, length):
    ok = local < length
    rows = start + local
    tok = tl.load(tok_ptr + rows, mask=ok, other=0)
    pos = tl.load(pos_ptr + rows, mask=ok, other=0)
    live = tl.load(live_ptr + rows, mask=ok, other=0) != 0
    return rows, ok, tok, pos, live


@triton.jit
def _mosrah_fwd_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, tok_ptr, pos_ptr, live_ptr, freq_ptr, z_ptr, lse_ptr,
                       L, HALF, U, qk_scale,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_U: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    start, length, head = _segment(cu_ptr, tl.program_id(1), L)
    if pid_m * BLOCK_M >= length:
        return
    local_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows, row_ok, tok, pos, q_live = _copies(tok_ptr, pos_ptr, live_ptr, start, local_m, length)
    qa, qb = _load_rotated(q_ptr, rows, row_ok, tok, head, L, HALF, pos, freq_ptr, BLOCK_H)
    qa = qa.to(q_ptr.dtype.element_ty)
    qb = qb.to(q_ptr.dtype.element_ty)
    offs_u = tl.arange(0, BLOCK_U)
    u_ok = offs_u < U

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_U), dtype=tl.float32)
    hi = tl.minimum(length, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        local_n = start_n + tl.arange(0, BLOCK_N)
        cols, col_ok, ktok, kpos, k_live = _copies(tok_ptr, pos_ptr, live_ptr, start, local_n, length)
        ka, kb = _load_rotated(k_ptr, cols, col_ok, ktok, head, L, HALF, kpos, freq_ptr, BLOCK_H)
        s = tl.dot(qa, tl.trans(ka.to(k_ptr.dtype.element_ty)), input_precision=PRECISION)
        s += tl.dot(qb, tl.trans(kb.to(k_ptr.dtype.element_ty)), input_precision=PRECISION)
        s = s * qk_scale
        vis = (local_n[None, :] <= local_m[:, None]) & (k_live & col_ok)[None, :] & (q_live & row_ok)[:, None]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        corr = tl.exp2(m_i - m_shift)
        l_i = l_i * corr + tl.sum(p, 1)
        vbase = (ktok.to(tl.int64) * L + head) * U
        v = tl.load(v_ptr + vbase[:, None] + offs_u[None, :], mask=col_ok[:, None] & u_ok[None, :], other=0.0)
        # dead keys may hold anything finite; p is 0 there, but keep them out of p·v exactly
        v = tl.where(k_live[:, None], v, 0.0)
        acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    empty_row = l_i == 0.0
    l_safe = tl.where(empty_row, 1.0, l_i)
    z = acc / l_safe[:, None]
    lse = tl.where(empty_row, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    zbase = (tok.to(tl.int64) * L + head) * U
    tl.store(z_ptr + zbase[:, None] + offs_u[None, :], z.to(z_ptr.dtype.element_ty),
             mask=row_ok[:, None] & u_ok[None, :])
    tl.store(lse_ptr + rows, lse, mask=row_ok)


@triton.jit
def _mosrah_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, tok_ptr, pos_ptr, live_ptr, freq_ptr,
                          dz_ptr, lse_ptr, delta_ptr, dq_ptr,
                          L, HALF, U, qk_scale, sm_scale,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_U: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    start, length, head = _segment(cu_ptr, tl.program_id(1), L)
    if pid_m * BLOCK_M >= length:
        return
    local_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows, row_ok, tok, pos, q_live = _copies(tok_ptr, pos_ptr, live_ptr, start, local_m, length)
    qa, qb = _load_rotated(q_ptr, rows, row_ok, tok, head, L, HALF, pos, freq_ptr, BLOCK_H)
    qa = qa.to(q_ptr.dtype.element_ty)
    qb = qb.to(q_ptr.dtype.element_ty)
    offs_u = tl.arange(0, BLOCK_U)
    u_ok = offs_u < U
    pair = tok.to(tl.int64) * L + head
    do = tl.load(dz_ptr + pair[:, None] * U + offs_u[None, :], mask=row_ok[:, None] & u_ok[None, :], other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + pair, mask=row_ok, other=0.0)

    dqa = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    dqb = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    hi = tl.minimum(length, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        local_n = start_n + tl.arange(0, BLOCK_N)
        cols, col_ok, ktok, kpos, k_live = _copies(tok_ptr, pos_ptr, live_ptr, start, local_n, length)
        ka, kb = _load_rotated(k_ptr, cols, col_ok, ktok, head, L, HALF, kpos, freq_ptr, BLOCK_H)
        ka = ka.to(k_ptr.dtype.element_ty)
        kb = kb.to(k_ptr.dtype.element_ty)
        s = tl.dot(qa, tl.trans(ka), input_precision=PRECISION)
        s += tl.dot(qb, tl.trans(kb), input_precision=PRECISION)
        s = s * qk_scale
        vis = (local_n[None, :] <= local_m[:, None]) & (k_live & col_ok)[None, :] & (q_live & row_ok)[:, None]
        p = tl.exp2(tl.where(vis, s, float("-inf")) - lse2[:, None])
        vbase = (ktok.to(tl.int64) * L + head) * U
        v = tl.load(v_ptr + vbase[:, None] + offs_u[None, :], mask=col_ok[:, None] & u_ok[None, :], other=0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = tl.where(vis, p * (dp - delta[:, None]), 0.0)
        dqa += tl.dot(ds.to(ka.dtype), ka, input_precision=PRECISION)
        dqb += tl.dot(ds.to(kb.dtype), kb, input_precision=PRECISION)
    dqa, dqb = _unrotate(dqa * sm_scale, dqb * sm_scale, pos, freq_ptr, HALF, BLOCK_H)
    _store_pair(dq_ptr, row_ok, tok, head, L, HALF, dqa, dqb, BLOCK_H)


@triton.jit
def _mosrah_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, tok_ptr, pos_ptr, live_ptr, freq_ptr,
                            dz_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                            L, HALF, U, qk_scale, sm_scale,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_U: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    start, length, head = _segment(cu_ptr, tl.program_id(1), L)
    if pid_n * BLOCK_N >= length:
        return
    local_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols, col_ok, ktok, kpos, k_live = _copies(tok_ptr, pos_ptr, live_ptr, start, local_n, length)
    ka, kb = _load_rotated(k_ptr, cols, col_ok, ktok, head, L, HALF, kpos, freq_ptr, BLOCK_H)
    ka = ka.to(k_ptr.dtype.element_ty)
    kb = kb.to(k_ptr.dtype.element_ty)
    offs_u = tl.arange(0, BLOCK_U)
    u_ok = offs_u < U
    kpair = ktok.to(tl.int64) * L + head
    kv_mask = col_ok[:, None] & u_ok[None, :]
    v = tl.load(v_ptr + kpair[:, None] * U + offs_u[None, :], mask=kv_mask, other=0.0)
    dka = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
    dkb = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_U), dtype=tl.float32)
    lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M     # the first query tile that can see this key tile
    for start_m in range(lo, length, BLOCK_M):
        local_m = start_m + tl.arange(0, BLOCK_M)
        rows, row_ok, tok, pos, q_live = _copies(tok_ptr, pos_ptr, live_ptr, start, local_m, length)
        qa, qb = _load_rotated(q_ptr, rows, row_ok, tok, head, L, HALF, pos, freq_ptr, BLOCK_H)
        qa = qa.to(q_ptr.dtype.element_ty)
        qb = qb.to(q_ptr.dtype.element_ty)
        pair = tok.to(tl.int64) * L + head
        do = tl.load(dz_ptr + pair[:, None] * U + offs_u[None, :], mask=row_ok[:, None] & u_ok[None, :],
                     other=0.0)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
        delta = tl.load(delta_ptr + pair, mask=row_ok, other=0.0)
        # transposed scores [BLOCK_N keys, BLOCK_M queries]
        st = tl.dot(ka, tl.trans(qa), input_precision=PRECISION)
        st += tl.dot(kb, tl.trans(qb), input_precision=PRECISION)
        st = st * qk_scale
        vis = (local_n[:, None] <= local_m[None, :]) & (k_live & col_ok)[:, None] & (q_live & row_ok)[None, :]
        pt = tl.exp2(tl.where(vis, st, float("-inf")) - lse2[None, :])
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = tl.where(vis, pt * (dpt - delta[None, :]), 0.0)
        dka += tl.dot(dst.to(qa.dtype), qa, input_precision=PRECISION)
        dkb += tl.dot(dst.to(qb.dtype), qb, input_precision=PRECISION)
    dka, dkb = _unrotate(dka * sm_scale, dkb * sm_scale, kpos, freq_ptr, HALF, BLOCK_H)
    _store_pair(dk_ptr, col_ok, ktok, head, L, HALF, dka, dkb, BLOCK_H)
    tl.store(dv_ptr + kpair[:, None] * U + offs_u[None, :], dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


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
# fp32 takes exact ("ieee") products on the FMA units, hence smaller tiles.
_TILES_16BIT = {16: Tiles(64, 64, 64, 64, 64, 64), 32: Tiles(64, 64, 64, 64, 64, 64),
                64: Tiles(64, 64, 64, 64, 64, 64, 8), 128: Tiles(64, 32, 32, 32, 32, 32, 8)}
_TILES_FP32 = {16: Tiles(64, 32, 32, 32, 32, 32), 32: Tiles(64, 32, 32, 32, 32, 32),
               64: Tiles(32, 32, 32, 32, 32, 32, 8), 128: Tiles(16, 32, 16, 16, 16, 16, 8)}


def _blocks(head_dim: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_U): each rotation half and the full head dim, padded to ≥ 16."""
    return max(16, triton.next_power_of_2(head_dim // 2)), max(16, triton.next_power_of_2(head_dim))


def tiles(head_dim: int, dtype: torch.dtype) -> Tiles:
    """Launch tiles (tests monkeypatch this to force several tiles per segment)."""
    return (_TILES_FP32 if dtype == torch.float32 else _TILES_16BIT)[_blocks(head_dim)[1]]


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


@triton_op("laminae::mosrah_attention_fwd", mutates_args=())
def _mosrah_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          token: torch.Tensor, position: torch.Tensor, live: torch.Tensor,
                          inv_freq: torch.Tensor, scale: float, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, N, L, U = q.shape
    t = tiles(U, q.dtype)
    block_h, block_u = _blocks(U)
    # pairs no copy selects stay 0: Z there is structurally zero, not unwritten memory
    z = torch.zeros_like(q)
    lse = empty(token.shape, dtype=torch.float32, device=q.device)
    wrap_triton(_mosrah_fwd_kernel)[(triton.cdiv(max_len, t.fwd_m), cu_seqlens.shape[0] - 1)](
        q, k, v, cu_seqlens, token, position, live, inv_freq, z, lse, L, U // 2, U, scale * LOG2E,
        BLOCK_M=t.fwd_m, BLOCK_N=t.fwd_n, BLOCK_H=block_h, BLOCK_U=block_u, PRECISION=dot_precision(q.dtype),
        num_warps=t.warps, num_stages=t.stages)
    return z, lse


@triton_op("laminae::mosrah_attention_bwd", mutates_args=())
def _mosrah_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          token: torch.Tensor, position: torch.Tensor, live: torch.Tensor,
                          inv_freq: torch.Tensor, scale: float, max_len: int, dz: torch.Tensor,
                          lse: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N, L, U = q.shape
    t = tiles(U, q.dtype)
    block_h, block_u = _blocks(U)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    segments = cu_seqlens.shape[0] - 1
    common = dict(BLOCK_H=block_h, BLOCK_U=block_u, PRECISION=dot_precision(q.dtype), num_warps=t.warps,
                  num_stages=t.stages)
    args = (q, k, v, cu_seqlens, token, position, live, inv_freq, dz, lse, delta)
    wrap_triton(_mosrah_bwd_dq_kernel)[(triton.cdiv(max_len, t.dq_m), segments)](
        *args, dq, L, U // 2, U, scale * LOG2E, scale, BLOCK_M=t.dq_m, BLOCK_N=t.dq_n, **common)
    wrap_triton(_mosrah_bwd_dkdv_kernel)[(triton.cdiv(max_len, t.dkdv_n), segments)](
        *args, dk, dv, L, U // 2, U, scale * LOG2E, scale, BLOCK_M=t.dkdv_m, BLOCK_N=t.dkdv_n, **common)
    return dq, dk, dv


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, token, position, live, inv_freq, scale, max_len = inputs
    z, lse = output
    ctx.save_for_backward(q, k, v, cu_seqlens, token, position, live, inv_freq, z, lse)
    ctx.scale, ctx.max_len = scale, max_len


def _backward(ctx, dz, _dlse):
    q, k, v, cu_seqlens, token, position, live, inv_freq, z, lse = ctx.saved_tensors
    dz = dz.contiguous()
    delta = (dz.float() * z.float()).sum(-1).contiguous()
    dq, dk, dv = _mosrah_attention_bwd(q, k, v, cu_seqlens, token, position, live, inv_freq, ctx.scale,
                                       ctx.max_len, dz, lse, delta)
    return dq, dk, dv, None, None, None, None, None, None, None


_mosrah_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


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
    z, _ = _mosrah_attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, token, position_ids,
                                 attention_mask, inv_freq.to(torch.float32).contiguous(), float(scale), q.shape[1])
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


def static_cases() -> Iterator[StaticCase]:
    """Every kernel at every (dtype, head dim) tile configuration it launches with."""
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        precision = dot_precision(torch.float32 if dt == "fp32" else torch.bfloat16)
        table = _TILES_FP32 if dt == "fp32" else _TILES_16BIT
        for head_dim in (16, 32, 64, 128):
            block_h, block_u = _blocks(head_dim)
            t = table[block_u]
            meta = dict(q_ptr=p, k_ptr=p, v_ptr=p, cu_ptr="*i32", tok_ptr="*i32", pos_ptr="*i32",
                        live_ptr="*i8", freq_ptr="*fp32")
            scalars = dict(L="i32", HALF="i32", U="i32", qk_scale="fp32")
            const = dict(BLOCK_H=block_h, BLOCK_U=block_u, PRECISION=precision)
            tags = {"dtype": dt, "head_dim": head_dim}
            yield StaticCase("mosrah_fwd", _mosrah_fwd_kernel, meta | dict(z_ptr=p, lse_ptr="*fp32") | scalars,
                             const | dict(BLOCK_M=t.fwd_m, BLOCK_N=t.fwd_n), t.warps, t.stages, tags=tags)
            bwd = meta | dict(dz_ptr=p, lse_ptr="*fp32", delta_ptr="*fp32")
            yield StaticCase("mosrah_bwd_dq", _mosrah_bwd_dq_kernel,
                             bwd | dict(dq_ptr=p) | scalars | dict(sm_scale="fp32"),
                             const | dict(BLOCK_M=t.dq_m, BLOCK_N=t.dq_n), t.warps, t.stages, tags=tags)
            yield StaticCase("mosrah_bwd_dkdv", _mosrah_bwd_dkdv_kernel,
                             bwd | dict(dk_ptr=p, dv_ptr=p) | scalars | dict(sm_scale="fp32"),
                             const | dict(BLOCK_M=t.dkdv_m, BLOCK_N=t.dkdv_n), t.warps, t.stages, tags=tags)
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
