"""Affine-scaled attention kernels: the toolkit's causal flash attention plus
row-wise and sequence-scan epilogues, through the identity

    O = α·(P·V) + (α_ma − α)·v̄          v̄_t = mean of the values visible to query t

Forward   a two-level scan over key chunks of VBAR_CHUNK (cached keys first, then
          the queries' own keys), grid (B·H_kv, head-dim blocks, chunks) for both
          levels: each chunk's kept-value sum and kept-key count; then per chunk the
          sums of the chunks before it plus an in-chunk ``tl.cumsum`` give the
          visible-key sum and count N_t, so v̄ ``[B, S, H_kv, D]`` and N_t ``[B, S]``
          are written from two reads of v and the keep mask with no step carried
          along the sequence. O_flash = P·V (fp32) and the log-sum-exp by
          ``_flash``; one row-wise kernel writes ``out = α·O_flash + (α_ma − α)·v̄`` in
          the input dtype.
Backward  one row-wise kernel reads the upstream g once and writes
            g′ = α·g                     (the flash backward's upstream),
            δ  = Σ_d g′·O_flash          (its row term),
            dα = Σ_d g·(O_flash − v̄),   dα_ma partials Σ_d g·v̄;
          the flash backward with g′ gives dq, dk, dv; a two-level suffix scan adds
          the v̄ path into dv in place: key j gets Σ over the queries t that see it
          of c_t·g_t, c_t = (α_ma − α_t)/N_t, summed over the heads of its kv group,
          which is a suffix sum over t (per query chunk: the sums of the later
          chunks plus ``tl.cumsum(..., reverse=True)``) read at the first query that
          sees j (t = j − (N − S), or 0 for cached keys), zero on padding keys.
A query with no visible key has N_t = 0: its output, v̄ and c_t are 0. Padding
contents never reach kept positions (masked with ``where``, never by multiplying).
No torch pass over a full-size tensor remains around the flash core.
"""
from __future__ import annotations

from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._attention import check_attention_inputs
from laminae.primitives._errors import DTypeError
from laminae.primitives._validation import check_has_tokens, check_tensor

from . import _flash
from ._common import StaticCase, empty

__all__ = ["affine_scaled_attention", "affine_scaled_attention_fwd"]

ROW_BLOCK = 16
ROW_WARPS = 4
# Scan tiles: at most SCAN_BLOCK_D features per program; the head dim is split across
# programs, so the scans read whole 64-128-byte segments per row.
SCAN_BLOCK_D = 32
SCAN_WARPS = 4
# The v̄ scan and its gradient's suffix scan, each in two levels over chunks of
# VBAR_CHUNK positions: every chunk's sum in parallel, then per chunk the sums before
# (after) it, SCAN_PREFIX_CHUNKS per step (one step up to 16 chunks, S 2048), and an
# in-chunk cumsum; no step is carried along the sequence, and
# B·H_kv·cdiv(D, 32)·cdiv(S, 128) programs run side by side.
VBAR_CHUNK = 128
SCAN_PREFIX_CHUNKS = 16


@triton.jit
def _affine_combine_kernel(of_ptr, vbar_ptr, alpha_ptr, ama_ptr, out_ptr, R, H, HKV, D,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[r] = α[r]·O_flash[r] + (α_ma[h] − α[r])·v̄[kv row of r] over rows r of [B·S·H, D]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < D)[None, :]
    h = rows % H
    kv_rows = (rows // H) * HKV + h // (H // HKV)
    a = tl.load(alpha_ptr + rows, mask=row_ok, other=0.0)
    ama = tl.load(ama_ptr + h, mask=row_ok, other=0.0)
    of = tl.load(of_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
    vbar = tl.load(vbar_ptr + kv_rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
    out = a[:, None] * of + (ama - a)[:, None] * vbar
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _affine_bwd_rows_kernel(g_ptr, of_ptr, vbar_ptr, alpha_ptr, ama_ptr,
                            gs_ptr, delta_ptr, dalpha_ptr, gvbar_ptr, R, S, H, HKV, D,
                            BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < D)[None, :]
    h = rows % H
    bs = rows // H                       # b·S + s
    kv_rows = bs * HKV + h // (H // HKV)
    offs = rows[:, None] * D + cols[None, :]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    of = tl.load(of_ptr + offs, mask=mask, other=0.0)
    vbar = tl.load(vbar_ptr + kv_rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
    a = tl.load(alpha_ptr + rows, mask=row_ok, other=0.0)
    # g′ as the flash backward reads it (rounded to the input dtype), and δ from that
    # same g′: dO·v − δ is then 0 where the truth makes it 0 (a row that sees one key)
    gs = (g * a[:, None]).to(gs_ptr.dtype.element_ty)
    tl.store(gs_ptr + offs, gs, mask=mask)
    gs = gs.to(tl.float32)
    # δ in the [B, H, S] layout of the flash backward
    b = bs // S
    s = bs % S
    tl.store(delta_ptr + (b * H + h) * S + s, tl.sum(gs * of, 1), mask=row_ok)
    gv = tl.sum(g * vbar, 1)
    tl.store(dalpha_ptr + rows, tl.sum(g * of, 1) - gv, mask=row_ok)
    tl.store(gvbar_ptr + rows, gv, mask=row_ok)


@triton.jit
def _keys_kept(mask_ptr, b, stride_mb, keys, key_ok, HAS_MASK: tl.constexpr):
    """[T] bool: the key exists and is not padding."""
    kept = key_ok
    if HAS_MASK:
        kept = kept & (tl.load(mask_ptr + b * stride_mb + keys, mask=key_ok, other=0) != 0)
    return kept


@triton.jit
def _kept_values(v_ptr, mask_ptr, b, hk, keys, key_ok, cols, col_ok, stride_vb, stride_vn, stride_vh, stride_mb,
                 HAS_MASK: tl.constexpr):
    """(the keys' v rows in fp32, 0 on padding and past the end [T, BD]; 1.0 where kept [T]).
    ``where``, not a product: padding may hold NaN."""
    kept = _keys_kept(mask_ptr, b, stride_mb, keys, key_ok, HAS_MASK)
    v = tl.load(v_ptr + b * stride_vb + hk * stride_vh + keys[:, None] * stride_vn + cols[None, :],
                mask=kept[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    return tl.where(kept[:, None], v, 0.0), kept.to(tl.float32)


@triton.jit
def _vbar_chunk_sums_kernel(v_ptr, mask_ptr, csum_ptr, ccount_ptr, N, HKV, D, NC,
                            stride_vb, stride_vn, stride_vh, stride_mb,
                            HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """First level of the v̄ scan, one program per (b·kv head, feature block, key chunk
    of BLOCK_T): the chunk's kept-value sum into csum ``[B, HKV, NC, D]`` fp32 and, from
    kv head 0's first feature block, its kept-key count into ccount ``[B, NC]`` fp32."""
    pid_bk = tl.program_id(0)
    pid_d = tl.program_id(1)
    c = tl.program_id(2)
    b = (pid_bk // HKV).to(tl.int64)
    hk = (pid_bk % HKV).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    keys = c * BLOCK_T + tl.arange(0, BLOCK_T)
    v, kept = _kept_values(v_ptr, mask_ptr, b, hk, keys, keys < N, cols, col_ok,
                           stride_vb, stride_vn, stride_vh, stride_mb, HAS_MASK)
    tl.store(csum_ptr + (pid_bk.to(tl.int64) * NC + c) * D + cols, tl.sum(v, 0), mask=col_ok)
    tl.store(ccount_ptr + b * NC + c, tl.sum(kept, 0), mask=(pid_d == 0) & (hk == 0))


@triton.jit
def _vbar_expand_kernel(v_ptr, mask_ptr, csum_ptr, ccount_ptr, vbar_ptr, count_ptr, S, N, HKV, D, NC,
                        stride_vb, stride_vn, stride_vh, stride_mb,
                        HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    """Second level: the sums of the chunks before this one (BLOCK_C chunk rows per
    step, ⌈c / BLOCK_C⌉ steps) plus an in-chunk ``tl.cumsum`` give the visible-key sum
    and count N_t; writes v̄ ``[B, S, HKV, D]`` fp32 (contiguous) and N_t ``[B, S]``
    fp32 at the chunk's query positions (key j is query j − (N − S))."""
    pid_bk = tl.program_id(0)
    pid_d = tl.program_id(1)
    c = tl.program_id(2)
    past = N - S
    if (c + 1) * BLOCK_T <= past:                                # cached keys only: no query here
        return
    b = (pid_bk // HKV).to(tl.int64)
    hk = (pid_bk % HKV).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    total = tl.zeros((BLOCK_D,), dtype=tl.float32)
    seen = tl.sum(tl.zeros((BLOCK_C,), dtype=tl.float32), 0)    # kept keys before the chunk (fp32 scalar)
    chunk_rows = pid_bk.to(tl.int64) * NC
    for start in range(0, c, BLOCK_C):
        prev = start + tl.arange(0, BLOCK_C)
        prev_ok = prev < c
        part = tl.load(csum_ptr + (chunk_rows + prev)[:, None] * D + cols[None, :],
                       mask=prev_ok[:, None] & col_ok[None, :], other=0.0)
        total += tl.sum(part, 0)
        seen += tl.sum(tl.load(ccount_ptr + b * NC + prev, mask=prev_ok, other=0.0), 0)
    keys = c * BLOCK_T + tl.arange(0, BLOCK_T)
    v, kept = _kept_values(v_ptr, mask_ptr, b, hk, keys, keys < N, cols, col_ok,
                           stride_vb, stride_vn, stride_vh, stride_mb, HAS_MASK)
    vsum = total[None, :] + tl.cumsum(v, 0)
    count = seen + tl.cumsum(kept, 0)
    vbar = vsum / tl.maximum(count, 1.0)[:, None]               # N_t = 0 ⇒ vsum = 0 ⇒ v̄ = 0
    t = keys - past
    t_ok = (t >= 0) & (keys < N)
    rows = (b * S + t) * HKV + hk
    tl.store(vbar_ptr + rows[:, None] * D + cols[None, :], vbar, mask=t_ok[:, None] & col_ok[None, :])
    tl.store(count_ptr + b * S + t, count, mask=t_ok & (pid_d == 0) & (hk == 0))


@triton.jit
def _weighted_upstream(g_ptr, alpha_ptr, ama_ptr, count_ptr, b, hk, t, t_ok, cols, col_ok, S, H, HKV, D,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """[T, BD] fp32: Σ over the kv group's heads of c_t·g_t, c_t = (α_ma − α_t)/N_t (0 where N_t = 0)."""
    group = H // HKV
    tile = t_ok[:, None] & col_ok[None, :]
    n = tl.load(count_ptr + b * S + t, mask=t_ok, other=0.0)
    w = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in range(0, group):
        h = hk * group + j
        rows = (b * S + t) * H + h
        a = tl.load(alpha_ptr + rows, mask=t_ok, other=0.0)
        c = tl.where(n > 0, (tl.load(ama_ptr + h) - a) / tl.maximum(n, 1.0), 0.0)
        g = tl.load(g_ptr + rows[:, None] * D + cols[None, :], mask=tile, other=0.0).to(tl.float32)
        w += g * c[:, None]
    return w


@triton.jit
def _vbar_grad_chunk_sums_kernel(g_ptr, alpha_ptr, ama_ptr, count_ptr, wsum_ptr, S, H, HKV, D, QC,
                                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """First level of the v̄-gradient suffix scan: per query chunk of BLOCK_T, the sum
    of the group-weighted upstream into wsum ``[B, HKV, QC, D]`` fp32."""
    pid_bk = tl.program_id(0)
    pid_d = tl.program_id(1)
    c = tl.program_id(2)
    b = (pid_bk // HKV).to(tl.int64)
    hk = (pid_bk % HKV).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    t = c * BLOCK_T + tl.arange(0, BLOCK_T)
    w = _weighted_upstream(g_ptr, alpha_ptr, ama_ptr, count_ptr, b, hk, t, t < S, cols, col_ok, S, H, HKV, D,
                           BLOCK_T, BLOCK_D)
    tl.store(wsum_ptr + (pid_bk.to(tl.int64) * QC + c) * D + cols, tl.sum(w, 0), mask=col_ok)


@triton.jit
def _vbar_grad_expand_kernel(g_ptr, alpha_ptr, ama_ptr, count_ptr, wsum_ptr, mask_ptr, dv_ptr, S, N, H, HKV, D,
                             QC, stride_mb,
                             HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_C: tl.constexpr):
    """dv[j] += keep_j·Σ_{t sees j} c_t·g_t (over the kv group's heads), in place on the
    contiguous ``[B, N, HKV, D]`` dv. Programs c < QC take query chunk c: the sums of
    the chunks after it (BLOCK_C per step) plus an in-chunk reverse ``tl.cumsum``;
    programs c ≥ QC take cached-key chunk c − QC, which every query sees: all sums."""
    pid_bk = tl.program_id(0)
    pid_d = tl.program_id(1)
    c = tl.program_id(2)
    b = (pid_bk // HKV).to(tl.int64)
    hk = (pid_bk % HKV).to(tl.int64)
    past = N - S
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    steps = tl.arange(0, BLOCK_T)
    total = tl.zeros((BLOCK_D,), dtype=tl.float32)
    chunk_rows = pid_bk.to(tl.int64) * QC
    for start in range(tl.where(c < QC, c + 1, 0), QC, BLOCK_C):
        later = start + tl.arange(0, BLOCK_C)
        part = tl.load(wsum_ptr + (chunk_rows + later)[:, None] * D + cols[None, :],
                       mask=(later < QC)[:, None] & col_ok[None, :], other=0.0)
        total += tl.sum(part, 0)
    if c < QC:
        t = c * BLOCK_T + steps
        t_ok = t < S
        w = _weighted_upstream(g_ptr, alpha_ptr, ama_ptr, count_ptr, b, hk, t, t_ok, cols, col_ok, S, H, HKV, D,
                               BLOCK_T, BLOCK_D)
        suffix = total[None, :] + tl.cumsum(w, 0, reverse=True)
        _add_where_kept(dv_ptr, mask_ptr, b, hk, past + t, t_ok, cols, col_ok, N, HKV, D, stride_mb, suffix, HAS_MASK)
    else:
        keys = (c - QC) * BLOCK_T + steps
        _add_where_kept(dv_ptr, mask_ptr, b, hk, keys, keys < past, cols, col_ok, N, HKV, D, stride_mb,
                        total[None, :], HAS_MASK)


@triton.jit
def _add_where_kept(dv_ptr, mask_ptr, b, hk, keys, key_ok, cols, col_ok, N, HKV, D, stride_mb, value,
                    HAS_MASK: tl.constexpr):
    """dv[b, keys, hk, cols] += value on kept keys (value broadcasts to [T, BD])."""
    kept = _keys_kept(mask_ptr, b, stride_mb, keys, key_ok, HAS_MASK)
    tile = key_ok[:, None] & col_ok[None, :]
    ptrs = dv_ptr + ((b * N + keys) * HKV + hk)[:, None] * D + cols[None, :]
    dv = tl.load(ptrs, mask=tile, other=0.0).to(tl.float32)
    tl.store(ptrs, (dv + tl.where(kept[:, None], value, 0.0)).to(dv_ptr.dtype.element_ty), mask=tile)


def _row_grid(rows: int):
    return (triton.cdiv(rows, ROW_BLOCK),)


def _scan_grid(batch: int, kv_heads: int, head_dim: int):
    return (batch * kv_heads, triton.cdiv(head_dim, _scan_block_d(head_dim)))


def _scan_block_d(head_dim: int) -> int:
    return min(SCAN_BLOCK_D, _flash.block_d(head_dim))


def _running_mean(v: torch.Tensor, key_mask: torch.Tensor | None, queries: int):
    """(v̄ ``[B, S, H_kv, D]`` fp32, N_t ``[B, S]`` fp32) for the last ``queries`` positions:
    a two-level scan over key chunks of VBAR_CHUNK, both levels parallel over chunks."""
    B, N, HKV, D = v.shape
    chunks = triton.cdiv(N, VBAR_CHUNK)
    vbar = empty((B, queries, HKV, D), dtype=torch.float32, device=v.device)
    count = empty((B, queries), dtype=torch.float32, device=v.device)
    csum = empty((B, HKV, chunks, D), dtype=torch.float32, device=v.device)
    ccount = empty((B, chunks), dtype=torch.float32, device=v.device)
    grid = _scan_grid(B, HKV, D) + (chunks,)
    strides = (v.stride(0), v.stride(1), v.stride(2), 0 if key_mask is None else key_mask.stride(0))
    const = dict(HAS_MASK=key_mask is not None, BLOCK_T=VBAR_CHUNK, BLOCK_D=_scan_block_d(D), num_warps=SCAN_WARPS)
    wrap_triton(_vbar_chunk_sums_kernel)[grid](v, key_mask, csum, ccount, N, HKV, D, chunks, *strides, **const)
    wrap_triton(_vbar_expand_kernel)[grid](v, key_mask, csum, ccount, vbar, count, queries, N, HKV, D, chunks,
                                           *strides, BLOCK_C=SCAN_PREFIX_CHUNKS, **const)
    return vbar, count


def _running_mean_grad(g, alpha, alpha_ma, count, key_mask, dv) -> None:
    """Adds the v̄ path into the contiguous dv ``[B, N, H_kv, D]`` in place: a two-level
    suffix scan over query chunks of VBAR_CHUNK (chunk sums, then per chunk the sums
    after it and an in-chunk reverse cumsum), plus the cached-key chunks."""
    B, S, H, D = g.shape
    N, HKV = dv.shape[1], dv.shape[2]
    chunks = triton.cdiv(S, VBAR_CHUNK)
    wsum = empty((B, HKV, chunks, D), dtype=torch.float32, device=g.device)
    grid = _scan_grid(B, HKV, D)
    const = dict(BLOCK_T=VBAR_CHUNK, BLOCK_D=_scan_block_d(D), num_warps=SCAN_WARPS)
    wrap_triton(_vbar_grad_chunk_sums_kernel)[grid + (chunks,)](
        g, alpha, alpha_ma, count, wsum, S, H, HKV, D, chunks, **const)
    wrap_triton(_vbar_grad_expand_kernel)[grid + (chunks + triton.cdiv(N - S, VBAR_CHUNK),)](
        g, alpha, alpha_ma, count, wsum, key_mask, dv, S, N, H, HKV, D, chunks,
        0 if key_mask is None else key_mask.stride(0),
        HAS_MASK=key_mask is not None, BLOCK_C=SCAN_PREFIX_CHUNKS, **const)


@triton_op("laminae::affine_scaled_attention_fwd", mutates_args=())
def affine_scaled_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, alpha_ma: torch.Tensor,
    key_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, O_flash, lse, v̄, N_t)`` for contiguous q/k/v, fp32 ``alpha`` ``[B, S, H]``
    and ``alpha_ma`` ``[H]``, and an int8 ``key_mask`` or None."""
    B, S, H, D = q.shape
    vbar, count = _running_mean(v, key_mask, S)
    o_flash, lse = _flash.flash_forward(q, k, v, key_mask, out_dtype=torch.float32)
    out = empty(q.shape, dtype=q.dtype, device=q.device)
    rows = B * S * H
    wrap_triton(_affine_combine_kernel)[_row_grid(rows)](
        o_flash, vbar, alpha, alpha_ma, out, rows, H, k.shape[2], D,
        BLOCK_R=ROW_BLOCK, BLOCK_D=_flash.block_d(D), num_warps=ROW_WARPS,
    )
    return out, o_flash, lse, vbar, count


@triton_op("laminae::affine_scaled_attention_bwd", mutates_args=())
def _affine_scaled_attention_bwd(
    g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor,
    alpha_ma: torch.Tensor, key_mask: torch.Tensor | None, o_flash: torch.Tensor, lse: torch.Tensor,
    vbar: torch.Tensor, count: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, S, H, D = q.shape
    N, HKV = k.shape[1], k.shape[2]
    rows = B * S * H
    g_scaled = empty(q.shape, dtype=q.dtype, device=q.device)
    delta = empty((B, H, S), dtype=torch.float32, device=q.device)
    dalpha = empty((B, S, H), dtype=torch.float32, device=q.device)
    g_vbar = empty((B, S, H), dtype=torch.float32, device=q.device)
    wrap_triton(_affine_bwd_rows_kernel)[_row_grid(rows)](
        g, o_flash, vbar, alpha, alpha_ma, g_scaled, delta, dalpha, g_vbar, rows, S, H, HKV, D,
        BLOCK_R=ROW_BLOCK, BLOCK_D=_flash.block_d(D), num_warps=ROW_WARPS,
    )
    dq, dk, dv = _flash.flash_backward(q, k, v, key_mask, g_scaled, lse, delta)
    dv = dv.contiguous()
    _running_mean_grad(g, alpha, alpha_ma, count, key_mask, dv)
    dalpha_ma = g_vbar.sum(dim=(0, 1))
    return dq, dk, dv, dalpha, dalpha_ma


def _setup_context(ctx, inputs, output):
    q, k, v, alpha, alpha_ma, key_mask = inputs
    _, o_flash, lse, vbar, count = output
    ctx.save_for_backward(q, k, v, alpha, alpha_ma, key_mask, o_flash, lse, vbar, count)


def _backward(ctx, g, *_unused):
    q, k, v, alpha, alpha_ma, key_mask, o_flash, lse, vbar, count = ctx.saved_tensors
    dq, dk, dv, dalpha, dalpha_ma = _affine_scaled_attention_bwd(
        g.contiguous(), q, k, v, alpha, alpha_ma, key_mask, o_flash, lse, vbar, count)
    return dq, dk, dv, dalpha, dalpha_ma, None


affine_scaled_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def affine_scaled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    alpha_ma: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton affine-scaled attention with the signature of
    :func:`laminae.primitives.affine_scaled_attention.affine_scaled_attention_reference`.

    ``q`` ``[B, S, H, D]``, ``k``/``v`` ``[B, N, H_kv, D]`` (fp32/bf16/fp16, one dtype,
    ``N ≥ S``, ``D ≤ 256``), ``alpha`` ``[B, S, H]``, ``alpha_ma`` ``[H]``,
    ``attention_mask`` ``(B, N)``. Differentiable in q, k, v, alpha and alpha_ma; returns ``[B, S, H, D]``
    in the dtype of ``q``.
    """
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"Triton affine-scaled attention supports fp32/bf16/fp16 inputs, got {q.dtype}")
    check_attention_inputs(q, k, v, attention_mask, module=False, alpha=alpha, alpha_ma=alpha_ma)
    check_has_tokens("q", q)
    B, S, H, D = q.shape
    check_tensor("alpha", alpha, shape=(B, S, H), layout="[batch, seq, num_heads]")
    check_tensor("alpha_ma", alpha_ma, shape=(H,), layout="[num_heads]")
    _flash._check_dims(q, k)
    out, *_ = affine_scaled_attention_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), alpha.float().contiguous(),
        alpha_ma.float().contiguous(), _flash.mask_arg(attention_mask))
    return out


def static_cases() -> Iterator[StaticCase]:
    """The row and scan kernels at each padded head dim and dtype, plus every flash
    configuration (with the fp32 O_flash the epilogue reads).

    Every pointer is declared 16-byte aligned (``divisible``), as Triton's launcher
    specialises it: q/k/v, alpha and the upstream gradient arrive contiguous (a copy
    where the caller's tensor was not), the key mask is built per call, the rest are
    fresh allocations. A contiguous caller tensor at an odd offset launches a second,
    unaligned binary: rare, and not the one the table describes. The head dim and
    strides are not declared: a case serves every head dim its BLOCK_D pads."""
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        # fp32 stops where the flash core does (FP32_MAX_HEAD_DIM): no launch reaches fp32 at 256
        for bd in (16, 32, 64, 128, 256) if dt != "fp32" else (16, 32, 64, 128):
            const = dict(BLOCK_R=ROW_BLOCK, BLOCK_D=bd)
            yield StaticCase("affine_combine", _affine_combine_kernel,
                             dict(of_ptr="*fp32", vbar_ptr="*fp32", alpha_ptr="*fp32", ama_ptr="*fp32", out_ptr=p,
                                  R="i32", H="i32", HKV="i32", D="i32"), const, ROW_WARPS, tags={"dtype": dt},
                             divisible=("of_ptr", "vbar_ptr", "alpha_ptr", "ama_ptr", "out_ptr"))
            yield StaticCase("affine_bwd_rows", _affine_bwd_rows_kernel,
                             dict(g_ptr=p, of_ptr="*fp32", vbar_ptr="*fp32", alpha_ptr="*fp32", ama_ptr="*fp32",
                                  gs_ptr=p, delta_ptr="*fp32", dalpha_ptr="*fp32", gvbar_ptr="*fp32",
                                  R="i32", S="i32", H="i32", HKV="i32", D="i32"),
                             const, ROW_WARPS, tags={"dtype": dt},
                             divisible=("g_ptr", "of_ptr", "vbar_ptr", "alpha_ptr", "ama_ptr", "gs_ptr", "delta_ptr",
                                        "dalpha_ptr", "gvbar_ptr"))
        for bd in sorted({_scan_block_d(d) for d in (16, 32, 64, 128, 256)}):
            for has_mask in (False, True):
                const = dict(HAS_MASK=has_mask, BLOCK_T=VBAR_CHUNK, BLOCK_D=bd)
                scan = dict(v_ptr=p, mask_ptr="*i8", csum_ptr="*fp32", ccount_ptr="*fp32")
                ints = dict(HKV="i32", D="i32", NC="i32", stride_vb="i32", stride_vn="i32", stride_vh="i32",
                            stride_mb="i32")
                yield StaticCase("vbar_chunk_sums", _vbar_chunk_sums_kernel, dict(scan, N="i32", **ints), const,
                                 SCAN_WARPS, tags={"dtype": dt}, divisible=tuple(scan))
                yield StaticCase("vbar_expand", _vbar_expand_kernel,
                                 dict(scan, vbar_ptr="*fp32", count_ptr="*fp32", S="i32", N="i32", **ints),
                                 dict(const, BLOCK_C=SCAN_PREFIX_CHUNKS), SCAN_WARPS, tags={"dtype": dt},
                                 divisible=(*scan, "vbar_ptr", "count_ptr"))
                yield StaticCase("vbar_grad_expand", _vbar_grad_expand_kernel,
                                 dict(g_ptr=p, alpha_ptr="*fp32", ama_ptr="*fp32", count_ptr="*fp32",
                                      wsum_ptr="*fp32", mask_ptr="*i8", dv_ptr=p, S="i32", N="i32", H="i32",
                                      HKV="i32", D="i32", QC="i32", stride_mb="i32"),
                                 dict(const, BLOCK_C=SCAN_PREFIX_CHUNKS), SCAN_WARPS, tags={"dtype": dt},
                                 divisible=("g_ptr", "alpha_ptr", "ama_ptr", "count_ptr", "wsum_ptr", "mask_ptr",
                                            "dv_ptr"))
            yield StaticCase("vbar_grad_chunk_sums", _vbar_grad_chunk_sums_kernel,
                             dict(g_ptr=p, alpha_ptr="*fp32", ama_ptr="*fp32", count_ptr="*fp32", wsum_ptr="*fp32",
                                  S="i32", H="i32", HKV="i32", D="i32", QC="i32"),
                             dict(BLOCK_T=VBAR_CHUNK, BLOCK_D=bd), SCAN_WARPS, tags={"dtype": dt},
                             divisible=("g_ptr", "alpha_ptr", "ama_ptr", "count_ptr", "wsum_ptr"))
    yield from _flash.static_cases(out_dtypes=("fp32",))


def tour_case(device: torch.device):
    from laminae.primitives.affine_scaled_attention import affine_scaled_attention_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    B, S, H, HKV, D = 2, 64, 4, 2, 32
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, :5] = False      # left padding
    keep[1, -9:] = False     # right padding
    keep[1, 20:23] = False   # a hole
    inputs = {
        "q": torch.randn(B, S, H, D, generator=gen).to(device),
        "k": torch.randn(B, S, HKV, D, generator=gen).to(device),
        "v": torch.randn(B, S, HKV, D, generator=gen).to(device),
        "alpha": torch.rand(B, S, H, generator=gen).to(device),
        "alpha_ma": torch.rand(H, generator=gen).to(device),
        "attention_mask": keep.to(device),
    }
    return TourCase("affine_scaled_attention (GQA 4/2, ragged mask)", affine_scaled_attention,
                    affine_scaled_attention_reference, inputs, ["q", "k", "v", "alpha"])
