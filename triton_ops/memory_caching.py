"""Memory Caching kernels: a chunked forward and backward over sequence row blocks.

Split of the work:

- Gates γ [B, S, N] (torch, :func:`segment_gates`, differentiable): pools, the
  causal running pool, ⟨u, pool⟩ scores and the softmax over segments i ≤ s.
  O(B·S·N·G) work, no head or head-dim factor; autograd takes dγ back to u and p.
- Full memories M_i = Σ κφ(k)ᵀv [B, H, N, D, D] (fp32 sums, stored in the input
  dtype: the dot operand) and z_i [B, H, N, D] (fp32): ``_mc_mem_kernel``, program
  (segment i, b·h), BLOCK_T tokens per step, K and V read once; recomputed in
  backward.
- Four kernels over row blocks of BLOCK_L tokens of the *sequence*, as flash
  attention tiles it; a block may hold the tail of one segment and the head of the
  next (segments shorter than a block, or not a multiple of it), so BLOCK_L is
  chosen for the hardware, not for segment_len: 64 rows on the aligned 16-bit path, so
  each D×D memory tile a program loads feeds a 64-row matrix product
  (wgmma). D is padded to BLOCK_D = max(16, next_power_of_2(D)) with masked loads.
  The fp32 path keeps "ieee" dots on the FMA units, whose operands live in
  registers: it reads a memory in slabs of BLOCK_E rows or columns (BLOCK_E <
  BLOCK_D) with 16-row blocks.

Forward  ``_mc_fwd_kernel``, program (row block, b·h): own segment causally
         (A = φQ·κφKᵀ over the key blocks from the first row's segment start to
         the diagonal, masked to same segment and key ≤ query; γ_s·A·V,
         γ_s·ΣA), then walks the memories i below the block's last segment:
         acc += (γ_i·φQ)·M_i, den += γ_i·φQ·z_i (γ_i = 0 for rows in segments ≤ i).
         Writes y = acc/(den + eps) and D_t = den + eps (fp32 [B, H, S]).
Backward with dN = g/D_t and dD = −(g·y)/D_t (torch, an O(S) row statistic):
         ``_mc_bwd_q_kernel``, program (query row block, b·h): dq and
         ∂ℓ/∂γ_i per head ([B, H, S, N]; torch sums the heads), walking like the
         forward. With T_i = dN·M_iᵀ + dD·z_iᵀ: ∂ℓ/∂γ_i = φq·T_i and
         dφq += γ_i·T_i (one D×D product per memory; on the own segment
         ∂ℓ/∂γ_s = Σ A∘dA with dA = dN·Vᵀ + dD).
         ``_mc_bwd_mem_kernel``, program (segment i, b·h, BLOCK_R rows of dM):
         walks the tokens after segment i in blocks of BLOCK_L rows,
         dM_i = Σ (γ_i·φq)ᵀ·dN, dz_i = Σ γ_i·dD·φq (dM in the input dtype, dz fp32).
         ``_mc_bwd_kv_kernel``, program (key row block, b·h): two walks over
         the query blocks (BLOCK_Q rows) of the block's segments from the
         diagonal on, one for dv = Aᵀ·(γ dN) + κφK_j·dM_j, one for
         dφk = dAᵀ·φQ + V_j·dM_jᵀ + dz_j (one accumulator live at a time).

No (segments × segments × L × D) tensor exists; every program walks at most N
memories (or the S tokens after its segment) at O(BLOCK_L·D²) per step, so the
cost is linear in S for a fixed number of segments. fp32 accumulation;
fp32/bf16/fp16 inputs, 16-bit dot operands for 16-bit inputs. Nothing is written
twice: no atomics.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import ConfigError, DTypeError
from laminae.primitives.memory_caching import check_memory_caching_inputs

from ._common import StaticCase, dot_precision, empty

__all__ = ["memory_caching", "memory_caching_core", "segment_gates", "supports_tile", "MAX_HEAD_DIM"]

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128
# Input kind -> BLOCK_D (head dim padded to a power of two >= 16) ->
# (BLOCK_L, BLOCK_Q, BLOCK_E, BLOCK_R, num_warps, num_stages); launches use exactly
# these, and static_cases() lists each one.
#   BLOCK_L  rows of the sequence per program (any segment_len: blocks cross segments)
#   BLOCK_Q  query rows per step of _mc_bwd_kv_kernel's own-segment loop (divides BLOCK_L)
#   BLOCK_E  memory slab width; == BLOCK_D keeps the whole φQ/dN tile in registers
#   BLOCK_R  rows of dM per _mc_bwd_mem_kernel program (more programs at D = 128)
# "16bit": bf16/fp16 with head_dim % 16 == 0 and 16-byte-aligned tensors (what Triton
#   specialises at launch: vector loads): 64-row tiles against a D × D memory, wgmma
#   (M = 64 per warpgroup; 8 warps split N).
# "16bit-unaligned": any other head dim or an unaligned view: element-wise address
#   tiles cost registers, so 16-row tiles (mma.sync).
# "fp32": "ieee" dots on the FMA units hold their operands in registers; 32-row blocks
#   spill there, so fp32 keeps 16 rows and slabs at D ≥ 64.
CONFIGS = {
    "16bit": {16: (64, 64, 16, 16, 8, 2), 32: (64, 64, 32, 32, 4, 2), 64: (64, 64, 64, 64, 8, 2),
              128: (64, 32, 128, 64, 8, 1)},
    "16bit-unaligned": {16: (16, 16, 16, 16, 4, 2), 32: (16, 16, 32, 32, 4, 2), 64: (16, 16, 64, 32, 4, 2),
                        128: (16, 16, 32, 32, 8, 1)},
    "fp32": {16: (16, 16, 16, 16, 8, 2), 32: (16, 16, 32, 32, 4, 1), 64: (16, 16, 32, 32, 8, 2),
             128: (16, 16, 16, 16, 8, 1)},
}
# _mc_mem_kernel: input kind -> BLOCK_D -> (BLOCK_T tokens per step, num_warps). The
# product is κφ(K)ᵀ·V, [BLOCK_D, BLOCK_T]·[BLOCK_T, BLOCK_D]: BLOCK_D is the MMA's M
# (64/128: wgmma), BLOCK_T its K.
MEM_CONFIGS = {
    "16bit": {16: (64, 4), 32: (64, 4), 64: (64, 4), 128: (64, 8)},
    "16bit-unaligned": {16: (32, 4), 32: (32, 4), 64: (32, 4), 128: (32, 8)},
    "fp32": {16: (16, 4), 32: (16, 4), 64: (16, 4), 128: (16, 8)},
}
# arguments a "16bit" launch has as multiples of 16 (static_cases passes them to the compile)
_DIVISIBLE = ("q_ptr", "k_ptr", "v_ptr", "mem_ptr", "y_ptr", "g_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "dmem_ptr", "D")
# fp32 side tensors every launch of any kind passes 16-byte aligned: the keep mask and
# gates arrive contiguous, the rest are fresh allocations
_SCRATCH = ("keep_ptr", "gam_ptr", "z_ptr", "den_ptr", "dden_ptr", "dgam_ptr", "dz_ptr")


def _aligned(kind: str, signature: dict) -> tuple[str, ...]:
    """What Triton's launcher specialises as 16-divisible at a launch of ``kind``:
    "16bit" everything in ``_DIVISIBLE``; "fp32" every pointer (contiguous inputs and
    fresh outputs; the head dim varies within a BLOCK_D); "16bit-unaligned" the side
    tensors only, since its inputs may be the unaligned views that chose it."""
    pointers = tuple(k for k, v in signature.items() if v.startswith("*"))
    if kind == "fp32":
        return pointers
    return tuple(a for a in signature if a in _SCRATCH or (kind == "16bit" and a in _DIVISIBLE))


# ----------------------------------------------------------------------------
# Tile helpers
# ----------------------------------------------------------------------------


@triton.jit
def _phi(x):
    return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))


@triton.jit
def _operand(x, dtype: tl.constexpr):
    """``x`` as a dot operand of ``dtype``. fp16 saturates at ±65504: a 1/den factor
    (den ≥ eps) can exceed fp16's range on rows whose every read is empty (left
    padding), where it multiplies exact zeros; inf·0 would be NaN in the product."""
    if dtype == tl.float16:
        x = tl.clamp(x, -65504.0, 65504.0)
    return x.to(dtype)


@triton.jit
def _row_block(blk, b, h, S, H, D, L, cd, BLOCK_L: tl.constexpr):
    """Tokens of sequence row block ``blk``: (tok, their segment, tok < S, the element
    offset of [b, tok, h, 0] from :func:`_block_start`, the [BLOCK_L, BLOCK_D] load mask).
    The offsets are int32 (one block spans BLOCK_L·H·D elements); the 64-bit part is
    the scalar block start, so no tile of 64-bit addresses stays live in registers."""
    tok = blk * BLOCK_L + tl.arange(0, BLOCK_L)
    ok = tok < S
    hd = tl.arange(0, BLOCK_L) * (H * D)
    return tok, tok // L, ok, hd, ok[:, None] & (cd < D)[None, :]


@triton.jit
def _block_start(blk, b, h, S, H, D, BLOCK_L: tl.constexpr):
    """Element offset (int64) of [b, blk·BLOCK_L, h, 0] in a [B, S, H, D] tensor."""
    return (b * S + blk * BLOCK_L) * H * D + h * D


@triton.jit
def _load_rows(ptr, hd, cols, mask):
    return tl.load(ptr + hd[:, None] + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _phi_rows(ptr, hd, cols, mask):
    """φ of a row tile in fp32; 0 outside ``mask`` (φ(0) = 1 would leak)."""
    return tl.where(mask, _phi(_load_rows(ptr, hd, cols, mask).to(tl.float32)), 0.0)


@triton.jit
def _key_tiles(k_ptr, v_ptr, keep_ptr, b, S, tok, ok, hd, cd, mask):
    """κφ(K) and V of a key row block in the input dtype, and the kept rows. Padded
    keys are never loaded (their contents, even NaN, cannot reach a product)."""
    kept = ok & (tl.load(keep_ptr + b * S + tok, mask=ok, other=0.0) > 0)
    m = mask & kept[:, None]
    phk = _operand(_phi_rows(k_ptr, hd, cd, m), k_ptr.dtype.element_ty)
    return phk, _load_rows(v_ptr, hd, cd, m), kept


@triton.jit
def _own_mask(row_tok, row_seg, col_tok, col_seg, ROWS_ARE_QUERIES: tl.constexpr):
    """Own-segment causal mask: same segment and key ≤ query."""
    same = row_seg[:, None] == col_seg[None, :]
    if ROWS_ARE_QUERIES:
        return same & (col_tok[None, :] <= row_tok[:, None])
    return same & (row_tok[:, None] <= col_tok[None, :])


@triton.jit
def _matrix(ptr, base, rows, cols, D, TRANS: tl.constexpr):
    """[rows, cols] tile of the D×D matrix at ``ptr + base·D`` (of its transpose if
    TRANS), in the stored dtype; 0 outside D."""
    m = (rows < D)[:, None] & (cols < D)[None, :]
    ptr += base * D
    if TRANS:
        return tl.load(ptr + cols[None, :] * D + rows[:, None], mask=m, other=0.0)
    return tl.load(ptr + rows[:, None] * D + cols[None, :], mask=m, other=0.0)


@triton.jit
def _times_matrix(acc, x, x_ptr, hd, rows_ok, scale, PHI: tl.constexpr, mat_ptr, base, cd, D,
                  TRANS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + (scale·X)·Mat`` (``Matᵀ`` if TRANS), Mat the D×D matrix at ``mat_ptr +
    base·D``, operands in Mat's dtype. X [BLOCK_L, BLOCK_D] is ``x`` (registers, 0
    outside ``rows_ok``) when one slab covers D; otherwise X is reloaded from
    ``x_ptr`` in slabs of BLOCK_E columns (φ applied if PHI) against BLOCK_E rows of Mat."""
    op = mat_ptr.dtype.element_ty
    if BLOCK_E == BLOCK_D:
        mat = _matrix(mat_ptr, base, cd, cd, D, TRANS)
        acc = tl.dot(_operand(scale[:, None] * x, op), mat, acc, input_precision=PRECISION)
    else:
        ce = tl.arange(0, BLOCK_E)
        for e0 in range(0, D, BLOCK_E):
            cs = e0 + ce
            m = rows_ok[:, None] & (cs < D)[None, :]
            if PHI:
                xs = _phi_rows(x_ptr, hd, cs, m)
            else:
                xs = _load_rows(x_ptr, hd, cs, m).to(tl.float32)
            mat = _matrix(mat_ptr, base, cs, cd, D, TRANS)
            acc = tl.dot(_operand(scale[:, None] * xs, op), mat, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _first_block_of_segment(blk, L, BLOCK_L: tl.constexpr):
    """Row block holding the first token of the segment of block ``blk``'s first row."""
    return (blk * BLOCK_L // L) * L // BLOCK_L


@triton.jit
def _last_segment(blk, S, L, BLOCK_L: tl.constexpr):
    """Segment of the last valid token of row block ``blk``."""
    return (tl.minimum(blk * BLOCK_L + BLOCK_L, S) - 1) // L


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _mc_mem_kernel(k_ptr, v_ptr, keep_ptr, mem_ptr, z_ptr, S, H, D, L, N,
                   BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Program (segment i, b·h): M_i = Σ κφ(k_t)ᵀ v_t over the kept tokens t of segment
    i (fp32 sum, stored in the input dtype: the other kernels' dot operand) and
    z_i = Σ κφ(k_t) (fp32). Dropped tokens are never loaded (0·NaN would be NaN)."""
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    cd = tl.arange(0, BLOCK_D)
    d_ok = cd < D
    rows = tl.arange(0, BLOCK_T)
    hd = rows[:, None] * (H * D) + cd[None, :]
    acc = tl.zeros([BLOCK_D, BLOCK_D], dtype=tl.float32)
    z = tl.zeros([BLOCK_D], dtype=tl.float32)
    end = tl.minimum(i * L + L, S)
    for t0 in range(i * L, end, BLOCK_T):
        tok = t0 + rows
        ok = tok < end
        kept = ok & (tl.load(keep_ptr + b * S + tok, mask=ok, other=0.0) > 0)
        m = kept[:, None] & d_ok[None, :]
        start = ((b * S + t0) * H + h) * D
        phk = tl.where(m, _phi(tl.load(k_ptr + start + hd, mask=m, other=0.0).to(tl.float32)), 0.0)
        v = tl.load(v_ptr + start + hd, mask=m, other=0.0)
        z += tl.sum(phk, axis=0)
        acc = tl.dot(tl.trans(_operand(phk, v.dtype)), v, acc, input_precision=PRECISION)
    out = (bh * N + i) * D
    tl.store(mem_ptr + out * D + cd[:, None] * D + cd[None, :], _operand(acc, mem_ptr.dtype.element_ty),
             mask=d_ok[:, None] & d_ok[None, :])
    tl.store(z_ptr + out + cd, z, mask=d_ok)


@triton.jit
def _mc_fwd_kernel(q_ptr, k_ptr, v_ptr, keep_ptr, gam_ptr, mem_ptr, z_ptr, y_ptr, den_ptr,
                   S, H, D, L, N, eps,
                   BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                   PRECISION: tl.constexpr):
    rb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    cd = tl.arange(0, BLOCK_D)
    tok, seg, row_ok, hd, m_hd = _row_block(rb, b, h, S, H, D, L, cd, BLOCK_L)
    qo = _block_start(rb, b, h, S, H, D, BLOCK_L)
    gam_row = (b * S + tok) * N
    phq = _operand(_phi_rows(q_ptr + qo, hd, cd, m_hd), q_ptr.dtype.element_ty)

    # own segment: causal linear attention over the key blocks from its start
    acc = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    acc_den = tl.zeros([BLOCK_L], dtype=tl.float32)
    for kb in range(_first_block_of_segment(rb, L, BLOCK_L), rb + 1):
        ktok, kseg, k_ok, khd, m_k = _row_block(kb, b, h, S, H, D, L, cd, BLOCK_L)
        ko = _block_start(kb, b, h, S, H, D, BLOCK_L)
        phk, v, _ = _key_tiles(k_ptr + ko, v_ptr + ko, keep_ptr, b, S, ktok, k_ok, khd, cd, m_k)
        a = tl.dot(phq, tl.trans(phk), input_precision=PRECISION)
        # the scores A·V multiplies (in the operand dtype) are the ones summed into den:
        # y stays a weighted mean of the values, exactly v for a token that sees only itself
        a = _operand(tl.where(_own_mask(tok, seg, ktok, kseg, True), a, 0.0), v.dtype)
        acc = tl.dot(a, v, acc, input_precision=PRECISION)
        acc_den += tl.sum(a.to(tl.float32), axis=1)
    gam = tl.load(gam_ptr + gam_row + seg, mask=row_ok, other=0.0)
    acc = gam[:, None] * acc
    acc_den = gam * acc_den
    # earlier segments' full memories; rows in segments <= i get γ_i = 0
    for i in range(0, _last_segment(rb, S, L, BLOCK_L)):
        gam = tl.load(gam_ptr + gam_row + i, mask=row_ok & (i < seg), other=0.0)
        base = (bh * N + i) * D
        acc = _times_matrix(acc, phq, q_ptr + qo, hd, row_ok, gam, True, mem_ptr, base, cd, D, False,
                            BLOCK_D, BLOCK_E, PRECISION)
        mz = tl.load(z_ptr + base + cd, mask=cd < D, other=0.0)
        acc_den += gam * tl.sum(phq.to(tl.float32) * mz[None, :], axis=1)

    den = acc_den + eps
    tl.store(y_ptr + qo + hd[:, None] + cd[None, :], (acc / den[:, None]).to(y_ptr.dtype.element_ty), mask=m_hd)
    tl.store(den_ptr + bh * S + tok, den, mask=row_ok)


@triton.jit
def _mc_bwd_q_kernel(q_ptr, k_ptr, v_ptr, keep_ptr, gam_ptr, mem_ptr, z_ptr, g_ptr, den_ptr, dden_ptr,
                     dq_ptr, dgam_ptr,
                     S, H, D, L, N,
                     BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                     PRECISION: tl.constexpr):
    rb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    cd = tl.arange(0, BLOCK_D)
    tok, seg, row_ok, hd, m_hd = _row_block(rb, b, h, S, H, D, L, cd, BLOCK_L)
    qo = _block_start(rb, b, h, S, H, D, BLOCK_L)
    gam_row = (b * S + tok) * N
    dgam_row = (bh * S + tok) * N

    phq = _operand(_phi_rows(q_ptr + qo, hd, cd, m_hd), q_ptr.dtype.element_ty)
    inv_den = 1.0 / tl.load(den_ptr + bh * S + tok, mask=row_ok, other=1.0)
    d_den = tl.load(dden_ptr + bh * S + tok, mask=row_ok, other=0.0)   # ∂ℓ/∂(Σγ·den) = −(g·y)/den
    go = _load_rows(g_ptr + qo, hd, cd, m_hd)
    # dN = g/den enters every product as g with 1/den applied to the fp32 result:
    # 1/den reaches 1e6 on rows that read nothing (fp16 holds 65504)

    # own segment: dA = dN·Vᵀ + dD on the causal part; ∂ℓ/∂γ_s = Σ A∘dA, dφq = γ_s·dA·κφK
    dg = tl.zeros([BLOCK_L], dtype=tl.float32)
    dphq = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for kb in range(_first_block_of_segment(rb, L, BLOCK_L), rb + 1):
        ktok, kseg, k_ok, khd, m_k = _row_block(kb, b, h, S, H, D, L, cd, BLOCK_L)
        ko = _block_start(kb, b, h, S, H, D, BLOCK_L)
        phk, v, _ = _key_tiles(k_ptr + ko, v_ptr + ko, keep_ptr, b, S, ktok, k_ok, khd, cd, m_k)
        causal = _own_mask(tok, seg, ktok, kseg, True)
        a = tl.where(causal, tl.dot(phq, tl.trans(phk), input_precision=PRECISION), 0.0)
        da = tl.dot(go, tl.trans(v), input_precision=PRECISION) * inv_den[:, None] + d_den[:, None]
        da = tl.where(causal, da, 0.0)
        dg += tl.sum(a * da, axis=1)
        dphq = tl.dot(_operand(da, phk.dtype), phk, dphq, input_precision=PRECISION)
    gam = tl.load(gam_ptr + gam_row + seg, mask=row_ok, other=0.0)
    dphq = gam[:, None] * dphq
    tl.store(dgam_ptr + dgam_row + seg, dg, mask=row_ok)
    # earlier segments: T_i = dN·M_iᵀ + dD·z_iᵀ, ∂ℓ/∂γ_i = φq·T_i, dφq += γ_i·T_i
    ones = tl.full([BLOCK_L], 1.0, tl.float32)
    for i in range(0, _last_segment(rb, S, L, BLOCK_L)):
        earlier = row_ok & (i < seg)
        gam = tl.load(gam_ptr + gam_row + i, mask=earlier, other=0.0)
        base = (bh * N + i) * D
        mz = tl.load(z_ptr + base + cd, mask=cd < D, other=0.0)
        t = _times_matrix(tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32), go, g_ptr + qo, hd, row_ok, ones, False,
                          mem_ptr, base, cd, D, True, BLOCK_D, BLOCK_E, PRECISION)
        t = t * inv_den[:, None] + d_den[:, None] * mz[None, :]
        tl.store(dgam_ptr + dgam_row + i, tl.sum(phq.to(tl.float32) * t, axis=1), mask=earlier)
        dphq += gam[:, None] * t

    # φ'(q) = min(φ(q), 1): 1 for q > 0, exp(q) below
    tl.store(dq_ptr + qo + hd[:, None] + cd[None, :],
             (dphq * tl.minimum(phq.to(tl.float32), 1.0)).to(dq_ptr.dtype.element_ty), mask=m_hd)


@triton.jit
def _mc_bwd_mem_kernel(q_ptr, gam_ptr, g_ptr, den_ptr, dden_ptr, dmem_ptr, dz_ptr,
                       S, H, D, L, N,
                       BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                       PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs = tl.arange(0, BLOCK_L)
    cd = tl.arange(0, BLOCK_D)
    cr = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)   # this program's rows of dM (φq dim)
    op = q_ptr.dtype.element_ty
    d_mem = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    d_z = tl.zeros([BLOCK_R], dtype=tl.float32)
    # every token after segment seg reads its full memory
    for t0 in range((seg + 1) * L, S, BLOCK_L):
        tok = t0 + offs                     # < S: int32 is exact; the products below are int64 (b, bh)
        row_ok = tok < S
        qo = (b * S + t0) * H * D + h * D
        hd = offs * (H * D)
        gam = tl.load(gam_ptr + (b * S + tok) * N + seg, mask=row_ok, other=0.0)
        inv_den = 1.0 / tl.load(den_ptr + bh * S + tok, mask=row_ok, other=1.0)
        d_den = tl.load(dden_ptr + bh * S + tok, mask=row_ok, other=0.0)
        gq = gam[:, None] * _phi_rows(q_ptr + qo, hd, cr, row_ok[:, None] & (cr < D)[None, :])
        dn = _load_rows(g_ptr + qo, hd, cd, row_ok[:, None] & (cd < D)[None, :]).to(tl.float32) * inv_den[:, None]
        d_mem = tl.dot(tl.trans(_operand(gq, op)), _operand(dn, op), d_mem, input_precision=PRECISION)
        d_z += tl.sum(gq * d_den[:, None], axis=0)
    base = (bh * N + seg) * D
    r_ok = cr < D
    tl.store(dmem_ptr + (base + cr[:, None]) * D + cd[None, :], _operand(d_mem, dmem_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (cd < D)[None, :])
    tl.store(dz_ptr + base + cr, d_z, mask=r_ok)


@triton.jit
def _query_tiles(qb, b, h, bh, S, H, D, L, N, q_ptr, g_ptr, gam_ptr, den_ptr, dden_ptr, cd, op: tl.constexpr,
                 BLOCK_Q: tl.constexpr, SCALE_G: tl.constexpr):
    """A query block of the own-segment walk of ``_mc_bwd_kv_kernel``: its tokens, their
    segments, then φ(Q) and g as operands in ``op``, one of them scaled by γ_s/D_t
    (``SCALE_G``: g, so that the second is γ_s·dN; else φ(Q)), and −g·y (fp32)."""
    tok, seg, row_ok, hd, m_hd = _row_block(qb, b, h, S, H, D, L, cd, BLOCK_Q)
    qo = _block_start(qb, b, h, S, H, D, BLOCK_Q)
    gam = tl.load(gam_ptr + (b * S + tok) * N + seg, mask=row_ok, other=0.0)
    den = tl.load(den_ptr + bh * S + tok, mask=row_ok, other=1.0)
    g_y = tl.load(dden_ptr + bh * S + tok, mask=row_ok, other=0.0) * den      # dD·D_t = −g·y
    phq = _phi_rows(q_ptr + qo, hd, cd, m_hd)
    g = _load_rows(g_ptr + qo, hd, cd, m_hd)
    # fp16 saturates γ/D_t times a row (see _operand) only on rows whose causal keys are
    # all padded; the callers' `where` keeps those products exactly 0
    if SCALE_G:
        g = (gam / den)[:, None] * g.to(tl.float32)
    else:
        phq = (gam / den)[:, None] * phq
    return tok, seg, _operand(phq, op), _operand(g, op), g_y


@triton.jit
def _mc_bwd_kv_kernel(q_ptr, k_ptr, v_ptr, keep_ptr, gam_ptr, g_ptr, den_ptr, dden_ptr, dmem_ptr, dz_ptr,
                      dk_ptr, dv_ptr,
                      S, H, D, L, N,
                      BLOCK_L: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                      PRECISION: tl.constexpr):
    kb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    op = k_ptr.dtype.element_ty
    cd = tl.arange(0, BLOCK_D)
    ktok, kseg, k_ok, khd, m_k = _row_block(kb, b, h, S, H, D, L, cd, BLOCK_L)
    ko = _block_start(kb, b, h, S, H, D, BLOCK_L)
    kept = k_ok & (tl.load(keep_ptr + b * S + ktok, mask=k_ok, other=0.0) > 0)
    m_kept = m_k & kept[:, None]          # padded keys are never loaded
    last_seg = _last_segment(kb, S, L, BLOCK_L)
    # own segment: the query blocks (BLOCK_Q rows) from the diagonal to the end of the
    # block's last segment. dv and dφ(k) are two walks, so one [BLOCK_L, D] accumulator
    # and one key-side operand are live at a time (the query tiles are loaded twice).
    q_lo = kb * (BLOCK_L // BLOCK_Q)
    q_hi = tl.cdiv(tl.minimum((last_seg + 1) * L, S), BLOCK_Q)
    ones = tl.full([BLOCK_L], 1.0, tl.float32)

    # dv = Aᵀ·(γ dN) + Σ_j κφ(K_j)·dM_j
    phk = _operand(_phi_rows(k_ptr + ko, khd, cd, m_kept), op)
    dv = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for qb in range(q_lo, q_hi):
        tok, seg, phq, d_num, _ = _query_tiles(qb, b, h, bh, S, H, D, L, N, q_ptr, g_ptr, gam_ptr, den_ptr,
                                               dden_ptr, cd, op, BLOCK_Q, True)
        at = tl.dot(phk, tl.trans(phq), input_precision=PRECISION)
        at = tl.where(_own_mask(ktok, kseg, tok, seg, False), at, 0.0)     # [key, query]
        dv = tl.dot(_operand(at, op), d_num, dv, input_precision=PRECISION)
    for j in range(kb * BLOCK_L // L, last_seg + 1):
        sel = kept & (kseg == j)
        dv = _times_matrix(dv, tl.where(sel[:, None], phk, 0.0), k_ptr + ko, khd, sel, ones, True,
                           dmem_ptr, (bh * N + j) * D, cd, D, False, BLOCK_D, BLOCK_E, PRECISION)
    tl.store(dv_ptr + ko + khd[:, None] + cd[None, :], dv.to(dv_ptr.dtype.element_ty), mask=m_k)

    # dφ(k) = dAᵀ·φ(Q) + Σ_j (V_j·dM_jᵀ + dz_j), with dA = (γ/D_t)·(V·g − g·y): V·g and
    # g·y in fp32 from the same g, so they cancel where the truth does (y = v, a token
    # that sees only itself); γ/D_t rides on φ(Q)
    v = _load_rows(v_ptr + ko, khd, cd, m_kept)
    dphk = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for qb in range(q_lo, q_hi):
        tok, seg, phq, g, g_y = _query_tiles(qb, b, h, bh, S, H, D, L, N, q_ptr, g_ptr, gam_ptr, den_ptr,
                                             dden_ptr, cd, op, BLOCK_Q, False)
        dat = tl.dot(v, tl.trans(g), input_precision=PRECISION) + g_y[None, :]
        dat = tl.where(_own_mask(ktok, kseg, tok, seg, False), dat, 0.0)
        dphk = tl.dot(_operand(dat, op), phq, dphk, input_precision=PRECISION)
    for j in range(kb * BLOCK_L // L, last_seg + 1):
        sel = kept & (kseg == j)
        base = (bh * N + j) * D
        dz = tl.load(dz_ptr + base + cd, mask=cd < D, other=0.0)
        dphk = _times_matrix(dphk + tl.where(sel[:, None], dz[None, :], 0.0), tl.where(sel[:, None], v, 0.0),
                             v_ptr + ko, khd, sel, ones, False, dmem_ptr, base, cd, D, True, BLOCK_D, BLOCK_E,
                             PRECISION)
    # φ'(k) = min(φ(k), 1) (1 for k > 0, exp(k) below), 0 for padded keys
    dk = dphk * tl.minimum(_phi_rows(k_ptr + ko, khd, cd, m_kept), 1.0)
    tl.store(dk_ptr + ko + khd[:, None] + cd[None, :], dk.to(dk_ptr.dtype.element_ty), mask=m_k)


# ----------------------------------------------------------------------------
# Launch glue
# ----------------------------------------------------------------------------


def supports_tile(segment_len: int, head_dim: int) -> bool:
    """Whether the kernels have a configuration for this (segment_len, head_dim):
    any segment length (a runtime loop over row blocks) and ``head_dim ≤ MAX_HEAD_DIM``."""
    return segment_len >= 1 and 1 <= head_dim <= MAX_HEAD_DIM


def _kind(*tensors: torch.Tensor) -> str:
    """Which CONFIGS table a launch on these [B, S, H, D] tensors uses. Reads only
    shapes and addresses (no device sync)."""
    if tensors[0].dtype == torch.float32:
        return "fp32"
    if tensors[0].shape[-1] % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors):
        return "16bit"
    return "16bit-unaligned"


def _config(kind: str, head_dim: int) -> tuple[int, int, int, int, int, int, int]:
    """(BLOCK_L, BLOCK_Q, BLOCK_D, BLOCK_E, BLOCK_R, num_warps, num_stages) for a supported head dim."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_l, block_q, block_e, block_r, warps, stages = CONFIGS[kind][block_d]
    return block_l, block_q, block_d, block_e, block_r, warps, stages


def _mem_config(kind: str, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps) of :func:`_mc_mem_kernel`."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_t, warps = MEM_CONFIGS[kind][block_d]
    return block_t, block_d, warps


def segment_gates(u: torch.Tensor, p: torch.Tensor, keep: torch.Tensor, segment_len: int) -> torch.Tensor:
    """γ ``[B, S, N]`` fp32 (differentiable torch): for token t in segment s,
    softmax over i ≤ s of ⟨u_t, pool_i⟩ (causal running pool at i = s), 0 for i > s.
    O(B·S·N·G) work and no head or head-dim factor."""
    B, S, G = u.shape
    L = segment_len
    N = triton.cdiv(S, L)
    pad = N * L - S
    keep_s = F.pad(keep, (0, pad)).reshape(B, N, L)
    pm = F.pad(p.float() * keep[..., None], (0, 0, 0, pad)).reshape(B, N, L, G)
    pools = pm.sum(2) / keep_s.sum(2).clamp_min(1)[..., None]                    # [B, N, G]
    running = (pm.cumsum(2) / keep_s.cumsum(2).clamp_min(1)[..., None]).reshape(B, N * L, G)[:, :S]
    uf = u.float()
    score = torch.einsum("bsg,bng->bsn", uf, pools)                                 # [B, S, N]
    own = torch.arange(S, device=u.device) // L                                     # segment of each token
    cols = torch.arange(N, device=u.device)
    score = torch.where(cols[None, :] == own[:, None], (uf * running).sum(-1, keepdim=True), score)
    score = score.masked_fill(cols[None, :] > own[:, None], float("-inf"))
    return torch.softmax(score, dim=-1)


def _segment_memories(k, v, keep, segment_len: int):
    """Full memories M [B, H, N, D, D] (fp32 sums in the input dtype: the kernels'
    dot operand) and z [B, H, N, D] (fp32), one launch of :func:`_mc_mem_kernel`
    reading K and V once."""
    B, S, H, D = k.shape
    N = triton.cdiv(S, segment_len)
    mem = empty((B, H, N, D, D), dtype=k.dtype, device=k.device)
    mz = empty((B, H, N, D), dtype=torch.float32, device=k.device)
    block_t, block_d, warps = _mem_config(_kind(k, v, mem), D)
    wrap_triton(_mc_mem_kernel)[(N, B * H)](
        k, v, keep, mem, mz, S, H, D, segment_len, N,
        BLOCK_T=block_t, BLOCK_D=block_d, PRECISION=dot_precision(k.dtype), num_warps=warps, num_stages=2,
    )
    return mem, mz


@triton_op("laminae::memory_caching_core", mutates_args=())
def memory_caching_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, keep: torch.Tensor,
    segment_len: int, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated readout for given gates: ``(y [B, S, H, D], den [B, H, S] fp32)``.

    ``q``, ``k``, ``v`` ``[B, S, H, D]`` contiguous; ``gamma`` ``[B, S, N]`` fp32
    (:func:`segment_gates`); ``keep`` fp32 ``(B, S)`` 0/1."""
    B, S, H, D = q.shape
    N = gamma.shape[-1]
    mem, mz = _segment_memories(k, v, keep, segment_len)
    y = empty((B, S, H, D), dtype=q.dtype, device=q.device)
    den = empty((B, H, S), dtype=torch.float32, device=q.device)
    block_l, _, block_d, block_e, _, warps, stages = _config(_kind(q, k, v, y), D)
    wrap_triton(_mc_fwd_kernel)[(triton.cdiv(S, block_l), B * H)](
        q, k, v, keep, gamma, mem, mz, y, den, S, H, D, segment_len, N, eps,
        BLOCK_L=block_l, BLOCK_D=block_d, BLOCK_E=block_e, PRECISION=dot_precision(q.dtype), num_warps=warps,
        num_stages=stages,
    )
    return y, den


@triton_op("laminae::memory_caching_core_bwd", mutates_args=())
def _memory_caching_core_bwd(
    g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, keep: torch.Tensor,
    y: torch.Tensor, den: torch.Tensor, segment_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, S, H, D = q.shape
    N = gamma.shape[-1]
    mem, mz = _segment_memories(k, v, keep, segment_len)
    dmem = empty((B, H, N, D, D), dtype=q.dtype, device=q.device)
    dq = empty((B, S, H, D), dtype=q.dtype, device=q.device)
    dk = empty((B, S, H, D), dtype=k.dtype, device=q.device)
    dv = empty((B, S, H, D), dtype=v.dtype, device=q.device)
    block_l, block_q, block_d, block_e, block_r, warps, stages = _config(_kind(q, k, v, g, dq, dk, dv), D)
    launch = dict(BLOCK_L=block_l, BLOCK_D=block_d, PRECISION=dot_precision(q.dtype), num_warps=warps,
                  num_stages=stages)
    rows = (triton.cdiv(S, block_l), B * H)
    # ∂ℓ/∂γ per head; columns i > s (later segments, γ = 0) stay zero
    dgam_heads = torch.zeros((B, H, S, N), dtype=torch.float32, device=q.device)
    # ∂ℓ/∂(Σγ·den) = −(g·y)/den per token and head, [B, H, S] fp32 (O(S) row statistic)
    dden = (-(g.float() * y.float()).sum(-1).transpose(1, 2) / den).contiguous()
    wrap_triton(_mc_bwd_q_kernel)[rows](
        q, k, v, keep, gamma, mem, mz, g, den, dden, dq, dgam_heads, S, H, D, segment_len, N,
        BLOCK_E=block_e, **launch,
    )
    # ∂ℓ/∂M_i (input dtype: the next kernel's dot operand), ∂ℓ/∂z_i of every segment's
    # full memory (the last one's stay zero)
    dz = empty((B, H, N, D), dtype=torch.float32, device=q.device)
    wrap_triton(_mc_bwd_mem_kernel)[(N, B * H, triton.cdiv(D, block_r))](
        q, gamma, g, den, dden, dmem, dz, S, H, D, segment_len, N, BLOCK_R=block_r, **launch,
    )
    wrap_triton(_mc_bwd_kv_kernel)[rows](
        q, k, v, keep, gamma, g, den, dden, dmem, dz, dk, dv, S, H, D, segment_len, N, BLOCK_Q=block_q,
        BLOCK_E=block_e, **launch,
    )
    return dq, dk, dv, dgam_heads.sum(1)


def _setup_context(ctx, inputs, output):
    q, k, v, gamma, keep, segment_len, eps = inputs
    y, den = output
    ctx.mark_non_differentiable(den)
    ctx.save_for_backward(q, k, v, gamma, keep, y, den)
    ctx.segment_len = segment_len


def _backward(ctx, g, _gden):
    q, k, v, gamma, keep, y, den = ctx.saved_tensors
    # backward runs under the caller's autocast; its torch matmuls must stay fp32 like
    # the forward's (which the module runs with autocast off)
    with torch.autocast(device_type=q.device.type, enabled=False):
        dq, dk, dv, dgamma = _memory_caching_core_bwd(g.contiguous(), q, k, v, gamma, keep, y, den,
                                                      ctx.segment_len)
    return dq, dk, dv, dgamma, None, None, None


memory_caching_core.register_autograd(_backward, setup_context=_setup_context)


def memory_caching(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    p: torch.Tensor,
    segment_len: int,
    attention_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Triton Memory Caching readout with the signature of
    :func:`laminae.primitives.memory_caching.memory_caching_reference`.

    ``q``, ``k``, ``v`` ``[B, S, H, D]`` and ``u``, ``p`` ``[B, S, G]`` in one of
    fp32/bf16/fp16; ``attention_mask`` an optional ``(B, S)`` keep mask. Returns ``y``
    ``[B, S, H, D]`` in the input dtype. Any ``segment_len``; ``head_dim ≤ 128``
    (``MAX_HEAD_DIM``), otherwise ``ConfigError``.
    The gates (O(S·N·G), no head dim) are torch; gradients reach u and p through them.
    """
    check_memory_caching_inputs(q, k, v, u, p, segment_len, attention_mask, eps)
    if q.dtype not in _SUPPORTED:
        raise DTypeError(f"Triton memory caching supports fp32/bf16/fp16 inputs, got {q.dtype}")
    B, S, H, D = q.shape
    if not supports_tile(segment_len, D):
        raise ConfigError(f"Triton memory caching supports head_dim <= {MAX_HEAD_DIM} (any segment_len); "
                          f"got head_dim={D}. Use the reference backend for larger heads")
    keep = (torch.ones(B, S, dtype=torch.float32, device=q.device) if attention_mask is None
            else (attention_mask != 0).to(torch.float32)).contiguous()
    gamma = segment_gates(u, p, keep, int(segment_len)).contiguous()
    y, _ = memory_caching_core(q.contiguous(), k.contiguous(), v.contiguous(), gamma, keep,
                               int(segment_len), float(eps))
    return y


# ----------------------------------------------------------------------------
# Static configurations and the tour
# ----------------------------------------------------------------------------


def static_cases() -> Iterator[StaticCase]:
    """Every configuration ``_config`` can launch: each BLOCK_D for each kind of input.
    The aligned 16-bit kernels at head_dim 64 and 128 must build on Hopper's wgmma (HGMMA)."""
    scal = dict(S="i32", H="i32", D="i32", L="i32", N="i32")
    for dt, kind in (("fp32", "fp32"), ("bf16", "16bit"), ("fp16", "16bit"), ("bf16", "16bit-unaligned"),
                     ("fp16", "16bit-unaligned")):
        pt = f"*{dt}"
        precision = "ieee" if dt == "fp32" else "tf32"
        wide = kind == "16bit"
        for block_d, (block_l, block_q, block_e, block_r, warps, stages) in CONFIGS[kind].items():
            common = dict(BLOCK_L=block_l, BLOCK_D=block_d)
            const = dict(**common, BLOCK_E=block_e, PRECISION=precision)
            ins = dict(q_ptr=pt, k_ptr=pt, v_ptr=pt, keep_ptr="*fp32", gam_ptr="*fp32")
            grad_in = dict(g_ptr=pt, den_ptr="*fp32", dden_ptr="*fp32")
            launch = dict(num_warps=warps, num_stages=stages, tags={"dtype": dt, "kind": kind},
                          expect="HGMMA" if wide and block_d >= 64 else "")

            def case(name, kernel, signature, constexprs):
                return StaticCase(name, kernel, signature, constexprs, divisible=_aligned(kind, signature), **launch)

            block_t, mem_warps = MEM_CONFIGS[kind][block_d]
            mem = {"k_ptr": pt, "v_ptr": pt, "keep_ptr": "*fp32", "mem_ptr": pt, "z_ptr": "*fp32", **scal}
            yield StaticCase("mc_mem", _mc_mem_kernel, mem,
                             dict(BLOCK_T=block_t, BLOCK_D=block_d, PRECISION=precision), num_warps=mem_warps,
                             num_stages=2, tags=launch["tags"], expect=launch["expect"], divisible=_aligned(kind, mem))
            yield case("mc_fwd", _mc_fwd_kernel,
                       {**ins, "mem_ptr": pt, "z_ptr": "*fp32", "y_ptr": pt, "den_ptr": "*fp32", **scal, "eps": "fp32"},
                       const)
            yield case("mc_bwd_q", _mc_bwd_q_kernel,
                       {**ins, "mem_ptr": pt, "z_ptr": "*fp32", **grad_in, "dq_ptr": pt, "dgam_ptr": "*fp32", **scal},
                       const)
            yield case("mc_bwd_mem", _mc_bwd_mem_kernel,
                       {"q_ptr": pt, "gam_ptr": "*fp32", **grad_in, "dmem_ptr": pt, "dz_ptr": "*fp32", **scal},
                       dict(**common, BLOCK_R=block_r, PRECISION=precision))
            yield case("mc_bwd_kv", _mc_bwd_kv_kernel,
                       {**ins, **grad_in, "dmem_ptr": pt, "dz_ptr": "*fp32", "dk_ptr": pt, "dv_ptr": pt, **scal},
                       dict(**common, BLOCK_Q=block_q, BLOCK_E=block_e, PRECISION=precision))


def tour_case(device: torch.device):
    from laminae.primitives.memory_caching import memory_caching_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    B, S, H, D, G = 2, 40, 2, 16, 12
    inputs = {name: (torch.randn(*shape, generator=gen) * 0.5).to(device)
              for name, shape in (("q", (B, S, H, D)), ("k", (B, S, H, D)), ("v", (B, S, H, D)),
                                  ("u", (B, S, G)), ("p", (B, S, G)))}
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :5] = False
    inputs.update(segment_len=16, attention_mask=mask.to(device))
    return TourCase("memory_caching (L=16, ragged)", memory_caching, memory_caching_reference, inputs,
                    ["q", "k", "v", "u", "p"])
