"""Memory Caching kernels: a chunked forward and backward over segments.

Split of the work:

- Gates γ [B, S, N] (torch, :func:`segment_gates`, differentiable): pools, the
  causal running pool, ⟨u, pool⟩ scores and the softmax over segments i ≤ s.
  O(B·S·N·G) work, no head or head-dim factor; autograd takes dγ back to u and p.
- Full memories M_i = Σ κφ(k)vᵀ [B, H, N, D, D] and z_i [B, H, N, D] (torch, one
  einsum; O(N·D²) per head), recomputed in backward.
- Three kernels, one program per (segment, batch·head), the segment's L tokens one
  tile of BLOCK_L rows (L and D padded to powers of two ≥ 16, masked loads):

Forward  ``_mc_fwd_kernel``, program (s, b·h): own segment causally
         (A = tril(φQ·κφKᵀ), γ_s·A·V, γ_s·ΣA), then walks i < s loading M_i, z_i:
         acc += γ_i·φQ·M_i, den += γ_i·φQ·z_i. Writes y = acc/(den + eps) and
         D_t = den + eps (fp32 [B, H, S]).
Backward with dN = g/D_t and dD = −(g·y)/D_t (torch, an O(S) row statistic):
         ``_mc_bwd_q_kernel``, program (s, b·h): dq and ∂ℓ/∂γ_i = dN·num_i + dD·den_i
         for every i ≤ s (per head, [B, H, S, N]; torch sums the heads), walking
         i < s like the forward.
         ``_mc_bwd_kv_kernel``, program (i, b·h): walks the later query segments
         s > i accumulating dM_i [D, D] and dz_i [D] on chip, then writes dk, dv
         of segment i (own-segment causal part + V·dM_iᵀ + dz_i, κφK·dM_i).

No (segments × segments × L × D) tensor exists; cost per program is linear in the
number of segments it walks. fp32 accumulation; fp32/bf16/fp16 inputs.
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

__all__ = ["memory_caching", "memory_caching_core", "segment_gates", "supports_tile"]

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
# Supported tiles (BLOCK_L, BLOCK_D) -> num_warps: L and D are padded to powers of two
# >= 16 and each segment is one on-chip tile. Every entry is compiled for sm_90 by the
# static check without spills; larger tiles (e.g. 32 x 64) spill in the fp32 backward.
WARPS = {(16, 16): 4, (16, 32): 4, (32, 16): 4, (32, 32): 8, (16, 64): 8, (64, 16): 8}


@triton.jit
def _phi(x):
    return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))


@triton.jit
def _mc_fwd_kernel(q_ptr, k_ptr, v_ptr, keep_ptr, gam_ptr, mem_ptr, z_ptr, y_ptr, den_ptr,
                   S, H, D, L, N, eps,
                   BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_l = tl.arange(0, BLOCK_L)
    tok = seg.to(tl.int64) * L + offs_l
    row_ok = (offs_l < L) & (tok < S)
    cd = tl.arange(0, BLOCK_D)
    d_ok = cd < D
    m_hd = row_ok[:, None] & d_ok[None, :]
    m_dd = d_ok[:, None] & d_ok[None, :]
    hd = ((b * S + tok) * H + h) * D
    gam_row = (b * S + tok) * N

    keep = tl.load(keep_ptr + b * S + tok, mask=row_ok, other=0.0)
    q = tl.load(q_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)
    phq = tl.where(m_hd, _phi(q), 0.0)
    phk = tl.where(m_hd, _phi(k), 0.0) * keep[:, None]

    # own segment: causal linear attention
    causal = offs_l[:, None] >= offs_l[None, :]
    gam = tl.load(gam_ptr + gam_row + seg, mask=row_ok, other=0.0)
    a = tl.where(causal, tl.dot(phq, tl.trans(phk), input_precision=PRECISION), 0.0)
    acc = gam[:, None] * tl.dot(a, v, input_precision=PRECISION)
    acc_den = gam * tl.sum(a, axis=1)
    # earlier segments: full memories
    for i in range(0, seg):
        gam = tl.load(gam_ptr + gam_row + i, mask=row_ok, other=0.0)
        mem = tl.load(mem_ptr + ((bh * N + i) * D + cd[:, None]) * D + cd[None, :], mask=m_dd, other=0.0)
        mz = tl.load(z_ptr + (bh * N + i) * D + cd, mask=d_ok, other=0.0)
        acc += gam[:, None] * tl.dot(phq, mem, input_precision=PRECISION)
        acc_den += gam * tl.sum(phq * mz[None, :], axis=1)

    den = acc_den + eps
    tl.store(y_ptr + hd[:, None] + cd[None, :], (acc / den[:, None]).to(y_ptr.dtype.element_ty), mask=m_hd)
    tl.store(den_ptr + bh * S + tok, den, mask=row_ok)


@triton.jit
def _mc_bwd_q_kernel(q_ptr, k_ptr, v_ptr, keep_ptr, gam_ptr, mem_ptr, z_ptr, g_ptr, den_ptr, dden_ptr,
                     dq_ptr, dgam_ptr,
                     S, H, D, L, N,
                     BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_l = tl.arange(0, BLOCK_L)
    tok = seg.to(tl.int64) * L + offs_l
    row_ok = (offs_l < L) & (tok < S)
    cd = tl.arange(0, BLOCK_D)
    d_ok = cd < D
    m_hd = row_ok[:, None] & d_ok[None, :]
    m_dd = d_ok[:, None] & d_ok[None, :]
    hd = ((b * S + tok) * H + h) * D
    gam_row = (b * S + tok) * N
    dgam_row = (bh * S + tok) * N

    keep = tl.load(keep_ptr + b * S + tok, mask=row_ok, other=0.0)
    q = tl.load(q_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)
    go = tl.load(g_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)
    den = tl.load(den_ptr + bh * S + tok, mask=row_ok, other=1.0)
    d_den = tl.load(dden_ptr + bh * S + tok, mask=row_ok, other=0.0)   # ∂ℓ/∂(Σγ·den) = −(g·y)/den
    phq = tl.where(m_hd, _phi(q), 0.0)
    phk = tl.where(m_hd, _phi(k), 0.0) * keep[:, None]
    d_num = go / den[:, None]                                          # ∂ℓ/∂(Σγ·num)

    # own segment
    causal = offs_l[:, None] >= offs_l[None, :]
    gam = tl.load(gam_ptr + gam_row + seg, mask=row_ok, other=0.0)
    a = tl.where(causal, tl.dot(phq, tl.trans(phk), input_precision=PRECISION), 0.0)
    dgam = tl.sum(d_num * tl.dot(a, v, input_precision=PRECISION), axis=1) + d_den * tl.sum(a, axis=1)
    tl.store(dgam_ptr + dgam_row + seg, dgam, mask=row_ok)
    da = tl.dot(gam[:, None] * d_num, tl.trans(v), input_precision=PRECISION) + (gam * d_den)[:, None]
    da = tl.where(causal, da, 0.0)
    dphq = tl.dot(da, phk, input_precision=PRECISION)
    # earlier segments
    for i in range(0, seg):
        gam = tl.load(gam_ptr + gam_row + i, mask=row_ok, other=0.0)
        mem = tl.load(mem_ptr + ((bh * N + i) * D + cd[:, None]) * D + cd[None, :], mask=m_dd, other=0.0)
        mz = tl.load(z_ptr + (bh * N + i) * D + cd, mask=d_ok, other=0.0)
        num = tl.dot(phq, mem, input_precision=PRECISION)
        dgam = tl.sum(d_num * num, axis=1) + d_den * tl.sum(phq * mz[None, :], axis=1)
        tl.store(dgam_ptr + dgam_row + i, dgam, mask=row_ok)
        dphq += gam[:, None] * (tl.dot(d_num, tl.trans(mem), input_precision=PRECISION)
                                + d_den[:, None] * mz[None, :])

    # φ'(q) = min(φ(q), 1): 1 for q > 0, exp(q) below
    tl.store(dq_ptr + hd[:, None] + cd[None, :], (dphq * tl.minimum(phq, 1.0)).to(dq_ptr.dtype.element_ty), mask=m_hd)


@triton.jit
def _mc_bwd_kv_kernel(q_ptr, k_ptr, v_ptr, keep_ptr, gam_ptr, g_ptr, den_ptr, dden_ptr, dk_ptr, dv_ptr,
                      S, H, D, L, N,
                      BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_l = tl.arange(0, BLOCK_L)
    cd = tl.arange(0, BLOCK_D)
    d_ok = cd < D
    d_mem = tl.zeros([BLOCK_D, BLOCK_D], dtype=tl.float32)
    d_z = tl.zeros([BLOCK_D], dtype=tl.float32)

    # later query segments read this segment's full memory: accumulate dM, dz
    for s in range(seg + 1, N):
        tok = s * L + offs_l  # < S: int32 is exact; every product below is int64 (bh, b)
        row_ok = (offs_l < L) & (tok < S)
        m_hd = row_ok[:, None] & d_ok[None, :]
        hd = ((b * S + tok) * H + h) * D
        q = tl.load(q_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)
        go = tl.load(g_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)
        den = tl.load(den_ptr + bh * S + tok, mask=row_ok, other=1.0)
        d_den = tl.load(dden_ptr + bh * S + tok, mask=row_ok, other=0.0)
        gam = tl.load(gam_ptr + (b * S + tok) * N + seg, mask=row_ok, other=0.0)
        gq = gam[:, None] * tl.where(m_hd, _phi(q), 0.0)
        d_mem += tl.dot(tl.trans(gq), go / den[:, None], input_precision=PRECISION)
        d_z += tl.sum(gq * d_den[:, None], axis=0)

    # this segment as its own query segment (causal part), then its memory's share
    tok = seg.to(tl.int64) * L + offs_l
    row_ok = (offs_l < L) & (tok < S)
    m_hd = row_ok[:, None] & d_ok[None, :]
    hd = ((b * S + tok) * H + h) * D
    keep = tl.load(keep_ptr + b * S + tok, mask=row_ok, other=0.0)
    den = tl.load(den_ptr + bh * S + tok, mask=row_ok, other=1.0)
    gam = tl.load(gam_ptr + (b * S + tok) * N + seg, mask=row_ok, other=0.0)
    d_num_own = gam[:, None] * tl.load(g_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32) \
        / den[:, None]
    phq = tl.where(m_hd, _phi(tl.load(q_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)), 0.0)
    phk = tl.where(m_hd, _phi(tl.load(k_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)),
                   0.0) * keep[:, None]
    causal = offs_l[:, None] >= offs_l[None, :]
    # dv = Aᵀ·(γ dN) + κφ(K)·dM
    a = tl.where(causal, tl.dot(phq, tl.trans(phk), input_precision=PRECISION), 0.0)
    dv = tl.dot(tl.trans(a), d_num_own, input_precision=PRECISION) + tl.dot(phk, d_mem, input_precision=PRECISION)
    tl.store(dv_ptr + hd[:, None] + cd[None, :], dv.to(dv_ptr.dtype.element_ty), mask=m_hd)
    # dφ(k) = dAᵀ·φ(Q) + V·dMᵀ + dz;  φ'(k) = min(φ(k), 1) (1 for k > 0, exp(k) below)
    v = tl.load(v_ptr + hd[:, None] + cd[None, :], mask=m_hd, other=0.0).to(tl.float32)
    d_den_own = gam * tl.load(dden_ptr + bh * S + tok, mask=row_ok, other=0.0)
    da = tl.where(causal, tl.dot(d_num_own, tl.trans(v), input_precision=PRECISION) + d_den_own[:, None], 0.0)
    dphk = (tl.dot(tl.trans(da), phq, input_precision=PRECISION)
            + tl.dot(v, tl.trans(d_mem), input_precision=PRECISION) + d_z[None, :])
    dk = dphk * tl.minimum(phk, 1.0)
    tl.store(dk_ptr + hd[:, None] + cd[None, :], dk.to(dk_ptr.dtype.element_ty), mask=m_hd)


# ----------------------------------------------------------------------------
# Launch glue
# ----------------------------------------------------------------------------


def _tiles(segment_len: int, head_dim: int) -> tuple[int, int]:
    return max(16, triton.next_power_of_2(segment_len)), max(16, triton.next_power_of_2(head_dim))


def supports_tile(segment_len: int, head_dim: int) -> bool:
    """Whether the kernels have a tile for this (segment_len, head_dim)."""
    return _tiles(segment_len, head_dim) in WARPS


def _blocks(segment_len: int, head_dim: int) -> tuple[int, int, int]:
    block_l, block_d = _tiles(segment_len, head_dim)
    return block_l, block_d, WARPS[(block_l, block_d)]


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
    block_l, block_d, warps = _blocks(segment_len, D)
    wrap_triton(_mc_fwd_kernel)[(N, B * H)](
        q, k, v, keep, gamma, mem, mz, y, den, S, H, D, segment_len, N, eps,
        BLOCK_L=block_l, BLOCK_D=block_d, PRECISION=dot_precision(q.dtype), num_warps=warps,
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
    block_l, block_d, warps = _blocks(segment_len, D)
    common = dict(BLOCK_L=block_l, BLOCK_D=block_d, PRECISION=dot_precision(q.dtype), num_warps=warps)
    dq = empty((B, S, H, D), dtype=q.dtype, device=q.device)
    dk = empty((B, S, H, D), dtype=k.dtype, device=q.device)
    dv = empty((B, S, H, D), dtype=v.dtype, device=q.device)
    # ∂ℓ/∂γ per head; columns i > s (later segments, γ = 0) stay zero
    dgam_heads = torch.zeros((B, H, S, N), dtype=torch.float32, device=q.device)
    # ∂ℓ/∂(Σγ·den) = −(g·y)/den per token and head, [B, H, S] fp32 (O(S) row statistic)
    dden = (-(g.float() * y.float()).sum(-1).transpose(1, 2) / den).contiguous()
    wrap_triton(_mc_bwd_q_kernel)[(N, B * H)](
        q, k, v, keep, gamma, mem, mz, g, den, dden, dq, dgam_heads, S, H, D, segment_len, N, **common,
    )
    wrap_triton(_mc_bwd_kv_kernel)[(N, B * H)](
        q, k, v, keep, gamma, g, den, dden, dk, dv, S, H, D, segment_len, N, **common,
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
    dq, dk, dv, dgamma = _memory_caching_core_bwd(g.contiguous(), q, k, v, gamma, keep, y, den, ctx.segment_len)
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
    ``[B, S, H, D]`` in the input dtype. Tile limits (see ``WARPS``): L ≤ 16 with
    D ≤ 64, L ≤ 32 with D ≤ 32, or L ≤ 64 with D ≤ 16; otherwise ``ConfigError``.
    The gates (O(S·N·G), no head dim) are torch; gradients reach u and p through them.
    """
    check_memory_caching_inputs(q, k, v, u, p, segment_len, mask, eps)
    if q.dtype not in _SUPPORTED:
        raise DTypeError(f"Triton memory caching supports fp32/bf16/fp16 inputs, got {q.dtype}")
    B, S, H, D = q.shape
    if not supports_tile(segment_len, D):
        supported = ", ".join(f"L<={bl}&D<={bd}" for bl, bd in WARPS)
        raise ConfigError(f"Triton memory caching supports (segment_len, head_dim) with one on-chip tile per "
                          f"segment: {supported}; got segment_len={segment_len}, head_dim={D}. "
                          "Use the reference backend for larger tiles")
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
    scal = dict(S="i32", H="i32", D="i32", L="i32", N="i32")
    for dt in ("fp32", "bf16", "fp16"):
        pt = f"*{dt}"
        precision = "ieee" if dt == "fp32" else "tf32"
        for (block_l, block_d), warps in WARPS.items():
            const = dict(BLOCK_L=block_l, BLOCK_D=block_d, PRECISION=precision)
            ins = dict(q_ptr=pt, k_ptr=pt, v_ptr=pt, keep_ptr="*fp32", gam_ptr="*fp32")
            tags = {"dtype": dt}
            yield StaticCase("mc_fwd", _mc_fwd_kernel,
                             {**ins, "mem_ptr": "*fp32", "z_ptr": "*fp32", "y_ptr": pt, "den_ptr": "*fp32",
                              **scal, "eps": "fp32"}, const, warps, tags=tags)
            grad_in = dict(g_ptr=pt, den_ptr="*fp32", dden_ptr="*fp32")
            yield StaticCase("mc_bwd_q", _mc_bwd_q_kernel,
                             {**ins, "mem_ptr": "*fp32", "z_ptr": "*fp32", **grad_in, "dq_ptr": pt,
                              "dgam_ptr": "*fp32", **scal}, const, warps, tags=tags)
            yield StaticCase("mc_bwd_kv", _mc_bwd_kv_kernel,
                             {**ins, **grad_in, "dk_ptr": pt, "dv_ptr": pt, **scal}, const, warps, tags=tags)


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
