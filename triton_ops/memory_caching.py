"""Memory Caching kernels: a chunked forward and backward, tiled within segments.

Split of the work:

- Gates γ [B, S, N] (torch, :func:`segment_gates`, differentiable): pools, the
  causal running pool, ⟨u, pool⟩ scores and the softmax over segments i ≤ s.
  O(B·S·N·G) work, no head or head-dim factor; autograd takes dγ back to u and p.
- Full memories M_i = Σ κφ(k)vᵀ [B, H, N, D, D] and z_i [B, H, N, D] (torch, one
  einsum; O(N·D²) per head), recomputed in backward.
- Four kernels. A segment of L tokens is cut into row blocks of BLOCK_L rows
  (NB = ⌈min(L, S)/BLOCK_L⌉ per segment), as causal flash attention cuts a
  sequence; D is padded to BLOCK_D = max(16, next_power_of_2(D)) with masked loads.
  A d×d memory is read in slabs of BLOCK_E rows or columns when BLOCK_E < BLOCK_D
  (D = 128), so no program holds a whole segment or a whole 128 × 128 matrix:

Forward  ``_mc_fwd_kernel``, program (row block of segment s, b·h): own segment
         causally over its row blocks ≤ the query block (A = φQ·κφKᵀ, masked on
         the diagonal block; γ_s·A·V, γ_s·ΣA), then walks i < s loading M_i, z_i:
         acc += γ_i·φQ·M_i, den += γ_i·φQ·z_i. Writes y = acc/(den + eps) and
         D_t = den + eps (fp32 [B, H, S]).
Backward with dN = g/D_t and dD = −(g·y)/D_t (torch, an O(S) row statistic):
         ``_mc_bwd_q_kernel``, program (query row block, b·h): dq and
         ∂ℓ/∂γ_i = dN·num_i + dD·den_i for every i ≤ s (per head, [B, H, S, N];
         torch sums the heads), walking like the forward.
         ``_mc_bwd_mem_kernel``, program (segment i, b·h, slab of BLOCK_E rows of
         dM): walks the tokens after segment i in blocks of BLOCK_L rows,
         dM_i = Σ γ_i·φq·dNᵀ, dz_i = Σ γ_i·dD·φq (fp32 [B, H, N, D, D] and [B, H, N, D]).
         ``_mc_bwd_kv_kernel``, program (key row block of segment i, b·h): the own
         segment's query row blocks ≥ the key block (causal part), then the
         memory share V·dM_iᵀ + dz_i, κφK·dM_i; writes dk, dv.

No (segments × segments × L × D) tensor exists; every program walks at most N
segments (or the S tokens after its segment) at O(BLOCK_L·D²) per step, so the
cost is linear in S for a fixed number of segments. fp32 accumulation;
fp32/bf16/fp16 inputs. Nothing is written twice: no atomics.
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
# BLOCK_D (head dim padded to a power of two >= 16) -> (largest BLOCK_L, BLOCK_E, num_warps,
# num_stages); launches use exactly these (num_stages included) so the static check sees them.
# BLOCK_L = min(largest, max(16, next_power_of_2(L))): any segment length is a runtime
# loop over row blocks. BLOCK_E < BLOCK_D reads the d×d memories in slabs. Every
# (BLOCK_L, BLOCK_D) this can produce is listed by static_cases() and compiles for
# sm_90 without spills.
CONFIGS = {16: (16, 16, 8, 2), 32: (16, 32, 8, 1), 64: (16, 32, 8, 2), 128: (16, 16, 8, 1)}


@triton.jit
def _phi(x):
    return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))


@triton.jit
def _mc_fwd_kernel(q_ptr, k_ptr, v_ptr, keep_ptr, gam_ptr, mem_ptr, z_ptr, y_ptr, den_ptr,
                   S, H, D, L, N, NB, eps,
                   BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    seg = pid // NB
    rb = pid % NB
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs = tl.arange(0, BLOCK_L)
    r_in = rb * BLOCK_L + offs                       # row within the segment
    tok = seg.to(tl.int64) * L + r_in
    row_ok = (r_in < L) & (tok < S)
    cd = tl.arange(0, BLOCK_D)
    d_ok = cd < D
    m_hd = row_ok[:, None] & d_ok[None, :]
    hd = ((b * S + tok) * H + h) * D
    gam_row = (b * S + tok) * N
    phq = tl.where(m_hd, _phi(tl.load(q_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)), 0.0)

    # own segment: causal linear attention over the key row blocks kb <= rb
    acc = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    acc_den = tl.zeros([BLOCK_L], dtype=tl.float32)
    for kb in range(0, rb + 1):
        k_in = kb * BLOCK_L + offs
        ktok = seg.to(tl.int64) * L + k_in
        k_ok = (k_in < L) & (ktok < S)
        m_k = k_ok[:, None] & d_ok[None, :]
        khd = ((b * S + ktok) * H + h) * D
        keep = tl.load(keep_ptr + b * S + ktok, mask=k_ok, other=0.0)
        phk = tl.where(m_k, _phi(tl.load(k_ptr + khd[:, None] + cd[None, :], mask=m_k, other=0.0).to(tl.float32)),
                       0.0) * keep[:, None]
        v = tl.load(v_ptr + khd[:, None] + cd[None, :], mask=m_k, other=0.0).to(tl.float32)
        a = tl.dot(phq, tl.trans(phk), input_precision=PRECISION)
        a = tl.where(r_in[:, None] >= k_in[None, :], a, 0.0)
        acc += tl.dot(a, v, input_precision=PRECISION)
        acc_den += tl.sum(a, axis=1)
    gam = tl.load(gam_ptr + gam_row + seg, mask=row_ok, other=0.0)
    acc = gam[:, None] * acc
    acc_den = gam * acc_den
    # earlier segments: full memories
    ce = tl.arange(0, BLOCK_E)
    for i in range(0, seg):
        gam = tl.load(gam_ptr + gam_row + i, mask=row_ok, other=0.0)
        base = (bh * N + i) * D
        if BLOCK_E == BLOCK_D:
            mem = tl.load(mem_ptr + (base + cd[:, None]) * D + cd[None, :], mask=d_ok[:, None] & d_ok[None, :],
                          other=0.0)
            num = tl.dot(phq, mem, input_precision=PRECISION)
        else:
            # φQ·M_i over slabs of BLOCK_E memory rows (φq columns reloaded per slab)
            num = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_E):
                cr = d0 + ce
                r_ok = cr < D
                m_r = row_ok[:, None] & r_ok[None, :]
                phq_r = tl.where(m_r, _phi(tl.load(q_ptr + hd[:, None] + cr[None, :], mask=m_r,
                                                   other=0.0).to(tl.float32)), 0.0)
                mem = tl.load(mem_ptr + (base + cr[:, None]) * D + cd[None, :], mask=r_ok[:, None] & d_ok[None, :],
                              other=0.0)
                num += tl.dot(phq_r, mem, input_precision=PRECISION)
        mz = tl.load(z_ptr + base + cd, mask=d_ok, other=0.0)
        acc += gam[:, None] * num
        acc_den += gam * tl.sum(phq * mz[None, :], axis=1)

    den = acc_den + eps
    tl.store(y_ptr + hd[:, None] + cd[None, :], (acc / den[:, None]).to(y_ptr.dtype.element_ty), mask=m_hd)
    tl.store(den_ptr + bh * S + tok, den, mask=row_ok)


@triton.jit
def _mc_bwd_q_kernel(q_ptr, k_ptr, v_ptr, keep_ptr, gam_ptr, mem_ptr, z_ptr, g_ptr, den_ptr, dden_ptr,
                     dq_ptr, dgam_ptr,
                     S, H, D, L, N, NB,
                     BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                     PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    seg = pid // NB
    rb = pid % NB
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs = tl.arange(0, BLOCK_L)
    r_in = rb * BLOCK_L + offs
    tok = seg.to(tl.int64) * L + r_in
    row_ok = (r_in < L) & (tok < S)
    cd = tl.arange(0, BLOCK_D)
    d_ok = cd < D
    m_hd = row_ok[:, None] & d_ok[None, :]
    hd = ((b * S + tok) * H + h) * D
    gam_row = (b * S + tok) * N
    dgam_row = (bh * S + tok) * N

    phq = tl.where(m_hd, _phi(tl.load(q_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)), 0.0)
    go = tl.load(g_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)
    den = tl.load(den_ptr + bh * S + tok, mask=row_ok, other=1.0)
    d_den = tl.load(dden_ptr + bh * S + tok, mask=row_ok, other=0.0)   # ∂ℓ/∂(Σγ·den) = −(g·y)/den
    d_num = go / den[:, None]                                          # ∂ℓ/∂(Σγ·num)

    # own segment, key row blocks kb <= rb
    dg = tl.zeros([BLOCK_L], dtype=tl.float32)
    dphq = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for kb in range(0, rb + 1):
        k_in = kb * BLOCK_L + offs
        ktok = seg.to(tl.int64) * L + k_in
        k_ok = (k_in < L) & (ktok < S)
        m_k = k_ok[:, None] & d_ok[None, :]
        khd = ((b * S + ktok) * H + h) * D
        keep = tl.load(keep_ptr + b * S + ktok, mask=k_ok, other=0.0)
        phk = tl.where(m_k, _phi(tl.load(k_ptr + khd[:, None] + cd[None, :], mask=m_k, other=0.0).to(tl.float32)),
                       0.0) * keep[:, None]
        v = tl.load(v_ptr + khd[:, None] + cd[None, :], mask=m_k, other=0.0).to(tl.float32)
        causal = r_in[:, None] >= k_in[None, :]
        a = tl.where(causal, tl.dot(phq, tl.trans(phk), input_precision=PRECISION), 0.0)
        dg += tl.sum(d_num * tl.dot(a, v, input_precision=PRECISION), axis=1) + d_den * tl.sum(a, axis=1)
        da = tl.where(causal, tl.dot(d_num, tl.trans(v), input_precision=PRECISION) + d_den[:, None], 0.0)
        dphq += tl.dot(da, phk, input_precision=PRECISION)
    gam = tl.load(gam_ptr + gam_row + seg, mask=row_ok, other=0.0)
    dphq = gam[:, None] * dphq
    tl.store(dgam_ptr + dgam_row + seg, dg, mask=row_ok)
    # earlier segments
    ce = tl.arange(0, BLOCK_E)
    for i in range(0, seg):
        gam = tl.load(gam_ptr + gam_row + i, mask=row_ok, other=0.0)
        base = (bh * N + i) * D
        mz = tl.load(z_ptr + base + cd, mask=d_ok, other=0.0)
        dg = d_den * tl.sum(phq * mz[None, :], axis=1)
        if BLOCK_E == BLOCK_D:
            mem = tl.load(mem_ptr + (base + cd[:, None]) * D + cd[None, :], mask=d_ok[:, None] & d_ok[None, :],
                          other=0.0)
            dg += tl.sum(d_num * tl.dot(phq, mem, input_precision=PRECISION), axis=1)
            dmq = tl.dot(d_num, tl.trans(mem), input_precision=PRECISION)
        else:
            # slabs of BLOCK_E memory columns (value dim; dN columns reloaded per slab)
            dmq = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
            for e0 in range(0, D, BLOCK_E):
                cc = e0 + ce
                c_ok = cc < D
                m_c = row_ok[:, None] & c_ok[None, :]
                dn_c = tl.load(g_ptr + hd[:, None] + cc[None, :], mask=m_c, other=0.0).to(tl.float32) / den[:, None]
                mem = tl.load(mem_ptr + (base + cd[:, None]) * D + cc[None, :], mask=d_ok[:, None] & c_ok[None, :],
                              other=0.0)
                dg += tl.sum(dn_c * tl.dot(phq, mem, input_precision=PRECISION), axis=1)
                dmq += tl.dot(dn_c, tl.trans(mem), input_precision=PRECISION)
        tl.store(dgam_ptr + dgam_row + i, dg, mask=row_ok)
        dphq += gam[:, None] * (dmq + d_den[:, None] * mz[None, :])

    # φ'(q) = min(φ(q), 1): 1 for q > 0, exp(q) below
    tl.store(dq_ptr + hd[:, None] + cd[None, :], (dphq * tl.minimum(phq, 1.0)).to(dq_ptr.dtype.element_ty), mask=m_hd)


@triton.jit
def _mc_bwd_mem_kernel(q_ptr, gam_ptr, g_ptr, den_ptr, dden_ptr, dmem_ptr, dz_ptr,
                       S, H, D, L, N,
                       BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                       PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs = tl.arange(0, BLOCK_L)
    cd = tl.arange(0, BLOCK_D)
    d_ok = cd < D
    cr = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)   # this program's rows of dM (φq dim)
    r_ok = cr < D
    d_mem = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
    d_z = tl.zeros([BLOCK_E], dtype=tl.float32)
    # every token after segment seg reads its full memory
    for t0 in range((seg + 1) * L, S, BLOCK_L):
        tok = t0 + offs                     # < S: int32 is exact; the products below are int64 (b, bh)
        row_ok = tok < S
        m_hd = row_ok[:, None] & d_ok[None, :]
        m_r = row_ok[:, None] & r_ok[None, :]
        hd = ((b * S + tok) * H + h) * D
        gam = tl.load(gam_ptr + (b * S + tok) * N + seg, mask=row_ok, other=0.0)
        den = tl.load(den_ptr + bh * S + tok, mask=row_ok, other=1.0)
        d_den = tl.load(dden_ptr + bh * S + tok, mask=row_ok, other=0.0)
        gq = gam[:, None] * tl.where(m_r, _phi(tl.load(q_ptr + hd[:, None] + cr[None, :], mask=m_r,
                                                       other=0.0).to(tl.float32)), 0.0)
        go = tl.load(g_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)
        d_mem += tl.dot(tl.trans(gq), go / den[:, None], input_precision=PRECISION)
        d_z += tl.sum(gq * d_den[:, None], axis=0)
    base = (bh * N + seg) * D
    tl.store(dmem_ptr + (base + cr[:, None]) * D + cd[None, :], d_mem, mask=r_ok[:, None] & d_ok[None, :])
    tl.store(dz_ptr + base + cr, d_z, mask=r_ok)


@triton.jit
def _mc_bwd_kv_kernel(q_ptr, k_ptr, v_ptr, keep_ptr, gam_ptr, g_ptr, den_ptr, dden_ptr, dmem_ptr, dz_ptr,
                      dk_ptr, dv_ptr,
                      S, H, D, L, N, NB,
                      BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                      PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    seg = pid // NB
    kb = pid % NB
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs = tl.arange(0, BLOCK_L)
    k_in = kb * BLOCK_L + offs                       # key row within the segment
    ktok = seg.to(tl.int64) * L + k_in
    k_ok = (k_in < L) & (ktok < S)
    cd = tl.arange(0, BLOCK_D)
    d_ok = cd < D
    m_k = k_ok[:, None] & d_ok[None, :]
    khd = ((b * S + ktok) * H + h) * D
    keep = tl.load(keep_ptr + b * S + ktok, mask=k_ok, other=0.0)
    phk = tl.where(m_k, _phi(tl.load(k_ptr + khd[:, None] + cd[None, :], mask=m_k, other=0.0).to(tl.float32)),
                   0.0) * keep[:, None]
    v = tl.load(v_ptr + khd[:, None] + cd[None, :], mask=m_k, other=0.0).to(tl.float32)

    # own segment: query row blocks qb >= kb;  dv = Aᵀ·(γ dN),  dφ(k) = dAᵀ·φ(Q)
    dv = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    dphk = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for qb in range(kb, NB):
        r_in = qb * BLOCK_L + offs
        tok = seg.to(tl.int64) * L + r_in
        row_ok = (r_in < L) & (tok < S)
        m_hd = row_ok[:, None] & d_ok[None, :]
        hd = ((b * S + tok) * H + h) * D
        gam = tl.load(gam_ptr + (b * S + tok) * N + seg, mask=row_ok, other=0.0)
        den = tl.load(den_ptr + bh * S + tok, mask=row_ok, other=1.0)
        d_den = gam * tl.load(dden_ptr + bh * S + tok, mask=row_ok, other=0.0)
        d_num = gam[:, None] * tl.load(g_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32) \
            / den[:, None]
        phq = tl.where(m_hd, _phi(tl.load(q_ptr + hd[:, None] + cd[None, :], mask=m_hd,
                                          other=0.0).to(tl.float32)), 0.0)
        causal = r_in[None, :] >= k_in[:, None]                   # [key, query]
        at = tl.where(causal, tl.dot(phk, tl.trans(phq), input_precision=PRECISION), 0.0)
        dv += tl.dot(at, d_num, input_precision=PRECISION)
        dat = tl.where(causal, tl.dot(v, tl.trans(d_num), input_precision=PRECISION) + d_den[None, :], 0.0)
        dphk += tl.dot(dat, phq, input_precision=PRECISION)

    # the memory's share: dv += κφ(K)·dM,  dφ(k) += V·dMᵀ + dz
    base = (bh * N + seg) * D
    if BLOCK_E == BLOCK_D:
        d_mem = tl.load(dmem_ptr + (base + cd[:, None]) * D + cd[None, :], mask=d_ok[:, None] & d_ok[None, :],
                        other=0.0)
        dv += tl.dot(phk, d_mem, input_precision=PRECISION)
        dphk += tl.dot(v, tl.trans(d_mem), input_precision=PRECISION)
    else:
        ce = tl.arange(0, BLOCK_E)
        for d0 in range(0, D, BLOCK_E):
            cs = d0 + ce
            s_ok = cs < D
            m_s = k_ok[:, None] & s_ok[None, :]
            # dv over slabs of dM rows (κφk columns reloaded), dφ(k) over slabs of dM columns (v columns)
            phk_s = tl.where(m_s, _phi(tl.load(k_ptr + khd[:, None] + cs[None, :], mask=m_s,
                                               other=0.0).to(tl.float32)), 0.0) * keep[:, None]
            dm_r = tl.load(dmem_ptr + (base + cs[:, None]) * D + cd[None, :], mask=s_ok[:, None] & d_ok[None, :],
                           other=0.0)
            dv += tl.dot(phk_s, dm_r, input_precision=PRECISION)
            v_s = tl.load(v_ptr + khd[:, None] + cs[None, :], mask=m_s, other=0.0).to(tl.float32)
            dm_c = tl.load(dmem_ptr + (base + cd[:, None]) * D + cs[None, :], mask=d_ok[:, None] & s_ok[None, :],
                           other=0.0)
            dphk += tl.dot(v_s, tl.trans(dm_c), input_precision=PRECISION)
    d_z = tl.load(dz_ptr + base + cd, mask=d_ok, other=0.0)
    dphk += d_z[None, :]
    tl.store(dv_ptr + khd[:, None] + cd[None, :], dv.to(dv_ptr.dtype.element_ty), mask=m_k)
    # φ'(k) = min(φ(k), 1) (1 for k > 0, exp(k) below); the keep factor is already in phk
    tl.store(dk_ptr + khd[:, None] + cd[None, :], (dphk * tl.minimum(phk, 1.0)).to(dk_ptr.dtype.element_ty),
             mask=m_k)


# ----------------------------------------------------------------------------
# Launch glue
# ----------------------------------------------------------------------------


def supports_tile(segment_len: int, head_dim: int) -> bool:
    """Whether the kernels have a configuration for this (segment_len, head_dim):
    any segment length (a runtime loop over row blocks) and ``head_dim ≤ MAX_HEAD_DIM``."""
    return segment_len >= 1 and 1 <= head_dim <= MAX_HEAD_DIM


def _config(segment_len: int, head_dim: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_L, BLOCK_D, BLOCK_E, num_warps, num_stages) for a supported shape."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    max_l, block_e, warps, stages = CONFIGS[block_d]
    block_l = min(max_l, max(16, triton.next_power_of_2(segment_len)))
    return block_l, block_d, block_e, warps, stages


def _row_blocks(S: int, segment_len: int, block_l: int) -> int:
    """Row blocks per segment; a sequence shorter than one segment needs only its rows."""
    return triton.cdiv(min(segment_len, S), block_l)


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
    """Full memories M [B, H, N, D, D] and z [B, H, N, D] (fp32)."""
    B, S, H, D = k.shape
    L = segment_len
    N = triton.cdiv(S, L)
    pad = N * L - S
    phk = F.pad((F.elu(k.float()) + 1.0) * keep[..., None, None], (0, 0, 0, 0, 0, pad)).reshape(B, N, L, H, D)
    vs = F.pad(v.float(), (0, 0, 0, 0, 0, pad)).reshape(B, N, L, H, D)
    mem = torch.einsum("bnlhd,bnlhe->bhnde", phk, vs).contiguous()
    mz = phk.sum(2).permute(0, 2, 1, 3).contiguous()
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
    block_l, block_d, block_e, warps, stages = _config(segment_len, D)
    nb = _row_blocks(S, segment_len, block_l)
    wrap_triton(_mc_fwd_kernel)[(N * nb, B * H)](
        q, k, v, keep, gamma, mem, mz, y, den, S, H, D, segment_len, N, nb, eps,
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
    block_l, block_d, block_e, warps, stages = _config(segment_len, D)
    nb = _row_blocks(S, segment_len, block_l)
    common = dict(BLOCK_L=block_l, BLOCK_D=block_d, BLOCK_E=block_e, PRECISION=dot_precision(q.dtype),
                  num_warps=warps, num_stages=stages)
    dq = empty((B, S, H, D), dtype=q.dtype, device=q.device)
    dk = empty((B, S, H, D), dtype=k.dtype, device=q.device)
    dv = empty((B, S, H, D), dtype=v.dtype, device=q.device)
    # ∂ℓ/∂γ per head; columns i > s (later segments, γ = 0) stay zero
    dgam_heads = torch.zeros((B, H, S, N), dtype=torch.float32, device=q.device)
    # ∂ℓ/∂(Σγ·den) = −(g·y)/den per token and head, [B, H, S] fp32 (O(S) row statistic)
    dden = (-(g.float() * y.float()).sum(-1).transpose(1, 2) / den).contiguous()
    wrap_triton(_mc_bwd_q_kernel)[(N * nb, B * H)](
        q, k, v, keep, gamma, mem, mz, g, den, dden, dq, dgam_heads, S, H, D, segment_len, N, nb, **common,
    )
    # ∂ℓ/∂M_i, ∂ℓ/∂z_i of every segment's full memory (the last one's stay zero)
    dmem = empty((B, H, N, D, D), dtype=torch.float32, device=q.device)
    dz = empty((B, H, N, D), dtype=torch.float32, device=q.device)
    wrap_triton(_mc_bwd_mem_kernel)[(N, B * H, triton.cdiv(D, block_e))](
        q, gamma, g, den, dden, dmem, dz, S, H, D, segment_len, N, **common,
    )
    wrap_triton(_mc_bwd_kv_kernel)[(N * nb, B * H)](
        q, k, v, keep, gamma, g, den, dden, dmem, dz, dk, dv, S, H, D, segment_len, N, nb, **common,
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
    mask: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Triton Memory Caching readout with the signature of
    :func:`laminae.primitives.memory_caching.memory_caching_reference`.

    ``q``, ``k``, ``v`` ``[B, S, H, D]`` and ``u``, ``p`` ``[B, S, G]`` in one of
    fp32/bf16/fp16; ``mask`` an optional ``(B, S)`` keep mask. Returns ``y``
    ``[B, S, H, D]`` in the input dtype. Any ``segment_len``; ``head_dim ≤ 128``
    (``MAX_HEAD_DIM``), otherwise ``ConfigError``.
    The gates (O(S·N·G), no head dim) are torch; gradients reach u and p through them.
    """
    check_memory_caching_inputs(q, k, v, u, p, segment_len, mask, eps)
    if q.dtype not in _SUPPORTED:
        raise DTypeError(f"Triton memory caching supports fp32/bf16/fp16 inputs, got {q.dtype}")
    B, S, H, D = q.shape
    if not supports_tile(segment_len, D):
        raise ConfigError(f"Triton memory caching supports head_dim <= {MAX_HEAD_DIM} (any segment_len); "
                          f"got head_dim={D}. Use the reference backend for larger heads")
    keep = (torch.ones(B, S, dtype=torch.float32, device=q.device) if mask is None
            else mask.to(torch.float32)).contiguous()
    gamma = segment_gates(u, p, keep, int(segment_len)).contiguous()
    y, _ = memory_caching_core(q.contiguous(), k.contiguous(), v.contiguous(), gamma, keep,
                               int(segment_len), float(eps))
    return y


# ----------------------------------------------------------------------------
# Static configurations and the tour
# ----------------------------------------------------------------------------


def static_cases() -> Iterator[StaticCase]:
    """Every configuration ``_config`` can launch: for each BLOCK_D, BLOCK_L = 16
    (segments of ≤ 16 tokens) and the largest BLOCK_L, in each input dtype."""
    scal = dict(S="i32", H="i32", D="i32", L="i32", N="i32")
    for dt in ("fp32", "bf16", "fp16"):
        pt = f"*{dt}"
        precision = "ieee" if dt == "fp32" else "tf32"
        for block_d, (max_l, block_e, warps, stages) in CONFIGS.items():
            for block_l in sorted({16, max_l}):
                const = dict(BLOCK_L=block_l, BLOCK_D=block_d, BLOCK_E=block_e, PRECISION=precision)
                ins = dict(q_ptr=pt, k_ptr=pt, v_ptr=pt, keep_ptr="*fp32", gam_ptr="*fp32")
                tags = {"dtype": dt}
                yield StaticCase("mc_fwd", _mc_fwd_kernel,
                                 {**ins, "mem_ptr": "*fp32", "z_ptr": "*fp32", "y_ptr": pt, "den_ptr": "*fp32",
                                  **scal, "NB": "i32", "eps": "fp32"}, const, warps, stages, tags=tags)
                grad_in = dict(g_ptr=pt, den_ptr="*fp32", dden_ptr="*fp32")
                yield StaticCase("mc_bwd_q", _mc_bwd_q_kernel,
                                 {**ins, "mem_ptr": "*fp32", "z_ptr": "*fp32", **grad_in, "dq_ptr": pt,
                                  "dgam_ptr": "*fp32", **scal, "NB": "i32"}, const, warps, stages, tags=tags)
                yield StaticCase("mc_bwd_mem", _mc_bwd_mem_kernel,
                                 {"q_ptr": pt, "gam_ptr": "*fp32", **grad_in, "dmem_ptr": "*fp32",
                                  "dz_ptr": "*fp32", **scal}, const, warps, stages, tags=tags)
                yield StaticCase("mc_bwd_kv", _mc_bwd_kv_kernel,
                                 {**ins, **grad_in, "dmem_ptr": "*fp32", "dz_ptr": "*fp32", "dk_ptr": pt,
                                  "dv_ptr": pt, **scal, "NB": "i32"}, const, warps, stages, tags=tags)


def tour_case(device: torch.device):
    from laminae.primitives.memory_caching import memory_caching_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    B, S, H, D, G = 2, 40, 2, 16, 12
    inputs = {name: (torch.randn(*shape, generator=gen) * 0.5).to(device)
              for name, shape in (("q", (B, S, H, D)), ("k", (B, S, H, D)), ("v", (B, S, H, D)),
                                  ("u", (B, S, G)), ("p", (B, S, G)))}
    mask = torch.ones(B, S)
    mask[1, :5] = 0.0
    inputs.update(segment_len=16, mask=mask.to(device))
    return TourCase("memory_caching (L=16, ragged)", memory_caching, memory_caching_reference, inputs,
                    ["q", "k", "v", "u", "p"])
