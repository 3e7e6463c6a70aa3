"""LUCID preconditioned attention: Triton kernels.

The preconditioner V′ = L⁻¹V (L_ij = exp(s·k̂_i·k̂_j − √d), j ≤ i) is one op with
three kernels; the attention of q over (k, V′) is the toolkit's causal flash
attention (``_flash.py``). Autograd sums the two key gradients (the softmax's and
the preconditioner's).

Blocked substitution with inverted diagonal blocks, BLOCK keys per block:
``_lucid_prep_kernel``, grid ``(n_blocks, B·H_kv)``, fully parallel
    k̂ (stored in the dtype of k: the operand of every later product) and the inverse
    of each diagonal block L_II (fp32, ``[B·H_kv, n_blocks·BLOCK, BLOCK]``). The
    diagonal comes from the fp32 row norms; the inverse is forward substitution on the
    identity in registers. This is the only row-by-row loop, and it runs for all
    blocks at once, off the sequential path.
``_lucid_solve_kernel``, grid ``(B·H_kv, cdiv(D, BLOCK_DV))``
    Forward: block rows in order, ``V′_I = L_II⁻¹ (V_I − Σ_{J<I} L_IJ V′_J)``; each step
    is a short chain of GEMMs (Gram tile k̂_I k̂_Jᵀ, exp, panel product with V′_J, then
    one product with the stored inverse). Value columns split across programs; every
    program recomputes the Gram tiles (they need all of D). The same kernel with
    ``TRANSPOSED`` runs the backward ``dV = L⁻ᵀ dV′`` from the last block row up (the
    Gram tile is symmetric; the inverse is read transposed).
``_lucid_dk_kernel``, grid ``(cdiv(N, BLOCK), B·H_kv)``: fully parallel. For key
    block I, ``dk̂_I = s·Σ_J dS_IJ k̂_J + s·Σ_J dS_JIᵀ k̂_J`` with
    ``dS = −(dV V′ᵀ) ⊙ L`` on the allowed lower triangle (J ≤ I and J ≥ I loops,
    tiles recomputed), then the RMS-norm backward ``dk = ρ(dk̂ − k̂(k̂·dk̂)/d)``.
Precision: fp32 inputs use exact ("ieee") products throughout. bf16/fp16 inputs feed
k̂, L tiles, V′ and dV to the tensor cores in the input dtype with fp32 accumulation;
the right-hand sides, V′ and dV stay fp32 in memory, and the product with the fp32
inverse runs in tf32.
Saved for backward: k (raw), V′ (fp32), the keep mask. Recomputed: k̂, ρ, the
inverses, L tiles. Never materialised: any N×N matrix.

Padding keys (keep mask 0) have a zero row and column in L and a unit diagonal;
their k̂ is taken as 0, so they get no preconditioner gradient, and their contents
are selected away (never multiplied by 0) before any product.
"""
from __future__ import annotations

import math
from typing import Iterator, NamedTuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
# Row sums call tl.reduce with tl.sum's own combine function: the same code on the GPU,
# but the interpreter runs it through numpy without re-entering a jit function, which
# keeps the row-by-row solves fast enough for the CPU test suite.
from triton.language.standard import _sum_combine

from laminae.primitives._errors import DTypeError, ShapeError
from laminae.primitives.lucid_attention import LUCID_ATTENTION_EPS, check_lucid_inputs

from ._common import StaticCase, dot_precision, empty

__all__ = ["lucid_attention", "lucid_precondition", "lucid_attend", "max_head_dim", "static_cases", "tour_case"]


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _keep_rows(mask_ptr, b, rows, N, HAS_MASK: tl.constexpr):
    keep = rows < N
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + b * N + rows, mask=rows < N, other=0) != 0)
    return keep


@triton.jit
def _load_rows(base, rows, keep, cols, col_ok, row_stride):
    """[rows, cols] tile in fp32, zero where a row is not kept: padding contents
    (even NaN) never enter a product."""
    m = keep[:, None] & col_ok[None, :]
    return tl.load(base + rows[:, None] * row_stride + cols[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _khat_tile(k_base, rows, keep, row_stride, D, eps, BLOCK_D: tl.constexpr):
    """(k̂, ρ) for a tile of rows in fp32; rows not kept (padding, past N) get k̂ = 0."""
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(k_base, rows, keep, offs_d, offs_d < D, row_stride)
    rho = 1.0 / tl.sqrt(tl.reduce(k * k, 1, _sum_combine) / D + eps)
    rho = tl.where(keep, rho, 0.0)
    return k * rho[:, None], rho


@triton.jit
def _l_tile(kh_i, kh_j, allowed, scale, shift, PRECISION: tl.constexpr):
    """exp(s·k̂_i·k̂_j − √d) where allowed, else 0 (fp32; k̂ in the operand dtype)."""
    s = tl.dot(kh_i, tl.trans(kh_j), input_precision=PRECISION) * scale - shift
    return tl.where(allowed, tl.exp(s), 0.0)


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr, OPERAND: tl.constexpr):
    """acc + a·b with fp32 ``a``/``b`` rounded to the operand dtype (a no-op for fp32,
    where PRECISION is "ieee"); fp32 accumulation."""
    return tl.dot(a.to(OPERAND), b.to(OPERAND), acc, input_precision=PRECISION)


@triton.jit
def _unit_triangular_inverse(t, n_rows, BLOCK: tl.constexpr):
    """Inverse of a lower-triangular [BLOCK, BLOCK] tile ``t`` in registers (fp32).

    Rows are first scaled by the inverse diagonal, so the loop runs on a unit triangle
    (column-oriented forward substitution on the identity: ``x_r`` is final when
    reached and is eliminated from the rows below). Only the first ``n_rows`` rows
    are eliminated; the rest of ``t`` must be the identity there."""
    offs = tl.arange(0, BLOCK)
    eye = offs[None, :] == offs[:, None]
    inv = 1.0 / tl.reduce(tl.where(eye, t, 0.0), 1, _sum_combine)
    m = tl.where(eye, 0.0, t * inv[:, None])
    x = tl.where(eye, inv[:, None], 0.0)
    for r in range(0, n_rows):
        sel = offs == r
        col = tl.reduce(tl.where(sel[None, :], m, 0.0), 1, _sum_combine)  # column r of the unit triangle
        x_r = tl.reduce(tl.where(sel[:, None], x, 0.0), 0, _sum_combine)  # final row r of the inverse
        x -= col[:, None] * x_r[None, :]
    return x


@triton.jit
def _lucid_prep_kernel(k_ptr, mask_ptr, kh_ptr, linv_ptr, N, HKV, D, eps, scale, shift,
                       HAS_MASK: tl.constexpr, UNIT_DIAG: tl.constexpr, BLOCK: tl.constexpr,
                       BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Per key block I, in parallel: k̂_I (stored in the dtype of k) and L_II⁻¹ (fp32)."""
    pid_n = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    row_stride = HKV * D
    base = (b * N * HKV + kvh) * D
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    start = pid_n * BLOCK
    rows = start + offs
    keep = _keep_rows(mask_ptr, b, rows, N, HAS_MASK)
    kh, _ = _khat_tile(k_ptr + base, rows, keep, row_stride, D, eps, BLOCK_D)
    # the diagonal from the fp32 row norms (exact, whatever the product precision);
    # padding keys and rows past N: unit diagonal, nothing off the diagonal
    if UNIT_DIAG:
        diag = tl.full((BLOCK,), 1.0, tl.float32)
    else:
        diag = tl.exp(tl.reduce(kh * kh, 1, _sum_combine) * scale - shift)
    diag = tl.where(keep, diag, 1.0)
    tl.store(kh_ptr + base + rows[:, None] * row_stride + offs_d[None, :], kh.to(kh_ptr.dtype.element_ty),
             mask=(rows < N)[:, None] & (offs_d < D)[None, :])
    eye = offs[None, :] == offs[:, None]
    l_ii = _l_tile(kh, kh, (offs[None, :] < offs[:, None]) & keep[:, None] & keep[None, :], scale, shift, PRECISION)
    l_ii = tl.where(eye, diag[:, None], l_ii)
    x = _unit_triangular_inverse(l_ii, tl.minimum(BLOCK, N - start), BLOCK)
    linv = linv_ptr + (pid.to(tl.int64) * tl.num_programs(0) + pid_n) * BLOCK * BLOCK
    tl.store(linv + offs[:, None] * BLOCK + offs[None, :], x)


@triton.jit
def _lucid_solve_kernel(kh_ptr, v_ptr, mask_ptr, linv_ptr, vp_ptr, N, HKV, D, scale, shift,
                        HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Block substitution for one (batch·kv head, value-column tile), BLOCK keys per step.

    Forward (``TRANSPOSED=False``, V′ = L⁻¹V), block rows first to last:
        V′_I = L_II⁻¹ (V_I − Σ_{J<I} L_IJ V′_J)
    Backward (``TRANSPOSED=True``, dV = L⁻ᵀdV′), block rows last to first:
        dV_I = L_II⁻ᵀ (dV′_I − Σ_{J>I} L_JIᵀ dV_J)
    ``v_ptr`` is the right-hand side, ``vp_ptr`` the solution (fp32). The Gram tile
    exp(S)[I, J] is symmetric, so [I, J] of it is L_IJ below the diagonal and L_JIᵀ
    above: both directions use the same product. Each step is a short chain of GEMMs."""
    pid = tl.program_id(0)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    row_stride = HKV * D
    base = (b * N * HKV + kvh) * D
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D
    v_ok = offs_v < D
    operand = kh_ptr.dtype.element_ty
    n_blocks = tl.cdiv(N, BLOCK)
    for it in range(0, n_blocks):
        if TRANSPOSED:
            blk = n_blocks - 1 - it
        else:
            blk = it
        rows = blk * BLOCK + offs
        keep_i = _keep_rows(mask_ptr, b, rows, N, HAS_MASK)
        kh_i = tl.load(kh_ptr + base + rows[:, None] * row_stride + offs_d[None, :],
                       mask=(rows < N)[:, None] & d_ok[None, :], other=0.0)
        acc = tl.zeros((BLOCK, BLOCK_DV), dtype=tl.float32)
        if TRANSPOSED:
            lo = (blk + 1) * BLOCK
            hi = N
        else:
            lo = 0
            hi = blk * BLOCK
        for start_j in range(lo, hi, BLOCK):
            cols = start_j + offs
            keep_j = _keep_rows(mask_ptr, b, cols, N, HAS_MASK)
            kh_j = tl.load(kh_ptr + base + cols[:, None] * row_stride + offs_d[None, :],
                           mask=(cols < N)[:, None] & d_ok[None, :], other=0.0)
            l_ij = _l_tile(kh_i, kh_j, keep_i[:, None] & keep_j[None, :], scale, shift, PRECISION)
            x_j = _load_rows(vp_ptr + base, cols, keep_j, offs_v, v_ok, row_stride)
            acc = _mma(l_ij, x_j, acc, PRECISION, operand)
        # the diagonal block through its inverse (the identity on padding rows, whose
        # right-hand side is kept out of the product and passed through)
        io = rows[:, None] * row_stride + offs_v[None, :]
        io_mask = (rows < N)[:, None] & v_ok[None, :]
        raw = tl.load(v_ptr + base + io, mask=io_mask, other=0.0).to(tl.float32)  # after the loop: fewer live registers
        blk_inv = linv_ptr + (pid.to(tl.int64) * n_blocks + blk) * BLOCK * BLOCK
        if TRANSPOSED:
            inv = tl.load(blk_inv + offs[None, :] * BLOCK + offs[:, None])
        else:
            inv = tl.load(blk_inv + offs[:, None] * BLOCK + offs[None, :])
        rhs = tl.where(keep_i[:, None], raw - acc, 0.0)
        x = tl.where(keep_i[:, None], tl.dot(inv, rhs, input_precision=PRECISION), raw)
        tl.store(vp_ptr + base + io, x, mask=io_mask)
        tl.debug_barrier()  # the next block rows of this program read these rows


@triton.jit
def _load_block(base, row0, keep, N, D, row_stride, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [row0, row0 + BLOCK) of a [N, D] row-major view through a block pointer,
    zero where a row is not kept (a select: padding NaN never enters a product)."""
    # a block pointer rather than a [BLOCK, BLOCK_D] tile of 64-bit addresses: at D = 128
    # those would not fit the register file next to the dk̂ kernel's accumulator
    ptr = tl.make_block_ptr(base, (N, D), (row_stride, 1), (row0, 0), (BLOCK, BLOCK_D), (1, 0))
    x = tl.load(ptr, boundary_check=(0, 1), padding_option="zero")
    return tl.where(keep[:, None], x, tl.zeros_like(x))


@triton.jit
def _dk_panel(acc, kh_i, a_i, rows, keep_i, start_j, kh_ptr, b_ptr, mask_ptr, b, base, N, row_stride, D, scale, shift,
              HAS_MASK: tl.constexpr, UNIT_DIAG: tl.constexpr, LOWER: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """acc − (a_I b_Jᵀ ⊙ L) k̂_J over the allowed part of the key-block pair (I, J), J
    of BLOCK_N keys: with ``LOWER`` the pairs j ≤ i (a = dV, b = V′), else j ≥ i
    (a = V′, b = dV, the Gram tile read as L_JIᵀ)."""
    operand = kh_ptr.dtype.element_ty
    cols = start_j + tl.arange(0, BLOCK_N)
    keep_j = _keep_rows(mask_ptr, b, cols, N, HAS_MASK)
    kh_j = _load_block(kh_ptr + base, start_j, keep_j, N, D, row_stride, BLOCK_N, BLOCK_D)
    if LOWER:
        allowed = cols[None, :] <= rows[:, None]
    else:
        allowed = cols[None, :] >= rows[:, None]
    allowed = allowed & keep_i[:, None] & keep_j[None, :]
    if UNIT_DIAG:  # a constant diagonal has no gradient
        allowed = allowed & (cols[None, :] != rows[:, None])
    l_t = _l_tile(kh_i, kh_j, allowed, scale, shift, PRECISION)
    b_j = _load_block(b_ptr + base, start_j, keep_j, N, D, row_stride, BLOCK_N, BLOCK_D).to(operand)
    ds = tl.dot(a_i, tl.trans(b_j), input_precision=PRECISION) * l_t
    return _mma(-ds, kh_j, acc, PRECISION, operand)


@triton.jit
def _lucid_dk_kernel(k_ptr, kh_ptr, mask_ptr, vp_ptr, dv_ptr, dk_ptr, N, HKV, D, eps, scale, shift,
                     HAS_MASK: tl.constexpr, UNIT_DIAG: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """dk for key block I (BLOCK rows), over key blocks J of BLOCK_N (BLOCK a multiple)."""
    pid_n = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    row_stride = HKV * D
    base = (b * N * HKV + kvh) * D
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    operand = kh_ptr.dtype.element_ty
    start = pid_n * BLOCK
    rows = start + offs
    keep_i = _keep_rows(mask_ptr, b, rows, N, HAS_MASK)
    kh_i = _load_block(kh_ptr + base, start, keep_i, N, D, row_stride, BLOCK, BLOCK_D)
    acc = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    # dk̂_I = s·Σ_J dS_IJ k̂_J + s·Σ_J dS_JIᵀ k̂_J with dS = −(dV V′ᵀ) ⊙ L; the diagonal
    # block is in both sums (S_ii is quadratic in k̂_i). One of dV_I, V′_I is live per loop.
    dv_i = _load_block(dv_ptr + base, start, keep_i, N, D, row_stride, BLOCK, BLOCK_D).to(operand)
    for start_j in range(0, start + BLOCK, BLOCK_N):
        acc = _dk_panel(acc, kh_i, dv_i, rows, keep_i, start_j, kh_ptr, vp_ptr, mask_ptr, b, base, N, row_stride, D,
                        scale, shift, HAS_MASK, UNIT_DIAG, True, BLOCK_N, BLOCK_D, PRECISION)
    vp_i = _load_block(vp_ptr + base, start, keep_i, N, D, row_stride, BLOCK, BLOCK_D).to(operand)
    for start_j in range(start, N, BLOCK_N):
        acc = _dk_panel(acc, kh_i, vp_i, rows, keep_i, start_j, kh_ptr, dv_ptr, mask_ptr, b, base, N, row_stride, D,
                        scale, shift, HAS_MASK, UNIT_DIAG, False, BLOCK_N, BLOCK_D, PRECISION)
    dkh = acc * scale
    kh32_i, rho_i = _khat_tile(k_ptr + base, rows, keep_i, row_stride, D, eps, BLOCK_D)  # fp32, after the loops
    # RMS-norm backward: dk = ρ·(dk̂ − k̂·(k̂·dk̂)/d)
    dk = rho_i[:, None] * (dkh - kh32_i * (tl.reduce(kh32_i * dkh, 1, _sum_combine) / D)[:, None])
    tl.store(dk_ptr + base + rows[:, None] * row_stride + offs_d[None, :], dk.to(dk_ptr.dtype.element_ty),
             mask=(rows < N)[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------
# Tiles
# ----------------------------------------------------------------------------


class Tiles(NamedTuple):
    """Launch shape for one head dim and dtype family."""

    block: int  # keys per block row: the diagonal blocks and every GEMM's M and K
    block_dv: int  # value columns per substitution program (the D split)
    warps: int  # prep and substitution kernels
    dk_warps: int  # the dk̂ kernel (it holds a [block, D] accumulator and three operand tiles)
    dk_block_n: int  # keys per J tile of the dk̂ kernel (divides dk_block)
    dk_block: int = 0  # keys per I tile of the dk̂ kernel (0: block)

    @property
    def dk_rows(self) -> int:
        return self.dk_block or self.block


# Per padded head dim, for fp32 (exact "ieee" products on CUDA cores) and for bf16/fp16
# (16-bit operands on the tensor cores, fp32 accumulation), sized for sm_90 without
# spills at NUM_STAGES (``python -m bench.static_sm90 lucid_attention``). 64-key
# blocks with 4-warp warpgroups give wgmma its M = 64 tiles. Head dims above the largest
# key have no spill-free tile and are rejected.
NUM_STAGES = 2
_TILES: dict[str, dict[int, Tiles]] = {
    "fp32": {16: Tiles(32, 16, 4, 4, 32), 32: Tiles(32, 32, 4, 8, 32), 64: Tiles(16, 32, 4, 8, 16)},
    "low": {16: Tiles(64, 16, 4, 4, 64), 32: Tiles(64, 32, 4, 4, 64), 64: Tiles(64, 64, 8, 8, 64),
            128: Tiles(64, 64, 8, 8, 16, 16)},
}


def _family(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "low"


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def max_head_dim(dtype: torch.dtype) -> int:
    return max(_TILES[_family(dtype)])


def tiles(head_dim: int, dtype: torch.dtype) -> Tiles:
    """Launch shape for ``head_dim`` and ``dtype`` (tests monkeypatch this to force
    small blocks)."""
    return _TILES[_family(dtype)][block_d(head_dim)]


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _mask_arg(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if key_mask is None else key_mask.to(torch.int8).contiguous()


def _scalars(head_dim: int) -> tuple[float, float]:
    return 1.0 / math.sqrt(head_dim), math.sqrt(head_dim)


def _prepare(k: torch.Tensor, key_mask: torch.Tensor | None, eps: float, unit_diagonal: bool,
             t: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """(k̂ ``[B, N, H_kv, D]`` in the dtype of k, L_II⁻¹ ``[B·H_kv, n_blocks·block, block]``
    fp32): every diagonal block inverted at once, off the sequential path."""
    B, N, HKV, D = k.shape
    n_blocks = triton.cdiv(N, t.block)
    scale, shift = _scalars(D)
    kh = empty(k.shape, dtype=k.dtype, device=k.device)
    linv = empty((B * HKV, n_blocks * t.block, t.block), dtype=torch.float32, device=k.device)
    wrap_triton(_lucid_prep_kernel)[(n_blocks, B * HKV)](
        k, key_mask, kh, linv, N, HKV, D, eps, scale, shift,
        HAS_MASK=key_mask is not None, UNIT_DIAG=unit_diagonal, BLOCK=t.block, BLOCK_D=block_d(D),
        PRECISION=dot_precision(k.dtype), num_warps=t.warps, num_stages=NUM_STAGES,
    )
    return kh, linv


def _substitute(kh: torch.Tensor, rhs: torch.Tensor, key_mask: torch.Tensor | None, linv: torch.Tensor,
                t: Tiles, transposed: bool) -> torch.Tensor:
    """L⁻¹·rhs (or L⁻ᵀ·rhs) in fp32, one program per (batch·kv head, value-column tile)."""
    B, N, HKV, D = kh.shape
    scale, shift = _scalars(D)
    bd = block_d(D)
    dv = min(t.block_dv, bd)
    out = empty((B, N, HKV, D), dtype=torch.float32, device=kh.device)
    wrap_triton(_lucid_solve_kernel)[(B * HKV, triton.cdiv(D, dv))](
        kh, rhs, key_mask, linv, out, N, HKV, D, scale, shift,
        HAS_MASK=key_mask is not None, BLOCK=t.block, BLOCK_D=bd, BLOCK_DV=dv,
        PRECISION=dot_precision(kh.dtype), TRANSPOSED=transposed, num_warps=t.warps, num_stages=NUM_STAGES,
    )
    return out


@triton_op("laminae::lucid_precondition", mutates_args=())
def _lucid_precondition_op(k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                           eps: float, unit_diagonal: bool) -> torch.Tensor:
    """V′ = L⁻¹V ``[B, N, H_kv, D]`` in fp32 (k, v contiguous, key_mask int8 or None)."""
    t = tiles(k.shape[-1], k.dtype)
    kh, linv = _prepare(k, key_mask, eps, unit_diagonal, t)
    return _substitute(kh, v, key_mask, linv, t, transposed=False)


@triton_op("laminae::lucid_precondition_bwd", mutates_args=())
def _lucid_precondition_bwd_op(dvp: torch.Tensor, k: torch.Tensor, vp: torch.Tensor,
                               key_mask: torch.Tensor | None, eps: float,
                               unit_diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv) of the preconditioner: dv = L⁻ᵀ dV′ in fp32, dk in the dtype of k."""
    B, N, HKV, D = k.shape
    t = tiles(D, k.dtype)
    scale, shift = _scalars(D)
    kh, linv = _prepare(k, key_mask, eps, unit_diagonal, t)  # recomputed: cheaper than saving
    dv = _substitute(kh, dvp, key_mask, linv, t, transposed=True)
    dk = empty(k.shape, dtype=k.dtype, device=k.device)
    wrap_triton(_lucid_dk_kernel)[(triton.cdiv(N, t.dk_rows), B * HKV)](
        k, kh, key_mask, vp, dv, dk, N, HKV, D, eps, scale, shift,
        HAS_MASK=key_mask is not None, UNIT_DIAG=unit_diagonal, BLOCK=t.dk_rows, BLOCK_N=t.dk_block_n,
        BLOCK_D=block_d(D), PRECISION=dot_precision(k.dtype), num_warps=t.dk_warps, num_stages=NUM_STAGES,
    )
    return dk, dv


def _setup_context(ctx, inputs, output):
    k, v, key_mask, eps, unit_diagonal = inputs
    ctx.save_for_backward(k, output, key_mask)
    ctx.eps, ctx.unit_diagonal = eps, unit_diagonal
    ctx.v_dtype = v.dtype


def _backward(ctx, dvp):
    k, vp, key_mask = ctx.saved_tensors
    dk, dv = _lucid_precondition_bwd_op(dvp.float().contiguous(), k, vp, key_mask, ctx.eps, ctx.unit_diagonal)
    return dk, dv.to(ctx.v_dtype), None, None, None


_lucid_precondition_op.register_autograd(_backward, setup_context=_setup_context)


def _check_triton(k: torch.Tensor) -> None:
    if k.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"the Triton LUCID kernels support fp32/bf16/fp16 inputs, got {k.dtype}")
    limit = max_head_dim(k.dtype)
    if k.shape[-1] > limit:
        raise ShapeError(f"the Triton LUCID kernels support head_dim <= {limit} for {k.dtype} "
                         f"(64 for fp32, 128 for bf16/fp16), got {k.shape[-1]}; use backend='reference'")


def lucid_precondition(k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       eps: float = LUCID_ATTENTION_EPS, *, unit_diagonal: bool = False) -> torch.Tensor:
    """Triton V′ = L⁻¹V with the signature of
    :func:`laminae.primitives.lucid_attention.lucid_precondition_reference`:
    ``k``, ``v`` ``[B, N, H_kv, D]`` → V′ ``[B, N, H_kv, D]`` fp32, differentiable in k and v."""
    _check_triton(k)
    if k.shape[1] == 0:
        return torch.zeros(k.shape, dtype=torch.float32, device=k.device) + 0.0 * (k.sum() + v.sum())
    return _lucid_precondition_op(k.contiguous(), v.contiguous(), _mask_arg(attention_mask), float(eps),
                                  bool(unit_diagonal))


def lucid_attend(q: torch.Tensor, k: torch.Tensor, v_prime: torch.Tensor,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention of ``q`` ``[B, S, H, D]`` over (``k``, ``v_prime``)
    ``[B, N, H_kv, D]`` (all one dtype), query i at position N − S + i."""
    from ._flash import flash_attention

    return flash_attention(q, k, v_prime, attention_mask)


def lucid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    eps: float = LUCID_ATTENTION_EPS,
    *,
    upcast: bool = True,
    unit_diagonal: bool = False,
) -> torch.Tensor:
    """Triton LUCID attention with the signature of
    :func:`laminae.primitives.lucid_attention.lucid_attention_reference`.

    ``q`` ``[B, S, H, D]``, ``k``/``v`` ``[B, N, H_kv, D]`` (fp32/bf16/fp16, N ≥ S),
    ``attention_mask`` an optional ``(B, N)`` keep mask. Returns ``[B, S, H, D]`` in the input
    dtype. ``upcast`` is accepted for interchangeability: the kernels always
    accumulate in fp32 and keep V′ in fp32 for the solve; the attention reads V′ in the
    input dtype."""
    check_lucid_inputs(q, k, v, attention_mask, eps)
    _check_triton(q)
    if q.shape[1] == 0:
        return torch.zeros_like(q) + 0.0 * (k.sum() + v.sum())
    v_prime = lucid_precondition(k, v, attention_mask, eps, unit_diagonal=unit_diagonal)
    return lucid_attend(q, k, v_prime.to(q.dtype), attention_mask)


# ----------------------------------------------------------------------------
# Static configurations and the tour
# ----------------------------------------------------------------------------


def static_cases() -> Iterator[StaticCase]:
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        precision = "ieee" if dt == "fp32" else "tf32"
        tags = {"dtype": dt}
        scalars = dict(N="i32", HKV="i32", D="i32")
        consts = dict(scale="fp32", shift="fp32")
        for bd, t in _TILES["fp32" if dt == "fp32" else "low"].items():
            # wgmma where the kernel is matmul-shaped: 16-bit operands at head_dim 64/128
            expect = "HGMMA" if dt != "fp32" and bd >= 64 else ""
            shape = dict(BLOCK=t.block, BLOCK_D=bd)
            for has_mask in (True, False):
                for unit in (False, True):
                    const = dict(HAS_MASK=has_mask, UNIT_DIAG=unit) | shape | dict(PRECISION=precision)
                    yield StaticCase("lucid_prep", _lucid_prep_kernel,
                                     dict(k_ptr=p, mask_ptr="*i8", kh_ptr=p, linv_ptr="*fp32") | scalars
                                     | dict(eps="fp32") | consts, const, t.warps, NUM_STAGES, tags=tags)
                    yield StaticCase("lucid_bwd_dk", _lucid_dk_kernel,
                                     dict(k_ptr=p, kh_ptr=p, mask_ptr="*i8", vp_ptr="*fp32", dv_ptr="*fp32",
                                          dk_ptr=p) | scalars | dict(eps="fp32") | consts,
                                     dict(HAS_MASK=has_mask, UNIT_DIAG=unit, BLOCK=t.dk_rows, BLOCK_N=t.dk_block_n,
                                          BLOCK_D=bd, PRECISION=precision), t.dk_warps, NUM_STAGES, tags=tags,
                                     expect=expect if t.dk_rows >= 64 else "")
                for transposed in (False, True):
                    const = dict(HAS_MASK=has_mask) | shape | dict(BLOCK_DV=min(t.block_dv, bd), PRECISION=precision,
                                                                   TRANSPOSED=transposed)
                    yield StaticCase("lucid_bwd_dv" if transposed else "lucid_solve", _lucid_solve_kernel,
                                     dict(kh_ptr=p, v_ptr="*fp32" if transposed else p, mask_ptr="*i8",
                                          linv_ptr="*fp32", vp_ptr="*fp32") | scalars | consts,
                                     const, t.warps, NUM_STAGES, tags=tags, expect=expect)


def tour_case(device: torch.device):
    from laminae.primitives.lucid_attention import lucid_attention_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    B, S, H, HKV, D = 2, 64, 4, 2, 32
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, :9] = False  # left padding in the second row
    keep[0, 50:53] = False  # a few holes
    inputs = {
        "q": torch.randn(B, S, H, D, generator=gen).to(device),
        "k": torch.randn(B, S, HKV, D, generator=gen).to(device),
        "v": torch.randn(B, S, HKV, D, generator=gen).to(device),
        "attention_mask": keep.to(device),
    }
    return TourCase("lucid_attention (GQA 4/2, D=32, ragged)", lucid_attention, lucid_attention_reference,
                    inputs, ["q", "k", "v"])
