"""StackMemory kernels: the stack step (depth mode) and the chunked stack scan (temporal mode).

Depth step. A row is one (token, head); its state is a tile ``[BLOCK_S, BLOCK_D]``
(slots × head width, padded to powers of two ≥ 8) of fp32 registers, and a program
holds ``BLOCK_R`` rows as one ``[BLOCK_R, BLOCK_S, BLOCK_D]`` tile. Everything is
elementwise or a reduction over one row: memory-bound and parallel over rows. The
update mixes neighbouring slots (St[i−1], St[i+1]); the input state is read-only, so
the neighbours are loaded at shifted addresses (the same cache lines). The backward
recomputes the gradient of the *new* state at slots i−1, i, i+1 on chip.

    fwd  reads logits, push, St, M   writes St', M', read R, entropy
    bwd  recomputes a, St', M', read weights; writes dlogits, dpush, dSt, dM and
         per-program partials of dgate (summed in torch)

Temporal scan. A row is one (sequence, head). The mask rides as one more column of
the stack, so the state is ``X = [St | M]`` ``[S, d + 1]`` (fp32 register tile
``[BLOCK_S, BLOCK_W]``, both ≥ 16 for ``tl.dot``) and one token is linear in it with
coefficients that do not depend on it::

    X_{t+1} = A_t·X_t + a_push,t·e₀·[p_t, 1]        A_t = a_push·Down + a_pop·Up + a_noop·I

(A_t tridiagonal, the identity for a dropped token). A_t·X is three terms per slot:
the tile shifted by one slot each way (``tl.gather`` along the slots, warp shuffles)
and itself, the reference's own sum; a dense ``tl.dot(A_t, X)`` would spend 16/3 of
its multiply-adds on zeros. Chunks of ``chunk`` tokens (64):

    summary  per (row, chunk) in parallel: Φ_c = Π A_t (S×S) and Y_c, the chunk's
             state from zero, in one loop over its tokens.
    carry    per row, serial over chunks: X_{c+1} = Φ_c·X_c + Y_c (T/chunk − 1 steps,
             one fp32 S×S by S×(d+1) ``tl.dot`` each).
    expand   per (row, chunk) in parallel: from the carried state, the tokens again,
             writing reads and entropies (the last chunk: the final state).

The backward is the reverse linear recurrence λ_t = A_tᵀ·λ_{t+1} + (read gradient),
chunked the same way: a forward pass per chunk writes every state (transient) and
the adjoint summary (Φ_c and ν_c = Σ_t Φ_{≤t}ᵀ·g_t, g_t the read gradient at X_{t+1});
a serial pass over chunks carries λ back (λ_c = Φ_cᵀ·λ_{c+1} + ν_c); a reverse pass
per chunk makes dpush = a_push·λ[0], da (the three bands of dA_t = λ_{t+1}·X_tᵀ, as λ
against the shifted X_t), dlogits and dgate partials; the first chunk ends at the
initial state's gradient. No kernel reads global memory another thread of its own
program wrote: states cross between kernels only.
Every product is fp32 ("ieee"): see ``docs/mechanisms/stack_memory.md`` (precision).

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
# Slots the temporal scan takes: its S×S chunk products (Φ·X, Φᵀ·λ) are fp32 tl.dot
# on FMA units, whose operands at S = 64 spill at any warp count.
MAX_SCAN_SLOTS = 32


def _blocks(num_slots: int, head_dim: int) -> tuple[int, int]:
    return max(MIN_BLOCK, triton.next_power_of_2(num_slots)), max(MIN_BLOCK, triton.next_power_of_2(head_dim))


def supports(num_slots: int, head_dim: int, mode: str = "depth") -> bool:
    """Whether the Triton kernels take this state size: padded S·d ≤ 512, and in
    temporal mode S ≤ 32 (the scan's S×S fp32 products)."""
    bs, bd = _blocks(num_slots, head_dim)
    return bs * bd <= MAX_ROW_TILE and (mode != "temporal" or num_slots <= MAX_SCAN_SLOTS)


def _step_rows(block_s: int, block_d: int) -> int:
    return max(1, STEP_TILE // (block_s * block_d))


# Tokens per chunk of the temporal scan: the serial pass over chunks is T/64 − 1
# steps, each chunk's own loops 64 (run for all chunks at once).
SCAN_CHUNK = 64
# tl.dot (the chunk products) takes tiles of at least 16 in every dimension.
SCAN_MIN_BLOCK = 16


def _scan_config(num_slots: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_S, BLOCK_W, num_warps) of every temporal-scan kernel: the state tile is
    slots × (head width + the mask column)."""
    bs = max(SCAN_MIN_BLOCK, triton.next_power_of_2(num_slots))
    bw = max(SCAN_MIN_BLOCK, triton.next_power_of_2(head_dim + 1))
    return bs, bw, _scan_warps(bs, bw)


def _scan_warps(block_s: int, block_w: int) -> int:
    # one warp per 16×16×16 of the chunk product Φ·X: fp32 tl.dot on FMA units holds
    # each operand's whole K extent in registers, so fewer warps spill
    return (block_s // 16) ** 2 * (block_w // 16)


def scan_serial_steps(length: int, chunk: int = SCAN_CHUNK) -> dict:
    """Dependent steps on the critical path of the temporal scan at ``length`` tokens
    (one step = one token's update of a register tile, or one chunk's combine):
    forward = chunk loop (summary) + combine + chunk loop (expand), backward the same;
    the chunk loops of all chunks run at once."""
    n = -(-length // chunk)
    inner = min(chunk, length)
    summary = inner if n > 1 else 0
    return {"fwd": summary + (n - 1) + inner, "bwd": inner + (n - 1) + inner}


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
# Temporal scan: the chunked linear recurrence
# ----------------------------------------------------------------------------


@triton.jit
def _tile(ptr, off, si, sj, S, W):
    """[BS, BW] tile of an [S, W] row-major block at ``off`` (0 outside)."""
    return tl.load(ptr + off + si[:, None] * W + sj[None, :], mask=(si < S)[:, None] & (sj < W)[None, :], other=0.0)


@triton.jit
def _store_tile(ptr, off, x, si, sj, S, W):
    tl.store(ptr + off + si[:, None] * W + sj[None, :], x, mask=(si < S)[:, None] & (sj < W)[None, :])


@triton.jit
def _neighbours(si, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row indices of slot i−1 and i+1 (clamped) as [BS, BN] tiles for ``tl.gather``
    along the slots: the shift of a register tile by one slot."""
    zero = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.int32)
    return tl.maximum(si - 1, 0)[:, None] + zero, tl.minimum(si + 1, BLOCK_S - 1)[:, None] + zero


@triton.jit
def _scan_read(x, g, col_m, row_ok, released):
    """Read of the state tile: (R [BW], read weights [BS], w_g·St_s [BS], M [BS]).
    ``g`` is zero beyond the d stack columns, so the mask column never scores;
    ``col_m`` is 1 at the mask column."""
    gate_score = tl.sum(x * g[None, :], axis=1)
    m = tl.sum(x * col_m[None, :], axis=1)
    score = tl.where(released != 0, gate_score - 1.0e9 * (1 - m), gate_score * m)
    score = tl.where(row_ok, score, float("-inf"))
    e = tl.exp(score - tl.max(score, axis=0))
    w = e / tl.sum(e, axis=0)
    return tl.sum(w[:, None] * x, axis=0), w, gate_score, m


@triton.jit
def _scan_read_grad(x, g, dr, w, gate_score, m, col_m, released):
    """Gradient of the read w.r.t. the state tile it read (stack columns and mask
    column), and the read-weight factor of its dgate terms (dgate = Σ_s factor_s·St_s)."""
    rel = released != 0
    dw = tl.sum(x * dr[None, :], axis=1)
    dscore = w * (dw - tl.sum(w * dw, axis=0))
    dscore_m = dscore * tl.where(rel, 1.0, m)
    grad = w[:, None] * dr[None, :] + dscore_m[:, None] * g[None, :]
    grad += col_m[None, :] * (dscore * tl.where(rel, 1.0e9, gate_score))[:, None]
    return grad, dscore_m


@triton.jit
def _scan_summary_kernel(z_ptr, p_ptr, keep_ptr, phi_ptr, y_ptr, T, H, S, D, W, chunk, n_chunks,
                         BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program (row, chunk c < n_chunks − 1): Φ_c = A_{c1−1}···A_{c0} and Y_c (the
    chunk's state from zero), stored at [row, c] of [rows, n_chunks − 1, S, S | W]."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    b = r // H
    h = r % H
    si = tl.arange(0, BLOCK_S)
    sj = tl.arange(0, BLOCK_W)
    above, below = _neighbours(si, BLOCK_S, BLOCK_W)
    above_s, below_s = _neighbours(si, BLOCK_S, BLOCK_S)
    first = (si == 0)[:, None]
    has_below = (si + 1 < S)[:, None]
    inside = (si < S)[:, None]
    col_m = tl.where(sj == D, 1.0, 0.0)
    y = tl.zeros((BLOCK_S, BLOCK_W), dtype=tl.float32)
    phi = tl.where(inside & (si[:, None] == si[None, :]), 1.0, 0.0)
    for j in range(chunk):
        t = c * chunk + j
        tok = (b * T + t) * H + h
        a0, a1, a2, _, _, _, _, _ = _actions(z_ptr, tok * 3, tok >= 0, tl.load(keep_ptr + b * T + t))
        pushed = tl.load(p_ptr + tok * D + sj, mask=sj < D, other=0.0) + col_m     # [p, 1]
        y_above = tl.where(first, pushed[None, :], tl.gather(y, above, 0))
        y_below = tl.where(has_below, tl.gather(y, below, 0), 0.0)
        y = tl.where(inside, a0 * y_above + a1 * y_below + a2 * y, 0.0)
        phi_above = tl.where(first, 0.0, tl.gather(phi, above_s, 0))
        phi_below = tl.where(has_below, tl.gather(phi, below_s, 0), 0.0)
        phi = tl.where(inside, a0 * phi_above + a1 * phi_below + a2 * phi, 0.0)
    block = r * (n_chunks - 1) + c
    _store_tile(phi_ptr, block * S * S, phi, si, si, S, S)
    _store_tile(y_ptr, block * S * W, y, si, sj, S, W)


@triton.jit
def _scan_carry_kernel(phi_ptr, y_ptr, carry_ptr, S, W, n_chunks, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program per row, serial over chunks: ``carry`` [rows, n_chunks + 1, S, W] holds
    the state entering chunk c at [row, c]; [row, 0] (the initial state) is given."""
    r = tl.program_id(0).to(tl.int64)
    si = tl.arange(0, BLOCK_S)
    sj = tl.arange(0, BLOCK_W)
    x = _tile(carry_ptr, r * (n_chunks + 1) * S * W, si, sj, S, W)
    for c in range(n_chunks - 1):
        block = r * (n_chunks - 1) + c
        phi = _tile(phi_ptr, block * S * S, si, si, S, S)
        x = tl.dot(phi, x, input_precision="ieee") + _tile(y_ptr, block * S * W, si, sj, S, W)
        _store_tile(carry_ptr, (r * (n_chunks + 1) + c + 1) * S * W, x, si, sj, S, W)


@triton.jit
def _scan_expand_kernel(z_ptr, p_ptr, g_ptr, keep_ptr, carry_ptr, read_ptr, ent_ptr, T, H, S, D, W, chunk,
                        n_chunks, released, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program (row, chunk): the chunk's tokens from its carried state, writing reads
    and entropies; the last chunk writes the final state at [row, n_chunks]."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    b = r // H
    h = r % H
    si = tl.arange(0, BLOCK_S)
    sj = tl.arange(0, BLOCK_W)
    above, below = _neighbours(si, BLOCK_S, BLOCK_W)
    first = (si == 0)[:, None]
    has_below = (si + 1 < S)[:, None]
    inside = (si < S)[:, None]
    col_m = tl.where(sj == D, 1.0, 0.0)
    g = tl.load(g_ptr + sj, mask=sj < D, other=0.0)
    x = _tile(carry_ptr, (r * (n_chunks + 1) + c) * S * W, si, sj, S, W)
    t0 = c * chunk
    for j in range(tl.minimum(chunk, T - t0)):
        tok = (b * T + t0 + j) * H + h
        a0, a1, a2, _, _, _, ent, _ = _actions(z_ptr, tok * 3, tok >= 0, tl.load(keep_ptr + b * T + t0 + j))
        pushed = tl.load(p_ptr + tok * D + sj, mask=sj < D, other=0.0) + col_m
        x_above = tl.where(first, pushed[None, :], tl.gather(x, above, 0))
        x_below = tl.where(has_below, tl.gather(x, below, 0), 0.0)
        x = tl.where(inside, a0 * x_above + a1 * x_below + a2 * x, 0.0)
        read, _, _, _ = _scan_read(x, g, col_m, si < S, released)
        tl.store(read_ptr + tok * D + sj, read, mask=sj < D)
        tl.store(ent_ptr + tok, ent)
    if c == n_chunks - 1:
        _store_tile(carry_ptr, (r * (n_chunks + 1) + n_chunks) * S * W, x, si, sj, S, W)


@triton.jit
def _scan_adjoint_summary_kernel(z_ptr, p_ptr, g_ptr, keep_ptr, dr_ptr, carry_ptr, hist_ptr, phi_ptr, nu_ptr,
                                 T, H, S, D, W, chunk, n_chunks, released,
                                 BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program (row, chunk): the chunk's states again from its carried state, each
    written to ``hist`` [rows, T, S, W] (slot t: the state after token t), and the
    adjoint summary Φ_c, ν_c = Σ_t (A_t···A_{c0})ᵀ·g_t at [row, c] of
    [rows, n_chunks, S, S | W]."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    b = r // H
    h = r % H
    si = tl.arange(0, BLOCK_S)
    sj = tl.arange(0, BLOCK_W)
    above, below = _neighbours(si, BLOCK_S, BLOCK_W)
    above_s, below_s = _neighbours(si, BLOCK_S, BLOCK_S)
    first = (si == 0)[:, None]
    has_below = (si + 1 < S)[:, None]
    inside = (si < S)[:, None]
    col_m = tl.where(sj == D, 1.0, 0.0)
    tile = si[:, None] * W + sj[None, :]
    in_state = inside & (sj < W)[None, :]
    g = tl.load(g_ptr + sj, mask=sj < D, other=0.0)
    x = _tile(carry_ptr, (r * (n_chunks + 1) + c) * S * W, si, sj, S, W)
    phi = tl.where(inside & (si[:, None] == si[None, :]), 1.0, 0.0)
    nu = tl.zeros((BLOCK_S, BLOCK_W), dtype=tl.float32)
    t0 = c * chunk
    for j in range(tl.minimum(chunk, T - t0)):
        tok = (b * T + t0 + j) * H + h
        a0, a1, a2, _, _, _, _, _ = _actions(z_ptr, tok * 3, tok >= 0, tl.load(keep_ptr + b * T + t0 + j))
        pushed = tl.load(p_ptr + tok * D + sj, mask=sj < D, other=0.0) + col_m
        x_above = tl.where(first, pushed[None, :], tl.gather(x, above, 0))
        x_below = tl.where(has_below, tl.gather(x, below, 0), 0.0)
        x = tl.where(inside, a0 * x_above + a1 * x_below + a2 * x, 0.0)
        tl.store(hist_ptr + (r * T + t0 + j) * S * W + tile, x, mask=in_state)
        _, w, gate_score, m = _scan_read(x, g, col_m, si < S, released)
        dr = tl.load(dr_ptr + tok * D + sj, mask=sj < D, other=0.0)
        grad, _ = _scan_read_grad(x, g, dr, w, gate_score, m, col_m, released)
        phi_above = tl.where(first, 0.0, tl.gather(phi, above_s, 0))
        phi_below = tl.where(has_below, tl.gather(phi, below_s, 0), 0.0)
        phi = tl.where(inside, a0 * phi_above + a1 * phi_below + a2 * phi, 0.0)
        nu += tl.dot(tl.trans(phi), grad, input_precision="ieee")
    block = r * n_chunks + c
    _store_tile(phi_ptr, block * S * S, phi, si, si, S, S)
    _store_tile(nu_ptr, block * S * W, nu, si, sj, S, W)


@triton.jit
def _scan_adjoint_carry_kernel(phi_ptr, nu_ptr, lam_ptr, S, W, n_chunks,
                               BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program per row, serial over chunks backwards: ``lam`` [rows, n_chunks, S, W]
    holds at [row, c] the gradient of the state leaving chunk c through every later
    token; [row, n_chunks − 1] (the final state's gradient) is given."""
    r = tl.program_id(0).to(tl.int64)
    si = tl.arange(0, BLOCK_S)
    sj = tl.arange(0, BLOCK_W)
    lam = _tile(lam_ptr, (r * n_chunks + n_chunks - 1) * S * W, si, sj, S, W)
    for i in range(n_chunks - 1):
        block = r * n_chunks + n_chunks - 1 - i
        phi = _tile(phi_ptr, block * S * S, si, si, S, S)
        lam = tl.dot(tl.trans(phi), lam, input_precision="ieee") + _tile(nu_ptr, block * S * W, si, sj, S, W)
        _store_tile(lam_ptr, (block - 1) * S * W, lam, si, sj, S, W)


@triton.jit
def _scan_backward_kernel(z_ptr, p_ptr, g_ptr, keep_ptr, dr_ptr, de_ptr, carry_ptr, hist_ptr, lam_ptr,
                          dz_ptr, dp_ptr, dg_ptr, dinit_ptr, T, H, S, D, W, chunk, n_chunks, released,
                          BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program (row, chunk), tokens in reverse: λ (the gradient of the state after
    token t) gains the read's gradient, gives dpush = a_push·λ[0] and da (λ against
    the three slot moves of X_t, the push row on top), then steps back through A_tᵀ.
    dgate partials at [row, c]; the first chunk writes the initial state's gradient."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    b = r // H
    h = r % H
    si = tl.arange(0, BLOCK_S)
    sj = tl.arange(0, BLOCK_W)
    above, below = _neighbours(si, BLOCK_S, BLOCK_W)
    first = (si == 0)[:, None]
    has_below = (si + 1 < S)[:, None]
    inside = (si < S)[:, None]
    col_m = tl.where(sj == D, 1.0, 0.0)
    tile = si[:, None] * W + sj[None, :]
    in_state = inside & (sj < W)[None, :]
    g = tl.load(g_ptr + sj, mask=sj < D, other=0.0)
    lam = _tile(lam_ptr, (r * n_chunks + c) * S * W, si, sj, S, W)
    t0 = c * chunk
    n_tok = tl.minimum(chunk, T - t0)
    x_next = _tile(hist_ptr, (r * T + t0 + n_tok - 1) * S * W, si, sj, S, W)
    d_gate = tl.zeros((BLOCK_S, BLOCK_W), dtype=tl.float32)
    for j in range(n_tok):
        t = t0 + n_tok - 1 - j
        if t > t0:
            x = tl.load(hist_ptr + (r * T + t - 1) * S * W + tile, mask=in_state, other=0.0)
        else:
            x = tl.load(carry_ptr + (r * (n_chunks + 1) + c) * S * W + tile, mask=in_state, other=0.0)
        tok = (b * T + t) * H + h
        a0, a1, a2, l0, l1, l2, ent, kept = _actions(z_ptr, tok * 3, tok >= 0, tl.load(keep_ptr + b * T + t))
        _, w, gate_score, m = _scan_read(x_next, g, col_m, si < S, released)
        dr = tl.load(dr_ptr + tok * D + sj, mask=sj < D, other=0.0)
        grad, dscore_m = _scan_read_grad(x_next, g, dr, w, gate_score, m, col_m, released)
        d_gate += dscore_m[:, None] * x_next
        lam += grad
        tl.store(dp_ptr + tok * D + sj, a0 * tl.sum(tl.where(first, lam, 0.0), axis=0), mask=sj < D)
        # da_o = Σ λ ⊙ (what move o brings into each slot): dA_t = λ·X_tᵀ on its three bands
        pushed = tl.load(p_ptr + tok * D + sj, mask=sj < D, other=0.0) + col_m
        da0 = tl.sum(lam * tl.where(first, pushed[None, :], tl.gather(x, above, 0)))
        da1 = tl.sum(lam * tl.where(has_below, tl.gather(x, below, 0), 0.0))
        da2 = tl.sum(lam * x)
        d_ent = tl.load(de_ptr + tok)
        dot = a0 * da0 + a1 * da1 + a2 * da2
        # softmax Jacobian plus dH/dz_o = −a_o·(log a_o + H); a dropped token's actions are constants
        tl.store(dz_ptr + tok * 3, tl.where(kept, a0 * (da0 - dot) - d_ent * a0 * (l0 + ent), 0.0))
        tl.store(dz_ptr + tok * 3 + 1, tl.where(kept, a1 * (da1 - dot) - d_ent * a1 * (l1 + ent), 0.0))
        tl.store(dz_ptr + tok * 3 + 2, tl.where(kept, a2 * (da2 - dot) - d_ent * a2 * (l2 + ent), 0.0))
        # A_tᵀ·λ: slot k went to k+1 on push, to k−1 on pop
        lam_below = tl.where(has_below, tl.gather(lam, below, 0), 0.0)
        lam_above = tl.where(first, 0.0, tl.gather(lam, above, 0))
        lam = tl.where(inside, a0 * lam_below + a1 * lam_above + a2 * lam, 0.0)
        x_next = x
    tl.store(dg_ptr + (r * n_chunks + c) * D + sj, tl.sum(d_gate, axis=0), mask=sj < D)
    if c == 0:
        _store_tile(dinit_ptr, r * S * W, lam, si, sj, S, W)


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


def _state(stack: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[..., S, d] and [..., S] → the scan's state layout [..., S, d + 1]."""
    return torch.cat([stack, mask.unsqueeze(-1)], dim=-1)


def _split_state(state: torch.Tensor, batch: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B·H, S, d + 1] → new (stack [B, H, S, d], mask [B, H, S]) tensors (an op's
    outputs may not alias each other)."""
    rows, S, W = state.shape
    copy = dict(memory_format=torch.contiguous_format)
    return (state[..., :W - 1].reshape(batch, heads, S, W - 1).clone(**copy),
            state[..., W - 1].reshape(batch, heads, S).clone(**copy))


def _scan_forward(logits, push, gate, keep, initial_stack, initial_mask, released, chunk):
    """Reads, entropies and ``carry`` [B·H, n_chunks + 1, S, d + 1]: the state entering
    each chunk, then the final state."""
    B, T, H, D = push.shape
    S, W = initial_stack.shape[2], D + 1
    bs, bw, warps = _scan_config(S, D)
    rows, n = B * H, triton.cdiv(T, chunk)
    carry = empty((rows, n + 1, S, W), dtype=torch.float32, device=push.device)
    carry[:, 0] = _state(initial_stack, initial_mask).reshape(rows, S, W)
    if n > 1:
        phi = empty((rows, n - 1, S, S), dtype=torch.float32, device=push.device)
        y = empty((rows, n - 1, S, W), dtype=torch.float32, device=push.device)
        wrap_triton(_scan_summary_kernel)[(rows, n - 1)](
            logits, push, keep, phi, y, T, H, S, D, W, chunk, n, BLOCK_S=bs, BLOCK_W=bw, num_warps=warps)
        wrap_triton(_scan_carry_kernel)[(rows,)](phi, y, carry, S, W, n, BLOCK_S=bs, BLOCK_W=bw, num_warps=warps)
    read = empty((B, T, H, D), dtype=torch.float32, device=push.device)
    entropy = empty((B, T, H), dtype=torch.float32, device=push.device)
    wrap_triton(_scan_expand_kernel)[(rows, n)](
        logits, push, gate, keep, carry, read, entropy, T, H, S, D, W, chunk, n, int(released),
        BLOCK_S=bs, BLOCK_W=bw, num_warps=warps)
    return read, entropy, carry


@triton_op("laminae::stack_scan", mutates_args=())
def _stack_scan_op(logits: torch.Tensor, push: torch.Tensor, gate: torch.Tensor, keep: torch.Tensor,
                   initial_stack: torch.Tensor, initial_mask: torch.Tensor, released: bool, chunk: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, T, H, 3], push [B, T, H, D], gate [D], keep [B·T], initial state
    [B, H, S, D] / [B, H, S] → (read [B, T, H, D], entropy [B, T, H], final state, and
    the chunks' entering states [B·H, n_chunks + 1, S, D + 1], kept for the backward)."""
    B, T, H, D = push.shape
    S = initial_stack.shape[2]
    read, entropy, carry = _scan_forward(logits, push, gate, keep, initial_stack, initial_mask, released, chunk)
    final_stack, final_mask = _split_state(carry[:, -1], B, H)
    return read, entropy, final_stack, final_mask, carry


@triton_op("laminae::stack_scan_bwd", mutates_args=())
def _stack_scan_bwd_op(logits: torch.Tensor, push: torch.Tensor, gate: torch.Tensor, keep: torch.Tensor,
                       carry: torch.Tensor, released: bool, chunk: int, d_read: torch.Tensor,
                       d_entropy: torch.Tensor, d_final_stack: torch.Tensor, d_final_mask: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, H, D = push.shape
    S, W = carry.shape[2], D + 1
    bs, bw, warps = _scan_config(S, D)
    rows, n = B * H, triton.cdiv(T, chunk)
    dev = push.device
    # every state of the forward, recomputed per chunk (transient) rather than saved
    hist = empty((rows, T, S, W), dtype=torch.float32, device=dev)
    phi = empty((rows, n, S, S), dtype=torch.float32, device=dev)
    nu = empty((rows, n, S, W), dtype=torch.float32, device=dev)
    wrap_triton(_scan_adjoint_summary_kernel)[(rows, n)](
        logits, push, gate, keep, d_read, carry, hist, phi, nu, T, H, S, D, W, chunk, n, int(released),
        BLOCK_S=bs, BLOCK_W=bw, num_warps=warps)
    lam = empty((rows, n, S, W), dtype=torch.float32, device=dev)
    lam[:, n - 1] = _state(d_final_stack, d_final_mask).reshape(rows, S, W)
    if n > 1:
        wrap_triton(_scan_adjoint_carry_kernel)[(rows,)](phi, nu, lam, S, W, n, BLOCK_S=bs, BLOCK_W=bw,
                                                         num_warps=warps)
    d_logits = empty((B, T, H, 3), dtype=torch.float32, device=dev)
    d_push = empty((B, T, H, D), dtype=torch.float32, device=dev)
    partials = empty((rows, n, D), dtype=torch.float32, device=dev)
    d_init = empty((rows, S, W), dtype=torch.float32, device=dev)
    wrap_triton(_scan_backward_kernel)[(rows, n)](
        logits, push, gate, keep, d_read, d_entropy, carry, hist, lam, d_logits, d_push, partials, d_init,
        T, H, S, D, W, chunk, n, int(released), BLOCK_S=bs, BLOCK_W=bw, num_warps=warps)
    return (d_logits, d_push, partials.sum((0, 1)), *_split_state(d_init, B, H))


def _scan_setup(ctx, inputs, output):
    logits, push, gate, keep, initial_stack, initial_mask, released, chunk = inputs
    ctx.released, ctx.chunk = released, chunk
    ctx.mark_non_differentiable(output[4])
    ctx.save_for_backward(logits, push, gate, keep, output[4])


def _scan_backward_autograd(ctx, d_read, d_entropy, d_final_stack, d_final_mask, _d_carry):
    logits, push, gate, keep, carry = ctx.saved_tensors
    B, T, H, D = push.shape
    S = carry.shape[2]
    d_logits, d_push, d_gate, d_init, d_init_mask = _stack_scan_bwd_op(
        logits, push, gate, keep, carry, ctx.released, ctx.chunk,
        _zeros_if_none(d_read, push), _zeros_if_none(d_entropy, entropy_like(logits)),
        _zeros_if_none(d_final_stack, push.new_empty(B, H, S, D)),
        _zeros_if_none(d_final_mask, push.new_empty(B, H, S)))
    return d_logits, d_push, d_gate, None, d_init, d_init_mask, None, None


_stack_scan_op.register_autograd(_scan_backward_autograd, setup_context=_scan_setup)


# ----------------------------------------------------------------------------
# Public functions (signatures of the references)
# ----------------------------------------------------------------------------


def _check_size(num_slots: int, head_dim: int, mode: str = "depth") -> None:
    if not supports(num_slots, head_dim):
        bs, bd = _blocks(num_slots, head_dim)
        raise ConfigError(f"Triton StackMemory keeps one padded state tile of at most {MAX_ROW_TILE} elements "
                          f"per row: stack_slots={num_slots} → {bs}, head_dim={head_dim} → {bd}, {bs * bd} > "
                          f"{MAX_ROW_TILE}; use backend='reference'")
    if not supports(num_slots, head_dim, mode):
        raise ConfigError(f"the Triton temporal scan takes at most {MAX_SCAN_SLOTS} stack slots, got "
                          f"stack_slots={num_slots}; use backend='reference'")


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
    Chunked over ``SCAN_CHUNK`` tokens: T/64 − 1 serial combine steps.
    """
    B, T, H, D = push.shape
    if initial_stack is None:
        initial_stack = torch.zeros(B, H, num_slots, D, device=push.device)
        initial_mask = torch.zeros(B, H, num_slots, device=push.device)
    _check_size(initial_stack.shape[2], D, "temporal")
    logits, push, gate, initial_stack, initial_mask = _f32(logits, push, gate, initial_stack, initial_mask)
    keep = dense_keep_mask(attention_mask, B, T, push.device).reshape(-1).float()
    read, entropy, final_stack, final_mask, _ = _stack_scan_op(
        logits, push, gate, keep, initial_stack, initial_mask, read_mode == "released", SCAN_CHUNK)
    return read, entropy, final_stack, final_mask


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


def _scan_block_pairs():
    """Every (BLOCK_S, BLOCK_W) the temporal scan launches with: those of every
    supported (slots, head width)."""
    top = MAX_ROW_TILE // MIN_BLOCK
    return sorted({_scan_config(s, d)[:2] for s in range(1, top + 1) for d in range(1, top + 1)
                   if supports(s, d, "temporal")})


def static_cases() -> Iterator[StaticCase]:
    """Every kernel at every tile configuration the launchers can pick, with their
    num_warps. Inputs are always fp32 (the state's dtype by design). Every pointer
    compiles 16-byte aligned (``divisible``), as Triton's launcher specialises it: the
    inputs pass through a contiguous fp32 copy (logits and push are column slices of
    one projection, so always copied), gradients arrive contiguous, outputs and the
    scan's work buffers are fresh allocations. Of the integers the scan's chunk
    (SCAN_CHUNK, 64 at every launch) and ``released`` are declared: it is 0 at the
    default soft read, and Triton's launcher makes the 1 of a released read a constant
    (a binary of its own). The others vary within a tile."""
    f = "*fp32"
    for bs, bd in _block_pairs():
        step = dict(BLOCK_R=_step_rows(bs, bd), BLOCK_S=bs, BLOCK_D=bd)
        ints = dict(n_rows="i32", H="i32", S="i32", D="i32", released="i32")
        fwd = dict(z_ptr=f, p_ptr=f, st_ptr=f, m_ptr=f, g_ptr=f, keep_ptr=f, read_ptr=f, nst_ptr=f, nm_ptr=f,
                   ent_ptr=f)
        bwd = dict(z_ptr=f, p_ptr=f, st_ptr=f, m_ptr=f, g_ptr=f, keep_ptr=f, dr_ptr=f, dn_ptr=f, dnm_ptr=f, de_ptr=f,
                   dz_ptr=f, dp_ptr=f, dst_ptr=f, dm_ptr=f, dg_ptr=f)
        yield StaticCase("stack_step_fwd", _stack_step_fwd_kernel, dict(fwd, **ints), step, STEP_WARPS,
                         divisible=(*fwd, "released"))
        yield StaticCase("stack_step_bwd", _stack_step_bwd_kernel, dict(bwd, **ints), step, STEP_BWD_WARPS,
                         divisible=(*bwd, "released"))
    sizes = dict(T="i32", H="i32", S="i32", D="i32", W="i32", chunk="i32", n_chunks="i32")
    inputs = dict(z_ptr=f, p_ptr=f, g_ptr=f, keep_ptr=f)
    kernels = [
        ("stack_scan_summary", _scan_summary_kernel,
         dict(z_ptr=f, p_ptr=f, keep_ptr=f, phi_ptr=f, y_ptr=f, **sizes)),
        ("stack_scan_carry", _scan_carry_kernel,
         dict(phi_ptr=f, y_ptr=f, carry_ptr=f, S="i32", W="i32", n_chunks="i32")),
        ("stack_scan_expand", _scan_expand_kernel,
         dict(**inputs, carry_ptr=f, read_ptr=f, ent_ptr=f, **sizes, released="i32")),
        ("stack_scan_adjoint_summary", _scan_adjoint_summary_kernel,
         dict(**inputs, dr_ptr=f, carry_ptr=f, hist_ptr=f, phi_ptr=f, nu_ptr=f, **sizes, released="i32")),
        ("stack_scan_adjoint_carry", _scan_adjoint_carry_kernel,
         dict(phi_ptr=f, nu_ptr=f, lam_ptr=f, S="i32", W="i32", n_chunks="i32")),
        ("stack_scan_backward", _scan_backward_kernel,
         dict(**inputs, dr_ptr=f, de_ptr=f, carry_ptr=f, hist_ptr=f, lam_ptr=f, dz_ptr=f, dp_ptr=f, dg_ptr=f,
              dinit_ptr=f, **sizes, released="i32")),
    ]
    for bs, bw in _scan_block_pairs():
        warps = _scan_warps(bs, bw)
        for name, kernel, signature in kernels:
            aligned = tuple(k for k, v in signature.items() if v.startswith("*"))
            aligned += tuple(k for k in ("chunk", "released") if k in signature)
            yield StaticCase(name, kernel, signature, dict(BLOCK_S=bs, BLOCK_W=bw), warps, divisible=aligned)


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
    depth = dict(inputs, num_heads=H, num_slots=S, mode="depth")
    # temporal: one sequence over two chunks of the scan (the second ragged), two heads,
    # padding holes on both sides of the chunk boundary
    Ht, Tt = 2, SCAN_CHUNK + 3
    keep = torch.ones(1, Tt, dtype=torch.bool)
    keep[0, [0, SCAN_CHUNK - 1, SCAN_CHUNK + 1]] = False
    temporal = dict(inputs, x=torch.randn(1, Tt, D, generator=gen).to(device),
                    action_weight=inputs["action_weight"][:3 * Ht], down_weight=inputs["down_weight"][:Ht * d],
                    up_weight=inputs["up_weight"][:, :Ht * d],
                    stack=inputs["stack"][:1, 0, :Ht], stack_mask=inputs["stack_mask"][:1, 0, :Ht],
                    attention_mask=keep.to(device), num_heads=Ht, num_slots=S, mode="temporal")
    return [TourCase(f"stack_memory (depth, H={H}, S={S}, d={d})", stack_memory, stack_memory_reference, depth, grads),
            TourCase(f"stack_memory (temporal, H={Ht}, S={S}, d={d}, T={Tt}: two chunks, padding)", stack_memory,
                     stack_memory_reference, temporal, grads)]
