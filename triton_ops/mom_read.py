"""MoM read kernels: per-token attention over the ``Tk·bs`` selected bank slots only,
on the tensor cores.

Inputs (see :func:`laminae.primitives.mom_read.mom_read_reference`): ``q`` ``[B, S, H, hd]``,
bank keys/values ``[E·bs, H·hd]`` shared by the batch, ``top_idx`` ``[B, S, Tk]`` and
fp32 log-gates ``lg = log(max(g, 1e-9))`` ``[B, S, Tk]`` (computed in torch, so autograd
carries the gate gradient through the clamp and the router). No dense ``[B, S, E·bs]``
bias exists anywhere: a slot outside a token's selected blocks is never loaded.

Schedule (torch, on device, no host sync): the B·S·Tk routed pairs (token, t) are
stably sorted by their block (``torch.sort``); ``torch.searchsorted`` on the sorted
block ids gives each block's pair range, and a fixed-size tile table lists
(block, first pair, end) for every run of ``BLOCK_M`` pairs of one block, as in a
grouped MoE GEMM. Its length is the static bound ``min(P, ⌈P/BLOCK_M⌉ + E)``; table
rows past the real tile count are empty and their programs exit at once. All the
pairs of a tile read the same block, so the ``[BLOCK_M, hd]`` query tile meets each
``[BLOCK_N, hd]`` key/value chunk with one ``tl.dot``.

Forward   ``_mom_fwd_pairs_kernel``, grid (tiles, H): a flash forward of the tile's
          pairs over their block (online softmax, no bias) writes each pair's
          normalised partial ō_p in the input dtype (a convex combination of v
          rows, so one 16-bit rounding of it costs what the output's own rounding
          does, at half the bytes of fp32) and its base-2 log-partition L_p (fp32).
          ``_mom_merge_kernel``, grid (token tiles, H): merges the Tk partials of a
          token with its log-gates, a_t = lg_t·log2e + L_t: o = Σ_t e^{a_t−M} ō_t /
          Σ_t e^{a_t−M}, LSE = M + log Σ_t e^{a_t−M}.
Backward  ``_mom_bwd_dq_kernel``, grid (tiles, H): δ = dO·o, recomputed
          P = exp(q·k/√hd + lg_t − LSE), dS = P (dO·v − δ); writes each pair's dq
          partial in the input dtype, the block mass W_t = Σ_j P_j and
          c_t = Σ_j P_j dP_j per pair and head (torch forms dlg_t = Σ_t' (W_t' c_t −
          W_t c_t'), a pairwise form free of the cancellation c_t − W_t·δ has when
          W_t ≈ 1), and each sorted pair's shift LSE − lg_t and δ for the next kernel.
          ``_mom_dq_merge_kernel``, grid (token tiles, H): dq = Σ_t partials, in fp32
          and t order, written once in the input dtype.
          ``_mom_bwd_dkdv_kernel``, grid (E · slot chunks, H): each program owns a
          chunk of one block's slots and loops over all pair tiles of that block,
          accumulating dKᵀ, dVᵀ ``[hd, BLOCK_N]`` on chip (head dim as the MMA's M, so
          a 64-row wgmma needs no 64-slot block): deterministic, no atomics, exactly 0
          for unselected blocks.

Head dims are padded to ``max(16, next_power_of_2(hd))`` with masked loads. Offsets
are int32 (``mom_read`` rejects a ``q`` with Tk·B·S·H·hd ≥ 2³¹ elements or such a bank):
64-bit per-element address math costs registers the tiles need. fp32 accumulation for every dtype; fp32 inputs
take exact ("ieee") products on the FMA units.
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import DTypeError, ShapeError
from laminae.primitives._validation import check_same_device, check_tensor, debug_checks_enabled
from laminae.primitives.mom_read import mom_log_gates

from ._common import StaticCase, dot_precision, empty, triton_dtype

__all__ = ["mom_read", "mom_read_fwd", "MoMTiles", "tiles", "pair_schedule", "static_cases", "tour_case",
           "MAX_HEAD_DIM"]

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 128


# ----------------------------------------------------------------------------
# Tile helpers
# ----------------------------------------------------------------------------


@triton.jit
def _tile_pairs(tile_ptr, order_ptr, TK, BLOCK_M: tl.constexpr):
    """Whether the tile holds pairs (table rows past the real tile count do not), its
    block, sorted pair positions, their validity, original pair index and token."""
    tile = tl.program_id(0)
    e = tl.load(tile_ptr + tile * 3)
    lo = tl.load(tile_ptr + tile * 3 + 1)
    hi = tl.load(tile_ptr + tile * 3 + 2)
    pm = lo + tl.arange(0, BLOCK_M)
    ok = pm < hi
    orig = tl.load(order_ptr + pm, mask=ok, other=0)
    return lo < hi, e, pm, ok, orig, orig // TK


@triton.jit
def _head_columns(H, HD, BLOCK_D: tl.constexpr):
    """This program's head (grid axis 1), the row width D = H·HD, the head's columns
    in a row and their validity."""
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    return h, H * HD, h * HD + offs_d, offs_d < HD


@triton.jit
def _block_slots(e, start, BS, BLOCK_N: tl.constexpr):
    """Bank rows ``start..start+BLOCK_N`` of block e and which of them lie inside it."""
    j = start + tl.arange(0, BLOCK_N)
    return e * BS + j, j < BS


@triton.jit
def _rows(ptr, rows, row_ok, col, d_ok, D):
    """``[len(rows), BLOCK_D]`` tile of a row-major ``[*, D]`` tensor, zero outside."""
    return tl.load(ptr + rows[:, None] * D + col[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _cols(ptr, rows, row_ok, col, d_ok, D):
    """The same tile transposed, ``[BLOCK_D, len(rows)]``: a dot's K-major operand."""
    return tl.load(ptr + rows[None, :] * D + col[:, None], mask=d_ok[:, None] & row_ok[None, :], other=0.0)


@triton.jit
def _probs_and_ds(q, do, kt, vt, shift, delta, valid, qk_scale, PRECISION: tl.constexpr):
    """Recomputed P = exp2(q·kᵀ·scale − shift), dP = dO·vᵀ and dS = P (dP − δ), all
    ``[pairs, slots]`` fp32; P is exactly 0 where ``valid`` is False."""
    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
    p = tl.where(valid, tl.exp2(s - shift[:, None]), 0.0)
    dp = tl.dot(do, vt, input_precision=PRECISION)
    return p, dp, p * (dp - delta[:, None])


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _mom_fwd_pairs_kernel(q_ptr, k_ptr, v_ptr, order_ptr, tile_ptr, part_o_ptr, part_lse_ptr,
                          H, HD, TK, BS, qk_scale,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          PRECISION: tl.constexpr):
    live, e, pm, p_ok, orig, tok = _tile_pairs(tile_ptr, order_ptr, TK, BLOCK_M)
    if live:
        h, D, col, d_ok = _head_columns(H, HD, BLOCK_D)
        q = _rows(q_ptr, tok, p_ok, col, d_ok, D)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for start in range(0, BS, BLOCK_N):
            slots, j_ok = _block_slots(e, start, BS, BLOCK_N)
            kt = _cols(k_ptr, slots, j_ok, col, d_ok, D)
            s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
            s = tl.where(j_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            corr = tl.exp2(m - m_new)
            v = _rows(v_ptr, slots, j_ok, col, d_ok, D)
            l = l * corr + tl.sum(p, axis=1)
            acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = orig[:, None] * D + col[None, :]
        # one reciprocal per row: a [BLOCK_M, BLOCK_D] IEEE division costs registers and stack
        tl.store(part_o_ptr + out, (acc * (1.0 / l)[:, None]).to(part_o_ptr.dtype.element_ty),
                 mask=p_ok[:, None] & d_ok[None, :])
        tl.store(part_lse_ptr + orig * H + h, m + tl.log2(l), mask=p_ok)


@triton.jit
def _mom_merge_kernel(part_o_ptr, part_lse_ptr, lg_ptr, o_ptr, lse_ptr,
                      N, H, HD, TK,
                      BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    h, D, col, d_ok = _head_columns(H, HD, BLOCK_D)
    n = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n_ok = n < N
    big_m = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    big_l = tl.zeros((BLOCK_T,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for t in range(0, TK):
        pair = n * TK + t
        a = tl.load(part_lse_ptr + pair * H + h, mask=n_ok, other=0.0) \
            + tl.load(lg_ptr + pair, mask=n_ok, other=0.0) * 1.4426950408889634
        m_next = tl.maximum(big_m, a)
        c_old = tl.exp2(big_m - m_next)
        c_t = tl.exp2(a - m_next)
        big_l = big_l * c_old + c_t
        acc = acc * c_old[:, None] + c_t[:, None] * _rows(part_o_ptr, pair, n_ok, col, d_ok, D).to(tl.float32)
        big_m = m_next
    tl.store(o_ptr + n[:, None] * D + col[None, :], (acc * (1.0 / big_l)[:, None]).to(o_ptr.dtype.element_ty),
             mask=n_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + n * H + h, (big_m + tl.log2(big_l)) * 0.6931471805599453, mask=n_ok)


@triton.jit
def _mom_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, lg_ptr, order_ptr, tile_ptr,
                       dq_part_ptr, wc_ptr, shift_ptr, delta_ptr,
                       H, HD, TK, BS, qk_scale, sm_scale,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       PRECISION: tl.constexpr):
    live, e, pm, p_ok, orig, tok = _tile_pairs(tile_ptr, order_ptr, TK, BLOCK_M)
    if live:
        h, D, col, d_ok = _head_columns(H, HD, BLOCK_D)
        q = _rows(q_ptr, tok, p_ok, col, d_ok, D)
        do = _rows(do_ptr, tok, p_ok, col, d_ok, D)
        delta = tl.sum(do.to(tl.float32) * _rows(o_ptr, tok, p_ok, col, d_ok, D).to(tl.float32), axis=1)
        shift = (tl.load(lse_ptr + tok * H + h, mask=p_ok, other=0.0)
                 - tl.load(lg_ptr + orig, mask=p_ok, other=0.0)) * 1.4426950408889634
        # per sorted pair, so the dK/dV kernel reads them contiguously
        tl.store(shift_ptr + pm * H + h, shift, mask=p_ok)
        tl.store(delta_ptr + pm * H + h, delta, mask=p_ok)
        dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        mass = tl.zeros((BLOCK_M,), dtype=tl.float32)   # W_t = Σ_j P_j
        mdp = tl.zeros((BLOCK_M,), dtype=tl.float32)    # c_t = Σ_j P_j dP_j
        for start in range(0, BS, BLOCK_N):
            slots, j_ok = _block_slots(e, start, BS, BLOCK_N)
            kt = _cols(k_ptr, slots, j_ok, col, d_ok, D)
            vt = _cols(v_ptr, slots, j_ok, col, d_ok, D)
            p, dp, ds = _probs_and_ds(q, do, kt, vt, shift, delta, j_ok[None, :], qk_scale, PRECISION)
            dq += tl.dot(ds.to(q.dtype), tl.trans(kt), input_precision=PRECISION)
            mass += tl.sum(p, axis=1)
            mdp += tl.sum(p * dp, axis=1)
        tl.store(dq_part_ptr + orig[:, None] * D + col[None, :], (dq * sm_scale).to(dq_part_ptr.dtype.element_ty),
                 mask=p_ok[:, None] & d_ok[None, :])
        wc = wc_ptr + (orig * H + h) * 2
        tl.store(wc, mass, mask=p_ok)
        tl.store(wc + 1, mdp, mask=p_ok)


@triton.jit
def _mom_dq_merge_kernel(dq_part_ptr, dq_ptr, N, H, HD, TK,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """dq = Σ_t dq_part[token, t] in fp32, in t order (deterministic), written once in
    q's dtype."""
    h, D, col, d_ok = _head_columns(H, HD, BLOCK_D)
    n = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n_ok = n < N
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for t in range(0, TK):
        acc += _rows(dq_part_ptr, n * TK + t, n_ok, col, d_ok, D).to(tl.float32)
    tl.store(dq_ptr + n[:, None] * D + col[None, :], acc.to(dq_ptr.dtype.element_ty),
             mask=n_ok[:, None] & d_ok[None, :])


@triton.jit
def _mom_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, order_ptr, offsets_ptr, shift_ptr, delta_ptr, dk_ptr, dv_ptr,
                         H, HD, TK, BS, qk_scale, sm_scale,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    chunks = tl.cdiv(BS, BLOCK_N)
    e = pid // chunks
    h, D, col, d_ok = _head_columns(H, HD, BLOCK_D)
    slots, j_ok = _block_slots(e, (pid % chunks) * BLOCK_N, BS, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    kt = _cols(k_ptr, slots, j_ok, col, d_ok, D)
    vt = _cols(v_ptr, slots, j_ok, col, d_ok, D)
    dkt = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    dvt = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    for p0 in range(lo, hi, BLOCK_M):
        pm = p0 + offs_m
        p_ok = pm < hi
        tok = tl.load(order_ptr + pm, mask=p_ok, other=0) // TK
        q = _rows(q_ptr, tok, p_ok, col, d_ok, D)
        do = _rows(do_ptr, tok, p_ok, col, d_ok, D)
        shift = tl.load(shift_ptr + pm * H + h, mask=p_ok, other=0.0)
        delta = tl.load(delta_ptr + pm * H + h, mask=p_ok, other=0.0)
        p, dp, ds = _probs_and_ds(q, do, kt, vt, shift, delta, p_ok[:, None] & j_ok[None, :], qk_scale, PRECISION)
        dvt += tl.dot(tl.trans(do), p.to(do.dtype), input_precision=PRECISION)
        dkt += tl.dot(tl.trans(q), ds.to(q.dtype), input_precision=PRECISION)
    out = slots[None, :] * D + col[:, None]
    kv_mask = d_ok[:, None] & j_ok[None, :]
    tl.store(dk_ptr + out, (dkt * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out, dvt.to(dv_ptr.dtype.element_ty), mask=kv_mask)


# ----------------------------------------------------------------------------
# Tiles and schedule
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MoMTiles:
    """``block_m``/``block_n``: pairs per tile and slots per chunk of the forward and
    dq kernels (``fwd_warps``/``dq_warps``); ``dkdv_m``/``dkdv_n``/``dkdv_warps``: the
    same for the dK/dV kernel; ``merge_t``: tokens per merge program; ``stages``:
    software-pipelining depth of the slot/pair loops. ``block_*`` ≥ 16 (``tl.dot``)."""

    block_m: int
    block_n: int
    fwd_warps: int
    dq_warps: int
    dkdv_m: int
    dkdv_n: int
    dkdv_warps: int
    merge_t: int
    stages: int = 2


# Keyed by BLOCK_D; sized for sm_90 and checked spill-free by the static check.
# 16-bit: 64-row pair tiles (one warpgroup's wgmma M); the dK/dV accumulators are
# [hd, BLOCK_N], so hd is their M. fp32 takes exact products on the FMA units with
# operands in registers: smaller tiles. The merge streams 1K elements per program.
_TILES_16BIT: dict[int, MoMTiles] = {
    16: MoMTiles(64, 64, 4, 4, 64, 64, 4, 64),
    32: MoMTiles(64, 64, 4, 4, 64, 64, 4, 32),
    64: MoMTiles(64, 64, 4, 4, 64, 64, 8, 16),
    128: MoMTiles(64, 32, 8, 8, 64, 32, 8, 8),
}
_TILES_FP32: dict[int, MoMTiles] = {
    16: MoMTiles(32, 32, 4, 4, 32, 32, 4, 64),
    32: MoMTiles(32, 32, 8, 4, 16, 32, 4, 32),
    64: MoMTiles(32, 32, 4, 8, 16, 32, 8, 16),
    128: MoMTiles(16, 32, 8, 8, 16, 16, 8, 8),
}


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def tiles(head_dim: int, dtype: torch.dtype) -> MoMTiles:
    """Launch tiles for ``head_dim`` and the input dtype (tests may monkeypatch this to
    force small tiles, so small blocks still span several chunks and pair tiles)."""
    return (_TILES_FP32 if dtype == torch.float32 else _TILES_16BIT)[block_d(head_dim)]


def _narrowest_chunk(dtype: torch.dtype) -> int:
    # fp32's FMA dots at 16-slot chunks left ptxas a few bytes of stack in two configurations
    return 32 if dtype == torch.float32 else 16


def fit_chunks(t: MoMTiles, block_size: int, dtype: torch.dtype) -> MoMTiles:
    """Slot chunks no wider than the block (a power of two ≥ 16, as ``tl.dot`` needs):
    a 64-slot chunk over a 16-slot block would spend 3/4 of its dot and exp work on
    masked slots."""
    cap = max(_narrowest_chunk(dtype), triton.next_power_of_2(block_size))
    return dataclasses.replace(t, block_n=min(t.block_n, cap), dkdv_n=min(t.dkdv_n, cap))


def _chunk_widths(widest: int, dtype: torch.dtype) -> list[int]:
    """The slot-chunk widths :func:`fit_chunks` can launch up to ``widest``."""
    return [w for w in (16, 32, 64) if _narrowest_chunk(dtype) <= w < widest] + [widest]


class PairSchedule(NamedTuple):
    order: torch.Tensor     # [P] int32: original pair index (token·Tk + t) of each sorted pair
    offsets: torch.Tensor   # [E + 1] int32: block e's sorted pairs are offsets[e]:offsets[e + 1]
    tiles: torch.Tensor     # [T, 3] int32: (block, first sorted pair, block end); empty rows lo = hi


def pair_schedule(top_idx: torch.Tensor, num_blocks: int, block_m: int) -> PairSchedule:
    """Group the routed pairs by block, on device and without a host sync.

    The tile table has the static length ``min(P, ⌈P/block_m⌉ + E)`` ≥ Σ_e ⌈c_e/block_m⌉.
    Out-of-range block ids sort outside every [offsets[e], offsets[e+1]) range, so
    no kernel reads a bank row for them."""
    flat = top_idx.reshape(-1)
    device = flat.device
    sorted_blocks, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_blocks + 1, device=device, dtype=sorted_blocks.dtype)
    offsets = torch.searchsorted(sorted_blocks, bounds)
    ntiles = torch.div(offsets[1:] - offsets[:-1] + block_m - 1, block_m, rounding_mode="floor")
    ends = torch.cumsum(ntiles, 0)
    pairs = flat.numel()
    tile_id = torch.arange(min(pairs, triton.cdiv(pairs, block_m) + num_blocks), device=device)
    block = torch.searchsorted(ends, tile_id, right=True)
    used = block < num_blocks
    block = block.clamp_max(num_blocks - 1)
    lo = offsets[block] + (tile_id - ends[block] + ntiles[block]) * block_m
    hi = offsets[block + 1]
    lo = torch.where(used, lo, hi)
    table = torch.stack([block, lo, hi], 1).to(torch.int32).contiguous()
    return PairSchedule(order.to(torch.int32), offsets.to(torch.int32), table)


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _scales(head_dim: int) -> tuple[float, float]:
    sm_scale = 1.0 / math.sqrt(head_dim)
    return sm_scale * LOG2E, sm_scale


@triton_op("laminae::mom_read_fwd", mutates_args=())
def mom_read_fwd(q: torch.Tensor, k_bank: torch.Tensor, v_bank: torch.Tensor, top_idx: torch.Tensor,
                 log_gates: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, S, H, hd], lse [B, S, H] fp32)`` for contiguous q/k/v, int64 ``top_idx``
    and fp32 ``log_gates`` ``[B, S, Tk]``."""
    B, S, H, hd = q.shape
    tk = top_idx.shape[-1]
    num_blocks = k_bank.shape[0] // block_size
    t = fit_chunks(tiles(hd, q.dtype), block_size, q.dtype)
    bd = block_d(hd)
    qk_scale, _ = _scales(hd)
    sched = pair_schedule(top_idx, num_blocks, t.block_m)
    part_o = empty((B, S, tk, H, hd), dtype=q.dtype, device=q.device)
    part_lse = empty((B, S, tk, H), dtype=torch.float32, device=q.device)
    wrap_triton(_mom_fwd_pairs_kernel)[(sched.tiles.shape[0], H)](
        q, k_bank, v_bank, sched.order, sched.tiles, part_o, part_lse, H, hd, tk, block_size, qk_scale,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=bd, PRECISION=dot_precision(q.dtype),
        num_warps=t.fwd_warps, num_stages=t.stages,
    )
    o = empty(q.shape, dtype=q.dtype, device=q.device)
    lse = empty((B, S, H), dtype=torch.float32, device=q.device)
    wrap_triton(_mom_merge_kernel)[(triton.cdiv(B * S, t.merge_t), H)](
        part_o, part_lse, log_gates, o, lse, B * S, H, hd, tk, BLOCK_T=t.merge_t, BLOCK_D=bd, num_warps=4, num_stages=1,
    )
    return o, lse


@triton_op("laminae::mom_read_bwd", mutates_args=())
def _mom_read_bwd(do: torch.Tensor, q: torch.Tensor, k_bank: torch.Tensor, v_bank: torch.Tensor,
                  top_idx: torch.Tensor, log_gates: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, S, H, hd = q.shape
    tk = top_idx.shape[-1]
    num_blocks = k_bank.shape[0] // block_size
    t = fit_chunks(tiles(hd, q.dtype), block_size, q.dtype)
    qk_scale, sm_scale = _scales(hd)
    bd = block_d(hd)
    precision = dot_precision(q.dtype)
    sched = pair_schedule(top_idx, num_blocks, t.block_m)
    dq_part = empty((B, S, tk, H, hd), dtype=q.dtype, device=q.device)
    wc = empty((B, S, tk, H, 2), dtype=torch.float32, device=q.device)
    shift = empty((B * S * tk, H), dtype=torch.float32, device=q.device)
    delta = empty((B * S * tk, H), dtype=torch.float32, device=q.device)
    wrap_triton(_mom_bwd_dq_kernel)[(sched.tiles.shape[0], H)](
        q, k_bank, v_bank, o, do, lse, log_gates, sched.order, sched.tiles, dq_part, wc, shift, delta,
        H, hd, tk, block_size, qk_scale, sm_scale,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=bd, PRECISION=precision,
        num_warps=t.dq_warps, num_stages=t.stages,
    )
    dk = empty(k_bank.shape, dtype=k_bank.dtype, device=q.device)
    dv = empty(v_bank.shape, dtype=v_bank.dtype, device=q.device)
    wrap_triton(_mom_bwd_dkdv_kernel)[(num_blocks * triton.cdiv(block_size, t.dkdv_n), H)](
        q, k_bank, v_bank, do, sched.order, sched.offsets, shift, delta, dk, dv,
        H, hd, tk, block_size, qk_scale, sm_scale,
        BLOCK_M=t.dkdv_m, BLOCK_N=t.dkdv_n, BLOCK_D=bd, PRECISION=precision,
        num_warps=t.dkdv_warps, num_stages=t.stages,
    )
    dq = empty(q.shape, dtype=q.dtype, device=q.device)
    wrap_triton(_mom_dq_merge_kernel)[(triton.cdiv(B * S, t.merge_t), H)](
        dq_part, dq, B * S, H, hd, tk, BLOCK_T=t.merge_t, BLOCK_D=bd, num_warps=4, num_stages=1,
    )
    # dlg_t = Σ_{j∈t} P_j (dP_j − δ) = c_t − W_t·Σ_t' c_t' (δ = Σ_t' c_t', Σ_t' W_t' = 1)
    #       = Σ_t' (W_t' c_t − W_t c_t'),
    # the pairwise form: when one block holds almost all the mass (W_t ≈ 1, c_t ≈ δ)
    # every term is still a product of small numbers, where c_t − W_t·δ would cancel.
    mass, mdp = wc.transpose(2, 3).unbind(-1)                         # [B, S, H, Tk]
    pairwise = mass.unsqueeze(-2) * mdp.unsqueeze(-1) - mass.unsqueeze(-1) * mdp.unsqueeze(-2)
    return dq, dk, dv, pairwise.sum(-1).sum(2)


def _setup_context(ctx, inputs, output):
    q, k_bank, v_bank, top_idx, log_gates, block_size = inputs
    o, lse = output
    ctx.block_size = block_size
    ctx.save_for_backward(q, k_bank, v_bank, top_idx, log_gates, o, lse)


def _backward(ctx, do, _dlse):
    q, k_bank, v_bank, top_idx, log_gates, o, lse = ctx.saved_tensors
    dq, dk, dv, dlg = _mom_read_bwd(do.contiguous(), q, k_bank, v_bank, top_idx, log_gates, o, lse,
                                    ctx.block_size)
    return dq, dk, dv, None, dlg, None


mom_read_fwd.register_autograd(_backward, setup_context=_setup_context)


def check_block_indices(top_idx: torch.Tensor, num_blocks: int) -> None:
    """Indices in [0, E) and distinct per token. Reads values back to the host: a
    debug check, not on the hot path."""
    if bool(((top_idx < 0) | (top_idx >= num_blocks)).any()):
        raise ValueError(f"`top_idx` values must lie in [0, {num_blocks})")
    srt = top_idx.sort(dim=-1).values
    if top_idx.shape[-1] > 1 and bool((srt[..., 1:] == srt[..., :-1]).any()):
        raise ValueError("`top_idx` repeats a block within a token; selected blocks must be distinct")


def mom_read(
    q: torch.Tensor,
    k_bank: torch.Tensor,
    v_bank: torch.Tensor,
    top_idx: torch.Tensor,
    top_gates: torch.Tensor,
    block_size: int,
    bias_in_activation_dtype: bool = False,
    validate: bool | None = None,
) -> torch.Tensor:
    """Triton MoM read with the signature of
    :func:`laminae.primitives.mom_read.mom_read_reference`.

    ``q`` ``[B, S, H, hd]`` (hd ≤ 128), ``k_bank``/``v_bank`` ``[E·bs, H·hd]`` (one dtype
    among fp32/bf16/fp16), ``top_idx`` ``[B, S, Tk]`` integer, distinct per token,
    in [0, E), ``top_gates`` ``[B, S, Tk]``. Differentiable in q, k_bank, v_bank and
    top_gates; returns ``[B, S, H, hd]`` in ``q``'s dtype.

    Shapes, dtypes and devices are always checked; the index values only with
    ``validate=True`` (default: ``LAMINAE_DEBUG=1``), since that check syncs with the
    host. Unchecked out-of-range indices read nothing (their pairs' outputs are
    undefined) and repeated ones give undefined results.
    """
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"Triton MoM read supports fp32/bf16/fp16 inputs, got {getattr(q, 'dtype', type(q))}")
    check_tensor("q", q, ndim=4, layout="[batch, seq, num_heads, head_dim]")
    B, S, H, hd = q.shape
    if S == 0:
        raise ShapeError(f"`q` must hold at least one token, got shape {tuple(q.shape)}")
    if hd > MAX_HEAD_DIM:
        raise ShapeError(f"Triton MoM read supports head_dim <= {MAX_HEAD_DIM}, got {hd}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ShapeError(f"`block_size` must be a positive int, got {block_size!r}")
    check_tensor("k_bank", k_bank, shape=(None, H * hd), dtypes=(q.dtype,), layout="[slots, num_heads * head_dim]")
    check_tensor("v_bank", v_bank, shape=tuple(k_bank.shape), dtypes=(q.dtype,),
                 layout="[slots, num_heads * head_dim]")
    slots = k_bank.shape[0]
    if slots == 0 or slots % block_size:
        raise ShapeError(f"bank rows ({slots}) must be a positive multiple of block_size ({block_size})")
    num_blocks = slots // block_size
    integer = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
    check_tensor("top_idx", top_idx, shape=(B, S, None), dtypes=integer, layout="[batch, seq, top_blocks]")
    tk = top_idx.shape[-1]
    if not 1 <= tk <= num_blocks:
        raise ShapeError(f"`top_idx` must select 1..{num_blocks} blocks per token, got {tk}")
    check_tensor("top_gates", top_gates, shape=(B, S, tk), layout="[batch, seq, top_blocks]")
    check_same_device(q=q, k_bank=k_bank, v_bank=v_bank, top_idx=top_idx, top_gates=top_gates)
    if tk * q.numel() >= 2**31 or k_bank.numel() >= 2**31:
        raise ShapeError(f"the Triton MoM read indexes with int32: top_blocks · q.numel() ({tk * q.numel()}) and "
                         f"k_bank.numel() ({k_bank.numel()}) must stay below 2**31")
    if (debug_checks_enabled() if validate is None else validate) and not torch.compiler.is_compiling():
        check_block_indices(top_idx, num_blocks)
    lg = mom_log_gates(top_gates, q.dtype if bias_in_activation_dtype else None).float()
    o, _ = mom_read_fwd(q.contiguous(), k_bank.contiguous(), v_bank.contiguous(),
                        top_idx.to(torch.int64).contiguous(), lg.contiguous(), block_size)
    return o


# ----------------------------------------------------------------------------
# Static configurations and tour
# ----------------------------------------------------------------------------


def static_cases() -> Iterator[StaticCase]:
    """Every (dtype, padded head dim, slot-chunk width) configuration of the four
    kernels, with the warps and stages they launch with; 16-bit matmul-shaped kernels at head dim 64/128
    must build to Hopper's wgmma. Every pointer is a contiguous input or a fresh tensor,
    16-byte aligned at launch, and at the tiles of head dims 64 and 128 the head dim HD
    is a multiple of 16: Triton specialises both (``divisible``)."""
    for case in _static_cases():
        pointers = tuple(k for k, v in case.signature.items() if v.startswith("*"))
        head_dim = ("HD",) if case.constexprs["BLOCK_D"] in (64, 128) else ()
        yield dataclasses.replace(case, divisible=pointers + head_dim)


def _static_cases() -> Iterator[StaticCase]:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dt = triton_dtype(dtype)
        p = f"*{dt}"
        prec = dot_precision(dtype)
        table = _TILES_FP32 if dtype == torch.float32 else _TILES_16BIT
        for bd, t in table.items():
            tags = {"dtype": dt}
            expect = "HGMMA" if dtype != torch.float32 and bd in (64, 128) else ""
            for bn in _chunk_widths(t.block_n, dtype):
                yield StaticCase("mom_fwd_pairs", _mom_fwd_pairs_kernel,
                                 dict(q_ptr=p, k_ptr=p, v_ptr=p, order_ptr="*i32", tile_ptr="*i32", part_o_ptr=p,
                                      part_lse_ptr="*fp32", H="i32", HD="i32", TK="i32", BS="i32", qk_scale="fp32"),
                                 dict(BLOCK_M=t.block_m, BLOCK_N=bn, BLOCK_D=bd, PRECISION=prec),
                                 t.fwd_warps, t.stages, tags=tags, expect=expect)
                yield StaticCase("mom_bwd_dq", _mom_bwd_dq_kernel,
                                 dict(q_ptr=p, k_ptr=p, v_ptr=p, o_ptr=p, do_ptr=p, lse_ptr="*fp32", lg_ptr="*fp32",
                                      order_ptr="*i32", tile_ptr="*i32", dq_part_ptr=p, wc_ptr="*fp32",
                                      shift_ptr="*fp32", delta_ptr="*fp32",
                                      H="i32", HD="i32", TK="i32", BS="i32", qk_scale="fp32", sm_scale="fp32"),
                                 dict(BLOCK_M=t.block_m, BLOCK_N=bn, BLOCK_D=bd, PRECISION=prec),
                                 t.dq_warps, t.stages, tags=tags, expect=expect)
            yield StaticCase("mom_merge", _mom_merge_kernel,
                             dict(part_o_ptr=p, part_lse_ptr="*fp32", lg_ptr="*fp32", o_ptr=p, lse_ptr="*fp32",
                                  N="i32", H="i32", HD="i32", TK="i32"),
                             dict(BLOCK_T=t.merge_t, BLOCK_D=bd), 4, 1, tags=tags)
            yield StaticCase("mom_dq_merge", _mom_dq_merge_kernel,
                             dict(dq_part_ptr=p, dq_ptr=p, N="i32", H="i32", HD="i32", TK="i32"),
                             dict(BLOCK_T=t.merge_t, BLOCK_D=bd), 4, 1, tags=tags)
            for bn in _chunk_widths(t.dkdv_n, dtype):
                yield StaticCase("mom_bwd_dkdv", _mom_bwd_dkdv_kernel,
                                 dict(q_ptr=p, k_ptr=p, v_ptr=p, do_ptr=p, order_ptr="*i32", offsets_ptr="*i32",
                                      shift_ptr="*fp32", delta_ptr="*fp32", dk_ptr=p, dv_ptr=p,
                                      H="i32", HD="i32", TK="i32", BS="i32", qk_scale="fp32", sm_scale="fp32"),
                                 dict(BLOCK_M=t.dkdv_m, BLOCK_N=bn, BLOCK_D=bd, PRECISION=prec),
                                 t.dkdv_warps, t.stages, tags=tags, expect=expect)


def tour_case(device: torch.device):
    from laminae.primitives.mom_read import mom_read_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    B, S, H, hd, E, bs, tk = 2, 16, 2, 16, 6, 8, 2
    logits = torch.randn(B, S, E, generator=gen)
    top_values, top_idx = logits.topk(tk, dim=-1)
    inputs = {
        "q": torch.randn(B, S, H, hd, generator=gen).to(device),
        "k_bank": torch.randn(E * bs, H * hd, generator=gen).to(device),
        "v_bank": torch.randn(E * bs, H * hd, generator=gen).to(device),
        "top_idx": top_idx.to(device),
        "top_gates": torch.softmax(top_values, -1).to(device),
        "block_size": bs,
    }
    return TourCase(f"mom_read (E={E}, bs={bs}, top {tk})", mom_read, mom_read_reference, inputs,
                    ["q", "k_bank", "v_bank", "top_gates"])
