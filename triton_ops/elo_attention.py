"""Elo tournament attention kernels: O(S·N) time, no [S, N] matrix in memory.

Notation per (batch, query head), rows i = queries, columns j = keys, visibility V
(causal at absolute position N − S + i, key keep mask):

    p_ij = softmax_j(s_ij)            s = q·kᵀ/√D              (the rating-free match)
    dR_ij = K·(p_ij − 1/n_i)·V_ij     intra_ij = Σ_{t<i} dR_tj
    z_ij = s_ij + g·(prior_j + intra_ij)        a_ij = softmax_j(z_ij)
    out_i = Σ_j a_ij·v_j              rating_j = prior_j + Σ_i dR_ij

intra is a column prefix sum over queries while the second softmax is a row
normalisation over keys. The kernels reconcile the two with *column checkpoints*:
``C[qb, j] = Σ_{t < qb·BLOCK_M} dR_tj``, the prefix sum at the start of every query
block. Inside a (query block, key block) tile the rest of the prefix is an in-tile
``cumsum`` over the rows of the recomputed dR, so any kernel can rebuild intra for
any tile from one checkpoint row.

Forward (three launches)
  1. stats    grid (query blocks, B·H): online log-sum-exp of s and the visible
              count n_i per row → lse1 [B·H, S], 1/n [B·H, S].
  2. rating   grid (key blocks, B·H): walks the query blocks in order carrying the
              column sum of dR (recomputed from s and lse1); stores the running sum
              as checkpoint C[qb] before each block and rating = prior + total.
  3. output   grid (query blocks, B·H): flash attention over key blocks with the
              extra logit g·(prior_j + C[qb, j] + in-tile exclusive cumsum of dR);
              writes out and lse2.

Backward (three launches), with upstream dO, dρ (rating) and δ_i = dO_i·out_i:
    dz_ij  = a_ij·(dO_i·v_j − δ_i)                           (second softmax)
    G_ij   = dρ_j + g·Σ_{i'>i} dz_i'j                          (∂L/∂dR_ij)
    γ_i    = Σ_j p_ij·G_ij
    ds_ij  = dz_ij + K·p_ij·(G_ij − γ_i)                      (both softmaxes)
    dq = Σ_j ds·k/√D, dk = Σ_i ds·q/√D, dv = Σ_i a·dO, dprior_j = dρ_j + g·Σ_i dz_ij,
    dg = Σ dz·(prior + intra), dK = Σ_V G·(p − 1/n)
  1. suffix   grid (key blocks, B·H): walks the query blocks in *reverse* carrying
              the column sum of dz; stores suffix checkpoints E[qb, j] = Σ_{i ≥ end of
              qb} dz_ij. The in-tile part of G is colsum − inclusive cumsum.
  2. dq       grid (query blocks, B·H): one sweep over key blocks for γ_i (and the
              per-row terms of dg, dK), a second for ds and dq.
  3. dk/dv    grid (key blocks, B·H_kv), looping over the query heads of the kv
              group: dk, dv (GQA sums on chip) and dprior.
The chain through K = softplus(elo_log_k), g = tanh(elo_gain) and the zero-padded
prior is plain torch autograd outside the op.

Memory beyond the inputs and outputs: the checkpoints C (saved for backward) and,
during backward only, E: each ``4·B·H·⌈S/BLOCK_M⌉·N`` bytes (1/BLOCK_M of an fp32
[S, N] matrix per head), plus five fp32 row vectors [B·H, S] (lse1, 1/n, lse2, δ, γ)
and the per-row partials of dg and dK.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import DTypeError, ShapeError
from laminae.primitives.elo_attention import check_elo_attention_inputs, full_prior

from ._common import StaticCase, dot_precision, empty

__all__ = ["elo_attention", "elo_attention_op", "launch_elo_attention", "static_cases", "tour_case"]

MAX_HEAD_DIM = 128
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------
# Tile helpers
# ----------------------------------------------------------------------------


@triton.jit
def _visible(rows, cols, S, N, mask_ptr, b):
    """[BLOCK_M, BLOCK_N] bool: query row i sees key col j (causal, in range, kept).
    The keep mask is always present (all ones without padding): one launch
    configuration per tile instead of two, for a B·N-byte load per tile."""
    keep = tl.load(mask_ptr + b * N + cols, mask=cols < N, other=0)
    return (cols[None, :] <= (N - S + rows)[:, None]) & (rows < S)[:, None] & (keep != 0)[None, :]


@triton.jit
def _match_and_intra(s, vis, lse1, rinv_n, ck, k_factor):
    """The rating-free match p, its rating update dR and intra = ck + Σ_{t<i in tile} dR."""
    p = tl.where(vis, tl.exp(s - lse1[:, None]), 0.0)
    d_rating = tl.where(vis, k_factor * (p - rinv_n[:, None]), 0.0)
    intra = ck[None, :] + (tl.cumsum(d_rating, axis=0) - d_rating)
    return p, d_rating, intra


# ----------------------------------------------------------------------------
# Forward kernels
# ----------------------------------------------------------------------------


@triton.jit
def _elo_fwd_stats_kernel(q_ptr, k_ptr, mask_ptr, lse1_ptr, rinv_ptr,
                          S, N, H, HKV, D, scale,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kvh = h // (H // HKV)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row_ok = rows < S
    q = tl.load(q_ptr + (b * S * H + h) * D + rows[:, None] * (H * D) + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + (b * N * HKV + kvh) * D
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    count = tl.zeros((BLOCK_M,), dtype=tl.float32)
    hi = tl.minimum(N, N - S + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(k_base + cols[:, None] * (HKV * D) + offs_d[None, :],
                    mask=(cols < N)[:, None] & d_ok[None, :], other=0.0)
        vis = _visible(rows, cols, S, N, mask_ptr, b)
        s = tl.where(vis, tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_shift) + tl.sum(tl.exp(s - m_shift[:, None]), 1)
        m_i = m_new
        count += tl.sum(vis.to(tl.float32), 1)
    empty_row = l_i == 0.0
    # rows with no visible key store lse 0 and 1/n 0: every tile masks them out
    lse1 = tl.where(empty_row, 0.0, m_i + tl.log(tl.where(empty_row, 1.0, l_i)))
    rinv = tl.where(count > 0.0, 1.0 / tl.maximum(count, 1.0), 0.0)
    tl.store(lse1_ptr + pid_bh.to(tl.int64) * S + rows, lse1, mask=row_ok)
    tl.store(rinv_ptr + pid_bh.to(tl.int64) * S + rows, rinv, mask=row_ok)


@triton.jit
def _elo_fwd_rating_kernel(q_ptr, k_ptr, mask_ptr, lse1_ptr, rinv_ptr, kf_ptr, prior_ptr, ck_ptr, rating_ptr,
                           S, N, H, HKV, D, NQB, scale,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kvh = h // (H // HKV)
    bh = pid_bh.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    k = tl.load(k_ptr + (b * N * HKV + kvh) * D + cols[:, None] * (HKV * D) + offs_d[None, :],
                mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    k_factor = tl.load(kf_ptr + h)
    q_base = q_ptr + (b * S * H + h) * D
    ck_base = ck_ptr + bh * NQB * N + cols
    running = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # the first query block that can see this key block; earlier checkpoints are 0
    lo = tl.maximum(pid_n * BLOCK_N - (N - S), 0) // BLOCK_M
    for qb in range(0, lo):
        tl.store(ck_base + qb * N, running, mask=col_ok)
    for qb in range(lo, NQB):
        tl.store(ck_base + qb * N, running, mask=col_ok)
        rows = qb * BLOCK_M + offs_m
        row_ok = rows < S
        q = tl.load(q_base + rows[:, None] * (H * D) + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lse1 = tl.load(lse1_ptr + bh * S + rows, mask=row_ok, other=0.0)
        rinv = tl.load(rinv_ptr + bh * S + rows, mask=row_ok, other=0.0)
        vis = _visible(rows, cols, S, N, mask_ptr, b)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        p = tl.where(vis, tl.exp(s - lse1[:, None]), 0.0)
        running += tl.sum(tl.where(vis, k_factor * (p - rinv[:, None]), 0.0), 0)
    prior = tl.load(prior_ptr + bh * N + cols, mask=col_ok, other=0.0)
    tl.store(rating_ptr + bh * N + cols, prior + running, mask=col_ok)


@triton.jit
def _elo_fwd_out_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, lse1_ptr, rinv_ptr, kf_ptr, gain_ptr, prior_ptr, ck_ptr,
                        o_ptr, lse2_ptr,
                        S, N, H, HKV, D, NQB, scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kvh = h // (H // HKV)
    bh = pid_bh.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row_ok = rows < S
    q_off = (b * S * H + h) * D + rows[:, None] * (H * D) + offs_d[None, :]
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    lse1 = tl.load(lse1_ptr + bh * S + rows, mask=row_ok, other=0.0)
    rinv = tl.load(rinv_ptr + bh * S + rows, mask=row_ok, other=0.0)
    k_factor = tl.load(kf_ptr + h)
    gain = tl.load(gain_ptr + h)
    k_base = k_ptr + (b * N * HKV + kvh) * D
    v_base = v_ptr + (b * N * HKV + kvh) * D
    ck_row = ck_ptr + (bh * NQB + pid_m) * N
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    hi = tl.minimum(N, N - S + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < N
        kv_off = cols[:, None] * (HKV * D) + offs_d[None, :]
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
        vis = _visible(rows, cols, S, N, mask_ptr, b)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        ck = tl.load(ck_row + cols, mask=col_ok, other=0.0)
        prior = tl.load(prior_ptr + bh * N + cols, mask=col_ok, other=0.0)
        p, d_rating, intra = _match_and_intra(s, vis, lse1, rinv, ck, k_factor)
        z = tl.where(vis, s + gain * (prior[None, :] + intra), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        pz = tl.exp(z - m_shift[:, None])
        corr = tl.exp(m_i - m_shift)
        l_i = l_i * corr + tl.sum(pz, 1)
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
        acc = acc * corr[:, None] + tl.dot(pz.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    empty_row = l_i == 0.0
    l_safe = tl.where(empty_row, 1.0, l_i)
    tl.store(o_ptr + q_off, (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse2_ptr + bh * S + rows, tl.where(empty_row, 0.0, m_i + tl.log(l_safe)), mask=row_ok)


# ----------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------


@triton.jit
def _second_softmax_grad(s, vis, intra, prior, gain, lse2, do, v, delta, PRECISION: tl.constexpr):
    """a = softmax(z) recomputed from lse2, and dz = a·(dO·vᵀ − δ)."""
    z = s + gain * (prior[None, :] + intra)
    a = tl.where(vis, tl.exp(z - lse2[:, None]), 0.0)
    da = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    return a, a * (da - delta[:, None])


@triton.jit
def _elo_bwd_suffix_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, lse1_ptr, rinv_ptr, lse2_ptr, delta_ptr,
                           kf_ptr, gain_ptr, prior_ptr, ck_ptr, cs_ptr,
                           S, N, H, HKV, D, NQB, scale,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kvh = h // (H // HKV)
    bh = pid_bh.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_off = (b * N * HKV + kvh) * D + cols[:, None] * (HKV * D) + offs_d[None, :]
    kv_mask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    k_factor = tl.load(kf_ptr + h)
    gain = tl.load(gain_ptr + h)
    prior = tl.load(prior_ptr + bh * N + cols, mask=col_ok, other=0.0)
    q_base = (b * S * H + h) * D
    ck_base = ck_ptr + bh * NQB * N + cols
    cs_base = cs_ptr + bh * NQB * N + cols
    suffix = tl.zeros((BLOCK_N,), dtype=tl.float32)
    lo = tl.maximum(pid_n * BLOCK_N - (N - S), 0) // BLOCK_M
    for step in range(0, NQB - lo):
        qb = NQB - 1 - step
        tl.store(cs_base + qb * N, suffix, mask=col_ok)
        rows = qb * BLOCK_M + offs_m
        row_ok = rows < S
        q_off = q_base + rows[:, None] * (H * D) + offs_d[None, :]
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
        do = tl.load(do_ptr + q_off, mask=q_mask, other=0.0)
        lse1 = tl.load(lse1_ptr + bh * S + rows, mask=row_ok, other=0.0)
        rinv = tl.load(rinv_ptr + bh * S + rows, mask=row_ok, other=0.0)
        lse2 = tl.load(lse2_ptr + bh * S + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + bh * S + rows, mask=row_ok, other=0.0)
        ck = tl.load(ck_base + qb * N, mask=col_ok, other=0.0)
        vis = _visible(rows, cols, S, N, mask_ptr, b)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        p, d_rating, intra = _match_and_intra(s, vis, lse1, rinv, ck, k_factor)
        a, dz = _second_softmax_grad(s, vis, intra, prior, gain, lse2, do, v, delta, PRECISION)
        suffix += tl.sum(dz, 0)
    for qb in range(0, lo):  # never read (no query there sees this key block); keep defined
        tl.store(cs_base + qb * N, suffix, mask=col_ok)


@triton.jit
def _elo_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, lse1_ptr, rinv_ptr, lse2_ptr, delta_ptr,
                       kf_ptr, gain_ptr, prior_ptr, drating_ptr, ck_ptr, cs_ptr,
                       dq_ptr, gamma_ptr, dgain_ptr, dkf_ptr,
                       S, N, H, HKV, D, NQB, scale,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kvh = h // (H // HKV)
    bh = pid_bh.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row_ok = rows < S
    q_off = (b * S * H + h) * D + rows[:, None] * (H * D) + offs_d[None, :]
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    do = tl.load(do_ptr + q_off, mask=q_mask, other=0.0)
    lse1 = tl.load(lse1_ptr + bh * S + rows, mask=row_ok, other=0.0)
    rinv = tl.load(rinv_ptr + bh * S + rows, mask=row_ok, other=0.0)
    lse2 = tl.load(lse2_ptr + bh * S + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + bh * S + rows, mask=row_ok, other=0.0)
    k_factor = tl.load(kf_ptr + h)
    gain = tl.load(gain_ptr + h)
    k_base = k_ptr + (b * N * HKV + kvh) * D
    v_base = v_ptr + (b * N * HKV + kvh) * D
    ck_row = ck_ptr + (bh * NQB + pid_m) * N
    cs_row = cs_ptr + (bh * NQB + pid_m) * N
    hi = tl.minimum(N, N - S + (pid_m + 1) * BLOCK_M)

    # sweep 1: γ_i = Σ_j p·G and the per-row terms of dg and dK
    gamma = tl.zeros((BLOCK_M,), dtype=tl.float32)
    dgain = tl.zeros((BLOCK_M,), dtype=tl.float32)
    dkf = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < N
        kv_off = cols[:, None] * (HKV * D) + offs_d[None, :]
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
        ck = tl.load(ck_row + cols, mask=col_ok, other=0.0)
        cs = tl.load(cs_row + cols, mask=col_ok, other=0.0)
        prior = tl.load(prior_ptr + bh * N + cols, mask=col_ok, other=0.0)
        drating = tl.load(drating_ptr + bh * N + cols, mask=col_ok, other=0.0)
        vis = _visible(rows, cols, S, N, mask_ptr, b)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        p, d_rating, intra = _match_and_intra(s, vis, lse1, rinv, ck, k_factor)
        a, dz = _second_softmax_grad(s, vis, intra, prior, gain, lse2, do, v, delta, PRECISION)
        later = cs[None, :] + (tl.sum(dz, 0)[None, :] - tl.cumsum(dz, axis=0))
        g_tile = tl.where(vis, drating[None, :] + gain * later, 0.0)
        gamma += tl.sum(p * g_tile, 1)
        dgain += tl.sum(dz * (prior[None, :] + intra), 1)
        dkf += tl.sum(tl.where(vis, g_tile * (p - rinv[:, None]), 0.0), 1)

    # sweep 2: ds = dz + K·p·(G − γ) and dq
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < N
        kv_off = cols[:, None] * (HKV * D) + offs_d[None, :]
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
        ck = tl.load(ck_row + cols, mask=col_ok, other=0.0)
        cs = tl.load(cs_row + cols, mask=col_ok, other=0.0)
        prior = tl.load(prior_ptr + bh * N + cols, mask=col_ok, other=0.0)
        drating = tl.load(drating_ptr + bh * N + cols, mask=col_ok, other=0.0)
        vis = _visible(rows, cols, S, N, mask_ptr, b)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        p, d_rating, intra = _match_and_intra(s, vis, lse1, rinv, ck, k_factor)
        a, dz = _second_softmax_grad(s, vis, intra, prior, gain, lse2, do, v, delta, PRECISION)
        later = cs[None, :] + (tl.sum(dz, 0)[None, :] - tl.cumsum(dz, axis=0))
        g_tile = drating[None, :] + gain * later
        ds = dz + k_factor * p * (g_tile - gamma[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(dq_ptr + q_off, (dq * scale).to(dq_ptr.dtype.element_ty), mask=q_mask)
    tl.store(gamma_ptr + bh * S + rows, gamma, mask=row_ok)
    tl.store(dgain_ptr + bh * S + rows, dgain, mask=row_ok)
    tl.store(dkf_ptr + bh * S + rows, dkf, mask=row_ok)


@triton.jit
def _elo_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, lse1_ptr, rinv_ptr, lse2_ptr, delta_ptr,
                         gamma_ptr, kf_ptr, gain_ptr, prior_ptr, drating_ptr, ck_ptr, cs_ptr,
                         dk_ptr, dv_ptr, dprior_ptr,
                         S, N, H, HKV, D, NQB, scale,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    b = (pid_bkv // HKV).to(tl.int64)
    kvh = pid_bkv % HKV
    group = H // HKV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_off = (b * N * HKV + kvh) * D + cols[:, None] * (HKV * D) + offs_d[None, :]
    kv_mask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    lo = tl.maximum(pid_n * BLOCK_N - (N - S), 0) // BLOCK_M
    for g in range(0, group):
        h = kvh * group + g
        bh = b * H + h
        k_factor = tl.load(kf_ptr + h)
        gain = tl.load(gain_ptr + h)
        prior = tl.load(prior_ptr + bh * N + cols, mask=col_ok, other=0.0)
        drating = tl.load(drating_ptr + bh * N + cols, mask=col_ok, other=0.0)
        q_base = (b * S * H + h) * D
        dz_cols = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for qb in range(lo, NQB):
            rows = qb * BLOCK_M + offs_m
            row_ok = rows < S
            q_off = q_base + rows[:, None] * (H * D) + offs_d[None, :]
            q_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
            do = tl.load(do_ptr + q_off, mask=q_mask, other=0.0)
            lse1 = tl.load(lse1_ptr + bh * S + rows, mask=row_ok, other=0.0)
            rinv = tl.load(rinv_ptr + bh * S + rows, mask=row_ok, other=0.0)
            lse2 = tl.load(lse2_ptr + bh * S + rows, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + bh * S + rows, mask=row_ok, other=0.0)
            gamma = tl.load(gamma_ptr + bh * S + rows, mask=row_ok, other=0.0)
            ck = tl.load(ck_ptr + (bh * NQB + qb) * N + cols, mask=col_ok, other=0.0)
            cs = tl.load(cs_ptr + (bh * NQB + qb) * N + cols, mask=col_ok, other=0.0)
            vis = _visible(rows, cols, S, N, mask_ptr, b)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            p, d_rating, intra = _match_and_intra(s, vis, lse1, rinv, ck, k_factor)
            a, dz = _second_softmax_grad(s, vis, intra, prior, gain, lse2, do, v, delta, PRECISION)
            later = cs[None, :] + (tl.sum(dz, 0)[None, :] - tl.cumsum(dz, axis=0))
            g_tile = drating[None, :] + gain * later
            ds = dz + k_factor * p * (g_tile - gamma[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
            dv += tl.dot(tl.trans(a.to(do.dtype)), do, input_precision=PRECISION)
            dz_cols += tl.sum(dz, 0)
        tl.store(dprior_ptr + bh * N + cols, drating + gain * dz_cols, mask=col_ok)
    tl.store(dk_ptr + kv_off, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


# ----------------------------------------------------------------------------
# Tiles
# ----------------------------------------------------------------------------

# (input precision, BLOCK_D) -> (BLOCK_M, BLOCK_N, warps of the light kernels
# (stats, rating, output, suffix), warps of the heavy ones (dq, dk/dv), pipeline
# stages). BLOCK_M is
# also the checkpoint granularity, so one BLOCK_M serves every kernel of a call.
# fp32 dots run on FMA units with their operands in registers: smaller tiles. Every
# entry is compiled for sm_90 by the static check (no spills, shared memory <= 227 KB).
_TILES: dict[tuple[str, int], tuple[int, int, int, int, int]] = {
    ("fp32", 16): (32, 32, 4, 8, 2),
    ("fp32", 32): (32, 32, 4, 4, 1),    # two stages make dk/dv spill
    ("fp32", 64): (16, 16, 4, 8, 2),
    ("fp32", 128): (16, 16, 8, 8, 1),   # likewise
    ("16bit", 16): (32, 32, 4, 4, 2),
    ("16bit", 32): (32, 32, 4, 4, 2),
    ("16bit", 64): (32, 32, 4, 8, 2),
    ("16bit", 128): (16, 32, 8, 8, 2),
}


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _precision_class(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "16bit"


def tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, light warps, heavy warps, stages) for ``head_dim`` and the input
    dtype (tests monkeypatch this to force small tiles and multi-block walks)."""
    return _TILES[(_precision_class(dtype), block_d(head_dim))]


# ----------------------------------------------------------------------------
# Launchers and the differentiable op
# ----------------------------------------------------------------------------


def _dims(q: torch.Tensor, k: torch.Tensor):
    B, S, H, D = q.shape
    N, HKV = k.shape[1], k.shape[2]
    block_m, block_n, light, heavy, stages = tiles(D, q.dtype)
    return B, S, H, D, N, HKV, block_m, block_n, light, heavy, stages, triton.cdiv(S, block_m)


@triton_op("laminae::elo_attention", mutates_args=())
def elo_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_factor: torch.Tensor, gain: torch.Tensor,
    prior: torch.Tensor, key_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, rating, lse1, 1/n, lse2, checkpoints)`` for contiguous q ``[B, S, H, D]``,
    k, v ``[B, N, H_kv, D]``, fp32 ``k_factor``/``gain`` ``[H]`` (already through
    softplus/tanh), fp32 ``prior`` ``[B, H, N]`` and an int8 ``key_mask`` ``(B, N)``."""
    B, S, H, D, N, HKV, block_m, block_n, light, heavy, stages, nqb = _dims(q, k)
    dev = q.device
    out = empty((B, S, H, D), dtype=q.dtype, device=dev)
    rating = empty((B, H, N), dtype=torch.float32, device=dev)
    lse1 = empty((B * H, S), dtype=torch.float32, device=dev)
    rinv = empty((B * H, S), dtype=torch.float32, device=dev)
    lse2 = empty((B * H, S), dtype=torch.float32, device=dev)
    ck = empty((B * H, nqb, N), dtype=torch.float32, device=dev)
    scale = 1.0 / math.sqrt(D)
    const = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d(D),
                 PRECISION=dot_precision(q.dtype), num_stages=stages)
    wrap_triton(_elo_fwd_stats_kernel)[(nqb, B * H)](
        q, k, key_mask, lse1, rinv, S, N, H, HKV, D, scale, num_warps=light, **const)
    wrap_triton(_elo_fwd_rating_kernel)[(triton.cdiv(N, block_n), B * H)](
        q, k, key_mask, lse1, rinv, k_factor, prior, ck, rating, S, N, H, HKV, D, nqb, scale,
        num_warps=light, **const)
    wrap_triton(_elo_fwd_out_kernel)[(nqb, B * H)](
        q, k, v, key_mask, lse1, rinv, k_factor, gain, prior, ck, out, lse2, S, N, H, HKV, D, nqb, scale,
        num_warps=light, **const)
    return out, rating, lse1, rinv, lse2, ck


@triton_op("laminae::elo_attention_bwd", mutates_args=())
def _elo_attention_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_factor: torch.Tensor, gain: torch.Tensor,
    prior: torch.Tensor, key_mask: torch.Tensor, dout: torch.Tensor, drating: torch.Tensor,
    lse1: torch.Tensor, rinv: torch.Tensor, lse2: torch.Tensor, delta: torch.Tensor, ck: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dprior, dK rows, dg rows)``; the row partials ``[B·H, S]`` are summed in torch."""
    B, S, H, D, N, HKV, block_m, block_n, light, heavy, stages, nqb = _dims(q, k)
    dev = q.device
    cs = empty((B * H, nqb, N), dtype=torch.float32, device=dev)
    gamma = empty((B * H, S), dtype=torch.float32, device=dev)
    dgain_rows = empty((B * H, S), dtype=torch.float32, device=dev)
    dkf_rows = empty((B * H, S), dtype=torch.float32, device=dev)
    dq = empty(q.shape, dtype=q.dtype, device=dev)
    dk = empty(k.shape, dtype=k.dtype, device=dev)
    dv = empty(v.shape, dtype=v.dtype, device=dev)
    dprior = empty((B, H, N), dtype=torch.float32, device=dev)
    scale = 1.0 / math.sqrt(D)
    const = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d(D),
                 PRECISION=dot_precision(q.dtype), num_stages=stages)
    nkb = triton.cdiv(N, block_n)
    wrap_triton(_elo_bwd_suffix_kernel)[(nkb, B * H)](
        q, k, v, key_mask, dout, lse1, rinv, lse2, delta, k_factor, gain, prior, ck, cs,
        S, N, H, HKV, D, nqb, scale, num_warps=light, **const)
    wrap_triton(_elo_bwd_dq_kernel)[(nqb, B * H)](
        q, k, v, key_mask, dout, lse1, rinv, lse2, delta, k_factor, gain, prior, drating, ck, cs,
        dq, gamma, dgain_rows, dkf_rows, S, N, H, HKV, D, nqb, scale, num_warps=heavy, **const)
    wrap_triton(_elo_bwd_dkdv_kernel)[(nkb, B * HKV)](
        q, k, v, key_mask, dout, lse1, rinv, lse2, delta, gamma, k_factor, gain, prior, drating, ck, cs,
        dk, dv, dprior, S, N, H, HKV, D, nqb, scale, num_warps=heavy, **const)
    return dq, dk, dv, dprior, dkf_rows, dgain_rows


def _setup_context(ctx, inputs, output):
    q, k, v, k_factor, gain, prior, key_mask = inputs
    out, _rating, lse1, rinv, lse2, ck = output
    ctx.save_for_backward(q, k, v, k_factor, gain, prior, key_mask, out, lse1, rinv, lse2, ck)


def _backward(ctx, dout, drating, _dlse1, _drinv, _dlse2, _dck):
    q, k, v, k_factor, gain, prior, key_mask, out, lse1, rinv, lse2, ck = ctx.saved_tensors
    B, S, H, _ = q.shape
    dout = torch.zeros_like(out) if dout is None else dout.to(q.dtype).contiguous()
    drating = torch.zeros_like(prior) if drating is None else drating.float().contiguous()
    delta = (dout.float() * out.float()).sum(-1).permute(0, 2, 1).reshape(B * H, S).contiguous()
    dq, dk, dv, dprior, dkf_rows, dgain_rows = _elo_attention_bwd(
        q, k, v, k_factor, gain, prior, key_mask, dout, drating, lse1, rinv, lse2, delta, ck)
    dk_factor = dkf_rows.view(B, H, S).sum(dim=(0, 2))
    dgain = dgain_rows.view(B, H, S).sum(dim=(0, 2))
    return dq, dk, dv, dk_factor, dgain, dprior, None


elo_attention_op.register_autograd(_backward, setup_context=_setup_context)


def elo_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    elo_log_k: torch.Tensor,
    elo_gain: torch.Tensor,
    prior_rating: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton Elo tournament attention, the signature of
    :func:`laminae.primitives.elo_attention.elo_attention_reference` (without ``upcast``).

    ``q`` ``[B, S, H, D]``, ``k``/``v`` ``[B, N, H_kv, D]`` (N ≥ S, H % H_kv == 0,
    D ≤ 128), fp32/bf16/fp16, one dtype; ``elo_log_k``/``elo_gain`` ``[H]`` raw
    parameters; ``prior_rating`` optional ``[B, H, P]`` (P ≤ N, the first P keys);
    ``key_mask`` optional ``(B, N)`` keep mask. Returns ``(out [B, S, H, D]`` in q's
    dtype, ``rating_out [B, H, N]`` float32), differentiable in every tensor input.

    Example::

        out, rating = elo_attention(q, k, v, attn.elo_log_k, attn.elo_gain, prior_rating=cache_rating)
    """
    check_elo_attention_inputs(q, k, v, elo_log_k, elo_gain, prior_rating, key_mask)
    return launch_elo_attention(q, k, v, elo_log_k, elo_gain, prior_rating, key_mask)


def launch_elo_attention(q, k, v, elo_log_k, elo_gain, prior_rating=None, key_mask=None):
    """:func:`elo_attention` for inputs already validated (``EloAttention`` checks them)."""
    if q.dtype not in _SUPPORTED:
        raise DTypeError(f"Triton Elo attention supports fp32/bf16/fp16 inputs, got {q.dtype}; "
                         "use backend='reference' for float64")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ShapeError(f"Triton Elo attention supports head_dim <= {MAX_HEAD_DIM}, got {q.shape[-1]}; "
                         "use backend='reference' for wider heads")
    B, _, H, _ = q.shape
    N = k.shape[1]
    k_factor = torch.nn.functional.softplus(elo_log_k.float())
    gain = torch.tanh(elo_gain.float())
    prior = full_prior(prior_rating, B, H, N, torch.float32, q.device).contiguous()
    if key_mask is None:
        mask = torch.ones(B, N, dtype=torch.int8, device=q.device)
    else:
        mask = key_mask.ne(0).to(torch.int8).contiguous()
    out, rating, *_ = elo_attention_op(q.contiguous(), k.contiguous(), v.contiguous(), k_factor, gain, prior, mask)
    return out, rating


# ----------------------------------------------------------------------------
# Static configurations and the tour
# ----------------------------------------------------------------------------


def static_cases() -> Iterator[StaticCase]:
    """Every (dtype, head-dim tile) configuration the six kernels launch with."""
    # activations and their gradients have the input dtype; every other pointer is fp32
    act_names = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "o_ptr", "dq_ptr", "dk_ptr", "dv_ptr")
    kernels = (
        ("elo_fwd_stats", _elo_fwd_stats_kernel, False),
        ("elo_fwd_rating", _elo_fwd_rating_kernel, False),
        ("elo_fwd_out", _elo_fwd_out_kernel, False),
        ("elo_bwd_suffix", _elo_bwd_suffix_kernel, False),
        ("elo_bwd_dq", _elo_bwd_dq_kernel, True),
        ("elo_bwd_dkdv", _elo_bwd_dkdv_kernel, True),
    )
    for dt in ("fp32", "bf16", "fp16"):
        precision = dot_precision(torch.float32 if dt == "fp32" else torch.bfloat16)
        for (cls, bd), (bm, bn, light, heavy, stages) in _TILES.items():
            if cls != ("fp32" if dt == "fp32" else "16bit"):
                continue
            const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, PRECISION=precision)
            for name, kernel, heavy_kernel in kernels:
                sig = {}
                for arg in kernel.arg_names:
                    if arg in const:
                        continue
                    if arg in act_names:
                        sig[arg] = f"*{dt}"
                    elif arg == "mask_ptr":
                        sig[arg] = "*i8"
                    elif arg.endswith("_ptr"):
                        sig[arg] = "*fp32"
                    else:
                        sig[arg] = "fp32" if arg == "scale" else "i32"
                yield StaticCase(name, kernel, sig, const, heavy if heavy_kernel else light, stages,
                                 tags={"dtype": dt})


def tour_case(device: torch.device):
    from laminae.primitives.elo_attention import elo_attention_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    B, S, H, kv_heads, D = 2, 64, 4, 2, 32
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, :9] = False          # left padding on the second row
    keep[0, 50:53] = False       # and a hole in the first
    inputs = {
        "q": torch.randn(B, S, H, D, generator=gen).to(device),
        "k": torch.randn(B, S, kv_heads, D, generator=gen).to(device),
        "v": torch.randn(B, S, kv_heads, D, generator=gen).to(device),
        "elo_log_k": (0.5 * torch.randn(H, generator=gen)).to(device),
        "elo_gain": (0.6 * torch.randn(H, generator=gen)).to(device),
        "prior_rating": torch.randn(B, H, S, generator=gen).to(device),
        "key_mask": keep.to(device),
    }
    return TourCase(f"elo attention (B={B}, S=N={S}, H={H}/{kv_heads}, D={D}, ragged mask, prior)",
                    elo_attention, elo_attention_reference, inputs, [n for n in inputs if n != "key_mask"])
