"""StackMemory kernels: the stack step (depth mode) and the stack scan (temporal mode).

A "row" is one (token, head) in depth mode and one (sequence, head) in temporal mode.
Its state is a tile ``[BLOCK_S, BLOCK_D]`` (slots × head width, padded to powers of
two ≥ 8) of fp32 registers; a program holds ``BLOCK_R`` rows as one
``[BLOCK_R, BLOCK_S, BLOCK_D]`` tile. Everything is elementwise or a reduction over
one row, so the kernels are memory-bound and parallel over rows.

The update mixes neighbouring slots (St[i−1], St[i+1]). Registers cannot be shifted
along a tile axis, so the neighbours are loaded from global memory at shifted
addresses (the same cache lines: DRAM traffic stays one read of the state). The
backward needs the gradient of the *new* state at slots i−1 and i+1 as well; that
gradient is made on chip from recomputed values, so it is recomputed at the shifted
slots too (three times the arithmetic of a memory-bound kernel, no extra traffic).

Depth step     fwd  reads logits, push, St, M   writes St', M', read R, entropy
               bwd  recomputes a, St', M', read weights; writes dlogits, dpush, dSt,
                    dM and per-program partials of dgate (summed in torch).
Temporal scan  fwd  one program per BLOCK_R (sequence, head) rows, a loop over t; the
                    state of step t goes through a per-row slot buffer (L1/L2
                    resident) so step t+1 can load it shifted; a barrier orders them.
               bwd  reruns the forward keeping every step's state (transient), then a
                    reverse loop carrying dSt, dM through a per-row buffer, which ends
                    as the gradient of the initial state.
Projections (one concatenated matmul in, one up-projection out) stay in torch.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import ConfigError, DTypeError
from laminae.primitives._validation import dense_keep_mask
from laminae.primitives.stack_memory import stack_memory_output, stack_memory_projections

from ._common import StaticCase, empty

__all__ = ["stack_memory", "stack_step", "stack_scan", "supports"]

MIN_BLOCK = 8
# Elements of one row's padded state tile the kernels accept: beyond it the ~10 live
# tiles of the backward no longer fit in registers.
MAX_ROW_TILE = 512
STEP_TILE = 1024          # elements per program in the depth step (BLOCK_R rows)
STEP_WARPS = 4
# The backward holds ~3x the live tiles of the forward (the gradient of the new state
# at three slot offsets); more threads keep it under 255 registers without spills.
STEP_BWD_WARPS = 8


def _blocks(num_slots: int, head_dim: int) -> tuple[int, int]:
    return max(MIN_BLOCK, triton.next_power_of_2(num_slots)), max(MIN_BLOCK, triton.next_power_of_2(head_dim))


def supports(num_slots: int, head_dim: int) -> bool:
    """Whether the Triton kernels take this state size (padded S·d ≤ 512)."""
    bs, bd = _blocks(num_slots, head_dim)
    return bs * bd <= MAX_ROW_TILE


def _step_rows(block_s: int, block_d: int) -> int:
    return max(1, STEP_TILE // (block_s * block_d))


def _scan_warps(block_s: int, block_d: int, backward: bool = False) -> int:
    return 8 if backward and block_s * block_d > 256 else 4


# ----------------------------------------------------------------------------
# Row helpers (inlined into every kernel)
# ----------------------------------------------------------------------------


@triton.jit
def _actions(z_ptr, zoff, rmask, keep):
    """Action probabilities (push, pop, no-op), log-probabilities and entropy of [R]
    rows; dropped rows get the pure no-op and entropy 0."""
    z0 = tl.load(z_ptr + zoff, mask=rmask, other=0.0).to(tl.float32)
    z1 = tl.load(z_ptr + zoff + 1, mask=rmask, other=0.0).to(tl.float32)
    z2 = tl.load(z_ptr + zoff + 2, mask=rmask, other=0.0).to(tl.float32)
    m = tl.maximum(tl.maximum(z0, z1), z2)
    e0 = tl.exp(z0 - m)
    e1 = tl.exp(z1 - m)
    e2 = tl.exp(z2 - m)
    se = e0 + e1 + e2
    lse = tl.log(se)
    l0 = z0 - m - lse
    l1 = z1 - m - lse
    l2 = z2 - m - lse
    a0 = e0 / se
    a1 = e1 / se
    a2 = e2 / se
    ent = -(a0 * l0 + a1 * l1 + a2 * l2)
    kept = keep != 0
    a0 = tl.where(kept, a0, 0.0)
    a1 = tl.where(kept, a1, 0.0)
    a2 = tl.where(kept, a2, 1.0)
    ent = tl.where(kept, ent, 0.0)
    return a0, a1, a2, l0, l1, l2, ent, kept


@triton.jit
def _load_slots(ptr, stoff, s, d, rmask, k, S, D):
    """[R, BS, BD] tile of a state at slot s + k (0 outside 0 ≤ s + k < S)."""
    j = s + k
    m = rmask[:, None, None] & ((j >= 0) & (j < S))[None, :, None] & (d < D)[None, None, :]
    return tl.load(ptr + stoff[:, None, None] + j[None, :, None] * D + d[None, None, :], mask=m, other=0.0)


@triton.jit
def _load_mask_slots(ptr, moff, s, rmask, k, S):
    j = s + k
    m = rmask[:, None] & ((j >= 0) & (j < S))[None, :]
    return tl.load(ptr + moff[:, None] + j[None, :], mask=m, other=0.0)


@triton.jit
def _updated(st_ptr, m_ptr, stoff, moff, s, d, rmask, k, S, D, a0, a1, a2, p):
    """New stack and mask at slot s + k, plus the three old slots they mix
    (above with p / 1 on top, same, below)."""
    j = s + k
    valid = (j >= 0) & (j < S)
    above = _load_slots(st_ptr, stoff, s, d, rmask, k - 1, S, D)
    same = _load_slots(st_ptr, stoff, s, d, rmask, k, S, D)
    below = _load_slots(st_ptr, stoff, s, d, rmask, k + 1, S, D)
    above = tl.where((j == 0)[None, :, None], p[:, None, :], above)
    new = a0[:, None, None] * above + a1[:, None, None] * below + a2[:, None, None] * same
    new = tl.where(valid[None, :, None], new, 0.0)
    m_above = _load_mask_slots(m_ptr, moff, s, rmask, k - 1, S)
    m_same = _load_mask_slots(m_ptr, moff, s, rmask, k, S)
    m_below = _load_mask_slots(m_ptr, moff, s, rmask, k + 1, S)
    m_above = tl.where((j == 0)[None, :], 1.0, m_above)
    new_m = a0[:, None] * m_above + a1[:, None] * m_below + a2[:, None] * m_same
    new_m = tl.where(valid[None, :], new_m, 0.0)
    return new, new_m, above, same, below, m_above, m_same, m_below


@triton.jit
def _scores(new, new_m, g, released):
    """Read scores [R, BS] and w_g·St'_s: soft w_g·(St' ⊙ M'), or released w_g·St' − 1e9·(1 − M')
    (the literal is RELEASED_PENALTY of the reference)."""
    gate_score = tl.sum(new * g[None, None, :], axis=2)
    score = tl.where(released != 0, gate_score - 1.0e9 * (1 - new_m), gate_score * new_m)
    return score, gate_score


@triton.jit
def _step_forward(z_ptr, p_ptr, st_ptr, m_ptr, zoff, poff, stoff, moff, keep, rmask, g, released, S, D,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One stack step of [R] rows: (St', M', read, entropy)."""
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    a0, a1, a2, l0, l1, l2, ent, kept = _actions(z_ptr, zoff, rmask, keep)
    p = tl.load(p_ptr + poff[:, None] + d[None, :], mask=rmask[:, None] & (d < D)[None, :], other=0.0)
    new, new_m, _, _, _, _, _, _ = _updated(st_ptr, m_ptr, stoff, moff, s, d, rmask, 0, S, D, a0, a1, a2, p)
    score, _ = _scores(new, new_m, g, released)
    score = tl.where((s < S)[None, :], score, float("-inf"))
    w = tl.exp(score - tl.max(score, axis=1)[:, None])
    w = w / tl.sum(w, axis=1)[:, None]
    read = tl.sum(w[:, :, None] * new, axis=1)
    return new, new_m, read, ent


@triton.jit
def _grad_of_new(new, new_m, dn_ptr, dnm_ptr, dnoff, dnmoff, s, d, rmask, k, S, D,
                 g, dr, row_max, row_sum, row_c, released):
    """Total gradient of the new stack and mask at slot s + k (``new``, ``new_m`` are
    their recomputed values there): the incoming one plus the read's."""
    j = s + k
    valid = (j >= 0) & (j < S)
    score, gate_score = _scores(new, new_m, g, released)
    w = tl.where(valid[None, :], tl.exp(score - row_max[:, None]) / row_sum[:, None], 0.0)
    dw = tl.sum(dr[:, None, :] * new, axis=2)
    dscore = w * (dw - row_c[:, None])
    rel = released != 0
    g_new = tl.load(dn_ptr + dnoff[:, None, None] + j[None, :, None] * D + d[None, None, :],
                    mask=rmask[:, None, None] & valid[None, :, None] & (d < D)[None, None, :], other=0.0)
    g_new += w[:, :, None] * dr[:, None, :]
    g_new += dscore[:, :, None] * tl.where(rel, g[None, None, :], g[None, None, :] * new_m[:, :, None])
    gm_new = tl.load(dnm_ptr + dnmoff[:, None] + j[None, :], mask=rmask[:, None] & valid[None, :], other=0.0)
    gm_new += dscore * tl.where(rel, 1.0e9, gate_score)
    g_new = tl.where(valid[None, :, None], g_new, 0.0)
    gm_new = tl.where(valid[None, :], gm_new, 0.0)
    return g_new, gm_new, dscore


@triton.jit
def _grad_new(st_ptr, m_ptr, dn_ptr, dnm_ptr, stoff, moff, dnoff, dnmoff, s, d, rmask, k, S, D,
              a0, a1, a2, p, g, dr, row_max, row_sum, row_c, released):
    """:func:`_grad_of_new` at slot offset k, recomputing the new state there."""
    new, new_m, _, _, _, _, _, _ = _updated(st_ptr, m_ptr, stoff, moff, s, d, rmask, k, S, D, a0, a1, a2, p)
    g_new, gm_new, _ = _grad_of_new(new, new_m, dn_ptr, dnm_ptr, dnoff, dnmoff, s, d, rmask, k, S, D,
                                    g, dr, row_max, row_sum, row_c, released)
    return g_new, gm_new


@triton.jit
def _step_backward(z_ptr, p_ptr, st_ptr, m_ptr, dr_ptr, de_ptr, dn_ptr, dnm_ptr,
                   zoff, poff, stoff, moff, dnoff, dnmoff, keep, rmask, g, released, S, D,
                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Gradients of one stack step of [R] rows: (dSt, dM, dlogits ×3, dpush, dgate [BD])."""
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    dmask = (d < D)[None, :]
    a0, a1, a2, l0, l1, l2, ent, kept = _actions(z_ptr, zoff, rmask, keep)
    p = tl.load(p_ptr + poff[:, None] + d[None, :], mask=rmask[:, None] & dmask, other=0.0)
    dr = tl.load(dr_ptr + poff[:, None] + d[None, :], mask=rmask[:, None] & dmask, other=0.0)
    # Row statistics of the read softmax, from the slots themselves.
    new, new_m, above, same, below, m_above, m_same, m_below = _updated(
        st_ptr, m_ptr, stoff, moff, s, d, rmask, 0, S, D, a0, a1, a2, p)
    score, _ = _scores(new, new_m, g, released)
    score = tl.where((s < S)[None, :], score, float("-inf"))
    row_max = tl.max(score, axis=1)
    e = tl.exp(score - row_max[:, None])
    row_sum = tl.sum(e, axis=1)
    w = e / row_sum[:, None]
    row_c = tl.sum(w * tl.sum(dr[:, None, :] * new, axis=2), axis=1)          # Σ_u w_u·dw_u

    g0, gm0, dscore = _grad_of_new(new, new_m, dn_ptr, dnm_ptr, dnoff, dnmoff, s, d, rmask, 0, S, D,
                                   g, dr, row_max, row_sum, row_c, released)
    g_up, gm_up = _grad_new(
        st_ptr, m_ptr, dn_ptr, dnm_ptr, stoff, moff, dnoff, dnmoff, s, d, rmask, -1, S, D,
        a0, a1, a2, p, g, dr, row_max, row_sum, row_c, released)
    g_down, gm_down = _grad_new(
        st_ptr, m_ptr, dn_ptr, dnm_ptr, stoff, moff, dnoff, dnmoff, s, d, rmask, 1, S, D,
        a0, a1, a2, p, g, dr, row_max, row_sum, row_c, released)

    # Transpose of the shifts: old slot i fed new slot i (no-op), i+1 (push), i−1 (pop).
    d_st = a2[:, None, None] * g0 + a0[:, None, None] * g_down + a1[:, None, None] * g_up
    d_m = a2[:, None] * gm0 + a0[:, None] * gm_down + a1[:, None] * gm_up
    d_push = a0[:, None] * tl.sum(tl.where((s == 0)[None, :, None], g0, 0.0), axis=1)

    da0 = tl.sum(tl.sum(g0 * above, axis=2), axis=1) + tl.sum(gm0 * m_above, axis=1)
    da1 = tl.sum(tl.sum(g0 * below, axis=2), axis=1) + tl.sum(gm0 * m_below, axis=1)
    da2 = tl.sum(tl.sum(g0 * same, axis=2), axis=1) + tl.sum(gm0 * m_same, axis=1)
    d_ent = tl.load(de_ptr + zoff // 3, mask=rmask, other=0.0)
    dot = a0 * da0 + a1 * da1 + a2 * da2
    # softmax Jacobian plus dH/dz_o = −a_o·(log a_o + H); a dropped row's actions are constants
    dz0 = tl.where(kept, a0 * (da0 - dot) - d_ent * a0 * (l0 + ent), 0.0)
    dz1 = tl.where(kept, a1 * (da1 - dot) - d_ent * a1 * (l1 + ent), 0.0)
    dz2 = tl.where(kept, a2 * (da2 - dot) - d_ent * a2 * (l2 + ent), 0.0)

    rel = released != 0
    dg_terms = dscore[:, :, None] * new * tl.where(rel, 1.0, new_m[:, :, None])
    d_gate = tl.sum(tl.sum(dg_terms, axis=1), axis=0)
    return d_st, d_m, dz0, dz1, dz2, d_push, d_gate


# ----------------------------------------------------------------------------
# Depth step kernels
# ----------------------------------------------------------------------------


@triton.jit
def _stack_step_fwd_kernel(z_ptr, p_ptr, st_ptr, m_ptr, g_ptr, keep_ptr, read_ptr, nst_ptr, nm_ptr, ent_ptr,
                           n_rows, H, S, D, released,
                           BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    g = tl.load(g_ptr + d, mask=d < D, other=0.0)
    keep = tl.load(keep_ptr + rows // H, mask=rmask, other=0.0)
    stoff = rows * S * D
    moff = rows * S
    new, new_m, read, ent = _step_forward(z_ptr, p_ptr, st_ptr, m_ptr, rows * 3, rows * D, stoff, moff, keep,
                                          rmask, g, released, S, D, BLOCK_S, BLOCK_D)
    smask = rmask[:, None] & (s < S)[None, :]
    tl.store(nst_ptr + stoff[:, None, None] + s[None, :, None] * D + d[None, None, :], new,
             mask=smask[:, :, None] & (d < D)[None, None, :])
    tl.store(nm_ptr + moff[:, None] + s[None, :], new_m, mask=smask)
    tl.store(read_ptr + rows[:, None] * D + d[None, :], read, mask=rmask[:, None] & (d < D)[None, :])
    tl.store(ent_ptr + rows, ent, mask=rmask)


@triton.jit
def _stack_step_bwd_kernel(z_ptr, p_ptr, st_ptr, m_ptr, g_ptr, keep_ptr, dr_ptr, dn_ptr, dnm_ptr, de_ptr,
                           dz_ptr, dp_ptr, dst_ptr, dm_ptr, dg_ptr, n_rows, H, S, D, released,
                           BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    g = tl.load(g_ptr + d, mask=d < D, other=0.0)
    keep = tl.load(keep_ptr + rows // H, mask=rmask, other=0.0)
    stoff = rows * S * D
    moff = rows * S
    d_st, d_m, dz0, dz1, dz2, d_push, d_gate = _step_backward(
        z_ptr, p_ptr, st_ptr, m_ptr, dr_ptr, de_ptr, dn_ptr, dnm_ptr, rows * 3, rows * D, stoff, moff,
        stoff, moff, keep, rmask, g, released, S, D, BLOCK_S, BLOCK_D)
    smask = rmask[:, None] & (s < S)[None, :]
    tl.store(dst_ptr + stoff[:, None, None] + s[None, :, None] * D + d[None, None, :], d_st,
             mask=smask[:, :, None] & (d < D)[None, None, :])
    tl.store(dm_ptr + moff[:, None] + s[None, :], d_m, mask=smask)
    tl.store(dz_ptr + rows * 3, dz0, mask=rmask)
    tl.store(dz_ptr + rows * 3 + 1, dz1, mask=rmask)
    tl.store(dz_ptr + rows * 3 + 2, dz2, mask=rmask)
    tl.store(dp_ptr + rows[:, None] * D + d[None, :], d_push, mask=rmask[:, None] & (d < D)[None, :])
    tl.store(dg_ptr + pid * D + d, d_gate, mask=d < D)


# ----------------------------------------------------------------------------
# Temporal scan kernels
# ----------------------------------------------------------------------------


@triton.jit
def _stack_scan_fwd_kernel(z_ptr, p_ptr, g_ptr, keep_ptr, buf_ptr, mbuf_ptr, read_ptr, ent_ptr,
                           n_rows, T, H, S, D, n_slots, released,
                           BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows are (sequence b, head h); ``buf`` [rows, n_slots, S, D] holds the state
    before token t in slot t % n_slots (slot 0 = the initial state, written by the
    caller)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    g = tl.load(g_ptr + d, mask=d < D, other=0.0)
    b = rows // H
    h = rows % H
    smask = rmask[:, None] & (s < S)[None, :]
    for t in range(T):
        tok = (b * T + t) * H + h                      # row of (b, t, h) in [B, T, H, ...]
        keep = tl.load(keep_ptr + b * T + t, mask=rmask, other=0.0)
        cur = t % n_slots
        nxt = (t + 1) % n_slots
        new, new_m, read, ent = _step_forward(
            z_ptr, p_ptr, buf_ptr, mbuf_ptr, tok * 3, tok * D, (rows * n_slots + cur) * S * D,
            (rows * n_slots + cur) * S, keep, rmask, g, released, S, D, BLOCK_S, BLOCK_D)
        out_st = (rows * n_slots + nxt) * S * D
        tl.store(buf_ptr + out_st[:, None, None] + s[None, :, None] * D + d[None, None, :], new,
                 mask=smask[:, :, None] & (d < D)[None, None, :])
        tl.store(mbuf_ptr + ((rows * n_slots + nxt) * S)[:, None] + s[None, :], new_m, mask=smask)
        tl.store(read_ptr + tok[:, None] * D + d[None, :], read, mask=rmask[:, None] & (d < D)[None, :])
        tl.store(ent_ptr + tok, ent, mask=rmask)
        # step t+1 loads this state at shifted slots written by other threads
        tl.debug_barrier()


@triton.jit
def _stack_scan_bwd_kernel(z_ptr, p_ptr, g_ptr, keep_ptr, buf_ptr, mbuf_ptr, dr_ptr, de_ptr, dc_ptr, dcm_ptr,
                           dz_ptr, dp_ptr, dg_ptr, n_rows, T, H, S, D, released,
                           BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Reverse loop. ``buf`` [rows, T+1, S, D] holds every state (slot t = before token
    t); ``dc``/``dcm`` [rows, S, D] / [rows, S] carry the gradient of the state after
    token t: they start as the final state's gradient and end as the initial one's."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    g = tl.load(g_ptr + d, mask=d < D, other=0.0)
    b = rows // H
    h = rows % H
    smask = rmask[:, None] & (s < S)[None, :]
    coff = rows * S * D
    cmoff = rows * S
    d_gate = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(T):
        t = T - 1 - i
        tok = (b * T + t) * H + h
        keep = tl.load(keep_ptr + b * T + t, mask=rmask, other=0.0)
        d_st, d_m, dz0, dz1, dz2, d_push, dg = _step_backward(
            z_ptr, p_ptr, buf_ptr, mbuf_ptr, dr_ptr, de_ptr, dc_ptr, dcm_ptr, tok * 3, tok * D,
            (rows * (T + 1) + t) * S * D, (rows * (T + 1) + t) * S, coff, cmoff, keep, rmask, g, released,
            S, D, BLOCK_S, BLOCK_D)
        d_gate += dg
        tl.store(dz_ptr + tok * 3, dz0, mask=rmask)
        tl.store(dz_ptr + tok * 3 + 1, dz1, mask=rmask)
        tl.store(dz_ptr + tok * 3 + 2, dz2, mask=rmask)
        tl.store(dp_ptr + tok[:, None] * D + d[None, :], d_push, mask=rmask[:, None] & (d < D)[None, :])
        tl.debug_barrier()          # every thread has read the carry at its shifted slots
        tl.store(dc_ptr + coff[:, None, None] + s[None, :, None] * D + d[None, None, :], d_st,
                 mask=smask[:, :, None] & (d < D)[None, None, :])
        tl.store(dcm_ptr + cmoff[:, None] + s[None, :], d_m, mask=smask)
        tl.debug_barrier()          # the next step reads the new carry
    tl.store(dg_ptr + pid * D + d, d_gate, mask=d < D)


# ----------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------


@triton_op("laminae::stack_step", mutates_args=())
def _stack_step_op(logits: torch.Tensor, push: torch.Tensor, stack: torch.Tensor, stack_mask: torch.Tensor,
                   gate: torch.Tensor, keep: torch.Tensor, released: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, H, 3], push [N, H, D], stack [N, H, S, D], stack_mask [N, H, S], gate [D],
    keep [N] (all fp32, contiguous) → (read [N, H, D], new_stack, new_mask, entropy [N, H])."""
    N, H, S, D = stack.shape
    bs, bd = _blocks(S, D)
    br = _step_rows(bs, bd)
    read = empty((N, H, D), dtype=torch.float32, device=push.device)
    new_stack = empty((N, H, S, D), dtype=torch.float32, device=push.device)
    new_mask = empty((N, H, S), dtype=torch.float32, device=push.device)
    entropy = empty((N, H), dtype=torch.float32, device=push.device)
    rows = N * H
    wrap_triton(_stack_step_fwd_kernel)[(triton.cdiv(rows, br),)](
        logits, push, stack, stack_mask, gate, keep, read, new_stack, new_mask, entropy,
        rows, H, S, D, int(released), BLOCK_R=br, BLOCK_S=bs, BLOCK_D=bd, num_warps=STEP_WARPS)
    return read, new_stack, new_mask, entropy


@triton_op("laminae::stack_step_bwd", mutates_args=())
def _stack_step_bwd_op(logits: torch.Tensor, push: torch.Tensor, stack: torch.Tensor, stack_mask: torch.Tensor,
                       gate: torch.Tensor, keep: torch.Tensor, released: bool, d_read: torch.Tensor,
                       d_new_stack: torch.Tensor, d_new_mask: torch.Tensor, d_entropy: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    N, H, S, D = stack.shape
    bs, bd = _blocks(S, D)
    br = _step_rows(bs, bd)
    rows = N * H
    grid = triton.cdiv(rows, br)
    d_logits = empty((N, H, 3), dtype=torch.float32, device=push.device)
    d_push = empty((N, H, D), dtype=torch.float32, device=push.device)
    d_stack = empty((N, H, S, D), dtype=torch.float32, device=push.device)
    d_mask = empty((N, H, S), dtype=torch.float32, device=push.device)
    partials = empty((grid, D), dtype=torch.float32, device=push.device)
    wrap_triton(_stack_step_bwd_kernel)[(grid,)](
        logits, push, stack, stack_mask, gate, keep, d_read, d_new_stack, d_new_mask, d_entropy,
        d_logits, d_push, d_stack, d_mask, partials, rows, H, S, D, int(released),
        BLOCK_R=br, BLOCK_S=bs, BLOCK_D=bd, num_warps=STEP_BWD_WARPS)
    return d_logits, d_push, d_stack, d_mask, partials.sum(0)


def entropy_like(logits):
    return logits.new_empty(logits.shape[:-1])


def _zeros_if_none(grad, like):
    return torch.zeros_like(like) if grad is None else grad.contiguous()


def _step_setup(ctx, inputs, output):
    logits, push, stack, stack_mask, gate, keep, released = inputs
    ctx.released = released
    ctx.save_for_backward(logits, push, stack, stack_mask, gate, keep)


def _step_backward_autograd(ctx, d_read, d_new_stack, d_new_mask, d_entropy):
    logits, push, stack, stack_mask, gate, keep = ctx.saved_tensors
    read_like = push
    grads = _stack_step_bwd_op(logits, push, stack, stack_mask, gate, keep, ctx.released,
                               _zeros_if_none(d_read, read_like), _zeros_if_none(d_new_stack, stack),
                               _zeros_if_none(d_new_mask, stack_mask),
                               _zeros_if_none(d_entropy, entropy_like(logits)))
    d_logits, d_push, d_stack, d_mask, d_gate = grads
    return d_logits, d_push, d_stack, d_mask, d_gate, None, None


_stack_step_op.register_autograd(_step_backward_autograd, setup_context=_step_setup)


def _scan_launch(logits, push, gate, keep, initial_stack, initial_mask, released, n_slots):
    """Run the forward scan keeping ``n_slots`` states per row (2: ping-pong; T+1: all)."""
    B, T, H, D = push.shape
    S = initial_stack.shape[2]
    bs, bd = _blocks(S, D)
    rows = B * H
    buf = empty((rows, n_slots, S, D), dtype=torch.float32, device=push.device)
    mbuf = empty((rows, n_slots, S), dtype=torch.float32, device=push.device)
    buf[:, 0] = initial_stack.reshape(rows, S, D)
    mbuf[:, 0] = initial_mask.reshape(rows, S)
    read = empty((B, T, H, D), dtype=torch.float32, device=push.device)
    entropy = empty((B, T, H), dtype=torch.float32, device=push.device)
    wrap_triton(_stack_scan_fwd_kernel)[(rows,)](
        logits, push, gate, keep, buf, mbuf, read, entropy, rows, T, H, S, D, n_slots, int(released),
        BLOCK_R=1, BLOCK_S=bs, BLOCK_D=bd, num_warps=_scan_warps(bs, bd))
    return read, entropy, buf, mbuf


@triton_op("laminae::stack_scan", mutates_args=())
def _stack_scan_op(logits: torch.Tensor, push: torch.Tensor, gate: torch.Tensor, keep: torch.Tensor,
                   initial_stack: torch.Tensor, initial_mask: torch.Tensor, released: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, T, H, 3], push [B, T, H, D], gate [D], keep [B·T], initial state
    [B, H, S, D] / [B, H, S] → (read [B, T, H, D], entropy [B, T, H], final state)."""
    B, T, H, D = push.shape
    S = initial_stack.shape[2]
    read, entropy, buf, mbuf = _scan_launch(logits, push, gate, keep, initial_stack, initial_mask, released, 2)
    final = T % 2
    return (read, entropy, buf[:, final].reshape(B, H, S, D).clone(), mbuf[:, final].reshape(B, H, S).clone())


@triton_op("laminae::stack_scan_bwd", mutates_args=())
def _stack_scan_bwd_op(logits: torch.Tensor, push: torch.Tensor, gate: torch.Tensor, keep: torch.Tensor,
                       initial_stack: torch.Tensor, initial_mask: torch.Tensor, released: bool,
                       d_read: torch.Tensor, d_entropy: torch.Tensor, d_final_stack: torch.Tensor,
                       d_final_mask: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, H, D = push.shape
    S = initial_stack.shape[2]
    bs, bd = _blocks(S, D)
    rows = B * H
    # every state of the forward, recomputed (transient) rather than saved per layer
    _, _, buf, mbuf = _scan_launch(logits, push, gate, keep, initial_stack, initial_mask, released, T + 1)
    carry = d_final_stack.reshape(rows, S, D).clone()
    carry_m = d_final_mask.reshape(rows, S).clone()
    d_logits = empty((B, T, H, 3), dtype=torch.float32, device=push.device)
    d_push = empty((B, T, H, D), dtype=torch.float32, device=push.device)
    partials = empty((rows, D), dtype=torch.float32, device=push.device)
    wrap_triton(_stack_scan_bwd_kernel)[(rows,)](
        logits, push, gate, keep, buf, mbuf, d_read, d_entropy, carry, carry_m, d_logits, d_push, partials,
        rows, T, H, S, D, int(released), BLOCK_R=1, BLOCK_S=bs, BLOCK_D=bd,
        num_warps=_scan_warps(bs, bd, backward=True))
    return d_logits, d_push, partials.sum(0), carry.reshape(B, H, S, D), carry_m.reshape(B, H, S)


def _scan_setup(ctx, inputs, output):
    logits, push, gate, keep, initial_stack, initial_mask, released = inputs
    ctx.released = released
    ctx.save_for_backward(logits, push, gate, keep, initial_stack, initial_mask)


def _scan_backward_autograd(ctx, d_read, d_entropy, d_final_stack, d_final_mask):
    logits, push, gate, keep, initial_stack, initial_mask = ctx.saved_tensors
    d_logits, d_push, d_gate, d_init, d_init_mask = _stack_scan_bwd_op(
        logits, push, gate, keep, initial_stack, initial_mask, ctx.released,
        _zeros_if_none(d_read, push), _zeros_if_none(d_entropy, entropy_like(logits)),
        _zeros_if_none(d_final_stack, initial_stack), _zeros_if_none(d_final_mask, initial_mask))
    return d_logits, d_push, d_gate, None, d_init, d_init_mask, None


_stack_scan_op.register_autograd(_scan_backward_autograd, setup_context=_scan_setup)


# ----------------------------------------------------------------------------
# Public functions (signatures of the references)
# ----------------------------------------------------------------------------


def _check_size(num_slots: int, head_dim: int) -> None:
    if not supports(num_slots, head_dim):
        bs, bd = _blocks(num_slots, head_dim)
        raise ConfigError(f"Triton StackMemory keeps one padded state tile of at most {MAX_ROW_TILE} elements "
                          f"per row: stack_slots={num_slots} → {bs}, head_dim={head_dim} → {bd}, {bs * bd} > "
                          f"{MAX_ROW_TILE}; use backend='reference'")


def _f32(*tensors):
    return tuple(None if t is None else t.to(torch.float32).contiguous() for t in tensors)


def stack_step(logits, push, stack, stack_mask, gate, attention_mask=None, *, read_mode: str = "soft"):
    """Triton depth step, the signature of :func:`~laminae.primitives.stack_memory.stack_step_reference`.

    ``logits`` [B, T, H, 3], ``push`` [B, T, H, d], ``stack`` [B, T, H, S, d], ``stack_mask``
    [B, T, H, S], ``gate`` [d], ``attention_mask`` [B, T] or None. Everything runs in fp32;
    returns fp32 ``(read, new_stack, new_mask, entropy)``.
    """
    B, T, H, S, D = stack.shape
    _check_size(S, D)
    logits, push, stack, stack_mask, gate = _f32(logits, push, stack, stack_mask, gate)
    keep = dense_keep_mask(attention_mask, B, T, push.device).reshape(-1).float()
    read, new_stack, new_mask, entropy = _stack_step_op(
        logits.reshape(B * T, H, 3), push.reshape(B * T, H, D), stack.reshape(B * T, H, S, D),
        stack_mask.reshape(B * T, H, S), gate, keep, read_mode == "released")
    return (read.reshape(B, T, H, D), new_stack.reshape(B, T, H, S, D), new_mask.reshape(B, T, H, S),
            entropy.reshape(B, T, H))


def stack_scan(logits, push, gate, attention_mask=None, initial_stack=None, initial_mask=None, *,
               num_slots: int | None = None, read_mode: str = "soft"):
    """Triton temporal scan, the signature of :func:`~laminae.primitives.stack_memory.stack_scan_reference`.

    Returns fp32 ``(read [B, T, H, d], entropy [B, T, H], final_stack [B, H, S, d], final_mask [B, H, S])``.
    """
    B, T, H, D = push.shape
    if initial_stack is None:
        initial_stack = torch.zeros(B, H, num_slots, D, device=push.device)
        initial_mask = torch.zeros(B, H, num_slots, device=push.device)
    _check_size(initial_stack.shape[2], D)
    logits, push, gate, initial_stack, initial_mask = _f32(logits, push, gate, initial_stack, initial_mask)
    keep = dense_keep_mask(attention_mask, B, T, push.device).reshape(-1).float()
    return _stack_scan_op(logits, push, gate, keep, initial_stack, initial_mask, read_mode == "released")


def stack_memory(x, action_weight, down_weight, up_weight, gate, res_weight, stack=None, stack_mask=None,
                 attention_mask=None, action_bias=None, down_bias=None, up_bias=None, *, num_heads: int,
                 num_slots: int, mode: str = "depth", read_mode: str = "soft"):
    """One StackMemory layer with the Triton step/scan, the signature of
    :func:`~laminae.primitives.stack_memory.stack_memory_reference`.

    ``x`` [B, T, D] fp32/bf16/fp16 → ``(out [B, T, D] in x.dtype, new_stack, new_mask, entropy)``
    (state and entropy fp32). The projections run in fp32 in torch (3H + H·d output
    columns: thin, memory-bound on reading ``x``).
    """
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"Triton StackMemory supports fp32/bf16/fp16 inputs, got {x.dtype}")
    dtype = x.dtype
    xf = x.float()
    f32 = (lambda t: None if t is None else t.float())
    logits, push = stack_memory_projections(xf, f32(action_weight), f32(down_weight), f32(action_bias),
                                            f32(down_bias), num_heads, attention_mask)
    if mode == "depth":
        if stack is None:
            B, T, H, d = push.shape
            stack, stack_mask = push.new_zeros(B, T, H, num_slots, d), push.new_zeros(B, T, H, num_slots)
        read, new_stack, new_mask, entropy = stack_step(logits, push, stack, stack_mask, gate, attention_mask,
                                                        read_mode=read_mode)
    else:
        read, entropy, new_stack, new_mask = stack_scan(logits, push, gate, attention_mask, stack, stack_mask,
                                                        num_slots=num_slots, read_mode=read_mode)
    out = stack_memory_output(xf, read, f32(up_weight), f32(up_bias), f32(res_weight), attention_mask)
    return out.to(dtype), new_stack, new_mask, entropy


# ----------------------------------------------------------------------------
# Launch configurations and tour
# ----------------------------------------------------------------------------


def _block_pairs():
    sizes = [MIN_BLOCK * 2**i for i in range(int(math.log2(MAX_ROW_TILE // MIN_BLOCK // MIN_BLOCK)) + 1)]
    return [(bs, bd) for bs in sizes for bd in sizes if bs * bd <= MAX_ROW_TILE]


def static_cases() -> Iterator[StaticCase]:
    """Every kernel at every (BLOCK_S, BLOCK_D) the launchers can pick, with their
    BLOCK_R and num_warps. Inputs are always fp32 (the state's dtype by design)."""
    f = "*fp32"
    for bs, bd in _block_pairs():
        step = dict(BLOCK_R=_step_rows(bs, bd), BLOCK_S=bs, BLOCK_D=bd)
        scan = dict(BLOCK_R=1, BLOCK_S=bs, BLOCK_D=bd)
        ints = dict(n_rows="i32", H="i32", S="i32", D="i32", released="i32")
        yield StaticCase("stack_step_fwd", _stack_step_fwd_kernel,
                         dict(z_ptr=f, p_ptr=f, st_ptr=f, m_ptr=f, g_ptr=f, keep_ptr=f, read_ptr=f, nst_ptr=f,
                              nm_ptr=f, ent_ptr=f, **ints), step, STEP_WARPS)
        yield StaticCase("stack_step_bwd", _stack_step_bwd_kernel,
                         dict(z_ptr=f, p_ptr=f, st_ptr=f, m_ptr=f, g_ptr=f, keep_ptr=f, dr_ptr=f, dn_ptr=f,
                              dnm_ptr=f, de_ptr=f, dz_ptr=f, dp_ptr=f, dst_ptr=f, dm_ptr=f, dg_ptr=f, **ints),
                         step, STEP_BWD_WARPS)
        sints = dict(n_rows="i32", T="i32", H="i32", S="i32", D="i32")
        yield StaticCase("stack_scan_fwd", _stack_scan_fwd_kernel,
                         dict(z_ptr=f, p_ptr=f, g_ptr=f, keep_ptr=f, buf_ptr=f, mbuf_ptr=f, read_ptr=f, ent_ptr=f,
                              **sints, n_slots="i32", released="i32"), scan, _scan_warps(bs, bd))
        yield StaticCase("stack_scan_bwd", _stack_scan_bwd_kernel,
                         dict(z_ptr=f, p_ptr=f, g_ptr=f, keep_ptr=f, buf_ptr=f, mbuf_ptr=f, dr_ptr=f, de_ptr=f,
                              dc_ptr=f, dcm_ptr=f, dz_ptr=f, dp_ptr=f, dg_ptr=f, **sints, released="i32"),
                         scan, _scan_warps(bs, bd, backward=True))


def tour_case(device: torch.device):
    from laminae.primitives.stack_memory import stack_memory_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    B, T, D, H, d, S = 2, 24, 128, 4, 6, 16
    inputs = {
        "x": torch.randn(B, T, D, generator=gen).to(device),
        "action_weight": (torch.randn(3 * H, D, generator=gen) * 0.3).to(device),
        "down_weight": (torch.randn(H * d, D, generator=gen) * 0.1).to(device),
        "up_weight": (torch.randn(D, H * d, generator=gen) * 0.1).to(device),
        "gate": torch.randn(d, generator=gen).to(device),
        "res_weight": torch.tensor(0.8).to(device),
        "stack": torch.randn(B, T, H, S, d, generator=gen).to(device),
        "stack_mask": torch.rand(B, T, H, S, generator=gen).to(device),
    }
    grads = list(inputs)
    cases = []
    for mode in ("depth", "temporal"):
        inp = dict(inputs, num_heads=H, num_slots=S, mode=mode)
        if mode == "temporal":   # a shorter sequence: the scan is sequential over tokens
            inp["x"] = inputs["x"][:, :8]
            inp["stack"], inp["stack_mask"] = inputs["stack"][:, 0], inputs["stack_mask"][:, 0]
        cases.append(TourCase(f"stack_memory ({mode}, H={H}, S={S}, d={d})", stack_memory, stack_memory_reference,
                              inp, grads))
    return cases
