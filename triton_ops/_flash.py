"""Causal softmax flash attention: the forward and backward kernels other attention
mechanisms build on.

Layout and visibility (the toolkit's attention convention):

- ``q`` is ``[B, S, H, D]``; ``k`` and ``v`` are ``[B, N, H_kv, D]`` with ``N ≥ S``
  and ``H % H_kv == 0`` (query head ``h`` reads kv head ``h // (H // H_kv)``).
- Query ``i`` sits at absolute position ``N − S + i`` (``S == N``: a plain forward;
  ``S < N``: decoding after a cache of ``N − S`` keys).
- Key ``j`` is visible to query ``i`` iff ``j ≤ N − S + i`` and ``attention_mask[b, j]``;
  with a sliding ``window`` W also ``N − S + i − j < W`` (the query and the W − 1
  positions before it; key blocks wholly outside the window are skipped).
- A query with no visible key returns 0 and has log-sum-exp ``−inf``.

Forward   grid ``(B·H, cdiv(S, BLOCK_M))``, query tiles last to first (the heaviest
          under the causal bound start first): online softmax over key blocks in fp32
          (base-2 exponentials), never holding an S×N matrix. Writes ``O = P·V`` in
          the dtype of the output buffer the caller allocates (callers that add an
          epilogue, such as affine-scaled attention, ask for fp32) and the per-row
          natural log-sum-exp ``[B, H, S]`` in fp32.
Backward  ``delta = rowsum(dO·O)`` (torch, or the caller's own fused row kernel);
          a dq kernel over query blocks and a dk/dv kernel over key blocks that
          loops over the query heads of its kv group, so GQA gradients are summed
          on chip. Both recompute ``P = exp(s − lse)``.

The head dim is padded to ``max(16, next_power_of_2(D))`` with masked loads
(``tl.dot`` needs every dimension ≥ 16), without any mask when the head dim fills the
tile (``EVEN_D``); the batch/head base of each pointer is int64, the per-element
offsets of a tile int32 (``S·H·D < 2³¹`` per batch row).
Tiles depend on the padded head dim and the dtype (:func:`tiles`), sized for Hopper
and checked for spills by the static sm_90 check.

Public pieces: :func:`flash_forward` / :func:`flash_backward` (plain launchers a
caller's ``triton_op`` can use), the differentiable op :func:`flash_attention`
and :func:`flash_attention_reference`, and :func:`static_cases`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import ConfigError, DTypeError, ShapeError

from ._common import INTERPRET_AT_IMPORT, StaticCase, dot_precision, empty

__all__ = [
    "FlashTiles",
    "FP32_MAX_HEAD_DIM",
    "MAX_HEAD_DIM",
    "tiles",
    "flash_forward",
    "flash_backward",
    "flash_decode",
    "flash_delta",
    "flash_attention",
    "flash_attention_reference",
    "static_cases",
]

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _kept(cols, N, mask_ptr, b):
    """[BLOCK_N] bool: key col j is in range and kept by the (B, N) int8 keep mask."""
    return tl.load(mask_ptr + b * N + cols, mask=cols < N, other=0) != 0


@triton.jit
def _visible(rows, cols, S, N, mask_ptr, b, HAS_MASK: tl.constexpr, WINDOW, HAS_WINDOW: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: query row i sees key col j (causal, in range, kept,
    within WINDOW positions when HAS_WINDOW)."""
    vis = (cols[None, :] <= (N - S + rows)[:, None]) & (rows < S)[:, None] & (cols < N)[None, :]
    if HAS_WINDOW:
        vis = vis & ((N - S + rows)[:, None] - cols[None, :] < WINDOW)
    if HAS_MASK:
        keep = _kept(cols, N, mask_ptr, b)
        vis = vis & keep[None, :]
    return vis


@triton.jit
def _key_blocks(pid_m, S, N, WINDOW, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(lo, full_lo, full_hi, hi)``: the key blocks query tile ``pid_m`` reads, split so
    that every row of the tile sees every key of ``[full_lo, full_hi)`` (no causal,
    window or bounds test there); ``[lo, full_lo)`` are window-edge blocks and
    ``[full_hi, hi)`` the diagonal blocks, both masked. All but ``hi`` are multiples
    of BLOCK_N, so the three ranges tile ``[lo, hi)`` exactly."""
    first = N - S + pid_m * BLOCK_M                              # position of the tile's first query
    last = N - S + tl.minimum((pid_m + 1) * BLOCK_M, S) - 1      # and of its last real one
    hi = tl.minimum(N, last + 1)                                 # later keys are never visible
    full_hi = (first + 1) // BLOCK_N * BLOCK_N                   # blocks wholly at or before `first`
    lo = full_hi * 0
    full_lo = lo
    if HAS_WINDOW:
        lo = tl.maximum(first - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last - WINDOW + 1, 0), BLOCK_N) * BLOCK_N  # inside `last`'s window
        full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_blocks(pid_n, S, N, WINDOW, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(lo, full_lo, full_hi, hi)``: the query blocks that see key tile ``pid_n``,
    split like :func:`_key_blocks`: every row of ``[full_lo, full_hi)`` is real and
    sees every key of the tile; ``[lo, full_lo)`` (diagonal) and ``[full_hi, hi)``
    (window edge, ragged tail) are masked."""
    first = pid_n * BLOCK_N                                      # the tile's first key
    last = tl.minimum((pid_n + 1) * BLOCK_N, N) - 1              # and its last real one
    lo = tl.maximum(first - (N - S), 0) // BLOCK_M * BLOCK_M      # the first query block that sees `first`
    full_lo = tl.cdiv(tl.maximum(last - (N - S), 0), BLOCK_M) * BLOCK_M  # rows from here on see `last`
    hi = S + lo * 0
    full_hi = S // BLOCK_M * BLOCK_M + lo * 0
    if HAS_WINDOW:
        hi = tl.minimum(hi, last + WINDOW - (N - S))            # later rows see no key of the tile
        full_hi = tl.minimum(full_hi, tl.maximum(first + WINDOW - (N - S), 0) // BLOCK_M * BLOCK_M)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _log2_lse(lse_ptr, rows, row_ok):
    """The forward's natural log-sum-exp in base 2; a row that saw no key (−inf)
    gets 0, so ``exp2(s − lse)`` of its (−inf) scores is 0, not NaN."""
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    return tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)


@triton.jit
def _load(ptrs, row_ok, d_ok, ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """A [rows, BLOCK_D] tile, 0 where masked: rows tested when ROWS, the head dim
    unless EVEN_D (D == BLOCK_D: no padded columns, no per-element mask)."""
    if ROWS:
        if EVEN_D:
            t = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            t = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            t = tl.load(ptrs)
        else:
            t = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return t


@triton.jit
def _store(ptrs, value, row_ok, d_ok, EVEN_D: tl.constexpr):
    if EVEN_D:
        tl.store(ptrs, value, mask=row_ok[:, None])
    else:
        tl.store(ptrs, value, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _fwd_blocks(acc, m_i, l_i, q, k_base, v_base, mask_ptr, b, rows, start, end, S, N, stride, qk_scale, WINDOW,
                offs_n, offs_d, d_ok, HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, MASKED: tl.constexpr,
                BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over key blocks ``[start, end)``; MASKED blocks test causality,
    window and bounds, the others only the optional keep mask."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        kv_off = cols[:, None] * stride + offs_d[None, :]                 # int32 within one (b, kv head)
        k = _load(k_base + kv_off, cols < N, d_ok, MASKED, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            s = tl.where(_visible(rows, cols, S, N, mask_ptr, b, HAS_MASK, WINDOW, HAS_WINDOW), s, float("-inf"))
        elif HAS_MASK:
            s = tl.where(_kept(cols, N, mask_ptr, b)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED or HAS_MASK:
            # a row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.exp2(s - m_new_safe[:, None])
        corr = tl.exp2(m_i - m_new_safe)
        l_i = l_i * corr + tl.sum(p, 1)
        v = _load(v_base + kv_off, cols < N, d_ok, MASKED, EVEN_D)
        acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _heavy_first(BLOCK_M: tl.constexpr, S):
    """This program's query tile: axis 1 walks the tiles last to first, so the tiles
    with the most causal key blocks start first (axis 0, the (b, h) pairs, varies
    fastest: every pair's heaviest tile is scheduled before any lighter one)."""
    return tl.cdiv(S, BLOCK_M) - 1 - tl.program_id(1)


@triton.jit
def _flash_fwd_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, lse_ptr,
                      S, N, H, HKV, D, qk_scale, WINDOW, S_BUCKET,
                      HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr):
    # S_BUCKET: only an autotune key (the sequence length, bucketed)
    pid_bh = tl.program_id(0)
    pid_m = _heavy_first(BLOCK_M, S)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kvh = h // (H // HKV)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row_ok = rows < S
    q_base = (b * S * H + h) * D                                          # int64 base, int32 tile offsets
    q_off = rows[:, None] * (H * D) + offs_d[None, :]
    q = _load(q_ptr + q_base + q_off, row_ok, d_ok, True, EVEN_D)
    k_base = k_ptr + (b * N * HKV + kvh) * D
    v_base = v_ptr + (b * N * HKV + kvh) * D

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_blocks(pid_m, S, N, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N)
    args = (q, k_base, v_base, mask_ptr, b, rows)
    tail = (S, N, HKV * D, qk_scale, WINDOW, offs_n, offs_d, d_ok, HAS_MASK, HAS_WINDOW)
    if HAS_WINDOW:
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, lo, tl.minimum(full_lo, hi), *tail, True, BLOCK_N,
                                    EVEN_D, PRECISION)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, full_lo, full_hi, *tail, False, BLOCK_N, EVEN_D, PRECISION)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, full_hi, hi, *tail, True, BLOCK_N, EVEN_D, PRECISION)

    empty_row = l_i == 0.0
    l_safe = tl.where(empty_row, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty_row, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    _store(o_ptr + q_base + q_off, o.to(o_ptr.dtype.element_ty), row_ok, d_ok, EVEN_D)
    tl.store(lse_ptr + (b * H + h) * S + rows, lse, mask=row_ok)


@triton.jit
def _flash_decode_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, part_ptr, ml_ptr,
                         S, N, H, HKV, D, qk_scale, WINDOW, SPLIT_N, SPLITS, STRIDE_KB, STRIDE_VB, STRIDE_N,
                         HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr):
    """Split-K decoding (flash-decoding): the S ≤ BLOCK_M newest queries of one (b, h)
    over the keys ``[split·SPLIT_N, (split+1)·SPLIT_N)``; writes the unnormalised
    partial output and its (running max, sum) in base 2 for :func:`_flash_decode_combine`.

    K and V are read through their batch strides (``STRIDE_KB``, ``STRIDE_VB``) and a
    shared row stride ``STRIDE_N`` (each row's ``[HKV, D]`` dense), so a cache's live
    rows are read in place from its larger storage."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kvh = h // (H // HKV)
    rows = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row_ok = rows < S
    q_off = rows[:, None] * (H * D) + offs_d[None, :]
    q = _load(q_ptr + (b * S * H + h) * D + q_off, row_ok, d_ok, True, EVEN_D)
    k_base = k_ptr + b * STRIDE_KB + kvh * D                             # int64 (b is), int32 tile offsets
    v_base = v_ptr + b * STRIDE_VB + kvh * D
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_blocks(0, S, N, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N)
    s0 = split * SPLIT_N
    s1 = s0 + SPLIT_N
    args = (q, k_base, v_base, mask_ptr, b, rows)
    tail = (S, N, STRIDE_N, qk_scale, WINDOW, offs_n, offs_d, d_ok, HAS_MASK, HAS_WINDOW)
    if HAS_WINDOW:
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, tl.maximum(lo, s0), tl.minimum(tl.minimum(full_lo, hi), s1),
                                    *tail, True, BLOCK_N, EVEN_D, PRECISION)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, tl.maximum(full_lo, s0), tl.minimum(full_hi, s1), *tail, False,
                                BLOCK_N, EVEN_D, PRECISION)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, tl.maximum(full_hi, s0), tl.minimum(hi, s1), *tail, True,
                                BLOCK_N, EVEN_D, PRECISION)
    part = (pid_bh * SPLITS + split).to(tl.int64) * BLOCK_M
    tl.store(part_ptr + part * BLOCK_D + rows[:, None] * BLOCK_D + offs_d[None, :], acc)
    tl.store(ml_ptr + (part + rows) * 2, m_i)
    tl.store(ml_ptr + (part + rows) * 2 + 1, l_i)


@triton.jit
def _flash_decode_combine(part_ptr, ml_ptr, o_ptr, S, H, D, SPLITS, BLOCK_M: tl.constexpr,
                          BLOCK_SPLIT: tl.constexpr, BLOCK_D: tl.constexpr):
    """O of query row ``r`` of one (b, h): the splits' partials rescaled to their
    common max and summed (a row that saw no key gives 0)."""
    pid_bh = tl.program_id(0)
    r = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    sp = tl.arange(0, BLOCK_SPLIT)
    offs_d = tl.arange(0, BLOCK_D)
    sp_ok = sp < SPLITS
    part = ((pid_bh * SPLITS + sp).to(tl.int64) * BLOCK_M + r)
    m = tl.load(ml_ptr + part * 2, mask=sp_ok, other=float("-inf"))
    l = tl.load(ml_ptr + part * 2 + 1, mask=sp_ok, other=0.0)
    m_all = tl.max(m, 0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_safe))
    acc = tl.load(part_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=sp_ok[:, None], other=0.0)
    total = tl.sum(l * w, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + (b * S * H + h) * D + r * (H * D) + offs_d, o.to(o_ptr.dtype.element_ty), mask=offs_d < D)

@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, mask_ptr, b, rows, start, end, S, N, stride, qk_scale, WINDOW,
               offs_n, offs_d, d_ok, HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, MASKED: tl.constexpr,
               BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr):
    """``dq += dS·K`` over key blocks ``[start, end)`` (masking as in :func:`_fwd_blocks`)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        kv_off = cols[:, None] * stride + offs_d[None, :]
        k = _load(k_base + kv_off, cols < N, d_ok, MASKED, EVEN_D)
        v = _load(v_base + kv_off, cols < N, d_ok, MASKED, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            s = tl.where(_visible(rows, cols, S, N, mask_ptr, b, HAS_MASK, WINDOW, HAS_WINDOW), s, float("-inf"))
        elif HAS_MASK:
            s = tl.where(_kept(cols, N, mask_ptr, b)[None, :], s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _flash_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                         S, N, H, HKV, D, qk_scale, sm_scale, WINDOW, S_BUCKET,
                         HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_m = _heavy_first(BLOCK_M, S)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kvh = h // (H // HKV)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row_ok = rows < S
    q_base = (b * S * H + h) * D
    q_off = rows[:, None] * (H * D) + offs_d[None, :]
    q = _load(q_ptr + q_base + q_off, row_ok, d_ok, True, EVEN_D)
    do = _load(do_ptr + q_base + q_off, row_ok, d_ok, True, EVEN_D)
    lse2 = _log2_lse(lse_ptr + (b * H + h) * S, rows, row_ok)
    delta = tl.load(delta_ptr + (b * H + h) * S + rows, mask=row_ok, other=0.0)
    k_base = k_ptr + (b * N * HKV + kvh) * D
    v_base = v_ptr + (b * N * HKV + kvh) * D

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_blocks(pid_m, S, N, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N)
    args = (q, do, lse2, delta, k_base, v_base, mask_ptr, b, rows)
    tail = (S, N, HKV * D, qk_scale, WINDOW, offs_n, offs_d, d_ok, HAS_MASK, HAS_WINDOW)
    if HAS_WINDOW:
        dq = _dq_blocks(dq, *args, lo, tl.minimum(full_lo, hi), *tail, True, BLOCK_N, EVEN_D, PRECISION)
    dq = _dq_blocks(dq, *args, full_lo, full_hi, *tail, False, BLOCK_N, EVEN_D, PRECISION)
    dq = _dq_blocks(dq, *args, full_hi, hi, *tail, True, BLOCK_N, EVEN_D, PRECISION)
    _store(dq_ptr + q_base + q_off, (dq * sm_scale).to(dq_ptr.dtype.element_ty), row_ok, d_ok, EVEN_D)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_ptr, delta_ptr, mask_ptr, b, cols, start, end, S, N,
                 stride, qk_scale, WINDOW, offs_m, offs_d, d_ok, HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 MASKED: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr):
    """``dv += Pᵀ·dO`` and ``dk += dSᵀ·Q`` over query blocks ``[start, end)`` of one
    head, on transposed scores ``sᵀ`` [BLOCK_N, BLOCK_M] (key rows, query columns).
    ``q_base``/``do_base`` point at the head's first row, so the per-element offsets
    of the loop are int32."""
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < S
        q_off = rows[:, None] * stride + offs_d[None, :]
        q = _load(q_base + q_off, row_ok, d_ok, MASKED, EVEN_D)
        do = _load(do_base + q_off, row_ok, d_ok, MASKED, EVEN_D)
        lse2 = _log2_lse(lse_ptr, rows, row_ok)
        delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
        if MASKED:
            st = tl.where(tl.trans(_visible(rows, cols, S, N, mask_ptr, b, HAS_MASK, WINDOW, HAS_WINDOW)), st,
                          float("-inf"))
        elif HAS_MASK:
            st = tl.where(_kept(cols, N, mask_ptr, b)[:, None], st, float("-inf"))
        pt = tl.exp2(st - lse2[None, :])
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _flash_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                           S, N, H, HKV, D, qk_scale, sm_scale, WINDOW, S_BUCKET,
                           HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr):
    # axis 1 walks key tiles first to last: under the causal bound the first see the most queries
    pid_bkv = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = (pid_bkv // HKV).to(tl.int64)
    kvh = pid_bkv % HKV
    group = H // HKV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_base = (b * N * HKV + kvh) * D
    kv_off = cols[:, None] * (HKV * D) + offs_d[None, :]
    k = _load(k_ptr + kv_base + kv_off, cols < N, d_ok, True, EVEN_D)
    v = _load(v_ptr + kv_base + kv_off, cols < N, d_ok, True, EVEN_D)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    lo, full_lo, full_hi, hi = _query_blocks(pid_n, S, N, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N)
    tail = (S, N, H * D, qk_scale, WINDOW, offs_m, offs_d, d_ok, HAS_MASK, HAS_WINDOW)
    for g in range(0, group):
        h = kvh * group + g
        q_base = (b * S * H + h) * D
        args = (q_ptr + q_base, do_ptr + q_base, lse_ptr + (b * H + h) * S, delta_ptr + (b * H + h) * S,
                mask_ptr, b, cols)
        dk, dv = _dkdv_blocks(dk, dv, k, v, *args, lo, tl.minimum(full_lo, hi), *tail, True, BLOCK_M, EVEN_D,
                              PRECISION)
        dk, dv = _dkdv_blocks(dk, dv, k, v, *args, full_lo, full_hi, *tail, False, BLOCK_M, EVEN_D, PRECISION)
        dk, dv = _dkdv_blocks(dk, dv, k, v, *args, full_hi, hi, *tail, True, BLOCK_M, EVEN_D, PRECISION)
    _store(dk_ptr + kv_base + kv_off, (dk * sm_scale).to(dk_ptr.dtype.element_ty), cols < N, d_ok, EVEN_D)
    _store(dv_ptr + kv_base + kv_off, dv.to(dv_ptr.dtype.element_ty), cols < N, d_ok, EVEN_D)


@triton.jit
def _flash_delta_kernel(o_ptr, do_ptr, delta_ptr, R, S, H, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta[b, h, s] = Σ_d O·dO in fp32 for BLOCK_R rows r = (b·S + s)·H + h of [B·S·H, D]."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    off = rows.to(tl.int64)[:, None] * D + offs_d[None, :]
    m = row_ok[:, None] & (offs_d < D)[None, :]
    o = tl.load(o_ptr + off, mask=m, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + off, mask=m, other=0.0).to(tl.float32)
    h = rows % H
    bs = rows // H
    tl.store(delta_ptr + (bs // S * H + h).to(tl.int64) * S + bs % S, tl.sum(o * do, 1), mask=row_ok)


# ----------------------------------------------------------------------------
# Tiles
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class FlashTiles:
    """Tile sizes, warps and software-pipeline stages of the three kernels for one
    padded head dim (``dq_stages``/``dkdv_stages`` 0: the same as ``stages``)."""

    fwd_m: int
    fwd_n: int
    fwd_warps: int
    dq_m: int
    dq_n: int
    dq_warps: int
    dkdv_m: int
    dkdv_n: int
    dkdv_warps: int
    stages: int = 2
    dq_stages: int = 0
    dkdv_stages: int = 0

    def of(self, kind: str) -> tuple[int, int, int, int]:
        """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of kernel ``kind`` ("fwd",
        "dq" or "dkdv"; BLOCK_M always counts queries, BLOCK_N keys)."""
        return {"fwd": (self.fwd_m, self.fwd_n, self.fwd_warps, self.stages),
                "dq": (self.dq_m, self.dq_n, self.dq_warps, self.dq_stages or self.stages),
                "dkdv": (self.dkdv_m, self.dkdv_n, self.dkdv_warps, self.dkdv_stages or self.stages)}[kind]


# Keyed by BLOCK_D; checked to compile without spills for sm_90 by the static check.
#
# bf16/fp16 at head dims 64 and 128 (any multiple of 16 padded to them) run Hopper's
# wgmma, which needs a warpgroup (4 warps) per 64 rows of a dot's M dimension: queries
# in the forward and dq kernels, keys (BLOCK_N) in dk/dv. A 128-query forward tile
# reads each K/V block once for 128 rows, twice the FLOPs per byte of a 64-row tile,
# with 8 warps. Such head dims are multiples of 16, so Triton's launcher specializes
# the loads into 16-byte vectors (static cases say so with ``divisible``); that leaves
# registers for 3 pipelined K/V stages in the forward. The backward kernels hold two
# fp32 accumulators and four score-sized tiles. In dk/dv the key tile (128 rows: two
# warpgroups) is the wgmma A operand of Kᵀ-side products and stays in registers with
# the dk, dv accumulators (at D 128: 64 + 128 registers a thread), so the query step
# is 16 rows: 32 rows spill at both head dims (sm_90 check: 84-352 bytes), while with
# int32 tile offsets and unmasked head dims 16 rows fit 2 stages at D 128 (242 regs).
_TILES_16BIT: dict[int, FlashTiles] = {
    16: FlashTiles(64, 64, 4, 64, 64, 4, 32, 64, 8),     # dk/dv on 4 warps spills 8 bytes
    32: FlashTiles(64, 64, 4, 64, 64, 4, 16, 64, 4),
    64: FlashTiles(128, 64, 8, 128, 64, 8, 16, 128, 8, stages=3, dq_stages=2, dkdv_stages=2),
    128: FlashTiles(128, 64, 8, 128, 64, 8, 16, 128, 8, stages=3, dq_stages=2, dkdv_stages=2),
    256: FlashTiles(32, 16, 8, 32, 32, 8, 16, 16, 8),
}
# More candidates the autotuner times on CUDA (the table's comes first): deeper
# pipelines, and 4-warp backward tiles that fit 2 CTAs on an SM.
_TUNE_16BIT: dict[int, tuple[FlashTiles, ...]] = {
    64: (dataclasses.replace(_TILES_16BIT[64], fwd_n=128, dq_stages=3, dkdv_stages=3),
         dataclasses.replace(_TILES_16BIT[64], dq_m=64, dq_warps=4, dq_stages=3, dkdv_n=64, dkdv_warps=4,
                             dkdv_stages=3)),
    128: (dataclasses.replace(_TILES_16BIT[128], stages=2, dq_n=32, dq_stages=3),
          dataclasses.replace(_TILES_16BIT[128], dq_m=64, dq_warps=4)),
}
# Candidates only without a keep mask: the 128×128 forward tile at D 128 (244
# registers; the mask test spills it).
_TUNE_16BIT_UNMASKED: dict[int, tuple[FlashTiles, ...]] = {
    128: (dataclasses.replace(_TILES_16BIT[128], fwd_n=128, stages=2),),
}
# Head dims padded to 64/128 that are not multiples of 16 load the head dim with a
# per-element mask (no vectors): their own smaller tiles.
_TILES_16BIT_ODD: dict[int, FlashTiles] = {
    64: FlashTiles(64, 64, 4, 64, 64, 4, 16, 64, 8),
    128: FlashTiles(64, 32, 8, 64, 16, 8, 32, 32, 8),
}
# fp32 inputs take exact ("ieee") products on the FMA units with operands in
# registers, hence small tiles. With int32 tile offsets ptxas holds the 8-warp fp32
# tiles at 128 registers a thread and spilled the former 32×32 dk/dv and dq tiles at
# 64/128 and the 16×16 forward at 128 (sm_90 check, 12-832 bytes): these are the
# spill-free ones. At a padded head dim of 256 no fp32 dk/dv tile tried is spill-free
# (16×16 on 2, 4 or 8 warps, 1 or 2 stages: 44-5420 bytes), so fp32 stops at 128
# (FP32_MAX_HEAD_DIM); bf16/fp16 go to 256.
_TILES_FP32: dict[int, FlashTiles] = {
    16: FlashTiles(64, 64, 4, 32, 32, 4, 32, 32, 4),
    32: FlashTiles(64, 32, 8, 64, 32, 8, 16, 32, 4),
    64: FlashTiles(16, 16, 4, 64, 32, 8, 16, 16, 4),
    128: FlashTiles(16, 16, 4, 32, 16, 8, 16, 16, 8, dkdv_stages=1),
}
FP32_MAX_HEAD_DIM = 128


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def even_d(head_dim: int, dtype: torch.dtype) -> bool:
    """The ``EVEN_D`` constexpr: 16-bit inputs whose head dim fills its tile, so no
    load or store tests the head dim (fp32 launches always mask it: fewer variants
    to compile for the path that is not the fast one)."""
    return dtype != torch.float32 and head_dim == block_d(head_dim)


def s_bucket(length: int) -> int:
    """The autotune key of a sequence length: the power of two at or above it,
    clamped to [64, 65536], so the tuner re-times at most 11 lengths per config."""
    return min(max(triton.next_power_of_2(length), 64), 65536)


# The window mask costs registers; fp32 at BLOCK_D = 256 has no spill-free dk/dv tile
# with it, so a window supports head_dim ≤ 128.
WINDOW_MAX_HEAD_DIM = 128


def window_tiles(t: FlashTiles, bd: int, fp32: bool) -> FlashTiles:
    """The tiles of a windowed launch (``t``: the plain tiles at padded head dim ``bd``):
    16-bit 128-key dk/dv tiles at 128 halve to 64 keys, and 4-warp forward/dq tiles
    at 64 take 8 warps (half the accumulator per thread), to stay spill-free."""
    if fp32:
        return t
    if bd == 128 and t.dkdv_n == 128:
        t = dataclasses.replace(t, dkdv_n=64)
    if bd == 64 and t.fwd_warps == 4:
        t = dataclasses.replace(t, fwd_warps=8, dq_warps=8)
    return t


def _vector_table(bd: int, fp32: bool, even: bool) -> bool:
    """Whether launches at ``bd`` use the tiles sized for 16-byte vector loads (16-bit
    inputs, a head dim that is a multiple of 16, a table with odd-head-dim tiles)."""
    return not fp32 and (even or bd not in _TILES_16BIT_ODD)


def _table(bd: int, fp32: bool, even: bool) -> FlashTiles:
    if fp32:
        return _TILES_FP32[bd]
    return _TILES_16BIT[bd] if _vector_table(bd, fp32, even) else _TILES_16BIT_ODD[bd]


def tiles(head_dim: int, dtype: torch.dtype) -> FlashTiles:
    """Launch tiles for ``head_dim`` and the input dtype (tests may monkeypatch this
    to force small tiles, so short sequences still span several blocks)."""
    return _table(block_d(head_dim), dtype == torch.float32, head_dim % 16 == 0)


_TABLE_TILES = tiles


def candidates(bd: int, fp32: bool, window: bool, even: bool = True, masked: bool = True) -> tuple[FlashTiles, ...]:
    """Every tile set a launch at padded head dim ``bd`` may use (``even``: the head
    dim is a multiple of 16; ``masked``: a keep mask is given): the table's first,
    then the autotuner's others."""
    first = _table(bd, fp32, even)
    more = _TUNE_16BIT.get(bd, ()) if not fp32 and even else ()
    if not masked and not fp32 and even:
        more = more + _TUNE_16BIT_UNMASKED.get(bd, ())
    return tuple(dict.fromkeys(window_tiles(t, bd, fp32) if window else t for t in (first, *more)))


def _prune(kind: str):
    """An autotune pruner keeping the configs of ``candidates`` for this launch."""

    def prune(configs, named_args, **kwargs):
        fp32 = named_args["q_ptr"].dtype == torch.float32
        even = named_args["D"] % 16 == 0
        want = {t.of(kind) for t in candidates(kwargs["BLOCK_D"], fp32, kwargs["HAS_WINDOW"], even, kwargs["HAS_MASK"])}
        return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in want]

    return prune


def _autotuned(kernel, kind: str):
    """``kernel`` autotuned on CUDA over every candidate of its kind, pruned per launch
    to the candidates of its head dim, dtype and window (keyed on those and on the
    bucketed sequence length ``S_BUCKET``)."""
    every = dict.fromkeys(t.of(kind) for bd in _TILES_16BIT for fp32 in (False, True) if not fp32 or bd in _TILES_FP32
                          for even in (False, True)
                          for window in (False, True) for masked in (False, True)
                          for t in candidates(bd, fp32, window, even, masked))
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in every]
    return triton.autotune(configs, key=["D", "S_BUCKET", "BLOCK_D", "EVEN_D", "HAS_MASK", "HAS_WINDOW"],
                           prune_configs_by={"early_config_prune": _prune(kind)})(kernel)


_TUNED = {kind: _autotuned(k, kind) for kind, k in (("fwd", _flash_fwd_kernel), ("dq", _flash_bwd_dq_kernel),
                                                    ("dkdv", _flash_bwd_dkdv_kernel))}
_PLAIN = {"fwd": _flash_fwd_kernel, "dq": _flash_bwd_dq_kernel, "dkdv": _flash_bwd_dkdv_kernel}


def _launch(kind: str, device: torch.device, head_dim: int, dtype: torch.dtype, window: bool, grid, *args, **consts):
    """Launch kernel ``kind`` on ``grid(BLOCK_M, BLOCK_N)``: autotuned on CUDA where the
    head dim and dtype have several candidates; one fixed config under the
    interpreter or when :func:`tiles` is replaced (tests forcing small tiles)."""
    bd, fp32 = block_d(head_dim), dtype == torch.float32
    if device.type == "cuda" and not INTERPRET_AT_IMPORT and tiles is _TABLE_TILES \
            and len(candidates(bd, fp32, window, head_dim % 16 == 0, consts["HAS_MASK"])) > 1:
        wrap_triton(_TUNED[kind])[lambda meta: grid(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **consts)
        return
    t = tiles(head_dim, dtype)
    m, n, warps, stages = (window_tiles(t, bd, fp32) if window else t).of(kind)
    wrap_triton(_PLAIN[kind])[grid(m, n)](*args, BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages, **consts)


# ----------------------------------------------------------------------------
# Launchers (usable inside another op's body)
# ----------------------------------------------------------------------------


def _check_dims(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"Triton flash attention supports fp32/bf16/fp16 inputs, got {q.dtype}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ShapeError(f"Triton flash attention supports head_dim <= {MAX_HEAD_DIM}, got {q.shape[-1]}")
    if q.dtype == torch.float32 and q.shape[-1] > FP32_MAX_HEAD_DIM:
        raise ShapeError(f"Triton flash attention in fp32 supports head_dim <= {FP32_MAX_HEAD_DIM} "
                         f"(bf16/fp16 up to {MAX_HEAD_DIM}), got {q.shape[-1]}; use backend='reference'")
    if k.shape[1] < q.shape[1]:
        raise ShapeError(f"keys must cover the query positions (N >= S), got S={q.shape[1]}, N={k.shape[1]}")
    if q.shape[2] % k.shape[2]:
        raise ShapeError(f"kv heads ({k.shape[2]}) must divide query heads ({q.shape[2]})")


def mask_arg(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A (B, N) keep mask as contiguous int8 for the kernels (None stays None)."""
    return None if key_mask is None else key_mask.to(torch.int8).contiguous()


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it when its data does not start on 16 bytes (a view into a
    larger buffer): Triton then specializes the loads into the vectors the static
    sm_90 check compiled (``divisible``)."""
    return t if t.storage_offset() * t.element_size() % 16 == 0 else t.clone()


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                  out_dtype: torch.dtype | None = None, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(O, lse)``: ``O = softmax(q·kᵀ/√D + mask)·v`` ``[B, S, H, D]`` in ``out_dtype``
    (default: the dtype of ``q``) and the natural log-sum-exp ``[B, H, S]`` fp32.

    ``q``, ``k``, ``v`` must be contiguous; ``key_mask`` is None or contiguous int8
    (see :func:`mask_arg`)."""
    B, S, H, D = q.shape
    N, HKV = k.shape[1], k.shape[2]
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    o = empty((B, S, H, D), dtype=out_dtype or q.dtype, device=q.device)
    lse = empty((B, H, S), dtype=torch.float32, device=q.device)
    _launch("fwd", q.device, D, q.dtype, window > 0, lambda m, n: (B * H, triton.cdiv(S, m)),
            q, k, v, key_mask, o, lse, S, N, H, HKV, D, LOG2E / math.sqrt(D), window, s_bucket(S),
            HAS_MASK=key_mask is not None, HAS_WINDOW=window > 0, BLOCK_D=block_d(D), EVEN_D=even_d(D, q.dtype),
            PRECISION=dot_precision(q.dtype))
    return o, lse


# Decoding: at most DECODE_MAX_QUERIES new queries per (b, h), in one 16-row tile (the
# step is bound by reading K and V, so mma.sync-sized tiles suffice); keys split in
# chunks of whole key blocks over up to DECODE_MAX_SPLITS programs per (b, h),
# aiming at DECODE_PROGRAMS programs in all (about two waves of the 132 SMs).
DECODE_MAX_QUERIES = 16
DECODE_MAX_SPLITS = 32
DECODE_PROGRAMS = 264


def decode_block_n(bd: int, fp32: bool) -> int:
    """Keys per step of the decoding kernel: 64, fewer at wide head dims (fp32 K/V
    tiles are registers; at 4 warps a 64 × 128 16-bit step spills)."""
    if fp32:
        return min(64, 4096 // bd) if bd <= 64 else 16
    return min(64, 8192 // bd)


def decode_split(bd: int, fp32: bool) -> bool:
    """Whether a decoding step at padded head dim ``bd`` runs split-K; fp32 at 256
    (no spill-free decoding tile) takes the flash forward."""
    return not (fp32 and bd > 128)


def decode_warps(bd: int) -> int:
    """Warps of the decoding kernels: 8 from head dim 128 on (spill-free there)."""
    return 4 if bd <= 64 else 8


def decode_splits(batch_heads: int, n: int, block_n: int) -> tuple[int, int]:
    """``(splits, keys per split)`` of a decoding step over ``n`` keys: enough splits
    to give every SM work, none shorter than one key block."""
    blocks = triton.cdiv(n, block_n)
    splits = max(1, min(DECODE_MAX_SPLITS, blocks, triton.cdiv(DECODE_PROGRAMS, batch_heads)))
    per = triton.cdiv(blocks, splits) * block_n
    return triton.cdiv(n, per), per


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """``t [B, N, HKV, D]`` as it is when every row's ``[HKV, D]`` block is dense (any
    batch and row strides: a view of a cache's storage), else a contiguous copy."""
    _, _, hkv, d = t.shape
    dense = (d == 1 or t.stride(3) == 1) and (hkv == 1 or t.stride(2) == d)
    return t if dense else t.contiguous()


def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """The forward of :func:`flash_forward` for a decoding step (``S ≤ 16`` newest
    queries over ``N`` cached keys), split over the keys (flash-decoding): each
    program reduces one chunk of keys for one (b, h) to an fp32 partial, a second
    kernel merges the partials. Not differentiable (decoding is inference).

    ``k`` and ``v`` may be views into larger storage (the first ``N`` rows of a
    cache's buffer): they are read in place through their batch and row strides,
    without a copy, when each row's ``[HKV, D]`` is dense and both share one row
    stride; ``q`` is made contiguous, ``key_mask`` is contiguous int8 (:func:`mask_arg`)."""
    B, S, H, D = q.shape
    N, HKV = k.shape[1], k.shape[2]
    if S > DECODE_MAX_QUERIES:
        raise ShapeError(f"flash_decode takes at most {DECODE_MAX_QUERIES} queries, got S={S}")
    bd = block_d(D)
    if not decode_split(bd, q.dtype == torch.float32):
        return flash_forward(q.contiguous(), k.contiguous(), v.contiguous(), key_mask)[0]
    q, k, v = _aligned(q.contiguous()), _aligned(_dense_rows(k)), _aligned(_dense_rows(v))
    if N > 1 and k.stride(1) != v.stride(1):
        k, v = k.contiguous(), v.contiguous()
    block_n = decode_block_n(bd, q.dtype == torch.float32)
    splits, per = decode_splits(B * H, N, block_n)
    part = empty((B * H * splits * DECODE_MAX_QUERIES, bd), dtype=torch.float32, device=q.device)
    ml = empty((B * H * splits * DECODE_MAX_QUERIES, 2), dtype=torch.float32, device=q.device)
    wrap_triton(_flash_decode_kernel)[(B * H, splits)](
        q, k, v, key_mask, part, ml, S, N, H, HKV, D, LOG2E / math.sqrt(D), 0, per, splits,
        k.stride(0), v.stride(0), k.stride(1),
        HAS_MASK=key_mask is not None, HAS_WINDOW=False, BLOCK_M=DECODE_MAX_QUERIES, BLOCK_N=block_n,
        BLOCK_D=bd, EVEN_D=even_d(D, q.dtype), PRECISION=dot_precision(q.dtype), num_warps=decode_warps(bd),
        num_stages=2)
    o = empty((B, S, H, D), dtype=q.dtype, device=q.device)
    wrap_triton(_flash_decode_combine)[(B * H, S)](
        part, ml, o, S, H, D, splits, BLOCK_M=DECODE_MAX_QUERIES, BLOCK_SPLIT=DECODE_MAX_SPLITS,
        BLOCK_D=bd, num_warps=decode_warps(bd))
    return o


# rows of the delta kernel's tile: 4096 elements of each operand per program
DELTA_TILE = 4096
DELTA_WARPS = 4


def flash_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dO·O)`` ``[B, H, S]`` fp32 for contiguous ``o``, ``do``
    ``[B, S, H, D]`` (any float dtypes; products summed in fp32), in one pass."""
    B, S, H, D = o.shape
    delta = empty((B, H, S), dtype=torch.float32, device=o.device)
    bd = block_d(D)
    rows = max(1, DELTA_TILE // bd)
    wrap_triton(_flash_delta_kernel)[(triton.cdiv(B * S * H, rows),)](
        o, do, delta, B * S * H, S, H, D, BLOCK_R=rows, BLOCK_D=bd, num_warps=DELTA_WARPS)
    return delta


def flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                   do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor | None, window: int = 0, *,
                   o: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` for upstream ``do`` ``[B, S, H, D]`` (the dtype of ``q``), given
    the forward's ``lse`` and ``delta = rowsum(do·O)`` ``[B, H, S]`` fp32 (or
    ``delta=None`` and the forward's output ``o``: :func:`flash_delta` computes it).
    All contiguous; gradients in the dtypes of q, k, v, summed over each GQA group."""
    if delta is None:
        if o is None:
            raise ConfigError("flash_backward needs `delta` or the forward's output `o`, got neither")
        delta = flash_delta(o, do)
    q, k, v, do = _aligned(q), _aligned(k), _aligned(v), _aligned(do)
    B, S, H, D = q.shape
    N, HKV = k.shape[1], k.shape[2]
    dq = empty(q.shape, dtype=q.dtype, device=q.device)
    dk = empty(k.shape, dtype=k.dtype, device=k.device)
    dv = empty(v.shape, dtype=v.dtype, device=v.device)
    scale = 1.0 / math.sqrt(D)
    consts = dict(HAS_MASK=key_mask is not None, HAS_WINDOW=window > 0, BLOCK_D=block_d(D),
                  EVEN_D=even_d(D, q.dtype), PRECISION=dot_precision(q.dtype))
    _launch("dq", q.device, D, q.dtype, window > 0, lambda m, n: (B * H, triton.cdiv(S, m)),
            q, k, v, key_mask, do, lse, delta, dq, S, N, H, HKV, D, scale * LOG2E, scale, window, s_bucket(S),
            **consts)
    _launch("dkdv", q.device, D, q.dtype, window > 0, lambda m, n: (B * HKV, triton.cdiv(N, n)),
            q, k, v, key_mask, do, lse, delta, dk, dv, S, N, H, HKV, D, scale * LOG2E, scale, window, s_bucket(S),
            **consts)
    return dq, dk, dv


# ----------------------------------------------------------------------------
# The differentiable op
# ----------------------------------------------------------------------------


@triton_op("laminae::flash_attention_fwd", mutates_args=())
def _flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_mask: torch.Tensor | None, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_forward(q, k, v, key_mask, window=window)


@triton_op("laminae::flash_attention_bwd", mutates_args=())
def _flash_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                         do: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, window: int = 0,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_backward(q, k, v, key_mask, do, lse, None, window, o=o)


def _setup_context(ctx, inputs, output):
    q, k, v, key_mask = inputs[:4]
    o, lse = output
    ctx.save_for_backward(q, k, v, key_mask, o, lse)
    ctx.window = inputs[4] if len(inputs) > 4 else 0


def _backward(ctx, do, _dlse):
    q, k, v, key_mask, o, lse = ctx.saved_tensors
    dq, dk, dv = _flash_attention_bwd(q, k, v, key_mask, do.contiguous(), lse, o, ctx.window)
    return dq, dk, dv, None, None


_flash_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal softmax attention ``[B, S, H, D]`` (differentiable in q, k, v); the
    signature of :func:`flash_attention_reference`. ``window`` W: each query sees
    itself and the W − 1 positions before it (sliding-window attention)."""
    _check_dims(q, k)
    window = _check_window(window)
    if window and q.shape[-1] > WINDOW_MAX_HEAD_DIM:
        raise ShapeError(f"windowed flash attention supports head_dim <= {WINDOW_MAX_HEAD_DIM}, got {q.shape[-1]}")
    o, _ = _flash_attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), mask_arg(attention_mask), window)
    return o


def _check_window(window: int | None) -> int:
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"`window` must be None or a positive int, got {window!r}")
    return window


def flash_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              attention_mask: torch.Tensor | None = None, window: int | None = None, *,
                              upcast: bool = True) -> torch.Tensor:
    """Plain causal softmax attention with the same conventions (materialises P)."""
    dtype = q.dtype
    compute = torch.promote_types(dtype, torch.float32) if upcast else dtype
    B, S, H, D = q.shape
    N, group = k.shape[1], H // k.shape[2]
    qc = q.to(compute)
    kc = k.to(compute).repeat_interleave(group, dim=2)
    vc = v.to(compute).repeat_interleave(group, dim=2)
    scores = torch.einsum("bshd,bnhd->bhsn", qc, kc) / math.sqrt(D)
    distance = torch.arange(S, device=q.device)[:, None] + (N - S) - torch.arange(N, device=q.device)[None, :]
    visible = (distance >= 0) & (distance < (_check_window(window) or N + 1))
    visible = visible[None, None]
    if attention_mask is not None:
        visible = visible & attention_mask.to(q.device).bool()[:, None, None, :]
    any_visible = visible.any(-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~any_visible, 0.0)
    p = torch.softmax(scores, dim=-1).masked_fill(~visible, 0.0)
    return torch.einsum("bhsn,bnhd->bshd", p, vc).to(dtype)


# ----------------------------------------------------------------------------
# Static configurations
# ----------------------------------------------------------------------------


def static_cases(out_dtypes: tuple[str, ...] | None = None,
                 windows: tuple[bool, ...] = (False,)) -> Iterator[StaticCase]:
    """Every (dtype, head-dim tile, mask, autotune candidate) configuration the
    kernels launch with.

    ``out_dtypes`` lists extra forward output dtypes (an epilogue caller stores O in
    fp32 for bf16/fp16 inputs); ``windows`` which HAS_WINDOW variants the caller uses.
    Every pointer compiles 16-byte aligned (``divisible``), as the launchers pass it
    (contiguous inputs through :func:`_aligned`, fresh outputs, :func:`mask_arg`), and
    so do the integers that always are (``S_BUCKET``; ``WINDOW`` is 0 without a window).
    bf16/fp16 at head dims 64 and 128 also compile ``D`` divisible by 16, the launch of
    a head dim that is a multiple of 16, and must build on Hopper's wgmma (``expect``);
    other head dims padded to them have their own tiles."""
    scalars = dict(S="i32", N="i32", H="i32", HKV="i32", D="i32", qk_scale="fp32")
    tail = dict(WINDOW="i32", S_BUCKET="i32")
    for dt in ("fp32", "bf16", "fp16"):
        p, fp32 = f"*{dt}", dt == "fp32"
        precision = dot_precision(torch.float32 if fp32 else torch.bfloat16)
        bwd_sig = dict(q_ptr=p, k_ptr=p, v_ptr=p, mask_ptr="*i8", do_ptr=p, lse_ptr="*fp32", delta_ptr="*fp32")
        bwd_scalars = scalars | dict(sm_scale="fp32") | tail
        # What Triton's launcher specialises as 16-divisible at every launch: each pointer
        # (q, k, v and dO pass through _aligned, the int8 key mask is built per call by
        # mask_arg, O, lse, delta and the gradients are fresh), S_BUCKET (a power of two
        # >= 64) and WINDOW (0 without a window); D too where it fills the tile (`even`).
        kernels = {
            "fwd": ("flash_fwd", _flash_fwd_kernel, ("q_ptr", "k_ptr", "v_ptr", "mask_ptr", "o_ptr", "lse_ptr")),
            "dq": ("flash_bwd_dq", _flash_bwd_dq_kernel,
                   ("q_ptr", "k_ptr", "v_ptr", "mask_ptr", "do_ptr", "lse_ptr", "delta_ptr", "dq_ptr")),
            "dkdv": ("flash_bwd_dkdv", _flash_bwd_dkdv_kernel,
                     ("q_ptr", "k_ptr", "v_ptr", "mask_ptr", "do_ptr", "lse_ptr", "delta_ptr", "dk_ptr", "dv_ptr")),
        }
        for bd in (_TILES_FP32 if fp32 else _TILES_16BIT):
            vector = not fp32 and bd in _TILES_16BIT_ODD
            # EVEN_D (D == BLOCK_D) only for 16-bit inputs whose head dim can fill the tile
            for even, ev_d, has_mask, has_window in (
                    (e, ed, m, w) for e in ((True, False) if vector else (False,))
                    for ed in ((True, False) if not fp32 and (e or not vector) else (False,))
                    for m in (True, False) for w in windows):
                if has_window and bd > WINDOW_MAX_HEAD_DIM:
                    continue
                tags = {"dtype": dt} | ({"window": True} if has_window else {}) | ({"div16": True} if even else {})
                base = dict(HAS_MASK=has_mask, HAS_WINDOW=has_window, BLOCK_D=bd, EVEN_D=ev_d, PRECISION=precision)
                options = candidates(bd, fp32, has_window, even, has_mask)
                for kind, (name, kernel, divisible) in kernels.items():
                    ints = ("S_BUCKET",) + (() if has_window else ("WINDOW",)) + (("D",) if even else ())
                    extra = dict(divisible=divisible + ints) | (dict(expect="HGMMA") if even else {})
                    for m, n, warps, stages in dict.fromkeys(t.of(kind) for t in options):
                        for o_dt in dict.fromkeys((dt, *(out_dtypes or ()))) if kind == "fwd" else (dt,):
                            signature = (dict(q_ptr=p, k_ptr=p, v_ptr=p, mask_ptr="*i8", o_ptr=f"*{o_dt}",
                                              lse_ptr="*fp32") | scalars | tail if kind == "fwd" else
                                         bwd_sig | (dict(dq_ptr=p) if kind == "dq" else dict(dk_ptr=p, dv_ptr=p))
                                         | bwd_scalars)
                            yield StaticCase(name, kernel, signature, dict(base, BLOCK_M=m, BLOCK_N=n), warps, stages,
                                             tags=tags | ({"out": o_dt} if o_dt != dt else {}), **extra)
            for ev_d, has_mask in ((ed, m) for ed in ((True, False) if not fp32 else (False,)) for m in (True, False)
                                   if decode_split(bd, fp32)):
                yield StaticCase("flash_decode", _flash_decode_kernel,
                                 dict(q_ptr=p, k_ptr=p, v_ptr=p, mask_ptr="*i8", part_ptr="*fp32", ml_ptr="*fp32")
                                 | scalars | dict(WINDOW="i32", SPLIT_N="i32", SPLITS="i32", STRIDE_KB="i32",
                                                  STRIDE_VB="i32", STRIDE_N="i32"),
                                 dict(HAS_MASK=has_mask, HAS_WINDOW=False, BLOCK_M=DECODE_MAX_QUERIES,
                                      BLOCK_N=decode_block_n(bd, fp32), BLOCK_D=bd, EVEN_D=ev_d, PRECISION=precision),
                                 decode_warps(bd), 2, tags={"dtype": dt},
                                 # q and the partials are fresh or `_aligned`, k and v `_aligned` views
                                 # whose strides vary with the cache (not declared); WINDOW is 0 and
                                 # SPLIT_N whole key blocks
                                 divisible=("q_ptr", "k_ptr", "v_ptr", "mask_ptr", "part_ptr", "ml_ptr", "WINDOW",
                                            "SPLIT_N"))
            if decode_split(bd, fp32):
                yield StaticCase("flash_decode_combine", _flash_decode_combine,
                                 dict(part_ptr="*fp32", ml_ptr="*fp32", o_ptr=p, S="i32", H="i32", D="i32",
                                      SPLITS="i32"),
                                 dict(BLOCK_M=DECODE_MAX_QUERIES, BLOCK_SPLIT=DECODE_MAX_SPLITS, BLOCK_D=bd),
                                 decode_warps(bd), tags={"dtype": dt}, divisible=("part_ptr", "ml_ptr", "o_ptr"))
            yield StaticCase("flash_delta", _flash_delta_kernel,
                             dict(o_ptr=p, do_ptr=p, delta_ptr="*fp32", R="i32", S="i32", H="i32", D="i32"),
                             dict(BLOCK_R=max(1, DELTA_TILE // bd), BLOCK_D=bd), DELTA_WARPS, tags={"dtype": dt},
                             divisible=("o_ptr", "do_ptr", "delta_ptr"))
